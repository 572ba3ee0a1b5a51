//! Keys registered in and removed from a pool, in order, for whoever announces them (vLLM's KV
//! events, which cache-aware routers consume). Off unless asked for ([`BlockPool::record_events`]):
//! a pool that nobody reads keeps nothing. Bounded: a reader that falls behind loses the oldest
//! events, counted, never memory.
//!
//! [`BlockPool::record_events`]: super::BlockPool::record_events

use std::collections::VecDeque;

use crate::identity::SequenceHash;

/// A key that became matchable in a pool (`stored`) or stopped being (evicted, withdrawn).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyEvent {
    /// The block's key.
    pub key: SequenceHash,
    /// Registered (true) or removed (false).
    pub stored: bool,
}

/// The recorded events of one pool.
pub(crate) type KeyEvents = DropOldest<KeyEvent>;

/// A log of at most `capacity` items that drops the oldest when full and counts the drops (a
/// reader that falls behind loses events, never memory). The pools' key events and the
/// leader's block events are kept in these.
#[derive(Debug)]
pub(crate) struct DropOldest<T> {
    capacity: usize,
    log: VecDeque<T>,
    dropped: u64,
}

impl<T> DropOldest<T> {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            log: VecDeque::new(),
            dropped: 0,
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    pub(crate) fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
        while self.log.len() > self.capacity {
            self.log.pop_front();
            self.dropped += 1;
        }
    }

    pub(crate) fn push(&mut self, item: T) {
        if self.log.len() >= self.capacity {
            self.log.pop_front();
            self.dropped += 1;
        }
        self.log.push_back(item);
    }

    /// Counts `n` items lost before they reached this log (a drained log's drops).
    pub(crate) fn count_dropped(&mut self, n: u64) {
        self.dropped += n;
    }

    /// The items so far, oldest first, and how many were dropped since the last take.
    pub(crate) fn take(&mut self) -> (Vec<T>, u64) {
        let items = self.log.drain(..).collect();
        (items, std::mem::take(&mut self.dropped))
    }
}
