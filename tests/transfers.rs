//! Transfers between tiers across layouts, verified byte for byte, and corruption detection.

use std::io::{IoSlice, IoSliceMut, Read, Seek, SeekFrom, Write};
use std::sync::{Arc, Mutex};

use kvbm_connector::backends::disk::{DiskTier, DiskTierOptions};
use kvbm_connector::backends::memory::MemoryTier;
use kvbm_connector::config::TransferConfig;
use kvbm_connector::layout::BlockOrder;
use kvbm_connector::tier::BatchCopy;
use kvbm_connector::transfer::TransferEngine;
use kvbm_connector::{
    Capability, ErrorKind, Layout, LayoutDims, StorageTier, StorageTierExt, TierKind,
};

/// Small model: 4 layers, K/V, 16 tokens, 2 heads × 64 dims, bf16 → 4 KiB runs, 32 KiB blocks.
/// A few pairs into a large tier take the sorted duplicate check (not a flag per tier block):
/// a destination named twice is still refused, and distinct ones still copy.
#[test]
fn duplicate_destinations_in_a_large_tier_are_refused() {
    let rt = runtime();
    let d = dims();
    let a: Arc<dyn StorageTier> =
        Arc::new(MemoryTier::host(Layout::fully_contiguous(d, 4).unwrap()).unwrap());
    let big: Arc<dyn StorageTier> =
        Arc::new(MemoryTier::host(Layout::fully_contiguous(d, 512).unwrap()).unwrap());
    a.write_block_from_slice(2, &image(&d, 2)).unwrap();
    let e = rt
        .block_on(engine().copy(a.clone(), big.clone(), vec![(0, 300), (1, 5), (2, 300)]))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("block 300 appears twice"), "{e}");
    assert!(big.read_block_to_vec(300).unwrap().iter().all(|&x| x == 0));
    assert!(rt
        .block_on(engine().copy(a.clone(), big.clone(), vec![(0, 300), (2, 511)]))
        .unwrap()
        .is_ok());
    assert_eq!(big.read_block_to_vec(511).unwrap(), image(&d, 2));
}

fn dims() -> LayoutDims {
    LayoutDims {
        num_layers: 4,
        outer_dim: 2,
        page_size: 16,
        inner_dim: 128,
        dtype_bytes: 2,
    }
}

/// Odd dims whose runs are not 4 KiB multiples (exercises the disk's bounce path).
fn odd_dims() -> LayoutDims {
    LayoutDims {
        num_layers: 3,
        outer_dim: 2,
        page_size: 4,
        inner_dim: 10,
        dtype_bytes: 2,
    }
}

/// The canonical image of "logical block" `b`: every byte depends on block, layer, K/V, offset.
fn image(d: &LayoutDims, b: usize) -> Vec<u8> {
    let run = d.region_bytes();
    (0..d.bytes_per_block())
        .map(|i| {
            let (r, off) = (i / run, i % run);
            (b.wrapping_mul(97) ^ r.wrapping_mul(31) ^ off.wrapping_mul(7)) as u8
        })
        .collect()
}

fn layouts(d: LayoutDims, n: usize) -> Vec<Layout> {
    vec![
        Layout::fully_contiguous(d, n).unwrap(),
        Layout::layer_separate(d, n, BlockOrder::BlockMajor).unwrap(),
        Layout::layer_separate(d, n, BlockOrder::OuterMajor).unwrap(),
        Layout::layer_separate_head_major(d, n, 2).unwrap(),
    ]
}

fn disk(d: LayoutDims, n: usize, dir: &std::path::Path, direct: bool) -> DiskTier {
    let mut o = DiskTierOptions::new(dir.to_path_buf());
    o.direct_io = direct;
    DiskTier::create(TierKind::Disk, d, n, o).unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap()
}

fn engine() -> TransferEngine {
    TransferEngine::new(&TransferConfig {
        max_concurrency: 3,
        batch_blocks: 2,
        ..Default::default()
    })
    .unwrap()
}

/// device (any layout) → host (contiguous) → disk → device (another layout), verifying each hop.
fn round_trip(d: LayoutDims, direct: bool) {
    let rt = runtime();
    let tmp = tempfile::tempdir().unwrap();
    let eng = engine();
    let n = 8;
    for src_layout in layouts(d, n) {
        for back_layout in layouts(d, n) {
            let device: Arc<dyn StorageTier> =
                Arc::new(MemoryTier::new(TierKind::Device, src_layout).unwrap());
            for b in 0..n {
                device.write_block_from_slice(b, &image(&d, b)).unwrap();
            }
            let host: Arc<dyn StorageTier> =
                Arc::new(MemoryTier::host(Layout::fully_contiguous(d, n).unwrap()).unwrap());
            let dsk: Arc<dyn StorageTier> = Arc::new(disk(d, n, tmp.path(), direct));
            let device2: Arc<dyn StorageTier> =
                Arc::new(MemoryTier::new(TierKind::Device, back_layout).unwrap());

            // Offload device blocks 0..5 into host blocks 7..2 (reversed), then host → disk.
            let off: Vec<(usize, usize)> = (0..6).map(|b| (b, 7 - b)).collect();
            let out = rt
                .block_on(eng.copy(device.clone(), host.clone(), off.clone()))
                .unwrap();
            assert!(out.is_ok(), "{:?}", out.failed);
            assert_eq!(out.blocks, 6);
            assert_eq!(out.bytes, 6 * d.bytes_per_block() as u64);
            let to_disk: Vec<(usize, usize)> = (2..8).map(|h| (h, h - 2)).collect();
            assert!(rt
                .block_on(eng.copy(host.clone(), dsk.clone(), to_disk))
                .unwrap()
                .is_ok());
            // Onboard disk → device2 and host → device2.
            let from_disk: Vec<(usize, usize)> = (0..3).map(|k| (k, k)).collect();
            assert!(rt
                .block_on(eng.copy(dsk.clone(), device2.clone(), from_disk))
                .unwrap()
                .is_ok());
            let from_host: Vec<(usize, usize)> = vec![(7, 5), (6, 6)];
            assert!(rt
                .block_on(eng.copy(host.clone(), device2.clone(), from_host))
                .unwrap()
                .is_ok());
            // Disk block k holds host block k+2 = device block 5-k.
            for k in 0..3 {
                assert_eq!(
                    device2.read_block_to_vec(k).unwrap(),
                    image(&d, 5 - k),
                    "disk block {k}"
                );
            }
            assert_eq!(device2.read_block_to_vec(5).unwrap(), image(&d, 0));
            assert_eq!(device2.read_block_to_vec(6).unwrap(), image(&d, 1));
            // Sync path gives the same bytes.
            let device3 = MemoryTier::new(TierKind::Device, back_layout).unwrap();
            let out = TransferEngine::copy_blocking(device.as_ref(), &device3, &[(4, 0)]).unwrap();
            assert!(out.is_ok());
            assert_eq!(device3.read_block_to_vec(0).unwrap(), image(&d, 4));
        }
    }
}

#[test]
fn round_trip_across_layouts_direct_io() {
    round_trip(dims(), true);
}

#[test]
fn round_trip_across_layouts_buffered() {
    round_trip(dims(), false);
}

#[test]
fn round_trip_across_layouts_unaligned_runs() {
    round_trip(odd_dims(), true);
}

#[test]
fn disk_to_disk_goes_through_a_bounce_buffer() {
    let tmp = tempfile::tempdir().unwrap();
    let d = dims();
    let a = disk(d, 4, tmp.path(), true);
    let b = disk(d, 4, tmp.path(), true);
    a.write_block_from_slice(1, &image(&d, 1)).unwrap();
    let out = TransferEngine::copy_blocking(&a, &b, &[(1, 3)]).unwrap();
    assert!(out.is_ok(), "{:?}", out.failed);
    assert_eq!(b.read_block_to_vec(3).unwrap(), image(&d, 1));
}

#[test]
fn corrupted_disk_block_is_a_load_error_and_others_still_load() {
    let rt = runtime();
    let tmp = tempfile::tempdir().unwrap();
    let d = dims();
    let n = 4;
    let host: Arc<dyn StorageTier> =
        Arc::new(MemoryTier::host(Layout::fully_contiguous(d, n).unwrap()).unwrap());
    for b in 0..n {
        host.write_block_from_slice(b, &image(&d, b)).unwrap();
    }
    let dsk = disk(d, n, tmp.path(), true);
    let path = dsk.path().to_path_buf();
    let dsk: Arc<dyn StorageTier> = Arc::new(dsk);
    let pairs: Vec<(usize, usize)> = (0..n).map(|b| (b, b)).collect();
    assert!(rt
        .block_on(engine().copy(host.clone(), dsk.clone(), pairs.clone()))
        .unwrap()
        .is_ok());

    // Flip bytes in the middle of block 2's slot behind the tier's back.
    let slot = d.bytes_per_block().div_ceil(4096) * 4096;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let at = (2 * slot + 1000) as u64;
    let mut byte = [0u8; 1];
    f.seek(SeekFrom::Start(at)).unwrap();
    f.read_exact(&mut byte).unwrap();
    f.seek(SeekFrom::Start(at)).unwrap();
    f.write_all(&[!byte[0]]).unwrap();
    f.sync_all().unwrap();
    drop(f);

    let device: Arc<dyn StorageTier> = Arc::new(
        MemoryTier::new(
            TierKind::Device,
            Layout::layer_separate(d, n, BlockOrder::OuterMajor).unwrap(),
        )
        .unwrap(),
    );
    let out = rt
        .block_on(engine().copy(dsk.clone(), device.clone(), pairs))
        .unwrap();
    assert_eq!(out.blocks, 3);
    assert_eq!(out.failed.len(), 1);
    let f = &out.failed[0];
    assert_eq!((f.src_block, f.dst_block), (2, 2));
    assert_eq!(f.error.kind(), ErrorKind::Corrupt);
    for b in [0, 1, 3] {
        assert_eq!(device.read_block_to_vec(b).unwrap(), image(&d, b));
    }
    // The host copy is untouched, so the block can be offloaded again and then served.
    assert!(rt
        .block_on(engine().copy(host.clone(), dsk.clone(), vec![(2, 2)]))
        .unwrap()
        .is_ok());
    assert_eq!(dsk.read_block_to_vec(2).unwrap(), image(&d, 2));
}

#[test]
fn invalid_transfers_are_refused_before_anything_moves() {
    let rt = runtime();
    let d = dims();
    let a: Arc<dyn StorageTier> =
        Arc::new(MemoryTier::host(Layout::fully_contiguous(d, 4).unwrap()).unwrap());
    let b: Arc<dyn StorageTier> =
        Arc::new(MemoryTier::host(Layout::fully_contiguous(d, 4).unwrap()).unwrap());
    a.write_block_from_slice(0, &image(&d, 0)).unwrap();
    let e = rt
        .block_on(engine().copy(a.clone(), b.clone(), vec![(0, 0), (4, 1)]))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange);
    let e = rt
        .block_on(engine().copy(a.clone(), b.clone(), vec![(0, 0), (1, 9)]))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange);
    let e = rt
        .block_on(engine().copy(a.clone(), b.clone(), vec![(0, 1), (2, 1)]))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    let e = rt
        .block_on(engine().copy(a.clone(), a.clone(), vec![(1, 1)]))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    let other: Arc<dyn StorageTier> =
        Arc::new(MemoryTier::host(Layout::fully_contiguous(odd_dims(), 4).unwrap()).unwrap());
    let e = rt
        .block_on(engine().copy(a.clone(), other, vec![(0, 0)]))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidLayout);
    // Nothing was written to the destination (it is still zeroed).
    assert!(b.read_block_to_vec(0).unwrap().iter().all(|&x| x == 0));
    assert!(b.read_block_to_vec(1).unwrap().iter().all(|&x| x == 0));
    // Same tier, different blocks is fine.
    assert!(rt
        .block_on(engine().copy(a.clone(), a.clone(), vec![(0, 3)]))
        .unwrap()
        .is_ok());
    assert_eq!(a.read_block_to_vec(3).unwrap(), image(&d, 0));
}

#[test]
fn submit_without_runtime_is_not_ready() {
    let d = dims();
    let a: Arc<dyn StorageTier> =
        Arc::new(MemoryTier::host(Layout::fully_contiguous(d, 2).unwrap()).unwrap());
    let b: Arc<dyn StorageTier> =
        Arc::new(MemoryTier::host(Layout::fully_contiguous(d, 2).unwrap()).unwrap());
    let e = engine().submit(a, b, vec![(0, 0)]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotReady);
}

#[test]
fn many_concurrent_transfers_complete_with_handles() {
    let rt = runtime();
    let d = dims();
    let n = 64;
    let src: Arc<dyn StorageTier> = Arc::new(
        MemoryTier::new(
            TierKind::Device,
            Layout::layer_separate(d, n, BlockOrder::BlockMajor).unwrap(),
        )
        .unwrap(),
    );
    for b in 0..n {
        src.write_block_from_slice(b, &image(&d, b)).unwrap();
    }
    let dst: Arc<dyn StorageTier> =
        Arc::new(MemoryTier::host(Layout::fully_contiguous(d, n).unwrap()).unwrap());
    let eng = engine();
    rt.block_on(async {
        let handles: Vec<_> = (0..8)
            .map(|t| {
                let pairs = (0..8).map(|i| (t * 8 + i, n - 1 - (t * 8 + i))).collect();
                eng.submit(src.clone(), dst.clone(), pairs).unwrap()
            })
            .collect();
        for h in handles {
            let out = h.await.unwrap();
            assert!(out.is_ok());
            assert_eq!(out.blocks, 8);
        }
    });
    for b in 0..n {
        assert_eq!(dst.read_block_to_vec(n - 1 - b).unwrap(), image(&d, b));
    }
}

/// A memory tier that lends a [`BatchCopy`] hook: records which of its sides the engine asked,
/// and takes the batch (copying block by block itself, optionally answering one result short) or
/// declines it.
#[derive(Debug)]
struct Hooked {
    inner: MemoryTier,
    take: bool,
    short: bool,
    asked: Mutex<Vec<&'static str>>,
}

impl Hooked {
    fn new(d: LayoutDims, n: usize, take: bool, short: bool) -> Self {
        Self {
            inner: MemoryTier::host(Layout::fully_contiguous(d, n).unwrap()).unwrap(),
            take,
            short,
            asked: Mutex::new(Vec::new()),
        }
    }

    /// Records `side`, then declines or answers `copy` for each pair (one short if asked to).
    fn answer(
        &self,
        side: &'static str,
        pairs: &[(usize, usize)],
        copy: impl Fn(usize, usize) -> kvbm_connector::Result<()>,
    ) -> Option<Vec<kvbm_connector::Result<()>>> {
        self.asked.lock().unwrap().push(side);
        if !self.take {
            return None;
        }
        let mut results: Vec<_> = pairs.iter().map(|&(s, d)| copy(s, d)).collect();
        if self.short {
            results.pop();
        }
        Some(results)
    }

    fn asked(&self) -> Vec<&'static str> {
        self.asked.lock().unwrap().clone()
    }
}

impl StorageTier for Hooked {
    fn kind(&self) -> TierKind {
        self.inner.kind()
    }
    fn capability(&self) -> Capability {
        self.inner.capability()
    }
    fn layout(&self) -> &Layout {
        self.inner.layout()
    }
    fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> kvbm_connector::Result<()> {
        self.inner.read_block(block, dst)
    }
    fn write_block(&self, block: usize, src: &[IoSlice<'_>]) -> kvbm_connector::Result<()> {
        self.inner.write_block(block, src)
    }
    fn with_block(
        &self,
        block: usize,
        f: &mut dyn FnMut(&[IoSlice<'_>]) -> kvbm_connector::Result<()>,
    ) -> kvbm_connector::Result<()> {
        self.inner.with_block(block, f)
    }
    fn with_block_mut(
        &self,
        block: usize,
        f: &mut dyn FnMut(&mut [IoSliceMut<'_>]) -> kvbm_connector::Result<()>,
    ) -> kvbm_connector::Result<()> {
        self.inner.with_block_mut(block, f)
    }
    fn batch_copy(&self) -> Option<&dyn BatchCopy> {
        Some(self)
    }
}

impl BatchCopy for Hooked {
    fn copy_to(
        &self,
        dst: &dyn StorageTier,
        pairs: &[(usize, usize)],
    ) -> Option<Vec<kvbm_connector::Result<()>>> {
        self.answer("to", pairs, |s, d| {
            self.inner.with_block(s, &mut |seg| dst.write_block(d, seg))
        })
    }

    fn copy_from(
        &self,
        src: &dyn StorageTier,
        pairs: &[(usize, usize)],
    ) -> Option<Vec<kvbm_connector::Result<()>>> {
        self.answer("from", pairs, |s, d| {
            self.inner
                .with_block_mut(d, &mut |seg| src.read_block(s, seg))
        })
    }
}

/// The engine offers a batch to the destination's hook, then the source's, and copies block by
/// block when both decline; a hook that answers short fails the pairs it left out.
#[test]
fn batch_copy_hooks_are_asked_destination_first() {
    let d = dims();
    let n = 4;
    let pairs = [(0, 3), (1, 2), (2, 1)];
    let plain =
        MemoryTier::host(Layout::layer_separate(d, n, BlockOrder::OuterMajor).unwrap()).unwrap();
    let seed = |tier: &dyn StorageTier| {
        for b in 0..n {
            tier.write_block_from_slice(b, &image(&d, b)).unwrap();
        }
    };
    let check = |dst: &dyn StorageTier| {
        for &(s, t) in &pairs {
            assert_eq!(dst.read_block_to_vec(t).unwrap(), image(&d, s));
        }
    };
    seed(&plain);

    // The destination takes it: the source is never asked.
    let (src, dst) = (
        Hooked::new(d, n, true, false),
        Hooked::new(d, n, true, false),
    );
    seed(&src);
    let out = TransferEngine::copy_blocking(&src, &dst, &pairs).unwrap();
    assert!(out.is_ok() && out.blocks == 3, "{out:?}");
    assert_eq!((src.asked(), dst.asked()), (vec![], vec!["from"]));
    check(&dst);

    // The destination has none: the source's is asked.
    let src = Hooked::new(d, n, true, false);
    seed(&src);
    let dst = MemoryTier::host(Layout::fully_contiguous(d, n).unwrap()).unwrap();
    let out = TransferEngine::copy_blocking(&src, &dst, &pairs).unwrap();
    assert!(out.is_ok() && out.blocks == 3, "{out:?}");
    assert_eq!(src.asked(), vec!["to"]);
    check(&dst);

    // Both decline: block by block.
    let (src, dst) = (
        Hooked::new(d, n, false, false),
        Hooked::new(d, n, false, false),
    );
    seed(&src);
    let out = TransferEngine::copy_blocking(&src, &dst, &pairs).unwrap();
    assert!(out.is_ok() && out.blocks == 3, "{out:?}");
    assert_eq!((src.asked(), dst.asked()), (vec!["to"], vec!["from"]));
    check(&dst);

    // A short answer: the pair left out is a failure, not a silent success.
    let dst = Hooked::new(d, n, true, true);
    let out = TransferEngine::copy_blocking(&plain, &dst, &pairs).unwrap();
    assert_eq!(out.blocks, 2, "{out:?}");
    assert_eq!(out.failed.len(), 1, "{out:?}");
    let f = &out.failed[0];
    assert_eq!(
        (f.src_block, f.dst_block, f.error.kind()),
        (2, 1, ErrorKind::Internal)
    );
}

/// Memory → memory copies on both sides of the size at which the engine switches to streaming
/// stores (transfers of 4 MiB and more): every layout into and out of contiguous and outer-major
/// tiers, block order reversed, through `copy_blocking` and the engine, every byte checked.
/// The odd model's 320-byte runs leave destination runs that start and end off a cache line.
#[test]
fn memory_copies_are_exact_below_and_above_the_streaming_size() {
    const STREAM_MIN: usize = 4 << 20;
    // 64 KiB blocks (8 KiB runs) and 1,920-byte blocks (320-byte runs).
    let big = LayoutDims {
        inner_dim: 256,
        ..dims()
    };
    let odd = LayoutDims {
        num_layers: 3,
        outer_dim: 2,
        page_size: 16,
        inner_dim: 10,
        dtype_bytes: 2,
    };
    let odd_n = STREAM_MIN / odd.bytes_per_block() + 1;
    let cases = [(big, 1), (big, 63), (big, 64), (big, 65), (odd, odd_n)];
    assert!(cases
        .iter()
        .any(|(d, n)| n * d.bytes_per_block() < STREAM_MIN));
    assert!(cases
        .iter()
        .any(|(d, n)| n * d.bytes_per_block() >= STREAM_MIN));
    let rt = runtime();
    let eng = engine();
    for (d, n) in cases {
        let images: Vec<Vec<u8>> = (0..n).map(|b| image(&d, b)).collect();
        let pairs: Vec<(usize, usize)> = (0..n).map(|b| (b, n - 1 - b)).collect();
        let targets = [
            Layout::fully_contiguous(d, n).unwrap(),
            Layout::layer_separate(d, n, BlockOrder::OuterMajor).unwrap(),
        ];
        for src_layout in layouts(d, n) {
            let src: Arc<dyn StorageTier> =
                Arc::new(MemoryTier::new(TierKind::Device, src_layout).unwrap());
            for (b, img) in images.iter().enumerate() {
                src.write_block_from_slice(b, img).unwrap();
            }
            for dst_layout in targets {
                for engine_path in [false, true] {
                    let dst: Arc<dyn StorageTier> = Arc::new(MemoryTier::host(dst_layout).unwrap());
                    for b in 0..n {
                        dst.write_block_from_slice(b, &vec![0xEE; d.bytes_per_block()])
                            .unwrap();
                    }
                    let out = if engine_path {
                        rt.block_on(eng.copy(src.clone(), dst.clone(), pairs.clone()))
                            .unwrap()
                    } else {
                        TransferEngine::copy_blocking(src.as_ref(), dst.as_ref(), &pairs).unwrap()
                    };
                    assert!(out.is_ok(), "{:?}", out.failed);
                    assert_eq!(out.blocks, n);
                    for (s, t) in &pairs {
                        assert!(
                            dst.read_block_to_vec(*t).unwrap() == images[*s],
                            "{n} blocks of {} B, {src_layout:?} -> {dst_layout:?}, engine \
                             {engine_path}: block {s} -> {t} differs",
                            d.bytes_per_block()
                        );
                    }
                }
            }
        }
    }
}
