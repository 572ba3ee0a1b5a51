//! Block events: what the leader's tiers came to hold and stopped holding, for an engine that
//! announces its cache's contents to cache-aware routers (vLLM's KV events through
//! `take_events`). Off unless [`Leader::record_block_events`] turns it on; bounded: a reader
//! that falls behind loses the oldest events, counted in [`BlockEvents::dropped`], never memory.
//!
//! Three streams, taken together by [`Leader::take_block_events`]:
//!
//! * **stores submitted**: which block of which request a key was stored for, in the step the
//!   store was decided, while the engine still has the request (its own block hash and tokens
//!   are read there: our keys are not the engine's);
//! * **tier events**: a key registered in the host or disk pool (the store completed: it can be
//!   matched), or removed from it (evicted, withdrawn after failing verification); a key written
//!   to the shared store by this instance (the store evicts on its own: no removal is known);
//! * **cleared**: [`Leader::clear_tiers`] withdrew everything (a cache reset).

use crate::connector::adapter::SchedulerAdapter;
use crate::connector::RequestId;
use crate::identity::SequenceHash;
use crate::pool::DropOldest;
use crate::tier::TierKind;

use super::Leader;

/// A store decided for block `block` (its index in the request's token blocks) of `request`
/// (group-tagged for a model with several KV-cache groups) under `key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreSubmitted {
    /// The request (as the leader names it: `R`, or `R` + group separator + `g`).
    pub request: RequestId,
    /// The block's index in the request's blocks.
    pub block: usize,
    /// The key it is stored under.
    pub key: SequenceHash,
}

/// A change in what a tier holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierEvent {
    /// `key` can now be matched in `tier` (the shared store: this instance wrote it).
    Stored {
        /// Host, disk or remote.
        tier: TierKind,
        /// The block's key.
        key: SequenceHash,
    },
    /// `key` left `tier` (evicted, or withdrawn).
    Removed {
        /// Host or disk.
        tier: TierKind,
        /// The block's key.
        key: SequenceHash,
    },
    /// Every tier was cleared.
    Cleared,
}

/// What [`Leader::take_block_events`] answers.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BlockEvents {
    /// Stores decided since the last take, oldest first.
    pub submitted: Vec<StoreSubmitted>,
    /// Tier events since the last take, oldest first (the host pool's, then the disk pool's,
    /// then the shared store's and resets, each stream in its own order).
    pub events: Vec<TierEvent>,
    /// Events and submissions dropped since the last take because the reader fell behind.
    pub dropped: u64,
}

/// The leader's own part of the log (the pools keep theirs).
#[derive(Debug)]
pub(super) struct EventLog {
    submitted: DropOldest<StoreSubmitted>,
    events: DropOldest<TierEvent>,
}

impl EventLog {
    fn new(capacity: usize) -> Self {
        Self {
            submitted: DropOldest::new(capacity),
            events: DropOldest::new(capacity),
        }
    }

    pub(super) fn submitted(&mut self, request: &RequestId, block: usize, key: SequenceHash) {
        self.submitted.push(StoreSubmitted {
            request: request.clone(),
            block,
            key,
        });
    }

    pub(super) fn remote_written(&mut self, key: SequenceHash) {
        self.events.push(TierEvent::Stored {
            tier: TierKind::Remote,
            key,
        });
    }
}

impl<A: SchedulerAdapter> Leader<A> {
    /// Starts recording block events, at most `capacity` of each stream between two
    /// [`Leader::take_block_events`] (the oldest dropped first and counted).
    pub fn record_block_events(&mut self, capacity: usize) {
        self.events = Some(EventLog::new(capacity));
        self.arm_pool_events();
    }

    /// Has the host and disk pools record their key events (once they exist; called again when
    /// they are built).
    pub(super) fn arm_pool_events(&self) {
        let (Some(log), Some(tiers)) = (self.events.as_ref(), self.tiers.as_ref()) else {
            return;
        };
        for pool in [tiers.host.as_ref(), tiers.disk.as_ref()]
            .into_iter()
            .flatten()
        {
            pool.record_events(log.events.capacity());
        }
    }

    /// Moves the pools' key events into the leader's log (so a reset is ordered after them).
    fn drain_pool_events(&mut self) {
        let (Some(log), Some(tiers)) = (self.events.as_mut(), self.tiers.as_ref()) else {
            return;
        };
        for pool in [tiers.host.as_ref(), tiers.disk.as_ref()]
            .into_iter()
            .flatten()
        {
            let (events, dropped) = pool.take_events();
            log.events.count_dropped(dropped);
            let tier = pool.kind();
            for e in events {
                log.events.push(if e.stored {
                    TierEvent::Stored { tier, key: e.key }
                } else {
                    TierEvent::Removed { tier, key: e.key }
                });
            }
        }
    }

    /// The block events since the last call (empty when not recording).
    pub fn take_block_events(&mut self) -> BlockEvents {
        self.drain_pool_events();
        let Some(log) = self.events.as_mut() else {
            return BlockEvents::default();
        };
        let (submitted, dropped_submitted) = log.submitted.take();
        let (events, dropped_events) = log.events.take();
        BlockEvents {
            submitted,
            events,
            dropped: dropped_submitted + dropped_events,
        }
    }

    /// Withdraws every block the host and disk tiers hold (a cache reset): no later request
    /// matches them; blocks in use by operations in flight are freed when those end, and stores
    /// still in flight are not registered when they complete (what they wrote was computed
    /// before the reset). The shared store is not cleared (other instances use it), and the
    /// keys already written to it stay there. Records one [`TierEvent::Cleared`].
    /// Returns how many blocks were withdrawn.
    pub fn clear_tiers(&mut self) -> usize {
        self.drain_pool_events();
        let mut n = 0;
        if let Some(tiers) = self.tiers.as_ref() {
            for pool in [tiers.host.as_ref(), tiers.disk.as_ref()]
                .into_iter()
                .flatten()
            {
                n += pool.unregister_all();
            }
        }
        // Host blocks queued for disk would store what was just withdrawn, and stores in flight
        // what was computed before the reset: neither is registered.
        self.disk_queue.clear();
        if let Some(r) = self.remote.as_mut() {
            r.queue.clear();
        }
        self.cache_epoch += 1;
        if let Some(log) = self.events.as_mut() {
            log.events.push(TierEvent::Cleared);
        }
        n
    }
}
