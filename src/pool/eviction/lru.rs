//! [`EvictionPolicy::Lru`](super::EvictionPolicy::Lru): least recently used first.

use super::{Eviction, InactiveLists, Placement, Released};

/// Least recently used first: one list, ordered by the clock at release (a released block joins
/// the most-recently-used end). Keeps nothing of its own.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Lru;

impl Eviction for Lru {
    fn place(&self, released: Released) -> Placement {
        Placement {
            list: 0,
            stamp: released.clock,
            run_first: false,
        }
    }

    fn victim(&self, lists: InactiveLists<'_>) -> Option<u32> {
        lists.head(0)
    }
}
