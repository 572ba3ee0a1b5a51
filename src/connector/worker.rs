//! The worker: the GPU-process half of the connector.
//!
//! One worker per engine process (per tensor-parallel rank). It registers the engine's device
//! cache as a [`StorageTier`], takes part in the start-up barrier, then has its [`TierFactory`]
//! build its own host, disk and remote tiers with the block counts the leader chose (the core
//! builds no tier: the factory comes from whoever creates the worker). Each iteration it receives
//! the leader's metadata, runs the operations on its tiers through the [`TransferEngine`], and
//! reports every operation's completion to the leader.
//!
//! Towards the engine it answers:
//! * which requests finished *loading* (all their loads done on this worker);
//! * which finished requests may have their device blocks freed (all their device operations
//!   done on this worker, and the leader asked the engine to hold them);
//! * which device blocks failed to load and must be recomputed.
//!
//! Each id is reported once. Loads run asynchronously (the engine does not compute on a request
//! until its load is reported). Stores are submitted after the forward pass (`save`) and must
//! have read their device blocks before the next iteration writes them: the next `bind_metadata`
//! waits for those reads.
//!
//! Stuck storage: transfers that touch a tier doing I/O (disk, remote) run on their own transfer
//! engine, so a frozen disk never takes the permits of memory copies (device ↔ host). A load from
//! such a tier has a deadline (`transfer.load_timeout_secs`): past it, the load completes as
//! failed — its unwritten device blocks are load errors the engine recomputes, reported to the
//! leader as failed blocks — while the stuck I/O finishes in the background through a closed
//! fence (see `fence`): the device blocks are never written by it. [`Worker::wait_idle`] does
//! not wait for such abandoned I/O, and [`Worker::wait_idle_or_stuck`] not for host → disk copies
//! once one of them is stuck past a grace.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::config::Config;
use crate::connector::adapter::Engine;
use crate::connector::barrier::{initialise, worker_barrier, InitCell, InitMode, InitStatus};
use crate::connector::fence::FencedDevice;
use crate::connector::metadata::{ConnectorMetadata, Direction, Operation, OperationId};
use crate::connector::metrics::{Metrics, WarnLimiter};
use crate::connector::outbox::Outbox;
use crate::connector::remote::{
    RemoteScope, RemoteSink, RemoteSource, RemoteStore, RemoteStoreStats,
};
use crate::connector::transport::{
    Completion, FinishWork, LeaderMessage, TierCounts, WorkerHello, WorkerMessage, WorkerTransport,
};
use crate::connector::RequestId;
use crate::error::{Error, ErrorKind, Result};
use crate::layout::KvLayout;
use crate::metrics_server::MetricsServer;
use crate::tier::{StorageTier, TierKind};
use crate::transfer::{BlockFailure, TransferEngine, TransferOutcome};

mod disk_keys;
use disk_keys::DiskKeys;
mod jobs;
mod waits;

/// How long `bind_metadata` waits for the previous iteration's stores to finish reading the
/// device before it gives up with an error.
pub const DEVICE_READ_TIMEOUT: Duration = Duration::from_secs(60);

/// How many finished request ids the worker remembers, to match a hold that arrives after the
/// engine reported the request finished.
const RECENTLY_FINISHED: usize = 4096;

/// The tiers of this worker once the barrier completed.
#[derive(Debug, Clone)]
pub struct WorkerTiers {
    /// The engine's device cache.
    pub device: Arc<dyn StorageTier>,
    /// Host tier, if the leader gave it blocks.
    pub host: Option<Arc<dyn StorageTier>>,
    /// Disk tier, if the leader gave it blocks.
    pub disk: Option<Arc<dyn StorageTier>>,
    /// The counts the leader chose.
    pub counts: TierCounts,
    /// The shared remote store (G4), when `remote.url` is set. Factories leave it `None`: the
    /// worker fills it from [`TierFactory::remote_store`] after [`TierFactory::build`].
    pub remote: Option<Arc<dyn RemoteStore>>,
    /// `(block, key)` of what a persisted disk tier held when it was reopened (`disk.persist`;
    /// empty otherwise): the worker keeps its index from there.
    pub disk_index: Vec<(usize, u128)>,
}

/// Builds a worker's own tiers once the start-up barrier chose their sizes: storage providers
/// implement it (the core builds no tier itself), and the worker holds one as
/// `Arc<dyn TierFactory>`.
///
/// `build` runs once per worker, on the thread running the barrier, with the worker's
/// configuration, its rank, the engine's device tier and the counts the leader chose. It returns
/// every tier the counts and the configuration ask for (a host tier when `num_host_blocks > 0`, a
/// disk tier when `num_disk_blocks > 0`; `remote` is left `None`), or an error,
/// which fails the worker's start-up (for instance [`ErrorKind::Unsupported`] for a setting this
/// build cannot serve). The returned [`WorkerTiers`] carry `device` and `counts` as given.
pub trait TierFactory: Send + Sync + std::fmt::Debug {
    /// The tiers of worker `rank`; see the [trait docs](TierFactory).
    fn build(
        &self,
        config: &Config,
        rank: usize,
        device: Arc<dyn StorageTier>,
        counts: TierCounts,
    ) -> Result<WorkerTiers>;

    /// The shared remote store (G4) the configuration names (`remote.url`), built for `scope`,
    /// or `None` when none is configured. The leader and every worker each build one (the
    /// leader looks up through it, the workers read and write their shards); called only when
    /// `remote.url` is set. It must not wait for the store to be reachable: a store that is down
    /// at start is reached later (reconnecting in the background). The default builds none.
    fn remote_store(
        &self,
        config: &Config,
        scope: &super::remote::RemoteScope,
    ) -> Result<Option<Arc<dyn super::remote::RemoteStore>>> {
        let _ = (config, scope);
        Ok(None)
    }
}

impl WorkerTiers {
    fn get(&self, kind: TierKind) -> Option<&Arc<dyn StorageTier>> {
        match kind {
            TierKind::Device => Some(&self.device),
            TierKind::Host => self.host.as_ref(),
            TierKind::Disk => self.disk.as_ref(),
            TierKind::Remote => None,
        }
    }
}

#[derive(Debug, Default)]
struct WorkerSlot {
    /// Loads submitted and not completed.
    loads: usize,
    /// Operations touching device blocks, submitted and not completed.
    device_ops: usize,
    /// Of `loads` (and `device_ops`), those reading the remote store.
    remote_loads: usize,
    had_load: bool,
    load_reported: bool,
    /// The leader asked the engine to hold this request's device blocks.
    hold: bool,
    /// The engine said the request finished.
    engine_finished: bool,
    /// The engine said the request started loading (TensorRT-LLM passes these ids).
    engine_loading: bool,
    /// Device blocks whose load failed, held until [`Worker::get_finished`] reports the
    /// request loaded: the engine hears of a request's failed blocks in the same iteration as
    /// of its load's end, never before (it would then take the load for whole).
    load_errors: Vec<usize>,
}

#[derive(Debug, Default)]
struct State {
    slots: HashMap<RequestId, WorkerSlot>,
    /// Failed device blocks of the loads [`Worker::get_finished`] reported done (and of loads
    /// without a request), since the last [`Worker::take_load_errors`].
    load_errors: BTreeSet<usize>,
    /// Of those loads, the requests with a failed block, since the last
    /// [`Worker::take_failed_loads`].
    failed_loads: BTreeSet<RequestId>,
    recently_finished: VecDeque<RequestId>,
    recently_finished_set: HashSet<RequestId>,
}

/// Bytes moved on one tier pair by this worker, and the time its transfers took.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct PathStats {
    /// Source tier.
    pub src: TierKind,
    /// Destination tier.
    pub dst: TierKind,
    /// Blocks copied successfully.
    pub blocks: u64,
    /// Bytes copied successfully.
    pub bytes: u64,
    /// Sum of the transfers' durations (submission to completion); concurrent transfers overlap.
    pub busy: Duration,
}

impl PathStats {
    /// Bytes per second over the busy time.
    pub fn bytes_per_sec(&self) -> f64 {
        let s = self.busy.as_secs_f64();
        if s > 0.0 {
            self.bytes as f64 / s
        } else {
            0.0
        }
    }
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    paths: Mutex<Vec<PathStats>>,
    device_reads: Mutex<usize>,
    device_reads_done: Condvar,
    /// Operations submitted and not completed (abandoned loads count as completed).
    active: Mutex<Active>,
    /// Notified whenever an operation completes (`active.all` went down).
    active_done: Condvar,
    /// Rate-limits the warning about failed operations.
    failure_warn: Mutex<WarnLimiter>,
    /// Rate-limits the warning about steps that went on past stuck host → disk copies.
    stuck_warn: Mutex<WarnLimiter>,
    /// This worker's transfer counters (blocks and bytes per tier pair), served with
    /// `tcp.metrics_addr`.
    metrics: Arc<Metrics>,
    /// The persisted disk tier's index, once the tiers exist (`disk.persist`).
    disk_keys: std::sync::OnceLock<DiskKeys>,
}

/// Operations in flight on a worker.
#[derive(Debug, Default)]
struct Active {
    /// All of them.
    all: usize,
    /// Those touching no device block (host → disk copies: nothing the engine waits for), with
    /// when each was submitted; writes to the remote store not among them.
    off_device: HashMap<OperationId, Instant>,
    /// Writes of host blocks to the remote store (write-behind): never waited for by
    /// [`Worker::wait_idle_or_stuck`].
    behind: usize,
    /// Loads from the remote store into device blocks: not waited for by
    /// [`Worker::wait_idle_or_stuck`] either (each ends within `remote.load_timeout_ms`; an
    /// engine schedules other requests meanwhile).
    remote_loads: usize,
}

impl Default for Shared {
    fn default() -> Self {
        Self {
            state: Mutex::default(),
            paths: Mutex::default(),
            device_reads: Mutex::default(),
            device_reads_done: Condvar::new(),
            active: Mutex::new(Active::default()),
            active_done: Condvar::new(),
            failure_warn: Mutex::new(WarnLimiter::new(WarnLimiter::INTERVAL)),
            stuck_warn: Mutex::new(WarnLimiter::new(WarnLimiter::INTERVAL)),
            metrics: Arc::new(Metrics::new()),
            disk_keys: std::sync::OnceLock::new(),
        }
    }
}

/// The worker-side connector.
pub struct Worker {
    config: Config,
    world_size: usize,
    /// The engine's worker init mode ([`InitMode::NAME`], [`InitMode::BLOCKING`]).
    mode: (&'static str, bool),
    transport: Arc<dyn WorkerTransport>,
    factory: Arc<dyn TierFactory>,
    runtime: WorkerRuntime,
    /// Copies between tiers in memory (device ↔ host).
    engine: TransferEngine,
    /// Copies that touch a tier doing I/O (disk, remote): their own permits, so stuck I/O never
    /// holds up memory copies.
    io_engine: TransferEngine,
    init: Option<Arc<InitCell<WorkerTiers>>>,
    shared: Arc<Shared>,
    current: Option<ConnectorMetadata>,
    loads_submitted: bool,
    stores_submitted: bool,
    /// Operations of the current metadata naming a request no metadata announced.
    orphans: HashSet<OperationId>,
    /// The highest metadata iteration bound so far.
    bound_iteration: u64,
    /// Finished requests' work received from the leader outside the metadata, waiting until the
    /// metadata iteration it follows is bound ([`FinishWork`]).
    finish_queue: Vec<(u64, ConnectorMetadata)>,
    /// The leader's end of the transport failed (logged once).
    leader_gone: bool,
    /// The HTTP endpoint of this worker's counters (`tcp.metrics_addr`, port + 1 + rank).
    metrics_server: Option<MetricsServer>,
    /// Completions waiting to be sent to the leader, in batches (see `outbox`).
    outbox: Arc<Outbox>,
    /// The remote store's counters last sent to the leader ([`WorkerMessage::StoreStats`]).
    store_stats_sent: RemoteStoreStats,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("rank", &self.transport.rank())
            .field("world_size", &self.world_size)
            .field("mode", &self.mode.0)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// A worker of engine `E` among `world_size` ranks, talking to its leader over `transport`,
    /// whose host, disk and remote tiers `factory` builds once the barrier chose their sizes.
    /// Nothing runs until [`Worker::register`], which runs the barrier as `E::WorkerInit` says.
    pub fn new<E: Engine>(
        config: Config,
        world_size: usize,
        transport: Arc<dyn WorkerTransport>,
        factory: Arc<dyn TierFactory>,
    ) -> Result<Self> {
        config.validate()?;
        if world_size == 0 || transport.rank() >= world_size {
            return Err(Error::invalid_argument(format!(
                "rank {} is not below world size {world_size}",
                transport.rank()
            )));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvbm-worker")
            .on_thread_start(background_thread_policy)
            .enable_time()
            .build()
            .map_err(|e| Error::io("start the worker runtime", e))?;
        let runtime = WorkerRuntime::new(runtime);
        let engine = TransferEngine::new(&config.transfer)?;
        let io_engine = TransferEngine::new(&config.transfer)?;
        let shared = Arc::new(Shared::default());
        let outbox = Outbox::new(transport.clone(), runtime.handle().clone());
        let metrics_server = match config.tcp.metrics_addr {
            Some(addr) => Some(MetricsServer::start(
                worker_metrics_addr(addr, transport.rank())?,
                &config.tcp,
                shared.metrics.clone(),
            )?),
            None => None,
        };
        Ok(Self {
            config,
            world_size,
            mode: (E::WorkerInit::NAME, E::WorkerInit::BLOCKING),
            transport,
            factory,
            runtime,
            engine,
            io_engine,
            init: None,
            shared,
            current: None,
            loads_submitted: false,
            stores_submitted: false,
            orphans: HashSet::new(),
            bound_iteration: 0,
            finish_queue: Vec::new(),
            leader_gone: false,
            metrics_server,
            outbox,
            store_stats_sent: RemoteStoreStats::default(),
        })
    }

    /// This worker's transfer counters (blocks and bytes per tier pair; the lookup and hit
    /// series are the leader's and stay 0 here).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.shared.metrics
    }

    /// Where this worker's counters are served over HTTP (`tcp.metrics_addr`'s port + 1 +
    /// rank; the bound port), if anywhere.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics_server.as_ref().map(|s| s.addr())
    }

    /// Replaces the factory that builds this worker's tiers (before [`Worker::register`]; an
    /// [`ErrorKind::AlreadyExists`] error after it).
    pub fn set_tier_factory(&mut self, factory: Arc<dyn TierFactory>) -> Result<()> {
        if self.init.is_some() {
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                "the worker's tiers are already being built: set the tier factory before register",
            ));
        }
        self.factory = factory;
        Ok(())
    }

    /// This worker's rank.
    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    /// Registers the engine's device cache and runs the barrier (inline for
    /// [`Blocking`](crate::connector::Blocking), in the background for
    /// [`NonBlocking`](crate::connector::NonBlocking), as the engine's `WorkerInit` says). A
    /// blocking registration returns once the leader is ready too (barrier step 3); a
    /// non-blocking worker is ready once its tiers are allocated.
    pub fn register(&mut self, device: Arc<dyn StorageTier>) -> Result<()> {
        if self.init.is_some() {
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                "a device cache is already registered with this worker",
            ));
        }
        let dims = *device.layout().dims();
        let hello = WorkerHello {
            rank: self.transport.rank(),
            world_size: self.world_size,
            bytes_per_block: device.bytes_per_block(),
            num_device_blocks: device.num_blocks(),
            dims,
        };
        let transport = self.transport.clone();
        let factory = self.factory.clone();
        let shared = self.shared.clone();
        let config = self.config.clone();
        let timeout = config.init_timeout();
        let rank = hello.rank;
        // Blocking (TensorRT-LLM): the registration returns once the leader is ready too
        // (barrier step 3), so the engine's first request finds it ready.
        let await_leader = self.mode.1;
        let init = initialise(self.mode.1, "kvbm-worker-init", move |_| {
            let mut tiers = None;
            let world_size = hello.world_size;
            worker_barrier(transport.as_ref(), hello, timeout, await_leader, |counts| {
                let mut built = factory.build(&config, rank, device.clone(), counts)?;
                built.remote = None;
                if let Some(disk) = &built.disk {
                    if let Some(keys) = DiskKeys::new(disk.clone(), &built.disk_index) {
                        let _ = shared.disk_keys.set(keys);
                    }
                }
                if config.remote.enabled() {
                    let scope = RemoteScope::for_instance(
                        &config,
                        device.layout().dims(),
                        world_size,
                        device.bytes_per_block(),
                    )?;
                    built.remote = factory.remote_store(&config, &scope)?;
                    if built.remote.is_none() {
                        tracing::warn!(
                            "remote.url is set but this build's tier factory provides no remote store: the remote tier is off"
                        );
                    }
                }
                let disk_index = std::mem::take(&mut built.disk_index);
                tiers = Some(built);
                Ok(disk_index)
            })?;
            tiers.ok_or_else(|| Error::internal("barrier finished without tiers"))
        })?;
        self.init = Some(init);
        Ok(())
    }

    /// The tiers, once ready.
    pub fn tiers(&self) -> Option<&WorkerTiers> {
        self.init.as_ref().and_then(|c| c.get())
    }

    /// True once the barrier completed and the tiers are allocated.
    pub fn is_ready(&self) -> bool {
        self.tiers().is_some()
    }

    /// The start-up error, if the barrier failed.
    pub fn init_error(&self) -> Option<Error> {
        match self.init.as_ref()?.status() {
            InitStatus::Failed(e) => Some(e.clone()),
            _ => None,
        }
    }

    /// Takes this iteration's metadata (bytes from the leader). Waits for the previous
    /// iteration's stores to finish reading device blocks; submits any operation of the previous
    /// metadata that was never started so none is lost.
    pub fn bind_metadata(&mut self, bytes: &[u8]) -> Result<()> {
        let _span = tracing::debug_span!("kvbm.worker.bind", rank = self.rank()).entered();
        let meta = ConnectorMetadata::decode(bytes)?;
        if !self.is_ready() {
            if meta.operations.is_empty() {
                return Ok(());
            }
            return Err(Error::new(
                ErrorKind::NotReady,
                format!(
                    "worker rank {} received {} operations before its start-up finished",
                    self.rank(),
                    meta.operations.len()
                ),
            ));
        }
        if self.current.is_some() {
            if !self.loads_submitted {
                self.start_load()?;
            }
            if !self.stores_submitted {
                self.save()?;
            }
        }
        self.wait_device_reads(DEVICE_READ_TIMEOUT)?;
        // A new iteration: what the last one left queued goes now.
        self.outbox.begin_iteration();
        self.orphans = self.account(&meta);
        self.bound_iteration = self.bound_iteration.max(meta.iteration);
        self.current = Some(meta);
        self.loads_submitted = false;
        self.stores_submitted = false;
        Ok(())
    }

    /// Records what a metadata (or a [`FinishWork`]) says about requests — new slots, finished
    /// requests, holds — and counts every operation against its request, before any is started:
    /// a request is never reported done while an operation of its metadata has yet to run.
    /// Returns the operations naming a request no metadata announced (refused when submitted).
    fn account(&self, meta: &ConnectorMetadata) -> HashSet<OperationId> {
        let mut orphans = HashSet::new();
        let mut st = self.shared.state.lock();
        for id in &meta.new_slots {
            st.slots.entry(id.clone()).or_default();
        }
        for id in &meta.finished {
            if let Some(s) = st.slots.get_mut(id) {
                s.engine_finished = true;
                s.hold = false;
            }
        }
        for id in &meta.hold {
            let finished = st.recently_finished_set.contains(id);
            if let Some(s) = st.slots.get_mut(id) {
                s.hold = true;
                // The engine may name a finished request before the hold reaches this worker.
                s.engine_finished |= finished;
            } else {
                // Already drained here; if the engine already said finished, report at once.
                st.slots.insert(
                    id.clone(),
                    WorkerSlot {
                        hold: true,
                        engine_finished: finished,
                        ..Default::default()
                    },
                );
            }
        }
        for op in &meta.operations {
            let t = op.transfer();
            let Some(id) = &t.request_id else { continue };
            let Some(slot) = st.slots.get_mut(id) else {
                // Never announced: refuse it rather than track a request nobody will finish.
                orphans.insert(t.id);
                continue;
            };
            if t.reads_device() || t.writes_device() {
                slot.device_ops += 1;
            }
            if op.direction() == Direction::Load {
                slot.loads += 1;
                if t.src == TierKind::Remote {
                    slot.remote_loads += 1;
                }
                slot.had_load = true;
                // A request matched again (after a preemption or a failed load) loads anew
                // and is reported loaded anew.
                slot.load_reported = false;
            }
        }
        orphans
    }

    /// Takes the [`FinishWork`] messages the leader sent since the last call (non-blocking; only
    /// once started: before that the barrier owns the transport).
    fn receive_finish_work(&mut self) {
        if self.leader_gone || !self.is_ready() {
            return;
        }
        loop {
            match self.transport.recv_timeout(Duration::ZERO) {
                Ok(Some(LeaderMessage::Finish(FinishWork {
                    after_iteration,
                    metadata,
                }))) => match ConnectorMetadata::decode(&metadata) {
                    Ok(meta) => self.finish_queue.push((after_iteration, meta)),
                    Err(e) => {
                        tracing::error!(rank = self.rank(), error = %e, "undecodable finished-request work from the leader");
                    }
                },
                // Barrier step 3 for a worker that did not wait for it (non-blocking start-up).
                Ok(Some(LeaderMessage::Ready)) => {}
                Ok(Some(LeaderMessage::Goodbye)) => {
                    tracing::info!(rank = self.rank(), "the kvbm leader shut down");
                    self.leader_gone = true;
                    break;
                }
                Ok(Some(other)) => {
                    tracing::warn!(
                        rank = self.rank(),
                        ?other,
                        "unexpected leader message after start-up"
                    );
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(rank = self.rank(), error = %e, "the leader's end of the transport failed");
                    self.leader_gone = true;
                    break;
                }
            }
        }
    }

    /// Runs the received [`FinishWork`] whose metadata iteration is bound: records its holds and
    /// submits its operations at once (they read device blocks the engine keeps for them).
    ///
    /// Called from [`Worker::get_finished`] only, which the engine calls at the end of an
    /// iteration: once this rank bound the metadata a message follows, that iteration's forward
    /// pass — which may write the request's last KV on this rank — has run too. (Binding is not
    /// enough: a rank that lags behind the leader's rank binds the metadata before its forward.)
    fn run_finish_work(&mut self) {
        self.receive_finish_work();
        if self.finish_queue.is_empty() {
            return;
        }
        let Some(tiers) = self.tiers().cloned() else {
            return;
        };
        let bound = self.bound_iteration;
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.finish_queue)
            .into_iter()
            .partition(|(after, _)| *after <= bound);
        self.finish_queue = later;
        let mut jobs = Vec::new();
        for (_, meta) in due {
            let orphans = self.account(&meta);
            for op in meta.operations {
                let orphan = orphans.contains(&op.id());
                jobs.extend(self.prepare(&tiers, op, orphan));
            }
        }
        self.start_jobs(jobs);
    }

    /// Drops the current metadata (after the iteration), submitting anything not yet started.
    pub fn clear_metadata(&mut self) -> Result<()> {
        if self.current.is_some() {
            if !self.loads_submitted {
                self.start_load()?;
            }
            if !self.stores_submitted {
                self.save()?;
            }
        }
        self.current = None;
        Ok(())
    }

    /// Starts this iteration's loads (asynchronous).
    pub fn start_load(&mut self) -> Result<()> {
        let _span = tracing::debug_span!("kvbm.worker.start_load", rank = self.rank()).entered();
        self.loads_submitted = true;
        self.submit_where(|op| op.direction() == Direction::Load)
    }

    /// Starts this iteration's stores and other operations (after the forward pass wrote the
    /// blocks). Does not wait for them.
    pub fn save(&mut self) -> Result<()> {
        let _span = tracing::debug_span!("kvbm.worker.save", rank = self.rank()).entered();
        self.stores_submitted = true;
        self.submit_where(|op| op.direction() != Direction::Load)
    }

    /// Requests done on this worker, each reported once: `(released, loaded)`.
    ///
    /// * `finished`: requests the engine reports finished since the last call.
    /// * `started_loading`: requests the engine says started loading (TensorRT-LLM passes them and
    ///   accepts only those back); `None` reports any finished load (vLLM).
    ///
    /// `released` lists finished requests whose device blocks the engine held for us and whose
    /// device operations are all done here; `loaded`, requests whose loads are all done here
    /// (failed blocks are in [`Worker::take_load_errors`]).
    pub fn get_finished(
        &mut self,
        finished: &[RequestId],
        started_loading: Option<&[RequestId]>,
    ) -> (Vec<RequestId>, Vec<RequestId>) {
        let _span = tracing::debug_span!("kvbm.worker.get_finished", rank = self.rank()).entered();
        // A finished request's last work may come outside the metadata (an idle engine builds
        // none): run what arrived before looking at what finished.
        self.run_finish_work();
        let mut st = self.shared.state.lock();
        for id in finished {
            if let Some(s) = st.slots.get_mut(id) {
                s.engine_finished = true;
            }
            if st.recently_finished_set.insert(id.clone()) {
                st.recently_finished.push_back(id.clone());
                if st.recently_finished.len() > RECENTLY_FINISHED {
                    if let Some(old) = st.recently_finished.pop_front() {
                        st.recently_finished_set.remove(&old);
                    }
                }
            }
        }
        if let Some(ids) = started_loading {
            for id in ids {
                // The engine may name a load before the metadata announcing it is bound.
                st.slots.entry(id.clone()).or_default().engine_loading = true;
            }
        }
        let any_loading = started_loading.is_none();
        let mut released = Vec::new();
        let mut loaded = Vec::new();
        let state = &mut *st;
        let (errors, failed_loads) = (&mut state.load_errors, &mut state.failed_loads);
        state.slots.retain(|id, s| {
            if s.had_load && s.loads == 0 && !s.load_reported && (any_loading || s.engine_loading) {
                s.load_reported = true;
                loaded.push(id.clone());
                if !s.load_errors.is_empty() {
                    errors.extend(s.load_errors.drain(..));
                    failed_loads.insert(id.clone());
                }
            }
            if s.engine_finished && s.device_ops == 0 && s.loads == 0 {
                // A load never reported (the engine finished the request first) leaves its
                // failed blocks unsaid: they are the engine's again, maybe another request's.
                if s.hold {
                    released.push(id.clone());
                }
                return false;
            }
            true
        });
        drop(st);
        // The iteration ends: every completion queued by now — among them those of whatever
        // the answer below reports done — goes to the leader before the engine hears of it.
        self.outbox.end_iteration();
        self.send_store_stats();
        released.sort();
        loaded.sort();
        (released, loaded)
    }

    /// Sends this rank's remote-store counters to the leader when they changed since the last
    /// time (the leader adds every rank's to the metrics and reports). A failed send is the
    /// transport's to report; the counters go with the next change.
    fn send_store_stats(&mut self) {
        let Some(store) = self.tiers().and_then(|t| t.remote.clone()) else {
            return;
        };
        let now = store.stats();
        if now == self.store_stats_sent {
            return;
        }
        if self.transport.send(WorkerMessage::StoreStats(now)).is_ok() {
            self.store_stats_sent = now;
        }
    }

    /// Whether request `id` is still tracked here: operations in flight, or its end not yet
    /// reported by [`Worker::get_finished`].
    pub fn tracks(&self, id: &RequestId) -> bool {
        self.shared.state.lock().slots.contains_key(id)
    }

    /// Whether request `id` has loads whose end [`Worker::get_finished`] has not reported yet.
    pub fn load_pending(&self, id: &RequestId) -> bool {
        self.shared
            .state
            .lock()
            .slots
            .get(id)
            .is_some_and(|s| s.had_load && !s.load_reported)
    }

    /// Device blocks whose load failed (the engine must recompute them): those of the requests
    /// [`Worker::get_finished`] reported loaded since the last call, so an engine that calls
    /// this right after `get_finished` hears of a request's failed blocks with its load's end.
    pub fn take_load_errors(&mut self) -> Vec<usize> {
        std::mem::take(&mut self.shared.state.lock().load_errors)
            .into_iter()
            .collect()
    }

    /// Requests with a load that failed, among those [`Worker::get_finished`] reported loaded
    /// since the last call, in id order (an engine that must
    /// recompute such a request whole, not from its first failed block, asks this: with a
    /// sliding window the tokens before that block are not on the device).
    pub fn take_failed_loads(&mut self) -> Vec<RequestId> {
        std::mem::take(&mut self.shared.state.lock().failed_loads)
            .into_iter()
            .collect()
    }

    /// Bytes moved per tier pair so far, ordered by (source, destination).
    pub fn transfer_stats(&self) -> Vec<PathStats> {
        let mut v = self.shared.paths.lock().clone();
        v.sort_by_key(|p| (p.src, p.dst));
        v
    }

    /// Requests this worker tracks.
    pub fn num_slots(&self) -> usize {
        self.shared.state.lock().slots.len()
    }

    /// The operations of the current metadata (for tools and tests).
    pub fn current_operations(&self) -> Vec<OperationId> {
        self.current
            .as_ref()
            .map(|m| m.operations.iter().map(|o| o.id()).collect())
            .unwrap_or_default()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Completions still queued (an engine that stopped without a last `get_finished`).
        self.outbox.flush();
        if let Some(keys) = self.shared.disk_keys.get() {
            if let Err(e) = keys.save() {
                tracing::warn!(error = %e, "kvbm worker: the persisted disk index was not saved");
            }
        }
    }
}

/// How long a dropped worker waits for its copies still running (a slow disk finishing its
/// writes) before it leaves them: a disk or store stuck for minutes must not hold up the
/// engine's shutdown or the process's exit. Abandoned writes are not in the persisted index.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// The worker's runtime. Dropping a tokio runtime waits for every blocking task — here, a copy
/// whose disk is stuck — however long it takes; this one waits at most [`SHUTDOWN_GRACE`].
#[derive(Debug)]
struct WorkerRuntime {
    handle: tokio::runtime::Handle,
    runtime: Option<tokio::runtime::Runtime>,
}

impl WorkerRuntime {
    fn new(runtime: tokio::runtime::Runtime) -> Self {
        Self {
            handle: runtime.handle().clone(),
            runtime: Some(runtime),
        }
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        &self.handle
    }
}

impl Drop for WorkerRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(SHUTDOWN_GRACE);
        }
    }
}

/// Run by each of the worker runtime's threads as it starts (its task thread and the blocking
/// threads that run copies): on Linux the thread is put under `SCHED_BATCH`, so waking it — the
/// engine's thread hands a step's operations over in `save` — never preempts the engine's
/// thread on its CPU; the copies run when a CPU is free (at once on an idle one), and the next
/// `bind_metadata` waits for their device reads as before. Best effort: a refusal is ignored.
fn background_thread_policy() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: `param` is a valid sched_param; pid 0 is the calling thread.
        let _ = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
    }
}

/// A worker's metrics address: the leader's port + 1 + rank (port 0 stays 0: any free port).
fn worker_metrics_addr(leader: std::net::SocketAddr, rank: usize) -> Result<std::net::SocketAddr> {
    if leader.port() == 0 {
        return Ok(leader);
    }
    let port = u16::try_from(rank)
        .ok()
        .and_then(|r| leader.port().checked_add(1)?.checked_add(r))
        .ok_or_else(|| {
            Error::invalid_config(
                "tcp.metrics_addr",
                leader,
                format!("rank {rank}'s port (port + 1 + rank) is above 65535"),
            )
        })?;
    Ok(std::net::SocketAddr::new(leader.ip(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workers_metrics_port_is_the_leaders_plus_one_plus_rank() {
        let a: std::net::SocketAddr = "127.0.0.1:9400".parse().unwrap();
        assert_eq!(worker_metrics_addr(a, 0).unwrap().port(), 9401);
        assert_eq!(worker_metrics_addr(a, 7).unwrap().port(), 9408);
        let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
        assert_eq!(worker_metrics_addr(any, 3).unwrap().port(), 0);
        let top: std::net::SocketAddr = "127.0.0.1:65535".parse().unwrap();
        let e = worker_metrics_addr(top, 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{e}");
        assert!(e.to_string().contains("tcp.metrics_addr"), "{e}");
    }
}
