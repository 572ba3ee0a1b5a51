//! [`BlockPool`], one tier's pool, and its handles: [`MutableBlock`] (a block being written)
//! and [`ImmutableBlock`] (a registered block held). Each operation takes the pool's lock once
//! and runs the bookkeeping ([`State`]).

use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;

use super::eviction::{Eviction, EvictionPolicy};
use super::state::State;
use super::{PoolStats, MAX_POOL_BLOCKS};
use crate::error::{Error, Result};
use crate::identity::SequenceHash;
use crate::tier::TierKind;

struct Inner {
    kind: TierKind,
    num_blocks: usize,
    policy: EvictionPolicy,
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
        let eviction = policy.build(n).map_err(|e| e.with("tier", kind))?;
        Self::with_eviction(kind, n, policy, eviction)
    }

    /// A pool of `num_blocks` (checked: 1 to [`MAX_POOL_BLOCKS`]) free blocks evicting by
    /// `eviction`, which `policy` names.
    pub(crate) fn with_eviction(
        kind: TierKind,
        num_blocks: u32,
        policy: EvictionPolicy,
        eviction: Box<dyn Eviction>,
    ) -> Result<Self> {
        let state = State::new(num_blocks, eviction).map_err(|e| e.with("tier", kind))?;
        Ok(Self {
            inner: Arc::new(Inner {
                kind,
                num_blocks: num_blocks as usize,
                policy,
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
        self.inner.policy
    }

    /// Every registered block as `(key, block id)`, ordered by block id (a snapshot; for
    /// publishing what the tier holds).
    pub fn registered(&self) -> Vec<(SequenceHash, usize)> {
        let mut v: Vec<(SequenceHash, usize)> = self
            .inner
            .state
            .lock()
            .registered()
            .map(|(h, id)| (h, id as usize))
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
            let n = n.min(st.available());
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
        items.retain(|item| !st.contains(key(item)));
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
            let Some(id) = st.lookup(hash) else {
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

    /// Registers blocks that already hold their keys (a tier reopened with its contents:
    /// `(block, key)` pairs) in this fresh pool: each named block is taken from the free list and
    /// registered under its key (released: inactive, matchable, evictable); blocks out of range,
    /// not free, or named twice, and keys named twice, are skipped. Returns how many were adopted.
    pub fn adopt(&self, entries: &[(usize, u128)]) -> usize {
        let mut by_block = std::collections::HashMap::with_capacity(entries.len());
        for &(block, key) in entries {
            by_block.entry(block).or_insert(SequenceHash(key));
        }
        let blocks = self.allocate_up_to(self.num_blocks());
        let named: Vec<(MutableBlock, SequenceHash)> = blocks
            .into_iter()
            .filter_map(|b| by_block.get(&b.block_id()).map(|&k| (b, k)))
            .collect();
        // Blocks not named were dropped above: back on the free list.
        let (n, errors) = self.register_all(named);
        if !errors.is_empty() {
            tracing::warn!(
                adopted = n,
                refused = errors.len(),
                "some reopened blocks were not adopted"
            );
        }
        n
    }

    /// A handle on every registered block, under one lock, as an internal hold (not a reuse:
    /// released, each block keeps its place in the eviction order): while held, no block
    /// changes key, so a snapshot of which block holds which key stays true (a persisted tier's
    /// index is saved so).
    pub fn hold_registered(&self) -> Vec<ImmutableBlock> {
        let mut st = self.inner.state.lock();
        let held: Vec<(SequenceHash, u32)> = st.registered().collect();
        let mut out = Vec::with_capacity(held.len());
        for (hash, id) in held {
            if st.acquire(id, false) {
                out.push(ImmutableBlock {
                    inner: Arc::clone(&self.inner),
                    id,
                    hash,
                });
            }
        }
        drop(st);
        out
    }

    /// Length of the registered prefix of `hashes`, without taking handles or touching LRU order.
    pub fn prefix_len(&self, hashes: &[SequenceHash]) -> usize {
        let st = self.inner.state.lock();
        hashes.iter().take_while(|&&h| st.contains(h)).count()
    }

    /// Whether `hash` is registered (active or inactive).
    pub fn contains(&self, hash: SequenceHash) -> bool {
        self.inner.state.lock().contains(hash)
    }

    /// Whether `hash` is registered on block `block`.
    pub fn holds(&self, hash: SequenceHash, block: usize) -> bool {
        self.inner.state.lock().lookup(hash).map(|b| b as usize) == Some(block)
    }

    /// Starts recording the keys this pool registers and removes (evicted or withdrawn), at most
    /// `capacity` of them between two [`BlockPool::take_events`] (the oldest dropped first, and
    /// counted). Recording again keeps what was recorded and sets the new capacity.
    pub fn record_events(&self, capacity: usize) {
        let mut st = self.inner.state.lock();
        match st.events.as_mut() {
            Some(ev) => ev.set_capacity(capacity),
            None => st.events = Some(super::events::KeyEvents::new(capacity)),
        }
    }

    /// The key events recorded since the last call, oldest first, and how many were dropped
    /// because the log was full (nothing when not recording).
    pub fn take_events(&self) -> (Vec<super::KeyEvent>, u64) {
        match self.inner.state.lock().events.as_mut() {
            Some(ev) => ev.take(),
            None => (Vec::new(), 0),
        }
    }

    /// Withdraws every registration (a cache reset): nothing can be matched any more; inactive
    /// blocks become free at once, blocks in use when their last handle drops. Records no
    /// per-key events (the caller announces the reset as one). Returns how many were withdrawn.
    pub fn unregister_all(&self) -> usize {
        let mut st = self.inner.state.lock();
        let events = st.events.take();
        let keys: Vec<(SequenceHash, u32)> = st.registered().collect();
        let n = keys
            .into_iter()
            .filter(|&(hash, id)| st.unregister(id, hash))
            .count();
        st.events = events;
        n
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
