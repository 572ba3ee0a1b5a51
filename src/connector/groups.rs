//! KV-cache groups: models whose layers do not all attend the same way (every layer
//! sliding-window, or sliding-window and full layers alternating) keep one block list per group of
//! layers, each with its own blocks.
//!
//! The leader serves group `g >= 1` of request `R` as a request of its own,
//! `R` + [`GROUP_SEP`] + `g`, whose keys are salted with the group (two groups never share a
//! block); group 0 keeps the request's own id and keys, so a one-group model is unchanged (its
//! hash vectors, persisted and remote blocks included).
//!
//! A hit is a token count every group can serve ([`Leader::match_groups`]): a full-attention group
//! needs every block before it, a sliding-window group of `W` tokens only the blocks that overlap
//! the window before it (`ceil((W - 1) / block_size)` blocks: the next token attends to the
//! `W - 1` before it), and the engine keeps its placeholder block where a window keeps none.
//!
//! What a sliding-window group stores is what a later hit can use: the window before the end of
//! its prompt and every block after it (a later turn of the conversation starts its hit at the
//! end of this one), and the window before each point where an earlier request's prefix ended
//! (a shared system prompt): the leader keeps a bounded table of the keys windowed groups have
//! computed, so a request that shares such a prefix but finds no window there marks that point,
//! and its own computation stores the window before it for the requests after it.
//!
//! [`Leader::match_groups`]: crate::connector::leader::Leader::match_groups

use std::fmt;
use std::str::FromStr;

use crate::connector::RequestId;
use crate::error::{Error, Result};

/// Separates a request id from its KV-cache group in the ids the leader and workers use.
pub const GROUP_SEP: char = '\u{1f}';

/// Most KV-cache groups a model may have here.
pub const MAX_KV_CACHE_GROUPS: usize = 64;

/// How the layers of one KV-cache group attend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// Every token attends to every token before it: every block before a hit is needed.
    Full,
    /// Each token attends to the `tokens - 1` tokens before it (and itself).
    SlidingWindow {
        /// The window in tokens (at least 1).
        tokens: usize,
    },
}

impl AttentionKind {
    /// The blocks before a block-aligned hit a group of this kind needs: `None` for every block
    /// (full attention), else the window's `ceil((W - 1) / block_size)` (at least one).
    pub fn window_blocks(self, block_size: usize) -> Option<usize> {
        match self {
            AttentionKind::Full => None,
            AttentionKind::SlidingWindow { tokens } => {
                Some(tokens.saturating_sub(1).div_ceil(block_size.max(1)).max(1))
            }
        }
    }
}

impl fmt::Display for AttentionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttentionKind::Full => f.write_str("full"),
            AttentionKind::SlidingWindow { tokens } => write!(f, "sliding:{tokens}"),
        }
    }
}

impl FromStr for AttentionKind {
    type Err = Error;

    /// `full`, or `sliding:W` with `W` a whole number of tokens, at least 1.
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim();
        if t == "full" {
            return Ok(AttentionKind::Full);
        }
        let bad = || {
            Error::invalid_argument(format!(
                "attention kind {:?}: expected `full` or `sliding:W` (W tokens, at least 1)",
                head(t)
            ))
            .with("attention", t)
        };
        let w = t.strip_prefix("sliding:").ok_or_else(bad)?;
        match w.parse::<usize>() {
            Ok(tokens) if tokens >= 1 => Ok(AttentionKind::SlidingWindow { tokens }),
            _ => Err(bad()),
        }
    }
}

/// The KV-cache groups of a model, in the engine's group order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCacheGroups {
    kinds: Vec<AttentionKind>,
}

impl Default for KvCacheGroups {
    fn default() -> Self {
        Self {
            kinds: vec![AttentionKind::Full],
        }
    }
}

impl KvCacheGroups {
    /// Groups of these kinds. Errors: no group, more than [`MAX_KV_CACHE_GROUPS`], or a window of
    /// 0 tokens (named by group).
    pub fn new(kinds: Vec<AttentionKind>) -> Result<Self> {
        let n = kinds.len();
        if n == 0 || n > MAX_KV_CACHE_GROUPS {
            return Err(Error::invalid_argument(format!(
                "{n} KV-cache groups: between 1 and {MAX_KV_CACHE_GROUPS} are supported"
            ))
            .with("kv_cache_groups", n));
        }
        if let Some(g) = kinds
            .iter()
            .position(|k| matches!(k, AttentionKind::SlidingWindow { tokens: 0 }))
        {
            return Err(Error::invalid_argument(format!(
                "KV-cache group {g} has a sliding window of 0 tokens: a window is at least 1"
            ))
            .with("group", g));
        }
        Ok(Self { kinds })
    }

    /// Groups from each one's sliding window in tokens (`None`: full attention), as an engine
    /// binding receives them. Errors: a window below 1 (named by group), and those of
    /// [`KvCacheGroups::new`].
    pub fn from_windows(windows: &[Option<i64>]) -> Result<Self> {
        let mut kinds = Vec::with_capacity(windows.len());
        for (g, w) in windows.iter().enumerate() {
            kinds.push(match *w {
                None => AttentionKind::Full,
                Some(t) if t >= 1 => AttentionKind::SlidingWindow {
                    tokens: usize::try_from(t).unwrap_or(usize::MAX),
                },
                Some(t) => {
                    return Err(Error::invalid_argument(format!(
                    "KV-cache group {g} has a sliding window of {t} tokens: a window is at least 1"
                ))
                    .with("group", g))
                }
            });
        }
        Self::new(kinds)
    }

    /// `n` full-attention groups.
    pub fn full(n: usize) -> Result<Self> {
        Self::new(vec![AttentionKind::Full; n])
    }

    /// How many groups.
    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    /// Never: a model has at least one group.
    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    /// The groups' kinds, in order.
    pub fn kinds(&self) -> &[AttentionKind] {
        &self.kinds
    }

    /// One full-attention group: a request is served under its own id and keys, as always.
    pub fn is_plain(&self) -> bool {
        self.kinds == [AttentionKind::Full]
    }

    /// The id the leader and workers use for group `g` of request `real`.
    pub fn request_id(real: &str, g: usize) -> RequestId {
        if g == 0 {
            RequestId::from(real)
        } else {
            RequestId::from(format!("{real}{GROUP_SEP}{g}").as_str())
        }
    }

    /// The request id of a leader or worker id, and its group.
    pub fn real_of(id: &str) -> (&str, usize) {
        match id.rsplit_once(GROUP_SEP) {
            Some((real, g)) => match g.parse() {
                Ok(g) => (real, g),
                Err(_) => (id, 0),
            },
            None => (id, 0),
        }
    }

    /// Group `g`'s cache salt: `None` for group 0 (the request's own), the group added to the
    /// request's salt for the others.
    pub fn salt(salt: Option<&str>, g: usize) -> Option<String> {
        (g > 0).then(|| format!("{}{GROUP_SEP}kv-cache-group-{g}", salt.unwrap_or("")))
    }

    /// Refuses a request id that contains [`GROUP_SEP`] where it would name a group (with
    /// several groups).
    pub fn check_request_id(&self, id: &str) -> Result<()> {
        if self.len() > 1 && id.contains(GROUP_SEP) {
            return Err(Error::invalid_argument(format!(
                "request id {:?} contains U+001F, which names KV-cache groups here",
                head(id)
            ))
            .with("request", id));
        }
        Ok(())
    }
}

/// The requests of `done` (leader or worker ids of any group) whose every one of `n` groups is
/// done: `busy` is false for each group's id. Each request once, by its own id, sorted.
pub fn whole_requests(
    done: Vec<RequestId>,
    n: usize,
    busy: impl Fn(&RequestId) -> bool,
) -> Vec<RequestId> {
    let mut out: Vec<RequestId> = Vec::new();
    for id in done {
        let (real, _) = KvCacheGroups::real_of(id.as_str());
        let whole = (0..n).all(|g| !busy(&KvCacheGroups::request_id(real, g)));
        if whole && !out.iter().any(|r| r.as_str() == real) {
            out.push(RequestId::from(real));
        }
    }
    out.sort();
    out
}

/// At most the first 64 characters of `s` (an error message quotes no more of an input).
fn head(s: &str) -> String {
    s.chars().take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_blocks_are_the_blocks_the_next_token_attends_to() {
        let w = |t| AttentionKind::SlidingWindow { tokens: t }.window_blocks(32);
        // vLLM's sliding_window_contiguous_blocks: cdiv(W - 1, block_size).
        assert_eq!(w(256), Some(8));
        assert_eq!(w(257), Some(8));
        assert_eq!(w(258), Some(9));
        assert_eq!(w(33), Some(1));
        assert_eq!(w(1), Some(1));
        assert_eq!(AttentionKind::Full.window_blocks(32), None);
    }

    #[test]
    fn kinds_parse_and_bad_ones_are_named() {
        assert_eq!(
            "full".parse::<AttentionKind>().unwrap(),
            AttentionKind::Full
        );
        assert_eq!(
            "sliding:256".parse::<AttentionKind>().unwrap(),
            AttentionKind::SlidingWindow { tokens: 256 }
        );
        for bad in ["sliding:0", "sliding:-1", "sliding:", "mamba", "chunked:64"] {
            let e = bad.parse::<AttentionKind>().unwrap_err();
            assert!(e.to_string().contains(bad), "{e}");
        }
        let e = KvCacheGroups::new(vec![
            AttentionKind::Full,
            AttentionKind::SlidingWindow { tokens: 0 },
        ])
        .unwrap_err();
        assert!(e.to_string().contains("group 1"), "{e}");
        assert!(KvCacheGroups::new(vec![]).is_err());
        assert!(KvCacheGroups::full(MAX_KV_CACHE_GROUPS + 1).is_err());
    }

    #[test]
    fn group_ids_round_trip_and_group_zero_is_the_request() {
        assert_eq!(KvCacheGroups::request_id("r", 0).as_str(), "r");
        let id = KvCacheGroups::request_id("r", 3);
        assert_eq!(KvCacheGroups::real_of(id.as_str()), ("r", 3));
        assert_eq!(KvCacheGroups::real_of("plain"), ("plain", 0));
        assert_eq!(KvCacheGroups::salt(Some("t"), 0), None);
        assert_ne!(
            KvCacheGroups::salt(Some("t"), 1),
            KvCacheGroups::salt(Some("t"), 2)
        );
    }
}
