//! `kvbm bench`'s disk paths: our disk tier against raw `O_DIRECT` reads and writes of the same
//! bytes, interleaved.

use super::*;

/// What both disk benches share: the raw limit's descriptor and per-block addresses (the same
/// memory our path uses), a runtime and a transfer engine with `in_flight` requests in flight.
pub(super) struct DiskRig {
    pub(super) ptrs: Vec<usize>,
    pub(super) raw: std::fs::File,
    pub(super) runtime: tokio::runtime::Runtime,
    pub(super) engine: TransferEngine,
    pub(super) pairs: Vec<(usize, usize)>,
    pub(super) in_flight: usize,
    /// "O_DIRECT" or "buffered".
    pub(super) kind: &'static str,
}

impl DiskRig {
    /// `mem` holds the blocks the limit moves; `path` is the tier's file, opened again for the
    /// raw calls (with O_DIRECT when `direct`).
    pub(super) fn new(
        mem: &dyn StorageTier,
        path: &std::path::Path,
        direct: bool,
        in_flight: usize,
    ) -> Result<Self> {
        let blocks = mem.num_blocks();
        let mut ptrs = Vec::with_capacity(blocks);
        for b in 0..blocks {
            mem.with_block(b, &mut |segs| {
                ptrs.push(segs.first().map_or(0, |s| s.as_ptr() as usize));
                Ok(())
            })?;
        }
        let mut oo = std::fs::OpenOptions::new();
        oo.read(true).write(true);
        if direct {
            oo.custom_flags(libc::O_DIRECT);
        }
        let raw = oo
            .open(path)
            .map_err(|e| Error::io("open the disk tier's file for the raw limit", e))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .build()
            .map_err(|e| Error::io("start a runtime", e))?;
        let engine = TransferEngine::new(&TransferConfig {
            max_concurrency: in_flight,
            batch_blocks: 1,
            ..Default::default()
        })?;
        Ok(Self {
            ptrs,
            raw,
            runtime,
            engine,
            pairs: (0..blocks).map(|i| (i, i)).collect(),
            in_flight,
            kind: if direct { "O_DIRECT" } else { "buffered" },
        })
    }

    /// Raw `pwrite`/`pread` of every block between its memory and its slot.
    pub(super) fn raw(&self, bpb: usize, slot: usize, write: bool) -> Result<()> {
        raw_direct(
            self.raw.as_raw_fd(),
            &self.ptrs,
            bpb,
            slot,
            self.in_flight,
            write,
        )
    }

    /// Our path: every block through the transfer engine.
    pub(super) fn copy(
        &self,
        src: &Arc<dyn StorageTier>,
        dst: &Arc<dyn StorageTier>,
    ) -> Result<()> {
        check_outcome(
            self.runtime.block_on(self.engine.copy(
                src.clone(),
                dst.clone(),
                self.pairs.clone(),
            ))?,
        )
    }
}

pub(super) fn disk_paths(
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
    let rig = DiskRig::new(mem.as_ref(), &path, note.is_none(), in_flight)?;
    let kind = rig.kind;
    // Each raw write is followed by ours, which restores the tier's checksums before reads.
    let (l, o) = interleaved(
        rounds,
        || rig.raw(bpb, slot, true),
        || rig.copy(&mem, &disk),
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
        || rig.raw(bpb, slot, false),
        || rig.copy(&disk, &mem),
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
