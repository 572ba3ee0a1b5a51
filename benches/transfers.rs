//! Block copies as a ratio of the limit measured on the same bytes in the same run.
//!
//! * memory → memory (fully contiguous both sides, and layer separate → contiguous gather) against
//!   one plain memcpy of the same bytes;
//! * memory → disk and disk → memory through the transfer engine against raw O_DIRECT
//!   `pwrite`/`pread` of the same bytes with the same block size and the same number of requests in
//!   flight, on the disk tier's own file at the same offsets (a second file of the same size was
//!   seen to read up to 2x faster or slower from one run to the next on a virtual disk, so only
//!   the same file gives a fair limit). Each raw write is followed by our write, which restores
//!   the tier's checksums before any read.
//!
//! Model block: 32 layers × K/V × 16 tokens × 8 heads × 128 dims × bf16 = 2 MiB.
//! Directory: `KVBM_BENCH_DIR` or the system temp dir. Targets: ratio >= 0.8.

mod common;

use std::alloc::{alloc_zeroed, dealloc, Layout as AllocLayout};
use std::hint::black_box;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvbm_connector::backends::disk::{DiskTier, DiskTierOptions};
use kvbm_connector::backends::memory::MemoryTier;
use kvbm_connector::config::TransferConfig;
use kvbm_connector::layout::BlockOrder;
use kvbm_connector::transfer::TransferEngine;
use kvbm_connector::{Layout, LayoutDims, StorageTier, StorageTierExt, TierKind};

const IN_FLIGHT: usize = 4;

fn dims() -> LayoutDims {
    LayoutDims {
        num_layers: 32,
        outer_dim: 2,
        page_size: 16,
        inner_dim: 8 * 128,
        dtype_bytes: 2,
    }
}

fn blocks() -> usize {
    if common::quick() {
        4
    } else {
        64
    }
}

fn rounds() -> usize {
    if common::quick() {
        1
    } else {
        10
    }
}

fn bench_dir() -> PathBuf {
    std::env::var_os("KVBM_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
}

/// Page-aligned heap buffer for the raw O_DIRECT limit.
struct Aligned {
    ptr: *mut u8,
    layout: AllocLayout,
}
unsafe impl Send for Aligned {}
unsafe impl Sync for Aligned {}
impl Aligned {
    fn new(len: usize) -> Self {
        let layout = AllocLayout::from_size_align(len, 4096).unwrap();
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        let s = Self { ptr, layout };
        unsafe { std::slice::from_raw_parts_mut(s.ptr, len) }
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i * 31 + 7) as u8);
        s
    }
    fn as_slice(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.ptr, self.layout.size()) }
    }
    #[allow(clippy::mut_from_ref)]
    fn chunk_mut(&self, off: usize, len: usize) -> &mut [u8] {
        // Bench-only: threads touch disjoint chunks.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) }
    }
}
impl Drop for Aligned {
    fn drop(&mut self) {
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

fn fill(tier: &dyn StorageTier) {
    for b in 0..tier.num_blocks() {
        let img: Vec<u8> = (0..tier.bytes_per_block())
            .map(|i| (i + b * 131) as u8)
            .collect();
        tier.write_block_from_slice(b, &img).unwrap();
    }
}

fn bench_memory(c: &mut Criterion) {
    let n = blocks();
    let src_c: Arc<dyn StorageTier> = Arc::new(
        MemoryTier::new(
            TierKind::Device,
            Layout::fully_contiguous(dims(), n).unwrap(),
        )
        .unwrap(),
    );
    let src_ls: Arc<dyn StorageTier> = Arc::new(
        MemoryTier::new(
            TierKind::Device,
            Layout::layer_separate(dims(), n, BlockOrder::OuterMajor).unwrap(),
        )
        .unwrap(),
    );
    let dst: Arc<dyn StorageTier> =
        Arc::new(MemoryTier::host(Layout::fully_contiguous(dims(), n).unwrap()).unwrap());
    fill(src_c.as_ref());
    fill(src_ls.as_ref());
    let pairs: Vec<(usize, usize)> = (0..n).map(|b| (b, b)).collect();
    let bytes = (n * dims().bytes_per_block()) as u64;
    let a = Aligned::new(bytes as usize);
    let b = Aligned::new(bytes as usize);

    let mut g = c.benchmark_group("memory_to_memory");
    g.throughput(Throughput::Bytes(bytes));
    g.bench_function("memcpy_limit", |bch| {
        bch.iter(|| {
            b.chunk_mut(0, bytes as usize)
                .copy_from_slice(black_box(a.as_slice()))
        })
    });
    g.bench_function("contiguous", |bch| {
        bch.iter(|| TransferEngine::copy_blocking(src_c.as_ref(), dst.as_ref(), &pairs).unwrap())
    });
    g.bench_function("layer_separate_gather", |bch| {
        bch.iter(|| TransferEngine::copy_blocking(src_ls.as_ref(), dst.as_ref(), &pairs).unwrap())
    });
    g.finish();

    let memcpy = || {
        b.chunk_mut(0, bytes as usize)
            .copy_from_slice(black_box(a.as_slice()))
    };
    let (l, o) = common::interleaved(rounds() * 3, memcpy, || {
        assert!(
            TransferEngine::copy_blocking(src_c.as_ref(), dst.as_ref(), &pairs)
                .unwrap()
                .is_ok()
        );
    });
    common::report_bandwidth("memory->memory contiguous vs memcpy", bytes, l, o, 0.8);
    let (l, o) = common::interleaved(rounds() * 3, memcpy, || {
        assert!(
            TransferEngine::copy_blocking(src_ls.as_ref(), dst.as_ref(), &pairs)
                .unwrap()
                .is_ok()
        );
    });
    common::report_bandwidth(
        "memory->memory layer-separate gather vs memcpy",
        bytes,
        l,
        o,
        0.8,
    );
}

/// Raw O_DIRECT I/O of each block between its address in `ptrs` and its slot in `file`, with
/// IN_FLIGHT threads: the same bytes, memory and file offsets our path uses, minus our code.
fn raw_direct(file: &std::fs::File, ptrs: &[usize], bpb: usize, slot: usize, write: bool) {
    let fd = file.as_raw_fd();
    let n = ptrs.len();
    std::thread::scope(|s| {
        for t in 0..IN_FLIGHT {
            s.spawn(move || {
                for blk in (t..n).step_by(IN_FLIGHT) {
                    let p = ptrs[blk] as *mut libc::c_void;
                    let off = (blk * slot) as libc::off_t;
                    // SAFETY (bench only): each block's memory is touched by one thread, and no
                    // other code touches the memory tier while the limit runs.
                    let r = unsafe {
                        if write {
                            libc::pwrite(fd, p, bpb, off)
                        } else {
                            libc::pread(fd, p, bpb, off)
                        }
                    };
                    assert_eq!(r, bpb as isize, "raw O_DIRECT I/O failed");
                }
            });
        }
    });
}

fn bench_disk(c: &mut Criterion) {
    let n = blocks();
    let bpb = dims().bytes_per_block();
    let bytes = (n * bpb) as u64;
    let dir = tempfile::tempdir_in(bench_dir()).unwrap();
    let mut opts = DiskTierOptions::new(dir.path().to_path_buf());
    opts.max_in_flight = IN_FLIGHT;
    let disk = DiskTier::create(TierKind::Disk, dims(), n, opts).unwrap();
    if !disk.direct_io() {
        println!(
            "NOTE disk tier runs without O_DIRECT here: {}",
            disk.direct_io_fallback_reason().unwrap_or("unknown")
        );
    }
    let (path, slot) = (disk.path().to_path_buf(), disk.slot_bytes());
    let disk: Arc<dyn StorageTier> = Arc::new(disk);
    let mem: Arc<dyn StorageTier> =
        Arc::new(MemoryTier::host(Layout::fully_contiguous(dims(), n).unwrap()).unwrap());
    fill(mem.as_ref());

    let raw = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .unwrap();
    // The limit moves the very bytes our path moves, between the same memory and the same file
    // offsets: on this virtual machine, O_DIRECT speed was seen to differ up to 2x between two
    // equally sized buffers, so any other buffer would not be a fair limit.
    let mut ptrs = Vec::with_capacity(n);
    for b in 0..n {
        mem.with_block(b, &mut |segs| {
            ptrs.push(segs[0].as_ptr() as usize);
            Ok(())
        })
        .unwrap();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let engine = TransferEngine::new(&TransferConfig {
        max_concurrency: IN_FLIGHT,
        batch_blocks: 1,
        ..Default::default()
    })
    .unwrap();
    let pairs: Vec<(usize, usize)> = (0..n).map(|b| (b, b)).collect();
    let copy = |src: &Arc<dyn StorageTier>, dst: &Arc<dyn StorageTier>| {
        let out = rt
            .block_on(engine.copy(src.clone(), dst.clone(), pairs.clone()))
            .unwrap();
        assert!(out.is_ok(), "{:?}", out.failed);
    };

    let mut g = c.benchmark_group("disk");
    g.throughput(Throughput::Bytes(bytes));
    g.sample_size(10);
    g.bench_function("raw_o_direct_write_limit", |b| {
        b.iter(|| raw_direct(&raw, &ptrs, bpb, slot, true))
    });
    g.bench_function("memory_to_disk", |b| b.iter(|| copy(&mem, &disk)));
    g.bench_function("raw_o_direct_read_limit", |b| {
        b.iter(|| raw_direct(&raw, &ptrs, bpb, slot, false))
    });
    g.bench_function("disk_to_memory", |b| b.iter(|| copy(&disk, &mem)));
    g.finish();

    let (l, o) = common::interleaved(
        rounds(),
        || raw_direct(&raw, &ptrs, bpb, slot, true),
        || copy(&mem, &disk),
    );
    common::report_bandwidth("memory->disk vs raw O_DIRECT write", bytes, l, o, 0.8);
    let (l, o) = common::interleaved(
        rounds(),
        || raw_direct(&raw, &ptrs, bpb, slot, false),
        || copy(&disk, &mem),
    );
    common::report_bandwidth(
        "disk->memory (checksum verified) vs raw O_DIRECT read",
        bytes,
        l,
        o,
        0.8,
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = bench_memory, bench_disk
}
criterion_main!(benches);
