//! `KvLayout` implemented outside the crate, through its public API only.
//!
//! The example layout: one tensor per layer, `[num_blocks, num_kv_heads, block_size,
//! 2 * head_size]`, each token's K and V side by side in the last dimension (how kernels that
//! split that logical shape per token, `split(head_size, dim=-1)`, read it). It is *not* vLLM's
//! CPU cache: vLLM's CPU attention registers the same shape but keeps each (block, head) slab as
//! all of K, then all of V, which is the built-in head-major `LayerSeparate` (`BlockOrder::HeadMajor`) (tests/layout_shapes.rs,
//! tests/python/test_vllm_forward.py). The shape alone cannot tell the two apart; this one only
//! shows how an arrangement the crate does not know is added from outside.
//!
//! The same K/V data is held once in a standard layout (vLLM FlashAttention, per layer `[2,
//! num_blocks, block_size, num_kv_heads, head_size]`) and once in the packed layout. The standard
//! cache is stored into a fully contiguous host tier with the transfer engine; the packed cache's
//! blocks are stored into a second host tier by handing its runs to `write_block`. Both tiers must
//! then hold the same canonical images, and loading the standard cache's images back into an
//! empty packed cache (the tier scattering straight into its runs) must rebuild it byte for byte.
//!
//! The packed cache is test-owned memory, not a tier: tiers hold the built-in `Layout`
//! (`StorageTier::layout`), so a layout of one's own moves blocks through a tier's segment lists.

use std::io::{IoSlice, IoSliceMut};

use kvbm_connector::backends::memory::MemoryTier;
use kvbm_connector::layout::{
    check_block, check_layout, BlockOrder, LayerSeparate, Region, Regions,
};
use kvbm_connector::transfer::TransferEngine;
use kvbm_connector::{
    ErrorKind, KvLayout, Layout, LayoutDims, Result, StorageTier, StorageTierExt, TierKind,
};

const LAYERS: usize = 3;
const BLOCKS: usize = 6;
const HEADS: usize = 2;
const PAGE: usize = 5;
const HEAD_SIZE: usize = 4;
/// bf16-sized elements; the values below are `u16`.
const ELEM: usize = 2;

/// Per layer `[num_blocks, num_kv_heads, block_size, 2 * head_size]`, K and V of a token side by
/// side in the last dimension.
///
/// Each layer's tensor gives a block the same span as block-major layer-separate
/// (`[num_blocks][2][block_size × num_kv_heads × head_size]`), so this layout takes its sizes from
/// one and differs only in the order inside a block. The canonical image of a block is
/// `[layer][K/V][token][head][head_size]` (the order of the standard layouts' runs), so every
/// (layer, K/V, token, head) is one run of `head_size` elements.
#[derive(Debug)]
struct PackedLastDimLayout {
    spans: LayerSeparate,
    num_kv_heads: usize,
    head_size: usize,
}

impl PackedLastDimLayout {
    fn new(
        num_layers: usize,
        num_blocks: usize,
        num_kv_heads: usize,
        block_size: usize,
        head_size: usize,
        dtype_bytes: usize,
    ) -> Result<Self> {
        let dims = LayoutDims {
            num_layers,
            outer_dim: 2,
            page_size: block_size,
            inner_dim: num_kv_heads * head_size,
            dtype_bytes,
        };
        Ok(Self {
            spans: LayerSeparate::new(dims, num_blocks, BlockOrder::BlockMajor)?,
            num_kv_heads,
            head_size,
        })
    }
}

impl KvLayout for PackedLastDimLayout {
    fn dims(&self) -> &LayoutDims {
        self.spans.dims()
    }

    fn num_blocks(&self) -> usize {
        self.spans.num_blocks()
    }

    fn num_allocations(&self) -> usize {
        self.spans.num_allocations()
    }

    fn allocation_bytes(&self) -> usize {
        self.spans.allocation_bytes()
    }

    fn regions(&self, block: usize) -> Result<Regions> {
        check_block(block, self.num_blocks())?;
        let d = self.dims();
        let run = self.head_size * d.dtype_bytes;
        let mut runs = Vec::with_capacity(d.regions_per_block() * d.page_size * self.num_kv_heads);
        for layer in 0..d.num_layers {
            for kv in 0..d.outer_dim {
                for token in 0..d.page_size {
                    for head in 0..self.num_kv_heads {
                        // Element [block, head, token, kv * head_size] of the layer's tensor.
                        let row = (block * self.num_kv_heads + head) * d.page_size + token;
                        runs.push(Region {
                            allocation: layer,
                            offset: (row * d.outer_dim + kv) * run,
                            len: run,
                            canonical_offset: runs.len() * run,
                        });
                    }
                }
            }
        }
        Ok(Regions::from_runs(runs))
    }
}

/// The K (`kv` 0) or V (`kv` 1) element of a (layer, block, token, head, dim): distinct values.
fn kv_value(layer: usize, kv: usize, block: usize, token: usize, head: usize, dim: usize) -> u16 {
    let i = ((((layer * 2 + kv) * BLOCKS + block) * PAGE + token) * HEADS + head) * HEAD_SIZE + dim;
    u16::try_from(i).expect("test values fit u16")
}

/// Every (layer, kv, block, token, head, dim) with its value.
fn elements() -> impl Iterator<Item = ([usize; 6], u16)> {
    (0..LAYERS).flat_map(|l| {
        (0..2).flat_map(move |kv| {
            (0..BLOCKS).flat_map(move |b| {
                (0..PAGE).flat_map(move |t| {
                    (0..HEADS).flat_map(move |h| {
                        (0..HEAD_SIZE)
                            .map(move |d| ([l, kv, b, t, h, d], kv_value(l, kv, b, t, h, d)))
                    })
                })
            })
        })
    })
}

/// The packed cache as its kernels would fill it: per layer `[blocks, heads, page, 2 * head_size]`, element
/// positions computed here from the tensor shape, independently of `PackedLastDimLayout::regions`.
fn packed_cache() -> Vec<Vec<u8>> {
    let mut cache = vec![vec![0u8; BLOCKS * HEADS * PAGE * 2 * HEAD_SIZE * ELEM]; LAYERS];
    for ([l, kv, b, t, h, d], v) in elements() {
        let i = ((b * HEADS + h) * PAGE + t) * 2 * HEAD_SIZE + kv * HEAD_SIZE + d;
        cache[l][i * ELEM..(i + 1) * ELEM].copy_from_slice(&v.to_le_bytes());
    }
    cache
}

/// The same data in the standard layer-separate outer-major layout (per layer
/// `[2, blocks, page, heads, head_size]`), written through the tier's own runs: run
/// `layer × 2 + kv` of block `b` is the tensor's `[kv][b]` slice.
fn standard_tier(dims: LayoutDims) -> MemoryTier {
    let layout = Layout::layer_separate(dims, BLOCKS, BlockOrder::OuterMajor).unwrap();
    let tier = MemoryTier::new(TierKind::Device, layout).unwrap();
    for b in 0..BLOCKS {
        tier.with_block_mut(b, &mut |runs| {
            assert_eq!(runs.len(), LAYERS * 2);
            for ([l, kv, blk, t, h, d], v) in elements().filter(|(at, _)| at[2] == b) {
                assert_eq!(blk, b);
                let i = (t * HEADS + h) * HEAD_SIZE + d;
                runs[l * 2 + kv][i * ELEM..(i + 1) * ELEM].copy_from_slice(&v.to_le_bytes());
            }
            Ok(())
        })
        .unwrap();
    }
    tier
}

/// The runs of one block of `cache`, in canonical order, to read from.
fn runs<'a>(cache: &'a [Vec<u8>], regions: &[Region]) -> Vec<IoSlice<'a>> {
    regions
        .iter()
        .map(|r| IoSlice::new(&cache[r.allocation][r.offset..r.offset + r.len]))
        .collect()
}

/// The runs of one block of `cache`, in canonical order, to write into: each allocation is cut
/// at its runs in address order, and the pieces are put back in canonical order.
fn runs_mut<'a>(cache: &'a mut [Vec<u8>], regions: &[Region]) -> Vec<IoSliceMut<'a>> {
    let mut by_address: Vec<usize> = (0..regions.len()).collect();
    by_address.sort_by_key(|&i| (regions[i].allocation, regions[i].offset));
    let mut rest: Vec<(&'a mut [u8], usize)> =
        cache.iter_mut().map(|a| (a.as_mut_slice(), 0)).collect();
    let mut pieces: Vec<Option<&'a mut [u8]>> = regions.iter().map(|_| None).collect();
    for i in by_address {
        let r = regions[i];
        let (tail, start) = std::mem::take(&mut rest[r.allocation]);
        let (run, after) = tail[r.offset - start..].split_at_mut(r.len);
        rest[r.allocation] = (after, r.offset + r.len);
        pieces[i] = Some(run);
    }
    pieces
        .into_iter()
        .map(|p| IoSliceMut::new(p.expect("every run cut")))
        .collect()
}

#[test]
fn the_layout_keeps_the_kv_layout_invariants() {
    let packed = PackedLastDimLayout::new(LAYERS, BLOCKS, HEADS, PAGE, HEAD_SIZE, ELEM).unwrap();
    check_layout(&packed).unwrap();
    assert_eq!(
        packed.bytes_per_block(),
        LAYERS * 2 * PAGE * HEADS * HEAD_SIZE * ELEM
    );
    assert_eq!(packed.total_bytes(), LAYERS * packed_cache()[0].len());
    assert_eq!(packed.regions(2).unwrap().len(), LAYERS * 2 * PAGE * HEADS);
    assert_eq!(
        packed.regions(BLOCKS).unwrap_err().kind(),
        ErrorKind::OutOfRange
    );
    // Zero heads is refused like any zero dimension.
    assert_eq!(
        PackedLastDimLayout::new(LAYERS, BLOCKS, 0, PAGE, HEAD_SIZE, ELEM)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidLayout
    );
}

#[test]
fn blocks_round_trip_between_the_packed_layout_and_a_contiguous_tier() {
    let packed = PackedLastDimLayout::new(LAYERS, BLOCKS, HEADS, PAGE, HEAD_SIZE, ELEM).unwrap();
    let dims = *packed.dims();
    let host = || MemoryTier::host(Layout::fully_contiguous(dims, BLOCKS).unwrap()).unwrap();

    // The standard cache, stored by the transfer engine.
    let from_standard = host();
    let pairs: Vec<(usize, usize)> = (0..BLOCKS).map(|b| (b, b)).collect();
    let out = TransferEngine::copy_blocking(&standard_tier(dims), &from_standard, &pairs).unwrap();
    assert!(out.is_ok(), "{:?}", out.failed);

    // The packed cache, stored block by block from its runs.
    let cache = packed_cache();
    let from_packed = host();
    for b in 0..BLOCKS {
        let regions: Vec<Region> = packed.regions(b).unwrap().collect();
        from_packed.write_block(b, &runs(&cache, &regions)).unwrap();
    }
    for b in 0..BLOCKS {
        assert_eq!(
            from_packed.read_block_to_vec(b).unwrap(),
            from_standard.read_block_to_vec(b).unwrap(),
            "canonical image of block {b}"
        );
    }

    // Loading the standard cache's images into an empty packed cache rebuilds it.
    let mut loaded = vec![vec![0u8; cache[0].len()]; LAYERS];
    for b in 0..BLOCKS {
        let regions: Vec<Region> = packed.regions(b).unwrap().collect();
        from_standard
            .read_block(b, &mut runs_mut(&mut loaded, &regions))
            .unwrap();
    }
    assert!(
        loaded == cache,
        "the loaded packed cache differs from the one stored"
    );
}
