//! Completion: operations in flight until every rank reported them, and what finishing one
//! changes — a stored block registered (matchable), a loaded block counted as a hit, a failed
//! block withdrawn or dropped, a request whose work drained closed.
//!
//! Invariants: an operation acts only when all ranks reported it (a lost rank counts as having
//! reported it with every block failed); a block that failed on any rank is never registered and
//! never counted as a hit; completions that arrive together are applied in operation order, so
//! a replay is reproducible. Every block whose store failed (device → host, device → disk, host →
//! disk) is counted in the metrics' store errors and warned about, rate-limited (a full disk fails
//! thousands of blocks: one warning per 30 s with the count since the last).

use std::collections::HashSet;

use crate::connector::adapter::SchedulerAdapter;
use crate::connector::metadata::OperationId;
use crate::connector::remote::CallKind;
use crate::connector::transport::{Completion, WorkerMessage};
use crate::connector::RequestId;
use crate::identity::SequenceHash;
use crate::pool::{ImmutableBlock, MutableBlock};
use crate::tier::TierKind;

use super::Leader;

/// What an operation holds until every rank has completed it.
#[derive(Debug)]
pub(super) enum Holds {
    Load {
        tier: TierKind,
        src: Vec<ImmutableBlock>,
        /// The device block each source block goes to (same order).
        dst: Vec<usize>,
    },
    /// A load from the remote store: nothing held here (the store owns the values).
    Remote {
        keys: Vec<SequenceHash>,
        dst: Vec<usize>,
    },
    /// A write of host blocks to the remote store: pair `k` writes `src[k]` as `keys[k]` (the
    /// workers report failed pairs by `k`); the host blocks are held until it completes.
    RemoteWrite {
        keys: Vec<SequenceHash>,
        src: Vec<ImmutableBlock>,
    },
    Store {
        tier: TierKind,
        dst: Vec<(MutableBlock, SequenceHash)>,
        /// Host blocks being copied down (host → disk); released on completion.
        src: Vec<ImmutableBlock>,
    },
}

impl Holds {
    /// The destination block ids of the operation.
    fn dst_blocks(&self) -> Vec<usize> {
        match self {
            Holds::Load { dst, .. } | Holds::Remote { dst, .. } => dst.clone(),
            Holds::Store { dst, .. } => dst.iter().map(|(b, _)| b.block_id()).collect(),
            Holds::RemoteWrite { keys, .. } => (0..keys.len()).collect(),
        }
    }
}

#[derive(Debug)]
pub(super) struct OpTrack {
    request: Option<RequestId>,
    acked: Vec<bool>,
    failed: HashSet<usize>,
    holds: Holds,
    /// When it was submitted (a remote load's latency informs the store's health).
    since: std::time::Instant,
    /// The cache epoch at submission ([`Leader::clear_tiers`] starts a new one): a store
    /// submitted before a reset is not registered when it completes after it.
    epoch: u64,
}

/// How long a match waits for the completions of a request's loads that the engine was already
/// told ended (see `Leader::await_loads`).
pub(super) const LOAD_REPORT_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

impl<A: SchedulerAdapter> Leader<A> {
    pub(super) fn track(&mut self, op: OperationId, request: Option<RequestId>, holds: Holds) {
        let world = self.transport.world_size();
        let mut track = OpTrack {
            request,
            acked: vec![false; world],
            failed: HashSet::new(),
            holds,
            since: std::time::Instant::now(),
            epoch: self.cache_epoch,
        };
        // A dead rank will never do it: count it as done there, every block failed.
        for (r, dead) in self.dead.iter().enumerate() {
            if *dead {
                if let Some(a) = track.acked.get_mut(r) {
                    *a = true;
                }
                track.failed.extend(track.holds.dst_blocks());
            }
        }
        self.ops.insert(op, track);
        self.metrics.record_operation_submitted();
    }

    /// A rank's connection was lost: every operation it had not completed counts as failed there
    /// (loads are load errors, stores are not registered), and the leader degrades.
    fn on_rank_lost(&mut self, rank: usize, why: &str) {
        if why == crate::connector::transport::GOODBYE {
            tracing::info!(
                rank,
                "a kvbm worker left (its engine shut down); matching and storing stop"
            );
        } else {
            tracing::error!(rank, reason = %why, "kvbm leader lost a worker; matching and storing stop");
        }
        if self.dead.len() <= rank {
            self.dead.resize(rank + 1, false);
        }
        if self.dead[rank] {
            return;
        }
        self.dead[rank] = true;
        let ids: Vec<OperationId> = self.ops.keys().copied().collect();
        for id in ids {
            let done = match self.ops.get_mut(&id) {
                Some(t) => match t.acked.get_mut(rank) {
                    Some(a) if !*a => {
                        *a = true;
                        let blocks = t.holds.dst_blocks();
                        t.failed.extend(blocks);
                        t.acked.iter().all(|a| *a)
                    }
                    _ => false,
                },
                None => false,
            };
            if done {
                if let Some(t) = self.ops.remove(&id) {
                    self.finish_op(t);
                }
            }
        }
    }

    /// Applies the completions workers reported since the last call (every leader call does this
    /// first; an idle engine may call it to let stored blocks become matchable sooner).
    pub fn process_completions(&mut self) {
        self.poll_completions();
    }

    /// Drains worker messages and completes operations every rank has reported. Before the
    /// barrier completed the barrier owns the transport: nothing is drained here.
    pub(super) fn poll_completions(&mut self) {
        self.poll_completions_from(None);
    }

    /// The engine asks about request `id` as if its loads were over (vLLM matches a request
    /// again after its load failed) while the leader still counts some in flight: the worker
    /// sent their completions before it told the engine (its outbox flushes first), so they
    /// are in transit (the rendezvous and TCP transports). Waits for them, at most
    /// [`LOAD_REPORT_WAIT`]; a lost rank ends the wait too (its operations count as failed).
    pub(super) fn await_loads(&mut self, id: &RequestId) {
        let deadline = std::time::Instant::now() + LOAD_REPORT_WAIT;
        while self.slots.get(id).is_some_and(|s| s.loads_in_flight > 0) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return;
            }
            match self.transport.recv_timeout(left) {
                Ok(Some(first)) => self.poll_completions_from(Some(first)),
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "kvbm leader transport failed while waiting for a load's completion");
                    return;
                }
            }
        }
    }

    /// [`Leader::poll_completions`], starting with a message already received.
    fn poll_completions_from(&mut self, mut first: Option<(usize, WorkerMessage)>) {
        if !self.ensure_ready() {
            return;
        }
        // Completions that arrived together are applied in operation order, not arrival order:
        // the order stored blocks join the host pool's LRU then does not depend on which copy
        // happened to finish first, and a replay is reproducible.
        let mut batch: Vec<(usize, Completion)> = Vec::new();
        loop {
            let next = match first.take() {
                Some(m) => Ok(Some(m)),
                None => self.transport.try_recv(),
            };
            match next {
                Ok(Some((rank, WorkerMessage::Completed(list)))) => {
                    batch.extend(list.into_iter().map(|c| (rank, c)));
                }
                Ok(Some((rank, WorkerMessage::StoreStats(st)))) => {
                    self.rank_store_stats.insert(rank, st);
                }
                Ok(Some((rank, WorkerMessage::Disconnected(why)))) => {
                    self.apply_completions(&mut batch);
                    self.on_rank_lost(rank, &why);
                }
                Ok(Some((rank, other))) => {
                    tracing::warn!(rank, ?other, "unexpected worker message after start-up");
                }
                Ok(None) => break,
                Err(e) => {
                    if !self.failure_logged {
                        tracing::error!(error = %e, "kvbm leader transport failed");
                        self.failure_logged = true;
                    }
                    break;
                }
            }
        }
        self.apply_completions(&mut batch);
        self.publish_store_stats();
    }

    fn apply_completions(&mut self, batch: &mut Vec<(usize, Completion)>) {
        batch.sort_by_key(|(rank, c)| (c.op, *rank));
        for (rank, c) in batch.drain(..) {
            self.on_completion(rank, c);
        }
    }

    fn on_completion(&mut self, rank: usize, c: Completion) {
        if c.op.is_custom() {
            if let Err(e) = self.adapter.on_custom_completion(rank, &c) {
                tracing::warn!(rank, op = %c.op, error = %e, "adapter refused a completion");
            }
            return;
        }
        let Some(track) = self.ops.get_mut(&c.op) else {
            tracing::warn!(rank, op = %c.op, "completion for an unknown operation");
            return;
        };
        let Some(seen) = track.acked.get_mut(rank) else {
            tracing::warn!(rank, op = %c.op, "completion from an unknown rank");
            return;
        };
        if *seen {
            tracing::warn!(rank, op = %c.op, "duplicate completion");
            return;
        }
        *seen = true;
        if let Some(e) = &c.error {
            tracing::warn!(rank, op = %c.op, error = %e, "operation failed on a worker");
        }
        track.failed.extend(c.failed_dst_blocks);
        if track.acked.iter().all(|a| *a) {
            if let Some(track) = self.ops.remove(&c.op) {
                self.finish_op(track);
            }
        }
    }

    /// An operation every rank completed (`track.failed`: the blocks that failed on any rank):
    /// counted, then what it changes by kind — a load's hits, errors and withdrawn blocks, a
    /// store's registered blocks, a remote load's or write's keys and the store's health.
    fn finish_op(&mut self, track: OpTrack) {
        self.metrics
            .record_operation_completed(track.failed.is_empty());
        let OpTrack {
            request,
            failed,
            holds,
            since,
            epoch,
            ..
        } = track;
        let request = request.as_ref();
        match holds {
            Holds::Store { tier, dst, .. } if epoch != self.cache_epoch => {
                self.drop_stale_store(request, tier, dst)
            }
            Holds::Remote { keys, dst } => {
                self.finish_remote_load(request, &failed, since, &keys, &dst)
            }
            Holds::RemoteWrite { keys, src } => {
                self.finish_remote_write(&failed, since, &keys, src)
            }
            Holds::Load { tier, src, dst } => self.finish_load(request, &failed, tier, src, &dst),
            Holds::Store { tier, dst, src } => self.finish_store(request, &failed, tier, dst, src),
        }
    }

    /// Bytes of one block over all ranks (0 before the tiers exist): what the transfer
    /// counters add per block.
    fn bytes_per_block_all_ranks(&self) -> u64 {
        self.tiers
            .as_ref()
            .map_or(0, |t| t.readiness.total_bytes_per_block()) as u64
    }

    /// A finished load from the remote store of `keys` into device blocks `dst`: the keys that
    /// loaded remembered as in the store, the store's health told, the hits, bytes and load
    /// errors (a block evicted since the lookup or failing verification, recomputed) counted.
    fn finish_remote_load(
        &mut self,
        request: Option<&RequestId>,
        failed_dst: &HashSet<usize>,
        since: std::time::Instant,
        keys: &[SequenceHash],
        dst: &[usize],
    ) {
        let bs = self.page_size as u64;
        let bpb = self.bytes_per_block_all_ranks();
        let total = keys.len() as u64;
        let failed = (failed_dst.len() as u64).min(total);
        let ok = total - failed;
        if failed > 0 {
            // Evicted since the lookup, or failed verification: recomputed.
            tracing::debug!(failed, "remote blocks failed to load");
        }
        if let Some(r) = self.remote.as_mut() {
            for (k, d) in keys.iter().zip(dst) {
                if !failed_dst.contains(d) {
                    r.remember(*k);
                }
            }
            r.record_transfer(CallKind::Load, keys.len(), failed as usize, since.elapsed());
            r.publish_state(&self.metrics);
        }
        self.metrics.record_hit(TierKind::Remote, ok * bs);
        self.metrics
            .record_transfer(TierKind::Remote, TierKind::Device, ok, ok * bpb);
        if failed > 0 {
            self.metrics.record_load_error(failed);
        }
        self.request_op_done(request, true);
    }

    /// A finished write of host blocks `src` to the remote store as `keys` (`failed_pairs`: the
    /// pairs `k` that failed): the keys no longer pending, those written remembered as in the
    /// store, the store's health told, the bytes and store errors counted, and the host blocks
    /// released.
    fn finish_remote_write(
        &mut self,
        failed_pairs: &HashSet<usize>,
        since: std::time::Instant,
        keys: &[SequenceHash],
        src: Vec<ImmutableBlock>,
    ) {
        let bpb_rank = self.bytes_per_block_all_ranks();
        let mut written = 0u64;
        let mut failed = 0u64;
        for (k, hash) in keys.iter().enumerate() {
            self.pending_keys.remove(&(TierKind::Remote, *hash));
            if failed_pairs.contains(&k) {
                failed += 1;
            } else {
                written += 1;
                if let Some(r) = self.remote.as_mut() {
                    r.remember(*hash);
                }
                if let Some(log) = self.events.as_mut() {
                    log.remote_written(*hash);
                }
            }
        }
        self.metrics.record_transfer(
            TierKind::Host,
            TierKind::Remote,
            written,
            written * bpb_rank,
        );
        if let Some(r) = self.remote.as_ref() {
            r.record_transfer(
                CallKind::Write,
                keys.len(),
                failed as usize,
                since.elapsed(),
            );
            r.publish_state(&self.metrics);
        }
        if failed > 0 {
            self.metrics.record_store_error(TierKind::Remote, failed);
            if let Some(r) = self.remote.as_mut() {
                r.write_failed(failed);
            }
        }
        if let Some(r) = self.remote.as_mut() {
            r.writing = r.writing.saturating_sub(src.len());
        }
        drop(src);
    }

    /// A finished load of `tier`'s blocks `src` into device blocks `dst`: a block that failed
    /// withdrawn from its pool, the hits, bytes and load errors counted, and host blocks read
    /// without a failure considered again for disk and the remote store (they were just reused).
    fn finish_load(
        &mut self,
        request: Option<&RequestId>,
        failed_dst: &HashSet<usize>,
        tier: TierKind,
        src: Vec<ImmutableBlock>,
        dst: &[usize],
    ) {
        let bs = self.page_size as u64;
        let bpb = self.bytes_per_block_all_ranks();
        let total = src.len() as u64;
        let failed = (failed_dst.len() as u64).min(total);
        let ok = total - failed;
        // A block that failed to load (e.g. its checksum) is withdrawn: no later match may serve
        // it, and a recomputed copy can be stored under its key again.
        if failed > 0 {
            let pool = self.tiers.as_ref().and_then(|t| match tier {
                TierKind::Host => t.host.clone(),
                TierKind::Disk => t.disk.clone(),
                _ => None,
            });
            for (b, d) in src.iter().zip(dst) {
                if failed_dst.contains(d) {
                    if let Some(p) = &pool {
                        p.unregister(b);
                    }
                    tracing::warn!(tier = %tier, block = b.block_id(), key = %b.sequence_hash(), "withdrew a block whose load failed");
                }
            }
        }
        self.metrics.record_hit(tier, ok * bs);
        self.metrics
            .record_transfer(tier, TierKind::Device, ok, ok * bpb);
        if failed > 0 {
            self.metrics.record_load_error(failed);
        }
        // A block read from host was just reused: count the sighting for disk admission.
        if tier == TierKind::Host && failed == 0 {
            for b in src {
                self.consider_for_remote(&b);
                self.consider_for_disk(b);
            }
        }
        self.request_op_done(request, true);
    }

    /// A finished store into `tier`'s blocks `dst` (from the device, or from the host blocks
    /// `src`): the keys no longer pending, the blocks that did not fail on any rank registered
    /// (matchable; a host block then considered for disk and the remote store), the others
    /// back to the free list, the bytes and store errors counted (warned about, rate-limited),
    /// and the host sources released.
    fn finish_store(
        &mut self,
        request: Option<&RequestId>,
        failed_dst: &HashSet<usize>,
        tier: TierKind,
        dst: Vec<(MutableBlock, SequenceHash)>,
        src: Vec<ImmutableBlock>,
    ) {
        let bpb = self.bytes_per_block_all_ranks();
        let src_tier = if src.is_empty() {
            TierKind::Device
        } else {
            TierKind::Host
        };
        let mut stored = 0u64;
        let mut failed = 0u64;
        let pool = self.tiers.as_ref().and_then(|t| match tier {
            TierKind::Host => t.host.clone(),
            TierKind::Disk => t.disk.clone(),
            _ => None,
        });
        let mut written = Vec::with_capacity(dst.len());
        for (block, hash) in dst {
            self.pending_keys.remove(&(tier, hash));
            if failed_dst.contains(&block.block_id()) {
                failed += 1;
                continue; // dropped: back to the free list, never matchable
            }
            written.push((block, hash));
        }
        // A host block may go on to disk or the remote store: each is considered with its
        // handle. Otherwise nothing keeps one: all are registered under one lock.
        let onward = tier == TierKind::Host
            && (self.remote.is_some() || self.tiers.as_ref().is_some_and(|t| t.disk.is_some()));
        match pool {
            None => {} // dropped: back to the free list
            Some(pool) if !onward => {
                let (n, errors) = pool.register_all(written);
                stored += n as u64;
                for e in errors {
                    tracing::warn!(error = %e, "cannot register a stored block");
                }
            }
            Some(pool) => {
                for (block, hash) in written {
                    match pool.register(block, hash) {
                        Ok(registered) => {
                            stored += 1;
                            self.consider_for_remote(&registered);
                            self.consider_for_disk(registered);
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot register a stored block")
                        }
                    }
                }
            }
        }
        self.metrics
            .record_transfer(src_tier, tier, stored, stored * bpb);
        if failed > 0 {
            self.metrics.record_store_error(tier, failed);
            if let Some(n) = self.store_warn.event(failed) {
                tracing::warn!(
                    src = %src_tier, dst = %tier, blocks = n,
                    total = self.metrics.snapshot().store_error_blocks(),
                    "kvbm: blocks failed to store (not cached; see kvbm_store_error_blocks_total)"
                );
            }
        }
        drop(src);
        self.request_op_done(request, false);
    }

    /// A store submitted before [`Leader::clear_tiers`] (a cache reset, e.g. after a weight
    /// update): what it wrote was computed before the reset, so it is never registered; its
    /// blocks go back to the free list, its keys are no longer pending, nothing is counted as
    /// stored or failed.
    fn drop_stale_store(
        &mut self,
        request: Option<&RequestId>,
        tier: TierKind,
        dst: Vec<(MutableBlock, SequenceHash)>,
    ) {
        for (_block, hash) in &dst {
            self.pending_keys.remove(&(tier, *hash));
        }
        drop(dst);
        self.request_op_done(request, false);
    }

    fn request_op_done(&mut self, request: Option<&RequestId>, load: bool) {
        let Some(id) = request else { return };
        let Some(slot) = self.slots.get_mut(id) else {
            return;
        };
        if load {
            slot.loads_in_flight = slot.loads_in_flight.saturating_sub(1);
        } else {
            slot.stores_in_flight = slot.stores_in_flight.saturating_sub(1);
        }
        if slot.life.is_finishing() && slot.loads_in_flight == 0 && slot.stores_in_flight == 0 {
            if let Err(e) = slot.life.drained() {
                tracing::warn!(error = %e, "cannot close a drained request");
            }
            if let Some(since) = slot.held_since {
                self.metrics.record_finish_hold(since.elapsed());
            }
            self.slots.remove(id);
        }
    }
}
