//! The [`FrequencyFilter`] that gates the host → disk offload.

use std::collections::HashMap;

use super::BuildSeqHasher;
use crate::error::{Error, Result};
use crate::identity::SequenceHash;

/// Admission filter for the host → disk step: a block is admitted to disk only once it has been
/// seen `min_frequency` times (1 admits always).
///
/// Memory is bounded: the counter table holds at most `capacity` hashes. Recording a new hash into
/// a full table first ages it TinyLFU-style: every count is halved and zeros are dropped (repeated
/// until there is room), so one-off hashes fade while frequent ones keep part of their count.
#[derive(Debug, Clone)]
pub struct FrequencyFilter {
    min_frequency: u32,
    capacity: usize,
    counts: HashMap<SequenceHash, u32, BuildSeqHasher>,
}

impl FrequencyFilter {
    /// A filter admitting hashes seen at least `min_frequency` times, tracking at most `capacity`.
    ///
    /// Errors: `min_frequency` or `capacity` is 0 (invalid argument).
    pub fn new(min_frequency: u32, capacity: usize) -> Result<Self> {
        if min_frequency == 0 {
            return Err(Error::invalid_argument(
                "min_frequency must be at least 1 (1 admits every block)",
            ));
        }
        if capacity == 0 {
            return Err(Error::invalid_argument(
                "frequency filter capacity must be at least 1",
            ));
        }
        Ok(Self {
            min_frequency,
            capacity,
            counts: HashMap::with_hasher(BuildSeqHasher::default()),
        })
    }

    /// Counts one sighting of `hash`; returns its new count (saturating).
    pub fn record(&mut self, hash: SequenceHash) -> u32 {
        if let Some(c) = self.counts.get_mut(&hash) {
            *c = c.saturating_add(1);
            return *c;
        }
        while self.counts.len() >= self.capacity {
            self.age();
        }
        self.counts.insert(hash, 1);
        1
    }

    /// Halves every count and drops the zeros.
    fn age(&mut self) {
        self.counts.retain(|_, c| {
            *c /= 2;
            *c > 0
        });
    }

    /// Whether `hash` has been seen often enough to go to disk.
    pub fn admit(&self, hash: SequenceHash) -> bool {
        self.min_frequency <= 1 || self.count(hash) >= self.min_frequency
    }

    /// The current (aged) count of `hash`; 0 if not tracked.
    pub fn count(&self, hash: SequenceHash) -> u32 {
        self.counts.get(&hash).copied().unwrap_or(0)
    }

    /// Sightings needed before admission.
    pub fn min_frequency(&self) -> u32 {
        self.min_frequency
    }

    /// Most hashes tracked at once.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Hashes tracked now.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    /// Whether no hash is tracked.
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    fn h(i: u64) -> SequenceHash {
        SequenceHash(u128::from(i))
    }

    #[test]
    fn filter_with_one_admits_always() {
        let mut f = FrequencyFilter::new(1, 8).unwrap();
        assert!(f.admit(h(1)));
        assert_eq!(f.record(h(1)), 1);
        assert!(f.admit(h(1)) && f.admit(h(2)));
        assert_eq!(f.min_frequency(), 1);
    }

    #[test]
    fn filter_with_three_admits_on_third_sighting() {
        let mut f = FrequencyFilter::new(3, 8).unwrap();
        assert!(f.is_empty());
        f.record(h(1));
        assert!(!f.admit(h(1)));
        f.record(h(1));
        assert!(!f.admit(h(1)));
        assert_eq!(f.record(h(1)), 3);
        assert!(f.admit(h(1)));
        assert!(!f.admit(h(2)));
        assert_eq!(f.len(), 1);
    }

    #[test]
    fn filter_ages_when_full() {
        let mut f = FrequencyFilter::new(2, 4).unwrap();
        for _ in 0..4 {
            f.record(h(1));
        }
        for i in 2..=4 {
            f.record(h(i));
        }
        assert_eq!(f.len(), 4);
        // Full: halving drops the one-offs, keeps h1 at 2.
        assert_eq!(f.record(h(5)), 1);
        assert_eq!(f.len(), 2);
        assert_eq!(f.count(h(1)), 2);
        assert!(f.admit(h(1)));
        assert_eq!(f.count(h(2)), 0);
        assert!(!f.admit(h(5)));

        // Every entry frequent: aging repeats until there is room.
        let mut g = FrequencyFilter::new(2, 2).unwrap();
        for _ in 0..8 {
            g.record(h(1));
            g.record(h(2));
        }
        g.record(h(3));
        assert!(g.len() <= 2);
        assert_eq!(g.count(h(3)), 1);
    }

    #[test]
    fn filter_rejects_zero_arguments() {
        assert_eq!(
            FrequencyFilter::new(0, 8).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            FrequencyFilter::new(2, 0).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }
}
