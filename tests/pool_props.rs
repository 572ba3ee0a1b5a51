//! Property tests of `kvbm_connector::pool::BlockPool` against a reference model.
//!
//! Random operation sequences (allocate, register under a hash from a small set so dedup and
//! collisions happen, drop mutable, clone/drop immutable, match and hold/drop, prefix length) run
//! against both the pool and a simple model that predicts registration, LRU order and evictions.
//! After every step: the stats sum to `num_blocks` and agree with the model; no block id is held
//! by two live handles of different kinds or two mutable handles; every held registered block is
//! still registered under its hash and matches to the same id; the registered set equals the
//! model's. At the end, with every handle dropped, `free + inactive == num_blocks`.

use std::collections::{HashMap, HashSet, VecDeque};

use kvbm_connector::pool::{BlockPool, ImmutableBlock, MutableBlock};
use kvbm_connector::{ErrorKind, SequenceHash, TierKind};
use proptest::prelude::*;
use proptest::sample::Index;

/// Hashes are drawn from `0..NUM_HASHES` so registrations collide often.
const NUM_HASHES: u64 = 6;

#[derive(Debug, Clone)]
enum Op {
    Allocate(usize),
    Register(Index, u64),
    DropMutable(Index),
    CloneImmutable(Index),
    DropImmutable(Index),
    Match(Vec<u64>, bool),
    PrefixLen(Vec<u64>),
}

fn hash_list() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(0..NUM_HASHES, 0..5)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..5).prop_map(Op::Allocate),
        4 => (any::<Index>(), 0..NUM_HASHES).prop_map(|(i, h)| Op::Register(i, h)),
        1 => any::<Index>().prop_map(Op::DropMutable),
        1 => any::<Index>().prop_map(Op::CloneImmutable),
        2 => any::<Index>().prop_map(Op::DropImmutable),
        3 => (hash_list(), any::<bool>()).prop_map(|(l, hold)| Op::Match(l, hold)),
        1 => hash_list().prop_map(Op::PrefixLen),
    ]
}

/// The model's key `h` as a 128-bit key with both halves set (keys are 128 bits wide).
fn sh(h: u64) -> SequenceHash {
    SequenceHash(u128::from(h) << 64 | u128::from(h))
}

/// What the pool should look like.
#[derive(Debug)]
struct Model {
    num_blocks: usize,
    free: usize,
    /// hash -> block id.
    registered: HashMap<u64, usize>,
    /// id -> hash, for registered blocks.
    hash_of: HashMap<usize, u64>,
    /// Live immutable handles per registered block id (absent = 0).
    refs: HashMap<usize, usize>,
    /// Inactive registered blocks, least recently used first.
    lru: VecDeque<usize>,
    evictions: u64,
}

impl Model {
    fn new(num_blocks: usize) -> Self {
        Self {
            num_blocks,
            free: num_blocks,
            registered: HashMap::new(),
            hash_of: HashMap::new(),
            refs: HashMap::new(),
            lru: VecDeque::new(),
            evictions: 0,
        }
    }

    /// A handle on registered block `id` was taken (match, dedup, clone).
    fn acquire(&mut self, id: usize) {
        let r = self.refs.entry(id).or_insert(0);
        if *r == 0 {
            self.lru.retain(|&x| x != id);
        }
        *r += 1;
    }

    /// A handle on `id` was dropped.
    fn release(&mut self, id: usize) {
        let r = self
            .refs
            .get_mut(&id)
            .expect("model: release of an unheld block");
        *r -= 1;
        if *r == 0 {
            self.refs.remove(&id);
            self.lru.push_back(id);
        }
    }

    fn prefix_len(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.registered.contains_key(h))
            .count()
    }
}

struct World {
    pool: BlockPool,
    model: Model,
    mutables: Vec<MutableBlock>,
    immutables: Vec<ImmutableBlock>,
}

impl World {
    fn apply(&mut self, op: Op) -> Result<(), TestCaseError> {
        let World {
            pool,
            model,
            mutables,
            immutables,
        } = self;
        match op {
            Op::Allocate(n) => {
                let available = model.free + model.lru.len();
                let before = pool.stats();
                match pool.allocate(n) {
                    Ok(got) => {
                        prop_assert!(n <= available, "allocated {n} with {available} available");
                        prop_assert_eq!(got.len(), n);
                        let from_free = n.min(model.free);
                        model.free -= from_free;
                        let ids: HashSet<usize> = got.iter().map(MutableBlock::block_id).collect();
                        prop_assert_eq!(ids.len(), n, "duplicate ids in one allocation");
                        for _ in from_free..n {
                            let id = model.lru.pop_front().expect("model: lru underflow");
                            let h = model
                                .hash_of
                                .remove(&id)
                                .expect("model: lru block unregistered");
                            model.registered.remove(&h);
                            model.evictions += 1;
                            prop_assert!(
                                ids.contains(&id),
                                "LRU block {id} was not the one evicted"
                            );
                        }
                        mutables.extend(got);
                    }
                    Err(e) => {
                        prop_assert!(
                            n > available,
                            "allocate({n}) failed with {available} available: {e}"
                        );
                        prop_assert_eq!(e.kind(), ErrorKind::NoSpace);
                        prop_assert_eq!(pool.stats(), before, "failed allocate changed the pool");
                    }
                }
            }
            Op::Register(i, h) => {
                if mutables.is_empty() {
                    return Ok(());
                }
                let m = mutables.swap_remove(i.index(mutables.len()));
                let mid = m.block_id();
                let imm = pool
                    .register(m, sh(h))
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(imm.sequence_hash(), sh(h));
                match model.registered.get(&h).copied() {
                    Some(existing) => {
                        prop_assert_eq!(
                            imm.block_id(),
                            existing,
                            "dedup must return the existing block"
                        );
                        model.acquire(existing);
                        model.free += 1;
                    }
                    None => {
                        prop_assert_eq!(imm.block_id(), mid);
                        model.registered.insert(h, mid);
                        model.hash_of.insert(mid, h);
                        model.acquire(mid);
                    }
                }
                immutables.push(imm);
            }
            Op::DropMutable(i) => {
                if mutables.is_empty() {
                    return Ok(());
                }
                drop(mutables.swap_remove(i.index(mutables.len())));
                model.free += 1;
            }
            Op::CloneImmutable(i) => {
                if immutables.is_empty() {
                    return Ok(());
                }
                let c = immutables[i.index(immutables.len())].clone();
                model.acquire(c.block_id());
                immutables.push(c);
            }
            Op::DropImmutable(i) => {
                if immutables.is_empty() {
                    return Ok(());
                }
                let b = immutables.swap_remove(i.index(immutables.len()));
                let id = b.block_id();
                drop(b);
                model.release(id);
            }
            Op::Match(list, hold) => {
                let hashes: Vec<SequenceHash> = list.iter().copied().map(sh).collect();
                let want = model.prefix_len(&list);
                let got = pool.match_prefix(&hashes);
                prop_assert_eq!(got.len(), want);
                for (b, h) in got.iter().zip(&list) {
                    prop_assert_eq!(b.sequence_hash(), sh(*h));
                    prop_assert_eq!(Some(&b.block_id()), model.registered.get(h));
                    model.acquire(b.block_id());
                }
                if hold {
                    immutables.extend(got);
                } else {
                    // Drop in order: the model's LRU must see the same release order.
                    for b in got {
                        let id = b.block_id();
                        drop(b);
                        model.release(id);
                    }
                }
            }
            Op::PrefixLen(list) => {
                let hashes: Vec<SequenceHash> = list.iter().copied().map(sh).collect();
                prop_assert_eq!(pool.prefix_len(&hashes), model.prefix_len(&list));
            }
        }
        Ok(())
    }

    fn check(&self) -> Result<(), TestCaseError> {
        let s = self.pool.stats();
        let n = self.pool.num_blocks();
        prop_assert_eq!(s.total(), n, "stats do not sum to num_blocks: {:?}", s);
        prop_assert_eq!(s.free + s.mutable + s.active + s.inactive, n);

        // No double hand-out.
        let mut_ids: Vec<usize> = self.mutables.iter().map(MutableBlock::block_id).collect();
        let mut_set: HashSet<usize> = mut_ids.iter().copied().collect();
        prop_assert_eq!(
            mut_set.len(),
            mut_ids.len(),
            "two live MutableBlocks share an id"
        );
        let imm_set: HashSet<usize> = self
            .immutables
            .iter()
            .map(ImmutableBlock::block_id)
            .collect();
        prop_assert!(
            mut_set.is_disjoint(&imm_set),
            "an id is held mutable and immutable at once"
        );
        prop_assert!(mut_set.iter().chain(&imm_set).all(|&id| id < n));

        // Counts agree with the handles and with the model.
        prop_assert_eq!(s.mutable, self.mutables.len());
        prop_assert_eq!(s.active, imm_set.len());
        let m = &self.model;
        prop_assert_eq!(s.free, m.free);
        prop_assert_eq!(s.inactive, m.lru.len());
        prop_assert_eq!(s.registered, m.registered.len());
        prop_assert_eq!(s.evictions, m.evictions);
        prop_assert_eq!(m.num_blocks, n);

        // Every held block is still registered under its hash, to the same id.
        for b in &self.immutables {
            let h = b.sequence_hash();
            prop_assert_eq!(
                self.pool.prefix_len(&[h]),
                1,
                "held block {:?} was evicted",
                b
            );
            let again = self.pool.match_prefix(&[h]);
            prop_assert_eq!(again.len(), 1);
            prop_assert_eq!(again[0].block_id(), b.block_id());
            prop_assert_eq!(m.registered.get(&(h.0 as u64)), Some(&b.block_id()));
        }

        // The registered set is the model's.
        for h in 0..NUM_HASHES {
            prop_assert_eq!(
                self.pool.contains(sh(h)),
                m.registered.contains_key(&h),
                "registration of hash {} differs from the model",
                h
            );
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn pool_matches_model(num_blocks in 1usize..8, ops in prop::collection::vec(op(), 1..60)) {
        let pool = BlockPool::new(TierKind::Host, num_blocks).unwrap();
        let mut world = World {
            pool,
            model: Model::new(num_blocks),
            mutables: Vec::new(),
            immutables: Vec::new(),
        };
        world.check()?;
        for op in ops {
            world.apply(op)?;
            world.check()?;
        }

        let World { pool, mutables, immutables, .. } = world;
        drop(mutables);
        drop(immutables);
        let s = pool.stats();
        prop_assert_eq!(s.free + s.inactive, num_blocks, "leak after dropping everything: {:?}", s);
        prop_assert_eq!((s.mutable, s.active), (0, 0));
        prop_assert_eq!(s.registered, s.inactive);
    }

    /// Whatever happened before, a full allocation succeeds once every handle is gone.
    #[test]
    fn everything_reusable_after_drop(num_blocks in 1usize..8, ops in prop::collection::vec(op(), 1..40)) {
        let pool = BlockPool::new(TierKind::Disk, num_blocks).unwrap();
        let mut world = World {
            pool: pool.clone(),
            model: Model::new(num_blocks),
            mutables: Vec::new(),
            immutables: Vec::new(),
        };
        for op in ops {
            world.apply(op)?;
        }
        drop(world);
        let all = pool.allocate(num_blocks).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let ids: HashSet<usize> = all.iter().map(MutableBlock::block_id).collect();
        prop_assert_eq!(ids.len(), num_blocks);
        prop_assert_eq!(pool.stats().registered, 0);
        prop_assert!(pool.allocate(1).is_err());
    }
}
