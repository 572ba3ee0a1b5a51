//! [`EvictionPolicy::Prefix`](super::EvictionPolicy::Prefix): prefix-aware reuse credit, with
//! its duel (two miniature pools deciding whether the credit applies) and its ghost.

use super::{Eviction, Ghost, InactiveLists, Placement, Released, NUM_LISTS};
use crate::error::Result;
use crate::identity::SequenceHash;
use crate::pool::state::State;

/// The prefix policy remembers the reuse counts of this many times `num_blocks` evicted keys.
const PREFIX_GHOST_FACTOR: usize = 8;

/// The prefix policy: one list per reuse count `c` (`0..=MAX_USES`), each ordered by the epoch
/// of the request that last used its blocks; a block's priority is that stamp plus its list's
/// credit (`num_blocks << (c - 1)` clock ticks, 0 for c = 0) while the credit applies, and the
/// smallest priority of the five heads leaves first (a tie goes to the lower list). Blocks
/// released together share their stamp and leave deepest first (a release goes in front of its
/// run). See [`EvictionPolicy::Prefix`](super::EvictionPolicy::Prefix) for the reasoning.
#[derive(Debug)]
pub(crate) struct Prefix {
    /// Credit of list `c`, in clock ticks (`num_blocks << (c - 1)`, 0 for c = 0).
    credit: [u64; NUM_LISTS],
    /// Whether the credit applies now (the duel's verdict; always for a credited miniature).
    credit_on: bool,
    /// Evicted keys' reuse counts, for the last `PREFIX_GHOST_FACTOR × num_blocks` evictions
    /// (none in the credit-free miniature).
    ghost: Ghost,
    /// The miniature simulations that turn the credit on and off (`None` in a miniature
    /// itself).
    duel: Option<Box<Duel>>,
}

impl Prefix {
    /// The prefix policy of a pool of `num_blocks` blocks, with its duel; the credit is off
    /// until the duel shows it pays (see `Duel::use_key`). Errors: its ghost or its
    /// miniatures cannot be allocated.
    pub(crate) fn new(num_blocks: u32) -> Result<Self> {
        let mut p = Self::miniature(num_blocks, true)?;
        p.duel = Some(Box::new(Duel::new(num_blocks)?));
        p.credit_on = false;
        Ok(p)
    }

    /// Without a duel: `credit`, the credit always on and the ghost kept (the duel's credited
    /// miniature); else prefix order alone, which needs neither (its plain one).
    pub(crate) fn miniature(num_blocks: u32, credit: bool) -> Result<Self> {
        let n = num_blocks as usize;
        let ghost_len = if credit {
            n.saturating_mul(PREFIX_GHOST_FACTOR)
        } else {
            0
        };
        let mut credits = [0u64; NUM_LISTS];
        for (c, slot) in credits.iter_mut().enumerate().skip(1) {
            *slot = (n as u64).saturating_mul(1u64 << (c - 1));
        }
        Ok(Self {
            credit: credits,
            credit_on: credit,
            ghost: Ghost::new(ghost_len)?,
            duel: None,
        })
    }
}

impl Eviction for Prefix {
    fn place(&self, released: Released) -> Placement {
        Placement {
            list: usize::from(released.uses),
            stamp: released.epoch,
            run_first: true,
        }
    }

    fn victim(&self, lists: InactiveLists<'_>) -> Option<u32> {
        // The smallest (stamp + credit of its list); a tie goes to the lower list.
        let mut best: Option<(u64, u32)> = None;
        for l in 0..NUM_LISTS {
            let Some((id, stamp)) = lists.head_stamp(l) else {
                continue;
            };
            let credit = if self.credit_on { self.credit[l] } else { 0 };
            let p = stamp.saturating_add(credit);
            if best.is_none_or(|(b, _)| p < b) {
                best = Some((p, id));
            }
        }
        best.map(|(_, id)| id)
    }

    /// Every evicted key's count is remembered.
    fn evicted(&mut self, hash: SequenceHash, _list: usize, uses: u8) {
        self.ghost.record(hash, uses);
    }

    fn recall(&mut self, hash: SequenceHash) -> Option<u8> {
        self.ghost.take(hash)
    }

    fn ticks_on_lookup(&self) -> bool {
        true
    }

    fn epoch_began(&mut self, clock: u64) {
        if let Some(d) = self.duel.as_mut() {
            // The miniatures keep the pool's time, scaled by their size: a credit of
            // `num_blocks / rate` of their ticks then lasts as long as the pool's own. (Their
            // own clocks run at their uses, which can be many more than the pool's releases:
            // a block matched again while held is released once.)
            let now = clock / (d.mask + 1);
            d.credited.set_epoch(now);
            d.plain.set_epoch(now);
        }
    }

    /// The duel's miniatures see the sampled keys (see [`Duel::observe_demand`]), and the
    /// credit follows the one of them that has been right more often lately.
    fn observe_demand(&mut self, hashes: &[SequenceHash], matched: usize) {
        let Some(d) = self.duel.as_mut() else {
            return;
        };
        if let Some(on) = d.observe_demand(hashes, matched) {
            self.credit_on = on;
        }
    }

    /// The miniatures store the key too if it is sampled and they lack it (a key a lookup
    /// asked for is in them already; one stored without a lookup, e.g. written through, enters
    /// them here). Not a use: it moves no score and counts no reuse.
    fn observe_store(&mut self, hash: SequenceHash) {
        if let Some(d) = self.duel.as_mut() {
            d.store(hash);
        }
    }
}

/// The prefix policy's two miniature simulations ("set dueling", after Qureshi et al., ISCA
/// 2007, over a key sample as in Waldspurger et al., USENIX ATC 2017): one keeps the reuse
/// credit, the other evicts in prefix order alone (credit 0). Both see the same sampled keys
/// (one key in `rate`, by its hash) with `num_blocks / rate` blocks each, and keep the pool's
/// time scaled by `rate`. A use is a key a lookup asks for — every key of it, past the pool's
/// first miss too, so that what the miniatures see does not depend on what the pool itself
/// kept; a stored key enters a miniature that lacks it without counting as a use. Each use
/// that one miniature holds and the other does not moves a saturating score one step, and
/// the full pool applies the credit only while the score leads by more than
/// [`DUEL_CREDIT_MARGIN`]: with no evidence (a fresh pool, a tie) or too little (a lead a
/// sample's noise reaches on its own) it evicts in prefix order alone, which is never far from
/// LRU, whereas a credit applied on a chance lead can keep dead chains for up to eight
/// turnovers of the pool. Credit pays where reuse predicts reuse (long-lived chat traffic) and costs where it
/// does not (conversations of a fixed length keep their past reuses after their last turn):
/// the duel measures which on the traffic at hand instead of guessing.
#[derive(Debug)]
struct Duel {
    /// A key is sampled when these bits of its fingerprint are all 0 (`rate - 1`, `rate` a
    /// power of two).
    mask: u64,
    credited: State,
    plain: State,
    /// In `-DUEL_SCORE_MAX..=DUEL_SCORE_MAX`: up when only `credited` holds a used key, down when
    /// only `plain` does. The credit applies while it is above [`DUEL_CREDIT_MARGIN`].
    score: i32,
}

/// A pool below this many blocks is simulated whole (rate 1): its miniatures are exact copies
/// of the two policies, and cost little in absolute terms.
const DUEL_WHOLE_BELOW: u32 = 512;

/// A larger pool's miniatures hold at least this many blocks (the largest power-of-two rate
/// that leaves them this many).
const DUEL_MIN_BLOCKS: u32 = 128;

/// The duel's score saturates here: after a long run one way, this many uses going the other
/// way turn the credit over.
const DUEL_SCORE_MAX: i32 = 32;

/// The credit applies only while the duel's score is above this (a quarter of its range): the
/// credited miniature must have held this many more of the recent uses than the plain one, not
/// merely more. The miniatures see one key in `rate`, so at a few hundred blocks each their
/// verdict on a short trace rests on a few dozen disagreements, and a lead of a few steps is
/// noise: on Mooncake's synthetic trace at 3M tokens of host cache, a credit kept on leads of a
/// few uses while the traffic had turned against it lost 1.4 points to LRU (docs/benchmarks.md,
/// "The duel's margin").
const DUEL_CREDIT_MARGIN: i32 = DUEL_SCORE_MAX / 4;

impl Duel {
    fn new(num_blocks: u32) -> Result<Self> {
        // Rate 1 for a small pool; else the largest power of two `rate` with
        // num_blocks / rate >= DUEL_MIN_BLOCKS.
        let ratio = if num_blocks < DUEL_WHOLE_BELOW {
            1
        } else {
            num_blocks / DUEL_MIN_BLOCKS
        };
        let rate = 1u32 << (31 - ratio.leading_zeros());
        let mini = num_blocks.div_ceil(rate).max(1);
        Ok(Self {
            mask: u64::from(rate - 1),
            credited: State::new(mini, Box::new(Prefix::miniature(mini, true)?))?,
            plain: State::new(mini, Box::new(Prefix::miniature(mini, false)?))?,
            score: 0,
        })
    }

    /// Whether `hash` is in the sample. Keys are hashes already: their top bits pick it.
    fn sampled(&self, hash: SequenceHash) -> bool {
        ((hash.0 >> 104) as u64) & self.mask == 0
    }

    /// A store of `hash`: each miniature that lacks it (and samples it) stores it.
    fn store(&mut self, hash: SequenceHash) {
        if !self.sampled(hash) {
            return;
        }
        for mini in [&mut self.credited, &mut self.plain] {
            if !mini.contains(hash) {
                mini.insert(hash);
            }
        }
    }

    /// A lookup's demand: the sampled keys of `hashes` are uses, past the pool's first miss
    /// (`matched`) too, since what the pool holds beyond a miss is not stored again, so keys
    /// seen only when matched or stored would leave the miniatures blind to exactly the keys the
    /// policy kept. Past the miss, at most as many sampled keys as a miniature has blocks: a
    /// longer demand would only churn its last block (a request's blocks share a stamp and leave
    /// deepest first), at a cost growing with the prompt on the engine's hot path. Returns
    /// whether the credit applies now if the score moved.
    fn observe_demand(&mut self, hashes: &[SequenceHash], matched: usize) -> Option<bool> {
        let cap = self.credited.num_blocks();
        let mut past = 0;
        let mut verdict = None;
        for (i, &hash) in hashes.iter().enumerate() {
            if !self.sampled(hash) {
                continue;
            }
            if i >= matched {
                if past == cap {
                    break;
                }
                past += 1;
            }
            verdict = self.use_key(hash).or(verdict);
        }
        verdict
    }

    /// Runs a use of sampled `hash` through both miniatures; returns whether the credit applies
    /// now if this use moved the score.
    fn use_key(&mut self, hash: SequenceHash) -> Option<bool> {
        let with = self.credited.access(hash);
        let without = self.plain.access(hash);
        let step = match (with, without) {
            (true, false) => 1,
            (false, true) => -1,
            _ => return None,
        };
        self.score = (self.score + step).clamp(-DUEL_SCORE_MAX, DUEL_SCORE_MAX);
        Some(self.score > DUEL_CREDIT_MARGIN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u64) -> SequenceHash {
        SequenceHash(u128::from(i))
    }

    #[test]
    fn prefix_duel_sees_a_lookups_keys_past_the_first_miss_up_to_a_miniatures_size() {
        // 8 blocks: simulated whole (rate 1), miniatures of 8 blocks. The policy is driven as
        // a pool of 8 blocks drives it: a store, then lookups (each a new epoch).
        let mut p = Prefix::new(8).unwrap();
        let uses = |p: &Prefix| {
            let d = p.duel.as_ref().unwrap();
            (
                d.credited.clock(),
                d.plain.clock(),
                d.credited.contains(h(3)),
            )
        };
        // h1 is stored (it enters both miniatures, one release each).
        p.observe_store(h(1));
        assert_eq!(uses(&p), (1, 1, false));
        // h1 matches, h2 misses, h3 past the miss: all three are uses in both miniatures,
        // although the pool returns h1 alone.
        p.epoch_began(1);
        p.observe_demand(&[h(1), h(2), h(3)], 1);
        assert_eq!(uses(&p), (4, 4, true));
        // A demand of 1 match + 20 misses: the match and 8 keys past the miss (a miniature's
        // size), not 20.
        let long: Vec<SequenceHash> = std::iter::once(h(1)).chain((100..120).map(h)).collect();
        p.epoch_began(1);
        p.observe_demand(&long, 1);
        assert_eq!(uses(&p).0, 4 + 1 + 8);
    }
}
