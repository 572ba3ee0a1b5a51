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
//!   order of the pool's [`EvictionPolicy`] (their [`SequenceHash`] is unregistered); all or
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
//! Invariants (checked by the unit tests below and the property tests in `tests/pool_props.rs`):
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
//! `parking_lot::Mutex`; handles hold an `Arc` of the pool and lock briefly on clone and drop.
//!
//! The module also holds [`match_across`] (prefix match over host then disk) and the
//! [`FrequencyFilter`] that gates the host → disk offload.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use parking_lot::Mutex;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::identity::SequenceHash;
use crate::tier::TierKind;

/// The largest pool: block ids are kept as `u32` internally and `u32::MAX` marks "no block".
pub const MAX_POOL_BLOCKS: usize = (u32::MAX - 1) as usize;

/// "No block" in the intrusive lists. Never a valid slot index (`num_blocks <= u32::MAX - 1`), so
/// `slots.get(NIL as usize)` is `None`.
const NIL: u32 = u32::MAX;

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

/// Builds [`SeqHasher`]s: for maps and sets keyed by [`SequenceHash`] (alone or with a tier).
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

// --- eviction policy -----------------------------------------------------------------------------

/// Which inactive block a full pool evicts to make room (config `eviction`, `KVBM_EVICTION`).
///
/// Every policy is O(1) per block and evicts only inactive blocks (nobody holds them). A
/// *reuse* is a block matched by [`BlockPool::match_prefix`] or stored again under its key
/// (dedup, or its key registered again soon after it was evicted); cloning a handle is not one.
/// docs/benchmarks.md ("Eviction policies") has the measurements behind the default.
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
    /// pool applies the credit while the credited one has been right more often lately. The
    /// default: on the Mooncake trace it reuses 8.65 / 17.34 / 30.36% of prompt tokens at 1M / 3M
    /// / 10M tokens of host cache where LRU reuses 5.5 / 14.3 / 29.8%, and on the replay's
    /// built-in workloads it is never more than 0.5 points below LRU; see docs/benchmarks.md.
    #[default]
    Prefix,
}

// --- internal state ------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    Mutable,
    Active,
    Inactive,
}

/// One block's bookkeeping. `prev`/`next` link the block's eviction list (inactive) or the free
/// stack (`next` only).
#[derive(Debug, Clone, Copy)]
struct Slot {
    /// Valid while the block is active or inactive.
    hash: SequenceHash,
    /// Live [`ImmutableBlock`]s; non-zero exactly while active.
    refs: usize,
    /// While inactive: the time that orders the eviction lists (the clock for LRU and 2Q, the
    /// epoch for the prefix policy). While mutable or active until its first reuse: the epoch
    /// it was allocated in (the prefix policy's time for its first release, see
    /// [`State::release_immutable`]).
    stamp: u64,
    prev: u32,
    next: u32,
    state: SlotState,
    /// The eviction list the block is in while inactive.
    list: u8,
    /// Reuses seen so far (matched or stored again), capped at [`MAX_USES`].
    uses: u8,
    /// Matched (or stored again) during the current active period: counted as one reuse when
    /// the last handle drops, however many handles were taken meanwhile.
    touched: bool,
}

/// One intrusive doubly-linked list of inactive blocks, oldest (next to evict) at `head`.
#[derive(Debug, Clone, Copy)]
struct List {
    head: u32,
    tail: u32,
    len: usize,
    /// First block of the run at the tail that shares the tail's stamp (prefix policy: a
    /// block released with the same stamp goes in front of that run, so a chain released
    /// parent → child ends up child first).
    run: u32,
}

impl List {
    const EMPTY: List = List {
        head: NIL,
        tail: NIL,
        len: 0,
        run: NIL,
    };
}

/// The most reuses a block's count keeps (the prefix policy's top class).
const MAX_USES: u8 = 4;

/// Eviction lists: the prefix policy keeps one per reuse count `0..=MAX_USES`; 2Q uses lists 0
/// (probation) and 1 (main); LRU list 0 only.
const NUM_LISTS: usize = MAX_USES as usize + 1;

/// The prefix policy remembers the reuse counts of this many times `num_blocks` evicted keys.
const PREFIX_GHOST_FACTOR: usize = 8;

/// The prefix policy looks back at most this many blocks from the tail's run to place a block
/// released late (older than the newest inactive block), or to find the front of the tail's
/// run when its pointer is unset (see `State::run_front`).
const LATE_INSERT_WALK: usize = 64;

/// 2Q's probation list may hold this fraction (1 / n) of the pool before it is evicted from
/// first.
const TWO_Q_PROBATION_DIVISOR: usize = 4;

#[derive(Debug)]
struct State {
    policy: EvictionPolicy,
    slots: Vec<Slot>,
    map: HashMap<SequenceHash, u32, BuildSeqHasher>,
    free_head: u32,
    free_len: usize,
    lists: [List; NUM_LISTS],
    /// Inactive blocks (the sum of the lists' lengths).
    inactive: usize,
    /// Blocks made inactive so far, plus (prefix policy) one tick for each lookup ending an
    /// epoch that allocated blocks and saw no release: the pool's clock (LRU and 2Q stamp each
    /// block with it).
    clock: u64,
    /// A block was allocated since the epoch began (see [`State::new_epoch`]).
    allocated_in_epoch: bool,
    /// The clock at the last `allocate` or `match_prefix` call: the prefix policy stamps every
    /// block reused and released since with it, so one request's blocks share a stamp (a block
    /// released for the first time since it was stored takes the epoch it was allocated in).
    epoch: u64,
    /// Prefix policy: credit of list `c`, in clock ticks (`num_blocks << (c - 1)`, 0 for c = 0).
    credit: [u64; NUM_LISTS],
    /// Prefix policy: whether the credit applies now (the duel's verdict; always for a
    /// miniature).
    credit_on: bool,
    /// 2Q: the probation list is evicted from first once it holds this many blocks.
    probation_target: usize,
    ghost: Ghost,
    /// Prefix policy: the miniature simulations that turn the credit on and off (`None` in a
    /// miniature itself and for the other policies).
    duel: Option<Box<Duel>>,
    mutable: usize,
    active: usize,
    evictions: u64,
}

impl State {
    fn new(num_blocks: u32, policy: EvictionPolicy) -> Result<Self> {
        let mut st = Self::bare(num_blocks, policy, true)?;
        if policy == EvictionPolicy::Prefix {
            st.duel = Some(Box::new(Duel::new(num_blocks)?));
            // No credit until the duel shows it pays (see `Duel::use_key`).
            st.credit_on = false;
        }
        Ok(st)
    }

    /// A state without a duel; `credit`: the prefix policy's credit and ghost (false: a
    /// miniature of prefix order alone, which needs neither).
    fn bare(num_blocks: u32, policy: EvictionPolicy, credit: bool) -> Result<Self> {
        let n = num_blocks as usize;
        let mut slots = Vec::new();
        slots.try_reserve_exact(n).map_err(|e| {
            Error::invalid_argument(format!("cannot allocate bookkeeping for {n} blocks: {e}"))
        })?;
        // Free stack: 0 on top, so a fresh pool hands out 0, 1, 2, ...
        slots.extend((0..num_blocks).map(|i| Slot {
            hash: SequenceHash(0),
            refs: 0,
            stamp: 0,
            prev: NIL,
            next: if i + 1 < num_blocks { i + 1 } else { NIL },
            state: SlotState::Free,
            list: 0,
            uses: 0,
            touched: false,
        }));
        let mut map = HashMap::with_hasher(BuildSeqHasher::default());
        map.try_reserve(n).map_err(|e| {
            Error::invalid_argument(format!("cannot allocate the hash map for {n} blocks: {e}"))
        })?;
        // Touch the table's memory now: reserving only maps it, so otherwise the first key stored
        // in each of its pages takes a page fault on the engine's hot path (a store's
        // completion), for as long as the pool is filling. Filling it once and clearing it keeps
        // the memory (about 20 ns per block, once).
        for i in 0..num_blocks {
            map.insert(SequenceHash(u128::from(i)), i);
        }
        map.clear();
        let ghost_len = match policy {
            EvictionPolicy::Lru => 0,
            EvictionPolicy::TwoQ => n,
            EvictionPolicy::Prefix if credit => n.saturating_mul(PREFIX_GHOST_FACTOR),
            EvictionPolicy::Prefix => 0,
        };
        let credit_on = credit;
        let mut credit = [0u64; NUM_LISTS];
        for (c, slot) in credit.iter_mut().enumerate().skip(1) {
            *slot = (n as u64).saturating_mul(1u64 << (c - 1));
        }
        Ok(Self {
            policy,
            slots,
            map,
            free_head: if num_blocks > 0 { 0 } else { NIL },
            free_len: n,
            lists: [List::EMPTY; NUM_LISTS],
            inactive: 0,
            clock: 0,
            epoch: 0,
            allocated_in_epoch: false,
            credit,
            credit_on,
            probation_target: (n / TWO_Q_PROBATION_DIVISOR).max(1),
            ghost: Ghost::new(ghost_len)?,
            duel: None,
            mutable: 0,
            active: 0,
            evictions: 0,
        })
    }

    fn stats(&self) -> PoolStats {
        PoolStats {
            free: self.free_len,
            mutable: self.mutable,
            active: self.active,
            inactive: self.inactive,
            registered: self.map.len(),
            evictions: self.evictions,
        }
    }

    fn state_of(&self, id: u32) -> Option<SlotState> {
        self.slots.get(id as usize).map(|s| s.state)
    }

    // --- intrusive lists ---

    fn free_push(&mut self, id: u32) {
        let head = self.free_head;
        if let Some(s) = self.slots.get_mut(id as usize) {
            s.state = SlotState::Free;
            s.refs = 0;
            s.prev = NIL;
            s.next = head;
            self.free_head = id;
            self.free_len += 1;
        }
    }

    fn free_pop(&mut self) -> Option<u32> {
        let id = self.free_head;
        let s = self.slots.get_mut(id as usize)?;
        self.free_head = s.next;
        s.next = NIL;
        self.free_len = self.free_len.saturating_sub(1);
        Some(id)
    }

    /// Puts inactive `id` into eviction list `l` with `stamp`: at the tail, or (`run_first`)
    /// in front of the tail's run of blocks with the same stamp. A stamp older than the tail's
    /// (a block released late, see [`State::release_immutable`]) goes in front of the newer
    /// blocks (see [`State::run_front`]).
    fn list_insert(&mut self, l: usize, id: u32, stamp: u64, run_first: bool) {
        let Some(list) = self.lists.get(l).copied() else {
            return;
        };
        let tail_stamp = self.slots.get(list.tail as usize).map(|t| t.stamp);
        let late = tail_stamp.is_some_and(|t| t > stamp);
        let before = if late || (run_first && tail_stamp == Some(stamp)) {
            self.run_front(&list, stamp)
        } else {
            NIL
        };
        let prev = match self.slots.get(before as usize) {
            Some(b) => b.prev,
            None => list.tail,
        };
        let Some(s) = self.slots.get_mut(id as usize) else {
            return;
        };
        s.list = l as u8;
        s.stamp = stamp;
        s.prev = prev;
        s.next = before;
        let list = &mut self.lists[l];
        match self.slots.get_mut(prev as usize) {
            Some(p) => p.next = id,
            None => list.head = id,
        }
        match self.slots.get_mut(before as usize) {
            Some(b) => b.prev = id,
            None => list.tail = id,
        }
        if !late {
            // The new block starts the tail's run (alone, or in front of same-stamp blocks).
            // A late one sits in front of the tail's run, which it does not join.
            list.run = id;
        }
        list.len += 1;
        self.inactive += 1;
    }

    /// The block a block stamped `stamp` (not newer than `list`'s tail) goes in front of: the
    /// first of the blocks stamped `stamp` or later, so that it leaves before them (among equal
    /// stamps the one released last leaves first, as a chain's deepest block does). The walk
    /// starts at the tail's run (known in O(1) while `run` is set) and looks back at most
    /// [`LATE_INSERT_WALK`] blocks, so that a release stays O(1); a block released later than
    /// that is placed a little too young.
    fn run_front(&self, list: &List, stamp: u64) -> u32 {
        let mut at = if list.run == NIL { list.tail } else { list.run };
        for _ in 0..LATE_INSERT_WALK {
            let Some(prev) = self.slots.get(at as usize).map(|s| s.prev) else {
                break;
            };
            match self.slots.get(prev as usize) {
                Some(p) if p.stamp >= stamp => at = prev,
                _ => break,
            }
        }
        at
    }

    fn list_unlink(&mut self, id: u32) {
        let Some(s) = self.slots.get_mut(id as usize) else {
            return;
        };
        let (prev, next, l) = (s.prev, s.next, s.list as usize);
        s.prev = NIL;
        s.next = NIL;
        let Some(list) = self.lists.get_mut(l) else {
            return;
        };
        if list.run == id {
            // The run continues with the next block (same stamp up to the tail), if any.
            list.run = next;
        }
        match self.slots.get_mut(prev as usize) {
            Some(p) => p.next = next,
            None => list.head = next,
        }
        match self.slots.get_mut(next as usize) {
            Some(n) => n.prev = prev,
            None => list.tail = prev,
        }
        list.len = list.len.saturating_sub(1);
        self.inactive = self.inactive.saturating_sub(1);
    }

    /// The inactive block the policy evicts next (`None` if none is inactive).
    fn victim(&self) -> Option<u32> {
        match self.policy {
            EvictionPolicy::Lru => Some(self.lists[0].head).filter(|&id| id != NIL),
            EvictionPolicy::TwoQ => {
                let (probation, main) = (&self.lists[0], &self.lists[1]);
                let l = if probation.len >= self.probation_target || main.len == 0 {
                    probation
                } else {
                    main
                };
                Some(l.head).filter(|&id| id != NIL)
            }
            EvictionPolicy::Prefix => {
                // The smallest (stamp + credit of its list); a tie goes to the lower list.
                let mut best: Option<(u64, u32)> = None;
                for (l, list) in self.lists.iter().enumerate() {
                    let Some(head) = self.slots.get(list.head as usize) else {
                        continue;
                    };
                    let credit = if self.credit_on { self.credit[l] } else { 0 };
                    let p = head.stamp.saturating_add(credit);
                    if best.is_none_or(|(b, _)| p < b) {
                        best = Some((p, list.head));
                    }
                }
                best.map(|(_, id)| id)
            }
        }
    }

    // --- the prefix policy's duel ---

    /// A new request's releases start: the prefix policy stamps every block released from now
    /// until the next call with the clock as it is now (and so do the miniatures). `lookup`: a
    /// lookup starts the epoch (a new request); if blocks were allocated in the epoch ending
    /// and none was released since it began, the clock takes one tick, so that those blocks
    /// (released later, see `release_immutable`) are older than the new request's. An
    /// allocation takes no tick: a caller allocating a request's blocks one call at a time
    /// keeps one epoch for them.
    fn new_epoch(&mut self, lookup: bool) {
        if lookup
            && self.policy == EvictionPolicy::Prefix
            && self.allocated_in_epoch
            && self.clock == self.epoch
        {
            self.clock += 1;
        }
        self.allocated_in_epoch = false;
        self.epoch = self.clock;
        if let Some(d) = self.duel.as_mut() {
            // The miniatures keep the pool's time, scaled by their size: a credit of
            // `num_blocks / rate` of their ticks then lasts as long as the pool's own. (Their
            // own clocks run at their uses, which can be many more than the pool's releases:
            // a block matched again while held is released once.)
            let now = self.clock / (d.mask + 1);
            d.credited.epoch = now;
            d.plain.epoch = now;
        }
    }

    /// A lookup asked for `hashes` and the pool matched the first `matched` of them: the duel's
    /// miniatures see the sampled ones (see [`Duel::observe_demand`]), and the credit follows
    /// the one of them that has been right more often lately.
    fn observe_demand(&mut self, hashes: &[SequenceHash], matched: usize) {
        let Some(d) = self.duel.as_mut() else {
            return;
        };
        if let Some(on) = d.observe_demand(hashes, matched) {
            self.credit_on = on;
        }
    }

    /// A key is stored: the miniatures store it too if it is sampled and they lack it (a key a
    /// lookup asked for is in them already; one stored without a lookup, e.g. written
    /// through, enters them here). Not a use: it moves no score and counts no reuse.
    fn observe_store(&mut self, hash: SequenceHash) {
        if let Some(d) = self.duel.as_mut() {
            d.store(hash);
        }
    }

    /// A miniature's use of `hash`: a hit (the block is reused and released at once) or a miss
    /// (the key is stored in a free or evicted block and released). True on a hit.
    fn access(&mut self, hash: SequenceHash) -> bool {
        if let Some(&id) = self.map.get(&hash) {
            if self.acquire(id, true) {
                self.release_immutable(id);
                return true;
            }
            return false;
        }
        self.insert(hash);
        false
    }

    /// A miniature stores `hash` (not registered) in a free or evicted block and releases it.
    fn insert(&mut self, hash: SequenceHash) {
        if let Some(id) = self.take_one() {
            // Cannot fail: `id` was just made mutable and `hash` is not registered.
            if let Ok(id) = self.register(TierKind::Host, id, hash) {
                self.release_immutable(id);
            }
        }
    }

    // --- transitions ---

    /// Takes `n` blocks (free first, then evictions in the policy's order) and marks them
    /// mutable. All or nothing.
    fn allocate(&mut self, kind: TierKind, n: usize) -> Result<Vec<u32>> {
        self.new_epoch(false);
        let available = self.free_len + self.inactive;
        if n > available {
            return Err(Error::no_space("blocks", self.slots.len(), available, n)
                .with("tier", kind)
                .with("op", "allocate"));
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            match self.take_one() {
                Some(id) => out.push(id),
                None => {
                    // Counters disagree with the lists: a bug. Give back what was taken.
                    for id in out {
                        self.release_mutable(id);
                    }
                    return Err(Error::internal(format!(
                        "pool counted {available} available blocks but could not take {n}"
                    ))
                    .with("tier", kind)
                    .with("op", "allocate"));
                }
            }
        }
        Ok(out)
    }

    /// One free block, or else the policy's victim (unregistered), as mutable.
    fn take_one(&mut self) -> Option<u32> {
        let id = match self.free_pop() {
            Some(id) => id,
            None => {
                let id = self.victim()?;
                let s = self.slots.get(id as usize)?;
                let (hash, list, uses) = (s.hash, s.list, s.uses);
                self.list_unlink(id);
                if let Entry::Occupied(e) = self.map.entry(hash) {
                    if *e.get() == id {
                        e.remove();
                    }
                }
                // 2Q remembers keys evicted from probation; the prefix policy every key's count.
                if self.policy == EvictionPolicy::Prefix || list == 0 {
                    self.ghost.record(hash, uses);
                }
                self.evictions += 1;
                id
            }
        };
        let epoch = self.epoch;
        self.allocated_in_epoch = true;
        let s = self.slots.get_mut(id as usize)?;
        s.state = SlotState::Mutable;
        s.refs = 0;
        s.stamp = epoch;
        self.mutable += 1;
        Some(id)
    }

    /// Mutable → free. Ignores a block that is not mutable (never happens by construction).
    fn release_mutable(&mut self, id: u32) {
        if self.state_of(id) == Some(SlotState::Mutable) {
            self.mutable = self.mutable.saturating_sub(1);
            self.free_push(id);
        }
    }

    /// One more handle on a registered block; inactive → active. `reuse`: the block is being
    /// reused (matched or stored again), not merely cloned. False if not registered.
    fn acquire(&mut self, id: u32, reuse: bool) -> bool {
        match self.state_of(id) {
            Some(SlotState::Active) => {
                if let Some(s) = self.slots.get_mut(id as usize) {
                    s.refs += 1;
                    s.touched |= reuse;
                }
                true
            }
            Some(SlotState::Inactive) => {
                self.list_unlink(id);
                if let Some(s) = self.slots.get_mut(id as usize) {
                    s.state = SlotState::Active;
                    s.refs = 1;
                    s.touched = reuse;
                }
                self.active += 1;
                true
            }
            _ => false,
        }
    }

    /// One handle fewer; the last one makes the block inactive (into the list its policy
    /// picks), or free if it was unregistered meanwhile.
    fn release_immutable(&mut self, id: u32) {
        let Some(s) = self.slots.get_mut(id as usize) else {
            return;
        };
        if s.state != SlotState::Active {
            return;
        }
        s.refs = s.refs.saturating_sub(1);
        if s.refs != 0 {
            return;
        }
        // A block released for the first time since it was stored (no reuse meanwhile) was
        // last used by the request that allocated it: it takes that request's epoch, however
        // long an internal hold (a write-through to the next tier) kept it active. Stamped with
        // the epoch at release instead, it would join a later request's blocks and, released
        // after them, leave after them as if it were the deepest of that later chain.
        let stamp = if s.touched {
            s.uses = s.uses.saturating_add(1).min(MAX_USES);
            s.touched = false;
            self.epoch
        } else {
            s.stamp.min(self.epoch)
        };
        let (hash, uses) = (s.hash, s.uses);
        self.active = self.active.saturating_sub(1);
        if self.map.get(&hash) != Some(&id) {
            self.free_push(id);
            return;
        }
        if let Some(s) = self.slots.get_mut(id as usize) {
            s.state = SlotState::Inactive;
        }
        self.clock += 1;
        match self.policy {
            EvictionPolicy::Lru => self.list_insert(0, id, self.clock, false),
            EvictionPolicy::TwoQ => self.list_insert(usize::from(uses > 0), id, self.clock, false),
            EvictionPolicy::Prefix => self.list_insert(usize::from(uses), id, stamp, true),
        }
    }

    /// Removes `id`'s registration (if `id` still holds `hash`); an inactive block becomes free.
    fn unregister(&mut self, id: u32, hash: SequenceHash) -> bool {
        match self.map.entry(hash) {
            Entry::Occupied(e) if *e.get() == id => {
                e.remove();
            }
            _ => return false,
        }
        if self.state_of(id) == Some(SlotState::Inactive) {
            self.list_unlink(id);
            self.free_push(id);
        }
        true
    }

    /// Mutable `id` becomes registered under `hash`; returns the block now holding `hash` with a
    /// handle taken on it (`id`, or the existing block, in which case `id` is freed).
    fn register(&mut self, kind: TierKind, id: u32, hash: SequenceHash) -> Result<u32> {
        if self.state_of(id) != Some(SlotState::Mutable) {
            return Err(Error::internal(format!(
                "block {id} is registered but is not in the mutable state"
            ))
            .with("tier", kind)
            .with("op", "register"));
        }
        let existing = match self.map.entry(hash) {
            Entry::Occupied(e) => Some(*e.get()),
            Entry::Vacant(v) => {
                v.insert(id);
                None
            }
        };
        self.observe_store(hash);
        match existing {
            Some(other) => {
                if !self.acquire(other, true) {
                    return Err(Error::internal(format!(
                        "hash {hash} maps to block {other}, which is not registered"
                    ))
                    .with("tier", kind)
                    .with("op", "register"));
                }
                self.release_mutable(id);
                Ok(other)
            }
            None => {
                // A key evicted not long ago returns: it is being reused.
                let uses = match self.ghost.take(hash) {
                    Some(u) => u.saturating_add(1).min(MAX_USES),
                    None => 0,
                };
                if let Some(s) = self.slots.get_mut(id as usize) {
                    s.state = SlotState::Active;
                    s.refs = 1;
                    s.hash = hash;
                    s.uses = uses;
                    s.touched = false;
                }
                self.mutable = self.mutable.saturating_sub(1);
                self.active += 1;
                Ok(id)
            }
        }
    }
}

// --- the duel -----------------------------------------------------------------------------------

/// The prefix policy's two miniature simulations ("set dueling", after Qureshi et al., ISCA
/// 2007, over a key sample as in Waldspurger et al., USENIX ATC 2017): one keeps the reuse
/// credit, the other evicts in prefix order alone (credit 0). Both see the same sampled keys
/// (one key in `rate`, by its hash) with `num_blocks / rate` blocks each, and keep the pool's
/// time scaled by `rate`. A use is a key a lookup asks for — every key of it, past the pool's
/// first miss too, so that what the miniatures see does not depend on what the pool itself
/// kept; a stored key enters a miniature that lacks it without counting as a use. Each use
/// that one miniature holds and the other does not moves a saturating score one step, and
/// the full pool applies the credit only while the score favours it strictly: with no
/// evidence (a fresh pool, a tie) it evicts in prefix order alone, which is never far from
/// LRU. Credit pays where reuse predicts reuse (long-lived chat traffic) and costs where it
/// does not (conversations of a fixed length keep their past reuses after their last turn):
/// the duel measures which on the traffic at hand instead of guessing.
#[derive(Debug)]
struct Duel {
    /// A key is sampled when these bits of its fingerprint are all 0 (`rate - 1`, `rate` a
    /// power of two).
    mask: u64,
    credited: State,
    plain: State,
    /// In `-DUEL_SCORE_MAX..=DUEL_SCORE_MAX`: up when only `credited` holds a used key, down when
    /// only `plain` does. The credit applies while it is above 0.
    score: i32,
}

/// A pool below this many blocks is simulated whole (rate 1): its miniatures are exact copies
/// of the two policies, and cost little in absolute terms.
const DUEL_WHOLE_BELOW: u32 = 512;

/// A larger pool's miniatures hold at least this many blocks (the largest power-of-two rate
/// that leaves them this many).
const DUEL_MIN_BLOCKS: u32 = 128;

/// The duel's score saturates here: after a long run one way, this many uses going the other
/// way turn the credit over.
const DUEL_SCORE_MAX: i32 = 32;

impl Duel {
    fn new(num_blocks: u32) -> Result<Self> {
        // Rate 1 for a small pool; else the largest power of two `rate` with
        // num_blocks / rate >= DUEL_MIN_BLOCKS.
        let ratio = if num_blocks < DUEL_WHOLE_BELOW {
            1
        } else {
            num_blocks / DUEL_MIN_BLOCKS
        };
        let rate = 1u32 << (31 - ratio.leading_zeros());
        let mini = num_blocks.div_ceil(rate).max(1);
        Ok(Self {
            mask: u64::from(rate - 1),
            credited: State::bare(mini, EvictionPolicy::Prefix, true)?,
            plain: State::bare(mini, EvictionPolicy::Prefix, false)?,
            score: 0,
        })
    }

    /// Whether `hash` is in the sample. Keys are hashes already: their top bits pick it.
    fn sampled(&self, hash: SequenceHash) -> bool {
        ((hash.0 >> 104) as u64) & self.mask == 0
    }

    /// A store of `hash`: each miniature that lacks it (and samples it) stores it.
    fn store(&mut self, hash: SequenceHash) {
        if !self.sampled(hash) {
            return;
        }
        for mini in [&mut self.credited, &mut self.plain] {
            if !mini.map.contains_key(&hash) {
                mini.insert(hash);
            }
        }
    }

    /// A lookup's demand: the sampled keys of `hashes` are uses, past the pool's first miss
    /// (`matched`) too, since what the pool holds beyond a miss is not stored again, so keys
    /// seen only when matched or stored would leave the miniatures blind to exactly the keys the
    /// policy kept. Past the miss, at most as many sampled keys as a miniature has blocks: a
    /// longer demand would only churn its last block (a request's blocks share a stamp and leave
    /// deepest first), at a cost growing with the prompt on the engine's hot path. Returns
    /// whether the credit applies now if the score moved.
    fn observe_demand(&mut self, hashes: &[SequenceHash], matched: usize) -> Option<bool> {
        let cap = self.credited.slots.len();
        let mut past = 0;
        let mut verdict = None;
        for (i, &hash) in hashes.iter().enumerate() {
            if !self.sampled(hash) {
                continue;
            }
            if i >= matched {
                if past == cap {
                    break;
                }
                past += 1;
            }
            verdict = self.use_key(hash).or(verdict);
        }
        verdict
    }

    /// Runs a use of sampled `hash` through both miniatures; returns whether the credit applies
    /// now if this use moved the score.
    fn use_key(&mut self, hash: SequenceHash) -> Option<bool> {
        let with = self.credited.access(hash);
        let without = self.plain.access(hash);
        let step = match (with, without) {
            (true, false) => 1,
            (false, true) => -1,
            _ => return None,
        };
        self.score = (self.score + step).clamp(-DUEL_SCORE_MAX, DUEL_SCORE_MAX);
        Some(self.score > 0)
    }
}

// --- ghost keys ----------------------------------------------------------------------------------

/// Recently evicted keys with their reuse counts: a table of packed entries (32-bit key tag,
/// eviction number mod 2^28, reuse count) in buckets of [`GHOST_WAYS`] (one 64-byte cache
/// line), the bucket picked by the key's low bits. Recording overwrites an empty or expired
/// entry of the key's bucket, else its oldest; taking reads one bucket. The table is sized up
/// front (a power of two at least twice the keys to remember, which keeps buckets from
/// overflowing: 8 to 16 bytes per key), so both are a few
/// compares in one cache line and allocate nothing. A bucket that fills before its keys expire
/// forgets its oldest early; a tag collision (one in 2^32 per compare) hands a reuse count to
/// the wrong key, which costs nothing but a slightly different eviction order.
#[derive(Debug)]
struct Ghost {
    table: Vec<u64>,
    /// Buckets - 1 (the number of buckets is a power of two).
    mask: usize,
    /// An entry is forgotten once this many evictions were recorded after it.
    window: u64,
    /// Evictions recorded so far.
    count: u64,
}

/// Entries per ghost bucket.
const GHOST_WAYS: usize = 8;
/// Bits of an entry's eviction number.
const GHOST_AGE_BITS: u32 = 28;
const GHOST_AGE_MASK: u64 = (1 << GHOST_AGE_BITS) - 1;

impl Ghost {
    fn new(len: usize) -> Result<Self> {
        // Ages wrap at 2^28 evictions: a longer window could not be told apart.
        let len = len.min(GHOST_AGE_MASK as usize);
        let slots = if len == 0 {
            0
        } else {
            len.saturating_mul(2).next_power_of_two().max(GHOST_WAYS)
        };
        let mut table = Vec::new();
        table.try_reserve_exact(slots).map_err(|e| {
            Error::invalid_argument(format!("cannot allocate {slots} ghost entries: {e}"))
        })?;
        table.resize(slots, 0);
        Ok(Self {
            table,
            mask: (slots / GHOST_WAYS).saturating_sub(1),
            window: len as u64,
            count: 0,
        })
    }

    /// First entry of `hash`'s bucket and its tag: the high 31 bits of the key's 64-bit
    /// fingerprint (mixed, so low-entropy keys spread too) with the top bit set (an empty entry
    /// is 0).
    fn locate(&self, hash: SequenceHash) -> (usize, u64) {
        let mut h = SeqHasher::default();
        h.write_u128(hash.0);
        let fp = h.finish();
        (
            ((fp as usize) & self.mask) * GHOST_WAYS,
            (fp >> 32) | 0x8000_0000,
        )
    }

    /// Evictions recorded since `entry` was, itself included.
    fn age(&self, entry: u64) -> u64 {
        self.count.wrapping_sub(entry >> 4) & GHOST_AGE_MASK
    }

    /// Remembers an evicted key in its bucket: over its own older entry, else the first empty or
    /// expired entry, else the oldest.
    fn record(&mut self, hash: SequenceHash, uses: u8) {
        let (first, tag) = self.locate(hash);
        let entry = (tag << 32) | ((self.count & GHOST_AGE_MASK) << 4) | u64::from(uses & 0xF);
        let Some(bucket) = self.table.get(first..first + GHOST_WAYS) else {
            return;
        };
        let (mut at, mut oldest) = (0, 0);
        for (w, &e) in bucket.iter().enumerate() {
            let age = self.age(e);
            if e == 0 || age > self.window || e >> 32 == tag {
                at = w;
                break;
            }
            if age > oldest {
                (at, oldest) = (w, age);
            }
        }
        if let Some(e) = self.table.get_mut(first + at) {
            *e = entry;
        }
        self.count += 1;
    }

    /// Forgets `hash` and returns its reuse count, if it is remembered.
    fn take(&mut self, hash: SequenceHash) -> Option<u8> {
        let (first, tag) = self.locate(hash);
        let bucket = self.table.get(first..first + GHOST_WAYS)?;
        let w = bucket.iter().position(|&e| e >> 32 == tag)?;
        let e = self.table.get_mut(first + w)?;
        let entry = std::mem::take(e);
        (self.age(entry) <= self.window).then_some((entry & 0xF) as u8)
    }
}

struct Inner {
    kind: TierKind,
    num_blocks: usize,
    state: Mutex<State>,
}

// --- the pool ------------------------------------------------------------------------------------

/// The block bookkeeping of one tier. Cloning shares the same pool.
#[derive(Clone)]
pub struct BlockPool {
    inner: Arc<Inner>,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks for a tier of `kind`, evicting with the default
    /// [`EvictionPolicy`].
    ///
    /// Errors: `num_blocks` is 0 or above [`MAX_POOL_BLOCKS`] (invalid argument).
    pub fn new(kind: TierKind, num_blocks: usize) -> Result<Self> {
        Self::with_policy(kind, num_blocks, EvictionPolicy::default())
    }

    /// A pool of `num_blocks` free blocks for a tier of `kind` that evicts by `policy`.
    ///
    /// Errors: `num_blocks` is 0 or above [`MAX_POOL_BLOCKS`], or its bookkeeping cannot be
    /// allocated (invalid argument).
    pub fn with_policy(kind: TierKind, num_blocks: usize, policy: EvictionPolicy) -> Result<Self> {
        if num_blocks == 0 {
            return Err(
                Error::invalid_argument("a block pool needs at least one block").with("tier", kind),
            );
        }
        let n = match u32::try_from(num_blocks) {
            Ok(n) if num_blocks <= MAX_POOL_BLOCKS => n,
            _ => {
                return Err(Error::invalid_argument(format!(
                    "a block pool holds at most {MAX_POOL_BLOCKS} blocks, not {num_blocks}"
                ))
                .with("tier", kind))
            }
        };
        let state = State::new(n, policy).map_err(|e| e.with("tier", kind))?;
        Ok(Self {
            inner: Arc::new(Inner {
                kind,
                num_blocks,
                state: Mutex::new(state),
            }),
        })
    }

    /// The tier these blocks belong to.
    pub fn kind(&self) -> TierKind {
        self.inner.kind
    }

    /// Number of blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.inner.num_blocks
    }

    /// The policy choosing which inactive block a full pool evicts.
    pub fn policy(&self) -> EvictionPolicy {
        self.inner.state.lock().policy
    }

    /// Every registered block as `(key, block id)`, ordered by block id (a snapshot; for
    /// publishing what the tier holds).
    pub fn registered(&self) -> Vec<(SequenceHash, usize)> {
        let mut v: Vec<(SequenceHash, usize)> = self
            .inner
            .state
            .lock()
            .map
            .iter()
            .map(|(h, id)| (*h, *id as usize))
            .collect();
        v.sort_by_key(|(_, id)| *id);
        v
    }

    /// A snapshot of the block counts.
    pub fn stats(&self) -> PoolStats {
        self.inner.state.lock().stats()
    }

    /// All or nothing: `n` blocks taken from the free list first, then by evicting the
    /// least-recently-used inactive registered blocks (their hash is unregistered).
    ///
    /// Errors: [`crate::ErrorKind::NoSpace`] if fewer than `n` blocks are free or inactive; nothing
    /// is taken then. `allocate(0)` returns an empty list.
    pub fn allocate(&self, n: usize) -> Result<Vec<MutableBlock>> {
        let ids = self.inner.state.lock().allocate(self.inner.kind, n)?;
        Ok(ids
            .into_iter()
            .map(|id| MutableBlock {
                inner: Arc::clone(&self.inner),
                id,
                armed: true,
            })
            .collect())
    }

    /// As [`BlockPool::allocate`], but takes as many of the `n` blocks as are free or inactive
    /// (possibly none) instead of failing, in the order `allocate(1)` calls would, under one lock.
    pub fn allocate_up_to(&self, n: usize) -> Vec<MutableBlock> {
        let ids = {
            let mut st = self.inner.state.lock();
            let n = n.min(st.free_len + st.inactive);
            st.allocate(self.inner.kind, n).unwrap_or_default()
        };
        ids.into_iter()
            .map(|id| MutableBlock {
                inner: Arc::clone(&self.inner),
                id,
                armed: true,
            })
            .collect()
    }

    /// Keeps the items of `items` whose key (`key`) is not registered, under one lock.
    pub fn retain_unregistered<T>(&self, items: &mut Vec<T>, key: impl Fn(&T) -> SequenceHash) {
        let st = self.inner.state.lock();
        items.retain(|item| !st.map.contains_key(&key(item)));
    }

    /// Registers a written block under `hash` and returns it as an [`ImmutableBlock`].
    ///
    /// If `hash` is already registered to another block, that block is returned instead (a handle
    /// is taken on it) and `block` goes back to the free list (deduplication): compare
    /// [`ImmutableBlock::block_id`] with the [`MutableBlock::block_id`] to tell.
    ///
    /// Errors: `block` belongs to another pool (invalid argument); the block is then dropped,
    /// which returns it to its own pool's free list.
    pub fn register(&self, mut block: MutableBlock, hash: SequenceHash) -> Result<ImmutableBlock> {
        if !Arc::ptr_eq(&block.inner, &self.inner) {
            return Err(Error::invalid_argument(format!(
                "block {} belongs to another pool ({} tier)",
                block.id, block.inner.kind
            ))
            .with("tier", self.inner.kind)
            .with("op", "register")
            .with("block", block.id));
        }
        // The guard is released before `block` can drop (its Drop locks the pool).
        let result = self
            .inner
            .state
            .lock()
            .register(self.inner.kind, block.id, hash);
        let id = result?;
        // The state machine has consumed the mutable block (registered or freed).
        block.armed = false;
        Ok(ImmutableBlock {
            inner: Arc::clone(&self.inner),
            id,
            hash,
        })
    }

    /// Registers written blocks under their keys as [`BlockPool::register`] does, each handle
    /// dropped at once (the block is then inactive: matchable and evictable), under one lock for
    /// all of them: for a caller that keeps no handle, like a store completing. Returns how many
    /// were registered (deduplicated ones count: their key is held) and an error per block that
    /// was not (such a block goes back to its own pool's free list, as with `register`).
    pub fn register_all(&self, blocks: Vec<(MutableBlock, SequenceHash)>) -> (usize, Vec<Error>) {
        let mut registered = 0;
        let mut errors = Vec::new();
        // Refused blocks are dropped after the lock is released (their Drop locks their pool).
        let mut refused = Vec::new();
        {
            let mut st = self.inner.state.lock();
            for (mut block, hash) in blocks {
                if !Arc::ptr_eq(&block.inner, &self.inner) {
                    errors.push(
                        Error::invalid_argument(format!(
                            "block {} belongs to another pool ({} tier)",
                            block.id, block.inner.kind
                        ))
                        .with("tier", self.inner.kind)
                        .with("op", "register")
                        .with("block", block.id),
                    );
                    refused.push(block);
                    continue;
                }
                match st.register(self.inner.kind, block.id, hash) {
                    Ok(id) => {
                        block.armed = false;
                        st.release_immutable(id);
                        registered += 1;
                    }
                    Err(e) => {
                        errors.push(e);
                        refused.push(block);
                    }
                }
            }
        }
        drop(refused);
        (registered, errors)
    }

    /// Walks `hashes` in order and stops at the first one not registered; returns a handle on
    /// each block of the matched prefix (inactive ones leave the LRU, so they count as recently
    /// used when released). One lock, no per-block allocation.
    pub fn match_prefix(&self, hashes: &[SequenceHash]) -> Vec<ImmutableBlock> {
        let mut out = Vec::with_capacity(hashes.len().min(self.inner.num_blocks));
        // Declared after `out`, so the guard is dropped first even on unwind.
        let mut st = self.inner.state.lock();
        st.new_epoch(true);
        for &hash in hashes {
            let Some(&id) = st.map.get(&hash) else {
                break;
            };
            if !st.acquire(id, true) {
                break;
            }
            out.push(ImmutableBlock {
                inner: Arc::clone(&self.inner),
                id,
                hash,
            });
        }
        st.observe_demand(hashes, out.len());
        drop(st);
        out
    }

    /// Length of the registered prefix of `hashes`, without taking handles or touching LRU order.
    pub fn prefix_len(&self, hashes: &[SequenceHash]) -> usize {
        let st = self.inner.state.lock();
        hashes.iter().take_while(|h| st.map.contains_key(h)).count()
    }

    /// Whether `hash` is registered (active or inactive).
    pub fn contains(&self, hash: SequenceHash) -> bool {
        self.inner.state.lock().map.contains_key(&hash)
    }

    /// Withdraws a block's registration (its data turned out bad): it can no longer be matched,
    /// and it returns to the free list when its last handle drops. False if the handle belongs to
    /// another pool or the block no longer holds its key.
    pub fn unregister(&self, block: &ImmutableBlock) -> bool {
        if !Arc::ptr_eq(&self.inner, &block.inner) {
            return false;
        }
        self.inner.state.lock().unregister(block.id, block.hash)
    }
}

impl fmt::Debug for BlockPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockPool")
            .field("kind", &self.inner.kind)
            .field("num_blocks", &self.inner.num_blocks)
            .field("stats", &self.stats())
            .finish()
    }
}

// --- handles -------------------------------------------------------------------------------------

/// Exclusive handle on a block being written (in flight). Not `Clone`.
///
/// Pass it to [`BlockPool::register`] once its bytes are in place; dropping it instead returns the
/// block to the free list (its content is never registered).
pub struct MutableBlock {
    inner: Arc<Inner>,
    id: u32,
    /// False once [`BlockPool::register`] has consumed the block; Drop then does nothing.
    armed: bool,
}

impl MutableBlock {
    /// The block id within its tier.
    pub fn block_id(&self) -> usize {
        self.id as usize
    }

    /// The tier of the pool the block belongs to.
    pub fn kind(&self) -> TierKind {
        self.inner.kind
    }
}

impl Drop for MutableBlock {
    fn drop(&mut self) {
        if self.armed {
            self.inner.state.lock().release_mutable(self.id);
        }
    }
}

impl fmt::Debug for MutableBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MutableBlock")
            .field("kind", &self.inner.kind)
            .field("block_id", &self.id)
            .finish()
    }
}

/// Shared handle on a registered block. `Clone` takes one more reference.
///
/// While any handle lives the block is never evicted. When the last one drops the block becomes
/// inactive: it stays registered (matchable) and enters the LRU at the most-recently-used end.
pub struct ImmutableBlock {
    inner: Arc<Inner>,
    id: u32,
    hash: SequenceHash,
}

impl ImmutableBlock {
    /// The block id within its tier.
    pub fn block_id(&self) -> usize {
        self.id as usize
    }

    /// The key the block is registered under.
    pub fn sequence_hash(&self) -> SequenceHash {
        self.hash
    }

    /// The tier of the pool the block belongs to.
    pub fn kind(&self) -> TierKind {
        self.inner.kind
    }
}

impl Clone for ImmutableBlock {
    fn clone(&self) -> Self {
        // The block is active (this handle holds it), so `acquire` only bumps the count.
        self.inner.state.lock().acquire(self.id, false);
        Self {
            inner: Arc::clone(&self.inner),
            id: self.id,
            hash: self.hash,
        }
    }
}

impl Drop for ImmutableBlock {
    fn drop(&mut self) {
        self.inner.state.lock().release_immutable(self.id);
    }
}

impl fmt::Debug for ImmutableBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImmutableBlock")
            .field("kind", &self.inner.kind)
            .field("block_id", &self.id)
            .field("sequence_hash", &self.hash)
            .finish()
    }
}

// --- matching across tiers -----------------------------------------------------------------------

/// The result of [`match_across`]: the blocks held on each tier, in the order the pools were given.
#[derive(Debug, Clone, Default)]
pub struct TieredMatch {
    /// One entry per pool searched (possibly empty), in search order. The blocks of entry `k`
    /// continue the prefix where entry `k - 1` stopped.
    pub per_tier: Vec<(TierKind, Vec<ImmutableBlock>)>,
}

impl TieredMatch {
    /// Blocks matched over all tiers: the length of the matched prefix.
    pub fn total_blocks(&self) -> usize {
        self.per_tier.iter().map(|(_, b)| b.len()).sum()
    }

    /// Blocks matched on tiers of `kind`.
    pub fn blocks_from(&self, kind: TierKind) -> usize {
        self.per_tier
            .iter()
            .filter(|(k, _)| *k == kind)
            .map(|(_, b)| b.len())
            .sum()
    }
}

/// Prefix match across tiers: the first pool (host) is searched from the start of `hashes`; each
/// next pool (disk) continues at the index where the previous one stopped. Returns the held blocks
/// per tier; `total_blocks()` is the length of the prefix found somewhere.
pub fn match_across(pools: &[&BlockPool], hashes: &[SequenceHash]) -> TieredMatch {
    let mut per_tier = Vec::with_capacity(pools.len());
    let mut pos = 0usize;
    for pool in pools {
        let rest = hashes.get(pos..).unwrap_or_default();
        let blocks = pool.match_prefix(rest);
        pos += blocks.len();
        per_tier.push((pool.kind(), blocks));
    }
    TieredMatch { per_tier }
}

// --- admission filter ----------------------------------------------------------------------------

/// Admission filter for the host → disk step: a block is admitted to disk only once it has been
/// seen `min_frequency` times (1 admits always).
///
/// Memory is bounded: the counter table holds at most `capacity` hashes. Recording a new hash into
/// a full table first ages it TinyLFU-style: every count is halved and zeros are dropped (repeated
/// until there is room), so one-off hashes fade while frequent ones keep part of their count.
#[derive(Debug, Clone)]
pub struct FrequencyFilter {
    min_frequency: u32,
    capacity: usize,
    counts: HashMap<SequenceHash, u32, BuildSeqHasher>,
}

impl FrequencyFilter {
    /// A filter admitting hashes seen at least `min_frequency` times, tracking at most `capacity`.
    ///
    /// Errors: `min_frequency` or `capacity` is 0 (invalid argument).
    pub fn new(min_frequency: u32, capacity: usize) -> Result<Self> {
        if min_frequency == 0 {
            return Err(Error::invalid_argument(
                "min_frequency must be at least 1 (1 admits every block)",
            ));
        }
        if capacity == 0 {
            return Err(Error::invalid_argument(
                "frequency filter capacity must be at least 1",
            ));
        }
        Ok(Self {
            min_frequency,
            capacity,
            counts: HashMap::with_hasher(BuildSeqHasher::default()),
        })
    }

    /// Counts one sighting of `hash`; returns its new count (saturating).
    pub fn record(&mut self, hash: SequenceHash) -> u32 {
        if let Some(c) = self.counts.get_mut(&hash) {
            *c = c.saturating_add(1);
            return *c;
        }
        while self.counts.len() >= self.capacity {
            self.age();
        }
        self.counts.insert(hash, 1);
        1
    }

    /// Halves every count and drops the zeros.
    fn age(&mut self) {
        self.counts.retain(|_, c| {
            *c /= 2;
            *c > 0
        });
    }

    /// Whether `hash` has been seen often enough to go to disk.
    pub fn admit(&self, hash: SequenceHash) -> bool {
        self.min_frequency <= 1 || self.count(hash) >= self.min_frequency
    }

    /// The current (aged) count of `hash`; 0 if not tracked.
    pub fn count(&self, hash: SequenceHash) -> u32 {
        self.counts.get(&hash).copied().unwrap_or(0)
    }

    /// Sightings needed before admission.
    pub fn min_frequency(&self) -> u32 {
        self.min_frequency
    }

    /// Most hashes tracked at once.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Hashes tracked now.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    /// Whether no hash is tracked.
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }
}

// --- tests ---------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    fn h(i: u64) -> SequenceHash {
        SequenceHash(u128::from(i))
    }

    fn pool(n: usize) -> BlockPool {
        BlockPool::with_policy(TierKind::Host, n, EvictionPolicy::Lru).unwrap()
    }

    /// Registers one fresh block under `hash` and drops the handle (leaves it inactive).
    fn cache(p: &BlockPool, hash: SequenceHash) -> usize {
        let m = p.allocate(1).unwrap().pop().unwrap();
        let imm = p.register(m, hash).unwrap();
        imm.block_id()
    }

    fn check_sum(p: &BlockPool) {
        let s = p.stats();
        assert_eq!(s.total(), p.num_blocks(), "{s:?}");
        assert_eq!(s.registered, s.active + s.inactive, "{s:?}");
    }

    #[test]
    fn register_all_registers_inactive_dedups_and_refuses_another_pools_block() {
        let p = pool(6);
        let other = pool(2);
        let dup = cache(&p, h(1));
        let mut blocks: Vec<(MutableBlock, SequenceHash)> = p
            .allocate(3)
            .unwrap()
            .into_iter()
            .zip([h(2), h(3), h(1)])
            .collect();
        let dup_id = blocks[2].0.block_id();
        blocks.push((other.allocate(1).unwrap().pop().unwrap(), h(4)));
        let (n, errors) = p.register_all(blocks);
        assert_eq!(n, 3);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].kind(), ErrorKind::InvalidArgument);
        // Registered and released: matchable, inactive (evictable), nothing held.
        let s = p.stats();
        assert_eq!(
            (s.registered, s.active, s.inactive, s.mutable),
            (3, 0, 3, 0),
            "{s:?}"
        );
        assert_eq!(p.prefix_len(&[h(1), h(2), h(3)]), 3);
        // The duplicate key kept its first block; the second went back to the free list.
        assert_eq!(p.match_prefix(&[h(1)])[0].block_id(), dup);
        assert_ne!(dup, dup_id);
        assert_eq!(s.free, 3);
        check_sum(&p);
        // The refused block went back to its own pool.
        assert_eq!(other.stats().free, 2);
        assert!(!other.contains(h(4)) && !p.contains(h(4)));
    }

    #[test]
    fn allocate_up_to_takes_what_is_free_or_evictable() {
        let p = pool(4);
        cache(&p, h(1));
        let held = p.allocate(1).unwrap();
        // 2 free + 1 inactive (evicted when taken) of the 5 asked.
        let got = p.allocate_up_to(5);
        assert_eq!(got.len(), 3);
        assert!(!p.contains(h(1)));
        assert!(p.allocate_up_to(1).is_empty());
        assert!(p.allocate_up_to(0).is_empty());
        drop((got, held));
        assert_eq!(p.stats().free, 4);
        check_sum(&p);
    }

    #[test]
    fn retain_unregistered_drops_registered_keys() {
        let p = pool(4);
        cache(&p, h(2));
        let mut items = vec![(10, h(1)), (11, h(2)), (12, h(3))];
        p.retain_unregistered(&mut items, |i| i.1);
        assert_eq!(items, vec![(10, h(1)), (12, h(3))]);
    }

    #[test]
    fn new_rejects_zero_blocks() {
        let e = BlockPool::new(TierKind::Disk, 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert_eq!(e.context_value("tier"), Some("disk"));
        let p = pool(3);
        assert_eq!(p.kind(), TierKind::Host);
        assert_eq!(p.num_blocks(), 3);
        assert_eq!(
            p.stats(),
            PoolStats {
                free: 3,
                ..PoolStats::default()
            }
        );
    }

    #[test]
    fn fresh_pool_hands_out_distinct_ids() {
        let p = pool(4);
        let blocks = p.allocate(4).unwrap();
        let mut ids: Vec<usize> = blocks.iter().map(MutableBlock::block_id).collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![0, 1, 2, 3]);
        assert!(blocks.iter().all(|b| b.kind() == TierKind::Host));
        assert_eq!(p.stats().mutable, 4);
        assert!(p.allocate(0).unwrap().is_empty());
    }

    #[test]
    fn allocate_is_all_or_nothing() {
        let p = pool(4);
        let held = p.allocate(3).unwrap();
        let before = p.stats();
        let e = p.allocate(2).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        assert_eq!(e.context_value("tier"), Some("host"));
        assert!(e.message().contains("2 blocks: 1 available of 4"), "{e}");
        assert_eq!(p.stats(), before);
        assert_eq!(p.allocate(1).unwrap().len(), 1);
        drop(held);
        check_sum(&p);
        assert_eq!(p.stats().free, 4);
    }

    #[test]
    fn active_blocks_are_never_evicted() {
        let p = pool(2);
        let a = p
            .register(p.allocate(1).unwrap().pop().unwrap(), h(1))
            .unwrap();
        let _b = p
            .register(p.allocate(1).unwrap().pop().unwrap(), h(2))
            .unwrap();
        assert_eq!(p.allocate(1).unwrap_err().kind(), ErrorKind::NoSpace);
        drop(a);
        // Only the inactive one can go.
        let got = p.allocate(1).unwrap();
        assert!(!p.contains(h(1)));
        assert!(p.contains(h(2)));
        assert_eq!(p.stats().evictions, 1);
        drop(got);
        check_sum(&p);
    }

    #[test]
    fn handle_drop_transitions() {
        let p = pool(2);
        let m = p.allocate(1).unwrap().pop().unwrap();
        assert_eq!(p.stats().mutable, 1);
        drop(m);
        assert_eq!(p.stats().free, 2);

        let m = p.allocate(1).unwrap().pop().unwrap();
        let id = m.block_id();
        let a = p.register(m, h(7)).unwrap();
        assert_eq!(
            (a.block_id(), a.sequence_hash(), a.kind()),
            (id, h(7), TierKind::Host)
        );
        let s = p.stats();
        assert_eq!(
            (s.mutable, s.active, s.inactive, s.registered),
            (0, 1, 0, 1)
        );

        let b = a.clone();
        drop(a);
        assert_eq!(p.stats().active, 1, "a clone still holds it");
        drop(b);
        let s = p.stats();
        assert_eq!((s.active, s.inactive, s.registered), (0, 1, 1));
        assert!(p.contains(h(7)));

        let m = p.match_prefix(&[h(7)]);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].block_id(), id);
        let s = p.stats();
        assert_eq!((s.active, s.inactive), (1, 0));
        drop(m);
        assert_eq!(p.stats().inactive, 1);
        check_sum(&p);
    }

    #[test]
    fn register_dedups_to_the_existing_block() {
        let p = pool(3);
        let mut ms = p.allocate(2).unwrap();
        let second = ms.pop().unwrap();
        let first = ms.pop().unwrap();
        let first_id = first.block_id();
        let second_id = second.block_id();
        let a = p.register(first, h(5)).unwrap();
        let b = p.register(second, h(5)).unwrap();
        assert_eq!(a.block_id(), first_id);
        assert_eq!(b.block_id(), first_id, "dedup returns the existing block");
        assert_ne!(b.block_id(), second_id);
        let s = p.stats();
        assert_eq!((s.free, s.mutable, s.active, s.registered), (2, 0, 1, 1));
        drop(a);
        assert_eq!(p.stats().active, 1);
        drop(b);
        assert_eq!(p.stats().inactive, 1);

        // Dedup against an inactive block brings it back to active.
        let m = p.allocate(1).unwrap().pop().unwrap();
        assert_ne!(
            m.block_id(),
            first_id,
            "the inactive block is not handed out while free ones exist"
        );
        let c = p.register(m, h(5)).unwrap();
        assert_eq!(c.block_id(), first_id);
        let s = p.stats();
        assert_eq!((s.free, s.active, s.inactive), (2, 1, 0));
        check_sum(&p);
    }

    #[test]
    fn register_rejects_a_block_of_another_pool() {
        let p = pool(1);
        let q = BlockPool::new(TierKind::Disk, 1).unwrap();
        let m = q.allocate(1).unwrap().pop().unwrap();
        let e = p.register(m, h(1)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert_eq!(e.context_value("tier"), Some("host"));
        assert_eq!(q.stats().free, 1, "the block went back to its own pool");
        assert!(!p.contains(h(1)) && !q.contains(h(1)));
    }

    #[test]
    fn eviction_follows_lru_order() {
        let p = pool(3);
        let ids: Vec<usize> = (1..=3).map(|i| cache(&p, h(i))).collect();
        assert_eq!(p.stats().inactive, 3);
        // Touch h1: it becomes the most recently used.
        drop(p.match_prefix(&[h(1)]));
        // prefix_len and contains do not touch the order.
        assert_eq!(p.prefix_len(&[h(2), h(3)]), 2);
        assert!(p.contains(h(2)));

        let b = p.allocate(1).unwrap();
        assert_eq!(b[0].block_id(), ids[1]);
        assert!(!p.contains(h(2)) && p.contains(h(1)) && p.contains(h(3)));
        let c = p.allocate(1).unwrap();
        assert_eq!(c[0].block_id(), ids[2]);
        assert!(!p.contains(h(3)));
        let d = p.allocate(1).unwrap();
        assert_eq!(d[0].block_id(), ids[0]);
        let s = p.stats();
        assert_eq!((s.evictions, s.registered, s.mutable), (3, 0, 3));
        drop((b, c, d));
        check_sum(&p);
    }

    /// Runs `step` and returns the one key of `keys` it unregistered (evicted).
    fn evicted_by(p: &BlockPool, keys: &[SequenceHash], step: impl FnOnce()) -> SequenceHash {
        let before: Vec<SequenceHash> = keys.iter().copied().filter(|&x| p.contains(x)).collect();
        step();
        let gone: Vec<SequenceHash> = before.into_iter().filter(|&x| !p.contains(x)).collect();
        assert_eq!(gone.len(), 1, "{gone:?}");
        gone[0]
    }

    /// Evicts one block by allocating it (kept in `held`); returns the key it held.
    fn evict_one(
        p: &BlockPool,
        keys: &[SequenceHash],
        held: &mut Vec<MutableBlock>,
    ) -> SequenceHash {
        evicted_by(p, keys, || held.extend(p.allocate(1).unwrap()))
    }

    #[test]
    fn prefix_policy_evicts_a_matched_chain_deepest_first() {
        let keys: Vec<SequenceHash> = (1..=3).map(h).collect();
        for (policy, want) in [
            (EvictionPolicy::Lru, [1, 2, 3]),
            (EvictionPolicy::Prefix, [3, 2, 1]),
        ] {
            let p = BlockPool::with_policy(TierKind::Host, 3, policy).unwrap();
            assert_eq!(p.policy(), policy);
            for &k in &keys {
                cache(&p, k);
            }
            // A request matches the chain; its handles drop parent -> child (as the leader's).
            drop(p.match_prefix(&keys));
            let mut held = Vec::new();
            let got: Vec<SequenceHash> = (0..3).map(|_| evict_one(&p, &keys, &mut held)).collect();
            assert_eq!(got, want.map(h).to_vec(), "{policy}");
        }
    }

    #[test]
    fn ghost_remembers_the_last_window_evictions_once_each() {
        // A window of 3, as a ring of the last three evictions would keep.
        let mut g = Ghost::new(3).unwrap();
        g.record(h(1), 2);
        g.record(h(2), 0);
        g.record(h(3), 1);
        assert_eq!(g.take(h(1)), Some(2), "two evictions after it: remembered");
        assert_eq!(g.take(h(1)), None, "taken once");
        assert_eq!(g.take(h(7)), None, "never evicted");
        g.record(h(4), 0);
        g.record(h(5), 0);
        assert_eq!(g.take(h(2)), None, "three evictions after it: forgotten");
        assert_eq!(g.take(h(3)), Some(1), "two after it: still there");
        // Evicted again, a key's newest count is the one remembered.
        g.record(h(6), 3);
        g.record(h(6), 1);
        assert_eq!(g.take(h(6)), Some(1));
        // LRU keeps no ghost.
        let mut none = Ghost::new(0).unwrap();
        none.record(h(1), 1);
        assert_eq!(none.take(h(1)), None);
    }

    /// A request's blocks held after their store (a write-through to the next tier) are
    /// released late, after a later request began or even after its blocks were released:
    /// they keep their own request's epoch and leave before the later request's blocks. (With
    /// the epoch at release they joined the later request's run, and released after its
    /// blocks, as in vLLM's test of a disk hit after host eviction, outlived them.)
    #[test]
    fn prefix_policy_block_released_late_keeps_its_requests_time() {
        let keys: Vec<SequenceHash> = (1..=8).map(h).collect();
        for b_first in [false, true] {
            let p = BlockPool::with_policy(TierKind::Host, 6, EvictionPolicy::Prefix).unwrap();
            // An older block, inactive: a late one must not go behind it.
            cache(&p, h(8));
            // Request A: 2 blocks stored and held (written through).
            let a: Vec<ImmutableBlock> = p
                .allocate(2)
                .unwrap()
                .into_iter()
                .zip([h(1), h(2)])
                .map(|(m, k)| p.register(m, k).unwrap())
                .collect();
            // Request B: looks up (a new epoch), stores 3 blocks allocated one call at a time
            // (as the disk tier's are: they still share one epoch), held too.
            drop(p.match_prefix(&[h(5)]));
            let b: Vec<ImmutableBlock> = [h(5), h(6), h(7)]
                .into_iter()
                .map(|k| {
                    p.register(p.allocate(1).unwrap().pop().unwrap(), k)
                        .unwrap()
                })
                .collect();
            if b_first {
                drop(b);
                drop(a); // placed in front of B's run, behind h8
            } else {
                drop(a);
                drop(b);
            }
            check_sum(&p);
            // h8 first (oldest), then A deepest first, then B deepest first.
            let mut held = Vec::new();
            let order: Vec<SequenceHash> =
                (0..6).map(|_| evict_one(&p, &keys, &mut held)).collect();
            assert_eq!(
                order,
                [8, 2, 1, 7, 6, 5].map(h).to_vec(),
                "b_first {b_first}"
            );
        }
    }

    #[test]
    fn prefix_policy_credit_doubles_with_reuse_and_survives_eviction() {
        // 4 blocks: one reuse is worth 4 clock ticks (one release each), two reuses 8. The
        // credit's own mechanics: the duel (which starts with the credit off) is left out.
        let p = BlockPool::with_policy(TierKind::Host, 4, EvictionPolicy::Prefix).unwrap();
        {
            let mut st = p.inner.state.lock();
            st.duel = None;
            st.credit_on = true;
        }
        let keys: Vec<SequenceHash> = (1..=16).map(h).collect();
        cache(&p, h(1)); // stamp 0
        drop(p.match_prefix(&[h(1)])); // one reuse, stamp 1: priority 1 + 4 = 5
        for i in 2..=4 {
            cache(&p, h(i)); // stamps 2, 3, 4
        }
        // Each new key evicts the smallest stamp + credit; a tie goes to the lower list.
        let order: Vec<SequenceHash> = (5..=9)
            .map(|i| {
                evicted_by(&p, &keys, || {
                    cache(&p, h(i));
                })
            })
            .collect();
        assert_eq!(order, [2, 3, 4, 5, 1].map(h).to_vec());
        // Remembered with one reuse, h1 stored again starts with two (credit 8, stamp 10): it
        // outlives the next three fresh keys.
        let again = evicted_by(&p, &keys, || {
            cache(&p, h(1));
        });
        assert_eq!(again, h(6));
        for i in 10..=12 {
            assert_ne!(
                evicted_by(&p, &keys, || {
                    cache(&p, h(i));
                }),
                h(1)
            );
        }
        assert!(p.contains(h(1)));
    }

    /// A key as the leader uses it: matched if cached, else computed and stored.
    fn use_key(p: &BlockPool, k: SequenceHash) -> bool {
        if p.match_prefix(&[k]).is_empty() {
            cache(p, k);
            return false;
        }
        true
    }

    #[test]
    fn prefix_duel_turns_the_credit_off_where_past_reuse_predicts_nothing() {
        // Like conversations of a fixed length: four keys reused three times and then never
        // again, then a stream of new keys each used once more three keys later. With the credit
        // the dead keys hold half of the 8 blocks for 32 ticks, so each new key is evicted
        // before its reuse; without it they leave first and every reuse hits. A fresh pool has
        // the credit off, and the miniatures' disagreements keep it off.
        let run = |policy| {
            let p = BlockPool::with_policy(TierKind::Host, 8, policy).unwrap();
            let dead: Vec<SequenceHash> = (100..104).map(h).collect();
            for &k in &dead {
                cache(&p, k);
            }
            for _ in 0..3 {
                for &k in &dead {
                    assert!(use_key(&p, k));
                }
            }
            let mut hits = 0;
            for i in 0..40 {
                use_key(&p, h(i));
                if i >= 3 && use_key(&p, h(i - 3)) {
                    hits += 1;
                }
            }
            (hits, dead.iter().any(|&k| p.contains(k)))
        };
        assert_eq!(run(EvictionPolicy::Lru), (37, false));
        let (hits, dead_kept) = run(EvictionPolicy::Prefix);
        assert!(!dead_kept, "the dead keys' credit kept them");
        assert!(
            hits >= 35,
            "prefix with its duel hit {hits} of 37 reuses (LRU: 37)"
        );
    }

    #[test]
    fn prefix_duel_sees_a_lookups_keys_past_the_first_miss_up_to_a_miniatures_size() {
        // 8 blocks: simulated whole (rate 1), miniatures of 8 blocks.
        let p = BlockPool::with_policy(TierKind::Host, 8, EvictionPolicy::Prefix).unwrap();
        cache(&p, h(1));
        let uses = |p: &BlockPool| {
            let st = p.inner.state.lock();
            let d = st.duel.as_ref().unwrap();
            (
                d.credited.clock,
                d.plain.clock,
                d.credited.map.contains_key(&h(3)),
            )
        };
        // h1 is stored (it enters both miniatures, one release each).
        assert_eq!(uses(&p), (1, 1, false));
        // h1 matches, h2 misses, h3 past the miss: all three are uses in both miniatures,
        // although the pool returns h1 alone.
        assert_eq!(p.match_prefix(&[h(1), h(2), h(3)]).len(), 1);
        assert_eq!(uses(&p), (4, 4, true));
        // A demand of 1 match + 20 misses: the match and 8 keys past the miss (a miniature's
        // size), not 20.
        let long: Vec<SequenceHash> = std::iter::once(h(1)).chain((100..120).map(h)).collect();
        assert_eq!(p.match_prefix(&long).len(), 1);
        assert_eq!(uses(&p).0, 4 + 1 + 8);
    }

    #[test]
    fn prefix_duel_keeps_the_credit_where_reuse_predicts_reuse() {
        // Four keys used every round and ten one-off keys between rounds in 8 blocks: LRU loses
        // the four to the one-offs every round; the credit keeps them, and the duel turns it on
        // (the pool starts without it).
        let run = |policy| {
            let p = BlockPool::with_policy(TierKind::Host, 8, policy).unwrap();
            let mut hits = 0;
            for round in 0..30u64 {
                for k in 1..=4 {
                    if use_key(&p, h(k)) && round >= 10 {
                        hits += 1;
                    }
                }
                for j in 0..10 {
                    use_key(&p, h(1000 + round * 10 + j));
                }
            }
            hits
        };
        assert_eq!(run(EvictionPolicy::Lru), 0);
        assert_eq!(run(EvictionPolicy::Prefix), 80);
    }

    #[test]
    fn two_q_probation_goes_first_until_a_quarter_of_the_pool() {
        let p = BlockPool::with_policy(TierKind::Host, 8, EvictionPolicy::TwoQ).unwrap();
        let keys: Vec<SequenceHash> = (1..=12).map(h).collect();
        for i in 1..=8 {
            cache(&p, h(i));
        }
        for i in 1..=4 {
            drop(p.match_prefix(&[h(i)])); // reused: main
        }
        // Probation (h5..h8, FIFO) goes first while it holds at least 2 (a quarter of 8), then
        // main (LRU), then probation again when main is empty.
        let mut held = Vec::new();
        let order: Vec<SequenceHash> = (0..8).map(|_| evict_one(&p, &keys, &mut held)).collect();
        assert_eq!(order, [5, 6, 7, 1, 2, 3, 4, 8].map(h).to_vec());
        // h5 left probation unreused: stored again, the ghost sends it to main.
        drop(held);
        for i in [5, 9, 10] {
            cache(&p, h(i));
        }
        let mut held = p.allocate(5).unwrap();
        let order: Vec<SequenceHash> = (0..3).map(|_| evict_one(&p, &keys, &mut held)).collect();
        assert_eq!(order, [9, 5, 10].map(h).to_vec());
    }

    #[test]
    fn allocate_takes_free_blocks_before_evicting() {
        let p = pool(3);
        let cached = cache(&p, h(1));
        let got = p.allocate(2).unwrap();
        assert!(got.iter().all(|b| b.block_id() != cached));
        assert!(p.contains(h(1)));
        assert_eq!(p.stats().evictions, 0);
        let more = p.allocate(1).unwrap();
        assert_eq!(more[0].block_id(), cached);
        assert!(!p.contains(h(1)));
    }

    #[test]
    fn match_stops_at_first_miss() {
        let p = pool(4);
        for i in [1, 2, 4] {
            cache(&p, h(i));
        }
        let m = p.match_prefix(&[h(1), h(2), h(3), h(4)]);
        let got: Vec<SequenceHash> = m.iter().map(ImmutableBlock::sequence_hash).collect();
        assert_eq!(got, vec![h(1), h(2)]);
        assert_eq!(p.prefix_len(&[h(1), h(2), h(3), h(4)]), 2);
        assert_eq!(p.prefix_len(&[h(3), h(1)]), 0);
        assert!(p.match_prefix(&[]).is_empty());
        assert!(p.match_prefix(&[h(9), h(1)]).is_empty());
        let s = p.stats();
        assert_eq!((s.active, s.inactive), (2, 1));
    }

    #[test]
    fn match_across_continues_on_disk() {
        let host = pool(4);
        let disk = BlockPool::new(TierKind::Disk, 8).unwrap();
        for i in 0..2 {
            cache(&host, h(i));
        }
        for i in 0..4 {
            cache(&disk, h(i));
        }
        cache(&disk, h(5));
        let hashes: Vec<SequenceHash> = (0..6).map(h).collect();
        let m = match_across(&[&host, &disk], &hashes);
        assert_eq!(m.per_tier.len(), 2);
        assert_eq!(m.blocks_from(TierKind::Host), 2);
        assert_eq!(
            m.blocks_from(TierKind::Disk),
            2,
            "disk continues at index 2 and stops at h4"
        );
        assert_eq!(m.total_blocks(), 4);
        let disk_hashes: Vec<SequenceHash> = m.per_tier[1]
            .1
            .iter()
            .map(ImmutableBlock::sequence_hash)
            .collect();
        assert_eq!(disk_hashes, vec![h(2), h(3)]);
        assert_eq!(
            disk.stats().active,
            2,
            "disk copies of h0, h1 are not taken"
        );

        // A gap on disk at the host's stopping point yields nothing from disk.
        let gap = [h(0), h(1), h(4), h(5)];
        let m = match_across(&[&host, &disk], &gap);
        assert_eq!(
            (m.blocks_from(TierKind::Host), m.blocks_from(TierKind::Disk)),
            (2, 0)
        );

        // Whole prefix on host: disk is searched with nothing left.
        let m = match_across(&[&host, &disk], &hashes[..2]);
        assert_eq!((m.total_blocks(), m.per_tier.len()), (2, 2));
        assert_eq!(match_across(&[], &hashes).total_blocks(), 0);
    }

    #[test]
    fn filter_with_one_admits_always() {
        let mut f = FrequencyFilter::new(1, 8).unwrap();
        assert!(f.admit(h(1)));
        assert_eq!(f.record(h(1)), 1);
        assert!(f.admit(h(1)) && f.admit(h(2)));
        assert_eq!(f.min_frequency(), 1);
    }

    #[test]
    fn filter_with_three_admits_on_third_sighting() {
        let mut f = FrequencyFilter::new(3, 8).unwrap();
        assert!(f.is_empty());
        f.record(h(1));
        assert!(!f.admit(h(1)));
        f.record(h(1));
        assert!(!f.admit(h(1)));
        assert_eq!(f.record(h(1)), 3);
        assert!(f.admit(h(1)));
        assert!(!f.admit(h(2)));
        assert_eq!(f.len(), 1);
    }

    #[test]
    fn filter_ages_when_full() {
        let mut f = FrequencyFilter::new(2, 4).unwrap();
        for _ in 0..4 {
            f.record(h(1));
        }
        for i in 2..=4 {
            f.record(h(i));
        }
        assert_eq!(f.len(), 4);
        // Full: halving drops the one-offs, keeps h1 at 2.
        assert_eq!(f.record(h(5)), 1);
        assert_eq!(f.len(), 2);
        assert_eq!(f.count(h(1)), 2);
        assert!(f.admit(h(1)));
        assert_eq!(f.count(h(2)), 0);
        assert!(!f.admit(h(5)));

        // Every entry frequent: aging repeats until there is room.
        let mut g = FrequencyFilter::new(2, 2).unwrap();
        for _ in 0..8 {
            g.record(h(1));
            g.record(h(2));
        }
        g.record(h(3));
        assert!(g.len() <= 2);
        assert_eq!(g.count(h(3)), 1);
    }

    #[test]
    fn filter_rejects_zero_arguments() {
        assert_eq!(
            FrequencyFilter::new(0, 8).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            FrequencyFilter::new(2, 0).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }

    #[test]
    fn handles_are_send_sync() {
        fn check<T: Send + Sync>() {}
        check::<BlockPool>();
        check::<MutableBlock>();
        check::<ImmutableBlock>();
        check::<TieredMatch>();
    }

    #[test]
    fn concurrent_use_keeps_counts() {
        let p = pool(64);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let p = p.clone();
                s.spawn(move || {
                    for i in 0..500u64 {
                        let Ok(mut ms) = p.allocate(2) else { continue };
                        let keep = ms.pop();
                        if let Some(m) = keep {
                            let imm = p.register(m, h((t * 7 + i) % 40)).unwrap();
                            let again = p.match_prefix(&[imm.sequence_hash()]);
                            assert_eq!(
                                again.first().map(ImmutableBlock::block_id),
                                Some(imm.block_id())
                            );
                        }
                    }
                });
            }
        });
        let s = p.stats();
        assert_eq!((s.mutable, s.active), (0, 0));
        assert_eq!(s.free + s.inactive, 64);
        check_sum(&p);
    }

    #[test]
    fn match_prefix_8192_is_fast() {
        use std::time::{Duration, Instant};
        let n = 8192;
        let p = BlockPool::new(TierKind::Host, n).unwrap();
        let hashes: Vec<SequenceHash> = (0..n as u64)
            .map(|i| SequenceHash(u128::from(i.wrapping_mul(0xA24B_AED4_963E_E407))))
            .collect();
        for &hash in &hashes {
            cache(&p, hash);
        }
        let rounds = 20;
        let (mut matching, mut dropping) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..rounds {
            let t0 = Instant::now();
            let m = p.match_prefix(&hashes);
            let t1 = Instant::now();
            assert_eq!(m.len(), n);
            drop(m);
            matching += t1 - t0;
            dropping += t1.elapsed();
        }
        let per = matching / rounds;
        eprintln!(
            "match_prefix of {n} hashes: {per:?}; dropping the handles: {:?}",
            dropping / rounds
        );
        // Only a sanity bound here (debug builds, shared CI); release runs well under 1 ms.
        assert!(per < Duration::from_millis(200), "{per:?}");
    }

    #[test]
    fn unregister_withdraws_a_block_and_frees_it_on_release() {
        let pool = BlockPool::new(TierKind::Disk, 4).unwrap();
        let b = pool.allocate(1).unwrap().pop().unwrap();
        let held = pool.register(b, SequenceHash(7)).unwrap();
        assert!(pool.unregister(&held));
        assert!(!pool.contains(SequenceHash(7)));
        assert!(pool.match_prefix(&[SequenceHash(7)]).is_empty());
        assert!(!pool.unregister(&held));
        drop(held);
        let s = pool.stats();
        assert_eq!((s.free, s.active, s.inactive, s.registered), (4, 0, 0, 0));
        // A fresh copy can be registered under the same key again.
        let b = pool.allocate(1).unwrap().pop().unwrap();
        let again = pool.register(b, SequenceHash(7)).unwrap();
        assert!(pool.contains(SequenceHash(7)));
        drop(again);
        assert_eq!(pool.stats().inactive, 1);
    }
}
