//! The remote store's health: a verdict (healthy, slow, unavailable) from a window of its recent
//! calls, and the back-off that keeps a slow or failing store out of the lookup and write path
//! (see [`StoreHealth`]). Owned by the leader's [`LookupThread`](super::remote::LookupThread),
//! fed by its lookups and by the leader's remote loads and writes.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// What the leader makes of the store from its recent calls ([`StoreHealth`]).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, strum::Display,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum StoreState {
    /// Answers in time: looked up, read and written.
    Healthy,
    /// Answers, but the median latency of the window is above `remote.slow_ms`: out of the
    /// lookup and write path until its back-off ends, then probed.
    Slow,
    /// Half of the window's calls failed or timed out: out of the path like a slow store.
    Unavailable,
}

/// One call's outcome, as the health window sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    /// Answered (a miss is an answer).
    Answered,
    /// Past its deadline, or failed (unreachable, refused, undecodable, a read that served none
    /// of its blocks).
    Failed,
}

/// Which kind of call an outcome belongs to: a path can fail one kind and answer the others
/// (small replies pass, a block's value never arrives), so each kind also gets its own verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    /// Which keys the store holds (small replies).
    Lookup,
    /// A read of blocks' values (a load).
    Load,
    /// A write of blocks' values.
    Write,
}

/// The store's state, decided from a window of its recent calls (lookups and loads) rather than
/// from a few late answers: a busy host that delays one answer does not take a healthy store
/// out, a store that is slow or failing for [`StoreHealth::MIN_SAMPLES`] calls out of
/// [`StoreHealth::WINDOW`] does. Failures are also judged per [`CallKind`]: half of the window's
/// loads (or writes) failed, at least [`StoreHealth::MIN_KIND_FAILURES`] of them, makes it
/// unavailable however many lookups answer (a half-broken path whose small replies pass would
/// otherwise stay healthy while every load waits out its deadline). A store out of the path is left alone for its back-off
/// (`remote.backoff_secs`, doubling with each verdict in a row up to
/// [`StoreHealth::MAX_BACKOFF`]), then probed: the calls after the back-off decide again.
#[derive(Debug)]
pub struct StoreHealth {
    inner: Mutex<HealthInner>,
    slow: Duration,
    backoff: Duration,
}

#[derive(Debug)]
struct HealthInner {
    window: std::collections::VecDeque<(Duration, CallOutcome, CallKind)>,
    state: StoreState,
    out_until: Option<Instant>,
    next_backoff: Duration,
    changes: u64,
}

impl StoreHealth {
    /// Calls the verdict looks at (the most recent ones).
    pub const WINDOW: usize = 32;
    /// Calls needed before a verdict is made (a fresh or probed store is healthy until then).
    pub const MIN_SAMPLES: usize = 8;
    /// Failed loads (or writes) in the window that make the store unavailable when they are
    /// half of that kind's calls there, whatever the other kinds did. Not one or two: a store
    /// that evicted a value between its lookup and its load fails a load too.
    pub const MIN_KIND_FAILURES: usize = 3;
    /// The longest back-off (unless `remote.backoff_secs` is longer).
    pub const MAX_BACKOFF: Duration = Duration::from_secs(60);

    /// Healthy, with `slow` as the latency threshold and `backoff` as the first back-off.
    pub fn new(slow: Duration, backoff: Duration) -> Self {
        Self {
            inner: Mutex::new(HealthInner {
                window: std::collections::VecDeque::with_capacity(Self::WINDOW),
                state: StoreState::Healthy,
                out_until: None,
                next_backoff: backoff,
                changes: 0,
            }),
            slow,
            backoff,
        }
    }

    /// The current verdict.
    pub fn state(&self) -> StoreState {
        self.inner.lock().state
    }

    /// The latency above which the store counts as slow.
    pub fn slow(&self) -> Duration {
        self.slow
    }

    /// How many times the verdict changed.
    pub fn changes(&self) -> u64 {
        self.inner.lock().changes
    }

    /// Whether the store is asked now: false while a slow or unavailable store's back-off runs.
    pub fn in_path(&self) -> bool {
        self.inner
            .lock()
            .out_until
            .is_none_or(|t| Instant::now() >= t)
    }

    /// Records one call that took `latency`; returns `(from, to)` when the verdict changed
    /// (the caller logs it).
    pub fn record(
        &self,
        kind: CallKind,
        latency: Duration,
        outcome: CallOutcome,
    ) -> Option<(StoreState, StoreState)> {
        self.record_at(Instant::now(), kind, latency, outcome)
    }

    fn record_at(
        &self,
        now: Instant,
        kind: CallKind,
        latency: Duration,
        outcome: CallOutcome,
    ) -> Option<(StoreState, StoreState)> {
        let mut h = self.inner.lock();
        if h.out_until.is_some_and(|t| now < t) {
            // A late answer of a call made before the store was taken out: the verdict stands
            // until the back-off ends.
            return None;
        }
        if h.window.len() == Self::WINDOW {
            h.window.pop_front();
        }
        h.window.push_back((latency, outcome, kind));
        // One kind failing half its calls (loads, writes: a value that never arrives).
        let kind_failed = |k: CallKind| {
            let (n, failed) = h
                .window
                .iter()
                .filter(|c| c.2 == k)
                .fold((0, 0), |(n, f), c| {
                    (n + 1, f + usize::from(c.1 == CallOutcome::Failed))
                });
            failed >= Self::MIN_KIND_FAILURES && failed * 2 >= n
        };
        let kind_broken = kind_failed(CallKind::Load) || kind_failed(CallKind::Write);
        if h.window.len() < Self::MIN_SAMPLES && !kind_broken {
            return None;
        }
        let failed = h
            .window
            .iter()
            .filter(|c| c.1 == CallOutcome::Failed)
            .count();
        let mut latencies: Vec<Duration> = h.window.iter().map(|c| c.0).collect();
        latencies.sort_unstable();
        let median = latencies[latencies.len() / 2];
        let verdict = if failed * 2 >= h.window.len() || kind_broken {
            StoreState::Unavailable
        } else if median > self.slow {
            StoreState::Slow
        } else {
            StoreState::Healthy
        };
        let from = h.state;
        if verdict == StoreState::Healthy {
            h.out_until = None;
            h.next_backoff = self.backoff;
        } else {
            // Out of the path; the window starts afresh for the probe after the back-off.
            h.out_until = Some(now + h.next_backoff);
            h.next_backoff = (h.next_backoff * 2).min(Self::MAX_BACKOFF.max(self.backoff));
            h.window.clear();
        }
        h.state = verdict;
        if from != verdict {
            h.changes += 1;
            Some((from, verdict))
        } else {
            None
        }
    }
}

/// Logs a change of the store's verdict (one line per change).
pub fn log_state_change(store: &str, from: StoreState, to: StoreState, slow: Duration) {
    match to {
        StoreState::Healthy => tracing::info!(
            store, %from, to = %to,
            "kvbm: remote store healthy again: back in the lookup and write path"
        ),
        _ => tracing::warn!(
            store, %from, to = %to, slow_ms = slow.as_millis() as u64,
            "kvbm: remote store taken out of the lookup and write path for its back-off (slow: median latency above remote.slow_ms; unavailable: half of its recent calls, or of its recent loads or writes, failed); serving from local tiers"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The verdict comes from a window, not a few answers: late answers among timely ones keep
    /// the store healthy; a window's median above the threshold makes it slow; half failed
    /// makes it unavailable; out of the path for the back-off (doubling), late answers then
    /// ignored; after the back-off a probe of timely calls makes it healthy again.
    #[test]
    fn store_health_is_a_verdict_of_a_window_with_a_doubling_back_off() {
        let ms = Duration::from_millis;
        let h = StoreHealth::new(ms(50), ms(1000));
        let t0 = Instant::now();
        let at = |n: u64| t0 + ms(n);
        // Healthy with a few very late answers among timely ones.
        for i in 0..StoreHealth::WINDOW {
            let late = i % 4 == 0;
            let lat = if late { ms(500) } else { ms(1) };
            assert_eq!(
                h.record_at(at(0), CallKind::Lookup, lat, CallOutcome::Answered),
                None
            );
        }
        assert_eq!(h.state(), StoreState::Healthy);
        // Slow once the median is past the threshold.
        let mut change = None;
        for _ in 0..StoreHealth::WINDOW {
            change =
                change.or(h.record_at(at(1), CallKind::Lookup, ms(200), CallOutcome::Answered));
        }
        assert_eq!(change, Some((StoreState::Healthy, StoreState::Slow)));
        assert_eq!(h.state(), StoreState::Slow);
        let out = h.inner.lock().out_until;
        assert_eq!(out, Some(at(1) + ms(1000)), "out for the first back-off");
        // Late answers during the back-off change nothing.
        for _ in 0..StoreHealth::WINDOW {
            assert_eq!(
                h.record_at(at(500), CallKind::Lookup, ms(1), CallOutcome::Answered),
                None
            );
        }
        assert_eq!(h.state(), StoreState::Slow);
        // After it: the probe fails half its calls: unavailable, for twice as long.
        let mut change = None;
        for i in 0..StoreHealth::MIN_SAMPLES {
            let o = if i % 2 == 0 {
                CallOutcome::Failed
            } else {
                CallOutcome::Answered
            };
            change = change.or(h.record_at(at(1001), CallKind::Lookup, ms(1), o));
        }
        assert_eq!(change, Some((StoreState::Slow, StoreState::Unavailable)));
        assert_eq!(h.inner.lock().out_until, Some(at(1001) + ms(2000)));
        // After that back-off, MIN_SAMPLES timely calls make it healthy; the back-off resets.
        let mut change = None;
        for _ in 0..StoreHealth::MIN_SAMPLES {
            change =
                change.or(h.record_at(at(3002), CallKind::Lookup, ms(1), CallOutcome::Answered));
        }
        assert_eq!(change, Some((StoreState::Unavailable, StoreState::Healthy)));
        assert_eq!(h.inner.lock().out_until, None);
        assert_eq!(h.inner.lock().next_backoff, ms(1000));
        assert_eq!(h.changes(), 3);
        // The back-off doubles up to MAX_BACKOFF.
        let mut now = 4000;
        let mut last = Duration::ZERO;
        for _ in 0..10 {
            for _ in 0..StoreHealth::MIN_SAMPLES {
                h.record_at(at(now), CallKind::Lookup, ms(1), CallOutcome::Failed);
            }
            let until = h.inner.lock().out_until.unwrap_or(at(now));
            last = until.duration_since(at(now));
            now += last.as_millis() as u64 + 1;
        }
        assert_eq!(last, StoreHealth::MAX_BACKOFF);
    }

    /// A half-broken path: lookups answer, loads never deliver. The loads' own verdict takes it
    /// out once [`StoreHealth::MIN_KIND_FAILURES`] of them failed and they are half of the
    /// window's loads, however many lookups answered; fewer failed loads among answered ones
    /// (values evicted between lookup and load) leave it healthy.
    #[test]
    fn loads_that_never_deliver_make_the_store_unavailable_whatever_the_lookups_do() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        // Two failed loads among answered ones and many answered lookups: healthy.
        let h = StoreHealth::new(ms(50), ms(1000));
        for i in 0..StoreHealth::WINDOW {
            let (kind, o) = match i % 4 {
                0 if i < 8 => (CallKind::Load, CallOutcome::Failed),
                0 => (CallKind::Load, CallOutcome::Answered),
                _ => (CallKind::Lookup, CallOutcome::Answered),
            };
            assert_eq!(h.record_at(t0, kind, ms(1), o), None, "call {i}");
        }
        assert_eq!(h.state(), StoreState::Healthy);
        // Lookups answer, every load fails: unavailable at the third failed load.
        let h = StoreHealth::new(ms(50), ms(1000));
        let mut change = None;
        let mut loads = 0;
        for i in 0..StoreHealth::WINDOW {
            let kind = if i % 4 == 3 {
                loads += 1;
                CallKind::Load
            } else {
                CallKind::Lookup
            };
            let o = if kind == CallKind::Load {
                CallOutcome::Failed
            } else {
                CallOutcome::Answered
            };
            change = h.record_at(t0, kind, ms(1), o);
            if change.is_some() {
                break;
            }
        }
        assert_eq!(change, Some((StoreState::Healthy, StoreState::Unavailable)));
        assert_eq!(loads, StoreHealth::MIN_KIND_FAILURES);
        assert!(!h.in_path(), "out of the path for its back-off");
        // Writes likewise.
        let h = StoreHealth::new(ms(50), ms(1000));
        for _ in 0..StoreHealth::MIN_KIND_FAILURES - 1 {
            assert_eq!(
                h.record_at(t0, CallKind::Write, ms(1), CallOutcome::Failed),
                None
            );
        }
        assert_eq!(
            h.record_at(t0, CallKind::Write, ms(1), CallOutcome::Failed),
            Some((StoreState::Healthy, StoreState::Unavailable))
        );
    }
}
