//! Offload: the metadata of each engine iteration, and the stores it carries — device → host (or
//! device → disk without a host tier) for every full, computed block, host → disk for blocks the
//! admission filter lets through, host → remote store writes for blocks its admission lets
//! through — plus finishing requests.
//!
//! Invariants: a block is considered for offload once (a slot's `offloaded` only grows); a key is
//! stored to a tier at most once at a time (`pending_keys`), never when the tier already holds it;
//! nothing is stored while a request's loads are in flight or while a rank is lost; a step that
//! fails its checks changes nothing, and metadata the adapter or the encoder refuses goes back to
//! the front of the queue (no operation is lost).

use std::collections::HashSet;

use crate::connector::adapter::{ScheduledRequest, SchedulerAdapter, SchedulerStep};
use crate::connector::lifecycle::RequestState;
use crate::connector::metadata::{
    BlockTransfer, ConnectorMetadata, KeyedStore, Operation, RemoteWrite, Store,
};
use crate::connector::transport::{FinishWork, LeaderMessage};
use crate::connector::RequestId;
use crate::error::{Error, ErrorKind, Result};
use crate::identity::{SequenceHash, Token};
use crate::pool::{BlockPool, BuildSeqHasher, FrequencyFilter, ImmutableBlock, MutableBlock};
use crate::tier::TierKind;

use super::completion::Holds;
use super::{first_bad_block, unknown_request, Leader, Outbox, Slot};

impl<A: SchedulerAdapter> Leader<A> {
    /// Builds the metadata of one engine iteration: loads and stores decided since the last one,
    /// stores of every block that is full and computed after this iteration, host → disk copies,
    /// and the requests held for the engine. Not ready: empty metadata.
    ///
    /// The whole step is checked before anything changes: an unknown request id or a device block
    /// out of range is an error and the leader's state is as before.
    pub fn build_connector_meta(&mut self, step: &SchedulerStep) -> Result<Vec<u8>> {
        let meta = self.build_metadata(step)?;
        match meta.encode() {
            Ok(bytes) => Ok(bytes),
            Err(e) => {
                self.restore_outbox(meta);
                Err(e)
            }
        }
    }

    /// Puts this leader's own work from an undelivered metadata back in front of the queue, so
    /// a failing hook or encoder loses nothing (operations of other kinds are dropped).
    fn restore_outbox(&mut self, meta: ConnectorMetadata) {
        let mut outbox = Outbox {
            new_slots: meta.new_slots,
            operations: meta
                .operations
                .into_iter()
                .filter(|op| self.ops.contains_key(&op.id()))
                .collect(),
            hold: meta.hold,
            finished: meta.finished,
        };
        let later = std::mem::take(&mut self.outbox);
        outbox.new_slots.extend(later.new_slots);
        outbox.operations.extend(later.operations);
        outbox.hold.extend(later.hold);
        outbox.finished.extend(later.finished);
        self.outbox = outbox;
    }

    /// As [`Leader::build_connector_meta`], returning the metadata unencoded.
    pub fn build_metadata(&mut self, step: &SchedulerStep) -> Result<ConnectorMetadata> {
        let _span = tracing::debug_span!("kvbm.leader.build_meta", requests = step.requests.len())
            .entered();
        self.poll_completions();
        if !self.ensure_ready() {
            self.follow_unready(step)?;
            self.iteration += 1;
            let mut meta = ConnectorMetadata::empty(self.iteration);
            self.adapter.extend_metadata(&mut meta)?;
            return Ok(meta);
        }
        // Check everything first.
        let computed_after = self.check_scheduled(step)?;
        self.check_preempted(step)?;
        self.iteration += 1;
        self.apply_step(step, computed_after)?;
        self.queue_disk_offloads();
        self.queue_remote_writes();
        self.publish_remote_state();
        self.take_metadata()
    }

    /// Checks the step's scheduled requests, changing nothing: each scheduled once, tracked, its
    /// new device blocks in range. Returns what the adapter says each has computed after this
    /// iteration, in step order.
    fn check_scheduled(&self, step: &SchedulerStep) -> Result<Vec<usize>> {
        let num_device = self
            .tiers
            .as_ref()
            .map_or(0, |t| t.readiness.counts.num_device_blocks);
        let mut computed_after = Vec::with_capacity(step.requests.len());
        let mut seen: HashSet<&RequestId> = HashSet::with_capacity(step.requests.len());
        for r in &step.requests {
            if !seen.insert(&r.request_id) {
                return Err(Error::invalid_argument(format!(
                    "request {} is scheduled twice in one iteration",
                    r.request_id
                ))
                .with("request", &r.request_id)
                .with("op", "build_connector_meta"));
            }
            if !self.slots.contains_key(&r.request_id) {
                return Err(unknown_request("build_connector_meta", &r.request_id));
            }
            if let Some(bad) = first_bad_block(&r.new_block_ids, num_device, self.placeholder) {
                return Err(Error::out_of_range("device block", bad, num_device)
                    .with("request", &r.request_id)
                    .with("op", "build_connector_meta"));
            }
            computed_after.push(self.adapter.computed_after(r)?);
        }
        Ok(computed_after)
    }

    /// Checks the step's preempted requests: each tracked, none with loads in flight (loads in
    /// transit are awaited first).
    fn check_preempted(&mut self, step: &SchedulerStep) -> Result<()> {
        for p in &step.preempted {
            // A running request's loads are done: a worker tells the engine a load finished only
            // after sending its completion, so one not applied yet is in transit (TCP).
            if self.slots.get(p).is_some_and(|s| s.loads_in_flight > 0) {
                self.await_loads(p);
            }
            match self.slots.get(p) {
                None => return Err(unknown_request("build_connector_meta (preempted)", p)),
                Some(s) if s.loads_in_flight > 0 => {
                    return Err(Error::new(
                        ErrorKind::InvalidState,
                        format!("request {p}: preempted while its loads are in flight"),
                    )
                    .with("request", p))
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Applies a checked step: preempted requests lose their device blocks and staging; each
    /// scheduled request follows the step (`computed_after`, from [`Leader::check_scheduled`])
    /// and offloads what it has computed.
    fn apply_step(&mut self, step: &SchedulerStep, computed_after: Vec<usize>) -> Result<()> {
        for p in &step.preempted {
            if let Some(slot) = self.slots.get_mut(p) {
                slot.life.preempt()?;
                slot.device_blocks.clear();
                slot.staged = None;
            }
        }
        for (r, after) in step.requests.iter().zip(computed_after) {
            let Some(slot) = self.slots.get_mut(&r.request_id) else {
                continue;
            };
            let computed = follow(slot, r, after);
            slot.life.schedule(computed >= slot.prompt_len)?;
            slot.computed = slot.computed.max(computed);
            let id = r.request_id.clone();
            self.offload(&id, computed);
        }
        Ok(())
    }

    /// The remote store's state into the metrics. Cheap (counters): the gauge follows the store
    /// between lookups.
    fn publish_remote_state(&self) {
        if let Some(r) = &self.remote {
            let st = r.store.stats();
            r.publish_state(&self.metrics);
            if !r.backing_off() && !st.available {
                self.metrics.set_remote_available(false);
            }
        }
    }

    /// The iteration's metadata: the outbox taken whole, then the adapter's part; when the adapter
    /// refuses, the outbox goes back to the front of the queue.
    fn take_metadata(&mut self) -> Result<ConnectorMetadata> {
        let mut meta = ConnectorMetadata::empty(self.iteration);
        let outbox = std::mem::take(&mut self.outbox);
        meta.new_slots = outbox.new_slots;
        meta.operations = outbox.operations;
        meta.hold = outbox.hold;
        meta.finished = outbox.finished;
        let backup = meta.clone();
        if let Err(e) = self.adapter.extend_metadata(&mut meta) {
            self.restore_outbox(backup);
            return Err(e);
        }
        Ok(meta)
    }

    /// Before the leader is ready no operation can run, but the requests the engine schedules
    /// are followed (tokens, device blocks, computed tokens), so that the first metadata built
    /// once ready stores what they computed meanwhile. (TensorRT-LLM admits requests as soon as
    /// its workers registered, which can be before the leader's barrier has seen them: those
    /// requests were never offloaded.)
    fn follow_unready(&mut self, step: &SchedulerStep) -> Result<()> {
        for p in &step.preempted {
            if let Some(slot) = self.slots.get_mut(p) {
                slot.device_blocks.clear();
            }
        }
        for r in &step.requests {
            let after = self.adapter.computed_after(r)?;
            let Some(slot) = self.slots.get_mut(&r.request_id) else {
                continue;
            };
            let computed = follow(slot, r, after);
            slot.computed = slot.computed.max(computed);
        }
        Ok(())
    }

    /// How many of the request's tokens the leader holds (`None`: it does not track the request).
    /// A caller that keeps the request's token list can then pass only the tokens after these.
    pub fn known_tokens(&self, id: &str) -> Option<usize> {
        self.slots.get(id).map(|s| s.seq.total_tokens())
    }

    /// How many of the request's tokens the leader counts as computed: the largest count its
    /// adapter gave in an accepted step, capped at the tokens it knows (`None`: it does not track
    /// the request). An engine that reports progress relatively (tokens finished since the last
    /// iteration) passes this as [`ScheduledRequest::num_computed_tokens`], so its adapter keeps
    /// no running total of its own (`examples/toy_engine.rs`).
    pub fn computed_tokens(&self, id: &RequestId) -> Option<usize> {
        self.slots.get(id).map(|s| s.computed)
    }

    /// Appends the request's tokens from index `first_token` on (those the leader holds are
    /// skipped; a gap is ignored with a warning, as the keys after it would shift). Untracked
    /// requests are ignored.
    pub fn append_request_tokens(&mut self, id: &str, first_token: usize, tokens: &[Token]) {
        if let Some(slot) = self.slots.get_mut(id) {
            append_tokens(slot, id, tokens, Some(first_token));
        }
    }

    /// The engine finished (or aborted) a request. `all_tokens` (when the engine has them) lets
    /// the leader key tokens it has not seen; `computed_tokens` says how many have KV on the device
    /// (default: what the last iteration said). Full computed blocks not yet stored are stored now.
    ///
    /// Returns true when operations on the request's device blocks are still in flight: the engine
    /// must keep those blocks until a worker reports the request finished. An unknown request (one
    /// the leader never matched) holds nothing: false.
    pub fn request_finished(
        &mut self,
        id: &RequestId,
        all_tokens: Option<&[Token]>,
        computed_tokens: Option<usize>,
    ) -> Result<bool> {
        let _span = tracing::debug_span!("kvbm.leader.finished", request = %id).entered();
        self.poll_completions();
        let ready = self.ensure_ready();
        let Some(slot) = self.slots.get_mut(id) else {
            tracing::debug!(request = %id, "request_finished for a request the leader does not track");
            return Ok(false);
        };
        if slot.life.is_finishing() {
            // Surface the duplicate as the state machine's error (names request and state).
            slot.life.finish(false, false)?;
        }
        if !ready {
            self.slots.remove(id);
            self.outbox.finished.push(id.clone());
            return Ok(false);
        }
        if let Some(tokens) = all_tokens {
            let known = slot.seq.total_tokens();
            if tokens.len() > known {
                slot.seq.append(&tokens[known..]);
            }
        }
        slot.staged = None;
        if let Some(r) = self.remote.as_mut() {
            r.forget(id);
        }
        let Some(slot) = self.slots.get_mut(id) else {
            return Ok(false);
        };
        let computed = computed_tokens
            .unwrap_or(slot.computed)
            .min(slot.seq.total_tokens());
        let preempted = slot.life.state() == RequestState::Preempted;
        if !preempted {
            self.offload(id, computed);
        }
        let Some(slot) = self.slots.get_mut(id) else {
            return Ok(false);
        };
        let (loads, stores) = (slot.loads_in_flight > 0, slot.stores_in_flight > 0);
        slot.life.finish(loads, stores)?;
        if loads || stores {
            slot.held_since = Some(std::time::Instant::now());
            self.outbox.hold.push(id.clone());
            Ok(true)
        } else {
            self.slots.remove(id);
            self.outbox.finished.push(id.clone());
            Ok(false)
        }
    }

    /// As [`Leader::request_finished`], except that what it decides for a request it holds — the
    /// request's last stores and the hold on its device blocks — goes to every worker at once over
    /// the transport ([`LeaderMessage::Finish`]) instead of with the next metadata. For engines
    /// that build no metadata while nothing is scheduled (TensorRT-LLM calls only `get_finished`
    /// then): the request still completes.
    ///
    /// Ordering: the message names the iteration of the last metadata built (the next one when
    /// the request's slot has not been sent yet); a worker applies it in `get_finished`, at the
    /// end of an iteration, only once it bound that metadata: no worker runs a store for the
    /// request before the metadata announcing its slot, nor before its own forward pass of that
    /// iteration wrote the request's last KV. A request answered false goes with the next metadata
    /// as before (nothing waits on it).
    pub fn request_finished_now(
        &mut self,
        id: &RequestId,
        all_tokens: Option<&[Token]>,
        computed_tokens: Option<usize>,
    ) -> Result<bool> {
        let queued = self.outbox.operations.len();
        let held = self.request_finished(id, all_tokens, computed_tokens)?;
        if !held {
            return Ok(false);
        }
        let mut meta = ConnectorMetadata::empty(self.iteration);
        if self.outbox.new_slots.contains(id) {
            // Not announced yet: the next metadata does it.
            meta.iteration += 1;
        }
        // `request_finished` appended only this request's operations, after those queued before.
        let split = queued.min(self.outbox.operations.len());
        meta.operations = self.outbox.operations.split_off(split);
        self.outbox.hold.retain(|h| h != id);
        meta.hold.push(id.clone());
        let metadata = match meta.encode() {
            Ok(m) => m,
            Err(e) => {
                // Nothing was sent: it goes with the next metadata instead.
                self.restore_outbox(meta);
                return Err(e);
            }
        };
        let msg = LeaderMessage::Finish(FinishWork {
            after_iteration: meta.iteration,
            metadata,
        });
        for rank in 0..self.transport.world_size() {
            // A rank that cannot be reached is lost: the transport reports it, and its operations
            // then count as failed there (see `completion`).
            if let Err(e) = self.transport.send(rank, msg.clone()) {
                tracing::warn!(rank, request = %id, error = %e, "cannot send a finished request's work");
            }
        }
        Ok(true)
    }

    /// Holds finished request `id`'s device blocks on every worker although this leader has
    /// nothing in flight for them ([`Leader::request_finished_now`] answered false): an engine
    /// whose layer groups live in pools served by leaders of their own holds a request when any
    /// pool does, and every pool's workers must then report its release (each reports only
    /// what it holds). The request's `finished` notice, queued for the next metadata, becomes
    /// this hold, sent at once as a [`LeaderMessage::Finish`] ordered after the last metadata
    /// (the next one when the request's slot has not been announced yet). Errors: a request
    /// this leader still tracks (its own answer decides), or one that cannot be encoded.
    pub fn hold_finished_now(&mut self, id: &RequestId) -> Result<()> {
        if self.slots.contains_key(id) {
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!("request {id}: held here already, or not finished"),
            )
            .with("request", id));
        }
        let mut meta = ConnectorMetadata::empty(self.iteration);
        if self.outbox.new_slots.contains(id) {
            meta.iteration += 1;
        }
        meta.hold.push(id.clone());
        let msg = LeaderMessage::Finish(FinishWork {
            after_iteration: meta.iteration,
            metadata: meta.encode()?,
        });
        self.outbox.finished.retain(|f| f != id);
        for rank in 0..self.transport.world_size() {
            if let Err(e) = self.transport.send(rank, msg.clone()) {
                tracing::warn!(rank, request = %id, error = %e, "cannot send a finished request's hold");
            }
        }
        Ok(())
    }

    /// Schedules device → host (or device → disk without a host tier) stores for every full block
    /// of `id` below `computed` tokens not considered before.
    ///
    /// A host tier too small for the request (every host block in use by stores in flight or held
    /// by loads) does not drop the rest: they stream straight from the device to the disk tier
    /// (through the disk admission filter). Only blocks neither tier can take now are dropped,
    /// and they are counted (`offload_dropped_blocks`) and logged.
    fn offload(&mut self, id: &RequestId, computed: usize) {
        let bs = self.page_size;
        let placeholder = self.placeholder;
        let trailing = self.adapter.stores_trail_compute();
        let Some(tiers) = self.tiers.as_mut() else {
            return;
        };
        let Some(slot) = self.slots.get_mut(id) else {
            return;
        };
        if slot.loads_in_flight > 0 {
            // Loads are still writing this request's device blocks: nothing there is final.
            return;
        }
        if self.dead.iter().any(|d| *d) {
            // A rank is gone: its shard of any block stored now would be missing.
            slot.offloaded = slot.offloaded.max(computed / bs);
            return;
        }
        let full = (computed.min(slot.seq.total_tokens()) / bs).min(slot.seq.num_full_blocks());
        if full <= slot.offloaded {
            return;
        }
        let Some(pool) = tiers.host.as_ref().or(tiers.disk.as_ref()) else {
            slot.offloaded = full;
            return;
        };
        let kind = pool.kind();
        let scan = BlockScan {
            page_size: bs,
            placeholder,
            trailing,
            computed,
            kind,
        };
        let start = slot.offloaded;
        let (mut wanted, upto, window_skipped) =
            scan.wanted(slot, full, &mut self.window_keys, &self.pending_keys);
        slot.offloaded = upto;
        if window_skipped > 0 {
            self.metrics.record_window_skipped(window_skipped);
        }
        // Those the tier holds already: one lock for the request's blocks, not one per block.
        pool.retain_unregistered(&mut wanted, |w| w.1);
        if wanted.is_empty() {
            return;
        }
        if let Some(log) = self.events.as_mut() {
            // Which block of the request each key is (`wanted` keeps the request's order).
            let mut next = wanted.iter().map(|w| w.1).peekable();
            for (i, &hash) in slot.seq.hashes().iter().enumerate().take(upto).skip(start) {
                if next.peek() == Some(&hash) {
                    next.next();
                    log.submitted(id, i, hash);
                }
            }
        }
        // Destination blocks: the first tier while it has any, then straight to disk.
        let overflow = if kind == TierKind::Host {
            tiers.disk.clone()
        } else {
            None
        };
        let (first, spill, dropped) = stage_destinations(
            pool,
            overflow,
            &mut tiers.filter,
            &mut self.pending_keys,
            wanted,
        );
        if dropped > 0 {
            self.metrics.record_offload_dropped(dropped as u64);
            tracing::warn!(
                request = %id,
                dropped,
                "kvbm: host and disk tiers are full (every block in use by operations in flight): blocks not offloaded; size the tiers to hold the largest request (docs/deployment.md)"
            );
        }
        for (dst_kind, staging) in [(kind, first), (TierKind::Disk, spill)] {
            self.submit_store(id, dst_kind, staging);
        }
    }

    /// Queues one device → `kind` store of `staging`'s pairs for request `id` (nothing if empty).
    fn submit_store(&mut self, id: &RequestId, kind: TierKind, staging: Staging) {
        let Staging { pairs, dst } = staging;
        if pairs.is_empty() {
            return;
        }
        let Some(slot) = self.slots.get_mut(id) else {
            return;
        };
        slot.stores_in_flight += 1;
        let op = self.next_op_id();
        let transfer = BlockTransfer {
            id: op,
            request_id: Some(id.clone()),
            src: TierKind::Device,
            dst: kind,
            pairs,
        };
        let store = self.store_op(transfer, dst.iter().map(|(_, h)| h.0).collect());
        self.outbox.operations.push(store);
        self.track(
            op,
            Some(id.clone()),
            Holds::Store {
                tier: kind,
                dst,
                src: Vec::new(),
            },
        );
    }

    /// A store of `transfer`: keyed (each destination block's key, `keys` by pair) when it
    /// writes a persisted disk tier (`disk.persist`), so the workers can save which block holds
    /// which key with the file; plain otherwise.
    fn store_op(&self, transfer: BlockTransfer, keys: Vec<u128>) -> Box<dyn Operation> {
        if transfer.dst == TierKind::Disk && self.config.disk.reopens() {
            Box::new(KeyedStore { transfer, keys })
        } else {
            Box::new(Store(transfer))
        }
    }

    /// Turns queued host blocks into one host → disk store.
    fn queue_disk_offloads(&mut self) {
        if self.disk_queue.is_empty() {
            return;
        }
        if self.degraded() {
            self.disk_queue.clear();
            return;
        }
        let Some(disk) = self.tiers.as_ref().and_then(|t| t.disk.clone()) else {
            self.disk_queue.clear();
            return;
        };
        let mut queue = std::mem::take(&mut self.disk_queue);
        // Completions arrive in any order; a fixed order keeps metadata reproducible.
        queue.sort_by_key(|(b, _)| b.block_id());
        let mut pairs = Vec::new();
        let mut dst = Vec::new();
        let mut src = Vec::new();
        for (host_block, hash) in queue {
            if disk.contains(hash) || self.pending_keys.contains(&(TierKind::Disk, hash)) {
                continue;
            }
            let Ok(mut v) = disk.allocate(1) else { break };
            let Some(b) = v.pop() else { break };
            pairs.push((host_block.block_id(), b.block_id()));
            dst.push((b, hash));
            src.push(host_block);
            self.pending_keys.insert((TierKind::Disk, hash));
        }
        if pairs.is_empty() {
            return;
        }
        let op = self.next_op_id();
        let transfer = BlockTransfer {
            id: op,
            request_id: None,
            src: TierKind::Host,
            dst: TierKind::Disk,
            pairs,
        };
        let store = self.store_op(transfer, dst.iter().map(|(_, h)| h.0).collect());
        self.outbox.operations.push(store);
        self.track(
            op,
            None,
            Holds::Store {
                tier: TierKind::Disk,
                dst,
                src,
            },
        );
    }

    /// Turns queued host blocks into one host → remote write (each worker writes its shard).
    /// While the store is failing the queue is dropped (nothing waits on a store that is down).
    fn queue_remote_writes(&mut self) {
        let degraded = self.degraded();
        let Some(r) = self.remote.as_mut() else {
            return;
        };
        if r.queue.is_empty() {
            return;
        }
        if degraded || r.backing_off() {
            r.queue.clear();
            return;
        }
        let mut queue = std::mem::take(&mut r.queue);
        queue.sort_by_key(|(b, _)| b.block_id());
        let mut pairs = Vec::new();
        let mut keys = Vec::new();
        let mut src = Vec::new();
        let room = r.write_room();
        let mut skipped = 0u64;
        for (host_block, hash) in queue {
            if r.knows(hash) || self.pending_keys.contains(&(TierKind::Remote, hash)) {
                continue;
            }
            if src.len() >= room {
                // Dropped (its hold on the host block with it): write-behind is best effort,
                // and a later sighting may queue the block again.
                skipped += 1;
                continue;
            }
            pairs.push((host_block.block_id(), keys.len()));
            keys.push(hash);
            src.push(host_block);
            self.pending_keys.insert((TierKind::Remote, hash));
        }
        if skipped > 0 {
            r.writes_skipped(skipped);
        }
        if pairs.is_empty() {
            return;
        }
        r.writing += src.len();
        let op = self.next_op_id();
        self.outbox.operations.push(Box::new(RemoteWrite {
            transfer: BlockTransfer {
                id: op,
                request_id: None,
                src: TierKind::Host,
                dst: TierKind::Remote,
                pairs,
            },
            keys: keys.iter().map(|h| h.0).collect(),
        }));
        self.track(op, None, Holds::RemoteWrite { keys, src });
    }

    /// Counts a sighting of a host block for the remote store's admission; queues it for
    /// writing when admitted.
    pub(super) fn consider_for_remote(&mut self, block: &ImmutableBlock) {
        let pending = self
            .pending_keys
            .contains(&(TierKind::Remote, block.sequence_hash()));
        if let Some(r) = self.remote.as_mut() {
            r.consider(block.clone(), pending);
        }
    }

    /// Counts a sighting of a host block and queues it for disk when admitted.
    pub(super) fn consider_for_disk(&mut self, block: ImmutableBlock) {
        let Some(tiers) = self.tiers.as_mut() else {
            return;
        };
        let Some(disk) = tiers.disk.as_ref() else {
            return;
        };
        let hash = block.sequence_hash();
        tiers.filter.record(hash);
        if tiers.filter.admit(hash)
            && !disk.contains(hash)
            && !self.pending_keys.contains(&(TierKind::Disk, hash))
            && !self.disk_queue.iter().any(|(_, h)| *h == hash)
        {
            self.disk_queue.push((block, hash));
        }
    }
}

/// The (device, destination) pairs of one store being put together, with the destination blocks
/// it holds and their keys.
#[derive(Default)]
struct Staging {
    pairs: Vec<(usize, usize)>,
    dst: Vec<(MutableBlock, SequenceHash)>,
}

impl Staging {
    fn add(&mut self, device: usize, block: MutableBlock, hash: SequenceHash) {
        self.pairs.push((device, block.block_id()));
        self.dst.push((block, hash));
    }
}

/// One offload pass's view of a request's blocks: what decides which of them are stored.
struct BlockScan {
    /// Tokens per block.
    page_size: usize,
    /// The engine's placeholder block (one it does not keep: out of a sliding window), if any.
    placeholder: Option<usize>,
    /// Whether the adapter's stores trail compute (see [`Slot::window_skips`]).
    trailing: bool,
    /// The request's computed tokens.
    computed: usize,
    /// The first tier the blocks go to (the host, or the disk without one).
    kind: TierKind,
}

impl BlockScan {
    /// The `(device block, key)` pairs of `slot`'s blocks from `slot.offloaded` up to `full` to
    /// store, how far the scan got (it stops at a block the request has no device block or
    /// hash for yet) and how many a sliding window skipped. Placeholder blocks, blocks outside
    /// the window and keys already being stored to the tier are left out; a windowed slot's
    /// keys are noted in `window_keys`.
    fn wanted(
        &self,
        slot: &Slot,
        full: usize,
        window_keys: &mut super::groups::SeenKeys,
        pending_keys: &HashSet<(TierKind, SequenceHash), BuildSeqHasher>,
    ) -> (Vec<(usize, SequenceHash)>, usize, u64) {
        let mut wanted: Vec<(usize, SequenceHash)> = Vec::with_capacity(full - slot.offloaded);
        let mut upto = slot.offloaded;
        let mut window_skipped = 0u64;
        for i in slot.offloaded..full {
            let Some(&device) = slot.device_blocks.get(i) else {
                break;
            };
            upto = i + 1;
            if Some(device) == self.placeholder {
                // The engine keeps no block here (out of a sliding window): nothing to store.
                continue;
            }
            let Some(&hash) = slot.seq.hashes().get(i) else {
                break;
            };
            if slot.window.is_some() {
                window_keys.insert(hash);
                if slot.window_skips(i, self.page_size, self.trailing, self.computed) {
                    window_skipped += 1;
                    continue;
                }
            }
            if pending_keys.contains(&(self.kind, hash)) {
                continue;
            }
            wanted.push((device, hash));
        }
        (wanted, upto, window_skipped)
    }
}

impl Slot {
    /// Whether block `i` of a sliding-window slot is not stored: before the window no later hit
    /// reads it; with stores that trail compute (`trailing`), the engine may have freed and
    /// reused a block outside the window by the time the store reads it.
    fn window_skips(&self, i: usize, page_size: usize, trailing: bool, computed: usize) -> bool {
        !self.worth_storing(i, page_size)
            || (trailing && !self.inside_window_while_storing(i, page_size, computed))
    }
}

/// Destination blocks for the `(device block, key)` pairs `wanted`: from `pool` (the first tier)
/// while it gives any, in one call, then one at a time from `overflow` (the disk tier behind a
/// host tier) for keys it neither holds nor is storing and its admission filter lets through.
/// Each key staged is marked pending for its tier. Returns the first tier's staging, the disk's,
/// and how many blocks neither could take.
fn stage_destinations(
    pool: &BlockPool,
    overflow: Option<BlockPool>,
    filter: &mut FrequencyFilter,
    pending_keys: &mut HashSet<(TierKind, SequenceHash), BuildSeqHasher>,
    wanted: Vec<(usize, SequenceHash)>,
) -> (Staging, Staging, usize) {
    let kind = pool.kind();
    let mut first = Staging {
        pairs: Vec::with_capacity(wanted.len()),
        dst: Vec::with_capacity(wanted.len()),
    };
    let mut spill = Staging::default();
    let mut dropped = 0usize;
    // As many destination blocks as the first tier can give now, in one call.
    let mut blocks = pool.allocate_up_to(wanted.len()).into_iter();
    for (device, hash) in wanted {
        if let Some(b) = blocks.next() {
            first.add(device, b, hash);
            pending_keys.insert((kind, hash));
            continue;
        }
        let Some(disk) = overflow.as_ref() else {
            dropped += 1;
            continue;
        };
        if disk.contains(hash) || pending_keys.contains(&(TierKind::Disk, hash)) {
            continue;
        }
        filter.record(hash);
        if !filter.admit(hash) {
            dropped += 1;
            continue;
        }
        match disk.allocate(1).ok().and_then(|mut v| v.pop()) {
            Some(b) => {
                spill.add(device, b, hash);
                pending_keys.insert((TierKind::Disk, hash));
            }
            None => dropped += 1,
        }
    }
    (first, spill, dropped)
}

/// Appends the part of `tokens` (starting at request index `first`) the slot does not know yet.
/// Applies one scheduled request's news to its slot (its new tokens and device blocks); returns
/// the tokens computed after this iteration (`after`, at most the tokens known).
fn follow(slot: &mut Slot, r: &ScheduledRequest, after: usize) -> usize {
    append_tokens(
        slot,
        r.request_id.as_str(),
        &r.new_tokens,
        r.first_token_index,
    );
    if r.replace_block_ids {
        slot.device_blocks.clear();
    }
    slot.device_blocks.extend_from_slice(&r.new_block_ids);
    after.min(slot.seq.total_tokens())
}

fn append_tokens(slot: &mut Slot, id: &str, tokens: &[Token], first: Option<usize>) {
    if tokens.is_empty() {
        return;
    }
    let known = slot.seq.total_tokens();
    let first = first.unwrap_or(known);
    if first > known {
        // Tokens in between were never reported: keying these would shift every later key.
        tracing::warn!(request = %id, known, first, "gap in reported tokens; later blocks are not offloaded");
        return;
    }
    let skip = known - first;
    if let Some(rest) = tokens.get(skip..) {
        slot.seq.append(rest);
    }
}
