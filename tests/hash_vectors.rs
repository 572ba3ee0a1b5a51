//! Fixed inputs -> fixed keys, so the key definition cannot drift.
//!
//! The expected values are cross-checked on every test run by an independent implementation of
//! the definition in `src/identity.rs` on Python's `xxhash` and `hashlib`
//! (`tests/python/test_hash_vectors.py`, run by `scripts/test.sh`), which reads them out of this
//! file. Changing any of them breaks every stored key and every peer that shares keys with us: do
//! it only deliberately.

use kvbm_connector::identity::{BlockHash, FullBlock, TokenSequence};
use kvbm_connector::{BlockHasher, HashAlgorithm, Salt, SequenceHash};

fn keys(alg: HashAlgorithm, cache_salt: Option<&str>, lora: Option<&str>) -> Vec<u64> {
    let h = BlockHasher::new(alg, Salt::new(alg, cache_salt, lora));
    let tokens: Vec<u32> = (0..64).collect();
    h.sequence_hashes(&tokens, 16)
        .unwrap()
        .into_iter()
        .map(|k| k.0)
        .collect()
}

#[test]
fn xxh3_vectors() {
    assert_eq!(
        keys(HashAlgorithm::Xxh3, None, None),
        [
            0x79c2079c74a8ee4d,
            0xca37f0ea43b0cef2,
            0xa5c5907e06f004e3,
            0xa0f460479b5ecdc6
        ]
    );
    assert_eq!(
        Salt::new(HashAlgorithm::Xxh3, Some("tenant-a"), None),
        Salt(0xfbaa614f2d7231fb)
    );
    assert_eq!(
        keys(HashAlgorithm::Xxh3, Some("tenant-a"), None),
        [
            0xffd66922c8b06ee4,
            0xba24a9fb14070557,
            0x32f215aa678b1bc2,
            0x7aabe0cc1e9e961c
        ]
    );
    assert_eq!(
        Salt::new(HashAlgorithm::Xxh3, Some("tenant-a"), Some("adapter-1")),
        Salt(0xc562c7a010fce96b)
    );
    assert_eq!(
        keys(HashAlgorithm::Xxh3, Some("tenant-a"), Some("adapter-1")),
        [
            0x0315a8d01d560f9c,
            0xc21f5fe1a680d4b8,
            0xa492994346975c31,
            0xaca538843d3df327
        ]
    );
}

#[test]
fn sha256_vectors() {
    assert_eq!(
        keys(HashAlgorithm::Sha256, None, None),
        [
            0x9a713de3f650cd26,
            0x144d4cb331689dff,
            0xbdd6dc29072830e6,
            0x3c3acd11a9d9ce73
        ]
    );
    assert_eq!(
        Salt::new(HashAlgorithm::Sha256, Some("tenant-a"), None),
        Salt(0x910c09b6e19bd16a)
    );
    assert_eq!(
        keys(HashAlgorithm::Sha256, Some("tenant-a"), None),
        [
            0x8b74733ab13f0f13,
            0x07a468813de3f652,
            0x0c5ec110d2a3ef70,
            0x6e1a01440e6f0d18
        ]
    );
    assert_eq!(
        keys(HashAlgorithm::Sha256, Some("tenant-a"), Some("adapter-1")),
        [
            0xf242cea4e4cca37e,
            0xe8b59bed482e0e0c,
            0x4ebde0ac8fd973a7,
            0xe3a935bb154bd1df
        ]
    );
}

#[test]
fn first_key_is_the_block_hash_and_chain_uses_parent() {
    let h = BlockHasher::new(HashAlgorithm::Xxh3, Salt::NONE);
    let tokens: Vec<u32> = (0..32).collect();
    let b0 = h.block_hash(&tokens[..16]);
    let b1 = h.block_hash(&tokens[16..]);
    assert_eq!(b0, BlockHash(0x79c2079c74a8ee4d));
    let s0 = h.sequence_hash(None, b0);
    assert_eq!(s0, SequenceHash(b0.0));
    assert_eq!(
        h.sequence_hash(Some(s0), b1),
        SequenceHash(0xca37f0ea43b0cef2)
    );
}

#[test]
fn same_block_after_different_prefixes_gets_different_keys() {
    let h = BlockHasher::new(HashAlgorithm::Xxh3, Salt::NONE);
    let a: Vec<u32> = (0..16).chain(100..116).collect();
    let b: Vec<u32> = (1..17).chain(100..116).collect();
    let ka = h.sequence_hashes(&a, 16).unwrap();
    let kb = h.sequence_hashes(&b, 16).unwrap();
    assert_ne!(ka[1], kb[1]);
    assert_eq!(h.block_hash(&a[16..]), h.block_hash(&b[16..]));
}

#[test]
fn tenants_never_share_keys() {
    for alg in [HashAlgorithm::Xxh3, HashAlgorithm::Sha256] {
        let a = keys(alg, Some("tenant-a"), None);
        let b = keys(alg, Some("tenant-b"), None);
        let none = keys(alg, None, None);
        let lora = keys(alg, None, Some("tenant-a"));
        for k in &a {
            assert!(!b.contains(k) && !none.contains(k) && !lora.contains(k));
        }
    }
}

#[test]
fn incremental_sequence_reports_each_block_once_without_rehash() {
    let h = BlockHasher::new(HashAlgorithm::Xxh3, Salt::NONE);
    let mut seq = TokenSequence::new(h, 16).unwrap();
    let mut reported: Vec<FullBlock> = Vec::new();
    // One token at a time, as in decode: exactly one report per 16 tokens.
    for t in 0..64u32 {
        let new = seq.extend(&[t]);
        assert_eq!(new.len(), usize::from((t + 1) % 16 == 0));
        reported.extend(new);
    }
    let idx: Vec<usize> = reported.iter().map(|b| b.index).collect();
    assert_eq!(idx, [0, 1, 2, 3]);
    let ks: Vec<u64> = reported.iter().map(|b| b.sequence_hash.0).collect();
    assert_eq!(ks, keys(HashAlgorithm::Xxh3, None, None));
    // An empty extend and a partial block report nothing.
    assert!(seq.extend(&[]).is_empty());
    assert!(seq.extend(&[1, 2, 3]).is_empty());
    assert_eq!(seq.num_full_blocks(), 4);
    assert_eq!(seq.total_tokens(), 67);
}

#[test]
fn algorithm_names_parse() {
    assert_eq!(
        "SHA256".parse::<HashAlgorithm>().unwrap(),
        HashAlgorithm::Sha256
    );
    assert_eq!(
        "xxh3".parse::<HashAlgorithm>().unwrap(),
        HashAlgorithm::Xxh3
    );
    assert!("md5".parse::<HashAlgorithm>().is_err());
    assert_eq!(HashAlgorithm::default(), HashAlgorithm::Xxh3);
}
