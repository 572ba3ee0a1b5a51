//! `kvbm bench`: each data path the tiers offer, against the limit measured on the same bytes in
//! the same run.
//!
//! * memory → memory (contiguous, and layer-separate gather) vs one plain memcpy of the same bytes;
//! * memory → disk and disk → memory through the transfer engine vs raw O_DIRECT `pwrite`/`pread`
//!   of the same bytes between the same memory and the same file offsets, with the same number of
//!   requests in flight (on a virtual disk, other buffers or files were seen to differ by 2×, so
//!   only the same memory and file make a fair limit);
//! * the leader's hot path: matches of an 8-block request per second (vs the reference's figure
//!   for Dynamo's leader, quoted, not measured).
//!
//! Rounds alternate limit and ours; medians are reported. The ratio is the figure to quote.

use std::io::IsTerminal;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backends::disk::{DiskTier, DiskTierOptions};
use crate::backends::memory::MemoryTier;
use crate::config::{Config, TransferConfig};
use crate::connector::adapter::ScheduledTokens;
use crate::connector::barrier::InitMode;
use crate::connector::leader::{Leader, RequestInfo};
use crate::connector::transport::in_process;
use crate::connector::worker::Worker;
use crate::connector::RequestId;
use crate::error::{Error, ErrorKind, Result};
use crate::layout::{BlockOrder, Layout, LayoutDims};
use crate::tier::{StorageTier, TierKind};
use crate::transfer::TransferEngine;

/// `kvbm bench` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Blocks per transfer (each 2 MiB: 32 layers × K/V × 16 tokens × 8 heads × 128 × bf16).
    #[arg(long, default_value_t = 32)]
    pub blocks: usize,
    /// Rounds per path (median reported).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Directory for the disk paths (default: the configured disk directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Requests in flight for the disk paths.
    #[arg(long, default_value_t = 4)]
    pub in_flight: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
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

fn check_outcome(o: crate::transfer::TransferOutcome) -> Result<()> {
    match o.failed.first() {
        None => Ok(()),
        Some(f) => Err(f.error.clone()),
    }
}

fn memory_paths(blocks: usize, rounds: usize) -> Result<Vec<PathResult>> {
    let d = dims();
    let bytes = blocks * d.bytes_per_block();
    let contiguous = MemoryTier::new(TierKind::Device, Layout::fully_contiguous(d, blocks)?)?;
    let separate = MemoryTier::new(
        TierKind::Device,
        Layout::layer_separate(d, blocks, BlockOrder::OuterMajor)?,
    )?;
    let host = MemoryTier::host(Layout::fully_contiguous(d, blocks)?)?;
    fill(&contiguous)?;
    fill(&separate)?;
    let a = vec![7u8; bytes];
    let mut b = vec![0u8; bytes];
    let pairs: Vec<(usize, usize)> = (0..blocks).map(|i| (i, i)).collect();
    let mut out = Vec::new();
    for (name, src) in [
        ("memory->memory (contiguous)", &contiguous),
        ("memory->memory (layer-separate gather)", &separate),
    ] {
        let (l, o) = interleaved(
            rounds * 3,
            || {
                b.copy_from_slice(std::hint::black_box(&a));
                Ok(())
            },
            || check_outcome(TransferEngine::copy_blocking(src, &host, &pairs)?),
        )?;
        out.push(bandwidth(name, bytes, l, o, "memcpy of the same bytes"));
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

fn disk_paths(
    blocks: usize,
    rounds: usize,
    dir: PathBuf,
    in_flight: usize,
) -> Result<(Vec<PathResult>, Option<String>)> {
    let d = dims();
    let bpb = d.bytes_per_block();
    let bytes = blocks * bpb;
    let opts = DiskTierOptions::new(dir).with_max_in_flight(in_flight);
    let disk = DiskTier::create(TierKind::Disk, d, blocks, opts)?;
    let note = disk.direct_io_fallback_reason().map(str::to_string);
    let (path, slot) = (disk.path().to_path_buf(), disk.slot_bytes());
    let disk: Arc<dyn StorageTier> = Arc::new(disk);
    let mem: Arc<dyn StorageTier> =
        Arc::new(MemoryTier::host(Layout::fully_contiguous(d, blocks)?)?);
    fill(mem.as_ref())?;
    let mut ptrs = Vec::with_capacity(blocks);
    for b in 0..blocks {
        mem.with_block(b, &mut |segs| {
            ptrs.push(segs.first().map_or(0, |s| s.as_ptr() as usize));
            Ok(())
        })?;
    }
    let mut oo = std::fs::OpenOptions::new();
    oo.read(true).write(true);
    if note.is_none() {
        oo.custom_flags(libc::O_DIRECT);
    }
    let raw = oo
        .open(&path)
        .map_err(|e| Error::io("open the disk tier's file for the raw limit", e))?;
    let fd = raw.as_raw_fd();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .map_err(|e| Error::io("start a runtime", e))?;
    let engine = TransferEngine::new(&TransferConfig {
        max_concurrency: in_flight,
        batch_blocks: 1,
    })?;
    let pairs: Vec<(usize, usize)> = (0..blocks).map(|i| (i, i)).collect();
    let copy = |src: &Arc<dyn StorageTier>, dst: &Arc<dyn StorageTier>| -> Result<()> {
        check_outcome(runtime.block_on(engine.copy(src.clone(), dst.clone(), pairs.clone()))?)
    };
    let kind = if note.is_none() {
        "O_DIRECT"
    } else {
        "buffered"
    };
    // Each raw write is followed by ours, which restores the tier's checksums before reads.
    let (l, o) = interleaved(
        rounds,
        || raw_direct(fd, &ptrs, bpb, slot, in_flight, true),
        || copy(&mem, &disk),
    )?;
    let mut out = vec![bandwidth(
        "memory->disk",
        bytes,
        l,
        o,
        &format!("raw {kind} pwrite, same file, memory and bytes"),
    )];
    let (l, o) = interleaved(
        rounds,
        || raw_direct(fd, &ptrs, bpb, slot, in_flight, false),
        || copy(&disk, &mem),
    )?;
    out.push(bandwidth(
        "disk->memory (checksum verified)",
        bytes,
        l,
        o,
        &format!("raw {kind} pread, same file, memory and bytes"),
    ));
    Ok((out, note))
}

/// Dynamo KVBM's leader lookup path, requests/s (reference §8, upper end; quoted, not measured).
pub const DYNAMO_LOOKUP_PER_SEC: f64 = 21_000.0;

fn leader_path(rounds: usize) -> Result<PathResult> {
    let dir = std::env::temp_dir();
    let mut config = Config::default();
    config.host.cache_blocks = Some(4096);
    config.disk.cache_blocks = Some(0);
    config.disk.dir = dir;
    let d = LayoutDims {
        num_layers: 2,
        outer_dim: 2,
        page_size: 16,
        inner_dim: 8,
        dtype_bytes: 2,
    };
    let (lt, wts) = in_process(1);
    let wt = wts
        .into_iter()
        .next()
        .ok_or_else(|| Error::internal("no worker end"))?;
    let device: Arc<dyn StorageTier> = Arc::new(MemoryTier::new(
        TierKind::Device,
        Layout::fully_contiguous(d, 64)?,
    )?);
    let mut worker = Worker::new(config.clone(), 1, wt, InitMode::NonBlocking)?;
    worker.register(device)?;
    let mut leader = Leader::new(ScheduledTokens, config, 16, lt, InitMode::Blocking)?;
    let prompt: Vec<u32> = (0..8 * 16 + 1).collect();
    let calls = 20_000 * rounds.max(1);
    let t = Instant::now();
    for k in 0..calls {
        let id = RequestId::from(k as u64);
        let info = RequestInfo {
            id: &id,
            tokens: &prompt,
            cache_salt: None,
            lora_name: None,
        };
        leader.get_num_new_matched_tokens(info, 0)?;
        leader.request_finished(&id, None, Some(0))?;
    }
    let per_sec = calls as f64 / t.elapsed().as_secs_f64().max(1e-12);
    Ok(PathResult {
        path: "leader match (8-block request) + release".into(),
        ours: per_sec,
        limit: DYNAMO_LOOKUP_PER_SEC,
        ratio: per_sec / DYNAMO_LOOKUP_PER_SEC,
        unit: "calls/s".into(),
        limit_source: "Dynamo KVBM lookup path, 21k requests/s (reference §8, quoted)".into(),
    })
}

/// Runs `kvbm bench`.
pub fn run(a: &BenchArgs) -> Result<ExitCode> {
    if a.blocks == 0 || a.rounds == 0 || a.in_flight == 0 {
        return Err(Error::invalid_argument(
            "--blocks, --rounds and --in-flight must be at least 1",
        ));
    }
    let config = Config::load(None)?;
    let dir = a.dir.clone().unwrap_or(config.disk.dir);
    let progress = !a.json && std::io::stderr().is_terminal();
    let mut results = Vec::new();
    if progress {
        eprintln!("bench: memory paths…");
    }
    results.extend(memory_paths(a.blocks, a.rounds)?);
    if progress {
        eprintln!("bench: disk paths in {}…", dir.display());
    }
    let (disk, note) = disk_paths(a.blocks, a.rounds, dir, a.in_flight)?;
    results.extend(disk);
    if progress {
        eprintln!("bench: leader hot path…");
    }
    results.push(leader_path(a.rounds)?);
    if a.json {
        let v = serde_json::json!({ "paths": results, "disk_note": note });
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| Error::internal(e.to_string()))?
        );
    } else {
        println!(
            "{:<42} {:>12} {:>12} {:>8}  limit",
            "path", "ours", "limit", "ratio"
        );
        for r in &results {
            println!(
                "{:<42} {:>12.2} {:>12.2} {:>8.3}  {} ({})",
                r.path, r.ours, r.limit, r.ratio, r.unit, r.limit_source
            );
        }
        if let Some(n) = note {
            println!("note: the disk tier runs without O_DIRECT here: {n}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
