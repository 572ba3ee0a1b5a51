//! The simulated engine's device block pool, with the engine's own prefix reuse (both engines
//! keep full computed blocks under their token-prefix key and reuse them on a later match).
//!
//! Invariants: a block is free, referenced (`refs > 0`), or cached with no reference (counted in
//! `idle_cached`, queued once in `evictable`); eviction reclaims the oldest idle cached block.

use std::collections::{HashMap, VecDeque};

/// The device blocks of the simulated engine.
pub struct DevicePool {
    free: Vec<usize>,
    refs: Vec<u32>,
    /// Prefix cache: key → block, and each cached block's key.
    cached: HashMap<u128, usize>,
    key_of: Vec<Option<u128>>,
    /// Cached blocks with no reference, oldest first; each block at most once (`queued`), and
    /// entries referenced again since are skipped when popped.
    evictable: VecDeque<usize>,
    queued: Vec<bool>,
    /// Cached blocks with no reference (what eviction can reclaim).
    idle_cached: usize,
    enabled: bool,
}

impl DevicePool {
    /// `n` blocks, of which the first `reserved` are never handed out (vLLM keeps block 0 as
    /// its null block); `enabled`: the prefix cache is on.
    pub fn new(n: usize, enabled: bool, reserved: usize) -> Self {
        Self {
            free: (reserved.min(n)..n).rev().collect(),
            refs: vec![0; n],
            cached: HashMap::new(),
            key_of: vec![None; n],
            evictable: VecDeque::new(),
            queued: vec![false; n],
            idle_cached: 0,
            enabled,
        }
    }

    /// Blocks an allocation can get (free, or cached and idle).
    pub fn available(&self) -> usize {
        self.free.len() + self.idle_cached
    }

    /// A referenced block: a free one, else the oldest idle cached one (evicted).
    pub fn alloc(&mut self) -> Option<usize> {
        if let Some(b) = self.free.pop() {
            self.refs[b] = 1;
            return Some(b);
        }
        while let Some(b) = self.evictable.pop_front() {
            self.queued[b] = false;
            if self.refs[b] == 0 {
                if let Some(k) = self.key_of[b].take() {
                    self.cached.remove(&k);
                    self.idle_cached -= 1;
                    self.refs[b] = 1;
                    return Some(b);
                }
            }
        }
        None
    }

    /// Longest cached prefix of `keys`, referenced.
    pub fn lookup(&mut self, keys: &[u128]) -> Vec<usize> {
        let mut out = Vec::new();
        if !self.enabled {
            return out;
        }
        for k in keys {
            match self.cached.get(k) {
                Some(&b) => {
                    if self.refs[b] == 0 {
                        self.idle_cached -= 1;
                    }
                    self.refs[b] += 1;
                    out.push(b);
                }
                None => break,
            }
        }
        out
    }

    /// Releases a request's blocks; full computed blocks are kept for reuse under their keys.
    pub fn release(&mut self, blocks: &[usize], keys: &[u128]) {
        for (i, &b) in blocks.iter().enumerate() {
            self.refs[b] = self.refs[b].saturating_sub(1);
            if self.enabled && self.key_of[b].is_none() {
                if let Some(&k) = keys.get(i) {
                    if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(k) {
                        e.insert(b);
                        self.key_of[b] = Some(k);
                    }
                }
            }
            if self.refs[b] == 0 {
                if self.key_of[b].is_some() {
                    self.idle_cached += 1;
                    if !self.queued[b] {
                        self.queued[b] = true;
                        self.evictable.push_back(b);
                    }
                } else {
                    self.free.push(b);
                }
            }
        }
    }

    /// True when `b` is neither referenced nor kept by the prefix cache.
    pub fn is_free(&self, b: usize) -> bool {
        self.refs[b] == 0 && self.key_of[b].is_none()
    }
}
