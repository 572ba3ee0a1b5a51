//! The transfer engine: copies lists of blocks between any two tiers.
//!
//! A transfer names a source tier, a destination tier and `(src_block, dst_block)` pairs. The two
//! tiers may have different layouts (e.g. a layer-separate device cache and a fully contiguous host
//! pool) but must have the same block dimensions; every copy moves a block's canonical image (see
//! [`crate::layout`]), so gather/scatter between layouts falls out of the segment lists.
//!
//! Path per batch: a tier that lends a [`BatchCopy`](crate::tier::BatchCopy) hook (see
//! [`StorageTier::batch_copy`]) is offered the whole batch, the destination's hook first, then the
//! source's; the first that takes it answers one result per pair. Otherwise, path per pair,
//! cheapest first:
//! * both host addressable: the engine copies the source's runs into the destination's (a
//!   gather/scatter memcpy); a transfer of at least [`STREAM_MIN_BYTES`] uses the store method
//!   that is faster on this machine ([`CopyPolicy`], measured by [`calibrate`]: streaming stores
//!   or ordinary ones), decided from the whole transfer, not the block;
//! * destination host addressable: the source reads straight into the destination's runs
//!   (disk → memory is one vectored read);
//! * source host addressable: the destination writes straight from the source's runs;
//! * neither: through a bounce buffer.
//!
//! Pairs are cut into batches of `batch_blocks`; each batch is one blocking task. A transfer keeps at
//! most `min(max_concurrency, src.max_in_flight, dst.max_in_flight)` batches running, and all
//! transfers together at most `max_concurrency`. Each submitted transfer has a [`TransferHandle`]
//! that resolves to a [`TransferOutcome`]: per-block failures (for example a disk checksum
//! mismatch, [`ErrorKind::Corrupt`]) are listed there and do not stop the other blocks; a failed
//! block's destination bytes must not be used (the caller reports it as a load error).

use std::io::IoSlice;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::config::TransferConfig;
use crate::error::{Error, ErrorKind, Result};
use crate::layout::KvLayout;
use crate::tier::{total_len, StorageTier, TierKind};

pub use crate::memcopy::{
    calibrate, calibration, method_for, CopyCalibration, CopyMethod, CopyPolicy, STREAM_MIN_BYTES,
};

/// One block that failed to copy.
#[derive(Debug, Clone)]
pub struct BlockFailure {
    /// Block id in the source tier.
    pub src_block: usize,
    /// Block id in the destination tier (its contents must not be used).
    pub dst_block: usize,
    /// Why.
    pub error: Error,
}

/// What a finished transfer did.
#[derive(Debug, Clone)]
pub struct TransferOutcome {
    /// Source tier kind.
    pub src: TierKind,
    /// Destination tier kind.
    pub dst: TierKind,
    /// Blocks copied successfully.
    pub blocks: usize,
    /// Bytes copied successfully.
    pub bytes: u64,
    /// Blocks that failed, in no particular order.
    pub failed: Vec<BlockFailure>,
    /// Wall time from submission to completion.
    pub elapsed: Duration,
}

impl TransferOutcome {
    /// True when every block was copied.
    pub fn is_ok(&self) -> bool {
        self.failed.is_empty()
    }

    /// Achieved bandwidth in bytes per second.
    pub fn bytes_per_sec(&self) -> f64 {
        let s = self.elapsed.as_secs_f64();
        if s > 0.0 {
            self.bytes as f64 / s
        } else {
            0.0
        }
    }
}

/// Completion handle of one submitted transfer. Await it, poll [`TransferHandle::is_finished`],
/// or drop it (the transfer still runs to completion).
#[derive(Debug)]
pub struct TransferHandle {
    task: tokio::task::JoinHandle<TransferOutcome>,
}

impl TransferHandle {
    /// True once the transfer has completed.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

impl std::future::Future for TransferHandle {
    type Output = Result<TransferOutcome>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.task)
            .poll(cx)
            .map(|r| r.map_err(|e| Error::internal(format!("transfer task did not complete: {e}"))))
    }
}

/// Copies blocks between tiers. Cheap to clone; clones share the concurrency bound.
#[derive(Debug, Clone)]
pub struct TransferEngine {
    permits: Arc<Semaphore>,
    max_concurrency: usize,
    batch_blocks: usize,
    copy: CopyPolicy,
}

impl TransferEngine {
    /// An engine with `config`'s bounds (each at least 1).
    pub fn new(config: &TransferConfig) -> Result<Self> {
        if config.max_concurrency == 0 || config.batch_blocks == 0 {
            return Err(Error::invalid_argument(
                "transfer max_concurrency and batch_blocks must be at least 1",
            ));
        }
        Ok(Self {
            permits: Arc::new(Semaphore::new(config.max_concurrency)),
            max_concurrency: config.max_concurrency,
            batch_blocks: config.batch_blocks,
            copy: config.copy_method,
        })
    }

    /// Checks a transfer before anything runs: same block dimensions, every id in range, no
    /// destination block written twice, no block copied onto itself.
    pub fn validate(
        src: &dyn StorageTier,
        dst: &dyn StorageTier,
        same_tier: bool,
        pairs: &[(usize, usize)],
    ) -> Result<()> {
        let (sd, dd) = (src.layout().dims(), dst.layout().dims());
        if sd != dd {
            return Err(Error::invalid_layout(format!(
                "cannot copy {} blocks {sd:?} into {} blocks {dd:?}: dimensions differ",
                src.kind(),
                dst.kind()
            )));
        }
        let (sn, dn) = (src.num_blocks(), dst.num_blocks());
        for &(s, d) in pairs {
            if s >= sn {
                return Err(Error::out_of_range("block", s, sn)
                    .with("tier", src.kind())
                    .with("side", "source"));
            }
            if d >= dn {
                return Err(Error::out_of_range("block", d, dn)
                    .with("tier", dst.kind())
                    .with("side", "destination"));
            }
            if same_tier && s == d {
                return Err(
                    Error::invalid_argument(format!("block {s} copied onto itself"))
                        .with("tier", src.kind()),
                );
            }
        }
        let twice = |d: usize| {
            Error::invalid_argument(format!(
                "destination block {d} appears twice in one transfer"
            ))
            .with("tier", dst.kind())
        };
        // A few pairs into a large tier (a request's blocks into the host tier, the hot path):
        // sort their destinations, rather than clear a flag per block of the tier.
        if pairs.len() >= 2 && pairs.len().saturating_mul(64) < dn {
            let mut dsts: Vec<usize> = pairs.iter().map(|p| p.1).collect();
            dsts.sort_unstable();
            if let Some(w) = dsts.windows(2).find(|w| w[0] == w[1]) {
                return Err(twice(w[0]));
            }
        } else if pairs.len() >= 2 {
            let mut seen = vec![false; dn];
            for &(_, d) in pairs {
                // In range: checked above.
                if let Some(slot) = seen.get_mut(d) {
                    if std::mem::replace(slot, true) {
                        return Err(twice(d));
                    }
                }
            }
        }
        Ok(())
    }

    /// Validates and starts a transfer on the current tokio runtime; returns its handle at once.
    ///
    /// Errors (nothing started): no tokio runtime, or [`TransferEngine::validate`] refused it.
    pub fn submit(
        &self,
        src: Arc<dyn StorageTier>,
        dst: Arc<dyn StorageTier>,
        pairs: Vec<(usize, usize)>,
    ) -> Result<TransferHandle> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            Error::new(
                ErrorKind::NotReady,
                "transfers need a tokio runtime; none is running",
            )
        })?;
        let same = Arc::ptr_eq(&src, &dst);
        Self::validate(src.as_ref(), dst.as_ref(), same, &pairs)?;
        Ok(self.start_on(&runtime, src, dst, pairs))
    }

    /// Starts a transfer [`TransferEngine::validate`] accepted, on `runtime` (for a caller that
    /// validated it on another thread and starts it from a task of its own).
    pub(crate) fn start_on(
        &self,
        runtime: &tokio::runtime::Handle,
        src: Arc<dyn StorageTier>,
        dst: Arc<dyn StorageTier>,
        pairs: Vec<(usize, usize)>,
    ) -> TransferHandle {
        let engine = self.clone();
        let task = runtime.spawn(async move { engine.run(src, dst, pairs).await });
        TransferHandle { task }
    }

    /// Runs a transfer [`TransferEngine::validate`] accepted on the calling thread, with this
    /// engine's copy policy, outside its concurrency bound (for a caller that copies a few
    /// blocks between memory tiers where waiting for a copy thread would cost more).
    pub(crate) fn copy_here(
        &self,
        src: &dyn StorageTier,
        dst: &dyn StorageTier,
        pairs: &[(usize, usize)],
    ) -> TransferOutcome {
        copy_now(src, dst, pairs, self.copy)
    }

    /// Validates, runs and awaits a transfer.
    pub async fn copy(
        &self,
        src: Arc<dyn StorageTier>,
        dst: Arc<dyn StorageTier>,
        pairs: Vec<(usize, usize)>,
    ) -> Result<TransferOutcome> {
        self.submit(src, dst, pairs)?.await
    }

    async fn run(
        &self,
        src: Arc<dyn StorageTier>,
        dst: Arc<dyn StorageTier>,
        pairs: Vec<(usize, usize)>,
    ) -> TransferOutcome {
        let start = Instant::now();
        let width = self
            .max_concurrency
            .min(src.capability().max_in_flight.max(1))
            .min(dst.capability().max_in_flight.max(1));
        let local = Arc::new(Semaphore::new(width));
        let mut outcome = TransferOutcome {
            src: src.kind(),
            dst: dst.kind(),
            blocks: 0,
            bytes: 0,
            failed: Vec::new(),
            elapsed: Duration::ZERO,
        };
        let method = copy_method(src.as_ref(), pairs.len(), self.copy);
        let mut tasks = JoinSet::new();
        for batch in pairs.chunks(self.batch_blocks) {
            // Both semaphores live as long as the engine and this call; acquire fails only if
            // closed, which never happens, but a failure still must not lose the batch silently.
            let permits = async {
                let l = local.clone().acquire_owned().await;
                let g = self.permits.clone().acquire_owned().await;
                (l, g)
            };
            let (l, g) = permits.await;
            let batch = batch.to_vec();
            let (s, d) = (src.clone(), dst.clone());
            tasks.spawn_blocking(move || {
                let _permits = (l, g);
                copy_batch(s.as_ref(), d.as_ref(), &batch, method)
            });
            // Collect finished batches as we go so memory stays bounded for huge transfers.
            while let Some(done) = tasks.try_join_next() {
                merge(&mut outcome, done);
            }
        }
        while let Some(done) = tasks.join_next().await {
            merge(&mut outcome, done);
        }
        outcome.bytes = outcome.blocks as u64 * src.bytes_per_block() as u64;
        outcome.elapsed = start.elapsed();
        tracing::debug!(
            src = %outcome.src, dst = %outcome.dst, blocks = outcome.blocks,
            failed = outcome.failed.len(), elapsed_us = outcome.elapsed.as_micros() as u64,
            "transfer finished"
        );
        outcome
    }

    /// Copies `pairs` on the calling thread, without a runtime (validates first), with the
    /// default copy policy ([`CopyPolicy::Auto`]).
    pub fn copy_blocking(
        src: &dyn StorageTier,
        dst: &dyn StorageTier,
        pairs: &[(usize, usize)],
    ) -> Result<TransferOutcome> {
        Self::copy_blocking_with(src, dst, pairs, CopyPolicy::Auto)
    }

    /// [`TransferEngine::copy_blocking`] with memory copies by `policy`.
    pub fn copy_blocking_with(
        src: &dyn StorageTier,
        dst: &dyn StorageTier,
        pairs: &[(usize, usize)],
        policy: CopyPolicy,
    ) -> Result<TransferOutcome> {
        let same = std::ptr::addr_eq(src as *const dyn StorageTier, dst as *const dyn StorageTier);
        Self::validate(src, dst, same, pairs)?;
        Ok(copy_now(src, dst, pairs, policy))
    }
}

/// Copies validated `pairs` on the calling thread, memory copies by `policy`, and times it.
fn copy_now(
    src: &dyn StorageTier,
    dst: &dyn StorageTier,
    pairs: &[(usize, usize)],
    policy: CopyPolicy,
) -> TransferOutcome {
    let start = Instant::now();
    let batch = copy_batch(src, dst, pairs, copy_method(src, pairs.len(), policy));
    let blocks = pairs.len() - batch.failed.len();
    TransferOutcome {
        src: src.kind(),
        dst: dst.kind(),
        blocks,
        bytes: blocks as u64 * src.bytes_per_block() as u64,
        failed: batch.failed,
        elapsed: start.elapsed(),
    }
}

struct BatchResult {
    copied: usize,
    failed: Vec<BlockFailure>,
}

fn merge(
    outcome: &mut TransferOutcome,
    done: std::result::Result<BatchResult, tokio::task::JoinError>,
) {
    match done {
        Ok(b) => {
            outcome.blocks += b.copied;
            outcome.failed.extend(b.failed);
        }
        Err(e) => {
            // A panicking batch is a bug; its blocks are unaccounted, so record one failure
            // rather than claim success.
            outcome.failed.push(BlockFailure {
                src_block: usize::MAX,
                dst_block: usize::MAX,
                error: Error::internal(format!("transfer batch did not complete: {e}")),
            });
        }
    }
}

/// How a transfer of `blocks` blocks of `src`'s size copies memory under `policy`.
fn copy_method(src: &dyn StorageTier, blocks: usize, policy: CopyPolicy) -> CopyMethod {
    method_for(blocks.saturating_mul(src.bytes_per_block()), policy)
}

fn copy_batch(
    src: &dyn StorageTier,
    dst: &dyn StorageTier,
    pairs: &[(usize, usize)],
    method: CopyMethod,
) -> BatchResult {
    let mut result = BatchResult {
        copied: 0,
        failed: Vec::new(),
    };
    let mut record = |s: usize, d: usize, r: Result<()>| match r {
        Ok(()) => result.copied += 1,
        Err(error) => {
            // Per block at debug level: the caller reports the operation (rate-limited).
            tracing::debug!(src_tier = %src.kind(), dst_tier = %dst.kind(), src_block = s, dst_block = d, %error, "block copy failed");
            result.failed.push(BlockFailure {
                src_block: s,
                dst_block: d,
                error: error.with("src_block", s).with("dst_block", d),
            })
        }
    };
    if let Some(done) = hooked_batch(src, dst, pairs) {
        // A hook answers one result per pair; a pair it left out failed rather than vanished.
        let answered = done.len();
        let mut done = done.into_iter();
        for &(s, d) in pairs {
            let r = done.next().unwrap_or_else(|| {
                Err(Error::internal(format!(
                    "batch copy answered {answered} results for {} pairs",
                    pairs.len()
                )))
            });
            record(s, d, r);
        }
        return result;
    }
    let mut bounce: Option<Vec<u8>> = None;
    for &(s, d) in pairs {
        let r = copy_block(src, dst, s, d, method, &mut bounce);
        record(s, d, r);
    }
    result
}

/// The whole batch through a tier's own [`BatchCopy`](crate::tier::BatchCopy): the destination's
/// first, then the source's; `None` when neither has one or both decline.
fn hooked_batch(
    src: &dyn StorageTier,
    dst: &dyn StorageTier,
    pairs: &[(usize, usize)],
) -> Option<Vec<Result<()>>> {
    dst.batch_copy()
        .and_then(|hook| hook.copy_from(src, pairs))
        .or_else(|| src.batch_copy().and_then(|hook| hook.copy_to(dst, pairs)))
}

fn copy_block(
    src: &dyn StorageTier,
    dst: &dyn StorageTier,
    s: usize,
    d: usize,
    method: CopyMethod,
    bounce: &mut Option<Vec<u8>>,
) -> Result<()> {
    let (sc, dc) = (src.capability(), dst.capability());
    if sc.host_addressable && dc.host_addressable {
        // Both in our address space: the engine copies the runs itself, so it can choose the
        // stores by the size of the whole transfer. Lock order as on the other paths:
        // destination block (exclusive), then source block (shared).
        return dst.with_block_mut(d, &mut |to| {
            src.with_block(s, &mut |from| {
                let (have, want) = (total_len(from), total_len(to));
                if have != want {
                    return Err(Error::invalid_layout(format!(
                        "source block lends {have} bytes, destination block {want}"
                    ))
                    .with("src_tier", src.kind())
                    .with("dst_tier", dst.kind()));
                }
                crate::memcopy::copy_segments(from, to, method);
                Ok(())
            })
        });
    }
    if dc.host_addressable {
        return dst.with_block_mut(d, &mut |segments| src.read_block(s, segments));
    }
    if sc.host_addressable {
        return src.with_block(s, &mut |segments| dst.write_block(d, segments));
    }
    // Neither side is in our address space: read into a bounce buffer, then write it out. The
    // tiers handle their own alignment needs.
    let buf = match bounce {
        Some(b) => b,
        None => bounce.insert(vec![0u8; src.bytes_per_block()]),
    };
    src.read_block(s, &mut [std::io::IoSliceMut::new(buf)])?;
    dst.write_block(d, &[IoSlice::new(buf)])
}
