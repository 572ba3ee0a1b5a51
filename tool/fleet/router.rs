//! The fleet's routers: which instance serves a request.
//!
//! * `round-robin` — request `i` (in trace order) to instance `i mod N`;
//! * `prefix` — the instance holding the longest prefix of the request's full blocks, as the
//!   router knows it; ties to the least-loaded (fewest requests so far), then the lowest index;
//!   no instance takes more than 1.25× its share of the requests routed so far (with `i`
//!   requests routed, an instance may hold at most `ceil(1.25 (i + 1) / N)` of them after this
//!   one; the least-loaded always may, so a request always has somewhere to go).
//!
//! What an instance holds, as the prefix router knows it: the block keys of the requests it sent
//! there, the most recently sent first kept, up to the instance's local capacity (host + disk
//! blocks) — an approximate index, as a router without the instances' cache events keeps one.

use std::collections::{BTreeMap, HashMap};

use kvbm_connector::error::{Error, Result};

/// A router's name, as `--router` takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RouterKind {
    /// Request `i` to instance `i mod N`.
    RoundRobin,
    /// Longest known prefix, ties to the least-loaded, at most 1.25× a share.
    Prefix,
}

impl RouterKind {
    /// The names `--router` takes.
    pub const NAMES: [&'static str; 2] = ["round-robin", "prefix"];

    /// Its `--router` name.
    pub fn name(self) -> &'static str {
        match self {
            RouterKind::RoundRobin => "round-robin",
            RouterKind::Prefix => "prefix",
        }
    }

    /// The router `--router` names (case-insensitive).
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "round-robin" | "roundrobin" | "rr" => Ok(RouterKind::RoundRobin),
            "prefix" => Ok(RouterKind::Prefix),
            _ => Err(Error::invalid_argument(format!(
                "--router {s:?}: unknown router (known: {})",
                Self::NAMES.join(", ")
            ))
            .with("flag", "--router")),
        }
    }
}

/// The block keys an instance is believed to hold: at most `capacity`, least recently routed
/// dropped first.
#[derive(Debug, Default)]
struct Index {
    used: HashMap<u128, u64>,
    order: BTreeMap<u64, u128>,
    clock: u64,
}

impl Index {
    fn insert(&mut self, key: u128, capacity: usize) {
        self.clock += 1;
        if let Some(old) = self.used.insert(key, self.clock) {
            self.order.remove(&old);
        }
        self.order.insert(self.clock, key);
        while self.used.len() > capacity {
            let Some((_, k)) = self.order.pop_first() else {
                break;
            };
            self.used.remove(&k);
        }
    }

    /// How many of `keys`, from the first, it holds.
    fn prefix(&self, keys: &[u128]) -> usize {
        keys.iter()
            .take_while(|k| self.used.contains_key(k))
            .count()
    }
}

/// Routes requests over `N` instances.
#[derive(Debug)]
pub struct Router {
    kind: RouterKind,
    /// Requests routed to each instance.
    load: Vec<usize>,
    /// Per instance (prefix router): the keys it is believed to hold.
    index: Vec<Index>,
    /// Keys per instance's index.
    capacity: usize,
}

impl Router {
    /// A router of `kind` over `instances` instances, each believed to hold up to `capacity`
    /// blocks (the prefix router's index).
    pub fn new(kind: RouterKind, instances: usize, capacity: usize) -> Self {
        Self {
            kind,
            load: vec![0; instances],
            index: (0..instances).map(|_| Index::default()).collect(),
            capacity: capacity.max(1),
        }
    }

    /// The requests routed to each instance so far.
    pub fn load(&self) -> &[usize] {
        &self.load
    }

    /// The most requests an instance may hold once `routed + 1` requests are routed:
    /// `ceil(1.25 (routed + 1) / N)`.
    pub fn cap(&self, routed: usize) -> usize {
        let n = self.load.len().max(1);
        (5 * (routed + 1)).div_ceil(4 * n)
    }

    /// The instance for a request whose full blocks have `keys` (of which the first `matchable`
    /// may be matched: a fully matched prompt computes its last block again), and records it
    /// there.
    pub fn route(&mut self, keys: &[u128], matchable: usize) -> usize {
        let n = self.load.len();
        let routed: usize = self.load.iter().sum();
        let k = match self.kind {
            RouterKind::RoundRobin => routed % n.max(1),
            RouterKind::Prefix => {
                let cap = self.cap(routed);
                let probe = &keys[..matchable.min(keys.len())];
                // (longest prefix, fewest requests, lowest index) among those under the cap.
                (0..n)
                    .filter(|&i| self.load[i] < cap)
                    .max_by(|&a, &b| {
                        let pa = self.index[a].prefix(probe);
                        let pb = self.index[b].prefix(probe);
                        pa.cmp(&pb)
                            .then(self.load[b].cmp(&self.load[a]))
                            .then(b.cmp(&a))
                    })
                    .unwrap_or(0)
            }
        };
        if let Some(l) = self.load.get_mut(k) {
            *l += 1;
        }
        if self.kind == RouterKind::Prefix {
            if let Some(ix) = self.index.get_mut(k) {
                for &key in keys {
                    ix.insert(key, self.capacity);
                }
            }
        }
        k
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_deals_in_turn() {
        let mut r = Router::new(RouterKind::RoundRobin, 3, 10);
        let got: Vec<usize> = (0..7).map(|_| r.route(&[1, 2], 2)).collect();
        assert_eq!(got, [0, 1, 2, 0, 1, 2, 0]);
        assert_eq!(r.load(), [3, 2, 2]);
    }

    #[test]
    fn prefix_follows_the_longest_prefix_and_ties_go_to_the_least_loaded() {
        let mut r = Router::new(RouterKind::Prefix, 2, 100);
        // Nothing known: instance 0 (least-loaded, lowest index), then 1 for a new prefix.
        assert_eq!(r.route(&[10, 11], 2), 0);
        assert_eq!(r.route(&[20, 21], 2), 1);
        // A request sharing 10, 11 goes where they are.
        assert_eq!(r.route(&[10, 11, 12], 3), 0);
        // Shares 20 (one block) with instance 1, nothing with 0.
        assert_eq!(r.route(&[20, 99], 2), 1);
        // The matchable bound: a key past it does not count.
        assert_eq!(r.route(&[30], 0), 0);
    }

    #[test]
    fn prefix_never_takes_more_than_a_share_and_a_quarter() {
        // One conversation growing by a block per request: the instance that served the last
        // request holds the longest prefix, so without the cap it would take every request.
        let n: usize = 4;
        let mut r = Router::new(RouterKind::Prefix, n, 1000);
        let chain: Vec<u128> = (0..402).collect();
        for i in 0..400_usize {
            r.route(&chain[..i + 2], i + 2);
            let routed = i + 1;
            let bound = (5 * routed).div_ceil(4 * n);
            assert!(
                r.load().iter().all(|&l| l <= bound),
                "{:?} at {routed}",
                r.load()
            );
        }
        // ... and it does stick to the holder up to the cap: the busiest is at it.
        assert_eq!(r.load().iter().max(), Some(&125), "{:?}", r.load());
    }

    #[test]
    fn the_index_forgets_beyond_the_capacity() {
        let mut ix = Index::default();
        ix.insert(1, 2);
        ix.insert(2, 2);
        assert_eq!(ix.prefix(&[1, 2]), 2);
        // A third key drops the least recently routed (1).
        ix.insert(3, 2);
        assert_eq!(ix.prefix(&[1, 2]), 0);
        assert_eq!(ix.prefix(&[2, 3]), 2);
        // Routing 2 again makes 3 the oldest.
        ix.insert(2, 2);
        ix.insert(4, 2);
        assert_eq!(ix.prefix(&[2, 4]), 2);
        assert_eq!(ix.prefix(&[3]), 0);
    }

    #[test]
    fn routers_parse_by_name() {
        assert_eq!(RouterKind::parse("Prefix").ok(), Some(RouterKind::Prefix));
        assert_eq!(
            RouterKind::parse("round-robin").ok(),
            Some(RouterKind::RoundRobin)
        );
        let e = RouterKind::parse("random").err().map(|e| e.to_string());
        assert!(e.is_some_and(|m| m.contains("--router") && m.contains("round-robin, prefix")));
    }
}
