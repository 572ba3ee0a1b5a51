//! The pool's unit tests, through [`BlockPool`]'s API: the transitions, the handles, and each
//! eviction policy's order (the ghost, the duel's observations and the filter are tested next
//! to their code).

use super::eviction::Prefix;
use super::*;
use crate::identity::SequenceHash;
use crate::tier::TierKind;
use crate::ErrorKind;

fn h(i: u64) -> SequenceHash {
    SequenceHash(u128::from(i))
}

fn pool(n: usize) -> BlockPool {
    BlockPool::with_policy(TierKind::Host, n, EvictionPolicy::Lru).unwrap()
}

/// Registers one fresh block under `hash` and drops the handle (leaves it inactive).
fn cache(p: &BlockPool, hash: SequenceHash) -> usize {
    let m = p.allocate(1).unwrap().pop().unwrap();
    let imm = p.register(m, hash).unwrap();
    imm.block_id()
}

fn check_sum(p: &BlockPool) {
    let s = p.stats();
    assert_eq!(s.total(), p.num_blocks(), "{s:?}");
    assert_eq!(s.registered, s.active + s.inactive, "{s:?}");
}

#[test]
fn register_all_registers_inactive_dedups_and_refuses_another_pools_block() {
    let p = pool(6);
    let other = pool(2);
    let dup = cache(&p, h(1));
    let mut blocks: Vec<(MutableBlock, SequenceHash)> = p
        .allocate(3)
        .unwrap()
        .into_iter()
        .zip([h(2), h(3), h(1)])
        .collect();
    let dup_id = blocks[2].0.block_id();
    blocks.push((other.allocate(1).unwrap().pop().unwrap(), h(4)));
    let (n, errors) = p.register_all(blocks);
    assert_eq!(n, 3);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].kind(), ErrorKind::InvalidArgument);
    // Registered and released: matchable, inactive (evictable), nothing held.
    let s = p.stats();
    assert_eq!(
        (s.registered, s.active, s.inactive, s.mutable),
        (3, 0, 3, 0),
        "{s:?}"
    );
    assert_eq!(p.prefix_len(&[h(1), h(2), h(3)]), 3);
    // The duplicate key kept its first block; the second went back to the free list.
    assert_eq!(p.match_prefix(&[h(1)])[0].block_id(), dup);
    assert_ne!(dup, dup_id);
    assert_eq!(s.free, 3);
    check_sum(&p);
    // The refused block went back to its own pool.
    assert_eq!(other.stats().free, 2);
    assert!(!other.contains(h(4)) && !p.contains(h(4)));
}

#[test]
fn allocate_up_to_takes_what_is_free_or_evictable() {
    let p = pool(4);
    cache(&p, h(1));
    let held = p.allocate(1).unwrap();
    // 2 free + 1 inactive (evicted when taken) of the 5 asked.
    let got = p.allocate_up_to(5);
    assert_eq!(got.len(), 3);
    assert!(!p.contains(h(1)));
    assert!(p.allocate_up_to(1).is_empty());
    assert!(p.allocate_up_to(0).is_empty());
    drop((got, held));
    assert_eq!(p.stats().free, 4);
    check_sum(&p);
}

#[test]
fn retain_unregistered_drops_registered_keys() {
    let p = pool(4);
    cache(&p, h(2));
    let mut items = vec![(10, h(1)), (11, h(2)), (12, h(3))];
    p.retain_unregistered(&mut items, |i| i.1);
    assert_eq!(items, vec![(10, h(1)), (12, h(3))]);
}

#[test]
fn new_rejects_zero_blocks() {
    let e = BlockPool::new(TierKind::Disk, 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert_eq!(e.context_value("tier"), Some("disk"));
    let p = pool(3);
    assert_eq!(p.kind(), TierKind::Host);
    assert_eq!(p.num_blocks(), 3);
    assert_eq!(
        p.stats(),
        PoolStats {
            free: 3,
            ..PoolStats::default()
        }
    );
}

#[test]
fn fresh_pool_hands_out_distinct_ids() {
    let p = pool(4);
    let blocks = p.allocate(4).unwrap();
    let mut ids: Vec<usize> = blocks.iter().map(MutableBlock::block_id).collect();
    ids.sort_unstable();
    assert_eq!(ids, vec![0, 1, 2, 3]);
    assert!(blocks.iter().all(|b| b.kind() == TierKind::Host));
    assert_eq!(p.stats().mutable, 4);
    assert!(p.allocate(0).unwrap().is_empty());
}

#[test]
fn allocate_is_all_or_nothing() {
    let p = pool(4);
    let held = p.allocate(3).unwrap();
    let before = p.stats();
    let e = p.allocate(2).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace);
    assert_eq!(e.context_value("tier"), Some("host"));
    assert!(e.message().contains("2 blocks: 1 available of 4"), "{e}");
    assert_eq!(p.stats(), before);
    assert_eq!(p.allocate(1).unwrap().len(), 1);
    drop(held);
    check_sum(&p);
    assert_eq!(p.stats().free, 4);
}

#[test]
fn active_blocks_are_never_evicted() {
    let p = pool(2);
    let a = p
        .register(p.allocate(1).unwrap().pop().unwrap(), h(1))
        .unwrap();
    let _b = p
        .register(p.allocate(1).unwrap().pop().unwrap(), h(2))
        .unwrap();
    assert_eq!(p.allocate(1).unwrap_err().kind(), ErrorKind::NoSpace);
    drop(a);
    // Only the inactive one can go.
    let got = p.allocate(1).unwrap();
    assert!(!p.contains(h(1)));
    assert!(p.contains(h(2)));
    assert_eq!(p.stats().evictions, 1);
    drop(got);
    check_sum(&p);
}

#[test]
fn handle_drop_transitions() {
    let p = pool(2);
    let m = p.allocate(1).unwrap().pop().unwrap();
    assert_eq!(p.stats().mutable, 1);
    drop(m);
    assert_eq!(p.stats().free, 2);

    let m = p.allocate(1).unwrap().pop().unwrap();
    let id = m.block_id();
    let a = p.register(m, h(7)).unwrap();
    assert_eq!(
        (a.block_id(), a.sequence_hash(), a.kind()),
        (id, h(7), TierKind::Host)
    );
    let s = p.stats();
    assert_eq!(
        (s.mutable, s.active, s.inactive, s.registered),
        (0, 1, 0, 1)
    );

    let b = a.clone();
    drop(a);
    assert_eq!(p.stats().active, 1, "a clone still holds it");
    drop(b);
    let s = p.stats();
    assert_eq!((s.active, s.inactive, s.registered), (0, 1, 1));
    assert!(p.contains(h(7)));

    let m = p.match_prefix(&[h(7)]);
    assert_eq!(m.len(), 1);
    assert_eq!(m[0].block_id(), id);
    let s = p.stats();
    assert_eq!((s.active, s.inactive), (1, 0));
    drop(m);
    assert_eq!(p.stats().inactive, 1);
    check_sum(&p);
}

#[test]
fn register_dedups_to_the_existing_block() {
    let p = pool(3);
    let mut ms = p.allocate(2).unwrap();
    let second = ms.pop().unwrap();
    let first = ms.pop().unwrap();
    let first_id = first.block_id();
    let second_id = second.block_id();
    let a = p.register(first, h(5)).unwrap();
    let b = p.register(second, h(5)).unwrap();
    assert_eq!(a.block_id(), first_id);
    assert_eq!(b.block_id(), first_id, "dedup returns the existing block");
    assert_ne!(b.block_id(), second_id);
    let s = p.stats();
    assert_eq!((s.free, s.mutable, s.active, s.registered), (2, 0, 1, 1));
    drop(a);
    assert_eq!(p.stats().active, 1);
    drop(b);
    assert_eq!(p.stats().inactive, 1);

    // Dedup against an inactive block brings it back to active.
    let m = p.allocate(1).unwrap().pop().unwrap();
    assert_ne!(
        m.block_id(),
        first_id,
        "the inactive block is not handed out while free ones exist"
    );
    let c = p.register(m, h(5)).unwrap();
    assert_eq!(c.block_id(), first_id);
    let s = p.stats();
    assert_eq!((s.free, s.active, s.inactive), (2, 1, 0));
    check_sum(&p);
}

#[test]
fn register_rejects_a_block_of_another_pool() {
    let p = pool(1);
    let q = BlockPool::new(TierKind::Disk, 1).unwrap();
    let m = q.allocate(1).unwrap().pop().unwrap();
    let e = p.register(m, h(1)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert_eq!(e.context_value("tier"), Some("host"));
    assert_eq!(q.stats().free, 1, "the block went back to its own pool");
    assert!(!p.contains(h(1)) && !q.contains(h(1)));
}

#[test]
fn eviction_follows_lru_order() {
    let p = pool(3);
    let ids: Vec<usize> = (1..=3).map(|i| cache(&p, h(i))).collect();
    assert_eq!(p.stats().inactive, 3);
    // Touch h1: it becomes the most recently used.
    drop(p.match_prefix(&[h(1)]));
    // prefix_len and contains do not touch the order.
    assert_eq!(p.prefix_len(&[h(2), h(3)]), 2);
    assert!(p.contains(h(2)));

    let b = p.allocate(1).unwrap();
    assert_eq!(b[0].block_id(), ids[1]);
    assert!(!p.contains(h(2)) && p.contains(h(1)) && p.contains(h(3)));
    let c = p.allocate(1).unwrap();
    assert_eq!(c[0].block_id(), ids[2]);
    assert!(!p.contains(h(3)));
    let d = p.allocate(1).unwrap();
    assert_eq!(d[0].block_id(), ids[0]);
    let s = p.stats();
    assert_eq!((s.evictions, s.registered, s.mutable), (3, 0, 3));
    drop((b, c, d));
    check_sum(&p);
}

/// Runs `step` and returns the one key of `keys` it unregistered (evicted).
fn evicted_by(p: &BlockPool, keys: &[SequenceHash], step: impl FnOnce()) -> SequenceHash {
    let before: Vec<SequenceHash> = keys.iter().copied().filter(|&x| p.contains(x)).collect();
    step();
    let gone: Vec<SequenceHash> = before.into_iter().filter(|&x| !p.contains(x)).collect();
    assert_eq!(gone.len(), 1, "{gone:?}");
    gone[0]
}

/// Evicts one block by allocating it (kept in `held`); returns the key it held.
fn evict_one(p: &BlockPool, keys: &[SequenceHash], held: &mut Vec<MutableBlock>) -> SequenceHash {
    evicted_by(p, keys, || held.extend(p.allocate(1).unwrap()))
}

#[test]
fn prefix_policy_evicts_a_matched_chain_deepest_first() {
    let keys: Vec<SequenceHash> = (1..=3).map(h).collect();
    for (policy, want) in [
        (EvictionPolicy::Lru, [1, 2, 3]),
        (EvictionPolicy::Prefix, [3, 2, 1]),
    ] {
        let p = BlockPool::with_policy(TierKind::Host, 3, policy).unwrap();
        assert_eq!(p.policy(), policy);
        for &k in &keys {
            cache(&p, k);
        }
        // A request matches the chain; its handles drop parent -> child (as the leader's).
        drop(p.match_prefix(&keys));
        let mut held = Vec::new();
        let got: Vec<SequenceHash> = (0..3).map(|_| evict_one(&p, &keys, &mut held)).collect();
        assert_eq!(got, want.map(h).to_vec(), "{policy}");
    }
}

/// A request's blocks held after their store (a write-through to the next tier) are
/// released late, after a later request began or even after its blocks were released:
/// they keep their own request's epoch and leave before the later request's blocks. (With
/// the epoch at release they joined the later request's run, and released after its
/// blocks, as in vLLM's test of a disk hit after host eviction, outlived them.)
#[test]
fn prefix_policy_block_released_late_keeps_its_requests_time() {
    let keys: Vec<SequenceHash> = (1..=8).map(h).collect();
    for b_first in [false, true] {
        let p = BlockPool::with_policy(TierKind::Host, 6, EvictionPolicy::Prefix).unwrap();
        // An older block, inactive: a late one must not go behind it.
        cache(&p, h(8));
        // Request A: 2 blocks stored and held (written through).
        let a: Vec<ImmutableBlock> = p
            .allocate(2)
            .unwrap()
            .into_iter()
            .zip([h(1), h(2)])
            .map(|(m, k)| p.register(m, k).unwrap())
            .collect();
        // Request B: looks up (a new epoch), stores 3 blocks allocated one call at a time
        // (as the disk tier's are: they still share one epoch), held too.
        drop(p.match_prefix(&[h(5)]));
        let b: Vec<ImmutableBlock> = [h(5), h(6), h(7)]
            .into_iter()
            .map(|k| {
                p.register(p.allocate(1).unwrap().pop().unwrap(), k)
                    .unwrap()
            })
            .collect();
        if b_first {
            drop(b);
            drop(a); // placed in front of B's run, behind h8
        } else {
            drop(a);
            drop(b);
        }
        check_sum(&p);
        // h8 first (oldest), then A deepest first, then B deepest first.
        let mut held = Vec::new();
        let order: Vec<SequenceHash> = (0..6).map(|_| evict_one(&p, &keys, &mut held)).collect();
        assert_eq!(
            order,
            [8, 2, 1, 7, 6, 5].map(h).to_vec(),
            "b_first {b_first}"
        );
    }
}

#[test]
fn prefix_policy_credit_doubles_with_reuse_and_survives_eviction() {
    // 4 blocks: one reuse is worth 4 clock ticks (one release each), two reuses 8. The
    // credit's own mechanics: the duel (which starts with the credit off) is left out.
    let p = BlockPool::with_eviction(
        TierKind::Host,
        4,
        EvictionPolicy::Prefix,
        Box::new(Prefix::miniature(4, true).unwrap()),
    )
    .unwrap();
    let keys: Vec<SequenceHash> = (1..=16).map(h).collect();
    cache(&p, h(1)); // stamp 0
    drop(p.match_prefix(&[h(1)])); // one reuse, stamp 1: priority 1 + 4 = 5
    for i in 2..=4 {
        cache(&p, h(i)); // stamps 2, 3, 4
    }
    // Each new key evicts the smallest stamp + credit; a tie goes to the lower list.
    let order: Vec<SequenceHash> = (5..=9)
        .map(|i| {
            evicted_by(&p, &keys, || {
                cache(&p, h(i));
            })
        })
        .collect();
    assert_eq!(order, [2, 3, 4, 5, 1].map(h).to_vec());
    // Remembered with one reuse, h1 stored again starts with two (credit 8, stamp 10): it
    // outlives the next three fresh keys.
    let again = evicted_by(&p, &keys, || {
        cache(&p, h(1));
    });
    assert_eq!(again, h(6));
    for i in 10..=12 {
        assert_ne!(
            evicted_by(&p, &keys, || {
                cache(&p, h(i));
            }),
            h(1)
        );
    }
    assert!(p.contains(h(1)));
}

/// A key as the leader uses it: matched if cached, else computed and stored.
fn use_key(p: &BlockPool, k: SequenceHash) -> bool {
    if p.match_prefix(&[k]).is_empty() {
        cache(p, k);
        return false;
    }
    true
}

#[test]
fn prefix_duel_turns_the_credit_off_where_past_reuse_predicts_nothing() {
    // Like conversations of a fixed length: four keys reused three times and then never
    // again, then a stream of new keys each used once more three keys later. With the credit
    // the dead keys hold half of the 8 blocks for 32 ticks, so each new key is evicted
    // before its reuse; without it they leave first and every reuse hits. A fresh pool has
    // the credit off, and the miniatures' disagreements keep it off.
    let run = |policy| {
        let p = BlockPool::with_policy(TierKind::Host, 8, policy).unwrap();
        let dead: Vec<SequenceHash> = (100..104).map(h).collect();
        for &k in &dead {
            cache(&p, k);
        }
        for _ in 0..3 {
            for &k in &dead {
                assert!(use_key(&p, k));
            }
        }
        let mut hits = 0;
        for i in 0..40 {
            use_key(&p, h(i));
            if i >= 3 && use_key(&p, h(i - 3)) {
                hits += 1;
            }
        }
        (hits, dead.iter().any(|&k| p.contains(k)))
    };
    assert_eq!(run(EvictionPolicy::Lru), (37, false));
    let (hits, dead_kept) = run(EvictionPolicy::Prefix);
    assert!(!dead_kept, "the dead keys' credit kept them");
    assert!(
        hits >= 35,
        "prefix with its duel hit {hits} of 37 reuses (LRU: 37)"
    );
}

#[test]
fn prefix_duel_keeps_the_credit_where_reuse_predicts_reuse() {
    // Four keys used every round and ten one-off keys between rounds in 8 blocks: LRU loses
    // the four to the one-offs every round; the credit keeps them, and the duel turns it on
    // (the pool starts without it).
    let run = |policy| {
        let p = BlockPool::with_policy(TierKind::Host, 8, policy).unwrap();
        let mut hits = 0;
        for round in 0..30u64 {
            for k in 1..=4 {
                if use_key(&p, h(k)) && round >= 10 {
                    hits += 1;
                }
            }
            for j in 0..10 {
                use_key(&p, h(1000 + round * 10 + j));
            }
        }
        hits
    };
    assert_eq!(run(EvictionPolicy::Lru), 0);
    assert_eq!(run(EvictionPolicy::Prefix), 80);
}

#[test]
fn two_q_probation_goes_first_until_a_quarter_of_the_pool() {
    let p = BlockPool::with_policy(TierKind::Host, 8, EvictionPolicy::TwoQ).unwrap();
    let keys: Vec<SequenceHash> = (1..=12).map(h).collect();
    for i in 1..=8 {
        cache(&p, h(i));
    }
    for i in 1..=4 {
        drop(p.match_prefix(&[h(i)])); // reused: main
    }
    // Probation (h5..h8, FIFO) goes first while it holds at least 2 (a quarter of 8), then
    // main (LRU), then probation again when main is empty.
    let mut held = Vec::new();
    let order: Vec<SequenceHash> = (0..8).map(|_| evict_one(&p, &keys, &mut held)).collect();
    assert_eq!(order, [5, 6, 7, 1, 2, 3, 4, 8].map(h).to_vec());
    // h5 left probation unreused: stored again, the ghost sends it to main.
    drop(held);
    for i in [5, 9, 10] {
        cache(&p, h(i));
    }
    let mut held = p.allocate(5).unwrap();
    let order: Vec<SequenceHash> = (0..3).map(|_| evict_one(&p, &keys, &mut held)).collect();
    assert_eq!(order, [9, 5, 10].map(h).to_vec());
}

#[test]
fn allocate_takes_free_blocks_before_evicting() {
    let p = pool(3);
    let cached = cache(&p, h(1));
    let got = p.allocate(2).unwrap();
    assert!(got.iter().all(|b| b.block_id() != cached));
    assert!(p.contains(h(1)));
    assert_eq!(p.stats().evictions, 0);
    let more = p.allocate(1).unwrap();
    assert_eq!(more[0].block_id(), cached);
    assert!(!p.contains(h(1)));
}

#[test]
fn match_stops_at_first_miss() {
    let p = pool(4);
    for i in [1, 2, 4] {
        cache(&p, h(i));
    }
    let m = p.match_prefix(&[h(1), h(2), h(3), h(4)]);
    let got: Vec<SequenceHash> = m.iter().map(ImmutableBlock::sequence_hash).collect();
    assert_eq!(got, vec![h(1), h(2)]);
    assert_eq!(p.prefix_len(&[h(1), h(2), h(3), h(4)]), 2);
    assert_eq!(p.prefix_len(&[h(3), h(1)]), 0);
    assert!(p.match_prefix(&[]).is_empty());
    assert!(p.match_prefix(&[h(9), h(1)]).is_empty());
    let s = p.stats();
    assert_eq!((s.active, s.inactive), (2, 1));
}

#[test]
fn match_across_continues_on_disk() {
    let host = pool(4);
    let disk = BlockPool::new(TierKind::Disk, 8).unwrap();
    for i in 0..2 {
        cache(&host, h(i));
    }
    for i in 0..4 {
        cache(&disk, h(i));
    }
    cache(&disk, h(5));
    let hashes: Vec<SequenceHash> = (0..6).map(h).collect();
    let m = match_across(&[&host, &disk], &hashes);
    assert_eq!(m.per_tier.len(), 2);
    assert_eq!(m.blocks_from(TierKind::Host), 2);
    assert_eq!(
        m.blocks_from(TierKind::Disk),
        2,
        "disk continues at index 2 and stops at h4"
    );
    assert_eq!(m.total_blocks(), 4);
    let disk_hashes: Vec<SequenceHash> = m.per_tier[1]
        .1
        .iter()
        .map(ImmutableBlock::sequence_hash)
        .collect();
    assert_eq!(disk_hashes, vec![h(2), h(3)]);
    assert_eq!(
        disk.stats().active,
        2,
        "disk copies of h0, h1 are not taken"
    );

    // A gap on disk at the host's stopping point yields nothing from disk.
    let gap = [h(0), h(1), h(4), h(5)];
    let m = match_across(&[&host, &disk], &gap);
    assert_eq!(
        (m.blocks_from(TierKind::Host), m.blocks_from(TierKind::Disk)),
        (2, 0)
    );

    // Whole prefix on host: disk is searched with nothing left.
    let m = match_across(&[&host, &disk], &hashes[..2]);
    assert_eq!((m.total_blocks(), m.per_tier.len()), (2, 2));
    assert_eq!(match_across(&[], &hashes).total_blocks(), 0);
}

#[test]
fn handles_are_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<BlockPool>();
    check::<MutableBlock>();
    check::<ImmutableBlock>();
    check::<TieredMatch>();
}

#[test]
fn concurrent_use_keeps_counts() {
    let p = pool(64);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let p = p.clone();
            s.spawn(move || {
                for i in 0..500u64 {
                    let Ok(mut ms) = p.allocate(2) else { continue };
                    let keep = ms.pop();
                    if let Some(m) = keep {
                        let imm = p.register(m, h((t * 7 + i) % 40)).unwrap();
                        let again = p.match_prefix(&[imm.sequence_hash()]);
                        assert_eq!(
                            again.first().map(ImmutableBlock::block_id),
                            Some(imm.block_id())
                        );
                    }
                }
            });
        }
    });
    let s = p.stats();
    assert_eq!((s.mutable, s.active), (0, 0));
    assert_eq!(s.free + s.inactive, 64);
    check_sum(&p);
}

#[test]
fn match_prefix_of_8192_cached_blocks_matches_them_all() {
    use std::time::{Duration, Instant};
    let n = 8192;
    let p = BlockPool::new(TierKind::Host, n).unwrap();
    let hashes: Vec<SequenceHash> = (0..n as u64)
        .map(|i| SequenceHash(u128::from(i.wrapping_mul(0xA24B_AED4_963E_E407))))
        .collect();
    for &hash in &hashes {
        cache(&p, hash);
    }
    let rounds = 20;
    let (mut matching, mut dropping) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..rounds {
        let t0 = Instant::now();
        let m = p.match_prefix(&hashes);
        let t1 = Instant::now();
        assert_eq!(m.len(), n);
        drop(m);
        matching += t1 - t0;
        dropping += t1.elapsed();
    }
    let per = matching / rounds;
    eprintln!(
        "match_prefix of {n} hashes: {per:?}; dropping the handles: {:?}",
        dropping / rounds
    );
    // Printed, not asserted: a debug build on a shared, busy machine says nothing about speed
    // (470 ms per match was seen on a loaded 2-core host). The speed is measured in release by
    // benches/hashing.rs (`match/prefix_128k`: these 8192 blocks).
}

#[test]
fn unregister_withdraws_a_block_and_frees_it_on_release() {
    let pool = BlockPool::new(TierKind::Disk, 4).unwrap();
    let b = pool.allocate(1).unwrap().pop().unwrap();
    let held = pool.register(b, SequenceHash(7)).unwrap();
    assert!(pool.unregister(&held));
    assert!(!pool.contains(SequenceHash(7)));
    assert!(pool.match_prefix(&[SequenceHash(7)]).is_empty());
    assert!(!pool.unregister(&held));
    drop(held);
    let s = pool.stats();
    assert_eq!((s.free, s.active, s.inactive, s.registered), (4, 0, 0, 0));
    // A fresh copy can be registered under the same key again.
    let b = pool.allocate(1).unwrap().pop().unwrap();
    let again = pool.register(b, SequenceHash(7)).unwrap();
    assert!(pool.contains(SequenceHash(7)));
    drop(again);
    assert_eq!(pool.stats().inactive, 1);
}

#[test]
fn prefix_duel_wants_a_margin_before_it_credits() {
    // A few rounds of the pattern where the credit pays (four keys used every round, ten
    // one-offs between rounds) give the credited miniature a small lead; then the traffic
    // turns: a stream of new keys each used once more three keys later, which the credit
    // defeats (the four keys, reused four times, hold half of the 8 blocks). On a lead of a
    // few uses the credit stays off and every reuse hits, as with LRU; applied on any lead
    // (score above 0) it lost 9 of the 37 reuses before the duel turned it off.
    let run = |policy| {
        let p = BlockPool::with_policy(TierKind::Host, 8, policy).unwrap();
        for round in 0..4u64 {
            for k in 1..=4 {
                use_key(&p, h(k));
            }
            for j in 0..10 {
                use_key(&p, h(1000 + round * 10 + j));
            }
        }
        let mut hits = 0;
        for i in 0..40 {
            use_key(&p, h(2000 + i));
            if i >= 3 && use_key(&p, h(2000 + i - 3)) {
                hits += 1;
            }
        }
        hits
    };
    assert_eq!(run(EvictionPolicy::Lru), 37);
    assert_eq!(run(EvictionPolicy::Prefix), 37);
}

#[test]
fn key_events_follow_registration_eviction_and_withdrawal_in_order() {
    let p = pool(2);
    // Not recorded before record_events.
    cache(&p, h(1));
    assert_eq!(p.take_events(), (vec![], 0));
    p.record_events(8);
    cache(&p, h(2));
    // A duplicate registration is not a new key.
    let m = p.allocate(1).unwrap().pop().unwrap();
    drop(p.register(m, h(2)).unwrap());
    // The pool is full (1, 2): a third key evicts the least recently used (1).
    cache(&p, h(3));
    let held = p.match_prefix(&[h(3)]);
    assert!(p.unregister(&held[0]));
    let ev = |key, stored| KeyEvent {
        key: h(key),
        stored,
    };
    assert_eq!(
        p.take_events(),
        (
            vec![ev(2, true), ev(1, false), ev(3, true), ev(3, false)],
            0
        )
    );
    assert_eq!(p.take_events(), (vec![], 0));
    drop(held);
    check_sum(&p);
}

#[test]
fn key_events_drop_the_oldest_past_their_capacity_and_count_them() {
    let p = pool(8);
    p.record_events(3);
    for i in 1..=5 {
        cache(&p, h(i));
    }
    let (events, dropped) = p.take_events();
    assert_eq!(dropped, 2);
    let keys: Vec<_> = events.iter().map(|e| e.key).collect();
    assert_eq!(keys, vec![h(3), h(4), h(5)]);
    assert_eq!(p.take_events(), (vec![], 0), "the drops are counted once");
}

#[test]
fn unregister_all_withdraws_every_key_without_per_key_events() {
    let p = pool(4);
    p.record_events(16);
    cache(&p, h(1));
    cache(&p, h(2));
    let held = p.match_prefix(&[h(2)]);
    let _ = p.take_events();
    assert_eq!(p.unregister_all(), 2);
    assert!(!p.contains(h(1)) && !p.contains(h(2)));
    assert_eq!(p.take_events(), (vec![], 0));
    drop(held);
    check_sum(&p);
    assert_eq!(p.stats().registered, 0);
    // Recording goes on after the reset.
    cache(&p, h(7));
    assert_eq!(
        p.take_events().0,
        vec![KeyEvent {
            key: h(7),
            stored: true
        }]
    );
}
