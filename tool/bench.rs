//! `kvbm bench`: each data path the tiers offer, against the limit measured on the same bytes in
//! the same run.
//!
//! * memory → memory (contiguous, and layer-separate gather) vs `memcpy` of the same bytes between
//!   the same buffers (one call per source allocation), one thread on each side, every page
//!   touched before timing and both buffers evicted from the caches before every timed call
//!   (`--curve`: at 1, 2, 4, … blocks up to `--blocks`, memory paths only). Each row names the
//!   store method its transfer used (`[plain]` or `[stream]`); under `--copy-method auto` (the
//!   configured default) the calibration's own figures are printed first;
//! * memory → disk and disk → memory through the transfer engine vs raw O_DIRECT `pwrite`/`pread`
//!   of the same bytes between the same memory and the same file offsets, with the same number of
//!   requests in flight (on a virtual disk, other buffers or files were seen to differ by 2×, so
//!   only the same memory and file make a fair limit);
//! * the leader's hot path: matches of an 8-block request per second (vs the reference's figure
//!   for Dynamo's leader, quoted, not measured), and the cost of the default key hash (SHA-256)
//!   on that path: the same path with the xxh3 opt-in, measured in the same run.
//!
//! With the `nixl` feature (and NIXL loadable, see `docs/nixl.md`), also:
//!
//! * memory → disk and disk → memory through NIXL's POSIX plugin (`NixlDiskTier`, host memory
//!   registered) vs raw O_DIRECT on the same file, memory and bytes, and vs the built-in disk
//!   tier on the same memory and bytes, all three interleaved.
//!
//! With `--redis URL` (a Redis / Valkey server or cluster, `remote.url`'s forms), also:
//!
//! * host → Redis: `RedisStore::put` of the blocks (header, checksum, `SET NX`, one pipeline) vs a
//!   raw pipelined `SET` of the same bytes from the same client, on fresh keys each round;
//! * Redis → host: `RedisStore::get` (bounded `GETRANGE`, verification, copy into the host
//!   buffers) vs a raw pipelined `GET` of the same bytes into the same buffers.
//!
//! The keys of both are deleted after each round (outside the timing); nothing else on the
//! server is touched.
//!
//! Rounds alternate limit and ours; medians are reported. The ratio is the figure to quote.

use std::io::IsTerminal;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_connector::backends::disk::{DiskTier, DiskTierOptions};
use kvbm_connector::backends::memory::MemoryTier;
use kvbm_connector::backends::StandardTiers;
use kvbm_connector::config::{Config, TransferConfig};
use kvbm_connector::connector::adapter::ScheduledTokens;
use kvbm_connector::connector::leader::{Leader, RequestInfo};
use kvbm_connector::connector::transport::in_process;
use kvbm_connector::connector::worker::Worker;
use kvbm_connector::connector::RequestId;
use kvbm_connector::error::{Error, ErrorKind, Result};
use kvbm_connector::frameworks::vllm::Vllm;
use kvbm_connector::identity::HashAlgorithm;
use kvbm_connector::layout::{BlockOrder, KvLayout, Layout, LayoutDims};
use kvbm_connector::tier::{StorageTier, TierKind};
use kvbm_connector::transfer::{self, CopyPolicy, TransferEngine};

#[cfg(feature = "cuda")]
mod cuda_bench;
mod disk;
mod leader;
#[cfg(feature = "nixl")]
mod nixl_bench;
mod redis;

use disk::*;
use leader::*;
use redis::*;

/// `kvbm bench` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Blocks per transfer (each 2 MiB: 32 layers × K/V × 16 tokens × 8 heads × 128 × bf16);
    /// with --curve, the largest size.
    #[arg(long, allow_negative_numbers = true, default_value_t = 32)]
    pub blocks: usize,
    /// Rounds per path (median reported).
    #[arg(long, allow_negative_numbers = true, default_value_t = 5)]
    pub rounds: usize,
    /// Directory for the disk paths (default: the configured disk directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Requests in flight for the disk paths.
    #[arg(long, allow_negative_numbers = true, default_value_t = 4)]
    pub in_flight: usize,
    /// Measure only the memory paths, at 1, 2, 4, … blocks up to --blocks (peak memory: twice
    /// the largest transfer, 4 GiB at 1024 blocks).
    #[arg(long)]
    pub curve: bool,
    /// How the memory paths' transfers of at least 4 MiB store their bytes: auto (the method
    /// this machine's calibration chose), plain, stream or stream-pages. Default:
    /// `transfer.copy_method`.
    #[arg(long, value_name = "METHOD")]
    pub copy_method: Option<CopyPolicy>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also measure host <-> Redis against raw pipelined SET/GET, on this server (URL forms of
    /// `remote.url`: redis://, rediss://, redis+cluster://).
    #[arg(long, value_name = "URL")]
    pub redis: Option<String>,
    /// Blocks per batch for the Redis paths (each 2 MiB, one rank's share).
    #[arg(long, allow_negative_numbers = true, default_value_t = 16)]
    pub redis_blocks: usize,
    /// Only these groups of paths, comma-separated: memory, disk, nixl, cuda, leader, redis.
    #[arg(long, value_name = "GROUPS")]
    pub only: Option<String>,
    /// Also measure the CUDA paths: GPU device tier <-> pinned host tier, against a plain
    /// cudaMemcpy of the same bytes (feature `cuda`; fails without a usable GPU).
    #[cfg(feature = "cuda")]
    #[arg(long)]
    pub cuda: bool,
    /// Blocks per transfer for the CUDA paths.
    #[cfg(feature = "cuda")]
    #[arg(long, allow_negative_numbers = true, default_value_t = 256)]
    pub cuda_blocks: usize,
    /// GPU ordinal for the CUDA paths.
    #[cfg(feature = "cuda")]
    #[arg(long, allow_negative_numbers = true, default_value_t = 0)]
    pub cuda_device: usize,
}

/// One measured path.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PathResult {
    /// What was measured.
    pub path: String,
    /// Our figure (GB/s or calls/s, see `unit`).
    pub ours: f64,
    /// The limit measured in the same run (or quoted, see `limit_source`).
    pub limit: f64,
    /// `ours / limit`.
    pub ratio: f64,
    /// Unit of `ours` and `limit`.
    pub unit: String,
    /// What the limit is.
    pub limit_source: String,
}

fn dims() -> LayoutDims {
    LayoutDims {
        num_layers: 32,
        outer_dim: 2,
        page_size: 16,
        inner_dim: 8 * 128,
        dtype_bytes: 2,
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Times `limit` and `ours` alternately, `rounds` times each after one warm-up.
fn interleaved(
    rounds: usize,
    mut limit: impl FnMut() -> Result<()>,
    mut ours: impl FnMut() -> Result<()>,
) -> Result<(Duration, Duration)> {
    limit()?;
    ours()?;
    let (mut l, mut o) = (Vec::new(), Vec::new());
    for _ in 0..rounds.max(1) {
        let t = Instant::now();
        limit()?;
        l.push(t.elapsed());
        let t = Instant::now();
        ours()?;
        o.push(t.elapsed());
    }
    Ok((median(l), median(o)))
}

fn bandwidth(
    path: &str,
    bytes: usize,
    limit: Duration,
    ours: Duration,
    source: &str,
) -> PathResult {
    let gbps = |d: Duration| bytes as f64 / d.as_secs_f64().max(1e-12) / 1e9;
    PathResult {
        path: path.to_string(),
        ours: gbps(ours),
        limit: gbps(limit),
        ratio: limit.as_secs_f64() / ours.as_secs_f64().max(1e-12),
        unit: "GB/s".into(),
        limit_source: source.into(),
    }
}

fn fill(tier: &dyn StorageTier) -> Result<()> {
    for b in 0..tier.num_blocks() {
        tier.with_block_mut(b, &mut |segs| {
            for (k, s) in segs.iter_mut().enumerate() {
                for (i, x) in s.iter_mut().enumerate() {
                    *x = (i.wrapping_mul(31) ^ k ^ b.wrapping_mul(131)) as u8;
                }
            }
            Ok(())
        })?;
    }
    Ok(())
}

fn check_outcome(o: kvbm_connector::transfer::TransferOutcome) -> Result<()> {
    match o.failed.first() {
        None => Ok(()),
        Some(f) => Err(f.error.clone()),
    }
}

/// The allocations of a memory tier as (address, length): block 0's runs, each less its offset
/// (every allocation holds a run of block 0 in the built-in layouts).
fn allocations(tier: &dyn StorageTier) -> Result<Vec<(usize, usize)>> {
    let layout = tier.layout();
    let mut bases = vec![0usize; layout.num_allocations()];
    let regions: Vec<_> = layout.regions(0)?.collect();
    tier.with_block(0, &mut |segs| {
        for (r, s) in regions.iter().zip(segs) {
            if let Some(b) = bases.get_mut(r.allocation) {
                *b = (s.as_ptr() as usize).wrapping_sub(r.offset);
            }
        }
        Ok(())
    })?;
    if bases.contains(&0) {
        return Err(Error::internal("an allocation holds no run of block 0"));
    }
    let len = layout.allocation_bytes();
    Ok(bases.into_iter().map(|b| (b, len)).collect())
}

/// Evicts `len` bytes at `addr` from every cache level (written back first), so the next copy
/// starts from memory. On other architectures than x86-64 this does nothing.
fn evict(addr: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let mut p = addr & !63;
        while p < addr + len {
            // SAFETY: `clflush` of an address inside a live allocation (the caller's) has no
            // effect on its contents; SSE2 is part of x86-64.
            unsafe { std::arch::x86_64::_mm_clflush(p as *const u8) };
            p += 64;
        }
        // SAFETY: as above.
        unsafe { std::arch::x86_64::_mm_mfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (addr, len);
}

/// Like [`interleaved`], with `cold` run (untimed) before every timed call of either side.
fn interleaved_cold(
    rounds: usize,
    mut cold: impl FnMut(),
    mut limit: impl FnMut() -> Result<()>,
    mut ours: impl FnMut() -> Result<()>,
) -> Result<(Duration, Duration)> {
    limit()?;
    ours()?;
    let (mut l, mut o) = (Vec::new(), Vec::new());
    for _ in 0..rounds.max(1) {
        cold();
        let t = Instant::now();
        limit()?;
        l.push(t.elapsed());
        cold();
        let t = Instant::now();
        ours()?;
        o.push(t.elapsed());
    }
    Ok((median(l), median(o)))
}

/// Peak memory of the memory paths at `blocks`: the source tier and the destination tier.
pub fn memory_paths_peak_bytes(blocks: usize) -> usize {
    2 * blocks * dims().bytes_per_block()
}

/// Memory → memory at `blocks` blocks: a contiguous source, then a layer-separate one (gather),
/// each into the same contiguous host tier, against `memcpy` of the same bytes between the same
/// allocations (one call per source allocation). One thread on both sides; every page touched
/// before timing; both buffers evicted from the caches before every timed call of either side;
/// rounds interleaved. One source exists at a time: peak [`memory_paths_peak_bytes`].
fn memory_paths(
    blocks: usize,
    rounds: usize,
    label: bool,
    policy: CopyPolicy,
) -> Result<Vec<PathResult>> {
    let d = dims();
    let bytes = blocks * d.bytes_per_block();
    let method = transfer::method_for(bytes, policy);
    let host = MemoryTier::host(Layout::fully_contiguous(d, blocks)?)?;
    fill(&host)?;
    let dst = *allocations(&host)?
        .first()
        .ok_or_else(|| Error::internal("host tier without allocation"))?;
    let pairs: Vec<(usize, usize)> = (0..blocks).map(|i| (i, i)).collect();
    let mut out = Vec::new();
    for (name, layout) in [
        (
            "memory->memory (contiguous)",
            Layout::fully_contiguous(d, blocks)?,
        ),
        (
            "memory->memory (layer-separate gather)",
            Layout::layer_separate(d, blocks, BlockOrder::OuterMajor)?,
        ),
    ] {
        let src = MemoryTier::new(TierKind::Device, layout)?;
        fill(&src)?;
        let from = allocations(&src)?;
        let calls = from.len();
        let limit = || {
            let mut at = dst.0;
            for &(p, len) in &from {
                // SAFETY: `len` bytes at `p` (an allocation of `src`) and `calls * len = bytes`
                // bytes from `dst.0` (the host tier's one allocation) are live for the whole
                // bench and touched by nothing else while the limit runs; they do not overlap.
                unsafe { std::ptr::copy_nonoverlapping(p as *const u8, at as *mut u8, len) };
                at += len;
            }
            Ok(())
        };
        let cold = || {
            for &(p, len) in &from {
                evict(p, len);
            }
            evict(dst.0, dst.1);
        };
        // Small transfers take microseconds: more rounds there (about 64 blocks' worth).
        let r = rounds * (64 / blocks).clamp(1, 16);
        let (l, o) = interleaved_cold(r, cold, limit, || {
            check_outcome(TransferEngine::copy_blocking_with(
                &src, &host, &pairs, policy,
            )?)
        })?;
        let path = if label {
            format!("{name}, {blocks} blocks [{method}]")
        } else {
            format!("{name} [{method}]")
        };
        out.push(bandwidth(
            &path,
            bytes,
            l,
            o,
            &format!("memcpy, same buffers, {calls} call(s), 1 thread, caches evicted"),
        ));
    }
    Ok(out)
}

/// The memory paths at 1, 2, 4, … blocks up to `max` (and `max` itself); `each` sees every
/// size's rows as soon as they are measured.
fn memory_curve(
    max: usize,
    rounds: usize,
    policy: CopyPolicy,
    mut each: impl FnMut(&[PathResult]),
) -> Result<Vec<PathResult>> {
    let mut sizes: Vec<usize> = std::iter::successors(Some(1usize), |n| n.checked_mul(2))
        .take_while(|&n| n <= max)
        .collect();
    if sizes.last() != Some(&max) {
        sizes.push(max);
    }
    let mut out = Vec::new();
    for n in sizes {
        let rows = memory_paths(n, rounds, true, policy)?;
        each(&rows);
        out.extend(rows);
    }
    Ok(out)
}

fn raw_direct(
    fd: i32,
    ptrs: &[usize],
    bpb: usize,
    slot: usize,
    in_flight: usize,
    write: bool,
) -> Result<()> {
    let n = ptrs.len();
    let failed = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        for t in 0..in_flight {
            let failed = &failed;
            s.spawn(move || {
                for k in (t..n).step_by(in_flight) {
                    let p = ptrs[k] as *mut libc::c_void;
                    let off = (k * slot) as libc::off_t;
                    // SAFETY: each block's memory (owned by a live memory tier that nothing else
                    // touches while the limit runs) is used by exactly one thread; the length is
                    // the block's.
                    let r = unsafe {
                        if write {
                            libc::pwrite(fd, p, bpb, off)
                        } else {
                            libc::pread(fd, p, bpb, off)
                        }
                    };
                    if r != bpb as isize {
                        failed.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            });
        }
    });
    if failed.load(std::sync::atomic::Ordering::Relaxed) {
        return Err(Error::new(
            ErrorKind::Io,
            "raw O_DIRECT I/O failed or was short",
        ));
    }
    Ok(())
}

/// Most rounds per path `kvbm bench` runs.
pub const MAX_ROUNDS: usize = 1000;

/// The groups of paths `--only` may name.
const GROUPS: [&str; 7] = [
    "memory", "disk", "nixl", "cuda", "leader", "metrics", "redis",
];

pub fn run(a: &BenchArgs) -> Result<ExitCode> {
    check_counts(a)?;
    let config = Config::load(None)?;
    let dir = a.dir.clone().unwrap_or(config.disk.dir);
    let progress = !a.json && std::io::stderr().is_terminal();
    check_only(a)?;
    let policy = a.copy_method.unwrap_or(config.transfer.copy_method);
    let calibration_json = calibrate_copies(a, policy);
    if a.curve {
        return run_curve(a, policy, calibration_json);
    }
    let measured = measure_paths(a, dir, policy, progress)?;
    if a.json {
        #[cfg_attr(not(feature = "nixl"), expect(unused_mut))]
        let mut v = serde_json::json!({
            "paths": measured.results,
            "disk_note": measured.note,
            "copy_policy": policy,
            "copy_calibration": calibration_json,
        });
        #[cfg(feature = "nixl")]
        if let Some(obj) = v.as_object_mut() {
            obj.insert("nixl_note".into(), serde_json::json!(measured.nixl_note));
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| Error::internal(e.to_string()))?
        );
    } else {
        print_table(&measured.results);
        if let Some(n) = measured.note {
            println!("note: the disk tier runs without O_DIRECT here: {n}");
        }
        #[cfg(feature = "nixl")]
        if let Some(n) = measured.nixl_note {
            println!("note: {n}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Refuses zero blocks, rounds or requests in flight, and more than [`MAX_ROUNDS`] rounds.
fn check_counts(a: &BenchArgs) -> Result<()> {
    if a.blocks == 0 || a.rounds == 0 || a.in_flight == 0 {
        return Err(Error::invalid_argument(
            "--blocks, --rounds and --in-flight must be at least 1",
        ));
    }
    if a.rounds > MAX_ROUNDS {
        // Each round of each path takes up to seconds: a typo must not run for days.
        return Err(Error::invalid_argument(format!(
            "--rounds {}: at most {MAX_ROUNDS}",
            a.rounds
        ))
        .with("flag", "--rounds"));
    }
    Ok(())
}

/// Refuses an `--only` that names a group not in [`GROUPS`].
fn check_only(a: &BenchArgs) -> Result<()> {
    if let Some(only) = &a.only {
        if let Some(bad) = only.split(',').find(|g| !GROUPS.contains(&g.trim())) {
            return Err(Error::invalid_argument(format!(
                "--only: unknown group `{bad}` (groups: {})",
                GROUPS.join(", ")
            )));
        }
    }
    Ok(())
}

/// Whether group `g` runs: every group without `--only`, else those it names.
fn wanted(a: &BenchArgs, g: &str) -> bool {
    a.only
        .as_ref()
        .is_none_or(|o| o.split(',').any(|x| x.trim() == g))
}

/// Under `auto`, runs the copy calibration before anything is timed (a transfer engine would
/// start it in the background; here the figures should not depend on when it ends), prints its
/// figures unless `--json`, and returns them for the JSON report (`None` when it did not run).
fn calibrate_copies(a: &BenchArgs, policy: CopyPolicy) -> Option<serde_json::Value> {
    let calibration =
        (policy == CopyPolicy::Auto && (a.curve || wanted(a, "memory"))).then(transfer::calibrate);
    if let (Some(c), false) = (calibration, a.json) {
        println!(
            "copy calibration: ordinary stores {:.2} GB/s, streaming stores {:.2} GB/s, streaming to four pages in turn {:.2} GB/s ({} MiB, caches flushed, fastest of 7, {:.0} ms in all) -> {} for transfers of at least {} MiB",
            c.plain_bytes_per_sec / 1e9,
            c.stream_bytes_per_sec / 1e9,
            c.stream_pages_bytes_per_sec / 1e9,
            c.bytes >> 20,
            c.elapsed.as_secs_f64() * 1e3,
            c.method,
            transfer::STREAM_MIN_BYTES >> 20,
        );
    }
    calibration.map(|c| {
        serde_json::json!({
            "method": c.method,
            "plain_bytes_per_sec": c.plain_bytes_per_sec,
            "stream_bytes_per_sec": c.stream_bytes_per_sec,
            "stream_pages_bytes_per_sec": c.stream_pages_bytes_per_sec,
            "bytes": c.bytes,
            "elapsed_secs": c.elapsed.as_secs_f64(),
        })
    })
}

/// `--curve`: the memory paths at 1, 2, 4, … blocks up to `--blocks`, each size's rows printed
/// as it ends (or one JSON report at the end).
fn run_curve(
    a: &BenchArgs,
    policy: CopyPolicy,
    calibration_json: Option<serde_json::Value>,
) -> Result<ExitCode> {
    let peak = memory_paths_peak_bytes(a.blocks);
    if !a.json {
        println!(
            "memory paths at 1..={} blocks of {} MiB; peak memory {:.1} GiB (source + destination)",
            a.blocks,
            dims().bytes_per_block() >> 20,
            peak as f64 / f64::from(1u32 << 30)
        );
    }
    if !a.json {
        print_header();
    }
    let results = memory_curve(a.blocks, a.rounds, policy, |rows| {
        if !a.json {
            rows.iter().for_each(print_row);
        }
    })?;
    if a.json {
        let v = serde_json::json!({
            "paths": results,
            "peak_bytes": peak,
            "copy_policy": policy,
            "copy_calibration": calibration_json,
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| Error::internal(e.to_string()))?
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// What [`measure_paths`] measured: the rows, and why the disk tier ran without O_DIRECT or the
/// NIXL paths were skipped (when they were).
struct Measured {
    results: Vec<PathResult>,
    note: Option<String>,
    #[cfg(feature = "nixl")]
    nixl_note: Option<String>,
}

/// Measures each wanted group in turn (memory, disk, NIXL, CUDA, the leader, metrics, Redis),
/// saying which on stderr when `progress`. A NIXL that is not installed skips its paths with a
/// note; every other error ends the run.
fn measure_paths(
    a: &BenchArgs,
    dir: PathBuf,
    policy: CopyPolicy,
    progress: bool,
) -> Result<Measured> {
    let want = |g: &str| wanted(a, g);
    let mut results = Vec::new();
    if want("memory") {
        if progress {
            eprintln!("bench: memory paths…");
        }
        results.extend(memory_paths(a.blocks, a.rounds, false, policy)?);
    }
    let mut note = None;
    if want("disk") {
        if progress {
            eprintln!("bench: disk paths in {}…", dir.display());
        }
        let (disk, n) = disk_paths(a.blocks, a.rounds, dir.clone(), a.in_flight)?;
        results.extend(disk);
        note = n;
    }
    #[cfg(feature = "nixl")]
    let nixl_note = if !want("nixl") {
        None
    } else {
        if progress {
            eprintln!("bench: NIXL paths (POSIX disk)…");
        }
        match nixl_bench::paths(a.blocks, a.rounds, dir, a.in_flight) {
            Ok(r) => {
                results.extend(r);
                None
            }
            // NIXL not installed: the other paths still stand; say why these are missing.
            Err(e) if e.kind() == ErrorKind::Unsupported => {
                Some(format!("NIXL paths skipped: {e}"))
            }
            Err(e) => return Err(e),
        }
    };
    #[cfg(feature = "cuda")]
    if a.cuda && want("cuda") {
        if progress {
            eprintln!("bench: CUDA paths (device <-> pinned host)…");
        }
        results.extend(cuda_bench::paths(a.cuda_blocks, a.rounds, a.cuda_device)?);
    }
    if want("leader") {
        if progress {
            eprintln!("bench: leader hot path…");
        }
        results.extend(leader_paths(a.rounds)?);
    }
    if want("metrics") {
        if progress {
            eprintln!("bench: metrics endpoint under slow clients…");
        }
        results.push(metrics_scrape(a.rounds)?);
    }
    if let Some(url) = a.redis.as_deref().filter(|_| want("redis")) {
        if progress {
            eprintln!("bench: Redis paths (host <-> Redis)…");
        }
        results.extend(redis_paths(url, a.redis_blocks, a.rounds)?);
    }
    Ok(Measured {
        results,
        note,
        #[cfg(feature = "nixl")]
        nixl_note,
    })
}

fn print_header() {
    println!(
        "{:<60} {:>12} {:>12} {:>8}  limit",
        "path", "ours", "limit", "ratio"
    );
}

fn print_row(r: &PathResult) {
    println!(
        "{:<60} {:>12.2} {:>12.2} {:>8.3}  {} ({})",
        r.path, r.ours, r.limit, r.ratio, r.unit, r.limit_source
    );
}

fn print_table(results: &[PathResult]) {
    print_header();
    results.iter().for_each(print_row);
}
