//! The Redis backend (`backends::redis`) against real servers: a standalone server, a 3-node
//! Redis Cluster, a server with `requirepass` and an ACL user, TLS servers (one also wanting a
//! client certificate) signed by a throw-away CA, and servers each test starts itself when it
//! kills, stops, restarts or fills one.
//!
//! Run with the servers of `scripts/redis-servers.sh`: `scripts/redis-servers.sh cargo test
//! --features redis --test redis` (scripts/test.sh does). The tests read their URLs from
//! `KVBM_TEST_REDIS_URL`, `KVBM_TEST_REDIS_CLUSTER_URL`, `KVBM_TEST_REDIS_AUTH_URL` and
//! `KVBM_TEST_REDIS_ACL_URL`, `KVBM_TEST_REDIS_TLS_URL`, `KVBM_TEST_REDIS_MTLS_URL`,
//! `KVBM_TEST_REDIS_TLS_CLUSTER_URL` (with the PEM
//! files in `KVBM_TEST_REDIS_TLS_DIR`), and start their own servers with `redis-server` from `PATH`. A test
//! whose server is missing prints `SKIP <test>: <reason>` and returns, except under `CI=true`,
//! where it fails.
//!
//! Every test works in a scope of its own (a random description), so they share servers while
//! running in parallel; those that flush, fill or kill a server use one of their own.

#![cfg(feature = "redis")]

use std::time::{Duration, Instant};

mod redis_server;
use redis_server::{skip, OwnServer};

use kvbm_connector::backends::redis::{RedisOptions, RedisStore, RedisUrl};
use kvbm_connector::connector::remote::{RemotePut, RemoteRead, RemoteScope, RemoteStore};
use kvbm_connector::{ErrorKind, HashAlgorithm};

// ------------------------------------------------------------------------------------------------
// Servers: from the environment, or our own; missing → SKIP (a failure under CI=true)
// ------------------------------------------------------------------------------------------------

/// The URL in `var`, or `None` after a skip.
fn env_url(var: &str) -> Option<RedisUrl> {
    match std::env::var(var) {
        Ok(u) if !u.is_empty() => Some(RedisUrl::parse(&u).expect("test URL parses")),
        _ => {
            skip(&format!(
                "{var} is not set (run under scripts/redis-servers.sh)"
            ));
            None
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Fixtures
// ------------------------------------------------------------------------------------------------

/// A scope no other test (or earlier run) shares.
fn scope(world_size: usize, bytes: usize) -> RemoteScope {
    let nonce: u64 = rand_u64();
    RemoteScope::new(
        &format!("redis-test-{nonce:016x}"),
        16,
        world_size,
        bytes,
        HashAlgorithm::default(),
    )
    .unwrap()
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
    );
    h.finish()
}

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn connect(url: &RedisUrl, scope: RemoteScope, secret: Option<&[u8]>) -> RedisStore {
    RedisStore::connect(
        url,
        scope,
        RedisOptions {
            secret: secret.map(<[u8]>::to_vec),
            ..RedisOptions::default()
        },
    )
    .expect("connect")
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

/// Reads `keys` for `rank`; the bytes read for each hit.
fn get(store: &RedisStore, rank: usize, keys: &[u128]) -> (Vec<RemoteRead>, Vec<Vec<u8>>) {
    let n = store.scope().bytes_per_block;
    let mut bufs = vec![vec![0u8; n]; keys.len()];
    let reads = {
        let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        store.get(rank, keys, &mut dst, soon()).expect("get")
    };
    (reads, bufs)
}

fn put(store: &RedisStore, rank: usize, blocks: &[(u128, Vec<u8>)]) -> RemotePut {
    let refs: Vec<(u128, &[u8])> = blocks.iter().map(|(k, b)| (*k, b.as_slice())).collect();
    store.put(rank, &refs, soon()).expect("put")
}

fn set_raw(store: &RedisStore, name: &str, value: &[u8]) {
    store
        .raw_command(&[b"SET", name.as_bytes(), value], soon())
        .expect("SET");
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let until = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ------------------------------------------------------------------------------------------------
// The same checks on a standalone server and on a cluster
// ------------------------------------------------------------------------------------------------

fn round_trip(url: &RedisUrl) {
    let ws = 4;
    let bytes = 8192 + 3;
    let store = connect(url, scope(ws, bytes), None);
    let keys: Vec<u128> = (0..12u128).map(|i| (i << 64) | 0xfeed).collect();
    for rank in 0..ws {
        let blocks: Vec<(u128, Vec<u8>)> = keys
            .iter()
            .map(|&k| {
                (
                    k,
                    random_bytes(bytes, k as u64 ^ (rank as u64) << 40 ^ (k >> 64) as u64),
                )
            })
            .collect();
        assert_eq!(
            put(&store, rank, &blocks),
            RemotePut {
                written: keys.len(),
                present: 0
            }
        );
        let (reads, bufs) = get(&store, rank, &keys);
        assert!(reads.iter().all(|r| *r == RemoteRead::Hit), "{reads:?}");
        for ((_, want), got) in blocks.iter().zip(&bufs) {
            assert_eq!(want, got, "rank {rank}: bytes differ");
        }
        // Written again: present, not rewritten.
        assert_eq!(
            put(&store, rank, &blocks),
            RemotePut {
                written: 0,
                present: keys.len()
            }
        );
    }
    assert_eq!(store.lookup_prefix(&keys, soon()).unwrap(), keys.len());
    let stats = store.stats();
    assert!(stats.available);
    assert_eq!((stats.errors, stats.timeouts, stats.invalid), (0, 0, 0));
    // A key never written: missing, and the buffer untouched.
    let (reads, bufs) = get(&store, 1, &[keys[0], 0xdead]);
    assert_eq!(reads, vec![RemoteRead::Hit, RemoteRead::Missing]);
    assert!(bufs[1].iter().all(|&b| b == 0));
}

fn lookup_stops_at_first_miss(url: &RedisUrl) {
    let ws = 2;
    let store = connect(url, scope(ws, 64), None);
    let keys: Vec<u128> = (1..=70u128).collect();
    let all: Vec<(u128, Vec<u8>)> = keys.iter().map(|&k| (k, vec![k as u8; 64])).collect();
    put(&store, 0, &all);
    // Rank 1 lacks key 36 (past the first round of 32) and key 50.
    let rank1: Vec<(u128, Vec<u8>)> = all
        .iter()
        .filter(|(k, _)| *k != 36 && *k != 50)
        .cloned()
        .collect();
    put(&store, 1, &rank1);
    assert_eq!(store.lookup_prefix(&keys, soon()).unwrap(), 35);
    assert_eq!(store.lookup_prefix(&keys[..10], soon()).unwrap(), 10);
    assert_eq!(store.lookup_prefix(&keys[36..49], soon()).unwrap(), 13);
    assert_eq!(store.lookup_prefix(&[999, 1, 2], soon()).unwrap(), 0);
    assert_eq!(store.lookup_prefix(&[], soon()).unwrap(), 0);
    // A block whose ranks are all there except one is not found.
    put(&store, 1, &[(36, vec![0; 64])]);
    assert_eq!(store.lookup_prefix(&keys, soon()).unwrap(), 49);
}

fn present_value_is_not_rewritten(url: &RedisUrl) {
    let store = connect(url, scope(1, 128), None);
    assert_eq!(put(&store, 0, &[(5, vec![1; 128])]).written, 1);
    let again = put(&store, 0, &[(5, vec![2; 128]), (6, vec![3; 128])]);
    assert_eq!(
        again,
        RemotePut {
            written: 1,
            present: 1
        }
    );
    let (reads, bufs) = get(&store, 0, &[5, 6]);
    assert_eq!(reads, vec![RemoteRead::Hit, RemoteRead::Hit]);
    assert_eq!(bufs[0], vec![1; 128], "the first value stays");
    assert_eq!(bufs[1], vec![3; 128]);
}

fn planted_values_are_never_served(url: &RedisUrl) {
    let n = 256;
    for secret in [None, Some(&b"deployment secret"[..])] {
        let sc = scope(2, n);
        let store = connect(url, sc.clone(), secret);
        let good = random_bytes(n, 7);
        let name = |k: u128| store.key_name(k, 1);
        let plant = |k: u128, v: Vec<u8>| {
            set_raw(&store, &name(k), &v);
            k
        };
        let mut cases: Vec<(u128, &str)> = Vec::new();
        // Another block's value under this block's name.
        cases.push((plant(1, store.encode_value(2, 1, &good)), "block key"));
        // Another rank's share.
        cases.push((plant(3, store.encode_value(3, 0, &good)), "rank"));
        // Payload altered after writing (checksum, or MAC with a secret).
        let mut flipped = store.encode_value(4, 1, &good);
        *flipped.last_mut().unwrap() ^= 0x40;
        cases.push((
            plant(4, flipped),
            if secret.is_some() { "MAC" } else { "checksum" },
        ));
        // Truncated, and longer than any valid value.
        let v = store.encode_value(5, 1, &good);
        cases.push((plant(5, v[..v.len() - 10].to_vec()), "truncated"));
        cases.push((plant(6, v[..20].to_vec()), "truncated"));
        let mut long = store.encode_value(7, 1, &good);
        long.extend_from_slice(&[0; 100_000]);
        cases.push((plant(7, long), "longer"));
        // Not ours at all.
        cases.push((
            plant(
                8,
                b"hello, this is not a block at all, but long enough to have a header.".to_vec(),
            ),
            "magic",
        ));
        // Written for another scope (other bytes per block): fingerprint/length differ.
        let other = connect(url, scope(2, n), None);
        cases.push((plant(9, other.encode_value(9, 1, &good)), "fingerprint"));
        // With a secret: a value written without it, or with another one.
        if secret.is_some() {
            let plain = connect(url, sc.clone(), None);
            cases.push((plant(10, plain.encode_value(10, 1, &good)), "no MAC"));
            let forger = connect(url, sc.clone(), Some(b"guessed"));
            cases.push((
                plant(11, forger.encode_value(11, 1, &good)),
                "MAC does not match",
            ));
        }
        // Empty: `SET key ""` makes EXISTS (the lookup) match while GETRANGE reads it as a
        // missing key; before, it was never withdrawn and the same load error came back.
        cases.push((plant(13, Vec::new()), "empty"));
        // Not a string (WRONGTYPE).
        store
            .raw_command(&[b"RPUSH", name(12).as_bytes(), b"x"], soon())
            .unwrap();
        cases.push((12, "WRONGTYPE"));

        let keys: Vec<u128> = cases.iter().map(|c| c.0).collect();
        let (reads, bufs) = get(&store, 1, &keys);
        for ((k, why), read) in cases.iter().zip(&reads) {
            match read {
                RemoteRead::Invalid(reason) => {
                    assert!(
                        reason.contains(why),
                        "key {k}: `{reason}` should name {why}"
                    )
                }
                other => panic!("key {k} ({why}): {other:?}, expected Invalid"),
            }
        }
        assert!(
            bufs.iter().all(|b| b.iter().all(|&x| x == 0)),
            "nothing served"
        );
        assert_eq!(store.stats().invalid, cases.len() as u64);
        // Invalid values are withdrawn (deleted in the background), so a good write replaces
        // them instead of finding them "present".
        wait_for(
            "invalid values to be withdrawn",
            Duration::from_secs(5),
            || {
                keys.iter().all(|&k| {
                    store
                        .raw_command(&[b"EXISTS", name(k).as_bytes()], soon())
                        .unwrap()
                        == b"0"
                })
            },
        );
        let fresh: Vec<(u128, Vec<u8>)> = keys.iter().map(|&k| (k, good.clone())).collect();
        assert_eq!(put(&store, 1, &fresh).written, keys.len());
        let (reads, _) = get(&store, 1, &keys);
        assert!(reads.iter().all(|r| *r == RemoteRead::Hit), "{reads:?}");
        // The valid value next to them is still served.
        put(&store, 1, &[(20, good.clone())]);
        let (reads, bufs) = get(&store, 1, &[20]);
        assert_eq!(reads, vec![RemoteRead::Hit]);
        assert_eq!(bufs[0], good);
    }
}

macro_rules! both {
    ($name:ident) => {
        mod $name {
            #[test]
            fn standalone() {
                if let Some(url) = super::env_url("KVBM_TEST_REDIS_URL") {
                    super::$name(&url);
                }
            }
            #[test]
            fn cluster() {
                if let Some(url) = super::env_url("KVBM_TEST_REDIS_CLUSTER_URL") {
                    assert!(url.cluster);
                    super::$name(&url);
                }
            }
        }
    };
}

both!(round_trip);
both!(lookup_stops_at_first_miss);
both!(present_value_is_not_rewritten);
both!(planted_values_are_never_served);

// ------------------------------------------------------------------------------------------------
// Standalone only
// ------------------------------------------------------------------------------------------------

#[test]
fn expired_values_are_missing() {
    let Some(url) = env_url("KVBM_TEST_REDIS_URL") else {
        return;
    };
    let store = RedisStore::connect(
        &url,
        scope(1, 32),
        RedisOptions {
            ttl: Some(Duration::from_millis(150)),
            ..RedisOptions::default()
        },
    )
    .unwrap();
    put(&store, 0, &[(1, vec![9; 32])]);
    assert_eq!(get(&store, 0, &[1]).0, vec![RemoteRead::Hit]);
    let ttl = store
        .raw_command(&[b"PTTL", store.key_name(1, 0).as_bytes()], soon())
        .unwrap();
    let ttl: i64 = String::from_utf8_lossy(&ttl)
        .parse()
        .expect("PTTL answers a number");
    assert!((1..=150).contains(&ttl), "PTTL {ttl}");
    wait_for("the value to expire", Duration::from_secs(5), || {
        get(&store, 0, &[1]).0 == vec![RemoteRead::Missing]
    });
    assert_eq!(store.lookup_prefix(&[1], soon()).unwrap(), 0);
    assert_eq!(store.stats().invalid, 0);
}

#[test]
fn flushed_and_evicted_values_are_missing() {
    let Some(server) =
        OwnServer::start(&["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"])
    else {
        return;
    };
    let n = 64 * 1024;
    let store = connect(&RedisUrl::parse(&server.url()).unwrap(), scope(1, n), None);
    // 200 blocks of 64 KiB (12.5 MiB) into 4 MiB: most are evicted.
    let keys: Vec<u128> = (0..200u128).collect();
    for chunk in keys.chunks(20) {
        let blocks: Vec<(u128, Vec<u8>)> = chunk
            .iter()
            .map(|&k| (k, random_bytes(n, k as u64 + 1)))
            .collect();
        put(&store, 0, &blocks);
    }
    let (reads, bufs) = get(&store, 0, &keys);
    let hits = reads.iter().filter(|r| **r == RemoteRead::Hit).count();
    let missing = reads.iter().filter(|r| **r == RemoteRead::Missing).count();
    assert_eq!(hits + missing, keys.len(), "{reads:?}");
    assert!(missing > 100, "{missing} missing: eviction did not happen");
    assert!(hits > 0, "nothing kept");
    for ((k, r), b) in keys.iter().zip(&reads).zip(&bufs) {
        if *r == RemoteRead::Hit {
            assert_eq!(*b, random_bytes(n, *k as u64 + 1));
        }
    }
    assert!(store.lookup_prefix(&keys, soon()).unwrap() < keys.len());
    // FLUSHALL: every block is a miss.
    store.raw_command(&[b"FLUSHALL"], soon()).unwrap();
    let (reads, _) = get(&store, 0, &keys[190..]);
    assert!(reads.iter().all(|r| *r == RemoteRead::Missing), "{reads:?}");
    assert_eq!(store.lookup_prefix(&keys, soon()).unwrap(), 0);
    assert_eq!(store.stats().invalid, 0);
}

#[test]
fn auth_required_and_refused_when_wrong() {
    let (Some(auth), Some(acl)) = (
        env_url("KVBM_TEST_REDIS_AUTH_URL"),
        env_url("KVBM_TEST_REDIS_ACL_URL"),
    ) else {
        return;
    };
    for url in [&auth, &acl] {
        let store = connect(url, scope(2, 16), None);
        for rank in 0..2 {
            put(&store, rank, &[(1, vec![1; 16])]);
            assert_eq!(put(&store, rank, &[(1, vec![1; 16])]).present, 1);
        }
        assert_eq!(
            get(&store, 0, &[1, 2]).0,
            vec![RemoteRead::Hit, RemoteRead::Missing]
        );
        assert_eq!(store.lookup_prefix(&[1, 2], soon()).unwrap(), 1);
        assert!(!store.describe().contains("pass"), "{}", store.describe());
        assert_eq!(store.stats().errors, 0);
    }
    // The ACL user (scripts/redis-servers.sh) may use only the tier's commands on `kvbm:*`
    // keys: the least a deployment needs works, and the rest is refused.
    let store = connect(&acl, scope(1, 16), None);
    let e = store.raw_command(&[b"FLUSHALL"], soon()).unwrap_err();
    assert!(
        e.to_string().contains("NOPERM") || e.to_string().contains("permission"),
        "{e}"
    );
    let e = store
        .raw_command(&[b"SET", b"other", b"x"], soon())
        .unwrap_err();
    assert!(
        e.to_string().contains("NOPERM") || e.to_string().contains("permission"),
        "{e}"
    );
    let port = auth.nodes[0].1;
    for (url, secret) in [
        (format!("redis://127.0.0.1:{port}/0"), None),
        (
            format!("redis://:wrong-pass@127.0.0.1:{port}/0"),
            Some("wrong-pass"),
        ),
        (
            format!("redis://kvbm:wrong-user-pass@127.0.0.1:{port}/0"),
            Some("wrong-user-pass"),
        ),
        (
            format!("redis://nobody:kvbm-test-pass@127.0.0.1:{port}/0"),
            Some("kvbm-test-pass"),
        ),
    ] {
        let e = RedisStore::connect(
            &RedisUrl::parse(&url).unwrap(),
            scope(1, 16),
            RedisOptions::default(),
        )
        .expect_err(&url);
        assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{url}: {e}");
        let text = e.to_string();
        assert!(
            text.contains("remote.url") && text.contains("refused"),
            "{text}"
        );
        if let Some(s) = secret {
            assert!(!text.contains(s), "password shown: {text}");
        }
    }
}

#[test]
fn killed_server_errors_within_the_deadline_then_reconnects() {
    let Some(mut server) = OwnServer::start(&[]) else {
        return;
    };
    let store = connect(
        &RedisUrl::parse(&server.url()).unwrap(),
        scope(2, 1024),
        None,
    );
    put(&store, 0, &[(1, vec![1; 1024])]);
    server.kill();
    // Calls fail (never hang) within their deadline, then fail fast while it is down.
    for _ in 0..5 {
        let t = Instant::now();
        let deadline = t + Duration::from_millis(300);
        let e = store
            .lookup_prefix(&[1], deadline)
            .expect_err("server is down");
        assert!(
            Instant::now() < deadline + Duration::from_millis(200),
            "took {:?}: {e}",
            t.elapsed()
        );
        let mut b = vec![0u8; 1024];
        assert!(store.get(0, &[1], &mut [&mut b[..]], deadline).is_err());
    }
    let stats = store.stats();
    assert!(!stats.available);
    assert!(stats.errors >= 5, "{stats:?}");
    let t = Instant::now();
    let e = store
        .lookup_prefix(&[1], t + Duration::from_secs(5))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotReady, "{e}");
    assert!(
        // Fail fast: far below the 5 s deadline a waiting call would use.
        t.elapsed() < Duration::from_secs(2),
        "not fast: {:?}",
        t.elapsed()
    );
    // Back, empty: it reconnects by itself; the block is gone.
    server.spawn();
    wait_for("the store to reconnect", Duration::from_secs(15), || {
        store.stats().available
    });
    assert!(store.stats().reconnects >= 1);
    assert_eq!(get(&store, 0, &[1]).0, vec![RemoteRead::Missing]);
    put(&store, 0, &[(1, vec![2; 1024])]);
    assert_eq!(get(&store, 0, &[1]).0, vec![RemoteRead::Hit]);
}

#[test]
fn a_server_that_stops_answering_times_out_at_the_deadline() {
    let Some(server) = OwnServer::start(&[]) else {
        return;
    };
    let store = connect(&RedisUrl::parse(&server.url()).unwrap(), scope(1, 64), None);
    put(&store, 0, &[(1, vec![1; 64])]);
    server.signal(libc::SIGSTOP);
    for _ in 0..3 {
        let t = Instant::now();
        let deadline = t + Duration::from_millis(100);
        let e = store.lookup_prefix(&[1], deadline).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert!(
            Instant::now() < deadline + Duration::from_millis(200),
            "{:?}",
            t.elapsed()
        );
    }
    let stats = store.stats();
    assert_eq!(stats.timeouts, 3, "{stats:?}");
    // Three in a row: the connection counts as lost; calls fail fast.
    assert!(!stats.available);
    let t = Instant::now();
    assert!(store
        .lookup_prefix(&[1], t + Duration::from_secs(5))
        .is_err());
    assert!(
        // Fail fast: far below the 5 s deadline a waiting call would use.
        t.elapsed() < Duration::from_secs(2),
        "{:?}",
        t.elapsed()
    );
    server.signal(libc::SIGCONT);
    wait_for("the store to reconnect", Duration::from_secs(15), || {
        store.stats().available
    });
    assert_eq!(get(&store, 0, &[1]).0, vec![RemoteRead::Hit]);
}

/// A read of values that misses its deadline resets the connection at once (lookups need three
/// in a row): on the pipelined connection every later reply waits behind the one that did not
/// arrive. How it would fail: after one timed-out read the store still counts as available and
/// the next calls queue behind the stalled reply.
#[test]
fn a_value_read_past_its_deadline_resets_the_connection_at_once() {
    let Some(server) = OwnServer::start(&[]) else {
        return;
    };
    let store = connect(&RedisUrl::parse(&server.url()).unwrap(), scope(1, 64), None);
    put(&store, 0, &[(1, vec![1; 64])]);
    server.signal(libc::SIGSTOP);
    let e = store
        .lookup_prefix(&[1], Instant::now() + Duration::from_millis(100))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(
        store.stats().available,
        "one late lookup is not a lost connection"
    );
    let mut buf = vec![0u8; 64];
    let e = store
        .get(
            0,
            &[1],
            &mut [buf.as_mut_slice()],
            Instant::now() + Duration::from_millis(100),
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    let stats = store.stats();
    assert_eq!(stats.timeouts, 2, "{stats:?}");
    assert!(
        !stats.available,
        "a late value read resets the connection: {stats:?}"
    );
    server.signal(libc::SIGCONT);
    wait_for("the store to reconnect", Duration::from_secs(15), || {
        store.stats().available
    });
    assert_eq!(get(&store, 0, &[1]).0, vec![RemoteRead::Hit]);
}

#[test]
fn a_store_made_while_the_server_is_down_connects_later() {
    let Some(mut server) = OwnServer::start(&[]) else {
        return;
    };
    server.kill();
    let store = connect(&RedisUrl::parse(&server.url()).unwrap(), scope(1, 64), None);
    assert!(!store.stats().available);
    assert_eq!(
        store.lookup_prefix(&[1], soon()).unwrap_err().kind(),
        ErrorKind::NotReady
    );
    server.spawn();
    wait_for("the store to connect", Duration::from_secs(15), || {
        store.stats().available
    });
    put(&store, 0, &[(1, vec![1; 64])]);
    assert_eq!(store.lookup_prefix(&[1], soon()).unwrap(), 1);
}

#[test]
fn bad_arguments_are_typed_errors() {
    let Some(url) = env_url("KVBM_TEST_REDIS_URL") else {
        return;
    };
    let store = connect(&url, scope(2, 64), None);
    let mut small = [0u8; 63];
    let e = store
        .get(0, &[1], &mut [&mut small[..]], soon())
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let e = store.get(0, &[1, 2], &mut [], soon()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let mut ok = [0u8; 64];
    let e = store.get(2, &[1], &mut [&mut ok[..]], soon()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
    let e = store.put(0, &[(1, &[0u8; 65][..])], soon()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    // A deadline already past: a timeout, not a call.
    let e = store
        .lookup_prefix(&[1], Instant::now() - Duration::from_millis(1))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    // Nothing was stored by the refused calls.
    assert_eq!(store.lookup_prefix(&[1], soon()).unwrap(), 0);
}

#[test]
fn tls_url_to_a_plain_server_is_an_error_not_a_hang() {
    let Some(url) = env_url("KVBM_TEST_REDIS_URL") else {
        return;
    };
    let tls = RedisUrl::parse(&format!("rediss://127.0.0.1:{}/0", url.nodes[0].1)).unwrap();
    let t = Instant::now();
    let store = RedisStore::connect(
        &tls,
        scope(1, 16),
        RedisOptions {
            connect_timeout: Duration::from_millis(500),
            ..RedisOptions::default()
        },
    );
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    if let Ok(store) = store {
        assert!(!store.stats().available);
        assert!(store.lookup_prefix(&[1], soon()).is_err());
    }
}

// ------------------------------------------------------------------------------------------------
// TLS: a private CA, client certificates (the TLS servers of scripts/redis-servers.sh)
// ------------------------------------------------------------------------------------------------

/// The TLS test files' directory, or `None` after a skip.
fn tls_dir() -> Option<std::path::PathBuf> {
    match std::env::var("KVBM_TEST_REDIS_TLS_DIR") {
        Ok(d) if !d.is_empty() => Some(d.into()),
        _ => {
            skip("KVBM_TEST_REDIS_TLS_DIR is not set (run under scripts/redis-servers.sh)");
            None
        }
    }
}

/// The TLS options a deployment would set: read through the configuration, as the engine does.
fn tls_options(
    dir: &std::path::Path,
    ca: Option<&str>,
    client: Option<(&str, &str)>,
) -> kvbm_connector::Result<RedisOptions> {
    let remote = kvbm_connector::config::RemoteConfig {
        tls_ca_file: ca.map(|f| dir.join(f)),
        tls_cert_file: client.map(|(c, _)| dir.join(c)),
        tls_key_file: client.map(|(_, k)| dir.join(k)),
        ..Default::default()
    };
    Ok(RedisOptions {
        tls: remote.tls_files()?,
        connect_timeout: Duration::from_secs(2),
        ..RedisOptions::default()
    })
}

/// Connects to `url` with [`tls_options`] (the system's roots when `ca` is `None`).
fn connect_tls(
    url: &RedisUrl,
    scope: RemoteScope,
    dir: &std::path::Path,
    ca: Option<&str>,
    client: Option<(&str, &str)>,
) -> kvbm_connector::Result<RedisStore> {
    RedisStore::connect(url, scope, tls_options(dir, ca, client).unwrap())
}

/// Connects to `url` trusting the test CA (presenting `client` if given; `what` names the case),
/// checks the store is available, then writes, reads back and looks up blocks on two ranks.
fn tls_round_trip(url: &RedisUrl, dir: &std::path::Path, client: Option<(&str, &str)>, what: &str) {
    let store = connect_tls(url, scope(2, 4099), dir, Some("ca.pem"), client).expect(what);
    assert!(store.stats().available, "{what}");
    let keys: Vec<u128> = (0..6u128).map(|i| (i << 64) | 0x7150).collect();
    for rank in 0..2 {
        let blocks: Vec<(u128, Vec<u8>)> = keys
            .iter()
            .map(|&k| (k, random_bytes(4099, k as u64 ^ rank as u64)))
            .collect();
        assert_eq!(put(&store, rank, &blocks).written, keys.len());
        let (reads, bufs) = get(&store, rank, &keys);
        assert!(reads.iter().all(|r| *r == RemoteRead::Hit), "{reads:?}");
        for ((_, want), got) in blocks.iter().zip(&bufs) {
            assert_eq!(want, got, "rank {rank}: bytes differ over TLS");
        }
    }
    assert_eq!(store.lookup_prefix(&keys, soon()).unwrap(), keys.len());
    assert_eq!(store.stats().errors, 0);
}

/// A connection refused over certificates: a typed error naming `key`, quickly, never a store
/// that keeps retrying something that cannot work.
fn assert_tls_refused(r: kvbm_connector::Result<RedisStore>, key: &str, what: &str) {
    let t = Instant::now();
    let e = r.expect_err(what);
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "{what}: {:?}",
        t.elapsed()
    );
    assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{what}: {e}");
    assert!(e.to_string().contains(key), "{what}: {e}");
}

#[test]
fn tls_with_a_private_ca_round_trips_and_an_untrusted_server_is_refused() {
    let (Some(url), Some(dir)) = (env_url("KVBM_TEST_REDIS_TLS_URL"), tls_dir()) else {
        return;
    };
    assert!(url.tls);
    tls_round_trip(&url, &dir, None, "TLS with the test CA");
    // The same server reached by a name its certificate does not list (it also listens on
    // 127.0.0.2; the certificate names 127.0.0.1 and localhost): the URL is what to fix.
    let other_name = RedisUrl::parse(&format!("rediss://127.0.0.2:{}/0", url.nodes[0].1)).unwrap();
    assert_tls_refused(
        connect_tls(&other_name, scope(1, 16), &dir, Some("ca.pem"), None),
        "remote.url",
        "a host name the certificate does not list",
    );
    // The system's roots do not know the test CA, nor does another CA.
    for (ca, what) in [(None, "system roots"), (Some("other-ca.pem"), "another CA")] {
        assert_tls_refused(
            connect_tls(&url, scope(1, 16), &dir, ca, None),
            "remote.tls_ca_file",
            what,
        );
    }
}

#[test]
fn mutual_tls_cluster_round_trips_and_refuses_an_untrusted_server_or_a_missing_certificate() {
    let (Some(url), Some(dir)) = (env_url("KVBM_TEST_REDIS_TLS_CLUSTER_URL"), tls_dir()) else {
        return;
    };
    assert!(url.tls && url.cluster);
    tls_round_trip(
        &url,
        &dir,
        Some(("client.pem", "client.key")),
        "mutual TLS cluster with the test CA and client certificate",
    );
    // The cluster client reports these as text only; they are still told apart.
    assert_tls_refused(
        RedisStore::connect(&url, scope(1, 16), RedisOptions::default()),
        "remote.tls_ca_file",
        "a TLS cluster with the system roots",
    );
    assert_tls_refused(
        connect_tls(&url, scope(1, 16), &dir, Some("ca.pem"), None),
        "remote.tls_cert_file",
        "a mutual TLS cluster without a client certificate",
    );
}

#[test]
fn mutual_tls_needs_a_client_certificate_from_the_servers_ca() {
    let (Some(url), Some(dir)) = (env_url("KVBM_TEST_REDIS_MTLS_URL"), tls_dir()) else {
        return;
    };
    tls_round_trip(
        &url,
        &dir,
        Some(("client.pem", "client.key")),
        "mutual TLS with the test client certificate",
    );
    for (client, what) in [
        (None, "no client certificate"),
        (
            Some(("other-client.pem", "other-client.key")),
            "a client certificate from another CA",
        ),
    ] {
        assert_tls_refused(
            connect_tls(&url, scope(1, 16), &dir, Some("ca.pem"), client),
            "remote.tls_cert_file",
            what,
        );
    }
}

/// A CA file, a client certificate and key, and the setting the error must name.
type TlsCase = (
    Option<std::path::PathBuf>,
    Option<(std::path::PathBuf, std::path::PathBuf)>,
    &'static str,
);

#[test]
fn bad_tls_files_are_typed_errors_naming_the_setting() {
    let (Some(url), Some(dir)) = (env_url("KVBM_TEST_REDIS_TLS_URL"), tls_dir()) else {
        return;
    };
    let scratch = tempfile::tempdir().unwrap();
    let key_text = std::fs::read_to_string(dir.join("client.key")).unwrap();
    let junk = scratch.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate\n").unwrap();
    let key_as_ca = dir.join("client.key");
    // The key flattened onto one line (as pasting into a secret store may do): the PEM parser's
    // own error would carry the file's bytes.
    let one_line_key = scratch.path().join("one-line.key");
    std::fs::write(&one_line_key, key_text.replace('\n', " ")).unwrap();
    let key_body: String = key_text
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .collect();
    let key_bytes_listed = format!("{:?}", &key_body.as_bytes()[..6]);
    let key_bytes_listed = key_bytes_listed
        .trim_matches(|c| c == '[' || c == ']')
        .to_string();
    let cases: Vec<TlsCase> = vec![
        // A CA file with no certificate in it.
        (Some(junk.clone()), None, "remote.tls_ca_file"),
        (Some(key_as_ca), None, "remote.tls_ca_file"),
        // A client certificate file with no certificate; a key file with no key.
        (
            None,
            Some((junk.clone(), dir.join("client.key"))),
            "remote.tls_cert_file",
        ),
        (
            None,
            Some((dir.join("client.pem"), junk.clone())),
            "remote.tls_key_file",
        ),
        (
            None,
            Some((dir.join("client.pem"), one_line_key.clone())),
            "remote.tls_key_file",
        ),
        // A key that is not the certificate's.
        (
            None,
            Some((dir.join("client.pem"), dir.join("other-client.key"))),
            "remote.tls_cert_file",
        ),
    ];
    for (ca, client, key) in cases {
        let remote = kvbm_connector::config::RemoteConfig {
            tls_ca_file: ca.clone(),
            tls_cert_file: client.as_ref().map(|(c, _)| c.clone()),
            tls_key_file: client.as_ref().map(|(_, k)| k.clone()),
            ..Default::default()
        };
        let options = RedisOptions {
            tls: remote.tls_files().unwrap(),
            ..RedisOptions::default()
        };
        let what = format!("{ca:?} {client:?}");
        let e = RedisStore::connect(&url, scope(1, 16), options).expect_err(&what);
        assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{what}: {e}");
        let text = e.to_string();
        assert!(text.contains(key), "{what}: want {key} in {text}");
        for line in key_text.lines().filter(|l| !l.starts_with("-----")) {
            assert!(
                !text.contains(line),
                "{what}: the key's contents are shown: {text}"
            );
        }
        assert!(
            !text.contains(&key_body[..16]) && !text.contains(&key_bytes_listed),
            "{what}: the key's contents are shown: {text}"
        );
    }
    // TLS files with a plain URL: refused, not ignored.
    let plain = RedisUrl::parse(&format!("redis://127.0.0.1:{}/0", url.nodes[0].1)).unwrap();
    let e = connect_tls(&plain, scope(1, 16), &dir, Some("ca.pem"), None)
        .expect_err("TLS files with redis://");
    assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{e}");
    assert!(e.to_string().contains("rediss://"), "{e}");
}
