//! The leader's side of the remote (G4) store: its lookups (after host and disk, continuing the
//! prefix where they stopped) and its write-behind of host blocks.
//!
//! Lookups run on a [`LookupThread`]. An engine that accepts "ask again later"
//! ([`Engine::DEFERRED_MATCH`](crate::connector::adapter::Engine::DEFERRED_MATCH), vLLM) gets a
//! pending answer while the lookup runs and the result when it asks again, for at most
//! `remote.lookup_wait_ms` from its first ask: past it the request goes on with what the local
//! tiers matched (the scheduler never waits for the store, and a slow store costs a request at
//! most that wait). Other engines (TensorRT-LLM) wait at most `remote.lookup_timeout_ms`; what
//! misses it is a miss, while the store call itself runs to `remote.io_timeout_ms`, so the
//! store's health sees its real latency, not the engine's patience. A failure or timeout is
//! counted and warned about (rate-limited). The store's [`StoreHealth`] (a window of its recent
//! lookups and loads) takes a slow or failing store out of the lookup and write path for a
//! back-off, then probes it again: local tiers only, never a hang, never an error to the engine.
//!
//! Writes: every host block seen often enough (`remote.min_frequency`, like the disk admission)
//! and not known to be in the store is written by the workers (each its shard) after it landed
//! in host memory, in the background; the store does not rewrite a value it holds.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use crate::config::Config;
use crate::connector::metrics::{Metrics, WarnLimiter};
use crate::connector::remote::{
    log_state_change, CallKind, CallOutcome, LookupOutcome, LookupThread, RemoteStore, StoreHealth,
    StoreState,
};
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
    /// How long a deferred lookup is waited for.
    lookup_wait: std::time::Duration,
    /// Per request: the lookup it waits for.
    asked: HashMap<RequestId, Asked>,
    /// Keys this instance wrote to or read from the store (not offered again).
    known: HashSet<SequenceHash>,
    /// Host → remote admission.
    filter: FrequencyFilter,
    /// Host blocks waiting to be written.
    pub queue: Vec<(ImmutableBlock, SequenceHash)>,
    /// Host blocks held by writes in flight (each holds its source blocks until it ends).
    pub writing: usize,
    /// At most this many host blocks are held by writes in flight ([`LeaderStore::write_room`]).
    pub max_writing: usize,
    warn: WarnLimiter,
    skipped_warn: WarnLimiter,
}

/// A request's deferred lookup.
#[derive(Debug, Clone, Copy)]
struct Asked {
    /// The index of the first key asked.
    first: usize,
    /// Times answered pending.
    times: u32,
    /// When it was submitted.
    since: Instant,
    /// Waited past `remote.lookup_wait_ms`: answered without the store from then on.
    expired: bool,
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
        let health = Arc::new(StoreHealth::new(
            config.remote.slow(),
            config.remote.backoff(),
        ));
        Ok(Self {
            lookups: LookupThread::start(store.clone(), health)?,
            store,
            deferred,
            lookup_timeout: config.remote.lookup_timeout(),
            io_timeout: config.remote.io_timeout(),
            lookup_wait: config.remote.lookup_wait(),
            asked: HashMap::new(),
            known: HashSet::new(),
            filter: FrequencyFilter::new(config.remote.min_frequency(), 1 << 16)?,
            queue: Vec::new(),
            writing: 0,
            max_writing: usize::MAX,
            warn: WarnLimiter::new(WarnLimiter::INTERVAL),
            skipped_warn: WarnLimiter::new(WarnLimiter::INTERVAL),
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
        if self.deferred {
            return self.lookup_deferred(id, first, keys, metrics);
        }
        self.lookup_blocking(id, first, keys, metrics)
    }

    /// A deferred lookup (see the module docs): the answer once the lookup thread has it;
    /// `Pending` while it is asked for, up to [`MAX_PENDING`] times or `lookup_wait`, then none
    /// (the lookup abandoned, counted as a timeout and as a slow call); none while the store
    /// backs off or the lookup thread refuses the lookup. A lookup of a request whose prefix moved
    /// abandons the earlier one.
    fn lookup_deferred(
        &mut self,
        id: &RequestId,
        first: usize,
        keys: &[SequenceHash],
        metrics: &Metrics,
    ) -> RemoteAnswer {
        let asked = self.asked.get(id).copied().filter(|a| a.first == first);
        if asked.is_some_and(|a| a.expired) {
            return RemoteAnswer::Found(0);
        }
        if let Some(outcome) = self.lookups.take(id.as_str(), first) {
            self.asked.remove(id);
            return RemoteAnswer::Found(self.settle(outcome, keys.len(), metrics));
        }
        if let Some(a) = asked {
            if a.times >= MAX_PENDING || a.since.elapsed() >= self.lookup_wait {
                // Waited long enough (or asked too often): on without the store; the late
                // answer is dropped (the store's health still sees the call).
                self.lookups.abandon(id.as_str(), first);
                self.asked.insert(id.clone(), Asked { expired: true, ..a });
                metrics.record_remote_lookup_timeout();
                self.warn_late();
                // A lookup not answered in the wait is evidence of a slow store at once
                // (its own answer, when it comes, is another sample).
                self.record_call(CallKind::Lookup, a.since.elapsed(), CallOutcome::Answered);
                self.publish_state(metrics);
                return RemoteAnswer::Found(0);
            }
            self.asked.insert(
                id.clone(),
                Asked {
                    times: a.times + 1,
                    ..a
                },
            );
            return RemoteAnswer::Pending;
        }
        if self.backing_off() {
            metrics.record_remote_lookup_skipped();
            self.publish_state(metrics);
            return RemoteAnswer::Found(0);
        }
        if let Some(old) = self.asked.get(id) {
            // The request's prefix moved: its earlier lookup is no longer wanted.
            let old_first = old.first;
            self.lookups.abandon(id.as_str(), old_first);
        }
        if !self
            .lookups
            .submit(id.as_str(), first, raw_keys(keys), self.io_timeout)
        {
            metrics.record_remote_lookup_skipped();
            return RemoteAnswer::Found(0);
        }
        self.asked.insert(
            id.clone(),
            Asked {
                first,
                times: 1,
                since: Instant::now(),
                expired: false,
            },
        );
        RemoteAnswer::Pending
    }

    /// A blocking lookup: submitted to the lookup thread and waited for up to `lookup_timeout`
    /// (a timeout when it does not answer); none while the store backs off or the thread refuses
    /// the lookup.
    fn lookup_blocking(
        &mut self,
        id: &RequestId,
        first: usize,
        keys: &[SequenceHash],
        metrics: &Metrics,
    ) -> RemoteAnswer {
        if self.backing_off() {
            metrics.record_remote_lookup_skipped();
            self.publish_state(metrics);
            return RemoteAnswer::Found(0);
        }
        let deadline = Instant::now() + self.lookup_timeout;
        if !self
            .lookups
            .submit(id.as_str(), first, raw_keys(keys), self.io_timeout)
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

    fn warn_late(&mut self) {
        if let Some(n) = self.warn.event(1) {
            tracing::warn!(
                store = %self.store.describe(), lookups = n,
                "kvbm: remote store lookups missed their deadline; serving from local tiers (see kvbm_remote_lookups_total)"
            );
        }
    }

    /// The store's verdict, for the report and the metrics.
    pub fn state(&self) -> StoreState {
        self.lookups.health().state()
    }

    /// Publishes the store's verdict to `metrics` (state gauge and availability).
    pub fn publish_state(&self, metrics: &Metrics) {
        let state = self.state();
        metrics.set_remote_state(state);
        metrics.set_remote_available(state != StoreState::Unavailable);
    }

    /// Tells the store's health how a load from it or a write to it went: `blocks` asked,
    /// `failed` not served or not written, over `elapsed` (from the operation's submission to
    /// its last completion).
    pub fn record_transfer(
        &self,
        kind: CallKind,
        blocks: usize,
        failed: usize,
        elapsed: std::time::Duration,
    ) {
        if blocks == 0 {
            return;
        }
        // One that moved none of its blocks failed as a call (a half-broken path: replies that
        // never come, values that never verify); one that moved some answered.
        let outcome = if failed >= blocks {
            CallOutcome::Failed
        } else {
            CallOutcome::Answered
        };
        self.record_call(kind, elapsed, outcome);
    }

    fn record_call(&self, kind: CallKind, elapsed: std::time::Duration, outcome: CallOutcome) {
        let health = self.lookups.health();
        if let Some((from, to)) = health.record(kind, elapsed, outcome) {
            log_state_change(&self.store.describe(), from, to, health.slow());
        }
    }

    /// Counts a lookup's outcome; the number of keys found (0 for any failure).
    fn settle(&mut self, outcome: LookupOutcome, asked: usize, metrics: &Metrics) -> usize {
        match outcome {
            LookupOutcome::Found(n) => {
                metrics.record_remote_lookup();
                self.publish_state(metrics);
                n.min(asked)
            }
            LookupOutcome::Timeout => {
                metrics.record_remote_lookup_timeout();
                self.warn_late();
                0
            }
            LookupOutcome::Failed(why) => {
                metrics.record_remote_lookup_error();
                self.publish_state(metrics);
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
                self.publish_state(metrics);
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

    /// Whether the store is out of the lookup and write path now (slow or unavailable, in its
    /// back-off).
    pub fn backing_off(&self) -> bool {
        !self.lookups.health().in_path()
    }

    /// Holds writes in flight to half the host tier of `host_blocks` blocks (at least one): a store
    /// whose replies stall keeps each write, and the host blocks it reads, for up to
    /// `remote.io_timeout_ms`, and without a bound those held blocks filled the host tier, so it
    /// stopped offloading and the store cost local hits, not only its own.
    pub fn bound_writes_to(&mut self, host_blocks: usize) {
        self.max_writing = (host_blocks / 2).max(1);
    }

    /// How many more host blocks writes may hold now.
    pub fn write_room(&self) -> usize {
        self.max_writing.saturating_sub(self.writing)
    }

    /// Counts `n` queued blocks not written because writes in flight hold their share of the
    /// host tier; warns (rate-limited).
    pub fn writes_skipped(&mut self, n: u64) {
        if let Some(n) = self.skipped_warn.event(n) {
            tracing::warn!(
                store = %self.store.describe(), blocks = n, held = self.writing,
                "kvbm: host blocks not written to the remote store: writes in flight already hold half the host tier (a slow store)"
            );
        }
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

/// The keys as the store takes them, built only when a lookup is submitted (not on a re-ask that
/// is still pending).
fn raw_keys(keys: &[SequenceHash]) -> Vec<u128> {
    keys.iter().map(|k| k.0).collect()
}
