//! `kvbm replay`: a workload replayed through a simulated engine over the real connector.
//!
//! * [`engines`] — what differs between the simulated engines (TensorRT-LLM, vLLM), behind one
//!   trait per process side; [`framework`] names them;
//! * [`simulator`] — the engine stand-in's scheduler process: admission, scheduling, the step
//!   loop through the connector, the report;
//! * [`rank`] — one rank's GPU process: the engine's worker calls, the model's KV writes,
//!   verification; [`channel`] reaches a rank in a child process, [`messages`] is what they say;
//! * [`multiproc`] — replays with one `kvbm worker` process per rank, and `kvbm worker` itself;
//! * [`pool`], [`request`], [`model`], [`options`], [`report`] — the engine's device blocks, its
//!   requests, the model's KV bytes, the run's options and its report;
//! * [`workload`], [`trace`], [`mooncake`] — built-in workloads, JSONL traces and Mooncake
//!   traces (read lazily).
//!
//! Dependencies point one way (no cycle): [`framework`] and [`messages`] know nothing of the tool;
//! [`engines`] knows them, [`request`] and [`report`]; [`rank`] knows [`engines`]; [`channel`]
//! knows [`rank`]; [`simulator`] knows [`engines`] and [`rank`]; [`multiproc`] and this command
//! sit on top.

pub mod channel;
pub mod engines;
pub mod framework;
pub mod messages;
pub mod model;
pub mod mooncake;
pub mod multiproc;
pub mod options;
pub mod pool;
pub mod rank;
pub mod report;
pub mod request;
pub mod simulator;
pub mod trace;
pub mod workload;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvbm_connector::config::Config;
use kvbm_connector::connector::groups::{AttentionKind, MAX_KV_CACHE_GROUPS};
use kvbm_connector::error::{Error, ErrorKind, Result};

use crate::{ModelArgs, OnOff};
use framework::Framework;
use options::SimOptions;
use report::render_table;
use trace::read_trace;
use workload::{generate_workload, WorkloadKind, WorkloadSize};

/// `kvbm replay` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplayArgs {
    /// Engine to imitate.
    #[arg(long, value_enum, default_value_t = Framework::Trtllm)]
    pub framework: Framework,
    /// Built-in workload (ignored with --trace).
    #[arg(long, value_enum, default_value_t = WorkloadKind::MultiTurn)]
    pub workload: WorkloadKind,
    /// Trace file: with `--trace-format jsonl`, {"id": "r1", "arrival": 0, "prompt": [1, 2, 3],
    /// "max_tokens": 1} per line; with `mooncake`, Mooncake's {"timestamp", "input_length",
    /// "output_length", "hash_ids"} per line.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Format of `--trace`.
    #[arg(long, value_enum, default_value_t = TraceFormat::Jsonl)]
    pub trace_format: TraceFormat,
    /// Cap on each request's output tokens (Mooncake traces: `output_length` capped here).
    #[arg(long, allow_negative_numbers = true)]
    pub max_output_tokens: Option<usize>,
    /// One request at a time, each arriving once the previous one finished (arrivals ignored),
    /// as capacity studies replay a trace.
    #[arg(long)]
    pub sequential: bool,
    /// Each step takes its simulated time (`--prefill-us-per-token`) in real time: the replay
    /// sleeps until the wall clock reaches the simulated one, as an engine whose model really
    /// computes for that long. The connector's threads and a remote store's round trips then
    /// overlap the model's time as they would on a GPU, and the wall measures what they cost
    /// the engine rather than how fast the host runs the stand-in (`serve_s` is then at least
    /// `simulated_ms`).
    #[arg(long)]
    pub pace: bool,
    /// A sliding window of this many tokens on every layer of the simulated model (vLLM's
    /// `SlidingWindowManager`, TensorRT-LLM's KV cache manager V2 with one sliding layer group:
    /// blocks before a request's window are freed while it runs and held as the null block —
    /// block 0, TensorRT-LLM's `BAD_PAGE_INDEX`; a hit's table is null before its window).
    #[arg(
        long,
        allow_negative_numbers = true,
        value_name = "TOKENS",
        conflicts_with = "layer_groups"
    )]
    pub sliding_window: Option<usize>,
    /// The simulated model's KV-cache groups, one attention kind each, in the engine's group
    /// order: `full` or `sliding:W` (W tokens), e.g. `full,sliding:64` for a model whose layers
    /// alternate (Gemma 2 style). Each group keeps its own block table over the one device
    /// pool (vLLM's hybrid KV-cache manager; TensorRT-LLM's layer groups sharing one pool) and
    /// its own KV bytes; a hit is a token count every group can serve. Default: `full`.
    #[arg(long, value_name = "KINDS")]
    pub layer_groups: Option<String>,
    /// Seed of the built-in workload.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0)]
    pub seed: u64,
    /// Requests in the built-in workload.
    #[arg(long, allow_negative_numbers = true, default_value_t = 400)]
    pub requests: usize,
    /// Engine steps between arrivals in the built-in workload.
    #[arg(long, allow_negative_numbers = true, default_value_t = 4)]
    pub arrival_gap: u64,
    /// Model shape.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Device (G1) blocks of the simulated engine.
    #[arg(long, allow_negative_numbers = true, default_value_t = 320)]
    pub device_blocks: usize,
    /// What backs the device cache: host memory laid out like the engine's (default), or real
    /// GPU memory (`cuda`, needs the `cuda` feature and a GPU; the host tier is then pinned).
    #[arg(long, value_enum, default_value_t = rank::DeviceKind::Memory)]
    pub device: rank::DeviceKind,
    /// Host (G2) blocks (overrides the configuration).
    #[arg(long, allow_negative_numbers = true)]
    pub host_blocks: Option<usize>,
    /// Disk (G3) blocks (overrides the configuration).
    #[arg(long, allow_negative_numbers = true)]
    pub disk_blocks: Option<usize>,
    /// Directory of the disk tier's file (overrides the configuration).
    #[arg(long)]
    pub disk_dir: Option<PathBuf>,
    /// Configuration file (TOML); the environment still overrides it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The remote (G4) store shared with other instances (overrides `KVBM_REMOTE_URL` and the
    /// configuration): `redis://[user:pass@]host:port[/db]`, `rediss://...`,
    /// `redis+cluster://h1:p1,h2:p2,...`.
    #[arg(long)]
    pub remote_url: Option<String>,
    /// The engine's own on-device prefix reuse.
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    pub device_prefix_cache: OnOff,
    /// Requests running at once.
    #[arg(long, allow_negative_numbers = true, default_value_t = 8)]
    pub max_batch: usize,
    /// Most tokens the requests waiting for admission hold at once (each costs 12 bytes
    /// while it waits). A request due while the waiting ones hold more stays in the trace,
    /// unread, until they drain; its TTFT still counts from its arrival. At least one request
    /// always waits, whatever its size.
    #[arg(long, allow_negative_numbers = true, default_value_t = options::MAX_WAITING_TOKENS)]
    pub max_waiting_tokens: usize,
    /// Refuse to start a run whose memory estimate (tiers' bookkeeping, host tier and device
    /// bytes, requests' tokens; see docs/deployment.md) is above this many bytes (`K`, `M`, `G`,
    /// `T`: powers of 1024). Default: the memory this machine (or its cgroup) has available.
    #[arg(long, value_parser = crate::memory::parse_bytes)]
    pub memory_limit: Option<u64>,
    /// Prompt tokens computed per step (chunked-prefill budget).
    #[arg(long, allow_negative_numbers = true, default_value_t = 256)]
    pub chunk_tokens: usize,
    /// Simulated compute cost per prompt token, microseconds (decode tokens cost a tenth).
    #[arg(long, default_value_t = 50.0)]
    pub prefill_us_per_token: f64,
    /// Tensor-parallel ranks: with more than 1, each rank is a `kvbm worker` child process and the
    /// leader talks to them over TCP on loopback (`KVBM_LEADER_ADDR`, `KVBM_AUTH_TOKEN`).
    #[arg(long, allow_negative_numbers = true, default_value_t = 1)]
    pub tp: usize,
    /// The leader's transport address with `--tp` above 1 (default: `KVBM_LEADER_ADDR`, else a
    /// free loopback port).
    #[arg(long)]
    pub leader_addr: Option<std::net::SocketAddr>,
    /// The engine channel's address with `--tp` above 1 (default: a free loopback port).
    #[arg(long)]
    pub engine_addr: Option<std::net::SocketAddr>,
    /// With `--tp` above 1: do not start the workers; wait for `kvbm worker` processes started
    /// by hand.
    #[arg(long)]
    pub external_workers: bool,
    /// Fault injection for tests: SIGKILL rank R's process at the first step from S on that has a
    /// load in flight (`R@S`).
    #[arg(long, hide = true, value_parser = parse_kill)]
    pub kill_rank: Option<(usize, u64)>,
    /// Write the JSON report here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// No table, no progress.
    #[arg(long)]
    pub quiet: bool,
}

/// Formats of `kvbm replay --trace`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TraceFormat {
    /// Our JSONL: id, arrival (engine step), prompt tokens, max_tokens per line.
    Jsonl,
    /// Mooncake's (FAST'25) trace: timestamp (ms, one engine step each), input_length,
    /// output_length, hash_ids of 512-token blocks; tokens derived from the ids; read lazily.
    Mooncake,
}

/// The requests `a` asks for, in arrival order: a trace (a Mooncake one read lazily) or a
/// built-in workload; `--max-output-tokens` applied.
pub fn workload_source(a: &ReplayArgs) -> Result<simulator::Source> {
    let cap = a.max_output_tokens;
    if cap == Some(0) {
        return Err(
            Error::invalid_argument("--max-output-tokens must be at least 1")
                .with("flag", "--max-output-tokens"),
        );
    }
    let capped = move |mut r: workload::TraceRequest| {
        if let Some(c) = cap {
            r.max_tokens = r.max_tokens.min(c);
        }
        r
    };
    let list = match (&a.trace, a.trace_format) {
        (Some(p), TraceFormat::Mooncake) => {
            let path = p.display().to_string();
            let reader = mooncake::open_mooncake(p, cap.unwrap_or(usize::MAX))?;
            return Ok(Box::new(
                reader.map(move |r| r.map_err(|e| e.with("path", &path))),
            ));
        }
        (Some(p), TraceFormat::Jsonl) => read_trace(p)?,
        (None, TraceFormat::Mooncake) => {
            return Err(
                Error::invalid_argument("--trace-format mooncake needs --trace FILE")
                    .with("flag", "--trace-format"),
            )
        }
        (None, TraceFormat::Jsonl) => {
            if a.requests == 0 || a.requests > workload::MAX_REQUESTS {
                return Err(Error::invalid_argument(format!(
                    "--requests is {}; it must be between 1 and {}",
                    a.requests,
                    workload::MAX_REQUESTS
                ))
                .with("flag", "--requests"));
            }
            if a.arrival_gap > workload::MAX_ARRIVAL_GAP {
                return Err(Error::invalid_argument(format!(
                    "--arrival-gap is {}; at most {}",
                    a.arrival_gap,
                    workload::MAX_ARRIVAL_GAP
                ))
                .with("flag", "--arrival-gap"));
            }
            generate_workload(
                a.workload,
                a.seed,
                WorkloadSize {
                    requests: a.requests,
                    arrival_gap: a.arrival_gap,
                },
            )
        }
    };
    let list: Vec<_> = list.into_iter().map(capped).collect();
    Ok(simulator::source_of(list))
}

/// The KV-cache groups `--layer-groups` (or `--sliding-window`) asks for: `[full]` by default.
/// Errors name the group and its text: more than
/// [`MAX_KV_CACHE_GROUPS`] groups, or a
/// kind other than `full` and `sliding:W`.
pub fn layer_groups(a: &ReplayArgs) -> Result<Vec<AttentionKind>> {
    if let Some(tokens) = a.sliding_window {
        return Ok(vec![AttentionKind::SlidingWindow { tokens }]);
    }
    let Some(text) = a.layer_groups.as_deref() else {
        return Ok(vec![AttentionKind::Full]);
    };
    let parts: Vec<&str> = text.split(',').collect();
    if parts.len() > MAX_KV_CACHE_GROUPS {
        return Err(Error::invalid_argument(format!(
            "--layer-groups lists {} groups; at most {MAX_KV_CACHE_GROUPS}",
            parts.len()
        ))
        .with("flag", "--layer-groups"));
    }
    parts
        .iter()
        .enumerate()
        .map(|(g, p)| {
            p.parse::<AttentionKind>()
                .map_err(|e| e.with("flag", "--layer-groups").with("group", g))
        })
        .collect()
}

/// The simulation options of `a` with this connector configuration.
pub fn sim_options(a: &ReplayArgs, config: Config) -> Result<SimOptions> {
    Ok(SimOptions {
        framework: a.framework,
        block_size: a.model.block_size,
        device_blocks: a.device_blocks,
        max_batch: a.max_batch,
        chunk_tokens: a.chunk_tokens,
        device_prefix_cache: a.device_prefix_cache == OnOff::On,
        prefill_us_per_token: a.prefill_us_per_token,
        model: a.model.shape(),
        config,
        progress: !a.quiet && std::io::stderr().is_terminal(),
        tp: a.tp,
        kill: a.kill_rank,
        device: a.device,
        sequential: a.sequential,
        pace: a.pace,
        groups: layer_groups(a)?,
        tiers: None,
        max_waiting_tokens: a.max_waiting_tokens,
    })
}

/// What one engine of `opts` holds at most ([`crate::memory`]): `distinct`, the most blocks the
/// workload can store where known (the host tier holds the bytes of no more), and
/// `waiting_tokens`, the tokens of the requests waiting at once; running requests hold about the
/// device's tokens.
pub fn engine_size(
    opts: &SimOptions,
    distinct: Option<usize>,
    waiting_tokens: u64,
) -> Result<crate::memory::EngineSize> {
    let bytes_per_block = opts.model_dims()?.bytes_per_block();
    let (host, disk) = opts.config.block_counts(bytes_per_block)?;
    Ok(crate::memory::EngineSize {
        host_blocks: host as u64,
        host_bytes_blocks: distinct.map_or(host, |d| d.min(host)) as u64,
        disk_blocks: disk as u64,
        policy: opts.config.eviction,
        device_blocks: opts.device_blocks as u64,
        bytes_per_block: bytes_per_block as u64,
        running_tokens_per_block: opts.block_size as u64,
        request_tokens: waiting_tokens,
    })
}

/// Host blocks used when neither flags nor configuration size the host tier.
pub const DEFAULT_HOST_BLOCKS: usize = 256;
/// Disk blocks used when neither flags nor configuration size the disk tier.
pub const DEFAULT_DISK_BLOCKS: usize = 4096;

/// The effective configuration of a replay: file and environment, then the flags.
pub fn replay_config(a: &ReplayArgs) -> Result<Config> {
    // Settings that constrain each other are checked once the flags are in (`validate` below):
    // `--remote-url rediss://…` may be what makes `KVBM_REMOTE_TLS_*` valid.
    let mut config = Config::load_for_overrides(a.config.as_deref())?;
    if let Some(n) = a.host_blocks {
        config.host.cache_blocks = Some(n);
    } else if config.host.cache_blocks.is_none() && config.host.cache_gb.is_none() {
        config.host.cache_blocks = Some(DEFAULT_HOST_BLOCKS);
    }
    if let Some(n) = a.disk_blocks {
        config.disk.cache_blocks = Some(n);
    } else if config.disk.cache_blocks.is_none() && config.disk.cache_gb.is_none() {
        config.disk.cache_blocks = Some(DEFAULT_DISK_BLOCKS);
    }
    if let Some(d) = &a.disk_dir {
        config.disk.dir = d.clone();
    }
    if let Some(u) = &a.remote_url {
        kvbm_connector::backends::remote::backend_for(u)
            .map_err(|e| Error::new(e.kind(), format!("--remote-url: {}", e.message())))?;
        config.remote.url = Some(u.clone());
    }
    config.validate()?;
    kvbm_connector::backends::remote::check(&config)?;
    let in_process_store = config
        .remote
        .url
        .as_deref()
        .is_some_and(|u| u.trim().to_ascii_lowercase().starts_with("memory://"));
    if in_process_store && a.tp > 1 {
        // Each rank is a process of its own: they would not share the store.
        return Err(Error::invalid_argument(
            "a memory:// store lives in one process, and --tp 2 or more runs each rank in a process of its own: use a Redis URL",
        )
        .with("flag", "--remote-url"));
    }
    Ok(config)
}

/// Runs `kvbm replay`.
pub fn run(a: &ReplayArgs) -> Result<ExitCode> {
    let config = replay_config(a)?;
    let workload = workload_source(a)?;
    let eviction = config.eviction;
    let opts = sim_options(a, config)?;
    // Tier sizes the configuration asks for, checked before anything starts (the error names
    // the setting), and what they and the requests will hold against the memory there is.
    opts.config
        .block_counts(opts.model_dims()?.bytes_per_block())?;
    engine_size(&opts, None, opts.max_waiting_tokens as u64)?
        .estimate()
        .check("kvbm replay", a.memory_limit)?;
    let report = if a.tp > 1 || a.external_workers {
        let leader_addr = match a.leader_addr {
            Some(addr) => addr,
            None => match std::env::var("KVBM_LEADER_ADDR") {
                Ok(_) => kvbm_connector::config::leader_addr_from_env()?,
                Err(_) => std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            },
        };
        let topo = multiproc::Topology {
            leader_addr,
            engine_addr: a
                .engine_addr
                .unwrap_or_else(|| std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
            external_workers: a.external_workers,
        };
        multiproc::replay(opts, workload, &topo)?
    } else {
        simulator::replay(opts, workload)?
    };
    if let Some(path) = &a.report {
        write_report(path, &report)?;
    }
    if !a.quiet {
        print!("{}", render_table(&report));
        println!("  eviction (host, disk) {eviction:>10}");
    }
    if report.summary.integrity_errors > 0 {
        eprintln!(
            "kvbm: {} onboarded block(s) differed from the model's KV",
            report.summary.integrity_errors
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes the JSON report to `path`, encoded straight into the file (a million requests' report
/// is hundreds of MB: it is never held as one string as well).
fn write_report(path: &std::path::Path, report: &report::Report) -> Result<()> {
    use std::io::Write as _;
    let cannot = |e: &dyn std::fmt::Display| {
        Error::new(
            ErrorKind::Io,
            format!("cannot write the report to {}: {e}", path.display()),
        )
    };
    let file = std::fs::File::create(path).map_err(|e| cannot(&e))?;
    let mut w = std::io::BufWriter::new(file);
    serde_json::to_writer_pretty(&mut w, report).map_err(|e| cannot(&e))?;
    w.write_all(b"\n").map_err(|e| cannot(&e))?;
    w.flush().map_err(|e| cannot(&e))
}

fn parse_kill(s: &str) -> std::result::Result<(usize, u64), String> {
    let (r, st) = s
        .split_once('@')
        .ok_or_else(|| format!("expected RANK@STEP, got {s:?}"))?;
    Ok((
        r.parse().map_err(|e| format!("rank {r:?}: {e}"))?,
        st.parse().map_err(|e| format!("step {st:?}: {e}"))?,
    ))
}

/// Polls `ready` until it answers true, fails, or `timeout` passes (a `Timeout` naming `what`).
pub fn wait_for(
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
