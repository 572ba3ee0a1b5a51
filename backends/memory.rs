//! The `memory` backend: blocks in page-aligned host RAM.
//!
//! It is the host tier (G2) when CUDA is off, and the device tier's stand-in in tests and the CLI
//! (vLLM's CPU backend really keeps its KV cache in host RAM). Any [`Layout`] is accepted, so it can
//! mirror an engine's layer-separate cache as well as a fully contiguous host pool.
//!
//! Soundness: the tier owns its allocations and hands out slices of them only under a per-block
//! reader/writer lock, so two callers never hold a mutable and another slice of the same block;
//! distinct blocks never overlap (layout invariant), so they need no mutual exclusion.

use std::alloc::{alloc_zeroed, dealloc, Layout as AllocLayout};
use std::io::{IoSlice, IoSliceMut};
use std::ptr::NonNull;

use parking_lot::RwLock;

use crate::error::{Error, Result};
use crate::layout::{KvLayout, Layout};
use crate::tier::{check_io, copy_segments, total_len, Capability, StorageTier, TierKind};

/// Alignment of every allocation: a page, so O_DIRECT disk I/O can use the memory directly.
pub const MEMORY_ALIGNMENT: usize = 4096;

/// One zeroed, page-aligned allocation, freed on drop.
struct AlignedAlloc {
    ptr: NonNull<u8>,
    layout: AllocLayout,
}

impl AlignedAlloc {
    fn new(len: usize) -> Result<Self> {
        let layout = AllocLayout::from_size_align(len, MEMORY_ALIGNMENT).map_err(|e| {
            Error::invalid_layout(format!(
                "allocation of {len} bytes is not representable: {e}"
            ))
        })?;
        // SAFETY: `len` is non-zero (layouts have no zero dimension) and the layout is valid.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            Error::no_space("bytes of host memory", len, 0, len).with("tier", "memory")
        })?;
        Ok(Self { ptr, layout })
    }
}

impl Drop for AlignedAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Blocks in aligned host RAM, in any layout.
pub struct MemoryTier {
    kind: TierKind,
    layout: Layout,
    allocations: Vec<AlignedAlloc>,
    locks: Box<[RwLock<()>]>,
}

// SAFETY: the raw allocations are only reached through `&self` methods that take the block's lock
// first (shared for reads, exclusive for writes); blocks never overlap.
unsafe impl Send for MemoryTier {}
// SAFETY: see above.
unsafe impl Sync for MemoryTier {}

impl std::fmt::Debug for MemoryTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryTier")
            .field("kind", &self.kind)
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

impl MemoryTier {
    /// Allocates a zeroed tier of `kind` with `layout`.
    pub fn new(kind: TierKind, layout: Layout) -> Result<Self> {
        let allocations = (0..layout.num_allocations())
            .map(|_| AlignedAlloc::new(layout.allocation_bytes()))
            .collect::<Result<Vec<_>>>()?;
        let locks = (0..layout.num_blocks()).map(|_| RwLock::new(())).collect();
        Ok(Self {
            kind,
            layout,
            allocations,
            locks,
        })
    }

    /// A host (G2) tier.
    pub fn host(layout: Layout) -> Result<Self> {
        Self::new(TierKind::Host, layout)
    }

    /// The runs of `block` as raw (pointer, len) pairs, in canonical order.
    fn runs(&self, block: usize) -> Result<Vec<(*mut u8, usize)>> {
        let regions = self.layout.regions(block)?;
        let mut out = Vec::with_capacity(regions.len());
        for r in regions {
            let alloc = self
                .allocations
                .get(r.allocation)
                .ok_or_else(|| Error::internal("region names a missing allocation"))?;
            // SAFETY: layout invariant: offset + len <= allocation_bytes, the allocation's size.
            out.push((unsafe { alloc.ptr.as_ptr().add(r.offset) }, r.len));
        }
        Ok(out)
    }

    fn lock(&self, op: &'static str, block: usize) -> Result<&RwLock<()>> {
        self.locks.get(block).ok_or_else(|| {
            Error::out_of_range("block", block, self.locks.len())
                .with("tier", self.kind)
                .with("op", op)
        })
    }
}

impl StorageTier for MemoryTier {
    fn kind(&self) -> TierKind {
        self.kind
    }

    fn capability(&self) -> Capability {
        Capability {
            host_addressable: true,
            direct_io_alignment: 1,
            checksummed: false,
            // RAM serves any number of parallel copies; the transfer engine's own bound applies.
            max_in_flight: 64,
        }
    }

    fn layout(&self) -> &Layout {
        &self.layout
    }

    fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> Result<()> {
        check_io(
            self.kind,
            "read_block",
            block,
            self.num_blocks(),
            total_len(dst),
            self.bytes_per_block(),
        )?;
        self.with_block(block, &mut |src| {
            copy_segments(src, dst);
            Ok(())
        })
    }

    fn write_block(&self, block: usize, src: &[IoSlice<'_>]) -> Result<()> {
        check_io(
            self.kind,
            "write_block",
            block,
            self.num_blocks(),
            total_len(src),
            self.bytes_per_block(),
        )?;
        self.with_block_mut(block, &mut |dst| {
            copy_segments(src, dst);
            Ok(())
        })
    }

    fn with_block(
        &self,
        block: usize,
        f: &mut dyn FnMut(&[IoSlice<'_>]) -> Result<()>,
    ) -> Result<()> {
        let _guard = self.lock("with_block", block)?.read();
        let runs = self.runs(block)?;
        let slices: Vec<IoSlice<'_>> = runs
            .iter()
            // SAFETY: the run lies inside a live allocation (see `runs`) and the shared lock keeps
            // writers of this block out while the slices live.
            .map(|&(p, len)| IoSlice::new(unsafe { std::slice::from_raw_parts(p, len) }))
            .collect();
        f(&slices)
    }

    fn with_block_mut(
        &self,
        block: usize,
        f: &mut dyn FnMut(&mut [IoSliceMut<'_>]) -> Result<()>,
    ) -> Result<()> {
        let _guard = self.lock("with_block_mut", block)?.write();
        let runs = self.runs(block)?;
        let mut slices: Vec<IoSliceMut<'_>> = runs
            .iter()
            // SAFETY: as in `with_block`; the exclusive lock makes these the only slices of this
            // block, and runs of one block never overlap each other.
            .map(|&(p, len)| IoSliceMut::new(unsafe { std::slice::from_raw_parts_mut(p, len) }))
            .collect();
        f(&mut slices)
    }
}
