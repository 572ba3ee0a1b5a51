//! `kvbm sweep --instances N`: a fleet planner. Splits one workload (usually a trace,
//! `--sequential`) over N simulated instances by a router ([`router`]: `round-robin` or
//! `prefix`), each instance a full `kvbm replay` engine with its own host (and disk) tier —
//! the real leader and worker, every onboarded block verified — with and without a shared tier
//! ([`store`]: an in-process store of `--shared-tokens`, unlimited by default, or a real server,
//! `--remote-url`). Requests are served in trace order, one at a time: each arrives once the one
//! before it (on whichever instance) is done and its stores, to host, disk and the shared tier,
//! have landed, so a run gives the same figures every time.
//!
//! Reports per run: each instance's hit rate and the fleet's (matched over prompt tokens), by
//! tier; the shared tier's traffic (blocks and tokens read and written) and size; a table,
//! `--json`, and an SVG plot of the fleet's hit rate against each instance's host capacity
//! (`--plot`).

pub mod report;
pub mod router;
pub mod store;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_connector::connector::worker::TierFactory;
use kvbm_connector::error::{Error, Result};
use kvbm_connector::identity::{BlockHasher, Salt};
use kvbm_connector::pool::EvictionPolicy;

use crate::replay::framework::Framework;
use crate::replay::simulator::Simulator;
use crate::replay::{replay_config, sim_options, workload_source};
use crate::sweep::{blocks_of, check_plot_path, parse_policy, unlimited, SweepArgs, MAX_POINTS};
use router::{Router, RouterKind};
use store::{FleetTiers, Shared, SharedStore, StoreSize, TrafficSnapshot};

/// Most instances in one fleet.
pub const MAX_INSTANCES: usize = 64;

/// The lookup deadline of the in-process shared tier, ms (see [`shared_tier`]).
const PLANNING_LOOKUP_TIMEOUT_MS: u64 = 1000;

/// Its read and write deadlines, and the median latency that would make it "slow", ms.
const PLANNING_IO_TIMEOUT_MS: u64 = 10_000;

/// How long `--remote-url` is given to answer before any replay starts.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Which runs have a shared tier (`--shared-tier`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SharedTierArg {
    /// Local tiers only.
    Off,
    /// Every instance also reads and writes the shared tier.
    On,
    /// Each configuration twice: without, then with the shared tier.
    Both,
}

/// `kvbm sweep` flags for fleets.
#[derive(Debug, Clone, clap::Args)]
pub struct FleetArgs {
    /// Split the workload over this many simulated instances (a fleet), each with its own
    /// host/disk tiers; comma-separated for several fleet sizes (`2,4,8`), each 1 to 64.
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    pub instances: Vec<usize>,
    /// How the fleet's router picks an instance: `round-robin`, or `prefix` (the instance
    /// holding the longest prefix of the request, ties to the least-loaded, none above 1.25×
    /// its share of requests); comma-separated for several.
    #[arg(long, value_delimiter = ',')]
    pub router: Vec<String>,
    /// Runs without (`off`), with (`on`) or without and with (`both`) a tier shared by the
    /// fleet's instances: an in-process store of `--shared-tokens`, or the `--remote-url`
    /// server. Default: both.
    #[arg(long, value_enum)]
    pub shared_tier: Option<SharedTierArg>,
    /// Capacity of the in-process shared tier in tokens (`K`, `M`, `G`: powers of 1000); least
    /// recently used blocks are evicted beyond it. Default: unlimited.
    #[arg(long, allow_negative_numbers = true, value_parser = crate::sweep::parse_tokens)]
    pub shared_tokens: Option<u64>,
    /// Print the runs as JSON (`{"runs": [...]}`) instead of the table.
    #[arg(long)]
    pub json: bool,
}

impl FleetArgs {
    /// True when `--instances` asks for a fleet.
    pub fn is_fleet(&self) -> bool {
        !self.instances.is_empty()
    }

    /// A sweep without `--instances` refuses the fleet's other flags.
    pub fn check_unused(&self) -> Result<()> {
        let used = [
            ("--router", !self.router.is_empty()),
            ("--shared-tier", self.shared_tier.is_some()),
            ("--shared-tokens", self.shared_tokens.is_some()),
            ("--json", self.json),
        ];
        match used.iter().find(|(_, on)| *on) {
            Some((f, _)) => Err(Error::invalid_argument(format!(
                "{f} is a fleet flag: it needs --instances N"
            ))
            .with("flag", *f)),
            None => Ok(()),
        }
    }
}

/// One planned fleet run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Plan {
    /// Instances.
    pub instances: usize,
    /// Router.
    pub router: RouterKind,
    /// With the shared tier.
    pub shared: bool,
    /// Eviction policy of every instance's tiers.
    pub policy: EvictionPolicy,
    /// Host capacity per instance, tokens.
    pub host_tokens: u64,
    /// ... in blocks.
    pub host_blocks: usize,
    /// Disk blocks per instance (0: none).
    pub disk_blocks: usize,
}

/// One instance's outcome in a run.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct InstanceResult {
    /// Requests it served.
    pub requests: usize,
    /// Their prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens matched (loaded instead of computed).
    pub matched_tokens: usize,
    /// ... from its host tier.
    pub from_host: usize,
    /// ... from its disk tier.
    pub from_disk: usize,
    /// ... from the shared tier.
    pub from_shared: usize,
    /// Onboarded blocks whose bytes differed (must be 0).
    pub integrity_errors: usize,
    /// Onboarded blocks verified.
    pub blocks_verified: usize,
    /// Loads that failed (recomputed).
    pub load_errors: usize,
    /// Blocks its offloads dropped (no host or disk block free for them at that moment: they
    /// never reach the shared tier either, which is written behind from host).
    pub offload_dropped_blocks: u64,
    /// Shared-tier lookups past their deadline, and skipped while the tier was out of the path.
    pub shared_lookup_timeouts: u64,
    /// ... skipped.
    pub shared_lookups_skipped: u64,
    /// Blocks whose write to the shared tier failed.
    pub shared_write_errors: u64,
}

impl InstanceResult {
    /// Matched / prompt tokens, percent.
    pub fn hit_pct(&self) -> f64 {
        crate::sweep::pct(self.matched_tokens, self.prompt_tokens)
    }
}

/// One fleet run's outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetRun {
    /// What ran.
    pub plan: Plan,
    /// Per instance.
    pub per_instance: Vec<InstanceResult>,
    /// The shared tier's name (`None`: no shared tier).
    pub store: Option<String>,
    /// Its traffic.
    pub traffic: Option<TrafficSnapshot>,
    /// Its size at the end (the in-process store only).
    pub size: Option<StoreSize>,
    /// The in-process store's capacity, tokens (`None`: unlimited, or no such store).
    pub shared_tokens: Option<u64>,
    /// Wall time, s.
    pub wall_s: f64,
}

impl FleetRun {
    /// The fleet's totals (requests, prompt, matched, by tier, errors).
    pub fn total(&self) -> InstanceResult {
        self.per_instance
            .iter()
            .fold(InstanceResult::default(), |t, i| InstanceResult {
                requests: t.requests + i.requests,
                prompt_tokens: t.prompt_tokens + i.prompt_tokens,
                matched_tokens: t.matched_tokens + i.matched_tokens,
                from_host: t.from_host + i.from_host,
                from_disk: t.from_disk + i.from_disk,
                from_shared: t.from_shared + i.from_shared,
                integrity_errors: t.integrity_errors + i.integrity_errors,
                blocks_verified: t.blocks_verified + i.blocks_verified,
                load_errors: t.load_errors + i.load_errors,
                offload_dropped_blocks: t.offload_dropped_blocks + i.offload_dropped_blocks,
                shared_lookup_timeouts: t.shared_lookup_timeouts + i.shared_lookup_timeouts,
                shared_lookups_skipped: t.shared_lookups_skipped + i.shared_lookups_skipped,
                shared_write_errors: t.shared_write_errors + i.shared_write_errors,
            })
    }
}

/// Runs `kvbm sweep --instances ...`.
pub fn run(a: &SweepArgs) -> Result<ExitCode> {
    let plans = plan(a)?;
    if let Some(path) = &a.plot {
        check_plot_path(path)?;
    }
    let server = remote_server(a)?;
    let title = crate::sweep::default_title(a);
    let started = Instant::now();
    let unl = unlimited(&a.replay)?;
    check_shared_memory(a, &plans, &unl, server.is_some())?;
    check_memory(a, &plans, &unl)?;
    let runs = run_all(a, &plans, server.is_some())?;
    if a.fleet.json {
        println!(
            "{}",
            report::render_json(&runs, &unl, a.replay.model.block_size)?
        );
    } else {
        print!(
            "{}",
            report::render_table(&title, &runs, &unl, a.replay.model.block_size)
        );
    }
    if !a.replay.quiet {
        let walls: Vec<String> = runs.iter().map(|r| format!("{:.1}", r.wall_s)).collect();
        eprintln!(
            "kvbm sweep: {} fleet runs in {:.1} s (each, s: {})",
            runs.len(),
            started.elapsed().as_secs_f64(),
            walls.join(" ")
        );
    }
    if let Some(path) = &a.plot {
        report::draw(path, &title, &runs, &unl, a.replay.model.block_size)?;
    }
    if runs.iter().any(|r| r.total().integrity_errors > 0) {
        eprintln!("kvbm: onboarded blocks differed from the model's KV");
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// Checks the flags and plans the runs, in this order: capacity (smallest first), policy, fleet
/// size, router, then without and with the shared tier. Everything a run could refuse is
/// refused here, before any replay.
pub fn plan(a: &SweepArgs) -> Result<Vec<Plan>> {
    let f = &a.fleet;
    for &n in &f.instances {
        if n == 0 || n > MAX_INSTANCES {
            return flag_err(
                "--instances",
                format!("--instances {n}: a fleet has between 1 and {MAX_INSTANCES} instances"),
            );
        }
    }
    let routers = routers(f)?;
    check_engine(a)?;
    let bs = a.replay.model.block_size;
    let hosts = host_capacities(a, bs)?;
    let disk_blocks = disk_blocks(a, bs)?;
    let shared_modes = shared_modes(a, bs)?;
    let mut policies: Vec<EvictionPolicy> = Vec::new();
    for p in &a.eviction {
        let p = parse_policy(p)?;
        if !policies.contains(&p) {
            policies.push(p);
        }
    }
    let mut instances: Vec<usize> = Vec::new();
    for &n in &f.instances {
        if !instances.contains(&n) {
            instances.push(n);
        }
    }
    let mut plans = Vec::new();
    for &(host_tokens, host_blocks) in &hosts {
        for &policy in &policies {
            for &n in &instances {
                for &router in &routers {
                    for &shared in shared_modes {
                        plans.push(Plan {
                            instances: n,
                            router,
                            shared,
                            policy,
                            host_tokens,
                            host_blocks,
                            disk_blocks,
                        });
                    }
                }
            }
        }
    }
    if plans.len() > MAX_POINTS {
        return flag_err(
            "--instances",
            format!(
                "{} fleet runs (capacities × policies × fleet sizes × routers × shared tier); at \
                 most {MAX_POINTS}",
                plans.len()
            ),
        );
    }
    // The configuration each instance will run with, checked once (tier sizes, remote URL).
    let mut ra = a.replay.clone();
    ra.host_blocks = Some(hosts[0].1);
    ra.disk_blocks = Some(disk_blocks);
    let config = replay_config(&ra)?;
    let opts = sim_options(&ra, config)?;
    opts.config
        .block_counts(opts.model_dims()?.bytes_per_block())?;
    Ok(plans)
}

/// An invalid-argument error naming `flag`.
/// Refuses, before any replay, an in-process shared tier that could outgrow this machine's
/// memory: it holds the bytes of every block it is given (the replay checks each one it
/// serves), at most the trace's distinct blocks, or `--shared-tokens`.
fn check_shared_memory(
    a: &SweepArgs,
    plans: &[Plan],
    unl: &crate::sweep::Unlimited,
    server: bool,
) -> Result<()> {
    if server || !plans.iter().any(|p| p.shared) {
        return Ok(());
    }
    let bs = a.replay.model.block_size.max(1);
    let config = replay_config(&a.replay)?;
    let per_block = sim_options(&a.replay, config)?
        .model_dims()?
        .bytes_per_block() as u64;
    let cap_blocks = a.fleet.shared_tokens.map_or(u64::MAX, |t| t / bs as u64);
    let need = (unl.distinct_blocks as u64)
        .min(cap_blocks)
        .saturating_mul(per_block);
    let Some(avail) = mem_available() else {
        return Ok(());
    };
    if need > avail / 2 {
        return flag_err(
            "--shared-tokens",
            format!(
                "the in-process shared tier could hold {} MiB ({} blocks of {per_block} bytes), \
                 over half of the {} MiB this machine has available: bound it with \
                 --shared-tokens, or plan with a smaller block (--layers, --kv-heads, \
                 --head-dim, --dtype-bytes: hit rates do not depend on the bytes)",
                need >> 20,
                need / per_block.max(1),
                avail >> 20
            ),
        );
    }
    Ok(())
}

/// The memory this process may still take ([`crate::memory::available`]).
fn mem_available() -> Option<u64> {
    crate::memory::available()
}

/// What one fleet run of `p` holds at most: each of its instances' tiers' bookkeeping, host
/// tier bytes (at most the blocks the workload's tokens fill) and device cache, and the one request in
/// flight (requests are served one at a time). The in-process shared tier is
/// [`check_shared_memory`]'s.
pub fn run_estimate(
    a: &SweepArgs,
    p: &Plan,
    unl: &crate::sweep::Unlimited,
) -> Result<crate::memory::Estimate> {
    let mut ra = a.replay.clone();
    ra.host_blocks = Some(p.host_blocks);
    ra.disk_blocks = Some(p.disk_blocks);
    let mut config = replay_config(&ra)?;
    config.eviction = p.policy;
    let opts = sim_options(&ra, config)?;
    let mut size = crate::replay::engine_size(&opts, Some(unl.blocks_bound), 0)?;
    // Requests are served one at a time: the one in flight is counted once, below.
    size.running_tokens_per_block = 0;
    let mut one = size.estimate();
    for part in &mut one.parts {
        if part.flag == "--host-blocks" && a.replay.host_blocks.is_none() {
            part.flag = "--capacities";
        }
    }
    let mut e = one.times(p.instances as u64, "--instances");
    e.add(
        "--max-waiting-tokens",
        format!(
            "the request in flight ({} tokens × {} B)",
            unl.longest_request,
            crate::memory::WAITING_TOKEN_BYTES
        ),
        (unl.longest_request as u64).saturating_mul(crate::memory::WAITING_TOKEN_BYTES as u64),
    );
    Ok(e)
}

/// Refuses, before any replay, fleet runs that would hold more than `--memory-limit` (default:
/// the memory available) — the `--jobs` largest runs at once ([`run_estimate`]) — naming
/// `--instances` (or the flag that costs most).
fn check_memory(a: &SweepArgs, plans: &[Plan], unl: &crate::sweep::Unlimited) -> Result<()> {
    let mut runs = plans
        .iter()
        .map(|p| run_estimate(a, p, unl))
        .collect::<Result<Vec<_>>>()?;
    let jobs = a.jobs.clamp(1, runs.len().max(1));
    runs.sort_by_key(|e| std::cmp::Reverse(e.total()));
    let mut all = crate::memory::Estimate::default();
    for e in runs.iter().take(jobs) {
        all.parts.extend(e.parts.iter().cloned());
    }
    let most = plans.iter().map(|p| p.instances).max().unwrap_or(1);
    all.check(
        &format!("kvbm sweep --instances {most} ({jobs} fleet run(s) at once, --jobs)"),
        a.replay.memory_limit,
    )
}

fn flag_err<T>(flag: &str, why: String) -> Result<T> {
    Err(Error::invalid_argument(why).with("flag", flag))
}

/// The `--router` names, parsed, each once, in the order first named (`round-robin` when none).
fn routers(f: &FleetArgs) -> Result<Vec<RouterKind>> {
    let mut routers: Vec<RouterKind> = Vec::new();
    for r in &f.router {
        let r = RouterKind::parse(r)?;
        if !routers.contains(&r) {
            routers.push(r);
        }
    }
    if routers.is_empty() {
        routers.push(RouterKind::RoundRobin);
    }
    Ok(routers)
}

/// What a fleet cannot run: ranks in processes of their own, vLLM's call order, `--jobs` out
/// of bounds, blocks of no tokens.
fn check_engine(a: &SweepArgs) -> Result<()> {
    let r = &a.replay;
    if r.tp > 1 || r.external_workers {
        return flag_err(
            "--tp",
            "a fleet's instances each replay in this process (--tp 1)".into(),
        );
    }
    if r.framework != Framework::Trtllm {
        return flag_err(
            "--framework",
            "a fleet replays TensorRT-LLM's call order (vLLM's scheduler builds its remote store \
             as it starts, before the fleet can hand it the shared one)"
                .into(),
        );
    }
    if a.jobs == 0 || a.jobs > 64 {
        return flag_err("--jobs", "--jobs is between 1 and 64".into());
    }
    if r.model.block_size == 0 {
        return flag_err("--block-size", "--block-size must be at least 1".into());
    }
    Ok(())
}

/// Each instance's host capacities, (tokens, blocks): `--host-blocks` (one) or `--capacities`
/// (distinct, smallest first), exactly one of them.
fn host_capacities(a: &SweepArgs, bs: usize) -> Result<Vec<(u64, usize)>> {
    match (a.replay.host_blocks, a.capacities.is_empty()) {
        (Some(_), false) => flag_err(
            "--host-blocks",
            "give each instance's host tier by --host-blocks or by --capacities, not both".into(),
        ),
        (Some(0), true) => flag_err("--host-blocks", "--host-blocks must be at least 1".into()),
        (Some(b), true) => Ok(vec![(b as u64 * bs as u64, b)]),
        (None, true) => flag_err(
            "--capacities",
            "a fleet needs each instance's host tier: --capacities 3M or --host-blocks N".into(),
        ),
        (None, false) => {
            let mut caps = a.capacities.clone();
            caps.sort_unstable();
            caps.dedup();
            caps.iter()
                .map(|&c| Ok((c, blocks_of(c, bs, "--capacities")?)))
                .collect()
        }
    }
}

/// Each instance's disk blocks: `--disk-blocks` or `--disk-tokens` (not both); none by default.
fn disk_blocks(a: &SweepArgs, bs: usize) -> Result<usize> {
    match (a.replay.disk_blocks, a.disk_tokens) {
        (Some(_), Some(_)) => flag_err(
            "--disk-tokens",
            "give each instance's disk tier by --disk-blocks or by --disk-tokens, not both".into(),
        ),
        (Some(b), None) => Ok(b),
        (None, Some(t)) => blocks_of(t, bs, "--disk-tokens"),
        (None, None) => Ok(0),
    }
}

/// Without and/or with the shared tier (`--shared-tier`, `both` by default); `--shared-tokens`
/// checked against it and `--remote-url`.
fn shared_modes(a: &SweepArgs, bs: usize) -> Result<&'static [bool]> {
    let shared = a.fleet.shared_tier.unwrap_or(SharedTierArg::Both);
    if let Some(t) = a.fleet.shared_tokens {
        if shared == SharedTierArg::Off {
            return flag_err(
                "--shared-tokens",
                "--shared-tokens sizes the shared tier, which --shared-tier off leaves out".into(),
            );
        }
        if a.replay.remote_url.is_some() {
            return flag_err(
                "--shared-tokens",
                "--shared-tokens sizes the in-process shared tier; a --remote-url server is sized \
                 by its own settings (maxmemory)"
                    .into(),
            );
        }
        blocks_of(t, bs, "--shared-tokens")?;
    }
    Ok(match shared {
        SharedTierArg::Off => &[false],
        SharedTierArg::On => &[true],
        SharedTierArg::Both => &[false, true],
    })
}

/// The `--remote-url` server, checked to answer (`None`: the in-process store). A URL of the
/// in-process kind is refused (the fleet's own store is that).
fn remote_server(a: &SweepArgs) -> Result<Option<String>> {
    let Some(url) = a.replay.remote_url.clone() else {
        return Ok(None);
    };
    if url.trim().to_ascii_lowercase().starts_with("memory://") {
        return Err(Error::invalid_argument(
            "--remote-url memory://: the fleet's shared tier is in-process already (leave out \
             --remote-url; --shared-tokens sizes it)",
        )
        .with("flag", "--remote-url"));
    }
    if a.fleet.shared_tier == Some(SharedTierArg::Off) {
        return Err(Error::invalid_argument(
            "--remote-url names the shared tier, which --shared-tier off leaves out",
        )
        .with("flag", "--remote-url"));
    }
    let config = replay_config(&a.replay)?;
    store::probe_server(&config, PROBE_TIMEOUT)?;
    Ok(Some(url))
}

/// Runs every plan (`--jobs` at a time); results in plan order.
fn run_all(a: &SweepArgs, plans: &[Plan], server: bool) -> Result<Vec<FleetRun>> {
    crate::sweep::run_in_parallel(plans, a.jobs, "fleet", |k, p| run_one(a, p, k, server))
}

/// Runs one fleet: `p.instances` engines in this thread, the requests in trace order, each to
/// the instance its router picks.
pub fn run_one(a: &SweepArgs, p: &Plan, run: usize, server: bool) -> Result<FleetRun> {
    let wall = Instant::now();
    let bs = a.replay.model.block_size;
    let mut ra = a.replay.clone();
    ra.host_blocks = Some(p.host_blocks);
    ra.disk_blocks = Some(p.disk_blocks);
    ra.quiet = true;
    if ra.disk_dir.is_none() {
        ra.disk_dir = Some(std::env::temp_dir().join("kvbm-sweep"));
    }
    if !p.shared {
        ra.remote_url = None;
    }
    let mut config = replay_config(&ra)?;
    config.eviction = p.policy;
    let shared = shared_tier(a, p, run, server, &mut config)?;
    let mut opts = sim_options(&ra, config)?;
    opts.progress = false;
    opts.tiers = shared
        .as_ref()
        .map(|s| Arc::new(FleetTiers { shared: s.clone() }) as Arc<dyn TierFactory>);
    let hasher = BlockHasher::new(opts.config.hash, Salt::NONE);
    let mut sims = (0..p.instances)
        .map(|_| Simulator::new(opts.clone(), Box::new(std::iter::empty())))
        .collect::<Result<Vec<_>>>()?;
    let mut router = Router::new(p.router, p.instances, p.host_blocks + p.disk_blocks);
    let progress = !a.replay.quiet && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut last = Instant::now();
    for (i, r) in workload_source(&ra)?.enumerate() {
        let r = r?;
        let keys: Vec<u128> = hasher
            .sequence_hashes(&r.prompt, bs)?
            .into_iter()
            .map(|k| k.0)
            .collect();
        let matchable = r.prompt.len().saturating_sub(1) / bs;
        let k = router.route(&keys, matchable);
        let sim = sims
            .get_mut(k)
            .ok_or_else(|| Error::internal(format!("the router picked instance {k}")))?;
        sim.serve(r)?;
        if progress && last.elapsed() > Duration::from_millis(500) {
            eprint!("\rfleet run {}: {} requests", run + 1, i + 1);
            last = Instant::now();
        }
    }
    if progress {
        eprint!("\r\x1b[K");
    }
    let mut per_instance = Vec::with_capacity(sims.len());
    for (sim, &requests) in sims.into_iter().zip(router.load()) {
        let m = sim.leader_metrics();
        per_instance.push(instance_result(sim.close()?, &m, requests));
    }
    Ok(FleetRun {
        plan: *p,
        per_instance,
        store: shared.as_ref().map(|s| match s {
            Shared::InProcess(_) => "in-process".to_string(),
            Shared::Server(_) => a
                .replay
                .remote_url
                .as_deref()
                .map(kvbm_connector::config::redact_url)
                .unwrap_or_default(),
        }),
        traffic: shared.as_ref().map(Shared::traffic),
        size: shared.as_ref().and_then(Shared::size),
        shared_tokens: match shared {
            Some(Shared::InProcess(_)) => a.fleet.shared_tokens,
            _ => None,
        },
        wall_s: wall.elapsed().as_secs_f64(),
    })
}

/// The shared tier of run `run` (`None` without one), and `config` set for it: a server's
/// values under a namespace of this run's own; the in-process store turned on by a
/// `memory://` URL (the fleet's factory builds the store), with a planning lookup deadline.
fn shared_tier(
    a: &SweepArgs,
    p: &Plan,
    run: usize,
    server: bool,
    config: &mut kvbm_connector::config::Config,
) -> Result<Option<Shared>> {
    if !p.shared {
        return Ok(None);
    }
    if server {
        // Each run its own namespace: runs never see each other's blocks on the server.
        let ns = format!(
            "{}kvbm-fleet-{}-{run}",
            config
                .remote
                .namespace
                .as_deref()
                .map(|n| format!("{n}/"))
                .unwrap_or_default(),
            std::process::id()
        );
        config.remote.namespace = Some(ns);
        return Ok(Some(Shared::Server(Arc::default())));
    }
    // The in-process store answers in microseconds, but on a busy machine a thread can be
    // descheduled for longer than TensorRT-LLM's 5 ms lookup deadline, and a few such calls
    // in a row make the leader's verdict "slow" and take the tier out of the path for
    // seconds: a plan measures what the tier holds, not the planning machine's scheduling, so
    // its deadlines and the verdict's threshold are raised (each at least what is set).
    config.remote.url = Some(format!("memory://kvbm-fleet-{run}"));
    let raise = |v: &mut Option<u64>, ms: u64| *v = Some(v.unwrap_or(0).max(ms));
    raise(
        &mut config.remote.lookup_timeout_ms,
        PLANNING_LOOKUP_TIMEOUT_MS,
    );
    raise(&mut config.remote.load_timeout_ms, PLANNING_IO_TIMEOUT_MS);
    raise(&mut config.remote.io_timeout_ms, PLANNING_IO_TIMEOUT_MS);
    raise(&mut config.remote.slow_ms, PLANNING_IO_TIMEOUT_MS);
    let bs = a.replay.model.block_size.max(1) as u64;
    let cap = a.fleet.shared_tokens.map(|t| (t / bs) as usize);
    Ok(Some(Shared::InProcess(SharedStore::new(cap)?)))
}

/// One instance's outcome from its replay's report.
fn instance_result(
    rep: crate::replay::report::Report,
    m: &kvbm_connector::connector::metrics::MetricsSnapshot,
    requests: usize,
) -> InstanceResult {
    let s = &rep.summary;
    InstanceResult {
        requests,
        prompt_tokens: s.prompt_tokens,
        matched_tokens: s.matched_tokens,
        from_host: s.matched_from.host,
        from_disk: s.matched_from.disk,
        from_shared: s.matched_from.remote,
        integrity_errors: s.integrity_errors,
        blocks_verified: s.blocks_verified,
        load_errors: s.load_errors,
        offload_dropped_blocks: m.offload_dropped_blocks,
        shared_lookup_timeouts: m.remote_lookup_timeouts,
        shared_lookups_skipped: m.remote_lookup_skipped,
        shared_write_errors: m.remote_store_error_blocks,
    }
}
