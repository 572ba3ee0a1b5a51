//! What a fleet sweep prints: the table, the JSON (`--json`) and the plot (`--plot`).

use std::fmt::Write as _;
use std::path::Path;

use kvbm_connector::error::{Error, Result};

use super::FleetRun;
use crate::sweep::{draw_lines, human, pct, Unlimited};

/// The fleet table: one line per run (fleet hit rate, split by tier, the shared tier's traffic
/// and size), each followed by its instances' hit rates; then the unlimited cache's line.
pub fn render_table(title: &str, runs: &[FleetRun], unl: &Unlimited, block_size: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "kvbm sweep (fleet) — {title}: {} requests, {} prompt tokens",
        unl.requests, unl.prompt
    );
    let _ = writeln!(
        out,
        "  {:>9} {:<11} {:<6} {:<7} {:>10} {:>9} {:>9} {:>9} {:>9} {:>12} {:>12} {:>12} {:>7}",
        "instances",
        "router",
        "shared",
        "policy",
        "host/inst",
        "fleet hit",
        "host",
        "disk",
        "shared",
        "shared read",
        "shared wrote",
        "shared held",
        "wall"
    );
    for r in runs {
        run_rows(&mut out, r);
    }
    let _ = writeln!(
        out,
        "  unlimited cache (one, never evicting): {:.2}% ({} distinct blocks, {} tokens)",
        pct(unl.matched, unl.prompt),
        unl.distinct_blocks,
        human(unl.distinct_blocks as f64 * block_size as f64)
    );
    let verified: usize = runs.iter().map(|r| r.total().blocks_verified).sum();
    let errors: usize = runs.iter().map(|r| r.total().integrity_errors).sum();
    let _ = writeln!(
        out,
        "  integrity errors {errors} ({verified} onboarded blocks verified); shared read/wrote/held in {block_size}-token blocks"
    );
    out
}

/// One run's rows: the fleet's line, its instances' hit rates, and what went wrong if anything
/// did (dropped offloads, shared-tier timeouts, skips and failed writes, load errors).
fn run_rows(out: &mut String, r: &FleetRun) {
    let t = r.total();
    let p = &r.plan;
    let (read, wrote) = match &r.traffic {
        Some(tr) => (
            format!("{} blk", tr.blocks_read),
            format!("{} blk", tr.blocks_written),
        ),
        None => ("-".into(), "-".into()),
    };
    let held = match (&r.size, &r.store) {
        (Some(s), _) => format!("{} blk", s.blocks),
        (None, Some(_)) => "(server)".into(),
        (None, None) => "-".into(),
    };
    let _ = writeln!(
        out,
        "  {:>9} {:<11} {:<6} {:<7} {:>10} {:>8.2}% {:>8.2}% {:>8.2}% {:>8.2}% {:>12} {:>12} {:>12} {:>6.1}s",
        p.instances,
        p.router.name(),
        if p.shared { "on" } else { "off" },
        p.policy.to_string(),
        human(p.host_tokens as f64),
        t.hit_pct(),
        pct(t.from_host, t.prompt_tokens),
        pct(t.from_disk, t.prompt_tokens),
        pct(t.from_shared, t.prompt_tokens),
        read,
        wrote,
        held,
        r.wall_s
    );
    let each: Vec<String> = r
        .per_instance
        .iter()
        .map(|i| format!("{:.2}% ({} req)", i.hit_pct(), i.requests))
        .collect();
    let _ = writeln!(out, "      per instance: {}", each.join(", "));
    if t.offload_dropped_blocks + t.shared_lookup_timeouts + t.shared_lookups_skipped > 0
        || t.shared_write_errors + t.load_errors as u64 > 0
    {
        let _ = writeln!(
            out,
            "      offloads dropped {} blocks; shared tier: {} lookups timed out, {} skipped, {} blocks not written; {} load errors",
            t.offload_dropped_blocks,
            t.shared_lookup_timeouts,
            t.shared_lookups_skipped,
            t.shared_write_errors,
            t.load_errors
        );
    }
}

/// One run as `--json` prints it.
#[derive(Debug, serde::Serialize)]
struct JsonRun {
    instances: usize,
    router: &'static str,
    shared_tier: bool,
    eviction: String,
    host_tokens: u64,
    host_blocks: usize,
    disk_blocks: usize,
    /// Capacity of the in-process shared tier, tokens (`null`: unlimited, or a server).
    shared_tokens: Option<u64>,
    /// `in-process`, the server's URL (password redacted), or `null`.
    shared_store: Option<String>,
    requests: usize,
    prompt_tokens: usize,
    matched_tokens: usize,
    /// Percent of the fleet's prompt tokens matched.
    fleet_hit_rate: f64,
    from_host: usize,
    from_disk: usize,
    from_shared: usize,
    /// Percent, per instance, in instance order.
    instance_hit_rates: Vec<f64>,
    per_instance: Vec<super::InstanceResult>,
    shared: Option<JsonShared>,
    integrity_errors: usize,
    blocks_verified: usize,
    load_errors: usize,
    offload_dropped_blocks: u64,
    shared_lookup_timeouts: u64,
    shared_lookups_skipped: u64,
    shared_write_errors: u64,
    wall_s: f64,
}

/// The shared tier's traffic and size.
#[derive(Debug, serde::Serialize)]
struct JsonShared {
    lookups: u64,
    blocks_read: u64,
    tokens_read: u64,
    blocks_written: u64,
    tokens_written: u64,
    blocks_already_present: u64,
    blocks_missing: u64,
    errors: u64,
    /// Blocks held at the end (`null` for a server).
    blocks_held: Option<usize>,
    bytes_held: Option<usize>,
    blocks_evicted: Option<u64>,
}

/// `{"runs": [...], "unlimited_hit_rate", ...}`.
pub fn render_json(runs: &[FleetRun], unl: &Unlimited, block_size: usize) -> Result<String> {
    let bs = block_size as u64;
    let list: Vec<JsonRun> = runs
        .iter()
        .map(|r| {
            let t = r.total();
            let p = &r.plan;
            JsonRun {
                instances: p.instances,
                router: p.router.name(),
                shared_tier: p.shared,
                eviction: p.policy.to_string(),
                host_tokens: p.host_tokens,
                host_blocks: p.host_blocks,
                disk_blocks: p.disk_blocks,
                shared_tokens: r.shared_tokens,
                shared_store: r.store.clone(),
                requests: t.requests,
                prompt_tokens: t.prompt_tokens,
                matched_tokens: t.matched_tokens,
                fleet_hit_rate: round4(t.hit_pct()),
                from_host: t.from_host,
                from_disk: t.from_disk,
                from_shared: t.from_shared,
                instance_hit_rates: r.per_instance.iter().map(|i| round4(i.hit_pct())).collect(),
                per_instance: r.per_instance.clone(),
                shared: r.traffic.map(|tr| JsonShared {
                    lookups: tr.lookups,
                    blocks_read: tr.blocks_read,
                    tokens_read: tr.blocks_read * bs,
                    blocks_written: tr.blocks_written,
                    tokens_written: tr.blocks_written * bs,
                    blocks_already_present: tr.blocks_present,
                    blocks_missing: tr.blocks_missing,
                    errors: tr.errors,
                    blocks_held: r.size.map(|s| s.blocks),
                    bytes_held: r.size.map(|s| s.bytes),
                    blocks_evicted: r.size.map(|s| s.evicted),
                }),
                integrity_errors: t.integrity_errors,
                blocks_verified: t.blocks_verified,
                load_errors: t.load_errors,
                offload_dropped_blocks: t.offload_dropped_blocks,
                shared_lookup_timeouts: t.shared_lookup_timeouts,
                shared_lookups_skipped: t.shared_lookups_skipped,
                shared_write_errors: t.shared_write_errors,
                wall_s: (r.wall_s * 100.0).round() / 100.0,
            }
        })
        .collect();
    let doc = serde_json::json!({
        "block_size": block_size,
        "requests": unl.requests,
        "prompt_tokens": unl.prompt,
        "unlimited_hit_rate": round4(pct(unl.matched, unl.prompt)),
        "runs": list,
    });
    serde_json::to_string_pretty(&doc)
        .map_err(|e| Error::internal(format!("cannot encode the runs: {e}")))
}

fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

/// The plot: the fleet's hit rate over each instance's host capacity, one line per (fleet size,
/// router, shared tier, policy); for the runs with the shared tier, one more line each: the
/// share of prompt tokens read from the shared tier (its read traffic, on the same % axis); and
/// the unlimited cache's line.
pub fn draw(
    path: &Path,
    title: &str,
    runs: &[FleetRun],
    unl: &Unlimited,
    block_size: usize,
) -> Result<()> {
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    let mut add = |name: String, pt: (f64, f64)| match series.iter_mut().find(|s| s.0 == name) {
        Some(s) => s.1.push(pt),
        None => series.push((name, vec![pt])),
    };
    for r in runs {
        let p = &r.plan;
        let t = r.total();
        let x = p.host_tokens as f64;
        let tier = if p.shared {
            "shared tier"
        } else {
            "local tiers only"
        };
        let name = format!(
            "{} × {}, {tier}, {}",
            p.instances,
            p.router.name(),
            p.policy
        );
        add(name.clone(), (x, t.hit_pct()));
        if p.shared {
            add(
                format!("{name}: read from it"),
                (x, pct(t.from_shared, t.prompt_tokens)),
            );
        }
    }
    draw_lines(
        path,
        &format!("Fleet prefix hit rate vs host capacity per instance — {title}"),
        &series,
        unl,
        block_size,
    )
}
