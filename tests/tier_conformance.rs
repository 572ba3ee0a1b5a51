//! One conformance suite for every [`StorageTier`] backend.
//!
//! The checks, their helpers and the `conformance!` macro live in `tests/conformance/mod.rs`
//! (shared with `tests/nixl.rs`); each `check_*` function states one invariant of the trait (see
//! `src/tier.rs`) and runs on concrete types and on `Arc<dyn StorageTier>` alike. The macro stamps
//! one `#[test]` per (backend, handle, check), so a failure names its case, e.g.
//! `disk_direct_aligned::dyn_arc::overwrite_leaves_others_intact`.
//!
//! Backends: the memory tier in all four built-in layouts and the disk tier with and without O_DIRECT,
//! each with a small block (384 bytes: regions not 4096-aligned, the disk bounces through its
//! aligned buffers) and a block that is a multiple of 4096 (the disk's direct path when buffers are
//! aligned, which these checks arrange where they can).

#[macro_use]
mod conformance;

use conformance::*;
use kvbm_connector::backends::disk::{DiskTier, DiskTierOptions};
use kvbm_connector::backends::memory::MemoryTier;
use kvbm_connector::{LayoutDims, StorageTier, TierKind};

// ------------------------------------------------------------------------------------------------
// Fixtures
// ------------------------------------------------------------------------------------------------

/// A tier plus whatever must outlive it (the disk tier's directory). Fields drop in order: the
/// tier (removing its file) before the directory.
struct Fixture<T> {
    tier: T,
    _dir: Option<tempfile::TempDir>,
}

fn memory(dims: LayoutDims, which: MemLayout) -> Fixture<MemoryTier> {
    Fixture {
        tier: MemoryTier::host(which.layout(dims)).expect("memory tier"),
        _dir: None,
    }
}

fn disk(dims: LayoutDims, direct_io: bool) -> Fixture<DiskTier> {
    let dir = tempfile::tempdir().expect("tempdir");
    let tier = DiskTier::create(
        TierKind::Disk,
        dims,
        NUM_BLOCKS,
        DiskTierOptions::new(dir.path()).with_direct_io(direct_io),
    )
    .expect("disk tier");
    Fixture {
        tier,
        _dir: Some(dir),
    }
}

// ------------------------------------------------------------------------------------------------
// One #[test] per (backend, handle, check)
// ------------------------------------------------------------------------------------------------

conformance! {
    fixture: required,
    capability: check_capability;
    memory_contiguous_small => memory(small_dims(), MemLayout::Contiguous);
    memory_block_major_small => memory(small_dims(), MemLayout::BlockMajor);
    memory_outer_major_small => memory(small_dims(), MemLayout::OuterMajor);
    memory_contiguous_aligned => memory(aligned_dims(), MemLayout::Contiguous);
    memory_block_major_aligned => memory(aligned_dims(), MemLayout::BlockMajor);
    memory_outer_major_aligned => memory(aligned_dims(), MemLayout::OuterMajor);
    memory_head_major_small => memory(small_dims(), MemLayout::HeadMajor);
    memory_head_major_aligned => memory(aligned_dims(), MemLayout::HeadMajor);
    disk_direct_small => disk(small_dims(), true);
    disk_buffered_small => disk(small_dims(), false);
    disk_direct_aligned => disk(aligned_dims(), true);
    disk_buffered_aligned => disk(aligned_dims(), false);
}

/// The disk's request for O_DIRECT is honoured or explained, and its capability says which.
#[test]
fn disk_direct_io_is_active_or_explained() {
    let fixture = disk(aligned_dims(), true);
    let tier = &fixture.tier;
    if tier.direct_io() {
        assert!(tier.direct_io_fallback_reason().is_none());
        assert_eq!(tier.capability().direct_io_alignment, ALIGN);
    } else {
        let reason = tier.direct_io_fallback_reason();
        assert!(reason.is_some(), "O_DIRECT off without a reason");
        println!("O_DIRECT fell back: {}", reason.unwrap_or_default());
        assert_eq!(tier.capability().direct_io_alignment, 1);
    }
    assert!(tier.capability().checksummed);
    assert!(!tier.capability().host_addressable);
}

/// Memory → disk → memory across layouts, the disk's write fed by the memory tier's lent runs
/// (the zero-copy path the transfer engine uses), for both block sizes.
#[test]
fn memory_to_disk_via_lent_runs() {
    for dims in [small_dims(), aligned_dims()] {
        let src = memory(dims, MemLayout::OuterMajor);
        let dst = memory(dims, MemLayout::HeadMajor);
        let disk = disk(dims, true);
        write_all_blocks(&src.tier, 11);
        for b in 0..NUM_BLOCKS {
            src.tier
                .with_block(b, &mut |runs| disk.tier.write_block(b, runs))
                .expect("memory → disk");
            dst.tier
                .with_block_mut(b, &mut |runs| disk.tier.read_block(b, runs))
                .expect("disk → memory");
        }
        assert_all_blocks(&dst.tier, 11);
    }
}
