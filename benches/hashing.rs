//! Hashing throughput and prefix-match latency.
//!
//! * `hash/chained_sha256` — keys of a 128k-token prompt through `TokenSequence` with the default
//!   hash (SHA-256, 128-bit keys), as GB/s of token bytes. Its cost against the xxh3 opt-in is
//!   reported as a same-run ratio (rounds interleaved).
//! * `hash/chained_xxh3` — the same with the xxh3-128 opt-in. One xxh3 pass over the whole
//!   prompt is shown too, for scale: chaining small blocks can never reach it.
//! * For each algorithm a `RATIO` line against the bare hashing the key definition requires with
//!   that hash (one hash per block plus one per chain link, in a tight loop with no bookkeeping),
//!   rounds interleaved, with the cost per 128k-token prompt; target 0.9 for the default.
//! * `match/prefix_128k` — `BlockPool::match_prefix` of a 128k-token prompt (8192 blocks of 16)
//!   fully registered in a host pool; the limit is the 1 ms target.

mod common;

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvbm_connector::pool::BlockPool;
use kvbm_connector::{BlockHasher, HashAlgorithm, Salt, TierKind, TokenSequence};

const TOKENS: usize = 128 * 1024;
const BLOCK: usize = 16;

fn prompt() -> Vec<u32> {
    (0..TOKENS as u32)
        .map(|i| i.wrapping_mul(2654435761) % 128_000)
        .collect()
}

/// Keys of a prompt the way the leader computes them (`TokenSequence::append`).
fn keys(alg: HashAlgorithm, tokens: &[u32]) -> usize {
    let mut seq = TokenSequence::new(BlockHasher::new(alg, Salt::NONE), BLOCK).unwrap();
    seq.append(tokens)
}

fn bench_hash(c: &mut Criterion) {
    let tokens = prompt();
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let mut g = c.benchmark_group("hash");
    g.throughput(Throughput::Bytes(bytes.len() as u64));
    g.bench_function("one_pass_xxh3_limit", |b| {
        b.iter(|| xxhash_rust::xxh3::xxh3_128(black_box(&bytes)))
    });
    g.bench_function("chained_xxh3", |b| {
        b.iter(|| keys(HashAlgorithm::Xxh3, black_box(&tokens)))
    });
    g.bench_function("chained_sha256", |b| {
        b.iter(|| keys(HashAlgorithm::Sha256, black_box(&tokens)))
    });
    g.finish();

    let rounds = if common::quick() { 3 } else { 50 };
    // Each algorithm against the bare loop of the same hash: the default (SHA-256, target 0.9)
    // first, then the xxh3 opt-in.
    for (alg, name) in [
        (HashAlgorithm::Sha256, "sha256 (default)"),
        (HashAlgorithm::Xxh3, "xxh3 (opt-in)"),
    ] {
        let (limit, ours) = common::interleaved(
            rounds,
            || {
                black_box(bare_chain(alg, black_box(&bytes)));
            },
            || {
                black_box(keys(alg, black_box(&tokens)));
            },
        );
        common::report_bandwidth(
            &format!(
                "hash chained {name} (TokenSequence) vs bare per-block {alg} chain, \
                 {:.1} us vs {:.1} us per 128k-token prompt",
                ours.as_secs_f64() * 1e6,
                limit.as_secs_f64() * 1e6
            ),
            bytes.len() as u64,
            limit,
            ours,
            0.9,
        );
    }

    // The cost of the default: SHA-256 keys against the xxh3 opt-in, same prompt, same run.
    let (xxh3, sha256) = common::interleaved(
        rounds,
        || {
            black_box(keys(HashAlgorithm::Xxh3, black_box(&tokens)));
        },
        || {
            black_box(keys(HashAlgorithm::Sha256, black_box(&tokens)));
        },
    );
    let gbps = |d: Duration| bytes.len() as f64 / d.as_secs_f64().max(1e-12) / 1e9;
    println!(
        "RATIO hash chained sha256 (default) vs xxh3 (opt-in), 128k tokens: {:.2} GB/s vs {:.2} GB/s, \
         {:.1} us vs {:.1} us per 128k-token prompt, sha256 {:.1}x the time of xxh3",
        gbps(sha256),
        gbps(xxh3),
        sha256.as_secs_f64() * 1e6,
        xxh3.as_secs_f64() * 1e6,
        sha256.as_secs_f64() / xxh3.as_secs_f64().max(1e-12)
    );
}

/// One hash of the key definition, written out as plainly as the crates allow: SHA-256 over
/// `seed LE ‖ bytes` truncated to 16 bytes, or xxh3-128 seeded.
#[inline(always)]
fn bare_hash(alg: HashAlgorithm, seed: u64, bytes: &[u8]) -> u128 {
    match alg {
        HashAlgorithm::Xxh3 => xxhash_rust::xxh3::xxh3_128_with_seed(bytes, seed),
        HashAlgorithm::Sha256 => {
            use sha2::Digest;
            let mut h = sha2::Sha256::new();
            h.update(seed.to_le_bytes());
            h.update(bytes);
            let d = h.finalize();
            let mut first = [0u8; 16];
            first.copy_from_slice(&d[..16]);
            u128::from_le_bytes(first)
        }
    }
}

/// The least work the key definition needs: one hash of each block's bytes, one hash of each
/// chain link (parent key ‖ block hash), in a tight loop with no bookkeeping.
fn bare_chain(alg: HashAlgorithm, bytes: &[u8]) -> u128 {
    // The salt is a run-time value in real use; keep the compiler from specialising on 0.
    let seed = black_box(0u64);
    let mut prev: Option<u128> = None;
    // The block size is a run-time setting too: no specialising on it either.
    for block in bytes.chunks_exact(black_box(BLOCK) * 4) {
        let b = bare_hash(alg, seed, block);
        prev = Some(match prev {
            None => b,
            Some(p) => {
                let mut link = [0u8; 32];
                link[..16].copy_from_slice(&p.to_le_bytes());
                link[16..].copy_from_slice(&b.to_le_bytes());
                bare_hash(alg, seed, &link)
            }
        });
    }
    prev.unwrap_or(0)
}

fn bench_match(c: &mut Criterion) {
    let tokens = prompt();
    let hashes = BlockHasher::new(HashAlgorithm::default(), Salt::NONE)
        .sequence_hashes(&tokens, BLOCK)
        .unwrap();
    let n = hashes.len();
    let pool = BlockPool::new(TierKind::Host, n).unwrap();
    let blocks = pool.allocate(n).unwrap();
    // Register every block, then drop the handles: all 8192 blocks are inactive (the common case
    // of a match against finished requests' offloaded blocks).
    let registered: Vec<_> = blocks
        .into_iter()
        .zip(&hashes)
        .map(|(b, h)| pool.register(b, *h).unwrap())
        .collect();
    drop(registered);

    let mut g = c.benchmark_group("match");
    g.bench_function("prefix_128k", |b| {
        b.iter(|| {
            let held = pool.match_prefix(black_box(&hashes));
            assert_eq!(held.len(), n);
            held
        })
    });
    g.bench_function("prefix_len_128k", |b| {
        b.iter(|| pool.prefix_len(black_box(&hashes)))
    });
    g.finish();

    let rounds = if common::quick() { 3 } else { 200 };
    let mut samples = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = std::time::Instant::now();
        let held = pool.match_prefix(&hashes);
        drop(held);
        samples.push(t.elapsed());
    }
    let med = common::median(&mut samples);
    let target = Duration::from_millis(1);
    println!(
        "RATIO match+release 128k-token prefix: {:.1} us, target 1000 us, ratio {:.1}x under target {}",
        med.as_secs_f64() * 1e6,
        target.as_secs_f64() / med.as_secs_f64().max(1e-12),
        if med < target { "OK" } else { "ABOVE TARGET" }
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = bench_hash, bench_match
}
criterion_main!(benches);
