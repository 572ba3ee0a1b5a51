//! How one KV block sits in memory: the [`KvLayout`] trait and its two shapes.
//!
//! Dimensions ([`LayoutDims`]): `num_layers`, `outer_dim` (2 = K and V, 1 = an MLA latent),
//! `page_size` (tokens per block), `inner_dim` (heads × head_dim) and `dtype_bytes`.
//! `bytes_per_block = num_layers × outer_dim × page_size × inner_dim × dtype_bytes`.
//!
//! * [`FullyContiguous`] (TensorRT-LLM, and our host/disk tiers): one allocation
//!   `[num_blocks][num_layers][outer_dim][page_size × inner_dim]`; a block is one run of bytes.
//! * [`LayerSeparate`] (vLLM): one allocation per layer, either block-major
//!   `[num_blocks][outer_dim][...]` or outer-major `[outer_dim][num_blocks][...]`; a block is
//!   `num_layers × outer_dim` separate runs.
//!
//! Every layout numbers a block's runs in *canonical order* — run `r = layer × outer_dim + outer`
//! sits at byte `r × region_bytes` of the block's fully contiguous image — so a copy between any two
//! layouts is a gather or scatter of runs with matching canonical offsets.
//!
//! Invariants: a constructed layout has no zero dimension, and every byte offset it can produce
//! (`num_blocks × bytes_per_block` included) fits in `usize`; so region math after construction
//! never overflows.

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
}

fn overflow(what: &str) -> Error {
    Error::invalid_layout(format!("{what} overflows usize"))
}

/// Which of the two shapes a layout has.
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
}

/// One run of a block's bytes inside one allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Which allocation (0 for fully contiguous; the layer for layer separate).
    pub allocation: usize,
    /// Byte offset inside that allocation.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
    /// Byte offset of this run inside the block's canonical (fully contiguous) image.
    pub canonical_offset: usize,
}

/// Where the bytes of each block of a cache live.
///
/// Object safe; implemented by [`FullyContiguous`], [`LayerSeparate`] and the serialisable [`Layout`].
pub trait KvLayout: Send + Sync + std::fmt::Debug {
    /// The block dimensions.
    fn dims(&self) -> &LayoutDims;
    /// Blocks in the cache.
    fn num_blocks(&self) -> usize;
    /// Which shape this is.
    fn kind(&self) -> LayoutKind;
    /// Separate allocations backing the cache (1, or `num_layers`).
    fn num_allocations(&self) -> usize;
    /// Bytes of each allocation.
    fn allocation_bytes(&self) -> usize;

    /// The runs of `block`, in canonical order; merged into one run when the block is contiguous.
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

/// Iterator over the runs of one block (no allocation).
#[derive(Debug, Clone)]
pub struct Regions {
    kind: LayoutKind,
    dims: LayoutDims,
    num_blocks: usize,
    block: usize,
    next: usize,
    end: usize,
}

impl Iterator for Regions {
    type Item = Region;

    fn next(&mut self) -> Option<Region> {
        if self.next >= self.end {
            return None;
        }
        let r = self.next;
        self.next += 1;
        let d = &self.dims;
        Some(match self.kind {
            LayoutKind::FullyContiguous => Region {
                allocation: 0,
                offset: self.block * d.bytes_per_block(),
                len: d.bytes_per_block(),
                canonical_offset: 0,
            },
            LayoutKind::LayerSeparateBlockMajor => {
                let (layer, outer) = (r / d.outer_dim, r % d.outer_dim);
                let rb = d.region_bytes();
                Region {
                    allocation: layer,
                    offset: (self.block * d.outer_dim + outer) * rb,
                    len: rb,
                    canonical_offset: r * rb,
                }
            }
            LayoutKind::LayerSeparateOuterMajor => {
                let (layer, outer) = (r / d.outer_dim, r % d.outer_dim);
                let rb = d.region_bytes();
                Region {
                    allocation: layer,
                    offset: (outer * self.num_blocks + self.block) * rb,
                    len: rb,
                    canonical_offset: r * rb,
                }
            }
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.end - self.next;
        (n, Some(n))
    }
}

impl ExactSizeIterator for Regions {}

fn check_block(block: usize, num_blocks: usize) -> Result<()> {
    if block >= num_blocks {
        return Err(Error::out_of_range("block", block, num_blocks));
    }
    Ok(())
}

fn check_total(dims: &LayoutDims, num_blocks: usize) -> Result<()> {
    dims.validate()?;
    if num_blocks == 0 {
        return Err(Error::invalid_layout("num_blocks must be non-zero").with("dim", "num_blocks"));
    }
    dims.bytes_per_block()
        .checked_mul(num_blocks)
        .ok_or_else(|| overflow("num_blocks × bytes_per_block"))?;
    Ok(())
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
        check_total(&dims, num_blocks)?;
        Ok(Self { dims, num_blocks })
    }
}

impl KvLayout for FullyContiguous {
    fn dims(&self) -> &LayoutDims {
        &self.dims
    }
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    fn kind(&self) -> LayoutKind {
        LayoutKind::FullyContiguous
    }
    fn num_allocations(&self) -> usize {
        1
    }
    fn allocation_bytes(&self) -> usize {
        self.num_blocks * self.dims.bytes_per_block()
    }
    fn regions(&self, block: usize) -> Result<Regions> {
        check_block(block, self.num_blocks)?;
        Ok(Regions {
            kind: LayoutKind::FullyContiguous,
            dims: self.dims,
            num_blocks: self.num_blocks,
            block,
            next: 0,
            end: 1,
        })
    }
}

/// Whether a layer-separate allocation is indexed by block first or by K/V first.
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
    /// `[num_blocks][outer_dim][...]` (e.g. vLLM's FlashInfer backend, MLA).
    BlockMajor,
    /// `[outer_dim][num_blocks][...]` (e.g. vLLM's FlashAttention backend).
    OuterMajor,
}

/// One allocation per layer, block-major or outer-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerSeparate {
    dims: LayoutDims,
    num_blocks: usize,
    order: BlockOrder,
}

impl LayerSeparate {
    /// Validates and builds the layout.
    pub fn new(dims: LayoutDims, num_blocks: usize, order: BlockOrder) -> Result<Self> {
        check_total(&dims, num_blocks)?;
        Ok(Self {
            dims,
            num_blocks,
            order,
        })
    }

    /// Block-major or outer-major.
    pub fn order(&self) -> BlockOrder {
        self.order
    }
}

impl KvLayout for LayerSeparate {
    fn dims(&self) -> &LayoutDims {
        &self.dims
    }
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    fn kind(&self) -> LayoutKind {
        match self.order {
            BlockOrder::BlockMajor => LayoutKind::LayerSeparateBlockMajor,
            BlockOrder::OuterMajor => LayoutKind::LayerSeparateOuterMajor,
        }
    }
    fn num_allocations(&self) -> usize {
        self.dims.num_layers
    }
    fn allocation_bytes(&self) -> usize {
        self.num_blocks * self.dims.outer_dim * self.dims.region_bytes()
    }
    fn regions(&self, block: usize) -> Result<Regions> {
        check_block(block, self.num_blocks)?;
        Ok(Regions {
            kind: self.kind(),
            dims: self.dims,
            num_blocks: self.num_blocks,
            block,
            next: 0,
            end: self.dims.regions_per_block(),
        })
    }
}

/// Either layout, as a value: what tiers hold and configs and wire messages carry.
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

    /// The same dimensions with another block count, fully contiguous (host and disk tiers).
    pub fn contiguous_with_blocks(&self, num_blocks: usize) -> Result<Self> {
        Self::fully_contiguous(*self.dims(), num_blocks)
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
    fn kind(&self) -> LayoutKind {
        self.inner().kind()
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

// ------------------------------------------------------------------------------------------------
// Detection from registered tensor shapes
// ------------------------------------------------------------------------------------------------

fn product(shape: &[usize], what: &str) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| overflow(what))
}

fn fmt_shape(shape: &[usize]) -> String {
    format!("{shape:?}")
}

/// Elements after the block/outer dims → (inner_dim) given page_size.
fn inner_from_tail(tail: &[usize], page_size: usize, shape: &[usize]) -> Result<usize> {
    if page_size == 0 {
        return Err(Error::invalid_layout("page_size must be non-zero").with("dim", "page_size"));
    }
    let elems = product(tail, "tensor element count")?;
    if elems == 0 || elems % page_size != 0 {
        return Err(Error::invalid_layout(format!(
            "trailing dims {} of shape {} hold {elems} elements, not a non-zero multiple of page_size {page_size}",
            fmt_shape(tail),
            fmt_shape(shape)
        )));
    }
    Ok(elems / page_size)
}

/// Layout of TensorRT-LLM's single registered cache tensor
/// `[num_blocks, num_layers, outer_dim, ...]` (trailing dims hold `page_size × inner_dim` elements).
///
/// `override_kind`, when given, must be [`LayoutKind::FullyContiguous`]: a single tensor cannot be
/// read as layer separate.
pub fn detect_trtllm(
    shape: &[usize],
    dtype_bytes: usize,
    page_size: usize,
    override_kind: Option<LayoutKind>,
) -> Result<Layout> {
    if shape.len() < 4 {
        return Err(Error::invalid_layout(format!(
            "TensorRT-LLM cache tensor must be [num_blocks, num_layers, outer_dim, ...], got {}",
            fmt_shape(shape)
        )));
    }
    if let Some(k) = override_kind {
        if k != LayoutKind::FullyContiguous {
            return Err(Error::invalid_layout(format!(
                "layout override {k} contradicts the single tensor of shape {}, which is fully_contiguous",
                fmt_shape(shape)
            )));
        }
    }
    let dims = LayoutDims {
        num_layers: shape[1],
        outer_dim: shape[2],
        page_size,
        inner_dim: inner_from_tail(&shape[3..], page_size, shape)?,
        dtype_bytes,
    };
    if !matches!(dims.outer_dim, 1 | 2) {
        return Err(Error::invalid_layout(format!(
            "outer_dim (dim 2 of {}) must be 1 or 2, got {}",
            fmt_shape(shape),
            dims.outer_dim
        )));
    }
    Layout::fully_contiguous(dims, shape[0])
}

/// Layout of vLLM's per-layer cache tensors, all of which must share one shape.
///
/// Accepted per-layer shapes (page dims after the block/outer dims hold `page_size × inner_dim`
/// elements):
/// * `[outer_dim, num_blocks, ...]` → outer-major (FlashAttention: `[2, N, page, heads, dim]`);
/// * `[num_blocks, outer_dim, ...]` → block-major (FlashInfer: `[N, 2, page, heads, dim]`);
/// * `[num_blocks, page_size, ...]` → block-major with `outer_dim = 1` (MLA latent).
///
/// The reading is taken from the dimension equal to `num_blocks` when it is given; without it,
/// from which leading dimension can be an outer dim (1 or 2). When both readings fit the shape the
/// caller must say which (`override_kind`); an override that contradicts the shape is refused,
/// because both readings have the same byte size and a wrong one silently swaps K and V.
pub fn detect_vllm(
    layer_shapes: &[Vec<usize>],
    dtype_bytes: usize,
    page_size: usize,
    num_blocks: Option<usize>,
    override_kind: Option<LayoutKind>,
) -> Result<Layout> {
    let Some(first) = layer_shapes.first() else {
        return Err(Error::invalid_layout(
            "no per-layer cache tensors registered",
        ));
    };
    for (i, s) in layer_shapes.iter().enumerate() {
        if s != first {
            return Err(Error::invalid_layout(format!(
                "layer {i} has shape {} but layer 0 has {}",
                fmt_shape(s),
                fmt_shape(first)
            ))
            .with("layer", i));
        }
    }
    let shape = first.as_slice();
    if shape.len() < 3 {
        return Err(Error::invalid_layout(format!(
            "per-layer cache tensor must have at least 3 dims, got {}",
            fmt_shape(shape)
        )));
    }
    let num_layers = layer_shapes.len();

    // Every reading that fits the shape: (kind, num_blocks, outer_dim, tail start).
    let mut candidates: Vec<(LayoutKind, usize, usize, usize)> = Vec::with_capacity(3);
    let fits_blocks = |n: usize| num_blocks.is_none_or(|want| want == n);
    // Outer-major: [outer, N, ...]
    if matches!(shape[0], 1 | 2) && fits_blocks(shape[1]) {
        candidates.push((LayoutKind::LayerSeparateOuterMajor, shape[1], shape[0], 2));
    }
    // Block-major with explicit outer dim: [N, outer, ...]
    if matches!(shape[1], 1 | 2) && fits_blocks(shape[0]) && shape[1] != page_size {
        candidates.push((LayoutKind::LayerSeparateBlockMajor, shape[0], shape[1], 2));
    }
    // MLA: [N, page_size, ...] with outer_dim 1.
    if shape[1] == page_size && fits_blocks(shape[0]) {
        candidates.push((LayoutKind::LayerSeparateBlockMajor, shape[0], 1, 1));
    }
    // Outer-major with outer 1 is the same bytes as block-major with outer 1; keep one reading.
    candidates.retain(|c| {
        !(c.0 == LayoutKind::LayerSeparateOuterMajor && c.2 == 1 && shape[1] == page_size)
    });

    let chosen = match override_kind {
        Some(LayoutKind::FullyContiguous) => {
            return Err(Error::invalid_layout(format!(
                "layout override fully_contiguous contradicts {num_layers} per-layer tensors of shape {}",
                fmt_shape(shape)
            )))
        }
        Some(k) => {
            let fitting: Vec<_> = candidates.iter().filter(|c| c.0 == k).collect();
            match fitting.as_slice() {
                [one] => **one,
                [] => {
                    return Err(Error::invalid_layout(format!(
                        "layout override {k} contradicts per-layer shape {}{}",
                        fmt_shape(shape),
                        num_blocks.map_or(String::new(), |n| format!(" with num_blocks {n}"))
                    )))
                }
                _ => {
                    return Err(Error::invalid_layout(format!(
                        "per-layer shape {} is ambiguous even with override {k}",
                        fmt_shape(shape)
                    )))
                }
            }
        }
        None => match candidates.as_slice() {
            [one] => *one,
            [] => {
                return Err(Error::invalid_layout(format!(
                    "cannot read per-layer shape {} as [outer, blocks, ...], [blocks, outer, ...] or [blocks, page_size, ...]{}",
                    fmt_shape(shape),
                    num_blocks.map_or(String::new(), |n| format!(" with num_blocks {n} and page_size {page_size}"))
                )))
            }
            _ => {
                return Err(Error::invalid_layout(format!(
                    "per-layer shape {} is ambiguous (block-major or outer-major); pass num_blocks or a layout override",
                    fmt_shape(shape)
                )))
            }
        },
    };
    let (kind, n, outer_dim, tail) = chosen;
    // vLLM keeps the page (block_size) as its own dimension right after the block/outer dims.
    if shape.get(tail) != Some(&page_size) {
        return Err(Error::invalid_layout(format!(
            "per-layer shape {} has {} tokens per block where page_size {page_size} was expected (dim {tail})",
            fmt_shape(shape),
            shape.get(tail).copied().unwrap_or(0)
        )));
    }
    let dims = LayoutDims {
        num_layers,
        outer_dim,
        page_size,
        inner_dim: inner_from_tail(&shape[tail..], page_size, shape)?,
        dtype_bytes,
    };
    let order = if kind == LayoutKind::LayerSeparateOuterMajor {
        BlockOrder::OuterMajor
    } else {
        BlockOrder::BlockMajor
    };
    Layout::layer_separate(dims, n, order)
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
        }
    }
}
