//! The ghost of evicted keys: recently evicted keys with their reuse counts, for the policies
//! that give a key stored again soon after its eviction the reuses it had (2Q, prefix).

use std::hash::Hasher;

use crate::error::{Error, Result};
use crate::identity::SequenceHash;
use crate::pool::SeqHasher;

/// Recently evicted keys with their reuse counts: a table of packed entries (32-bit key tag,
/// eviction number mod 2^28, reuse count) in buckets of [`GHOST_WAYS`] (one 64-byte cache
/// line), the bucket picked by the key's low bits. Recording overwrites an empty or expired
/// entry of the key's bucket, else its oldest; taking reads one bucket. The table is sized up
/// front (a power of two at least twice the keys to remember, which keeps buckets from
/// overflowing: 8 to 16 bytes per key), so both are a few
/// compares in one cache line and allocate nothing. A bucket that fills before its keys expire
/// forgets its oldest early; a tag collision (one in 2^32 per compare) hands a reuse count to
/// the wrong key, which costs nothing but a slightly different eviction order.
#[derive(Debug)]
pub(crate) struct Ghost {
    table: Vec<u64>,
    /// Buckets - 1 (the number of buckets is a power of two).
    mask: usize,
    /// An entry is forgotten once this many evictions were recorded after it.
    window: u64,
    /// Evictions recorded so far.
    count: u64,
}

/// Entries per ghost bucket.
const GHOST_WAYS: usize = 8;
/// Bits of an entry's eviction number.
const GHOST_AGE_BITS: u32 = 28;
const GHOST_AGE_MASK: u64 = (1 << GHOST_AGE_BITS) - 1;

impl Ghost {
    /// A ghost remembering the keys of the last `len` evictions (0: none; recording and
    /// taking then do nothing). Errors: its table cannot be allocated (invalid argument).
    pub(crate) fn new(len: usize) -> Result<Self> {
        // Ages wrap at 2^28 evictions: a longer window could not be told apart.
        let len = len.min(GHOST_AGE_MASK as usize);
        let slots = if len == 0 {
            0
        } else {
            len.saturating_mul(2).next_power_of_two().max(GHOST_WAYS)
        };
        let mut table = Vec::new();
        table.try_reserve_exact(slots).map_err(|e| {
            Error::invalid_argument(format!("cannot allocate {slots} ghost entries: {e}"))
        })?;
        table.resize(slots, 0);
        Ok(Self {
            table,
            mask: (slots / GHOST_WAYS).saturating_sub(1),
            window: len as u64,
            count: 0,
        })
    }

    /// First entry of `hash`'s bucket and its tag: the high 31 bits of the key's 64-bit
    /// fingerprint (mixed, so low-entropy keys spread too) with the top bit set (an empty entry
    /// is 0).
    fn locate(&self, hash: SequenceHash) -> (usize, u64) {
        let mut h = SeqHasher::default();
        h.write_u128(hash.0);
        let fp = h.finish();
        (
            ((fp as usize) & self.mask) * GHOST_WAYS,
            (fp >> 32) | 0x8000_0000,
        )
    }

    /// Evictions recorded since `entry` was, itself included.
    fn age(&self, entry: u64) -> u64 {
        self.count.wrapping_sub(entry >> 4) & GHOST_AGE_MASK
    }

    /// Remembers an evicted key in its bucket: over its own older entry, else the first empty or
    /// expired entry, else the oldest.
    pub(crate) fn record(&mut self, hash: SequenceHash, uses: u8) {
        let (first, tag) = self.locate(hash);
        let entry = (tag << 32) | ((self.count & GHOST_AGE_MASK) << 4) | u64::from(uses & 0xF);
        let Some(bucket) = self.table.get(first..first + GHOST_WAYS) else {
            return;
        };
        let (mut at, mut oldest) = (0, 0);
        for (w, &e) in bucket.iter().enumerate() {
            let age = self.age(e);
            if e == 0 || age > self.window || e >> 32 == tag {
                at = w;
                break;
            }
            if age > oldest {
                (at, oldest) = (w, age);
            }
        }
        if let Some(e) = self.table.get_mut(first + at) {
            *e = entry;
        }
        self.count += 1;
    }

    /// Forgets `hash` and returns its reuse count, if it is remembered.
    pub(crate) fn take(&mut self, hash: SequenceHash) -> Option<u8> {
        let (first, tag) = self.locate(hash);
        let bucket = self.table.get(first..first + GHOST_WAYS)?;
        let w = bucket.iter().position(|&e| e >> 32 == tag)?;
        let e = self.table.get_mut(first + w)?;
        let entry = std::mem::take(e);
        (self.age(entry) <= self.window).then_some((entry & 0xF) as u8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u64) -> SequenceHash {
        SequenceHash(u128::from(i))
    }

    #[test]
    fn ghost_remembers_the_last_window_evictions_once_each() {
        // A window of 3, as a ring of the last three evictions would keep.
        let mut g = Ghost::new(3).unwrap();
        g.record(h(1), 2);
        g.record(h(2), 0);
        g.record(h(3), 1);
        assert_eq!(g.take(h(1)), Some(2), "two evictions after it: remembered");
        assert_eq!(g.take(h(1)), None, "taken once");
        assert_eq!(g.take(h(7)), None, "never evicted");
        g.record(h(4), 0);
        g.record(h(5), 0);
        assert_eq!(g.take(h(2)), None, "three evictions after it: forgotten");
        assert_eq!(g.take(h(3)), Some(1), "two after it: still there");
        // Evicted again, a key's newest count is the one remembered.
        g.record(h(6), 3);
        g.record(h(6), 1);
        assert_eq!(g.take(h(6)), Some(1));
        // A ghost of length 0 (the prefix policy's credit-free miniature) keeps nothing.
        let mut none = Ghost::new(0).unwrap();
        none.record(h(1), 1);
        assert_eq!(none.take(h(1)), None);
    }
}
