//! The `memory` backend: blocks in page-aligned host RAM.
//!
//! It is the host tier (G2) when CUDA is off, and the device tier's stand-in in tests and the CLI
//! (vLLM's CPU backend really keeps its KV cache in host RAM). Any [`Layout`] is accepted, so it can
//! mirror an engine's layer-separate cache as well as a fully contiguous host pool.
//!
//! Soundness: the tier owns its allocations and hands out slices of them only under a per-block
//! reader/writer lock, so two callers never hold a mutable and another slice of the same block;
//! distinct blocks never overlap (layout invariant), so they need no mutual exclusion.

use std::io::{IoSlice, IoSliceMut};
use std::ptr::NonNull;

use parking_lot::RwLock;

use crate::error::{Error, Result};
use crate::layout::{KvLayout, Layout};
use crate::tier::{check_io, copy_segments, total_len, Capability, TierKind};

/// Alignment of every allocation: a page, so O_DIRECT disk I/O can use the memory directly.
pub const MEMORY_ALIGNMENT: usize = 4096;

/// One zeroed, page-aligned allocation, freed on drop: an anonymous private mapping, so the kernel
/// hands out zero pages as they are first touched. A tier's capacity then costs address space,
/// not start-up time: a heap allocation with this alignment is zeroed by a memset of every byte
/// (15 s of page faults for a 1M-token host tier in `kvbm sweep`, whatever the trace touched).
struct AlignedAlloc {
    ptr: NonNull<u8>,
    len: usize,
}

impl AlignedAlloc {
    fn new(len: usize) -> Result<Self> {
        if len == 0 || len > isize::MAX as usize - MEMORY_ALIGNMENT {
            return Err(Error::invalid_layout(format!(
                "allocation of {len} bytes is not representable"
            )));
        }
        // SAFETY: a fresh anonymous private mapping of `len` (> 0) bytes: no file, no address
        // hint; the result is checked for MAP_FAILED before use.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(Error::no_space("bytes of host memory", len, 0, len)
                .with("tier", "memory")
                .with("os_error", e));
        }
        // Mappings start on a page boundary: a multiple of MEMORY_ALIGNMENT (a test checks it).
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or_else(|| {
            Error::no_space("bytes of host memory", len, 0, len).with("tier", "memory")
        })?;
        Ok(Self { ptr, len })
    }
}

// SAFETY: an `AlignedAlloc` is a uniquely owned mapping; it is only unmapped by its drop and
// only read or written through `HostBlocks` under its per-block locks.
unsafe impl Send for AlignedAlloc {}
// SAFETY: see above; `&AlignedAlloc` gives no access to the bytes.
unsafe impl Sync for AlignedAlloc {}

impl Drop for AlignedAlloc {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with exactly this length, unmapped once. A failure cannot be
        // acted on here (the range stays mapped: a leak, never a use after free).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{BlockOrder, LayoutDims};
    use crate::tier::StorageTier;

    /// Resident set size of this process, from /proc (Linux).
    fn rss_bytes() -> Option<usize> {
        let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
        let pages: usize = statm.split_whitespace().nth(1)?.parse().ok()?;
        // SAFETY: sysconf reads a system constant; no memory is passed.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
        Some(pages * page)
    }

    #[test]
    fn a_tier_is_aligned_zeroed_and_costs_only_the_pages_it_touches() {
        // 2 GiB in 16 KiB blocks, two allocations (layer-separate).
        let dims = LayoutDims {
            num_layers: 2,
            outer_dim: 2,
            page_size: 16,
            inner_dim: 64,
            dtype_bytes: 2,
        };
        let blocks = 2 * 1024 * 1024 * 1024 / dims.bytes_per_block();
        let before = rss_bytes();
        let tier =
            MemoryTier::host(Layout::layer_separate(dims, blocks, BlockOrder::BlockMajor).unwrap())
                .unwrap();
        let after = rss_bytes();
        // A memset of every byte (what an over-aligned heap allocation does) makes all 2 GiB
        // resident at once; a mapping makes only the touched pages resident.
        if let (Some(b), Some(a)) = (before, after) {
            assert!(
                a.saturating_sub(b) < 512 << 20,
                "building a 2 GiB tier made {} MiB resident",
                (a - b) >> 20
            );
        }
        for a in &tier._allocations {
            assert_eq!(a.ptr.as_ptr() as usize % MEMORY_ALIGNMENT, 0);
        }
        for block in [0, blocks / 2, blocks - 1] {
            tier.with_block(block, &mut |runs| {
                assert!(runs.iter().all(|r| r.iter().all(|&b| b == 0)));
                Ok(())
            })
            .unwrap();
        }
        // Written bytes read back.
        let data = vec![7u8; dims.bytes_per_block()];
        tier.write_block(blocks - 1, &[IoSlice::new(&data)])
            .unwrap();
        tier.with_block(blocks - 1, &mut |runs| {
            assert!(runs.iter().all(|r| r.iter().all(|&b| b == 7)));
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn an_allocation_beyond_the_address_space_is_a_typed_error() {
        let e = AlignedAlloc::new(usize::MAX / 2).err().unwrap();
        assert!(e.to_string().contains("bytes"), "{e}");
    }
}
