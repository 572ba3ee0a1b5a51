//! Page-locked host memory as a tier: [`PinnedHostTier`], the host tier (G2) when CUDA is on.
//!
//! The memory tier's sibling: the same [`HostBlocks`] bookkeeping (any layout, host addressable, a
//! reader/writer lock per block), over `cuMemHostAlloc` allocations the tier owns and frees after
//! the blocks that point into them.

use std::sync::Arc;

use super::gpu::{CudaDevice, PinnedBuffer};
use crate::backends::memory::HostBlocks;
use crate::error::Result;
use crate::layout::{KvLayout, Layout};
use crate::tier::TierKind;

/// Blocks in page-locked host memory, in any layout: the host tier (G2) when CUDA is on. Like
/// the memory tier, host addressable, with a per-block reader/writer lock; device copies to and
/// from it run at the link's full rate without the driver's staging.
pub struct PinnedHostTier {
    blocks: HostBlocks,
    /// Declared after `blocks`, which points into them.
    _allocations: Vec<PinnedBuffer>,
}

impl std::fmt::Debug for PinnedHostTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedHostTier")
            .field("kind", &self.blocks.kind())
            .field("layout", self.blocks.layout())
            .finish_non_exhaustive()
    }
}

impl PinnedHostTier {
    /// Allocates a zeroed tier of `kind` with `layout` in pinned memory registered with `device`'s
    /// context (portable: usable from every context).
    pub fn new(device: &Arc<CudaDevice>, kind: TierKind, layout: Layout) -> Result<Self> {
        let allocations = (0..layout.num_allocations())
            .map(|_| device.alloc_pinned(layout.allocation_bytes()))
            .collect::<Result<Vec<_>>>()?;
        let bases = allocations.iter().map(|a| a.as_ptr()).collect();
        // SAFETY: each buffer is `allocation_bytes` long and owned by the tier, which drops it
        // after `blocks`; nothing else reaches it.
        let blocks = unsafe { HostBlocks::new(kind, layout, bases)? };
        Ok(Self {
            blocks,
            _allocations: allocations,
        })
    }

    /// A host (G2) tier.
    pub fn host(device: &Arc<CudaDevice>, layout: Layout) -> Result<Self> {
        Self::new(device, TierKind::Host, layout)
    }
}

crate::backends::memory::host_blocks_tier!(PinnedHostTier);
