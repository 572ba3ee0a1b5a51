//! `kvbm bench --cuda` (feature `cuda`): the GPU device tier against the pinned host tier, each
//! path against one plain synchronous `cuMemcpy` (what `cudaMemcpy` does) of the same bytes
//! between the same device and pinned memory, interleaved. The limit source names how many
//! copies our side issued per transfer.

use std::ffi::c_void;

use super::*;
use kvbm_connector::backends::cuda::cudarc::driver::sys;
use kvbm_connector::backends::cuda::{
    self, CudaDevice, CudaDeviceTier, DeviceBuffer, PinnedHostTier,
};

#[derive(Clone, Copy)]
enum Dir {
    D2H,
    H2D,
}

/// A device tier over `bufs` (one per allocation of `layout`), which must outlive it.
fn register(
    dev: &Arc<CudaDevice>,
    layout: Layout,
    bufs: &[DeviceBuffer],
) -> Result<Arc<CudaDeviceTier>> {
    let ptrs: Vec<u64> = bufs.iter().map(|b| b.ptr()).collect();
    // SAFETY: the caller keeps `bufs` alive (declared before the tier, dropped after).
    unsafe { CudaDeviceTier::register(dev.clone(), layout, &ptrs) }
}

/// Runs `f` once and says how many copies the tier issued for it.
fn copies_of(tier: &CudaDeviceTier, f: &mut dyn FnMut() -> Result<()>) -> Result<String> {
    let b = tier.copy_stats();
    f()?;
    let a = tier.copy_stats();
    Ok(format!(
        "ours: {} plain + {} strided copies in {} batch(es)",
        a.copies_1d - b.copies_1d,
        a.copies_2d - b.copies_2d,
        a.batches - b.batches
    ))
}

/// A fixed permutation of `0..n` (xorshift Fisher-Yates).
fn shuffled(n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

pub(super) fn paths(blocks: usize, rounds: usize, ordinal: usize) -> Result<Vec<PathResult>> {
    if blocks == 0 {
        return Err(Error::invalid_argument("--cuda-blocks must be at least 1"));
    }
    let info = cuda::probe()?;
    let dev = CudaDevice::open(ordinal)?;
    let gpu = dev.info();
    eprintln!(
        "bench: CUDA GPU {ordinal}: {} (sm_{}{}, {} GiB), driver {} ({})",
        gpu.name,
        gpu.compute_capability.0,
        gpu.compute_capability.1,
        gpu.total_memory >> 30,
        info.driver_version_string(),
        info.library
    );
    let d = dims();
    let bytes = blocks * d.bytes_per_block();
    let host_tier = PinnedHostTier::host(&dev, Layout::fully_contiguous(d, blocks)?)?;
    let mut host_ptr = 0usize;
    host_tier.with_block(0, &mut |segs| {
        host_ptr = segs.first().map_or(0, |s| s.as_ptr() as usize);
        Ok(())
    })?;
    let host: Arc<dyn StorageTier> = Arc::new(host_tier);
    let fc_layout = Layout::fully_contiguous(d, blocks)?;
    let fc_bufs = vec![dev.alloc(fc_layout.allocation_bytes())?];
    let fc = register(&dev, fc_layout, &fc_bufs)?;
    let ls_layout = Layout::layer_separate(d, blocks, BlockOrder::OuterMajor)?;
    let ls_bufs = (0..ls_layout.num_allocations())
        .map(|_| dev.alloc(ls_layout.allocation_bytes()))
        .collect::<Result<Vec<_>>>()?;
    let ls = register(&dev, ls_layout, &ls_bufs)?;
    fc_bufs[0].fill(0x3C)?;
    for b in &ls_bufs {
        b.fill(0xC3)?;
    }
    let dptr = fc_bufs[0].ptr();
    // The limit: one synchronous copy of all the bytes, contiguous on both sides. The
    // pinned tier's memory is touched by nothing else while the bench runs.
    let plain = |dir: Dir| -> Result<()> {
        dev.bind()?;
        // SAFETY: `bytes` bytes at `host_ptr` (the pinned tier's one allocation) and at
        // `dptr` (the contiguous device buffer), both live for the whole bench.
        let r = unsafe {
            match dir {
                Dir::D2H => sys::cuMemcpyDtoH_v2(host_ptr as *mut c_void, dptr, bytes),
                Dir::H2D => sys::cuMemcpyHtoD_v2(dptr, host_ptr as *const c_void, bytes),
            }
        };
        // The backend's own driver-error wording is not public; the call and the code are.
        r.result().map_err(|e| {
            Error::new(ErrorKind::Io, format!("cuMemcpy failed: {e}")).with("cuda_call", "cuMemcpy")
        })
    };
    let seq: Vec<(usize, usize)> = (0..blocks).map(|i| (i, i)).collect();
    let scattered: Vec<(usize, usize)> = shuffled(blocks).into_iter().zip(0..blocks).collect();
    let copy = |src: &dyn StorageTier, dst: &dyn StorageTier, pairs: &[(usize, usize)]| {
        check_outcome(TransferEngine::copy_blocking(src, dst, pairs)?)
    };
    let mut out = Vec::new();
    type Case<'a> = (&'a str, Dir, &'a Arc<CudaDeviceTier>, &'a [(usize, usize)]);
    let cases: [Case<'_>; 5] = [
        ("device->pinned (contiguous)", Dir::D2H, &fc, &seq),
        ("pinned->device (contiguous)", Dir::H2D, &fc, &seq),
        (
            "device->pinned (layer-separate gather)",
            Dir::D2H,
            &ls,
            &seq,
        ),
        (
            "pinned->device (layer-separate scatter)",
            Dir::H2D,
            &ls,
            &seq,
        ),
        (
            "device->pinned (layer-separate, scattered)",
            Dir::D2H,
            &ls,
            &scattered,
        ),
    ];
    for (name, dir, tier, pairs) in cases {
        let mut ours = || match dir {
            Dir::D2H => copy(tier.as_ref(), host.as_ref(), pairs),
            Dir::H2D => copy(host.as_ref(), tier.as_ref(), pairs),
        };
        let copies = copies_of(tier, &mut ours)?;
        let (l, o) = interleaved(rounds, || plain(dir), &mut ours)?;
        let what = match dir {
            Dir::D2H => "cuMemcpyDtoH",
            Dir::H2D => "cuMemcpyHtoD",
        };
        out.push(bandwidth(
            name,
            bytes,
            l,
            o,
            &format!("one plain {what} of the same bytes, pinned; {copies}"),
        ));
    }
    // What the connector runs: the transfer engine with its default batches and concurrency.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .map_err(|e| Error::io("start a runtime", e))?;
    let cfg = TransferConfig::default();
    let engine = TransferEngine::new(&cfg)?;
    let ls_dyn: Arc<dyn StorageTier> = ls.clone();
    let mut ours = || {
        check_outcome(runtime.block_on(engine.copy(ls_dyn.clone(), host.clone(), seq.clone()))?)
    };
    let copies = copies_of(&ls, &mut ours)?;
    let (l, o) = interleaved(rounds, || plain(Dir::D2H), &mut ours)?;
    out.push(bandwidth(
        "device->pinned (gather, engine defaults)",
        bytes,
        l,
        o,
        &format!(
            "one plain cuMemcpyDtoH of the same bytes, pinned; batches of {}, {} in flight; {copies}",
            cfg.batch_blocks, cfg.max_concurrency
        ),
    ));
    drop((fc, ls));
    Ok(out)
}
