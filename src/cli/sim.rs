//! The engine stand-in behind `kvbm replay`.
//!
//! It behaves like the chosen framework's scheduler and model runner, and drives the real leader
//! and worker through that framework's adapter in its call order:
//!
//! * **vLLM**: continuous batching with a per-step token budget (chunked prefill), device blocks
//!   allocated on demand and preemption of the newest request when they run out; asynchronous
//!   loads (`WAITING_FOR_REMOTE_KVS`), a second `update_state_after_alloc` with 0 after the load,
//!   `request_finished` holding blocks until `finished_sending`.
//! * **TensorRT-LLM**: device blocks for prompt and output reserved at admission (guaranteed no
//!   evict), context chunks then generation, `RequestData` with `computed_position`,
//!   `get_finished(finished_gen_req_ids, started_loading_req_ids)`.
//!
//! The model stand-in writes, for every token it computes, deterministic KV bytes — a function of
//! the token prefix, the layer, K or V and the position — through the worker's per-layer calls
//! into a memory device tier laid out as that framework lays out its cache. Every block onboarded
//! from host or disk is compared byte for byte with what the model would have computed; the count
//! of differences is `integrity_errors`.
//!
//! Time is simulated: a step costs `prefill_us_per_token` per prompt token computed plus a tenth of
//! that per decode token; idle stretches skip to the next arrival.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::connector::transport::in_process;
use crate::error::{Error, ErrorKind, Result};
use crate::frameworks::{trtllm, vllm};
use crate::identity::{BlockHasher, HashAlgorithm, Salt};
use crate::layout::LayoutDims;
use crate::tier::TierKind;

use super::rank::{
    BlockWrite, LocalRank, RankDriver, RankExecutor, Shard, StepCommand, StepReply, Verify,
};
use super::workload::{prefix_hash_step, sample_token, TraceRequest, PREFIX_HASH_SEED};

/// Which engine to imitate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::Display, clap::ValueEnum, serde::Serialize)]
#[strum(serialize_all = "lowercase")]
#[serde(rename_all = "lowercase")]
pub enum Framework {
    /// TensorRT-LLM.
    Trtllm,
    /// vLLM.
    Vllm,
}

/// Shape of the simulated model's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ModelShape {
    /// Layers.
    pub layers: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Bytes per element.
    pub dtype_bytes: usize,
}

impl Default for ModelShape {
    fn default() -> Self {
        Self {
            layers: 4,
            kv_heads: 2,
            head_dim: 32,
            dtype_bytes: 2,
        }
    }
}

/// Everything a replay needs besides the workload.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// Engine to imitate.
    pub framework: Framework,
    /// Tokens per block.
    pub block_size: usize,
    /// Device blocks.
    pub device_blocks: usize,
    /// Requests running at once.
    pub max_batch: usize,
    /// Prompt tokens computed per step (the chunked-prefill budget).
    pub chunk_tokens: usize,
    /// The engine's own on-device prefix reuse.
    pub device_prefix_cache: bool,
    /// Simulated compute cost per prompt token, in microseconds.
    pub prefill_us_per_token: f64,
    /// The model's KV shape.
    pub model: ModelShape,
    /// Connector configuration (tier sizes, disk directory, hash, ...).
    pub config: Config,
    /// Show a progress line on stderr.
    pub progress: bool,
    /// Tensor-parallel ranks (each a worker process when more than 1).
    pub tp: usize,
    /// Fault injection: kill this rank's process at this step (multi-process runs).
    pub kill: Option<(usize, u64)>,
    /// What backs the device cache (host memory, or a real GPU with feature `cuda`).
    pub device: super::rank::DeviceKind,
}

/// Per-request outcome.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RequestReport {
    /// Request id.
    pub id: String,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens the connector matched (summed over admissions, if preempted).
    pub matched_tokens: usize,
    /// Matched tokens by tier.
    pub matched_from: MatchedFrom,
    /// Tokens the engine's own device cache provided.
    pub device_hit_tokens: usize,
    /// Tokens the model computed for this request (recomputation included).
    pub computed_tokens: usize,
    /// Tokens generated.
    pub output_tokens: usize,
    /// Simulated time to first token, in milliseconds.
    pub ttft_ms: f64,
    /// Times the request was preempted.
    pub preemptions: usize,
    /// Device blocks whose load failed and were recomputed.
    pub load_errors: usize,
}

/// Matched tokens by tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MatchedFrom {
    /// From the host tier.
    pub host: usize,
    /// From the disk tier.
    pub disk: usize,
}

/// Latency of one connector method, in microseconds.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Latency {
    /// Method name (the framework's).
    pub method: String,
    /// Calls.
    pub calls: usize,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
}

/// Bytes moved on one tier pair.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PathReport {
    /// `src->dst`.
    pub path: String,
    /// Blocks moved.
    pub blocks: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Achieved bandwidth over the transfers' busy time, GB/s.
    pub gb_per_s: f64,
}

/// Whole-run figures.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Summary {
    /// Engine imitated.
    pub framework: Framework,
    /// Requests completed.
    pub requests: usize,
    /// Prompt tokens over all requests.
    pub prompt_tokens: usize,
    /// Tokens matched by the connector.
    pub matched_tokens: usize,
    /// `matched_tokens / prompt_tokens`.
    pub hit_rate: f64,
    /// Matched tokens by tier.
    pub matched_from: MatchedFrom,
    /// Tokens the engine's own device cache provided.
    pub device_hit_tokens: usize,
    /// Tokens the model computed.
    pub computed_tokens: usize,
    /// Bytes offloaded per tier pair (device→host, host→disk, ...).
    pub offloaded: Vec<PathReport>,
    /// Bytes onboarded per tier pair (host→device, disk→device).
    pub onboarded: Vec<PathReport>,
    /// Connector call latency per method.
    pub leader_latency: Vec<Latency>,
    /// Onboarded blocks whose bytes differed from what the model computes (must be 0).
    pub integrity_errors: usize,
    /// Onboarded blocks checked.
    pub blocks_verified: usize,
    /// Device blocks whose load failed (recomputed, never used).
    pub load_errors: usize,
    /// Preemptions.
    pub preemptions: usize,
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Ranks lost during the run (their loads were recomputed).
    pub rank_failures: usize,
    /// Engine steps.
    pub steps: u64,
    /// Simulated engine time, ms.
    pub simulated_ms: f64,
    /// Mean simulated time to first token, ms.
    pub mean_ttft_ms: f64,
    /// Wall time of the replay, seconds.
    pub wall_s: f64,
}

/// A replay's report.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Report {
    /// Whole-run figures.
    pub summary: Summary,
    /// Per-request figures, in workload order.
    pub requests: Vec<RequestReport>,
}

// ------------------------------------------------------------------------------------------------
// The engine's device block pool, with optional prefix reuse
// ------------------------------------------------------------------------------------------------

struct DevicePool {
    free: Vec<usize>,
    refs: Vec<u32>,
    /// Prefix cache: key → block, and each cached block's key.
    cached: HashMap<u64, usize>,
    key_of: Vec<Option<u64>>,
    /// Cached blocks with no reference, oldest first; each block at most once (`queued`), and
    /// entries referenced again since are skipped when popped.
    evictable: VecDeque<usize>,
    queued: Vec<bool>,
    /// Cached blocks with no reference (what eviction can reclaim).
    idle_cached: usize,
    enabled: bool,
}

impl DevicePool {
    fn new(n: usize, enabled: bool) -> Self {
        Self {
            free: (0..n).rev().collect(),
            refs: vec![0; n],
            cached: HashMap::new(),
            key_of: vec![None; n],
            evictable: VecDeque::new(),
            queued: vec![false; n],
            idle_cached: 0,
            enabled,
        }
    }

    fn available(&self) -> usize {
        self.free.len() + self.idle_cached
    }

    fn alloc(&mut self) -> Option<usize> {
        if let Some(b) = self.free.pop() {
            self.refs[b] = 1;
            return Some(b);
        }
        while let Some(b) = self.evictable.pop_front() {
            self.queued[b] = false;
            if self.refs[b] == 0 {
                if let Some(k) = self.key_of[b].take() {
                    self.cached.remove(&k);
                    self.idle_cached -= 1;
                    self.refs[b] = 1;
                    return Some(b);
                }
            }
        }
        None
    }

    /// Longest cached prefix of `keys`, referenced.
    fn lookup(&mut self, keys: &[u64]) -> Vec<usize> {
        let mut out = Vec::new();
        if !self.enabled {
            return out;
        }
        for k in keys {
            match self.cached.get(k) {
                Some(&b) => {
                    if self.refs[b] == 0 {
                        self.idle_cached -= 1;
                    }
                    self.refs[b] += 1;
                    out.push(b);
                }
                None => break,
            }
        }
        out
    }

    /// Releases a request's blocks; full computed blocks are kept for reuse under their keys.
    fn release(&mut self, blocks: &[usize], keys: &[u64]) {
        for (i, &b) in blocks.iter().enumerate() {
            self.refs[b] = self.refs[b].saturating_sub(1);
            if self.enabled && self.key_of[b].is_none() {
                if let Some(&k) = keys.get(i) {
                    if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(k) {
                        e.insert(b);
                        self.key_of[b] = Some(k);
                    }
                }
            }
            if self.refs[b] == 0 {
                if self.key_of[b].is_some() {
                    self.idle_cached += 1;
                    if !self.queued[b] {
                        self.queued[b] = true;
                        self.evictable.push_back(b);
                    }
                } else {
                    self.free.push(b);
                }
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Requests
// ------------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Pending,
    Waiting,
    Loading,
    Running,
    Held,
    Done,
}

struct Req {
    id: String,
    num_id: u64,
    tokens: Vec<u32>,
    prefix: Vec<u64>,
    prompt_len: usize,
    max_tokens: usize,
    generated: usize,
    computed: usize,
    blocks: Vec<usize>,
    phase: Phase,
    arrival: u64,
    arrival_clock_us: f64,
    first_token_us: Option<f64>,
    /// Tokens loaded by the current admission: (first block, blocks).
    loading: Option<(usize, usize)>,
    /// The engine already told vLLM about this request (cached vs new).
    announced: bool,
    /// Its load finished: it rejoins the batch without a new match.
    loaded: bool,
    /// TensorRT-LLM: tokens / blocks reported through RequestData.
    sent_tokens: usize,
    sent_blocks: usize,
    report: RequestReport,
}

impl Req {
    fn push_token(&mut self, t: u32) {
        let h = self.prefix.last().copied().unwrap_or(PREFIX_HASH_SEED);
        self.tokens.push(t);
        self.prefix.push(prefix_hash_step(h, t));
    }
}

/// The scheduler side of the connector, per engine.
pub(crate) enum Sched {
    /// TensorRT-LLM.
    Trt(Box<trtllm::TrtllmScheduler>),
    /// vLLM.
    Vllm(Box<vllm::VllmScheduler>),
}

impl Sched {
    fn is_ready(&mut self) -> bool {
        match self {
            Sched::Trt(s) => s.leader_mut().is_ready(),
            Sched::Vllm(s) => s.leader_mut().is_ready(),
        }
    }

    fn process_completions(&mut self) {
        match self {
            Sched::Trt(s) => s.leader_mut().process_completions(),
            Sched::Vllm(s) => s.leader_mut().process_completions(),
        }
    }

    fn has_pending_work(&self) -> bool {
        match self {
            Sched::Trt(s) => s.leader().has_pending_work(),
            Sched::Vllm(s) => s.leader().has_pending_work(),
        }
    }

    fn request_state(
        &self,
        id: &str,
        num: u64,
    ) -> Option<crate::connector::lifecycle::RequestState> {
        match self {
            Sched::Trt(s) => s.leader().request_state(&num.into()),
            Sched::Vllm(s) => s.leader().request_state(&id.into()),
        }
    }

    pub(crate) fn init_error(&self) -> Option<Error> {
        let status = match self {
            Sched::Trt(s) => s.leader().status(),
            Sched::Vllm(s) => s.leader().status(),
        };
        match status {
            crate::connector::leader::LeaderStatus::Failed(e) => Some(e),
            _ => None,
        }
    }
}

#[derive(Default)]
struct Timings(HashMap<&'static str, Vec<u64>>);

impl Timings {
    fn time<T>(&mut self, method: &'static str, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        self.0
            .entry(method)
            .or_default()
            .push(t.elapsed().as_nanos() as u64);
        out
    }

    fn report(&self) -> Vec<Latency> {
        let mut out: Vec<Latency> = self
            .0
            .iter()
            .map(|(m, v)| {
                let mut v = v.clone();
                v.sort_unstable();
                let pick = |q: f64| -> f64 {
                    if v.is_empty() {
                        return 0.0;
                    }
                    let i = ((v.len() - 1) as f64 * q).round() as usize;
                    v[i.min(v.len() - 1)] as f64 / 1000.0
                };
                Latency {
                    method: (*m).to_string(),
                    calls: v.len(),
                    p50_us: pick(0.5),
                    p99_us: pick(0.99),
                }
            })
            .collect();
        out.sort_by(|a, b| a.method.cmp(&b.method));
        out
    }
}

/// The simulated engine.
pub struct Engine {
    opts: SimOptions,
    pool: DevicePool,
    sched: Sched,
    /// The ranks; `None` once a rank died.
    ranks: Vec<Option<Box<dyn RankDriver>>>,
    /// Child processes of the ranks (multi-process runs), by rank.
    children: Vec<std::process::Child>,
    /// Per request: how many live ranks reported it released / loaded so far.
    released_votes: HashMap<usize, usize>,
    loaded_votes: HashMap<usize, usize>,
    rank_failures: usize,
    reqs: Vec<Req>,
    by_id: HashMap<String, usize>,
    by_num: HashMap<u64, usize>,
    /// Running order (admission order): vLLM preempts from the back.
    running: Vec<usize>,
    waiting: VecDeque<usize>,
    /// vLLM: ids finished last step (the next scheduler output carries them).
    finished_last_step: HashSet<String>,
    /// TensorRT-LLM: ids newly finished with saving / newly loading, passed once to get_finished.
    new_saving: Vec<u64>,
    new_loading: Vec<u64>,
    /// vLLM: requests preempted since the last scheduler output.
    pending_preempted: Vec<String>,
    /// vLLM: the finished ids of this step's scheduler output, for the worker's get_finished.
    vllm_finished_for_worker: HashSet<String>,
    /// Device blocks freed since the last forward pass; overwritten with junk once the next
    /// metadata is bound (so a hit only passes if a load really copied), unless reused by then.
    to_clobber: Vec<usize>,
    timings: Timings,
    hasher: BlockHasher,
    step: u64,
    clock_us: f64,
    integrity_errors: usize,
    blocks_verified: usize,
    load_errors: usize,
    preemptions: usize,
}

/// Polls `ready` until it answers true, fails, or `timeout` passes (a `Timeout` naming `what`).
pub(crate) fn wait_for(
    what: &str,
    timeout: Duration,
    mut ready: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while !ready()? {
        if Instant::now() > deadline {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "{what} did not become ready within {:.0}s",
                    timeout.as_secs_f64()
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

fn sim_err(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidArgument, msg)
}

impl Engine {
    /// Checks the options and the model's block dimensions (of the whole model, all ranks).
    pub fn model_dims(opts: &SimOptions) -> Result<LayoutDims> {
        if opts.block_size == 0
            || opts.device_blocks == 0
            || opts.max_batch == 0
            || opts.chunk_tokens == 0
            || opts.tp == 0
        {
            return Err(sim_err(
                "block size, device blocks, max batch, chunk tokens and tp must be at least 1",
            ));
        }
        if !(opts.prefill_us_per_token.is_finite() && opts.prefill_us_per_token >= 0.0) {
            return Err(sim_err("prefill_us_per_token must be a number >= 0"));
        }
        let m = opts.model;
        if m.kv_heads % opts.tp != 0 {
            return Err(sim_err(format!(
                "{} KV heads cannot be split evenly over {} ranks",
                m.kv_heads, opts.tp
            )));
        }
        let dims = LayoutDims {
            num_layers: m.layers,
            outer_dim: 2,
            page_size: opts.block_size,
            inner_dim: m.kv_heads.saturating_mul(m.head_dim),
            dtype_bytes: m.dtype_bytes,
        };
        dims.validate()?;
        Ok(dims)
    }

    /// The block dimensions of one rank's shard (KV heads split evenly).
    pub fn shard_dims(opts: &SimOptions) -> Result<LayoutDims> {
        let d = Self::model_dims(opts)?;
        Ok(LayoutDims {
            inner_dim: d.inner_dim / opts.tp,
            ..d
        })
    }

    /// Builds a single-process engine: leader and one worker over the in-process transport.
    pub fn new(opts: SimOptions, workload: &[TraceRequest]) -> Result<Self> {
        let shard = Shard {
            rank: 0,
            dims: Self::shard_dims(&opts)?,
        };
        let n = opts.device_blocks;
        let (lt, wts) = in_process(1);
        let wt = wts
            .into_iter()
            .next()
            .ok_or_else(|| Error::internal("no worker transport"))?;
        let executor = |wt| {
            RankExecutor::new(
                opts.framework,
                opts.device,
                opts.config.clone(),
                shard,
                n,
                1,
                wt,
            )
        };
        let (sched, rank) = match opts.framework {
            Framework::Trtllm => {
                // TensorRT-LLM: the scheduler starts non-blocking, the worker registers blocking.
                let sched = Sched::Trt(Box::new(trtllm::TrtllmScheduler::new(
                    opts.config.clone(),
                    opts.block_size,
                    lt,
                )?));
                (sched, executor(wt)?)
            }
            Framework::Vllm => {
                // vLLM: the worker registers non-blocking, then the scheduler starts blocking.
                let exec = executor(wt)?;
                let sched = Sched::Vllm(Box::new(vllm::VllmScheduler::new(
                    opts.config.clone(),
                    opts.block_size,
                    lt,
                )?));
                (sched, exec)
            }
        };
        wait_for("the worker", opts.config.init_timeout(), || {
            match rank.init_error() {
                Some(e) => Err(e),
                None => Ok(rank.is_ready()),
            }
        })?;
        Self::assemble(
            opts,
            workload,
            sched,
            vec![Box::new(LocalRank(rank))],
            Vec::new(),
        )
    }

    pub(crate) fn assemble(
        opts: SimOptions,
        workload: &[TraceRequest],
        sched: Sched,
        ranks: Vec<Box<dyn RankDriver>>,
        children: Vec<std::process::Child>,
    ) -> Result<Self> {
        Self::model_dims(&opts)?;
        let n = opts.device_blocks;
        let mut engine = Self {
            pool: DevicePool::new(n, opts.device_prefix_cache),
            hasher: BlockHasher::new(HashAlgorithm::Xxh3, Salt::NONE),
            sched,
            ranks: ranks.into_iter().map(Some).collect(),
            children,
            released_votes: HashMap::new(),
            loaded_votes: HashMap::new(),
            rank_failures: 0,
            reqs: Vec::with_capacity(workload.len()),
            by_id: HashMap::new(),
            by_num: HashMap::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            finished_last_step: HashSet::new(),
            new_saving: Vec::new(),
            new_loading: Vec::new(),
            pending_preempted: Vec::new(),
            vllm_finished_for_worker: HashSet::new(),
            to_clobber: Vec::new(),
            timings: Timings::default(),
            step: 0,
            clock_us: 0.0,
            integrity_errors: 0,
            blocks_verified: 0,
            load_errors: 0,
            preemptions: 0,
            opts,
        };
        engine.wait_ready()?;
        for (i, r) in workload.iter().enumerate() {
            if engine.by_id.insert(r.id.clone(), i).is_some() {
                return Err(sim_err(format!("duplicate request id {:?}", r.id)));
            }
            engine.by_num.insert(i as u64, i);
            let mut req = Req {
                id: r.id.clone(),
                num_id: i as u64,
                tokens: Vec::with_capacity(r.prompt.len() + r.max_tokens),
                prefix: Vec::with_capacity(r.prompt.len() + r.max_tokens),
                prompt_len: r.prompt.len(),
                max_tokens: r.max_tokens.max(1),
                generated: 0,
                computed: 0,
                blocks: Vec::new(),
                phase: Phase::Pending,
                arrival: r.arrival,
                arrival_clock_us: 0.0,
                first_token_us: None,
                loading: None,
                announced: false,
                loaded: false,
                sent_tokens: 0,
                sent_blocks: 0,
                report: RequestReport {
                    id: r.id.clone(),
                    prompt_tokens: r.prompt.len(),
                    matched_tokens: 0,
                    matched_from: MatchedFrom::default(),
                    device_hit_tokens: 0,
                    computed_tokens: 0,
                    output_tokens: 0,
                    ttft_ms: 0.0,
                    preemptions: 0,
                    load_errors: 0,
                },
            };
            for &t in &r.prompt {
                req.push_token(t);
            }
            engine.reqs.push(req);
        }
        let worst = engine
            .reqs
            .iter()
            .map(|r| (r.prompt_len + r.max_tokens).div_ceil(engine.opts.block_size))
            .max()
            .unwrap_or(0);
        if worst > n {
            return Err(sim_err(format!(
                "a request needs {worst} device blocks but the device has {n}; raise --device-blocks"
            )));
        }
        Ok(engine)
    }

    fn wait_ready(&mut self) -> Result<()> {
        let timeout = self.opts.config.init_timeout();
        let sched = &mut self.sched;
        wait_for("the connector", timeout, || match sched.init_error() {
            Some(e) => Err(e),
            None => Ok(sched.is_ready()),
        })
    }

    fn keys(&self, i: usize, blocks: usize) -> Vec<u64> {
        let bs = self.opts.block_size;
        let r = &self.reqs[i];
        let n = (blocks * bs).min(r.tokens.len());
        self.hasher
            .sequence_hashes(&r.tokens[..n], bs)
            .map(|v| v.into_iter().map(|k| k.0).collect())
            .unwrap_or_default()
    }

    fn all_done(&self) -> bool {
        self.reqs.iter().all(|r| r.phase == Phase::Done)
    }

    /// Runs the whole workload.
    pub fn run(mut self) -> Result<Report> {
        let wall = Instant::now();
        let total = self.reqs.len();
        let mut last_progress = Instant::now();
        let mut arrivals: Vec<usize> = (0..self.reqs.len()).collect();
        arrivals.sort_by_key(|&i| (self.reqs[i].arrival, i));
        let mut next_arrival = 0usize;
        let mut guard = 0u64;
        while !self.all_done() {
            // Admit arrivals; skip idle stretches.
            let idle = self.running.is_empty()
                && self.waiting.is_empty()
                && !self
                    .reqs
                    .iter()
                    .any(|r| matches!(r.phase, Phase::Loading | Phase::Held));
            if idle {
                if let Some(&i) = arrivals.get(next_arrival) {
                    self.step = self.step.max(self.reqs[i].arrival);
                }
            }
            while let Some(&i) = arrivals.get(next_arrival) {
                if self.reqs[i].arrival > self.step {
                    break;
                }
                self.reqs[i].phase = Phase::Waiting;
                self.reqs[i].arrival_clock_us = self.clock_us;
                self.waiting.push_back(i);
                next_arrival += 1;
            }
            self.one_step()?;
            self.step += 1;
            guard += 1;
            if guard > 200_000 {
                let count = |p: Phase| self.reqs.iter().filter(|r| r.phase == p).count();
                let loading: Vec<usize> = (0..self.reqs.len())
                    .filter(|&i| self.reqs[i].phase == Phase::Loading)
                    .collect();
                let stuck: Vec<String> = loading
                    .iter()
                    .chain(self.running.iter())
                    .chain(self.waiting.iter())
                    .take(6)
                    .map(|&i| {
                        let r = &self.reqs[i];
                        format!(
                            "{}:{:?} computed {}/{} blocks {} loading {:?} loaded {} leader {:?}",
                            r.id,
                            r.phase,
                            r.computed,
                            r.tokens.len(),
                            r.blocks.len(),
                            r.loading,
                            r.loaded,
                            self.sched.request_state(&r.id, r.num_id)
                        )
                    })
                    .collect();
                return Err(Error::internal(format!(
                    "replay made no progress: {} running, {} waiting, {} loading, {} held, {} blocks available; {}",
                    self.running.len(),
                    self.waiting.len(),
                    count(Phase::Loading),
                    count(Phase::Held),
                    self.pool.available(),
                    stuck.join("; ")
                )));
            }
            if self.opts.progress && last_progress.elapsed() > Duration::from_millis(200) {
                let done = self.reqs.iter().filter(|r| r.phase == Phase::Done).count();
                eprint!(
                    "\rreplay: {done}/{total} requests finished, step {}",
                    self.step
                );
                last_progress = Instant::now();
            }
        }
        if self.opts.progress {
            eprintln!(
                "\rreplay: {total}/{total} requests finished, step {}   ",
                self.step
            );
        }
        self.drain()?;
        Ok(self.report(wall.elapsed()))
    }

    /// Lets background stores (host → disk) finish so the report counts them.
    fn drain(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            self.sched.process_completions();
            if !self.sched.has_pending_work() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    "background transfers did not finish within 60 s",
                ));
            }
            // Operations still queued in the leader go out with one more (empty) iteration.
            self.engine_iteration(&[], &[])?;
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn one_step(&mut self) -> Result<()> {
        self.admit()?;
        let scheduled = self.schedule()?;
        let computed_before: Vec<usize> = scheduled
            .iter()
            .map(|&(i, _)| self.reqs[i].computed)
            .collect();
        let (prefill_tokens, decode_tokens) = scheduled.iter().fold((0, 0), |(p, d), &(i, n)| {
            if self.reqs[i].computed >= self.reqs[i].prompt_len {
                (p, d + n)
            } else {
                (p + n, d)
            }
        });
        self.engine_iteration(&scheduled, &computed_before)?;
        self.clock_us += 20.0
            + self.opts.prefill_us_per_token * prefill_tokens as f64
            + self.opts.prefill_us_per_token / 10.0 * decode_tokens as f64;
        self.advance(&scheduled)?;
        Ok(())
    }

    // --- admission -------------------------------------------------------------------------------

    fn admit(&mut self) -> Result<()> {
        let bs = self.opts.block_size;
        let mut still = VecDeque::new();
        while let Some(i) = self.waiting.pop_front() {
            if self.running.len() >= self.opts.max_batch {
                still.push_back(i);
                continue;
            }
            let r = &self.reqs[i];
            if r.phase == Phase::Loading {
                continue;
            }
            // Loaded requests come back without a new match.
            if r.loaded {
                self.reqs[i].loaded = false;
                self.after_load_admit(i)?;
                continue;
            }
            let n = r.tokens.len();
            // Blocks needed now: vLLM the prompt; TensorRT-LLM prompt and output (no evict).
            let need = match self.opts.framework {
                Framework::Vllm => n.div_ceil(bs),
                Framework::Trtllm => (r.prompt_len + r.max_tokens).div_ceil(bs),
            };
            let keys = self.keys(i, n.saturating_sub(1) / bs);
            let local_blocks = self.pool.lookup(&keys);
            let fresh = need.saturating_sub(local_blocks.len());
            if self.pool.available() < fresh {
                self.pool.release(&local_blocks, &[]);
                still.push_back(i);
                // Keep arrival order: nothing behind this one is admitted this step.
                while let Some(j) = self.waiting.pop_front() {
                    still.push_back(j);
                }
                break;
            }
            let local = local_blocks.len() * bs;
            let m = self.connector_match(i, local)?;
            let mut blocks = local_blocks;
            for _ in 0..fresh {
                match self.pool.alloc() {
                    Some(b) => blocks.push(b),
                    None => return Err(Error::internal("device pool ran out after checking")),
                }
            }
            let r = &mut self.reqs[i];
            r.blocks = blocks;
            r.report.device_hit_tokens += local;
            r.report.matched_tokens += m.0;
            r.report.matched_from.host += m.1;
            r.report.matched_from.disk += m.2;
            r.computed = local;
            self.connector_alloc(i, m.0)?;
            let r = &mut self.reqs[i];
            if m.0 > 0 {
                r.phase = Phase::Loading;
                r.loading = Some((local / bs, m.0 / bs));
                self.new_loading.push(r.num_id);
            } else {
                r.phase = Phase::Running;
                self.running.push(i);
            }
        }
        self.waiting = still;
        Ok(())
    }

    /// A request whose load finished joins the running set (vLLM: second alloc call with 0).
    fn after_load_admit(&mut self, i: usize) -> Result<()> {
        if self.opts.framework == Framework::Vllm {
            self.connector_alloc(i, 0)?;
        }
        self.reqs[i].phase = Phase::Running;
        self.running.push(i);
        Ok(())
    }

    /// (external tokens, from host, from disk).
    fn connector_match(&mut self, i: usize, local: usize) -> Result<(usize, usize, usize)> {
        let r = &self.reqs[i];
        let timings = &mut self.timings;
        let (ext, host, disk) = match &mut self.sched {
            Sched::Trt(sched) => {
                let req = trtllm::LlmRequest {
                    request_id: r.num_id,
                    tokens: &r.tokens,
                    cache_salt: None,
                    lora_name: None,
                };
                let (n, _) = timings.time("get_num_new_matched_tokens", || {
                    sched.get_num_new_matched_tokens(&req, local)
                })?;
                let m = sched.leader().last_match();
                (n, m.host_tokens, m.disk_tokens)
            }
            Sched::Vllm(sched) => {
                let req = vllm::Request {
                    request_id: &r.id,
                    all_token_ids: &r.tokens,
                    cache_salt: None,
                    lora_name: None,
                    num_computed_tokens: local,
                };
                let (n, _) = timings.time("get_num_new_matched_tokens", || {
                    sched.get_num_new_matched_tokens(&req, local)
                })?;
                let m = sched.leader().last_match();
                (n.unwrap_or(0), m.host_tokens, m.disk_tokens)
            }
        };
        Ok((ext, host, disk))
    }

    fn connector_alloc(&mut self, i: usize, external: usize) -> Result<()> {
        let r = &self.reqs[i];
        let timings = &mut self.timings;
        match &mut self.sched {
            Sched::Trt(sched) => {
                // TensorRT-LLM calls it once per admission and passes no count.
                let _ = external;
                let req = trtllm::LlmRequest {
                    request_id: r.num_id,
                    tokens: &r.tokens,
                    cache_salt: None,
                    lora_name: None,
                };
                timings.time("update_state_after_alloc", || {
                    sched.update_state_after_alloc(&req, &r.blocks)
                })
            }
            Sched::Vllm(sched) => {
                let req = vllm::Request {
                    request_id: &r.id,
                    all_token_ids: &r.tokens,
                    cache_salt: None,
                    lora_name: None,
                    num_computed_tokens: r.computed,
                };
                let groups = [r.blocks.clone()];
                timings.time("update_state_after_alloc", || {
                    sched.update_state_after_alloc(&req, &groups, external)
                })
            }
        }
    }

    // --- scheduling ------------------------------------------------------------------------------

    /// Picks this step's (request, tokens to compute); allocates blocks on demand (vLLM, with
    /// preemption of the newest request when they run out).
    fn schedule(&mut self) -> Result<Vec<(usize, usize)>> {
        let bs = self.opts.block_size;
        let mut budget = self.opts.chunk_tokens;
        let mut out = Vec::new();
        let mut k = 0;
        while k < self.running.len() {
            let i = self.running[k];
            let r = &self.reqs[i];
            let remaining = r.tokens.len().saturating_sub(r.computed);
            if remaining == 0 {
                k += 1;
                continue;
            }
            let decoding = r.computed >= r.prompt_len;
            let n = if decoding { 1 } else { remaining.min(budget) };
            if n == 0 {
                k += 1;
                continue;
            }
            let need = (r.computed + n).div_ceil(bs);
            let mut preempted_self = false;
            while self.reqs[i].blocks.len() < need {
                if let Some(b) = self.pool.alloc() {
                    self.reqs[i].blocks.push(b);
                    continue;
                }
                // Out of blocks: vLLM preempts the newest running request. (TensorRT-LLM reserved
                // every block at admission and never gets here.)
                if self.opts.framework == Framework::Trtllm {
                    return Err(Error::internal(
                        "TensorRT-LLM request ran out of reserved blocks",
                    ));
                }
                // The newest request the engine has already run (vLLM schedules running
                // requests before it admits waiting ones, so a request admitted this step is
                // never a victim — unless it is the one that needs the block, which then waits).
                let victim = self
                    .running
                    .iter()
                    .rev()
                    .copied()
                    .find(|&j| j == i || self.reqs[j].announced);
                let Some(victim) = victim else {
                    break;
                };
                self.preempt(victim)?;
                if victim == i {
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self {
                break;
            }
            if !decoding {
                budget -= n;
            }
            out.push((i, n));
            k += 1;
        }
        Ok(out)
    }

    fn preempt(&mut self, i: usize) -> Result<()> {
        self.running.retain(|&j| j != i);
        let keys = self.keys(i, self.reqs[i].computed / self.opts.block_size);
        let blocks = std::mem::take(&mut self.reqs[i].blocks);
        self.pool.release(&blocks, &keys);
        self.to_clobber.extend_from_slice(&blocks);
        let r = &mut self.reqs[i];
        let was_announced = r.announced;
        r.computed = 0;
        r.announced = false;
        r.phase = Phase::Waiting;
        r.report.preemptions += 1;
        self.preemptions += 1;
        self.waiting.push_front(i);
        // Only a request the engine ran is "preempted" for the connector; one admitted this step
        // and put back before it ran is simply matched again when it is next admitted.
        if matches!(self.sched, Sched::Vllm(_)) && was_announced {
            self.pending_preempted.push(self.reqs[i].id.clone());
        }
        Ok(())
    }

    // --- one engine iteration through the connector -----------------------------------------------

    fn engine_iteration(
        &mut self,
        scheduled: &[(usize, usize)],
        computed_before: &[usize],
    ) -> Result<()> {
        let metadata = self.build_meta(scheduled)?;
        let bs = self.opts.block_size;
        // The KV the model computes this iteration, block by block.
        let mut writes = Vec::new();
        for (&(i, n), &before) in scheduled.iter().zip(computed_before) {
            let r = &self.reqs[i];
            let mut p = before;
            while p < before + n {
                let k = p / bs;
                let upto = ((k + 1) * bs).min(before + n);
                let block = *r
                    .blocks
                    .get(k)
                    .ok_or_else(|| Error::internal("a scheduled token has no device block"))?;
                writes.push(BlockWrite {
                    block,
                    first_slot: p % bs,
                    hashes: r.prefix[p..upto].to_vec(),
                });
                p = upto;
            }
        }
        let (finished, started_loading) = match self.sched {
            Sched::Trt(_) => (
                std::mem::take(&mut self.new_saving)
                    .iter()
                    .map(u64::to_string)
                    .collect(),
                std::mem::take(&mut self.new_loading)
                    .iter()
                    .map(u64::to_string)
                    .collect(),
            ),
            Sched::Vllm(_) => {
                let mut f: Vec<String> = std::mem::take(&mut self.vllm_finished_for_worker)
                    .into_iter()
                    .collect();
                f.sort();
                (f, Vec::new())
            }
        };
        // Freed blocks are clobbered on the ranks unless reused or kept by the prefix cache.
        let clobber: Vec<usize> = std::mem::take(&mut self.to_clobber)
            .into_iter()
            .filter(|&b| self.pool.refs[b] == 0 && self.pool.key_of[b].is_none())
            .collect();
        let cmd = StepCommand {
            metadata,
            clobber,
            writes,
            finished,
            started_loading,
        };
        let mut replies = Vec::new();
        for rank in 0..self.ranks.len() {
            // Fault injection: at the first step from S on with a load in flight.
            if let Some((victim, at)) = self.opts.kill {
                if victim == rank
                    && self.step >= at
                    && self.ranks[rank].is_some()
                    && self.reqs.iter().any(|r| r.phase == Phase::Loading)
                {
                    self.kill_rank(rank);
                }
            }
            let Some(driver) = self.ranks[rank].as_mut() else {
                continue;
            };
            match driver.step(&cmd) {
                Ok(r) => replies.push(r),
                Err(e) => self.rank_died(rank, &e),
            }
        }
        self.apply_replies(replies)
    }

    /// Kills a rank's process (fault injection for tests).
    fn kill_rank(&mut self, rank: usize) {
        if let Some(child) = self.children.get_mut(rank) {
            tracing::warn!(rank, "killing the rank's process (fault injection)");
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// A rank stopped answering: its device is gone. Requests whose loads it had not confirmed
    /// are treated as failed loads (recomputed); the engine runs on with the live ranks.
    fn rank_died(&mut self, rank: usize, e: &Error) {
        tracing::error!(rank, error = %e, "rank lost; its loads are recomputed");
        eprintln!("kvbm: rank {rank} lost: {e}");
        self.ranks[rank] = None;
        self.rank_failures += 1;
        let loading: Vec<usize> = (0..self.reqs.len())
            .filter(|&i| self.reqs[i].phase == Phase::Loading)
            .collect();
        for i in loading {
            let Some((first, count)) = self.reqs[i].loading.take() else {
                continue;
            };
            self.load_errors += count;
            let r = &mut self.reqs[i];
            r.report.load_errors += count;
            r.computed = first * self.opts.block_size;
            r.loaded = true;
            r.phase = Phase::Waiting;
            self.waiting.push_front(i);
        }
    }

    fn live_ranks(&self) -> usize {
        self.ranks.iter().filter(|r| r.is_some()).count()
    }

    /// Acts on an id only once every live rank reported it.
    fn apply_replies(&mut self, replies: Vec<StepReply>) -> Result<()> {
        let mut errors: HashSet<usize> = HashSet::new();
        let mut released = Vec::new();
        let mut loaded = Vec::new();
        for r in replies {
            errors.extend(r.load_errors);
            for id in r.released {
                if let Some(&i) = self.index_of(&id) {
                    *self.released_votes.entry(i).or_default() += 1;
                }
            }
            for id in r.loaded {
                if let Some(&i) = self.index_of(&id) {
                    *self.loaded_votes.entry(i).or_default() += 1;
                }
            }
        }
        let live = self.live_ranks().max(1);
        self.released_votes.retain(|&i, v| {
            if *v >= live {
                released.push(i);
                false
            } else {
                true
            }
        });
        self.loaded_votes.retain(|&i, v| {
            if *v >= live {
                loaded.push(i);
                false
            } else {
                true
            }
        });
        released.sort_unstable();
        loaded.sort_unstable();
        self.load_errors += errors.len();
        for i in loaded {
            self.on_loaded(i, &errors)?;
        }
        for i in released {
            if self.reqs[i].phase == Phase::Held {
                self.free_request_blocks(i)?;
                self.reqs[i].phase = Phase::Done;
            }
        }
        Ok(())
    }

    fn index_of(&self, id: &str) -> Option<&usize> {
        match self.sched {
            Sched::Trt(_) => id.parse::<u64>().ok().and_then(|n| self.by_num.get(&n)),
            Sched::Vllm(_) => self.by_id.get(id),
        }
    }

    fn build_meta(&mut self, scheduled: &[(usize, usize)]) -> Result<Vec<u8>> {
        let timings = &mut self.timings;
        match &mut self.sched {
            Sched::Trt(sched) => {
                let mut out = trtllm::SchedulerOutput::default();
                for &(i, _) in scheduled {
                    let r = &mut self.reqs[i];
                    let is_new = r.sent_tokens == 0 && r.sent_blocks == 0;
                    let computed_position = if r.computed >= r.prompt_len {
                        r.tokens.len().saturating_sub(1)
                    } else {
                        r.computed
                    };
                    let data = trtllm::RequestData {
                        request_id: r.num_id,
                        new_tokens: r.tokens[r.sent_tokens..].to_vec(),
                        new_block_ids: r.blocks[r.sent_blocks.min(r.blocks.len())..].to_vec(),
                        computed_position,
                    };
                    r.sent_tokens = r.tokens.len();
                    r.sent_blocks = r.blocks.len();
                    if is_new {
                        out.new_requests.push(data);
                    } else {
                        out.cached_requests.push(data);
                    }
                }
                timings.time("build_connector_meta", || sched.build_connector_meta(&out))
            }
            Sched::Vllm(sched) => {
                let mut out = vllm::SchedulerOutput {
                    finished_req_ids: std::mem::take(&mut self.finished_last_step),
                    ..Default::default()
                };
                for p in self.pending_preempted.drain(..) {
                    out.preempted_req_ids.insert(p);
                }
                for &(i, n) in scheduled {
                    let r = &mut self.reqs[i];
                    out.num_scheduled_tokens.insert(r.id.clone(), n);
                    if !r.announced {
                        r.announced = true;
                        r.sent_blocks = r.blocks.len();
                        out.scheduled_new_reqs.push(vllm::NewRequestData {
                            req_id: r.id.clone(),
                            prompt_token_ids: r.tokens.clone(),
                            block_ids: vec![r.blocks.clone()],
                            num_computed_tokens: r.computed,
                        });
                    } else {
                        let c = &mut out.scheduled_cached_reqs;
                        c.req_ids.push(r.id.clone());
                        c.resumed_from_preemption.push(false);
                        let lo = r.computed.min(r.tokens.len());
                        let hi = (r.computed + n).min(r.tokens.len());
                        c.new_token_ids.push(r.tokens[lo..hi].to_vec());
                        let new_blocks = r.blocks[r.sent_blocks.min(r.blocks.len())..].to_vec();
                        r.sent_blocks = r.blocks.len();
                        c.new_block_ids.push(if new_blocks.is_empty() {
                            None
                        } else {
                            Some(vec![new_blocks])
                        });
                        c.num_computed_tokens.push(r.computed);
                    }
                }
                self.vllm_finished_for_worker = out.finished_req_ids.clone();
                timings.time("build_connector_meta", || sched.build_connector_meta(&out))
            }
        }
    }

    fn on_loaded(&mut self, i: usize, errors: &HashSet<usize>) -> Result<()> {
        let bs = self.opts.block_size;
        let Some((first, count)) = self.reqs[i].loading.take() else {
            return Ok(());
        };
        let mut first_bad: Option<usize> = None;
        let mut check = Verify::default();
        for k in first..first + count {
            let block = self.reqs[i].blocks[k];
            if errors.contains(&block) {
                first_bad.get_or_insert(k);
                self.reqs[i].report.load_errors += 1;
                continue;
            }
            if first_bad.is_none() {
                check
                    .blocks
                    .push((block, self.reqs[i].prefix[k * bs..(k + 1) * bs].to_vec()));
            }
        }
        // Every live rank compares its shard of each onboarded block with the model's KV.
        let mut bad = 0;
        for rank in 0..self.ranks.len() {
            let Some(driver) = self.ranks[rank].as_mut() else {
                continue;
            };
            match driver.verify(&check) {
                Ok(n) => bad += n,
                Err(e) => self.rank_died(rank, &e),
            }
        }
        self.blocks_verified += check.blocks.len();
        if bad > 0 {
            self.integrity_errors += bad;
            tracing::error!(request = %self.reqs[i].id, bad, "onboarded blocks differ from the model's KV");
        }
        let r = &mut self.reqs[i];
        // Loaded tokens count as computed, up to the first bad block (recomputed instead).
        let good_blocks = first_bad.unwrap_or(first + count);
        r.computed = good_blocks * bs;
        r.loaded = true;
        r.phase = Phase::Waiting;
        self.waiting.push_front(i);
        Ok(())
    }

    // --- after the forward pass -------------------------------------------------------------------

    fn advance(&mut self, scheduled: &[(usize, usize)]) -> Result<()> {
        let mut finished = Vec::new();
        for &(i, n) in scheduled {
            let r = &mut self.reqs[i];
            r.computed += n;
            r.report.computed_tokens += n;
            if r.computed == r.tokens.len() {
                // The model samples the next token.
                let h = r.prefix.last().copied().unwrap_or(PREFIX_HASH_SEED);
                r.push_token(sample_token(h));
                r.generated += 1;
                r.report.output_tokens = r.generated;
                if r.first_token_us.is_none() {
                    r.first_token_us = Some(self.clock_us);
                    r.report.ttft_ms = (self.clock_us - r.arrival_clock_us) / 1000.0;
                }
                if r.generated >= r.max_tokens {
                    finished.push(i);
                }
            }
        }
        for i in finished {
            self.finish(i)?;
        }
        Ok(())
    }

    fn finish(&mut self, i: usize) -> Result<()> {
        self.running.retain(|&j| j != i);
        let r = &self.reqs[i];
        let timings = &mut self.timings;
        let held = match &mut self.sched {
            Sched::Trt(sched) => {
                let req = trtllm::LlmRequest {
                    request_id: r.num_id,
                    tokens: &r.tokens,
                    cache_salt: None,
                    lora_name: None,
                };
                timings.time("request_finished", || {
                    sched.request_finished(&req, &r.blocks)
                })?
            }
            Sched::Vllm(sched) => {
                let req = vllm::Request {
                    request_id: &r.id,
                    all_token_ids: &r.tokens,
                    cache_salt: None,
                    lora_name: None,
                    num_computed_tokens: r.computed,
                };
                timings
                    .time("request_finished", || {
                        sched.request_finished(&req, &r.blocks)
                    })?
                    .0
            }
        };
        if self.opts.framework == Framework::Vllm {
            self.finished_last_step.insert(self.reqs[i].id.clone());
        }
        if held {
            self.reqs[i].phase = Phase::Held;
            if self.opts.framework == Framework::Trtllm {
                self.new_saving.push(self.reqs[i].num_id);
            }
        } else {
            self.free_request_blocks(i)?;
            self.reqs[i].phase = Phase::Done;
        }
        Ok(())
    }

    fn free_request_blocks(&mut self, i: usize) -> Result<()> {
        let bs = self.opts.block_size;
        let full = self.reqs[i].computed / bs;
        let keys = self.keys(i, full);
        let blocks = std::mem::take(&mut self.reqs[i].blocks);
        self.pool.release(&blocks, &keys);
        self.to_clobber.extend_from_slice(&blocks);
        Ok(())
    }

    /// Lets every live rank finish its background transfers; sums their per-path statistics.
    fn collect_paths(&mut self) -> Vec<(TierKind, TierKind, u64, u64, f64)> {
        let mut sums: Vec<(TierKind, TierKind, u64, u64, f64)> = Vec::new();
        for rank in 0..self.ranks.len() {
            let Some(driver) = self.ranks[rank].as_mut() else {
                continue;
            };
            match driver.finish() {
                Ok(stats) => {
                    for (src, dst, blocks, bytes, busy) in stats.paths {
                        match sums.iter_mut().find(|p| p.0 == src && p.1 == dst) {
                            Some(p) => {
                                p.2 += blocks;
                                p.3 += bytes;
                                p.4 += busy;
                            }
                            None => sums.push((src, dst, blocks, bytes, busy)),
                        }
                    }
                }
                Err(e) => self.rank_died(rank, &e),
            }
        }
        sums.sort_by_key(|p| (p.0, p.1));
        sums
    }

    fn report(&mut self, wall: Duration) -> Report {
        let paths = self.collect_paths();
        for c in &mut self.children {
            let _ = c.wait();
        }
        let mut offloaded = Vec::new();
        let mut onboarded = Vec::new();
        for (src, dst, blocks, bytes, busy) in paths {
            let row = PathReport {
                path: format!("{src}->{dst}"),
                blocks,
                bytes,
                gb_per_s: if busy > 0.0 {
                    bytes as f64 / busy / 1e9
                } else {
                    0.0
                },
            };
            if dst == TierKind::Device {
                onboarded.push(row);
            } else {
                offloaded.push(row);
            }
        }
        let requests: Vec<RequestReport> = self.reqs.iter().map(|r| r.report.clone()).collect();
        let prompt_tokens: usize = requests.iter().map(|r| r.prompt_tokens).sum();
        let matched: usize = requests.iter().map(|r| r.matched_tokens).sum();
        let from = requests
            .iter()
            .fold(MatchedFrom::default(), |a, r| MatchedFrom {
                host: a.host + r.matched_from.host,
                disk: a.disk + r.matched_from.disk,
            });
        let ttft: Vec<f64> = requests.iter().map(|r| r.ttft_ms).collect();
        Report {
            summary: Summary {
                framework: self.opts.framework,
                requests: requests.len(),
                prompt_tokens,
                matched_tokens: matched,
                hit_rate: if prompt_tokens == 0 {
                    0.0
                } else {
                    matched as f64 / prompt_tokens as f64
                },
                matched_from: from,
                device_hit_tokens: requests.iter().map(|r| r.device_hit_tokens).sum(),
                computed_tokens: requests.iter().map(|r| r.computed_tokens).sum(),
                offloaded,
                onboarded,
                leader_latency: self.timings.report(),
                integrity_errors: self.integrity_errors,
                blocks_verified: self.blocks_verified,
                load_errors: self.load_errors,
                preemptions: self.preemptions,
                tp: self.ranks.len(),
                rank_failures: self.rank_failures,
                steps: self.step,
                simulated_ms: self.clock_us / 1000.0,
                mean_ttft_ms: if ttft.is_empty() {
                    0.0
                } else {
                    ttft.iter().sum::<f64>() / ttft.len() as f64
                },
                wall_s: wall.as_secs_f64(),
            },
            requests,
        }
    }
}

/// Runs a replay in one process (leader and one worker over the in-process transport).
pub fn replay(opts: SimOptions, workload: &[TraceRequest]) -> Result<Report> {
    Engine::new(opts, workload)?.run()
}
