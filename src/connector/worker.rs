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
use crate::connector::metrics_server::MetricsServer;
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
use crate::tier::{StorageTier, TierKind};
use crate::transfer::{BlockFailure, TransferEngine, TransferOutcome};

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
    /// This worker's transfer counters (blocks and bytes per tier pair), served with
    /// `tcp.metrics_addr`.
    metrics: Arc<Metrics>,
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
            metrics: Arc::new(Metrics::new()),
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
    runtime: tokio::runtime::Runtime,
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
    /// [`NonBlocking`](crate::connector::NonBlocking), as the engine's `WorkerInit` says).
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
        let config = self.config.clone();
        let timeout = config.init_timeout();
        let rank = hello.rank;
        let init = initialise(self.mode.1, "kvbm-worker-init", move || {
            let mut tiers = None;
            let world_size = hello.world_size;
            worker_barrier(transport.as_ref(), hello, timeout, |counts| {
                let mut built = factory.build(&config, rank, device.clone(), counts)?;
                built.remote = None;
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
                tiers = Some(built);
                Ok(())
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

    fn submit_where(&mut self, pick: impl Fn(&dyn Operation) -> bool) -> Result<()> {
        let Some(meta) = self.current.as_ref() else {
            return Ok(());
        };
        let ops: Vec<Box<dyn Operation>> = meta
            .operations
            .iter()
            .filter(|op| pick(op.as_ref()))
            .cloned()
            .collect();
        if ops.is_empty() {
            return Ok(());
        }
        let tiers = self
            .tiers()
            .cloned()
            .ok_or_else(|| Error::new(ErrorKind::NotReady, "worker is not ready"))?;
        let (here, elsewhere): (Vec<Job>, Vec<Job>) = ops
            .into_iter()
            .filter_map(|op| {
                let orphan = self.orphans.contains(&op.id());
                self.prepare(&tiers, op, orphan)
            })
            .partition(|job| job.inline);
        // Copies to or from disk and the store start first, so they run while this thread copies.
        self.start_jobs(elsewhere);
        for job in here {
            job.run_here(&self.shared, &self.outbox);
        }
        Ok(())
    }

    /// Starts checked operations: all of them from one task on the worker's runtime, so the
    /// engine's thread hands a step's operations over with one wake-up of the runtime, not two
    /// spawns per operation (each transfer still runs as its own task, concurrently).
    fn start_jobs(&self, mut jobs: Vec<Job>) {
        if jobs.is_empty() {
            return;
        }
        let shared = self.shared.clone();
        let outbox = self.outbox.clone();
        let handle = self.runtime.handle().clone();
        if jobs.len() == 1 {
            if let Some(job) = jobs.pop() {
                let _enter = self.runtime.enter();
                job.start(&handle, shared, outbox);
            }
            return;
        }
        self.runtime.spawn(async move {
            for job in jobs {
                job.start(&handle, shared.clone(), outbox.clone());
            }
        });
    }

    /// Checks one operation and counts it in flight; returns what starts it, or `None` when it
    /// completed at once (refused: an `orphan`, naming a request no metadata announced; no tier
    /// for one of its sides; a transfer [`TransferEngine::validate`] refuses).
    fn prepare(&self, tiers: &WorkerTiers, op: Box<dyn Operation>, orphan: bool) -> Option<Job> {
        let t = op.transfer().clone();
        let direction = op.direction();
        let touches_device = t.reads_device() || t.writes_device();
        let behind = !touches_device && t.dst == TierKind::Remote;
        let remote_load = direction == Direction::Load && t.src == TierKind::Remote;
        // Counted until `complete` (every path below ends there).
        {
            let mut active = self.shared.active.lock();
            active.all += 1;
            if behind {
                active.behind += 1;
            } else if remote_load {
                active.remote_loads += 1;
            } else if !touches_device {
                active.off_device.insert(t.id, Instant::now());
            }
        }
        if t.reads_device() {
            *self.shared.device_reads.lock() += 1;
        }
        let done = OpDone {
            op: t.id,
            request: t.request_id.clone(),
            direction,
            touches_device,
            off_device: !touches_device && !behind,
            behind,
            remote_load,
            reads_device: t.reads_device(),
            writes_device: t.writes_device(),
            dst_blocks: t.pairs.iter().map(|p| p.1).collect(),
        };
        let shared = self.shared.clone();
        let outbox = self.outbox.clone();
        if orphan {
            let e = Error::invalid_argument(format!(
                "operation {} names request {:?}, which no metadata announced",
                t.id,
                t.request_id.as_ref().map(RequestId::as_str)
            ));
            let done = OpDone {
                request: None,
                touches_device: false,
                reads_device: false,
                writes_device: false,
                direction: Direction::Store,
                ..done
            };
            complete(&shared, &outbox, done, Err(e));
            return None;
        }
        let deadlines = (
            self.config.remote.load_timeout(),
            self.config.remote.io_timeout(),
        );
        let rank = self.rank();
        let (src, dst) = match remote_sides(tiers, op.as_ref(), rank, deadlines) {
            Ok(sides) => sides,
            Err(e) => {
                complete(&shared, &outbox, done, Err(e.with("op", t.id)));
                return None;
            }
        };
        let (src, dst) = match (src, dst) {
            (Some(s), Some(d)) => (s, d.clone()),
            _ => {
                let e =
                    Error::unsupported(format!("{} → {} has no tier on this worker", t.src, t.dst))
                        .with("op", t.id);
                complete(&shared, &outbox, done, Err(e));
                return None;
            }
        };
        let does_io = |k: TierKind| matches!(k, TierKind::Disk | TierKind::Remote);
        let engine = if does_io(t.src) || does_io(t.dst) {
            &self.io_engine
        } else {
            &self.engine
        };
        let bytes_per_block = dst.bytes_per_block();
        // A load from a tier doing I/O writes the device through a fence, and has a deadline.
        let fence = (direction == Direction::Load
            && t.dst == TierKind::Device
            && !src.capability().host_addressable)
            .then(|| Arc::new(FencedDevice::new(dst.clone())));
        let target = match &fence {
            Some(f) => f.clone() as Arc<dyn StorageTier>,
            None => dst,
        };
        let (src_kind, dst_kind) = (t.src, t.dst);
        // Kept only for a fenced load, to name its failed pairs if it is abandoned.
        let pairs = if fence.is_some() {
            t.pairs.clone()
        } else {
            Vec::new()
        };
        let same = Arc::ptr_eq(&src, &target);
        if let Err(e) = TransferEngine::validate(src.as_ref(), target.as_ref(), same, &t.pairs) {
            complete(&shared, &outbox, done, Err(e));
            return None;
        }
        // A device tier in host memory (an engine on the CPU) and another memory tier: a memcpy
        // of this step's blocks, done at once on this thread (`transfer.inline_device_copies`).
        let inline = self.config.transfer.inline_device_copies
            && touches_device
            && fence.is_none()
            && src.capability().host_addressable
            && target.capability().host_addressable;
        Some(Job {
            inline,
            engine: engine.clone(),
            src,
            target,
            pairs: t.pairs,
            fence,
            fence_pairs: pairs,
            kinds: (src_kind, dst_kind),
            bytes_per_block,
            deadline: self.config.transfer.load_timeout(),
            done,
        })
    }

    /// Waits until no store is reading device blocks.
    fn wait_device_reads(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut n = self.shared.device_reads.lock();
        while *n > 0 {
            if self
                .shared
                .device_reads_done
                .wait_until(&mut n, deadline)
                .timed_out()
            {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "{} store(s) still reading device blocks after {:.0}s",
                        *n,
                        timeout.as_secs_f64()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Waits until every submitted operation has completed (for shutdown and tests). A load
    /// abandoned at its deadline is complete: its stuck I/O is not waited for.
    pub fn wait_idle(&self, timeout: Duration) -> Result<()> {
        let done = self.wait_idle_inner(timeout);
        // What completed is the leader's now: callers look for it next.
        self.outbox.flush();
        done
    }

    fn wait_idle_inner(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let seen = self.shared.active.lock().all;
            let busy = {
                let st = self.shared.state.lock();
                st.slots.values().any(|s| s.device_ops > 0 || s.loads > 0)
            } || *self.shared.device_reads.lock() > 0
                || self.shared.active.lock().all > 0;
            if !busy {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    "operations still running at the deadline",
                ));
            }
            self.wait_for_a_completion(seen);
        }
    }

    /// As [`Worker::wait_idle`], except for the remote store and copies touching no device block:
    /// writes of host blocks to the remote store (write-behind) and loads from it (each bounded
    /// by `remote.load_timeout_ms`; the engine runs other requests meanwhile, as vLLM and
    /// TensorRT-LLM do while a request's KV is fetched) are never waited for, and host → disk copies,
    /// once everything else is done, are not waited for while any of them has been running for
    /// `grace` or more (the disk is stuck: they finish in the background). For callers that wait
    /// every iteration, like `kvbm replay`: a frozen disk then delays one iteration by `grace`,
    /// not every iteration by the freeze, and a shared store's round trips none (an engine never
    /// waits for write-behind), while runs without a remote store stay reproducible.
    pub fn wait_idle_or_stuck(&self, timeout: Duration, grace: Duration) -> Result<()> {
        let done = self.wait_idle_or_stuck_inner(timeout, grace);
        self.outbox.flush();
        done
    }

    fn wait_idle_or_stuck_inner(&self, timeout: Duration, grace: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            let device_busy = {
                let st = self.shared.state.lock();
                st.slots
                    .values()
                    .any(|s| s.device_ops > s.remote_loads || s.loads > s.remote_loads)
            } || *self.shared.device_reads.lock() > 0;
            let seen = self.shared.active.lock().all;
            let (all, off_device, stuck) = {
                let a = self.shared.active.lock();
                let stuck = a.off_device.values().any(|t| t.elapsed() >= grace);
                let waited_for = a
                    .all
                    .saturating_sub(a.behind)
                    .saturating_sub(a.remote_loads);
                (waited_for, a.off_device.len(), stuck)
            };
            let waited = start.elapsed();
            if !device_busy && (all == 0 || (all == off_device && stuck)) {
                return Ok(());
            }
            if waited >= timeout {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    "operations still running at the deadline",
                ));
            }
            self.wait_for_a_completion(seen);
        }
    }

    /// Waits up to `max` for an operation to complete while loads from the remote store are in
    /// flight (at once otherwise). For a caller that steps an engine with nothing to schedule
    /// but requests waiting for their remote loads: it waits for them instead of spinning.
    pub fn wait_for_remote_loads(&self, max: Duration) {
        let mut active = self.shared.active.lock();
        if active.remote_loads > 0 {
            let _ = self.shared.active_done.wait_for(&mut active, max);
        }
    }

    /// Between two polls of [`Worker::wait_idle`]: returns once an operation completed since
    /// `seen` operations were in flight, or after 200 µs (what else the wait checks — a copy
    /// running past its grace — changes without a completion). A host copy takes microseconds:
    /// a caller waiting every iteration, like `kvbm replay`, should not sleep a fixed 200 µs.
    fn wait_for_a_completion(&self, seen: usize) {
        let pause = Duration::from_micros(200);
        let mut active = self.shared.active.lock();
        if active.all != seen {
            return;
        }
        if active.all == 0 {
            drop(active);
            std::thread::sleep(pause);
            return;
        }
        let _ = self.shared.active_done.wait_for(&mut active, pause);
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
    }
}

/// An operation checked on the engine's thread, to be started on the worker's runtime.
struct Job {
    /// Run on the engine's thread when submitted ([`Job::run_here`]), not on the runtime.
    inline: bool,
    engine: TransferEngine,
    src: Arc<dyn StorageTier>,
    /// The destination tier, or its fence for a load from a tier doing I/O.
    target: Arc<dyn StorageTier>,
    pairs: Vec<(usize, usize)>,
    /// A load from a tier doing I/O writes the device through this, and has `deadline`.
    fence: Option<Arc<FencedDevice>>,
    /// The pairs again, kept only for a fenced load (to name its failed pairs if abandoned).
    fence_pairs: Vec<(usize, usize)>,
    kinds: (TierKind, TierKind),
    bytes_per_block: usize,
    deadline: Duration,
    done: OpDone,
}

impl Job {
    /// Copies on the calling thread and completes the operation (a copy between two memory
    /// tiers: no fence, no deadline).
    fn run_here(self, shared: &Shared, outbox: &Arc<Outbox>) {
        let outcome = self
            .engine
            .copy_here(self.src.as_ref(), self.target.as_ref(), &self.pairs);
        complete(shared, outbox, self.done, Ok(outcome));
    }

    /// Starts the transfer on `runtime` and a task that completes the operation when it ends.
    fn start(self, runtime: &tokio::runtime::Handle, shared: Arc<Shared>, outbox: Arc<Outbox>) {
        let Job {
            inline: _,
            engine,
            src,
            target,
            pairs,
            fence,
            fence_pairs,
            kinds,
            bytes_per_block,
            deadline,
            done,
        } = self;
        let h = engine.start_on(runtime, src, target, pairs);
        runtime.spawn(async move {
            let outcome = match fence {
                None => h.await,
                Some(fence) => match tokio::time::timeout(deadline, h).await {
                    Ok(outcome) => outcome,
                    // The transfer runs on (dropping its handle does not stop it), but
                    // nothing it reads reaches the device any more.
                    Err(_) => Ok(abandoned(
                        kinds,
                        bytes_per_block,
                        &fence_pairs,
                        &fence.close(),
                        deadline,
                    )),
                },
            };
            complete(&shared, &outbox, done, outcome);
        });
    }
}

struct OpDone {
    op: OperationId,
    request: Option<RequestId>,
    direction: Direction,
    touches_device: bool,
    /// Counted as off-device in [`Active`] at submission (kept as submitted).
    off_device: bool,
    /// Counted as a write-behind to the remote store in [`Active`].
    behind: bool,
    /// Counted as a load from the remote store in [`Active`] and the request's slot.
    remote_load: bool,
    reads_device: bool,
    writes_device: bool,
    dst_blocks: Vec<usize>,
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

fn complete(shared: &Shared, outbox: &Arc<Outbox>, done: OpDone, outcome: Result<TransferOutcome>) {
    if let Ok(o) = &outcome {
        shared
            .metrics
            .record_transfer(o.src, o.dst, o.blocks as u64, o.bytes);
        let mut paths = shared.paths.lock();
        match paths.iter_mut().find(|p| p.src == o.src && p.dst == o.dst) {
            Some(p) => {
                p.blocks += o.blocks as u64;
                p.bytes += o.bytes;
                p.busy += o.elapsed;
            }
            None => paths.push(PathStats {
                src: o.src,
                dst: o.dst,
                blocks: o.blocks as u64,
                bytes: o.bytes,
                busy: o.elapsed,
            }),
        }
    }
    let (failed, error): (Vec<usize>, Option<String>) = match outcome {
        Ok(o) if o.is_ok() => (Vec::new(), None),
        Ok(o) => {
            let first = o.failed.first().map(|f| f.error.to_string());
            (o.failed.iter().map(|f| f.dst_block).collect(), first)
        }
        Err(e) => (done.dst_blocks.clone(), Some(e.to_string())),
    };
    if let Some(e) = &error {
        tracing::debug!(op = %done.op, failed = failed.len(), error = %e, "operation failed");
        if let Some(n) = shared.failure_warn.lock().event(failed.len() as u64) {
            tracing::warn!(op = %done.op, direction = ?done.direction, blocks = n, error = %e, "kvbm: block transfers failed (rate-limited; count since the last warning)");
        }
    }
    // Queue it for the leader first: the engine learns the operation is done (below) only in
    // `get_finished`, which sends the queue before it returns, so a later match can already
    // find what it stored.
    outbox.push(Completion {
        op: done.op,
        failed_dst_blocks: failed.clone(),
        error,
    });
    {
        let mut st = shared.state.lock();
        let st = &mut *st;
        // Only device blocks are the engine's to recompute. A request's wait in its slot until
        // `get_finished` reports its load done (the engine reads them right after that call: one
        // completing in between must not reach it an iteration before its request's end).
        if done.writes_device && !failed.is_empty() {
            match done.request.as_ref().and_then(|id| st.slots.get_mut(id)) {
                Some(s) => s.load_errors.extend(failed.iter().copied()),
                None => {
                    st.load_errors.extend(failed.iter().copied());
                    if let Some(id) = &done.request {
                        st.failed_loads.insert(id.clone());
                    }
                }
            }
        }
        if let Some(id) = &done.request {
            if let Some(s) = st.slots.get_mut(id) {
                if done.touches_device {
                    s.device_ops = s.device_ops.saturating_sub(1);
                }
                if done.direction == Direction::Load {
                    s.loads = s.loads.saturating_sub(1);
                }
                if done.remote_load {
                    s.remote_loads = s.remote_loads.saturating_sub(1);
                }
            }
        }
    }
    if done.reads_device {
        let mut n = shared.device_reads.lock();
        *n = n.saturating_sub(1);
        shared.device_reads_done.notify_all();
    }
    let settled = {
        let mut active = shared.active.lock();
        active.all = active.all.saturating_sub(1);
        if done.off_device {
            active.off_device.remove(&done.op);
        }
        if done.behind {
            active.behind = active.behind.saturating_sub(1);
        }
        if done.remote_load {
            active.remote_loads = active.remote_loads.saturating_sub(1);
        }
        active.all == 0
    };
    if settled {
        outbox.settled();
    }
    shared.active_done.notify_all();
}

/// The outcome of a load abandoned at its `deadline`: the device blocks in `written` are loaded,
/// every other pair failed with [`ErrorKind::Timeout`].
fn abandoned(
    (src, dst): (TierKind, TierKind),
    bytes_per_block: usize,
    pairs: &[(usize, usize)],
    written: &HashSet<usize>,
    deadline: Duration,
) -> TransferOutcome {
    let failed: Vec<BlockFailure> = pairs
        .iter()
        .filter(|(_, d)| !written.contains(d))
        .map(|&(s, d)| BlockFailure {
            src_block: s,
            dst_block: d,
            error: Error::new(
                ErrorKind::Timeout,
                format!(
                    "load missed its deadline of {:.1}s (transfer.load_timeout_secs); the engine recomputes the block",
                    deadline.as_secs_f64()
                ),
            )
            .with("src_tier", src)
            .with("src_block", s)
            .with("dst_block", d),
        })
        .collect();
    let blocks = pairs.len() - failed.len();
    TransferOutcome {
        src,
        dst,
        blocks,
        bytes: blocks as u64 * bytes_per_block as u64,
        failed,
        elapsed: deadline,
    }
}

type Sides = (Option<Arc<dyn StorageTier>>, Option<Arc<dyn StorageTier>>);

/// The source and destination tiers of `op` on this worker: its own tiers, or, for a side that
/// is the remote store, that operation's view of it ([`RemoteSource`] for a load, keyed by the
/// pairs' source index, each read batch bounded by `deadlines.0` (`remote.load_timeout_ms`);
/// [`RemoteSink`] for a write, keyed by their destination index, each batch bounded by
/// `deadlines.1` (`remote.io_timeout_ms`)).
fn remote_sides(
    tiers: &WorkerTiers,
    op: &dyn Operation,
    rank: usize,
    deadlines: (Duration, Duration),
) -> Result<Sides> {
    let t = op.transfer();
    if t.src != TierKind::Remote && t.dst != TierKind::Remote {
        return Ok((tiers.get(t.src).cloned(), tiers.get(t.dst).cloned()));
    }
    let Some(store) = tiers.remote.clone() else {
        return Err(Error::unsupported(
            "an operation on the remote tier, but this worker has no remote store (remote.url / KVBM_REMOTE_URL)",
        ));
    };
    let keys = op.block_keys().to_vec();
    let idx = |p: &(usize, usize)| if t.src == TierKind::Remote { p.0 } else { p.1 };
    if let Some(bad) = t.pairs.iter().map(idx).find(|&k| k >= keys.len()) {
        return Err(Error::out_of_range("remote key index", bad, keys.len()));
    }
    if t.src == TierKind::Remote {
        let dims = *tiers.device.layout().dims();
        let src: Arc<dyn StorageTier> =
            Arc::new(RemoteSource::new(store, rank, keys, dims, deadlines.0)?);
        Ok((Some(src), tiers.get(t.dst).cloned()))
    } else {
        let Some(host) = tiers.get(t.src).cloned() else {
            return Ok((None, None));
        };
        let dims = *host.layout().dims();
        let dst: Arc<dyn StorageTier> =
            Arc::new(RemoteSink::new(store, rank, keys, dims, deadlines.1)?);
        Ok((Some(host), Some(dst)))
    }
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
