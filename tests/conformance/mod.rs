//! The [`StorageTier`] conformance suite shared by `tests/tier_conformance.rs` (the memory and
//! disk tiers) and `tests/nixl.rs` (the NIXL disk tier and the UCX remote tier).
//!
//! Each `check_*` function states one invariant of the trait (see `src/tier.rs`) and is generic
//! over the tier, so it runs on concrete types and on `Arc<dyn StorageTier>` alike. The
//! `conformance!` macro stamps one `#[test]` per (backend, handle, check), so a failure names its
//! case, e.g. `disk_direct_aligned::dyn_arc::overwrite_leaves_others_intact`.
//!
//! Use: `#[macro_use] mod conformance;` and `use conformance::*;`, then define the fixtures (any
//! struct with a `tier` field; the fields after it outlive the tier) and invoke `conformance!`.

pub mod remote;

use std::io::{IoSlice, IoSliceMut};

use kvbm_connector::layout::BlockOrder;
use kvbm_connector::{ErrorKind, KvLayout, Layout, LayoutDims, StorageTier, StorageTierExt};

// ------------------------------------------------------------------------------------------------
// Fixtures
// ------------------------------------------------------------------------------------------------

pub const NUM_BLOCKS: usize = 8;
pub const ALIGN: usize = 4096;

/// 3 layers × 2 × 4 tokens × 8 × 2 bytes: regions of 64 bytes, blocks of 384.
pub fn small_dims() -> LayoutDims {
    LayoutDims {
        num_layers: 3,
        outer_dim: 2,
        page_size: 4,
        inner_dim: 8,
        dtype_bytes: 2,
    }
}

/// 2 layers × 2 × 16 tokens × 128 × 2 bytes: regions of 4096 bytes, blocks of 16 KiB.
pub fn aligned_dims() -> LayoutDims {
    LayoutDims {
        num_layers: 2,
        outer_dim: 2,
        page_size: 16,
        inner_dim: 128,
        dtype_bytes: 2,
    }
}

/// The memory tier's built-in layouts (each test binary uses some of them).
#[derive(Clone, Copy)]
#[allow(dead_code)]
pub enum MemLayout {
    Contiguous,
    BlockMajor,
    OuterMajor,
    /// Split by head inside each block, with [`HEADS`] heads (vLLM's CPU attention).
    HeadMajor,
}

/// Heads of the head-major fixtures (divides both test dims' `inner_dim`).
pub const HEADS: usize = 2;

impl MemLayout {
    /// This layout over `NUM_BLOCKS` blocks of `dims`.
    pub fn layout(self, dims: LayoutDims) -> Layout {
        match self {
            MemLayout::Contiguous => Layout::fully_contiguous(dims, NUM_BLOCKS),
            MemLayout::BlockMajor => {
                Layout::layer_separate(dims, NUM_BLOCKS, BlockOrder::BlockMajor)
            }
            MemLayout::OuterMajor => {
                Layout::layer_separate(dims, NUM_BLOCKS, BlockOrder::OuterMajor)
            }
            MemLayout::HeadMajor => Layout::layer_separate_head_major(dims, NUM_BLOCKS, HEADS),
        }
        .expect("valid test layout")
    }
}

// ------------------------------------------------------------------------------------------------
// Helpers
// ------------------------------------------------------------------------------------------------

/// A distinct byte for every (block, byte index, generation): no two blocks or generations share
/// an image, and neighbouring bytes differ.
pub fn pattern(block: usize, index: usize, generation: u64) -> u8 {
    let x = (index as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((block as u64 + 1).wrapping_mul(0xC2B2_AE3D_27D4_EB4F))
        .wrapping_add(generation.wrapping_mul(0x1656_67B1_9E37_79F9));
    (x ^ (x >> 29) ^ (x >> 47)) as u8
}

/// A buffer whose bytes start on a 4096-byte boundary, so the disk tier can use it directly.
pub struct AlignedBuf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    pub fn zeroed(len: usize) -> Self {
        let storage = vec![0u8; len + ALIGN];
        let start = storage.as_ptr().align_offset(ALIGN);
        assert!(start < ALIGN);
        Self {
            storage,
            start,
            len,
        }
    }

    pub fn image(block: usize, len: usize, generation: u64) -> Self {
        let mut b = Self::zeroed(len);
        for (i, x) in b.as_mut().iter_mut().enumerate() {
            *x = pattern(block, i, generation);
        }
        b
    }

    pub fn as_ref(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }

    pub fn as_mut(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

pub fn write_image<T: StorageTier + ?Sized>(tier: &T, block: usize, generation: u64) {
    let img = AlignedBuf::image(block, tier.bytes_per_block(), generation);
    tier.write_block(block, &[IoSlice::new(img.as_ref())])
        .unwrap_or_else(|e| panic!("write block {block}: {e}"));
}

pub fn read_image<T: StorageTier + ?Sized>(tier: &T, block: usize) -> Vec<u8> {
    let mut buf = AlignedBuf::zeroed(tier.bytes_per_block());
    tier.read_block(block, &mut [IoSliceMut::new(buf.as_mut())])
        .unwrap_or_else(|e| panic!("read block {block}: {e}"));
    buf.as_ref().to_vec()
}

pub fn assert_image<T: StorageTier + ?Sized>(tier: &T, block: usize, generation: u64) {
    let got = read_image(tier, block);
    let want = AlignedBuf::image(block, tier.bytes_per_block(), generation);
    if let Some(i) = got.iter().zip(want.as_ref()).position(|(a, b)| a != b) {
        panic!(
            "block {block}: byte {i} is {:#04x}, expected {:#04x} (generation {generation})",
            got[i],
            want.as_ref()[i]
        );
    }
}

pub fn write_all_blocks<T: StorageTier + ?Sized>(tier: &T, generation: u64) {
    for b in 0..tier.num_blocks() {
        write_image(tier, b, generation);
    }
}

pub fn assert_all_blocks<T: StorageTier + ?Sized>(tier: &T, generation: u64) {
    for b in 0..tier.num_blocks() {
        assert_image(tier, b, generation);
    }
}

/// Splits `buf` at `cuts` (ascending offsets) into mutable pieces.
pub fn split_mut<'a>(mut buf: &'a mut [u8], cuts: &[usize]) -> Vec<IoSliceMut<'a>> {
    let mut out = Vec::new();
    let mut at = 0;
    for &c in cuts {
        let (head, tail) = buf.split_at_mut(c - at);
        out.push(IoSliceMut::new(head));
        buf = tail;
        at = c;
    }
    out.push(IoSliceMut::new(buf));
    out
}

/// Splits `buf` at `cuts` (ascending offsets) into pieces.
pub fn split<'a>(buf: &'a [u8], cuts: &[usize]) -> Vec<IoSlice<'a>> {
    let mut out = Vec::new();
    let mut at = 0;
    for &c in cuts {
        out.push(IoSlice::new(&buf[at..c]));
        at = c;
    }
    out.push(IoSlice::new(&buf[at..]));
    out
}

// ------------------------------------------------------------------------------------------------
// Checks
// ------------------------------------------------------------------------------------------------

/// Every block round-trips its own distinct image; the geometry agrees with the layout.
pub fn check_round_trip<T: StorageTier + ?Sized>(tier: &T) {
    assert_eq!(tier.num_blocks(), NUM_BLOCKS);
    assert_eq!(tier.num_blocks(), tier.layout().num_blocks());
    assert_eq!(tier.bytes_per_block(), tier.layout().bytes_per_block());
    write_all_blocks(tier, 1);
    assert_all_blocks(tier, 1);
    // The convenience path (unaligned Vec) agrees.
    for b in 0..tier.num_blocks() {
        let v = tier.read_block_to_vec(b).expect("read_block_to_vec");
        assert_eq!(v, AlignedBuf::image(b, tier.bytes_per_block(), 1).as_ref());
    }
}

/// Overwriting one block changes it and nothing else, including its neighbours.
pub fn check_overwrite_leaves_others_intact<T: StorageTier + ?Sized>(tier: &T) {
    write_all_blocks(tier, 1);
    let target = tier.num_blocks() / 2;
    write_image(tier, target, 2);
    for b in 0..tier.num_blocks() {
        assert_image(tier, b, if b == target { 2 } else { 1 });
    }
    // Overwrite the first and last too (edges of the allocation / file).
    write_image(tier, 0, 3);
    write_image(tier, tier.num_blocks() - 1, 3);
    for b in 0..tier.num_blocks() {
        let g = match b {
            _ if b == target => 2,
            _ if b == 0 || b == tier.num_blocks() - 1 => 3,
            _ => 1,
        };
        assert_image(tier, b, g);
    }
}

/// Images split at odd boundaries (uneven lengths, a 1-byte piece, an empty piece) are gathered
/// and scattered like one contiguous buffer, and the two splits need not agree.
pub fn check_odd_segments<T: StorageTier + ?Sized>(tier: &T) {
    let bpb = tier.bytes_per_block();
    write_all_blocks(tier, 1);
    let block = 3;
    let img = AlignedBuf::image(block, bpb, 7);
    // Three uneven segments for the write.
    let src = split(img.as_ref(), &[1, bpb / 2 + 3]);
    assert_eq!(src.len(), 3);
    tier.write_block(block, &src)
        .expect("write with 3 segments");
    // Five different segments (one empty) for the read.
    let mut back = vec![0u8; bpb];
    {
        let mut dst = split_mut(&mut back, &[5, 5, bpb / 3, bpb - 1]);
        tier.read_block(block, &mut dst)
            .expect("read with 5 segments");
    }
    assert_eq!(back, img.as_ref());
    // Many tiny segments both ways (more than IOV_MAX for blocks of 4 KiB or more).
    let img = AlignedBuf::image(block, bpb, 8);
    let src: Vec<IoSlice<'_>> = img.as_ref().chunks(3).map(IoSlice::new).collect();
    tier.write_block(block, &src)
        .expect("write with many segments");
    let mut back = vec![0u8; bpb];
    {
        let mut dst: Vec<IoSliceMut<'_>> = back.chunks_mut(2).map(IoSliceMut::new).collect();
        tier.read_block(block, &mut dst)
            .expect("read with many segments");
    }
    assert_eq!(back, img.as_ref());
    for b in 0..tier.num_blocks() {
        assert_image(tier, b, if b == block { 8 } else { 1 });
    }
}

/// Buffers that start off any alignment boundary work both ways.
pub fn check_unaligned_buffers<T: StorageTier + ?Sized>(tier: &T) {
    let bpb = tier.bytes_per_block();
    let block = 1;
    let mut src = vec![0u8; bpb + 1];
    for (i, x) in src[1..].iter_mut().enumerate() {
        *x = pattern(block, i, 4);
    }
    tier.write_block(block, &[IoSlice::new(&src[1..])])
        .expect("write from unaligned buffer");
    let mut dst = vec![0u8; bpb + 3];
    tier.read_block(block, &mut [IoSliceMut::new(&mut dst[3..])])
        .expect("read into unaligned buffer");
    assert_eq!(&dst[3..], &src[1..]);
    assert_image(tier, block, 4);
}

/// A block id past the end is `OutOfRange` for reads and writes, and nothing changes.
pub fn check_out_of_range<T: StorageTier + ?Sized>(tier: &T) {
    write_all_blocks(tier, 1);
    let n = tier.num_blocks();
    let bpb = tier.bytes_per_block();
    let img = AlignedBuf::image(0, bpb, 9);
    for bad in [n, n + 1, usize::MAX] {
        let err = tier
            .write_block(bad, &[IoSlice::new(img.as_ref())])
            .expect_err("write past the end must fail");
        assert_eq!(err.kind(), ErrorKind::OutOfRange, "{err}");
        let mut buf = vec![0xEEu8; bpb];
        let err = tier
            .read_block(bad, &mut [IoSliceMut::new(&mut buf)])
            .expect_err("read past the end must fail");
        assert_eq!(err.kind(), ErrorKind::OutOfRange, "{err}");
        assert!(
            buf.iter().all(|&x| x == 0xEE),
            "failed read touched the buffer"
        );
    }
    assert_all_blocks(tier, 1);
}

/// Segments that do not add up to `bytes_per_block` are `InvalidArgument`, and nothing changes.
pub fn check_wrong_length<T: StorageTier + ?Sized>(tier: &T) {
    write_all_blocks(tier, 1);
    let bpb = tier.bytes_per_block();
    let block = 2;
    let long = AlignedBuf::image(block, bpb + 1, 9);
    let short = &long.as_ref()[..bpb - 1];
    for src in [
        vec![IoSlice::new(short)],
        vec![IoSlice::new(long.as_ref())],
        vec![IoSlice::new(short), IoSlice::new(&long.as_ref()[..2])],
        vec![],
    ] {
        let err = tier
            .write_block(block, &src)
            .expect_err("wrong write length must fail");
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    }
    for len in [0, 1, bpb - 1, bpb + 1] {
        let mut buf = vec![0xEEu8; len];
        let err = tier
            .read_block(block, &mut [IoSliceMut::new(&mut buf)])
            .expect_err("wrong read length must fail");
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
        assert!(
            buf.iter().all(|&x| x == 0xEE),
            "failed read touched the buffer"
        );
    }
    assert_all_blocks(tier, 1);
}

/// Several threads writing and reading their own blocks at once never see each other's bytes.
pub fn check_concurrent<T: StorageTier + ?Sized>(tier: &T) {
    const THREADS: usize = 4;
    const ROUNDS: u64 = 6;
    write_all_blocks(tier, 0);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            s.spawn(move || {
                for round in 1..=ROUNDS {
                    for b in (t..tier.num_blocks()).step_by(THREADS) {
                        write_image(tier, b, round);
                    }
                    for b in (t..tier.num_blocks()).step_by(THREADS) {
                        assert_image(tier, b, round);
                    }
                    // Read a block owned by another thread: whichever generation it holds, it
                    // must be a whole image of that block, never a mix.
                    let other = (t + 1 + round as usize) % tier.num_blocks();
                    if other % THREADS != t {
                        let got = read_image(tier, other);
                        let whole = (0..=ROUNDS).any(|g| {
                            got.iter()
                                .enumerate()
                                .all(|(i, &x)| x == pattern(other, i, g))
                        });
                        assert!(whole, "block {other} read torn by a concurrent write");
                    }
                }
            });
        }
    });
    assert_all_blocks(tier, ROUNDS);
}

/// Capabilities are sane and match behaviour: host-addressable tiers lend their runs (reads see the
/// stored image, writes through them are read back); others answer `Unsupported`.
pub fn check_capability<T: StorageTier + ?Sized>(tier: &T) {
    let cap = tier.capability();
    assert!(cap.max_in_flight >= 1, "{cap:?}");
    assert!(cap.direct_io_alignment.is_power_of_two(), "{cap:?}");
    write_all_blocks(tier, 1);
    let bpb = tier.bytes_per_block();
    let block = 5;
    if cap.host_addressable {
        let mut seen = Vec::new();
        tier.with_block(block, &mut |runs| {
            for r in runs {
                seen.extend_from_slice(r);
            }
            Ok(())
        })
        .expect("with_block on a host-addressable tier");
        assert_eq!(seen, AlignedBuf::image(block, bpb, 1).as_ref());

        let img = AlignedBuf::image(block, bpb, 5);
        tier.with_block_mut(block, &mut |runs| {
            let mut at = 0;
            for r in runs.iter_mut() {
                let n = r.len();
                r.copy_from_slice(&img.as_ref()[at..at + n]);
                at += n;
            }
            assert_eq!(at, bpb);
            Ok(())
        })
        .expect("with_block_mut on a host-addressable tier");
        for b in 0..tier.num_blocks() {
            assert_image(tier, b, if b == block { 5 } else { 1 });
        }
        let err = tier
            .with_block(tier.num_blocks(), &mut |_| Ok(()))
            .expect_err("with_block past the end");
        assert_eq!(err.kind(), ErrorKind::OutOfRange, "{err}");
    } else {
        let mut called = false;
        let err = tier
            .with_block(block, &mut |_| {
                called = true;
                Ok(())
            })
            .expect_err("with_block on a tier that is not host addressable");
        assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
        let err = tier
            .with_block_mut(block, &mut |_| {
                called = true;
                Ok(())
            })
            .expect_err("with_block_mut on a tier that is not host addressable");
        assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
        assert!(!called);
        assert_all_blocks(tier, 1);
    }
}

// ------------------------------------------------------------------------------------------------
// One #[test] per (backend, handle, check)
// ------------------------------------------------------------------------------------------------

/// Stamps `mod <backend> { mod concrete { <one #[test] per check> } mod dyn_arc { … } }` for each
/// `backend => fixture expression;` line.
///
/// The header says what the fixture expression gives and which capability check runs:
/// * `fixture: required` — a fixture (a struct with a `tier` field);
/// * `fixture: optional` — an `Option` of one, where `None` (the backend is not usable here) skips
///   the test: it returns early, and passes;
/// * `capability: <path>` — [`check_capability`], or a backend's own check that wraps it with what
///   it knows about itself.
///
/// The fixture expressions and the capability path are resolved from the invoking crate's root.
macro_rules! conformance {
    (
        fixture: $mode:ident,
        capability: $capability:path;
        $($backend:ident => $make:expr;)*
    ) => {
        $(
            mod $backend {
                conformance!(@handles $mode, $make;
                    $crate::conformance::check_round_trip => round_trip,
                    $crate::conformance::check_overwrite_leaves_others_intact
                        => overwrite_leaves_others_intact,
                    $crate::conformance::check_odd_segments => odd_segments,
                    $crate::conformance::check_unaligned_buffers => unaligned_buffers,
                    $crate::conformance::check_out_of_range => out_of_range,
                    $crate::conformance::check_wrong_length => wrong_length,
                    $crate::conformance::check_concurrent => concurrent,
                    $capability => capability,
                );
            }
        )*
    };
    (@fixture required, $make:expr) => {
        $make
    };
    (@fixture optional, $make:expr) => {
        match $make {
            Some(fixture) => fixture,
            None => return,
        }
    };
    (@handles $mode:ident, $make:expr; $($check:path => $name:ident,)*) => {
        /// The backend as its concrete type.
        mod concrete {
            #[allow(unused_imports)]
            use crate::*;
            $(
                #[test]
                fn $name() {
                    let fixture = conformance!(@fixture $mode, $make);
                    $check(&fixture.tier);
                }
            )*
        }
        /// The backend behind `Arc<dyn StorageTier>`.
        mod dyn_arc {
            #[allow(unused_imports)]
            use crate::*;
            $(
                #[test]
                fn $name() {
                    let fixture = conformance!(@fixture $mode, $make);
                    let tier: ::std::sync::Arc<dyn ::kvbm_connector::StorageTier> =
                        ::std::sync::Arc::new(fixture.tier);
                    $check(&*tier);
                    // The tier first; what it needs (the rest of the fixture) at the end of scope.
                    drop(tier);
                }
            )*
        }
    };
}
