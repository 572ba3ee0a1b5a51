//! Start-up: [`InitMode`] and the three-step leader/worker barrier.
//!
//! 1. Each worker → leader: its `bytes_per_block` (computed from the caches it registered) and its
//!    device block count ([`WorkerHello`]).
//! 2. Leader → each worker: host and disk block counts ([`TierCounts`]), derived from the configured
//!    sizes and the *sum* of `bytes_per_block` over ranks (every rank allocates the same counts for
//!    its own shard); the device count is the minimum over ranks.
//!
//! Then each worker allocates its tiers and confirms ([`WorkerMessage::Ready`]).
//!
//! 3. Leader → each worker, once every rank confirmed: [`LeaderMessage::Ready`], sent only after
//!    the leader's own readiness is recorded, so any call the leader gets from then on finds it
//!    ready. A worker that starts up blocking ([`Blocking`]: TensorRT-LLM's) returns from its
//!    registration only on it: TensorRT-LLM admits requests as soon as the registration returned
//!    (its older connector API has no `wait_for_initialization`), and a request admitted while
//!    the leader was still finishing its barrier would never be offloaded if it also finished
//!    before then. A leader that fails after step 2 refuses every rank
//!    ([`LeaderMessage::Refused`]), so none waits for step 3 until the deadline.
//!
//! The whole barrier has one deadline; missing it is an [`ErrorKind::Timeout`] error naming the
//! step and the ranks still missing.
//!
//! Each side runs the barrier either inline ([`Blocking`]: the constructor returns once it is
//! done) or on a background thread ([`NonBlocking`]: calls made before it is done see "not
//! ready"), as its engine's [`Engine`](crate::connector::Engine) declares. vLLM registers caches
//! before it builds the scheduler side, so its worker is non-blocking and its leader blocking;
//! TensorRT-LLM builds both at once, so the reverse.
//!
//! Public here: [`InitMode`] and [`Readiness`] (what the leader reports once ready). The barrier
//! functions (`leader_barrier`, `worker_barrier`) and the cell a background start-up fills
//! (`initialise`, `InitCell`) are crate-private: an integrator runs the barrier by building a
//! `Leader` and a `Worker`, never by hand.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::config::Config;
use crate::connector::transport::{
    LeaderMessage, LeaderTransport, Rank, TierCounts, WorkerHello, WorkerMessage, WorkerTransport,
};
use crate::error::{Error, ErrorKind, Result};
use crate::layout::LayoutDims;

/// How one side (leader or worker) runs the start-up barrier: part of an engine's definition,
/// declared by its [`Engine`](crate::connector::Engine) as a type, never a caller's choice.
///
/// A blocking side returns from its constructor (`Leader::new`, `Worker::register`) only once the
/// barrier is done, so the side an engine builds *first* must be [`NonBlocking`] whenever the
/// second is built on the same thread: two blocking sides on one thread would wait for each other
/// until the init timeout. Sealed: [`Blocking`] and [`NonBlocking`] are the only modes.
pub trait InitMode: sealed::Sealed + Send + Sync + 'static {
    /// Whether the constructor runs the barrier inline (and fails if it fails).
    const BLOCKING: bool;
    /// `"blocking"` or `"non_blocking"` (logs, `Debug`).
    const NAME: &'static str;
}

/// Run the barrier inline: the constructor returns once it is done and fails if it fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Blocking;

/// Run the barrier on a background thread: calls before it finishes answer "not ready".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct NonBlocking;

impl InitMode for Blocking {
    const BLOCKING: bool = true;
    const NAME: &'static str = "blocking";
}

impl InitMode for NonBlocking {
    const BLOCKING: bool = false;
    const NAME: &'static str = "non_blocking";
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Blocking {}
    impl Sealed for super::NonBlocking {}
}

/// What the leader learned from the barrier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Readiness {
    /// What every rank allocated.
    pub counts: TierCounts,
    /// Block dimensions (of rank 0's shard).
    pub dims: LayoutDims,
    /// Bytes per block of each rank's shard, by rank.
    pub bytes_per_block: Vec<usize>,
    /// `(block, key)` pairs every rank's disk tier already held at start-up (persisted tiers
    /// reopened: each rank's [`WorkerMessage::DiskIndex`], intersected); usually empty.
    pub disk_index: Vec<(usize, u128)>,
}

impl Readiness {
    /// Bytes of one block over all ranks.
    pub fn total_bytes_per_block(&self) -> usize {
        self.bytes_per_block.iter().sum()
    }
}

/// Where a non-blocking initialisation stands.
#[derive(Debug)]
pub(crate) enum InitStatus<'a, T> {
    /// Still running.
    Pending,
    /// Done.
    Ready(&'a T),
    /// Failed; the error says why.
    Failed(&'a Error),
}

/// The result of an initialisation that may run in the background.
#[derive(Debug)]
pub(crate) struct InitCell<T> {
    cell: OnceLock<std::result::Result<T, Error>>,
}

impl<T> Default for InitCell<T> {
    fn default() -> Self {
        Self {
            cell: OnceLock::new(),
        }
    }
}

impl<T> InitCell<T> {
    /// Records the outcome (the first one wins).
    pub(crate) fn set(&self, outcome: Result<T>) {
        let _ = self.cell.set(outcome);
    }

    /// The status now (one atomic load when set).
    pub(crate) fn status(&self) -> InitStatus<'_, T> {
        match self.cell.get() {
            None => InitStatus::Pending,
            Some(Ok(v)) => InitStatus::Ready(v),
            Some(Err(e)) => InitStatus::Failed(e),
        }
    }

    /// The value when ready.
    pub(crate) fn get(&self) -> Option<&T> {
        match self.cell.get() {
            Some(Ok(v)) => Some(v),
            _ => None,
        }
    }
}

/// Runs `f` inline (`blocking`: an [`InitMode::BLOCKING`]) or on a named background thread,
/// recording its outcome in the returned cell. Blocking mode returns `f`'s error directly. `f`
/// gets the cell, to record its value before it returns (the leader does, before telling the
/// workers it is ready); the first value recorded wins.
pub(crate) fn initialise<T: Send + Sync + 'static>(
    blocking: bool,
    name: &str,
    f: impl FnOnce(&InitCell<T>) -> Result<T> + Send + 'static,
) -> Result<Arc<InitCell<T>>> {
    let cell = Arc::new(InitCell::default());
    if blocking {
        let v = f(&cell)?;
        cell.set(Ok(v));
    } else {
        let c = cell.clone();
        let label = name.to_string();
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let outcome = f(&c);
                if let Err(e) = &outcome {
                    if Arc::strong_count(&c) > 1 {
                        tracing::error!(side = %label, error = %e, "kvbm initialisation failed");
                    } else {
                        // Its owner is gone (a leader replaced before start-up, e.g. by one
                        // per TensorRT-LLM pool): nobody waits for this outcome.
                        tracing::debug!(side = %label, error = %e, "kvbm initialisation ended, owner gone");
                    }
                }
                c.set(outcome);
            })
            .map_err(|e| Error::io("spawn initialisation thread", e))?;
    }
    Ok(cell)
}

fn missing(have: &[bool]) -> Vec<Rank> {
    have.iter()
        .enumerate()
        .filter(|(_, h)| !**h)
        .map(|(r, _)| r)
        .collect()
}

fn timed_out(step: &str, timeout: Duration, ranks: &[Rank]) -> Error {
    Error::new(
        ErrorKind::Timeout,
        format!(
            "start-up barrier timed out after {:.1}s: {step} missing from rank(s) {ranks:?}",
            timeout.as_secs_f64()
        ),
    )
    .with("step", step)
    .with("missing_ranks", format!("{ranks:?}"))
}

/// The leader's side of the barrier.
///
/// `page_size`, when given, is the leader's tokens per block: a rank whose blocks hold another
/// number is refused (its keys would name different token spans). `on_ready` records the
/// outcome where the leader's calls read it; it runs before step 3 tells the workers.
pub(crate) fn leader_barrier(
    transport: &dyn LeaderTransport,
    config: &Config,
    page_size: Option<usize>,
    timeout: Duration,
    on_ready: impl FnOnce(&Readiness),
) -> Result<Readiness> {
    let deadline = Instant::now() + timeout;
    let world = transport.world_size();
    if world == 0 {
        return Err(Error::invalid_argument("world_size must be at least 1"));
    }
    // Step 1: every rank's bytes_per_block and device block count.
    let hellos = collect_hellos(transport, world, page_size, deadline, timeout)?;
    let bytes_per_block: Vec<usize> = hellos.iter().map(|h| h.bytes_per_block).collect();
    let total: usize = bytes_per_block
        .iter()
        .try_fold(0usize, |a, b| a.checked_add(*b))
        .ok_or_else(|| Error::invalid_argument("sum of bytes_per_block overflows"))?;
    let counts = tier_counts(transport, world, config, &hellos, total)?;
    // Step 2: every rank allocates the same counts.
    for rank in 0..world {
        transport.send(rank, LeaderMessage::Allocate(counts))?;
    }
    let disk_index = match await_allocations(transport, world, deadline, timeout) {
        Ok(index) => index,
        Err(e) => {
            // The ranks that confirmed wait for step 3: tell them, rather than let them wait
            // for the deadline.
            for rank in 0..world {
                let _ = transport.send(rank, LeaderMessage::Refused(e.message().to_string()));
            }
            return Err(e);
        }
    };
    let dims = hellos
        .first()
        .map(|h| h.dims)
        .ok_or_else(|| Error::internal("barrier finished without any rank"))?;
    tracing::info!(
        world,
        host_blocks = counts.num_host_blocks,
        disk_blocks = counts.num_disk_blocks,
        device_blocks = counts.num_device_blocks,
        bytes_per_block = total,
        "kvbm leader ready"
    );
    let readiness = Readiness {
        counts,
        dims,
        bytes_per_block,
        disk_index,
    };
    // Step 3, once the leader's calls see it ready.
    on_ready(&readiness);
    for rank in 0..world {
        if let Err(e) = transport.send(rank, LeaderMessage::Ready) {
            // The rank is gone: the transport reports it, and it counts as lost from then on.
            tracing::warn!(rank, error = %e, "cannot tell a kvbm worker that the leader is ready");
        }
    }
    Ok(readiness)
}

/// Barrier step 1 on the leader: each of the `world` ranks' hello (its `bytes_per_block`, device block count
/// and dimensions), in rank order, by `deadline` (`timeout` is named in the error). A rank whose
/// hello disagrees with the world, the first hello or the leader's `page_size` is refused (and
/// told why); one that disconnects is forgotten until it says hello again.
fn collect_hellos(
    transport: &dyn LeaderTransport,
    world: usize,
    page_size: Option<usize>,
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<WorkerHello>> {
    let mut hellos: Vec<Option<WorkerHello>> = vec![None; world];
    while hellos.iter().any(Option::is_none) {
        let have: Vec<bool> = hellos.iter().map(Option::is_some).collect();
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out(
                "step 1 (bytes_per_block)",
                timeout,
                &missing(&have),
            ));
        }
        let Some((rank, msg)) = transport.recv_timeout(left)? else {
            continue;
        };
        match msg {
            WorkerMessage::Hello(h) => {
                let check =
                    check_hello(rank, world, &h, hellos.iter().flatten().next()).and_then(|()| {
                        match page_size {
                            Some(p) if p != h.dims.page_size => {
                                Err(Error::invalid_layout(format!(
                            "rank {rank} has {}-token blocks but the leader keys {p}-token blocks",
                            h.dims.page_size
                        ))
                                .with("rank", rank))
                            }
                            _ => Ok(()),
                        }
                    });
                if let Err(e) = check {
                    let _ = transport.send(rank, LeaderMessage::Refused(e.message().to_string()));
                    return Err(e);
                }
                if let Some(slot) = hellos.get_mut(rank) {
                    *slot = Some(h);
                }
            }
            WorkerMessage::Disconnected(why) => {
                // It may reconnect before the deadline; forget what it said.
                tracing::warn!(rank, reason = %why, "rank disconnected during barrier step 1");
                if let Some(slot) = hellos.get_mut(rank) {
                    *slot = None;
                }
            }
            other => tracing::warn!(rank, ?other, "unexpected message during barrier step 1"),
        }
    }
    Ok(hellos.into_iter().flatten().collect())
}

/// The tier block counts every rank allocates: host and disk from the configuration over the
/// ranks' summed `bytes_per_block` (`total`), the device count the smallest any rank has. A size
/// that cannot be allocated is refused to every rank, so none waits for its counts until the
/// deadline; the error names the setting.
fn tier_counts(
    transport: &dyn LeaderTransport,
    world: usize,
    config: &Config,
    hellos: &[WorkerHello],
    total: usize,
) -> Result<TierCounts> {
    if let Some(warning) = config.tier_warning() {
        tracing::warn!("kvbm: {warning}");
    }
    let (num_host_blocks, num_disk_blocks) = match config.block_counts(total) {
        Ok(counts) => counts,
        Err(e) => {
            for rank in 0..world {
                let _ = transport.send(rank, LeaderMessage::Refused(e.message().to_string()));
            }
            return Err(e);
        }
    };
    let num_device_blocks = hellos
        .iter()
        .map(|h| h.num_device_blocks)
        .min()
        .unwrap_or(0);
    Ok(TierCounts {
        num_host_blocks,
        num_disk_blocks,
        num_device_blocks,
    })
}

/// Barrier step 2 on the leader: each of the `world` ranks' confirmation that it allocated its tiers, by
/// `deadline`. A rank that could not allocate, or that disconnects, fails the barrier.
fn await_allocations(
    transport: &dyn LeaderTransport,
    world: usize,
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<(usize, u128)>> {
    let mut ready = vec![false; world];
    let mut indexes: Vec<std::collections::HashSet<(usize, u128)>> =
        vec![Default::default(); world];
    while ready.iter().any(|r| !r) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out(
                "step 2 (allocation confirmed)",
                timeout,
                &missing(&ready),
            ));
        }
        let Some((rank, msg)) = transport.recv_timeout(left)? else {
            continue;
        };
        match msg {
            WorkerMessage::Ready => {
                if let Some(r) = ready.get_mut(rank) {
                    *r = true;
                }
            }
            WorkerMessage::DiskIndex(chunk) => {
                if let Some(set) = indexes.get_mut(rank) {
                    set.extend(chunk);
                }
            }
            WorkerMessage::Failed(why) => {
                return Err(Error::new(
                    ErrorKind::NotReady,
                    format!("rank {rank} could not allocate its tiers: {why}"),
                )
                .with("rank", rank))
            }
            WorkerMessage::Disconnected(why) => {
                return Err(Error::new(
                    ErrorKind::Cancelled,
                    format!("rank {rank} disconnected during start-up: {why}"),
                )
                .with("rank", rank))
            }
            other => tracing::warn!(rank, ?other, "unexpected message during barrier step 2"),
        }
    }
    // A block is served only when every rank holds the same key in it.
    let mut common = indexes.pop().unwrap_or_default();
    for set in &indexes {
        common.retain(|e| set.contains(e));
    }
    let mut common: Vec<(usize, u128)> = common.into_iter().collect();
    common.sort_unstable();
    Ok(common)
}

fn check_hello(
    rank: Rank,
    world: usize,
    h: &WorkerHello,
    first: Option<&WorkerHello>,
) -> Result<()> {
    if rank >= world || h.rank != rank {
        return Err(Error::invalid_argument(format!(
            "worker says it is rank {} but connected as rank {rank} of {world}",
            h.rank
        ))
        .with("rank", rank));
    }
    if h.world_size != world {
        return Err(Error::invalid_argument(format!(
            "rank {rank} expects world size {} but the leader has {world}",
            h.world_size
        ))
        .with("rank", rank));
    }
    if h.bytes_per_block == 0 || h.num_device_blocks == 0 {
        return Err(Error::invalid_argument(format!(
            "rank {rank} reported bytes_per_block {} and {} device blocks; both must be non-zero",
            h.bytes_per_block, h.num_device_blocks
        ))
        .with("rank", rank));
    }
    if let Some(f) = first {
        let (a, b) = (&f.dims, &h.dims);
        if a.num_layers != b.num_layers || a.page_size != b.page_size || a.outer_dim != b.outer_dim
        {
            return Err(Error::invalid_layout(format!(
                "rank {rank} layout (layers {}, outer {}, page {}) disagrees with rank {} (layers {}, outer {}, page {})",
                b.num_layers, b.outer_dim, b.page_size, f.rank, a.num_layers, a.outer_dim, a.page_size
            ))
            .with("rank", rank));
        }
    }
    Ok(())
}

/// A worker's side of the barrier: report, receive counts, `allocate`, confirm, and with
/// `await_leader` wait for the leader's step 3 ([`LeaderMessage::Ready`]). Without it, the
/// leader's `Ready` arrives after start-up (the worker ignores it there).
pub(crate) fn worker_barrier(
    transport: &dyn WorkerTransport,
    hello: WorkerHello,
    timeout: Duration,
    await_leader: bool,
    allocate: impl FnOnce(TierCounts) -> Result<Vec<(usize, u128)>>,
) -> Result<TierCounts> {
    let deadline = Instant::now() + timeout;
    let rank = transport.rank();
    transport.send(WorkerMessage::Hello(hello))?;
    let counts = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "start-up barrier timed out after {:.1}s: rank {rank} got no block counts from the leader",
                    timeout.as_secs_f64()
                ),
            )
            .with("rank", rank)
            .with("step", "step 2 (block counts)"));
        }
        match transport.recv_timeout(left)? {
            Some(LeaderMessage::Allocate(c)) => break c,
            Some(LeaderMessage::Refused(why)) => {
                return Err(Error::new(
                    ErrorKind::NotReady,
                    format!("leader refused rank {rank}: {why}"),
                )
                .with("rank", rank))
            }
            Some(LeaderMessage::Goodbye) => return Err(leader_left(rank)),
            Some(other @ (LeaderMessage::Finish(_) | LeaderMessage::Ready)) => {
                tracing::warn!(
                    rank,
                    ?other,
                    "unexpected leader message during start-up; ignored"
                );
            }
            None => continue,
        }
    };
    let disk_index = match allocate(counts) {
        Ok(index) => index,
        Err(e) => {
            let _ = transport.send(WorkerMessage::Failed(e.to_string()));
            return Err(e);
        }
    };
    for chunk in disk_index.chunks(crate::connector::transport::DISK_INDEX_CHUNK) {
        transport.send(WorkerMessage::DiskIndex(chunk.to_vec()))?;
    }
    transport.send(WorkerMessage::Ready)?;
    if await_leader {
        await_leader_ready(transport, rank, deadline, timeout)?;
    }
    Ok(counts)
}

/// Barrier step 3 on a worker: the leader's [`LeaderMessage::Ready`] by `deadline`.
fn await_leader_ready(
    transport: &dyn WorkerTransport,
    rank: Rank,
    deadline: Instant,
    timeout: Duration,
) -> Result<()> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "start-up barrier timed out after {:.1}s: rank {rank} allocated its tiers but the leader never said it was ready (another rank missing, or the leader stopped)",
                    timeout.as_secs_f64()
                ),
            )
            .with("rank", rank)
            .with("step", "step 3 (leader ready)"));
        }
        match transport.recv_timeout(left)? {
            Some(LeaderMessage::Ready) => return Ok(()),
            Some(LeaderMessage::Refused(why)) => {
                return Err(Error::new(
                    ErrorKind::NotReady,
                    format!(
                        "the leader's start-up failed after rank {rank} allocated its tiers: {why}"
                    ),
                )
                .with("rank", rank)
                .with("step", "step 3 (leader ready)"))
            }
            Some(LeaderMessage::Goodbye) => return Err(leader_left(rank)),
            Some(other @ (LeaderMessage::Allocate(_) | LeaderMessage::Finish(_))) => {
                tracing::warn!(
                    rank,
                    ?other,
                    "unexpected leader message during start-up; ignored"
                );
            }
            None => continue,
        }
    }
}

/// The leader said goodbye before start-up ended.
fn leader_left(rank: Rank) -> Error {
    Error::new(
        ErrorKind::Cancelled,
        format!("the kvbm leader shut down before rank {rank}'s start-up ended"),
    )
    .with("rank", rank)
}
