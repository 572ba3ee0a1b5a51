//! The `cuda` backend (feature `cuda`).
//!
//! Two kinds of test:
//! * CPU tests, which run everywhere: the probe answers an error (never a panic) when there is no
//!   driver or GPU, and the copy planner ([`plan_copies`]) is checked against an emulation of the
//!   copies it plans (merging, strided copies, exact coverage);
//! * GPU tests, which need a CUDA GPU. Without one each prints `SKIP <test>: <reason>` to stderr
//!   (written past the test harness's capture, so `cargo test` shows it) and passes. With
//!   `KVBM_REQUIRE_GPU=1` (as `scripts/gpu-check.sh` sets) a missing GPU fails them instead.
//!   `KVBM_CUDA_DEVICE` picks the GPU (default 0). Run the GPU tests with `--test-threads 1` (as
//!   `scripts/gpu-check.sh` does): the gating tests hold an engine stream with a blocking host
//!   function, and CUDA runs a context's host functions on one driver thread, so a held stream
//!   stalls the other tests' host functions and synchronising calls when they run in parallel.

#![cfg(feature = "cuda")]

mod common;

use std::ffi::c_void;
use std::io::{IoSlice, IoSliceMut, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_connector::backends::cuda::{
    self, block_pieces, plan_copies, CopyOp, CudaDevice, CudaDeviceTier, DeviceBuffer, Piece,
    PinnedHostTier,
};
use kvbm_connector::backends::disk::{DiskTier, DiskTierOptions};
use kvbm_connector::backends::memory::MemoryTier;
use kvbm_connector::layout::BlockOrder;
use kvbm_connector::transfer::TransferEngine;
use kvbm_connector::{
    ErrorKind, KvLayout, Layout, LayoutDims, StorageTier, StorageTierExt, TierKind,
};
use proptest::prelude::*;

// ------------------------------------------------------------------------------------------------
// Fixtures
// ------------------------------------------------------------------------------------------------

/// Prints past libtest's output capture, so a skip is seen in a plain `cargo test`.
fn say(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

/// The GPU, or `None` after printing why the test is skipped.
fn gpu(test: &str) -> Option<Arc<CudaDevice>> {
    let reason = match cuda::probe() {
        Ok(_) => {
            let ordinal = std::env::var("KVBM_CUDA_DEVICE")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            match CudaDevice::open(ordinal) {
                Ok(d) => return Some(d),
                Err(e) => e.to_string(),
            }
        }
        Err(e) => e.to_string(),
    };
    if std::env::var_os("KVBM_REQUIRE_GPU").is_some_and(|v| v != "0") {
        panic!("{test}: KVBM_REQUIRE_GPU is set but no GPU is usable: {reason}");
    }
    say(&format!("SKIP {test}: no usable CUDA GPU: {reason}"));
    None
}

/// 3 layers × 2 × 4 tokens × 8 × 2 bytes: runs of 64 bytes, blocks of 384.
fn small() -> LayoutDims {
    LayoutDims {
        num_layers: 3,
        outer_dim: 2,
        page_size: 4,
        inner_dim: 8,
        dtype_bytes: 2,
    }
}

/// 4 layers × 2 × 16 tokens × 128 × 2 bytes: runs of 4 KiB, blocks of 32 KiB.
fn aligned() -> LayoutDims {
    LayoutDims {
        num_layers: 4,
        outer_dim: 2,
        page_size: 16,
        inner_dim: 128,
        dtype_bytes: 2,
    }
}

fn layouts(d: LayoutDims, n: usize) -> Vec<(&'static str, Layout)> {
    vec![
        ("fully_contiguous", Layout::fully_contiguous(d, n).unwrap()),
        (
            "layer_separate_block_major",
            Layout::layer_separate(d, n, BlockOrder::BlockMajor).unwrap(),
        ),
        (
            "layer_separate_outer_major",
            Layout::layer_separate(d, n, BlockOrder::OuterMajor).unwrap(),
        ),
        (
            "layer_separate_head_major",
            Layout::layer_separate_head_major(d, n, 2).unwrap(),
        ),
    ]
}

/// A block image that differs per block, per `salt` and per byte.
fn image(block: usize, salt: u8, bpb: usize) -> Vec<u8> {
    (0..bpb)
        .map(|i| (i.wrapping_mul(31) ^ block.wrapping_mul(131) ^ (i >> 8)) as u8 ^ salt)
        .collect()
}

/// A device tier over freshly allocated GPU memory; the buffers must outlive the tier's use.
fn device_tier(dev: &Arc<CudaDevice>, layout: Layout) -> (Arc<CudaDeviceTier>, Vec<DeviceBuffer>) {
    let bufs: Vec<DeviceBuffer> = (0..layout.num_allocations())
        .map(|_| dev.alloc(layout.allocation_bytes()).unwrap())
        .collect();
    let ptrs: Vec<u64> = bufs.iter().map(|b| b.ptr()).collect();
    // SAFETY: the buffers are returned to the caller, who keeps them alive while the tier is used.
    let tier = unsafe { CudaDeviceTier::register(dev.clone(), layout, &ptrs) }.unwrap();
    (tier, bufs)
}

fn fill(tier: &dyn StorageTier, salt: u8) {
    for b in 0..tier.num_blocks() {
        tier.write_block_from_slice(b, &image(b, salt, tier.bytes_per_block()))
            .unwrap();
    }
}

fn assert_ok(o: kvbm_connector::transfer::TransferOutcome) {
    assert!(o.is_ok(), "transfer failed: {:?}", o.failed.first());
}

// ------------------------------------------------------------------------------------------------
// CPU: probe
// ------------------------------------------------------------------------------------------------

#[test]
fn probe_answers_without_panicking() {
    let r = std::panic::catch_unwind(cuda::probe);
    let r = r.expect("probe panicked");
    match r.clone() {
        Ok(info) => {
            assert!(!info.devices.is_empty());
            say(&format!(
                "cuda probe: driver {} ({}), {} GPU(s): {}",
                info.driver_version_string(),
                info.library,
                info.devices.len(),
                info.devices
                    .iter()
                    .map(|g| format!(
                        "{} sm_{}{} {} GiB",
                        g.name,
                        g.compute_capability.0,
                        g.compute_capability.1,
                        g.total_memory >> 30
                    ))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
            // The reason names the library or the driver call that failed.
            let text = e.to_string();
            assert!(
                text.contains("libcuda") || text.contains("cu"),
                "unhelpful probe error: {text}"
            );
            // Every constructor answers the same error instead of touching the driver.
            let open = std::panic::catch_unwind(|| CudaDevice::open(0)).expect("open panicked");
            assert_eq!(open.unwrap_err().kind(), ErrorKind::Unsupported);
            say(&format!("cuda probe (expected without a GPU): {text}"));
        }
    }
    // The answer is cached and stable.
    assert_eq!(
        cuda::probe().map_err(|e| e.to_string()),
        r.map_err(|e| e.to_string())
    );
}

#[test]
fn probe_error_when_no_driver_is_expected() {
    // On machines known to have no driver (CI), say so: KVBM_EXPECT_NO_CUDA=1.
    if std::env::var_os("KVBM_EXPECT_NO_CUDA").is_none() {
        return;
    }
    let e = cuda::probe().expect_err("a CUDA driver was found where none was expected");
    assert!(e.to_string().contains("libcuda"), "{e}");
}

/// A `libcuda.so` / `libcuda.so.1` that opens but has no driver API (a stand-in built with the C compiler) must
/// be an error too: cudarc panics binding it, and the probe keeps that panic inside. Runs the check
/// in a child process (the probe's answer is cached per process) with the stand-in first on
/// `LD_LIBRARY_PATH`.
#[test]
fn probe_survives_a_driver_library_it_cannot_bind() {
    const CHILD: &str = "KVBM_BOGUS_LIBCUDA_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let e = cuda::probe().expect_err("a library without the driver API was accepted");
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
        assert!(e.to_string().contains("could not bind"), "{e}");
        assert_eq!(
            CudaDevice::open(0).unwrap_err().kind(),
            ErrorKind::Unsupported
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("stand_in.c");
    std::fs::write(&src, "int kvbm_not_a_cuda_driver(void) { return 0; }\n").unwrap();
    // Under every name the probe (and cudarc) try, so a real driver elsewhere on the loader's
    // path cannot stand in for the stand-in.
    let so = dir.path().join(cuda::DRIVER_LIBRARIES[0]);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let built = std::process::Command::new(&cc)
        .args(["-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(&src)
        .output();
    if !matches!(&built, Ok(o) if o.status.success()) {
        say(&format!(
            "SKIP probe_survives_a_driver_library_it_cannot_bind: `{cc}` could not build a stand-in libcuda.so.1"
        ));
        return;
    }
    for name in &cuda::DRIVER_LIBRARIES[1..] {
        std::os::unix::fs::symlink(&so, dir.path().join(name)).unwrap();
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "probe_survives_a_driver_library_it_cannot_bind",
            "--test-threads",
            "1",
        ])
        .env(CHILD, "1")
        .env("LD_LIBRARY_PATH", dir.path())
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child run failed:\n{stdout}\n{stderr}"
    );
}

// ------------------------------------------------------------------------------------------------
// CPU: copy planning, checked by emulating the planned copies
// ------------------------------------------------------------------------------------------------

const DEV_BASE: u64 = 0x7f00_0000_0000;
const HOST_BASE: usize = 0x5500_0000_0000;

/// Device runs of `block` of `layout` with allocation `a` at `DEV_BASE + a × stride`.
fn fake_device_runs(layout: &Layout, block: usize) -> Vec<(u64, usize)> {
    let stride = layout.allocation_bytes() as u64 + 4096;
    layout
        .regions(block)
        .unwrap()
        .map(|r| {
            (
                DEV_BASE + r.allocation as u64 * stride + r.offset as u64,
                r.len,
            )
        })
        .collect()
}

fn fake_host_runs(layout: &Layout, block: usize) -> Vec<(usize, usize)> {
    let stride = layout.allocation_bytes() + 4096;
    layout
        .regions(block)
        .unwrap()
        .map(|r| (HOST_BASE + r.allocation * stride + r.offset, r.len))
        .collect()
}

fn plan_for(
    dev: &Layout,
    host: &Layout,
    pairs: &[(usize, usize)],
    max_pitch: usize,
) -> Vec<CopyOp> {
    let pieces: Vec<Vec<Piece>> = pairs
        .iter()
        .map(|&(d, h)| block_pieces(&fake_device_runs(dev, d), &fake_host_runs(host, h)))
        .collect();
    plan_copies(&pieces, max_pitch)
}

/// Applies `ops` device → host byte by byte on emulated memory and checks the result is each
/// pair's canonical image, with every host byte written once and nothing else touched.
fn emulate_and_check(dev: &Layout, host: &Layout, pairs: &[(usize, usize)], ops: &[CopyOp]) {
    let dstride = dev.allocation_bytes() as u64 + 4096;
    let hstride = host.allocation_bytes() + 4096;
    let dsize = dstride as usize * dev.num_allocations();
    let hsize = hstride * host.num_allocations();
    // Device byte value: a hash of its address.
    let dval = |addr: u64| ((addr - DEV_BASE).wrapping_mul(2654435761) >> 7) as u8;
    let mut hmem = vec![0u8; hsize];
    let mut writes = vec![0u8; hsize];
    for op in ops {
        for row in 0..op.height {
            for i in 0..op.width {
                let d = op.device + (row * op.device_pitch + i) as u64;
                let h = op.host + row * op.host_pitch + i;
                assert!(d >= DEV_BASE && ((d - DEV_BASE) as usize) < dsize);
                let hi = h - HOST_BASE;
                hmem[hi] = dval(d);
                writes[hi] += 1;
            }
        }
    }
    let bpb = dev.bytes_per_block();
    let mut expected_writes = vec![0u8; hsize];
    for &(d, h) in pairs {
        // The canonical image of device block d.
        let mut canon = vec![0u8; bpb];
        for r in dev.regions(d).unwrap() {
            let base = DEV_BASE + r.allocation as u64 * dstride + r.offset as u64;
            for i in 0..r.len {
                canon[r.canonical_offset + i] = dval(base + i as u64);
            }
        }
        for r in host.regions(h).unwrap() {
            let base = r.allocation * hstride + r.offset;
            assert_eq!(
                &hmem[base..base + r.len],
                &canon[r.canonical_offset..r.canonical_offset + r.len],
                "host block {h} run at canonical {} differs",
                r.canonical_offset
            );
            for w in &mut expected_writes[base..base + r.len] {
                *w += 1;
            }
        }
    }
    assert_eq!(
        writes, expected_writes,
        "a host byte was written other than once"
    );
}

#[test]
fn contiguous_consecutive_blocks_are_one_copy() {
    let d = aligned();
    let dev = Layout::fully_contiguous(d, 64).unwrap();
    let host = Layout::fully_contiguous(d, 64).unwrap();
    let pairs: Vec<(usize, usize)> = (0..32).map(|i| (i + 8, i)).collect();
    let ops = plan_for(&dev, &host, &pairs, usize::MAX);
    assert_eq!(ops.len(), 1, "{ops:?}");
    assert_eq!(ops[0].height, 1);
    assert_eq!(ops[0].bytes(), 32 * d.bytes_per_block());
    emulate_and_check(&dev, &host, &pairs, &ops);
}

#[test]
fn contiguous_runs_merge_where_adjacent() {
    let d = small();
    let dev = Layout::fully_contiguous(d, 16).unwrap();
    let host = Layout::fully_contiguous(d, 16).unwrap();
    let pairs = [(0, 0), (1, 1), (2, 2), (7, 3), (8, 4), (3, 9)];
    let ops = plan_for(&dev, &host, &pairs, usize::MAX);
    assert_eq!(ops.len(), 3, "{ops:?}");
    assert!(ops.iter().all(|o| o.height == 1));
    emulate_and_check(&dev, &host, &pairs, &ops);
}

#[test]
fn layer_separate_consecutive_blocks_are_one_strided_copy_per_run() {
    let d = aligned();
    let host = Layout::fully_contiguous(d, 64).unwrap();
    let pairs: Vec<(usize, usize)> = (0..16).map(|i| (i + 3, i + 40)).collect();
    // Outer-major: each (layer, K/V) run is one strided copy over the 16 blocks.
    let om = Layout::layer_separate(d, 64, BlockOrder::OuterMajor).unwrap();
    let ops = plan_for(&om, &host, &pairs, usize::MAX);
    assert_eq!(ops.len(), d.regions_per_block(), "{ops:?}");
    assert!(ops
        .iter()
        .all(|o| o.height == 16 && o.width == d.region_bytes()));
    emulate_and_check(&om, &host, &pairs, &ops);
    // Block-major: K and V of a layer are adjacent on both sides: one strided copy per layer.
    let bm = Layout::layer_separate(d, 64, BlockOrder::BlockMajor).unwrap();
    let ops = plan_for(&bm, &host, &pairs, usize::MAX);
    assert_eq!(ops.len(), d.num_layers, "{ops:?}");
    assert!(ops
        .iter()
        .all(|o| o.height == 16 && o.width == 2 * d.region_bytes()));
    emulate_and_check(&bm, &host, &pairs, &ops);
}

#[test]
fn scattered_blocks_fall_back_to_per_run_copies() {
    let d = small();
    let dev = Layout::layer_separate(d, 32, BlockOrder::OuterMajor).unwrap();
    let host = Layout::fully_contiguous(d, 32).unwrap();
    // Every step goes backwards on one side: nothing to stride over.
    let pairs = [(9, 0), (2, 5), (30, 1), (4, 3)];
    let ops = plan_for(&dev, &host, &pairs, usize::MAX);
    assert_eq!(ops.len(), pairs.len() * d.regions_per_block());
    assert!(ops.iter().all(|o| o.height == 1));
    emulate_and_check(&dev, &host, &pairs, &ops);
}

#[test]
fn strides_beyond_the_pitch_limit_are_not_strided_copies() {
    let d = small();
    let dev = Layout::layer_separate(d, 32, BlockOrder::OuterMajor).unwrap();
    let host = Layout::fully_contiguous(d, 32).unwrap();
    let pairs: Vec<(usize, usize)> = (0..8).map(|i| (i, i)).collect();
    let ops = plan_for(&dev, &host, &pairs, d.region_bytes());
    assert!(ops.iter().all(|o| o.height == 1), "{ops:?}");
    emulate_and_check(&dev, &host, &pairs, &ops);
}

#[test]
fn pieces_cut_at_both_sides_boundaries() {
    let dev = [(1000u64, 10usize), (2000, 6)];
    let host = [(50usize, 4usize), (54, 8), (90, 4)];
    let p = block_pieces(&dev, &host);
    // 4+6 are adjacent on both sides (1000..1010 ↔ 50..60): one piece; then 2 bytes of run 2 on
    // the device side end the second host segment; then 4 bytes into the third.
    assert_eq!(
        p,
        vec![
            Piece {
                device: 1000,
                host: 50,
                len: 10
            },
            Piece {
                device: 2000,
                host: 60,
                len: 2
            },
            Piece {
                device: 2002,
                host: 90,
                len: 4
            },
        ]
    );
}

fn arb_layout(n: usize) -> impl Strategy<Value = Layout> {
    (
        1usize..4,
        1usize..3,
        1usize..5,
        1usize..4,
        prop::sample::select(vec![1usize, 2, 4]),
        0u8..3,
    )
        .prop_map(move |(l, o, p, i, t, kind)| {
            let d = LayoutDims {
                num_layers: l,
                outer_dim: o,
                page_size: p,
                inner_dim: i,
                dtype_bytes: t,
            };
            match kind {
                0 => Layout::fully_contiguous(d, n).unwrap(),
                1 => Layout::layer_separate(d, n, BlockOrder::BlockMajor).unwrap(),
                _ => Layout::layer_separate(d, n, BlockOrder::OuterMajor).unwrap(),
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Any layouts (same dims), any pairs (distinct destinations), any pitch limit: the plan
    /// moves every pair's canonical image and writes each destination byte once.
    #[test]
    fn plans_move_exactly_the_canonical_images(
        dev in arb_layout(12),
        host_kind in 0u8..3,
        pairs_seed in prop::collection::vec((0usize..12, 0usize..12), 1..12),
        run in 1usize..6,
        max_pitch in prop::sample::select(vec![usize::MAX, 64, 1 << 20]),
    ) {
        let d = *dev.dims();
        let host = match host_kind {
            0 => Layout::fully_contiguous(d, 12).unwrap(),
            1 => Layout::layer_separate(d, 12, BlockOrder::BlockMajor).unwrap(),
            _ => Layout::layer_separate(d, 12, BlockOrder::OuterMajor).unwrap(),
        };
        // Mix runs of consecutive blocks with jumps; destinations distinct.
        let mut pairs = Vec::new();
        let mut used = [false; 12];
        for (s, h) in pairs_seed {
            for k in 0..run {
                let (s, h) = ((s + k) % 12, (h + k) % 12);
                if !used[h] {
                    used[h] = true;
                    pairs.push((s, h));
                }
            }
        }
        let ops = plan_for(&dev, &host, &pairs, max_pitch);
        emulate_and_check(&dev, &host, &pairs, &ops);
    }
}

// ------------------------------------------------------------------------------------------------
// GPU
// ------------------------------------------------------------------------------------------------

#[test]
fn gpu_round_trips_device_and_host_in_every_layout() {
    let Some(dev) = gpu("gpu_round_trips_device_and_host_in_every_layout") else {
        return;
    };
    for d in [small(), aligned()] {
        for (name, layout) in layouts(d, 24) {
            let (tier, _bufs) = device_tier(&dev, layout);
            let bpb = d.bytes_per_block();
            // Host tiers: pinned and pageable, in two layouts.
            let hosts: Vec<(&str, Arc<dyn StorageTier>)> = vec![
                (
                    "pinned contiguous",
                    Arc::new(
                        PinnedHostTier::host(&dev, Layout::fully_contiguous(d, 24).unwrap())
                            .unwrap(),
                    ),
                ),
                (
                    "pinned layer-separate",
                    Arc::new(
                        PinnedHostTier::host(
                            &dev,
                            Layout::layer_separate(d, 24, BlockOrder::OuterMajor).unwrap(),
                        )
                        .unwrap(),
                    ),
                ),
                (
                    "pageable contiguous",
                    Arc::new(MemoryTier::host(Layout::fully_contiguous(d, 24).unwrap()).unwrap()),
                ),
            ];
            for (hname, host) in hosts {
                fill(tier.as_ref(), 0x11);
                // Single-block primitives.
                for b in [0, 5, 23] {
                    assert_eq!(
                        tier.read_block_to_vec(b).unwrap(),
                        image(b, 0x11, bpb),
                        "{name}"
                    );
                }
                // Consecutive and scattered pairs, through the transfer engine (the CUDA hook).
                let consecutive: Vec<(usize, usize)> = (0..12).map(|i| (i + 4, i)).collect();
                let scattered = [(23, 12), (1, 13), (17, 14), (2, 15), (3, 16)];
                for pairs in [&consecutive[..], &scattered[..]] {
                    assert_ok(
                        TransferEngine::copy_blocking(tier.as_ref(), host.as_ref(), pairs).unwrap(),
                    );
                    for &(s, h) in pairs {
                        assert_eq!(
                            host.read_block_to_vec(h).unwrap(),
                            image(s, 0x11, bpb),
                            "{name} -> {hname}: device {s} -> host {h}"
                        );
                    }
                }
                // Back: clobber the device, load host blocks into other device blocks.
                fill(tier.as_ref(), 0xEE);
                let back: Vec<(usize, usize)> = consecutive
                    .iter()
                    .chain(scattered.iter())
                    .map(|&(s, h)| (h, (s + 7) % 24))
                    .collect();
                assert_ok(
                    TransferEngine::copy_blocking(host.as_ref(), tier.as_ref(), &back).unwrap(),
                );
                for &(h, dblk) in &back {
                    let orig = consecutive
                        .iter()
                        .chain(scattered.iter())
                        .find(|p| p.1 == h)
                        .unwrap()
                        .0;
                    assert_eq!(
                        tier.read_block_to_vec(dblk).unwrap(),
                        image(orig, 0x11, bpb),
                        "{hname} -> {name}: host {h} -> device {dblk}"
                    );
                }
            }
        }
    }
}

#[test]
fn gpu_async_transfers_on_a_runtime() {
    let Some(dev) = gpu("gpu_async_transfers_on_a_runtime") else {
        return;
    };
    let d = aligned();
    let (tier, _bufs) = device_tier(
        &dev,
        Layout::layer_separate(d, 64, BlockOrder::OuterMajor).unwrap(),
    );
    let host: Arc<dyn StorageTier> =
        Arc::new(PinnedHostTier::host(&dev, Layout::fully_contiguous(d, 64).unwrap()).unwrap());
    fill(tier.as_ref(), 0x42);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let engine = TransferEngine::new(&kvbm_connector::config::TransferConfig {
        max_concurrency: 4,
        batch_blocks: 8,
        ..Default::default()
    })
    .unwrap();
    let device: Arc<dyn StorageTier> = tier.clone();
    let pairs: Vec<(usize, usize)> = (0..64).map(|i| (i, 63 - i)).collect();
    let out = rt
        .block_on(engine.copy(device.clone(), host.clone(), pairs.clone()))
        .unwrap();
    assert_ok(out);
    for &(s, h) in &pairs {
        assert_eq!(
            host.read_block_to_vec(h).unwrap(),
            image(s, 0x42, d.bytes_per_block())
        );
    }
}

#[test]
fn gpu_merges_adjacent_runs() {
    let Some(dev) = gpu("gpu_merges_adjacent_runs") else {
        return;
    };
    let d = aligned();
    let n = 64;
    let host = PinnedHostTier::host(&dev, Layout::fully_contiguous(d, n).unwrap()).unwrap();
    let all: Vec<(usize, usize)> = (0..n).map(|i| (i, i)).collect();
    // Fully contiguous: one copy for the whole batch.
    let (fc, _b1) = device_tier(&dev, Layout::fully_contiguous(d, n).unwrap());
    fill(fc.as_ref(), 1);
    let before = fc.copy_stats();
    assert_ok(TransferEngine::copy_blocking(fc.as_ref(), &host, &all).unwrap());
    let after = fc.copy_stats();
    assert_eq!(after.copies_1d - before.copies_1d, 1);
    assert_eq!(after.copies_2d - before.copies_2d, 0);
    assert_eq!(after.batches - before.batches, 1);
    assert_eq!(after.bytes - before.bytes, (n * d.bytes_per_block()) as u64);
    // Layer separate: one strided copy per run.
    let (ls, _b2) = device_tier(
        &dev,
        Layout::layer_separate(d, n, BlockOrder::OuterMajor).unwrap(),
    );
    fill(ls.as_ref(), 2);
    let before = ls.copy_stats();
    assert_ok(TransferEngine::copy_blocking(ls.as_ref(), &host, &all).unwrap());
    let after = ls.copy_stats();
    assert_eq!(
        after.copies_2d - before.copies_2d,
        d.regions_per_block() as u64
    );
    assert_eq!(after.copies_1d - before.copies_1d, 0);
    for b in 0..n {
        assert_eq!(
            host.read_block_to_vec(b).unwrap(),
            image(b, 2, d.bytes_per_block())
        );
    }
}

static HOLD: AtomicBool = AtomicBool::new(true);
static HOLD_STREAMS: AtomicBool = AtomicBool::new(true);

/// A host function on the engine's stream that keeps the stream busy until `flag` (a
/// `&'static AtomicBool`) is false. Each test has its own flag (tests run in parallel).
unsafe extern "C" fn hold_stream(flag: *mut c_void) {
    // SAFETY: callers pass a `&'static AtomicBool`.
    let flag = unsafe { &*(flag as *const AtomicBool) };
    let start = Instant::now();
    while flag.load(Ordering::Acquire) && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn flag_ptr(flag: &'static AtomicBool) -> *mut c_void {
    flag as *const AtomicBool as *mut c_void
}

/// The address of `tier`'s block `block` (one segment: a fully contiguous pinned tier).
fn pinned_block_addr(tier: &PinnedHostTier, block: usize) -> usize {
    let mut addr: Option<usize> = None;
    tier.with_block(block, &mut |s| {
        addr = Some(s[0].as_ptr() as usize);
        Ok(())
    })
    .unwrap();
    addr.unwrap()
}

/// The gating tests' tiers: an 8-block layer-separate device tier filled with salt 0xA0 ("before
/// the forward pass") and an 8-block pinned host tier.
fn gating_tiers(
    dev: &Arc<CudaDevice>,
) -> (
    LayoutDims,
    Arc<CudaDeviceTier>,
    Vec<DeviceBuffer>,
    PinnedHostTier,
) {
    let d = aligned();
    let (tier, bufs) = device_tier(
        dev,
        Layout::layer_separate(d, 8, BlockOrder::OuterMajor).unwrap(),
    );
    fill(tier.as_ref(), 0xA0);
    let host = PinnedHostTier::host(dev, Layout::fully_contiguous(d, 8).unwrap()).unwrap();
    (d, tier, bufs, host)
}

#[test]
fn gpu_stores_wait_for_the_engine_event_without_blocking_the_cpu() {
    let Some(dev) = gpu("gpu_stores_wait_for_the_engine_event_without_blocking_the_cpu") else {
        return;
    };
    use cuda::cudarc::driver::sys;
    let (d, tier, _bufs, host) = gating_tiers(&dev);
    let bpb = d.bytes_per_block();
    let ctx = dev.context().clone();
    // The engine: a stream that is busy (held by a host function), then writes block 0's final KV
    // ("the forward pass"), then records its event.
    let engine = ctx.new_stream().unwrap();
    let staging = PinnedHostTier::host(&dev, Layout::fully_contiguous(d, 1).unwrap()).unwrap();
    staging
        .write_block_from_slice(0, &image(0, 0xB0, bpb))
        .unwrap();
    HOLD.store(true, Ordering::Release);
    dev.bind().unwrap();
    let runs = tier.device_runs(0).unwrap();
    let src = pinned_block_addr(&staging, 0);
    // SAFETY: the stream, the pinned staging block and the device runs are live until the stream
    // is synchronised below.
    unsafe {
        sys::cuLaunchHostFunc(engine.cu_stream(), Some(hold_stream), flag_ptr(&HOLD))
            .result()
            .unwrap();
        for r in &runs {
            sys::cuMemcpyHtoDAsync_v2(
                r.ptr,
                (src + r.canonical_offset) as *const c_void,
                r.len,
                engine.cu_stream(),
            )
            .result()
            .unwrap();
        }
    }
    let event = engine.record_event(None).unwrap();
    let t = Instant::now();
    // SAFETY: a live event of this context.
    unsafe { tier.gate_stores_on(event.cu_event()) }.unwrap();
    assert!(
        t.elapsed() < Duration::from_millis(100),
        "gating blocked the CPU"
    );
    // Loads are not gated: writing block 5 completes while the engine is held.
    tier.write_block_from_slice(5, &image(5, 0xC0, bpb))
        .unwrap();
    // The store of block 0 waits for the event.
    std::thread::scope(|s| {
        let store = s.spawn(|| TransferEngine::copy_blocking(tier.as_ref(), &host, &[(0, 0)]));
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !store.is_finished(),
            "the store did not wait for the engine's event"
        );
        HOLD.store(false, Ordering::Release);
        assert_ok(store.join().unwrap().unwrap());
    });
    engine.synchronize().unwrap();
    assert_eq!(
        host.read_block_to_vec(0).unwrap(),
        image(0, 0xB0, bpb),
        "the store read the block before the forward pass finished"
    );
    assert_eq!(tier.read_block_to_vec(5).unwrap(), image(5, 0xC0, bpb));
}

#[test]
fn gpu_stream_gating_orders_copies_against_the_engine_stream() {
    let Some(dev) = gpu("gpu_stream_gating_orders_copies_against_the_engine_stream") else {
        return;
    };
    use cuda::cudarc::driver::sys;
    let (d, tier, _bufs, host) = gating_tiers(&dev);
    let bpb = d.bytes_per_block();
    host.write_block_from_slice(3, &image(3, 0xD0, bpb))
        .unwrap(); // what the load brings
    let ctx = dev.context().clone();
    // The engine's stream, busy (held) as during a forward pass; what the Python classes call
    // at their hooks: stores and loads gated on the engine's stream itself (no event given).
    let engine = ctx.new_stream().unwrap();
    dev.bind().unwrap();
    // SAFETY: a live stream; the flag is static.
    unsafe {
        sys::cuLaunchHostFunc(
            engine.cu_stream(),
            Some(hold_stream),
            flag_ptr(&HOLD_STREAMS),
        )
    }
    .result()
    .unwrap();
    let t = Instant::now();
    // SAFETY: a live stream of this GPU's primary context.
    unsafe { tier.gate_stores_on_stream(engine.cu_stream()) }.unwrap();
    // SAFETY: as above.
    unsafe { tier.gate_loads_on_stream(engine.cu_stream()) }.unwrap();
    assert!(
        t.elapsed() < Duration::from_millis(100),
        "gating blocked the CPU"
    );
    // Another engine stream that reads device block 3 once our loads are done.
    let reader = ctx.new_stream().unwrap();
    let staging = PinnedHostTier::host(&dev, Layout::fully_contiguous(d, 1).unwrap()).unwrap();
    let dst = pinned_block_addr(&staging, 0);
    std::thread::scope(|s| {
        let store = s.spawn(|| TransferEngine::copy_blocking(tier.as_ref(), &host, &[(0, 0)]));
        let load = s.spawn(|| TransferEngine::copy_blocking(&host, tier.as_ref(), &[(3, 3)]));
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !store.is_finished(),
            "the store did not wait for the engine's stream"
        );
        assert!(
            !load.is_finished(),
            "the load did not wait for the engine's earlier work"
        );
        // The load's copies are enqueued (behind the held engine stream): the reader waits for
        // them on the GPU, then copies block 3 out.
        // SAFETY: a live stream of this GPU's primary context.
        unsafe { tier.order_stream_after_loads(reader.cu_stream()) }.unwrap();
        for r in tier.device_runs(3).unwrap() {
            // SAFETY: the staging block and the device run are live until `reader` is
            // synchronised below.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    (dst + r.canonical_offset) as *mut c_void,
                    r.ptr,
                    r.len,
                    reader.cu_stream(),
                )
            }
            .result()
            .unwrap();
        }
        std::thread::sleep(Duration::from_millis(100));
        HOLD_STREAMS.store(false, Ordering::Release);
        assert_ok(store.join().unwrap().unwrap());
        assert_ok(load.join().unwrap().unwrap());
    });
    reader.synchronize().unwrap();
    engine.synchronize().unwrap();
    assert_eq!(
        staging.read_block_to_vec(0).unwrap(),
        image(3, 0xD0, bpb),
        "the engine's reader ran before our load"
    );
    assert_eq!(tier.read_block_to_vec(3).unwrap(), image(3, 0xD0, bpb));
    assert_eq!(host.read_block_to_vec(0).unwrap(), image(0, 0xA0, bpb));
}

#[test]
fn gpu_disk_round_trip_through_the_pinned_bounce() {
    let Some(dev) = gpu("gpu_disk_round_trip_through_the_pinned_bounce") else {
        return;
    };
    for d in [small(), aligned()] {
        for (name, layout) in layouts(d, 16) {
            let bpb = d.bytes_per_block();
            let dir = tempfile::tempdir().unwrap();
            let disk =
                DiskTier::create(TierKind::Disk, d, 16, DiskTierOptions::new(dir.path())).unwrap();
            let (tier, _bufs) = device_tier(&dev, layout);
            fill(tier.as_ref(), 0x5A);
            let out: Vec<(usize, usize)> = (0..10).map(|i| (i, i + 2)).collect();
            assert_ok(TransferEngine::copy_blocking(tier.as_ref(), &disk, &out).unwrap());
            // Corrupt disk block 5 (from device block 3): only that block fails on the way back.
            {
                use std::io::{Seek, SeekFrom};
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(disk.path())
                    .unwrap();
                f.seek(SeekFrom::Start(5 * disk.slot_bytes() as u64 + 3))
                    .unwrap();
                f.write_all(&[0xDE, 0xAD]).unwrap();
                f.sync_all().unwrap();
            }
            fill(tier.as_ref(), 0x00);
            let back: Vec<(usize, usize)> = (2..12).map(|h| (h, 15 - (h - 2))).collect();
            let o = TransferEngine::copy_blocking(&disk, tier.as_ref(), &back).unwrap();
            assert_eq!(o.failed.len(), 1, "{name}: {:?}", o.failed);
            assert_eq!(o.failed[0].src_block, 5);
            assert_eq!(o.failed[0].error.kind(), ErrorKind::Corrupt);
            for &(h, dblk) in &back {
                if h == 5 {
                    continue;
                }
                assert_eq!(
                    tier.read_block_to_vec(dblk).unwrap(),
                    image(h - 2, 0x5A, bpb),
                    "{name}: disk {h} -> device {dblk}"
                );
            }
        }
    }
}

#[test]
fn gpu_staged_block_access_and_registration_checks() {
    let Some(dev) = gpu("gpu_staged_block_access_and_registration_checks") else {
        return;
    };
    let d = small();
    let layout = Layout::layer_separate(d, 4, BlockOrder::BlockMajor).unwrap();
    let (tier, bufs) = device_tier(&dev, layout);
    let bpb = d.bytes_per_block();
    tier.with_block_mut(2, &mut |segs| {
        assert_eq!(segs.len(), 1);
        segs[0].copy_from_slice(&image(2, 9, bpb));
        Ok(())
    })
    .unwrap();
    assert_eq!(tier.read_block_to_vec(2).unwrap(), image(2, 9, bpb));
    let mut seen = Vec::new();
    tier.with_block(2, &mut |segs| {
        seen = segs[0].to_vec();
        Ok(())
    })
    .unwrap();
    assert_eq!(seen, image(2, 9, bpb));
    // Segment lists of any shape.
    let img = image(1, 3, bpb);
    tier.write_block(1, &[IoSlice::new(&img[..100]), IoSlice::new(&img[100..])])
        .unwrap();
    let (mut a, mut b) = (vec![0u8; 7], vec![0u8; bpb - 7]);
    tier.read_block(1, &mut [IoSliceMut::new(&mut a), IoSliceMut::new(&mut b)])
        .unwrap();
    assert_eq!([a, b].concat(), img);
    // Bad block ids and lengths are errors.
    assert_eq!(
        tier.read_block_to_vec(4).unwrap_err().kind(),
        ErrorKind::OutOfRange
    );
    assert_eq!(
        tier.write_block_from_slice(0, &[0u8; 3])
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidArgument
    );
    // Registration refuses the wrong number of allocations, host memory and short allocations.
    let ptrs: Vec<u64> = bufs.iter().map(|b| b.ptr()).collect();
    // SAFETY: each call is refused before the pointers are used.
    unsafe {
        assert!(CudaDeviceTier::register(dev.clone(), layout, &ptrs[..1]).is_err());
        let host = vec![0u8; layout.allocation_bytes()];
        let mut bad = ptrs.clone();
        bad[0] = host.as_ptr() as u64;
        assert!(CudaDeviceTier::register(dev.clone(), layout, &bad).is_err());
        // 8 GiB per layer: its last byte is far past anything this process allocated.
        let big = Layout::layer_separate(d, 1 << 26, BlockOrder::BlockMajor).unwrap();
        let small_buf = dev.alloc(4096).unwrap();
        let short = vec![small_buf.ptr(); big.num_allocations()];
        assert!(CudaDeviceTier::register(dev.clone(), big, &short).is_err());
    }
}

#[test]
fn gpu_connector_offloads_and_onboards_through_the_gpu_tier() {
    let Some(dev) = gpu("gpu_connector_offloads_and_onboards_through_the_gpu_tier") else {
        return;
    };
    use common::{new_leader, new_worker};
    use kvbm_connector::connector::transport::in_process;
    use kvbm_connector::connector::RequestId;
    use kvbm_connector::connector::{Blocking, NonBlocking};

    let layout = Layout::layer_separate(
        common::dims(),
        common::DEVICE_BLOCKS,
        BlockOrder::OuterMajor,
    )
    .unwrap();
    let (tier, bufs) = device_tier(&dev, layout);
    // The worker's background threads may hold the tier past this test's end: keep the memory.
    std::mem::forget(bufs);
    let dir = tempfile::tempdir().unwrap();
    let config = common::config(dir.path(), 16, 64);
    let (lt, wts) = in_process(1);
    let device: Arc<dyn StorageTier> = tier.clone();
    let mut worker = new_worker(config.clone(), 1, wts[0].clone(), NonBlocking).unwrap();
    worker.register(device.clone()).unwrap();
    let leader = new_leader(config, common::BS, lt, Blocking).unwrap();
    common::wait_until("worker ready", || worker.is_ready());
    let mut r = common::Rig {
        leader,
        worker,
        device,
        dir,
    };
    let prompt: Vec<u32> = (100..140).collect(); // 10 blocks
    let a: RequestId = "a".into();
    r.offload(&a, &prompt, &(0..10).collect::<Vec<_>>());
    let b: RequestId = "b".into();
    // `onboard` checks every loaded block's bytes on the GPU.
    assert_eq!(r.onboard(&b, &prompt, &(10..20).collect::<Vec<_>>()), 36);
    r.leader.process_completions();
    let snap = r.leader.metrics().snapshot();
    assert_eq!(snap.load_error_blocks, 0);
    assert!(tier.copy_stats().batches > 0);
}
