//! Matching a request across its KV-cache groups (see [`crate::connector::groups`]): the hit is
//! the longest one every group can serve, and the keys sliding-window groups computed, which say
//! where a later hit may end.
//!
//! Invariants: after [`Leader::match_groups`] every group of the request has the same hit staged
//! (or none), so the engine's one count loads every group; a sliding-window group's staging is the
//! window before that hit, never a prefix of a longer hit's.

use std::collections::{HashSet, VecDeque};

use crate::connector::adapter::SchedulerAdapter;
use crate::connector::groups::{AttentionKind, KvCacheGroups};
use crate::connector::RequestId;
use crate::error::{Error, ErrorKind, Result};
use crate::identity::SequenceHash;
use crate::pool::BuildSeqHasher;

use super::matching::Scope;
use super::{Leader, MatchResult, RequestInfo};

/// Keys the windowed-key table holds at most (about 10 MB).
pub(super) const SEEN_KEYS: usize = 1 << 18;

/// A bounded set of block keys, the oldest forgotten first.
#[derive(Debug)]
pub(super) struct SeenKeys {
    capacity: usize,
    set: HashSet<SequenceHash, BuildSeqHasher>,
    order: VecDeque<SequenceHash>,
}

impl SeenKeys {
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            set: HashSet::default(),
            order: VecDeque::new(),
        }
    }

    pub(super) fn insert(&mut self, h: SequenceHash) {
        if !self.set.insert(h) {
            return;
        }
        self.order.push_back(h);
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
    }

    /// The length of the longest prefix of `hashes` computed before: keys are chained, so the
    /// last key seen ends it. `None`: none seen.
    pub(super) fn longest_prefix(&self, hashes: &[SequenceHash]) -> Option<usize> {
        hashes
            .iter()
            .rposition(|h| self.set.contains(h))
            .map(|i| i + 1)
    }
}

impl<A: SchedulerAdapter> Leader<A> {
    /// Refuses to change the model's KV-cache groups from `current` to `new` once a request is
    /// tracked (its keys and windows were built with the old ones); `what` names the engine's
    /// setting for the error. The same groups again are accepted at any time.
    pub fn check_groups_change(
        &self,
        current: &KvCacheGroups,
        new: &KvCacheGroups,
        what: &str,
    ) -> Result<()> {
        if new != current && self.num_slots() > 0 {
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!("the {what} are set before the first request"),
            )
            .with("requests_tracked", self.num_slots()));
        }
        Ok(())
    }

    /// How many tokens beyond `num_computed_tokens` every KV-cache group of `request` can load
    /// (as [`Leader::get_num_new_matched_tokens_from`] for one group): each group is matched
    /// under its own id and salt ([`KvCacheGroups::request_id`], [`KvCacheGroups::salt`]);
    /// full-attention groups first, whose smallest hit caps the sliding-window groups', which
    /// are matched again at a lower cap until every group serves the same hit. The full groups'
    /// stagings are trimmed to it. Counted once in the lookup metrics. `host_tokens`,
    /// `disk_tokens` and `remote_tokens` split the hit's tokens (they add up to it, as for one
    /// group) in the proportion the groups load from each tier: a sliding group loads only its
    /// window, and several groups load the same token once each.
    ///
    /// One full-attention group is the plain match. Errors: a request id that contains
    /// [`GROUP_SEP`](crate::connector::groups::GROUP_SEP); a sliding-window group on an engine
    /// without [`Engine::PLACEHOLDER_BLOCK`](crate::connector::Engine::PLACEHOLDER_BLOCK)
    /// (unsupported); and those of the plain match.
    pub fn match_groups(
        &mut self,
        groups: &KvCacheGroups,
        request: RequestInfo<'_>,
        first_token: usize,
        num_computed_tokens: usize,
    ) -> Result<MatchResult> {
        self.match_groups_capped(groups, request, first_token, num_computed_tokens, None)
    }

    /// [`Leader::match_groups`] with the hit at most `cap` tokens beyond `num_computed_tokens`
    /// (`None`: no cap): an engine whose layer groups live in pools served by leaders of their
    /// own matches every pool, then each again at the smallest pool's hit, so all load the same
    /// count (a sliding-window group needs the window before that hit, not the first blocks of
    /// a longer one). The request matched again replaces its staging.
    pub fn match_groups_capped(
        &mut self,
        groups: &KvCacheGroups,
        request: RequestInfo<'_>,
        first_token: usize,
        num_computed_tokens: usize,
        cap: Option<usize>,
    ) -> Result<MatchResult> {
        if groups.is_plain() {
            let scope = Scope {
                cap_tokens: cap,
                ..Scope::FULL
            };
            return self.match_scoped(request, first_token, num_computed_tokens, scope);
        }
        let real = request.id.as_str();
        groups.check_request_id(real)?;
        self.check_windows_supported(groups)?;
        let ids: Vec<_> = (0..groups.len())
            .map(|g| KvCacheGroups::request_id(real, g))
            .collect();
        let salts: Vec<Option<String>> = (0..groups.len())
            .map(|g| KvCacheGroups::salt(request.cache_salt, g))
            .collect();
        let infos: Vec<RequestInfo<'_>> = (0..groups.len())
            .map(|g| RequestInfo {
                id: &ids[g],
                tokens: request.tokens,
                cache_salt: salts[g].as_deref().or(request.cache_salt),
                lora_name: request.lora_name,
            })
            .collect();
        self.count_lookups = false;
        let agreed = self.agree_on_hit(groups, &infos, first_token, num_computed_tokens, cap);
        self.count_lookups = true;
        let (mut hit, pending) = agreed?;
        if pending || hit == usize::MAX {
            hit = 0;
        }
        let mut out = self.trim_groups_to(&ids, hit)?;
        let total = request.tokens.len() + first_token;
        self.metrics
            .record_lookup(total as u64, out.external_tokens as u64);
        out.pending = pending;
        self.last_match = out;
        Ok(out)
    }

    /// Refuses a sliding-window group on an engine without a placeholder block: nothing is
    /// loaded before a window, so the engine must mark those blocks.
    fn check_windows_supported(&self, groups: &KvCacheGroups) -> Result<()> {
        if self.placeholder.is_some() {
            return Ok(());
        }
        match groups
            .kinds()
            .iter()
            .position(|k| *k != AttentionKind::Full)
        {
            Some(g) => Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "KV-cache group {g} is {}: a sliding-window group needs an engine that keeps a placeholder block before the window, and this one declares none",
                    groups.kinds()[g]
                ),
            )
            .with("group", g)),
            None => Ok(()),
        }
    }

    /// Matches each group (`infos[g]`, its id and salt): the full-attention groups first, whose
    /// smallest hit caps the sliding-window groups', then the windowed groups again at the
    /// lowest hit until they agree. Returns the hit in tokens (`usize::MAX`: no group set one)
    /// and whether a remote lookup is pending (then matching stopped). The first error stops it.
    fn agree_on_hit(
        &mut self,
        groups: &KvCacheGroups,
        infos: &[RequestInfo<'_>],
        first_token: usize,
        num_computed_tokens: usize,
        cap: Option<usize>,
    ) -> Result<(usize, bool)> {
        let bs = self.page_size;
        let mut pending = false;
        let mut hit = cap.unwrap_or(usize::MAX);
        let full = Scope {
            cap_tokens: cap,
            ..Scope::FULL
        };
        for (g, kind) in groups.kinds().iter().enumerate() {
            if *kind != AttentionKind::Full {
                continue;
            }
            let m = self.match_scoped(infos[g], first_token, num_computed_tokens, full)?;
            pending |= m.pending;
            hit = hit.min(m.external_tokens);
        }
        // The windowed groups: each hit at most the others', until all agree.
        while !pending {
            let cap = (hit != usize::MAX).then_some(hit);
            let mut lowest = hit;
            let mut agree = true;
            for (g, kind) in groups.kinds().iter().enumerate() {
                let Some(w) = kind.window_blocks(bs) else {
                    continue;
                };
                let AttentionKind::SlidingWindow { tokens } = *kind else {
                    continue;
                };
                let scope = Scope {
                    window: Some(w),
                    window_tokens: Some(tokens),
                    cap_tokens: cap,
                };
                let m = self.match_scoped(infos[g], first_token, num_computed_tokens, scope)?;
                pending |= m.pending;
                agree &= lowest == usize::MAX || m.external_tokens == lowest;
                lowest = lowest.min(m.external_tokens);
            }
            hit = lowest;
            if agree || pending {
                break;
            }
        }
        Ok((hit, pending))
    }

    /// Every group's staging (request ids `ids`) trimmed to `hit` tokens (all were matched to
    /// it or beyond), so all serve it (a group that serves less than the others, which none
    /// does, would set the hit for all), and the groups' answers as one: the hit, and its
    /// tokens split across host, disk and the remote store in the proportion the groups load
    /// from each ([`split_tokens`]). Not `pending`, not counted.
    fn trim_groups_to(&mut self, ids: &[RequestId], hit: usize) -> Result<MatchResult> {
        let mut got: Vec<MatchResult> = Vec::with_capacity(ids.len());
        for id in ids {
            got.push(self.trim_staged(id, hit)?);
        }
        let least = got.iter().map(|m| m.external_tokens).min().unwrap_or(0);
        if got.iter().any(|m| m.external_tokens != least) {
            got.clear();
            for id in ids {
                got.push(self.trim_staged(id, least)?);
            }
        }
        let mut out = MatchResult::NONE;
        let mut loads = [0usize; 3];
        for m in &got {
            out.external_tokens = m.external_tokens;
            out.load_async |= m.load_async;
            loads[0] += m.host_tokens;
            loads[1] += m.disk_tokens;
            loads[2] += m.remote_tokens;
        }
        [out.host_tokens, out.disk_tokens, out.remote_tokens] =
            split_tokens(out.external_tokens, loads);
        Ok(out)
    }
}

/// Splits `hit` tokens across (host, disk, remote) in proportion to `loads`, what the groups
/// load from each tier, so that they add up to `hit` exactly (the rounding remainder goes to the
/// tier that loads the most). One group's split, which already adds up to its hit, is returned
/// as it is.
fn split_tokens(hit: usize, loads: [usize; 3]) -> [usize; 3] {
    let total: u128 = loads.iter().map(|&x| x as u128).sum();
    if hit == 0 || total == 0 {
        return [0; 3];
    }
    let mut out = [0usize; 3];
    for (o, &l) in out.iter_mut().zip(&loads) {
        // At most `hit`: l <= total.
        *o = usize::try_from(hit as u128 * l as u128 / total).unwrap_or(hit);
    }
    let rest = hit.saturating_sub(out.iter().sum());
    if let Some(most) = (0..3).max_by_key(|&i| loads[i]) {
        out[most] += rest;
    }
    out
}

#[cfg(test)]
mod split_tests {
    use super::split_tokens;

    #[test]
    fn a_hits_tokens_are_split_by_what_the_groups_load() {
        // One group: its own split.
        assert_eq!(split_tokens(96, [64, 32, 0]), [64, 32, 0]);
        // A full group (96 from host) and a sliding one (its 32-token window from disk).
        assert_eq!(split_tokens(96, [96, 32, 0]), [72, 24, 0]);
        // Rounding: the remainder to the largest share; always adds up.
        let s = split_tokens(100, [1, 1, 1]);
        assert_eq!(s.iter().sum::<usize>(), 100);
        assert_eq!(split_tokens(0, [5, 0, 0]), [0, 0, 0]);
        assert_eq!(split_tokens(16, [0, 0, 0]), [0, 0, 0]);
    }
}
