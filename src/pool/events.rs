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

/// The recorded events of one pool, at most `capacity` of them.
#[derive(Debug)]
pub(crate) struct KeyEvents {
    capacity: usize,
    log: VecDeque<KeyEvent>,
    dropped: u64,
}

impl KeyEvents {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            log: VecDeque::new(),
            dropped: 0,
        }
    }

    pub(crate) fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
        while self.log.len() > self.capacity {
            self.log.pop_front();
            self.dropped += 1;
        }
    }

    pub(crate) fn push(&mut self, key: SequenceHash, stored: bool) {
        if self.log.len() >= self.capacity {
            self.log.pop_front();
            self.dropped += 1;
        }
        self.log.push_back(KeyEvent { key, stored });
    }

    /// The events so far, oldest first, and how many were dropped since the last take.
    pub(crate) fn take(&mut self) -> (Vec<KeyEvent>, u64) {
        let events = self.log.drain(..).collect();
        (events, std::mem::take(&mut self.dropped))
    }
}
