//! What a replay, a sweep point or a fleet run will hold in memory, estimated before anything
//! starts, and the memory this machine can give it (`--memory-limit`).
//!
//! A replay's memory follows its flags, not its trace: each tier's bookkeeping is allocated (and
//! touched) when the tier is built, one entry per block whatever the trace holds; the device
//! cache's and the host tier's bytes become resident as blocks are written; requests cost
//! [`WAITING_TOKEN_BYTES`] per token while they are in the engine, and the waiting ones are
//! bounded by `--max-waiting-tokens`. A configuration whose estimate is over the limit is refused
//! before any tier is built, naming the flag that costs most, instead of being killed by the
//! machine halfway.
//!
//! The per-block figures are the connector's bookkeeping as measured (peak RSS of `kvbm replay`
//! with 2,000,000 blocks less the same run with 16, rounded up for the hash map's power-of-two
//! growth): they are documented in docs/deployment.md ("Memory of kvbm replay and kvbm sweep").

use kvbm_connector::error::{Error, Result};
use kvbm_connector::pool::EvictionPolicy;

pub use crate::replay::options::WAITING_TOKEN_BYTES;

/// Bookkeeping bytes per block of a host or disk tier under `policy` (slot, key map, and the
/// policy's own: 2Q's ghost of evicted keys, the prefix policy's ghost and miniature pools).
/// Measured: 125 (LRU), 142 (2Q), 259 (prefix).
pub fn tier_block_bytes(policy: EvictionPolicy) -> u64 {
    match policy {
        EvictionPolicy::Lru => 144,
        EvictionPolicy::TwoQ => 160,
        EvictionPolicy::Prefix => 288,
    }
}

/// Bookkeeping bytes a disk tier's block costs on top of [`tier_block_bytes`] (its index
/// entry). Measured: 16.
pub const DISK_BLOCK_EXTRA_BYTES: u64 = 24;

/// Bookkeeping bytes per device block of the simulated engine (its block pool and prefix
/// cache). Measured: 16.
pub const DEVICE_BLOCK_BYTES: u64 = 24;

/// One part of an estimate: the flag that sizes it, what it is, its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// The flag that sizes it (named by a refusal).
    pub flag: &'static str,
    /// What it is, for the message.
    pub what: String,
    /// Bytes.
    pub bytes: u64,
}

/// What one run holds at most, part by part.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Estimate {
    /// The parts (their bytes summed, saturating).
    pub parts: Vec<Part>,
}

impl Estimate {
    /// Adds a part.
    pub fn add(&mut self, flag: &'static str, what: impl Into<String>, bytes: u64) {
        self.parts.push(Part {
            flag,
            what: what.into(),
            bytes,
        });
    }

    /// All parts, saturating.
    pub fn total(&self) -> u64 {
        self.parts
            .iter()
            .fold(0u64, |t, p| t.saturating_add(p.bytes))
    }

    /// Every part multiplied by `n` (`n` instances, each holding the same).
    pub fn times(&self, n: u64, flag: &'static str) -> Estimate {
        let mut out = Estimate::default();
        for p in &self.parts {
            out.add(
                if n > 1 { flag } else { p.flag },
                format!("{n} × {}", p.what),
                p.bytes.saturating_mul(n),
            );
        }
        out
    }

    /// Refuses an estimate over `limit` (`--memory-limit`, else [`available`]; no check when
    /// neither is known): an invalid-argument error naming the flag of the largest part, with
    /// every part in the message. `what` names the run (`kvbm replay`, `3 sweep runs at once`).
    pub fn check(&self, what: &str, limit: Option<u64>) -> Result<()> {
        let (limit, whose) = match limit {
            Some(l) => (l, "--memory-limit allows"),
            None => match available() {
                Some(a) => (
                    a,
                    "this machine has available (--memory-limit to set another)",
                ),
                None => return Ok(()),
            },
        };
        let total = self.total();
        if total <= limit {
            return Ok(());
        }
        // The first of the largest parts (a saturated estimate may have several).
        let flag = self
            .parts
            .iter()
            .fold(None::<&Part>, |best, p| match best {
                Some(b) if b.bytes >= p.bytes => Some(b),
                _ => Some(p),
            })
            .map_or("--memory-limit", |p| p.flag);
        let parts: Vec<String> = self
            .parts
            .iter()
            .filter(|p| p.bytes > 0)
            .map(|p| format!("{} {} MiB", p.what, mib(p.bytes)))
            .collect();
        Err(Error::invalid_argument(format!(
            "{what} would hold about {} MiB ({}), more than the {} MiB {whose}: lower {flag}",
            mib(total),
            parts.join(", "),
            mib(limit)
        ))
        .with("flag", flag)
        .with("estimate_bytes", total)
        .with("limit_bytes", limit))
    }
}

/// Bytes in MiB, rounded up.
fn mib(b: u64) -> u64 {
    b.div_ceil(1 << 20)
}

/// What one engine (a replay, or one instance of a fleet) holds at most: its tiers'
/// bookkeeping (`host_blocks`, `disk_blocks` under `policy`), the host tier's bytes (at most
/// `host_bytes_blocks` blocks of `bytes_per_block`: the tier's blocks, or fewer where the
/// workload has fewer distinct blocks), the device cache (its bytes and bookkeeping, and the
/// tokens of the requests running on it: `running_tokens_per_block` per block), and the tokens
/// of the requests waiting (`request_tokens`).
pub struct EngineSize {
    /// Host tier blocks.
    pub host_blocks: u64,
    /// ... of which can hold bytes (at most `host_blocks`).
    pub host_bytes_blocks: u64,
    /// Disk tier blocks (its bytes are on disk).
    pub disk_blocks: u64,
    /// Eviction policy of both tiers.
    pub policy: EvictionPolicy,
    /// Device blocks.
    pub device_blocks: u64,
    /// Bytes of one block (all ranks).
    pub bytes_per_block: u64,
    /// Tokens the running requests hold per device block (the block size; 0 where requests
    /// are counted elsewhere).
    pub running_tokens_per_block: u64,
    /// Tokens of the requests waiting at once, at most.
    pub request_tokens: u64,
}

impl EngineSize {
    /// The estimate, part by part.
    pub fn estimate(&self) -> Estimate {
        let mut e = Estimate::default();
        let tier = tier_block_bytes(self.policy);
        e.add(
            "--host-blocks",
            format!(
                "host tier bookkeeping ({} blocks × {tier} B)",
                self.host_blocks
            ),
            self.host_blocks.saturating_mul(tier),
        );
        let stored = self.host_bytes_blocks.min(self.host_blocks);
        e.add(
            "--host-blocks",
            format!(
                "host tier bytes ({stored} blocks × {} B)",
                self.bytes_per_block
            ),
            stored.saturating_mul(self.bytes_per_block),
        );
        let disk = tier + DISK_BLOCK_EXTRA_BYTES;
        e.add(
            "--disk-blocks",
            format!(
                "disk tier bookkeeping ({} blocks × {disk} B)",
                self.disk_blocks
            ),
            self.disk_blocks.saturating_mul(disk),
        );
        let device = self
            .bytes_per_block
            .saturating_add(DEVICE_BLOCK_BYTES)
            .saturating_add(
                self.running_tokens_per_block
                    .saturating_mul(WAITING_TOKEN_BYTES as u64),
            );
        e.add(
            "--device-blocks",
            format!(
                "device cache and its requests' tokens ({} blocks × {device} B)",
                self.device_blocks
            ),
            self.device_blocks.saturating_mul(device),
        );
        e.add(
            "--max-waiting-tokens",
            format!(
                "waiting requests' tokens ({} tokens × {WAITING_TOKEN_BYTES} B)",
                self.request_tokens
            ),
            self.request_tokens
                .saturating_mul(WAITING_TOKEN_BYTES as u64),
        );
        e
    }
}

/// The memory this process may still take: the smaller of `MemAvailable` (/proc/meminfo) and
/// what its cgroup's `memory.max` leaves above `memory.current` (cgroup v2; a container's
/// limit, past which the kernel kills the process). `None` where neither can be read.
pub fn available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| {
        let line = t.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        kb.checked_mul(1024)
    });
    let read = |f: &str| {
        std::fs::read_to_string(format!("/sys/fs/cgroup/{f}"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
    };
    let cgroup =
        read("memory.max").map(|max| max.saturating_sub(read("memory.current").unwrap_or(0)));
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `--memory-limit`: bytes, or with a `K`, `M`, `G` or `T` suffix (powers of 1024, an optional
/// `iB` or `B` after it: `16G`, `512MiB`).
pub fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let body = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, shift) = match body.char_indices().last() {
        Some((i, 'k' | 'K')) => (&body[..i], 10),
        Some((i, 'm' | 'M')) => (&body[..i], 20),
        Some((i, 'g' | 'G')) => (&body[..i], 30),
        Some((i, 't' | 'T')) => (&body[..i], 40),
        _ => (body, 0),
    };
    let x: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a byte count (e.g. 16G, 512M, 1073741824)"))?;
    let v = x * (1u64 << shift) as f64;
    if !(v.is_finite() && (1.0..=1.8e19).contains(&v)) {
        return Err(format!("{s:?}: a byte count is between 1 and 16 EiB"));
    }
    Ok(v as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(host_blocks: u64, policy: EvictionPolicy) -> EngineSize {
        EngineSize {
            host_blocks,
            host_bytes_blocks: 0,
            disk_blocks: 0,
            policy,
            device_blocks: 320,
            bytes_per_block: 65536,
            running_tokens_per_block: 16,
            request_tokens: 1 << 24,
        }
    }

    #[test]
    fn byte_counts_take_powers_of_1024() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("16G"), Ok(16 << 30));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5K"), Ok(1536));
        assert_eq!(parse_bytes("2TB"), Ok(2 << 40));
        for bad in ["", "G", "-1G", "0", "1e30", "NaN", "3X"] {
            assert!(parse_bytes(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_host_tier_bookkeeping_follows_its_blocks_and_policy() {
        // The sweep: 4M tokens of 16-token blocks per instance.
        let e = engine(250_000, EvictionPolicy::Prefix).estimate();
        assert_eq!(e.parts[0].bytes, 250_000 * 288);
        let lru = engine(250_000, EvictionPolicy::Lru).estimate();
        assert!(lru.total() < e.total());
        // Host bytes count only the blocks that can hold bytes.
        let mut s = engine(250_000, EvictionPolicy::Lru);
        s.host_bytes_blocks = 100;
        assert_eq!(s.estimate().parts[1].bytes, 100 * 65536);
    }

    #[test]
    fn an_estimate_over_the_limit_is_refused_naming_its_largest_flag() {
        // 64 instances of 10M tokens (625,000 blocks of 16 tokens) each: about 11 GiB of
        // bookkeeping alone.
        let one = engine(625_000, EvictionPolicy::Prefix).estimate();
        let fleet = one.times(64, "--instances");
        assert!(fleet.total() > 10 << 30, "{}", fleet.total());
        let err = fleet
            .check("a fleet of 64", Some(8 << 30))
            .expect_err("over the limit");
        let text = err.to_string();
        assert!(
            text.contains("--instances") && text.contains("8192 MiB"),
            "{text}"
        );
        assert_eq!(err.context_value("flag"), Some("--instances"));
        // One instance fits in the same limit; the same estimate under a larger one passes.
        assert!(one.check("one", Some(8 << 30)).is_ok());
        assert!(fleet.check("a fleet of 64", Some(64 << 30)).is_ok());
        // Saturating, never an overflow.
        let huge = engine(u64::MAX, EvictionPolicy::Prefix).estimate();
        assert_eq!(huge.total(), u64::MAX);
        assert!(huge.check("x", Some(1 << 40)).is_err());
    }

    #[test]
    fn a_single_engine_names_the_flag_that_costs_most() {
        let mut s = engine(16, EvictionPolicy::Lru);
        s.device_blocks = 1 << 40;
        let err = s
            .estimate()
            .check("kvbm replay", Some(1 << 30))
            .expect_err("over");
        assert!(err.to_string().contains("lower --device-blocks"), "{err}");
        // Saturated parts: the first of them is named.
        s.device_blocks = u64::MAX;
        s.request_tokens = u64::MAX;
        let err = s
            .estimate()
            .check("kvbm replay", Some(1 << 30))
            .expect_err("over");
        assert!(err.to_string().contains("lower --device-blocks"), "{err}");
    }
}
