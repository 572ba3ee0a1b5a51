//! The leader: the scheduler-side half of the connector.
//!
//! The leader lives beside the engine's scheduler. It keeps one slot per request (its tokens and
//! their block keys, its device blocks, its lifecycle state), owns the block *accounting* of the
//! host and disk tiers (a [`BlockPool`] each; the bytes live on the workers), and decides:
//!
//! * **matches** — how many tokens beyond the device's own prefix can be loaded from host, then
//!   disk ([`Leader::get_num_new_matched_tokens`]); the matched blocks are held so they cannot be
//!   evicted before they are loaded;
//! * **loads** — once the engine allocated device blocks, which host/disk block goes into which
//!   device block ([`Leader::update_state_after_alloc`]);
//! * **stores** — every block that is full and computed is copied device → host exactly once
//!   (deduplicated by key), and host → disk when the admission filter lets it through
//!   ([`Leader::build_connector_meta`], [`Leader::request_finished`]).
//!
//! Workers report every operation's completion over the transport; the leader acts on an
//! operation only when *all* ranks reported it. A stored block becomes matchable only after its
//! store completed on every rank; a load that failed on any rank is never counted as a hit.
//!
//! Before the start-up barrier completes the leader answers "not ready": no match, nothing
//! scheduled, nothing held. It never blocks the scheduler and never panics on engine input.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::config::Config;
use crate::connector::adapter::{SchedulerAdapter, SchedulerStep};
use crate::connector::barrier::{
    initialise, leader_barrier, InitCell, InitMode, InitStatus, Readiness,
};
use crate::connector::lifecycle::{Lifecycle, RequestState};
use crate::connector::metadata::{
    BlockTransfer, ConnectorMetadata, KeyedStore, Load, OperationId, RemoteLoad, Store,
};
use crate::connector::metrics::Metrics;
use crate::connector::remote::{HostIndex, LeaderRemote};
use crate::connector::transport::{Completion, LeaderTransport, WorkerMessage};
use crate::connector::RequestId;
use crate::error::{Error, ErrorKind, Result};
use crate::identity::{BlockHasher, Salt, SequenceHash, Token, TokenSequence};
use crate::pool::{match_across, BlockPool, FrequencyFilter, ImmutableBlock, MutableBlock};
use crate::tier::TierKind;

/// A request as the leader needs to see it when matching.
#[derive(Debug, Clone, Copy)]
pub struct RequestInfo<'a> {
    /// The request.
    pub id: &'a RequestId,
    /// All its tokens so far (the prompt; after a preemption, prompt and generated tokens).
    pub tokens: &'a [Token],
    /// Its cache salt (tenant isolation), if any.
    pub cache_salt: Option<&'a str>,
    /// Its LoRA adapter's name, if any.
    pub lora_name: Option<&'a str>,
}

/// The answer to a match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MatchResult {
    /// Tokens beyond the device's prefix that can be loaded.
    pub external_tokens: usize,
    /// Whether they load asynchronously (always, when there are any).
    pub load_async: bool,
    /// Of `external_tokens`, those held in the host tier.
    pub host_tokens: usize,
    /// Of `external_tokens`, those held in the disk tier.
    pub disk_tokens: usize,
    /// Of `external_tokens`, those in another instance's host tier (the remote tier; only with
    /// `remote.dir` set).
    pub remote_tokens: usize,
}

impl MatchResult {
    /// Nothing to load.
    pub const NONE: MatchResult = MatchResult {
        external_tokens: 0,
        load_async: false,
        host_tokens: 0,
        disk_tokens: 0,
        remote_tokens: 0,
    };
}

/// Where the leader's start-up stands.
#[derive(Debug, Clone)]
pub enum LeaderStatus {
    /// The barrier is still running: calls answer "not ready".
    NotReady,
    /// Ready, with what the barrier agreed.
    Ready(Readiness),
    /// The barrier failed; calls answer "not ready" and this is why.
    Failed(Error),
}

/// Matched blocks held for a request until the engine allocates device blocks for them.
#[derive(Debug)]
struct Staged {
    /// Index of the first matched block in the request.
    start: usize,
    host: Vec<ImmutableBlock>,
    disk: Vec<ImmutableBlock>,
    /// Remote blocks after the disk ones: `(key, the peer's host block)`, all of `remote_peer`.
    remote: Vec<(SequenceHash, usize)>,
    remote_peer: Option<Arc<str>>,
}

impl Staged {
    fn blocks(&self) -> usize {
        self.host.len() + self.disk.len() + self.remote.len()
    }
}

#[derive(Debug)]
struct Slot {
    life: Lifecycle,
    seq: TokenSequence,
    prompt_len: usize,
    device_blocks: Vec<usize>,
    computed: usize,
    /// Blocks below this index have been considered for offload.
    offloaded: usize,
    staged: Option<Staged>,
    loads_in_flight: usize,
    stores_in_flight: usize,
}

/// What an operation holds until every rank has completed it.
#[derive(Debug)]
enum Holds {
    Load {
        tier: TierKind,
        src: Vec<ImmutableBlock>,
        /// The device block each source block goes to (same order).
        dst: Vec<usize>,
    },
    /// A load from another instance's host tier: nothing held here (the peer owns the blocks).
    Remote {
        keys: Vec<SequenceHash>,
        dst: Vec<usize>,
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
        }
    }
}

#[derive(Debug)]
struct OpTrack {
    request: Option<RequestId>,
    acked: Vec<bool>,
    failed: HashSet<usize>,
    holds: Holds,
}

struct Tiers {
    readiness: Readiness,
    host: Option<BlockPool>,
    disk: Option<BlockPool>,
    filter: FrequencyFilter,
}

/// Work queued for the next metadata.
#[derive(Debug, Default)]
struct Outbox {
    new_slots: Vec<RequestId>,
    operations: Vec<Box<dyn crate::connector::metadata::Operation>>,
    hold: Vec<RequestId>,
    finished: Vec<RequestId>,
}

/// The scheduler-side connector, generic over how the engine describes an iteration.
pub struct Leader<A: SchedulerAdapter> {
    adapter: A,
    config: Config,
    page_size: usize,
    transport: Arc<dyn LeaderTransport>,
    init: Arc<InitCell<Readiness>>,
    tiers: Option<Tiers>,
    slots: HashMap<RequestId, Slot>,
    ops: HashMap<OperationId, OpTrack>,
    outbox: Outbox,
    /// Host blocks waiting to be copied down to disk.
    disk_queue: Vec<(ImmutableBlock, SequenceHash)>,
    /// Keys with a store in flight, per destination tier (no second copy of the same block).
    pending_keys: HashSet<(TierKind, SequenceHash)>,
    iteration: u64,
    next_op: u64,
    metrics: Arc<Metrics>,
    failure_logged: bool,
    last_match: MatchResult,
    /// Ranks whose connection was lost. While any is dead the leader is degraded: it matches
    /// nothing and stores nothing, and operations count as failed on the dead ranks.
    dead: Vec<bool>,
    /// The remote (G4) tier's discovery, when `remote.dir` is set.
    remote: Option<LeaderRemote>,
}

impl<A: SchedulerAdapter> std::fmt::Debug for Leader<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leader")
            .field("adapter", &self.adapter.name())
            .field("page_size", &self.page_size)
            .field("slots", &self.slots.len())
            .field("ops_in_flight", &self.ops.len())
            .field("iteration", &self.iteration)
            .finish_non_exhaustive()
    }
}

impl<A: SchedulerAdapter> Leader<A> {
    /// Creates the leader and starts the barrier (inline for [`InitMode::Blocking`], which then
    /// fails if the barrier fails; on a background thread for [`InitMode::NonBlocking`]).
    pub fn new(
        adapter: A,
        config: Config,
        page_size: usize,
        transport: Arc<dyn LeaderTransport>,
        mode: InitMode,
    ) -> Result<Self> {
        if page_size == 0 {
            return Err(Error::invalid_argument("page_size must be at least 1"));
        }
        config.validate()?;
        let (t, c) = (transport.clone(), config.clone());
        let timeout = config.init_timeout();
        let init = initialise(mode, "kvbm-leader-init", move || {
            leader_barrier(t.as_ref(), &c, Some(page_size), timeout)
        })?;
        let mut leader = Self {
            adapter,
            config,
            page_size,
            transport,
            init,
            tiers: None,
            slots: HashMap::new(),
            ops: HashMap::new(),
            outbox: Outbox::default(),
            disk_queue: Vec::new(),
            pending_keys: HashSet::new(),
            iteration: 0,
            next_op: 0,
            metrics: Arc::new(Metrics::new()),
            failure_logged: false,
            last_match: MatchResult::NONE,
            dead: Vec::new(),
            remote: None,
        };
        leader.remote = LeaderRemote::new(&leader.config.remote);
        if !leader.ensure_ready() && mode == InitMode::Blocking {
            if let LeaderStatus::Failed(e) = leader.status() {
                return Err(e);
            }
        }
        Ok(leader)
    }

    /// The adapter.
    pub fn adapter(&self) -> &A {
        &self.adapter
    }

    /// The adapter, mutably (for adapters that keep state of their own).
    pub fn adapter_mut(&mut self) -> &mut A {
        &mut self.adapter
    }

    /// Tokens per block.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// The answer of the most recent successful match (with its host/disk split); adapters whose
    /// engine API returns only a count use this for reporting.
    pub fn last_match(&self) -> MatchResult {
        self.last_match
    }

    /// The counters (share the `Arc` with an exporter).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Where start-up stands.
    pub fn status(&self) -> LeaderStatus {
        match self.init.status() {
            InitStatus::Pending => LeaderStatus::NotReady,
            InitStatus::Ready(r) => LeaderStatus::Ready(r.clone()),
            InitStatus::Failed(e) => LeaderStatus::Failed(e.clone()),
        }
    }

    /// True once the barrier completed.
    pub fn is_ready(&mut self) -> bool {
        self.ensure_ready()
    }

    /// Requests the leader is tracking.
    pub fn num_slots(&self) -> usize {
        self.slots.len()
    }

    /// Operations sent (or queued) and not yet completed by every rank.
    pub fn num_operations_in_flight(&self) -> usize {
        self.ops.len()
    }

    /// True while anything is still to do: operations in flight, host blocks waiting to be
    /// copied to disk, or work queued for the next metadata. An idle engine keeps building
    /// (empty) iterations until this is false.
    pub fn has_pending_work(&self) -> bool {
        !self.ops.is_empty()
            || !self.disk_queue.is_empty()
            || !self.outbox.operations.is_empty()
            || !self.outbox.hold.is_empty()
    }

    /// Ranks whose connection was lost (the leader is degraded while any is listed).
    pub fn dead_ranks(&self) -> Vec<usize> {
        self.dead
            .iter()
            .enumerate()
            .filter(|(_, d)| **d)
            .map(|(r, _)| r)
            .collect()
    }

    fn degraded(&self) -> bool {
        self.dead.iter().any(|d| *d)
    }

    /// The lifecycle state of a request, if tracked.
    pub fn request_state(&self, id: &RequestId) -> Option<RequestState> {
        self.slots.get(id).map(|s| s.life.state())
    }

    /// Host and disk pool statistics, once ready.
    pub fn pool_stats(
        &self,
    ) -> Option<(
        Option<crate::pool::PoolStats>,
        Option<crate::pool::PoolStats>,
    )> {
        self.tiers.as_ref().map(|t| {
            (
                t.host.as_ref().map(BlockPool::stats),
                t.disk.as_ref().map(BlockPool::stats),
            )
        })
    }

    fn ensure_ready(&mut self) -> bool {
        if self.tiers.is_some() {
            return true;
        }
        match self.init.status() {
            InitStatus::Pending => false,
            InitStatus::Failed(e) => {
                if !self.failure_logged {
                    tracing::error!(error = %e, "kvbm leader start-up failed; answering not ready");
                    self.failure_logged = true;
                }
                false
            }
            InitStatus::Ready(r) => {
                let r = r.clone();
                match self.build_tiers(r) {
                    Ok(t) => {
                        self.tiers = Some(t);
                        true
                    }
                    Err(e) => {
                        if !self.failure_logged {
                            tracing::error!(error = %e, "kvbm leader cannot build its pools");
                            self.failure_logged = true;
                        }
                        false
                    }
                }
            }
        }
    }

    fn build_tiers(&self, readiness: Readiness) -> Result<Tiers> {
        if readiness.dims.page_size != self.page_size {
            return Err(Error::invalid_layout(format!(
                "the leader keys blocks of {} tokens but the workers' blocks hold {}",
                self.page_size, readiness.dims.page_size
            )));
        }
        let pool = |kind, n: usize| -> Result<Option<BlockPool>> {
            if n == 0 {
                Ok(None)
            } else {
                BlockPool::new(kind, n).map(Some)
            }
        };
        let host = pool(TierKind::Host, readiness.counts.num_host_blocks)?;
        let disk = pool(TierKind::Disk, readiness.counts.num_disk_blocks)?;
        // The filter remembers a few times more keys than the disk holds, at least 1024.
        let capacity = readiness.counts.num_disk_blocks.saturating_mul(4).max(1024);
        let filter = FrequencyFilter::new(self.config.disk.min_frequency, capacity)?;
        Ok(Tiers {
            readiness,
            host,
            disk,
            filter,
        })
    }

    fn next_op_id(&mut self) -> OperationId {
        self.next_op += 1;
        OperationId(self.next_op)
    }

    // --------------------------------------------------------------------------------------------
    // Scheduler calls
    // --------------------------------------------------------------------------------------------

    /// How many tokens beyond `num_computed_tokens` (what the device already has) can be loaded
    /// from host and disk. The matched blocks are held until [`Leader::update_state_after_alloc`]
    /// or a later call replaces them. Not ready, nothing matched, or an unaligned
    /// `num_computed_tokens`: [`MatchResult::NONE`].
    ///
    /// A request seen again while prefilling or decoding was preempted and is being re-admitted.
    pub fn get_num_new_matched_tokens(
        &mut self,
        request: RequestInfo<'_>,
        num_computed_tokens: usize,
    ) -> Result<MatchResult> {
        let _span = tracing::debug_span!("kvbm.leader.match", request = %request.id).entered();
        self.last_match = MatchResult::NONE;
        self.poll_completions();
        if !self.ensure_ready() {
            return Ok(MatchResult::NONE);
        }
        let bs = self.page_size;
        let algorithm = self.config.hash;
        let slot = match self.slots.get_mut(request.id) {
            Some(s) => s,
            None => {
                let salt = Salt::new(algorithm, request.cache_salt, request.lora_name);
                let mut seq = TokenSequence::new(BlockHasher::new(algorithm, salt), bs)?;
                seq.append(request.tokens);
                self.outbox.new_slots.push(request.id.clone());
                self.slots.entry(request.id.clone()).or_insert(Slot {
                    life: Lifecycle::new(request.id.clone()),
                    seq,
                    prompt_len: request.tokens.len(),
                    device_blocks: Vec::new(),
                    computed: 0,
                    offloaded: 0,
                    staged: None,
                    loads_in_flight: 0,
                    stores_in_flight: 0,
                })
            }
        };
        if slot.life.state() == RequestState::Onboarding && slot.loads_in_flight > 0 {
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!(
                    "request {}: matched again while its loads are in flight",
                    request.id
                ),
            )
            .with("request", request.id)
            .with("state", RequestState::Onboarding));
        }
        if matches!(
            slot.life.state(),
            RequestState::Prefilling | RequestState::Decoding
        ) {
            // Re-admitted: the engine preempted it and freed its device blocks.
            slot.life.preempt()?;
            slot.device_blocks.clear();
        }
        let known = slot.seq.total_tokens();
        if request.tokens.len() > known {
            slot.seq.append(&request.tokens[known..]);
        }
        slot.staged = None;
        let n = slot.seq.total_tokens();
        let aligned = num_computed_tokens % bs == 0;
        let start = num_computed_tokens / bs;
        // The engine must compute at least one token: never match the block holding the last one.
        let limit = n.saturating_sub(1) / bs;
        let Some(tiers) = self.tiers.as_ref() else {
            return Ok(MatchResult::NONE);
        };
        let mut staged = None;
        if aligned && start < limit && !self.dead.iter().any(|d| *d) {
            let hashes = &slot.seq.hashes()[start..limit.min(slot.seq.num_full_blocks())];
            let pools: Vec<&BlockPool> = tiers.host.iter().chain(tiers.disk.iter()).collect();
            let m = match_across(&pools, hashes);
            let mut host = Vec::new();
            let mut disk = Vec::new();
            for (kind, blocks) in m.per_tier {
                match kind {
                    TierKind::Host => host = blocks,
                    TierKind::Disk => disk = blocks,
                    _ => {}
                }
            }
            // The remote tier continues where host and disk stopped, from one peer.
            let mut remote = Vec::new();
            let mut remote_peer: Option<Arc<str>> = None;
            if let Some(r) = &self.remote {
                for &hash in hashes.iter().skip(host.len() + disk.len()) {
                    let Some((peer, block)) = r.index.get(&hash) else {
                        break;
                    };
                    if remote_peer.as_ref().is_some_and(|p| p != peer) {
                        break;
                    }
                    remote_peer.get_or_insert_with(|| peer.clone());
                    remote.push((hash, *block));
                }
            }
            if !host.is_empty() || !disk.is_empty() || !remote.is_empty() {
                staged = Some(Staged {
                    start,
                    host,
                    disk,
                    remote,
                    remote_peer,
                });
            }
        }
        let matched_blocks = staged.as_ref().map_or(0, Staged::blocks);
        self.metrics
            .record_lookup(n as u64, (matched_blocks * bs) as u64);
        if matched_blocks == 0 {
            slot.life.unstage()?;
            return Ok(MatchResult::NONE);
        }
        slot.life.stage_onboard()?;
        let (host_blocks, disk_blocks, remote_blocks) = staged
            .as_ref()
            .map_or((0, 0, 0), |s| (s.host.len(), s.disk.len(), s.remote.len()));
        slot.staged = staged;
        let m = MatchResult {
            external_tokens: matched_blocks * bs,
            load_async: true,
            host_tokens: host_blocks * bs,
            disk_tokens: disk_blocks * bs,
            remote_tokens: remote_blocks * bs,
        };
        self.last_match = m;
        Ok(m)
    }

    /// The engine allocated `block_ids` (the request's whole device block list) and will load
    /// `num_external_tokens` tokens. With a non-zero count the staged blocks are mapped onto the
    /// device blocks and the loads are scheduled in the next metadata; with zero the staging is
    /// dropped (the engine chose not to load, or it is the second call after a finished load).
    pub fn update_state_after_alloc(
        &mut self,
        id: &RequestId,
        block_ids: &[usize],
        num_external_tokens: usize,
    ) -> Result<()> {
        let _span = tracing::debug_span!("kvbm.leader.alloc", request = %id).entered();
        if !self.ensure_ready() {
            return Ok(());
        }
        let bs = self.page_size;
        let num_device = self
            .tiers
            .as_ref()
            .map_or(0, |t| t.readiness.counts.num_device_blocks);
        let Some(slot) = self.slots.get_mut(id) else {
            return Err(unknown_request("update_state_after_alloc", id));
        };
        if let Some(&bad) = block_ids.iter().find(|&&b| b >= num_device) {
            return Err(Error::out_of_range("device block", bad, num_device)
                .with("request", id)
                .with("op", "update_state_after_alloc"));
        }
        if !slot.life.is_finishing() {
            slot.device_blocks.clear();
            slot.device_blocks.extend_from_slice(block_ids);
        }
        if num_external_tokens == 0 {
            if slot.staged.take().is_some() {
                slot.life.unstage()?;
            }
            return Ok(());
        }
        let Some(staged) = slot.staged.as_ref() else {
            return Err(Error::invalid_argument(format!(
                "request {id}: the engine asks to load {num_external_tokens} tokens but none are staged"
            ))
            .with("request", id));
        };
        if num_external_tokens != staged.blocks() * bs {
            return Err(Error::invalid_argument(format!(
                "request {id}: the engine asks to load {num_external_tokens} tokens but {} were matched",
                staged.blocks() * bs
            ))
            .with("request", id));
        }
        let needed = staged.start + staged.blocks();
        if block_ids.len() < needed {
            return Err(Error::invalid_argument(format!(
                "request {id}: {} device blocks allocated but the load needs {needed}",
                block_ids.len()
            ))
            .with("request", id));
        }
        slot.life.start_onboard()?;
        let Some(staged) = slot.staged.take() else {
            return Err(Error::internal("staging vanished"));
        };
        let host_pairs: Vec<(usize, usize)> = staged
            .host
            .iter()
            .enumerate()
            .map(|(k, b)| (b.block_id(), block_ids[staged.start + k]))
            .collect();
        let disk_start = staged.start + staged.host.len();
        let disk_pairs: Vec<(usize, usize)> = staged
            .disk
            .iter()
            .enumerate()
            .map(|(k, b)| (b.block_id(), block_ids[disk_start + k]))
            .collect();
        let remote_start = disk_start + staged.disk.len();
        let remote_pairs: Vec<(usize, usize)> = staged
            .remote
            .iter()
            .enumerate()
            .map(|(k, (_, b))| (*b, block_ids[remote_start + k]))
            .collect();
        let remote_keys: Vec<SequenceHash> = staged.remote.iter().map(|(h, _)| *h).collect();
        let remote_peer = staged.remote_peer.clone();
        let mut loads = Vec::new();
        for (tier, pairs, src) in [
            (TierKind::Host, host_pairs, staged.host),
            (TierKind::Disk, disk_pairs, staged.disk),
        ] {
            if !pairs.is_empty() {
                loads.push((tier, pairs, src));
            }
        }
        for (tier, pairs, src) in loads {
            let op = self.next_op_id();
            let dst: Vec<usize> = pairs.iter().map(|p| p.1).collect();
            let transfer = BlockTransfer {
                id: op,
                request_id: Some(id.clone()),
                src: tier,
                dst: TierKind::Device,
                pairs,
            };
            self.outbox.operations.push(Box::new(Load(transfer)));
            self.track(op, Some(id.clone()), Holds::Load { tier, src, dst });
            if let Some(slot) = self.slots.get_mut(id) {
                slot.loads_in_flight += 1;
            }
        }
        if let (false, Some(peer)) = (remote_pairs.is_empty(), remote_peer) {
            let op = self.next_op_id();
            let dst: Vec<usize> = remote_pairs.iter().map(|p| p.1).collect();
            self.outbox.operations.push(Box::new(RemoteLoad {
                transfer: BlockTransfer {
                    id: op,
                    request_id: Some(id.clone()),
                    src: TierKind::Remote,
                    dst: TierKind::Device,
                    pairs: remote_pairs,
                },
                instance: peer.to_string(),
                keys: remote_keys.iter().map(|h| h.0).collect(),
            }));
            self.track(
                op,
                Some(id.clone()),
                Holds::Remote {
                    keys: remote_keys,
                    dst,
                },
            );
            if let Some(slot) = self.slots.get_mut(id) {
                slot.loads_in_flight += 1;
            }
        }
        Ok(())
    }

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
            self.iteration += 1;
            let mut meta = ConnectorMetadata::empty(self.iteration);
            self.adapter.extend_metadata(&mut meta)?;
            return Ok(meta);
        }
        let num_device = self
            .tiers
            .as_ref()
            .map_or(0, |t| t.readiness.counts.num_device_blocks);
        // Check everything first.
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
            if let Some(&bad) = r.new_block_ids.iter().find(|&&b| b >= num_device) {
                return Err(Error::out_of_range("device block", bad, num_device)
                    .with("request", &r.request_id)
                    .with("op", "build_connector_meta"));
            }
            computed_after.push(self.adapter.computed_after(r)?);
        }
        for p in &step.preempted {
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
        self.iteration += 1;
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
            append_tokens(slot, &r.request_id, &r.new_tokens, r.first_token_index);
            if r.replace_block_ids {
                slot.device_blocks.clear();
            }
            slot.device_blocks.extend_from_slice(&r.new_block_ids);
            let computed = after.min(slot.seq.total_tokens());
            slot.life.schedule(computed >= slot.prompt_len)?;
            slot.computed = slot.computed.max(computed);
            let id = r.request_id.clone();
            self.offload(&id, computed);
        }
        self.queue_disk_offloads();
        self.remote_publish_and_refresh();
        let mut meta = ConnectorMetadata::empty(self.iteration);
        meta.remote_instance = self.remote.as_ref().map(|r| r.instance.clone());
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
            self.outbox.hold.push(id.clone());
            Ok(true)
        } else {
            self.slots.remove(id);
            self.outbox.finished.push(id.clone());
            Ok(false)
        }
    }

    // --------------------------------------------------------------------------------------------
    // Internals
    // --------------------------------------------------------------------------------------------

    fn track(&mut self, op: OperationId, request: Option<RequestId>, holds: Holds) {
        let world = self.transport.world_size();
        let mut track = OpTrack {
            request,
            acked: vec![false; world],
            failed: HashSet::new(),
            holds,
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
        tracing::error!(rank, reason = %why, "kvbm leader lost a worker; matching and storing stop");
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

    /// Schedules device → host (or device → disk without a host tier) stores for every full block
    /// of `id` below `computed` tokens not considered before.
    fn offload(&mut self, id: &RequestId, computed: usize) {
        let bs = self.page_size;
        let Some(tiers) = self.tiers.as_ref() else {
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
        let mut wanted: Vec<(usize, SequenceHash)> = Vec::new();
        let mut upto = slot.offloaded;
        for i in slot.offloaded..full {
            let Some(&device) = slot.device_blocks.get(i) else {
                break;
            };
            upto = i + 1;
            let Some(&hash) = slot.seq.hashes().get(i) else {
                break;
            };
            if pool.contains(hash) || self.pending_keys.contains(&(kind, hash)) {
                continue;
            }
            wanted.push((device, hash));
        }
        slot.offloaded = upto;
        if wanted.is_empty() {
            return;
        }
        // Take as many destination blocks as can be had; the rest are simply not stored.
        let mut dst = Vec::with_capacity(wanted.len());
        let mut pairs = Vec::with_capacity(wanted.len());
        for (device, hash) in wanted {
            match pool.allocate(1) {
                Ok(mut v) => {
                    if let Some(b) = v.pop() {
                        pairs.push((device, b.block_id()));
                        dst.push((b, hash));
                        self.pending_keys.insert((kind, hash));
                    }
                }
                Err(_) => break,
            }
        }
        if pairs.is_empty() {
            return;
        }
        slot.stores_in_flight += 1;
        let op = self.next_op_id();
        let transfer = BlockTransfer {
            id: op,
            request_id: Some(id.clone()),
            src: TierKind::Device,
            dst: kind,
            pairs,
        };
        if self.remote.is_some() && kind == TierKind::Host {
            // The workers publish each block's key once written (remote readers verify it).
            let keys = dst.iter().map(|(_, h)| h.0).collect();
            self.outbox
                .operations
                .push(Box::new(KeyedStore { transfer, keys }));
        } else {
            self.outbox.operations.push(Box::new(Store(transfer)));
        }
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
        self.outbox.operations.push(Box::new(Store(BlockTransfer {
            id: op,
            request_id: None,
            src: TierKind::Host,
            dst: TierKind::Disk,
            pairs,
        })));
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

    /// Applies the completions workers reported since the last call (every leader call does this
    /// first; an idle engine may call it to let stored blocks become matchable sooner).
    pub fn process_completions(&mut self) {
        self.poll_completions();
    }

    /// Drains worker messages and completes operations every rank has reported. Before the
    /// barrier completed the barrier owns the transport: nothing is drained here.
    fn poll_completions(&mut self) {
        if !self.ensure_ready() {
            return;
        }
        // Completions that arrived together are applied in operation order, not arrival order:
        // the order stored blocks join the host pool's LRU then does not depend on which copy
        // happened to finish first, and a replay is reproducible.
        let mut batch: Vec<(usize, Completion)> = Vec::new();
        loop {
            match self.transport.try_recv() {
                Ok(Some((rank, WorkerMessage::Completed(list)))) => {
                    batch.extend(list.into_iter().map(|c| (rank, c)));
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

    fn finish_op(&mut self, track: OpTrack) {
        let bs = self.page_size as u64;
        let bpb = self
            .tiers
            .as_ref()
            .map_or(0, |t| t.readiness.total_bytes_per_block()) as u64;
        let ok_all = track.failed.is_empty();
        self.metrics.record_operation_completed(ok_all);
        match track.holds {
            Holds::Remote { keys, dst } => {
                let total = keys.len() as u64;
                let failed = (track.failed.len() as u64).min(total);
                let ok = total - failed;
                if failed > 0 {
                    // Stale: the peer evicted or rewrote it. No later match tries it again
                    // until the peer publishes it anew.
                    if let Some(r) = self.remote.as_mut() {
                        for (k, d) in keys.iter().zip(&dst) {
                            if track.failed.contains(d) {
                                r.index.remove(k);
                            }
                        }
                    }
                    tracing::debug!(failed, "remote blocks failed verification or transfer");
                }
                self.metrics.record_hit(TierKind::Remote, ok * bs);
                self.metrics
                    .record_transfer(TierKind::Remote, TierKind::Device, ok, ok * bpb);
                if failed > 0 {
                    self.metrics.record_load_error(failed);
                }
                self.request_op_done(track.request.as_ref(), true);
            }
            Holds::Load { tier, src, dst } => {
                let total = src.len() as u64;
                let failed = (track.failed.len() as u64).min(total);
                let ok = total - failed;
                // A block that failed to load (e.g. its checksum) is withdrawn: no later match
                // may serve it, and a recomputed copy can be stored under its key again.
                if failed > 0 {
                    let pool = self.tiers.as_ref().and_then(|t| match tier {
                        TierKind::Host => t.host.clone(),
                        TierKind::Disk => t.disk.clone(),
                        _ => None,
                    });
                    for (b, d) in src.iter().zip(&dst) {
                        if track.failed.contains(d) {
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
                        self.consider_for_disk(b);
                    }
                }
                self.request_op_done(track.request.as_ref(), true);
            }
            Holds::Store { tier, dst, src } => {
                let src_tier = if src.is_empty() {
                    TierKind::Device
                } else {
                    TierKind::Host
                };
                let mut stored = 0u64;
                for (block, hash) in dst {
                    self.pending_keys.remove(&(tier, hash));
                    if track.failed.contains(&block.block_id()) {
                        continue; // dropped: back to the free list, never matchable
                    }
                    let pool = self.tiers.as_ref().and_then(|t| match tier {
                        TierKind::Host => t.host.clone(),
                        TierKind::Disk => t.disk.clone(),
                        _ => None,
                    });
                    let Some(pool) = pool else { continue };
                    match pool.register(block, hash) {
                        Ok(registered) => {
                            stored += 1;
                            if tier == TierKind::Host {
                                self.consider_for_disk(registered);
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, "cannot register a stored block"),
                    }
                }
                self.metrics
                    .record_transfer(src_tier, tier, stored, stored * bpb);
                drop(src);
                self.request_op_done(track.request.as_ref(), false);
            }
        }
    }

    /// Remote tier on: every `remote.publish_every` iterations, writes this instance's host index
    /// and re-reads the peers' (skipping those whose sharding, block size or hash differ).
    fn remote_publish_and_refresh(&mut self) {
        let iteration = self.iteration;
        let (Some(remote), Some(tiers)) = (self.remote.as_mut(), self.tiers.as_ref()) else {
            return;
        };
        if !remote.due(iteration) {
            return;
        }
        remote.last = Some(iteration);
        let own = HostIndex {
            instance: remote.instance.clone(),
            world_size: self.transport.world_size(),
            page_size: self.page_size,
            bytes_per_block: tiers.readiness.total_bytes_per_block(),
            hash: self.config.hash,
            blocks: tiers
                .host
                .as_ref()
                .map(|p| p.registered().into_iter().map(|(h, b)| (h.0, b)).collect())
                .unwrap_or_default(),
        };
        if let Err(e) = remote.publish(&own) {
            tracing::warn!(error = %e, "cannot publish the host index");
        }
        remote.refresh(|peer| {
            peer.world_size == own.world_size
                && peer.page_size == own.page_size
                && peer.bytes_per_block == own.bytes_per_block
                && peer.hash == own.hash
        });
    }

    /// Counts a sighting of a host block and queues it for disk when admitted.
    fn consider_for_disk(&mut self, block: ImmutableBlock) {
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
            self.slots.remove(id);
        }
    }

    /// Total bytes of one block over all ranks, once ready.
    pub fn bytes_per_block(&self) -> Option<usize> {
        self.tiers
            .as_ref()
            .map(|t| t.readiness.total_bytes_per_block())
    }

    /// Whether an error is the "not ready" kind.
    pub fn is_not_ready(e: &Error) -> bool {
        e.kind() == ErrorKind::NotReady
    }
}

/// Appends the part of `tokens` (starting at request index `first`) the slot does not know yet.
fn append_tokens(slot: &mut Slot, id: &RequestId, tokens: &[Token], first: Option<usize>) {
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

fn unknown_request(op: &'static str, id: &RequestId) -> Error {
    Error::new(
        ErrorKind::NotFound,
        format!("{op}: unknown request id {id}"),
    )
    .with("op", op)
    .with("request", id)
}
