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
//!
//! The work is split by what it decides; each part is an `impl` block of [`Leader`] over the
//! same state:
//!
//! * `matching` — matches and the loads that follow an allocation;
//! * `offload` — the iteration's metadata, device → host stores, host → disk copies, the disk
//!   admission filter, finished requests and the remote tier's index;
//! * `completion` — operations in flight until every rank reported them, and what a completed
//!   (or failed, or orphaned by a lost rank) operation changes.
//!
//! This file holds the state they share and the start-up. Invariants of the state: every
//! operation in `ops` holds the local pool blocks it reads or writes until it is finished; a key is in
//! `pending_keys` exactly while a store of it to that tier is in flight; a slot leaves `slots`
//! only once it is finishing with nothing in flight (or was never ready).

mod completion;
mod events;
mod groups;
mod matching;
mod offload;
mod remote;

pub use events::{BlockEvents, StoreSubmitted, TierEvent};

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::config::Config;
use crate::connector::adapter::{Engine, SchedulerAdapter};
use crate::connector::barrier::{
    initialise, leader_barrier, InitCell, InitMode, InitStatus, Readiness,
};
use crate::connector::lifecycle::{Lifecycle, RequestState};
use crate::connector::metadata::OperationId;
use crate::connector::metrics::Metrics;
use crate::connector::remote::RemoteScope;
use crate::connector::transport::LeaderTransport;
use crate::connector::worker::TierFactory;
use crate::connector::RequestId;
use crate::error::{Error, ErrorKind, Result};
use crate::identity::{SequenceHash, Token, TokenSequence};
use crate::pool::{BlockPool, BuildSeqHasher, FrequencyFilter, ImmutableBlock};
use crate::tier::TierKind;

use completion::OpTrack;
use matching::Staged;

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

impl<'a> RequestInfo<'a> {
    /// A request with no cache salt and no LoRA adapter (salt 0: the keys every such request
    /// shares).
    pub fn new(id: &'a RequestId, tokens: &'a [Token]) -> Self {
        Self {
            id,
            tokens,
            cache_salt: None,
            lora_name: None,
        }
    }
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
    /// Of `external_tokens`, those in the remote (G4) store (only with `remote.url` set).
    pub remote_tokens: usize,
    /// The answer is not known yet (a remote lookup is running): the engine asks again later
    /// (vLLM: `None`). Only for engines with
    /// [`Engine::DEFERRED_MATCH`]; nothing is
    /// staged meanwhile.
    pub pending: bool,
}

impl MatchResult {
    /// Nothing to load.
    pub const NONE: MatchResult = MatchResult {
        external_tokens: 0,
        load_async: false,
        host_tokens: 0,
        disk_tokens: 0,
        remote_tokens: 0,
        pending: false,
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

/// One request the leader tracks, from its first match until its work drained.
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
    /// When `request_finished` answered true (the engine keeps the request's device blocks
    /// until its operations end): the hold is counted in the metrics when they do.
    held_since: Option<std::time::Instant>,
    /// A sliding-window group: the blocks before a hit it needs (see `groups`); `None`: every
    /// block (full attention).
    window: Option<usize>,
    /// That group's window in tokens.
    window_tokens: Option<usize>,
    /// Block indices where a later hit is expected to end (an earlier request's prefix ended
    /// there), besides the prompt's end: a windowed slot stores the window before each.
    window_ends: Vec<usize>,
}

impl Slot {
    /// Whether block `i` is one a later hit can use: every block of a full-attention slot; of a
    /// sliding-window slot, those in the window before the end of its prompt or after it, and
    /// those in the window before a marked end.
    fn worth_storing(&self, i: usize, page_size: usize) -> bool {
        let Some(w) = self.window else {
            return true;
        };
        let prompt_end = self.prompt_len.saturating_sub(1) / page_size.max(1);
        i + w >= prompt_end || self.window_ends.iter().any(|&e| i < e && i + w >= e)
    }

    /// Whether block `i` is still inside the window when the request has computed as many tokens
    /// as it can in the iteration whose stores read it, when stores trail the compute
    /// ([`SchedulerAdapter::stores_trail_compute`]), `computed` tokens being computed before that
    /// iteration: a prompt chunk ends at the prompt's end at most, a generation step adds one
    /// token (speculative decoding's extra tokens are not counted). An engine frees the blocks
    /// wholly before the window of the next token, `computed - W + 1` tokens (vLLM's skipped
    /// tokens; exact, not the window's block count, whose alignment varies). Any block of a
    /// full-attention slot.
    fn inside_window_while_storing(&self, i: usize, page_size: usize, computed: usize) -> bool {
        let Some(w) = self.window_tokens else {
            return true;
        };
        let reach = if computed < self.prompt_len {
            self.prompt_len
        } else {
            computed + 1
        };
        i >= (reach + 1).saturating_sub(w) / page_size.max(1)
    }
}

/// The host and disk block accounting, built once the barrier agreed on the counts.
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
    pending_keys: HashSet<(TierKind, SequenceHash), BuildSeqHasher>,
    iteration: u64,
    next_op: u64,
    metrics: Arc<Metrics>,
    /// The HTTP endpoint of `metrics` (`tcp.metrics_addr`); stopped with the leader.
    metrics_server: Option<crate::metrics_server::MetricsServer>,
    failure_logged: bool,
    /// Rate-limits the warning about failed stores (see `completion`).
    store_warn: crate::connector::metrics::WarnLimiter,
    last_match: MatchResult,
    /// Ranks whose connection was lost. While any is dead the leader is degraded: it matches
    /// nothing and stores nothing, and operations count as failed on the dead ranks.
    dead: Vec<bool>,
    /// The remote (G4) store, when `remote.url` is set and the tier factory provides one.
    remote: Option<remote::LeaderStore>,
    /// Builds the remote store once the barrier completed (see [`Leader::set_tier_factory`]).
    factory: Option<Arc<dyn TierFactory>>,
    /// Whether building the remote store was attempted.
    remote_tried: bool,
    /// The engine accepts "ask again later" from a match (see [`MatchResult::pending`]).
    deferred_match: bool,
    /// [`Engine::PLACEHOLDER_BLOCK`]: never a transfer source or destination.
    placeholder: Option<usize>,
    /// Whether a match counts in the lookup metrics (see `get_num_new_matched_tokens_uncounted`).
    count_lookups: bool,
    /// The last remote-store counters each rank reported ([`WorkerMessage::StoreStats`]).
    ///
    /// [`WorkerMessage::StoreStats`]: crate::connector::transport::WorkerMessage::StoreStats
    rank_store_stats: HashMap<usize, crate::connector::remote::RemoteStoreStats>,
    /// Keys sliding-window slots computed, stored or not (bounded): where a later request's
    /// windowed match finds its prefix here but no window, the prefix's end is marked for storing.
    window_keys: groups::SeenKeys,
    /// Block events for the engine to announce, when recorded ([`Leader::record_block_events`]).
    events: Option<events::EventLog>,
    /// Counts [`Leader::clear_tiers`] calls: a store submitted in an earlier epoch is not
    /// registered when it completes.
    cache_epoch: u64,
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
    /// Creates the leader of engine `E` and starts the barrier as `E::LeaderInit` says: inline
    /// for [`Blocking`](crate::connector::Blocking), which then fails if the barrier fails; on a
    /// background thread for [`NonBlocking`](crate::connector::NonBlocking).
    pub fn new<E: Engine<Adapter = A>>(
        adapter: A,
        config: Config,
        page_size: usize,
        transport: Arc<dyn LeaderTransport>,
    ) -> Result<Self> {
        if page_size == 0 {
            return Err(Error::invalid_argument("page_size must be at least 1"));
        }
        config.validate()?;
        let (t, c) = (transport.clone(), config.clone());
        let timeout = config.init_timeout();
        // The outcome is recorded before the workers hear the leader is ready (barrier step 3).
        let init = initialise(E::LeaderInit::BLOCKING, "kvbm-leader-init", move |cell| {
            leader_barrier(t.as_ref(), &c, Some(page_size), timeout, |r| {
                cell.set(Ok(r.clone()))
            })
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
            pending_keys: HashSet::default(),
            iteration: 0,
            next_op: 0,
            metrics: Arc::new(Metrics::new()),
            metrics_server: None,
            failure_logged: false,
            store_warn: crate::connector::metrics::WarnLimiter::new(
                crate::connector::metrics::WarnLimiter::INTERVAL,
            ),
            last_match: MatchResult::NONE,
            dead: Vec::new(),
            remote: None,
            factory: None,
            remote_tried: false,
            deferred_match: E::DEFERRED_MATCH,
            placeholder: E::PLACEHOLDER_BLOCK,
            count_lookups: true,
            rank_store_stats: HashMap::new(),
            window_keys: groups::SeenKeys::new(groups::SEEN_KEYS),
            events: None,
            cache_epoch: 0,
        };
        if let Some(addr) = leader.config.tcp.metrics_addr {
            leader.metrics_server = Some(crate::metrics_server::MetricsServer::start(
                addr,
                &leader.config.tcp,
                leader.metrics.clone(),
            )?);
        }
        if !leader.ensure_ready() && <E::LeaderInit as InitMode>::BLOCKING {
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

    /// Where the counters are served over HTTP (`tcp.metrics_addr`, the bound port), if anywhere.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics_server.as_ref().map(|s| s.addr())
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
            || self.remote.as_ref().is_some_and(|r| !r.queue.is_empty())
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

    /// Sets the factory whose [`TierFactory::remote_store`] builds this leader's remote store
    /// (with `remote.url` set; the engine adapters pass the standard one). The store is built
    /// once the barrier completed; a factory set later is used if none was built yet.
    pub fn set_tier_factory(&mut self, factory: Arc<dyn TierFactory>) {
        self.factory = Some(factory);
        if self.remote.is_none() {
            self.remote_tried = false;
        }
        if self.tiers.is_some() {
            self.build_remote();
        }
    }

    /// The remote store, once built.
    pub fn remote_store(&self) -> Option<&Arc<dyn crate::connector::remote::RemoteStore>> {
        self.remote.as_ref().map(|r| &r.store)
    }

    /// The remote-store counters of the leader's store and every rank's (as last reported),
    /// added; `None` without a remote store. `available`: the leader's store answered its last
    /// call and no rank's last report said otherwise.
    pub fn remote_store_stats(&self) -> Option<crate::connector::remote::RemoteStoreStats> {
        let own = self.remote.as_ref()?.store.stats();
        Some(
            self.rank_store_stats
                .values()
                .fold(own, |sum, rank| sum.plus(*rank)),
        )
    }

    /// Copies [`Leader::remote_store_stats`] into the metrics.
    pub(super) fn publish_store_stats(&self) {
        if let Some(st) = self.remote_store_stats() {
            self.metrics.set_remote_store_stats(&st);
        }
    }

    /// Builds the remote store if configured and not tried yet. A failure leaves the remote
    /// tier off (the workers fail their start-up with the same error).
    fn build_remote(&mut self) {
        if self.remote_tried || !self.config.remote.enabled() {
            return;
        }
        let (Some(factory), Some(tiers)) = (self.factory.clone(), self.tiers.as_ref()) else {
            return;
        };
        self.remote_tried = true;
        let r = &tiers.readiness;
        let bpb = r.bytes_per_block.first().copied().unwrap_or(0);
        if r.bytes_per_block.iter().any(|b| *b != bpb) {
            tracing::warn!(
                "kvbm: the ranks' blocks differ in size ({:?}): the remote tier is off",
                r.bytes_per_block
            );
            return;
        }
        let built = RemoteScope::for_instance(&self.config, &r.dims, r.bytes_per_block.len(), bpb)
            .and_then(|scope| factory.remote_store(&self.config, &scope))
            .and_then(|store| {
                store
                    .map(|s| remote::LeaderStore::new(s, &self.config, self.deferred_match))
                    .transpose()
            });
        match built {
            Ok(Some(mut store)) => {
                if let Some(host) = self.tiers.as_ref().and_then(|t| t.host.as_ref()) {
                    store.bound_writes_to(host.num_blocks());
                }
                if store.store.leaves_the_process() && matches!(self.config.remote.secret(), Ok(None)) {
                    // Said once per leader, at start-up (the workers' stores say nothing).
                    tracing::warn!(
                        remote = %store.store.describe(),
                        "kvbm: the remote tier has no deployment secret (KVBM_REMOTE_SECRET or remote.secret_file): anyone who can write to the store can plant a block that will be served; its checksum only catches damage, not a forged value (docs/deployment.md)"
                    );
                }
                store.publish_state(&self.metrics);
                self.metrics
                    .set_remote_available(store.store.stats().available);
                self.remote = Some(store);
            }
            Ok(None) => tracing::warn!(
                "kvbm: remote.url is set but the tier factory provides no remote store: the remote tier is off"
            ),
            Err(e) => {
                tracing::error!(error = %e, "kvbm: cannot build the remote store: the remote tier is off")
            }
        }
    }

    fn ensure_ready(&mut self) -> bool {
        if self.tiers.is_some() {
            if !self.remote_tried && self.factory.is_some() {
                self.build_remote();
            }
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
                        self.arm_pool_events();
                        self.build_remote();
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
                BlockPool::with_policy(kind, n, self.config.eviction).map(Some)
            }
        };
        let host = pool(TierKind::Host, readiness.counts.num_host_blocks)?;
        let disk = pool(TierKind::Disk, readiness.counts.num_disk_blocks)?;
        if let Some(disk) = disk.as_ref().filter(|_| !readiness.disk_index.is_empty()) {
            // What every rank's persisted disk tier held when it was reopened (`disk.persist`).
            let n = disk.adopt(&readiness.disk_index);
            tracing::info!(
                blocks = n,
                "kvbm leader: blocks of a persisted disk tier reopened"
            );
        }
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

/// The first of `blocks` that is not a device block (`num_device` of them) nor the engine's
/// `placeholder` (which stands where the engine keeps no block, and is never transferred).
fn first_bad_block(
    blocks: &[usize],
    num_device: usize,
    placeholder: Option<usize>,
) -> Option<usize> {
    blocks
        .iter()
        .copied()
        .find(|&b| b >= num_device && Some(b) != placeholder)
}

fn unknown_request(op: &'static str, id: &RequestId) -> Error {
    Error::new(
        ErrorKind::NotFound,
        format!("{op}: unknown request id {id}"),
    )
    .with("op", op)
    .with("request", id)
}
