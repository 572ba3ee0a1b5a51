//! End to end through the vLLM adapter: a scheduler-side [`VllmScheduler`] and a worker-side
//! [`VllmWorker`] in one process over the in-process transport, driven by a small stand-in for
//! vLLM v1's engine loop (scheduler, model runner, `update_from_output`) in vLLM's call order.
//!
//! The device tier is host memory in vLLM's per-layer layout; host and disk tiers are the
//! worker's own. The model stand-in writes, per layer, the KV of the tokens each step computes;
//! a token's KV is a pure function of (token prefix, layer, K/V, position), so a full block's
//! bytes are a pure function of the prefix up to the block's end. Freed device blocks are
//! clobbered with junk, so a hit can pass only if the load really copied.
//!
//! The engine lets every transfer of a step finish before `get_finished` (one legal
//! interleaving, and the one that keeps the metadata snapshots stable). A scenario that needs a
//! transfer still in flight holds it at a [`Gate`] in front of the device tier.

#![cfg(feature = "vllm")]

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::io::{IoSlice, IoSliceMut, Write};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvbm_connector::backends::memory::MemoryTier;
use kvbm_connector::connector::metadata::{ConnectorMetadata, Direction};
use kvbm_connector::connector::metrics::MetricsSnapshot;
use kvbm_connector::connector::transport::in_process;
use kvbm_connector::frameworks::vllm::{
    CachedRequestData, NewRequestData, Request, SchedulerOutput, VllmScheduler, VllmWorker,
};
use kvbm_connector::layout::BlockOrder;
use kvbm_connector::{
    Capability, Config, Error, ErrorKind, Layout, LayoutDims, StorageTier, StorageTierExt, TierKind,
};

const BS: usize = 4;
const LAYERS: usize = 2;
const HEADS: usize = 2;
const HEAD_DIM: usize = 4;
const DTYPE: usize = 2;
/// Bytes of one token's K (or V) in one layer.
const TOKEN_BYTES: usize = HEADS * HEAD_DIM * DTYPE;
const WAIT: Duration = Duration::from_secs(10);
/// vLLM's null block.
const NULL_BLOCK: usize = 0;

fn dims() -> LayoutDims {
    LayoutDims {
        num_layers: LAYERS,
        outer_dim: 2,
        page_size: BS,
        inner_dim: HEADS * HEAD_DIM,
        dtype_bytes: DTYPE,
    }
}

fn layer_name(l: usize) -> String {
    format!("model.layers.{l}.self_attn")
}

fn blocks_for(tokens: usize) -> usize {
    tokens.div_ceil(BS)
}

fn tokens(start: u32, len: usize) -> Vec<u32> {
    (start..start + len as u32).collect()
}

// ------------------------------------------------------------------------------------------------
// The model stand-in
// ------------------------------------------------------------------------------------------------

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// `h[p]` names the prefix `tokens[..=p]`.
fn prefix_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    tokens
        .iter()
        .map(|&t| {
            h = mix(h ^ u64::from(t));
            h
        })
        .collect()
}

/// The KV one layer holds for the token at `pos`, as K (`kv` 0) or V (`kv` 1).
fn token_kv(prefix: u64, layer: usize, kv: usize, pos: usize) -> [u8; TOKEN_BYTES] {
    let mut x = prefix ^ ((layer as u64) << 56) ^ ((kv as u64) << 48) ^ pos as u64;
    let mut out = [0u8; TOKEN_BYTES];
    for chunk in out.chunks_mut(8) {
        x = mix(x);
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    out
}

/// Byte offset of (layer, K/V, slot) in a block's canonical image.
fn canonical_offset(layer: usize, kv: usize, slot: usize) -> usize {
    ((layer * 2 + kv) * BS + slot) * TOKEN_BYTES
}

/// What a full block `b` of `tokens` holds once computed.
fn expected_block(tokens: &[u32], b: usize) -> Vec<u8> {
    let h = prefix_hashes(&tokens[..(b + 1) * BS]);
    let mut img = vec![0u8; dims().bytes_per_block()];
    for layer in 0..LAYERS {
        for kv in 0..2 {
            for slot in 0..BS {
                let p = b * BS + slot;
                let off = canonical_offset(layer, kv, slot);
                img[off..off + TOKEN_BYTES].copy_from_slice(&token_kv(h[p], layer, kv, p));
            }
        }
    }
    img
}

/// Greedy "sampling": the next token is a function of the prefix alone.
fn sample(tokens: &[u32]) -> u32 {
    let h = prefix_hashes(tokens).last().copied().unwrap_or(0);
    1000 + (h % 9000) as u32
}

fn assert_block(actual: &[u8], expected: &[u8], what: std::fmt::Arguments<'_>) {
    assert!(
        actual == expected,
        "{what}: wrong bytes (got {:02x?}.., want {:02x?}..)",
        &actual[..8],
        &expected[..8]
    );
}

fn junk(block: usize) -> Vec<u8> {
    vec![0xa5 ^ block as u8; dims().bytes_per_block()]
}

// ------------------------------------------------------------------------------------------------
// A gate in front of the device tier: holds transfers so a test can observe them in flight
// ------------------------------------------------------------------------------------------------

/// Holds device writes (loads) and/or device reads (stores) of the connector's transfers.
#[derive(Debug, Default)]
struct Gate {
    /// `[loads held, stores held]`.
    held: Mutex<[bool; 2]>,
    cv: Condvar,
    /// The threads that moved device blocks for the connector (each once).
    threads: Mutex<Vec<std::thread::ThreadId>>,
}

fn gate_slot(d: Direction) -> usize {
    match d {
        Direction::Load => 0,
        Direction::Store => 1,
    }
}

impl Gate {
    fn hold(&self, d: Direction, held: bool) {
        self.held.lock().unwrap()[gate_slot(d)] = held;
        self.cv.notify_all();
    }

    fn is_open(&self) -> bool {
        *self.held.lock().unwrap() == [false, false]
    }

    fn pass(&self, d: Direction) -> kvbm_connector::Result<()> {
        let me = std::thread::current().id();
        let mut threads = self.threads.lock().unwrap();
        if !threads.contains(&me) {
            threads.push(me);
        }
        drop(threads);
        let guard = self.held.lock().unwrap();
        let (_g, t) = self
            .cv
            .wait_timeout_while(guard, Duration::from_secs(30), |h| h[gate_slot(d)])
            .unwrap();
        if t.timed_out() {
            return Err(Error::new(ErrorKind::Timeout, "test gate never opened"));
        }
        Ok(())
    }
}

/// The cache the worker registers: the device memory behind a [`Gate`]. The model stand-in
/// reads and writes `inner` directly (never gated).
#[derive(Debug)]
struct GatedDevice {
    inner: Arc<MemoryTier>,
    gate: Arc<Gate>,
}

impl StorageTier for GatedDevice {
    fn kind(&self) -> TierKind {
        self.inner.kind()
    }
    fn capability(&self) -> Capability {
        self.inner.capability()
    }
    fn layout(&self) -> &Layout {
        self.inner.layout()
    }
    fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> kvbm_connector::Result<()> {
        self.gate.pass(Direction::Store)?;
        self.inner.read_block(block, dst)
    }
    fn write_block(&self, block: usize, src: &[IoSlice<'_>]) -> kvbm_connector::Result<()> {
        self.gate.pass(Direction::Load)?;
        self.inner.write_block(block, src)
    }
    fn with_block(
        &self,
        block: usize,
        f: &mut dyn FnMut(&[IoSlice<'_>]) -> kvbm_connector::Result<()>,
    ) -> kvbm_connector::Result<()> {
        self.gate.pass(Direction::Store)?;
        self.inner.with_block(block, f)
    }
    fn with_block_mut(
        &self,
        block: usize,
        f: &mut dyn FnMut(&mut [IoSliceMut<'_>]) -> kvbm_connector::Result<()>,
    ) -> kvbm_connector::Result<()> {
        self.gate.pass(Direction::Load)?;
        self.inner.with_block_mut(block, f)
    }
}

// ------------------------------------------------------------------------------------------------
// The engine stand-in
// ------------------------------------------------------------------------------------------------

/// Which per-layer tensor shape the attention backend registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    /// `[2, num_blocks, page, heads, head_dim]` (outer-major).
    FlashAttention,
    /// `[num_blocks, 2, page, heads, head_dim]` (block-major).
    FlashInfer,
    /// vLLM's CPU attention: `[num_blocks, heads, page, 2 × head_dim]`, each (block, head) slab
    /// all of K then all of V (head-major).
    CpuAttention,
}

/// How a request preempted earlier reaches the worker when it is scheduled again *without* an
/// external load. vLLM v1's scheduler puts it in `scheduled_resumed_reqs`; with the default
/// (V1) model runner those become `CachedRequestData` entries with
/// `resumed_from_preemption = true` and the whole new block list; with the V2 model runner
/// (`use_v2_model_runner`) recent vLLM folds them into `scheduled_new_reqs`, carrying all
/// tokens (prompt and generated). A preempted request that loads external KV first passes
/// through WAITING_FOR_REMOTE_KVS → WAITING and comes back as a new request either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ModelRunner {
    V1,
    V2,
}

#[derive(Debug, Clone)]
struct Opts {
    device_blocks: usize,
    host_blocks: usize,
    disk_blocks: usize,
    /// Tokens per step (chunked prefill).
    budget: usize,
    backend: Backend,
    runner: ModelRunner,
    /// A sliding window of this many tokens on every layer (vLLM's `SlidingWindowManager`):
    /// device block 0 is the null block, which the block table holds for the blocks before
    /// the window.
    window: Option<usize>,
    /// vLLM on the CPU: the worker copies device blocks on the engine's thread
    /// (`transfer.inline_device_copies`). Off, the stand-in plays a GPU engine, whose copies run
    /// on the worker's threads (and can be held at the gate).
    inline: bool,
}

impl Default for Opts {
    fn default() -> Self {
        Self {
            device_blocks: 32,
            host_blocks: 32,
            disk_blocks: 64,
            budget: 32,
            backend: Backend::FlashAttention,
            runner: ModelRunner::V1,
            window: None,
            inline: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Waiting,
    WaitingForRemoteKvs,
    Running,
    Preempted,
    /// Finished; its device blocks are kept until a worker reports it in `finished_sending`.
    FinishedHeld,
}

#[derive(Debug)]
struct Req {
    prompt_len: usize,
    /// `all_token_ids`.
    tokens: Vec<u32>,
    max_tokens: usize,
    num_computed: usize,
    blocks: Vec<usize>,
    status: Status,
    /// Tokens the engine's own device prefix cache pretends to have (block aligned), used once.
    local_hit: usize,
    /// Request block indices an asynchronous load fills.
    loading: std::ops::Range<usize>,
    load_failed: bool,
}

/// A block the connector stored, as the test expects to find it.
#[derive(Debug, Clone)]
struct Placed {
    req: String,
    index: usize,
    image: Vec<u8>,
}

/// What one step returned to the scheduler.
#[derive(Debug, Default)]
struct StepReport {
    finished_sending: BTreeSet<String>,
    finished_recving: BTreeSet<String>,
    load_errors: BTreeSet<usize>,
    preempted: BTreeSet<String>,
    /// Requests finished this step and whether `request_finished` asked to delay the free.
    finished: Vec<(String, bool)>,
}

/// vLLM v1's engine core in miniature: its scheduler (FCFS, chunked prefill, preemption of the
/// newest running request, WAITING_FOR_REMOTE_KVS), a model runner driving the worker-side
/// connector, and `update_from_output`. Where vLLM versions differ it follows recent vLLM
/// (num_computed_tokens set when an async load is allocated; load failures recomputed from the
/// first failed block; `preempted_req_ids` in the scheduler output).
struct Engine {
    sched: VllmScheduler,
    worker: VllmWorker,
    device: Arc<MemoryTier>,
    gate: Arc<Gate>,
    dir: tempfile::TempDir,
    opts: Opts,
    free: BTreeSet<usize>,
    reqs: BTreeMap<String, Req>,
    waiting: VecDeque<String>,
    running: Vec<String>,
    /// `finished_req_ids` of the next scheduler output.
    finished_ids: HashSet<String>,
    /// `finished_recving` not yet consumed by the scheduler.
    recving: HashSet<String>,
    step_no: usize,
    metas: Vec<ConnectorMetadata>,
    outputs: Vec<SchedulerOutput>,
    /// `(step, request, block index)` of every device → lower-tier store, in order.
    stores: Vec<(usize, String, usize)>,
    /// `(request, local, external, load_async)` of every `get_num_new_matched_tokens`.
    matches: Vec<(String, usize, usize, bool)>,
    host_placed: HashMap<usize, Placed>,
    disk_placed: HashMap<usize, Placed>,
    /// Stored blocks to compare once their transfer has finished.
    unverified: Vec<(TierKind, usize, Placed)>,
}

impl Drop for Engine {
    /// A failed assertion must not leave transfers parked at the gate (the worker's runtime
    /// would wait for them on drop).
    fn drop(&mut self) {
        self.gate.hold(Direction::Load, false);
        self.gate.hold(Direction::Store, false);
    }
}

fn view<'a>(id: &'a str, r: &'a Req) -> Request<'a> {
    Request {
        request_id: id,
        all_token_ids: &r.tokens,
        cache_salt: None,
        lora_name: None,
        num_computed_tokens: r.num_computed,
    }
}

fn push_cached(
    c: &mut CachedRequestData,
    id: &str,
    resumed: bool,
    new_tokens: &[u32],
    new_blocks: Option<Vec<usize>>,
    num_computed: usize,
) {
    c.req_ids.push(id.to_string());
    c.resumed_from_preemption.push(resumed);
    c.new_token_ids.push(new_tokens.to_vec());
    c.new_block_ids.push(new_blocks.map(|b| vec![b]));
    c.num_computed_tokens.push(num_computed);
}

impl Engine {
    fn new(opts: Opts) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut config = Config::default();
        config.host.cache_blocks = Some(opts.host_blocks);
        config.disk.cache_blocks = Some(opts.disk_blocks);
        config.disk.dir = dir.path().to_path_buf();
        config.transfer.inline_device_copies = opts.inline;
        // vLLM's block pool keeps block 0 as its null block (never in a request's list but as
        // a stand-in for blocks a sliding window dropped): `device_blocks` usable blocks + it.
        let n = opts.device_blocks + 1;
        let (shape, layout) = match opts.backend {
            Backend::FlashAttention => (
                vec![2, n, BS, HEADS, HEAD_DIM],
                Layout::layer_separate(dims(), n, BlockOrder::OuterMajor),
            ),
            Backend::FlashInfer => (
                vec![n, 2, BS, HEADS, HEAD_DIM],
                Layout::layer_separate(dims(), n, BlockOrder::BlockMajor),
            ),
            Backend::CpuAttention => (
                vec![n, HEADS, BS, 2 * HEAD_DIM],
                Layout::layer_separate_head_major(dims(), n, HEADS),
            ),
        };
        let override_kind = match opts.backend {
            // With 2 heads the shape also reads as block-major: the attention backend says which.
            Backend::CpuAttention => Some(kvbm_connector::LayoutKind::LayerSeparateHeadMajor),
            _ => None,
        };
        let device = Arc::new(MemoryTier::new(TierKind::Device, layout.unwrap()).unwrap());
        let gate = Arc::new(Gate::default());
        let cache: Arc<dyn StorageTier> = Arc::new(GatedDevice {
            inner: device.clone(),
            gate: gate.clone(),
        });
        let layers: Vec<(String, Vec<usize>)> = (0..LAYERS)
            .map(|l| (layer_name(l), shape.clone()))
            .collect();

        // vLLM builds the workers and registers their caches first (non-blocking), then the
        // scheduler-side connector (blocking: returns once the barrier completed).
        let (lt, wts) = in_process(1);
        let mut worker = VllmWorker::new(config.clone(), BS, 1, wts[0].clone()).unwrap();
        let started = Instant::now();
        worker
            .register_kv_caches(&layers, DTYPE, Some(n), override_kind, cache)
            .unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "worker init blocked"
        );
        let mut sched = VllmScheduler::new(config, BS, lt).unwrap();
        assert!(sched.leader_mut().is_ready());
        let deadline = Instant::now() + WAIT;
        while !worker.worker().is_ready() {
            assert!(Instant::now() < deadline, "worker never became ready");
            std::thread::sleep(Duration::from_millis(1));
        }
        for b in 0..n {
            device.write_block_from_slice(b, &junk(b)).unwrap();
        }
        Self {
            sched,
            worker,
            device,
            gate,
            dir,
            free: (1..n).collect(),
            opts,
            reqs: BTreeMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            finished_ids: HashSet::new(),
            recving: HashSet::new(),
            step_no: 0,
            metas: Vec::new(),
            outputs: Vec::new(),
            stores: Vec::new(),
            matches: Vec::new(),
            host_placed: HashMap::new(),
            disk_placed: HashMap::new(),
            unverified: Vec::new(),
        }
    }

    fn add(&mut self, id: &str, prompt: Vec<u32>, max_tokens: usize) {
        self.add_with_local_hit(id, prompt, max_tokens, 0);
    }

    /// A request whose first `local_hit` tokens the engine's own prefix cache has on device.
    fn add_with_local_hit(&mut self, id: &str, prompt: Vec<u32>, max_tokens: usize, local: usize) {
        assert_eq!(local % BS, 0);
        let req = Req {
            prompt_len: prompt.len(),
            tokens: prompt,
            max_tokens,
            num_computed: 0,
            blocks: Vec::new(),
            status: Status::Waiting,
            local_hit: local,
            loading: 0..0,
            load_failed: false,
        };
        assert!(self.reqs.insert(id.to_string(), req).is_none());
        self.waiting.push_back(id.to_string());
    }

    fn metrics(&self) -> MetricsSnapshot {
        self.sched.leader().metrics().snapshot()
    }

    fn req(&self, id: &str) -> &Req {
        &self.reqs[id]
    }

    // --- device blocks ---------------------------------------------------------------------------

    fn alloc(&mut self, n: usize) -> Vec<usize> {
        assert!(self.free.len() >= n);
        (0..n).map(|_| self.free.pop_first().unwrap()).collect()
    }

    fn free_blocks(&mut self, blocks: &[usize]) {
        for &b in blocks {
            if self.is_null(b) {
                continue;
            }
            self.device.write_block_from_slice(b, &junk(b)).unwrap();
            assert!(self.free.insert(b), "device block {b} freed twice");
        }
    }

    /// Block 0 is vLLM's null block.
    fn is_null(&self, b: usize) -> bool {
        b == NULL_BLOCK
    }

    /// Request blocks before the window of `computed` tokens (vLLM's `get_num_skipped_tokens`:
    /// `computed - window + 1` tokens, whole blocks of them), 0 without a window.
    fn skipped_blocks(&self, computed: usize) -> usize {
        self.opts
            .window
            .map_or(0, |w| (computed + 1).saturating_sub(w) / BS)
    }

    /// vLLM's `remove_skipped_blocks`: a running request's blocks before its window are freed and
    /// replaced by the null block.
    fn skip_out_of_window(&mut self, id: &str) {
        let r = &self.reqs[id];
        let skip = self.skipped_blocks(r.num_computed).min(r.blocks.len());
        let gone: Vec<usize> = r.blocks[..skip]
            .iter()
            .copied()
            .filter(|&b| !self.is_null(b))
            .collect();
        self.free_blocks(&gone);
        let r = self.reqs.get_mut(id).unwrap();
        for b in &mut r.blocks[..skip] {
            *b = NULL_BLOCK;
        }
    }

    /// `n` block-table entries from request block index `first` on for a request with
    /// `computed` tokens: the null block before the window, fresh blocks after it.
    fn alloc_from(&mut self, first: usize, n: usize, computed: usize) -> Vec<usize> {
        let skip = self.skipped_blocks(computed);
        let nulls = skip.saturating_sub(first).min(n);
        let mut v = vec![NULL_BLOCK; nulls];
        v.extend(self.alloc(n - nulls));
        v
    }

    fn owner_of(&self, device_block: usize) -> (String, usize) {
        assert!(
            !self.is_null(device_block),
            "the connector read the null block"
        );
        self.reqs
            .iter()
            .find_map(|(id, r)| {
                r.blocks
                    .iter()
                    .position(|&b| b == device_block)
                    .map(|i| (id.clone(), i))
            })
            .unwrap_or_else(|| panic!("device block {device_block} belongs to no request"))
    }

    // --- scheduler ---------------------------------------------------------------------------------

    /// vLLM v1's `schedule()`: running requests first (preempting the newest when device blocks
    /// run out), then waiting ones if nothing was preempted. Returns the output and
    /// `(request, first token, tokens)` of what the model computes.
    fn schedule(&mut self) -> (SchedulerOutput, Vec<(String, usize, usize)>) {
        let mut out = SchedulerOutput {
            finished_req_ids: std::mem::take(&mut self.finished_ids),
            ..Default::default()
        };
        let mut work = Vec::new();
        let mut budget = self.opts.budget;
        let mut preempted = Vec::new();
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i].clone();
            self.skip_out_of_window(&id);
            let r = &self.reqs[&id];
            let start = r.num_computed;
            let n = (r.tokens.len() - start).min(budget);
            let need = blocks_for(start + n).saturating_sub(r.blocks.len());
            let mut fits = true;
            while self.free.len() < need {
                let victim = self.running.pop().unwrap();
                self.preempt(&victim);
                fits = victim != id;
                preempted.push(victim);
                if !fits {
                    break;
                }
            }
            if !fits {
                break;
            }
            let new_blocks = self.alloc(need);
            let r = self.reqs.get_mut(&id).unwrap();
            r.blocks.extend(&new_blocks);
            let new_blocks = (!new_blocks.is_empty()).then_some(new_blocks);
            push_cached(
                &mut out.scheduled_cached_reqs,
                &id,
                false,
                &r.tokens[start..start + n],
                new_blocks,
                start,
            );
            out.num_scheduled_tokens.insert(id.clone(), n);
            work.push((id, start, n));
            budget -= n;
            i += 1;
        }
        if preempted.is_empty() {
            self.schedule_waiting(&mut out, &mut work, &mut budget);
        }
        out.preempted_req_ids = preempted.into_iter().collect();
        (out, work)
    }

    fn preempt(&mut self, id: &str) {
        let r = self.reqs.get_mut(id).unwrap();
        let blocks = std::mem::take(&mut r.blocks);
        r.num_computed = 0;
        r.status = Status::Preempted;
        self.free_blocks(&blocks);
        self.waiting.push_front(id.to_string());
    }

    fn schedule_waiting(
        &mut self,
        out: &mut SchedulerOutput,
        work: &mut Vec<(String, usize, usize)>,
        budget: &mut usize,
    ) {
        let mut skipped = Vec::new();
        while *budget > 0 {
            let Some(id) = self.waiting.pop_front() else {
                break;
            };
            if self.reqs[&id].status == Status::WaitingForRemoteKvs {
                if !self.recving.remove(&id) {
                    skipped.push(id);
                    continue;
                }
                self.remote_kvs_arrived(&id);
            }
            let r = &self.reqs[&id];
            let (computed, external, load_async) = if r.num_computed == 0 {
                let local = r.local_hit;
                let (ext, load_async) = self
                    .sched
                    .get_num_new_matched_tokens(&view(&id, r), local)
                    .unwrap();
                let ext = ext.expect("this connector always knows its match");
                self.matches.push((id.clone(), local, ext, load_async));
                (local + ext, ext, load_async)
            } else {
                (r.num_computed, 0, false)
            };
            let r = &self.reqs[&id];
            let n = if load_async {
                0
            } else {
                (r.tokens.len() - computed).min(*budget)
            };
            let have = r.blocks.len();
            let entries = blocks_for(computed + n).saturating_sub(have);
            let need = entries
                - self
                    .skipped_blocks(computed)
                    .saturating_sub(have)
                    .min(entries);
            if self.free.len() < need {
                // vLLM stops admitting (no preemption on behalf of waiting requests).
                self.waiting.push_front(id);
                break;
            }
            let new_blocks = self.alloc_from(have, entries, computed);
            let r = self.reqs.get_mut(&id).unwrap();
            r.blocks.extend(&new_blocks);
            if r.num_computed == 0 {
                for b in 0..r.local_hit / BS {
                    if r.blocks[b] == NULL_BLOCK {
                        continue;
                    }
                    let img = expected_block(&r.tokens, b);
                    self.device
                        .write_block_from_slice(r.blocks[b], &img)
                        .unwrap();
                }
                r.local_hit = 0;
            }
            let blocks = r.blocks.clone();
            self.sched
                .update_state_after_alloc(&view(&id, r), std::slice::from_ref(&blocks), external)
                .unwrap();
            if load_async {
                // Recent vLLM sets num_computed_tokens already, though nothing is computed yet.
                r.status = Status::WaitingForRemoteKvs;
                r.loading = (computed - external) / BS..computed / BS;
                r.num_computed = computed;
                skipped.push(id);
                continue;
            }
            let resumed = r.status == Status::Preempted;
            r.status = Status::Running;
            if resumed && self.opts.runner == ModelRunner::V1 {
                push_cached(
                    &mut out.scheduled_cached_reqs,
                    &id,
                    true,
                    &r.tokens[computed..computed + n],
                    Some(blocks),
                    computed,
                );
            } else {
                out.scheduled_new_reqs.push(NewRequestData {
                    req_id: id.clone(),
                    prompt_token_ids: match self.opts.runner {
                        ModelRunner::V1 => r.tokens[..r.prompt_len].to_vec(),
                        ModelRunner::V2 => r.tokens.clone(),
                    },
                    first_token_index: 0,
                    block_ids: vec![blocks],
                    num_computed_tokens: computed,
                });
            }
            out.num_scheduled_tokens.insert(id.clone(), n);
            self.running.push(id.clone());
            work.push((id, computed, n));
            *budget -= n;
        }
        for id in skipped.into_iter().rev() {
            self.waiting.push_front(id);
        }
    }

    /// vLLM's `_update_waiting_for_remote_kv`.
    fn remote_kvs_arrived(&mut self, id: &str) {
        let r = self.reqs.get_mut(id).unwrap();
        if r.load_failed {
            // num_computed was cut back to the first failed block when the error was reported.
            if r.num_computed == 0 {
                let blocks = std::mem::take(&mut r.blocks);
                self.free_blocks(&blocks);
            }
        } else {
            let mut computed = (r.blocks.len() * BS).min(r.tokens.len());
            if computed == r.tokens.len() {
                computed -= 1;
            }
            r.num_computed = computed;
        }
        let r = self.reqs.get_mut(id).unwrap();
        r.status = Status::Waiting;
        r.load_failed = false;
        r.loading = 0..0;
    }

    // --- one engine iteration --------------------------------------------------------------------

    fn step(&mut self) -> StepReport {
        self.step_no += 1;
        let (out, work) = self.schedule();
        let bytes = self.sched.build_connector_meta(&out).unwrap();
        let meta = ConnectorMetadata::decode(&bytes).unwrap();
        self.note_stores(&meta);
        self.metas.push(meta);
        self.outputs.push(out.clone());
        // vLLM's `_update_after_schedule`.
        for (id, _, n) in &work {
            self.reqs.get_mut(id).unwrap().num_computed += n;
        }

        let w = &mut self.worker;
        w.bind_connector_metadata(&bytes).unwrap();
        w.start_load_kv().unwrap();
        for l in 0..LAYERS {
            let name = layer_name(l);
            self.worker.wait_for_layer_load(&name).unwrap();
            self.forward_layer(l, &work);
            self.worker.save_kv_layer(&name).unwrap();
        }
        self.worker.wait_for_save().unwrap();
        if self.gate.is_open() {
            self.worker.worker().wait_idle(WAIT).unwrap();
            self.verify_stores();
        }
        let (sending, recving) = self.worker.get_finished(&out.finished_req_ids);
        let errors = self.worker.get_block_ids_with_load_errors();
        self.worker.clear_connector_metadata().unwrap();

        let mut report = StepReport {
            finished_sending: sending.unwrap_or_default().into_iter().collect(),
            finished_recving: recving.unwrap_or_default().into_iter().collect(),
            load_errors: errors.into_iter().collect(),
            preempted: out.preempted_req_ids.iter().cloned().collect(),
            finished: Vec::new(),
        };
        self.update_from_output(&work, &mut report);
        if self.gate.is_open() {
            self.settle();
        }
        report
    }

    /// Lets every transfer finish and the leader apply the completions.
    fn settle(&mut self) {
        self.worker.worker().wait_idle(WAIT).unwrap();
        self.verify_stores();
        self.sched.leader_mut().process_completions();
    }

    /// The model stand-in: layer `l`'s KV of every token computed this step.
    fn forward_layer(&mut self, l: usize, work: &[(String, usize, usize)]) {
        for (id, start, n) in work {
            let r = &self.reqs[id];
            let h = prefix_hashes(&r.tokens[..start + n]);
            for b in start / BS..blocks_for(start + n) {
                let dev = r.blocks[b];
                let mut img = self.device.read_block_to_vec(dev).unwrap();
                let (lo, hi) = ((b * BS).max(*start), ((b + 1) * BS).min(start + n));
                for (p, &prefix) in h.iter().enumerate().take(hi).skip(lo) {
                    for kv in 0..2 {
                        let off = canonical_offset(l, kv, p % BS);
                        img[off..off + TOKEN_BYTES].copy_from_slice(&token_kv(prefix, l, kv, p));
                    }
                }
                self.device.write_block_from_slice(dev, &img).unwrap();
            }
        }
    }

    /// vLLM's `update_from_output`: load errors, sampled tokens and finishes, then KV transfers.
    fn update_from_output(&mut self, work: &[(String, usize, usize)], report: &mut StepReport) {
        if !report.load_errors.is_empty() {
            assert!(
                !report.load_errors.contains(&NULL_BLOCK),
                "the null block reported as a load error"
            );
            for r in self.reqs.values_mut() {
                if r.status != Status::WaitingForRemoteKvs {
                    continue;
                }
                if let Some(i) = r.blocks.iter().position(|b| report.load_errors.contains(b)) {
                    r.num_computed = r.num_computed.min(i * BS);
                    r.load_failed = true;
                }
            }
        }
        for (id, _, _) in work {
            let r = self.reqs.get_mut(id).unwrap();
            if r.num_computed < r.tokens.len() {
                continue; // a prefill chunk: nothing sampled
            }
            let t = sample(&r.tokens);
            r.tokens.push(t);
            if r.tokens.len() - r.prompt_len >= r.max_tokens {
                let delay = self.finish(id);
                report.finished.push((id.clone(), delay));
            }
        }
        for id in &report.finished_recving {
            let Some(r) = self.reqs.get(id) else { continue };
            if r.status != Status::WaitingForRemoteKvs {
                // Aborted while loading. Recent vLLM frees the blocks here (and then asserts on
                // a finished_sending for the same id); this engine leaves the free to
                // finished_sending so the scenario can go on. See
                // `aborted_load_is_reported_in_finished_sending_only`.
                continue;
            }
            for b in r.loading.clone() {
                let dev = r.blocks[b];
                if !report.load_errors.contains(&dev) && !self.is_null(dev) {
                    assert_block(
                        &self.device.read_block_to_vec(dev).unwrap(),
                        &expected_block(&r.tokens, b),
                        format_args!("request {id} block {b} loaded into device block {dev}"),
                    );
                }
            }
            self.recving.insert(id.clone());
        }
        for id in &report.finished_sending {
            let r = self
                .reqs
                .remove(id)
                .unwrap_or_else(|| panic!("finished_sending for unknown request {id}"));
            assert_eq!(r.status, Status::FinishedHeld, "{id} was not held");
            self.free_blocks(&r.blocks);
        }
    }

    /// The request finished (or was aborted): `request_finished`, then free or hold its blocks.
    /// Returns the connector's "delay free" answer.
    fn finish(&mut self, id: &str) -> bool {
        self.running.retain(|x| x != id);
        self.waiting.retain(|x| x != id);
        let r = &self.reqs[id];
        let (delay, params) = self
            .sched
            .request_finished(&view(id, r), &r.blocks)
            .unwrap();
        assert!(params.is_none());
        self.finished_ids.insert(id.to_string());
        if delay {
            self.reqs.get_mut(id).unwrap().status = Status::FinishedHeld;
        } else {
            let r = self.reqs.remove(id).unwrap();
            self.free_blocks(&r.blocks);
        }
        delay
    }

    /// A client abort between two steps (vLLM's `finish_requests`).
    fn abort(&mut self, id: &str) -> bool {
        self.finish(id)
    }

    fn is_idle(&self) -> bool {
        self.reqs.is_empty() && self.finished_ids.is_empty()
    }

    fn run_until_idle(&mut self) -> Vec<StepReport> {
        let mut reports = Vec::new();
        while !self.is_idle() {
            assert!(reports.len() < 200, "engine does not drain");
            reports.push(self.step());
        }
        reports
    }

    // --- checks ----------------------------------------------------------------------------------

    /// Records the blocks each store of `meta` copies, to verify once the store finished.
    fn note_stores(&mut self, meta: &ConnectorMetadata) {
        for op in &meta.operations {
            let t = op.transfer();
            if op.direction() != Direction::Store {
                if t.dst == TierKind::Device {
                    for &(_, d) in &t.pairs {
                        assert!(!self.is_null(d), "a load into the null block: {t:?}");
                    }
                }
                continue;
            }
            for &(s, d) in &t.pairs {
                let placed = match t.src {
                    TierKind::Device => {
                        let (req, index) = self.owner_of(s);
                        self.stores.push((self.step_no, req.clone(), index));
                        let image = expected_block(&self.reqs[&req].tokens, index);
                        Placed { req, index, image }
                    }
                    TierKind::Host => self.host_placed[&s].clone(),
                    other => panic!("store from {other}"),
                };
                match t.dst {
                    TierKind::Host => self.host_placed.insert(d, placed.clone()),
                    TierKind::Disk => self.disk_placed.insert(d, placed.clone()),
                    other => panic!("store to {other}"),
                };
                self.unverified.push((t.dst, d, placed));
            }
        }
    }

    fn verify_stores(&mut self) {
        let tiers = self.worker.worker().tiers().unwrap().clone();
        for (kind, block, placed) in std::mem::take(&mut self.unverified) {
            let tier = match kind {
                TierKind::Host => tiers.host.as_ref().unwrap(),
                _ => tiers.disk.as_ref().unwrap(),
            };
            assert_block(
                &tier.read_block_to_vec(block).unwrap(),
                &placed.image,
                format_args!(
                    "request {} block {} stored in {kind} block {block}",
                    placed.req, placed.index
                ),
            );
        }
    }

    /// Device → lower-tier stores of `req`: `(step, block index)`.
    fn stores_of(&self, req: &str) -> Vec<(usize, usize)> {
        self.stores
            .iter()
            .filter(|(_, r, _)| r == req)
            .map(|(s, _, i)| (*s, *i))
            .collect()
    }

    fn last_match(&self, req: &str) -> (usize, usize, bool) {
        self.matches
            .iter()
            .rev()
            .find(|m| m.0 == req)
            .map(|m| (m.1, m.2, m.3))
            .unwrap_or_else(|| panic!("{req} was never matched"))
    }

    /// Drains the engine, checks nothing is left anywhere and snapshots the metadata.
    fn finish_scenario(mut self, name: &str) {
        self.drain_and_check();
        let metas = &self.metas;
        let mut settings = insta::Settings::clone_current();
        settings.set_snapshot_path("../snapshots");
        settings.set_prepend_module_to_snapshot(false);
        settings.bind(|| insta::assert_yaml_snapshot!(format!("vllm__{name}"), metas));
    }

    /// Drains and checks the engine (as [`Engine::finish_scenario`]) and returns its metadata,
    /// for scenarios whose metadata must equal another scenario's by design.
    /// Serialized, as the snapshots compare them.
    fn into_metadata(mut self) -> Vec<serde_json::Value> {
        self.drain_and_check();
        std::mem::take(&mut self.metas)
            .iter()
            .map(|m| serde_json::to_value(m).expect("metadata serializes"))
            .collect()
    }

    /// Drains the engine and checks nothing is left in the leader, the worker or the pools.
    fn drain_and_check(&mut self) {
        self.run_until_idle();
        self.settle();
        let leader = self.sched.leader();
        assert_eq!(leader.num_slots(), 0, "leader slots left");
        assert_eq!(leader.num_operations_in_flight(), 0, "operations left");
        assert_eq!(self.worker.worker().num_slots(), 0, "worker slots left");
        let (host, disk) = leader.pool_stats().unwrap();
        for s in host.iter().chain(disk.iter()) {
            assert_eq!((s.mutable, s.active), (0, 0), "blocks still held: {s:?}");
        }
        assert_eq!(
            self.free.len(),
            self.opts.device_blocks,
            "device blocks leaked"
        );
        assert!(self.unverified.is_empty());
    }
}

/// Runs `prompt` alone to completion so its full blocks reach the host tier.
fn warm(e: &mut Engine, id: &str, prompt: &[u32]) {
    e.add(id, prompt.to_vec(), 1);
    e.run_until_idle();
}

/// Runs `prompt` again as request `id` to completion; the connector's match for it.
fn repeat(e: &mut Engine, id: &str, prompt: &[u32]) -> (usize, usize, bool) {
    e.add(id, prompt.to_vec(), 1);
    e.step();
    let m = e.last_match(id);
    e.run_until_idle();
    m
}

// ------------------------------------------------------------------------------------------------
// Scenarios
// ------------------------------------------------------------------------------------------------

#[test]
fn cold_request() {
    let mut e = Engine::new(Opts::default());
    e.add("a", tokens(100, 10), 3);
    let first = e.step();
    assert_eq!(e.last_match("a"), (0, 0, false));
    assert!(first.finished_recving.is_empty());
    let reports = e.run_until_idle();
    // Blocks 0-1 are computed by the prefill, block 2 by the second decode step.
    assert_eq!(e.stores_of("a"), vec![(1, 0), (1, 1), (3, 2)]);
    assert_eq!(reports[1].finished, vec![("a".to_string(), false)]);
    let m = e.metrics();
    assert_eq!(
        m.transfer(TierKind::Device, TierKind::Host).unwrap().blocks,
        3
    );
    assert_eq!(m.host_hit_tokens + m.disk_hit_tokens, 0);
    e.finish_scenario("cold_request");
}

fn hit_from_host(backend: Backend) -> Engine {
    let mut e = Engine::new(Opts {
        backend,
        ..Opts::default()
    });
    let a = tokens(200, 17);
    warm(&mut e, "a", &a);
    let mut b = a[..16].to_vec();
    b.extend(tokens(900, 5));
    e.add("b", b, 2);
    let r = e.step();
    assert_eq!(e.last_match("b"), (0, 16, true));
    assert_eq!(e.req("b").status, Status::WaitingForRemoteKvs);
    assert_eq!(r.finished_recving, BTreeSet::from(["b".to_string()]));
    // Loaded bytes were compared when finished_recving came; now it computes the rest.
    let r = e.step();
    assert!(r.finished_recving.is_empty());
    assert_eq!(e.req("b").num_computed, 21);
    assert_eq!(e.metrics().host_hit_tokens, 16);
    // Its own full block 4 is stored; the loaded ones are already on host.
    assert_eq!(e.stores_of("b"), vec![(e.step_no, 4)]);
    e
}

#[test]
fn prefix_hit_from_host() {
    hit_from_host(Backend::FlashAttention).finish_scenario("prefix_hit_from_host");
}

/// The metadata names blocks, never bytes: with FlashInfer's device layout it is the same as
/// with FlashAttention's, by design.
#[test]
fn prefix_hit_from_host_flashinfer_layout() {
    assert_eq!(
        hit_from_host(Backend::FlashInfer).into_metadata(),
        hit_from_host(Backend::FlashAttention).into_metadata()
    );
}

/// vLLM's CPU attention layout (head-major): the same metadata as FlashAttention's, and the
/// loaded bytes (checked by the engine against the canonical image) are right.
#[test]
fn prefix_hit_from_host_cpu_attention_layout() {
    assert_eq!(
        hit_from_host(Backend::CpuAttention).into_metadata(),
        hit_from_host(Backend::FlashAttention).into_metadata()
    );
}

/// A host tier smaller than a request: the blocks it cannot take stream straight from the
/// device to disk, so the repeat is served every full block (host, then disk), none dropped.
#[test]
fn host_tier_smaller_than_a_request_streams_the_rest_to_disk() {
    let mut e = Engine::new(Opts {
        host_blocks: 2,
        ..Opts::default()
    });
    let a = tokens(500, 29); // 7 full blocks, all computed by one prefill step
    warm(&mut e, "a", &a);
    let m = e.metrics();
    assert_eq!(m.offload_dropped_blocks, 0);
    assert_eq!(
        m.transfer(TierKind::Device, TierKind::Host).unwrap().blocks,
        2
    );
    assert_eq!(
        m.transfer(TierKind::Device, TierKind::Disk).unwrap().blocks,
        5
    );
    assert_eq!(repeat(&mut e, "b", &a), (0, 28, true));
    let m = e.metrics();
    assert_eq!(m.host_hit_tokens, 8);
    assert_eq!(m.disk_hit_tokens, 20);
    assert_eq!(m.load_error_blocks, 0);
    e.finish_scenario("host_tier_smaller_than_a_request");
}

/// Without a disk tier the blocks the host cannot take are dropped, but counted (and logged),
/// never silently.
#[test]
fn host_tier_smaller_than_a_request_without_disk_counts_what_it_drops() {
    let mut e = Engine::new(Opts {
        host_blocks: 2,
        disk_blocks: 0,
        ..Opts::default()
    });
    let a = tokens(600, 29);
    warm(&mut e, "a", &a);
    assert_eq!(e.metrics().offload_dropped_blocks, 5);
    assert_eq!(repeat(&mut e, "b", &a), (0, 8, true));
}

#[test]
fn hit_from_disk_after_host_eviction() {
    let mut e = Engine::new(Opts {
        host_blocks: 4,
        ..Opts::default()
    });
    let a = tokens(300, 17);
    warm(&mut e, "a", &a);
    warm(&mut e, "c", &tokens(400, 17)); // evicts a's 4 blocks from host
    assert_eq!(repeat(&mut e, "b", &a), (0, 16, true));
    let m = e.metrics();
    assert_eq!(m.disk_hit_tokens, 16);
    assert_eq!(m.host_hit_tokens, 0);
    assert_eq!(m.load_error_blocks, 0);
    e.finish_scenario("hit_from_disk_after_host_eviction");
}

#[test]
fn chunked_prefill_stores_each_block_once_in_its_step() {
    let mut e = Engine::new(Opts {
        budget: 14,
        ..Opts::default()
    });
    e.add("a", tokens(500, 40), 1);
    let reports = e.run_until_idle();
    // 14 + 14 + 12 tokens: full blocks after each step are 3, 7, 10.
    let want: Vec<(usize, usize)> = [(1, 0..3), (2, 3..7), (3, 7..10)]
        .into_iter()
        .flat_map(|(s, r)| r.map(move |i| (s, i)))
        .collect();
    assert_eq!(e.stores_of("a"), want);
    assert_eq!(reports[2].finished, vec![("a".to_string(), false)]);
    e.finish_scenario("chunked_prefill");
}

#[test]
fn decode_fills_new_blocks_that_later_prompts_hit() {
    let mut e = Engine::new(Opts::default());
    e.add("a", tokens(600, 6), 11);
    e.run_until_idle();
    // Block 0 is prompt; blocks 1-3 are completed by decode steps 2, 6 and 10.
    assert_eq!(e.stores_of("a"), vec![(1, 0), (3, 1), (7, 2), (11, 3)]);
    let mut all = tokens(600, 6);
    while all.len() < 17 {
        all.push(sample(&all));
    }
    let mut b = all.clone();
    b.extend(tokens(950, 3));
    e.add("b", b, 1);
    e.run_until_idle();
    assert_eq!(e.last_match("b"), (0, 16, true));
    assert_eq!(e.metrics().host_hit_tokens, 16);
    e.finish_scenario("decode_fills_new_blocks");
}

#[test]
fn preempted_request_resumes_from_its_own_offloaded_blocks() {
    let mut e = Engine::new(Opts {
        device_blocks: 8,
        ..Opts::default()
    });
    e.add("a", tokens(700, 12), 8);
    e.add("b", tokens(800, 12), 8);
    let mut preempted_at = None;
    while preempted_at.is_none() {
        let r = e.step();
        if r.preempted.contains("b") {
            preempted_at = Some(e.step_no);
        }
        assert!(e.step_no < 20);
    }
    // b had computed 16 tokens (4 full blocks, all stored) and holds 17.
    let b = &e.req("b");
    assert_eq!(
        (b.status, b.num_computed, b.tokens.len()),
        (Status::Preempted, 0, 17)
    );
    e.run_until_idle();
    assert_eq!(e.last_match("b"), (0, 16, true));
    assert_eq!(e.metrics().host_hit_tokens, 16);
    // Each of b's full blocks was stored once, before the preemption.
    let b_stores = e.stores_of("b");
    assert_eq!(
        b_stores.iter().map(|s| s.1).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    assert!(b_stores.iter().all(|s| s.0 < preempted_at.unwrap()));
    e.finish_scenario("preempt_resume");
}

/// A request preempted before it filled a block comes back with nothing to load; how vLLM
/// describes it to the connector depends on the model runner.
fn preempt_resume_without_hit(runner: ModelRunner) -> Engine {
    let mut e = Engine::new(Opts {
        device_blocks: 3,
        runner,
        ..Opts::default()
    });
    e.add("a", tokens(1100, 7), 5);
    e.add("b", tokens(1200, 2), 3);
    e.step(); // a: 7 tokens, b: 2 tokens, no block left
    e.step(); // a completes block 1, b decodes in block 0
    let r = e.step(); // a needs a block: b (newest) is preempted with 3 computed tokens
    assert_eq!(r.preempted, BTreeSet::from(["b".to_string()]));
    e.run_until_idle();
    let (local, ext, _) = e.last_match("b");
    assert_eq!((local, ext), (0, 0));
    // b (2 prompt + 2 generated tokens) is rescheduled in step 6, once a has finished.
    let out = &e.outputs[5];
    match runner {
        ModelRunner::V1 => {
            let c = &out.scheduled_cached_reqs;
            assert_eq!(c.req_ids, vec!["b".to_string()]);
            assert_eq!(c.resumed_from_preemption, vec![true]);
            assert_eq!(c.new_token_ids[0].len(), 4);
        }
        ModelRunner::V2 => {
            assert_eq!(out.scheduled_new_reqs.len(), 1);
            assert_eq!(out.scheduled_new_reqs[0].prompt_token_ids.len(), 4);
        }
    }
    // b's block 0 is stored once, after the resume recomputed it.
    assert_eq!(e.stores_of("b"), vec![(6, 0)]);
    e
}

#[test]
fn preempt_resume_without_hit_v1_runner() {
    preempt_resume_without_hit(ModelRunner::V1).finish_scenario("preempt_resume_without_hit");
}

/// The two model runners describe the resume differently to the connector, but what the
/// connector tells its workers is the same, by design.
#[test]
fn preempt_resume_without_hit_v2_runner() {
    assert_eq!(
        preempt_resume_without_hit(ModelRunner::V2).into_metadata(),
        preempt_resume_without_hit(ModelRunner::V1).into_metadata()
    );
}

/// Aborts `b` while its load from host is held at the gate; returns the engine and the report
/// of the step that released `b`.
fn abort_while_loading() -> (Engine, StepReport) {
    let mut e = Engine::new(Opts::default());
    let a = tokens(1300, 17);
    warm(&mut e, "a", &a);
    e.gate.hold(Direction::Load, true);
    e.add("b", a.clone(), 1);
    let r = e.step();
    assert_eq!(e.req("b").status, Status::WaitingForRemoteKvs);
    assert!(r.finished_recving.is_empty());
    let b_blocks = e.req("b").blocks.clone();
    assert!(e.abort("b"), "abort during a load must delay the free");
    let r = e.step();
    assert_eq!(e.metas.last().unwrap().hold, vec!["b".into()]);
    assert!(
        r.finished_sending.is_empty(),
        "released while its load runs"
    );
    assert!(b_blocks.iter().all(|b| !e.free.contains(b)));
    e.gate.hold(Direction::Load, false);
    e.settle();
    // The load finished into blocks the engine still holds.
    for (i, &dev) in b_blocks.iter().enumerate().take(4) {
        assert_block(
            &e.device.read_block_to_vec(dev).unwrap(),
            &expected_block(&a, i),
            format_args!("block {i}"),
        );
    }
    let r = e.step();
    assert_eq!(r.finished_sending, BTreeSet::from(["b".to_string()]));
    assert!(b_blocks.iter().all(|b| e.free.contains(b)));
    (e, r)
}

#[test]
fn abort_while_load_in_flight_delays_the_free_until_the_load_finished() {
    let (e, _) = abort_while_loading();
    e.finish_scenario("abort_while_loading");
}

/// vLLM on the CPU, where the device cache is host memory: the worker copies a step's loads in
/// `start_load_kv` and its stores when the forward pass is done, on the engine's own thread, so
/// no copy waits for a time slice of the worker's threads on a busy host. A load is reported in
/// the step that submitted it; a request whose blocks were stored in its last step is not held.
/// (With copies on the worker's threads the gate sees those threads, not this one.)
#[test]
fn on_the_cpu_device_copies_run_on_the_engines_thread() {
    let mut e = Engine::new(Opts {
        inline: true,
        ..Opts::default()
    });
    let a = tokens(1300, 17);
    e.add("a", a.clone(), 1);
    let r = e.step();
    // Its one full block was stored before the step ended: nothing to hold its blocks for.
    assert_eq!(r.finished, vec![("a".to_string(), false)]);
    assert_eq!(e.sched.leader().num_operations_in_flight(), 0);
    e.add("b", a.clone(), 1);
    let r = e.step();
    assert_eq!(e.last_match("b"), (0, 16, true));
    assert_eq!(r.finished_recving, BTreeSet::from(["b".to_string()]));
    e.run_until_idle();
    let me = std::thread::current().id();
    let threads = e.gate.threads.lock().unwrap().clone();
    assert_eq!(threads, vec![me], "device blocks moved on other threads");
    e.drain_and_check();
}

#[test]
fn finish_with_stores_in_flight_keeps_blocks_until_finished_sending() {
    let mut e = Engine::new(Opts::default());
    e.gate.hold(Direction::Store, true);
    let a = tokens(1400, 9);
    e.add("a", a.clone(), 1);
    let r = e.step();
    assert_eq!(r.finished, vec![("a".to_string(), true)]);
    assert!(e.sched.leader().num_operations_in_flight() > 0);
    let a_blocks = e.req("a").blocks.clone();
    assert_eq!(e.req("a").status, Status::FinishedHeld);
    assert!(a_blocks.iter().all(|b| !e.free.contains(b)));
    // The next bind waits for the stores' device reads, so they must be let through first;
    // the leader then learns they finished before it builds the next metadata (else whether
    // their host → disk copy is queued in the next step or the one after would depend on
    // which thread runs first: a busy host flipped it).
    e.gate.hold(Direction::Store, false);
    e.settle();
    let r = e.step();
    assert_eq!(e.metas.last().unwrap().hold, vec!["a".into()]);
    assert_eq!(r.finished_sending, BTreeSet::from(["a".to_string()]));
    assert!(a_blocks.iter().all(|b| e.free.contains(b)));
    // What was stored is a's KV, not the junk of freed blocks.
    let mut b = a[..8].to_vec();
    b.extend(tokens(990, 3));
    e.add("b", b, 1);
    e.run_until_idle();
    assert_eq!(e.last_match("b"), (0, 8, true));
    e.finish_scenario("finish_with_stores_in_flight");
}

#[test]
fn two_requests_sharing_a_prefix_in_one_step_store_shared_blocks_once() {
    let mut e = Engine::new(Opts {
        budget: 64,
        ..Opts::default()
    });
    let shared = tokens(1500, 12);
    let mut a = shared.clone();
    a.extend(tokens(1600, 5));
    let mut b = shared.clone();
    b.extend(tokens(1700, 5));
    e.add("a", a, 1);
    e.add("b", b, 1);
    e.step();
    assert_eq!(e.last_match("b"), (0, 0, false)); // a's blocks are not stored yet
    e.run_until_idle();
    assert_eq!(e.stores_of("a"), vec![(1, 0), (1, 1), (1, 2), (1, 3)]);
    assert_eq!(e.stores_of("b"), vec![(1, 3)]);
    let m = e.metrics();
    assert_eq!(
        m.transfer(TierKind::Device, TierKind::Host).unwrap().blocks,
        5
    );
    e.finish_scenario("shared_prefix_same_step");
}

#[test]
fn full_prompt_match_drops_the_last_block() {
    let mut e = Engine::new(Opts::default());
    let a = tokens(1800, 16);
    warm(&mut e, "a", &a);
    e.add("b", a.clone(), 1);
    e.run_until_idle();
    assert_eq!(e.last_match("b"), (0, 12, true));
    // Beyond a local device-cache hit of two blocks, only block 2 may be loaded.
    e.add_with_local_hit("c", a.clone(), 1, 8);
    e.run_until_idle();
    assert_eq!(e.last_match("c"), (8, 4, true));
    assert_eq!(e.metrics().host_hit_tokens, 12 + 4);
    e.finish_scenario("full_prompt_match");
}

/// Warms `a` onto disk, flushes it out of host and flips bytes in the disk slot of its block
/// `corrupt`. Returns the engine.
fn engine_with_corrupt_disk_block(a: &[u32], corrupt: usize) -> Engine {
    let mut e = Engine::new(Opts {
        host_blocks: 4,
        ..Opts::default()
    });
    warm(&mut e, "a", a);
    warm(&mut e, "c", &tokens(2400, 17)); // evicts a from host
    let (&disk_block, _) = e
        .disk_placed
        .iter()
        .find(|(_, p)| p.req == "a" && p.index == corrupt)
        .expect("a's block reached disk");
    let file = std::fs::read_dir(e.dir.path())
        .unwrap()
        .map(|d| d.unwrap().path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("kvbm-disk-"))
        })
        .expect("disk tier file");
    let slot = dims().bytes_per_block().next_multiple_of(4096);
    let mut f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
    use std::io::Seek;
    f.seek(std::io::SeekFrom::Start((disk_block * slot + 17) as u64))
        .unwrap();
    f.write_all(&[0xde, 0xad, 0xbe, 0xef]).unwrap();
    f.sync_all().unwrap();
    e
}

#[test]
fn corrupt_disk_block_is_a_load_error_and_is_recomputed() {
    let a = tokens(2300, 17);
    let mut e = engine_with_corrupt_disk_block(&a, 2);
    e.add("b", a.clone(), 1);
    let r = e.step();
    assert_eq!(e.last_match("b"), (0, 16, true));
    let bad = e.req("b").blocks[2];
    assert_eq!(r.load_errors, BTreeSet::from([bad]));
    assert_eq!(r.finished_recving, BTreeSet::from(["b".to_string()]));
    // vLLM recomputes from the first failed block.
    assert_eq!(e.req("b").num_computed, 8);
    e.run_until_idle();
    let m = e.metrics();
    assert_eq!(m.disk_hit_tokens, 12);
    assert_eq!(m.load_error_blocks, 1);
    e.finish_scenario("load_error");
}

// ------------------------------------------------------------------------------------------------
// Regressions: bugs this suite found (fixed), kept as minimal reproductions
// ------------------------------------------------------------------------------------------------

/// vLLM sets `num_computed_tokens` (local + external) when it allocates for an asynchronous
/// load, so an abort while the load runs passes the loaded range to `request_finished`. Blocks
/// loaded from host are skipped (host has them), but blocks loaded from disk are not on host:
/// the leader stores the device blocks the load is still writing, and registers whatever they
/// held under the prefix's keys.
#[test]
fn abort_during_disk_load_does_not_store_the_blocks_being_loaded() {
    let mut e = Engine::new(Opts {
        host_blocks: 4,
        ..Opts::default()
    });
    let a = tokens(2500, 17);
    warm(&mut e, "a", &a);
    warm(&mut e, "c", &tokens(2600, 17)); // evicts a from host; a stays on disk
    e.gate.hold(Direction::Load, true);
    e.add("b", a.clone(), 1);
    e.step();
    assert_eq!(e.last_match("b"), (0, 16, true));
    assert!(e.abort("b"));
    e.step();
    assert_eq!(
        e.stores_of("b"),
        vec![],
        "stores device blocks being loaded"
    );
    e.gate.hold(Direction::Load, false);
    e.settle(); // compares what reached host with a's KV
    e.add("d", a.clone(), 1);
    e.run_until_idle(); // a hit on host would compare the loaded bytes
    e.drain_and_check();
}

/// After a block's disk load failed its checksum, the block stays registered on disk (and a
/// recomputed copy is never written over it, since disk "contains" the key): every later
/// request with that prefix loads it again and fails again.
#[test]
fn failed_disk_block_is_not_matched_again() {
    let a = tokens(2700, 17);
    let mut e = engine_with_corrupt_disk_block(&a, 2);
    e.add("b", a.clone(), 1);
    e.run_until_idle();
    assert_eq!(e.metrics().load_error_blocks, 1);
    warm(&mut e, "f", &tokens(2800, 17)); // a's blocks leave host again
    e.add("d", a.clone(), 1);
    let r = e.step();
    assert_eq!(
        r.load_errors,
        BTreeSet::new(),
        "the corrupt block was loaded again"
    );
    e.run_until_idle();
    assert_eq!(e.metrics().load_error_blocks, 1);
    e.drain_and_check();
}

/// When the first loaded block fails, vLLM cuts `num_computed_tokens` to 0, frees the blocks and
/// asks the connector again (`get_num_new_matched_tokens`). The leader's slot is still
/// `Onboarding`, and `stage_onboard` from there is refused.
#[test]
fn load_error_on_the_first_block_lets_the_request_rematch() {
    let a = tokens(2900, 17);
    let mut e = engine_with_corrupt_disk_block(&a, 0);
    e.add("b", a.clone(), 1);
    let r = e.step();
    assert_eq!(r.load_errors, BTreeSet::from([e.req("b").blocks[0]]));
    assert_eq!(e.req("b").num_computed, 0);
    e.run_until_idle();
    assert_eq!(e.metrics().load_error_blocks, 1);
    e.drain_and_check();
}

/// Recent vLLM delays the free of a request aborted in WAITING_FOR_REMOTE_KVS by itself, frees
/// it on the first of finished_recving / finished_sending that names it, and asserts
/// `req_id in self.requests` on the second. The worker reports the aborted request in both, in
/// the same `get_finished`: an AssertionError in the engine core.
#[test]
fn aborted_load_is_reported_in_finished_sending_only() {
    let (mut e, r) = abort_while_loading();
    assert_eq!(r.finished_recving, BTreeSet::new());
    e.drain_and_check();
}

/// The `_from` calls the Python binding makes (only the tokens the leader does not hold yet)
/// match exactly as the whole token list does; tokens already held are skipped; a lookup of an
/// unknown request must start at token 0, and a gap is refused.
#[test]
fn token_deltas_match_as_whole_token_lists() {
    let mut e = Engine::new(Opts::default());
    let a = tokens(200, 17);
    warm(&mut e, "a", &a);
    let s = &mut e.sched;
    let req = |id: &'static str, t: &'static [u32]| Request {
        request_id: id,
        all_token_ids: t,
        cache_salt: None,
        lora_name: None,
        num_computed_tokens: 0,
    };
    let a: &'static [u32] = Box::leak(a.into_boxed_slice());
    let whole = s.get_num_new_matched_tokens(&req("whole", a), 0).unwrap();
    assert_eq!(whole, (Some(16), true));

    assert_eq!(s.known_tokens("x"), 0);
    let err = s
        .get_num_new_matched_tokens_from(&req("x", &a[4..]), 4, 0)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    assert_eq!(
        s.get_num_new_matched_tokens_from(&req("x", &a[..8]), 0, 0)
            .unwrap(),
        (Some(4), true)
    );
    assert_eq!(s.known_tokens("x"), 8);
    // Overlapping: tokens 4..8 are held already and skipped.
    assert_eq!(
        s.get_num_new_matched_tokens_from(&req("x", &a[4..]), 4, 0)
            .unwrap(),
        whole
    );
    assert_eq!(s.known_tokens("x"), 17);
    // A gap (tokens from 20 when 17 are held) is refused, and nothing changes.
    let err = s
        .get_num_new_matched_tokens_from(&req("x", &a[..1]), 20, 0)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    assert_eq!(s.known_tokens("x"), 17);
}

// ------------------------------------------------------------------------------------------------
// Sliding-window attention (one KV-cache group; vLLM's null block stands for the blocks before
// the window)
// ------------------------------------------------------------------------------------------------

fn windowed(window: usize) -> Opts {
    Opts {
        window: Some(window),
        ..Opts::default()
    }
}

/// The device blocks each load of `e`'s metadata writes.
fn load_destinations(e: &Engine) -> Vec<Vec<usize>> {
    e.metas
        .iter()
        .flat_map(|m| m.operations.iter())
        .filter(|op| op.direction() == Direction::Load)
        .map(|op| op.transfer().pairs.iter().map(|p| p.1).collect())
        .collect()
}

/// A hit of 16 tokens with an 8-token window: vLLM's block table holds the null block for
/// request blocks 0-1 (before the window of the 16 matched tokens) and real blocks for 2-3.
/// Only those two are loaded (before the fix the load named the null block twice and failed
/// with "destination block 0 appears twice"), their bytes are checked when the load finished,
/// and the request then computes the rest without a load error.
#[test]
fn sliding_window_hit_loads_only_the_blocks_inside_the_window() {
    let mut e = Engine::new(windowed(8));
    let a = tokens(200, 17);
    warm(&mut e, "a", &a);
    let mut b = a[..16].to_vec();
    b.extend(tokens(900, 5));
    e.add("b", b, 2);
    let r = e.step();
    assert_eq!(e.last_match("b"), (0, 16, true));
    assert_eq!(r.finished_recving, BTreeSet::from(["b".to_string()]));
    assert!(r.load_errors.is_empty());
    assert_eq!(&e.req("b").blocks[..2], &[NULL_BLOCK, NULL_BLOCK]);
    let loads = load_destinations(&e);
    assert_eq!(loads.len(), 1, "one load: {loads:?}");
    assert_eq!(loads[0], e.req("b").blocks[2..4].to_vec());
    let r = e.step();
    assert!(r.load_errors.is_empty());
    assert_eq!(e.req("b").num_computed, 21);
    let m = e.metrics();
    assert_eq!((m.load_error_blocks, m.host_hit_tokens), (0, 8));
    e.drain_and_check();
}

/// The engine's own prefix cache hits 12 tokens of a request the connector has never seen
/// (block table: the null block for block 0, before that hit's window, then real blocks). The
/// connector stores only what the device holds: never the null block under a real block's key
/// (the stand-in's `owner_of` refuses a read of it, and every stored block's bytes are checked).
#[test]
fn sliding_window_never_stores_the_null_block() {
    let mut e = Engine::new(windowed(8));
    e.add_with_local_hit("a", tokens(300, 22), 2, 12);
    e.run_until_idle();
    let stored: Vec<usize> = e.stores_of("a").into_iter().map(|(_, i)| i).collect();
    // Block 0 was null when the request's blocks were considered; 1-2 (the engine's own hit)
    // and 3-4 (computed) are stored, each once.
    assert_eq!(stored, vec![1, 2, 3, 4]);
    e.drain_and_check();
}

/// A long decode moves the window past the prompt's blocks: vLLM frees them mid-request and
/// hands them to a second request. What was stored while they were live is still served by a
/// later hit (whose window blocks are loaded), and no freed block is read after its reuse.
#[test]
fn sliding_window_blocks_freed_mid_request_are_stored_while_live() {
    let mut e = Engine::new(Opts {
        window: Some(8),
        budget: 8,
        ..Opts::default()
    });
    let a = tokens(400, 16);
    e.add("a", a.clone(), 12);
    e.add("x", tokens(700, 9), 3);
    e.run_until_idle();
    assert_eq!(
        e.stores_of("a").iter().map(|s| s.1).collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4, 5]
    );
    let mut b = a.clone();
    b.extend(tokens(950, 3));
    let (_, external, _) = repeat(&mut e, "b", &b);
    assert_eq!(external, 16);
    assert_eq!(e.metrics().load_error_blocks, 0);
    e.drain_and_check();
}
