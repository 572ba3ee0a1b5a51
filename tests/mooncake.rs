//! Mooncake traces and capacity sweeps through the real `kvbm` binary: a small hand-written trace
//! replayed against hand-computed LRU hits (both engines), the parser's errors, the sweep's table
//! (insta snapshot) and its SVG plot.

#![cfg(feature = "cli")]

use std::io::Cursor;
use std::path::Path;
use std::process::{Command, Output};

use kvbm_connector::config::{CONFIG_FILE_VAR, ENV_VARS};
use kvbm_connector::log::LOG_ENV;
use serde_json::Value;

/// The tool's request type and limits, compiled from its source (the tool is a binary).
#[allow(dead_code)]
#[path = "../tool/replay/workload.rs"]
mod workload;

/// The tool's Mooncake reader, compiled from its source.
#[path = "../tool/replay/mooncake.rs"]
mod mooncake;

use mooncake::{block_token, prompt_tokens, MooncakeReader, MAX_LINE_BYTES};

const BIN: &str = env!("CARGO_BIN_EXE_kvbm");

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

fn assert_ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status.code(),
        text(&out.stdout),
        text(&out.stderr)
    );
}

/// The hand-written trace. Blocks are 512 tokens; a block's key is its whole prefix of ids, so
/// write `12` for the block with ids [1, 2]. With one output token no prompt's last block fills
/// up, so a request stores exactly `input_length / 512` full blocks, and it may match at most
/// `(input_length - 1) / 512` (a fully matched prompt computes its last block again).
const HAND_TRACE: &str = r#"{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]}
{"timestamp": 1, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]}
{"timestamp": 2, "input_length": 1536, "output_length": 5, "hash_ids": [1, 2, 4]}

{"timestamp": 3, "input_length": 700, "output_length": 5, "hash_ids": [9, 1]}
{"timestamp": 4, "input_length": 1600, "output_length": 5, "hash_ids": [1, 2, 4, 7]}
{"timestamp": 5, "input_length": 1537, "output_length": 5, "hash_ids": [1, 2, 4, 8]}
"#;

/// Expected matched tokens per request, host LRU of 3 blocks (cache shown oldest first):
/// * line 1: empty cache → 0; stores 1, 12 (the 76-token tail is partial) → [1 12];
/// * line 2: 1024 tokens = 2 full blocks, at most 1 matchable: 1 → 512; touches 1, 12 → [1 12];
/// * line 3: matchable 2: 1, 12 → 1024; stores 124 → [1 12 124];
/// * line 5 (line 4 is blank): [9 1] — its second block has the tokens of id 1 but the prefix 9,
///   so it is a different block: matchable 1, 9 missing → 0; stores 9, evicting 1 → [12 124 9];
/// * line 6: matchable 3, but 1 was evicted: 12 and 124 are useless without their parent → 0;
///   stores 1 (evicts 12), 12 (evicts 124), 124 (evicts 9) → [1 12 124];
/// * line 7: 1537 tokens, matchable 3: 1, 12, 124 → 1536.
///
/// Total 3072 of 7497 prompt tokens.
const HAND_LRU3: [(&str, usize); 6] = [
    ("line1", 0),
    ("line2", 512),
    ("line3", 1024),
    ("line5", 0),
    ("line6", 0),
    ("line7", 1536),
];

/// With 4 host blocks nothing is evicted before line 6: after line 5 the cache is
/// [1 12 124 9], so line 6 matches 1, 12, 124 → 1536 and line 7 too: total 4608, which is also
/// the unlimited cache's figure (the trace has 4 distinct full blocks).
const HAND_LRU4: [(&str, usize); 6] = [
    ("line1", 0),
    ("line2", 512),
    ("line3", 1024),
    ("line5", 0),
    ("line6", 1536),
    ("line7", 1536),
];

const SHAPE: [&str; 10] = [
    "--block-size",
    "512",
    "--layers",
    "1",
    "--kv-heads",
    "1",
    "--head-dim",
    "8",
    "--device-blocks",
    "64",
];

/// Replays the hand trace sequentially with `host` host blocks; per-request matched tokens.
fn replay_hand(framework: &str, host: usize, sequential: bool) -> (Vec<(String, usize)>, Value) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let trace = dir.path().join("hand.jsonl");
    std::fs::write(&trace, HAND_TRACE).expect("write trace");
    let report = dir.path().join("r.json");
    let mut cmd = kvbm(dir.path());
    // The hand computation is LRU's (the configuration's default policy may differ).
    cmd.env("KVBM_EVICTION", "lru");
    cmd.args(["replay", "--quiet", "--framework", framework])
        .args(["--trace-format", "mooncake", "--trace"])
        .arg(&trace)
        .args(SHAPE)
        .args(["--device-prefix-cache", "off", "--disk-blocks", "0"])
        .args(["--max-output-tokens", "1", "--host-blocks"])
        .arg(host.to_string())
        .arg("--report")
        .arg(&report);
    if sequential {
        cmd.arg("--sequential");
    }
    let out = cmd.output().expect("run kvbm");
    assert_ok(&out, &format!("{framework} hand trace, host {host}"));
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&report).expect("report"))
        .expect("report JSON");
    let got = r["requests"]
        .as_array()
        .expect("requests")
        .iter()
        .map(|q| {
            (
                q["id"].as_str().expect("id").to_string(),
                q["matched_tokens"].as_u64().expect("matched") as usize,
            )
        })
        .collect();
    (got, r)
}

#[test]
fn a_small_mooncake_trace_gets_the_hand_computed_lru_hits() {
    for framework in ["trtllm", "vllm"] {
        for (host, expected) in [(3, HAND_LRU3), (4, HAND_LRU4)] {
            let (got, r) = replay_hand(framework, host, true);
            let want: Vec<(String, usize)> =
                expected.iter().map(|&(i, m)| (i.to_string(), m)).collect();
            assert_eq!(got, want, "{framework}, {host} host blocks");
            let s = &r["summary"];
            assert_eq!(s["prompt_tokens"], 7497, "{framework}");
            assert_eq!(
                s["matched_tokens"].as_u64(),
                Some(want.iter().map(|w| w.1 as u64).sum()),
                "{framework}, {host}"
            );
            assert_eq!(
                s["device_hit_tokens"], 0,
                "{framework}: device cache is off"
            );
            assert_eq!(s["integrity_errors"], 0, "{framework}");
            // Every matched block was onboarded and verified.
            assert_eq!(
                s["blocks_verified"].as_u64(),
                Some(want.iter().map(|w| w.1 as u64 / 512).sum()),
                "{framework}, {host}"
            );
            // Outputs capped at 1 token.
            assert!(r["requests"]
                .as_array()
                .expect("requests")
                .iter()
                .all(|q| q["output_tokens"] == 1));
        }
    }
}

#[test]
fn a_mooncake_trace_replays_by_its_timestamps_too() {
    // Without --sequential the requests overlap (one engine step per millisecond): the run must
    // finish clean; its hits depend on the overlap, so only bounds are checked.
    let (got, r) = replay_hand("vllm", 3, false);
    assert_eq!(got.len(), 6);
    assert_eq!(r["summary"]["integrity_errors"], 0);
    assert!(got.iter().map(|g| g.1).sum::<usize>() <= 4608);
}

#[test]
fn tokens_depend_on_the_block_id_only() {
    let a = prompt_tokens(&[5, 6], 1024);
    let b = prompt_tokens(&[7, 6], 1024);
    assert_eq!(a.len(), 1024);
    assert_eq!(a[512..], b[512..], "same id, same tokens, wherever it sits");
    assert_ne!(a[..512], b[..512], "different ids, different tokens");
    let p = prompt_tokens(&[1, 2], 600);
    assert_eq!(p.len(), 600, "the last block is cut to input_length");
    assert_eq!(p[..], prompt_tokens(&[1, 2], 1024)[..600]);
    assert_eq!(p[512], block_token(2, 0));
    assert!(a.iter().all(|&t| t < workload::VOCAB));
}

/// Reads a whole trace; the first error, if any.
fn read_all(text: &str) -> Result<Vec<workload::TraceRequest>, String> {
    MooncakeReader::new(Cursor::new(text.as_bytes().to_vec()), 1000)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())
}

#[test]
fn mooncake_lines_become_requests() {
    let r = read_all(HAND_TRACE).expect("valid");
    assert_eq!(r.len(), 6);
    assert_eq!(r[3].id, "line5", "ids are line numbers (blank lines count)");
    assert_eq!(r[3].arrival, 3);
    assert_eq!(r[3].prompt.len(), 700);
    assert_eq!(r[0].max_tokens, 5, "output_length under the cap");
    let capped = MooncakeReader::new(Cursor::new(HAND_TRACE.as_bytes().to_vec()), 2)
        .collect::<Result<Vec<_>, _>>()
        .expect("valid");
    assert!(capped.iter().all(|q| q.max_tokens == 2));
    let dir = tempfile::tempdir().expect("temporary directory");
    let file = dir.path().join("t.jsonl");
    std::fs::write(&file, HAND_TRACE).expect("write");
    let from_file = mooncake::open_mooncake(&file, 1000)
        .expect("open")
        .collect::<Result<Vec<_>, _>>()
        .expect("valid");
    assert_eq!(from_file, r, "the file reader reads the same requests");
    assert!(mooncake::open_mooncake(&dir.path().join("missing"), 1).is_err());
    let zero =
        read_all(r#"{"timestamp": 0, "input_length": 3, "output_length": 0, "hash_ids": [4]}"#)
            .expect("valid");
    assert_eq!(
        zero[0].max_tokens, 1,
        "an output of 0 still samples one token"
    );
}

#[test]
fn malformed_mooncake_lines_are_errors_naming_line_and_field() {
    let ok = r#"{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}"#;
    let cases: Vec<(String, &[&str])> = vec![
        (format!("{ok}\nnot json"), &["line 2", "not JSON"]),
        (format!("{ok}\n[1, 2]"), &["line 2", "JSON object"]),
        (
            r#"{"timestamp": 0, "input_length": -5, "output_length": 5, "hash_ids": []}"#.into(),
            &["line 1", "\"input_length\"", "non-negative"],
        ),
        (
            r#"{"timestamp": 0, "input_length": 99999999999, "output_length": 5, "hash_ids": [1]}"#
                .into(),
            &["line 1", "\"input_length\"", "at most 16777216"],
        ),
        (
            r#"{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1]}"#.into(),
            &["line 1", "\"hash_ids\"", "has 1 ids", "needs 2"],
        ),
        (
            r#"{"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": []}"#.into(),
            &["line 1", "\"input_length\" is 0"],
        ),
        (
            r#"{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, "x"]}"#
                .into(),
            &["line 1", "\"hash_ids\"[1]"],
        ),
        (
            r#"{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}"#.into(),
            &["line 1", "missing field \"output_length\""],
        ),
        (
            r#"{"timestamp": 1.5, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}"#
                .into(),
            &["line 1", "\"timestamp\""],
        ),
        (
            r#"{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2], "x": 1}"#
                .into(),
            &["line 1", "unknown field \"x\""],
        ),
        (
            format!(
                "{}\n{ok}",
                r#"{"timestamp": 9, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}"#
            ),
            &["line 2", "\"timestamp\" 0 is earlier"],
        ),
        ("\n  \n".into(), &["no requests"]),
        (
            format!("{ok}\n{}", " ".repeat(MAX_LINE_BYTES + 10)),
            &["line 2", "longer than"],
        ),
    ];
    for (input, needles) in cases {
        let err = read_all(&input).expect_err("malformed");
        for n in needles {
            assert!(err.contains(n), "error {err:?} should mention {n:?}");
        }
    }
}

#[test]
fn a_duplicate_key_is_refused_naming_the_line_and_the_key() {
    // serde_json keeps the last of two equal keys: the line would be read as 1024 tokens with
    // its first input_length dropped, silently.
    let ok = r#"{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}"#;
    for (line, key) in [
        (
            r#"{"timestamp": 0, "input_length": 512, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]}"#,
            "input_length",
        ),
        (
            r#"{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2], "hash_ids": [3, 4]}"#,
            "hash_ids",
        ),
        (
            r#"{"timestamp": 0, "timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}"#,
            "timestamp",
        ),
    ] {
        let err = MooncakeReader::new(Cursor::new(format!("{ok}\n{line}\n").into_bytes()), 1000)
            .collect::<Result<Vec<_>, _>>()
            .expect_err("a duplicate key");
        let text = err.to_string();
        assert!(
            text.contains("line 2") && text.contains(&format!("duplicate field \"{key}\"")),
            "{text}"
        );
        assert_eq!(err.context_value("field"), Some(key), "{text}");
        assert_eq!(err.context_value("line"), Some("2"), "{text}");
    }
}

#[test]
fn a_byte_order_mark_is_skipped_at_the_start_and_named_elsewhere() {
    let ok = r#"{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}"#;
    // At the start of the file (some editors save one): skipped, the trace reads as without.
    let with_bom = format!("\u{feff}{ok}\n{ok}\n");
    assert_eq!(with_bom.as_bytes()[..3], [0xEF, 0xBB, 0xBF]);
    let r = read_all(&with_bom).expect("a leading byte-order mark is skipped");
    assert_eq!(r, read_all(&format!("{ok}\n{ok}\n")).expect("valid"));
    // Anywhere else (two files concatenated): refused, naming the mark, not "not JSON".
    let err = read_all(&format!("{ok}\n\u{feff}{ok}\n")).expect_err("a second mark");
    assert!(
        err.contains("line 2") && err.contains("byte-order mark (EF BB BF)"),
        "{err}"
    );
    assert!(!err.contains("not JSON"), "{err}");
}

/// `n` Mooncake requests of 512 tokens (distinct blocks), all at timestamp 0.
fn burst(n: usize) -> String {
    (0..n)
        .map(|i| {
            format!(
                "{{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 2, \"hash_ids\": [{i}]}}\n"
            )
        })
        .collect()
}

/// Replays `trace` (Mooncake) with the tiny shape and `extra` flags; the report.
fn replay_report(dir: &Path, trace: &Path, extra: &[&str]) -> Value {
    let report = dir.join("burst.json");
    let out = kvbm(dir)
        .args(["replay", "--quiet", "--trace-format", "mooncake", "--trace"])
        .arg(trace)
        .args(SHAPE)
        .args(["--disk-blocks", "0", "--host-blocks", "64", "--report"])
        .arg(&report)
        .args(extra)
        .output()
        .expect("run kvbm");
    assert_ok(&out, &format!("burst replay {extra:?}"));
    serde_json::from_str(&std::fs::read_to_string(&report).expect("report")).expect("report JSON")
}

#[test]
fn requests_due_at_once_wait_in_the_trace_beyond_the_waiting_bound() {
    // 60 requests of 512 tokens at timestamp 0: without a bound all 60 (30,720 tokens, 12 bytes
    // each) wait in the engine at once — the issue's million such requests took 6.6 GB. With
    // --max-waiting-tokens 2048 at most 4 of them are read from the trace at a time.
    let dir = tempfile::tempdir().expect("temporary directory");
    let trace = dir.path().join("burst.jsonl");
    std::fs::write(&trace, burst(60)).expect("write trace");
    let all = replay_report(dir.path(), &trace, &[]);
    assert_eq!(
        all["summary"]["peak_waiting_tokens"],
        60 * 512,
        "{}",
        all["summary"]
    );
    let bounded = replay_report(dir.path(), &trace, &["--max-waiting-tokens", "2048"]);
    let s = &bounded["summary"];
    assert_eq!(s["requests"], 60);
    assert!(
        s["peak_waiting_tokens"].as_u64().is_some_and(|p| p <= 2048),
        "{s}"
    );
    assert_eq!(s["integrity_errors"], 0);
    // Held back in the trace, not delayed: with room for a full batch (8 requests) waiting,
    // the engine schedules the same requests at the same steps, and every request's time to
    // first token still counts from its arrival.
    let roomy = replay_report(dir.path(), &trace, &["--max-waiting-tokens", "8192"]);
    assert!(
        roomy["summary"]["peak_waiting_tokens"]
            .as_u64()
            .is_some_and(|p| p <= 8192),
        "{}",
        roomy["summary"]
    );
    let per_request = |r: &Value| -> Vec<(String, f64, u64)> {
        r["requests"]
            .as_array()
            .expect("requests")
            .iter()
            .map(|q| {
                (
                    q["id"].as_str().expect("id").to_string(),
                    q["ttft_ms"].as_f64().expect("ttft"),
                    q["matched_tokens"].as_u64().expect("matched"),
                )
            })
            .collect()
    };
    assert_eq!(per_request(&roomy), per_request(&all));
    assert_eq!(roomy["summary"]["steps"], all["summary"]["steps"]);
    assert_eq!(
        roomy["summary"]["mean_ttft_ms"],
        all["summary"]["mean_ttft_ms"]
    );
    // A bound below one request still lets one request wait at a time.
    let one = replay_report(dir.path(), &trace, &["--max-waiting-tokens", "1"]);
    assert_eq!(one["summary"]["requests"], 60);
    assert_eq!(one["summary"]["peak_waiting_tokens"], 512);
}

#[test]
fn a_bad_mooncake_file_fails_the_replay_naming_the_line() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let trace = dir.path().join("bad.jsonl");
    std::fs::write(
        &trace,
        format!(
            "{}\n{}\n",
            r#"{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}"#,
            r#"{"timestamp": 1, "input_length": 6000, "output_length": 5, "hash_ids": [1, 2]}"#
        ),
    )
    .expect("write");
    let out = kvbm(dir.path())
        .args(["replay", "--quiet", "--trace-format", "mooncake", "--trace"])
        .arg(&trace)
        .args(SHAPE)
        .output()
        .expect("run kvbm");
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    for n in ["line 2", "hash_ids", "bad.jsonl"] {
        assert!(stderr.contains(n), "stderr should mention {n:?}: {stderr}");
    }
}

/// `kvbm sweep` of the hand trace (written into `dir`) in Mooncake format, sequential, with the
/// tiny shape and outputs capped at 1; the caller adds capacities, policies and the plot.
fn hand_sweep(dir: &Path) -> Command {
    let trace = dir.join("hand.jsonl");
    std::fs::write(&trace, HAND_TRACE).expect("write trace");
    let mut cmd = kvbm(dir);
    cmd.args(["sweep", "--quiet", "--trace-format", "mooncake", "--trace"])
        .arg(&trace)
        .args(SHAPE)
        .args([
            "--sequential",
            "--device-prefix-cache",
            "off",
            "--max-output-tokens",
            "1",
        ]);
    cmd
}

#[test]
fn sweep_prints_hit_rates_per_capacity_and_draws_the_plot() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let plot = dir.path().join("curve.svg");
    let out = hand_sweep(dir.path())
        // Out of order and repeated on purpose: the table is sorted and deduplicated.
        .args(["--capacities", "2048,1536,1K,2048", "--disk-tokens", "2048"])
        .args(["--eviction", "lru", "--jobs", "2", "--plot"])
        .arg(&plot)
        .output()
        .expect("run kvbm");
    assert_ok(&out, "kvbm sweep");
    // Host 1536 tokens = 3 blocks and 2048 = 4: the hand-computed 3072 and 4608 tokens above;
    // 1K = 1 block; with a 4-block disk behind 3 host blocks, the disk serves what the host
    // evicted (the unlimited figure); the unlimited line (4 distinct blocks) is 4608.
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path("../snapshots");
    settings.bind(|| insta::assert_snapshot!("sweep_table", text(&out.stdout)));

    let svg = std::fs::read_to_string(&plot).expect("the plot was written");
    assert!(svg.starts_with("<svg"), "an SVG document");
    assert!(
        svg.len() > 4000,
        "a plot, not an empty canvas: {} bytes",
        svg.len()
    );
    for needle in [
        "hand.jsonl",
        "host cache capacity (tokens, log scale)",
        "prefix hit rate (% of prompt tokens)",
        "lru, host only",
        "lru, host + 2K disk",
        "unlimited cache (61.46%; its 4 distinct blocks hold 2K tokens)",
    ] {
        assert!(svg.contains(needle), "the plot should show {needle:?}");
    }
    // Three data series and the unlimited line are drawn as polylines.
    assert!(svg.matches("<polyline").count() >= 4, "{svg}");
}

#[test]
fn sweep_refuses_what_it_sets_itself_and_unknown_policies() {
    let dir = tempfile::tempdir().expect("temporary directory");
    for (args, needle) in [
        (
            vec!["--capacities", "1M", "--host-blocks", "5"],
            "--capacities",
        ),
        (
            vec!["--capacities", "1M", "--eviction", "mru"],
            "unknown policy",
        ),
        (vec!["--capacities", "0"], "between 1 and"),
        (vec!["--capacities", "10"], "less than one block"),
    ] {
        let out = kvbm(dir.path())
            .args(["sweep", "--quiet", "--requests", "4"])
            .args(args.iter())
            .output()
            .expect("run kvbm");
        let stderr = text(&out.stderr);
        assert!(
            matches!(out.status.code(), Some(c) if c != 0) && stderr.contains(needle),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn sweep_compares_eviction_policies_one_line_each() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let plot = dir.path().join("policies.svg");
    let out = hand_sweep(dir.path())
        .args([
            "--capacities",
            "1536,2048",
            "--eviction",
            "lru,2q,prefix,LRU",
            "--plot",
        ])
        .arg(&plot)
        .output()
        .expect("run kvbm");
    assert_ok(&out, "kvbm sweep --eviction");
    let table = text(&out.stdout);
    for policy in ["lru", "2q", "prefix"] {
        let rows = table
            .lines()
            .filter(|l| l.split_whitespace().next() == Some(policy))
            .count();
        assert_eq!(
            rows, 2,
            "one row per capacity for {policy} (duplicates dropped):\n{table}"
        );
    }
    // LRU's rows are the hand-computed ones whatever the configuration's default policy is.
    assert!(
        table.contains("lru                1536           3            0           0    40.98%")
    );
    let svg = std::fs::read_to_string(&plot).expect("plot");
    for name in ["lru, host only", "2q, host only", "prefix, host only"] {
        assert!(svg.contains(name), "legend should name {name:?}");
    }
}
