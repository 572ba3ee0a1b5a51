//! Per-tier block pools: which blocks of a tier are free, being written, in use, or cached.
//!
//! A [`BlockPool`] owns the *bookkeeping* of one tier's `num_blocks` block ids (never the bytes;
//! those live in a [`crate::StorageTier`]). Every block is in exactly one state:
//!
//! | state      | held by                          | registered (matchable) | evictable |
//! |------------|----------------------------------|------------------------|-----------|
//! | *free*     | nobody                           | no                     | no        |
//! | *mutable*  | one [`MutableBlock`]             | no                     | no        |
//! | *active*   | one or more [`ImmutableBlock`]s  | yes                    | no        |
//! | *inactive* | nobody                           | yes                    | yes       |
//!
//! Transitions:
//!
//! * [`BlockPool::allocate`] hands out free blocks first, then evicts inactive blocks in the
//!   order of the pool's [`EvictionPolicy`] (their [`SequenceHash`](crate::identity::SequenceHash) is unregistered); all or
//!   nothing.
//! * [`BlockPool::register`] turns a written [`MutableBlock`] into an active [`ImmutableBlock`]
//!   under its hash. If the hash is already registered the existing block is returned instead and
//!   the new one goes back to the free list (deduplication).
//! * Dropping a [`MutableBlock`] returns its block to the free list (its content was never
//!   registered). Dropping the last [`ImmutableBlock`] of a block makes it inactive: it stays
//!   registered and joins the eviction list its policy picks.
//! * [`BlockPool::match_prefix`] takes a handle on each block of the registered prefix of a hash
//!   list, pulling inactive ones out of the eviction lists (so they count as recently used, and
//!   reused, once released). It stops at the first key not registered: every block it returns
//!   has its parent (the previous key) returned too.
//!
//! Invariants (checked by the unit tests in `pool/tests.rs` and the property tests in `tests/pool_props.rs`):
//!
//! * `free + mutable + active + inactive == num_blocks`, always;
//! * a block with a live handle is never evicted and never handed out again;
//! * a hash maps to at most one block, and a registered block is active or inactive.
//!
//! Cost: every operation is O(1) per block touched. The eviction lists (one for LRU, two for
//! 2Q, five for the prefix policy, whose victim is the best of the five heads) are intrusive
//! doubly-linked lists and the free list an intrusive stack, all threaded through one per-block
//! slot array with `u32` links (about 48 bytes per block, no per-block allocation); the hash →
//! block map and the ghost of evicted keys (2Q: the last `num_blocks` evictions, prefix: the
//! last 8 × `num_blocks`; a bucketed table of 8-byte entries, no map, 8 to 16 bytes per key) are
//! sized up front so they never grow under the lock. The prefix policy also runs two miniature
//! pools over a sample of the keys (its duel, which turns the credit on and off; a pool below
//! 512 blocks is simulated whole, a larger one at 128 to 255 blocks each): a sampled key costs
//! two more pool operations. All state sits behind one
//!
//! The module also holds [`match_across`] (prefix match over host then disk) and the
//! [`FrequencyFilter`] that gates the host → disk offload.
//!
//! Layout (`src/pool/`):
//!
//! * `handles.rs`: [`BlockPool`], [`MutableBlock`], [`ImmutableBlock`];
//! * `state.rs`: the bookkeeping behind the lock (slots, free stack, hash map, eviction lists,
//!   clock, transitions);
//! * `eviction.rs`: [`EvictionPolicy`] (the names) and the eviction trait the bookkeeping
//!   calls, with one file per policy under `eviction/` (`lru.rs`, `two_q.rs`, `prefix.rs` with
//!   its duel, and `ghost.rs`, the evicted keys 2Q and the prefix policy remember); its module
//!   documentation says how to add a policy;
//! * `tiered.rs`: [`match_across`], [`TieredMatch`];
//! * `events.rs`: [`KeyEvent`], the keys a pool registered and removed, recorded when asked for;
//! * `filter.rs`: [`FrequencyFilter`].

use std::hash::{BuildHasherDefault, Hasher};

use serde::Serialize;

mod events;
mod eviction;
mod filter;
mod handles;
mod state;
mod tiered;

pub(crate) use events::DropOldest;
pub use events::KeyEvent;
pub use eviction::EvictionPolicy;
pub use filter::FrequencyFilter;
pub use handles::{BlockPool, ImmutableBlock, MutableBlock};
pub use tiered::{match_across, TieredMatch};

/// The largest pool: block ids are kept as `u32` internally and `u32::MAX` marks "no block".
pub const MAX_POOL_BLOCKS: usize = (u32::MAX - 1) as usize;

// --- hashing -------------------------------------------------------------------------------------

/// Hasher for keys that are already 128-bit hashes: one folded multiply instead of SipHash.
///
/// A pure pass-through would be enough for real keys (xxh3 / SHA-256 outputs), but the fold also
/// spreads low-entropy keys (tests, small integers) over the top bits the map uses for its tags.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SeqHasher(u64);

impl Hasher for SeqHasher {
    fn finish(&self) -> u64 {
        const K: u64 = 0x9E37_79B9_7F4A_7C15;
        let p = u128::from(self.0 ^ 0x2D35_8DCC_AA6C_78A5) * u128::from(K);
        (p as u64) ^ ((p >> 64) as u64)
    }

    fn write(&mut self, bytes: &[u8]) {
        // Not reached for `SequenceHash` (it hashes as one `write_u128`); kept total for safety.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, i: u64) {
        self.0 ^= i;
    }

    fn write_u128(&mut self, i: u128) {
        // Both halves feed the map's hash: keys that differ only in their high half still spread.
        self.0 ^= (i as u64) ^ ((i >> 64) as u64).rotate_left(32);
    }
}

/// Builds [`SeqHasher`]s: for maps and sets keyed by [`SequenceHash`](crate::identity::SequenceHash) (alone or with a tier).
pub(crate) type BuildSeqHasher = BuildHasherDefault<SeqHasher>;

// --- stats ---------------------------------------------------------------------------------------

/// A snapshot of a pool's block counts. `free + mutable + active + inactive == num_blocks`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PoolStats {
    /// Blocks on the free list (hold nothing).
    pub free: usize,
    /// Blocks held by a [`MutableBlock`] (being written).
    pub mutable: usize,
    /// Registered blocks held by at least one [`ImmutableBlock`].
    pub active: usize,
    /// Registered blocks nobody holds: matchable, and evictable in LRU order.
    pub inactive: usize,
    /// Registered hashes (`active + inactive`).
    pub registered: usize,
    /// Blocks evicted (unregistered to be reused) since the pool was created.
    pub evictions: u64,
}

impl PoolStats {
    /// `free + mutable + active + inactive`: equals the pool's `num_blocks`.
    pub fn total(&self) -> usize {
        self.free + self.mutable + self.active + self.inactive
    }
}

#[cfg(test)]
mod tests;
