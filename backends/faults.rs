//! Fault injection: a [`StorageTier`] wrapper that fails, stalls or corrupts reads and writes on a
//! schedule, and a [`TierFactory`] that wraps the host and disk tiers another factory builds.
//!
//! For tests and the replay tool (`KVBM_REPLAY_FAULTS`): it shows what the connector promises
//! under storage faults — a failed store is never matched, a stalled load becomes a load error at
//! its deadline, a corrupt read is never served, and the run finishes.
//!
//! A [`FaultPlan`] is a list of [`FaultRule`]s: which tier ([`TierKind::Host`] or
//! [`TierKind::Disk`]), which side ([`FaultOp::Read`] or [`FaultOp::Write`]), what happens
//! ([`FaultAction`]) and when ([`FaultWhen`]: every call, given blocks, a window of calls, every
//! n-th call, or with a probability drawn from a seeded generator). The first rule that matches a
//! call decides it. Its text form (see [`FaultPlan::parse`]):
//!
//! ```text
//! seed=7; disk.write:fail:p=0.25; disk.read:stall=2000:every=3; host.read:corrupt:block=4,5
//! ```
//!
//! What each action does:
//! * `fail`: the call returns an [`ErrorKind::Io`] error and the inner tier is not touched;
//! * `stall=MS`: the call sleeps MS milliseconds, then runs (a frozen or swapping disk);
//! * `corrupt` (reads only): the bytes are read, then scribbled, and the call returns
//!   [`ErrorKind::Corrupt`] — what a checksumming tier answers for a damaged block: the destination
//!   holds garbage and must not be used.
//!
//! Invariants: a wrapper with no matching rule behaves exactly as its inner tier (same kind,
//! layout and capability, no batch hook of its own, so every byte goes through the faulted calls);
//! a fault never panics; every injected fault is counted ([`FaultyTier::injected`]).

use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::config::Config;
use crate::connector::transport::TierCounts;
use crate::connector::worker::{TierFactory, WorkerTiers};
use crate::error::{Error, ErrorKind, Result};
use crate::layout::Layout;
use crate::tier::{Capability, StorageTier, TierKind};

/// The environment variable the replay tool reads its fault plan from (test hook).
pub const FAULTS_ENV: &str = "KVBM_REPLAY_FAULTS";

/// Longest stall a plan may ask for (ten minutes): a typo must not hang a test run for days.
pub const MAX_STALL: Duration = Duration::from_secs(600);

/// Which side of a tier a rule applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultOp {
    /// `read_block` and `with_block` (loads from the tier, copies out of it).
    Read,
    /// `write_block` and `with_block_mut` (stores into the tier).
    Write,
}

/// What an injected fault does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FaultAction {
    /// The call fails with an I/O error; the inner tier is not touched.
    Fail,
    /// The call sleeps this long, then runs.
    Stall(Duration),
    /// The bytes read are scribbled and the call fails as corrupt (reads only).
    Corrupt,
}

/// When a rule fires.
#[derive(Debug, Clone, PartialEq)]
pub enum FaultWhen {
    /// Every call.
    Always,
    /// Calls on these blocks.
    Blocks(Vec<usize>),
    /// Calls number `from` to `from + count - 1` on this side (counted from 0).
    Calls {
        /// First call faulted.
        from: u64,
        /// How many.
        count: u64,
    },
    /// Every n-th call on this side (the n-th, 2n-th, ...).
    Every(u64),
    /// Each call with this probability, from the plan's seeded generator.
    Probability(f64),
}

/// One rule of a [`FaultPlan`].
#[derive(Debug, Clone, PartialEq)]
pub struct FaultRule {
    /// The tier it applies to.
    pub tier: TierKind,
    /// Reads or writes.
    pub op: FaultOp,
    /// What happens.
    pub action: FaultAction,
    /// When.
    pub when: FaultWhen,
}

/// A schedule of faults; see the [module docs](self).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FaultPlan {
    /// Rules, first match wins.
    pub rules: Vec<FaultRule>,
    /// Seed of the generator behind [`FaultWhen::Probability`].
    pub seed: u64,
}

fn bad(spec: &str, why: impl std::fmt::Display) -> Error {
    Error::invalid_config(FAULTS_ENV, spec, why)
}

impl FaultPlan {
    /// Parses the text form: items separated by `;`, each `seed=N` or
    /// `TIER.OP:ACTION[:WHEN]` with TIER `host` or `disk`, OP `read` or `write`, ACTION `fail`,
    /// `stall=MS` or `corrupt` (reads only), WHEN `all` (the default), `block=N[,N...]`,
    /// `calls=FROM+COUNT`, `every=N` or `p=F` (0 to 1). Errors are
    /// [`ErrorKind::InvalidConfig`] naming [`FAULTS_ENV`] and the item.
    pub fn parse(spec: &str) -> Result<Self> {
        let mut plan = FaultPlan::default();
        for item in spec.split(';').map(str::trim).filter(|s| !s.is_empty()) {
            if let Some(seed) = item.strip_prefix("seed=") {
                plan.seed = seed
                    .trim()
                    .parse()
                    .map_err(|e| bad(item, format!("bad seed: {e}")))?;
                continue;
            }
            let mut parts = item.split(':').map(str::trim);
            let target = parts.next().unwrap_or_default();
            let (tier, op) = target
                .split_once('.')
                .ok_or_else(|| bad(item, "expected TIER.OP (e.g. disk.read)"))?;
            let tier = match tier {
                "host" => TierKind::Host,
                "disk" => TierKind::Disk,
                other => return Err(bad(item, format!("tier {other:?}: expected host or disk"))),
            };
            let op = match op {
                "read" => FaultOp::Read,
                "write" => FaultOp::Write,
                other => return Err(bad(item, format!("side {other:?}: expected read or write"))),
            };
            let action = match parts.next().unwrap_or_default() {
                "fail" => FaultAction::Fail,
                "corrupt" if op == FaultOp::Read => FaultAction::Corrupt,
                "corrupt" => return Err(bad(item, "corrupt applies to reads only")),
                a => match a.strip_prefix("stall=") {
                    Some(ms) => {
                        let ms: u64 = ms
                            .parse()
                            .map_err(|e| bad(item, format!("bad stall milliseconds: {e}")))?;
                        let d = Duration::from_millis(ms);
                        if d > MAX_STALL {
                            return Err(bad(item, "a stall is at most 600000 ms"));
                        }
                        FaultAction::Stall(d)
                    }
                    None => {
                        return Err(bad(
                            item,
                            format!("action {a:?}: expected fail, stall=MS or corrupt"),
                        ))
                    }
                },
            };
            let when = match parts.next() {
                None | Some("all") => FaultWhen::Always,
                Some(w) => parse_when(item, w)?,
            };
            if parts.next().is_some() {
                return Err(bad(item, "expected TIER.OP:ACTION[:WHEN]"));
            }
            plan.rules.push(FaultRule {
                tier,
                op,
                action,
                when,
            });
        }
        Ok(plan)
    }

    /// The rules for one tier.
    fn for_tier(&self, tier: TierKind) -> Vec<FaultRule> {
        self.rules
            .iter()
            .filter(|r| r.tier == tier)
            .cloned()
            .collect()
    }
}

fn parse_when(item: &str, w: &str) -> Result<FaultWhen> {
    let num = |s: &str| -> Result<u64> {
        s.trim()
            .parse()
            .map_err(|e| bad(item, format!("bad number {s:?}: {e}")))
    };
    if let Some(list) = w.strip_prefix("block=") {
        let blocks = list
            .split(',')
            .map(|b| num(b).map(|n| n as usize))
            .collect::<Result<Vec<_>>>()?;
        return Ok(FaultWhen::Blocks(blocks));
    }
    if let Some(range) = w.strip_prefix("calls=") {
        let (from, count) = range
            .split_once('+')
            .ok_or_else(|| bad(item, "expected calls=FROM+COUNT"))?;
        return Ok(FaultWhen::Calls {
            from: num(from)?,
            count: num(count)?,
        });
    }
    if let Some(n) = w.strip_prefix("every=") {
        let n = num(n)?;
        if n == 0 {
            return Err(bad(item, "every=N needs N >= 1"));
        }
        return Ok(FaultWhen::Every(n));
    }
    if let Some(p) = w.strip_prefix("p=") {
        let p: f64 = p
            .trim()
            .parse()
            .map_err(|e| bad(item, format!("bad probability: {e}")))?;
        if !(0.0..=1.0).contains(&p) {
            return Err(bad(item, "a probability is between 0 and 1"));
        }
        return Ok(FaultWhen::Probability(p));
    }
    Err(bad(
        item,
        format!("when {w:?}: expected all, block=N, calls=FROM+COUNT, every=N or p=F"),
    ))
}

/// Faults injected so far by one [`FaultyTier`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Calls failed.
    pub failed: u64,
    /// Calls stalled.
    pub stalled: u64,
    /// Reads corrupted.
    pub corrupted: u64,
}

/// A tier that injects the faults of its rules into every call to `inner`; see the
/// [module docs](self).
#[derive(Debug)]
pub struct FaultyTier {
    inner: Arc<dyn StorageTier>,
    rules: Vec<FaultRule>,
    /// Calls so far per side: `[reads, writes]`.
    calls: [AtomicU64; 2],
    rng: Mutex<u64>,
    failed: AtomicU64,
    stalled: AtomicU64,
    corrupted: AtomicU64,
}

impl FaultyTier {
    /// Wraps `inner` with the rules of `plan` for `inner`'s kind (the others are ignored).
    pub fn new(inner: Arc<dyn StorageTier>, plan: &FaultPlan) -> Self {
        let kind = inner.kind();
        Self {
            rules: plan.for_tier(kind),
            inner,
            calls: [AtomicU64::new(0), AtomicU64::new(0)],
            rng: Mutex::new(plan.seed ^ (kind as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)),
            failed: AtomicU64::new(0),
            stalled: AtomicU64::new(0),
            corrupted: AtomicU64::new(0),
        }
    }

    /// The faults injected so far.
    pub fn injected(&self) -> FaultCounts {
        FaultCounts {
            failed: self.failed.load(Ordering::Relaxed),
            stalled: self.stalled.load(Ordering::Relaxed),
            corrupted: self.corrupted.load(Ordering::Relaxed),
        }
    }

    /// splitmix64: a uniform draw in [0, 1).
    fn draw(&self) -> f64 {
        let mut s = self.rng.lock();
        *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Counts the call and picks its fault, if any; a stall sleeps here and lets the call run.
    fn decide(&self, op: FaultOp, block: usize) -> Option<FaultAction> {
        let side = match op {
            FaultOp::Read => 0,
            FaultOp::Write => 1,
        };
        let n = self.calls[side].fetch_add(1, Ordering::Relaxed);
        let rule = self
            .rules
            .iter()
            .filter(|r| r.op == op)
            .find(|r| match &r.when {
                FaultWhen::Always => true,
                FaultWhen::Blocks(b) => b.contains(&block),
                FaultWhen::Calls { from, count } => n >= *from && n - from < *count,
                FaultWhen::Every(k) => (n + 1) % k == 0,
                FaultWhen::Probability(p) => self.draw() < *p,
            })?;
        match rule.action {
            FaultAction::Stall(d) => {
                self.stalled.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(d);
                None
            }
            a => Some(a),
        }
    }

    fn injected_failure(&self, op: &'static str, block: usize) -> Error {
        self.failed.fetch_add(1, Ordering::Relaxed);
        Error::new(ErrorKind::Io, format!("injected {op} failure"))
            .with("tier", self.inner.kind())
            .with("block", block)
    }

    fn injected_corruption(&self, block: usize) -> Error {
        self.corrupted.fetch_add(1, Ordering::Relaxed);
        Error::corrupt("injected corruption: checksum mismatch")
            .with("tier", self.inner.kind())
            .with("block", block)
    }
}

/// Flips every byte: what a damaged block reads back as.
fn scribble(segments: &mut [IoSliceMut<'_>]) {
    for s in segments.iter_mut() {
        for b in s.iter_mut() {
            *b = !*b;
        }
    }
}

impl StorageTier for FaultyTier {
    fn kind(&self) -> TierKind {
        self.inner.kind()
    }

    fn capability(&self) -> Capability {
        self.inner.capability()
    }

    fn layout(&self) -> &Layout {
        self.inner.layout()
    }

    fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> Result<()> {
        match self.decide(FaultOp::Read, block) {
            Some(FaultAction::Fail) => Err(self.injected_failure("read", block)),
            Some(FaultAction::Corrupt) => {
                self.inner.read_block(block, dst)?;
                scribble(dst);
                Err(self.injected_corruption(block))
            }
            _ => self.inner.read_block(block, dst),
        }
    }

    fn write_block(&self, block: usize, src: &[IoSlice<'_>]) -> Result<()> {
        match self.decide(FaultOp::Write, block) {
            Some(FaultAction::Fail) => Err(self.injected_failure("write", block)),
            _ => self.inner.write_block(block, src),
        }
    }

    fn with_block(
        &self,
        block: usize,
        f: &mut dyn FnMut(&[IoSlice<'_>]) -> Result<()>,
    ) -> Result<()> {
        match self.decide(FaultOp::Read, block) {
            Some(FaultAction::Fail) => Err(self.injected_failure("read", block)),
            Some(FaultAction::Corrupt) => {
                self.inner.with_block(block, &mut |segs| {
                    let mut copy: Vec<u8> = segs.iter().flat_map(|s| s.iter().copied()).collect();
                    scribble(&mut [IoSliceMut::new(&mut copy)]);
                    // The caller sees the garbage, then the error: it must not use it.
                    let _ = f(&[IoSlice::new(&copy)]);
                    Ok(())
                })?;
                Err(self.injected_corruption(block))
            }
            _ => self.inner.with_block(block, f),
        }
    }

    fn with_block_mut(
        &self,
        block: usize,
        f: &mut dyn FnMut(&mut [IoSliceMut<'_>]) -> Result<()>,
    ) -> Result<()> {
        match self.decide(FaultOp::Write, block) {
            Some(FaultAction::Fail) => Err(self.injected_failure("write", block)),
            _ => self.inner.with_block_mut(block, f),
        }
    }
}

/// A [`TierFactory`] that has `inner` build a worker's tiers, then wraps its host and disk tiers
/// in [`FaultyTier`]s following `plan` (a tier no rule names is left as built).
#[derive(Debug, Clone)]
pub struct FaultyTiers {
    inner: Arc<dyn TierFactory>,
    plan: FaultPlan,
    built: Arc<Mutex<Vec<Arc<FaultyTier>>>>,
}

impl FaultyTiers {
    /// Wraps the tiers `inner` builds with `plan`'s faults.
    pub fn new(inner: Arc<dyn TierFactory>, plan: FaultPlan) -> Self {
        Self {
            inner,
            plan,
            built: Arc::new(Mutex::new(Vec::new())),
        }
    }

    /// The faulty tiers built so far (to read what they injected).
    pub fn tiers(&self) -> Vec<Arc<FaultyTier>> {
        self.built.lock().clone()
    }

    /// Faults injected so far by every tier built, added up.
    pub fn injected(&self) -> FaultCounts {
        self.built
            .lock()
            .iter()
            .map(|t| t.injected())
            .fold(FaultCounts::default(), |a, b| FaultCounts {
                failed: a.failed + b.failed,
                stalled: a.stalled + b.stalled,
                corrupted: a.corrupted + b.corrupted,
            })
    }

    fn wrap(&self, tier: Option<Arc<dyn StorageTier>>) -> Option<Arc<dyn StorageTier>> {
        let tier = tier?;
        if !self.plan.rules.iter().any(|r| r.tier == tier.kind()) {
            return Some(tier);
        }
        let faulty = Arc::new(FaultyTier::new(tier, &self.plan));
        self.built.lock().push(faulty.clone());
        Some(faulty)
    }
}

impl TierFactory for FaultyTiers {
    fn build(
        &self,
        config: &Config,
        rank: usize,
        device: Arc<dyn StorageTier>,
        counts: TierCounts,
    ) -> Result<WorkerTiers> {
        let mut tiers = self.inner.build(config, rank, device, counts)?;
        tiers.host = self.wrap(tiers.host.take());
        tiers.disk = self.wrap(tiers.disk.take());
        Ok(tiers)
    }

    fn remote_store(
        &self,
        config: &Config,
        scope: &crate::connector::remote::RemoteScope,
    ) -> Result<Option<Arc<dyn crate::connector::remote::RemoteStore>>> {
        self.inner.remote_store(config, scope)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::memory::MemoryTier;
    use crate::layout::LayoutDims;
    use crate::tier::StorageTierExt;

    fn host() -> Arc<dyn StorageTier> {
        let dims = LayoutDims {
            num_layers: 1,
            outer_dim: 2,
            page_size: 2,
            inner_dim: 4,
            dtype_bytes: 1,
        };
        Arc::new(MemoryTier::host(Layout::fully_contiguous(dims, 8).unwrap()).unwrap())
    }

    #[test]
    fn parses_the_text_form() {
        let p = FaultPlan::parse(
            "seed=7; disk.write:fail:p=0.25; disk.read:stall=20:every=3; host.read:corrupt:block=4,5; host.write:fail:calls=2+3; disk.read:fail",
        )
        .unwrap();
        assert_eq!(p.seed, 7);
        assert_eq!(p.rules.len(), 5);
        assert_eq!(
            p.rules[1].action,
            FaultAction::Stall(Duration::from_millis(20))
        );
        assert_eq!(p.rules[2].when, FaultWhen::Blocks(vec![4, 5]));
        assert_eq!(p.rules[3].when, FaultWhen::Calls { from: 2, count: 3 });
        assert_eq!(p.rules[4].when, FaultWhen::Always);
        for bad in [
            "gpu.read:fail",
            "disk.peek:fail",
            "disk.write:corrupt",
            "disk.read:explode",
            "disk.read:fail:p=2",
            "disk.read:fail:every=0",
            "disk.read:stall=999999999",
            "disk.read:fail:all:extra",
            "seed=x",
        ] {
            let e = FaultPlan::parse(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{bad}");
            assert!(e.to_string().contains(FAULTS_ENV), "{e}");
        }
    }

    #[test]
    fn faults_follow_the_schedule() {
        let plan =
            FaultPlan::parse("host.write:fail:calls=1+2; host.read:corrupt:block=3").unwrap();
        let t = FaultyTier::new(host(), &plan);
        let img = vec![7u8; t.bytes_per_block()];
        assert!(t.write_block_from_slice(0, &img).is_ok());
        assert_eq!(
            t.write_block_from_slice(1, &img).unwrap_err().kind(),
            ErrorKind::Io
        );
        assert!(t.write_block_from_slice(2, &img).is_err());
        assert!(t.write_block_from_slice(3, &img).is_ok());
        assert_eq!(t.read_block_to_vec(0).unwrap(), img);
        assert_eq!(
            t.read_block_to_vec(3).unwrap_err().kind(),
            ErrorKind::Corrupt
        );
        let e = t.with_block(3, &mut |_| Ok(())).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt);
        assert_eq!(
            t.injected(),
            FaultCounts {
                failed: 2,
                stalled: 0,
                corrupted: 2
            }
        );
    }

    #[test]
    fn probability_is_seeded() {
        let run = |seed: u64| {
            let plan = FaultPlan {
                seed,
                ..FaultPlan::parse("host.write:fail:p=0.5").unwrap()
            };
            let t = FaultyTier::new(host(), &plan);
            let img = vec![1u8; t.bytes_per_block()];
            (0..64)
                .map(|i| t.write_block_from_slice(i % 8, &img).is_ok())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(3), run(3));
        let ok = run(3).iter().filter(|o| **o).count();
        assert!((10..54).contains(&ok), "{ok}");
    }
}
