//! Fixed inputs -> fixed keys, so the key definition cannot drift.
//!
//! The expected values are cross-checked on every test run by an independent implementation of
//! the definition in `src/identity.rs` on Python's `xxhash` (xxh3-128) and `hashlib` (SHA-256)
//! (`tests/python/test_hash_vectors.py`, run by `scripts/test.sh`), which reads them out of this
//! file. Changing any of them breaks every stored key and every peer that shares keys with us: do
//! it only deliberately.

use kvbm_connector::identity::{BlockHash, FullBlock, TokenSequence};
use kvbm_connector::{BlockHasher, HashAlgorithm, Salt, SequenceHash};

fn keys(alg: HashAlgorithm, cache_salt: Option<&str>, lora: Option<&str>) -> Vec<u128> {
    let h = BlockHasher::new(alg, Salt::new(alg, cache_salt, lora));
    let tokens: Vec<u32> = (0..64).collect();
    h.sequence_hashes(&tokens, 16)
        .unwrap()
        .into_iter()
        .map(|k| k.0)
        .collect()
}

#[test]
fn sha256_vectors() {
    assert_eq!(
        keys(HashAlgorithm::Sha256, None, None),
        [
            0x574f832652fa2b7d9a713de3f650cd26,
            0xd81dc48eb68169e932fa21f0153f53dd,
            0x6f05ea5e91a4f6df0e839b85f7fcc87f,
            0xb021d5c0d42b9fab1627df40988eb49c
        ]
    );
    assert_eq!(
        Salt::new(HashAlgorithm::Sha256, Some("tenant-a"), None),
        Salt(0x910c09b6e19bd16a)
    );
    assert_eq!(
        keys(HashAlgorithm::Sha256, Some("tenant-a"), None),
        [
            0x80ebdc22494ae2708b74733ab13f0f13,
            0xf28713aa6615bd34f494d44b4ea1f3d1,
            0xbcab2639368fea79579907246fa16d5f,
            0xacea036e6b4c7ebf5917c8dca6ba8c6c
        ]
    );
    assert_eq!(
        Salt::new(HashAlgorithm::Sha256, Some("tenant-a"), Some("adapter-1")),
        Salt(0x0e30ad0375fe68aa)
    );
    assert_eq!(
        keys(HashAlgorithm::Sha256, Some("tenant-a"), Some("adapter-1")),
        [
            0xbfd44f3e0727b86cf242cea4e4cca37e,
            0x069b8c942d86bfa90a43331f1975a311,
            0xb4863485acc6344dbdcf62b38e1b4809,
            0xdb9dca764dcd70aedc05a6ef718a6fe9
        ]
    );
}

#[test]
fn xxh3_vectors() {
    assert_eq!(
        keys(HashAlgorithm::Xxh3, None, None),
        [
            0x3ff10ada66d8e18cf9d0a2aa4da337c5,
            0xcbca46ba26fc6ebae2d513d1f3cbcb46,
            0xece6bf3badf8c5f679227a22cbb396eb,
            0xec152a0252a78537943ea5a087131837
        ]
    );
    assert_eq!(
        Salt::new(HashAlgorithm::Xxh3, Some("tenant-a"), None),
        Salt(0x39de159c2adb3517)
    );
    assert_eq!(
        keys(HashAlgorithm::Xxh3, Some("tenant-a"), None),
        [
            0x7ee9926911114689cb3106932b633d0b,
            0x09c6065d89d6a2b084ad7bcc9d79f597,
            0x2e8bbbe3995bacfeb6976c7df05cdae9,
            0xf94a18b7f9d63c126f7bbc747f0d4331
        ]
    );
    assert_eq!(
        keys(HashAlgorithm::Xxh3, Some("tenant-a"), Some("adapter-1")),
        [
            0x45d29a9b79a8562c18432f281585558f,
            0x71a7ee98398f182bcb60ce569daa8bfd,
            0x938b35106f33536e49889765980d3234,
            0xecd2b0e05a927d006fda43f9015d5b4e
        ]
    );
}

#[test]
fn first_key_is_the_block_hash_and_chain_uses_parent() {
    let h = BlockHasher::new(HashAlgorithm::default(), Salt::NONE);
    let tokens: Vec<u32> = (0..32).collect();
    let b0 = h.block_hash(&tokens[..16]);
    let b1 = h.block_hash(&tokens[16..]);
    assert_eq!(b0, BlockHash(0x574f832652fa2b7d9a713de3f650cd26));
    let s0 = h.sequence_hash(None, b0);
    assert_eq!(s0, SequenceHash(b0.0));
    assert_eq!(
        h.sequence_hash(Some(s0), b1),
        SequenceHash(0xd81dc48eb68169e932fa21f0153f53dd)
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
    let ks: Vec<u128> = reported.iter().map(|b| b.sequence_hash.0).collect();
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
    assert_eq!(HashAlgorithm::default(), HashAlgorithm::Sha256);
}
