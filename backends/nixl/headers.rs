//! Block headers: what makes a remote block verifiable. One sealed entry per block of an
//! exported host tier (`[key (2 words), checksum, sequence, seal]`), in memory registered with UCX; the
//! exporter invalidates an entry before it rewrites the block and publishes it after, and an
//! importer reads it before it trusts a block's bytes ([`RemoteTier::read_verified`]).
//!
//! [`RemoteTier::read_verified`]: super::RemoteTier::read_verified

use std::sync::atomic::{AtomicU64, Ordering};

use nixl_sys::{MemType, RegistrationHandle};
use xxhash_rust::xxh3::Xxh3;

use super::agent::{NixlAgent, RawRegion};
use super::probe::NixlBackend;
use crate::backends::slot_file::hash_segments;
use crate::error::{Error, Result};
use crate::tier::StorageTier;

/// Little-endian u64 words of one block header entry: `[key low, key high, checksum, sequence,
/// seal]` (the key is the 128-bit block key).
const WORDS: usize = 5;

/// Bytes of one block header entry (five little-endian u64 words: key low, key high, checksum,
/// sequence, seal).
pub const BLOCK_HEADER_BYTES: usize = WORDS * 8;

/// The seal of a header entry: a hash of its fields, never 0 (0 marks "being written"). It
/// detects torn and invalidated entries; it is no authenticator.
fn seal(key: u128, checksum: u64, seq: u64) -> u64 {
    let mut h = Xxh3::new();
    h.update(b"kvbm-block-header");
    h.update(&key.to_le_bytes());
    h.update(&checksum.to_le_bytes());
    h.update(&seq.to_le_bytes());
    h.digest() | 1
}

/// Decodes one header entry read from an exporter: `(key, checksum)` when it is valid (a
/// non-zero key and a matching seal), `None` when invalidated, being written or torn.
pub fn decode_header(bytes: &[u8]) -> Option<(u128, u64)> {
    if bytes.len() < BLOCK_HEADER_BYTES {
        return None;
    }
    let w = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
        u64::from_le_bytes(b)
    };
    let key = u128::from(w(0)) | (u128::from(w(1)) << 64);
    let (checksum, seq, sealed) = (w(2), w(3), w(4));
    (key != 0 && sealed == seal(key, checksum, seq)).then_some((key, checksum))
}

/// One header entry per block of an exported host tier, in memory registered with UCX, so that
/// importers can check what a block holds before they trust its bytes. See
/// [`NixlAgent::register_block_headers`] and [`RemoteTier::read_verified`](super::RemoteTier::read_verified).
pub struct BlockHeaders {
    /// Deregistered (dropped) before `words` is freed (fields drop in order).
    _handle: RegistrationHandle,
    /// [`WORDS`] words per block: key (low, high), checksum, sequence, seal.
    words: Box<[AtomicU64]>,
    seq: AtomicU64,
}

impl std::fmt::Debug for BlockHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockHeaders")
            .field("num_blocks", &self.num_blocks())
            .finish_non_exhaustive()
    }
}

impl BlockHeaders {
    pub(super) fn new(agent: &NixlAgent, num_blocks: usize) -> Result<Self> {
        let words: Box<[AtomicU64]> = (0..num_blocks * WORDS).map(|_| AtomicU64::new(0)).collect();
        let handle = agent.register(
            &RawRegion {
                addr: words.as_ptr() as usize,
                len: (num_blocks * BLOCK_HEADER_BYTES).max(1),
                mem: MemType::Dram,
                dev: 0,
            },
            Some(NixlBackend::Ucx),
        )?;
        Ok(Self {
            _handle: handle,
            words,
            seq: AtomicU64::new(0),
        })
    }

    pub(super) fn addr(&self) -> usize {
        self.words.as_ptr() as usize
    }

    /// Blocks covered.
    pub fn num_blocks(&self) -> usize {
        self.words.len() / WORDS
    }

    fn entry(&self, block: usize) -> Result<&[AtomicU64]> {
        self.words
            .get(block * WORDS..block * WORDS + WORDS)
            .ok_or_else(|| Error::out_of_range("block header", block, self.num_blocks()))
    }

    /// Marks `block` as holding nothing verifiable. Call it **before** overwriting the block.
    pub fn invalidate(&self, block: usize) -> Result<()> {
        let e = self.entry(block)?;
        e[4].store(0, Ordering::SeqCst);
        e[0].store(0, Ordering::SeqCst);
        e[1].store(0, Ordering::SeqCst);
        Ok(())
    }

    /// Publishes that `block` holds `key` (non-zero) with image checksum `checksum`.
    pub fn publish(&self, block: usize, key: u128, checksum: u64) -> Result<()> {
        if key == 0 {
            return Err(Error::invalid_argument(
                "key 0 marks an invalid block header",
            ));
        }
        let e = self.entry(block)?;
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        e[4].store(0, Ordering::SeqCst);
        e[0].store(key as u64, Ordering::SeqCst);
        e[1].store((key >> 64) as u64, Ordering::SeqCst);
        e[2].store(checksum, Ordering::SeqCst);
        e[3].store(seq, Ordering::SeqCst);
        e[4].store(seal(key, checksum, seq), Ordering::SeqCst);
        Ok(())
    }

    /// Hashes `block` of `tier` (the registered tier these headers describe; no write to the
    /// block may run meanwhile) and publishes it as holding `key`. Returns the checksum.
    pub fn publish_from(&self, tier: &dyn StorageTier, block: usize, key: u128) -> Result<u64> {
        let mut checksum = 0;
        tier.with_block(block, &mut |runs| {
            checksum = hash_segments(runs);
            Ok(())
        })?;
        self.publish(block, key, checksum)?;
        Ok(checksum)
    }

    /// `(key, checksum)` of `block` when valid.
    pub fn get(&self, block: usize) -> Option<(u128, u64)> {
        let e = self.entry(block).ok()?;
        let mut b = [0u8; BLOCK_HEADER_BYTES];
        for (i, w) in e.iter().enumerate() {
            b[i * 8..i * 8 + 8].copy_from_slice(&w.load(Ordering::SeqCst).to_le_bytes());
        }
        decode_header(&b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_seal_detects_invalid_and_torn_entries() {
        let enc = |k: u128, c: u64, s: u64, x: u64| {
            [k as u64, (k >> 64) as u64, c, s, x]
                .iter()
                .flat_map(|w| w.to_le_bytes())
                .collect::<Vec<u8>>()
        };
        assert_eq!(decode_header(&enc(7, 9, 1, seal(7, 9, 1))), Some((7, 9)));
        assert_eq!(decode_header(&enc(0, 9, 1, seal(0, 9, 1))), None);
        assert_eq!(decode_header(&enc(7, 9, 1, 0)), None);
        // Key of one version, checksum of another.
        assert_eq!(decode_header(&enc(7, 10, 1, seal(7, 9, 1))), None);
        assert_eq!(decode_header(&enc(7, 9, 2, seal(7, 9, 1))), None);
        assert_eq!(decode_header(&[0u8; 8]), None);
        // Both halves of the 128-bit key are stored and sealed: keys that differ only in the
        // high half are told apart, and a key of 0 in the low half alone is still valid.
        let k = (5u128 << 64) | 7;
        assert_eq!(decode_header(&enc(k, 9, 1, seal(k, 9, 1))), Some((k, 9)));
        assert_eq!(decode_header(&enc(k, 9, 1, seal(7, 9, 1))), None);
        let high = 5u128 << 64;
        assert_eq!(
            decode_header(&enc(high, 9, 1, seal(high, 9, 1))),
            Some((high, 9))
        );
    }
}
