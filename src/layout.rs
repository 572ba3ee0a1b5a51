//! How one KV block sits in memory: the [`KvLayout`] trait, its built-in shapes, and the
//! invariants any layout keeps.
//!
//! Dimensions ([`LayoutDims`]): `num_layers`, `outer_dim` (2 = K and V, 1 = an MLA latent),
//! `page_size` (tokens per block), `inner_dim` (elements per token per layer per outer index) and
//! `dtype_bytes`. `bytes_per_block = num_layers × outer_dim × page_size × inner_dim × dtype_bytes`.
//!
//! * [`FullyContiguous`]: one allocation `[num_blocks][num_layers][outer_dim][page_size × inner_dim]`;
//!   a block is one run of bytes (our host and disk tiers use it).
//! * [`LayerSeparate`]: one allocation per layer, either block-major `[num_blocks][outer_dim][...]`
//!   or outer-major `[outer_dim][num_blocks][...]`; a block is `num_layers × outer_dim` separate
//!   runs.
//!   Or head-major ([`BlockOrder::HeadMajor`]), split by head inside each block:
//!   `[num_blocks][num_heads][outer_dim][page_size][head_dim]` (`inner_dim = num_heads ×
//!   head_dim`), each (block, head) slab all of K for its tokens, then all of V (vLLM's CPU
//!   attention); a block is then `num_layers × outer_dim × page_size × num_heads` runs of one
//!   head's `head_dim` elements (`num_layers × outer_dim` when there is one head).
//! * Any other arrangement: implement [`KvLayout`] and list each block's runs with
//!   [`Regions::from_runs`]; [`check_layout`] verifies the invariants below.
//!
//! Every layout numbers a block's bytes in *canonical order*: the block's fully contiguous image is
//! `[num_layers][outer_dim][page_size × inner_dim]`, and each run ([`Region`]) names where in that
//! image its bytes belong (`canonical_offset`). A copy between any two layouts is then a gather or
//! scatter of runs with matching canonical offsets. Which engine registers which shape, and how its
//! tensors are read, is the adapters' business (`frameworks/`).
//!
//! Invariants: a constructed layout has no zero dimension, and every byte offset it can produce
//! (`num_blocks × bytes_per_block` included) fits in `usize`; so region math after construction
//! never overflows. The runs of one block tile its canonical image exactly once and lie inside
//! their allocations; runs of different blocks never overlap.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Dimensions of one KV block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayoutDims {
    /// Transformer layers.
    pub num_layers: usize,
    /// 2 for separate K and V, 1 for an MLA latent.
    pub outer_dim: usize,
    /// Tokens per block.
    pub page_size: usize,
    /// Elements per token per layer per outer index (kv heads × head dim).
    pub inner_dim: usize,
    /// Bytes per element (1, 2, 4 or 8).
    pub dtype_bytes: usize,
}

impl LayoutDims {
    /// Checks every dimension is non-zero, `dtype_bytes` is 1, 2, 4 or 8, and `bytes_per_block`
    /// fits in `usize`.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("num_layers", self.num_layers),
            ("outer_dim", self.outer_dim),
            ("page_size", self.page_size),
            ("inner_dim", self.inner_dim),
            ("dtype_bytes", self.dtype_bytes),
        ] {
            if v == 0 {
                return Err(
                    Error::invalid_layout(format!("{name} must be non-zero")).with("dim", name)
                );
            }
        }
        if !matches!(self.dtype_bytes, 1 | 2 | 4 | 8) {
            return Err(Error::invalid_layout(format!(
                "dtype_bytes must be 1, 2, 4 or 8, got {}",
                self.dtype_bytes
            )));
        }
        self.checked_bytes_per_block().map(|_| ())
    }

    fn checked_region_bytes(&self) -> Result<usize> {
        self.page_size
            .checked_mul(self.inner_dim)
            .and_then(|v| v.checked_mul(self.dtype_bytes))
            .ok_or_else(|| overflow("page_size × inner_dim × dtype_bytes"))
    }

    fn checked_bytes_per_block(&self) -> Result<usize> {
        self.checked_region_bytes()?
            .checked_mul(self.num_layers)
            .and_then(|v| v.checked_mul(self.outer_dim))
            .ok_or_else(|| overflow("bytes_per_block"))
    }

    /// Bytes of one (layer, outer) run of a block. Call on validated dims.
    pub fn region_bytes(&self) -> usize {
        self.page_size * self.inner_dim * self.dtype_bytes
    }

    /// Bytes of one whole block. Call on validated dims.
    pub fn bytes_per_block(&self) -> usize {
        self.region_bytes() * self.num_layers * self.outer_dim
    }

    /// Runs per block in canonical order (`num_layers × outer_dim`).
    pub fn regions_per_block(&self) -> usize {
        self.num_layers * self.outer_dim
    }

    /// Checks [`validate`](Self::validate), a non-zero `num_blocks`, and that
    /// `num_blocks × bytes_per_block` fits in `usize`: what every layout's constructor checks, so
    /// that its region math cannot overflow afterwards.
    pub fn validate_cache(&self, num_blocks: usize) -> Result<()> {
        self.validate()?;
        if num_blocks == 0 {
            return Err(
                Error::invalid_layout("num_blocks must be non-zero").with("dim", "num_blocks")
            );
        }
        self.bytes_per_block()
            .checked_mul(num_blocks)
            .ok_or_else(|| overflow("num_blocks × bytes_per_block"))?;
        Ok(())
    }
}

fn overflow(what: &str) -> Error {
    Error::invalid_layout(format!("{what} overflows usize"))
}

/// Which of the built-in shapes a layout has ([`Layout::kind`]).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    strum::Display,
    strum::EnumString,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum LayoutKind {
    /// `[num_blocks][num_layers][outer_dim][...]` in one allocation.
    FullyContiguous,
    /// Per layer `[num_blocks][outer_dim][...]`.
    LayerSeparateBlockMajor,
    /// Per layer `[outer_dim][num_blocks][...]`.
    LayerSeparateOuterMajor,
    /// Per layer `[num_blocks][num_heads][outer_dim][page_size][head_dim]`.
    LayerSeparateHeadMajor,
}

/// One run of a block's bytes inside one allocation.
///
/// A layout's runs keep the invariants listed on [`KvLayout::regions`]; [`check_layout`] verifies
/// them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Which allocation, `< num_allocations()` (0 for fully contiguous; the layer for layer
    /// separate).
    pub allocation: usize,
    /// Byte offset inside that allocation; `offset + len <= allocation_bytes()`.
    pub offset: usize,
    /// Length in bytes, non-zero.
    pub len: usize,
    /// Byte offset of this run inside the block's canonical (fully contiguous) image.
    pub canonical_offset: usize,
}

/// Where the bytes of each block of a cache live.
///
/// Object safe; implemented by [`FullyContiguous`], [`LayerSeparate`] and the serialisable
/// [`Layout`], and open to layouts defined elsewhere (an engine's own cache shape): such a layout
/// lists its runs with [`Regions::from_runs`] and keeps the invariants below, which
/// [`check_layout`] verifies. The transfer path reads and writes blocks as canonical images, so a
/// layout only has to say where each piece of the image lives.
///
/// Invariants of an implementation:
/// * `dims()` passes [`LayoutDims::validate_cache`] with `num_blocks()`;
/// * `num_allocations() >= 1`, every allocation is `allocation_bytes()` long, and
///   [`total_bytes`](Self::total_bytes) fits in `usize`;
/// * the defaults of [`bytes_per_block`](Self::bytes_per_block) and
///   [`total_bytes`](Self::total_bytes) are kept;
/// * the runs of [`regions`](Self::regions) keep the invariants listed there.
pub trait KvLayout: Send + Sync + std::fmt::Debug {
    /// The block dimensions.
    fn dims(&self) -> &LayoutDims;
    /// Blocks in the cache.
    fn num_blocks(&self) -> usize;
    /// Separate allocations backing the cache (1 for fully contiguous, `num_layers` for layer
    /// separate).
    fn num_allocations(&self) -> usize;
    /// Bytes of each allocation.
    fn allocation_bytes(&self) -> usize;

    /// The runs of `block`, in canonical order; merged into one run when the block is contiguous.
    ///
    /// For `block < num_blocks()`: each run is non-empty and lies inside its allocation
    /// (`allocation < num_allocations()`, `offset + len <= allocation_bytes()`); the first run's
    /// `canonical_offset` is 0 and each next one starts where the one before ended, so together
    /// they tile `[0, bytes_per_block)` exactly once; no two runs of this or any other block
    /// overlap. A `block` out of range is an [`crate::ErrorKind::OutOfRange`] error
    /// ([`check_block`]).
    fn regions(&self, block: usize) -> Result<Regions>;

    /// Bytes of one block.
    fn bytes_per_block(&self) -> usize {
        self.dims().bytes_per_block()
    }
    /// Total bytes over all allocations.
    fn total_bytes(&self) -> usize {
        self.allocation_bytes() * self.num_allocations()
    }
}

/// Iterator over the runs of one block, as [`KvLayout::regions`] returns them.
///
/// The built-in layouts compute their runs on the fly (no allocation); a layout defined elsewhere
/// hands its list to [`Regions::from_runs`].
#[derive(Debug, Clone)]
pub struct Regions(Runs);

#[derive(Debug, Clone)]
enum Runs {
    /// Run `next..end` of `block` of a built-in layout.
    Computed {
        kind: LayoutKind,
        dims: LayoutDims,
        num_blocks: usize,
        /// Heads per (layer, outer) page: 1 except for [`LayoutKind::LayerSeparateHeadMajor`].
        heads: usize,
        block: usize,
        next: usize,
        end: usize,
    },
    /// Runs listed by the layout.
    Listed(std::vec::IntoIter<Region>),
}

impl Regions {
    /// The runs of one block, in canonical order, as a layout defined outside this crate lists
    /// them. They must keep the invariants of [`KvLayout::regions`].
    pub fn from_runs(runs: Vec<Region>) -> Self {
        Self(Runs::Listed(runs.into_iter()))
    }

    fn computed(
        kind: LayoutKind,
        dims: LayoutDims,
        num_blocks: usize,
        heads: usize,
        block: usize,
    ) -> Self {
        let end = match kind {
            LayoutKind::FullyContiguous => 1,
            LayoutKind::LayerSeparateHeadMajor if heads > 1 => {
                dims.regions_per_block() * dims.page_size * heads
            }
            _ => dims.regions_per_block(),
        };
        Self(Runs::Computed {
            kind,
            dims,
            num_blocks,
            heads,
            block,
            next: 0,
            end,
        })
    }
}

impl Iterator for Regions {
    type Item = Region;

    fn next(&mut self) -> Option<Region> {
        let (kind, d, num_blocks, heads, block, r) = match &mut self.0 {
            Runs::Listed(runs) => return runs.next(),
            Runs::Computed {
                kind,
                dims,
                num_blocks,
                heads,
                block,
                next,
                end,
            } => {
                if *next >= *end {
                    return None;
                }
                *next += 1;
                (*kind, &*dims, *num_blocks, *heads, *block, *next - 1)
            }
        };
        // One head: head-major is block-major memory, each (block, outer) page one run.
        let kind = match kind {
            LayoutKind::LayerSeparateHeadMajor if heads <= 1 => LayoutKind::LayerSeparateBlockMajor,
            k => k,
        };
        Some(match kind {
            LayoutKind::FullyContiguous => Region {
                allocation: 0,
                offset: block * d.bytes_per_block(),
                len: d.bytes_per_block(),
                canonical_offset: 0,
            },
            LayoutKind::LayerSeparateBlockMajor => {
                let (layer, outer) = (r / d.outer_dim, r % d.outer_dim);
                let rb = d.region_bytes();
                Region {
                    allocation: layer,
                    offset: (block * d.outer_dim + outer) * rb,
                    len: rb,
                    canonical_offset: r * rb,
                }
            }
            LayoutKind::LayerSeparateOuterMajor => {
                let (layer, outer) = (r / d.outer_dim, r % d.outer_dim);
                let rb = d.region_bytes();
                Region {
                    allocation: layer,
                    offset: (outer * num_blocks + block) * rb,
                    len: rb,
                    canonical_offset: r * rb,
                }
            }
            LayoutKind::LayerSeparateHeadMajor => {
                // Run r is (layer, outer, token, head) in canonical order: one head's elements of
                // one token, at [block][head][outer][token] of the layer's allocation.
                let head = r % heads;
                let token = (r / heads) % d.page_size;
                let lo = r / heads / d.page_size;
                let (layer, outer) = (lo / d.outer_dim, lo % d.outer_dim);
                let hb = d.inner_dim / heads * d.dtype_bytes;
                let row = ((block * heads + head) * d.outer_dim + outer) * d.page_size + token;
                Region {
                    allocation: layer,
                    offset: row * hb,
                    len: hb,
                    canonical_offset: r * hb,
                }
            }
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match &self.0 {
            Runs::Listed(runs) => runs.size_hint(),
            Runs::Computed { next, end, .. } => {
                let n = end - next;
                (n, Some(n))
            }
        }
    }
}

impl ExactSizeIterator for Regions {}

/// The error every layout returns for a `block` outside `0..num_blocks`
/// ([`crate::ErrorKind::OutOfRange`]).
pub fn check_block(block: usize, num_blocks: usize) -> Result<()> {
    if block >= num_blocks {
        return Err(Error::out_of_range("block", block, num_blocks));
    }
    Ok(())
}

/// Checks the invariants of [`KvLayout`] on `layout`, over every block: its dimensions, each
/// block's runs (non-empty, inside their allocations, tiling the canonical image in order), that no
/// two runs overlap, and that the block past the end is refused. Takes time and memory in
/// proportion to the runs of the whole cache: for an implementation's tests, or to vet a layout
/// once before trusting it.
pub fn check_layout(layout: &dyn KvLayout) -> Result<()> {
    let dims = layout.dims();
    dims.validate_cache(layout.num_blocks())?;
    let bytes_per_block = layout.bytes_per_block();
    let (allocations, allocation_bytes) = (layout.num_allocations(), layout.allocation_bytes());
    if bytes_per_block != dims.bytes_per_block() || allocations == 0 {
        return Err(Error::invalid_layout(format!(
            "{bytes_per_block}-byte blocks over {allocations} allocations do not match dimensions {dims:?}"
        )));
    }
    allocations
        .checked_mul(allocation_bytes)
        .ok_or_else(|| overflow("num_allocations × allocation_bytes"))?;
    let bad = |block: usize, r: &Region, why: &str| {
        Error::invalid_layout(format!("run {r:?} of block {block} {why}")).with("block", block)
    };
    // (allocation, offset, end, block) of every run, for the overlap check.
    let mut spans = Vec::new();
    for block in 0..layout.num_blocks() {
        let mut canonical = 0usize;
        for r in layout.regions(block)? {
            if r.len == 0 || r.canonical_offset != canonical {
                return Err(bad(
                    block,
                    &r,
                    &format!("is empty or does not start at canonical byte {canonical}"),
                ));
            }
            let end = r
                .offset
                .checked_add(r.len)
                .filter(|&e| e <= allocation_bytes);
            let Some(end) = end.filter(|_| r.allocation < allocations) else {
                return Err(bad(block, &r, "lies outside its allocation"));
            };
            canonical = canonical
                .checked_add(r.len)
                .filter(|&c| c <= bytes_per_block)
                .ok_or_else(|| bad(block, &r, "runs past the end of the canonical image"))?;
            spans.push((r.allocation, r.offset, end, block));
        }
        if canonical != bytes_per_block {
            return Err(Error::invalid_layout(format!(
                "the runs of block {block} cover {canonical} canonical bytes, not {bytes_per_block}"
            ))
            .with("block", block));
        }
    }
    spans.sort_unstable();
    if let Some(w) = spans
        .windows(2)
        .find(|w| w[0].0 == w[1].0 && w[0].2 > w[1].1)
    {
        return Err(Error::invalid_layout(format!(
            "runs of blocks {} and {} overlap in allocation {}",
            w[0].3, w[1].3, w[0].0
        )));
    }
    match layout.regions(layout.num_blocks()) {
        Err(e) if e.kind() == crate::ErrorKind::OutOfRange => Ok(()),
        _ => Err(Error::invalid_layout(format!(
            "block {} is past the end but not refused as out of range",
            layout.num_blocks()
        ))),
    }
}

/// One allocation `[num_blocks][num_layers][outer_dim][page_size × inner_dim]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FullyContiguous {
    dims: LayoutDims,
    num_blocks: usize,
}

impl FullyContiguous {
    /// Validates and builds the layout.
    pub fn new(dims: LayoutDims, num_blocks: usize) -> Result<Self> {
        dims.validate_cache(num_blocks)?;
        Ok(Self { dims, num_blocks })
    }

    /// Always [`LayoutKind::FullyContiguous`].
    pub fn kind(&self) -> LayoutKind {
        LayoutKind::FullyContiguous
    }
}

impl KvLayout for FullyContiguous {
    fn dims(&self) -> &LayoutDims {
        &self.dims
    }
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    fn num_allocations(&self) -> usize {
        1
    }
    fn allocation_bytes(&self) -> usize {
        self.num_blocks * self.dims.bytes_per_block()
    }
    fn regions(&self, block: usize) -> Result<Regions> {
        check_block(block, self.num_blocks)?;
        Ok(Regions::computed(
            self.kind(),
            self.dims,
            self.num_blocks,
            1,
            block,
        ))
    }
}

/// How a layer-separate allocation orders its blocks, K/V (outer) indices and heads.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    strum::Display,
    strum::EnumString,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum BlockOrder {
    /// `[num_blocks][outer_dim][...]`.
    BlockMajor,
    /// `[outer_dim][num_blocks][...]`.
    OuterMajor,
    /// `[num_blocks][num_heads][outer_dim][page_size][head_dim]` (`inner_dim = num_heads ×
    /// head_dim`): each block split by head, every (block, head) slab holding its outer indices
    /// (K, then V) one after the other, `page_size × head_dim` elements each. vLLM's CPU
    /// attention backend (`CPU_ATTN`) keeps its cache so: per layer a tensor of shape
    /// `[num_blocks, num_heads, page_size, 2 × head_dim]` that its kernels view as `[num_blocks,
    /// num_heads, 2 × page_size, head_dim]` and split in two along the page dimension (so the
    /// last dimension does *not* hold a token's K and V side by side). A block is `num_layers ×
    /// outer_dim × page_size × num_heads` runs of one head's elements of one token. With one head
    /// it is block-major memory. Built with [`LayerSeparate::head_major`].
    HeadMajor,
}

/// One allocation per layer, block-major, outer-major or head-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerSeparate {
    dims: LayoutDims,
    num_blocks: usize,
    order: BlockOrder,
    /// Heads a block is split by ([`BlockOrder::HeadMajor`]); 1 otherwise.
    #[serde(default = "one")]
    num_heads: usize,
}

fn one() -> usize {
    1
}

impl LayerSeparate {
    /// Validates and builds a block-major or outer-major layout; head-major needs the head count
    /// ([`LayerSeparate::head_major`]) and is refused here.
    pub fn new(dims: LayoutDims, num_blocks: usize, order: BlockOrder) -> Result<Self> {
        if order == BlockOrder::HeadMajor {
            return Err(Error::invalid_argument(
                "a head-major layout needs its head count: use LayerSeparate::head_major",
            ));
        }
        dims.validate_cache(num_blocks)?;
        Ok(Self {
            dims,
            num_blocks,
            order,
            num_heads: 1,
        })
    }

    /// Validates and builds a head-major layout ([`BlockOrder::HeadMajor`]): `num_heads` must be
    /// non-zero and divide `inner_dim`.
    pub fn head_major(dims: LayoutDims, num_blocks: usize, num_heads: usize) -> Result<Self> {
        dims.validate_cache(num_blocks)?;
        if num_heads == 0 || dims.inner_dim % num_heads != 0 {
            return Err(Error::invalid_layout(format!(
                "num_heads {num_heads} must be non-zero and divide inner_dim {}",
                dims.inner_dim
            ))
            .with("dim", "num_heads"));
        }
        Ok(Self {
            dims,
            num_blocks,
            order: BlockOrder::HeadMajor,
            num_heads,
        })
    }

    /// Block-major, outer-major or head-major.
    pub fn order(&self) -> BlockOrder {
        self.order
    }

    /// Heads each block is split by (1 unless head-major).
    pub fn num_heads(&self) -> usize {
        self.num_heads
    }

    /// [`LayoutKind::LayerSeparateBlockMajor`], [`LayoutKind::LayerSeparateOuterMajor`] or
    /// [`LayoutKind::LayerSeparateHeadMajor`].
    pub fn kind(&self) -> LayoutKind {
        match self.order {
            BlockOrder::BlockMajor => LayoutKind::LayerSeparateBlockMajor,
            BlockOrder::OuterMajor => LayoutKind::LayerSeparateOuterMajor,
            BlockOrder::HeadMajor => LayoutKind::LayerSeparateHeadMajor,
        }
    }
}

impl KvLayout for LayerSeparate {
    fn dims(&self) -> &LayoutDims {
        &self.dims
    }
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    fn num_allocations(&self) -> usize {
        self.dims.num_layers
    }
    fn allocation_bytes(&self) -> usize {
        self.num_blocks * self.dims.outer_dim * self.dims.region_bytes()
    }
    fn regions(&self, block: usize) -> Result<Regions> {
        check_block(block, self.num_blocks)?;
        Ok(Regions::computed(
            self.kind(),
            self.dims,
            self.num_blocks,
            self.num_heads,
            block,
        ))
    }
}

/// Any built-in layout, as a value: what tiers hold and configs and wire messages carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Layout {
    /// See [`FullyContiguous`].
    FullyContiguous(FullyContiguous),
    /// See [`LayerSeparate`].
    LayerSeparate(LayerSeparate),
}

impl Layout {
    /// A fully contiguous layout.
    pub fn fully_contiguous(dims: LayoutDims, num_blocks: usize) -> Result<Self> {
        FullyContiguous::new(dims, num_blocks).map(Layout::FullyContiguous)
    }

    /// A layer-separate layout.
    pub fn layer_separate(dims: LayoutDims, num_blocks: usize, order: BlockOrder) -> Result<Self> {
        LayerSeparate::new(dims, num_blocks, order).map(Layout::LayerSeparate)
    }

    /// A layer-separate layout split by head inside each block ([`BlockOrder::HeadMajor`]).
    pub fn layer_separate_head_major(
        dims: LayoutDims,
        num_blocks: usize,
        num_heads: usize,
    ) -> Result<Self> {
        LayerSeparate::head_major(dims, num_blocks, num_heads).map(Layout::LayerSeparate)
    }

    /// The same dimensions with another block count, fully contiguous (host and disk tiers).
    pub fn contiguous_with_blocks(&self, num_blocks: usize) -> Result<Self> {
        Self::fully_contiguous(*self.dims(), num_blocks)
    }

    /// Which built-in shape this is.
    pub fn kind(&self) -> LayoutKind {
        match self {
            Layout::FullyContiguous(l) => l.kind(),
            Layout::LayerSeparate(l) => l.kind(),
        }
    }

    fn inner(&self) -> &dyn KvLayout {
        match self {
            Layout::FullyContiguous(l) => l,
            Layout::LayerSeparate(l) => l,
        }
    }
}

impl KvLayout for Layout {
    fn dims(&self) -> &LayoutDims {
        self.inner().dims()
    }
    fn num_blocks(&self) -> usize {
        self.inner().num_blocks()
    }
    fn num_allocations(&self) -> usize {
        self.inner().num_allocations()
    }
    fn allocation_bytes(&self) -> usize {
        self.inner().allocation_bytes()
    }
    fn regions(&self, block: usize) -> Result<Regions> {
        self.inner().regions(block)
    }
}

/// Checks that a registered base address is aligned to `align` bytes (a power of two).
pub fn check_alignment(what: &str, addr: usize, align: usize) -> Result<()> {
    if align == 0 || !align.is_power_of_two() {
        return Err(Error::invalid_argument(format!(
            "alignment {align} is not a power of two"
        )));
    }
    if addr % align != 0 {
        return Err(Error::invalid_layout(format!(
            "{what} at {addr:#x} is not aligned to {align} bytes"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims() -> LayoutDims {
        LayoutDims {
            num_layers: 3,
            outer_dim: 2,
            page_size: 4,
            inner_dim: 8,
            dtype_bytes: 2,
        }
    }

    #[test]
    fn regions_cover_the_block_once() {
        for layout in [
            Layout::fully_contiguous(dims(), 5).unwrap(),
            Layout::layer_separate(dims(), 5, BlockOrder::BlockMajor).unwrap(),
            Layout::layer_separate(dims(), 5, BlockOrder::OuterMajor).unwrap(),
            Layout::layer_separate_head_major(dims(), 5, 1).unwrap(),
            Layout::layer_separate_head_major(dims(), 5, 2).unwrap(),
            Layout::layer_separate_head_major(dims(), 5, 4).unwrap(),
        ] {
            let bpb = layout.bytes_per_block();
            // Canonical offsets tile [0, bpb) exactly.
            let mut covered = 0;
            for r in layout.regions(3).unwrap() {
                assert_eq!(r.canonical_offset, covered);
                covered += r.len;
                assert!(r.offset + r.len <= layout.allocation_bytes());
            }
            assert_eq!(covered, bpb);
            check_layout(&layout).unwrap();
        }
    }

    /// Head-major runs land where vLLM's CPU cache tensor `[blocks, heads, page, 2 × head_dim]`
    /// (viewed `[blocks, heads, 2 × page, head_dim]`, K then V) holds each element, computed here
    /// from that shape and not from the layout's own formula.
    #[test]
    fn head_major_runs_match_the_cpu_attention_tensor() {
        let d = dims(); // 3 layers, 2 outer, 4 tokens, inner 8, 2 bytes
        let heads = 2;
        let hd = d.inner_dim / heads;
        let blocks = 5;
        let l = Layout::layer_separate_head_major(d, blocks, heads).unwrap();
        assert_eq!(l.kind(), LayoutKind::LayerSeparateHeadMajor);
        assert_eq!(l.num_allocations(), 3);
        assert_eq!(
            l.allocation_bytes(),
            blocks * heads * d.page_size * 2 * hd * 2
        );
        for block in 0..blocks {
            let runs: Vec<Region> = l.regions(block).unwrap().collect();
            assert_eq!(runs.len(), 3 * 2 * d.page_size * heads);
            let mut i = 0;
            for layer in 0..3 {
                for kv in 0..2 {
                    for token in 0..d.page_size {
                        for head in 0..heads {
                            // Element [block, head, kv * page + token, 0] of the viewed tensor.
                            let elem = ((block * heads + head) * 2 * d.page_size
                                + kv * d.page_size
                                + token)
                                * hd;
                            assert_eq!(runs[i].allocation, layer);
                            assert_eq!(runs[i].offset, elem * 2, "run {i} of block {block}");
                            assert_eq!(runs[i].len, hd * 2);
                            i += 1;
                        }
                    }
                }
            }
        }
        // One head is block-major memory, in the same runs.
        let one = Layout::layer_separate_head_major(d, blocks, 1).unwrap();
        let bm = Layout::layer_separate(d, blocks, BlockOrder::BlockMajor).unwrap();
        for b in 0..blocks {
            assert_eq!(
                one.regions(b).unwrap().collect::<Vec<_>>(),
                bm.regions(b).unwrap().collect::<Vec<_>>()
            );
        }
        for bad in [0, 3] {
            let e = Layout::layer_separate_head_major(d, blocks, bad).unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::InvalidLayout);
        }
    }

    /// The runs of a block.
    type RunsOf = fn(usize) -> Vec<Region>;

    /// A layout that lists whatever runs it is given for every block (one allocation).
    #[derive(Debug)]
    struct Listed {
        dims: LayoutDims,
        allocation_bytes: usize,
        runs: RunsOf,
    }

    impl KvLayout for Listed {
        fn dims(&self) -> &LayoutDims {
            &self.dims
        }
        fn num_blocks(&self) -> usize {
            2
        }
        fn num_allocations(&self) -> usize {
            1
        }
        fn allocation_bytes(&self) -> usize {
            self.allocation_bytes
        }
        fn regions(&self, block: usize) -> Result<Regions> {
            check_block(block, 2)?;
            Ok(Regions::from_runs((self.runs)(block)))
        }
    }

    #[test]
    fn check_layout_refuses_broken_runs() {
        let d = LayoutDims {
            num_layers: 1,
            outer_dim: 1,
            page_size: 1,
            inner_dim: 8,
            dtype_bytes: 1,
        };
        fn run(allocation: usize, offset: usize, len: usize, canonical_offset: usize) -> Region {
            Region {
                allocation,
                offset,
                len,
                canonical_offset,
            }
        }
        let listed = |runs: RunsOf| Listed {
            dims: d,
            allocation_bytes: 16,
            runs,
        };
        // Two 4-byte runs per block, the halves swapped: fine.
        check_layout(&listed(|b| {
            vec![run(0, b * 8 + 4, 4, 0), run(0, b * 8, 4, 4)]
        }))
        .unwrap();
        let broken: [(RunsOf, &str); 5] = [
            (|b| vec![run(0, b * 4, 8, 0)], "overlap"),
            (|b| vec![run(0, b * 8, 4, 0)], "cover"),
            (
                |b| vec![run(0, b * 8, 4, 4), run(0, b * 8 + 4, 4, 0)],
                "canonical byte",
            ),
            (|b| vec![run(1, b * 8, 8, 0)], "outside"),
            (|b| vec![run(0, b * 8 + 4, 8, 0)], "outside"),
        ];
        for (runs, why) in broken {
            let e = check_layout(&listed(runs)).unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::InvalidLayout);
            assert!(e.to_string().contains(why), "{why}: {e}");
        }
    }
}
