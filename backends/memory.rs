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
use crate::tier::{check_io, copy_segments, total_len, Capability, TierKind};

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

// SAFETY: an `AlignedAlloc` is a uniquely owned heap allocation; it is only freed by its drop and
// only read or written through `HostBlocks` under its per-block locks.
unsafe impl Send for AlignedAlloc {}
// SAFETY: see above; `&AlignedAlloc` gives no access to the bytes.
unsafe impl Sync for AlignedAlloc {}

impl Drop for AlignedAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Block access over host memory that its owner keeps alive: the runs of each block from the
/// layout, a per-block reader/writer lock, and the four [`StorageTier`] block operations. The
/// memory tier, the pinned host tier (`cuda`) and the tensor tier (`python`) are this plus their
/// own way of owning the memory.
///
/// Soundness: slices of a block exist only under its lock (shared for reads, exclusive for
/// writes); distinct blocks never overlap (layout invariant), so they need no mutual exclusion.
pub(crate) struct HostBlocks {
    kind: TierKind,
    layout: Layout,
    bases: Vec<*mut u8>,
    locks: Box<[RwLock<()>]>,
}

// SAFETY: the raw pointers are only dereferenced through `&self` methods that take the block's
// lock first; blocks never overlap; `new`'s contract keeps the memory valid.
unsafe impl Send for HostBlocks {}
// SAFETY: see above.
unsafe impl Sync for HostBlocks {}

impl HostBlocks {
    /// Block access over `bases` (one per allocation of `layout`).
    ///
    /// # Safety
    /// Each `bases[i]` must point to `layout.allocation_bytes()` bytes that stay valid while this
    /// value lives and that nothing else writes meanwhile except through it.
    pub(crate) unsafe fn new(kind: TierKind, layout: Layout, bases: Vec<*mut u8>) -> Result<Self> {
        if bases.len() != layout.num_allocations() {
            return Err(Error::invalid_layout(format!(
                "{} allocations given for a layout of {}",
                bases.len(),
                layout.num_allocations()
            )));
        }
        let locks = (0..layout.num_blocks()).map(|_| RwLock::new(())).collect();
        Ok(Self {
            kind,
            layout,
            bases,
            locks,
        })
    }

    /// The tier kind errors name.
    pub(crate) fn kind(&self) -> TierKind {
        self.kind
    }

    /// The layout.
    pub(crate) fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The runs of `block` as raw (pointer, len) pairs, in canonical order.
    fn runs(&self, block: usize) -> Result<Vec<(*mut u8, usize)>> {
        let regions = self.layout.regions(block)?;
        let mut out = Vec::with_capacity(regions.len());
        for r in regions {
            let base = *self
                .bases
                .get(r.allocation)
                .ok_or_else(|| Error::internal("region names a missing allocation"))?;
            // SAFETY: layout invariant: offset + len <= allocation_bytes, each base's size.
            out.push((unsafe { base.add(r.offset) }, r.len));
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

    /// [`StorageTier::read_block`].
    pub(crate) fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> Result<()> {
        check_io(
            self.kind,
            "read_block",
            block,
            self.layout.num_blocks(),
            total_len(dst),
            self.layout.bytes_per_block(),
        )?;
        self.with_block(block, &mut |src| {
            copy_segments(src, dst);
            Ok(())
        })
    }

    /// [`StorageTier::write_block`].
    pub(crate) fn write_block(&self, block: usize, src: &[IoSlice<'_>]) -> Result<()> {
        check_io(
            self.kind,
            "write_block",
            block,
            self.layout.num_blocks(),
            total_len(src),
            self.layout.bytes_per_block(),
        )?;
        self.with_block_mut(block, &mut |dst| {
            copy_segments(src, dst);
            Ok(())
        })
    }

    /// [`StorageTier::with_block`].
    pub(crate) fn with_block(
        &self,
        block: usize,
        f: &mut dyn FnMut(&[IoSlice<'_>]) -> Result<()>,
    ) -> Result<()> {
        let _guard = self.lock("with_block", block)?.read();
        let runs = self.runs(block)?;
        let slices: Vec<IoSlice<'_>> = runs
            .iter()
            // SAFETY: the run lies inside live memory (`new`'s contract) and the shared lock
            // keeps writers of this block out while the slices live.
            .map(|&(p, len)| IoSlice::new(unsafe { std::slice::from_raw_parts(p, len) }))
            .collect();
        f(&slices)
    }

    /// [`StorageTier::with_block_mut`].
    pub(crate) fn with_block_mut(
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

/// Implements [`StorageTier`] for a type whose `blocks` field is a [`HostBlocks`]: every call goes
/// to it, with [`HOST_CAPABILITY`].
macro_rules! host_blocks_tier {
    ($ty:ty) => {
        impl $crate::tier::StorageTier for $ty {
            fn kind(&self) -> $crate::tier::TierKind {
                self.blocks.kind()
            }

            fn capability(&self) -> $crate::tier::Capability {
                $crate::backends::memory::HOST_CAPABILITY
            }

            fn layout(&self) -> &$crate::layout::Layout {
                self.blocks.layout()
            }

            fn read_block(
                &self,
                block: usize,
                dst: &mut [std::io::IoSliceMut<'_>],
            ) -> $crate::error::Result<()> {
                self.blocks.read_block(block, dst)
            }

            fn write_block(
                &self,
                block: usize,
                src: &[std::io::IoSlice<'_>],
            ) -> $crate::error::Result<()> {
                self.blocks.write_block(block, src)
            }

            fn with_block(
                &self,
                block: usize,
                f: &mut dyn FnMut(&[std::io::IoSlice<'_>]) -> $crate::error::Result<()>,
            ) -> $crate::error::Result<()> {
                self.blocks.with_block(block, f)
            }

            fn with_block_mut(
                &self,
                block: usize,
                f: &mut dyn FnMut(&mut [std::io::IoSliceMut<'_>]) -> $crate::error::Result<()>,
            ) -> $crate::error::Result<()> {
                self.blocks.with_block_mut(block, f)
            }
        }
    };
}
#[cfg(any(feature = "cuda", feature = "python"))]
pub(crate) use host_blocks_tier;

/// Capability of a host-addressable tier (RAM serves any number of parallel copies; the transfer
/// engine's own bound applies).
pub(crate) const HOST_CAPABILITY: Capability = Capability {
    host_addressable: true,
    direct_io_alignment: 1,
    checksummed: false,
    max_in_flight: 64,
};

/// Blocks in aligned host RAM, in any layout.
pub struct MemoryTier {
    blocks: HostBlocks,
    /// Declared after `blocks`, which points into them.
    _allocations: Vec<AlignedAlloc>,
}

impl std::fmt::Debug for MemoryTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryTier")
            .field("kind", &self.blocks.kind())
            .field("layout", self.blocks.layout())
            .finish_non_exhaustive()
    }
}

impl MemoryTier {
    /// Allocates a zeroed tier of `kind` with `layout`.
    pub fn new(kind: TierKind, layout: Layout) -> Result<Self> {
        let allocations = (0..layout.num_allocations())
            .map(|_| AlignedAlloc::new(layout.allocation_bytes()))
            .collect::<Result<Vec<_>>>()?;
        let bases = allocations.iter().map(|a| a.ptr.as_ptr()).collect();
        // SAFETY: each allocation is `allocation_bytes` long and is owned by the tier, which
        // drops it after `blocks`; nothing else reaches it.
        let blocks = unsafe { HostBlocks::new(kind, layout, bases)? };
        Ok(Self {
            blocks,
            _allocations: allocations,
        })
    }

    /// A host (G2) tier.
    pub fn host(layout: Layout) -> Result<Self> {
        Self::new(TierKind::Host, layout)
    }
}

host_blocks_tier!(MemoryTier);
