//! `kvbm sweep --instances N` (the fleet planner), through the real binary: hit rates on small
//! traces worked out by hand for both routers, with and without the shared tier; the prefix
//! router's 1.25× cap; a fleet of one against the plain sweep; the `--json` schema; and the
//! bad input refused before any replay (`--instances` out of bounds, an unknown router, a
//! `--remote-url` nobody answers); the shared tier on a real `redis-server` (started on a free
//! loopback port; SKIP without one, a failure under `CI=true`).
//!
//! Conventions as in `tests/cli.rs`: a clean configuration environment, a temporary directory
//! per run.

#![cfg(feature = "cli")]

use std::path::Path;
use std::process::{Command, Output};

use kvbm_connector::config::{CONFIG_FILE_VAR, ENV_VARS};
use kvbm_connector::log::LOG_ENV;
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_kvbm");

#[cfg(feature = "redis")]
mod redis_server;

/// `kvbm` with a clean configuration environment whose disk directory is `dir`.
fn kvbm(dir: &Path) -> Command {
    let mut c = Command::new(BIN);
    for v in ENV_VARS {
        c.env_remove(v.name);
    }
    c.env_remove(CONFIG_FILE_VAR);
    c.env_remove(LOG_ENV);
    c.env("KVBM_DISK_CACHE_DIR", dir);
    c
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Writes a JSONL trace of `prompts` (one request each, in order) and returns its path.
fn trace(dir: &Path, prompts: &[Vec<u32>]) -> std::path::PathBuf {
    let path = dir.join("trace.jsonl");
    let lines: Vec<String> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            json!({"id": format!("r{i}"), "arrival": i, "prompt": p, "max_tokens": 1}).to_string()
        })
        .collect();
    std::fs::write(&path, lines.join("\n") + "\n").expect("write the trace");
    path
}

/// `kvbm sweep --json` over `trace` with block size 4, the device cache off, requests one at a
/// time, and `extra` flags; the parsed JSON.
fn fleet_json(dir: &Path, trace: &Path, extra: &[&str]) -> Value {
    fleet_json_with(dir, trace, extra, None)
}

/// [`fleet_json`] with a config file (`CONFIG_FILE_VAR`).
fn fleet_json_with(dir: &Path, trace: &Path, extra: &[&str], config: Option<&Path>) -> Value {
    let mut c = kvbm(dir);
    if let Some(config) = config {
        c.env(CONFIG_FILE_VAR, config);
    }
    c.args(["sweep", "--trace"])
        .arg(trace)
        .args([
            "--sequential",
            "--block-size",
            "4",
            "--layers",
            "1",
            "--kv-heads",
            "1",
            "--head-dim",
            "4",
            "--device-blocks",
            "64",
            "--device-prefix-cache",
            "off",
            "--json",
            "--quiet",
        ])
        .args(extra);
    let out = c.output().expect("run kvbm");
    assert!(
        out.status.success(),
        "kvbm sweep failed: {}\n{}",
        text(&out.stderr),
        text(&out.stdout)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(&out.stdout)))
}

/// The run of `doc` with this router and shared tier.
fn run_of<'a>(doc: &'a Value, router: &str, shared: bool) -> &'a Value {
    doc["runs"]
        .as_array()
        .and_then(|runs| {
            runs.iter()
                .find(|r| r["router"] == router && r["shared_tier"] == shared)
        })
        .unwrap_or_else(|| panic!("no {router} run with shared_tier {shared}: {doc}"))
}

fn tokens(from: u32, to: u32) -> Vec<u32> {
    (from..=to).collect()
}

/// Three two-turn conversations A, B, C of 4-token blocks: the first turns (9 tokens: 2 full
/// blocks), then the second turns (13 tokens: the first turn and one more block; 3 blocks may
/// match). Round-robin over 2 instances sends A, C, B' to instance 0 and B, A', C' to 1: every
/// second turn lands away from its first, so local tiers match nothing, and the shared tier
/// 2 blocks (8 tokens) each. The prefix router keeps each conversation on one instance: 8 tokens
/// each from the host. Prompt tokens: 3 × 9 + 3 × 13 = 66; 24 matched = 36.36%.
fn conversations() -> Vec<Vec<u32>> {
    let first = |base: u32| tokens(base, base + 8);
    let second = |base: u32| tokens(base, base + 12);
    vec![
        first(100),
        first(200),
        first(300),
        second(100),
        second(200),
        second(300),
    ]
}

#[test]
fn routers_and_the_shared_tier_give_the_hand_computed_hit_rates() {
    let dir = tempfile::tempdir().expect("tempdir");
    let t = trace(dir.path(), &conversations());
    let doc = fleet_json(
        dir.path(),
        &t,
        &[
            "--host-blocks",
            "32",
            "--instances",
            "2",
            "--router",
            "round-robin,prefix",
            "--shared-tier",
            "both",
        ],
    );
    let hit = |r: &Value| r["fleet_hit_rate"].as_f64().unwrap_or(-1.0);
    let rr_off = run_of(&doc, "round-robin", false);
    let rr_on = run_of(&doc, "round-robin", true);
    let px_off = run_of(&doc, "prefix", false);
    let px_on = run_of(&doc, "prefix", true);
    for r in [rr_off, rr_on, px_off, px_on] {
        assert_eq!(r["prompt_tokens"], 66, "{r}");
        assert_eq!(r["requests"], 6, "{r}");
        assert_eq!(r["integrity_errors"], 0, "{r}");
    }
    // Round-robin, local tiers only: every second turn lands away from its first.
    assert_eq!(rr_off["matched_tokens"], 0, "{rr_off}");
    assert_eq!(hit(rr_off), 0.0);
    assert!(rr_off["shared"].is_null(), "{rr_off}");
    // Round-robin with the shared tier: 8 tokens per second turn, all from the shared tier.
    assert_eq!(rr_on["matched_tokens"], 24, "{rr_on}");
    assert_eq!(rr_on["from_shared"], 24, "{rr_on}");
    assert!((hit(rr_on) - 36.3636).abs() < 1e-3, "{rr_on}");
    // Its traffic: 6 blocks read (2 per second turn); 9 distinct full blocks written (2 per
    // first turn, 1 more per second), all still held (unlimited).
    let sh = &rr_on["shared"];
    assert_eq!(sh["blocks_read"], 6, "{sh}");
    assert_eq!(sh["tokens_read"], 24, "{sh}");
    assert_eq!(sh["blocks_written"], 9, "{sh}");
    assert_eq!(sh["tokens_written"], 36, "{sh}");
    assert_eq!(sh["blocks_held"], 9, "{sh}");
    assert_eq!(sh["blocks_evicted"], 0, "{sh}");
    // Instances: each served 3 requests; instance 1 got A' and C' (16 tokens of 9 + 13 + 13),
    // instance 0 B' (8 of 9 + 9 + 13).
    let per: Vec<u64> = rr_on["per_instance"]
        .as_array()
        .map(|v| {
            v.iter()
                .map(|i| i["matched_tokens"].as_u64().unwrap_or(0))
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(per, [8, 16], "{rr_on}");
    // The prefix router keeps conversations together: the same 24 tokens from the host tiers.
    assert_eq!(px_off["matched_tokens"], 24, "{px_off}");
    assert_eq!(px_off["from_host"], 24, "{px_off}");
    // ... and the shared tier adds nothing to it (the host answers first).
    assert_eq!(px_on["matched_tokens"], 24, "{px_on}");
    assert_eq!(px_on["from_shared"], 0, "{px_on}");
    assert!((doc["unlimited_hit_rate"].as_f64().unwrap_or(0.0) - 36.3636).abs() < 1e-3);
}

#[test]
fn the_prefix_router_never_takes_more_than_a_share_and_a_quarter() {
    // One conversation growing by a block per request: the instance that served the last
    // request always holds the longest prefix, so without the cap all 8 would go to it.
    let dir = tempfile::tempdir().expect("tempdir");
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| tokens(1, 9 + 4 * i)).collect();
    let t = trace(dir.path(), &prompts);
    let doc = fleet_json(
        dir.path(),
        &t,
        &[
            "--host-blocks",
            "64",
            "--instances",
            "2",
            "--router",
            "prefix",
            "--shared-tier",
            "off",
        ],
    );
    let r = run_of(&doc, "prefix", false);
    let load: Vec<u64> = r["per_instance"]
        .as_array()
        .map(|v| {
            v.iter()
                .map(|i| i["requests"].as_u64().unwrap_or(0))
                .collect()
        })
        .unwrap_or_default();
    // The cap with i requests routed before: ceil(1.25 (i + 1) / 2) = 1, 2, 2, 3, 4, 4, 5, 5.
    // Instance 0 takes r0 and r1, is full at r2 (cap 2), which goes to 1; instance 1 then
    // holds the longest prefix and takes r3..r6 (up to 5), is full at r7, which goes back to
    // 0. Without the cap: [8, 0].
    assert_eq!(load, [3, 5], "{r}");
}

#[test]
fn a_fleet_of_one_matches_the_plain_sweep() {
    let dir = tempfile::tempdir().expect("tempdir");
    let common = [
        "sweep",
        "--workload",
        "multi-turn",
        "--requests",
        "120",
        "--sequential",
        "--device-prefix-cache",
        "off",
        "--quiet",
    ];
    let plain = kvbm(dir.path())
        .args(common)
        .args(["--capacities", "1024"])
        .output()
        .expect("run kvbm");
    assert!(plain.status.success(), "{}", text(&plain.stderr));
    // The plain sweep's line: "prefix 1024 64 0 0 HIT% MATCHED 0".
    let stdout = text(&plain.stdout);
    let matched: u64 = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("prefix"))
        .and_then(|l| l.split_whitespace().nth(6))
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("no prefix line: {stdout}"));
    let fleet = kvbm(dir.path())
        .args(common)
        .args([
            "--capacities",
            "1024",
            "--instances",
            "1",
            "--shared-tier",
            "off",
            "--json",
        ])
        .output()
        .expect("run kvbm");
    assert!(fleet.status.success(), "{}", text(&fleet.stderr));
    let doc: Value = serde_json::from_slice(&fleet.stdout).expect("JSON");
    assert!(matched > 0, "{stdout}");
    assert_eq!(doc["runs"][0]["matched_tokens"], matched, "{doc}");
}

#[test]
fn the_shared_tier_never_loses_hits_and_its_capacity_binds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = [
        "sweep",
        "--workload",
        "multi-turn",
        "--requests",
        "200",
        "--sequential",
        "--device-prefix-cache",
        "off",
        "--capacities",
        "512",
        "--instances",
        "3",
        "--router",
        "round-robin,prefix",
        "--json",
        "--quiet",
    ];
    let out = kvbm(dir.path()).args(base).output().expect("run kvbm");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let doc: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    for router in ["round-robin", "prefix"] {
        let off = run_of(&doc, router, false)["fleet_hit_rate"]
            .as_f64()
            .unwrap_or(0.0);
        let on = run_of(&doc, router, true)["fleet_hit_rate"]
            .as_f64()
            .unwrap_or(-1.0);
        assert!(on >= off, "{router}: shared {on} < local {off}");
    }
    let rr_on = run_of(&doc, "round-robin", true);
    assert!(rr_on["from_shared"].as_u64().unwrap_or(0) > 0, "{rr_on}");
    // A shared tier of 20 blocks (320 tokens of 16): it holds at most 20 and evicts the rest.
    let small = kvbm(dir.path())
        .args(base)
        .args(["--shared-tier", "on", "--shared-tokens", "320"])
        .output()
        .expect("run kvbm");
    assert!(small.status.success(), "{}", text(&small.stderr));
    let doc_small: Value = serde_json::from_slice(&small.stdout).expect("JSON");
    let r = run_of(&doc_small, "round-robin", true);
    assert_eq!(r["shared_tokens"], 320, "{r}");
    assert_eq!(r["shared"]["blocks_held"], 20, "{r}");
    assert!(
        r["shared"]["blocks_evicted"].as_u64().unwrap_or(0) > 0,
        "{r}"
    );
}

#[test]
fn the_json_lists_every_run_with_its_fields() {
    let dir = tempfile::tempdir().expect("tempdir");
    let t = trace(dir.path(), &conversations());
    let svg = dir.path().join("fleet.svg");
    let svg_arg = svg.to_string_lossy().into_owned();
    let doc = fleet_json(
        dir.path(),
        &t,
        &[
            "--capacities",
            "64,128",
            "--instances",
            "1,2",
            "--router",
            "prefix",
            "--plot",
            &svg_arg,
        ],
    );
    // The plot: one line per (fleet size, router, shared tier, policy), and for the shared
    // runs the share read from the shared tier.
    let plot = std::fs::read_to_string(&svg).expect("the plot was written");
    for series in [
        "1 × prefix, local tiers only, prefix",
        "2 × prefix, shared tier, prefix",
        "2 × prefix, shared tier, prefix: read from it",
        "unlimited cache",
    ] {
        assert!(plot.contains(series), "no {series:?} in the plot");
    }
    let runs = doc["runs"].as_array().expect("runs");
    // 2 capacities × 2 fleet sizes × 1 router × (off, on), in that order.
    assert_eq!(runs.len(), 8, "{doc}");
    let order: Vec<(u64, u64, bool)> = runs
        .iter()
        .map(|r| {
            (
                r["host_tokens"].as_u64().unwrap_or(0),
                r["instances"].as_u64().unwrap_or(0),
                r["shared_tier"].as_bool().unwrap_or(false),
            )
        })
        .collect();
    assert_eq!(
        order,
        [
            (64, 1, false),
            (64, 1, true),
            (64, 2, false),
            (64, 2, true),
            (128, 1, false),
            (128, 1, true),
            (128, 2, false),
            (128, 2, true)
        ]
    );
    for r in runs {
        for key in [
            "instances",
            "router",
            "shared_tier",
            "eviction",
            "host_tokens",
            "host_blocks",
            "disk_blocks",
            "shared_tokens",
            "shared_store",
            "requests",
            "prompt_tokens",
            "matched_tokens",
            "fleet_hit_rate",
            "from_host",
            "from_disk",
            "from_shared",
            "instance_hit_rates",
            "per_instance",
            "shared",
            "integrity_errors",
            "blocks_verified",
            "load_errors",
            "wall_s",
        ] {
            assert!(r.get(key).is_some(), "run without {key:?}: {r}");
        }
        let n = r["instances"].as_u64().unwrap_or(0) as usize;
        assert_eq!(r["per_instance"].as_array().map(Vec::len), Some(n), "{r}");
        assert_eq!(
            r["instance_hit_rates"].as_array().map(Vec::len),
            Some(n),
            "{r}"
        );
        assert_eq!(r["router"], "prefix");
        assert_eq!(r["host_blocks"], r["host_tokens"].as_u64().unwrap_or(0) / 4);
        if r["shared_tier"] == true {
            assert_eq!(r["shared_store"], "in-process", "{r}");
            for key in [
                "lookups",
                "blocks_read",
                "tokens_read",
                "blocks_written",
                "tokens_written",
                "blocks_held",
                "bytes_held",
                "blocks_evicted",
            ] {
                assert!(
                    r["shared"].get(key).is_some(),
                    "shared without {key:?}: {r}"
                );
            }
        } else {
            assert!(r["shared"].is_null() && r["shared_store"].is_null(), "{r}");
        }
    }
    for key in [
        "block_size",
        "requests",
        "prompt_tokens",
        "unlimited_hit_rate",
    ] {
        assert!(doc.get(key).is_some(), "no {key:?}: {doc}");
    }
}

/// `kvbm sweep` with `args` after a small built-in workload exits 2 naming `flag` and `why`, having printed nothing on stdout
/// (no run's table: refused before any replay).
fn refused(args: &[&str], flag: &str, why: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let out: Output = kvbm(dir.path())
        .args(["sweep", "--requests", "20", "--capacities", "1024"])
        .args(args)
        .output()
        .expect("run kvbm");
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(err.contains(flag) && err.contains(why), "{args:?}: {err}");
    assert!(
        out.stdout.is_empty(),
        "{args:?} printed: {}",
        text(&out.stdout)
    );
}

#[test]
fn bad_fleet_input_is_refused_before_any_replay() {
    refused(&["--instances", "0"], "--instances", "between 1 and 64");
    refused(&["--instances", "65"], "--instances", "between 1 and 64");
    refused(&["--instances", "2,0"], "--instances", "between 1 and 64");
    refused(
        &["--instances", "2", "--router", "random"],
        "--router",
        "unknown router (known: round-robin, prefix)",
    );
    refused(&["--router", "prefix"], "--router", "needs --instances");
    refused(
        &[
            "--instances",
            "2",
            "--shared-tier",
            "off",
            "--shared-tokens",
            "1M",
        ],
        "--shared-tokens",
        "--shared-tier off",
    );
    refused(
        &["--instances", "2", "--framework", "vllm"],
        "--framework",
        "TensorRT-LLM's call order",
    );
    refused(
        &["--instances", "2", "--remote-url", "memory://x"],
        "--remote-url",
        "in-process already",
    );
    // A shared tier that could outgrow the machine's memory (blocks of 640 MiB: the 98 distinct
    // blocks of this workload need 61 GiB, far more than half of any machine this runs on; how
    // it fails: without the check the replay starts, and its tiers or the store fill memory).
    refused(
        &[
            "--instances",
            "2",
            "--block-size",
            "16",
            "--layers",
            "160",
            "--kv-heads",
            "8",
            "--head-dim",
            "8192",
            "--dtype-bytes",
            "2",
        ],
        "--shared-tokens",
        "over half of the",
    );
}

#[test]
fn a_fleet_that_cannot_fit_in_memory_is_refused_before_any_replay() {
    // Each instance's host tier keeps bookkeeping for every block it may hold, allocated when
    // it is built (about 260 bytes a block under the default prefix policy), and its device
    // cache 320 blocks of 64 KiB: 64 instances of this workload need about 1.3 GiB even with
    // 64-block host tiers. A limit below that is refused by name, before any instance is built
    // (without the estimate the 64 instances start, and a machine with less memory kills them).
    refused(
        &["--instances", "64", "--memory-limit", "1G"],
        "--instances",
        "more than the 1024 MiB --memory-limit allows",
    );
    // The fleet: 64 instances of 10M tokens each (625,000 blocks of 16 tokens): about
    // 11 GiB of host tier bookkeeping alone, refused under 8 GiB whatever the machine has.
    let dir = tempfile::tempdir().expect("tempdir");
    let out: Output = kvbm(dir.path())
        .args(["sweep", "--requests", "20", "--instances", "64"])
        .args(["--capacities", "10M", "--memory-limit", "8G"])
        .output()
        .expect("run kvbm");
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    for n in [
        "--instances",
        "625000 blocks × 288 B",
        "more than the 8192 MiB",
    ] {
        assert!(err.contains(n), "{n:?}: {err}");
    }
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
    // One instance of the same fits: the estimate follows the instances.
    let ok = kvbm(dir.path())
        .args([
            "sweep",
            "--requests",
            "20",
            "--instances",
            "1",
            "--shared-tier",
            "off",
        ])
        .args(["--capacities", "1024", "--memory-limit", "1G", "--quiet"])
        .output()
        .expect("run kvbm");
    assert!(ok.status.success(), "{}", text(&ok.stderr));
}

#[test]
fn a_plain_sweep_whose_runs_cannot_fit_is_refused_naming_the_flag() {
    // Two runs at once (--jobs 2) of 30M-token host tiers (1,875,000 blocks each, about 500
    // MiB of bookkeeping apiece): refused under 512 MiB, naming --capacities.
    let dir = tempfile::tempdir().expect("tempdir");
    let out: Output = kvbm(dir.path())
        .args([
            "sweep",
            "--requests",
            "20",
            "--capacities",
            "1M,30M",
            "--jobs",
            "2",
        ])
        .args(["--memory-limit", "512M"])
        .output()
        .expect("run kvbm");
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("lower --capacities") && err.contains("--jobs"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
}

#[test]
fn an_unreachable_remote_url_is_refused_before_any_replay() {
    // A loopback port nobody listens on: bound, then released.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let url = format!("redis://127.0.0.1:{port}");
    refused(
        &["--instances", "2", "--remote-url", &url],
        "--remote-url",
        "cannot be reached",
    );
}

#[cfg(feature = "redis")]
#[test]
fn a_redis_server_as_the_shared_tier_gives_the_same_hits_and_counts_its_traffic() {
    let Some(server) = redis_server::OwnServer::start(&[]) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let t = trace(dir.path(), &conversations());
    let url = server.url();
    // A server's calls keep the configured deadlines (the in-process tier's are raised for
    // planning): TensorRT-LLM's 5 ms lookup deadline is missed by a loopback server on a busy
    // host (3 of 6 lookups timed out there, 16 tokens matched for 24), and this test is about
    // the hits and the traffic, so it gives the server the in-process tier's planning deadlines.
    let config = dir.path().join("kvbm.toml");
    std::fs::write(
        &config,
        "[remote]\nlookup_timeout_ms = 1000\nload_timeout_ms = 10000\nio_timeout_ms = 10000\nslow_ms = 10000\n",
    )
    .expect("write the config");
    for run in 1..=2 {
        let doc = fleet_json_with(
            dir.path(),
            &t,
            &[
                "--host-blocks",
                "32",
                "--instances",
                "2",
                "--router",
                "round-robin",
                "--shared-tier",
                "on",
                "--remote-url",
                &url,
            ],
            Some(&config),
        );
        let r = run_of(&doc, "round-robin", true);
        // As the in-process tier: 8 tokens per second turn, from the server.
        assert_eq!(r["matched_tokens"], 24, "{r}");
        assert_eq!(r["from_shared"], 24, "{r}");
        assert_eq!(r["integrity_errors"], 0, "{r}");
        assert!(
            r["shared_store"]
                .as_str()
                .is_some_and(|s| s.starts_with("redis://127.0.0.1:")),
            "{r}"
        );
        let sh = &r["shared"];
        assert_eq!(sh["blocks_read"], 6, "{sh}");
        // Each run writes its 9 blocks under a namespace of its own: the second finds none of
        // the first's (it would find all 9 present otherwise) ...
        assert_eq!(sh["blocks_written"], 9, "run {run}: {sh}");
        // ... and the server's size is its own business.
        assert!(sh["blocks_held"].is_null(), "{sh}");
        let keys = server.cli(&["dbsize"]).unwrap_or_default();
        assert_eq!(keys.trim(), (9 * run).to_string(), "run {run}");
    }
}
