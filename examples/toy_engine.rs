//! A third engine adapter written outside the crate, for a "toy engine" that names requests by
//! a [`Ticket`] (batch, lane), reserves every page a sequence needs when it admits it, and reports
//! progress as a *delta*: per sequence, the tokens whose KV became final since the previous tick.
//! [`FinalDeltas`] is its [`SchedulerAdapter`] (the running total is the leader's), [`ToyPrefetch`]
//! a custom operation kind. It drives the real [`Leader`] and [`Worker`] over `in_process(1)`
//! with memory device, host and disk tiers (`harness::InProcess`), and checks every onboarded byte
//! (`harness::verify_blocks`): a wrong one fails the run (a `Corrupt` error, exit status 1).
//! Run it with `cargo run --example toy_engine`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use kvbm_connector::harness::{matching_blocks, verify_blocks, write_blocks};
use kvbm_connector::harness::{DeviceBlocks, InProcess, ScratchDir};
use kvbm_connector::prelude::*;
use serde::{Deserialize, Serialize};

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const PAGE: usize = 4; // tokens per page (the toy's word for a block)
const DEVICE_PAGES: usize = 64;
const CHUNK: usize = 8; // prompt tokens one tick computes per sequence (chunked prefill)

struct Toy;
impl Engine for Toy {
    type Adapter = FinalDeltas;
    type LeaderInit = NonBlocking; // the toy polls readiness before it admits a request
    type WorkerInit = NonBlocking;
}

/// Copies disk blocks into host blocks. A [`Direction::Store`]: it writes no device block, so the
/// worker starts it after the forward pass and its failures are not device blocks to recompute.
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

/// Offload by final-token deltas, staged before each tick's metadata, over the leader's count.
#[derive(Debug, Default)]
struct FinalDeltas {
    deltas: HashMap<RequestId, usize>,
    prefetch: Vec<(usize, usize)>, // (disk, host) pairs for the next metadata
    prefetch_reports: (usize, usize), // completions, failed ones
}

impl SchedulerAdapter for FinalDeltas {
    fn name(&self) -> &'static str {
        "final-deltas"
    }

    fn computed_after(&self, r: &ScheduledRequest) -> kvbm_connector::Result<usize> {
        let id = &r.request_id;
        let delta = self.deltas.get(id).copied();
        let after = delta.and_then(|d| r.num_computed_tokens.checked_add(d));
        after.ok_or_else(|| Error::invalid_argument("no staged delta, or overflow").with("id", id))
    }

    fn extend_metadata(&mut self, meta: &mut ConnectorMetadata) -> kvbm_connector::Result<()> {
        if !self.prefetch.is_empty() {
            let pairs = std::mem::take(&mut self.prefetch);
            meta.operations.push(Box::new(ToyPrefetch(BlockTransfer {
                // A custom id: its completions come back through on_custom_completion.
                id: OperationId::custom(meta.iteration),
                request_id: None, // background work: no request's operation
                src: TierKind::Disk,
                dst: TierKind::Host,
                pairs,
            })));
        }
        Ok(())
    }

    fn on_custom_completion(&mut self, _: usize, c: &Completion) -> kvbm_connector::Result<()> {
        self.prefetch_reports.0 += 1;
        self.prefetch_reports.1 += usize::from(!c.failed_dst_blocks.is_empty());
        Ok(())
    }
}

/// The toy's request handle: (batch, lane).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Ticket(u16, u16);

impl Ticket {
    fn id(self) -> RequestId {
        RequestId::from(format!("b{}.l{}", self.0, self.1))
    }
}

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+).into());
        }
    };
}

#[derive(Default)]
struct Seq {
    tokens: Vec<Token>,
    prompt_len: usize,
    max_len: usize,
    pages: Vec<usize>,
    final_tokens: usize,   // tokens with final KV on the device
    reported_final: usize, // final tokens reported in deltas so far
    loading: usize,        // tokens a load is bringing in (0: running)
    work: usize,           // tokens this tick computes
}

/// The toy engine (what the user already had) with its connector calls.
struct ToyEngine {
    rig: InProcess<FinalDeltas>,
    pages: DeviceBlocks,
    seqs: BTreeMap<Ticket, Seq>,
    verified: usize, // onboarded blocks checked
}

impl ToyEngine {
    /// Looks the prompt up (expecting `want` tokens to load), reserves (zeroed) every page the
    /// sequence needs, tells the leader.
    fn admit(&mut self, ticket: Ticket, tokens: Vec<Token>, gen: usize, want: usize) -> Res<()> {
        let (id, leader) = (ticket.id(), &mut self.rig.leader);
        let loading = leader.get_num_new_matched_tokens(RequestInfo::new(&id, &tokens), 0)?;
        let loading = loading.external_tokens;
        ensure!(loading == want, "{ticket:?}: {loading} tokens to load");
        let (prompt_len, max_len) = (tokens.len(), tokens.len() + gen);
        let pages = self.pages.allocate(max_len.div_ceil(PAGE))?;
        leader.update_state_after_alloc(&id, &pages, loading)?;
        let mut s = Seq::default();
        (s.tokens, s.pages, s.loading) = (tokens, pages, loading);
        (s.prompt_len, s.max_len) = (prompt_len, max_len);
        self.seqs.insert(ticket, s);
        Ok(())
    }

    /// One tick in the toy's call order: plan, metadata and forward pass, finished sequences.
    fn tick(&mut self) -> Res<()> {
        let (mut step, mut deltas) = (SchedulerStep::default(), HashMap::new());
        let running = |s: &Seq| s.loading == 0 && s.tokens.len() < s.max_len;
        for (&ticket, s) in self.seqs.iter_mut().filter(|(_, s)| running(s)) {
            let prefill = s.prompt_len.saturating_sub(s.final_tokens);
            s.work = if prefill > 0 { prefill.min(CHUNK) } else { 1 };
            let (leader, id) = (&self.rig.leader, ticket.id());
            deltas.insert(id.clone(), s.final_tokens + s.work - s.reported_final);
            s.reported_final = s.final_tokens + s.work;
            // What the leader holds: tokens, computed count (0s: untracked, the step fails).
            let known = leader.known_tokens(id.as_str()).unwrap_or(0);
            step.requests.push(ScheduledRequest {
                num_computed_tokens: leader.computed_tokens(&id).unwrap_or(0),
                new_tokens: s.tokens[known..].to_vec(),
                first_token_index: Some(known),
                request_id: id,
                ..Default::default()
            });
        }
        self.rig.leader.adapter_mut().deltas = deltas;
        let (device, mut done) = (self.pages.tier(), Vec::new());
        self.rig.iteration(&step, || {
            for (&ticket, s) in self.seqs.iter_mut().filter(|(_, s)| s.work > 0) {
                let from = s.final_tokens / PAGE;
                s.final_tokens += std::mem::take(&mut s.work);
                let computed = &s.pages[..s.final_tokens / PAGE];
                write_blocks(&**device, &s.tokens, computed, from)?;
                if s.final_tokens == s.tokens.len() && s.tokens.len() < s.max_len {
                    let fnv = |h: u32, t: &Token| (h ^ t).wrapping_mul(0x0100_0193);
                    let sampled = s.tokens.iter().fold(0x811c_9dc5, fnv) % 50_000;
                    s.tokens.push(sampled);
                }
                if s.tokens.len() == s.max_len {
                    done.push(ticket);
                }
            }
            Ok(())
        })?;
        let mut finished = Vec::new();
        for ticket in done {
            let (id, s) = (ticket.id(), self.seqs.get_mut(&ticket).ok_or("gone")?);
            let leader = &mut self.rig.leader;
            let agree = leader.computed_tokens(&id) == Some(s.final_tokens);
            ensure!(agree, "{id}: final token counts differ");
            let held = leader.request_finished(&id, Some(&s.tokens), Some(s.final_tokens))?;
            self.pages.finish(&id, std::mem::take(&mut s.pages), held); // held: still read
            finished.push(id);
        }
        let r = self.rig.finish_iteration(&finished);
        let errors = r.load_errors;
        ensure!(errors.is_empty(), "load errors on device blocks {errors:?}");
        self.pages.release(&r.released)?;
        for id in &r.loaded {
            let s = self.seqs.iter_mut().find(|(t, _)| t.id() == *id);
            let s = s.ok_or("unknown load")?.1;
            // Every onboarded byte, against what the toy's model computes for the prefix.
            let loaded = &s.pages[..s.loading / PAGE];
            self.verified += verify_blocks(&**self.pages.tier(), &s.tokens, loaded)?;
            s.final_tokens = std::mem::take(&mut s.loading);
        }
        Ok(())
    }

    /// Ticks until every sequence finished, every page is back and the connector is quiescent.
    fn drain(&mut self) -> Res<()> {
        for _ in 0..200 {
            let finished = self.seqs.values().all(|s| s.tokens.len() == s.max_len);
            if finished && self.pages.num_held() == 0 && self.rig.is_quiescent() {
                return Ok(());
            }
            self.tick()?;
        }
        Err("the toy engine did not drain in 200 ticks".into())
    }
}

fn main() -> Res<()> {
    let dir = ScratchDir::new("kvbm-toy-engine")?;
    let mut config = Config::default();
    (config.host.cache_blocks, config.disk.cache_blocks) = (Some(64), Some(128)); // no evictions
    config.disk.dir = dir.path().to_path_buf();
    // The toy keeps one buffer per layer, pages outermost: a StorageTier whose Layout says so.
    let dims = LayoutDims {
        num_layers: 3,
        outer_dim: 2,
        page_size: PAGE,
        inner_dim: 8,
        dtype_bytes: 2,
    };
    let layout = Layout::layer_separate(dims, DEVICE_PAGES, BlockOrder::BlockMajor)?;
    let device: Arc<dyn StorageTier> = Arc::new(MemoryTier::new(TierKind::Device, layout)?);
    let tiers = StandardTiers::shared();
    let rig = InProcess::start::<Toy>(FinalDeltas::default(), config, device.clone(), tiers)?;
    let (pages, seqs) = (DeviceBlocks::new(device), BTreeMap::new());
    let mut toy = ToyEngine {
        rig,
        pages,
        seqs,
        verified: 0,
    };

    let system: Vec<Token> = (1000..1024).collect(); // 24 tokens: 6 full pages shared by all
    let with = |tail: std::ops::Range<Token>| system.iter().copied().chain(tail).collect();
    // Batch 0: one conversation, nothing cached. Batch 1: two sequences sharing its system prompt.
    toy.admit(Ticket(0, 0), with(1..7), 6, 0)?; // 30 prompt tokens, 36 in all
    toy.drain()?;
    toy.admit(Ticket(1, 0), with(200..210), 3, system.len())?;
    toy.admit(Ticket(1, 1), with(300..305), 3, system.len())?;
    toy.drain()?;

    // A fault: host copies lost behind the leader's back (zeroed); a toy_prefetch restores them
    // from their disk copies (found by content: safe while nothing is in flight and the host tier
    // never evicted). Batch 2 loads A's blocks from host: one not restored fails its byte check.
    let (leader, worker) = (&mut toy.rig.leader, &toy.rig.worker);
    let host_pool = leader.pool_stats().and_then(|(h, _)| h);
    ensure!(host_pool.is_some_and(|h| h.evictions == 0), "unsafe");
    let tiers = worker.tiers().ok_or("worker not ready")?.clone();
    let host = tiers.host.ok_or("no host tier")?;
    let disk = tiers.disk.ok_or("no disk tier")?;
    let copies = matching_blocks(&*disk, &*host); // (disk, host) pairs
    let zero = vec![0; host.bytes_per_block()];
    for &(_, h) in &copies {
        host.write_block_from_slice(h, &zero)?;
    }
    leader.adapter_mut().prefetch = copies.clone();
    toy.tick()?;
    let paths = toy.rig.worker.transfer_stats();
    let disk_host = (TierKind::Disk, TierKind::Host);
    let moved = paths.iter().find(|p| (p.src, p.dst) == disk_host);
    toy.rig.leader.process_completions();
    let reports = toy.rig.leader.adapter().prefetch_reports;
    let n = copies.len(); // 0 fails too: no prefetch, no completion
    let ok = moved.map(|p| p.blocks) == Some(n as u64) && reports.0 > 0 && reports.1 == 0;
    ensure!(ok, "prefetch of {n}: {moved:?}, {reports:?}");

    // Batch 2: A's conversation continues (its 8 computed full blocks are on host); a miss.
    let mut next_turn = toy.seqs[&Ticket(0, 0)].tokens.clone();
    next_turn.extend(400..405);
    toy.admit(Ticket(2, 0), next_turn, 4, 32)?;
    toy.admit(Ticket(2, 1), (5000..5021).collect(), 4, 0)?;
    toy.drain()?;

    // Everything went back where it came from, and every hit was verified.
    let snap = toy.rig.leader.metrics().snapshot();
    let slots = toy.rig.leader.num_slots() + toy.rig.worker.num_slots();
    let free = toy.pages.num_free();
    ensure!((free, slots) == (DEVICE_PAGES, 0), "{free} {slots}");
    let (host, disk, verified) = (snap.host_hit_tokens, snap.disk_hit_tokens, toy.verified);
    let got = (host, disk, snap.load_error_blocks, verified);
    ensure!(got == (80, 0, 0, 20), "hits, errors, verified: {got:?}");
    println!("toy engine: 5 requests, 3 prefix hits ({host} tokens from host), 2 misses");
    println!("  {verified} onboarded blocks verified byte for byte; toy_prefetch restored {n}");
    Ok(())
}
