//! Block identity: token blocks and their chained sequence hash.
//!
//! A block's key ([`SequenceHash`]) names the whole token prefix up to and including that block:
//!
//! * block hash `b(i)` = H(seed = salt, bytes = the block's token ids as little-endian `u32`);
//! * sequence hash `s(0) = b(0)`, `s(i)` = H(seed = salt, bytes = `s(i-1)` LE ‖ `b(i)` LE).
//!
//! Keys and block hashes are 128 bits (`u128`; 16 bytes little-endian wherever they are hashed or
//! stored). With [`HashAlgorithm::Sha256`] (the default, as vLLM's) H is SHA-256 over
//! `salt LE ‖ bytes`, truncated to its first 16 bytes read little-endian: collision-resistant, so
//! a tenant cannot craft a prompt whose key equals another request's (finding any collision takes
//! about 2^64 SHA-256 evaluations, and a billion cached blocks collide by accident with a chance
//! near 2^-68). H is not keyed: collision resistance needs no secret, so instances that share a
//! cache share nothing but the algorithm. With [`HashAlgorithm::Xxh3`] (an explicit opt-in for
//! trusted single-tenant deployments) H is xxh3-128 seeded with the salt: as wide, several times
//! cheaper, but not collision-resistant: anyone who knows the seed (the salt is derived from
//! public inputs) can forge a key.
//!
//! The salt ([`Salt`]) separates tenants: it is derived from the request's cache salt and LoRA name
//! (see [`Salt::new`]); two requests with different salts never share a key.
//!
//! Only *full* blocks get keys. [`TokenSequence`] accepts tokens incrementally and yields each newly
//! full block once, hashing only the new block (the chain makes earlier blocks' keys reusable).

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_128_with_seed;

use crate::error::{Error, Result};

/// A token id as the engines hand them over.
pub type Token = u32;

/// Hash of one block's tokens alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockHash(pub u128);

/// The key of a full block: names the whole prefix up to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SequenceHash(pub u128);

impl std::fmt::Display for SequenceHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// Which hash function builds the keys.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    strum::Display,
    strum::EnumString,
    strum::VariantNames,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase", ascii_case_insensitive)]
pub enum HashAlgorithm {
    /// SHA-256 over `salt ‖ input`, truncated to 128 bits. Collision-resistant: the default.
    #[default]
    Sha256,
    /// xxh3-128, seeded with the salt. Several times cheaper but forgeable by anyone who can
    /// choose prompts: only for trusted single-tenant deployments.
    Xxh3,
}

/// The per-tenant seed of every hash of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Salt(pub u64);

impl Salt {
    /// The salt of a request with no cache salt and no LoRA adapter.
    pub const NONE: Salt = Salt(0);

    /// Derives the salt from a request's cache salt and LoRA name.
    ///
    /// Both absent gives [`Salt::NONE`] (0). Otherwise the salt is H(seed 0) over the encoding
    /// `tag(cache_salt) ‖ tag(lora_name)`, where `tag(None) = u32::MAX LE` and
    /// `tag(Some(s)) = len(s) as u32 LE ‖ utf8(s)`. The length prefix keeps `("ab", "c")` and
    /// `("a", "bc")` apart, and `Some("")` apart from `None`.
    pub fn new(
        algorithm: HashAlgorithm,
        cache_salt: Option<&str>,
        lora_name: Option<&str>,
    ) -> Self {
        if cache_salt.is_none() && lora_name.is_none() {
            return Salt::NONE;
        }
        let mut buf =
            Vec::with_capacity(8 + cache_salt.map_or(0, str::len) + lora_name.map_or(0, str::len));
        for field in [cache_salt, lora_name] {
            match field {
                None => buf.extend_from_slice(&u32::MAX.to_le_bytes()),
                Some(s) => {
                    // Lengths above u32::MAX cannot be told apart from the None tag; saturate
                    // (such a salt is not a realistic input, and saturation keeps this total).
                    let len = u32::try_from(s.len()).unwrap_or(u32::MAX - 1);
                    buf.extend_from_slice(&len.to_le_bytes());
                    buf.extend_from_slice(s.as_bytes());
                }
            }
        }
        // The salt is a 64-bit seed (xxh3's seed width): the low 64 bits of the 128-bit hash.
        Salt(hash_bytes(algorithm, 0, &buf) as u64)
    }
}

#[inline(always)]
fn hash_bytes(algorithm: HashAlgorithm, seed: u64, bytes: &[u8]) -> u128 {
    match algorithm {
        HashAlgorithm::Xxh3 => xxh3_128_with_seed(bytes, seed),
        HashAlgorithm::Sha256 => {
            let mut h = Sha256::new();
            h.update(seed.to_le_bytes());
            h.update(bytes);
            let digest = h.finalize();
            let mut first = [0u8; 16];
            first.copy_from_slice(&digest[..16]);
            u128::from_le_bytes(first)
        }
    }
}

/// Computes block and sequence hashes for one salt and algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHasher {
    algorithm: HashAlgorithm,
    salt: Salt,
}

impl BlockHasher {
    /// A hasher for `algorithm` seeded with `salt`.
    pub fn new(algorithm: HashAlgorithm, salt: Salt) -> Self {
        Self { algorithm, salt }
    }

    /// The algorithm in use.
    pub fn algorithm(&self) -> HashAlgorithm {
        self.algorithm
    }

    /// The salt in use.
    pub fn salt(&self) -> Salt {
        self.salt
    }

    /// Hash of one block's tokens.
    pub fn block_hash(&self, tokens: &[Token]) -> BlockHash {
        // Token ids are hashed as little-endian u32 on every platform.
        #[cfg(target_endian = "little")]
        let bytes: &[u8] = {
            // SAFETY: u32 has no padding and any byte pattern is a valid u8; the slice covers
            // exactly the memory of `tokens`, which lives for this borrow.
            unsafe { std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), tokens.len() * 4) }
        };
        #[cfg(not(target_endian = "little"))]
        let owned: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        #[cfg(not(target_endian = "little"))]
        let bytes: &[u8] = &owned;
        BlockHash(hash_bytes(self.algorithm, self.salt.0, bytes))
    }

    /// Key of a block given the key of the block before it (`None` for the first block).
    pub fn sequence_hash(&self, parent: Option<SequenceHash>, block: BlockHash) -> SequenceHash {
        match parent {
            None => SequenceHash(block.0),
            Some(p) => {
                let mut buf = [0u8; 32];
                buf[..16].copy_from_slice(&p.0.to_le_bytes());
                buf[16..].copy_from_slice(&block.0.to_le_bytes());
                SequenceHash(hash_bytes(self.algorithm, self.salt.0, &buf))
            }
        }
    }

    /// Keys of every full block of `tokens`, cut in blocks of `block_size`.
    pub fn sequence_hashes(
        &self,
        tokens: &[Token],
        block_size: usize,
    ) -> Result<Vec<SequenceHash>> {
        let mut seq = TokenSequence::new(*self, block_size)?;
        seq.append(tokens);
        Ok(seq.into_hashes())
    }
}

/// One newly full block reported by [`TokenSequence::extend`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FullBlock {
    /// Index of the block in the sequence (0-based).
    pub index: usize,
    /// Hash of the block's tokens alone.
    pub block_hash: BlockHash,
    /// Key of the block (names the prefix up to it).
    pub sequence_hash: SequenceHash,
}

/// A token sequence that grows incrementally and keys each block once when it becomes full.
#[derive(Debug, Clone)]
pub struct TokenSequence {
    hasher: BlockHasher,
    block_size: usize,
    /// Tokens of the block being filled (fewer than `block_size`).
    partial: Vec<Token>,
    /// Keys of all full blocks so far, in order.
    hashes: Vec<SequenceHash>,
    total_tokens: usize,
}

impl TokenSequence {
    /// An empty sequence cut in blocks of `block_size` tokens.
    pub fn new(hasher: BlockHasher, block_size: usize) -> Result<Self> {
        if block_size == 0 {
            return Err(Error::invalid_argument("block_size must be at least 1"));
        }
        Ok(Self {
            hasher,
            block_size,
            partial: Vec::with_capacity(block_size),
            hashes: Vec::new(),
            total_tokens: 0,
        })
    }

    /// Appends tokens; returns the blocks that became full, each reported exactly once.
    pub fn extend(&mut self, tokens: &[Token]) -> Vec<FullBlock> {
        let mut out = Vec::with_capacity((self.partial.len() + tokens.len()) / self.block_size);
        self.feed(tokens, |b| out.push(b));
        out
    }

    /// Appends tokens and keys the blocks that became full, without listing them; returns how
    /// many became full. The cheaper form of [`TokenSequence::extend`] when only the keys matter.
    pub fn append(&mut self, tokens: &[Token]) -> usize {
        let before = self.hashes.len();
        self.feed(tokens, |_| {});
        self.hashes.len() - before
    }

    fn feed(&mut self, mut tokens: &[Token], mut on_block: impl FnMut(FullBlock)) {
        self.hashes
            .reserve((self.partial.len() + tokens.len()) / self.block_size);
        self.total_tokens += tokens.len();
        while !tokens.is_empty() {
            if self.partial.is_empty() && tokens.len() >= self.block_size {
                // Hash straight from the caller's slice: no copy for whole blocks.
                let (block, rest) = tokens.split_at(self.block_size);
                on_block(self.seal(block));
                tokens = rest;
                continue;
            }
            let take = (self.block_size - self.partial.len()).min(tokens.len());
            self.partial.extend_from_slice(&tokens[..take]);
            tokens = &tokens[take..];
            if self.partial.len() == self.block_size {
                let block = std::mem::take(&mut self.partial);
                on_block(self.seal(&block));
                self.partial = block;
                self.partial.clear();
            }
        }
    }

    #[inline]
    fn seal(&mut self, block: &[Token]) -> FullBlock {
        let block_hash = self.hasher.block_hash(block);
        let sequence_hash = self
            .hasher
            .sequence_hash(self.hashes.last().copied(), block_hash);
        let index = self.hashes.len();
        self.hashes.push(sequence_hash);
        FullBlock {
            index,
            block_hash,
            sequence_hash,
        }
    }

    /// Keys of all full blocks so far.
    pub fn hashes(&self) -> &[SequenceHash] {
        &self.hashes
    }

    /// Consumes the sequence, returning the keys of its full blocks.
    pub fn into_hashes(self) -> Vec<SequenceHash> {
        self.hashes
    }

    /// Tokens appended so far (full blocks and the partial one).
    pub fn total_tokens(&self) -> usize {
        self.total_tokens
    }

    /// Number of full blocks.
    pub fn num_full_blocks(&self) -> usize {
        self.hashes.len()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The hasher (algorithm and salt) of this sequence.
    pub fn hasher(&self) -> BlockHasher {
        self.hasher
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incremental_equals_one_shot() {
        let h = BlockHasher::new(HashAlgorithm::Xxh3, Salt::NONE);
        let tokens: Vec<Token> = (0..100).collect();
        let one = h.sequence_hashes(&tokens, 16).unwrap();
        let mut seq = TokenSequence::new(h, 16).unwrap();
        let mut seen = Vec::new();
        for chunk in tokens.chunks(7) {
            seen.extend(seq.extend(chunk).into_iter().map(|b| b.sequence_hash));
        }
        assert_eq!(one.len(), 6);
        assert_eq!(seen, one);
        assert_eq!(seq.total_tokens(), 100);
    }

    #[test]
    fn zero_block_size_is_an_error() {
        let h = BlockHasher::new(HashAlgorithm::Xxh3, Salt::NONE);
        assert_eq!(
            TokenSequence::new(h, 0).unwrap_err().kind(),
            crate::ErrorKind::InvalidArgument
        );
    }

    #[test]
    fn salts_separate_tenants() {
        let a = Salt::new(HashAlgorithm::Xxh3, Some("ab"), Some("c"));
        let b = Salt::new(HashAlgorithm::Xxh3, Some("a"), Some("bc"));
        let c = Salt::new(HashAlgorithm::Xxh3, Some(""), None);
        assert_ne!(a, b);
        assert_ne!(c, Salt::NONE);
    }
}
