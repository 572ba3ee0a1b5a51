//! `kvbm`: the command-line tool of kvbm-connector (feature `cli`).
//!
//! * `kvbm replay` — replays a workload through a simulated engine driving the real leader and
//!   workers; verifies every onboarded byte; prints a table and optionally a JSON report
//!   ([`replay`]).
//! * `kvbm sweep` — replays a workload at several cache capacities and policies; a table and an
//!   SVG plot of hit rate against capacity ([`sweep`]); with `--instances`, the workload split
//!   over a fleet of instances by a router, with and without a shared tier ([`fleet`]).
//! * `kvbm bench` — measures each data path against a limit measured in the same run ([`bench`](mod@bench)).
//! * `kvbm config` — prints the effective configuration and the derived block counts
//!   ([`config_cmd`]).
//! * `kvbm worker` — one tensor-parallel rank of a multi-process replay
//!   ([`replay::multiproc`]).
//!
//! The tool lives in `tool/`, outside the library's `src/`, and is compiled only into this
//! binary: it is a client of the library like any integrator, so it can use nothing but the
//! library's public API (the compiler checks it), the library exports none of the tool's
//! internals, and the core cannot come to depend on it. `tests/cli.rs` compiles the workload
//! generator ([`replay::workload`]) from this folder too, to compare reports with it.

#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

mod bench;
mod config_cmd;
mod fleet;
mod memory;
mod replay;
mod sweep;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use kvbm_connector::error::Result;
use kvbm_connector::layout::LayoutDims;

use replay::options::ModelShape;

/// KV-cache block manager: replay workloads, benchmark data paths, inspect configuration.
#[derive(Debug, Parser)]
#[command(name = "kvbm", version, about, long_about = None)]
struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Replay a workload through a simulated engine and the real connector; verify every byte.
    Replay(replay::ReplayArgs),
    /// Replay a workload at several host (and disk) capacities and eviction policies: a table
    /// of hit rates and an SVG plot (capacity curves).
    Sweep(sweep::SweepArgs),
    /// Measure each data path against a limit measured in the same run.
    Bench(bench::BenchArgs),
    /// Print the effective configuration (file + environment) and the derived block counts.
    Config(config_cmd::ConfigArgs),
    /// One tensor-parallel rank of a multi-process replay (started by `kvbm replay --tp N`, or by
    /// hand with `--external-workers`).
    Worker(replay::multiproc::WorkerArgs),
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
    #[arg(long, allow_negative_numbers = true, default_value_t = 16)]
    pub block_size: usize,
    /// Layers of the simulated model.
    #[arg(long, allow_negative_numbers = true, default_value_t = 8)]
    pub layers: usize,
    /// KV heads of the simulated model.
    #[arg(long, allow_negative_numbers = true, default_value_t = 2)]
    pub kv_heads: usize,
    /// Head dimension of the simulated model.
    #[arg(long, allow_negative_numbers = true, default_value_t = 64)]
    pub head_dim: usize,
    /// Bytes per element (2 = bf16).
    #[arg(long, allow_negative_numbers = true, default_value_t = 2)]
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
        let d = LayoutDims {
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Warnings on stderr (KVBM_LOG filters; default `warn`).
    kvbm_connector::log::init_stderr();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvbm: error: {e}");
            ExitCode::from(2)
        }
    }
}

/// Runs a parsed command line.
fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Replay(a) => replay::run(&a),
        Command::Sweep(a) => sweep::run(&a),
        Command::Bench(a) => bench::run(&a),
        Command::Config(a) => config_cmd::run(&a),
        Command::Worker(a) => replay::multiproc::run_worker(&a),
    }
}
