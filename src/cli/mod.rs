//! The `kvbm` command-line tool (feature `cli`).
//!
//! * `kvbm replay` — replays a workload through a simulated engine driving the real leader and
//!   workers; verifies every onboarded byte; prints a table and optionally a JSON report.
//! * `kvbm bench` — measures each data path against a limit measured in the same run.
//! * `kvbm config` — prints the effective configuration and the derived block counts.

pub mod bench;
pub mod multiproc;
pub mod rank;
pub mod sim;
pub mod workload;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::{Config, ENV_VARS};
use crate::error::{Error, ErrorKind, Result};
use sim::{Framework, ModelShape, Report, SimOptions};
use workload::{generate_workload, read_trace, WorkloadKind, WorkloadSize};

/// KV-cache block manager: replay workloads, benchmark data paths, inspect configuration.
#[derive(Debug, Parser)]
#[command(name = "kvbm", version, about, long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Replay a workload through a simulated engine and the real connector; verify every byte.
    Replay(ReplayArgs),
    /// Measure each data path against a limit measured in the same run.
    Bench(bench::BenchArgs),
    /// Print the effective configuration (file + environment) and the derived block counts.
    Config(ConfigArgs),
    /// One tensor-parallel rank of a multi-process replay (started by `kvbm replay --tp N`, or by
    /// hand with `--external-workers`).
    Worker(multiproc::WorkerArgs),
}

/// `on` / `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnOff {
    /// Enabled.
    On,
    /// Disabled.
    Off,
}

/// Model shape flags shared by replay and config.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Layers of the simulated model.
    #[arg(long, default_value_t = 8)]
    pub layers: usize,
    /// KV heads of the simulated model.
    #[arg(long, default_value_t = 2)]
    pub kv_heads: usize,
    /// Head dimension of the simulated model.
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    /// Bytes per element (2 = bf16).
    #[arg(long, default_value_t = 2)]
    pub dtype_bytes: usize,
}

impl ModelArgs {
    fn shape(&self) -> ModelShape {
        ModelShape {
            layers: self.layers,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            dtype_bytes: self.dtype_bytes,
        }
    }

    fn bytes_per_block(&self) -> Result<usize> {
        let d = crate::layout::LayoutDims {
            num_layers: self.layers,
            outer_dim: 2,
            page_size: self.block_size,
            inner_dim: self.kv_heads.saturating_mul(self.head_dim),
            dtype_bytes: self.dtype_bytes,
        };
        d.validate()?;
        Ok(d.bytes_per_block())
    }
}

/// `kvbm replay` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplayArgs {
    /// Engine to imitate.
    #[arg(long, value_enum, default_value_t = Framework::Trtllm)]
    pub framework: Framework,
    /// Built-in workload (ignored with --trace).
    #[arg(long, value_enum, default_value_t = WorkloadKind::MultiTurn)]
    pub workload: WorkloadKind,
    /// JSONL trace: {"id": "r1", "arrival": 0, "prompt": [1, 2, 3], "max_tokens": 1} per line.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Seed of the built-in workload.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Requests in the built-in workload.
    #[arg(long, default_value_t = 400)]
    pub requests: usize,
    /// Engine steps between arrivals in the built-in workload.
    #[arg(long, default_value_t = 4)]
    pub arrival_gap: u64,
    /// Model shape.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Device (G1) blocks of the simulated engine.
    #[arg(long, default_value_t = 320)]
    pub device_blocks: usize,
    /// What backs the device cache: host memory laid out like the engine's (default), or real
    /// GPU memory (`cuda`, needs the `cuda` feature and a GPU; the host tier is then pinned).
    #[arg(long, value_enum, default_value_t = rank::DeviceKind::Memory)]
    pub device: rank::DeviceKind,
    /// Host (G2) blocks (overrides the configuration).
    #[arg(long)]
    pub host_blocks: Option<usize>,
    /// Disk (G3) blocks (overrides the configuration).
    #[arg(long)]
    pub disk_blocks: Option<usize>,
    /// Directory of the disk tier's file (overrides the configuration).
    #[arg(long)]
    pub disk_dir: Option<PathBuf>,
    /// Configuration file (TOML); the environment still overrides it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The engine's own on-device prefix reuse.
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    pub device_prefix_cache: OnOff,
    /// Requests running at once.
    #[arg(long, default_value_t = 8)]
    pub max_batch: usize,
    /// Prompt tokens computed per step (chunked-prefill budget).
    #[arg(long, default_value_t = 256)]
    pub chunk_tokens: usize,
    /// Simulated compute cost per prompt token, microseconds (decode tokens cost a tenth).
    #[arg(long, default_value_t = 50.0)]
    pub prefill_us_per_token: f64,
    /// Tensor-parallel ranks: with more than 1, each rank is a `kvbm worker` child process and the
    /// leader talks to them over TCP on loopback (`KVBM_LEADER_ADDR`, `KVBM_AUTH_TOKEN`).
    #[arg(long, default_value_t = 1)]
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

/// Host blocks used when neither flags nor configuration size the host tier.
pub const DEFAULT_HOST_BLOCKS: usize = 256;
/// Disk blocks used when neither flags nor configuration size the disk tier.
pub const DEFAULT_DISK_BLOCKS: usize = 4096;

/// `kvbm config` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ConfigArgs {
    /// Configuration file (TOML); the environment still overrides it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Bytes of one block (all ranks) to derive block counts for; default: the model flags.
    #[arg(long)]
    pub bytes_per_block: Option<usize>,
    /// Model shape (used when --bytes-per-block is not given).
    #[command(flatten)]
    pub model: ModelArgs,
}

/// Entry point of the `kvbm` binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvbm: error: {e}");
            ExitCode::from(2)
        }
    }
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Replay(a) => replay(&a),
        Command::Bench(a) => bench::run(&a),
        Command::Config(a) => config_cmd(&a),
        Command::Worker(a) => multiproc::run_worker(&a),
    }
}

/// The effective configuration of a replay: file and environment, then the flags.
pub fn replay_config(a: &ReplayArgs) -> Result<Config> {
    let mut config = Config::load(a.config.as_deref())?;
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
    config.validate()?;
    Ok(config)
}

fn replay(a: &ReplayArgs) -> Result<ExitCode> {
    let config = replay_config(a)?;
    let workload = match &a.trace {
        Some(p) => read_trace(p)?,
        None => {
            if a.requests == 0 {
                return Err(Error::invalid_argument("--requests must be at least 1"));
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
    let opts = SimOptions {
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
    };
    let report = if a.tp > 1 || a.external_workers {
        let leader_addr = match a.leader_addr {
            Some(addr) => addr,
            None => match std::env::var("KVBM_LEADER_ADDR") {
                Ok(_) => crate::config::leader_addr_from_env()?,
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
        multiproc::replay(opts, &workload, &topo)?
    } else {
        sim::replay(opts, &workload)?
    };
    if let Some(path) = &a.report {
        let json = serde_json::to_string_pretty(&report)
            .map_err(|e| Error::internal(format!("cannot encode the report: {e}")))?;
        std::fs::write(path, json + "\n").map_err(|e| {
            Error::new(
                ErrorKind::Io,
                format!("cannot write the report to {}: {e}", path.display()),
            )
        })?;
    }
    if !a.quiet {
        print!("{}", render_table(&report));
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

fn parse_kill(s: &str) -> std::result::Result<(usize, u64), String> {
    let (r, st) = s
        .split_once('@')
        .ok_or_else(|| format!("expected RANK@STEP, got {s:?}"))?;
    Ok((
        r.parse().map_err(|e| format!("rank {r:?}: {e}"))?,
        st.parse().map_err(|e| format!("step {st:?}: {e}"))?,
    ))
}

/// The short human table printed by `kvbm replay`.
pub fn render_table(r: &Report) -> String {
    use std::fmt::Write;
    let s = &r.summary;
    let mut out = String::new();
    let pct = |a: usize, b: usize| {
        if b == 0 {
            0.0
        } else {
            100.0 * a as f64 / b as f64
        }
    };
    let _ = writeln!(
        out,
        "kvbm replay — {} engine, {} requests, {} steps",
        s.framework, s.requests, s.steps
    );
    let _ = writeln!(out, "  prompt tokens        {:>10}", s.prompt_tokens);
    let _ = writeln!(
        out,
        "  matched by kvbm       {:>10}  ({:.1}% of prompt tokens)",
        s.matched_tokens,
        100.0 * s.hit_rate
    );
    let _ = writeln!(
        out,
        "    from host           {:>10}  ({:.1}%)",
        s.matched_from.host,
        pct(s.matched_from.host, s.prompt_tokens)
    );
    let _ = writeln!(
        out,
        "    from disk           {:>10}  ({:.1}%)",
        s.matched_from.disk,
        pct(s.matched_from.disk, s.prompt_tokens)
    );
    let _ = writeln!(out, "  device cache hits     {:>10}", s.device_hit_tokens);
    let _ = writeln!(out, "  tokens computed       {:>10}", s.computed_tokens);
    for p in s.offloaded.iter().chain(s.onboarded.iter()) {
        let _ = writeln!(
            out,
            "  {:<20} {:>10} blocks  {:>8.1} MB  {:>6.2} GB/s",
            p.path,
            p.blocks,
            p.bytes as f64 / 1e6,
            p.gb_per_s
        );
    }
    for l in &s.leader_latency {
        let _ = writeln!(
            out,
            "  {:<28} p50 {:>7.1} µs  p99 {:>7.1} µs  ({} calls)",
            l.method, l.p50_us, l.p99_us, l.calls
        );
    }
    let _ = writeln!(
        out,
        "  integrity errors      {:>10}  ({} onboarded blocks verified)",
        s.integrity_errors, s.blocks_verified
    );
    let _ = writeln!(out, "  load errors           {:>10}", s.load_errors);
    let _ = writeln!(out, "  preemptions           {:>10}", s.preemptions);
    let _ = writeln!(out, "  mean TTFT (simulated) {:>10.2} ms", s.mean_ttft_ms);
    let _ = writeln!(out, "  wall time             {:>10.2} s", s.wall_s);
    out
}

fn config_cmd(a: &ConfigArgs) -> Result<ExitCode> {
    let config = Config::load(a.config.as_deref())?;
    let bpb = match a.bytes_per_block {
        Some(0) => {
            return Err(Error::invalid_argument(
                "--bytes-per-block must be at least 1",
            ))
        }
        Some(n) => n,
        None => a.model.bytes_per_block()?,
    };
    let (host, disk) = config.block_counts(bpb)?;
    println!("# effective configuration (defaults < file < DYN_KVBM_* < KVBM_*)");
    print!("{}", config.to_toml()?);
    println!();
    println!("# environment variables in effect");
    let mut any = false;
    for v in ENV_VARS {
        if let Ok(val) = std::env::var(v.name) {
            any = true;
            let alias = if v.dynamo_alias { " (Dynamo name)" } else { "" };
            println!("#   {}={} -> {}{alias}", v.name, v.shown(&val), v.key);
        }
    }
    if !any {
        println!("#   (none)");
    }
    println!();
    println!("# derived for {bpb} bytes per block");
    println!("host_blocks = {host}");
    println!("disk_blocks = {disk}");
    Ok(ExitCode::SUCCESS)
}
