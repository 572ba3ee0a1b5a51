//! What a replay reports: per-request and whole-run figures (the JSON of `--report`), the
//! connector-call timings they are built from, and the short table `kvbm replay` prints.
//!
//! The JSON field names are a format: tests/cli.rs snapshots them.

use std::collections::HashMap;
use std::time::Instant;

use super::framework::Framework;

/// Per-request outcome.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RequestReport {
    /// Request id.
    pub id: String,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens the connector matched (summed over admissions, if preempted).
    pub matched_tokens: usize,
    /// Matched tokens by tier.
    pub matched_from: MatchedFrom,
    /// Tokens the engine's own device cache provided.
    pub device_hit_tokens: usize,
    /// Tokens the model computed for this request (recomputation included).
    pub computed_tokens: usize,
    /// Tokens generated.
    pub output_tokens: usize,
    /// Simulated time to first token, in milliseconds.
    pub ttft_ms: f64,
    /// Times the request was preempted.
    pub preemptions: usize,
    /// Device blocks whose load failed and were recomputed.
    pub load_errors: usize,
}

/// Matched tokens by tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MatchedFrom {
    /// From the host tier.
    pub host: usize,
    /// From the disk tier.
    pub disk: usize,
    /// From the remote (G4) store.
    pub remote: usize,
}

/// Latency of one connector method, in microseconds.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Latency {
    /// Method name (the framework's).
    pub method: String,
    /// Calls.
    pub calls: usize,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
}

/// Bytes moved on one tier pair.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PathReport {
    /// `src->dst`.
    pub path: String,
    /// Blocks moved.
    pub blocks: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Achieved bandwidth over the transfers' busy time, GB/s.
    pub gb_per_s: f64,
}

/// Whole-run figures.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Summary {
    /// Engine imitated.
    pub framework: Framework,
    /// Requests completed.
    pub requests: usize,
    /// Prompt tokens over all requests.
    pub prompt_tokens: usize,
    /// Tokens matched by the connector.
    pub matched_tokens: usize,
    /// `matched_tokens / prompt_tokens`.
    pub hit_rate: f64,
    /// Matched tokens by tier.
    pub matched_from: MatchedFrom,
    /// Tokens the engine's own device cache provided.
    pub device_hit_tokens: usize,
    /// Tokens the model computed.
    pub computed_tokens: usize,
    /// Bytes offloaded per tier pair (device→host, host→disk, ...).
    pub offloaded: Vec<PathReport>,
    /// Bytes onboarded per tier pair (host→device, disk→device).
    pub onboarded: Vec<PathReport>,
    /// Connector call latency per method.
    pub leader_latency: Vec<Latency>,
    /// Onboarded blocks whose bytes differed from what the model computes (must be 0).
    pub integrity_errors: usize,
    /// Onboarded blocks checked.
    pub blocks_verified: usize,
    /// Device blocks whose load failed (recomputed, never used).
    pub load_errors: usize,
    /// Blocks whose store into the host or disk tier failed (not cached, never matched).
    pub store_errors: u64,
    /// Preemptions.
    pub preemptions: usize,
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Ranks lost during the run (their loads were recomputed).
    pub rank_failures: usize,
    /// Engine steps.
    pub steps: u64,
    /// Simulated engine time, ms.
    pub simulated_ms: f64,
    /// Most tokens the requests waiting for admission held at once (a preempted one counts its
    /// output so far too): at most `--max-waiting-tokens`, or one request's when a single one
    /// is larger.
    pub peak_waiting_tokens: usize,
    /// Mean simulated time to first token, ms.
    pub mean_ttft_ms: f64,
    /// Wall time of the replay, seconds (draining background stores at the end included).
    pub wall_s: f64,
    /// Wall time until the last request finished, seconds: `wall_s` less the drain of
    /// background stores (host → disk, host → remote) that no request waits for.
    pub serve_s: f64,
    /// The remote (G4) store, when the remote tier is on (`null` otherwise).
    pub remote: Option<RemoteReport>,
}

/// The remote store's side of a replay: what the leader counted and the store's own counters.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RemoteReport {
    /// The store (no password).
    pub store: String,
    /// Whether it answered its last call.
    pub available: bool,
    /// Its verdict from a window of its recent calls: healthy, slow or unavailable
    /// (`remote.slow_ms`), and how many times that changed during the replay.
    pub state: String,
    /// Changes of `state` during the replay.
    pub state_changes: u64,
    /// Lookups it answered.
    pub lookups: u64,
    /// Lookups past their deadline (misses).
    pub lookup_timeouts: u64,
    /// Lookups that failed (misses).
    pub lookup_errors: u64,
    /// Lookups not sent while it was failing (misses).
    pub lookup_skipped: u64,
    /// Blocks sent to it (a block it already held is not rewritten).
    pub sent_blocks: u64,
    /// Blocks whose write failed.
    pub write_errors: u64,
    /// Tokens loaded from it.
    pub hit_tokens: u64,
    /// Failed calls to the store, the leader's and every rank's.
    pub store_errors: u64,
    /// Calls to the store past their deadline, the leader's and every rank's.
    pub store_timeouts: u64,
    /// Reconnections to the store, the leader's and every rank's.
    pub reconnects: u64,
    /// Values read from the store that failed verification (each withdrawn), the leader's and
    /// every rank's.
    pub invalid_values: u64,
}

/// A replay's report.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Report {
    /// Whole-run figures.
    pub summary: Summary,
    /// Per-request figures, in workload order.
    pub requests: Vec<RequestReport>,
}

/// Wall-clock durations of the connector calls, per method.
#[derive(Default)]
pub struct Timings(HashMap<&'static str, Vec<u64>>);

impl Timings {
    /// Runs `f`, recording its wall time under `method`.
    pub fn time<T>(&mut self, method: &'static str, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        self.0
            .entry(method)
            .or_default()
            .push(t.elapsed().as_nanos() as u64);
        out
    }

    /// Median and 99th percentile per method, by method name.
    pub fn report(&self) -> Vec<Latency> {
        let mut out: Vec<Latency> = self
            .0
            .iter()
            .map(|(m, v)| {
                let mut v = v.clone();
                v.sort_unstable();
                let pick = |q: f64| -> f64 {
                    if v.is_empty() {
                        return 0.0;
                    }
                    let i = ((v.len() - 1) as f64 * q).round() as usize;
                    v[i.min(v.len() - 1)] as f64 / 1000.0
                };
                Latency {
                    method: (*m).to_string(),
                    calls: v.len(),
                    p50_us: pick(0.5),
                    p99_us: pick(0.99),
                }
            })
            .collect();
        out.sort_by(|a, b| a.method.cmp(&b.method));
        out
    }
}

/// The short human table printed by `kvbm replay`.
pub fn render_table(r: &Report) -> String {
    use std::fmt::Write;
    let s = &r.summary;
    let mut out = String::new();
    let pct = |a: usize, b: usize| {
        if b == 0 {
            0.0
        } else {
            100.0 * a as f64 / b as f64
        }
    };
    let _ = writeln!(
        out,
        "kvbm replay — {} engine, {} requests, {} steps",
        s.framework, s.requests, s.steps
    );
    let _ = writeln!(out, "  prompt tokens        {:>10}", s.prompt_tokens);
    let _ = writeln!(
        out,
        "  matched by kvbm       {:>10}  ({:.1}% of prompt tokens)",
        s.matched_tokens,
        100.0 * s.hit_rate
    );
    let _ = writeln!(
        out,
        "    from host           {:>10}  ({:.1}%)",
        s.matched_from.host,
        pct(s.matched_from.host, s.prompt_tokens)
    );
    let _ = writeln!(
        out,
        "    from disk           {:>10}  ({:.1}%)",
        s.matched_from.disk,
        pct(s.matched_from.disk, s.prompt_tokens)
    );
    let _ = writeln!(
        out,
        "    from remote         {:>10}  ({:.1}%)",
        s.matched_from.remote,
        pct(s.matched_from.remote, s.prompt_tokens)
    );
    let _ = writeln!(out, "  device cache hits     {:>10}", s.device_hit_tokens);
    let _ = writeln!(out, "  tokens computed       {:>10}", s.computed_tokens);
    for p in s.offloaded.iter().chain(s.onboarded.iter()) {
        let _ = writeln!(
            out,
            "  {:<20} {:>10} blocks  {:>8.1} MB  {:>6.2} GB/s",
            p.path,
            p.blocks,
            p.bytes as f64 / 1e6,
            p.gb_per_s
        );
    }
    for l in &s.leader_latency {
        let _ = writeln!(
            out,
            "  {:<28} p50 {:>7.1} µs  p99 {:>7.1} µs  ({} calls)",
            l.method, l.p50_us, l.p99_us, l.calls
        );
    }
    let _ = writeln!(
        out,
        "  integrity errors      {:>10}  ({} onboarded blocks verified)",
        s.integrity_errors, s.blocks_verified
    );
    let _ = writeln!(out, "  load errors           {:>10}", s.load_errors);
    let _ = writeln!(out, "  store errors          {:>10}", s.store_errors);
    if let Some(r) = &s.remote {
        let _ = writeln!(
            out,
            "  remote {} ({}, {}, {} state changes): {} lookups, {} timeouts, {} errors, {} skipped; {} blocks sent, {} write errors",
            r.store,
            if r.available { "available" } else { "unavailable" },
            r.state,
            r.state_changes,
            r.lookups,
            r.lookup_timeouts,
            r.lookup_errors,
            r.lookup_skipped,
            r.sent_blocks,
            r.write_errors
        );
    }
    let _ = writeln!(out, "  preemptions           {:>10}", s.preemptions);
    let _ = writeln!(out, "  mean TTFT (simulated) {:>10.2} ms", s.mean_ttft_ms);
    let _ = writeln!(
        out,
        "  wall time             {:>10.2} s  (requests served in {:.2} s; then background stores drained)",
        s.wall_s, s.serve_s
    );
    out
}
