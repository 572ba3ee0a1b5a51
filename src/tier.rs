//! Where blocks live: the [`StorageTier`] trait.
//!
//! A tier stores `num_blocks` blocks of `bytes_per_block` bytes each, arranged by its [`Layout`].
//! Whatever the layout, a tier reads and writes a block as its *canonical image* (see
//! [`crate::layout`]): the caller passes a list of buffers ("segments") whose lengths add up to
//! `bytes_per_block`, and the tier scatters or gathers its own runs into or out of them. That one
//! primitive serves every path: memory → disk is the memory tier lending its runs (see
//! [`StorageTier::with_block`]) to the disk tier's vectored write, with no copy in between.
//!
//! The primitives are *blocking* and thread-safe; the [`crate::transfer`] engine runs them on
//! blocking threads with bounded concurrency, so several requests are in flight at once.
//!
//! Invariants every backend keeps (checked by the conformance suite in `tests/`):
//! * bytes read back are exactly the bytes last written to that block;
//! * a bad block id or segment length is an error and changes nothing;
//! * concurrent calls on different blocks do not interfere; calls on the same block are serialised.
//!
//! ## Capabilities
//!
//! What a tier can do is declared, never discovered by failing. [`StorageTier::capability`] answers
//! a [`Capability`] record (host addressable, direct-I/O alignment, checksums, how many calls in
//! parallel), which the transfer engine reads to pick each block's path. One capability is a
//! behaviour rather than a flag: a tier with a faster way to move a whole batch than block by block
//! (a GPU tier's planned stream copies with one completion wait) lends it as a [`BatchCopy`] from
//! [`StorageTier::batch_copy`]. The engine asks the destination, then the source, and copies block
//! by block when neither takes the batch; tiers without one (the default) need do nothing. The
//! core only knows the trait: which backend lends a hook, and how it copies, stays in the backend.

use std::fmt::Debug;
use std::io::{IoSlice, IoSliceMut};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::layout::{KvLayout, Layout};

/// The storage hierarchy levels.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    strum::Display,
    strum::EnumString,
    strum::EnumIter,
    strum::IntoStaticStr,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase", ascii_case_insensitive)]
pub enum TierKind {
    /// G1: device (GPU) memory owned by the engine.
    Device,
    /// G2: host DRAM (pinned when CUDA is on).
    Host,
    /// G3: local disk.
    Disk,
    /// G4: remote or shared storage.
    Remote,
}

impl TierKind {
    /// The level name used in the literature: `G1` … `G4`.
    pub fn level(self) -> &'static str {
        match self {
            TierKind::Device => "G1",
            TierKind::Host => "G2",
            TierKind::Disk => "G3",
            TierKind::Remote => "G4",
        }
    }
}

/// What a tier can do, declared up front so callers pick a path instead of failing at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capability {
    /// Blocks are in this process's address space: [`StorageTier::with_block`] and
    /// [`StorageTier::with_block_mut`] work, and copies to or from it need no bounce buffer.
    pub host_addressable: bool,
    /// Buffers passed to `read_block`/`write_block` are used directly (no bounce) when each
    /// segment's address and length are multiples of this many bytes; 1 means any buffer.
    pub direct_io_alignment: usize,
    /// Every block written carries a checksum verified on read; a mismatch is
    /// [`crate::ErrorKind::Corrupt`] and the bytes are not served.
    pub checksummed: bool,
    /// How many blocking calls the tier serves well in parallel (the transfer engine's bound).
    pub max_in_flight: usize,
}

/// One tier of block storage. Object safe: held as `Arc<dyn StorageTier>`.
pub trait StorageTier: Send + Sync + Debug {
    /// Which level this tier is.
    fn kind(&self) -> TierKind;

    /// What it can do.
    fn capability(&self) -> Capability;

    /// How its blocks are arranged.
    fn layout(&self) -> &Layout;

    /// Number of blocks.
    fn num_blocks(&self) -> usize {
        self.layout().num_blocks()
    }

    /// Bytes per block.
    fn bytes_per_block(&self) -> usize {
        self.layout().bytes_per_block()
    }

    /// Copies the canonical image of `block` into `dst` (lengths must add up to
    /// `bytes_per_block`). Blocking.
    fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> Result<()>;

    /// Replaces the contents of `block` with the canonical image in `src` (lengths must add up to
    /// `bytes_per_block`). Blocking.
    fn write_block(&self, block: usize, src: &[IoSlice<'_>]) -> Result<()>;

    /// Host-addressable tiers lend the runs of `block` (canonical order) to `f` for reading, with
    /// writers to that block held off meanwhile. Others answer [`crate::ErrorKind::Unsupported`].
    fn with_block(
        &self,
        block: usize,
        f: &mut dyn FnMut(&[IoSlice<'_>]) -> Result<()>,
    ) -> Result<()> {
        let _ = (block, f);
        Err(Error::unsupported(format!(
            "{} tier is not host addressable",
            self.kind()
        )))
    }

    /// Host-addressable tiers lend the runs of `block` (canonical order) to `f` for writing, with
    /// every other access to that block held off meanwhile.
    fn with_block_mut(
        &self,
        block: usize,
        f: &mut dyn FnMut(&mut [IoSliceMut<'_>]) -> Result<()>,
    ) -> Result<()> {
        let _ = (block, f);
        Err(Error::unsupported(format!(
            "{} tier is not host addressable",
            self.kind()
        )))
    }

    /// The tier's own batch copy, if it has one (see [`BatchCopy`]); `None` (the default): the
    /// transfer engine copies to and from this tier block by block.
    fn batch_copy(&self) -> Option<&dyn BatchCopy> {
        None
    }

    /// The tier's persistence, if its blocks outlive the process (see [`Persistent`]); `None`
    /// (the default): they do not.
    fn persistent(&self) -> Option<&dyn Persistent> {
        None
    }
}

/// A tier whose blocks outlive the process (the optional capability behind
/// [`StorageTier::persistent`]): its owner, who knows which key each block holds, tells the tier
/// ([`Persistent::bind`]), and a later process that reopens the tier gets those `(block, key)`
/// pairs back (how is the backend's business).
///
/// What the tier keeps on disk must describe the blocks truthfully whenever the process dies: a
/// block being rewritten is withdrawn first (durably, where a saved index names it), the
/// bindings are saved within a bounded time of a change without the owner's help, a
/// [`Persistent::clear`] is on disk before it returns, and every block is still verified on
/// read. Object safe.
pub trait Persistent: Send + Sync {
    /// The checksum of `block`'s last complete write (`None`: never written, or a write failed
    /// part-way). An owner takes it right after the write it keys, while the block still holds
    /// that write, and hands it to [`Persistent::bind`].
    fn checksum(&self, block: usize) -> Option<u64>;

    /// Records that each `(block, key, checksum)` holds `key`: kept only while the block's last
    /// complete write still has `checksum` (an entry for a block rewritten since is dropped), and
    /// withdrawn when the block is next written.
    fn bind(&self, entries: &[(usize, u128, u64)]);

    /// Forgets what `blocks` hold (the owner dropped them, or found them damaged).
    fn unbind(&self, blocks: &[usize]);

    /// Withdraws `blocks` before the owner rewrites them, durably where a saved index names one
    /// (one sync for the batch; a write of a block not withdrawn does it itself, alone).
    ///
    /// Errors: the withdrawal could not be made durable ([`ErrorKind::Io`](crate::ErrorKind::Io));
    /// the blocks must then not be written.
    fn prepare_rewrite(&self, blocks: &[usize]) -> Result<()>;

    /// Forgets every block: when this returns, a process that reopens the tier finds none.
    ///
    /// Errors: the empty index could not be written ([`ErrorKind::Io`](crate::ErrorKind::Io)).
    fn clear(&self) -> Result<()>;

    /// Saves the bindings now (a clean shutdown; the tier also saves on its own).
    fn flush(&self) -> Result<()>;
}

/// A tier's fast path for a whole batch of blocks between itself and another tier (the optional
/// capability behind [`StorageTier::batch_copy`]). Object safe.
///
/// The transfer engine offers each batch of a transfer to the destination's hook
/// ([`BatchCopy::copy_from`]), then to the source's ([`BatchCopy::copy_to`]), and copies block by
/// block when both decline. A hook that takes a batch answers `Some` with exactly one result per
/// pair, in the pairs' order; a failed pair's destination bytes must not be used, as on the
/// per-block path. It declines (`None`) before touching any block, for any reason of its own
/// (typically: the other side is a tier it has no fast path for). Pairs reach the hook already
/// validated by the engine (same block dimensions, ids in range, no destination twice), but a
/// hook must not rely on that for soundness: a bad pair is an error in its result, never a panic.
pub trait BatchCopy: Send + Sync {
    /// Copies `(own block, dst block)` pairs from the tier that lent this hook into `dst`.
    fn copy_to(&self, dst: &dyn StorageTier, pairs: &[(usize, usize)]) -> Option<Vec<Result<()>>>;

    /// Copies `(src block, own block)` pairs from `src` into the tier that lent this hook.
    fn copy_from(&self, src: &dyn StorageTier, pairs: &[(usize, usize)])
        -> Option<Vec<Result<()>>>;
}

/// Conveniences on every tier (blanket impl), kept out of the object-safe core.
pub trait StorageTierExt: StorageTier {
    /// Reads a block into a new `Vec` (canonical image).
    fn read_block_to_vec(&self, block: usize) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; self.bytes_per_block()];
        self.read_block(block, &mut [IoSliceMut::new(&mut buf)])?;
        Ok(buf)
    }

    /// Writes a block from one contiguous canonical image.
    fn write_block_from_slice(&self, block: usize, src: &[u8]) -> Result<()> {
        self.write_block(block, &[IoSlice::new(src)])
    }
}

impl<T: StorageTier + ?Sized> StorageTierExt for T {}

/// Checks `block` is in range and the segments add up to `bytes_per_block`.
pub(crate) fn check_io(
    kind: TierKind,
    op: &'static str,
    block: usize,
    num_blocks: usize,
    segments_len: usize,
    bytes_per_block: usize,
) -> Result<()> {
    if block >= num_blocks {
        return Err(Error::out_of_range("block", block, num_blocks)
            .with("tier", kind)
            .with("op", op));
    }
    if segments_len != bytes_per_block {
        return Err(Error::invalid_argument(format!(
            "buffers hold {segments_len} bytes but a block is {bytes_per_block}"
        ))
        .with("tier", kind)
        .with("op", op)
        .with("block", block));
    }
    Ok(())
}

/// Copies between two segment lists that describe the same canonical image (same total length),
/// cutting at whichever boundary comes first.
pub(crate) fn copy_segments(src: &[IoSlice<'_>], dst: &mut [IoSliceMut<'_>]) {
    crate::memcopy::copy_segments(src, dst, crate::memcopy::CopyMethod::Plain)
}

/// Sum of segment lengths.
pub(crate) fn total_len<T: std::ops::Deref<Target = [u8]>>(segments: &[T]) -> usize {
    segments.iter().map(|s| s.len()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_segments_crosses_boundaries() {
        let a: Vec<u8> = (0..10).collect();
        let b: Vec<u8> = (10..16).collect();
        let src = [
            IoSlice::new(&a[..3]),
            IoSlice::new(&a[3..]),
            IoSlice::new(&b),
        ];
        let mut x = [0u8; 7];
        let mut y = [0u8; 9];
        {
            let mut dst = [IoSliceMut::new(&mut x), IoSliceMut::new(&mut y)];
            copy_segments(&src, &mut dst);
        }
        let joined: Vec<u8> = x.iter().chain(y.iter()).copied().collect();
        assert_eq!(joined, (0..16).collect::<Vec<u8>>());
    }

    #[test]
    fn tier_kind_names() {
        assert_eq!(TierKind::Disk.to_string(), "disk");
        assert_eq!(TierKind::Disk.level(), "G3");
        assert_eq!("HOST".parse::<TierKind>().unwrap(), TierKind::Host);
    }
}
