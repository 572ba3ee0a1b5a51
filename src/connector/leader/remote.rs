//! The leader's side of the remote (G4) store: its lookups (after host and disk, continuing the
//! prefix where they stopped) and its write-behind of host blocks.
//!
//! Lookups run on a [`LookupThread`]. An engine that accepts "ask again later"
//! ([`Engine::DEFERRED_MATCH`](crate::connector::adapter::Engine::DEFERRED_MATCH), vLLM) gets a
//! pending answer while the lookup runs and the result when it asks again: the scheduler never
//! waits for the store. Other engines (TensorRT-LLM) wait at most `remote.lookup_timeout_ms`;
//! what misses it is a miss. A failure or timeout is counted and warned about (rate-limited); after
//! a failure, or a few timeouts in a row, the store is not asked for a moment
//! ([`LookupThread::BACKOFF`]): local tiers only, never a hang, never an error to the engine.
//!
//! Writes: every host block seen often enough (`remote.min_frequency`, like the disk admission)
//! and not known to be in the store is written by the workers (each its shard) after it landed
//! in host memory, in the background; the store does not rewrite a value it holds.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use crate::config::Config;
use crate::connector::metrics::{Metrics, WarnLimiter};
use crate::connector::remote::{LookupOutcome, LookupThread, RemoteStore};
use crate::connector::RequestId;
use crate::error::Result;
use crate::identity::SequenceHash;
use crate::pool::{FrequencyFilter, ImmutableBlock};

/// How many keys the leader remembers as written to (or read from) the store; beyond, it
/// forgets them all (a forgotten key is at worst offered again, and the store keeps it once).
const KNOWN_CAP: usize = 1 << 20;

/// How many times one request is answered "pending" before it is answered without the store.
const MAX_PENDING: u32 = 64;

/// What a remote lookup answers the match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RemoteAnswer {
    /// This many of the keys asked, from the first, are in the store (0: a miss).
    Found(usize),
    /// Ask again later: the lookup is running.
    Pending,
}

/// The leader's remote store and what it keeps about it.
pub(super) struct LeaderStore {
    pub store: Arc<dyn RemoteStore>,
    lookups: LookupThread,
    /// Answer later instead of waiting (the engine asks again).
    deferred: bool,
    lookup_timeout: std::time::Duration,
    io_timeout: std::time::Duration,
    /// Per request: the first key index asked and how many times it was answered pending.
    asked: HashMap<RequestId, (usize, u32)>,
    /// Keys this instance wrote to or read from the store (not offered again).
    known: HashSet<SequenceHash>,
    /// Host → remote admission.
    filter: FrequencyFilter,
    /// Host blocks waiting to be written.
    pub queue: Vec<(ImmutableBlock, SequenceHash)>,
    warn: WarnLimiter,
}

impl std::fmt::Debug for LeaderStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderStore")
            .field("store", &self.store.describe())
            .field("deferred", &self.deferred)
            .field("queued", &self.queue.len())
            .finish_non_exhaustive()
    }
}

impl LeaderStore {
    pub fn new(store: Arc<dyn RemoteStore>, config: &Config, deferred: bool) -> Result<Self> {
        Ok(Self {
            lookups: LookupThread::start(store.clone())?,
            store,
            deferred,
            lookup_timeout: config.remote.lookup_timeout(),
            io_timeout: config.remote.io_timeout(),
            asked: HashMap::new(),
            known: HashSet::new(),
            filter: FrequencyFilter::new(config.remote.min_frequency(), 1 << 16)?,
            queue: Vec::new(),
            warn: WarnLimiter::new(WarnLimiter::INTERVAL),
        })
    }

    /// How many of `keys` (the request's keys from index `first`, after what host and disk
    /// matched) the store holds, or pending (see the module docs).
    pub fn lookup(
        &mut self,
        id: &RequestId,
        first: usize,
        keys: &[SequenceHash],
        metrics: &Metrics,
    ) -> RemoteAnswer {
        if keys.is_empty() {
            return RemoteAnswer::Found(0);
        }
        // The keys as the store takes them, built only when a lookup is submitted (not on a
        // re-ask that is still pending).
        let raw = || keys.iter().map(|k| k.0).collect::<Vec<u128>>();
        if self.deferred {
            if let Some(outcome) = self.lookups.take(id.as_str(), first) {
                self.asked.remove(id);
                return RemoteAnswer::Found(self.settle(outcome, keys.len(), metrics));
            }
            let (asked_first, times) = self.asked.get(id).copied().unwrap_or((usize::MAX, 0));
            if times >= MAX_PENDING {
                // Answered pending too often (its prefix keeps moving): no store this time.
                self.asked.remove(id);
                self.lookups.forget(id.as_str());
                return RemoteAnswer::Found(0);
            }
            if asked_first != first {
                if self.lookups.backing_off() {
                    metrics.record_remote_lookup_skipped();
                    metrics.set_remote_available(false);
                    return RemoteAnswer::Found(0);
                }
                if !self
                    .lookups
                    .submit(id.as_str(), first, raw(), self.io_timeout)
                {
                    metrics.record_remote_lookup_skipped();
                    return RemoteAnswer::Found(0);
                }
            }
            self.asked.insert(id.clone(), (first, times + 1));
            return RemoteAnswer::Pending;
        }
        if self.lookups.backing_off() {
            metrics.record_remote_lookup_skipped();
            metrics.set_remote_available(false);
            return RemoteAnswer::Found(0);
        }
        let deadline = Instant::now() + self.lookup_timeout;
        if !self
            .lookups
            .submit(id.as_str(), first, raw(), self.lookup_timeout)
        {
            metrics.record_remote_lookup_skipped();
            return RemoteAnswer::Found(0);
        }
        let outcome = self
            .lookups
            .wait(id.as_str(), first, deadline)
            .unwrap_or(LookupOutcome::Timeout);
        RemoteAnswer::Found(self.settle(outcome, keys.len(), metrics))
    }

    /// Counts a lookup's outcome; the number of keys found (0 for any failure).
    fn settle(&mut self, outcome: LookupOutcome, asked: usize, metrics: &Metrics) -> usize {
        match outcome {
            LookupOutcome::Found(n) => {
                metrics.record_remote_lookup();
                metrics.set_remote_available(true);
                n.min(asked)
            }
            LookupOutcome::Timeout => {
                metrics.record_remote_lookup_timeout();
                if let Some(n) = self.warn.event(1) {
                    tracing::warn!(
                        store = %self.store.describe(), lookups = n,
                        "kvbm: remote store lookups missed their deadline; serving from local tiers (see kvbm_remote_lookups_total)"
                    );
                }
                0
            }
            LookupOutcome::Failed(why) => {
                metrics.record_remote_lookup_error();
                metrics.set_remote_available(false);
                if let Some(n) = self.warn.event(1) {
                    tracing::warn!(
                        store = %self.store.describe(), lookups = n, error = %why,
                        "kvbm: remote store lookups failed; serving from local tiers (see kvbm_remote_lookups_total)"
                    );
                }
                0
            }
            LookupOutcome::Skipped => {
                metrics.record_remote_lookup_skipped();
                metrics.set_remote_available(false);
                0
            }
        }
    }

    /// The request finished: its lookups are forgotten.
    pub fn forget(&mut self, id: &RequestId) {
        if self.asked.remove(id).is_some() {
            self.lookups.forget(id.as_str());
        }
    }

    /// Whether `hash` is known to be in the store (written or read by this instance).
    pub fn knows(&self, hash: SequenceHash) -> bool {
        self.known.contains(&hash)
    }

    /// Remembers that the store holds `hash`.
    pub fn remember(&mut self, hash: SequenceHash) {
        if self.known.len() >= KNOWN_CAP {
            self.known.clear();
        }
        self.known.insert(hash);
    }

    /// Counts a sighting of a host block; queues it for writing when admitted and not known
    /// (nor queued) already.
    pub fn consider(&mut self, block: ImmutableBlock, pending: bool) {
        let hash = block.sequence_hash();
        self.filter.record(hash);
        if self.filter.admit(hash)
            && !pending
            && !self.known.contains(&hash)
            && !self.queue.iter().any(|(_, h)| *h == hash)
        {
            self.queue.push((block, hash));
        }
    }

    /// Whether writes should be skipped now (the store is failing).
    pub fn backing_off(&self) -> bool {
        self.lookups.backing_off()
    }

    /// Counts `n` blocks whose write failed; warns (rate-limited).
    pub fn write_failed(&mut self, n: u64) {
        if let Some(n) = self.warn.event(n) {
            tracing::warn!(
                store = %self.store.describe(), blocks = n,
                "kvbm: blocks failed to write to the remote store (not shared; see kvbm_store_error_blocks_total{{tier=\"remote\"}})"
            );
        }
    }
}
