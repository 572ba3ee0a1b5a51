//! A third engine adapter, written entirely outside the crate.
//!
//! The "toy engine" below is a small batch-of-sequences engine with its own conventions, none of
//! which match TensorRT-LLM or vLLM:
//!
//! * requests are named by a [`Ticket`] (the batch that admitted them and a lane in it);
//! * it reserves every page a sequence will ever need when it admits the sequence, so iterations
//!   never carry new pages;
//! * its scheduler describes progress by a *delta*: per sequence, how many tokens' KV became final
//!   since the previous tick (this tick's forward pass included, and tokens a load brought in
//!   counted once the load landed). It never states an absolute position.
//!
//! [`FinalDeltas`] implements [`SchedulerAdapter`] for it by summing those deltas per request, and
//! adds a custom operation kind, [`ToyPrefetch`] (`"toy_prefetch"`): a disk → host copy that
//! re-warms host copies of blocks from their disk copies. The core worker runs it like any other
//! operation, because it only ever executes an operation's [`Operation::transfer`].
//!
//! The run drives the real [`Leader`] and [`Worker`] over `in_process(1)`, with a memory "device"
//! tier and host and disk tiers (disk in a temporary directory), and checks every onboarded byte.
//!
//! ```sh
//! cargo run --example toy_engine
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::error::Error;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvbm_connector::prelude::*;
use serde::{Deserialize, Serialize};

type Res<T> = std::result::Result<T, Box<dyn Error>>;

/// Tokens per page (the toy's word for a block).
const PAGE: usize = 4;
/// Pages of the toy's device cache.
const DEVICE_PAGES: usize = 64;
/// Prompt tokens one tick computes per sequence (chunked prefill).
const CHUNK: usize = 8;
/// Host and disk tier sizes, in blocks. The host tier is large enough never to evict in this
/// run, which is what makes the prefetch below safe (see [`FinalDeltas::extend_metadata`]).
const HOST_BLOCKS: usize = 64;
const DISK_BLOCKS: usize = 128;

// ================================================================================================
// The adapter: what a user writes for their engine.
// ================================================================================================

/// The toy engine as the connector sees it: its adapter, and both sides starting non-blocking
/// (the toy polls readiness before it admits a request).
struct Toy;

impl Engine for Toy {
    type Adapter = FinalDeltas;
    type LeaderInit = NonBlocking;
    type WorkerInit = NonBlocking;
}

/// The toy's custom operation: copy disk blocks into host blocks ahead of need.
///
/// Its direction is [`Direction::Store`]: it does not write the engine's device blocks, so the
/// worker starts it with the stores (after the forward pass) and a failure is not reported as a
/// device block to recompute (that is what [`Direction::Load`] failures mean).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct ToyPrefetch(BlockTransfer);

#[typetag::serde(name = "toy_prefetch")]
impl Operation for ToyPrefetch {
    fn direction(&self) -> Direction {
        Direction::Store
    }
    fn transfer(&self) -> &BlockTransfer {
        &self.0
    }
    fn clone_op(&self) -> Box<dyn Operation> {
        Box::new(self.clone())
    }
}

/// The adapter's book: the glue stages each tick's deltas through [`Leader::adapter_mut`],
/// [`SchedulerAdapter::computed_after`] reads them, [`SchedulerAdapter::extend_metadata`] commits
/// them once the step was accepted.
#[derive(Debug, Default)]
struct Book {
    /// Sum of the deltas of every accepted tick, per request.
    final_tokens: HashMap<RequestId, usize>,
    /// This tick's deltas, staged before `build_metadata` and committed in `extend_metadata`
    /// (which runs once per built metadata, after the step was accepted).
    pending: HashMap<RequestId, usize>,
    /// Host block → disk block holding the same bytes, learnt from the leader's host → disk
    /// stores and forgotten when the leader writes either block again.
    disk_copy: BTreeMap<usize, usize>,
    /// Emit a prefetch in the next metadata.
    prefetch_requested: bool,
    /// Blocks named by prefetches emitted so far.
    prefetched_blocks: usize,
    /// Prefetch completions reported by the worker, and how many of them failed.
    prefetch_completions: usize,
    prefetch_failures: usize,
    next_op: u64,
}

/// Offload by summed final-token deltas.
#[derive(Debug, Default)]
struct FinalDeltas {
    book: Book,
}

impl SchedulerAdapter for FinalDeltas {
    fn name(&self) -> &'static str {
        "final-deltas"
    }

    fn computed_after(&self, r: &ScheduledRequest) -> kvbm_connector::Result<usize> {
        let book = &self.book;
        let delta = book.pending.get(&r.request_id).copied().ok_or_else(|| {
            kvbm_connector::Error::invalid_argument(format!(
                "request {} is scheduled but its final-token delta was not staged",
                r.request_id
            ))
            .with("request", &r.request_id)
        })?;
        let before = book.final_tokens.get(&r.request_id).copied().unwrap_or(0);
        before.checked_add(delta).ok_or_else(|| {
            kvbm_connector::Error::invalid_argument("final-token count overflows")
                .with("request", &r.request_id)
        })
    }

    fn on_custom_completion(
        &mut self,
        _rank: usize,
        completion: &kvbm_connector::connector::transport::Completion,
    ) -> kvbm_connector::Result<()> {
        let book = &mut self.book;
        book.prefetch_completions += 1;
        if !completion.failed_dst_blocks.is_empty() {
            book.prefetch_failures += 1;
        }
        Ok(())
    }

    fn extend_metadata(&mut self, meta: &mut ConnectorMetadata) -> kvbm_connector::Result<()> {
        let book = &mut self.book;
        // The step was accepted: its deltas count from now on.
        for (id, delta) in std::mem::take(&mut book.pending) {
            let total = book.final_tokens.entry(id).or_insert(0);
            *total = total.saturating_add(delta);
        }
        // Which host blocks have an identical disk copy. The leader writes host blocks only with
        // device → host stores and disk blocks only with stores into disk, and every such write
        // is in some metadata, so watching them keeps the map exact. First forget every block
        // this metadata writes.
        let mut learnt = Vec::new();
        for op in &meta.operations {
            let t = op.transfer();
            for &(s, d) in &t.pairs {
                match t.dst {
                    TierKind::Host => {
                        book.disk_copy.remove(&d);
                    }
                    TierKind::Disk => {
                        book.disk_copy.retain(|_, dd| *dd != d);
                        if t.src == TierKind::Host {
                            learnt.push((s, d));
                        }
                    }
                    _ => {}
                }
            }
        }
        // A prefetch writes host blocks the *leader* manages. It is sound only while neither
        // block can be reused by the leader before it finishes, and only from disk copies that
        // are complete: copies learnt from this very metadata have not been written yet (they run
        // alongside), so they are left out. The engine asks for a prefetch only when the leader
        // is quiescent and its host tier never evicted, and waits for the worker to go idle
        // before the next step (see `run`).
        if std::mem::take(&mut book.prefetch_requested) && !book.disk_copy.is_empty() {
            book.next_op += 1;
            let pairs: Vec<(usize, usize)> = book.disk_copy.iter().map(|(&h, &d)| (d, h)).collect();
            book.prefetched_blocks += pairs.len();
            meta.operations.push(Box::new(ToyPrefetch(BlockTransfer {
                // Custom ids never collide with the leader's; their completions come back through
                // `on_custom_completion`.
                id: OperationId::custom(book.next_op),
                // Background work: naming a request would make the worker track it as one of the
                // request's operations.
                request_id: None,
                src: TierKind::Disk,
                dst: TierKind::Host,
                pairs,
            })));
        }
        book.disk_copy.extend(learnt);
        Ok(())
    }
}

// ================================================================================================
// The glue: the toy's scheduler-side connector, mapping the toy's calls onto the leader.
// ================================================================================================

/// The toy engine's request handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Ticket {
    batch: u16,
    lane: u16,
}

impl Ticket {
    fn id(self) -> RequestId {
        RequestId::from(format!("b{}.l{}", self.batch, self.lane))
    }
}

/// What the toy scheduler says about one sequence in one tick.
#[derive(Debug, Clone)]
struct Progress {
    ticket: Ticket,
    /// Tokens appended since the last tick (on the first tick: none; the prompt was given at
    /// admission).
    appended: Vec<Token>,
    /// Index of `appended[0]` in the sequence.
    first: usize,
    /// Tokens whose KV became final since the last tick, this tick's forward pass included.
    newly_final: usize,
}

struct ToyScheduler {
    leader: Leader<FinalDeltas>,
}

impl ToyScheduler {
    /// Tokens of `prompt` the connector can load (the toy has no device prefix cache, so it
    /// always asks from token 0).
    fn lookup(&mut self, ticket: Ticket, prompt: &[Token]) -> Res<usize> {
        let id = ticket.id();
        let m = self.leader.get_num_new_matched_tokens(
            RequestInfo {
                id: &id,
                tokens: prompt,
                cache_salt: None,
                lora_name: None,
            },
            0,
        )?;
        Ok(m.external_tokens)
    }

    /// The toy reserved `pages` (the whole sequence) and will load `external` tokens.
    fn reserved(&mut self, ticket: Ticket, pages: &[usize], external: usize) -> Res<()> {
        self.leader
            .update_state_after_alloc(&ticket.id(), pages, external)?;
        Ok(())
    }

    /// One tick: stage the deltas, build the metadata the workers need.
    fn tick(&mut self, progress: &[Progress]) -> Res<Vec<u8>> {
        let book = &mut self.leader.adapter_mut().book;
        for p in progress {
            book.pending.insert(p.ticket.id(), p.newly_final);
        }
        let step = SchedulerStep {
            requests: progress
                .iter()
                .map(|p| ScheduledRequest {
                    request_id: p.ticket.id(),
                    new_tokens: p.appended.clone(),
                    first_token_index: Some(p.first),
                    new_block_ids: Vec::new(),
                    replace_block_ids: false,
                    // The toy reports no absolute count; this adapter does not read it.
                    num_computed_tokens: 0,
                    num_scheduled_tokens: None,
                    computed_position: None,
                })
                .collect(),
            preempted: Vec::new(),
        };
        match self.leader.build_connector_meta(&step) {
            Ok(bytes) => Ok(bytes),
            Err(e) => {
                // Rejected step: its deltas must not count.
                self.leader.adapter_mut().book.pending.clear();
                Err(e.into())
            }
        }
    }

    /// The toy finished a sequence whose KV is final for `final_tokens` tokens. True: keep its
    /// pages until the worker releases the request.
    fn finished(&mut self, ticket: Ticket, tokens: &[Token], final_tokens: usize) -> Res<bool> {
        let id = ticket.id();
        let summed = self.leader.adapter_mut().book.final_tokens.remove(&id);
        if summed != Some(final_tokens) {
            return Err(format!(
                "request {id}: the adapter summed {summed:?} final tokens, the engine has {final_tokens}"
            )
            .into());
        }
        Ok(self
            .leader
            .request_finished(&id, Some(tokens), Some(final_tokens))?)
    }

    fn request_prefetch(&mut self) {
        self.leader.adapter_mut().book.prefetch_requested = true;
    }

    fn disk_copies(&self) -> Vec<(usize, usize)> {
        let book = &self.leader.adapter().book;
        book.disk_copy.iter().map(|(&h, &d)| (h, d)).collect()
    }
}

// ================================================================================================
// The toy engine itself (what the user already had).
// ================================================================================================

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the connector to load its prefix.
    Loading,
    Running,
}

#[derive(Debug)]
struct Seq {
    tokens: Vec<Token>,
    prompt_len: usize,
    max_len: usize,
    pages: Vec<usize>,
    /// Tokens with final KV on the device.
    final_tokens: usize,
    /// Tokens the connector has been told about.
    reported: usize,
    /// Final tokens not yet reported in a delta (a landed load).
    unreported_final: usize,
    /// Tokens the connector loaded (never computed by the toy).
    loaded: usize,
    /// Work planned for this tick.
    work: usize,
    phase: Phase,
}

/// The toy's "KV" of block `k`: a function of every token up to the block's end, like a model's.
fn image(tokens: &[Token], k: usize, bytes: usize) -> Res<Vec<u8>> {
    let end = (k + 1) * PAGE;
    let prefix = tokens
        .get(..end)
        .ok_or_else(|| format!("block {k} is past the {} known tokens", tokens.len()))?;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for t in prefix {
        h = (h ^ u64::from(*t)).wrapping_mul(0x0100_0000_01b3);
    }
    Ok((0..bytes)
        .map(|i| (h.wrapping_add(i as u64 * 0x9e37_79b9) >> 11) as u8)
        .collect())
}

fn sample(tokens: &[Token]) -> Token {
    let mut h: u32 = 0x811c_9dc5;
    for t in tokens {
        h = (h ^ t).wrapping_mul(0x0100_0193);
    }
    h % 50_000
}

struct ToyEngine {
    device: Arc<dyn StorageTier>,
    free: Vec<usize>,
    seqs: BTreeMap<Ticket, Seq>,
    /// Pages of finished sequences the connector asked us to keep.
    held: HashMap<RequestId, Vec<usize>>,
    /// Finished sequences not yet told to the worker.
    finished_unreported: Vec<RequestId>,
    /// Finished sequences: (ticket, all tokens).
    transcripts: BTreeMap<Ticket, Vec<Token>>,
    by_id: HashMap<RequestId, Ticket>,
    verified_blocks: usize,
}

impl ToyEngine {
    fn bytes_per_block(&self) -> usize {
        self.device.bytes_per_block()
    }

    /// Reserves and scrubs pages (scrubbing makes every onboarded byte check a real one).
    fn reserve(&mut self, n: usize) -> Res<Vec<usize>> {
        if self.free.len() < n {
            return Err(format!("{n} pages wanted, {} free", self.free.len()).into());
        }
        let pages = self.free.split_off(self.free.len() - n);
        let zero = vec![0u8; self.bytes_per_block()];
        for &p in &pages {
            self.device.write_block_from_slice(p, &zero)?;
        }
        Ok(pages)
    }

    /// This tick's work for every running sequence.
    fn plan(&mut self) -> Vec<Progress> {
        let mut out = Vec::new();
        for (&ticket, s) in self.seqs.iter_mut() {
            if s.phase != Phase::Running {
                continue;
            }
            s.work = if s.final_tokens < s.prompt_len {
                CHUNK.min(s.prompt_len - s.final_tokens)
            } else {
                1 // decode: the KV of the token sampled last tick
            };
            out.push(Progress {
                ticket,
                appended: s.tokens.get(s.reported..).unwrap_or_default().to_vec(),
                first: s.reported,
                newly_final: s.unreported_final + s.work,
            });
            s.reported = s.tokens.len();
            s.unreported_final = 0;
        }
        out
    }

    /// The forward pass: write the KV of every block the tick completes, sample. Returns the
    /// sequences that finished.
    fn forward(&mut self) -> Res<Vec<Ticket>> {
        let bytes = self.bytes_per_block();
        let mut done = Vec::new();
        for (&ticket, s) in self.seqs.iter_mut() {
            if s.phase != Phase::Running || s.work == 0 {
                continue;
            }
            let before = s.final_tokens;
            s.final_tokens += std::mem::take(&mut s.work);
            for k in 0..s.final_tokens / PAGE {
                if (k + 1) * PAGE > before {
                    let page = *s
                        .pages
                        .get(k)
                        .ok_or_else(|| format!("{ticket:?} has no page for block {k}"))?;
                    self.device
                        .write_block_from_slice(page, &image(&s.tokens, k, bytes)?)?;
                }
            }
            if s.final_tokens == s.tokens.len() && s.tokens.len() < s.max_len {
                let next = sample(&s.tokens);
                s.tokens.push(next);
            }
            if s.tokens.len() == s.max_len {
                done.push(ticket);
            }
        }
        Ok(done)
    }

    /// A load landed: check every onboarded byte, then let the sequence run.
    fn loaded(&mut self, id: &RequestId) -> Res<()> {
        let ticket = *self
            .by_id
            .get(id)
            .ok_or_else(|| format!("worker reports a load for unknown request {id}"))?;
        let bytes = self.bytes_per_block();
        let s = self
            .seqs
            .get_mut(&ticket)
            .ok_or_else(|| format!("{id} is not running"))?;
        for k in 0..s.loaded / PAGE {
            let page = *s.pages.get(k).ok_or("missing page")?;
            if self.device.read_block_to_vec(page)? != image(&s.tokens, k, bytes)? {
                return Err(
                    format!("{id}: onboarded block {k} (page {page}) has wrong bytes").into(),
                );
            }
            self.verified_blocks += 1;
        }
        s.final_tokens = s.loaded;
        s.unreported_final = s.loaded;
        s.phase = Phase::Running;
        Ok(())
    }

    fn finish(&mut self, ticket: Ticket, held: bool) -> Res<()> {
        let s = self
            .seqs
            .remove(&ticket)
            .ok_or_else(|| format!("{ticket:?} is not running"))?;
        let id = ticket.id();
        if held {
            // Never free pages the connector may still be reading.
            self.held.insert(id.clone(), s.pages);
        } else {
            self.free.extend(s.pages);
        }
        self.finished_unreported.push(id);
        self.transcripts.insert(ticket, s.tokens);
        Ok(())
    }

    fn released(&mut self, id: &RequestId) -> Res<()> {
        let pages = self
            .held
            .remove(id)
            .ok_or_else(|| format!("worker released {id}, which the toy does not hold"))?;
        self.free.extend(pages);
        Ok(())
    }

    fn idle(&self) -> bool {
        self.seqs.is_empty() && self.held.is_empty()
    }
}

// ================================================================================================
// The run.
// ================================================================================================

struct Rig {
    engine: ToyEngine,
    sched: ToyScheduler,
    worker: Worker,
    ticks: usize,
    /// Operations in the last tick's metadata.
    last_ops: usize,
}

impl Rig {
    fn admit(&mut self, ticket: Ticket, prompt: Vec<Token>, generate: usize) -> Res<usize> {
        let external = self.sched.lookup(ticket, &prompt)?;
        let max_len = prompt.len() + generate;
        let pages = self.engine.reserve(max_len.div_ceil(PAGE))?;
        self.sched.reserved(ticket, &pages, external)?;
        self.engine.by_id.insert(ticket.id(), ticket);
        self.engine.seqs.insert(
            ticket,
            Seq {
                prompt_len: prompt.len(),
                reported: prompt.len(),
                tokens: prompt,
                max_len,
                pages,
                final_tokens: 0,
                unreported_final: 0,
                loaded: external,
                work: 0,
                phase: if external > 0 {
                    Phase::Loading
                } else {
                    Phase::Running
                },
            },
        );
        Ok(external)
    }

    /// One engine tick, in the toy's call order.
    fn tick(&mut self) -> Res<()> {
        self.ticks += 1;
        let progress = self.engine.plan();
        let bytes = self.sched.tick(&progress)?;
        self.worker.bind_metadata(&bytes)?;
        self.last_ops = self.worker.current_operations().len();
        self.worker.start_load()?;
        let done = self.engine.forward()?;
        self.worker.save()?;
        // The toy runs each tick's transfers to completion (simple, deterministic output).
        self.worker.wait_idle(Duration::from_secs(30))?;
        for ticket in done {
            let tokens = self
                .engine
                .seqs
                .get(&ticket)
                .map(|s| (s.tokens.clone(), s.final_tokens))
                .ok_or("finished sequence vanished")?;
            let held = self.sched.finished(ticket, &tokens.0, tokens.1)?;
            self.engine.finish(ticket, held)?;
        }
        let finished = std::mem::take(&mut self.engine.finished_unreported);
        let (released, loaded) = self.worker.get_finished(&finished, None);
        for id in &released {
            self.engine.released(id)?;
        }
        for id in &loaded {
            self.engine.loaded(id)?;
        }
        let errors = self.worker.take_load_errors();
        if !errors.is_empty() {
            return Err(format!("load errors on device blocks {errors:?}").into());
        }
        Ok(())
    }

    /// Ticks until every sequence finished, every page is back and the leader is quiescent:
    /// nothing in flight *and* nothing queued (host → disk copies of blocks whose host store just
    /// completed are queued by the leader and only appear in the next metadata, so "nothing in
    /// flight" alone is not enough).
    fn drain(&mut self) -> Res<()> {
        for _ in 0..200 {
            self.sched.leader.process_completions();
            if self.engine.idle()
                && self.last_ops == 0
                && self.sched.leader.num_operations_in_flight() == 0
            {
                return Ok(());
            }
            self.tick()?;
        }
        Err("the toy engine did not drain in 200 ticks".into())
    }
}

/// A unique directory under the system temp dir, removed on drop.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new() -> Res<Self> {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
        let dir =
            std::env::temp_dir().join(format!("kvbm-toy-engine-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn main() -> Res<()> {
    let dir = ScratchDir::new()?;
    run(dir.path())
}

fn run(dir: &Path) -> Res<()> {
    let mut config = Config::default();
    config.host.cache_blocks = Some(HOST_BLOCKS);
    config.disk.cache_blocks = Some(DISK_BLOCKS);
    config.disk.dir = dir.to_path_buf();
    config.init_timeout_secs = 10.0;

    // The toy keeps one buffer per layer with pages outermost, and registers its cache directly
    // as a StorageTier whose Layout says so.
    let dims = LayoutDims {
        num_layers: 3,
        outer_dim: 2,
        page_size: PAGE,
        inner_dim: 8,
        dtype_bytes: 2,
    };
    let device: Arc<dyn StorageTier> = Arc::new(MemoryTier::new(
        TierKind::Device,
        Layout::layer_separate(dims, DEVICE_PAGES, BlockOrder::BlockMajor)?,
    )?);

    // Both sides start non-blocking; the toy holds admission until both are ready.
    let (leader_end, worker_ends) = in_process(1);
    let worker_end = worker_ends.first().ok_or("no worker transport")?.clone();
    let mut worker = Worker::new::<Toy>(config.clone(), 1, worker_end, StandardTiers::shared())?;
    worker.register(device.clone())?;
    let mut leader = Leader::new::<Toy>(FinalDeltas::default(), config.clone(), PAGE, leader_end)?;
    let deadline = Instant::now() + config.init_timeout();
    while !(leader.is_ready() && worker.is_ready()) {
        if let Some(e) = worker.init_error() {
            return Err(e.into());
        }
        if Instant::now() > deadline {
            return Err(format!("start-up did not finish: {:?}", leader.status()).into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }

    let mut rig = Rig {
        engine: ToyEngine {
            device: device.clone(),
            free: (0..DEVICE_PAGES).rev().collect(),
            seqs: BTreeMap::new(),
            held: HashMap::new(),
            finished_unreported: Vec::new(),
            transcripts: BTreeMap::new(),
            by_id: HashMap::new(),
            verified_blocks: 0,
        },
        sched: ToyScheduler { leader },
        worker,
        ticks: 0,
        last_ops: usize::MAX,
    };

    let system: Vec<Token> = (1000..1024).collect(); // 24 tokens: 6 full pages shared by all
    let with = |tail: std::ops::Range<Token>| -> Vec<Token> {
        system.iter().copied().chain(tail).collect()
    };
    let mut hits = 0usize;
    let mut misses = 0usize;
    let mut expect = |what: &str, got: usize, want: usize| -> Res<()> {
        if got != want {
            return Err(format!("{what}: {got} tokens matched, expected {want}").into());
        }
        if got > 0 {
            hits += 1;
        } else {
            misses += 1;
        }
        Ok(())
    };

    // Batch 0: one conversation, nothing cached yet.
    let a = Ticket { batch: 0, lane: 0 };
    let got = rig.admit(a, with(1..7), 6)?; // 30 prompt tokens, 36 in all
    expect("A (cold)", got, 0)?;
    rig.drain()?;

    // Batch 1: two sequences sharing the system prompt, admitted in the same tick.
    let b = Ticket { batch: 1, lane: 0 };
    let c = Ticket { batch: 1, lane: 1 };
    let got = rig.admit(b, with(200..210), 3)?;
    expect("B (shares the system prompt)", got, system.len())?;
    let got = rig.admit(c, with(300..305), 3)?;
    expect("C (shares the system prompt)", got, system.len())?;
    rig.drain()?;

    // Fault injection, then the custom operation: the host copies are lost (zeroed behind the
    // leader's back), and a toy_prefetch re-warms them from disk before the next batch needs
    // them. Safe here: nothing is in flight and the host tier never evicted.
    let host_stats = rig
        .sched
        .leader
        .pool_stats()
        .and_then(|(h, _)| h)
        .ok_or("no host pool")?;
    if host_stats.evictions != 0 || rig.sched.leader.num_operations_in_flight() != 0 {
        return Err("prefetch preconditions do not hold".into());
    }
    let tiers = rig.worker.tiers().ok_or("worker not ready")?.clone();
    let host = tiers.host.ok_or("no host tier")?;
    let disk = tiers.disk.ok_or("no disk tier")?;
    let copies = rig.sched.disk_copies();
    if copies.is_empty() {
        return Err("no host block has a disk copy".into());
    }
    let zero = vec![0u8; host.bytes_per_block()];
    for &(h, d) in &copies {
        if host.read_block_to_vec(h)? != disk.read_block_to_vec(d)? {
            return Err(
                format!("host block {h} and its disk copy {d} differ before the fault").into(),
            );
        }
        host.write_block_from_slice(h, &zero)?;
    }
    rig.sched.request_prefetch();
    rig.tick()?;
    // The worker's own count of what it moved, disk -> host being only ever the toy's operation.
    let worker_prefetched = rig
        .worker
        .transfer_stats()
        .iter()
        .find(|p| p.src == TierKind::Disk && p.dst == TierKind::Host)
        .map_or(0, |p| p.blocks);
    if worker_prefetched != copies.len() as u64 {
        return Err(format!(
            "the worker copied {worker_prefetched} blocks disk -> host, expected {}",
            copies.len()
        )
        .into());
    }
    // The worker reported the prefetch's completion back to the adapter (custom op ids).
    rig.sched.leader.process_completions();
    let (completions, failures) = {
        let book = &rig.sched.leader.adapter().book;
        (book.prefetch_completions, book.prefetch_failures)
    };
    if completions == 0 || failures != 0 {
        return Err(format!(
            "expected prefetch completions without failures, got {completions} ({failures} failed)"
        )
        .into());
    }
    let prefetched = rig.sched.leader.adapter().book.prefetched_blocks;
    if prefetched != copies.len() {
        return Err(format!(
            "toy_prefetch named {prefetched} blocks, expected {}",
            copies.len()
        )
        .into());
    }
    for &(h, d) in &copies {
        if host.read_block_to_vec(h)? != disk.read_block_to_vec(d)? {
            return Err(
                format!("toy_prefetch did not restore host block {h} from disk {d}").into(),
            );
        }
    }

    // Batch 2: A's conversation continues (its 8 computed full blocks were stored), and an
    // unrelated prompt misses.
    let d = Ticket { batch: 2, lane: 0 };
    let e = Ticket { batch: 2, lane: 1 };
    let mut next_turn = rig
        .engine
        .transcripts
        .get(&a)
        .ok_or("A has no transcript")?
        .clone();
    next_turn.extend(400..405);
    let got = rig.admit(d, next_turn, 4)?;
    expect("D (A's next turn)", got, 32)?;
    let got = rig.admit(e, (5000..5021).collect(), 4)?;
    expect("E (unrelated)", got, 0)?;
    rig.drain()?;

    // Everything went back where it came from.
    if rig.engine.free.len() != DEVICE_PAGES {
        return Err(format!(
            "{} of {DEVICE_PAGES} pages free at the end",
            rig.engine.free.len()
        )
        .into());
    }
    if rig.sched.leader.num_slots() != 0 || rig.worker.num_slots() != 0 {
        return Err(format!(
            "slots left: leader {}, worker {}",
            rig.sched.leader.num_slots(),
            rig.worker.num_slots()
        )
        .into());
    }
    let snap = rig.sched.leader.metrics().snapshot();
    let expected_host_hits = (2 * system.len() + 32) as u64;
    if snap.host_hit_tokens != expected_host_hits || snap.load_error_blocks != 0 {
        return Err(format!(
            "metrics: {} host hit tokens (expected {expected_host_hits}), {} load errors",
            snap.host_hit_tokens, snap.load_error_blocks
        )
        .into());
    }

    println!(
        "toy engine: 5 requests in 3 batches over {} ticks, adapter `{}`",
        rig.ticks,
        rig.sched.leader.adapter().name()
    );
    println!(
        "  prefix hits: {hits} requests ({} tokens from host, {} from disk); misses: {misses}",
        snap.host_hit_tokens, snap.disk_hit_tokens
    );
    let mut moved: BTreeSet<String> = BTreeSet::new();
    for t in &snap.transfers {
        moved.insert(format!("{} -> {}: {} blocks", t.src, t.dst, t.blocks));
    }
    moved.insert(format!("disk -> host (toy_prefetch): {prefetched} blocks"));
    println!(
        "  blocks moved: {}",
        moved.into_iter().collect::<Vec<_>>().join(", ")
    );
    println!(
        "  verified: {} onboarded blocks byte for byte, {} host blocks restored by toy_prefetch",
        rig.engine.verified_blocks,
        copies.len()
    );
    Ok(())
}
