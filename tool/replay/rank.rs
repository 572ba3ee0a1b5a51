//! The GPU-process side of the simulated engine: one [`RankExecutor`] per tensor-parallel rank.
//!
//! The engine stand-in (scheduler process) sends each rank [`StepCommand`]s — the connector
//! metadata, the freed blocks to clobber, and the KV the model computes this step — and the rank
//! runs the engine's worker calls in order (bind, start loads, per layer: wait for the layer,
//! write its KV, save it; wait for save; get_finished) through the engine's [`WorkerSide`]: vLLM
//! in one command per step, TensorRT-LLM in two (`get_finished` after the scheduler finished
//! requests) or, with nothing scheduled, only `get_finished`. It answers with the requests done on this rank and
//! the device blocks whose loads failed, and compares onboarded device blocks with what the model
//! computes for this rank's shard.
//!
//! A rank runs in the engine's process ([`LocalRank`]) or in a child process (`kvbm worker`,
//! reached over the engine channel, `channel.rs`).

use std::io::IoSliceMut;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use kvbm_connector::backends::memory::MemoryTier;
use kvbm_connector::config::Config;
use kvbm_connector::connector::transport::WorkerTransport;
use kvbm_connector::connector::worker::TierFactory;
use kvbm_connector::error::{Error, Result};
use kvbm_connector::layout::Layout;
use kvbm_connector::tier::{StorageTier, TierKind};

use super::engines::{engine_of, WorkerSide};
use super::framework::Framework;
use super::messages::{BlockWrite, RankDriver, RankStats, StepCommand, StepReply, Verify};
use super::model::Shard;

/// Writes `bytes` at canonical offset `at` of a block lent as segments.
fn write_canonical(segs: &mut [IoSliceMut<'_>], mut at: usize, mut bytes: &[u8]) {
    for s in segs.iter_mut() {
        if bytes.is_empty() {
            return;
        }
        if at >= s.len() {
            at -= s.len();
            continue;
        }
        let n = (s.len() - at).min(bytes.len());
        s[at..at + n].copy_from_slice(&bytes[..n]);
        bytes = &bytes[n..];
        at = 0;
    }
}

/// What backs the simulated engine's device cache.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    strum::Display,
    clap::ValueEnum,
    Serialize,
    Deserialize,
)]
#[strum(serialize_all = "lowercase")]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// Host memory laid out like the engine's cache (no GPU needed).
    #[default]
    Memory,
    /// Real GPU memory on GPU 0 (feature `cuda`); the host tier is then pinned.
    Cuda,
}

/// Keeps GPU allocations alive for as long as the rank runs.
#[cfg(feature = "cuda")]
type GpuBuffers = Vec<kvbm_connector::backends::cuda::DeviceBuffer>;
#[cfg(not(feature = "cuda"))]
type GpuBuffers = ();

/// The device tier of one rank, in `layout`.
fn device_tier(kind: DeviceKind, layout: Layout) -> Result<(Arc<dyn StorageTier>, GpuBuffers)> {
    match kind {
        DeviceKind::Memory => Ok((
            Arc::new(MemoryTier::new(TierKind::Device, layout)?),
            GpuBuffers::default(),
        )),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => {
            use kvbm_connector::backends::cuda::{CudaDevice, CudaDeviceTier};
            use kvbm_connector::layout::KvLayout;
            let dev = CudaDevice::open(0)?;
            let buffers = (0..layout.num_allocations())
                .map(|_| dev.alloc(layout.allocation_bytes()))
                .collect::<Result<Vec<_>>>()?;
            let ptrs: Vec<u64> = buffers.iter().map(|b| b.ptr()).collect();
            // SAFETY: the buffers are the executor's (its last field, dropped after the worker
            // and the tier) and nothing else uses them.
            let tier = unsafe { CudaDeviceTier::register(dev, layout, &ptrs)? };
            Ok((tier, buffers))
        }
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda => Err(Error::unsupported(
            "--device cuda needs kvbm built with the `cuda` feature",
        )),
    }
}

/// Runs iterations on one rank: the engine's worker, its device tier and the model shard.
pub struct RankExecutor {
    shard: Shard,
    device: Arc<dyn StorageTier>,
    worker: Box<dyn WorkerSide>,
    scratch: Vec<u8>,
    /// How long a step waits for host → disk copies (`transfer.load_timeout_secs`): a stuck disk
    /// slows a step by at most this, never by the whole freeze.
    io_grace: Duration,
    /// Declared last: dropped after the worker and the device tier that use it.
    _gpu: GpuBuffers,
}

impl RankExecutor {
    /// Creates the rank's device tier (its shard, laid out as `framework` lays out its cache),
    /// builds the engine's worker (for a model of `groups` KV-cache groups) over `transport` and
    /// registers the cache (TensorRT-LLM:
    /// blocking; vLLM: non-blocking — the barrier then completes in the background).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        framework: Framework,
        device_kind: DeviceKind,
        config: Config,
        shard: Shard,
        num_blocks: usize,
        world_size: usize,
        groups: usize,
        transport: Arc<dyn WorkerTransport>,
        tiers: Option<Arc<dyn TierFactory>>,
    ) -> Result<Self> {
        let engine = engine_of(framework);
        let io_grace = config.transfer.load_timeout();
        let d = shard.dims;
        let (device, gpu) = device_tier(device_kind, engine.cache_layout(d, num_blocks)?)?;
        let worker = engine.worker(
            config,
            d,
            num_blocks,
            world_size,
            groups,
            transport,
            device.clone(),
            tiers,
        )?;
        Ok(Self {
            scratch: vec![0u8; shard.token_bytes()],
            io_grace,
            shard,
            device,
            worker,
            _gpu: gpu,
        })
    }

    /// True once the worker finished its start-up barrier.
    pub fn is_ready(&self) -> bool {
        self.worker.worker().is_ready()
    }

    /// The start-up error, if any.
    pub fn init_error(&self) -> Option<Error> {
        self.worker.worker().init_error()
    }

    fn clobber(&self, blocks: &[usize]) -> Result<()> {
        for &b in blocks {
            self.device.with_block_mut(b, &mut |segs| {
                for s in segs.iter_mut() {
                    s.fill(0xA5);
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    fn write_layer(&mut self, l: usize, writes: &[BlockWrite]) -> Result<()> {
        let d = self.shard.dims;
        let tb = self.shard.token_bytes();
        let run = d.region_bytes();
        let shard = self.shard;
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut result = Ok(());
        for w in writes {
            result = self.device.with_block_mut(w.block, &mut |segs| {
                for (k, &h) in w.hashes.iter().enumerate() {
                    let t = w.first_slot + k;
                    if t >= d.page_size {
                        return Err(Error::invalid_argument(format!(
                            "token slot {t} is outside a {}-token block",
                            d.page_size
                        )));
                    }
                    for o in 0..d.outer_dim {
                        let reg = l * d.outer_dim + o;
                        shard.kv_bytes(h, reg, &mut scratch);
                        write_canonical(segs, reg * run + t * tb, &scratch);
                    }
                }
                Ok(())
            });
            if result.is_err() {
                break;
            }
        }
        self.scratch = scratch;
        result
    }

    /// Runs one iteration (or the part of one the command names) in the engine's call order.
    pub fn step(&mut self, cmd: &StepCommand) -> Result<StepReply> {
        if let Some(metadata) = &cmd.metadata {
            self.worker.bind_connector_meta(metadata)?;
            // Freed blocks are rewritten only after the stores that read them finished (the bind
            // above waited for them) and before loads start writing reused ones.
            self.clobber(&cmd.clobber)?;
            self.worker.start_load_kv()?;
            if cmd.forward {
                for l in 0..self.shard.dims.num_layers {
                    self.worker.wait_for_layer_load(l)?;
                    self.write_layer(l, &cmd.writes)?;
                    self.worker.save_kv_layer(l)?;
                }
                self.worker.wait_for_save()?;
            }
        }
        // The replay is deterministic: what this iteration (or, in an iteration that only
        // reports, the last `get_finished`) submitted finishes, and its completions are on their
        // way to the leader, before the engine finishes requests or hears what finished — except
        // a host → disk copy stuck past the load deadline, which finishes in the background, and
        // the remote store's writes and loads: a request loading from the store waits for it
        // while the others run (as in the engines), so a slow store delays its own hits only.
        let worker = self.worker.worker();
        worker.wait_idle_or_stuck(Duration::from_secs(60), self.io_grace)?;
        if !cmd.forward {
            // Nothing scheduled: wait a little for a remote load instead of spinning.
            worker.wait_for_remote_loads(Duration::from_millis(1));
        }
        if !cmd.report {
            return Ok(StepReply::default());
        }
        self.worker
            .get_finished(&cmd.finished, &cmd.started_loading)
    }

    /// Counts blocks whose bytes differ from the model's KV for this shard.
    pub fn verify(&mut self, v: &Verify) -> Result<usize> {
        let mut bad = 0;
        let mut buf = vec![0u8; self.shard.dims.bytes_per_block()];
        for (block, hashes) in &v.blocks {
            self.device
                .read_block(*block, &mut [IoSliceMut::new(&mut buf)])?;
            if buf != self.shard.expected_block(hashes) {
                bad += 1;
            }
        }
        Ok(bad)
    }

    /// Lets background transfers finish; reports per-path statistics.
    pub fn finish(&mut self) -> Result<RankStats> {
        let worker = self.worker.worker();
        worker.wait_idle(Duration::from_secs(60))?;
        Ok(RankStats {
            paths: worker
                .transfer_stats()
                .into_iter()
                .map(|p| (p.src, p.dst, p.blocks, p.bytes, p.busy.as_secs_f64()))
                .collect(),
        })
    }
}

/// A rank in the engine's own process.
pub struct LocalRank(pub RankExecutor);

impl RankDriver for LocalRank {
    fn step(&mut self, cmd: &StepCommand) -> Result<StepReply> {
        self.0.step(cmd)
    }
    fn verify(&mut self, v: &Verify) -> Result<usize> {
        self.0.verify(v)
    }
    fn finish(&mut self) -> Result<RankStats> {
        self.0.finish()
    }
}
