//! Property tests of `kvbm_connector::pool::BlockPool` against a reference model, once per
//! eviction policy.
//!
//! Random operation sequences (allocate, register under a hash from a small set so dedup and
//! collisions happen, drop mutable, clone/drop immutable, match and hold/drop, prefix length) run
//! against both the pool and a simple model. The model checks what every policy must keep (after
//! every step: the stats sum to `num_blocks` and agree with the model; no block id is held by two
//! live handles of different kinds or two mutable handles; every held registered block is still
//! registered under its hash and matches to the same id; the registered set equals the model's;
//! at the end, with every handle dropped, `free + inactive == num_blocks`), and predicts each
//! eviction with a plain reference implementation of the policy: the inactive blocks in a `Vec`
//! with their list, stamp and release sequence number, the victim found by a scan (LRU: oldest
//! release; 2Q: oldest probation block while probation holds a quarter of the pool or main is
//! empty, else oldest main block; prefix: smallest stamp + credit, then lower list, older stamp,
//! newer release; a block's first release after it was stored takes the epoch it was allocated
//! in, and a match ending an epoch that allocated blocks and saw no release ticks the clock
//! once), and a ghost queue of evicted keys. The prefix policy's credit is switched by
//! its duel: the model runs two miniature models of its own (credit on, credit off; a pool this
//! small samples every key, and they keep the pool's clock) on every key a match asks for (past
//! the first miss too; a stored key enters a miniature that lacks it without counting) and
//! applies the credit while the credited one has been right more often by a margin (a score
//! saturating at ±32, starting at 0 with the credit off, the credit on while it is above 8).

use std::cmp::Reverse;
use std::collections::{HashMap, HashSet, VecDeque};

use kvbm_connector::pool::{BlockPool, EvictionPolicy, ImmutableBlock, MutableBlock};
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
    prop::collection::vec(0..NUM_HASHES, 0..10)
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

/// An inactive block in the model: which list its policy put it in, its stamp, and when it
/// was released (a global sequence number).
#[derive(Debug, Clone, Copy)]
struct Inactive {
    id: usize,
    list: u8,
    stamp: u64,
    seq: u64,
}

const MAX_USES: u8 = 4;

/// What the pool should look like.
#[derive(Debug)]
struct Model {
    policy: EvictionPolicy,
    num_blocks: usize,
    free: usize,
    /// hash -> block id.
    registered: HashMap<u64, usize>,
    /// id -> hash, for registered blocks.
    hash_of: HashMap<usize, u64>,
    /// Live immutable handles per registered block id (absent = 0).
    refs: HashMap<usize, usize>,
    /// Reuse count per registered block, and whether it was reused in its current active period.
    uses: HashMap<usize, u8>,
    touched: HashSet<usize>,
    /// Inactive registered blocks, in release order.
    inactive: Vec<Inactive>,
    /// Releases so far plus the prefix policy's lookup ticks (the pool's clock), the clock at
    /// the last allocate/match, release count.
    clock: u64,
    epoch: u64,
    seq: u64,
    /// The epoch each block was allocated in (the prefix policy stamps a block's first release
    /// after it was stored with it), and whether the current epoch allocated any block.
    born: HashMap<usize, u64>,
    allocated_in_epoch: bool,
    /// Evicted keys remembered: (hash, uses, still the newest entry for its hash).
    ghost: VecDeque<(u64, u8, bool)>,
    ghost_cap: usize,
    evictions: u64,
    /// Prefix policy: whether the credit applies (the duel's verdict), and the duel.
    credit_on: bool,
    duel: Option<Box<ModelDuel>>,
    /// Ids for blocks a miniature takes from its free count.
    next_id: usize,
}

/// The reference duel: two miniature models and the score.
#[derive(Debug)]
struct ModelDuel {
    credited: Model,
    plain: Model,
    score: i32,
}

impl Model {
    fn new(num_blocks: usize, policy: EvictionPolicy) -> Self {
        let mut m = Self::bare(num_blocks, policy, true);
        if policy == EvictionPolicy::Prefix {
            m.duel = Some(Box::new(ModelDuel {
                credited: Self::bare(num_blocks, policy, true),
                plain: Self::bare(num_blocks, policy, false),
                score: 0,
            }));
            m.credit_on = false;
        }
        m
    }

    fn bare(num_blocks: usize, policy: EvictionPolicy, credit: bool) -> Self {
        let ghost_cap = match policy {
            EvictionPolicy::Lru => 0,
            EvictionPolicy::TwoQ => num_blocks,
            EvictionPolicy::Prefix if credit => 8 * num_blocks,
            EvictionPolicy::Prefix => 0,
        };
        Self {
            policy,
            num_blocks,
            free: num_blocks,
            registered: HashMap::new(),
            hash_of: HashMap::new(),
            refs: HashMap::new(),
            uses: HashMap::new(),
            touched: HashSet::new(),
            inactive: Vec::new(),
            clock: 0,
            epoch: 0,
            seq: 0,
            born: HashMap::new(),
            allocated_in_epoch: false,
            ghost: VecDeque::new(),
            ghost_cap,
            evictions: 0,
            credit_on: credit,
            duel: None,
            next_id: num_blocks,
        }
    }

    /// The clock at an allocate or match call (the miniatures take the pool's clock too). A
    /// match (`lookup`) ending a prefix epoch that allocated blocks and saw no release first
    /// ticks the clock once.
    fn new_epoch(&mut self, lookup: bool) {
        if lookup
            && self.policy == EvictionPolicy::Prefix
            && self.allocated_in_epoch
            && self.clock == self.epoch
        {
            self.clock += 1;
        }
        self.allocated_in_epoch = false;
        self.epoch = self.clock;
        if let Some(d) = self.duel.as_mut() {
            d.credited.epoch = self.clock;
            d.plain.epoch = self.clock;
        }
    }

    /// A stored key enters each miniature that lacks it (no use, no score).
    fn observe_store(&mut self, h: u64) {
        if let Some(d) = self.duel.as_mut() {
            for mini in [&mut d.credited, &mut d.plain] {
                if !mini.registered.contains_key(&h) {
                    mini.access(h);
                }
            }
        }
    }

    /// A key a match asks for: both miniatures use it; the score moves when they disagree.
    fn observe(&mut self, h: u64) {
        let Some(d) = self.duel.as_mut() else {
            return;
        };
        let with = d.credited.access(h);
        let without = d.plain.access(h);
        let step = match (with, without) {
            (true, false) => 1,
            (false, true) => -1,
            _ => return,
        };
        d.score = (d.score + step).clamp(-32, 32);
        // The credit needs a lead of more than a quarter of the score's range.
        self.credit_on = d.score > 8;
    }

    /// A miniature's use of `h`: a hit is reused and released; a miss takes a free or evicted
    /// block, registers `h` there and releases it.
    fn access(&mut self, h: u64) -> bool {
        if let Some(&id) = self.registered.get(&h) {
            self.acquire(id, true);
            self.release(id);
            return true;
        }
        let id = if self.free > 0 {
            self.free -= 1;
            self.next_id += 1;
            self.next_id
        } else {
            self.evict()
        };
        self.allocated(id);
        self.register_new(h, id);
        self.release(id);
        false
    }

    /// Block `id` was allocated (from free or by eviction) in the current epoch.
    fn allocated(&mut self, id: usize) {
        self.born.insert(id, self.epoch);
        self.allocated_in_epoch = true;
    }

    /// `h`, not registered, is registered on block `id` with one handle (its reuse count from
    /// the ghost).
    fn register_new(&mut self, h: u64, id: usize) {
        self.registered.insert(h, id);
        self.hash_of.insert(id, h);
        let uses = self.register_uses(h);
        self.uses.insert(id, uses);
        self.acquire(id, false);
    }

    /// A handle on registered block `id` was taken; `reuse`: by a match or a dedup (not a clone).
    fn acquire(&mut self, id: usize, reuse: bool) {
        let r = self.refs.entry(id).or_insert(0);
        if *r == 0 {
            self.inactive.retain(|b| b.id != id);
            self.touched.remove(&id);
        }
        *r += 1;
        if reuse {
            self.touched.insert(id);
        }
    }

    /// A handle on `id` was dropped.
    fn release(&mut self, id: usize) {
        let r = self
            .refs
            .get_mut(&id)
            .expect("model: release of an unheld block");
        *r -= 1;
        if *r > 0 {
            return;
        }
        self.refs.remove(&id);
        let uses = self.uses.entry(id).or_insert(0);
        let touched = self.touched.remove(&id);
        if touched {
            *uses = (*uses + 1).min(MAX_USES);
        }
        let uses = *uses;
        // Reused in this active period: the epoch now; else (its first release since it was
        // stored) the epoch it was allocated in.
        let prefix_stamp = if touched {
            self.epoch
        } else {
            self.born
                .get(&id)
                .copied()
                .unwrap_or(self.epoch)
                .min(self.epoch)
        };
        self.clock += 1;
        self.seq += 1;
        let (list, stamp) = match self.policy {
            EvictionPolicy::Lru => (0, self.clock),
            EvictionPolicy::TwoQ => (u8::from(uses > 0), self.clock),
            EvictionPolicy::Prefix => (uses, prefix_stamp),
        };
        self.inactive.push(Inactive {
            id,
            list,
            stamp,
            seq: self.seq,
        });
    }

    /// The reference choice of the next block to evict.
    fn victim(&self) -> Option<Inactive> {
        let oldest = |list: u8| {
            self.inactive
                .iter()
                .filter(|b| b.list == list)
                .min_by_key(|b| b.seq)
                .copied()
        };
        match self.policy {
            EvictionPolicy::Lru => oldest(0),
            EvictionPolicy::TwoQ => {
                let probation = self.inactive.iter().filter(|b| b.list == 0).count();
                let main = self.inactive.len() - probation;
                if probation >= (self.num_blocks / 4).max(1) || main == 0 {
                    oldest(0)
                } else {
                    oldest(1)
                }
            }
            EvictionPolicy::Prefix => {
                let credit = |list: u8| match list {
                    _ if !self.credit_on => 0,
                    0 => 0,
                    c => (self.num_blocks as u64) << (c - 1),
                };
                self.inactive
                    .iter()
                    .min_by_key(|b| (b.stamp + credit(b.list), b.list, b.stamp, Reverse(b.seq)))
                    .copied()
            }
        }
    }

    /// Evicts the reference victim; returns its id.
    fn evict(&mut self) -> usize {
        let v = self.victim().expect("model: nothing to evict");
        self.inactive.retain(|b| b.id != v.id);
        let h = self
            .hash_of
            .remove(&v.id)
            .expect("model: inactive block unregistered");
        self.registered.remove(&h);
        let uses = self.uses.remove(&v.id).unwrap_or(0);
        let remember = match self.policy {
            EvictionPolicy::Lru => false,
            EvictionPolicy::TwoQ => v.list == 0,
            EvictionPolicy::Prefix => true,
        };
        if remember && self.ghost_cap > 0 {
            if self.ghost.len() == self.ghost_cap {
                self.ghost.pop_front();
            }
            for e in self.ghost.iter_mut().filter(|e| e.0 == h) {
                e.2 = false;
            }
            self.ghost.push_back((h, uses, true));
        }
        self.evictions += 1;
        v.id
    }

    /// The reuse count a fresh registration of `h` starts with (and forgets `h`'s ghost).
    fn register_uses(&mut self, h: u64) -> u8 {
        match self.ghost.iter_mut().find(|e| e.0 == h && e.2) {
            Some(e) => {
                e.2 = false;
                (e.1 + 1).min(MAX_USES)
            }
            None => 0,
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
                model.new_epoch(false);
                let available = model.free + model.inactive.len();
                let before = pool.stats();
                match pool.allocate(n) {
                    Ok(got) => {
                        prop_assert!(n <= available, "allocated {n} with {available} available");
                        prop_assert_eq!(got.len(), n);
                        let from_free = n.min(model.free);
                        model.free -= from_free;
                        let ids: HashSet<usize> = got.iter().map(MutableBlock::block_id).collect();
                        prop_assert_eq!(ids.len(), n, "duplicate ids in one allocation");
                        for b in &got[..from_free] {
                            model.allocated(b.block_id());
                        }
                        for b in &got[from_free..] {
                            let want = model.evict();
                            model.allocated(want);
                            prop_assert_eq!(
                                b.block_id(),
                                want,
                                "{:?} evicted block {} where the reference evicts {}",
                                model.policy,
                                b.block_id(),
                                want
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
                model.observe_store(h);
                match model.registered.get(&h).copied() {
                    Some(existing) => {
                        prop_assert_eq!(
                            imm.block_id(),
                            existing,
                            "dedup must return the existing block"
                        );
                        model.acquire(existing, true);
                        model.free += 1;
                    }
                    None => {
                        prop_assert_eq!(imm.block_id(), mid);
                        model.register_new(h, mid);
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
                model.acquire(c.block_id(), false);
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
                model.new_epoch(true);
                let want = model.prefix_len(&list);
                let got = pool.match_prefix(&hashes);
                prop_assert_eq!(got.len(), want);
                for (b, h) in got.iter().zip(&list) {
                    prop_assert_eq!(b.sequence_hash(), sh(*h));
                    prop_assert_eq!(Some(&b.block_id()), model.registered.get(h));
                    model.acquire(b.block_id(), true);
                }
                // Every matched key, then at most a miniature's size (here the pool's: a pool
                // this small samples every key) past the first miss.
                let cap = got.len() + model.num_blocks;
                for &h in list.iter().take(cap) {
                    model.observe(h);
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
        prop_assert_eq!(s.inactive, m.inactive.len());
        prop_assert_eq!(self.pool.policy(), m.policy);
        prop_assert_eq!(s.registered, m.registered.len());
        prop_assert_eq!(s.evictions, m.evictions);
        prop_assert_eq!(m.num_blocks, n);

        // Every held block is still registered under its hash, to the same id (read from the
        // `registered` snapshot: a match here would count as a reuse and move the epoch).
        let snapshot: HashMap<SequenceHash, usize> = self.pool.registered().into_iter().collect();
        for b in &self.immutables {
            let h = b.sequence_hash();
            prop_assert_eq!(
                self.pool.prefix_len(&[h]),
                1,
                "held block {:?} was evicted",
                b
            );
            prop_assert_eq!(snapshot.get(&h), Some(&b.block_id()));
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

fn policy() -> impl Strategy<Value = EvictionPolicy> {
    prop_oneof![
        Just(EvictionPolicy::Lru),
        Just(EvictionPolicy::TwoQ),
        Just(EvictionPolicy::Prefix),
    ]
}

/// Runs `ops` against a pool of `policy` and the model, checking after every step.
fn pool_matches_model(
    policy: EvictionPolicy,
    num_blocks: usize,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let pool = BlockPool::with_policy(TierKind::Host, num_blocks, policy).unwrap();
    let mut world = World {
        pool,
        model: Model::new(num_blocks, policy),
        mutables: Vec::new(),
        immutables: Vec::new(),
    };
    world.check()?;
    for op in ops {
        world.apply(op)?;
        world.check()?;
    }

    let World {
        pool,
        mutables,
        immutables,
        ..
    } = world;
    drop(mutables);
    drop(immutables);
    let s = pool.stats();
    prop_assert_eq!(
        s.free + s.inactive,
        num_blocks,
        "leak after dropping everything: {:?}",
        s
    );
    prop_assert_eq!((s.mutable, s.active), (0, 0));
    prop_assert_eq!(s.registered, s.inactive);
    Ok(())
}

proptest! {
    // More cases for the prefix policy: its duel's corner cases decide an eviction in few of
    // the random sequences. At 256 cases a duel that gave a tied score to the credit went
    // unnoticed; at 2048 it is caught (a few seconds), as are miniatures keeping their own
    // clock and a lookup's keys past the first miss observed without the miniature-size cap.
    // That keys past the miss are observed at all is checked by a unit test in
    // src/pool/eviction/prefix.rs (`prefix_duel_sees_…`): random sequences this small rarely
    // depend on it.
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn prefix_pool_matches_model(num_blocks in 1usize..8, ops in prop::collection::vec(op(), 1..60)) {
        pool_matches_model(EvictionPolicy::Prefix, num_blocks, ops)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn lru_pool_matches_model(num_blocks in 1usize..8, ops in prop::collection::vec(op(), 1..60)) {
        pool_matches_model(EvictionPolicy::Lru, num_blocks, ops)?;
    }

    #[test]
    fn two_q_pool_matches_model(num_blocks in 1usize..8, ops in prop::collection::vec(op(), 1..60)) {
        pool_matches_model(EvictionPolicy::TwoQ, num_blocks, ops)?;
    }

    /// Whatever happened before, a full allocation succeeds once every handle is gone.
    #[test]
    fn everything_reusable_after_drop(
        policy in policy(),
        num_blocks in 1usize..8,
        ops in prop::collection::vec(op(), 1..40),
    ) {
        let pool = BlockPool::with_policy(TierKind::Disk, num_blocks, policy).unwrap();
        let mut world = World {
            pool: pool.clone(),
            model: Model::new(num_blocks, policy),
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
