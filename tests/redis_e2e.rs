//! The remote (G4) tier end to end on real Redis servers, through the `kvbm` binary: two
//! `kvbm replay` processes (two instances) sharing prefixes through Redis (standalone and a
//! 3-node cluster; `--tp 2`), and what a failing Redis costs: killed mid-run (the run finishes,
//! misses and load errors are recomputed), restarted empty (misses), a wrong value planted under
//! every key (load errors, never served). Integrity errors are 0 in every run.
//!
//! Servers: the tests that kill, restart or overwrite a server start their own `redis-server`
//! (from `PATH`) on a free loopback port; the cluster test uses `KVBM_TEST_REDIS_CLUSTER_URL`
//! (`scripts/redis-servers.sh`, which scripts/test.sh sources). A missing server prints
//! `SKIP <test>: <reason>` and returns, except under `CI=true`, where it fails. Each run uses a
//! namespace of its own (`KVBM_REMOTE_NAMESPACE`), so runs sharing a server never see each
//! other's blocks.

#![cfg(all(feature = "cli", feature = "redis"))]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod redis_server;
use redis_server::{skip, OwnServer};

use kvbm_connector::config::{AUTH_TOKEN_ENV, CONFIG_FILE_VAR, ENV_VARS, LEADER_ADDR_ENV};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_kvbm");
/// Bound on one replay of these small workloads (a few seconds in debug).
const REPLAY_LIMIT: Duration = Duration::from_secs(120);

/// A namespace no other run shares.
fn namespace() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
    );
    format!("e2e-{:016x}", h.finish())
}

/// `kvbm replay` of instance `name` (its own directory under `dir`) against `url` in
/// namespace `ns`: `requests` multi-turn requests of seed 3, no disk tier and no device prefix
/// reuse (what it matches comes from its host tier or the store).
fn replay(dir: &Path, name: &str, url: &str, ns: &str, args: &[&str]) -> Command {
    let own = dir.join(name);
    std::fs::create_dir_all(&own).expect("instance directory");
    let mut c = Command::new(BIN);
    for v in ENV_VARS {
        c.env_remove(v.name);
    }
    c.env_remove(CONFIG_FILE_VAR)
        .env_remove(AUTH_TOKEN_ENV)
        .env_remove(LEADER_ADDR_ENV)
        .env("KVBM_INIT_TIMEOUT_SECS", "30")
        .env("KVBM_REMOTE_NAMESPACE", ns)
        // TensorRT-LLM's synchronous lookups: the default 5 ms is for release builds on a
        // quiet machine; these run in debug on a loaded one.
        .env("KVBM_REMOTE_LOOKUP_TIMEOUT_MS", "500")
        .env("KVBM_LOG", "error")
        .args([
            "replay",
            "--quiet",
            "--workload",
            "multi-turn",
            "--seed",
            "3",
        ])
        .args(["--device-prefix-cache", "off", "--disk-blocks", "0"])
        .args(["--remote-url", url])
        .arg("--disk-dir")
        .arg(&own)
        .arg("--report")
        .arg(report_path(dir, name))
        .args(args);
    c
}

fn report_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.json"))
}

/// Starts `c` with its output captured.
fn spawn(c: &mut Command) -> Child {
    c.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvbm starts")
}

/// Runs `c` to the end (bounded); its output, after checking it succeeded.
fn run(mut c: Command) -> Output {
    let out = wait_bounded(spawn(&mut c));
    assert!(
        out.status.success(),
        "kvbm failed: {}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn wait_bounded(mut child: Child) -> Output {
    let until = Instant::now() + REPLAY_LIMIT;
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if Instant::now() > until {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "kvbm replay did not finish within {REPLAY_LIMIT:?}; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn summary(dir: &Path, name: &str) -> Value {
    let text = std::fs::read_to_string(report_path(dir, name)).expect("report written");
    let v: Value = serde_json::from_str(&text).expect("report is JSON");
    v["summary"].clone()
}

fn n(v: &Value, path: &[&str]) -> u64 {
    let mut cur = v;
    for p in path {
        cur = &cur[*p];
    }
    cur.as_u64()
        .unwrap_or_else(|| panic!("{path:?} is not a count in {v}"))
}

/// A writes its blocks to the store; B, a second process, matches them from the store. Both
/// run with the environment variables `env` set.
fn share(url: &str, framework: &str, extra: &[&str], env: &[(&str, String)]) {
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace();
    let mut args = vec!["--framework", framework, "--requests", "20"];
    args.extend_from_slice(extra);
    let with_env = |mut c: Command| {
        c.envs(env.iter().map(|(k, v)| (*k, v.as_str())));
        c
    };
    run(with_env(replay(dir.path(), "a", url, &ns, &args)));
    let a = summary(dir.path(), "a");
    assert_eq!(n(&a, &["integrity_errors"]), 0);
    assert_eq!(
        n(&a, &["matched_from", "remote"]),
        0,
        "nothing to share yet: {a}"
    );
    assert!(
        n(&a, &["remote", "sent_blocks"]) > 0,
        "A wrote nothing: {a}"
    );
    run(with_env(replay(dir.path(), "b", url, &ns, &args)));
    let b = summary(dir.path(), "b");
    assert_eq!(n(&b, &["integrity_errors"]), 0, "{b}");
    assert_eq!(n(&b, &["load_errors"]), 0, "{b}");
    assert!(
        n(&b, &["matched_from", "remote"]) > 0,
        "B found nothing of A's: {b}"
    );
    assert_eq!(
        n(&b, &["remote", "hit_tokens"]),
        n(&b, &["matched_from", "remote"]),
        "{b}"
    );
    assert!(n(&b, &["blocks_verified"]) > 0, "{b}");
    assert_eq!(b["remote"]["available"], Value::Bool(true), "{b}");
}

#[test]
fn two_instances_share_prefixes_through_redis() {
    let Some(server) = OwnServer::start(&[]) else {
        return;
    };
    for framework in ["vllm", "trtllm"] {
        share(&server.url(), framework, &[], &[]);
    }
}

#[test]
fn two_instances_share_prefixes_through_a_redis_cluster() {
    let url = match std::env::var("KVBM_TEST_REDIS_CLUSTER_URL") {
        Ok(u) if !u.is_empty() => u,
        _ => {
            skip("KVBM_TEST_REDIS_CLUSTER_URL is not set (run under scripts/redis-servers.sh)");
            return;
        }
    };
    share(&url, "vllm", &[], &[]);
}

/// Through a server that wants TLS with a client certificate, configured the way a deployment
/// does (`KVBM_REMOTE_TLS_*` variables); then refused, naming the setting, without the client
/// certificate.
#[test]
fn two_instances_share_prefixes_over_mutual_tls() {
    let (url, dir) = match (
        std::env::var("KVBM_TEST_REDIS_MTLS_URL"),
        std::env::var("KVBM_TEST_REDIS_TLS_DIR"),
    ) {
        (Ok(u), Ok(d)) if !u.is_empty() && !d.is_empty() => (u, PathBuf::from(d)),
        _ => {
            skip("KVBM_TEST_REDIS_MTLS_URL / KVBM_TEST_REDIS_TLS_DIR are not set (run under scripts/redis-servers.sh)");
            return;
        }
    };
    let file = |f: &str| dir.join(f).display().to_string();
    let ca = ("KVBM_REMOTE_TLS_CA_FILE", file("ca.pem"));
    let env = [
        ca.clone(),
        ("KVBM_REMOTE_TLS_CERT_FILE", file("client.pem")),
        ("KVBM_REMOTE_TLS_KEY_FILE", file("client.key")),
    ];
    for framework in ["vllm", "trtllm"] {
        share(&url, framework, &[], &env);
    }
    let scratch = tempfile::tempdir().unwrap();
    let mut c = replay(
        scratch.path(),
        "c",
        &url,
        &namespace(),
        &["--requests", "2"],
    );
    c.env(ca.0, &ca.1);
    let out = wait_bounded(spawn(&mut c));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "ran without a client certificate:\n{stderr}"
    );
    assert!(stderr.contains("remote.tls_cert_file"), "{stderr}");
}

#[test]
fn two_tp2_instances_share_prefixes_through_redis() {
    let Some(server) = OwnServer::start(&[]) else {
        return;
    };
    for framework in ["vllm", "trtllm"] {
        share(&server.url(), framework, &["--tp", "2"], &[]);
    }
}

#[test]
fn redis_restarted_empty_is_only_misses() {
    let Some(mut server) = OwnServer::start(&[]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace();
    let args = ["--framework", "vllm", "--requests", "20"];
    run(replay(dir.path(), "a", &server.url(), &ns, &args));
    server.kill();
    server.spawn();
    run(replay(dir.path(), "b", &server.url(), &ns, &args));
    let b = summary(dir.path(), "b");
    assert_eq!(n(&b, &["integrity_errors"]), 0, "{b}");
    assert_eq!(n(&b, &["matched_from", "remote"]), 0, "{b}");
    assert_eq!(n(&b, &["load_errors"]), 0, "{b}");
    // B's own writes went to the new, empty server.
    assert!(n(&b, &["remote", "sent_blocks"]) > 0, "{b}");
}

#[test]
fn redis_killed_mid_run_costs_misses_and_load_errors_never_wrong_bytes() {
    let Some(mut server) = OwnServer::start(&[]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace();
    for framework in ["vllm", "trtllm"] {
        server.kill();
        server.spawn();
        let a_args = ["--framework", framework, "--requests", "40"];
        run(replay(dir.path(), "a", &server.url(), &ns, &a_args));
        // B replays more of the same workload; Redis dies once B has started matching.
        let b_args = ["--framework", framework, "--requests", "200"];
        let child = spawn(&mut replay(dir.path(), "b", &server.url(), &ns, &b_args));
        std::thread::sleep(Duration::from_millis(500));
        server.kill();
        let out = wait_bounded(child);
        assert!(
            out.status.success(),
            "B did not finish: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let b = summary(dir.path(), "b");
        assert_eq!(n(&b, &["integrity_errors"]), 0, "{b}");
        assert_eq!(n(&b, &["requests"]), 200, "{b}");
        let failed = n(&b, &["remote", "lookup_errors"])
            + n(&b, &["remote", "lookup_skipped"])
            + n(&b, &["remote", "lookup_timeouts"])
            + n(&b, &["remote", "write_errors"]);
        assert!(failed > 0, "the kill went unnoticed (B ended first?): {b}");
        assert_eq!(b["remote"]["available"], Value::Bool(false), "{b}");
    }
}

#[test]
fn a_wrong_value_planted_under_every_key_is_a_load_error_never_served() {
    let Some(server) = OwnServer::start(&[]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace();
    let args = ["--framework", "vllm", "--requests", "20"];
    run(replay(dir.path(), "a", &server.url(), &ns, &args));
    let Some(keys) = server.cli(&["--scan", "--pattern", "*"]) else {
        skip("redis-cli is not on PATH");
        return;
    };
    let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
    assert!(!keys.is_empty());
    for k in &keys {
        // A value of any other form fails the header check (the header names the key, the
        // length and the checksum; a MAC too with a secret: tests/redis.rs plants subtler ones).
        server
            .cli(&["SET", k, "not a kv block"])
            .expect("SET a planted value");
    }
    run(replay(dir.path(), "b", &server.url(), &ns, &args));
    let b = summary(dir.path(), "b");
    assert_eq!(n(&b, &["integrity_errors"]), 0, "{b}");
    assert_eq!(
        n(&b, &["remote", "hit_tokens"]),
        0,
        "a planted value was served: {b}"
    );
    assert!(n(&b, &["load_errors"]) > 0, "{b}");
}

/// A `rediss://` URL pointed at a plain server's port: the replay still runs (the tier is
/// unavailable, local tiers serve) and the warning says it is the TLS handshake that got no
/// answer, not only "did not answer in time". How it would fail: no "TLS" in the log.
#[test]
fn a_tls_url_against_a_plain_server_names_tls() {
    let Some(server) = OwnServer::start(&[]) else {
        return;
    };
    let tls = server.url().replacen("redis://", "rediss://", 1);
    let dir = tempfile::tempdir().unwrap();
    let mut c = replay(dir.path(), "a", &tls, &namespace(), &["--requests", "5"]);
    c.env("KVBM_LOG", "warn");
    let out = run(c);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("TLS handshake") && err.contains("tls-port"),
        "{err}"
    );
    let a = summary(dir.path(), "a");
    assert_eq!(n(&a, &["integrity_errors"]), 0);
}
