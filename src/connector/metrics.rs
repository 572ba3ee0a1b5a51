//! The connector's counters, exposed as a [`MetricsSnapshot`] or in Prometheus text format.
//!
//! [`Metrics`] owns a fixed set of monotonic `u64` counters: lookup and matched tokens, hit
//! tokens per tier, failed-load blocks, failed-store blocks per destination tier, operations submitted/completed/failed, and blocks and
//! bytes moved per (source, destination) tier pair (a fixed 4 × 4 table indexed by
//! [`TierKind`]). Every `record_*` call is one or two relaxed atomic adds: no lock, no
//! allocation, safe to call on the hot path from any thread.
//!
//! Invariants:
//!
//! * counters only grow (they wrap on `u64` overflow instead of panicking);
//! * each counter is exact, but a [`MetricsSnapshot`] reads them one by one, so while writers run
//!   it may mix values from slightly different moments (e.g. a hit counted before its lookup);
//! * rates are computed at read time and are `0` when nothing was looked up (never NaN).
//!
//! Operation accounting: `operations_completed` counts operations that finished successfully
//! and `operations_failed` those that finished with an error; the two are disjoint, so
//! `submitted - completed - failed` is the number still in flight.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use crate::connector::remote::StoreState;
use crate::tier::TierKind;

/// Every tier, in [`TierKind`]'s order (the order of the transfer table and its output).
const TIERS: [TierKind; 4] = [
    TierKind::Device,
    TierKind::Host,
    TierKind::Disk,
    TierKind::Remote,
];

/// The (source, destination) pairs always rendered, even at zero, so rate queries see them
/// from the first scrape: offload (device → host, host → disk) and onboard (host → device,
/// disk → device). Other pairs appear once they are non-zero.
const STANDARD_PATHS: [(TierKind, TierKind); 4] = [
    (TierKind::Device, TierKind::Host),
    (TierKind::Host, TierKind::Device),
    (TierKind::Host, TierKind::Disk),
    (TierKind::Disk, TierKind::Device),
];

/// Row/column of `tier` in the transfer table.
fn index(tier: TierKind) -> usize {
    match tier {
        TierKind::Device => 0,
        TierKind::Host => 1,
        TierKind::Disk => 2,
        TierKind::Remote => 3,
    }
}

/// One relaxed add; wraps on overflow.
fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

/// One relaxed read.
fn get(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

/// `num / den`, or 0 when `den` is 0.
fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

/// Blocks and bytes moved along one (source, destination) pair.
#[derive(Debug, Default)]
struct PairCounters {
    blocks: AtomicU64,
    bytes: AtomicU64,
}

/// The connector's counters. Lock-free; share it as `Arc<Metrics>` or `&'static Metrics`.
#[derive(Debug, Default)]
pub struct Metrics {
    lookup_tokens: AtomicU64,
    matched_tokens: AtomicU64,
    host_hit_tokens: AtomicU64,
    disk_hit_tokens: AtomicU64,
    remote_hit_tokens: AtomicU64,
    load_error_blocks: AtomicU64,
    offload_dropped_blocks: AtomicU64,
    window_skipped_blocks: AtomicU64,
    host_store_error_blocks: AtomicU64,
    disk_store_error_blocks: AtomicU64,
    remote_store_error_blocks: AtomicU64,
    remote_lookups: AtomicU64,
    remote_lookup_timeouts: AtomicU64,
    remote_lookup_errors: AtomicU64,
    remote_lookup_skipped: AtomicU64,
    /// 1 while the remote store answers, 0 while it is failing; 0 without a remote tier.
    remote_available: AtomicU64,
    /// The remote store's verdict: 0 none (no remote tier), 1 healthy, 2 slow, 3 unavailable.
    remote_state: AtomicU64,
    /// Changes of that verdict.
    remote_state_changes: AtomicU64,
    /// The remote stores' own counters, the leader's and every rank's added (set, not added to:
    /// see [`Metrics::set_remote_store_stats`]).
    remote_call_errors: AtomicU64,
    remote_call_timeouts: AtomicU64,
    remote_reconnects: AtomicU64,
    remote_invalid_values: AtomicU64,
    operations_submitted: AtomicU64,
    operations_completed: AtomicU64,
    operations_failed: AtomicU64,
    /// Finished requests whose device blocks the engine kept for our operations, and the
    /// microseconds from their finish until the leader saw those operations end.
    finish_holds: AtomicU64,
    finish_hold_us: AtomicU64,
    /// `transfers[index(src)][index(dst)]`.
    transfers: [[PairCounters; 4]; 4],
}

impl Metrics {
    /// All counters at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// A lookup for `prompt_tokens` tokens matched `matched_tokens` beyond the device (promised,
    /// not yet loaded).
    pub fn record_lookup(&self, prompt_tokens: u64, matched_tokens: u64) {
        add(&self.lookup_tokens, prompt_tokens);
        add(&self.matched_tokens, matched_tokens);
    }

    /// `tokens` whose load from `tier` completed successfully: the hits. Counted for
    /// [`TierKind::Host`], [`TierKind::Disk`] and [`TierKind::Remote`]; [`TierKind::Device`] is
    /// not a load source and is ignored.
    pub fn record_hit(&self, tier: TierKind, tokens: u64) {
        match tier {
            TierKind::Host => add(&self.host_hit_tokens, tokens),
            TierKind::Disk => add(&self.disk_hit_tokens, tokens),
            TierKind::Remote => add(&self.remote_hit_tokens, tokens),
            TierKind::Device => {}
        }
    }

    /// `blocks` blocks and `bytes` bytes moved from `src` to `dst` by completed operations
    /// (offload: device → host, host → disk; onboard: host → device, disk → device; any other
    /// pair is counted too).
    pub fn record_transfer(&self, src: TierKind, dst: TierKind, blocks: u64, bytes: u64) {
        let pair = &self.transfers[index(src)][index(dst)];
        add(&pair.blocks, blocks);
        add(&pair.bytes, bytes);
    }

    /// `blocks` device blocks whose load failed (they will be recomputed).
    pub fn record_load_error(&self, blocks: u64) {
        add(&self.load_error_blocks, blocks);
    }

    /// `blocks` full blocks that were not offloaded because neither the host nor the disk tier had
    /// a free block for them (every block in use by operations in flight).
    pub fn record_offload_dropped(&self, blocks: u64) {
        add(&self.offload_dropped_blocks, blocks);
    }

    /// `blocks` full blocks of sliding-window KV-cache groups not offloaded because no later hit
    /// reads them (they lie before every window a hit is expected to need).
    pub fn record_window_skipped(&self, blocks: u64) {
        add(&self.window_skipped_blocks, blocks);
    }

    /// `blocks` blocks whose store into `dst` failed (never registered, never matched). Counted
    /// for [`TierKind::Host`], [`TierKind::Disk`] and [`TierKind::Remote`]; the device is not a
    /// store destination.
    pub fn record_store_error(&self, dst: TierKind, blocks: u64) {
        match dst {
            TierKind::Host => add(&self.host_store_error_blocks, blocks),
            TierKind::Disk => add(&self.disk_store_error_blocks, blocks),
            TierKind::Remote => add(&self.remote_store_error_blocks, blocks),
            TierKind::Device => {}
        }
    }

    /// One lookup in the remote store answered (found or not).
    pub fn record_remote_lookup(&self) {
        add(&self.remote_lookups, 1);
    }

    /// One lookup in the remote store missed its deadline (counted as a miss).
    pub fn record_remote_lookup_timeout(&self) {
        add(&self.remote_lookup_timeouts, 1);
    }

    /// One lookup in the remote store failed (store down or erring; counted as a miss).
    pub fn record_remote_lookup_error(&self) {
        add(&self.remote_lookup_errors, 1);
    }

    /// One lookup not sent because the store failed or timed out moments ago (a miss).
    pub fn record_remote_lookup_skipped(&self) {
        add(&self.remote_lookup_skipped, 1);
    }

    /// Whether the remote store answers now.
    pub fn set_remote_available(&self, available: bool) {
        self.remote_available
            .store(u64::from(available), Ordering::Relaxed);
    }

    /// The remote store's verdict ([`StoreState`]).
    pub fn set_remote_state(&self, state: StoreState) {
        let v = match state {
            StoreState::Healthy => 1,
            StoreState::Slow => 2,
            StoreState::Unavailable => 3,
        };
        let old = self.remote_state.swap(v, Ordering::Relaxed);
        if old != 0 && old != v {
            add(&self.remote_state_changes, 1);
        }
    }

    /// One operation (load or store) was submitted.
    pub fn record_operation_submitted(&self) {
        add(&self.operations_submitted, 1);
    }

    /// One operation finished: successfully (`ok`, counted as completed) or with an error
    /// (counted as failed, not completed).
    pub fn record_operation_completed(&self, ok: bool) {
        if ok {
            add(&self.operations_completed, 1);
        } else {
            add(&self.operations_failed, 1);
        }
    }

    /// The remote stores' counters (the leader's and every rank's, added): failed calls, calls
    /// past their deadline, reconnections, values that failed verification (withdrawn).
    pub fn set_remote_store_stats(&self, st: &crate::connector::remote::RemoteStoreStats) {
        self.remote_call_errors.store(st.errors, Ordering::Relaxed);
        self.remote_call_timeouts
            .store(st.timeouts, Ordering::Relaxed);
        self.remote_reconnects
            .store(st.reconnects, Ordering::Relaxed);
        self.remote_invalid_values
            .store(st.invalid, Ordering::Relaxed);
    }

    /// A finished request's device blocks were kept for `held` (from `request_finished`
    /// answering true until its last operation ended): the engine could not reuse them then.
    pub fn record_finish_hold(&self, held: std::time::Duration) {
        add(&self.finish_holds, 1);
        add(
            &self.finish_hold_us,
            u64::try_from(held.as_micros()).unwrap_or(u64::MAX),
        );
    }

    /// The current values (read counter by counter; see the module docs).
    pub fn snapshot(&self) -> MetricsSnapshot {
        let mut transfers = Vec::new();
        for src in TIERS {
            for dst in TIERS {
                let pair = &self.transfers[index(src)][index(dst)];
                let (blocks, bytes) = (get(&pair.blocks), get(&pair.bytes));
                if blocks != 0 || bytes != 0 {
                    transfers.push(TransferCounters {
                        src,
                        dst,
                        blocks,
                        bytes,
                    });
                }
            }
        }
        MetricsSnapshot {
            lookup_tokens: get(&self.lookup_tokens),
            matched_tokens: get(&self.matched_tokens),
            host_hit_tokens: get(&self.host_hit_tokens),
            disk_hit_tokens: get(&self.disk_hit_tokens),
            remote_hit_tokens: get(&self.remote_hit_tokens),
            load_error_blocks: get(&self.load_error_blocks),
            offload_dropped_blocks: get(&self.offload_dropped_blocks),
            window_skipped_blocks: get(&self.window_skipped_blocks),
            host_store_error_blocks: get(&self.host_store_error_blocks),
            disk_store_error_blocks: get(&self.disk_store_error_blocks),
            remote_store_error_blocks: get(&self.remote_store_error_blocks),
            remote_lookups: get(&self.remote_lookups),
            remote_lookup_timeouts: get(&self.remote_lookup_timeouts),
            remote_lookup_errors: get(&self.remote_lookup_errors),
            remote_lookup_skipped: get(&self.remote_lookup_skipped),
            remote_available: get(&self.remote_available) != 0,
            remote_state_changes: get(&self.remote_state_changes),
            remote_call_errors: get(&self.remote_call_errors),
            remote_call_timeouts: get(&self.remote_call_timeouts),
            remote_reconnects: get(&self.remote_reconnects),
            remote_invalid_values: get(&self.remote_invalid_values),
            remote_state: match get(&self.remote_state) {
                1 => Some(StoreState::Healthy),
                2 => Some(StoreState::Slow),
                3 => Some(StoreState::Unavailable),
                _ => None,
            },
            operations_submitted: get(&self.operations_submitted),
            operations_completed: get(&self.operations_completed),
            operations_failed: get(&self.operations_failed),
            finish_holds: get(&self.finish_holds),
            finish_hold_us: get(&self.finish_hold_us),
            transfers,
        }
    }

    /// The counters in Prometheus text exposition format (version 0.0.4).
    ///
    /// Counters (`kvbm_` prefix, `_total` suffix): `kvbm_lookup_tokens_total`,
    /// `kvbm_matched_tokens_total`, `kvbm_hit_tokens_total{tier="host"|"disk"|"remote"}`,
    /// `kvbm_load_error_blocks_total`, `kvbm_offload_dropped_blocks_total`,
    /// `kvbm_store_error_blocks_total{tier="host"|"disk"}`,
    /// `kvbm_operations_submitted_total`,
    /// `kvbm_operations_completed_total`, `kvbm_operations_failed_total`,
    /// `kvbm_transfer_blocks_total{src="device",dst="host"}` and `kvbm_transfer_bytes_total{...}`
    /// (the four offload/onboard paths always, other pairs once non-zero). Gauges:
    /// `kvbm_host_hit_rate` and `kvbm_disk_hit_rate` (hit tokens / lookup tokens, 0 without
    /// lookups). Every metric has its `# HELP` and `# TYPE` lines; the output ends with a newline.
    pub fn render_prometheus(&self) -> String {
        self.snapshot().render_prometheus()
    }
}

/// The counters of a [`Metrics`] at one moment.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct MetricsSnapshot {
    /// Prompt tokens looked up.
    pub lookup_tokens: u64,
    /// Tokens matched beyond the device (promised to the engine, not yet loaded).
    pub matched_tokens: u64,
    /// Tokens loaded successfully from host memory.
    pub host_hit_tokens: u64,
    /// Tokens loaded successfully from disk.
    pub disk_hit_tokens: u64,
    /// Tokens loaded successfully from remote storage.
    pub remote_hit_tokens: u64,
    /// Device blocks whose load failed (recomputed instead).
    pub load_error_blocks: u64,
    /// Full blocks not offloaded because neither tier had a free block for them.
    pub offload_dropped_blocks: u64,
    /// Full blocks of sliding-window groups not offloaded: no later hit reads them.
    pub window_skipped_blocks: u64,
    /// Blocks whose store into the host tier failed (never matched).
    pub host_store_error_blocks: u64,
    /// Blocks whose store into the disk tier failed (never matched).
    pub disk_store_error_blocks: u64,
    /// Blocks whose write to the remote store failed.
    pub remote_store_error_blocks: u64,
    /// Lookups the remote store answered.
    pub remote_lookups: u64,
    /// Remote lookups past their deadline (misses).
    pub remote_lookup_timeouts: u64,
    /// Remote lookups that failed (misses).
    pub remote_lookup_errors: u64,
    /// Remote lookups not sent while the store was failing (misses).
    pub remote_lookup_skipped: u64,
    /// Whether the remote store answered its last call (false without a remote tier).
    pub remote_available: bool,
    /// The remote store's verdict from its recent calls (`None` without a remote tier).
    pub remote_state: Option<StoreState>,
    /// How many times that verdict changed.
    pub remote_state_changes: u64,
    /// Calls to the remote store that failed, the leader's and every rank's.
    pub remote_call_errors: u64,
    /// Calls to the remote store past their deadline, the leader's and every rank's.
    pub remote_call_timeouts: u64,
    /// Reconnections to the remote store, the leader's and every rank's.
    pub remote_reconnects: u64,
    /// Values read from the remote store that failed verification (each withdrawn), the
    /// leader's and every rank's.
    pub remote_invalid_values: u64,
    /// Operations submitted.
    pub operations_submitted: u64,
    /// Operations finished successfully.
    pub operations_completed: u64,
    /// Operations finished with an error.
    pub operations_failed: u64,
    /// Finished requests whose device blocks the engine kept for the connector's operations
    /// (`request_finished` answered true).
    pub finish_holds: u64,
    /// Microseconds those requests' blocks were kept, summed: from the finish until the leader
    /// saw their last operation end. Divided by `finish_holds`, the mean hold.
    pub finish_hold_us: u64,
    /// Blocks and bytes per (source, destination) pair: only non-zero pairs, ordered by
    /// (`src`, `dst`).
    pub transfers: Vec<TransferCounters>,
}

/// Blocks and bytes moved from one tier to another.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TransferCounters {
    /// Where the blocks were read.
    pub src: TierKind,
    /// Where the blocks were written.
    pub dst: TierKind,
    /// Blocks moved.
    pub blocks: u64,
    /// Bytes moved.
    pub bytes: u64,
}

impl MetricsSnapshot {
    /// Host hit tokens / lookup tokens; 0 without lookups.
    pub fn host_hit_rate(&self) -> f64 {
        ratio(self.host_hit_tokens, self.lookup_tokens)
    }

    /// Disk hit tokens / lookup tokens; 0 without lookups.
    pub fn disk_hit_rate(&self) -> f64 {
        ratio(self.disk_hit_tokens, self.lookup_tokens)
    }

    /// (Host + disk + remote hit tokens) / lookup tokens; 0 without lookups.
    pub fn hit_rate(&self) -> f64 {
        let hits = self
            .host_hit_tokens
            .saturating_add(self.disk_hit_tokens)
            .saturating_add(self.remote_hit_tokens);
        ratio(hits, self.lookup_tokens)
    }

    /// Blocks whose store failed, host, disk and remote together.
    pub fn store_error_blocks(&self) -> u64 {
        self.host_store_error_blocks
            .saturating_add(self.disk_store_error_blocks)
            .saturating_add(self.remote_store_error_blocks)
    }

    /// Operations submitted but not yet finished (0 if the counters were read mid-update).
    pub fn operations_in_flight(&self) -> u64 {
        self.operations_submitted
            .saturating_sub(self.operations_completed)
            .saturating_sub(self.operations_failed)
    }

    /// The counters of one (source, destination) pair, if anything moved along it.
    pub fn transfer(&self, src: TierKind, dst: TierKind) -> Option<&TransferCounters> {
        self.transfers.iter().find(|t| t.src == src && t.dst == dst)
    }

    /// This snapshot in Prometheus text format (see [`Metrics::render_prometheus`]).
    pub fn render_prometheus(&self) -> String {
        let mut out = String::with_capacity(2048);
        for (name, help, value) in [
            (
                "kvbm_lookup_tokens_total",
                "Prompt tokens looked up in the offload tiers.",
                self.lookup_tokens,
            ),
            (
                "kvbm_matched_tokens_total",
                "Tokens matched beyond the device (promised to the engine, not yet loaded).",
                self.matched_tokens,
            ),
            (
                "kvbm_load_error_blocks_total",
                "Device blocks whose load failed and are recomputed.",
                self.load_error_blocks,
            ),
            (
                "kvbm_offload_dropped_blocks_total",
                "Full blocks not offloaded because neither the host nor the disk tier had a free block.",
                self.offload_dropped_blocks,
            ),
            (
                "kvbm_window_skipped_blocks_total",
                "Full blocks of sliding-window KV-cache groups not offloaded: before every window a later hit needs.",
                self.window_skipped_blocks,
            ),
            (
                "kvbm_operations_submitted_total",
                "Load and store operations submitted.",
                self.operations_submitted,
            ),
            (
                "kvbm_operations_completed_total",
                "Load and store operations finished successfully.",
                self.operations_completed,
            ),
            (
                "kvbm_operations_failed_total",
                "Load and store operations finished with an error.",
                self.operations_failed,
            ),
            (
                "kvbm_finish_holds_total",
                "Finished requests whose device blocks the engine kept for the connector's operations.",
                self.finish_holds,
            ),
        ] {
            counter_line(&mut out, name, help, value);
        }
        labelled(
            &mut out,
            "kvbm_hit_tokens_total",
            "Tokens loaded successfully from an offload tier, by tier.",
            "counter",
            "tier",
            &[
                (TierKind::Host, self.host_hit_tokens),
                (TierKind::Disk, self.disk_hit_tokens),
                (TierKind::Remote, self.remote_hit_tokens),
            ],
        );
        labelled(
            &mut out,
            "kvbm_store_error_blocks_total",
            "Blocks whose store into an offload tier failed (never matched), by tier.",
            "counter",
            "tier",
            &[
                (TierKind::Host, self.host_store_error_blocks),
                (TierKind::Disk, self.disk_store_error_blocks),
                (TierKind::Remote, self.remote_store_error_blocks),
            ],
        );
        labelled(
            &mut out,
            "kvbm_remote_lookups_total",
            "Lookups in the remote store, by outcome (answered, timeout and error count as misses; skipped: not sent while the store was failing).",
            "counter",
            "outcome",
            &[
                ("answered", self.remote_lookups),
                ("timeout", self.remote_lookup_timeouts),
                ("error", self.remote_lookup_errors),
                ("skipped", self.remote_lookup_skipped),
            ],
        );
        labelled(
            &mut out,
            "kvbm_remote_calls_failed_total",
            "Calls to the remote store that did not succeed, by reason (error, timeout), the leader's and every worker's.",
            "counter",
            "reason",
            &[
                ("error", self.remote_call_errors),
                ("timeout", self.remote_call_timeouts),
            ],
        );
        counter_line(
            &mut out,
            "kvbm_remote_reconnects_total",
            "Reconnections to the remote store, the leader's and every worker's.",
            self.remote_reconnects,
        );
        counter_line(
            &mut out,
            "kvbm_remote_invalid_values_total",
            "Values read from the remote store that failed verification (each withdrawn), the leader's and every worker's.",
            self.remote_invalid_values,
        );

        let pairs = self.rendered_pairs();
        for (name, help, bytes) in [
            (
                "kvbm_transfer_blocks_total",
                "Blocks moved between tiers by completed operations.",
                false,
            ),
            (
                "kvbm_transfer_bytes_total",
                "Bytes moved between tiers by completed operations.",
                true,
            ),
        ] {
            header(&mut out, name, help, "counter");
            for t in &pairs {
                let labels = format!("src=\"{}\",dst=\"{}\"", t.src, t.dst);
                line(
                    &mut out,
                    name,
                    &labels,
                    if bytes { t.bytes } else { t.blocks },
                );
            }
        }

        header(
            &mut out,
            "kvbm_finish_hold_seconds_total",
            "Seconds finished requests' device blocks were kept for the connector's operations, summed.",
            "counter",
        );
        let _ = writeln!(
            out,
            "kvbm_finish_hold_seconds_total {}",
            self.finish_hold_us as f64 / 1e6
        );

        let mut gauge = |name: &str, help: &str, value: f64| {
            header(&mut out, name, help, "gauge");
            let _ = writeln!(out, "{name} {value}");
        };
        gauge(
            "kvbm_host_hit_rate",
            "Host hit tokens divided by lookup tokens (0 without lookups).",
            self.host_hit_rate(),
        );
        gauge(
            "kvbm_disk_hit_rate",
            "Disk hit tokens divided by lookup tokens (0 without lookups).",
            self.disk_hit_rate(),
        );
        gauge(
            "kvbm_remote_available",
            "1 while the remote store answers, 0 while it fails or without a remote tier.",
            if self.remote_available { 1.0 } else { 0.0 },
        );
        if let Some(state) = self.remote_state {
            labelled(
                &mut out,
                "kvbm_remote_state",
                "The remote store's verdict from a window of its recent calls: 1 for the current state (healthy; slow: median latency above remote.slow_ms; unavailable: half of its calls failed), 0 for the others.",
                "gauge",
                "state",
                &[StoreState::Healthy, StoreState::Slow, StoreState::Unavailable]
                    .map(|s| (s, u64::from(s == state))),
            );
        }
        out
    }

    /// The pairs to render: the standard offload/onboard paths (zero if unused) and every other
    /// non-zero pair, ordered by (`src`, `dst`).
    fn rendered_pairs(&self) -> Vec<TransferCounters> {
        let mut pairs = self.transfers.clone();
        for (src, dst) in STANDARD_PATHS {
            if self.transfer(src, dst).is_none() {
                pairs.push(TransferCounters {
                    src,
                    dst,
                    blocks: 0,
                    bytes: 0,
                });
            }
        }
        pairs.sort_by_key(|t| (t.src, t.dst));
        pairs
    }
}

/// Rate-limits a warning: the first event warns at once, later ones at most once per `interval`,
/// each warning carrying how many events happened since the previous one (none is lost, none
/// floods the log: a full disk fails thousands of blocks a second).
#[derive(Debug)]
pub(crate) struct WarnLimiter {
    interval: std::time::Duration,
    last: Option<std::time::Instant>,
    pending: u64,
}

impl WarnLimiter {
    /// How often a rate-limited warning repeats at most.
    pub(crate) const INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);

    pub(crate) const fn new(interval: std::time::Duration) -> Self {
        Self {
            interval,
            last: None,
            pending: 0,
        }
    }

    /// Counts `n` events; answers the count to warn about now, if it is time to warn.
    pub(crate) fn event(&mut self, n: u64) -> Option<u64> {
        self.pending = self.pending.saturating_add(n);
        let now = std::time::Instant::now();
        if self
            .last
            .is_some_and(|l| now.duration_since(l) < self.interval)
        {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.pending))
    }
}

/// Appends the `# HELP` and `# TYPE` lines of one metric.
fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Appends a counter without labels: its header and its one sample.
fn counter_line(out: &mut String, name: &str, help: &str, value: u64) {
    header(out, name, help, "counter");
    line(out, name, "", value);
}

/// Appends a metric of `kind` with one label: its header and one sample per (label value, value).
fn labelled<V: std::fmt::Display>(
    out: &mut String,
    name: &str,
    help: &str,
    kind: &str,
    label: &str,
    samples: &[(V, u64)],
) {
    header(out, name, help, kind);
    for (v, value) in samples {
        line(out, name, &format!("{label}=\"{v}\""), *value);
    }
}

/// Appends one integer sample, with `labels` (already formatted, without braces) if non-empty.
fn line(out: &mut String, name: &str, labels: &str, value: u64) {
    if labels.is_empty() {
        let _ = writeln!(out, "{name} {value}");
    } else {
        let _ = writeln!(out, "{name}{{{labels}}} {value}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::Arc;

    #[test]
    fn counters_add_up() {
        let m = Metrics::new();
        m.record_lookup(100, 64);
        m.record_lookup(50, 16);
        m.record_hit(TierKind::Host, 48);
        m.record_hit(TierKind::Disk, 16);
        m.record_hit(TierKind::Remote, 8);
        m.record_hit(TierKind::Device, 1000); // ignored
        m.record_load_error(2);
        m.record_load_error(1);
        m.record_store_error(TierKind::Host, 3);
        m.record_store_error(TierKind::Disk, 5);
        m.record_store_error(TierKind::Disk, 1);
        m.record_store_error(TierKind::Device, 100); // ignored
        m.record_operation_submitted();
        m.record_operation_submitted();
        m.record_operation_submitted();
        m.record_operation_completed(true);
        m.record_operation_completed(false);
        m.record_transfer(TierKind::Device, TierKind::Host, 2, 2048);
        m.record_transfer(TierKind::Device, TierKind::Host, 1, 1024);
        m.record_transfer(TierKind::Disk, TierKind::Device, 4, 4096);
        m.record_transfer(TierKind::Host, TierKind::Disk, 0, 0); // stays absent

        let s = m.snapshot();
        assert_eq!(s.lookup_tokens, 150);
        assert_eq!(s.matched_tokens, 80);
        assert_eq!(s.host_hit_tokens, 48);
        assert_eq!(s.disk_hit_tokens, 16);
        assert_eq!(s.remote_hit_tokens, 8);
        assert_eq!(s.load_error_blocks, 3);
        assert_eq!(s.host_store_error_blocks, 3);
        assert_eq!(s.disk_store_error_blocks, 6);
        assert_eq!(s.store_error_blocks(), 9);
        assert_eq!(s.operations_submitted, 3);
        assert_eq!(s.operations_completed, 1);
        assert_eq!(s.operations_failed, 1);
        assert_eq!(s.operations_in_flight(), 1);
        assert_eq!(
            s.transfers,
            vec![
                TransferCounters {
                    src: TierKind::Device,
                    dst: TierKind::Host,
                    blocks: 3,
                    bytes: 3072
                },
                TransferCounters {
                    src: TierKind::Disk,
                    dst: TierKind::Device,
                    blocks: 4,
                    bytes: 4096
                },
            ]
        );
        assert_eq!(
            s.transfer(TierKind::Device, TierKind::Host)
                .map(|t| t.blocks),
            Some(3)
        );
        assert!(s.transfer(TierKind::Host, TierKind::Disk).is_none());
    }

    #[test]
    fn transfers_are_ordered_by_src_then_dst() {
        let m = Metrics::new();
        for src in TIERS.iter().rev() {
            for dst in TIERS.iter().rev() {
                m.record_transfer(*src, *dst, 1, 1);
            }
        }
        let s = m.snapshot();
        assert_eq!(s.transfers.len(), 16);
        let keys: Vec<_> = s.transfers.iter().map(|t| (t.src, t.dst)).collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted);
    }

    #[test]
    fn rates() {
        let zero = MetricsSnapshot::default();
        assert_eq!(zero.host_hit_rate(), 0.0);
        assert_eq!(zero.disk_hit_rate(), 0.0);
        assert_eq!(zero.hit_rate(), 0.0);

        let m = Metrics::new();
        m.record_lookup(200, 150);
        m.record_hit(TierKind::Host, 100);
        m.record_hit(TierKind::Disk, 50);
        m.record_hit(TierKind::Remote, 10);
        let s = m.snapshot();
        assert_eq!(s.host_hit_rate(), 0.5);
        assert_eq!(s.disk_hit_rate(), 0.25);
        assert_eq!(s.hit_rate(), 0.8);
    }

    #[test]
    fn render_contains_expected_lines() {
        let m = Metrics::new();
        m.record_lookup(200, 150);
        m.record_hit(TierKind::Host, 100);
        m.record_hit(TierKind::Disk, 50);
        m.record_transfer(TierKind::Device, TierKind::Host, 3, 3 * 4096);
        m.record_transfer(TierKind::Remote, TierKind::Host, 1, 7);
        m.record_operation_submitted();
        m.record_operation_completed(true);
        m.record_store_error(TierKind::Disk, 4);
        let text = m.render_prometheus();
        let lines: Vec<&str> = text.lines().collect();
        for want in [
            "# HELP kvbm_transfer_blocks_total Blocks moved between tiers by completed operations.",
            "# TYPE kvbm_transfer_blocks_total counter",
            "kvbm_transfer_blocks_total{src=\"device\",dst=\"host\"} 3",
            "kvbm_transfer_bytes_total{src=\"device\",dst=\"host\"} 12288",
            "kvbm_transfer_blocks_total{src=\"remote\",dst=\"host\"} 1",
            "kvbm_transfer_blocks_total{src=\"host\",dst=\"disk\"} 0",
            "kvbm_transfer_blocks_total{src=\"disk\",dst=\"device\"} 0",
            "kvbm_lookup_tokens_total 200",
            "kvbm_matched_tokens_total 150",
            "kvbm_hit_tokens_total{tier=\"host\"} 100",
            "kvbm_hit_tokens_total{tier=\"disk\"} 50",
            "kvbm_hit_tokens_total{tier=\"remote\"} 0",
            "kvbm_operations_submitted_total 1",
            "kvbm_operations_completed_total 1",
            "kvbm_operations_failed_total 0",
            "kvbm_load_error_blocks_total 0",
            "# TYPE kvbm_store_error_blocks_total counter",
            "kvbm_store_error_blocks_total{tier=\"host\"} 0",
            "kvbm_store_error_blocks_total{tier=\"disk\"} 4",
            "# TYPE kvbm_host_hit_rate gauge",
            "kvbm_host_hit_rate 0.5",
            "kvbm_disk_hit_rate 0.25",
        ] {
            assert!(lines.contains(&want), "missing {want:?} in\n{text}");
        }
        // Unused non-standard pairs are left out.
        assert!(!text.contains("src=\"device\",dst=\"disk\""), "{text}");
        // Transfer samples are ordered by (src, dst).
        let order: Vec<&str> = lines
            .iter()
            .filter(|l| l.starts_with("kvbm_transfer_blocks_total{"))
            .copied()
            .collect();
        assert_eq!(
            order,
            [
                "kvbm_transfer_blocks_total{src=\"device\",dst=\"host\"} 3",
                "kvbm_transfer_blocks_total{src=\"host\",dst=\"device\"} 0",
                "kvbm_transfer_blocks_total{src=\"host\",dst=\"disk\"} 0",
                "kvbm_transfer_blocks_total{src=\"disk\",dst=\"device\"} 0",
                "kvbm_transfer_blocks_total{src=\"remote\",dst=\"host\"} 1",
            ]
        );
    }

    /// Checks the exposition format: every sample belongs to a metric declared by exactly one
    /// HELP and one TYPE line (in that order, before its samples, samples contiguous), names
    /// carry the prefix, counters the suffix, and every value parses as a finite number.
    fn check_exposition(text: &str) -> BTreeMap<String, String> {
        assert!(text.ends_with('\n'));
        let mut types: BTreeMap<String, String> = BTreeMap::new();
        let mut helps: BTreeMap<String, usize> = BTreeMap::new();
        let mut current: Option<String> = None;
        let mut finished: Vec<String> = Vec::new();
        for l in text.lines() {
            if let Some(rest) = l.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap_or_default().to_string();
                assert!(!helps.contains_key(&name), "two HELP lines for {name}");
                helps.insert(name.clone(), 1);
                if let Some(prev) = current.replace(name) {
                    finished.push(prev);
                }
            } else if let Some(rest) = l.strip_prefix("# TYPE ") {
                let mut parts = rest.split(' ');
                let name = parts.next().unwrap_or_default().to_string();
                let kind = parts.next().unwrap_or_default().to_string();
                assert_eq!(current.as_deref(), Some(name.as_str()), "TYPE before HELP");
                assert!(kind == "counter" || kind == "gauge", "{l}");
                assert!(types.insert(name, kind).is_none(), "two TYPE lines: {l}");
            } else {
                let (series, value) = l.rsplit_once(' ').unwrap_or_default();
                let name = series.split('{').next().unwrap_or_default();
                assert_eq!(
                    current.as_deref(),
                    Some(name),
                    "sample outside its block: {l}"
                );
                assert!(types.contains_key(name), "sample before TYPE: {l}");
                assert!(!finished.iter().any(|f| f == name), "{l}");
                let v: f64 = value.parse().unwrap_or(f64::NAN);
                assert!(v.is_finite(), "bad value in {l}");
            }
        }
        for (name, kind) in &types {
            assert!(name.starts_with("kvbm_"), "{name}");
            assert_eq!(kind == "counter", name.ends_with("_total"), "{name}");
            assert!(helps.contains_key(name), "{name} has no HELP");
        }
        assert_eq!(helps.len(), types.len());
        types
    }

    #[test]
    fn every_metric_has_help_and_type() {
        let m = Metrics::new();
        m.record_lookup(10, 5);
        m.record_transfer(TierKind::Host, TierKind::Remote, 1, 1);
        let types = check_exposition(&m.render_prometheus());
        for name in [
            "kvbm_lookup_tokens_total",
            "kvbm_matched_tokens_total",
            "kvbm_hit_tokens_total",
            "kvbm_load_error_blocks_total",
            "kvbm_store_error_blocks_total",
            "kvbm_operations_submitted_total",
            "kvbm_operations_completed_total",
            "kvbm_operations_failed_total",
            "kvbm_transfer_blocks_total",
            "kvbm_transfer_bytes_total",
        ] {
            assert_eq!(
                types.get(name).map(String::as_str),
                Some("counter"),
                "{name}"
            );
        }
        assert_eq!(
            types.get("kvbm_host_hit_rate").map(String::as_str),
            Some("gauge")
        );
        assert_eq!(
            types.get("kvbm_disk_hit_rate").map(String::as_str),
            Some("gauge")
        );
    }

    #[test]
    fn zero_metrics_render_valid_output() {
        let text = Metrics::default().render_prometheus();
        check_exposition(&text);
        assert!(!text.contains("NaN") && !text.contains("inf"), "{text}");
        assert!(text.lines().any(|l| l == "kvbm_host_hit_rate 0"));
        assert!(text.lines().any(|l| l == "kvbm_disk_hit_rate 0"));
        assert!(text
            .lines()
            .any(|l| l == "kvbm_transfer_bytes_total{src=\"device\",dst=\"host\"} 0"));
    }

    #[test]
    fn snapshot_serialises() {
        // No JSON crate in the dev-dependencies; TOML exercises the same Serialize impls.
        let m = Metrics::new();
        m.record_transfer(TierKind::Device, TierKind::Host, 1, 2);
        let text = toml::to_string(&m.snapshot()).unwrap_or_default();
        assert!(text.contains("src = \"device\""), "{text}");
        assert!(text.contains("lookup_tokens = 0"), "{text}");
    }

    #[test]
    fn concurrent_increments_are_not_lost() {
        const THREADS: u64 = 4;
        const N: u64 = 10_000;
        let m = Arc::new(Metrics::new());
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let m = Arc::clone(&m);
                s.spawn(move || {
                    for i in 0..N {
                        m.record_lookup(2, 1);
                        m.record_hit(TierKind::Host, 1);
                        m.record_transfer(TierKind::Device, TierKind::Host, 1, 4096);
                        m.record_operation_submitted();
                        m.record_operation_completed((i + t) % 2 == 0);
                    }
                });
            }
        });
        let s = m.snapshot();
        assert_eq!(s.lookup_tokens, 2 * THREADS * N);
        assert_eq!(s.matched_tokens, THREADS * N);
        assert_eq!(s.host_hit_tokens, THREADS * N);
        assert_eq!(s.operations_submitted, THREADS * N);
        assert_eq!(s.operations_completed + s.operations_failed, THREADS * N);
        assert_eq!(s.operations_in_flight(), 0);
        let pair = s.transfer(TierKind::Device, TierKind::Host);
        assert_eq!(
            pair.map(|p| (p.blocks, p.bytes)),
            Some((THREADS * N, THREADS * N * 4096))
        );
    }

    #[test]
    fn warnings_are_rate_limited_and_counted() {
        let mut w = WarnLimiter::new(std::time::Duration::from_secs(3600));
        assert_eq!(w.event(5), Some(5));
        assert_eq!(w.event(3), None);
        assert_eq!(w.event(2), None);
        let mut w = WarnLimiter::new(std::time::Duration::ZERO);
        assert_eq!(w.event(1), Some(1));
        assert_eq!(w.event(4), Some(4));
    }

    #[test]
    fn metrics_is_send_sync() {
        fn check<T: Send + Sync + Default + std::fmt::Debug>() {}
        check::<Metrics>();
    }
}
