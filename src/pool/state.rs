//! The block bookkeeping behind a [`BlockPool`](super::BlockPool): one slot per block, the free
//! stack, the hash → block map, the eviction lists the policy orders, the clock and the
//! transitions between the four states (free, mutable, active, inactive). What is evicted, and
//! where a released block goes, the pool's [`Eviction`] policy decides.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use super::eviction::{Eviction, Placement, Released, MAX_USES, NUM_LISTS};
use super::{BuildSeqHasher, PoolStats};
use crate::error::{Error, Result};
use crate::identity::SequenceHash;
use crate::tier::TierKind;

/// "No block" in the intrusive lists. Never a valid slot index (`num_blocks <= u32::MAX - 1`), so
/// `slots.get(NIL as usize)` is `None`.
const NIL: u32 = u32::MAX;

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
    /// Live [`ImmutableBlock`](super::ImmutableBlock)s; non-zero exactly while active.
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

/// The prefix policy looks back at most this many blocks from the tail's run to place a block
/// released late (older than the newest inactive block), or to find the front of the tail's
/// run when its pointer is unset (see `State::run_front`).
const LATE_INSERT_WALK: usize = 64;

/// What a policy sees of the inactive blocks: each eviction list's head (the block it would
/// evict first, with its stamp) and length. O(1) per question.
#[derive(Debug, Clone, Copy)]
pub(crate) struct InactiveLists<'a> {
    lists: &'a [List; NUM_LISTS],
    slots: &'a [Slot],
}

impl InactiveLists<'_> {
    /// The block at the head of list `l` (`None` if it is empty or there is no such list).
    pub(crate) fn head(&self, l: usize) -> Option<u32> {
        self.lists
            .get(l)
            .map(|list| list.head)
            .filter(|&id| id != NIL)
    }

    /// The block at the head of list `l` and its stamp.
    pub(crate) fn head_stamp(&self, l: usize) -> Option<(u32, u64)> {
        let head = self.lists.get(l)?.head;
        self.slots.get(head as usize).map(|s| (head, s.stamp))
    }

    /// Blocks in list `l` (0 if there is no such list).
    pub(crate) fn len(&self, l: usize) -> usize {
        self.lists.get(l).map_or(0, |list| list.len)
    }
}

/// One pool's bookkeeping (or one of the prefix policy's miniatures): behind the pool's lock.
#[derive(Debug)]
pub(crate) struct State {
    /// Decides where released blocks go and which one is evicted.
    eviction: Box<dyn Eviction>,
    slots: Vec<Slot>,
    map: HashMap<SequenceHash, u32, BuildSeqHasher>,
    free_head: u32,
    free_len: usize,
    lists: [List; NUM_LISTS],
    /// Inactive blocks (the sum of the lists' lengths).
    inactive: usize,
    /// Blocks made inactive so far, plus (prefix policy, [`Eviction::ticks_on_lookup`]) one tick
    /// for each lookup ending an epoch that allocated blocks and saw no release: the pool's
    /// clock (LRU and 2Q stamp each block with it).
    clock: u64,
    /// A block was allocated since the epoch began (see [`State::new_epoch`]).
    allocated_in_epoch: bool,
    /// The clock at the last `allocate` or `match_prefix` call: the prefix policy stamps every
    /// block reused and released since with it, so one request's blocks share a stamp (a block
    /// released for the first time since it was stored takes the epoch it was allocated in).
    epoch: u64,
    mutable: usize,
    active: usize,
    evictions: u64,
    /// Keys registered and removed, when recorded ([`super::BlockPool::record_events`]).
    pub(crate) events: Option<super::events::KeyEvents>,
}

impl State {
    /// Bookkeeping for `num_blocks` free blocks, evicting by `eviction`. Errors: the slots or
    /// the map cannot be allocated (invalid argument).
    pub(crate) fn new(num_blocks: u32, eviction: Box<dyn Eviction>) -> Result<Self> {
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
        Ok(Self {
            eviction,
            slots,
            map,
            free_head: if num_blocks > 0 { 0 } else { NIL },
            free_len: n,
            lists: [List::EMPTY; NUM_LISTS],
            inactive: 0,
            clock: 0,
            epoch: 0,
            allocated_in_epoch: false,
            mutable: 0,
            active: 0,
            evictions: 0,
            events: None,
        })
    }

    /// Number of blocks.
    pub(crate) fn num_blocks(&self) -> usize {
        self.slots.len()
    }

    /// Blocks an allocation can take now: free or inactive.
    pub(crate) fn available(&self) -> usize {
        self.free_len + self.inactive
    }

    /// The block registered under `hash`, if any.
    pub(crate) fn lookup(&self, hash: SequenceHash) -> Option<u32> {
        self.map.get(&hash).copied()
    }

    /// Whether `hash` is registered.
    pub(crate) fn contains(&self, hash: SequenceHash) -> bool {
        self.map.contains_key(&hash)
    }

    /// Every registered `(key, block id)`, in no particular order.
    pub(crate) fn registered(&self) -> impl Iterator<Item = (SequenceHash, u32)> + '_ {
        self.map.iter().map(|(h, id)| (*h, *id))
    }

    /// The clock (blocks made inactive so far, plus the prefix policy's lookup ticks).
    #[cfg(test)]
    pub(crate) fn clock(&self) -> u64 {
        self.clock
    }

    /// Sets the epoch alone (the prefix policy keeps its miniatures on the pool's time, scaled).
    pub(crate) fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    pub(crate) fn stats(&self) -> PoolStats {
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
        self.eviction.victim(InactiveLists {
            lists: &self.lists,
            slots: &self.slots,
        })
    }

    // --- epochs and the policy's observations ---

    /// A new request's releases start: the prefix policy stamps every block released from now
    /// until the next call with the clock as it is now (and so do its miniatures, see
    /// [`Eviction::epoch_began`]). `lookup`: a lookup starts the epoch (a new request); if the
    /// policy [ticks on a lookup](Eviction::ticks_on_lookup), blocks were allocated in the
    /// epoch ending and none was released since it began, the clock takes one tick, so that
    /// those blocks (released later, see `release_immutable`) are older than the new
    /// request's. An allocation takes no tick: a caller allocating a request's blocks one call
    /// at a time keeps one epoch for them.
    pub(crate) fn new_epoch(&mut self, lookup: bool) {
        if lookup
            && self.eviction.ticks_on_lookup()
            && self.allocated_in_epoch
            && self.clock == self.epoch
        {
            self.clock += 1;
        }
        self.allocated_in_epoch = false;
        self.epoch = self.clock;
        self.eviction.epoch_began(self.clock);
    }

    /// A lookup asked for `hashes` and the pool matched the first `matched` of them: the policy
    /// sees them (the prefix policy's duel, see [`Eviction::observe_demand`]).
    pub(crate) fn observe_demand(&mut self, hashes: &[SequenceHash], matched: usize) {
        self.eviction.observe_demand(hashes, matched);
    }

    /// A miniature's use of `hash`: a hit (the block is reused and released at once) or a miss
    /// (the key is stored in a free or evicted block and released). True on a hit.
    pub(crate) fn access(&mut self, hash: SequenceHash) -> bool {
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
    pub(crate) fn insert(&mut self, hash: SequenceHash) {
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
    pub(crate) fn allocate(&mut self, kind: TierKind, n: usize) -> Result<Vec<u32>> {
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
                        if let Some(ev) = self.events.as_mut() {
                            ev.push(super::KeyEvent {
                                key: hash,
                                stored: false,
                            });
                        }
                    }
                }
                // 2Q remembers keys evicted from probation; the prefix policy every key's count.
                self.eviction.evicted(hash, usize::from(list), uses);
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
    pub(crate) fn release_mutable(&mut self, id: u32) {
        if self.state_of(id) == Some(SlotState::Mutable) {
            self.mutable = self.mutable.saturating_sub(1);
            self.free_push(id);
        }
    }

    /// One more handle on a registered block; inactive → active. `reuse`: the block is being
    /// reused (matched or stored again), not merely cloned. False if not registered.
    pub(crate) fn acquire(&mut self, id: u32, reuse: bool) -> bool {
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
    pub(crate) fn release_immutable(&mut self, id: u32) {
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
        let epoch = if s.touched {
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
        let Placement {
            list,
            stamp,
            run_first,
        } = self.eviction.place(Released {
            uses,
            clock: self.clock,
            epoch,
        });
        self.list_insert(list, id, stamp, run_first);
    }

    /// Removes `id`'s registration (if `id` still holds `hash`); an inactive block becomes free.
    pub(crate) fn unregister(&mut self, id: u32, hash: SequenceHash) -> bool {
        match self.map.entry(hash) {
            Entry::Occupied(e) if *e.get() == id => {
                e.remove();
            }
            _ => return false,
        }
        if let Some(ev) = self.events.as_mut() {
            ev.push(super::KeyEvent {
                key: hash,
                stored: false,
            });
        }
        if self.state_of(id) == Some(SlotState::Inactive) {
            self.list_unlink(id);
            self.free_push(id);
        }
        true
    }

    /// Mutable `id` becomes registered under `hash`; returns the block now holding `hash` with a
    /// handle taken on it (`id`, or the existing block, in which case `id` is freed).
    pub(crate) fn register(&mut self, kind: TierKind, id: u32, hash: SequenceHash) -> Result<u32> {
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
        self.eviction.observe_store(hash);
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
                if let Some(ev) = self.events.as_mut() {
                    ev.push(super::KeyEvent {
                        key: hash,
                        stored: true,
                    });
                }
                // A key evicted not long ago returns: it is being reused.
                let uses = match self.eviction.recall(hash) {
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
