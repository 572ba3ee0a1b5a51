//! One conformance suite for every [`RemoteStore`]: what the trait promises (`src/connector/
//! remote.rs`), checked on a store a backend builds. A backend's test file provides a
//! [`StoreMaker`] (a store for a scope, all of them over one backing server or map) and stamps
//! one `#[test]` per check with [`remote_conformance!`]; `tests/remote_conformance.rs` does it
//! for the in-process `memory://` store and for Redis / Valkey.
//!
//! How each check would fail: a store that serves a value of another scope or rank
//! (`scopes_and_ranks_never_share_a_value`), overwrites a present value or reports it written
//! (`a_present_value_is_kept_and_counted`), counts a prefix past a key some rank lacks
//! (`lookup_counts_the_prefix_every_rank_holds`), answers a missing key with an error or a hit
//! (`a_missing_key_is_a_miss_not_an_error`), accepts a value of the wrong length
//! (`a_value_of_the_wrong_length_is_refused`), or waits past a deadline that already passed
//! (`a_passed_deadline_is_answered_at_once`).

#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_connector::connector::remote::{RemoteRead, RemoteScope, RemoteStore};
use kvbm_connector::{ErrorKind, HashAlgorithm};

/// Builds a store of the backend under test for a scope; every store it builds shares one
/// backing (one server, one map), as instances of a deployment share it.
pub trait StoreMaker {
    /// A store for `scope`, or `None` when the backend is not available here (the caller has
    /// already said why: a skip, or a failure under `CI=true`).
    fn make(&self, scope: &RemoteScope) -> Option<Arc<dyn RemoteStore>>;
}

/// Bytes of one rank's share of a block in these checks.
pub const BYTES: usize = 256;

/// A scope no other check, test run or earlier run shares.
pub fn fresh_scope(world_size: usize) -> RemoteScope {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    RemoteScope::new(
        &format!("conformance-{:016x}", h.finish()),
        16,
        world_size,
        BYTES,
        HashAlgorithm::default(),
    )
    .expect("scope")
}

/// Distinct bytes for (rank, key).
pub fn value(rank: usize, key: u128) -> Vec<u8> {
    let mut x = (key as u64) ^ ((rank as u64 + 1) << 48) ^ 0x9e37_79b9_7f4a_7c15;
    (0..BYTES)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

fn put(store: &dyn RemoteStore, rank: usize, keys: &[u128]) {
    let values: Vec<Vec<u8>> = keys.iter().map(|&k| value(rank, k)).collect();
    let blocks: Vec<(u128, &[u8])> = keys
        .iter()
        .copied()
        .zip(values.iter().map(Vec::as_slice))
        .collect();
    store.put(rank, &blocks, deadline()).expect("put");
}

fn get(store: &dyn RemoteStore, rank: usize, keys: &[u128]) -> (Vec<RemoteRead>, Vec<Vec<u8>>) {
    let mut bufs = vec![vec![0u8; BYTES]; keys.len()];
    let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let reads = store.get(rank, keys, &mut dst, deadline()).expect("get");
    assert_eq!(reads.len(), keys.len(), "one outcome per key");
    (reads, bufs)
}

/// What is put is read back, byte for byte, by key and rank, in one batch of many.
pub fn what_is_put_is_read_back(m: &dyn StoreMaker) {
    let Some(s) = m.make(&fresh_scope(2)) else {
        return;
    };
    let keys: Vec<u128> = (1..=64).map(|k| k * 0x1_0000_0001).collect();
    for rank in 0..2 {
        put(s.as_ref(), rank, &keys);
    }
    for rank in 0..2 {
        let (reads, bufs) = get(s.as_ref(), rank, &keys);
        for (i, (r, b)) in reads.iter().zip(&bufs).enumerate() {
            assert_eq!(r, &RemoteRead::Hit, "rank {rank} key {i}");
            assert_eq!(
                b,
                &value(rank, keys[i]),
                "rank {rank} key {i}: bytes differ"
            );
        }
    }
    assert!(s.stats().available, "{:?}", s.stats());
}

/// A key never written reads as a miss (not an error, not a hit), beside keys that hit.
pub fn a_missing_key_is_a_miss_not_an_error(m: &dyn StoreMaker) {
    let Some(s) = m.make(&fresh_scope(1)) else {
        return;
    };
    put(s.as_ref(), 0, &[10, 30]);
    let (reads, bufs) = get(s.as_ref(), 0, &[10, 20, 30]);
    assert_eq!(reads[0], RemoteRead::Hit);
    assert_eq!(reads[1], RemoteRead::Missing);
    assert_eq!(reads[2], RemoteRead::Hit);
    assert_eq!(bufs[2], value(0, 30));
}

/// `lookup_prefix` counts keys from the first while every rank holds them: it stops at a key
/// one rank lacks, at an unknown key, and is 0 for no keys.
pub fn lookup_counts_the_prefix_every_rank_holds(m: &dyn StoreMaker) {
    let Some(s) = m.make(&fresh_scope(2)) else {
        return;
    };
    put(s.as_ref(), 0, &[1, 2, 3, 4]);
    put(s.as_ref(), 1, &[1, 2, 4]);
    let n = |keys: &[u128]| s.lookup_prefix(keys, deadline()).expect("lookup");
    assert_eq!(n(&[1, 2, 3, 4]), 2, "rank 1 lacks key 3");
    assert_eq!(n(&[1, 2]), 2);
    assert_eq!(n(&[9, 1, 2]), 0, "the first key is unknown");
    assert_eq!(n(&[]), 0);
}

/// Values are the scope's and the rank's own: another scope (another model, layout or
/// namespace) and another rank never see them.
pub fn scopes_and_ranks_never_share_a_value(m: &dyn StoreMaker) {
    let (Some(a), Some(b)) = (m.make(&fresh_scope(2)), m.make(&fresh_scope(2))) else {
        return;
    };
    assert_ne!(a.scope(), b.scope());
    put(a.as_ref(), 0, &[5, 6]);
    assert_eq!(b.lookup_prefix(&[5], deadline()).expect("lookup"), 0);
    let (reads, _) = get(b.as_ref(), 0, &[5, 6]);
    assert_eq!(reads, vec![RemoteRead::Missing, RemoteRead::Missing]);
    let (reads, _) = get(a.as_ref(), 1, &[5]);
    assert_eq!(reads, vec![RemoteRead::Missing], "rank 1 never wrote key 5");
    assert_eq!(
        a.lookup_prefix(&[5], deadline()).expect("lookup"),
        0,
        "rank 1 lacks it"
    );
}

/// Writing a key that is present keeps the first value (blocks are immutable: same key, same
/// bytes) and says so (`present`, not `written`).
pub fn a_present_value_is_kept_and_counted(m: &dyn StoreMaker) {
    let Some(s) = m.make(&fresh_scope(1)) else {
        return;
    };
    let first = value(0, 77);
    let r = s.put(0, &[(77, &first)], deadline()).expect("put");
    assert_eq!((r.written, r.present), (1, 0));
    let other = vec![0xAB; BYTES];
    let r = s
        .put(0, &[(77, &other), (78, &value(0, 78))], deadline())
        .expect("put");
    assert_eq!((r.written, r.present), (1, 1), "{r:?}");
    let (reads, bufs) = get(s.as_ref(), 0, &[77]);
    assert_eq!(reads[0], RemoteRead::Hit);
    assert_eq!(bufs[0], first, "the present value was replaced");
}

/// A value or a destination that is not exactly the scope's bytes per block is refused before
/// anything is written (an error, never a stored fragment).
pub fn a_value_of_the_wrong_length_is_refused(m: &dyn StoreMaker) {
    let Some(s) = m.make(&fresh_scope(1)) else {
        return;
    };
    let short = vec![1u8; BYTES - 1];
    let e = s
        .put(0, &[(1, &short)], deadline())
        .expect_err("a short value");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert_eq!(
        s.lookup_prefix(&[1], deadline()).expect("lookup"),
        0,
        "nothing was stored"
    );
    put(s.as_ref(), 0, &[2]);
    let mut buf = vec![0u8; BYTES + 1];
    let mut dst: Vec<&mut [u8]> = vec![buf.as_mut_slice()];
    let e = s
        .get(0, &[2], &mut dst, deadline())
        .expect_err("a long destination");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let mut a = vec![0u8; BYTES];
    let mut dst: Vec<&mut [u8]> = vec![a.as_mut_slice()];
    let e = s
        .get(0, &[2, 3], &mut dst, deadline())
        .expect_err("fewer buffers than keys");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
}

/// A deadline that has already passed is answered at once — a timeout, or the answer if the
/// store had it in hand — never by waiting. (The bound is generous: this checks that the call
/// does not wait for a reply past its deadline, not how fast the store is.)
pub fn a_passed_deadline_is_answered_at_once(m: &dyn StoreMaker) {
    let Some(s) = m.make(&fresh_scope(1)) else {
        return;
    };
    put(s.as_ref(), 0, &[1]);
    let past = Instant::now() - Duration::from_millis(1);
    let start = Instant::now();
    match s.lookup_prefix(&[1], past) {
        Ok(n) => assert!(n <= 1),
        Err(e) => assert_eq!(e.kind(), ErrorKind::Timeout, "{e}"),
    }
    let mut a = vec![0u8; BYTES];
    let mut dst: Vec<&mut [u8]> = vec![a.as_mut_slice()];
    match s.get(0, &[1], &mut dst, past) {
        Ok(reads) => assert_eq!(reads.len(), 1),
        Err(e) => assert_eq!(e.kind(), ErrorKind::Timeout, "{e}"),
    }
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "calls past their deadline waited {:?}",
        start.elapsed()
    );
}

/// Stamps one `#[test]` per conformance check for the store maker `$maker` (an expression of a
/// type implementing [`StoreMaker`]), in a module named `$name`.
#[macro_export]
macro_rules! remote_conformance {
    ($name:ident, $maker:expr) => {
        mod $name {
            use super::*;
            #[test]
            fn what_is_put_is_read_back() {
                conformance::remote::what_is_put_is_read_back(&$maker);
            }
            #[test]
            fn a_missing_key_is_a_miss_not_an_error() {
                conformance::remote::a_missing_key_is_a_miss_not_an_error(&$maker);
            }
            #[test]
            fn lookup_counts_the_prefix_every_rank_holds() {
                conformance::remote::lookup_counts_the_prefix_every_rank_holds(&$maker);
            }
            #[test]
            fn scopes_and_ranks_never_share_a_value() {
                conformance::remote::scopes_and_ranks_never_share_a_value(&$maker);
            }
            #[test]
            fn a_present_value_is_kept_and_counted() {
                conformance::remote::a_present_value_is_kept_and_counted(&$maker);
            }
            #[test]
            fn a_value_of_the_wrong_length_is_refused() {
                conformance::remote::a_value_of_the_wrong_length_is_refused(&$maker);
            }
            #[test]
            fn a_passed_deadline_is_answered_at_once() {
                conformance::remote::a_passed_deadline_is_answered_at_once(&$maker);
            }
        }
    };
}
