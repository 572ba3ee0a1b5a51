//! Prefix matching across tiers: [`match_across`] (host, then disk) and its [`TieredMatch`].

use super::{BlockPool, ImmutableBlock};
use crate::identity::SequenceHash;
use crate::tier::TierKind;

/// The result of [`match_across`]: the blocks held on each tier, in the order the pools were given.
#[derive(Debug, Clone, Default)]
pub struct TieredMatch {
    /// One entry per pool searched (possibly empty), in search order. The blocks of entry `k`
    /// continue the prefix where entry `k - 1` stopped.
    pub per_tier: Vec<(TierKind, Vec<ImmutableBlock>)>,
}

impl TieredMatch {
    /// Blocks matched over all tiers: the length of the matched prefix.
    pub fn total_blocks(&self) -> usize {
        self.per_tier.iter().map(|(_, b)| b.len()).sum()
    }

    /// Blocks matched on tiers of `kind`.
    pub fn blocks_from(&self, kind: TierKind) -> usize {
        self.per_tier
            .iter()
            .filter(|(k, _)| *k == kind)
            .map(|(_, b)| b.len())
            .sum()
    }
}

/// Prefix match across tiers: the first pool (host) is searched from the start of `hashes`; each
/// next pool (disk) continues at the index where the previous one stopped. Returns the held blocks
/// per tier; `total_blocks()` is the length of the prefix found somewhere.
pub fn match_across(pools: &[&BlockPool], hashes: &[SequenceHash]) -> TieredMatch {
    let mut per_tier = Vec::with_capacity(pools.len());
    let mut pos = 0usize;
    for pool in pools {
        let rest = hashes.get(pos..).unwrap_or_default();
        let blocks = pool.match_prefix(rest);
        pos += blocks.len();
        per_tier.push((pool.kind(), blocks));
    }
    TieredMatch { per_tier }
}
