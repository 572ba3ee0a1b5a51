//! A leader + worker rig over the in-process transport, shared by the core-level tests.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_connector::backends::memory::MemoryTier;
use kvbm_connector::backends::StandardTiers;
use kvbm_connector::connector::adapter::Engine;
use kvbm_connector::connector::adapter::{ScheduledRequest, ScheduledTokens, SchedulerStep};
use kvbm_connector::connector::leader::{Leader, RequestInfo};
use kvbm_connector::connector::transport::LeaderTransport;
use kvbm_connector::connector::transport::{in_process, WorkerTransport};
use kvbm_connector::connector::worker::{TierFactory, Worker};
use kvbm_connector::connector::RequestId;
use kvbm_connector::connector::{Blocking, InitMode, NonBlocking};
use kvbm_connector::layout::BlockOrder;
use kvbm_connector::{Config, Layout, LayoutDims, Result, StorageTier, StorageTierExt, TierKind};

/// A test engine with the init modes `L` (leader) and `W` (workers): the core tests cover every
/// pairing, where a real engine declares one.
pub struct TestEngine<L, W>(std::marker::PhantomData<(L, W)>);

impl<L: InitMode, W: InitMode> Engine for TestEngine<L, W> {
    type Adapter = ScheduledTokens;
    type LeaderInit = L;
    type WorkerInit = W;
}

/// A core worker running its barrier as `_mode` says, whose tiers the backends' standard
/// factory builds.
pub fn new_worker<W: InitMode>(
    config: Config,
    world_size: usize,
    transport: Arc<dyn WorkerTransport>,
    _mode: W,
) -> Result<Worker> {
    Worker::new::<TestEngine<NonBlocking, W>>(
        config,
        world_size,
        transport,
        StandardTiers::shared(),
    )
}

/// A core leader (offload by scheduled tokens) running its barrier as `_mode` says.
pub fn new_leader<L: InitMode>(
    config: Config,
    page_size: usize,
    transport: Arc<dyn LeaderTransport>,
    _mode: L,
) -> Result<Leader<ScheduledTokens>> {
    Leader::new::<TestEngine<L, Blocking>>(ScheduledTokens, config, page_size, transport)
}

pub const BS: usize = 4;
pub const DEVICE_BLOCKS: usize = 32;

pub fn dims() -> LayoutDims {
    LayoutDims {
        num_layers: 2,
        outer_dim: 2,
        page_size: BS,
        inner_dim: 8,
        dtype_bytes: 2,
    }
}

/// The KV a model would compute for block `block` of `tokens`: a function of the whole prefix.
pub fn image(tokens: &[u32], block: usize) -> Vec<u8> {
    let end = (block + 1) * BS;
    let mut h: u64 = 1469598103934665603;
    for t in &tokens[..end] {
        h = (h ^ u64::from(*t)).wrapping_mul(1099511628211);
    }
    (0..dims().bytes_per_block())
        .map(|i| (h.wrapping_add(i as u64 * 31) >> 7) as u8)
        .collect()
}

pub fn config(dir: &std::path::Path, host: usize, disk: usize) -> Config {
    let mut config = Config::default();
    config.host.cache_blocks = Some(host);
    config.disk.cache_blocks = Some(disk);
    config.disk.dir = dir.to_path_buf();
    config.init_timeout_secs = 10.0;
    config
}

pub fn device() -> Arc<dyn StorageTier> {
    Arc::new(
        MemoryTier::new(
            TierKind::Device,
            Layout::layer_separate(dims(), DEVICE_BLOCKS, BlockOrder::OuterMajor).unwrap(),
        )
        .unwrap(),
    )
}

pub fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

pub struct Rig {
    pub leader: Leader<ScheduledTokens>,
    pub worker: Worker,
    pub device: Arc<dyn StorageTier>,
    pub dir: tempfile::TempDir,
}

pub fn rig(host: usize, disk: usize) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), host, disk);
    rig_with(config, dir)
}

/// A rig over `config`; `dir` (the disk tier's directory) lives as long as the rig.
pub fn rig_with(config: Config, dir: tempfile::TempDir) -> Rig {
    rig_with_factory(config, dir, StandardTiers::shared())
}

/// A rig over `config` whose worker's tiers `factory` builds (and the leader's remote store,
/// when `remote.url` is set).
pub fn rig_with_factory(
    config: Config,
    dir: tempfile::TempDir,
    factory: Arc<dyn TierFactory>,
) -> Rig {
    rig_of_engine::<TestEngine<Blocking, Blocking>>(config, dir, factory)
}

/// As [`rig_with_factory`], with the leader of engine `E` (its `DEFERRED_MATCH` matters).
pub fn rig_of_engine<E: Engine<Adapter = ScheduledTokens>>(
    config: Config,
    dir: tempfile::TempDir,
    factory: Arc<dyn TierFactory>,
) -> Rig {
    let (lt, wts) = in_process(1);
    let device = device();
    let mut worker = new_worker(config.clone(), 1, wts[0].clone(), NonBlocking).unwrap();
    worker.set_tier_factory(factory.clone()).unwrap();
    worker.register(device.clone()).unwrap();
    let mut leader = Leader::new::<E>(ScheduledTokens, config, BS, lt).unwrap();
    leader.set_tier_factory(factory);
    wait_until("leader ready", || leader.is_ready());
    wait_until("worker ready", || worker.is_ready());
    Rig {
        leader,
        worker,
        device,
        dir,
    }
}

pub fn info<'a>(id: &'a RequestId, tokens: &'a [u32]) -> RequestInfo<'a> {
    RequestInfo {
        id,
        tokens,
        cache_salt: None,
        lora_name: None,
    }
}

pub fn prefill(id: &RequestId, computed: usize, scheduled: usize) -> ScheduledRequest {
    ScheduledRequest {
        request_id: id.clone(),
        num_computed_tokens: computed,
        num_scheduled_tokens: Some(scheduled),
        ..Default::default()
    }
}

impl Rig {
    /// One iteration: metadata, loads, the model writing `writes` (tokens, block, device block),
    /// stores; waits for the worker and applies completions. Returns get_finished's answer.
    pub fn step(
        &mut self,
        step: SchedulerStep,
        writes: &[(&[u32], usize, usize)],
        finished: &[RequestId],
    ) -> (Vec<RequestId>, Vec<RequestId>) {
        self.execute(&step, writes);
        self.worker.wait_idle(Duration::from_secs(10)).unwrap();
        self.leader.process_completions();
        self.worker.get_finished(finished, None)
    }

    /// As [`Rig::step`] up to the wait, which is `kvbm replay`'s: `Worker::wait_idle_or_stuck`
    /// within `timeout` (write-behind to the remote store and loads from it keep running);
    /// then applies completions. Returns the wait's outcome; calls no `get_finished`.
    pub fn step_as_replay(
        &mut self,
        step: &SchedulerStep,
        writes: &[(&[u32], usize, usize)],
        timeout: Duration,
    ) -> kvbm_connector::Result<()> {
        self.execute(step, writes);
        let waited = self
            .worker
            .wait_idle_or_stuck(timeout, Duration::from_secs(60));
        self.leader.process_completions();
        waited
    }

    /// Builds and binds the step's metadata, starts its loads, writes the model's KV and starts
    /// the stores.
    fn execute(&mut self, step: &SchedulerStep, writes: &[(&[u32], usize, usize)]) {
        let bytes = self.leader.build_connector_meta(step).unwrap();
        self.worker.bind_metadata(&bytes).unwrap();
        self.worker.start_load().unwrap();
        for (tokens, block, device_block) in writes {
            self.device
                .write_block_from_slice(*device_block, &image(tokens, *block))
                .unwrap();
        }
        self.worker.save().unwrap();
    }

    /// Runs request `id` cold through prefill on device blocks `blocks`, then finishes it and lets
    /// every store complete.
    pub fn offload(&mut self, id: &RequestId, tokens: &[u32], blocks: &[usize]) {
        let m = self
            .leader
            .get_num_new_matched_tokens(info(id, tokens), 0)
            .unwrap();
        assert_eq!(m.external_tokens, 0, "expected a cold request");
        self.leader.update_state_after_alloc(id, blocks, 0).unwrap();
        let full = tokens.len() / BS;
        let writes: Vec<(&[u32], usize, usize)> =
            (0..full).map(|b| (tokens, b, blocks[b])).collect();
        let step = SchedulerStep {
            requests: vec![prefill(id, 0, tokens.len())],
            ..Default::default()
        };
        self.step(step, &writes, &[]);
        self.leader.request_finished(id, None, None).unwrap();
        // Drain: stores to host, then host -> disk.
        for _ in 0..3 {
            self.step(SchedulerStep::default(), &[], std::slice::from_ref(id));
        }
    }

    /// Admits cold request `id` with `tokens` into device `blocks` and builds the metadata of its
    /// whole prefill without executing it: its stores are in flight (not yet run by any worker)
    /// when the caller finishes the request. Returns that metadata.
    pub fn prefill_unexecuted(
        &mut self,
        id: &RequestId,
        tokens: &[u32],
        blocks: &[usize],
    ) -> Vec<u8> {
        self.leader
            .get_num_new_matched_tokens(info(id, tokens), 0)
            .unwrap();
        self.leader.update_state_after_alloc(id, blocks, 0).unwrap();
        self.leader
            .build_connector_meta(&SchedulerStep {
                requests: vec![prefill(id, 0, tokens.len())],
                ..Default::default()
            })
            .unwrap()
    }

    /// Matches `tokens` as request `id`, loads into `blocks`, and checks every loaded block's bytes.
    /// Returns the number of tokens loaded.
    pub fn onboard(&mut self, id: &RequestId, tokens: &[u32], blocks: &[usize]) -> usize {
        for &b in blocks {
            self.device
                .write_block_from_slice(b, &vec![0xEE; dims().bytes_per_block()])
                .unwrap();
        }
        let m = self
            .leader
            .get_num_new_matched_tokens(info(id, tokens), 0)
            .unwrap();
        self.leader
            .update_state_after_alloc(id, blocks, m.external_tokens)
            .unwrap();
        if m.external_tokens == 0 {
            return 0;
        }
        let mut loaded = Vec::new();
        for _ in 0..3 {
            let (_, l) = self.step(SchedulerStep::default(), &[], &[]);
            loaded.extend(l);
            if !loaded.is_empty() {
                break;
            }
        }
        assert_eq!(loaded, vec![id.clone()]);
        for (k, &dev) in blocks.iter().enumerate().take(m.external_tokens / BS) {
            assert_eq!(
                self.device.read_block_to_vec(dev).unwrap(),
                image(tokens, k),
                "loaded block {k} differs"
            );
        }
        m.external_tokens
    }
}
