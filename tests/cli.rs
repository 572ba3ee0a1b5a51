//! Integration tests that run the real `kvbm` binary (`CARGO_BIN_EXE_kvbm`, built in the test's
//! profile): the default replay, both engines on every built-in workload, the matching rule on a
//! hand-computed and a random trace, malformed traces and configurations, the report's JSON schema
//! (insta snapshot), `kvbm bench` and `--help`.
//!
//! Every run gets its own temporary directory (disk tier, reports, traces) and an environment
//! without any configuration variable, except `KVBM_DISK_CACHE_DIR` pointing at that directory,
//! so nothing lands in the default `$TMPDIR/kvbm-<uid>`.

#![cfg(feature = "cli")]

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

use kvbm_connector::config::{CONFIG_FILE_VAR, ENV_VARS};
use kvbm_connector::log::LOG_ENV;
use serde_json::{json, Value};
use workload::{generate, generate_workload, WorkloadKind, WorkloadSize};

/// The tool's workload generators and model stand-in, compiled from the tool's own source (the
/// tool is a binary, not a library): the reports of the binary are compared with them. Their
/// unit tests are here, at the end of this file.
#[path = "../tool/replay/workload.rs"]
mod workload;

/// The tool's trace parser, compiled from its source for the fuzz tests at the end of this file.
#[path = "../tool/replay/trace.rs"]
mod trace;

const BIN: &str = env!("CARGO_BIN_EXE_kvbm");
const FRAMEWORKS: [&str; 2] = ["trtllm", "vllm"];

// ------------------------------------------------------------------------------------------------
// Helpers
// ------------------------------------------------------------------------------------------------

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

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("temporary directory")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Fails with the command's output unless it exited 0.
fn assert_ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status.code(),
        text(&out.stdout),
        text(&out.stderr)
    );
}

/// A clean failure: a non-zero exit code (not a signal), every needle on stderr, no panic.
fn assert_clean_failure(out: &Output, what: &str, needles: &[&str]) {
    let stderr = text(&out.stderr);
    assert!(
        matches!(out.status.code(), Some(c) if c != 0),
        "{what}: expected a non-zero exit, got {:?}\n--- stderr\n{stderr}",
        out.status.code()
    );
    assert!(
        !stderr.contains("panicked"),
        "{what}: panic on stderr:\n{stderr}"
    );
    for n in needles {
        assert!(
            stderr.contains(n),
            "{what}: stderr should mention {n:?}:\n{stderr}"
        );
    }
}

fn read_report(path: &Path) -> Value {
    let s =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("report {}: {e}", path.display()));
    serde_json::from_str(&s).unwrap_or_else(|e| panic!("report {}: {e}\n{s}", path.display()))
}

fn u(v: &Value) -> usize {
    v.as_u64()
        .unwrap_or_else(|| panic!("expected an unsigned integer, got {v}")) as usize
}

/// Per-request entries of a report, by id.
fn requests_by_id(report: &Value) -> HashMap<String, Value> {
    report["requests"]
        .as_array()
        .expect("requests array")
        .iter()
        .map(|r| (r["id"].as_str().expect("id").to_string(), r.clone()))
        .collect()
}

/// The first number after `label` on the table line that starts with it.
fn table_value(table: &str, label: &str) -> f64 {
    let line = table
        .lines()
        .map(str::trim_start)
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("no {label:?} line in the table:\n{table}"));
    line[label.len()..]
        .split_whitespace()
        .next()
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no number on {line:?}"))
}

/// Writes a JSONL trace: (id, arrival, prompt, max_tokens) per line.
fn write_trace(path: &Path, reqs: &[(String, u64, Vec<u32>, usize)]) {
    let mut s = String::new();
    for (id, arrival, prompt, max_tokens) in reqs {
        s.push_str(
            &json!({"id": id, "arrival": arrival, "prompt": prompt, "max_tokens": max_tokens})
                .to_string(),
        );
        s.push('\n');
    }
    std::fs::write(path, s).expect("write trace");
}

/// Checks the invariants every successful report must satisfy; returns the per-request entries.
fn check_report_invariants(report: &Value, what: &str) -> Vec<Value> {
    let s = &report["summary"];
    let reqs = report["requests"].as_array().expect("requests").clone();
    assert_eq!(u(&s["integrity_errors"]), 0, "{what}: integrity errors");
    assert_eq!(u(&s["requests"]), reqs.len(), "{what}: summary.requests");
    let prompt: usize = reqs.iter().map(|r| u(&r["prompt_tokens"])).sum();
    let matched: usize = reqs.iter().map(|r| u(&r["matched_tokens"])).sum();
    let host: usize = reqs.iter().map(|r| u(&r["matched_from"]["host"])).sum();
    let disk: usize = reqs.iter().map(|r| u(&r["matched_from"]["disk"])).sum();
    assert_eq!(u(&s["prompt_tokens"]), prompt, "{what}: prompt_tokens sum");
    assert_eq!(
        u(&s["matched_tokens"]),
        matched,
        "{what}: matched_tokens sum"
    );
    assert_eq!(u(&s["matched_from"]["host"]), host, "{what}: host sum");
    assert_eq!(u(&s["matched_from"]["disk"]), disk, "{what}: disk sum");
    for r in &reqs {
        let id = &r["id"];
        assert_eq!(
            u(&r["matched_from"]["host"]) + u(&r["matched_from"]["disk"]),
            u(&r["matched_tokens"]),
            "{what}: request {id}: host + disk == matched"
        );
        assert!(
            u(&r["matched_tokens"]) < u(&r["prompt_tokens"]) || u(&r["preemptions"]) > 0,
            "{what}: request {id}: a match never covers the whole prompt"
        );
        let ttft = r["ttft_ms"].as_f64().expect("ttft_ms");
        assert!(ttft.is_finite() && ttft >= 0.0, "{what}: {id} ttft {ttft}");
    }
    let hit_rate = s["hit_rate"].as_f64().expect("hit_rate");
    if prompt > 0 {
        assert!(
            (hit_rate - matched as f64 / prompt as f64).abs() < 1e-9,
            "{what}: hit_rate"
        );
    }
    let wall = s["wall_s"].as_f64().expect("wall_s");
    assert!(wall.is_finite() && wall >= 0.0, "{what}: wall_s {wall}");
    reqs
}

// ------------------------------------------------------------------------------------------------
// 1. The default replay
// ------------------------------------------------------------------------------------------------

#[test]
fn default_replay_passes_integrity_and_hits_host_and_disk() {
    let dir = tmp();
    // Truly no arguments (only the environment keeps the disk file out of the default $TMPDIR/kvbm-<uid>).
    let t = Instant::now();
    let out = kvbm(dir.path()).arg("replay").output().expect("run kvbm");
    let wall = t.elapsed();
    println!(
        "default `kvbm replay` wall time: {:.2} s",
        wall.as_secs_f64()
    );
    assert_ok(&out, "kvbm replay");
    let table = text(&out.stdout);
    assert!(
        table.starts_with("kvbm replay — trtllm engine, 400 requests"),
        "table header:\n{table}"
    );
    assert_eq!(table_value(&table, "integrity errors"), 0.0, "{table}");
    assert!(
        table_value(&table, "from host") > 0.0,
        "host hits:\n{table}"
    );
    assert!(
        table_value(&table, "from disk") > 0.0,
        "disk hits:\n{table}"
    );
    assert!(table_value(&table, "matched by kvbm") > 0.0, "{table}");

    // The same run with a report: the JSON agrees with the table.
    let report = dir.path().join("r.json");
    let out = kvbm(dir.path())
        .args(["replay", "--quiet", "--report"])
        .arg(&report)
        .arg("--disk-dir")
        .arg(dir.path())
        .output()
        .expect("run kvbm");
    assert_ok(&out, "kvbm replay --report");
    assert!(out.stdout.is_empty(), "--quiet prints no table");
    let r = read_report(&report);
    check_report_invariants(&r, "default replay");
    let s = &r["summary"];
    assert_eq!(u(&s["requests"]), 400);
    assert!(u(&s["matched_from"]["host"]) > 0, "host hits: {s}");
    assert!(u(&s["matched_from"]["disk"]) > 0, "disk hits: {s}");
    assert!(
        u(&s["blocks_verified"]) > 0,
        "onboarded blocks verified: {s}"
    );
    // Nothing is left behind in the disk directory but the report (persist is off).
    let left: Vec<PathBuf> = std::fs::read_dir(dir.path())
        .expect("read dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p != &report)
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// The lines of the README's sample `kvbm replay` output (the code block that starts with
/// `kvbm replay —`), each without its `<- …` note and trailing spaces; `...` lines dropped.
fn readme_sample() -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let readme = std::fs::read_to_string(&path).expect("read README.md");
    let start = readme
        .find("```\nkvbm replay —")
        .expect("the README shows a sample `kvbm replay` output in a ``` block");
    let block = &readme[start + 4..];
    let end = block.find("```").expect("the sample block ends");
    block[..end]
        .lines()
        .map(|l| l.split("<-").next().unwrap_or(l).trim_end().to_string())
        .filter(|l| !l.trim().is_empty() && l.trim() != "...")
        .collect()
}

/// A table line's label: the text before the first run of two spaces.
fn label_of(line: &str) -> &str {
    let t = line.trim_start();
    t.split("  ").next().unwrap_or(t)
}

/// Every line of the README's sample output appears in a real default run's table, in the same
/// order, and each figure a run fixes — the header's request and step counts, the prompt,
/// matched, device-hit and computed token counts, the integrity line (errors and blocks
/// verified), the simulated TTFT — is that run's, character for character. The split of the
/// matched tokens between host and disk, the block counts per path and every timing depend on
/// when the background copies finish, so for those lines only the label is checked.
#[test]
fn readme_sample_output_matches_a_real_run() {
    const EXACT: [&str; 6] = [
        "prompt tokens",
        "matched by kvbm",
        "device cache hits",
        "tokens computed",
        "integrity errors",
        "mean TTFT (simulated)",
    ];
    let sample = readme_sample();
    assert!(sample.len() > 10, "sample too short: {sample:?}");
    let dir = tmp();
    let out = kvbm(dir.path()).arg("replay").output().expect("run kvbm");
    assert_ok(&out, "kvbm replay");
    let table = text(&out.stdout);
    let run: Vec<&str> = table.lines().map(str::trim_end).collect();
    assert_eq!(
        run.first().copied(),
        Some(sample[0].as_str()),
        "header:\n{table}"
    );
    let mut at = 0;
    let mut exact = 0;
    for want in &sample[1..] {
        let label = label_of(want);
        let found = run[at + 1..]
            .iter()
            .position(|l| label_of(l) == label)
            .map(|k| at + 1 + k)
            .unwrap_or_else(|| {
                panic!(
                    "README line {want:?}: no {label:?} line after line {at} in the run:\n{table}"
                )
            });
        if EXACT.contains(&label) {
            let norm = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
            assert_eq!(
                norm(want),
                norm(run[found]),
                "README line vs the run:\n{table}"
            );
            exact += 1;
        }
        at = found;
    }
    assert_eq!(
        exact,
        EXACT.len(),
        "the README shows every fixed figure: {sample:?}"
    );
}

// ------------------------------------------------------------------------------------------------
// 2. Both engines on every built-in workload
// ------------------------------------------------------------------------------------------------

#[test]
fn both_frameworks_on_every_builtin_workload() {
    const REQUESTS: usize = 40;
    let seed = 3;
    for framework in FRAMEWORKS {
        for (name, kind) in [
            ("multi-turn", WorkloadKind::MultiTurn),
            ("shared-prefix", WorkloadKind::SharedPrefix),
            ("random", WorkloadKind::Random),
        ] {
            let what = format!("{framework} {name}");
            let dir = tmp();
            let report = dir.path().join("r.json");
            let out = kvbm(dir.path())
                .args([
                    "replay",
                    "--quiet",
                    "--framework",
                    framework,
                    "--workload",
                    name,
                ])
                .args([
                    "--requests",
                    &REQUESTS.to_string(),
                    "--seed",
                    &seed.to_string(),
                ])
                .args(["--disk-blocks", "1024", "--disk-dir"])
                .arg(dir.path())
                .arg("--report")
                .arg(&report)
                .output()
                .expect("run kvbm");
            assert_ok(&out, &what);
            let r = read_report(&report);
            let reqs = check_report_invariants(&r, &what);
            assert_eq!(u(&r["summary"]["requests"]), REQUESTS, "{what}");
            assert_eq!(r["summary"]["framework"], framework, "{what}");
            // The report's requests are exactly the generator's, with their prompt lengths.
            let workload = generate_workload(
                kind,
                seed,
                WorkloadSize {
                    requests: REQUESTS,
                    arrival_gap: 4,
                },
            );
            let by_id = requests_by_id(&r);
            assert_eq!(by_id.len(), REQUESTS, "{what}: distinct ids");
            for w in &workload {
                let e = by_id
                    .get(&w.id)
                    .unwrap_or_else(|| panic!("{what}: request {} missing", w.id));
                assert_eq!(u(&e["prompt_tokens"]), w.prompt.len(), "{what}: {}", w.id);
                assert_eq!(u(&e["output_tokens"]), w.max_tokens, "{what}: {}", w.id);
                assert_eq!(
                    u(&e["matched_tokens"]) % 16,
                    0,
                    "{what}: {} whole blocks",
                    w.id
                );
            }
            // Without preemptions and load errors every prompt token is matched, found on the
            // device or computed once, and each generated token but the last is computed.
            for e in &reqs {
                if u(&e["preemptions"]) == 0 && u(&e["load_errors"]) == 0 {
                    assert_eq!(
                        u(&e["computed_tokens"]),
                        u(&e["prompt_tokens"])
                            - u(&e["matched_tokens"])
                            - u(&e["device_hit_tokens"])
                            + u(&e["output_tokens"])
                            - 1,
                        "{what}: request {}: computed tokens",
                        e["id"]
                    );
                }
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// 3 and 4. The matching rule
// ------------------------------------------------------------------------------------------------

/// The rule of the issue, as a tiny model: a request's `matched_tokens` is the longest prefix of
/// its full blocks already offloaded by earlier requests, minus the last block when that would
/// cover the whole prompt. With one output token a request offloads exactly its full prompt
/// blocks (the generated token's KV is never computed). Blocks are keyed by their token prefix.
fn expected_matches(bs: usize, prompts: &[&[u32]]) -> Vec<usize> {
    let mut offloaded: HashSet<Vec<u32>> = HashSet::new();
    prompts
        .iter()
        .map(|p| {
            let full = p.len() / bs;
            let mut k = 0;
            while k < full && offloaded.contains(&p[..(k + 1) * bs]) {
                k += 1;
            }
            if k * bs == p.len() {
                k -= 1;
            }
            for j in 1..=full {
                offloaded.insert(p[..j * bs].to_vec());
            }
            k * bs
        })
        .collect()
}

const RULE_BS: usize = 4;
const RULE_GAP: u64 = 50;

/// Replays `prompts` (one output token each, `RULE_GAP` steps apart, device prefix cache off,
/// ample host, no disk) and returns each request's matched tokens.
///
/// With `keep_busy`, a long-decoding request with its own tokens (which share no block with the
/// others) keeps the engine stepping between arrivals, so the connector's completions have real
/// time to land; without it the engine skips idle stretches in no time at all.
fn replay_rule_trace(framework: &str, prompts: &[&[u32]], keep_busy: bool) -> Vec<usize> {
    let dir = tmp();
    let trace = dir.path().join("t.jsonl");
    let report = dir.path().join("r.json");
    let mut reqs: Vec<(String, u64, Vec<u32>, usize)> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| (format!("q{i}"), i as u64 * RULE_GAP, p.to_vec(), 1))
        .collect();
    let last_arrival = prompts.len() as u64 * RULE_GAP;
    if keep_busy {
        let filler_tokens = last_arrival as usize + 10;
        reqs.insert(
            0,
            (
                "busy".into(),
                0,
                vec![31_999, 31_998, 31_997],
                filler_tokens,
            ),
        );
    }
    write_trace(&trace, &reqs);
    let out = kvbm(dir.path())
        .args(["replay", "--quiet", "--framework", framework, "--trace"])
        .arg(&trace)
        .args(["--block-size", &RULE_BS.to_string()])
        .args(["--device-prefix-cache", "off"])
        .args(["--host-blocks", "8192", "--disk-blocks", "0"])
        .args(["--device-blocks", "1024"])
        .arg("--disk-dir")
        .arg(dir.path())
        .arg("--report")
        .arg(&report)
        .output()
        .expect("run kvbm");
    assert_ok(&out, &format!("{framework} rule trace"));
    let r = read_report(&report);
    check_report_invariants(&r, framework);
    let by_id = requests_by_id(&r);
    (0..prompts.len())
        .map(|i| {
            let e = &by_id[&format!("q{i}")];
            assert_eq!(u(&e["device_hit_tokens"]), 0, "device prefix cache is off");
            assert_eq!(u(&e["preemptions"]), 0);
            u(&e["matched_tokens"])
        })
        .collect()
}

/// The hand-computed trace (block size 4) and its expected matches.
fn hand_trace() -> (Vec<Vec<u32>>, Vec<usize>) {
    let r = |a: u32, b: u32| (a..=b).collect::<Vec<u32>>();
    let cat = |parts: &[&[u32]]| parts.concat();
    // A 7-token prompt whose generated token `g` a later prompt continues with.
    let p7 = r(300, 306);
    let g = generate(&p7, 1)[0];
    let prompts = vec![
        // q0: [1..12], 3 full blocks; nothing offloaded yet -> 0.
        //     Offloads [1-4] [5-8] [9-12].
        r(1, 12),
        // q1: identical to q0. All 3 full blocks offloaded, but 3×4 = 12 = the whole prompt:
        //     drop the last -> 2×4 = 8.
        r(1, 12),
        // q2: [1..14]: 3 full blocks, all offloaded; 12 < 14 -> 12. (Partial block [13,14].)
        r(1, 14),
        // q3: [1..6], a prefix of q0: 1 full block [1-4], offloaded; 4 < 6 -> 4.
        r(1, 6),
        // q4: [1..8], a prefix of q0 that is an exact multiple of the block size: 2 full blocks,
        //     both offloaded, 8 = the whole prompt: drop the last -> 4.
        r(1, 8),
        // q5: [1..6, 99..102]: diverges from q0 in the middle of block 1 (position 6).
        //     Blocks [1-4] yes, [5,6,99,100] no -> 4. Offloads [5,6,99,100] after [1-4].
        cat(&[&r(1, 6), &r(99, 102)]),
        // q6: [1..8, 200..204]: diverges at a block boundary. [1-4] yes, [5-8] yes,
        //     [200-203] no -> 8. Offloads [200-203] after [1-8].
        cat(&[&r(1, 8), &r(200, 204)]),
        // q7: [50, 2..12]: differs in the first token -> 0.
        cat(&[&[50], &r(2, 12)]),
        // q8: q5 + [103, 104]: [1-4] yes, [5,6,99,100] yes (q5), [101-104] no -> 8.
        cat(&[&r(1, 6), &r(99, 104)]),
        // q9: identical to q6 (13 tokens): 3 full blocks, all offloaded (q6); 12 < 13 -> 12.
        cat(&[&r(1, 8), &r(200, 204)]),
        // q10: [300..306]: new -> 0. 7 tokens = 1 full block [300-303] offloaded; the second
        //      block [304,305,306,g] is full only with the generated token, whose KV is never
        //      computed: not offloaded.
        p7.clone(),
        // q11: [300..306, g, 400, 401]: [300-303] yes, [304,305,306,g] no -> 4.
        //      Its prefill computes [304,305,306,g] and offloads it.
        cat(&[&p7, &[g, 400, 401]]),
        // q12: identical to q11 (10 tokens): 2 full blocks, both offloaded; 8 < 10 -> 8.
        cat(&[&p7, &[g, 400, 401]]),
    ];
    let expected = vec![0, 8, 12, 4, 4, 4, 8, 0, 8, 12, 0, 4, 8];
    (prompts, expected)
}

fn check_hand_trace(keep_busy: bool) {
    let (prompts, expected) = hand_trace();
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    // The model agrees with the arithmetic above.
    assert_eq!(expected_matches(RULE_BS, &refs), expected, "the model");
    for framework in FRAMEWORKS {
        let got = replay_rule_trace(framework, &refs, keep_busy);
        assert_eq!(got, expected, "{framework}: matched tokens per request");
    }
}

/// The same with a long-decoding request keeping the engine stepping between arrivals.
#[test]
fn hand_computed_trace_matches_the_rule() {
    check_hand_trace(true);
}

/// The rule exactly as the issue states it: requests far apart with nothing running in between,
/// so the engine skips each idle stretch at once.
#[test]
fn hand_computed_trace_matches_the_rule_with_an_idle_engine() {
    check_hand_trace(false);
}

/// SplitMix64, for the seeded random trace.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// ~30 prompts over a 3-token vocabulary: about half continue a prefix of an earlier prompt, so
/// prefixes collide often, at block boundaries and inside blocks.
fn random_prompts(seed: u64, n: usize) -> Vec<Vec<u32>> {
    let mut rng = Rng(seed);
    let mut out: Vec<Vec<u32>> = Vec::with_capacity(n);
    for _ in 0..n {
        let mut p = if !out.is_empty() && rng.below(2) == 0 {
            let base = &out[rng.below(out.len())];
            base[..1 + rng.below(base.len())].to_vec()
        } else {
            Vec::new()
        };
        let extra = usize::from(p.is_empty()) + rng.below(12);
        p.extend((0..extra).map(|_| 1 + rng.below(3) as u32));
        out.push(p);
    }
    out
}

fn check_random_trace(keep_busy: bool) {
    for seed in [7u64, 8] {
        let prompts = random_prompts(seed, 30);
        let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
        let expected = expected_matches(RULE_BS, &refs);
        assert!(
            expected.iter().filter(|&&m| m > 0).count() >= 5,
            "seed {seed}: the trace should exercise matches: {expected:?}"
        );
        for framework in FRAMEWORKS {
            let got = replay_rule_trace(framework, &refs, keep_busy);
            for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                assert_eq!(
                    g, e,
                    "{framework}, seed {seed}: request q{i} {:?} matched {g}, the model says {e}\n\
                     all: got {got:?}\n     want {expected:?}",
                    prompts[i]
                );
            }
        }
    }
}

#[test]
fn random_trace_matches_the_model() {
    check_random_trace(true);
}

#[test]
fn random_trace_matches_the_model_with_an_idle_engine() {
    check_random_trace(false);
}

/// The smallest case of the idle rule, repeated: `a` offloads its one full block; `b`, 50 idle
/// steps later, matches it. (A worker that let the engine see a store as done before sending its
/// completion to the leader, with an idle skip that lets no time pass, made vLLM miss it in most
/// runs of an earlier engine stand-in.)
#[test]
fn far_apart_request_sees_the_previous_offload() {
    let prompt: Vec<u32> = (1..=7).collect();
    for framework in FRAMEWORKS {
        for attempt in 0..10 {
            let got = replay_rule_trace(framework, &[&prompt, &prompt], false);
            assert_eq!(got, vec![0, 4], "{framework}, attempt {attempt}");
        }
    }
}

/// After the run, every block offloaded to host has been copied down to disk (ample disk,
/// `min_frequency` 1), and the report counts those copies.
#[test]

fn report_counts_the_last_host_to_disk_copies() {
    for framework in FRAMEWORKS {
        let dir = tmp();
        let trace = dir.path().join("t.jsonl");
        let report = dir.path().join("r.json");
        write_trace(&trace, &[("a".into(), 0, (1..=12).collect(), 1)]);
        let out = kvbm(dir.path())
            .args(["replay", "--quiet", "--framework", framework, "--trace"])
            .arg(&trace)
            .args(["--block-size", "4", "--device-prefix-cache", "off"])
            .args(["--host-blocks", "64", "--disk-blocks", "64", "--disk-dir"])
            .arg(dir.path())
            .arg("--report")
            .arg(&report)
            .output()
            .expect("run kvbm");
        assert_ok(&out, framework);
        let r = read_report(&report);
        let blocks = |path: &str| {
            r["summary"]["offloaded"]
                .as_array()
                .expect("offloaded")
                .iter()
                .find(|p| p["path"] == path)
                .map_or(0, |p| u(&p["blocks"]))
        };
        assert_eq!(blocks("device->host"), 3, "{framework}");
        assert_eq!(blocks("host->disk"), 3, "{framework}: {}", r["summary"]);
    }
}

// ------------------------------------------------------------------------------------------------
// 5. Malformed traces
// ------------------------------------------------------------------------------------------------

#[test]
fn malformed_traces_fail_cleanly() {
    let good = r#"{"id":"a","arrival":0,"prompt":[1,2,3],"max_tokens":1}"#;
    let cases: Vec<(&str, String, Vec<&str>)> = vec![
        ("not json", format!("{good}\nnot json\n"), vec!["line 2"]),
        (
            "missing field",
            format!("{good}\n{}\n", r#"{"id":"b","arrival":0,"prompt":[1]}"#),
            vec!["line 2", "missing field", "max_tokens"],
        ),
        (
            "negative arrival",
            r#"{"id":"a","arrival":-1,"prompt":[1],"max_tokens":1}"#.to_string(),
            vec!["line 1", "-1"],
        ),
        (
            "empty prompt",
            format!(
                "{good}\n\n{}\n",
                r#"{"id":"b","arrival":0,"prompt":[],"max_tokens":1}"#
            ),
            vec!["line 3", "empty prompt"],
        ),
        (
            "max_tokens 0",
            r#"{"id":"a","arrival":0,"prompt":[1],"max_tokens":0}"#.to_string(),
            vec!["line 1", "max_tokens"],
        ),
        (
            "duplicate id",
            format!(
                "{good}\n{}\n",
                r#"{"id":"a","arrival":5,"prompt":[4],"max_tokens":1}"#
            ),
            vec!["line 2", "duplicate id", "\"a\""],
        ),
        (
            "unknown field",
            r#"{"id":"a","arrival":0,"prompt":[1],"max_tokens":1,"temperature":0.5}"#.to_string(),
            vec!["line 1", "unknown field", "temperature"],
        ),
        (
            "wrong type",
            r#"{"id":"a","arrival":0,"prompt":"1 2 3","max_tokens":1}"#.to_string(),
            vec!["line 1", "\"prompt\"", "must be an array"],
        ),
        ("empty file", String::new(), vec!["no requests"]),
        (
            "blank lines only",
            "\n  \n\n".to_string(),
            vec!["no requests"],
        ),
    ];
    for (what, body, needles) in cases {
        let dir = tmp();
        let trace = dir.path().join("t.jsonl");
        let report = dir.path().join("r.json");
        std::fs::write(&trace, body).expect("write trace");
        let out = kvbm(dir.path())
            .args(["replay", "--trace"])
            .arg(&trace)
            .arg("--disk-dir")
            .arg(dir.path())
            .arg("--report")
            .arg(&report)
            .output()
            .expect("run kvbm");
        assert_clean_failure(&out, what, &needles);
        assert!(!report.exists(), "{what}: a report was written");
        assert!(
            out.stdout.is_empty(),
            "{what}: stdout {}",
            text(&out.stdout)
        );
    }
    // A trace that does not exist.
    let dir = tmp();
    let report = dir.path().join("r.json");
    let missing = dir.path().join("missing.jsonl");
    let out = kvbm(dir.path())
        .args(["replay", "--trace"])
        .arg(&missing)
        .arg("--report")
        .arg(&report)
        .output()
        .expect("run kvbm");
    assert_clean_failure(&out, "missing trace", &["missing.jsonl"]);
    assert!(!report.exists());
}

/// A type error in a trace line names the line and the offending value but not the field.
#[test]

fn trace_type_errors_name_the_field() {
    for (line, field) in [
        (
            r#"{"id":"a","arrival":-1,"prompt":[1],"max_tokens":1}"#,
            "arrival",
        ),
        (
            r#"{"id":"a","arrival":0,"prompt":"1 2","max_tokens":1}"#,
            "prompt",
        ),
        (
            r#"{"id":"a","arrival":0,"prompt":[1],"max_tokens":-3}"#,
            "max_tokens",
        ),
    ] {
        let dir = tmp();
        let trace = dir.path().join("t.jsonl");
        std::fs::write(&trace, line).expect("write trace");
        let out = kvbm(dir.path())
            .args(["replay", "--trace"])
            .arg(&trace)
            .output()
            .expect("run kvbm");
        assert_clean_failure(&out, field, &["line 1", field]);
    }
}

/// Files the disk tier left in `dir` (`kvbm-*.blocks`).
fn block_files(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "blocks"))
                .collect()
        })
        .unwrap_or_default()
}

/// Issue 13, item 1: sizes from a trace or a flag are bounded before anything is allocated; each
/// is a clean input error (exit 2) naming the field, and no disk file is left behind. Before the
/// fix `max_tokens` 2^62 panicked ("capacity overflow"), 1e12 aborted (SIGABRT) leaving its disk
/// file, u64::MAX wrapped into "ran out of reserved blocks", `--requests 1e12` aborted.
#[test]
fn sizes_from_input_are_bounded() {
    let huge: Vec<(&str, String, Vec<&str>)> = vec![
        (
            "max_tokens 2^62",
            (1u64 << 62).to_string(),
            vec!["line 1", "max_tokens", "16777216"],
        ),
        (
            "max_tokens 1e12",
            "1000000000000".into(),
            vec!["line 1", "max_tokens"],
        ),
        (
            "max_tokens u64::MAX",
            u64::MAX.to_string(),
            vec!["line 1", "max_tokens"],
        ),
        (
            "prompt + max_tokens",
            "16777215".into(),
            vec!["line 1", "prompt", "max_tokens"],
        ),
    ];
    for (what, max_tokens, needles) in huge {
        let dir = tmp();
        let trace = dir.path().join("t.jsonl");
        std::fs::write(
            &trace,
            format!(r#"{{"id":"a","arrival":0,"prompt":[1,2],"max_tokens":{max_tokens}}}"#),
        )
        .expect("write trace");
        let out = kvbm(dir.path())
            .args(["replay", "--trace"])
            .arg(&trace)
            .output()
            .expect("run kvbm");
        assert_clean_failure(&out, what, &needles);
        assert_eq!(out.status.code(), Some(2), "{what}");
        assert!(block_files(dir.path()).is_empty(), "{what}: disk file left");
    }
    // Within the per-request limit but beyond the device: named, nothing started.
    let dir = tmp();
    let trace = dir.path().join("t.jsonl");
    std::fs::write(
        &trace,
        r#"{"id":"a","arrival":0,"prompt":[1,2],"max_tokens":16000000}"#,
    )
    .expect("write trace");
    let out = kvbm(dir.path())
        .args(["replay", "--trace"])
        .arg(&trace)
        .output()
        .expect("run kvbm");
    assert_clean_failure(&out, "beyond the device", &["\"a\"", "--device-blocks"]);
    assert!(block_files(dir.path()).is_empty());
    // An arrival step past the limit (u64::MAX overflowed the step counter).
    let dir = tmp();
    let trace = dir.path().join("t.jsonl");
    std::fs::write(
        &trace,
        format!(
            "{}\n{}\n",
            r#"{"id":"a","arrival":0,"prompt":[1,2],"max_tokens":2}"#,
            r#"{"id":"b","arrival":18446744073709551615,"prompt":[1,2],"max_tokens":2}"#
        ),
    )
    .expect("write trace");
    let out = kvbm(dir.path())
        .args(["replay", "--trace"])
        .arg(&trace)
        .output()
        .expect("run kvbm");
    assert_clean_failure(&out, "arrival u64::MAX", &["line 2", "arrival"]);
    for (flag, value) in [
        ("--arrival-gap", "18446744073709551615"),
        ("--device-blocks", "100000000000000000"),
    ] {
        let dir = tmp();
        let out = kvbm(dir.path())
            .args(["replay", "--requests", "4", flag, value])
            .output()
            .expect("run kvbm");
        assert_clean_failure(&out, flag, &[flag]);
        assert_eq!(out.status.code(), Some(2), "{flag}");
        assert!(block_files(dir.path()).is_empty(), "{flag}: disk file left");
    }
    for n in ["1000000000000", "1000001", "0"] {
        let dir = tmp();
        let out = kvbm(dir.path())
            .args(["replay", "--requests", n])
            .output()
            .expect("run kvbm");
        assert_clean_failure(&out, &format!("--requests {n}"), &["--requests", "1000000"]);
        assert_eq!(out.status.code(), Some(2));
        assert!(
            block_files(dir.path()).is_empty(),
            "--requests {n}: disk file left"
        );
    }
}

/// A replay whose tiers and requests would hold more than `--memory-limit` is refused before
/// any tier is built, naming the flag that costs most; the same replay runs under a limit it fits.
#[test]
fn a_replay_that_cannot_fit_in_memory_is_refused_naming_the_flag() {
    // 2,000,000 host blocks: about 550 MiB of the tier's bookkeeping alone (prefix policy),
    // allocated and touched when the tier is built, whatever the workload.
    for (flag, value, limit) in [
        ("--host-blocks", "2000000", "256M"),
        ("--disk-blocks", "2000000", "256M"),
        ("--max-waiting-tokens", "100000000", "512M"),
    ] {
        let dir = tmp();
        let out = kvbm(dir.path())
            .args([
                "replay",
                "--requests",
                "4",
                "--memory-limit",
                limit,
                flag,
                value,
            ])
            .output()
            .expect("run kvbm");
        assert_clean_failure(
            &out,
            flag,
            &[&format!("lower {flag}"), "--memory-limit allows"],
        );
        assert_eq!(out.status.code(), Some(2), "{flag}");
        assert!(block_files(dir.path()).is_empty(), "{flag}: disk file left");
    }
    let dir = tmp();
    let out = kvbm(dir.path())
        .args([
            "replay",
            "--requests",
            "4",
            "--memory-limit",
            "1G",
            "--quiet",
        ])
        .output()
        .expect("run kvbm");
    assert!(out.status.success(), "{}", text(&out.stderr));
}

// ------------------------------------------------------------------------------------------------
// 6. Malformed and good configurations
// ------------------------------------------------------------------------------------------------

/// (what, config file contents or None for a missing file, env, stderr needles)
type ConfigCase = (
    &'static str,
    Option<&'static str>,
    Vec<(&'static str, &'static str)>,
    Vec<&'static str>,
);

fn bad_config_cases() -> Vec<ConfigCase> {
    vec![
        (
            "unknown key",
            Some("hash = \"xxh3\"\nbogus_key = 1\n"),
            vec![],
            vec!["bogus_key"],
        ),
        (
            "unknown key in a table",
            Some("[host]\ncache_gigs = 4\n"),
            vec![],
            vec!["cache_gigs"],
        ),
        (
            "negative cache_gb",
            Some("[host]\ncache_gb = -2.5\n"),
            vec![],
            vec!["host.cache_gb", "-2.5"],
        ),
        ("missing file", None, vec![], vec!["missing.toml"]),
        (
            "KVBM_HOST_CACHE_GB=abc",
            Some(""),
            vec![("KVBM_HOST_CACHE_GB", "abc")],
            vec!["KVBM_HOST_CACHE_GB", "abc"],
        ),
        (
            "DYN_KVBM_DISK_CACHE_GB=-1",
            Some(""),
            vec![("DYN_KVBM_DISK_CACHE_GB", "-1")],
            vec!["DYN_KVBM_DISK_CACHE_GB", "-1"],
        ),
        (
            "KVBM_HASH=md5",
            Some(""),
            vec![("KVBM_HASH", "md5")],
            vec!["KVBM_HASH", "md5"],
        ),
        // Issue 13, item 11: the TOML file refuses what the environment refuses.
        (
            "empty disk.dir in the file",
            Some("[disk]\ndir = \"\"\n"),
            vec![],
            vec!["disk.dir", "must be a directory path"],
        ),
        (
            "KVBM_DISK_CACHE_DIR empty",
            Some(""),
            vec![("KVBM_DISK_CACHE_DIR", "")],
            vec!["KVBM_DISK_CACHE_DIR", "must be a directory path"],
        ),
        // Issue 13, item 11: a size no process can address names its setting.
        (
            "huge host.cache_gb",
            Some("[host]\ncache_gb = 1e300\n"),
            vec![],
            vec!["host.cache_gb", "1e300"],
        ),
        (
            "huge KVBM_DISK_CACHE_GB",
            Some(""),
            vec![("KVBM_DISK_CACHE_GB", "1e12")],
            vec!["disk.cache_gb"],
        ),
        (
            "huge disk.cache_blocks",
            Some("[disk]\ncache_blocks = 9223372036854775807\n"),
            vec![],
            vec!["disk.cache_blocks"],
        ),
    ]
}

/// Issue 13, item 11: `--disk-dir` creates only its last component (mode 0700); a missing
/// parent is an error naming the path, and nothing is created.
#[test]
fn disk_dir_creates_only_its_last_component() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tmp();
    let nested = dir.path().join("a").join("b");
    let out = kvbm(dir.path())
        .args(["replay", "--requests", "4", "--quiet", "--disk-dir"])
        .arg(&nested)
        .output()
        .expect("run kvbm");
    assert_clean_failure(
        &out,
        "nested --disk-dir",
        &["only the last component", "a/b"],
    );
    assert!(!dir.path().join("a").exists(), "a parent was created");
    let last = dir.path().join("new");
    let out = kvbm(dir.path())
        .args(["replay", "--requests", "4", "--quiet", "--disk-dir"])
        .arg(&last)
        .output()
        .expect("run kvbm");
    assert_ok(&out, "--disk-dir with a missing last component");
    let mode = std::fs::metadata(&last)
        .expect("created")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700, "created with mode {mode:o}");
    assert!(
        block_files(&last).is_empty(),
        "the disk file was left behind"
    );
}

#[test]
fn malformed_configs_fail_cleanly() {
    for (what, file, env, needles) in bad_config_cases() {
        let dir = tmp();
        let path = dir.path().join(if file.is_some() {
            "c.toml"
        } else {
            "missing.toml"
        });
        if let Some(body) = file {
            std::fs::write(&path, body).expect("write config");
        }
        let report = dir.path().join("r.json");
        let mut replay = kvbm(dir.path());
        replay
            .args(["replay", "--requests", "4", "--config"])
            .arg(&path)
            .arg("--report")
            .arg(&report);
        let mut config = kvbm(dir.path());
        config.args(["config", "--config"]).arg(&path);
        for (k, v) in &env {
            replay.env(k, v);
            config.env(k, v);
        }
        let out = replay.output().expect("run kvbm replay");
        assert_clean_failure(&out, &format!("replay: {what}"), &needles);
        assert!(!report.exists(), "replay: {what}: a report was written");
        let out = config.output().expect("run kvbm config");
        assert_clean_failure(&out, &format!("config: {what}"), &needles);
        assert!(
            out.stdout.is_empty(),
            "config: {what}: printed a configuration"
        );
    }
}

#[test]
fn config_prints_the_effective_configuration() {
    let dir = tmp();
    let path = dir.path().join("kvbm.toml");
    std::fs::write(
        &path,
        "hash = \"xxh3\"\n\n[host]\ncache_gb = 9.0\n\n[disk]\ncache_gb = 1.5\nmin_frequency = 2\n",
    )
    .expect("write config");
    let out = kvbm(dir.path())
        .args(["config", "--bytes-per-block", "1000000", "--config"])
        .arg(&path)
        .env("DYN_KVBM_CPU_CACHE_GB", "2")
        .output()
        .expect("run kvbm config");
    assert_ok(&out, "kvbm config");
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().map(str::trim).collect();
    // The Dynamo variable overrides the file's 9 GB: 2e9 / 1e6 = 2000 host blocks;
    // the file's disk 1.5e9 / 1e6 = 1500.
    for want in [
        "host_blocks = 2000",
        "disk_blocks = 1500",
        "hash = \"xxh3\"",
        "cache_gb = 2.0",
        "cache_gb = 1.5",
        "min_frequency = 2",
    ] {
        assert!(lines.contains(&want), "missing {want:?} in:\n{stdout}");
    }
    assert!(
        stdout.contains("DYN_KVBM_CPU_CACHE_GB") && stdout.contains("Dynamo"),
        "the Dynamo variable is listed as in effect:\n{stdout}"
    );
    assert!(!stdout.contains("cache_gb = 9.0"), "{stdout}");
}

#[test]
fn config_shows_the_remote_settings_never_a_password_or_secret() {
    let dir = tmp();
    let out = kvbm(dir.path())
        .args(["config", "--bytes-per-block", "1000000"])
        .env("KVBM_REMOTE_URL", "redis://kvbm:hunter2@10.0.0.5:6379/1")
        .env("KVBM_REMOTE_SECRET", "mac-key-s3cret")
        .env("KVBM_REMOTE_LOOKUP_TIMEOUT_MS", "7")
        .env("KVBM_REMOTE_MIN_FREQUENCY", "2")
        .output()
        .expect("run kvbm config");
    assert_ok(&out, "kvbm config");
    let stdout = text(&out.stdout);
    assert!(!stdout.contains("hunter2"), "{stdout}");
    assert!(!stdout.contains("mac-key-s3cret"), "{stdout}");
    let lines: Vec<&str> = stdout.lines().map(str::trim).collect();
    for want in [
        "[remote]",
        "url = \"redis://kvbm:<redacted>@10.0.0.5:6379/1\"",
        "lookup_timeout_ms = 7",
        "min_frequency = 2",
    ] {
        assert!(lines.contains(&want), "missing {want:?} in:\n{stdout}");
    }
    assert!(stdout.contains("KVBM_REMOTE_SECRET=<redacted>"), "{stdout}");
    // A bad URL is refused naming the variable, still without the password.
    let out = kvbm(dir.path())
        .args(["config", "--bytes-per-block", "1000000"])
        .env("KVBM_REMOTE_URL", "http://kvbm:hunter2@10.0.0.5:6379")
        .output()
        .expect("run kvbm config");
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("KVBM_REMOTE_URL"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
}

// ------------------------------------------------------------------------------------------------
// 7. The report's JSON schema
// ------------------------------------------------------------------------------------------------

#[test]
fn report_json_schema() {
    let dir = tmp();
    let report = dir.path().join("r.json");
    let out = kvbm(dir.path())
        .args([
            "replay",
            "--quiet",
            "--framework",
            "vllm",
            "--workload",
            "shared-prefix",
        ])
        // The engine's own prefix cache off: the connector serves the shared prefixes, so the
        // report has matches and onboarded paths.
        .args([
            "--requests",
            "8",
            "--seed",
            "1",
            "--device-prefix-cache",
            "off",
        ])
        .args(["--disk-blocks", "1024", "--disk-dir"])
        .arg(dir.path())
        .arg("--report")
        .arg(&report)
        .output()
        .expect("run kvbm");
    assert_ok(&out, "snapshot run");
    let r = read_report(&report);
    check_report_invariants(&r, "snapshot run");
    assert!(
        u(&r["summary"]["matched_tokens"]) > 0,
        "the snapshot run has hits"
    );
    // Only timings are redacted: everything else is a function of the arguments.
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path("../snapshots");
    settings.set_prepend_module_to_snapshot(false);
    settings.bind(|| {
        insta::assert_json_snapshot!("cli__report_schema", r, {
            ".summary.wall_s" => "[wall_s]",
            ".summary.serve_s" => "[serve_s]",
            ".summary.leader_latency[].p50_us" => "[p50_us]",
            ".summary.leader_latency[].p99_us" => "[p99_us]",
            ".summary.offloaded[].gb_per_s" => "[gb_per_s]",
            ".summary.onboarded[].gb_per_s" => "[gb_per_s]",
        });
    });
}

// ------------------------------------------------------------------------------------------------
// 8. kvbm bench
// ------------------------------------------------------------------------------------------------

#[test]
fn bench_json_has_every_path_with_finite_ratios() {
    let dir = tmp();
    let out = kvbm(dir.path())
        .args(["bench", "--blocks", "4", "--rounds", "1", "--json", "--dir"])
        .arg(dir.path())
        .output()
        .expect("run kvbm bench");
    assert_ok(&out, "kvbm bench");
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bench JSON: {e}\n{}", text(&out.stdout)));
    let paths = v["paths"].as_array().expect("paths");
    for prefix in ["memory->memory", "memory->disk", "disk->memory", "leader"] {
        assert!(
            paths
                .iter()
                .any(|p| p["path"].as_str().is_some_and(|s| s.starts_with(prefix))),
            "no {prefix} path in {v}"
        );
    }
    for p in paths {
        for k in ["ours", "limit", "ratio"] {
            let x = p[k].as_f64().unwrap_or(f64::NAN);
            assert!(x.is_finite() && x > 0.0, "{}: {k} = {x}", p["path"]);
        }
        assert!(
            p["unit"].is_string() && p["limit_source"].is_string(),
            "{p}"
        );
    }
    let left: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").collect();
    assert!(left.is_empty(), "bench left files behind: {left:?}");
}

/// `kvbm bench --curve`: each row names its store method; transfers under 4 MiB (1 block) stay
/// on ordinary stores whatever the method; a forced method is obeyed from 4 MiB (2 blocks) on;
/// under auto the calibration's choice is reported and used; an unknown method is refused.
#[test]
fn bench_curve_names_the_copy_method_of_each_size() {
    let dir = tmp();
    let curve = |method: &str| -> Value {
        let out = kvbm(dir.path())
            .args([
                "bench", "--curve", "--blocks", "4", "--rounds", "1", "--json",
            ])
            .args(["--copy-method", method])
            .output()
            .expect("run kvbm bench --curve");
        assert_ok(&out, "kvbm bench --curve");
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("bench JSON: {e}\n{}", text(&out.stdout)))
    };
    let methods = |v: &Value| -> Vec<(String, String)> {
        v["paths"]
            .as_array()
            .expect("paths")
            .iter()
            .map(|p| {
                let path = p["path"].as_str().unwrap_or_default().to_string();
                let method = path
                    .rsplit_once('[')
                    .map(|(_, m)| m.trim_end_matches(']').to_string())
                    .unwrap_or_default();
                (path, method)
            })
            .collect()
    };
    for forced in ["plain", "stream", "stream-pages"] {
        let v = curve(forced);
        assert!(
            v["copy_calibration"].is_null(),
            "a forced method needs no calibration: {v}"
        );
        let rows = methods(&v);
        assert_eq!(
            rows.len(),
            6,
            "1, 2 and 4 blocks, contiguous and gather: {rows:?}"
        );
        for (path, method) in rows {
            let want = if path.contains(", 1 blocks") {
                "plain"
            } else {
                forced
            };
            assert_eq!(method, want, "{path}");
        }
    }
    let v = curve("auto");
    let chosen = v["copy_calibration"]["method"]
        .as_str()
        .unwrap_or_else(|| panic!("no calibration under auto: {v}"))
        .to_string();
    assert!(
        ["plain", "stream", "stream-pages"].contains(&chosen.as_str()),
        "{v}"
    );
    for k in [
        "plain_bytes_per_sec",
        "stream_bytes_per_sec",
        "stream_pages_bytes_per_sec",
    ] {
        let x = v["copy_calibration"][k].as_f64().unwrap_or(f64::NAN);
        assert!(x.is_finite() && x >= 0.0, "{k} = {x}");
    }
    for (path, method) in methods(&v) {
        let want = if path.contains(", 1 blocks") {
            "plain"
        } else {
            chosen.as_str()
        };
        assert_eq!(method, want, "{path}");
    }
    let out = kvbm(dir.path())
        .args(["bench", "--curve", "--blocks", "1", "--copy-method", "avx"])
        .output()
        .expect("run kvbm bench");
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("avx"), "{}", text(&out.stderr));
}

#[test]
fn bench_redis_rows_against_raw_set_get() {
    let dir = tmp();
    let out = kvbm(dir.path())
        .args(["bench", "--only", "memory,bogus"])
        .output()
        .expect("run kvbm bench");
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("bogus"), "{}", text(&out.stderr));
    let Ok(url) = std::env::var("KVBM_TEST_REDIS_URL") else {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("CI=true and KVBM_TEST_REDIS_URL is not set (scripts/test.sh starts Redis)");
        }
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr().lock(),
            "SKIP bench_redis_rows_against_raw_set_get: KVBM_TEST_REDIS_URL is not set"
        );
        return;
    };
    let out = kvbm(dir.path())
        .args(["bench", "--only", "redis", "--redis", &url])
        .args(["--redis-blocks", "2", "--rounds", "1", "--json"])
        .output()
        .expect("run kvbm bench");
    assert_ok(&out, "kvbm bench --only redis");
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bench JSON: {e}\n{}", text(&out.stdout)));
    let paths = v["paths"].as_array().expect("paths");
    assert_eq!(paths.len(), 2, "{v}");
    for (p, name) in paths.iter().zip(["host -> redis", "redis -> host"]) {
        assert!(
            p["path"].as_str().is_some_and(|s| s.starts_with(name)),
            "{p}"
        );
        let x = p["ratio"].as_f64().unwrap_or(f64::NAN);
        assert!(x.is_finite() && x > 0.0, "{p}");
    }
}

// ------------------------------------------------------------------------------------------------
// 9. Command line
// ------------------------------------------------------------------------------------------------

#[test]
fn help_and_unknown_flags() {
    let dir = tmp();
    let out = kvbm(dir.path()).arg("--help").output().expect("run");
    assert_ok(&out, "kvbm --help");
    let s = text(&out.stdout);
    for sub in ["replay", "bench", "config"] {
        assert!(s.contains(sub), "--help lists {sub}:\n{s}");
    }
    let out = kvbm(dir.path())
        .args(["replay", "--help"])
        .output()
        .expect("run");
    assert_ok(&out, "kvbm replay --help");
    let s = text(&out.stdout);
    for flag in [
        "--framework",
        "--workload",
        "--trace",
        "--seed",
        "--block-size",
        "--device-blocks",
        "--host-blocks",
        "--disk-blocks",
        "--disk-dir",
        "--config",
        "--device-prefix-cache",
        "--max-batch",
        "--prefill-us-per-token",
        "--report",
        "--quiet",
    ] {
        assert!(s.contains(flag), "replay --help lists {flag}:\n{s}");
    }
    let out = kvbm(dir.path())
        .args(["replay", "--no-such-flag"])
        .output()
        .expect("run");
    assert_clean_failure(
        &out,
        "unknown flag",
        &["unexpected argument '--no-such-flag'", "Usage"],
    );
    let out = kvbm(dir.path())
        .args(["replay", "--framework", "sglang"])
        .output()
        .expect("run");
    assert_clean_failure(&out, "bad framework", &["sglang", "trtllm", "vllm"]);
    let out = kvbm(dir.path()).output().expect("run");
    assert_clean_failure(&out, "no subcommand", &["Usage"]);
}

/// Warnings reach stderr by default (`KVBM_LOG` unset); `KVBM_LOG=error` silences them; a filter
/// that does not parse is named on stderr and the default used. The warning is the barrier's "both
/// tiers sized 0" one.
#[test]
fn warnings_show_on_stderr_filtered_by_kvbm_log() {
    let dir = tmp();
    let needle = "will store and load nothing";
    let replay = |log: Option<&str>| {
        let mut c = kvbm(dir.path());
        c.args(["replay", "--requests", "4", "--quiet"])
            .env("KVBM_HOST_CACHE_GB", "0")
            .env("KVBM_DISK_CACHE_GB", "0");
        if let Some(v) = log {
            c.env(LOG_ENV, v);
        }
        let out = c.output().expect("run");
        assert_ok(&out, "replay with both tiers sized 0");
        text(&out.stderr)
    };
    let err = replay(None);
    assert!(
        err.contains(needle) && err.contains("WARN"),
        "default: the warning on stderr:\n{err}"
    );
    let err = replay(Some("error"));
    assert!(!err.contains(needle), "KVBM_LOG=error: no warning:\n{err}");
    let err = replay(Some("kvbm_connector=[["));
    assert!(
        err.contains(needle) && err.contains(LOG_ENV),
        "bad KVBM_LOG: named, default used:\n{err}"
    );
}

// ------------------------------------------------------------------------------------------------
// The workload generators (tool/replay/workload.rs, compiled into this test)
// ------------------------------------------------------------------------------------------------

mod generators {
    use super::workload::*;

    #[test]
    fn generators_are_deterministic_and_valid() {
        for kind in [
            WorkloadKind::MultiTurn,
            WorkloadKind::SharedPrefix,
            WorkloadKind::Random,
        ] {
            let size = WorkloadSize {
                requests: 10,
                arrival_gap: 3,
            };
            let a = generate_workload(kind, 7, size);
            assert_eq!(a, generate_workload(kind, 7, size));
            assert_ne!(a, generate_workload(kind, 8, size));
            assert_eq!(a.len(), 10);
            assert!(a.iter().all(|r| !r.prompt.is_empty() && r.max_tokens > 0));
        }
    }

    /// The generator's arrivals stay within MAX_ARRIVAL at the largest gap and the most
    /// requests (multi-turn: conversation c's turn t arrives at (c + 6t) × gap; the others at
    /// i × gap), so a bounded `--arrival-gap` can never make an arrival the replay refuses.
    #[test]
    fn largest_generated_arrival_is_within_the_limit() {
        let n = MAX_REQUESTS as u64;
        let multi_turn = (n.div_ceil(4) + 6 * 3) * MAX_ARRIVAL_GAP;
        let others = (n - 1) * MAX_ARRIVAL_GAP;
        assert!(multi_turn.max(others) <= MAX_ARRIVAL);
        for kind in [
            WorkloadKind::MultiTurn,
            WorkloadKind::SharedPrefix,
            WorkloadKind::Random,
        ] {
            let size = WorkloadSize {
                requests: 8,
                arrival_gap: MAX_ARRIVAL_GAP,
            };
            let w = generate_workload(kind, 3, size);
            assert!(w.iter().all(|r| r.arrival <= MAX_ARRIVAL), "{kind}");
        }
    }

    #[test]
    fn multi_turn_prompts_extend_with_the_models_answers() {
        let w = generate_workload(
            WorkloadKind::MultiTurn,
            1,
            WorkloadSize {
                requests: 4,
                arrival_gap: 1,
            },
        );
        let (t0, t1) = (&w[0], &w[1]);
        assert_eq!(t0.id, "c0-t0");
        assert_eq!(t1.id, "c0-t1");
        let answer = generate(&t0.prompt, t0.max_tokens);
        assert_eq!(&t1.prompt[..t0.prompt.len()], &t0.prompt[..]);
        assert_eq!(
            &t1.prompt[t0.prompt.len()..t0.prompt.len() + answer.len()],
            &answer[..]
        );
    }
}

// ------------------------------------------------------------------------------------------------
// The trace parser (tool/replay/trace.rs, compiled into this test): fixed cases and fuzzing
// ------------------------------------------------------------------------------------------------

mod trace_parser {
    use super::trace::{parse_trace, read_trace, MAX_TRACE_BYTES};
    use super::workload::{TraceRequest, MAX_ARRIVAL, MAX_REQUESTS, MAX_REQUEST_TOKENS};
    use kvbm_connector::error::ErrorKind;
    use proptest::prelude::*;

    #[test]
    fn malformed_traces_name_the_line() {
        let cases = [
            ("{\"id\":\"a\",\"arrival\":0,\"prompt\":[1],\"max_tokens\":1}\nnot json", "line 2"),
            ("{\"id\":\"a\",\"arrival\":0,\"prompt\":[],\"max_tokens\":1}", "empty prompt"),
            ("{\"id\":\"a\",\"arrival\":0,\"prompt\":[1],\"max_tokens\":0}", "max_tokens"),
            ("{\"id\":\"a\",\"arrival\":-1,\"prompt\":[1],\"max_tokens\":1}", "line 1"),
            ("{\"id\":\"a\",\"arrival\":0,\"prompt\":[1],\"max_tokens\":1,\"x\":2}", "unknown field"),
            (
                "{\"id\":\"a\",\"arrival\":0,\"prompt\":[1],\"max_tokens\":1}\n{\"id\":\"a\",\"arrival\":0,\"prompt\":[1],\"max_tokens\":1}",
                "duplicate id",
            ),
            ("\n\n", "no requests"),
            ("{\"id\":\"a\",\"arrival\":0,\"prompt\":[1],\"max_tokens\":18446744073709551615}", "max_tokens"),
        ];
        for (text, want) in cases {
            let e = parse_trace(text).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument);
            assert!(e.to_string().contains(want), "{e} should mention {want}");
        }
    }

    #[test]
    fn duplicate_keys_and_byte_order_marks_are_named() {
        let ok = "{\"id\":\"a\",\"arrival\":0,\"prompt\":[1],\"max_tokens\":1}";
        // A duplicate key would otherwise keep its last value silently.
        let dup = "{\"id\":\"b\",\"arrival\":0,\"prompt\":[1],\"prompt\":[1,2,3],\"max_tokens\":1}";
        let e = parse_trace(&format!("{ok}\n{dup}")).unwrap_err();
        assert!(
            e.to_string().contains("line 2")
                && e.to_string().contains("duplicate field \"prompt\""),
            "{e}"
        );
        // A byte-order mark at the start of the file is skipped; elsewhere it is named.
        let first = parse_trace(&format!("\u{feff}{ok}")).expect("a leading mark is skipped");
        assert_eq!(first, parse_trace(ok).expect("valid"));
        let e = parse_trace(&format!("{ok}\n\u{feff}{ok}")).unwrap_err();
        assert!(
            e.to_string().contains("line 2") && e.to_string().contains("byte-order mark"),
            "{e}"
        );
    }

    #[test]
    fn oversized_trace_file_is_refused_unread() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = dir.path().join("big.jsonl");
        let f = std::fs::File::create(&path).expect("create");
        f.set_len(MAX_TRACE_BYTES + 1).expect("sparse file");
        let e = read_trace(&path).unwrap_err();
        assert!(e.to_string().contains("larger than"), "{e}");
    }

    /// What every parsed trace promises (see the module docs of trace.rs).
    fn check_parsed(reqs: &[TraceRequest]) {
        assert!(!reqs.is_empty() && reqs.len() <= MAX_REQUESTS);
        for r in reqs {
            assert!(!r.id.is_empty() && !r.prompt.is_empty() && r.max_tokens >= 1);
            assert!(r.prompt.len() + r.max_tokens <= MAX_REQUEST_TOKENS);
            assert!(r.arrival <= MAX_ARRIVAL);
        }
        assert!(reqs.windows(2).all(|w| w[0].arrival <= w[1].arrival));
    }

    fn check_error(e: &kvbm_connector::error::Error) {
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        let s = e.to_string();
        assert!(s.contains("line") || s.contains("no requests"), "{s}");
    }

    /// One JSON value that is likely to be a near-valid field value.
    fn json_value() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<u64>().prop_map(|n| n.to_string()),
            any::<i64>().prop_map(|n| n.to_string()),
            (0u64..40).prop_map(|n| n.to_string()),
            Just("1e300".to_string()),
            Just("-0".to_string()),
            Just("null".to_string()),
            "[a-z0-9\"]{0,6}".prop_map(|s| format!("{s:?}")),
            proptest::collection::vec(any::<u64>(), 0..4).prop_map(|v| format!("{v:?}")),
            proptest::collection::vec(0u32..5, 0..6).prop_map(|v| format!("{v:?}")),
        ]
    }

    fn line() -> impl Strategy<Value = String> {
        let key = prop_oneof![
            Just("id"),
            Just("arrival"),
            Just("prompt"),
            Just("max_tokens"),
            Just("other")
        ];
        prop_oneof![
            proptest::collection::vec((key, json_value()), 0..6).prop_map(|kv| {
                let body: Vec<String> = kv.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
                format!("{{{}}}", body.join(","))
            }),
            (
                "[a-c]{1,2}",
                any::<u64>(),
                proptest::collection::vec(any::<u32>(), 0..5),
                prop_oneof![any::<u64>(), 0u64..40, Just(1u64 << 24), Just((1u64 << 24) - 2)],
            )
                .prop_map(|(id, arrival, prompt, max_tokens)| format!(
                    r#"{{"id":"{id}","arrival":{arrival},"prompt":{prompt:?},"max_tokens":{max_tokens}}}"#
                )),
            ".{0,40}",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        /// Arbitrary text: `Ok` with the promised invariants, or an error naming the line; never
        /// a panic.
        #[test]
        fn arbitrary_text_never_panics(text in ".{0,200}") {
            match parse_trace(&text) {
                Ok(reqs) => check_parsed(&reqs),
                Err(e) => check_error(&e),
            }
        }

        /// Near-valid lines (every field present or not, of any type, sizes up to u64::MAX).
        #[test]
        fn near_valid_traces_are_ok_or_named(lines in proptest::collection::vec(line(), 0..6)) {
            match parse_trace(&lines.join("\n")) {
                Ok(reqs) => check_parsed(&reqs),
                Err(e) => check_error(&e),
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// A sliding-window model (vLLM's call order)
// ------------------------------------------------------------------------------------------------

/// `--sliding-window 64`: every layer attends over 64 tokens, so vLLM frees a running request's
/// blocks before its window and a hit's table is vLLM's null block before the window. Every
/// onboarded block is verified, none fails, and a hit loads only its window's blocks: fewer
/// blocks cross than tokens are matched (before the null block was left out of transfers, every
/// such load failed: "destination block 0 appears twice").
///
/// TensorRT-LLM's call order (one sliding layer group, `BAD_PAGE_INDEX` before the window): its
/// stores trail the compute by an iteration (offload by computed position), and the simulated
/// engine frees a block that left the window and reuses it at once, as vLLM does. Every
/// onboarded block is verified: storing a windowed block that the request's next iteration may
/// move out of the window served other requests' bytes (72 integrity errors here before the
/// leader held those stores back). The second setting (a 48-token window over 32-token blocks,
/// 256-token chunks: the window's block count, 2, is one more than it spans at some positions)
/// served 4 wrong blocks while the leader judged "still in the window" by that block count.
#[test]
fn replay_with_a_sliding_window_loads_only_the_window() {
    let dir = tmp();
    let settings: [(&str, &[&str]); 2] = [
        (
            "w64",
            &[
                "--sliding-window",
                "64",
                "--block-size",
                "16",
                "--requests",
                "150",
            ],
        ),
        (
            "w48",
            &[
                "--sliding-window",
                "48",
                "--block-size",
                "32",
                "--requests",
                "120",
                "--workload",
                "shared-prefix",
                "--seed",
                "947",
                "--chunk-tokens",
                "256",
                "--device-blocks",
                "256",
                "--device-prefix-cache",
                "off",
                "--max-batch",
                "32",
            ],
        ),
    ];
    for (name, args) in settings {
        for framework in ["vllm", "trtllm"] {
            let what = format!("{name}, {framework}");
            let report = dir.path().join(format!("swa-{name}-{framework}.json"));
            let out = kvbm(dir.path())
                .args(["replay", "--framework", framework])
                .args(args)
                .args([
                    "--host-blocks",
                    "4096",
                    "--disk-blocks",
                    "0",
                    "--quiet",
                    "--report",
                ])
                .arg(&report)
                .output()
                .expect("run kvbm");
            assert_ok(&out, &format!("kvbm replay {what}"));
            let r = read_report(&report);
            check_report_invariants(&r, &what);
            let s = &r["summary"];
            assert_eq!(u(&s["integrity_errors"]), 0, "{what}: {s}");
            assert_eq!(u(&s["load_errors"]), 0, "{what}: {s}");
            let verified = u(&s["blocks_verified"]);
            let matched = u(&s["matched_tokens"]);
            // (TensorRT-LLM's w48 hits were all windows before a shared prompt's end, stored
            // after the window had left them: wrong bytes, now never stored, so no hit.)
            if (name, framework) != ("w48", "trtllm") {
                assert!(verified > 0 && matched > 0, "{what}: {s}");
            }
            if name == "w64" {
                let block_size = 16;
                assert!(
                    verified * block_size < matched,
                    "{what}: a hit loads its window's blocks only: {verified} blocks for {matched} matched tokens"
                );
            }
        }
    }
}

/// Runs `kvbm replay` with `args` on a small windowed model's settings (16-token blocks, 120
/// requests, 4,096 host blocks, no disk), checks it succeeded and its report's invariants, and
/// returns the report's summary.
fn windowed_replay(dir: &Path, name: &str, args: &[&str]) -> Value {
    let report = dir.join(name);
    let out = kvbm(dir)
        .arg("replay")
        .args(args)
        .args([
            "--block-size",
            "16",
            "--requests",
            "120",
            "--host-blocks",
            "4096",
            "--disk-blocks",
            "0",
            "--quiet",
            "--report",
        ])
        .arg(&report)
        .output()
        .expect("run kvbm");
    assert_ok(&out, name);
    let r = read_report(&report);
    check_report_invariants(&r, name);
    r["summary"].clone()
}

/// Blocks a replay's summary says were stored device -> host.
fn offloaded_to_host(s: &Value) -> usize {
    s["offloaded"]
        .as_array()
        .expect("offloaded")
        .iter()
        .find(|t| t["path"] == "device->host")
        .map_or(0, |t| u(&t["blocks"]))
}

/// The same model over two tensor-parallel ranks (worker processes): every onboarded block of
/// both ranks is verified, none fails, and the window-aware stores cross fewer blocks device ->
/// host than the same replay of a model without a window (a sliding-window group stores only the
/// windows a later hit needs; before, every computed block).
#[test]
fn replay_with_a_sliding_window_over_two_ranks_stores_only_windows() {
    let dir = tmp();
    let offloaded = |window: Option<&str>, name: &str| -> (usize, Value) {
        let mut args = vec!["--framework", "vllm", "--tp", "2"];
        if let Some(w) = window {
            args.extend(["--sliding-window", w]);
        }
        let s = windowed_replay(dir.path(), name, &args);
        (offloaded_to_host(&s), s)
    };
    let (windowed, s) = offloaded(Some("64"), "swa-tp2.json");
    assert_eq!(u(&s["tp"]), 2, "{s}");
    assert_eq!(u(&s["load_errors"]), 0, "{s}");
    assert_eq!(u(&s["rank_failures"]), 0, "{s}");
    assert!(u(&s["blocks_verified"]) > 0, "{s}");
    let (full, _) = offloaded(None, "full-tp2.json");
    assert!(
        windowed < full,
        "a window stores fewer blocks: {windowed} with a window, {full} without"
    );
}

/// A hybrid model (issue 25 item 5): several KV-cache groups, each with its own block table
/// over the one device pool and its own KV bytes (a block onboarded into another group's place
/// fails verification), in both engines' call orders (vLLM's per-group block lists, TensorRT-LLM's
/// `*_by_layer_group` calls) and over two ranks. Every onboarded block of every group is
/// verified; a hit is served by every group (more blocks verified than the full group's alone);
/// sliding groups store only their windows (fewer blocks offloaded than the same number of full
/// groups).
#[test]
fn replay_of_a_hybrid_model_serves_every_group_in_both_call_orders() {
    let dir = tmp();
    let run = |framework: &str, groups: &str, extra: &[&str]| -> Value {
        let name = format!(
            "hybrid-{framework}-{}-{}.json",
            groups.replace([',', ':'], "_"),
            extra.len()
        );
        let mut args = vec!["--framework", framework, "--layer-groups", groups];
        args.extend(extra);
        let s = windowed_replay(dir.path(), &name, &args);
        assert_eq!(u(&s["integrity_errors"]), 0, "{name}: {s}");
        assert_eq!(u(&s["load_errors"]), 0, "{name}: {s}");
        s
    };
    let offloaded = offloaded_to_host;
    for framework in ["vllm", "trtllm"] {
        let hybrid = run(framework, "full,sliding:64", &[]);
        let what = format!("{framework} full,sliding:64");
        let (verified, matched) = (u(&hybrid["blocks_verified"]), u(&hybrid["matched_tokens"]));
        assert!(matched > 0, "{what}: {hybrid}");
        // The full group alone loads matched / 16 blocks; the sliding group adds its windows.
        assert!(
            verified * 16 > matched,
            "{what}: every group is loaded: {hybrid}"
        );
        let two_full = run(framework, "full,full", &[]);
        assert!(
            offloaded(&hybrid) < offloaded(&two_full),
            "{what}: a sliding group stores its windows only: {} blocks offloaded, {} with two full groups",
            offloaded(&hybrid),
            offloaded(&two_full)
        );
        let three = run(framework, "sliding:48,full,sliding:128", &[]);
        assert!(
            u(&three["matched_tokens"]) > 0,
            "{framework} three groups: {three}"
        );
    }
    let tp = run("vllm", "full,sliding:64", &["--tp", "2"]);
    assert_eq!(u(&tp["tp"]), 2, "{tp}");
    assert_eq!(u(&tp["rank_failures"]), 0, "{tp}");
    assert!(u(&tp["blocks_verified"]) > 0, "{tp}");
}

/// `--layer-groups` answers a kind it does not know, too many groups, and a clash with
/// `--sliding-window` by name, before anything runs.
#[test]
fn layer_groups_bad_input_is_refused_by_name() {
    let dir = tmp();
    let refused = |args: &[&str]| -> String {
        let out = kvbm(dir.path())
            .args(["replay", "--requests", "4"])
            .args(args)
            .output()
            .expect("run kvbm");
        assert!(!out.status.success(), "{args:?} was accepted");
        text(&out.stderr)
    };
    let err = refused(&["--layer-groups", "full,chunked:4"]);
    assert!(
        err.contains("chunked:4") && err.contains("group=1") && err.contains("--layer-groups"),
        "{err}"
    );
    let err = refused(&["--layer-groups", "full,sliding:0"]);
    assert!(
        err.contains("sliding:0") && err.contains("group=1"),
        "{err}"
    );
    let many = vec!["full"; 65].join(",");
    let err = refused(&["--layer-groups", &many]);
    assert!(
        err.contains("65 groups") && err.contains("at most 64"),
        "{err}"
    );
    let err = refused(&["--layer-groups", "full", "--sliding-window", "64"]);
    assert!(
        err.contains("--sliding-window") && err.contains("--layer-groups"),
        "{err}"
    );
}

// ------------------------------------------------------------------------------------------------
// Flags answered at once and by name (issue 26 item 6)
// ------------------------------------------------------------------------------------------------

/// A negative count is named as an invalid value of its flag (before, clap read `-5` as an
/// unknown flag: "unexpected argument '-5'"); `kvbm bench --rounds` is bounded (before, a typo
/// ran for ever); `kvbm sweep --plot` into a missing directory fails before the sweep runs
/// (before, after it); a remote URL with a host longer than a DNS name is refused and quoted cut;
/// `kvbm sweep`'s default policy is the configuration's, `prefix`.
#[test]
fn bad_flags_are_refused_at_once_and_by_name() {
    let dir = tmp();
    let out = kvbm(dir.path())
        .args(["replay", "--host-blocks", "-5"])
        .output()
        .expect("run kvbm");
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("invalid value '-5'") && err.contains("--host-blocks"),
        "{err}"
    );

    let out = kvbm(dir.path())
        .args(["bench", "--rounds", "1000000000"])
        .output()
        .expect("run kvbm");
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("--rounds") && err.contains("at most"), "{err}");

    // A missing directory (before: refused after the sweep), a device (before: the whole sweep
    // ran, then "No space left on device") and a directory are refused before the sweep: no
    // table was printed.
    for (plot, why) in [
        (
            dir.path().join("no-such-dir").join("x.svg"),
            "not a directory",
        ),
        (PathBuf::from("/dev/full"), "not a regular file"),
        (dir.path().to_path_buf(), "is a directory"),
    ] {
        let t = Instant::now();
        let out = kvbm(dir.path())
            .args(["sweep", "--capacities", "1M", "--plot"])
            .arg(&plot)
            .output()
            .expect("run kvbm");
        assert!(!out.status.success());
        let err = text(&out.stderr);
        assert!(err.contains("--plot") && err.contains(why), "{err}");
        assert!(
            !text(&out.stdout).contains("hit rate"),
            "the sweep ran before --plot {} was refused",
            plot.display()
        );
        println!(
            "{} refused in {:.3} s",
            plot.display(),
            t.elapsed().as_secs_f64()
        );
    }
    // A plot into a new file is written (the check before the sweep removed what it created).
    let svg = dir.path().join("curve.svg");
    let out = kvbm(dir.path())
        .args(["sweep", "--quiet", "--capacities", "1k", "--plot"])
        .arg(&svg)
        .output()
        .expect("run kvbm");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let body = std::fs::read_to_string(&svg).expect("the plot was written");
    assert!(
        body.starts_with("<svg") && body.contains("</svg>"),
        "{body:.200}"
    );

    // A 100,000-character host is refused, and quoted cut (before: 400 KB of stderr).
    for host in ["a".repeat(100_000), "b".repeat(300)] {
        let out = kvbm(dir.path())
            .args(["replay", "--quiet", "--remote-url"])
            .arg(format!("redis://{host}:6379/0"))
            .output()
            .expect("run kvbm");
        assert!(!out.status.success());
        let err = text(&out.stderr);
        assert!(err.len() < 2_000, "{} bytes of stderr", err.len());
        assert!(
            err.contains("remote.url") && err.contains("characters"),
            "{err}"
        );
    }

    let out = kvbm(dir.path())
        .args(["sweep", "--help"])
        .output()
        .expect("run kvbm");
    let help = text(&out.stdout);
    assert!(help.contains("[default: prefix]"), "{help}");
}

/// One `kvbm replay` over a persisted disk tier in `dir` (`KVBM_DISK_PERSIST`, namespace `ns`):
/// its table.
fn persisted_replay(dir: &Path, ns: &str, framework: &str, tp: &str) -> String {
    let out = kvbm(dir)
        .env("KVBM_DISK_PERSIST", "1")
        .env("KVBM_REMOTE_NAMESPACE", ns)
        .args([
            "replay",
            "--framework",
            framework,
            "--tp",
            tp,
            "--host-blocks",
            "64",
        ])
        .output()
        .expect("run kvbm");
    assert_ok(&out, "kvbm replay with a persisted disk tier");
    text(&out.stdout)
}

#[test]
fn a_persisted_disk_tier_serves_the_next_run_and_never_wrong_bytes() {
    for (framework, tp) in [("trtllm", "1"), ("vllm", "2")] {
        let dir = tmp();
        let first = persisted_replay(dir.path(), "toy", framework, tp);
        let second = persisted_replay(dir.path(), "toy", framework, tp);
        let what = format!("{framework} --tp {tp}");
        for t in [&first, &second] {
            assert_eq!(table_value(t, "integrity errors"), 0.0, "{what}:\n{t}");
            assert_eq!(table_value(t, "load errors"), 0.0, "{what}:\n{t}");
        }
        // The second run starts with the first run's disk blocks (every rank's, over TCP with
        // --tp 2): its early requests hit where the first run's computed. Each onboarded byte
        // was checked against the model stand-in.
        let (m1, m2) = (
            table_value(&first, "matched by kvbm"),
            table_value(&second, "matched by kvbm"),
        );
        assert!(m2 > m1 * 1.5, "{what}: matched {m1} then {m2}\n{second}");
        // Another model (namespace) in the same directory: its own files, nothing reused.
        let other = persisted_replay(dir.path(), "another-model", framework, tp);
        // (A first run's count varies a little with when background copies finish.)
        let mo = table_value(&other, "matched by kvbm");
        assert!(
            mo < m1 * 1.2,
            "{what}: another namespace matched {mo} (first run {m1}):\n{other}"
        );
        // Every persisted data file damaged: its blocks fail their checksums, loads fail and
        // are recomputed, no wrong byte is served.
        for entry in std::fs::read_dir(dir.path()).expect("disk dir") {
            let path = entry.expect("entry").path();
            if path.to_string_lossy().ends_with(".persist.blocks") {
                let mut bytes = std::fs::read(&path).expect("read");
                for b in bytes.iter_mut().step_by(1024) {
                    *b ^= 0x5a;
                }
                std::fs::write(&path, bytes).expect("write");
            }
        }
        let damaged = persisted_replay(dir.path(), "toy", framework, tp);
        assert_eq!(
            table_value(&damaged, "integrity errors"),
            0.0,
            "{what}:\n{damaged}"
        );
        assert!(
            table_value(&damaged, "load errors") > 0.0,
            "{what}:\n{damaged}"
        );
    }
}

#[test]
fn a_persisted_disk_tier_without_a_namespace_is_refused_by_name() {
    let dir = tmp();
    let out = kvbm(dir.path())
        .env("KVBM_DISK_PERSIST", "1")
        .args(["replay", "--quiet"])
        .output()
        .expect("run kvbm");
    assert_clean_failure(
        &out,
        "KVBM_DISK_PERSIST without a namespace",
        &["KVBM_REMOTE_NAMESPACE", "disk.persist"],
    );
}
