//! The GPU-process side of the simulated engine: one per tensor-parallel rank.
//!
//! The engine stand-in (scheduler process) sends each rank one [`StepCommand`] per iteration —
//! the connector metadata, the freed blocks to clobber, and the KV the model computes this step —
//! and the rank runs the framework's worker calls in order (bind, start loads, per layer: wait for
//! the layer, write its KV, save it; wait for save; get_finished). It answers with the requests
//! done on this rank and the device blocks whose loads failed. [`Verify`] compares onboarded device
//! blocks with what the model computes for this rank's shard.
//!
//! A rank runs in the engine's process ([`LocalRank`]) or in a child process (`kvbm worker`),
//! reached over a small length-prefixed JSON channel on loopback ([`RemoteRank`], [`serve`]). The
//! channel is the simulated engine's own RPC (what TensorRT-LLM does with MPI and vLLM with its
//! executor); the connector's leader ↔ worker traffic runs over its own transport.

use std::collections::HashSet;
use std::io::{IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::backends::memory::MemoryTier;
use crate::config::Config;
use crate::connector::barrier::InitMode;
use crate::connector::transport::WorkerTransport;
use crate::error::{Error, ErrorKind, Result};
use crate::frameworks::{trtllm, vllm};
use crate::layout::{BlockOrder, Layout, LayoutDims};
use crate::tier::{StorageTier, TierKind};

use super::sim::Framework;

/// KV the model computes for consecutive tokens of one device block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockWrite {
    /// Device block.
    pub block: usize,
    /// Slot (token index inside the block) of the first token.
    pub first_slot: usize,
    /// Prefix hash of each token written (the model's KV is a function of it).
    pub hashes: Vec<u64>,
}

/// One iteration for one rank.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepCommand {
    /// The leader's metadata bytes.
    pub metadata: Vec<u8>,
    /// Freed device blocks to overwrite with junk once the metadata is bound.
    pub clobber: Vec<usize>,
    /// The KV computed this iteration.
    pub writes: Vec<BlockWrite>,
    /// Requests the engine reports finished (vLLM: all finished last step; TensorRT-LLM: those
    /// held for saving).
    pub finished: Vec<String>,
    /// TensorRT-LLM: requests that started loading.
    pub started_loading: Vec<String>,
}

/// One rank's answer to a [`StepCommand`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepReply {
    /// Finished requests whose device blocks this rank no longer needs.
    pub released: Vec<String>,
    /// Requests whose loads finished on this rank.
    pub loaded: Vec<String>,
    /// Device blocks whose loads failed on this rank.
    pub load_errors: Vec<usize>,
}

/// Blocks to verify: (device block, prefix hash of each of its tokens).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verify {
    /// The blocks.
    pub blocks: Vec<(usize, Vec<u64>)>,
}

/// What a rank reports at the end.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RankStats {
    /// Per tier pair: (src, dst, blocks, bytes, busy seconds).
    pub paths: Vec<(TierKind, TierKind, u64, u64, f64)>,
}

/// Requests to a rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RankRequest {
    /// Run one iteration.
    Step(StepCommand),
    /// Compare blocks with the model's KV; answers the number of mismatches.
    Verify(Verify),
    /// Let background transfers finish and report statistics.
    Finish,
}

/// Answers of a rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RankResponse {
    /// To `Step`.
    Step(StepReply),
    /// To `Verify`: mismatching blocks.
    Verified(usize),
    /// To `Finish`.
    Finished(RankStats),
    /// The request failed on the rank.
    Error(String),
}

/// How the engine reaches one rank.
pub trait RankDriver: Send {
    /// Runs one iteration.
    fn step(&mut self, cmd: &StepCommand) -> Result<StepReply>;
    /// Counts blocks that differ from the model's KV.
    fn verify(&mut self, v: &Verify) -> Result<usize>;
    /// Drains and reports.
    fn finish(&mut self) -> Result<RankStats>;
}

/// The model shard of one rank, and how its KV bytes are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    /// This rank.
    pub rank: usize,
    /// Block dimensions of this rank's shard.
    pub dims: LayoutDims,
}

impl Shard {
    fn token_bytes(&self) -> usize {
        self.dims.inner_dim * self.dims.dtype_bytes
    }

    /// The KV of the token whose prefix hash is `h`, for run `run` (layer × outer + kv).
    pub fn kv_bytes(&self, h: u64, run: usize, out: &mut [u8]) {
        let salt = (self.rank as u64 + 1).wrapping_mul(0xd6e8_feb8_6659_fd93);
        let mut z = h ^ salt ^ ((run as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        for chunk in out.chunks_mut(8) {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^= x >> 31;
            let b = x.to_le_bytes();
            chunk.copy_from_slice(&b[..chunk.len()]);
        }
    }

    /// The canonical image of a block whose tokens have prefix hashes `hashes`.
    pub fn expected_block(&self, hashes: &[u64]) -> Vec<u8> {
        let d = self.dims;
        let tb = self.token_bytes();
        let run = d.region_bytes();
        let mut img = vec![0u8; d.bytes_per_block()];
        for r in 0..d.regions_per_block() {
            for (t, &h) in hashes.iter().enumerate().take(d.page_size) {
                let at = r * run + t * tb;
                self.kv_bytes(h, r, &mut img[at..at + tb]);
            }
        }
        img
    }
}

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
type GpuBuffers = Vec<crate::backends::cuda::DeviceBuffer>;
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
            use crate::backends::cuda::{CudaDevice, CudaDeviceTier};
            use crate::layout::KvLayout;
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

enum FrameworkWorker {
    Trt(Box<trtllm::TrtllmWorker>),
    Vllm(Box<vllm::VllmWorker>),
}

/// Runs iterations on one rank: the framework's worker, its device tier and the model shard.
pub struct RankExecutor {
    shard: Shard,
    device: Arc<dyn StorageTier>,
    worker: FrameworkWorker,
    layer_names: Vec<String>,
    scratch: Vec<u8>,
    /// Declared last: dropped after the worker and the device tier that use it.
    _gpu: GpuBuffers,
}

/// Name of layer `l` in the simulated vLLM model.
pub fn layer_name(l: usize) -> String {
    format!("model.layers.{l}.self_attn.attn")
}

impl RankExecutor {
    /// Creates the rank's device tier (its shard, laid out as `framework` lays out its cache),
    /// builds the framework's worker over `transport` and registers the cache (TensorRT-LLM:
    /// blocking; vLLM: non-blocking — the barrier then completes in the background).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        framework: Framework,
        device_kind: DeviceKind,
        config: Config,
        shard: Shard,
        num_blocks: usize,
        world_size: usize,
        transport: Arc<dyn WorkerTransport>,
    ) -> Result<Self> {
        let d = shard.dims;
        let heads_dim = d.inner_dim;
        let layer_names: Vec<String> = (0..d.num_layers).map(layer_name).collect();
        let layout = match framework {
            Framework::Trtllm => Layout::fully_contiguous(d, num_blocks)?,
            Framework::Vllm => Layout::layer_separate(d, num_blocks, BlockOrder::OuterMajor)?,
        };
        let (device, gpu) = device_tier(device_kind, layout)?;
        let worker = match framework {
            Framework::Trtllm => {
                let mut w = trtllm::TrtllmWorker::with_mode(
                    config,
                    d.page_size,
                    world_size,
                    transport,
                    InitMode::Blocking,
                )?;
                w.register_kv_caches(
                    &[num_blocks, d.num_layers, 2, d.page_size * heads_dim],
                    d.dtype_bytes,
                    device.clone(),
                )?;
                FrameworkWorker::Trt(Box::new(w))
            }
            Framework::Vllm => {
                let mut w = vllm::VllmWorker::with_mode(
                    config,
                    d.page_size,
                    world_size,
                    transport,
                    InitMode::NonBlocking,
                )?;
                let layers: Vec<(String, Vec<usize>)> = layer_names
                    .iter()
                    .map(|n| (n.clone(), vec![2, num_blocks, d.page_size, heads_dim]))
                    .collect();
                w.register_kv_caches(
                    &layers,
                    d.dtype_bytes,
                    Some(num_blocks),
                    None,
                    device.clone(),
                )?;
                FrameworkWorker::Vllm(Box::new(w))
            }
        };
        Ok(Self {
            scratch: vec![0u8; shard.token_bytes()],
            shard,
            device,
            worker,
            layer_names,
            _gpu: gpu,
        })
    }

    /// True once the worker finished its start-up barrier.
    pub fn is_ready(&self) -> bool {
        match &self.worker {
            FrameworkWorker::Trt(w) => w.worker().is_ready(),
            FrameworkWorker::Vllm(w) => w.worker().is_ready(),
        }
    }

    /// The start-up error, if any.
    pub fn init_error(&self) -> Option<Error> {
        match &self.worker {
            FrameworkWorker::Trt(w) => w.worker().init_error(),
            FrameworkWorker::Vllm(w) => w.worker().init_error(),
        }
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

    /// Runs one iteration in the framework's call order.
    pub fn step(&mut self, cmd: &StepCommand) -> Result<StepReply> {
        match &mut self.worker {
            FrameworkWorker::Trt(w) => w.bind_connector_meta(&cmd.metadata)?,
            FrameworkWorker::Vllm(w) => w.bind_connector_metadata(&cmd.metadata)?,
        }
        // Freed blocks are rewritten only after the stores that read them finished (the bind
        // above waited for them) and before loads start writing reused ones.
        self.clobber(&cmd.clobber)?;
        match &mut self.worker {
            FrameworkWorker::Trt(w) => w.start_load_kv()?,
            FrameworkWorker::Vllm(w) => w.start_load_kv()?,
        }
        for l in 0..self.shard.dims.num_layers {
            match &mut self.worker {
                FrameworkWorker::Trt(w) => w.wait_for_layer_load(l)?,
                FrameworkWorker::Vllm(w) => w.wait_for_layer_load(&self.layer_names[l])?,
            }
            self.write_layer(l, &cmd.writes)?;
            match &mut self.worker {
                FrameworkWorker::Trt(w) => w.save_kv_layer(l)?,
                FrameworkWorker::Vllm(w) => w.save_kv_layer(&self.layer_names[l])?,
            }
        }
        // The replay is deterministic: this iteration's transfers finish (and their completions
        // are on their way to the leader) before the engine hears what finished.
        match &mut self.worker {
            FrameworkWorker::Trt(w) => {
                w.wait_for_save()?;
                w.worker().wait_idle(Duration::from_secs(60))?;
            }
            FrameworkWorker::Vllm(w) => {
                w.wait_for_save()?;
                w.worker().wait_idle(Duration::from_secs(60))?;
            }
        }
        let reply = match &mut self.worker {
            FrameworkWorker::Trt(w) => {
                let ids = |v: &[String]| -> Vec<u64> {
                    v.iter().filter_map(|s| s.parse().ok()).collect()
                };
                let (saved, loaded) =
                    w.get_finished(&ids(&cmd.finished), &ids(&cmd.started_loading));
                StepReply {
                    released: saved.iter().map(u64::to_string).collect(),
                    loaded: loaded.iter().map(u64::to_string).collect(),
                    load_errors: w.get_block_ids_with_load_errors(),
                }
            }
            FrameworkWorker::Vllm(w) => {
                let finished: HashSet<String> = cmd.finished.iter().cloned().collect();
                let (sending, recving) = w.get_finished(&finished);
                let mut errors: Vec<usize> =
                    w.get_block_ids_with_load_errors().into_iter().collect();
                errors.sort_unstable();
                w.clear_connector_metadata()?;
                let sorted = |s: Option<HashSet<String>>| -> Vec<String> {
                    let mut v: Vec<String> = s.unwrap_or_default().into_iter().collect();
                    v.sort();
                    v
                };
                StepReply {
                    released: sorted(sending),
                    loaded: sorted(recving),
                    load_errors: errors,
                }
            }
        };
        Ok(reply)
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
        let worker = match &self.worker {
            FrameworkWorker::Trt(w) => w.worker(),
            FrameworkWorker::Vllm(w) => w.worker(),
        };
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

// ------------------------------------------------------------------------------------------------
// The engine channel: u32 big-endian length + JSON, over loopback TCP
// ------------------------------------------------------------------------------------------------

/// Largest frame on the engine channel.
const MAX_FRAME: usize = 256 << 20;

/// Writes one frame.
pub fn write_frame<T: Serialize>(stream: &mut TcpStream, value: &T) -> Result<()> {
    let body = serde_json::to_vec(value)
        .map_err(|e| Error::internal(format!("cannot encode a frame: {e}")))?;
    let len = u32::try_from(body.len()).map_err(|_| Error::invalid_argument("frame too large"))?;
    stream
        .write_all(&len.to_be_bytes())
        .and_then(|()| stream.write_all(&body))
        .map_err(|e| Error::io("write to the engine channel", e))
}

/// Reads one frame.
pub fn read_frame<T: for<'de> Deserialize<'de>>(stream: &mut TcpStream) -> Result<T> {
    let mut len = [0u8; 4];
    stream
        .read_exact(&mut len)
        .map_err(|e| Error::new(ErrorKind::Cancelled, format!("engine channel closed: {e}")))?;
    let n = u32::from_be_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(Error::new(
            ErrorKind::Decode,
            format!("engine frame of {n} bytes is too large"),
        ));
    }
    let mut body = vec![0u8; n];
    stream
        .read_exact(&mut body)
        .map_err(|e| Error::new(ErrorKind::Cancelled, format!("engine channel closed: {e}")))?;
    serde_json::from_slice(&body)
        .map_err(|e| Error::new(ErrorKind::Decode, format!("malformed engine frame: {e}")))
}

/// A rank in a child process, reached over the engine channel.
pub struct RemoteRank {
    /// The rank.
    pub rank: usize,
    stream: TcpStream,
}

impl RemoteRank {
    /// Wraps an accepted connection.
    pub fn new(rank: usize, stream: TcpStream) -> Self {
        Self { rank, stream }
    }

    fn call(&mut self, req: &RankRequest) -> Result<RankResponse> {
        write_frame(&mut self.stream, req)?;
        match read_frame::<RankResponse>(&mut self.stream)? {
            RankResponse::Error(e) => Err(Error::new(
                ErrorKind::Internal,
                format!("rank {}: {e}", self.rank),
            )),
            other => Ok(other),
        }
    }
}

fn unexpected(rank: usize) -> Error {
    Error::new(
        ErrorKind::Decode,
        format!("rank {rank} answered out of turn"),
    )
}

impl RankDriver for RemoteRank {
    fn step(&mut self, cmd: &StepCommand) -> Result<StepReply> {
        match self.call(&RankRequest::Step(cmd.clone()))? {
            RankResponse::Step(r) => Ok(r),
            _ => Err(unexpected(self.rank)),
        }
    }
    fn verify(&mut self, v: &Verify) -> Result<usize> {
        match self.call(&RankRequest::Verify(v.clone()))? {
            RankResponse::Verified(n) => Ok(n),
            _ => Err(unexpected(self.rank)),
        }
    }
    fn finish(&mut self) -> Result<RankStats> {
        match self.call(&RankRequest::Finish)? {
            RankResponse::Finished(s) => Ok(s),
            _ => Err(unexpected(self.rank)),
        }
    }
}

/// Serves engine requests on `stream` until the engine closes it or sends `Finish`.
pub fn serve(mut exec: RankExecutor, mut stream: TcpStream) -> Result<()> {
    loop {
        let req: RankRequest = match read_frame(&mut stream) {
            Ok(r) => r,
            Err(e) if e.kind() == ErrorKind::Cancelled => return Ok(()),
            Err(e) => return Err(e),
        };
        let (resp, last) = match req {
            RankRequest::Step(cmd) => (exec.step(&cmd).map(RankResponse::Step), false),
            RankRequest::Verify(v) => (exec.verify(&v).map(RankResponse::Verified), false),
            RankRequest::Finish => (exec.finish().map(RankResponse::Finished), true),
        };
        let resp = resp.unwrap_or_else(|e| RankResponse::Error(e.to_string()));
        write_frame(&mut stream, &resp)?;
        if last {
            return Ok(());
        }
    }
}
