//! The engine stand-in behind `kvbm replay`: one scheduler process driving the real leader and,
//! through [`RankDriver`]s, the real workers of its ranks.
//!
//! It behaves like the chosen engine's scheduler and model runner and drives the connector in that
//! engine's call order; where the engines differ it asks the engine's
//! [`SchedulerSide`] (see [`super::engines`] for what differs). The parts:
//!
//! * this module: start-up, the step loop (arrivals, idle stretches skipped, a progress line, a
//!   guard against a replay that makes no progress), draining, the report;
//! * [`schedule`]: admission (device prefix cache, connector match, block allocation), the
//!   per-step token budget (chunked prefill), preemption, the model's sampling, finishing;
//! * [`iteration`]: one engine iteration through the connector and the ranks, the ranks' votes on
//!   what finished, verification of every onboarded block, lost ranks.
//!
//! The model stand-in writes, for every token it computes, deterministic KV bytes — a function of
//! the token prefix, the layer, K or V and the position ([`super::model`]) — through the worker's
//! per-layer calls into a device tier laid out as that engine lays out its cache. Every block
//! onboarded from host or disk is compared byte for byte with what the model would have computed;
//! the count of differences is `integrity_errors`.
//!
//! Time is simulated: a step costs `prefill_us_per_token` per prompt token computed plus a tenth of
//! that per decode token; idle stretches skip to the next arrival.

mod iteration;
pub(crate) mod schedule;

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvbm_connector::connector::transport::in_process;
use kvbm_connector::error::{Error, ErrorKind, Result};
use kvbm_connector::identity::{BlockHasher, Salt};
use kvbm_connector::tier::TierKind;

use super::engines::{engine_of, CallOrder, SchedulerSide};
use super::framework::Framework;
use super::messages::RankDriver;
use super::model::Shard;
use super::options::SimOptions;
use super::pool::DevicePool;
use super::rank::{LocalRank, RankExecutor};
use super::report::{
    MatchedFrom, PathReport, RemoteReport, Report, RequestReport, Summary, Timings,
};
use super::request::{Phase, Req};
use super::wait_for;
use super::workload::TraceRequest;

/// Where a replay's requests come from, in arrival order: read one at a time (a trace file read
/// lazily, or a list), so memory follows what is in flight and cached, not the whole workload.
pub type Source = Box<dyn Iterator<Item = Result<TraceRequest>>>;

/// A list of requests as a [`Source`] (sorted by arrival, stable; the list is moved, not copied).
pub fn source_of(mut v: Vec<TraceRequest>) -> Source {
    v.sort_by_key(|r| r.arrival);
    Box::new(v.into_iter().map(Ok))
}

/// `--pace` sleeps only when the simulated clock is at least this far ahead of the wall clock.
const PACE_SLACK: Duration = Duration::from_micros(200);

/// The simulated engine.
pub struct Simulator {
    opts: SimOptions,
    pool: DevicePool,
    sched: Box<dyn SchedulerSide>,
    /// The ranks; `None` once a rank died.
    ranks: Vec<Option<Box<dyn RankDriver>>>,
    /// Child processes of the ranks (multi-process runs), by rank.
    children: Vec<std::process::Child>,
    /// Per request: how many live ranks reported it released / loaded so far.
    released_votes: HashMap<usize, usize>,
    loaded_votes: HashMap<usize, usize>,
    rank_failures: usize,
    /// Requests that arrived so far, in arrival order (a finished one keeps only its report).
    reqs: Vec<Req>,
    /// Requests still to arrive.
    source: Source,
    /// The next request to arrive, read ahead.
    next: Option<TraceRequest>,
    /// Ids seen (unique within a replay).
    ids: std::collections::HashSet<String>,
    /// Arrived requests not yet done (indices into `reqs`), pruned every step.
    live: Vec<usize>,
    /// Grows whenever a request arrives, computes, loads or finishes (the stall guard's measure).
    progress: u64,
    /// Bumped at each step with `progress` unchanged; reset by progress.
    stalled_steps: u64,
    /// Request index by the connector's id (what the ranks report).
    by_request_id: HashMap<String, usize>,
    /// Running order (admission order): vLLM preempts from the back.
    running: Vec<usize>,
    waiting: VecDeque<usize>,
    /// Device blocks freed since the last forward pass; overwritten with junk once the next
    /// metadata is bound (so a hit only passes if a load really copied), unless reused by then.
    to_clobber: Vec<usize>,
    timings: Timings,
    hasher: BlockHasher,
    step: u64,
    clock_us: f64,
    /// With `--pace`: the wall-clock instant of simulated time 0.
    paced_from: Option<Instant>,
    integrity_errors: usize,
    blocks_verified: usize,
    load_errors: usize,
    preemptions: usize,
    /// Matches answered "ask again later" (remote lookups running).
    match_pending: usize,
    /// While a due request is held back (the waiting ones hold `max_waiting_tokens`): the
    /// simulated clock at the start of each step since it became due, `(step, clock_us)`, so
    /// that it and those due after it arrive with the clock of their arrival step. Empty
    /// otherwise.
    due_clocks: VecDeque<(u64, f64)>,
    /// Most tokens the waiting requests held at once.
    peak_waiting_tokens: usize,
    /// When the first step ran (the report's wall clock).
    started: Option<Instant>,
}

impl Simulator {
    /// Builds a single-process engine: leader and one worker over the in-process transport, started
    /// in the engine's order.
    pub fn new(opts: SimOptions, workload: Source) -> Result<Self> {
        opts.check_workload(&[])?;
        let shard = Shard {
            rank: 0,
            dims: opts.shard_dims()?,
        };
        let engine = engine_of(opts.framework);
        let (lt, wts) = in_process(1);
        let wt = wts
            .into_iter()
            .next()
            .ok_or_else(|| Error::internal("no worker transport"))?;
        let executor = || {
            RankExecutor::new(
                opts.framework,
                opts.device,
                opts.config.clone(),
                shard,
                opts.device_blocks,
                1,
                opts.n_groups(),
                wt,
                opts.tiers.clone(),
            )
        };
        let scheduler = || {
            let mut sched =
                engine.scheduler(opts.config.clone(), opts.block_size, lt, &opts.groups)?;
            if let Some(t) = &opts.tiers {
                sched.leader_mut().set_tier_factory(t.clone());
            }
            Ok::<_, Error>(sched)
        };
        let (sched, rank) = if engine.workers_first() {
            let rank = executor()?;
            (scheduler()?, rank)
        } else {
            let sched = scheduler()?;
            (sched, executor()?)
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

    /// Builds the engine over a started scheduler side and its ranks (`children`: their
    /// processes, by rank, in multi-process runs); waits for the connector to be ready.
    pub fn assemble(
        opts: SimOptions,
        workload: Source,
        sched: Box<dyn SchedulerSide>,
        ranks: Vec<Box<dyn RankDriver>>,
        children: Vec<std::process::Child>,
    ) -> Result<Self> {
        opts.model_dims()?;
        opts.check_workload(&[])?;
        let n = opts.device_blocks;
        let mut engine = Self {
            // vLLM's block 0 is its null block, which the connector never reads or writes (and
            // with a sliding window it stands for TensorRT-LLM's BAD_PAGE_INDEX too).
            pool: DevicePool::new(
                n,
                opts.device_prefix_cache,
                usize::from(opts.framework == Framework::Vllm || opts.windowed()),
            ),
            hasher: BlockHasher::new(opts.config.hash, Salt::NONE),
            sched,
            ranks: ranks.into_iter().map(Some).collect(),
            children,
            released_votes: HashMap::new(),
            loaded_votes: HashMap::new(),
            rank_failures: 0,
            reqs: Vec::new(),
            source: workload,
            next: None,
            ids: std::collections::HashSet::new(),
            live: Vec::new(),
            progress: 0,
            stalled_steps: 0,
            by_request_id: HashMap::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            to_clobber: Vec::new(),
            timings: Timings::default(),
            step: 0,
            clock_us: 0.0,
            paced_from: None,
            integrity_errors: 0,
            blocks_verified: 0,
            load_errors: 0,
            preemptions: 0,
            match_pending: 0,
            due_clocks: VecDeque::new(),
            peak_waiting_tokens: 0,
            started: None,
            opts,
        };
        engine.wait_ready()?;
        engine.next = engine.pull()?;
        Ok(engine)
    }

    /// Reads the next request from the source (checked against the options and the previous
    /// arrival).
    fn pull(&mut self) -> Result<Option<TraceRequest>> {
        let Some(r) = self.source.next().transpose()? else {
            return Ok(None);
        };
        self.accept(r).map(Some)
    }

    /// Checks a request against the options, the previous arrival and the ids seen.
    fn accept(&mut self, r: TraceRequest) -> Result<TraceRequest> {
        self.opts.check_request(&r)?;
        if self.reqs.len() >= super::workload::MAX_REQUESTS {
            return Err(Error::invalid_argument(format!(
                "request {:?}: more than {} requests in one replay",
                r.id,
                super::workload::MAX_REQUESTS
            )));
        }
        if let Some(prev) = self.reqs.last() {
            if r.arrival < prev.arrival {
                return Err(Error::invalid_argument(format!(
                    "request {:?} arrives at step {}, before the previous request ({}): a \
                     workload is read in arrival order",
                    r.id, r.arrival, prev.arrival
                )));
            }
        }
        if !self.ids.insert(r.id.clone()) {
            return Err(Error::invalid_argument(format!(
                "duplicate request id {:?}",
                r.id
            )));
        }
        Ok(r)
    }

    /// A request arrives: it becomes the engine's, waiting for admission (`clock_us`: the
    /// simulated time of its arrival step, which its TTFT counts from).
    fn arrive(&mut self, r: TraceRequest, clock_us: f64) {
        let i = self.reqs.len();
        let mut req = Req {
            id: r.id.clone(),
            num_id: i as u64,
            // Room for the prompt only (the output grows as it is generated): the sizes were
            // checked by `check_request`, but memory is spent on tokens, not promises.
            tokens: Vec::with_capacity(r.prompt.len()),
            prefix: Vec::with_capacity(r.prompt.len()),
            prompt_len: r.prompt.len(),
            max_tokens: r.max_tokens.max(1),
            generated: 0,
            computed: 0,
            blocks: vec![Vec::new(); self.opts.n_groups()],
            phase: Phase::Waiting,
            arrival: r.arrival,
            arrival_clock_us: clock_us,
            first_token_us: None,
            loading: None,
            announced: false,
            loaded: false,
            sent_tokens: 0,
            sent_blocks: 0,
            report: RequestReport {
                id: r.id,
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
        let id = self.sched.request_id(&req).to_string();
        self.by_request_id.insert(id, i);
        self.reqs.push(req);
        self.waiting.push_back(i);
        self.live.push(i);
        self.progress += 1;
    }

    /// A request is done: its tokens are dropped (only its report stays).
    pub(super) fn retire(&mut self, i: usize) {
        let r = &mut self.reqs[i];
        r.phase = Phase::Done;
        r.tokens = Vec::new();
        r.prefix = Vec::new();
        r.blocks = Vec::new();
        self.progress += 1;
    }

    fn wait_ready(&mut self) -> Result<()> {
        let timeout = self.opts.config.init_timeout();
        let leader = self.sched.leader_mut();
        wait_for("the connector", timeout, || match leader.init_error() {
            Some(e) => Err(e),
            None => Ok(leader.ready()),
        })
    }

    /// The device prefix cache's keys of request `i`'s first `blocks` blocks in KV-cache group
    /// `g` (group 0 the plain sequence hashes; other groups salted, so groups never share a
    /// cached block).
    fn keys(&self, i: usize, g: usize, blocks: usize) -> Vec<u128> {
        let bs = self.opts.block_size;
        let r = &self.reqs[i];
        let n = (blocks * bs).min(r.tokens.len());
        let salt = (g as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
        self.hasher
            .sequence_hashes(&r.tokens[..n], bs)
            .map(|v| v.into_iter().map(|k| k.0 ^ salt).collect())
            .unwrap_or_default()
    }

    /// Runs the whole workload.
    pub fn run(mut self) -> Result<Report> {
        self.run_until_idle()?;
        self.close()
    }

    /// Steps until every request of the source arrived and is done (the report's clock starts
    /// at the first call).
    fn run_until_idle(&mut self) -> Result<()> {
        let wall = *self.started.get_or_insert_with(Instant::now);
        if self.opts.pace && self.paced_from.is_none() {
            self.paced_from = Some(wall);
        }
        let mut last_progress = Instant::now();
        loop {
            self.live.retain(|&i| self.reqs[i].phase != Phase::Done);
            if self.next.is_none() && self.live.is_empty() {
                break;
            }
            self.admit_arrivals()?;
            let before = self.progress;
            self.one_step()?;
            self.step += 1;
            if self.progress == before {
                self.stalled_steps += 1;
            } else {
                self.stalled_steps = 0;
            }
            if self.stalled_steps > 200_000 {
                return Err(self.stall_error());
            }
            if self.opts.progress && last_progress.elapsed() > Duration::from_millis(200) {
                let done = self.reqs.len() - self.live.len();
                eprint!("\rreplay: {done} requests finished, step {}", self.step);
                last_progress = Instant::now();
            }
        }
        Ok(())
    }

    /// Serves one more request `r` (a fleet's instance, `kvbm sweep --instances`): it arrives
    /// once everything before it is done, and the engine steps until it is done too and its
    /// stores (to host, disk and the remote tier) finished. Returns its report (matched tokens
    /// by tier). The request is checked as a source's are.
    pub fn serve(&mut self, r: TraceRequest) -> Result<RequestReport> {
        let r = self.accept(r)?;
        self.run_until_idle()?;
        self.next = Some(r);
        self.run_until_idle()?;
        self.settle()?;
        self.reqs
            .last()
            .map(|q| q.report.clone())
            .ok_or_else(|| Error::internal("a served request left no report"))
    }

    /// The leader's counters now (a fleet reads what its report leaves out: dropped offloads,
    /// the remote tier's timeouts and skips).
    pub fn leader_metrics(&self) -> kvbm_connector::connector::metrics::MetricsSnapshot {
        self.sched.leader().metrics()
    }

    /// Ends the replay: lets background stores finish and reports (wall time from the first
    /// step).
    pub fn close(mut self) -> Result<Report> {
        let wall = *self.started.get_or_insert_with(Instant::now);
        let total = self.reqs.len();
        if self.opts.progress {
            eprintln!("\rreplay: {total} requests finished, step {}   ", self.step);
        }
        let served = wall.elapsed();
        self.settle()?;
        Ok(self.report(wall.elapsed(), served))
    }

    /// Admits the requests that have arrived, skipping idle stretches (nothing live: the
    /// step jumps to the next arrival). Sequential: the next request arrives once the previous
    /// one is done, whatever its arrival says.
    ///
    /// Memory follows `max_waiting_tokens`, not the trace: a due request that would take the
    /// waiting requests' tokens past it stays unread in the source (with every request
    /// behind it) until admissions drain the queue; at least one request always waits. Such a
    /// request arrives with the clock of the step it became due ([`Self::due_clock`]), so its
    /// TTFT counts the time it was held back.
    fn admit_arrivals(&mut self) -> Result<()> {
        let sequential = self.opts.sequential;
        if self.live.is_empty() && !sequential {
            if let Some(r) = &self.next {
                self.step = self.step.max(r.arrival);
            }
        }
        let mut waiting_tokens: usize = self
            .waiting
            .iter()
            .map(|&i| self.reqs[i].tokens.len())
            .sum();
        let mut held_back = false;
        while let Some(r) = &self.next {
            let due = if sequential {
                self.live.is_empty()
            } else {
                r.arrival <= self.step
            };
            if !due {
                break;
            }
            let tokens = r.prompt.len();
            if !self.waiting.is_empty()
                && waiting_tokens.saturating_add(tokens) > self.opts.max_waiting_tokens
            {
                held_back = true;
                break;
            }
            if let Some(r) = self.next.take() {
                let clock = self.due_clock(r.arrival);
                self.arrive(r, clock);
            }
            waiting_tokens = waiting_tokens.saturating_add(tokens);
            self.next = self.pull()?;
        }
        self.peak_waiting_tokens = self.peak_waiting_tokens.max(waiting_tokens);
        if held_back {
            self.due_clocks.push_back((self.step, self.clock_us));
        } else {
            // Every due request arrived: no earlier step's clock is needed again.
            self.due_clocks.clear();
        }
        Ok(())
    }

    /// The simulated clock at the start of the first step at or after `arrival` (the clock now
    /// when no request is held back); forgets the steps before it (requests come in arrival
    /// order).
    fn due_clock(&mut self, arrival: u64) -> f64 {
        while self.due_clocks.front().is_some_and(|&(s, _)| s < arrival) {
            self.due_clocks.pop_front();
        }
        self.due_clocks.front().map_or(self.clock_us, |&(_, c)| c)
    }

    /// The error of a replay that made no progress: how many requests run, wait, load and are
    /// held, the free blocks, and up to six stuck requests (loading first) with their state.
    fn stall_error(&self) -> Error {
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
                    r.table_len(),
                    r.loading,
                    r.loaded,
                    self.sched.leader().state_of(&self.sched.request_id(r))
                )
            })
            .collect();
        Error::internal(format!(
            "replay made no progress: {} running, {} waiting, {} loading, {} held, {} blocks available; {}",
            self.running.len(),
            self.waiting.len(),
            count(Phase::Loading),
            count(Phase::Held),
            self.pool.available(),
            stuck.join("; ")
        ))
    }

    /// Lets background stores (host → disk, host → remote) finish so the report counts them.
    fn settle(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            self.sched.leader_mut().apply_completions();
            if !self.sched.leader().pending_work() {
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
        let pending_before = self.match_pending;
        let admitted = self.admit()?;
        if self.match_pending > pending_before && self.running.is_empty() && admitted == 0 {
            // Only requests waiting for remote lookups: let the lookup thread run.
            std::thread::sleep(Duration::from_micros(200));
        }
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
        let order = self.sched.call_order();
        match order {
            CallOrder::EveryStep => self.engine_iteration(&scheduled, &computed_before)?,
            // An empty batch (nothing scheduled, nothing admitted) builds no metadata.
            CallOrder::Manager if scheduled.is_empty() && admitted == 0 => {}
            CallOrder::Manager => self.run_ranks(&scheduled, &computed_before, false)?,
        }
        self.clock_us += 20.0
            + self.opts.prefill_us_per_token * prefill_tokens as f64
            + self.opts.prefill_us_per_token / 10.0 * decode_tokens as f64;
        self.pace();
        self.advance(&scheduled)?;
        if order == CallOrder::Manager {
            // After the scheduler finished this iteration's requests, every rank's get_finished.
            self.report_iteration()?;
        }
        Ok(())
    }

    /// With `--pace`, sleeps until the wall clock has caught up with the simulated one (only
    /// when it is at least [`PACE_SLACK`] ahead: shorter sleeps cost more than they model).
    fn pace(&self) {
        let Some(from) = self.paced_from else {
            return;
        };
        let due = from + Duration::from_secs_f64(self.clock_us.max(0.0) / 1e6);
        let now = Instant::now();
        if due > now + PACE_SLACK {
            std::thread::sleep(due - now);
        }
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

    /// The remote (G4) store's part of the report: the leader's remote counters and the
    /// store's own; `None` without a remote store.
    fn remote_report(&self) -> Option<RemoteReport> {
        let metrics = self.sched.leader().metrics();
        self.sched
            .leader()
            .remote_store()
            .map(|(store, st)| RemoteReport {
                store,
                available: metrics.remote_available,
                state: metrics
                    .remote_state
                    .map_or_else(|| "unknown".to_string(), |s| s.to_string()),
                state_changes: metrics.remote_state_changes,
                lookups: metrics.remote_lookups,
                lookup_timeouts: metrics.remote_lookup_timeouts,
                lookup_errors: metrics.remote_lookup_errors,
                lookup_skipped: metrics.remote_lookup_skipped,
                sent_blocks: metrics
                    .transfer(TierKind::Host, TierKind::Remote)
                    .map_or(0, |t| t.blocks),
                write_errors: metrics.remote_store_error_blocks,
                hit_tokens: metrics.remote_hit_tokens,
                store_errors: st.errors,
                store_timeouts: st.timeouts,
                reconnects: st.reconnects,
                invalid_values: st.invalid,
            })
    }

    fn report(&mut self, wall: Duration, served: Duration) -> Report {
        let paths = self.collect_paths();
        for c in &mut self.children {
            let _ = c.wait();
        }
        let (offloaded, onboarded) = path_rows(paths);
        let requests: Vec<RequestReport> = self.reqs.iter().map(|r| r.report.clone()).collect();
        let prompt_tokens: usize = requests.iter().map(|r| r.prompt_tokens).sum();
        let matched: usize = requests.iter().map(|r| r.matched_tokens).sum();
        let from = requests
            .iter()
            .fold(MatchedFrom::default(), |a, r| MatchedFrom {
                host: a.host + r.matched_from.host,
                disk: a.disk + r.matched_from.disk,
                remote: a.remote + r.matched_from.remote,
            });
        let remote = self.remote_report();
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
                store_errors: self.sched.leader().metrics().store_error_blocks(),
                preemptions: self.preemptions,
                tp: self.ranks.len(),
                rank_failures: self.rank_failures,
                steps: self.step,
                simulated_ms: self.clock_us / 1000.0,
                peak_waiting_tokens: self.peak_waiting_tokens,
                mean_ttft_ms: if ttft.is_empty() {
                    0.0
                } else {
                    ttft.iter().sum::<f64>() / ttft.len() as f64
                },
                wall_s: wall.as_secs_f64(),
                serve_s: served.as_secs_f64(),
                remote,
            },
            requests,
        }
    }
}

/// The summed per-path statistics as report rows, split into offloads (to host, disk or
/// remote) and onboards (to the device), each in the given order; a path that never ran
/// reports 0 GB/s.
fn path_rows(
    paths: Vec<(TierKind, TierKind, u64, u64, f64)>,
) -> (Vec<PathReport>, Vec<PathReport>) {
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
    (offloaded, onboarded)
}

/// Runs a replay in one process (leader and one worker over the in-process transport).
pub fn replay(opts: SimOptions, workload: Source) -> Result<Report> {
    Simulator::new(opts, workload)?.run()
}

/// The prefix hash KV-cache group `g`'s bytes of a token are made from: group 0 keeps the
/// token's own (a one-group model's bytes are unchanged); other groups mix the group in, so two
/// groups' blocks never hold the same bytes and a block onboarded into the wrong group fails
/// verification.
pub(crate) fn group_hash(h: u64, g: usize) -> u64 {
    if g == 0 {
        return h;
    }
    let mut x = h ^ (g as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}
