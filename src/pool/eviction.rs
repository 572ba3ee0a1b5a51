//! Eviction: which inactive block a full pool gives up, behind one trait, one file per policy.
//!
//! The block bookkeeping ([`super::state`]) keeps every inactive block in one of
//! [`NUM_LISTS`] intrusive eviction lists threaded through its slot array (no per-block
//! allocation, O(1) insert and unlink), each ordered by a stamp, oldest at the head. A policy
//! ([`Eviction`]) owns no block: it decides where a released block goes
//! ([`Eviction::place`]: which list, which stamp), which list head leaves next
//! ([`Eviction::victim`]), and keeps whatever else it needs of its own (2Q's and the prefix
//! policy's [`Ghost`] of evicted keys, the prefix policy's duel), fed by the hooks the pool
//! calls under its lock (an eviction, a key registered again, a lookup's demand, a store, a new
//! epoch). Every hook is O(1) per block touched.
//!
//! | policy                  | file                  | lists used                           |
//! |-------------------------|-----------------------|--------------------------------------|
//! | [`EvictionPolicy::Lru`]    | `eviction/lru.rs`     | 0                                    |
//! | [`EvictionPolicy::TwoQ`]   | `eviction/two_q.rs`   | 0 (probation), 1 (main)              |
//! | [`EvictionPolicy::Prefix`] | `eviction/prefix.rs`  | one per reuse count, `0..=MAX_USES`  |
//!
//! The pool holds its policy as a `Box<dyn Eviction>` (one virtual call per hook, under the lock
//! the operation takes anyway); [`EvictionPolicy`] names the policies for configuration.
//!
//! # Adding a policy
//!
//! 1. Write `eviction/<name>.rs`: a type implementing [`Eviction`] (its constructor sizes
//!    everything it keeps up front, so that no hook allocates), with its `mod` line below.
//! 2. Add its variant to [`EvictionPolicy`] (the `serde` / `strum` name is the configuration
//!    value, documented on the variant) and its arm to [`EvictionPolicy::build`]; the compiler
//!    points at that one `match`.
//!
//! Nothing else changes: the bookkeeping, the handles and the tool (`kvbm sweep --eviction`
//! lists [`EvictionPolicy`]'s names) take the new policy as they are.

mod ghost;
mod lru;
mod prefix;
mod two_q;

use std::fmt;

use serde::Serialize;

use crate::error::Result;
use crate::identity::SequenceHash;

pub(crate) use ghost::Ghost;
pub(crate) use lru::Lru;
pub(crate) use prefix::Prefix;
pub(crate) use two_q::TwoQ;

pub(crate) use super::state::InactiveLists;

/// The most reuses a block's count keeps (the prefix policy's top class).
pub(crate) const MAX_USES: u8 = 4;

/// Eviction lists a policy may use: the prefix policy keeps one per reuse count
/// `0..=MAX_USES`; 2Q uses lists 0 (probation) and 1 (main); LRU list 0 only.
pub(crate) const NUM_LISTS: usize = MAX_USES as usize + 1;

/// Which inactive block a full pool evicts to make room (config `eviction`, `KVBM_EVICTION`).
///
/// Every policy is O(1) per block and evicts only inactive blocks (nobody holds them). A
/// *reuse* is a block matched by [`BlockPool::match_prefix`](super::BlockPool::match_prefix) or
/// stored again under its key (dedup, or its key registered again soon after it was evicted);
/// cloning a handle is not one. docs/benchmarks.md ("Eviction policies") has the measurements behind the default.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    serde::Deserialize,
    strum::Display,
    strum::EnumString,
    strum::VariantNames,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase", ascii_case_insensitive)]
pub enum EvictionPolicy {
    /// Least recently used first (released blocks join the most-recently-used end).
    Lru,
    /// 2Q (Johnson & Shasha, 1994), simplified: blocks never reused wait in a FIFO probation
    /// list that is evicted from first once it holds a quarter of the pool; reused blocks live
    /// in an LRU main list. Keys evicted from probation are remembered (as many as the pool
    /// has blocks), and one stored again joins the main list directly.
    #[serde(rename = "2q")]
    #[strum(serialize = "2q")]
    TwoQ,
    /// Prefix-aware reuse credit (ours): a block's eviction priority is the time
    /// it was released plus a credit that doubles with each reuse (`num_blocks` blocks of time
    /// for one reuse, up to 8 × `num_blocks` for four or more), the smallest going first. The
    /// blocks released together (one request's chain) share one time and leave deepest first
    /// (a block held after it was stored, e.g. while it is written through to disk, keeps the
    /// time of the request that stored it),
    /// and a child never has more reuses than its parent, so a parent outlives its children:
    /// a cached block is (almost) never orphaned. The reuse counts of evicted keys are
    /// remembered for 8 × `num_blocks` evictions, so a conversation returning after the cache
    /// turned over regains its credit. The credit applies only where it pays: two miniature
    /// pools (one with the credit, one without) replay a sample of the keys looked up, and the
    /// pool applies the credit while the credited one has been right more often lately, by a
    /// margin. The default: on Mooncake's conversation trace it reuses 8.64 / 17.06 / 30.29% of
    /// prompt tokens at 1M / 3M / 10M tokens of host cache where LRU reuses 5.5 / 14.3 / 29.8%,
    /// on its synthetic trace it is never more than 0.03 points below LRU from 1M to 10M tokens,
    /// and on the replay's built-in workloads it is never more than 0.5 points below LRU; see
    /// docs/benchmarks.md.
    #[default]
    Prefix,
}

impl EvictionPolicy {
    /// The policy's state for a pool of `num_blocks` blocks: the one place a name meets its
    /// implementation. Errors: its bookkeeping cannot be allocated (invalid argument).
    pub(crate) fn build(self, num_blocks: u32) -> Result<Box<dyn Eviction>> {
        Ok(match self {
            Self::Lru => Box::new(Lru),
            Self::TwoQ => Box::new(TwoQ::new(num_blocks)?),
            Self::Prefix => Box::new(Prefix::new(num_blocks)?),
        })
    }
}

/// A block just made inactive (its last handle dropped while it is still registered), as
/// [`Eviction::place`] sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Released {
    /// Its reuse count, this release's reuse included (capped at [`MAX_USES`]).
    pub(crate) uses: u8,
    /// The pool's clock, this release counted: a new value at every release.
    pub(crate) clock: u64,
    /// The epoch of the request that last used it: the current epoch if it was reused while
    /// held, else the (earlier or equal) epoch it was allocated in. Blocks released by one
    /// request share it.
    pub(crate) epoch: u64,
}

/// Where a released block goes: list `list`, ordered by `stamp`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Placement {
    /// The eviction list, below [`NUM_LISTS`].
    pub(crate) list: usize,
    /// Orders the list (oldest at the head); a stamp older than the list's tail goes in front of
    /// the newer blocks (looking back a bounded number of blocks).
    pub(crate) stamp: u64,
    /// Among the tail's blocks of the same stamp, go in front of them (leave first), so that a
    /// chain released parent → child leaves child first; false: behind them.
    pub(crate) run_first: bool,
}

/// An eviction policy: where released blocks go and which one leaves next, over the
/// bookkeeping's eviction lists. Implementations allocate in their constructor only and keep
/// every hook O(1) per block. The hooks other than [`Eviction::place`] and
/// [`Eviction::victim`] default to doing nothing.
pub(crate) trait Eviction: fmt::Debug + Send {
    /// The list and stamp a block just made inactive takes.
    fn place(&self, released: Released) -> Placement;

    /// The inactive block to evict next, from `lists`' heads (`None` if none is inactive).
    fn victim(&self, lists: InactiveLists<'_>) -> Option<u32>;

    /// A block was evicted: its key `hash` was unregistered from list `list`, with `uses`
    /// reuses.
    fn evicted(&mut self, hash: SequenceHash, list: usize, uses: u8) {
        let _ = (hash, list, uses);
    }

    /// `hash`, not registered, is being registered: the reuse count remembered for it (it was
    /// evicted not long ago), forgotten now; `None` if not remembered.
    fn recall(&mut self, hash: SequenceHash) -> Option<u8> {
        let _ = hash;
        None
    }

    /// Whether a lookup ending an epoch that allocated blocks and released none ticks the clock
    /// (so that those blocks, released later, are older than the new request's).
    fn ticks_on_lookup(&self) -> bool {
        false
    }

    /// A new epoch began with the pool's clock at `clock`.
    fn epoch_began(&mut self, clock: u64) {
        let _ = clock;
    }

    /// A lookup asked for `hashes` and the pool matched the first `matched` of them.
    fn observe_demand(&mut self, hashes: &[SequenceHash], matched: usize) {
        let _ = (hashes, matched);
    }

    /// `hash` is being registered (stored, or stored again and deduplicated).
    fn observe_store(&mut self, hash: SequenceHash) {
        let _ = hash;
    }
}
