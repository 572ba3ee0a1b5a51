//! End-to-end tests of the TensorRT-LLM adapter: scheduler (leader) and worker in one process over
//! the in-process transport, a memory "device" tier registered as TensorRT-LLM's single cache
//! tensor, a memory host tier and a disk tier.
//!
//! [`Engine`] is a small stand-in for TensorRT-LLM's executor. Every iteration it makes the
//! connector calls in TensorRT-LLM's order:
//!
//! 1. admission of each new context request: `get_num_new_matched_tokens` → allocate device
//!    blocks → `update_state_after_alloc`; a request whose match loads asynchronously waits, not
//!    scheduled, until `get_finished` returns it as loaded;
//! 2. `build_connector_meta` with TensorRT-LLM's `RequestData`: `computed_position` is the
//!    context's current position for a context request (after an asynchronous load, its first
//!    appearance already counts the loaded tokens, as TensorRT-LLM's manager reports it) and
//!    `len(tokens) - 1` for a generation request; `new_tokens` and `new_block_ids` are what is
//!    new since the request last appeared;
//! 3. worker: `bind_connector_meta`, `start_load_kv`, then per layer `wait_for_layer_load` → the
//!    model stand-in writes that layer's KV of the tokens computed this iteration →
//!    `save_kv_layer`; then `wait_for_save`;
//! 4. sampling; a finished request goes through `request_finished`: true means the engine keeps
//!    its device blocks until `get_finished` reports it saved;
//! 5. `get_finished(finished_gen_req_ids, started_loading_req_ids)` with the ids new since the
//!    last call (as TensorRT-LLM's `KvCacheConnectorManager` passes them), then
//!    `process_completions`.
//!
//! An iteration with nothing to schedule (no waiting or running request: only loads in flight or
//! finished requests held for their stores) makes step 5 alone, as TensorRT-LLM does: it builds
//! no metadata then. Once every request is done, [`Engine::run`] flushes what the leader still has
//! queued (host → disk copies) with empty iterations, as the next request's iteration would.
//! The worker's transport is tapped: the work the leader sends outside the metadata for a
//! finished request ([`LeaderMessage::Finish`]) is recorded with the iteration it arrived in.
//!
//! Determinism: right after the forward pass the engine waits for the worker to be idle, so every
//! completion is in the leader's queue before `request_finished` and `get_finished` run; the
//! metadata of every iteration is then the same on every run and is snapshotted.
//!
//! Bytes: the KV of a token is a pure function of (token prefix, layer, K/V, position), so a full
//! block's bytes are a pure function of the prefix up to its end. Every onboarded block is
//! compared with them; freed device blocks are clobbered, so a hit passes only if the load copied.

#![cfg(feature = "trtllm")]

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvbm_connector::backends::memory::MemoryTier;
use kvbm_connector::connector::lifecycle::RequestState;
use kvbm_connector::connector::metadata::{ConnectorMetadata, Direction};
use kvbm_connector::connector::metrics::MetricsSnapshot;
use kvbm_connector::connector::transport::{
    in_process, LeaderMessage, Rank, WorkerMessage, WorkerTransport,
};
use kvbm_connector::connector::RequestId;
use kvbm_connector::error::Result as KvResult;
use kvbm_connector::frameworks::trtllm::{
    LlmRequest, RequestData, SchedulerOutput, TrtllmScheduler, TrtllmWorker,
};
use kvbm_connector::{Config, Layout, LayoutDims, StorageTier, StorageTierExt, TierKind};

/// Tokens per block.
const BS: usize = 4;
const LAYERS: usize = 2;
const INNER: usize = 4;
const DTYPE: usize = 2;
const DEVICE_BLOCKS: usize = 48;
/// Bytes of one token's K (or V) in one layer.
const TOKEN_BYTES: usize = INNER * DTYPE;
/// An engine that needs more iterations than this is stuck.
const MAX_ITERATIONS: usize = 100;

fn dims() -> LayoutDims {
    LayoutDims {
        num_layers: LAYERS,
        outer_dim: 2,
        page_size: BS,
        inner_dim: INNER,
        dtype_bytes: DTYPE,
    }
}

// ------------------------------------------------------------------------------------------------
// The model stand-in
// ------------------------------------------------------------------------------------------------

/// `h[p]` names the prefix `tokens[..=p]` (FNV-1a).
fn prefix_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    tokens
        .iter()
        .map(|&t| {
            h = (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3);
            h
        })
        .collect()
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// K (`kv == 0`) or V of the token at `pos` in `layer`, given the hash of its prefix.
fn token_kv(prefix: u64, layer: usize, kv: usize, pos: usize) -> [u8; TOKEN_BYTES] {
    let mut x = prefix ^ ((layer as u64) << 56) ^ ((kv as u64) << 48) ^ pos as u64;
    let mut out = [0u8; TOKEN_BYTES];
    for chunk in out.chunks_mut(8) {
        x = splitmix(x);
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    out
}

/// Byte offset of (layer, K/V, slot in block) in a fully contiguous block.
fn offset(layer: usize, kv: usize, slot: usize) -> usize {
    ((layer * 2 + kv) * BS + slot) * TOKEN_BYTES
}

/// The bytes of full block `block` of `tokens`: a function of `tokens[..(block + 1) * BS]` only.
fn expected_block(tokens: &[u32], block: usize) -> Vec<u8> {
    let end = (block + 1) * BS;
    let h = prefix_hashes(&tokens[..end]);
    let mut image = vec![0u8; dims().bytes_per_block()];
    for layer in 0..LAYERS {
        for kv in 0..2 {
            for (p, &prefix) in h.iter().enumerate().skip(block * BS) {
                let o = offset(layer, kv, p % BS);
                image[o..o + TOKEN_BYTES].copy_from_slice(&token_kv(prefix, layer, kv, p));
            }
        }
    }
    image
}

/// The token sampled after `tokens`.
fn next_token(tokens: &[u32]) -> u32 {
    let h = prefix_hashes(tokens).last().copied().unwrap_or(0);
    100_000 + (h % 50_000) as u32
}

/// A prompt of `len` tokens, distinct per `seed`.
fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| seed * 1000 + i).collect()
}

// ------------------------------------------------------------------------------------------------
// The engine stand-in
// ------------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Req {
    id: u64,
    /// Prompt and generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens to generate before finishing (at least 1).
    max_new: usize,
    /// Tokens the engine's own device prefix cache provides (`num_computed_tokens`).
    device_prefix: usize,
    blocks: Vec<usize>,
    /// Tokens with KV on the device (TensorRT-LLM's context position).
    pos: usize,
    /// Tokens onboarded asynchronously by the connector.
    loaded: usize,
    appeared: bool,
    reported_tokens: usize,
    reported_blocks: usize,
}

impl Req {
    fn llm(&self) -> LlmRequest<'_> {
        LlmRequest {
            request_id: self.id,
            tokens: &self.tokens,
            cache_salt: None,
            lora_name: None,
        }
    }
}

/// Finished-request work received outside the metadata: (iteration, its metadata).
type FinishLog = Arc<Mutex<Vec<(usize, ConnectorMetadata)>>>;

/// The worker's transport, recording every [`LeaderMessage::Finish`] it delivers.
#[derive(Debug)]
struct Tap {
    inner: Arc<dyn WorkerTransport>,
    iteration: Arc<AtomicUsize>,
    log: FinishLog,
}

impl WorkerTransport for Tap {
    fn rank(&self) -> Rank {
        self.inner.rank()
    }
    fn send(&self, msg: WorkerMessage) -> KvResult<()> {
        self.inner.send(msg)
    }
    fn recv_timeout(&self, timeout: Duration) -> KvResult<Option<LeaderMessage>> {
        let m = self.inner.recv_timeout(timeout)?;
        if let Some(LeaderMessage::Finish(w)) = &m {
            let meta = ConnectorMetadata::decode(&w.metadata).unwrap();
            assert_eq!(meta.iteration, w.after_iteration);
            let at = self.iteration.load(Ordering::SeqCst);
            self.log.lock().unwrap().push((at, meta));
        }
        Ok(m)
    }
}

/// The worker's transport holding back its start-up confirmation ([`WorkerMessage::Ready`]):
/// while `registering`, the leader gets it only once the worker waits for an answer after
/// sending it — the schedule of a busy host, where the leader's background barrier thread has
/// not run yet when the worker's registration is done on its side. [`HoldReady::release`] hands
/// over what is still held.
#[derive(Debug)]
struct HoldReady {
    inner: Arc<dyn WorkerTransport>,
    registering: AtomicBool,
    held: Mutex<Option<WorkerMessage>>,
}

impl HoldReady {
    fn new(inner: Arc<dyn WorkerTransport>) -> Self {
        Self {
            inner,
            registering: AtomicBool::new(true),
            held: Mutex::new(None),
        }
    }

    /// The registration returned: nothing is held back from now on.
    fn registration_over(&self) {
        self.registering.store(false, Ordering::SeqCst);
    }

    /// Sends what is still held (nothing once the worker waited for the leader).
    fn release(&self) {
        if let Some(m) = self.held.lock().unwrap().take() {
            self.inner.send(m).unwrap();
        }
    }
}

impl WorkerTransport for HoldReady {
    fn rank(&self) -> Rank {
        self.inner.rank()
    }
    fn send(&self, msg: WorkerMessage) -> KvResult<()> {
        if msg == WorkerMessage::Ready && self.registering.load(Ordering::SeqCst) {
            *self.held.lock().unwrap() = Some(msg);
            return Ok(());
        }
        self.inner.send(msg)
    }
    fn recv_timeout(&self, timeout: Duration) -> KvResult<Option<LeaderMessage>> {
        if self.registering.load(Ordering::SeqCst) {
            self.release();
        }
        self.inner.recv_timeout(timeout)
    }
}

/// What one iteration computes: a request and the token positions whose KV it writes.
type Plan = Vec<(u64, Range<usize>)>;

struct Engine {
    sched: TrtllmScheduler,
    worker: TrtllmWorker,
    device: Arc<dyn StorageTier>,
    free: BTreeSet<usize>,
    /// Most context tokens a request computes per iteration.
    chunk: usize,
    waiting: Vec<Req>,
    /// Admitted, waiting for their asynchronous load.
    loading: Vec<Req>,
    running: Vec<Req>,
    /// Finished; device blocks kept until `get_finished` reports them saved.
    saving: Vec<Req>,
    /// Ids not yet passed to `get_finished` (TensorRT-LLM's `new_async_requests`).
    new_saving: Vec<u64>,
    new_loading: Vec<u64>,
    /// Requests done and freed.
    done: HashMap<u64, Req>,
    /// `get_num_new_matched_tokens` answers.
    matched: HashMap<u64, (usize, bool)>,
    /// `request_finished` answers.
    finish_held: HashMap<u64, bool>,
    admitted_at: HashMap<u64, usize>,
    first_scheduled_at: HashMap<u64, usize>,
    /// Iteration in which `get_finished` reported an id saved / loaded.
    saved_at: HashMap<u64, usize>,
    loaded_at: HashMap<u64, usize>,
    /// Onboarded device blocks compared byte for byte.
    verified_blocks: usize,
    /// Every iteration's metadata, decoded (none for an idle iteration).
    metas: Vec<ConnectorMetadata>,
    /// The iteration each metadata was built in.
    meta_at: Vec<usize>,
    /// Finished-request work the worker received outside the metadata.
    finish_log: FinishLog,
    /// The iteration counter the tap reads.
    tap_iteration: Arc<AtomicUsize>,
    /// A request finished after the last metadata was built.
    finished_since_bind: bool,
    iteration: usize,
    _dir: tempfile::TempDir,
}

impl Engine {
    /// Scheduler first (non-blocking), then the worker registers its cache (blocking: it returns
    /// once the barrier completed, the leader's side included).
    fn new(host_blocks: usize, disk_blocks: usize) -> Self {
        let (mut engine, hold) = Self::start(host_blocks, disk_blocks);
        hold.registration_over();
        assert!(
            engine.sched.leader_mut().is_ready(),
            "the worker's registration returned before the scheduler was ready: {:?}",
            engine.sched.leader().status()
        );
        engine
    }

    /// As [`Engine::new`], the worker's start-up confirmation held back ([`HoldReady`]) until the
    /// caller says the registration is over; the scheduler's readiness is not checked.
    fn start(host_blocks: usize, disk_blocks: usize) -> (Self, Arc<HoldReady>) {
        let dir = tempfile::tempdir().unwrap();
        let mut config = Config::default();
        config.host.cache_blocks = Some(host_blocks);
        config.disk.cache_blocks = Some(disk_blocks);
        config.disk.dir = dir.path().to_path_buf();
        let (leader_transport, worker_transports) = in_process(1);
        let sched = TrtllmScheduler::new(config.clone(), BS, leader_transport).unwrap();
        let tap_iteration = Arc::new(AtomicUsize::new(0));
        let finish_log = FinishLog::default();
        let hold = Arc::new(HoldReady::new(worker_transports[0].clone()));
        let tap = Arc::new(Tap {
            inner: hold.clone(),
            iteration: tap_iteration.clone(),
            log: finish_log.clone(),
        });
        let mut worker = TrtllmWorker::new(config, BS, 1, tap).unwrap();
        let device: Arc<dyn StorageTier> = Arc::new(
            MemoryTier::new(
                TierKind::Device,
                Layout::fully_contiguous(dims(), DEVICE_BLOCKS).unwrap(),
            )
            .unwrap(),
        );
        worker
            .register_kv_caches(
                &[DEVICE_BLOCKS, LAYERS, 2, BS * INNER],
                DTYPE,
                device.clone(),
            )
            .unwrap();
        assert!(
            worker.worker().is_ready(),
            "blocking registration returned before ready"
        );
        let engine = Self {
            sched,
            worker,
            device,
            free: (0..DEVICE_BLOCKS).collect(),
            chunk: usize::MAX,
            waiting: Vec::new(),
            loading: Vec::new(),
            running: Vec::new(),
            saving: Vec::new(),
            new_saving: Vec::new(),
            new_loading: Vec::new(),
            done: HashMap::new(),
            matched: HashMap::new(),
            finish_held: HashMap::new(),
            admitted_at: HashMap::new(),
            first_scheduled_at: HashMap::new(),
            saved_at: HashMap::new(),
            loaded_at: HashMap::new(),
            verified_blocks: 0,
            metas: Vec::new(),
            meta_at: Vec::new(),
            finish_log,
            tap_iteration,
            finished_since_bind: false,
            iteration: 0,
            _dir: dir,
        };
        for b in 0..DEVICE_BLOCKS {
            engine.clobber(b);
        }
        (engine, hold)
    }

    fn submit(&mut self, id: u64, tokens: Vec<u32>, max_new: usize) {
        self.submit_with_prefix(id, tokens, max_new, 0);
    }

    /// A request of which the engine's own prefix cache already holds `device_prefix` tokens.
    fn submit_with_prefix(&mut self, id: u64, tokens: Vec<u32>, max_new: usize, prefix: usize) {
        assert!(max_new >= 1 && prefix < tokens.len());
        self.waiting.push(Req {
            id,
            prompt_len: tokens.len(),
            tokens,
            max_new,
            device_prefix: prefix,
            blocks: Vec::new(),
            pos: 0,
            loaded: 0,
            appeared: false,
            reported_tokens: 0,
            reported_blocks: 0,
        });
    }

    // --- one iteration ---------------------------------------------------------------------------

    /// One engine iteration. With nothing to schedule TensorRT-LLM calls only `get_finished`;
    /// with only requests that are admitted to load, it builds and binds the metadata and starts
    /// the loads, but runs no forward pass.
    fn step(&mut self) {
        self.next_iteration();
        if self.waiting.is_empty() && self.running.is_empty() {
            // Determinism: what the last `get_finished` submitted has finished.
            self.worker_idle();
            self.report();
            return;
        }
        self.admit();
        let (output, plan) = self.plan();
        self.bind(&output);
        if plan.is_empty() {
            self.worker.start_load_kv().unwrap();
            self.worker_idle();
        } else {
            self.forward(&plan);
            self.worker_idle();
            self.sample(&plan);
        }
        self.report();
        self.sched.leader_mut().process_completions();
    }

    fn next_iteration(&mut self) {
        self.iteration += 1;
        self.tap_iteration.store(self.iteration, Ordering::SeqCst);
    }

    /// An iteration with an empty batch that still builds metadata: what the next request's
    /// iteration does for work the leader queued while the engine was idle.
    fn flush(&mut self) {
        self.next_iteration();
        self.bind(&SchedulerOutput::default());
        self.forward(&Plan::new());
        self.worker_idle();
        self.report();
        self.sched.leader_mut().process_completions();
    }

    /// Iterates until every request is done, then flushes until a metadata built after the last
    /// finish carries nothing (so host → disk copies queued by the last completions have run too).
    fn run(&mut self) {
        for _ in 0..MAX_ITERATIONS {
            let busy = !(self.waiting.is_empty()
                && self.loading.is_empty()
                && self.running.is_empty()
                && self.saving.is_empty());
            if busy {
                self.step();
                continue;
            }
            if !self.finished_since_bind
                && self.sched.leader().num_operations_in_flight() == 0
                && self.metas.last().is_some_and(ConnectorMetadata::is_empty)
            {
                return;
            }
            self.flush();
        }
        panic!("engine still busy after {MAX_ITERATIONS} iterations");
    }

    /// Step 1: match, allocate, `update_state_after_alloc`.
    fn admit(&mut self) {
        for mut req in std::mem::take(&mut self.waiting) {
            let (tokens, load_async) = self
                .sched
                .get_num_new_matched_tokens(&req.llm(), req.device_prefix)
                .unwrap();
            assert_eq!(
                load_async,
                tokens > 0,
                "request {}: loads are async",
                req.id
            );
            assert_eq!(tokens % BS, 0, "request {}: whole blocks only", req.id);
            self.matched.insert(req.id, (tokens, load_async));
            self.admitted_at.insert(req.id, self.iteration);
            req.blocks = (0..req.prompt_len.div_ceil(BS))
                .map(|_| self.free.pop_first().expect("device out of blocks"))
                .collect();
            // The engine's own prefix cache provides the first `device_prefix` tokens.
            self.write_kv(&req, 0..req.device_prefix, 0..LAYERS);
            self.sched
                .update_state_after_alloc(&req.llm(), &req.blocks)
                .unwrap();
            req.pos = req.device_prefix;
            if load_async {
                req.loaded = tokens;
                req.pos += tokens;
                self.new_loading.push(req.id);
                self.loading.push(req);
            } else {
                self.running.push(req);
            }
        }
    }

    /// Step 2 (engine side): what each running request computes, as TensorRT-LLM reports it.
    fn plan(&mut self) -> (SchedulerOutput, Plan) {
        let mut output = SchedulerOutput::default();
        let mut plan = Plan::new();
        for req in &mut self.running {
            let len = req.tokens.len();
            let context = req.pos < req.prompt_len;
            let range = if context {
                req.pos..req.pos.saturating_add(self.chunk).min(req.prompt_len)
            } else {
                len - 1..len
            };
            while req.blocks.len() * BS < range.end {
                let b = self.free.pop_first().expect("device out of blocks");
                req.blocks.push(b);
            }
            // A context request reports its current position: after an asynchronous load (the
            // only kind this connector answers) that already counts the loaded tokens, on the
            // request's first appearance too (TensorRT-LLM subtracts them only for synchronous
            // loads).
            let computed_position = if context { req.pos } else { len - 1 };
            let data = RequestData {
                request_id: req.id,
                new_tokens: req.tokens[req.reported_tokens..].to_vec(),
                new_block_ids: req.blocks[req.reported_blocks..].to_vec(),
                computed_position,
                new_block_ids_by_layer_group: Vec::new(),
            };
            req.reported_tokens = len;
            req.reported_blocks = req.blocks.len();
            if req.appeared {
                output.cached_requests.push(data);
            } else {
                self.first_scheduled_at.insert(req.id, self.iteration);
                output.new_requests.push(data);
            }
            req.appeared = true;
            plan.push((req.id, range));
        }
        (output, plan)
    }

    /// Step 2: `build_connector_meta` → `bind_connector_meta`.
    fn bind(&mut self, output: &SchedulerOutput) {
        let bytes = self.sched.build_connector_meta(output).unwrap();
        self.finished_since_bind = false;
        self.metas.push(ConnectorMetadata::decode(&bytes).unwrap());
        self.meta_at.push(self.iteration);
        self.worker.bind_connector_meta(&bytes).unwrap();
    }

    /// Step 3: the forward pass with the worker's per-layer hooks.
    fn forward(&mut self, plan: &Plan) {
        self.worker.start_load_kv().unwrap();
        for layer in 0..LAYERS {
            self.worker.wait_for_layer_load(layer).unwrap();
            for (id, range) in plan {
                let req = self.running.iter().find(|r| r.id == *id).unwrap();
                self.write_kv(req, range.clone(), layer..layer + 1);
            }
            self.worker.save_kv_layer(layer).unwrap();
        }
        self.worker.wait_for_save().unwrap();
    }

    /// Waits until the worker finished everything submitted (completions are then queued for
    /// the leader, which applies them on its next call).
    fn worker_idle(&self) {
        self.worker
            .worker()
            .wait_idle(Duration::from_secs(10))
            .unwrap();
    }

    /// Step 4: advance positions, sample, finish.
    fn sample(&mut self, plan: &Plan) {
        for (id, range) in plan {
            let i = self.running.iter().position(|r| r.id == *id).unwrap();
            let req = &mut self.running[i];
            req.pos = range.end;
            if req.pos < req.tokens.len() {
                continue; // a context chunk that is not the last
            }
            let t = next_token(&req.tokens);
            req.tokens.push(t);
            if req.tokens.len() - req.prompt_len == req.max_new {
                let req = self.running.remove(i);
                self.finish(req);
            }
        }
    }

    fn finish(&mut self, req: Req) {
        let held = self
            .sched
            .request_finished(&req.llm(), &req.blocks)
            .unwrap();
        self.finish_held.insert(req.id, held);
        self.finished_since_bind = true;
        if held {
            self.new_saving.push(req.id);
            self.saving.push(req);
        } else {
            self.release(req);
        }
    }

    /// The client cancels a request that is loading or running. Returns `request_finished`'s answer.
    fn abort(&mut self, id: u64) -> bool {
        let req = if let Some(i) = self.loading.iter().position(|r| r.id == id) {
            self.loading.remove(i)
        } else {
            let i = self.running.iter().position(|r| r.id == id).unwrap();
            self.running.remove(i)
        };
        self.finish(req);
        self.finish_held[&id]
    }

    /// Step 5: `get_finished` with the ids new since the last call; acts on what it returns.
    fn report(&mut self) -> (Vec<u64>, Vec<u64>) {
        let finished = std::mem::take(&mut self.new_saving);
        let loading = std::mem::take(&mut self.new_loading);
        let (saved, loaded) = self.worker.get_finished(&finished, &loading);
        for &id in &loaded {
            assert!(
                self.loaded_at.insert(id, self.iteration).is_none(),
                "request {id} reported loaded twice"
            );
            let req = self
                .loading
                .iter()
                .chain(&self.saving)
                .find(|r| r.id == id)
                .unwrap_or_else(|| panic!("request {id} reported loaded but not loading"));
            self.verified_blocks += self.verify_onboarded(req);
            if let Some(i) = self.loading.iter().position(|r| r.id == id) {
                let req = self.loading.remove(i);
                self.running.push(req);
            }
        }
        for &id in &saved {
            assert!(
                self.saved_at.insert(id, self.iteration).is_none(),
                "request {id} reported saved twice"
            );
            let i = self
                .saving
                .iter()
                .position(|r| r.id == id)
                .unwrap_or_else(|| {
                    panic!("request {id} reported saved but the engine holds nothing")
                });
            let req = self.saving.remove(i);
            self.release(req);
        }
        (saved, loaded)
    }

    // --- device blocks ---------------------------------------------------------------------------

    /// The model stand-in: writes the KV of `req.tokens[range]` in `layers` into its blocks.
    fn write_kv(&self, req: &Req, range: Range<usize>, layers: Range<usize>) {
        if range.is_empty() {
            return;
        }
        let h = prefix_hashes(&req.tokens[..range.end]);
        let mut p = range.start;
        while p < range.end {
            let b = p / BS;
            let stop = range.end.min((b + 1) * BS);
            let mut image = self.device.read_block_to_vec(req.blocks[b]).unwrap();
            for layer in layers.clone() {
                for kv in 0..2 {
                    for (q, &prefix) in h.iter().enumerate().take(stop).skip(p) {
                        let o = offset(layer, kv, q % BS);
                        image[o..o + TOKEN_BYTES].copy_from_slice(&token_kv(prefix, layer, kv, q));
                    }
                }
            }
            self.device
                .write_block_from_slice(req.blocks[b], &image)
                .unwrap();
            p = stop;
        }
    }

    /// Compares every onboarded block with what the model computes for its prefix; returns how
    /// many blocks it compared.
    fn verify_onboarded(&self, req: &Req) -> usize {
        let first = req.device_prefix / BS;
        let blocks = first..first + req.loaded / BS;
        for b in blocks.clone() {
            let got = self.device.read_block_to_vec(req.blocks[b]).unwrap();
            assert!(
                got == expected_block(&req.tokens, b),
                "request {}: onboarded block {b} (device block {}) does not hold its prefix's KV",
                req.id,
                req.blocks[b]
            );
        }
        blocks.len()
    }

    fn clobber(&self, block: usize) {
        let junk = vec![0xa5 ^ block as u8; dims().bytes_per_block()];
        self.device.write_block_from_slice(block, &junk).unwrap();
    }

    fn release(&mut self, req: Req) {
        for &b in &req.blocks {
            self.clobber(b);
            assert!(self.free.insert(b), "device block {b} freed twice");
        }
        self.done.insert(req.id, req);
    }

    // --- checks ----------------------------------------------------------------------------------

    fn metrics(&self) -> MetricsSnapshot {
        self.sched.leader().metrics().snapshot()
    }

    /// Blocks copied `src` → `dst` (completed).
    fn transferred(&self, src: TierKind, dst: TierKind) -> u64 {
        self.metrics().transfer(src, dst).map_or(0, |t| t.blocks)
    }

    /// Device → host block pairs sent in each iteration (1, 2, ...): in its metadata and in the
    /// finished-request work the worker received outside it.
    fn stores_per_iteration(&self) -> Vec<usize> {
        let stores = |m: &ConnectorMetadata| -> usize {
            m.operations
                .iter()
                .filter(|op| op.direction() == Direction::Store)
                .filter(|op| op.transfer().src == TierKind::Device)
                .map(|op| op.transfer().pairs.len())
                .sum()
        };
        let mut out = vec![0; self.iteration];
        for (m, &at) in self.metas.iter().zip(&self.meta_at) {
            out[at - 1] += stores(m);
        }
        for (at, m) in self.finish_log.lock().unwrap().iter() {
            out[at - 1] += stores(m);
        }
        out
    }

    /// The finished-request work received outside the metadata, with its iteration.
    fn finish_work(&self) -> Vec<(usize, ConnectorMetadata)> {
        self.finish_log.lock().unwrap().clone()
    }

    fn tokens_of(&self, id: u64) -> Vec<u32> {
        self.done[&id].tokens.clone()
    }

    /// Nothing left anywhere: no slot, no operation, no held block, every device block free.
    fn assert_drained(&self) {
        assert!(self.waiting.is_empty() && self.loading.is_empty() && self.running.is_empty());
        assert!(
            self.saving.is_empty(),
            "engine still holds blocks of finished requests"
        );
        assert_eq!(self.free.len(), DEVICE_BLOCKS, "device blocks leaked");
        let leader = self.sched.leader();
        assert_eq!(leader.num_slots(), 0, "leader slots left");
        assert_eq!(
            leader.num_operations_in_flight(),
            0,
            "leader operations left"
        );
        let (host, disk) = leader.pool_stats().expect("leader ready");
        for stats in [host, disk].into_iter().flatten() {
            assert_eq!(stats.mutable, 0, "{stats:?}");
            assert_eq!(stats.active, 0, "{stats:?}");
        }
        assert_eq!(self.worker.worker().num_slots(), 0, "worker slots left");
    }

    /// Snapshots every iteration's metadata as `snapshots/trtllm__<scenario>.snap`.
    fn snapshot(&self, scenario: &str) {
        let mut settings = insta::Settings::clone_current();
        settings.set_snapshot_path("../snapshots");
        settings.set_prepend_module_to_snapshot(false);
        // Every metadata built, then the finished-request work sent outside it, with the number
        // of metadata built before the worker received it (the iteration number itself depends
        // on when stores finish: a request is released in the iteration that ran its last stores
        // or in the next one).
        let finish: Vec<(usize, ConnectorMetadata)> = self
            .finish_work()
            .into_iter()
            .map(|(at, m)| (self.meta_at.iter().filter(|&&b| b <= at).count(), m))
            .collect();
        let sent = (&self.metas, finish);
        settings.bind(|| insta::assert_yaml_snapshot!(format!("trtllm__{scenario}"), sent));
    }
}

// ------------------------------------------------------------------------------------------------
// Scenarios
// ------------------------------------------------------------------------------------------------

#[test]
fn cold_request() {
    let mut e = Engine::new(16, 64);
    e.submit(1, prompt(1, 14), 2); // 3 full blocks and 2 tokens
    e.run();
    assert_eq!(e.matched[&1], (0, false));
    // Iteration 1 computes the prompt; iteration 2 (computed_position 14) stores its 3 full
    // blocks; at finish nothing is left to store.
    assert_eq!(e.stores_per_iteration()[..2], [0, 3]);
    assert!(!e.finish_held[&1]);
    assert_eq!(e.transferred(TierKind::Device, TierKind::Host), 3);
    assert_eq!(e.transferred(TierKind::Host, TierKind::Disk), 3);
    let (host, disk) = e.sched.leader().pool_stats().unwrap();
    assert_eq!(host.unwrap().registered, 3);
    assert_eq!(disk.unwrap().registered, 3);
    let m = e.metrics();
    assert_eq!((m.lookup_tokens, m.matched_tokens), (14, 0));
    e.assert_drained();
    e.snapshot("cold_request");
}

/// Issue 42 item 7: TensorRT-LLM without `wait_for_initialization` (its older connector API)
/// admits requests as soon as the worker's `register_kv_caches` returned. On a busy host the
/// leader's background barrier thread had often not yet seen the worker's confirmation then, and
/// a short request admitted and finished before it did was never offloaded. Here the worker's
/// confirmation reaches the leader only when the worker waits for the leader after sending it
/// ([`HoldReady`]): the registration must return with the leader ready (barrier step 3), and a
/// one-token request finished right after it is offloaded — a later request with its prompt loads
/// it from host. Without step 3 the registration returns with the leader not ready, the request
/// finishes untracked, and the later request matches nothing (deterministic: no race decides it).
#[test]
fn a_request_finished_right_after_registration_is_offloaded() {
    let (mut e, hold) = Engine::start(16, 64);
    hold.registration_over();
    let ready_when_registered = e.sched.leader_mut().is_ready();
    let p = prompt(1, 14);
    e.submit(1, p.clone(), 1);
    e.run();
    // Whatever the registration did, the leader hears the worker now.
    hold.release();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !e.sched.leader_mut().is_ready() {
        assert!(Instant::now() < deadline, "{:?}", e.sched.leader().status());
        std::thread::sleep(Duration::from_millis(1));
    }
    e.submit(2, p, 1);
    e.run();
    assert_eq!(
        e.matched[&2],
        (12, true),
        "the first request's 3 full blocks were offloaded"
    );
    assert_eq!(e.verified_blocks, 3);
    assert!(
        ready_when_registered,
        "register_kv_caches returned before the scheduler was ready"
    );
    e.assert_drained();
}

#[test]
fn prefix_hit_from_host() {
    let mut e = Engine::new(16, 64);
    let p = prompt(1, 14);
    e.submit(1, p.clone(), 1);
    e.run();
    e.submit(2, p, 1);
    e.run();
    // All 3 full blocks match (the prompt's last 2 tokens are left to compute).
    assert_eq!(e.matched[&2], (12, true));
    assert_eq!(e.verified_blocks, 3);
    // Not scheduled until loaded; loaded in the iteration it was admitted in.
    assert_eq!(e.loaded_at[&2], e.admitted_at[&2]);
    assert_eq!(e.first_scheduled_at[&2], e.loaded_at[&2] + 1);
    let m = e.metrics();
    assert_eq!((m.host_hit_tokens, m.disk_hit_tokens), (12, 0));
    assert_eq!(m.load_error_blocks, 0);
    // The hit stores nothing new: its blocks are on host already.
    assert_eq!(e.transferred(TierKind::Device, TierKind::Host), 3);
    e.assert_drained();
    e.snapshot("prefix_hit_from_host");
}

#[test]
fn disk_hit_after_host_eviction() {
    let mut e = Engine::new(4, 64);
    let a = prompt(1, 13);
    e.submit(1, a.clone(), 1);
    e.run();
    // B's 3 blocks need host room: A's blocks are evicted (they are on disk by now); the
    // default (prefix) policy trims A's chain from its tail and keeps its first block, so A's
    // repeat loads one block from host and the rest from disk.
    e.submit(2, prompt(2, 13), 1);
    e.run();
    let (host, _) = e.sched.leader().pool_stats().unwrap();
    assert!(host.unwrap().evictions >= 2);
    e.submit(3, a, 1);
    e.run();
    assert_eq!(e.matched[&3], (12, true));
    assert_eq!(e.verified_blocks, 3);
    let m = e.metrics();
    assert_eq!((m.host_hit_tokens, m.disk_hit_tokens), (4, 8), "{m:?}");
    assert_eq!(m.load_error_blocks, 0);
    e.assert_drained();
    e.snapshot("disk_hit_after_host_eviction");
}

#[test]
fn chunked_prefill() {
    let mut e = Engine::new(16, 64);
    e.chunk = 6;
    e.submit(1, prompt(1, 22), 1); // 5 full blocks, chunks [0,6) [6,12) [12,18) [18,22)
    e.run();
    // Offload follows computed_position, one iteration behind: a block is stored in the
    // iteration after the one that completed it; the last chunk's block is flushed at finish,
    // in the same iteration, outside the metadata; iteration 5 is idle (`get_finished` only).
    assert_eq!(e.stores_per_iteration()[..4], [0, 1, 2, 2]);
    assert!(e.finish_held[&1]);
    // Released by the `get_finished` that ran its last stores if they finished in time, else by
    // the next (idle) iteration's.
    assert!([4, 5].contains(&e.saved_at[&1]));
    assert_eq!(e.transferred(TierKind::Device, TierKind::Host), 5);
    // All of them are right: a second request with the same prompt loads and checks them.
    e.submit(2, prompt(1, 22), 1);
    e.run();
    assert_eq!(e.matched[&2], (20, true));
    assert_eq!(e.verified_blocks, 5);
    assert_eq!(e.transferred(TierKind::Device, TierKind::Host), 5);
    e.assert_drained();
    e.snapshot("chunked_prefill");
}

#[test]
fn decode_fills_new_blocks() {
    let mut e = Engine::new(16, 64);
    // Prompt 10 tokens; 8 generated: block 2 is completed by generated tokens, block 3 is all
    // generated (allocated during decode).
    e.submit(1, prompt(1, 10), 8);
    e.run();
    assert_eq!(e.transferred(TierKind::Device, TierKind::Host), 4);
    let generated = e.tokens_of(1);
    assert_eq!(generated.len(), 18);
    // A later prompt made of those tokens hits all four blocks.
    e.submit(2, generated[..17].to_vec(), 1);
    e.run();
    assert_eq!(e.matched[&2], (16, true));
    assert_eq!(e.verified_blocks, 4);
    e.assert_drained();
    e.snapshot("decode_fills_new_blocks");
}

#[test]
fn abort_while_load_in_flight() {
    let mut e = Engine::new(16, 64);
    let p = prompt(1, 13);
    e.submit(1, p.clone(), 1);
    e.run();
    // Iteration by hand: admit B, abort it before the worker ran its load.
    e.submit(2, p, 4);
    e.next_iteration();
    e.admit();
    assert_eq!(e.matched[&2], (12, true));
    assert!(e.abort(2), "a request with a load in flight must be held");
    let id = RequestId::from(2u64);
    assert_eq!(
        e.sched.leader().request_state(&id),
        Some(RequestState::Aborted)
    );
    // The hold went to the worker at once, but ordered after the metadata that announces the
    // request (not built yet): applied earlier, the worker would report the request released
    // before its load even started, and the engine would free blocks the load then writes.
    assert_eq!(e.report(), (vec![], vec![]));
    let (output, plan) = e.plan();
    assert!(plan.is_empty());
    e.bind(&output);
    let meta = e.metas.last().unwrap();
    // The hold went outside the metadata, ordered after the metadata announcing the request.
    assert!(!meta.hold.contains(&id));
    assert!(meta.new_slots.contains(&id));
    assert!(e
        .finish_work()
        .iter()
        .any(|(_, w)| w.hold.contains(&id) && w.iteration == meta.iteration));
    assert!(meta
        .operations
        .iter()
        .any(|op| op.direction() == Direction::Load && op.request_id() == Some(&id)));
    // Bound but not started: neither saved nor loaded yet.
    assert_eq!(e.report(), (vec![], vec![]));
    e.forward(&plan);
    e.worker_idle();
    // Load done: the id comes back both as loaded and as saved (its blocks may be freed).
    assert_eq!(e.report(), (vec![2], vec![2]));
    e.sched.leader_mut().process_completions();
    assert_eq!(e.verified_blocks, 3);
    e.run();
    e.assert_drained();
    e.snapshot("abort_while_load_in_flight");
}

#[test]
fn finish_with_stores_in_flight() {
    let mut e = Engine::new(16, 64);
    let p = prompt(1, 8);
    e.submit(1, p.clone(), 1); // finishes in its only iteration
    e.step();
    // Its 2 blocks were computed in the last (only) iteration: stored at finish, sent to the
    // worker at once (outside the metadata, which was built before the request finished).
    assert!(e.finish_held[&1]);
    assert_eq!(e.stores_per_iteration(), [2]);
    assert_eq!(e.metas.len(), 1);
    assert!(e.metas[0].hold.is_empty());
    let work = e.finish_work();
    assert_eq!(work.len(), 1);
    assert_eq!(
        work[0].0, 1,
        "received in the iteration the request finished"
    );
    assert_eq!(
        work[0].1.iteration, 1,
        "ordered after the metadata of iteration 1"
    );
    assert!(work[0].1.hold.contains(&RequestId::from(1u64)));
    // Kept until its stores completed: released by iteration 1's `get_finished` (which ran them)
    // if they finished in time, else by the next one's.
    if !e.saved_at.contains_key(&1) {
        assert_eq!(e.saving.len(), 1, "the engine must keep the blocks");
        e.step();
    }
    assert!(e.saved_at[&1] <= 2);
    e.run();
    // The flushed bytes are the final ones.
    let mut q = p;
    q.push(7);
    e.submit(2, q, 1);
    e.run();
    assert_eq!(e.matched[&2], (8, true));
    assert_eq!(e.verified_blocks, 2);
    e.assert_drained();
    e.snapshot("finish_with_stores_in_flight");
}

/// TensorRT-LLM calls only `get_finished` while nothing is scheduled. A request held for its
/// last stores must still complete — stores run, blocks released, reported saved — and the next
/// request with the same prefix must find them (before, the stores waited for a metadata that an
/// idle engine never builds: the request stayed held and the next one matched `(0, false)`).
#[test]
fn idle_engine_completes_held_request() {
    let mut e = Engine::new(16, 64);
    let p = prompt(1, 12);
    e.submit(1, p.clone(), 1);
    e.step();
    assert!(e.finish_held[&1]);
    for _ in 0..3 {
        e.step(); // idle: `get_finished` only
    }
    assert_eq!(e.metas.len(), 1, "an idle engine builds no metadata");
    // Released by `get_finished` alone: in iteration 1 if its stores finished before that call
    // returned, else in the first idle iteration.
    assert!(
        e.saved_at.get(&1).is_some_and(|&at| at <= 2),
        "not released by get_finished alone"
    );
    assert!(e.free.len() == DEVICE_BLOCKS, "device blocks still held");
    // The worker ran the stores (the leader counts them on its next call).
    let stored: u64 = e
        .worker
        .worker()
        .transfer_stats()
        .iter()
        .filter(|p| (p.src, p.dst) == (TierKind::Device, TierKind::Host))
        .map(|p| p.blocks)
        .sum();
    assert_eq!(stored, 3);
    e.submit(2, p, 1);
    e.step();
    assert_eq!(e.matched[&2], (8, true));
    e.run();
    assert_eq!(e.verified_blocks, 2);
    e.assert_drained();
}

#[test]
fn shared_prefix_in_one_iteration() {
    let mut e = Engine::new(16, 64);
    let shared = prompt(1, 8);
    let a: Vec<u32> = shared.iter().copied().chain(prompt(2, 6)).collect();
    let b: Vec<u32> = shared.iter().copied().chain(prompt(3, 6)).collect();
    e.submit(1, a, 1);
    e.submit(2, b.clone(), 1);
    e.run();
    assert_eq!(e.first_scheduled_at[&1], e.first_scheduled_at[&2]);
    // 2 shared blocks + 1 of each: 4 distinct blocks, each stored once.
    assert_eq!(e.stores_per_iteration()[..2], [4, 0]);
    assert_eq!(e.transferred(TierKind::Device, TierKind::Host), 4);
    e.submit(3, b, 1);
    e.run();
    assert_eq!(e.matched[&3], (12, true));
    assert_eq!(e.verified_blocks, 3);
    e.assert_drained();
    e.snapshot("shared_prefix_in_one_iteration");
}

#[test]
fn full_prompt_match_drops_last_block() {
    let mut e = Engine::new(16, 64);
    let p = prompt(1, 12); // exactly 3 blocks
    e.submit(1, p.clone(), 1);
    e.run();
    assert_eq!(e.transferred(TierKind::Device, TierKind::Host), 3);
    e.submit(2, p, 1);
    e.run();
    // All 3 blocks are stored, but the engine must compute at least one token.
    assert_eq!(e.matched[&2], (8, true));
    assert_eq!(e.verified_blocks, 2);
    assert_eq!(e.transferred(TierKind::Device, TierKind::Host), 3);
    e.assert_drained();
    e.snapshot("full_prompt_match_drops_last_block");
}

#[test]
fn unaligned_computed_count() {
    let mut e = Engine::new(16, 64);
    let p = prompt(1, 13);
    e.submit(1, p.clone(), 1);
    e.run();
    // The device holds 5 tokens (a partial block): nothing can be loaded behind them.
    let r = LlmRequest {
        request_id: 2,
        tokens: &p,
        cache_salt: None,
        lora_name: None,
    };
    assert_eq!(
        e.sched.get_num_new_matched_tokens(&r, 5).unwrap(),
        (0, false)
    );
    // Nothing staged: no host block held, no request state.
    let (host, _) = e.sched.leader().pool_stats().unwrap();
    assert_eq!(host.unwrap().active, 0);
    assert_ne!(
        e.sched.leader().request_state(&RequestId::from(2u64)),
        Some(RequestState::OnboardStaged)
    );
    assert_eq!(e.metrics().matched_tokens, 0);
    // The engine gives up on it: nothing is held.
    assert!(!e.sched.request_finished(&r, &[]).unwrap());
    e.finish_held.insert(2, false);
    // An aligned count on the same prefix does match: blocks 1 and 2 load behind the device's 4.
    e.submit_with_prefix(3, p, 1, 4);
    e.run();
    assert_eq!(e.matched[&3], (8, true));
    assert_eq!(e.verified_blocks, 2);
    e.assert_drained();
    e.snapshot("unaligned_computed_count");
}

// ------------------------------------------------------------------------------------------------
// Regressions: bugs this suite found, kept as minimal reproductions
// ------------------------------------------------------------------------------------------------

/// TensorRT-LLM passes to `get_finished` only the ids `request_finished` answered true for; a
/// request answered false is never named again, and nothing else tells the worker to drop the
/// slot the metadata made for it: one slot leaks per such request.
#[test]
fn regression_worker_forgets_requests_finished_without_hold() {
    let mut e = Engine::new(16, 64);
    e.submit(1, prompt(1, 14), 2);
    e.run();
    assert!(!e.finish_held[&1]);
    assert_eq!(e.sched.leader().num_slots(), 0);
    assert_eq!(e.worker.worker().num_slots(), 0, "worker slot leaked");
}

/// `request_finished` assumes every token but the last has its KV on the device
/// (`tokens.len() - 1`); for a request aborted before it computed anything, the full blocks
/// beyond the loaded prefix hold junk, and they are stored and become matchable.
#[test]
fn regression_abort_during_load_stores_no_uncomputed_blocks() {
    let mut e = Engine::new(16, 64);
    let p = prompt(1, 8);
    e.submit(1, p.clone(), 1);
    e.run();
    assert_eq!(e.transferred(TierKind::Device, TierKind::Host), 2);
    // B extends the stored prefix by 2 blocks and 1 token; aborted before its load ran.
    let b: Vec<u32> = p.iter().copied().chain(prompt(2, 9)).collect();
    e.submit(2, b.clone(), 1);
    e.next_iteration();
    e.admit();
    assert_eq!(e.matched[&2], (8, true));
    assert!(e.abort(2));
    // The iteration that admitted it builds and binds its metadata (TensorRT-LLM does so before
    // any request can finish).
    let (output, plan) = e.plan();
    e.bind(&output);
    e.forward(&plan);
    e.worker_idle();
    e.report();
    e.run();
    assert_eq!(
        e.transferred(TierKind::Device, TierKind::Host),
        2,
        "blocks 2 and 3 of the aborted request were never computed"
    );
    // A later request with B's prompt must not be served those blocks.
    e.submit(3, b, 1);
    e.run();
    assert_eq!(e.matched[&3], (8, true));
}

/// With an unaligned `num_computed_tokens` the adapter answers (0, false) without telling the
/// leader about the request, so the engine's next calls for it (`update_state_after_alloc`,
/// then `build_connector_meta`) fail with "unknown request id".
#[test]
fn regression_unaligned_request_can_be_scheduled() {
    let mut e = Engine::new(16, 64);
    let p = prompt(1, 13);
    e.submit(1, p.clone(), 1);
    e.run();
    e.submit_with_prefix(2, p, 1, 5);
    e.run();
    assert_eq!(e.matched[&2], (0, false));
    assert!(e.done.contains_key(&2));
    e.assert_drained();
}

/// Tensor parallelism: ranks run their loops in their own processes, so a rank behind rank 0 may
/// get a finished request's work (sent by the leader right after rank 0's forward pass) before it
/// bound the metadata announcing the request, or after binding it but before its own forward pass
/// wrote the request's last KV. It must hold the work until its `get_finished`: run earlier, its
/// stores would copy the blocks before this rank computed them. Here rank 1 lags one whole
/// iteration; its shard of the stored blocks must be what its forward pass wrote, checked by a
/// second request that loads them on both ranks.
#[test]
fn lagging_rank_runs_finish_work_after_its_forward_pass() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::default();
    config.host.cache_blocks = Some(16);
    config.disk.cache_blocks = Some(0);
    config.disk.dir = dir.path().to_path_buf();
    let (lt, wts) = in_process(2);
    let mut sched = TrtllmScheduler::new(config.clone(), BS, lt).unwrap();
    let layout = || Layout::fully_contiguous(dims(), DEVICE_BLOCKS).unwrap();
    let devices: Vec<Arc<dyn StorageTier>> = (0..2)
        .map(|_| Arc::new(MemoryTier::new(TierKind::Device, layout()).unwrap()) as _)
        .collect();
    let shape = [DEVICE_BLOCKS, LAYERS, 2, BS * INNER];
    // Both ranks register at once (each blocks until the leader is ready, which needs both).
    let mut workers: Vec<TrtllmWorker> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|r| {
                let (config, wt, device) = (config.clone(), wts[r].clone(), devices[r].clone());
                s.spawn(move || {
                    let mut w = TrtllmWorker::new(config, BS, 2, wt).unwrap();
                    w.register_kv_caches(&shape, DTYPE, device).unwrap();
                    w
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        sched.leader_mut().is_ready(),
        "{:?}",
        sched.leader().status()
    );
    // Each rank's shard of a block: a pattern of (rank, block, version).
    let shard = |rank: u8, block: usize, version: u8| {
        vec![rank.wrapping_mul(16) ^ (block as u8) ^ version; dims().bytes_per_block()]
    };
    let llm = |id: u64, tokens: &[u32]| -> (u64, Vec<u32>) { (id, tokens.to_vec()) };
    fn req((id, tokens): &(u64, Vec<u32>)) -> LlmRequest<'_> {
        LlmRequest {
            request_id: *id,
            tokens: tokens.as_slice(),
            cache_salt: None,
            lora_name: None,
        }
    }
    let forward = |w: &mut TrtllmWorker, device: &Arc<dyn StorageTier>, rank: u8, version: u8| {
        w.start_load_kv().unwrap();
        for layer in 0..LAYERS {
            w.wait_for_layer_load(layer).unwrap();
            for b in 0..2 {
                device
                    .write_block_from_slice(b, &shard(rank, b, version))
                    .unwrap();
            }
            w.save_kv_layer(layer).unwrap();
        }
        w.wait_for_save().unwrap();
    };
    // Rank 1's cache holds stale bytes (version 0) until its forward pass writes version 1.
    for b in 0..2 {
        devices[1]
            .write_block_from_slice(b, &shard(1, b, 0))
            .unwrap();
    }
    // Iteration 1: request 1 (8 tokens, 2 blocks) computes its prompt and finishes.
    let mut r1 = llm(1, &prompt(1, 8));
    assert_eq!(
        sched.get_num_new_matched_tokens(&req(&r1), 0).unwrap(),
        (0, false)
    );
    sched.update_state_after_alloc(&req(&r1), &[0, 1]).unwrap();
    let meta = sched
        .build_connector_meta(&SchedulerOutput {
            new_requests: vec![RequestData {
                request_id: 1,
                new_tokens: r1.1.clone(),
                new_block_ids: vec![0, 1],
                computed_position: 0,
                new_block_ids_by_layer_group: Vec::new(),
            }],
            cached_requests: vec![],
        })
        .unwrap();
    workers[0].bind_connector_meta(&meta).unwrap();
    forward(&mut workers[0], &devices[0], 0, 1);
    workers[0]
        .worker()
        .wait_idle(Duration::from_secs(10))
        .unwrap();
    r1.1.push(7);
    assert!(sched.request_finished(&req(&r1), &[0, 1]).unwrap());
    // Rank 1 is still ending its previous iteration: the work is not its to run yet.
    assert_eq!(workers[1].get_finished(&[], &[]), (vec![], vec![]));
    workers[1].bind_connector_meta(&meta).unwrap();
    // Bound, but its forward pass has not run: nothing may read the blocks yet.
    workers[1]
        .worker()
        .wait_idle(Duration::from_secs(10))
        .unwrap();
    assert!(workers[1].worker().transfer_stats().is_empty());
    forward(&mut workers[1], &devices[1], 1, 1);
    let mut released = [false, false];
    for _ in 0..100 {
        for (r, w) in workers.iter_mut().enumerate() {
            let finished: &[u64] = if released[r] { &[] } else { &[1] };
            let (saved, _) = w.get_finished(finished, &[]);
            released[r] |= saved == [1];
            w.worker().wait_idle(Duration::from_secs(10)).unwrap();
        }
        if released == [true, true] {
            break;
        }
    }
    assert_eq!(
        released,
        [true, true],
        "each rank reports it once its stores ran"
    );
    // Request 2 loads both blocks onto blocks 2 and 3 of both ranks: each shard is the bytes its
    // rank's forward pass wrote.
    let r2 = llm(2, &[r1.1[..8].to_vec(), vec![9]].concat());
    assert_eq!(
        sched.get_num_new_matched_tokens(&req(&r2), 0).unwrap(),
        (8, true)
    );
    sched
        .update_state_after_alloc(&req(&r2), &[2, 3, 4])
        .unwrap();
    let meta = sched
        .build_connector_meta(&SchedulerOutput::default())
        .unwrap();
    for (r, w) in workers.iter_mut().enumerate() {
        w.bind_connector_meta(&meta).unwrap();
        w.start_load_kv().unwrap();
        w.worker().wait_idle(Duration::from_secs(10)).unwrap();
        assert_eq!(w.get_finished(&[], &[2]), (vec![], vec![2]));
        for b in 0..2 {
            assert_eq!(
                devices[r].read_block_to_vec(2 + b).unwrap(),
                shard(r as u8, b, 1),
                "rank {r}: block {b} was stored before this rank computed it"
            );
        }
    }
}
