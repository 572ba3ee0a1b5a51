//! Capacity study of the eviction policies on a Mooncake-format trace, driving
//! [`BlockPool`] directly (no engine, no transfers, no token hashing): the fast harness behind
//! the policy choice in docs/benchmarks.md ("Eviction policies").
//!
//! ```text
//! cargo run --release --example eviction_sim -- [TRACE] [--blocks N,N,...] [--disk N]
//!     [--policies lru,2q,prefix]
//! ```
//!
//! `TRACE` defaults to `../shared/data/mooncake/conversation_trace.jsonl`; `--blocks` to the
//! issue's 1M / 3M / 10M tokens (1953, 5859, 19531 blocks of 512 tokens); `--disk N` adds a
//! disk pool of N blocks behind the host pool (same policy). The accounting is the trace README's
//! and the connector's: requests one at a time; a prompt's full 512-token blocks are keyed by
//! the chain of its `hash_ids`; the longest cached prefix is matched (host first, disk
//! continuing), never the block holding the prompt's last token (a fully matched prompt gives
//! its last block back); the matched handles are dropped in prefix order; then every full block
//! the host does not hold is allocated and registered (and dropped) in order, as the leader's
//! offload does, and the disk gets a copy of every block it lacks. Hit rate = matched / prompt
//! tokens. The trace is streamed: memory is the pools' bookkeeping, not the trace.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::process::ExitCode;
use std::time::Instant;

use kvbm_connector::pool::{match_across, BlockPool, EvictionPolicy, MutableBlock};
use kvbm_connector::{SequenceHash, TierKind};
use serde::Deserialize;

const BLOCK: u64 = 512;
const DEFAULT_TRACE: &str = "../shared/data/mooncake/conversation_trace.jsonl";

#[derive(Deserialize)]
struct Line {
    input_length: u64,
    hash_ids: Vec<u64>,
}

struct Outcome {
    prompt: u64,
    host_hits: u64,
    disk_hits: u64,
    requests: u64,
}

fn key(parent: SequenceHash, id: u64) -> SequenceHash {
    let mut bytes = [0u8; 24];
    bytes[..16].copy_from_slice(&parent.0.to_le_bytes());
    bytes[16..].copy_from_slice(&id.to_le_bytes());
    SequenceHash(xxhash_rust::xxh3::xxh3_128(&bytes))
}

/// Stores every key of `keys` that `pool` lacks: all allocated first, then registered in order.
fn store(pool: &BlockPool, keys: &[SequenceHash]) -> Result<(), String> {
    let mut staged: Vec<(MutableBlock, SequenceHash)> = Vec::new();
    for &k in keys {
        if pool.contains(k) {
            continue;
        }
        match pool.allocate(1) {
            Ok(mut v) => {
                if let Some(b) = v.pop() {
                    staged.push((b, k));
                }
            }
            Err(_) => break, // every block in use: the rest is not stored (as the leader)
        }
    }
    for (b, k) in staged {
        drop(pool.register(b, k).map_err(|e| e.to_string())?);
    }
    Ok(())
}

fn run(
    trace: &str,
    host_blocks: usize,
    disk_blocks: usize,
    policy: EvictionPolicy,
) -> Result<Outcome, String> {
    let host =
        BlockPool::with_policy(TierKind::Host, host_blocks, policy).map_err(|e| e.to_string())?;
    let disk = match disk_blocks {
        0 => None,
        n => Some(BlockPool::with_policy(TierKind::Disk, n, policy).map_err(|e| e.to_string())?),
    };
    let file = File::open(trace).map_err(|e| format!("{trace}: {e}"))?;
    let mut out = Outcome {
        prompt: 0,
        host_hits: 0,
        disk_hits: 0,
        requests: 0,
    };
    let mut keys: Vec<SequenceHash> = Vec::new();
    for (no, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| format!("{trace}: {e}"))?;
        if line.trim().is_empty() {
            continue;
        }
        let r: Line =
            serde_json::from_str(&line).map_err(|e| format!("{trace} line {}: {e}", no + 1))?;
        let n = r.input_length;
        let full = ((n / BLOCK) as usize).min(r.hash_ids.len());
        let limit = ((n.saturating_sub(1) / BLOCK) as usize).min(full);
        keys.clear();
        let mut parent = SequenceHash(0);
        for &id in &r.hash_ids[..full] {
            parent = key(parent, id);
            keys.push(parent);
        }
        let mut pools = vec![&host];
        pools.extend(disk.as_ref());
        let m = match_across(&pools, &keys[..limit]);
        out.host_hits += m.blocks_from(TierKind::Host) as u64 * BLOCK;
        out.disk_hits += m.blocks_from(TierKind::Disk) as u64 * BLOCK;
        out.prompt += n;
        out.requests += 1;
        // Handles dropped in prefix order, host before disk (as the leader's load completion).
        drop(m);
        store(&host, &keys)?;
        if let Some(d) = &disk {
            store(d, &keys)?;
        }
    }
    Ok(out)
}

fn main() -> ExitCode {
    let mut trace = DEFAULT_TRACE.to_string();
    let mut blocks = vec![1953usize, 5859, 19531];
    let mut disk = 0usize;
    let mut policies = vec![
        EvictionPolicy::Lru,
        EvictionPolicy::TwoQ,
        EvictionPolicy::Prefix,
    ];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let parsed = match a.as_str() {
            "--blocks" => args.next().map(|v| {
                v.split(',')
                    .map(|x| {
                        x.trim()
                            .parse::<usize>()
                            .map_err(|e| format!("--blocks {x}: {e}"))
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map(|v| blocks = v)
            }),
            "--disk" => args.next().map(|v| {
                v.parse::<usize>()
                    .map(|v| disk = v)
                    .map_err(|e| format!("--disk {v}: {e}"))
            }),
            "--policies" => args.next().map(|v| {
                v.split(',')
                    .map(|x| {
                        x.trim()
                            .parse::<EvictionPolicy>()
                            .map_err(|_| format!("--policies: {x} is not one of lru, 2q, prefix"))
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map(|v| policies = v)
            }),
            _ if !a.starts_with("--") => {
                trace = a.clone();
                Some(Ok(()))
            }
            _ => Some(Err(format!("unknown flag {a}"))),
        };
        match parsed {
            Some(Ok(())) => {}
            Some(Err(e)) => {
                eprintln!("eviction_sim: {e}");
                return ExitCode::FAILURE;
            }
            None => {
                eprintln!("eviction_sim: {a} needs a value");
                return ExitCode::FAILURE;
            }
        }
    }
    println!("trace: {trace}; disk blocks: {disk}");
    println!(
        "{:>8} {:>12} {:>8} {:>9} {:>9} {:>9} {:>7}",
        "blocks", "tokens", "policy", "hit %", "host %", "disk %", "secs"
    );
    for &b in &blocks {
        for &p in &policies {
            let t0 = Instant::now();
            match run(&trace, b, disk, p) {
                Ok(o) => {
                    let pct = |x: u64| 100.0 * x as f64 / o.prompt.max(1) as f64;
                    println!(
                        "{:>8} {:>12} {:>8} {:>9.2} {:>9.2} {:>9.2} {:>7.1}",
                        b,
                        b as u64 * BLOCK,
                        p.to_string(),
                        pct(o.host_hits + o.disk_hits),
                        pct(o.host_hits),
                        pct(o.disk_hits),
                        t0.elapsed().as_secs_f64()
                    );
                    if o.requests == 0 {
                        eprintln!("eviction_sim: no requests in {trace}");
                        return ExitCode::FAILURE;
                    }
                }
                Err(e) => {
                    eprintln!("eviction_sim: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    ExitCode::SUCCESS
}
