//! [`EvictionPolicy::TwoQ`](super::EvictionPolicy::TwoQ): 2Q (Johnson & Shasha, 1994),
//! simplified.

use super::{Eviction, Ghost, InactiveLists, Placement, Released};
use crate::error::Result;
use crate::identity::SequenceHash;

/// 2Q's probation list may hold this fraction (1 / n) of the pool before it is evicted from
/// first.
const TWO_Q_PROBATION_DIVISOR: usize = 4;

/// The probation list: blocks never reused, first in first out.
const PROBATION: usize = 0;
/// The main list: reused blocks, least recently used first.
const MAIN: usize = 1;

/// 2Q: blocks never reused wait in a FIFO probation list (list 0) that is evicted from first
/// once it holds a quarter of the pool (or the main list is empty); reused blocks live in an
/// LRU main list (list 1). Both are ordered by the clock at release. Keys evicted from
/// probation are remembered (as many as the pool has blocks), and one stored again starts with
/// its reuse count plus one, so it joins the main list.
#[derive(Debug)]
pub(crate) struct TwoQ {
    /// The probation list is evicted from first once it holds this many blocks.
    probation_target: usize,
    /// Keys evicted from probation, with their reuse counts.
    ghost: Ghost,
}

impl TwoQ {
    /// 2Q for a pool of `num_blocks` blocks. Errors: its ghost cannot be allocated.
    pub(crate) fn new(num_blocks: u32) -> Result<Self> {
        let n = num_blocks as usize;
        Ok(Self {
            probation_target: (n / TWO_Q_PROBATION_DIVISOR).max(1),
            ghost: Ghost::new(n)?,
        })
    }
}

impl Eviction for TwoQ {
    fn place(&self, released: Released) -> Placement {
        Placement {
            list: if released.uses > 0 { MAIN } else { PROBATION },
            stamp: released.clock,
            run_first: false,
        }
    }

    fn victim(&self, lists: InactiveLists<'_>) -> Option<u32> {
        let l = if lists.len(PROBATION) >= self.probation_target || lists.len(MAIN) == 0 {
            PROBATION
        } else {
            MAIN
        };
        lists.head(l)
    }

    fn evicted(&mut self, hash: SequenceHash, list: usize, uses: u8) {
        if list == PROBATION {
            self.ghost.record(hash, uses);
        }
    }

    fn recall(&mut self, hash: SequenceHash) -> Option<u8> {
        self.ghost.take(hash)
    }
}
