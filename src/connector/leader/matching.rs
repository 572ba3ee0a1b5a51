//! Matching: how many tokens of a request the host, disk and remote tiers can supply beyond the
//! device's own prefix, and, once the engine allocated device blocks, the loads that bring them in.
//!
//! Invariants: matched blocks are held (staged) from the match until the allocation maps them or
//! drops them, so they cannot be evicted in between; the block holding a request's last token is
//! never matched (the engine must compute at least one token); nothing is matched while a rank is
//! lost; remote blocks continue a match where host and disk stopped (looked up in the store,
//! see `remote`); a pending remote lookup stages nothing.

use crate::connector::adapter::SchedulerAdapter;
use crate::connector::lifecycle::{Lifecycle, RequestState};
use crate::connector::metadata::{BlockTransfer, KeyedLoad, Load, Operation, RemoteLoad};
use crate::connector::RequestId;
use crate::error::{Error, ErrorKind, Result};
use crate::identity::{BlockHasher, Salt, SequenceHash, TokenSequence};
use crate::pool::{match_across, BlockPool, ImmutableBlock, TieredMatch};
use crate::tier::TierKind;

use super::completion::Holds;
use super::remote::RemoteAnswer;
use super::{first_bad_block, unknown_request, Leader, MatchResult, RequestInfo, Slot};

/// Matched blocks held for a request until the engine allocates device blocks for them.
#[derive(Debug)]
pub(super) struct Staged {
    /// Index of the first matched block in the request.
    start: usize,
    /// Matched blocks after `start` that a sliding window does not need (the engine keeps its
    /// placeholder there): matched, never loaded. The loaded blocks follow them.
    skip: usize,
    host: Vec<ImmutableBlock>,
    disk: Vec<ImmutableBlock>,
    /// Keys of the remote blocks after the disk ones (in the store when looked up).
    remote: Vec<SequenceHash>,
}

impl Staged {
    /// Blocks to load.
    fn blocks(&self) -> usize {
        self.host.len() + self.disk.len() + self.remote.len()
    }

    /// Blocks matched: those skipped before a window and those to load.
    fn tokens_blocks(&self) -> usize {
        self.skip + self.blocks()
    }

    /// The match as the engine is told it: the matched tokens by the tier that serves them (the
    /// blocks skipped before a window count with the tier its first block is loaded from).
    fn result(&self, bs: usize) -> MatchResult {
        let (mut host, mut disk, mut remote) =
            (self.host.len(), self.disk.len(), self.remote.len());
        if host > 0 {
            host += self.skip;
        } else if disk > 0 {
            disk += self.skip;
        } else {
            remote += self.skip;
        }
        MatchResult {
            external_tokens: self.tokens_blocks() * bs,
            load_async: true,
            host_tokens: host * bs,
            disk_tokens: disk * bs,
            remote_tokens: remote * bs,
            pending: false,
        }
    }

    /// Refuses an allocation that cannot take these blocks: the engine asking to load another
    /// number of tokens than were matched (`num_external_tokens`), fewer device blocks than the
    /// load reaches, a real device block before a sliding window (nothing is loaded there: the
    /// engine would read it as computed), or only placeholder blocks. Nothing changes.
    fn check_allocation(
        &self,
        id: &RequestId,
        block_ids: &[usize],
        num_external_tokens: usize,
        bs: usize,
        placeholder: Option<usize>,
    ) -> Result<()> {
        if num_external_tokens != self.tokens_blocks() * bs {
            return Err(Error::invalid_argument(format!(
                "request {id}: the engine asks to load {num_external_tokens} tokens but {} were matched",
                self.tokens_blocks() * bs
            ))
            .with("request", id));
        }
        let needed = self.start + self.tokens_blocks();
        if block_ids.len() < needed {
            return Err(Error::invalid_argument(format!(
                "request {id}: {} device blocks allocated but the load needs {needed}",
                block_ids.len()
            ))
            .with("request", id));
        }
        // The engine's placeholder is a block a sliding-window layer does not keep.
        let real = |d: usize| Some(d) != placeholder;
        let window_from = self.start + self.skip;
        if let Some(k) = block_ids[self.start..window_from]
            .iter()
            .position(|&d| real(d))
        {
            // Nothing is loaded before a sliding window (its blocks were never stored): an
            // engine that keeps a real block there would read it as computed.
            return Err(Error::invalid_argument(format!(
                "request {id}: device block {} at block position {} lies before the sliding window of the {num_external_tokens} matched tokens, where the engine keeps its placeholder block",
                block_ids[self.start + k],
                self.start + k
            ))
            .with("request", id)
            .with("op", "update_state_after_alloc"));
        }
        if !block_ids[self.start..needed].iter().any(|&d| real(d)) {
            // The block holding the last matched token is inside any window, so an engine always
            // lists a real one there: placeholders only are refused before anything is loaded.
            return Err(Error::invalid_argument(format!(
                "request {id}: every device block allocated for the {num_external_tokens} matched tokens is the placeholder block"
            ))
            .with("request", id));
        }
        Ok(())
    }
}

/// How a match looks: every block before the hit (full attention), or only a sliding window's;
/// and how far it may reach.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Scope {
    /// The blocks before a hit a sliding-window group needs; `None`: every block.
    pub(super) window: Option<usize>,
    /// That group's window in tokens; `None`: full attention.
    pub(super) window_tokens: Option<usize>,
    /// The hit ends at most this many tokens beyond the device's prefix (another group's hit).
    pub(super) cap_tokens: Option<usize>,
}

impl Scope {
    /// Full attention, no cap: the plain match.
    pub(super) const FULL: Scope = Scope {
        window: None,
        window_tokens: None,
        cap_tokens: None,
    };
}

/// Most marked window ends a request keeps (the oldest is dropped).
const MAX_WINDOW_ENDS: usize = 8;

/// A match whose remote lookup is still running: the engine is to ask again ([`ask_again`]).
struct AskAgain;

/// "Ask again later" (a remote lookup is running): nothing staged, nothing counted yet.
fn ask_again(life: &mut Lifecycle, last_match: &mut MatchResult) -> Result<MatchResult> {
    life.unstage()?;
    *last_match = MatchResult {
        pending: true,
        ..MatchResult::NONE
    };
    Ok(*last_match)
}

/// A match's host and disk blocks.
fn by_tier(m: TieredMatch) -> (Vec<ImmutableBlock>, Vec<ImmutableBlock>) {
    let (mut host, mut disk) = (Vec::new(), Vec::new());
    for (kind, blocks) in m.per_tier {
        match kind {
            TierKind::Host => host = blocks,
            TierKind::Disk => disk = blocks,
            _ => {}
        }
    }
    (host, disk)
}

/// The sliding-window match of `hashes[start..]`: the largest end `e` whose window before it
/// (`[max(start, e - w), e)`) host and disk hold (host first, then disk, as any match), staged
/// with the blocks between `start` and the window skipped. `None`: no end has its window.
fn match_window(
    pools: &[&BlockPool],
    hashes: &[SequenceHash],
    start: usize,
    w: usize,
) -> Option<Staged> {
    let rest = hashes.get(start..)?;
    // run[k]: how many blocks in a row end at `start + k` that some tier holds.
    let mut run = Vec::with_capacity(rest.len());
    let mut len = 0usize;
    for h in rest {
        len = if pools.iter().any(|p| p.contains(*h)) {
            len + 1
        } else {
            0
        };
        run.push(len);
    }
    for end in (1..=rest.len()).rev() {
        let from = end.saturating_sub(w);
        if run[end - 1] < end - from {
            continue;
        }
        let m = match_across(pools, &rest[from..end]);
        let got: usize = m.per_tier.iter().map(|(_, b)| b.len()).sum();
        if got < end - from {
            // Held, but not host-then-disk in order: try a shorter hit.
            continue;
        }
        let (host, disk) = by_tier(m);
        return Some(Staged {
            start,
            skip: from,
            host,
            disk,
            remote: Vec::new(),
        });
    }
    None
}

impl<A: SchedulerAdapter> Leader<A> {
    /// How many tokens beyond `num_computed_tokens` (what the device already has) can be loaded
    /// from host and disk. The matched blocks are held until [`Leader::update_state_after_alloc`]
    /// or a later call replaces them. Not ready, nothing matched, or an unaligned
    /// `num_computed_tokens`: [`MatchResult::NONE`].
    ///
    /// A request seen again while prefilling or decoding was preempted and is being re-admitted.
    pub fn get_num_new_matched_tokens(
        &mut self,
        request: RequestInfo<'_>,
        num_computed_tokens: usize,
    ) -> Result<MatchResult> {
        self.get_num_new_matched_tokens_from(request, 0, num_computed_tokens)
    }

    /// [`Leader::get_num_new_matched_tokens`] where `request.tokens` are the request's tokens
    /// from index `first_token` on: a caller that knows the leader holds the first
    /// [`Leader::known_tokens`] tokens passes only the rest (tokens the leader already holds are
    /// skipped). A request the leader does not track must start at 0, and `first_token` beyond
    /// the tokens it holds (a gap) is refused: either would shift every later block's key.
    pub fn get_num_new_matched_tokens_from(
        &mut self,
        request: RequestInfo<'_>,
        first_token: usize,
        num_computed_tokens: usize,
    ) -> Result<MatchResult> {
        self.match_scoped(request, first_token, num_computed_tokens, Scope::FULL)
    }

    /// The match of [`Leader::get_num_new_matched_tokens_from`] for a request (or KV-cache
    /// group) that attends as `scope` says, ending at most `scope.cap_tokens` beyond the device's
    /// prefix.
    pub(super) fn match_scoped(
        &mut self,
        request: RequestInfo<'_>,
        first_token: usize,
        num_computed_tokens: usize,
        scope: Scope,
    ) -> Result<MatchResult> {
        let known = self
            .slots
            .get(request.id)
            .map_or(0, |s| s.seq.total_tokens());
        if first_token > known {
            return Err(Error::invalid_argument(format!(
                "request {}: tokens from index {first_token} given, but only {known} are known",
                request.id
            ))
            .with("request", request.id));
        }
        let _span = tracing::debug_span!("kvbm.leader.match", request = %request.id).entered();
        self.last_match = MatchResult::NONE;
        // Completions that arrived are applied first when they can change the answer. A request
        // seen for the first time applies them below only if an operation in flight stores one
        // of its keys (only such a completion can make more of it match); otherwise the step's
        // other leader calls (build_connector_meta, request_finished, update_connector_output)
        // apply them, so a step's first lookup does not carry the previous step's stores.
        let fresh = !self.slots.contains_key(request.id);
        if !fresh {
            self.poll_completions();
        }
        // Not ready yet (start-up barrier running): the request is still tracked (its tokens
        // here, its blocks and progress from the next calls) and matches nothing, so once ready
        // its computed blocks are stored like any other's. Below, no tiers: no match.
        self.ensure_ready();
        if !self.prepare_match_slot(request, first_token, fresh)? {
            return Ok(MatchResult::NONE);
        }
        let bs = self.page_size;
        let Some(slot) = self.slots.get_mut(request.id) else {
            return Ok(MatchResult::NONE);
        };
        slot.staged = None;
        slot.window = scope.window;
        slot.window_tokens = scope.window_tokens;
        let n = slot.seq.total_tokens();
        let aligned = num_computed_tokens % bs == 0;
        let start = num_computed_tokens / bs;
        // The engine must compute at least one token: never match the block holding the last one.
        let mut limit = n.saturating_sub(1) / bs;
        if let Some(cap) = scope.cap_tokens {
            limit = limit.min(start + cap / bs);
        }
        if self.tiers.is_none() {
            return Ok(MatchResult::NONE);
        }
        let found = if !aligned || start >= limit || self.dead.iter().any(|d| *d) {
            Ok(None)
        } else if let Some(w) = scope.window {
            self.stage_window(request.id, start, limit, w)
        } else {
            self.stage_full(request.id, start, limit)
        };
        let Some(slot) = self.slots.get_mut(request.id) else {
            return Ok(MatchResult::NONE);
        };
        let staged = match found {
            Ok(staged) => staged,
            Err(AskAgain) => return ask_again(&mut slot.life, &mut self.last_match),
        };
        let matched_blocks = staged.as_ref().map_or(0, Staged::tokens_blocks);
        if self.count_lookups {
            self.metrics
                .record_lookup(n as u64, (matched_blocks * bs) as u64);
        }
        if matched_blocks == 0 {
            slot.life.unstage()?;
            return Ok(MatchResult::NONE);
        }
        slot.life.stage_onboard()?;
        let m = staged.as_ref().map_or(MatchResult::NONE, |s| s.result(bs));
        slot.staged = staged;
        self.last_match = m;
        Ok(m)
    }

    /// The slot a match works on, made ready for it: created for a request seen the first time
    /// (`fresh`: its tokens hashed, announced to the workers), its loads awaited while it is
    /// onboarding (matched again with loads still in flight is refused), re-admitted when the
    /// engine preempted it (its device blocks gone), the tokens after `first_token` it does not
    /// hold yet appended; and for a fresh request one of whose keys a store in flight writes,
    /// the completions that arrived applied. `false`: the slot went away meanwhile (no match).
    fn prepare_match_slot(
        &mut self,
        request: RequestInfo<'_>,
        first_token: usize,
        fresh: bool,
    ) -> Result<bool> {
        let bs = self.page_size;
        let algorithm = self.config.hash;
        let mut slot = match self.slots.get_mut(request.id) {
            Some(s) => s,
            None => {
                let salt = Salt::new(algorithm, request.cache_salt, request.lora_name);
                let mut seq = TokenSequence::new(BlockHasher::new(algorithm, salt), bs)?;
                seq.append(request.tokens);
                self.outbox.new_slots.push(request.id.clone());
                self.slots.entry(request.id.clone()).or_insert(Slot {
                    life: Lifecycle::new(request.id.clone()),
                    seq,
                    prompt_len: request.tokens.len(),
                    device_blocks: Vec::new(),
                    computed: 0,
                    offloaded: 0,
                    staged: None,
                    loads_in_flight: 0,
                    stores_in_flight: 0,
                    held_since: None,
                    window: None,
                    window_tokens: None,
                    window_ends: Vec::new(),
                })
            }
        };
        if slot.life.state() == RequestState::Onboarding && slot.loads_in_flight > 0 {
            self.await_loads(request.id);
            slot = match self.slots.get_mut(request.id) {
                Some(s) => s,
                None => return Ok(false),
            };
        }
        if slot.life.state() == RequestState::Onboarding && slot.loads_in_flight > 0 {
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!(
                    "request {}: matched again while its loads are in flight",
                    request.id
                ),
            )
            .with("request", request.id)
            .with("state", RequestState::Onboarding));
        }
        if matches!(
            slot.life.state(),
            RequestState::Prefilling | RequestState::Decoding
        ) {
            // Re-admitted: the engine preempted it and freed its device blocks.
            slot.life.preempt()?;
            slot.device_blocks.clear();
        }
        let skip = slot.seq.total_tokens() - first_token;
        if let Some(rest) = request.tokens.get(skip..) {
            slot.seq.append(rest);
        }
        let pending = &self.pending_keys;
        if fresh
            && !pending.is_empty()
            && slot.seq.hashes().iter().any(|h| {
                [TierKind::Host, TierKind::Disk, TierKind::Remote]
                    .into_iter()
                    .any(|t| pending.contains(&(t, *h)))
            })
        {
            // A store of one of its keys is in flight: its completion may have arrived.
            self.poll_completions();
            return Ok(self.slots.contains_key(request.id));
        }
        Ok(true)
    }

    /// The full-attention match of blocks `start..limit` of request `id`: every block from
    /// `start` on, from host, then disk, then the remote store where they stopped. `Ok(None)`:
    /// nothing matched.
    fn stage_full(
        &mut self,
        id: &RequestId,
        start: usize,
        limit: usize,
    ) -> std::result::Result<Option<Staged>, AskAgain> {
        let (Some(slot), Some(tiers)) = (self.slots.get(id), self.tiers.as_ref()) else {
            return Ok(None);
        };
        let hashes = &slot.seq.hashes()[start..limit.min(slot.seq.num_full_blocks())];
        let pools: Vec<&BlockPool> = tiers.host.iter().chain(tiers.disk.iter()).collect();
        let (host, disk) = by_tier(match_across(&pools, hashes));
        // The remote store continues where host and disk stopped.
        let mut remote = Vec::new();
        if let Some(r) = self.remote.as_mut() {
            let local = host.len() + disk.len();
            let rest = &hashes[local..];
            match r.lookup(id, start + local, rest, &self.metrics) {
                RemoteAnswer::Found(n) => remote = rest[..n.min(rest.len())].to_vec(),
                RemoteAnswer::Pending => return Err(AskAgain),
            }
        }
        if host.is_empty() && disk.is_empty() && remote.is_empty() {
            return Ok(None);
        }
        Ok(Some(Staged {
            start,
            skip: 0,
            host,
            disk,
            remote,
        }))
    }

    /// The sliding-window match (window of `w` blocks) of blocks `start..limit` of request `id`:
    /// the longest hit whose window host and disk hold ([`match_window`]), or whose window the
    /// remote store holds the rest of; then, where an earlier request's prefix ended beyond that
    /// hit with no window there, that end marked (`Slot::window_ends`), so this request stores
    /// the window before it for the requests after it. `Ok(None)`: nothing matched.
    fn stage_window(
        &mut self,
        id: &RequestId,
        start: usize,
        limit: usize,
        w: usize,
    ) -> std::result::Result<Option<Staged>, AskAgain> {
        let (Some(slot), Some(tiers)) = (self.slots.get_mut(id), self.tiers.as_ref()) else {
            return Ok(None);
        };
        let hashes = &slot.seq.hashes()[..limit.min(slot.seq.num_full_blocks())];
        let pools: Vec<&BlockPool> = tiers.host.iter().chain(tiers.disk.iter()).collect();
        let mut staged = match_window(&pools, hashes, start, w);
        let end = hashes.len();
        let got = staged
            .as_ref()
            .map_or(start, |s| s.start + s.tokens_blocks());
        if got < end {
            if let Some(r) = self.remote.as_mut() {
                // The store may hold the window before the longest hit: host and disk first,
                // the store for the rest of it.
                let from = end.saturating_sub(w).max(start);
                let (host, disk) = by_tier(match_across(&pools, &hashes[from..end]));
                let local = from + host.len() + disk.len();
                let rest = &hashes[local..end];
                match r.lookup(id, local, rest, &self.metrics) {
                    RemoteAnswer::Found(n) if n >= rest.len() => {
                        staged = Some(Staged {
                            start,
                            skip: from - start,
                            host,
                            disk,
                            remote: rest.to_vec(),
                        });
                    }
                    RemoteAnswer::Found(_) => {}
                    RemoteAnswer::Pending => return Err(AskAgain),
                }
            }
        }
        // A prefix computed before whose window is not here: mark its end, so this request
        // stores the window before it for the requests after it.
        let got = staged
            .as_ref()
            .map_or(start, |s| s.start + s.tokens_blocks());
        let rest = hashes.get(start..).unwrap_or_default();
        if let Some(end) = self.window_keys.longest_prefix(rest) {
            let end = start + end;
            if end > got && !slot.window_ends.contains(&end) {
                if slot.window_ends.len() >= MAX_WINDOW_ENDS {
                    slot.window_ends.remove(0);
                }
                slot.window_ends.push(end);
            }
        }
        Ok(staged)
    }

    /// [`Leader::get_num_new_matched_tokens_from`] without counting the lookup in the metrics
    /// (`lookup_tokens`, `matched_tokens`): an engine adapter that looks a request up once per
    /// KV-cache group counts it once itself ([`Metrics::record_lookup`]).
    ///
    /// [`Metrics::record_lookup`]: crate::connector::metrics::Metrics::record_lookup
    pub fn get_num_new_matched_tokens_uncounted(
        &mut self,
        request: RequestInfo<'_>,
        first_token: usize,
        num_computed_tokens: usize,
    ) -> Result<MatchResult> {
        self.count_lookups = false;
        let m = self.get_num_new_matched_tokens_from(request, first_token, num_computed_tokens);
        self.count_lookups = true;
        m
    }

    /// Request `id`'s staged match (what its last match promised the engine and the allocation
    /// will load), [`MatchResult::NONE`] when nothing is staged or the request is unknown: an
    /// engine whose allocation call does not repeat the matched count (TensorRT-LLM) reads it
    /// here instead of keeping its own copy.
    pub fn staged_match(&self, id: &RequestId) -> MatchResult {
        self.slots
            .get(id)
            .and_then(|s| s.staged.as_ref())
            .map_or(MatchResult::NONE, |s| s.result(self.page_size))
    }

    /// Keeps at most `tokens` (rounded down to whole blocks) of request `id`'s staged match and
    /// releases the blocks after them: the engine will load fewer (another KV-cache group of
    /// the same request matched less). Returns the match as it stands now (also
    /// [`Leader::last_match`]); nothing staged is [`MatchResult::NONE`].
    pub fn trim_staged(&mut self, id: &RequestId, tokens: usize) -> Result<MatchResult> {
        let bs = self.page_size;
        let Some(slot) = self.slots.get_mut(id) else {
            return Err(unknown_request("trim_staged", id));
        };
        let keep = tokens / bs;
        let Some(staged) = slot.staged.as_mut() else {
            self.last_match = MatchResult::NONE;
            return Ok(MatchResult::NONE);
        };
        if slot.window.is_some() && keep < staged.tokens_blocks() {
            // A shorter hit needs the window before it, not the first blocks of this one:
            // nothing of this staging serves it (`match_groups` matches such a group again).
            slot.staged = None;
            slot.life.unstage()?;
            self.last_match = MatchResult::NONE;
            return Ok(MatchResult::NONE);
        }
        let mut left = keep.saturating_sub(staged.skip);
        let host = staged.host.len().min(left);
        staged.host.truncate(host);
        left -= host;
        let disk = staged.disk.len().min(left);
        staged.disk.truncate(disk);
        left -= disk;
        let remote = staged.remote.len().min(left);
        staged.remote.truncate(remote);
        if staged.blocks() == 0 {
            slot.staged = None;
            slot.life.unstage()?;
            self.last_match = MatchResult::NONE;
            return Ok(MatchResult::NONE);
        }
        let m = staged.result(bs);
        self.last_match = m;
        Ok(m)
    }

    /// The engine allocated `block_ids` (the request's whole device block list) and will load
    /// `num_external_tokens` tokens. With a non-zero count the staged blocks are mapped onto the
    /// device blocks and the loads are scheduled in the next metadata; with zero the staging is
    /// dropped (the engine chose not to load, or it is the second call after a finished load).
    pub fn update_state_after_alloc(
        &mut self,
        id: &RequestId,
        block_ids: &[usize],
        num_external_tokens: usize,
    ) -> Result<()> {
        let _span = tracing::debug_span!("kvbm.leader.alloc", request = %id).entered();
        if !self.ensure_ready() {
            // Not ready: nothing was matched, nothing loads; the blocks are followed (checked
            // against the device once ready, by the workers, like every transfer).
            if let Some(slot) = self.slots.get_mut(id) {
                if !slot.life.is_finishing() {
                    slot.device_blocks.clear();
                    slot.device_blocks.extend_from_slice(block_ids);
                }
            }
            return Ok(());
        }
        let bs = self.page_size;
        let placeholder = self.placeholder;
        let num_device = self
            .tiers
            .as_ref()
            .map_or(0, |t| t.readiness.counts.num_device_blocks);
        let Some(slot) = self.slots.get_mut(id) else {
            return Err(unknown_request("update_state_after_alloc", id));
        };
        if let Some(bad) = first_bad_block(block_ids, num_device, placeholder) {
            return Err(Error::out_of_range("device block", bad, num_device)
                .with("request", id)
                .with("op", "update_state_after_alloc"));
        }
        if !slot.life.is_finishing() {
            slot.device_blocks.clear();
            slot.device_blocks.extend_from_slice(block_ids);
        }
        if num_external_tokens == 0 {
            if slot.staged.take().is_some() {
                slot.life.unstage()?;
            }
            return Ok(());
        }
        let Some(staged) = slot.staged.as_ref() else {
            return Err(Error::invalid_argument(format!(
                "request {id}: the engine asks to load {num_external_tokens} tokens but none are staged"
            ))
            .with("request", id));
        };
        staged.check_allocation(id, block_ids, num_external_tokens, bs, placeholder)?;
        slot.life.start_onboard()?;
        let Some(staged) = slot.staged.take() else {
            return Err(Error::internal("staging vanished"));
        };
        self.queue_loads(id, staged, block_ids, placeholder);
        Ok(())
    }

    /// Queues one load of request `id` from `tier` (host or disk): `pairs` from the held `src`
    /// blocks into device blocks.
    fn queue_tier_load(
        &mut self,
        id: &RequestId,
        tier: TierKind,
        pairs: Vec<(usize, usize)>,
        src: Vec<ImmutableBlock>,
    ) {
        let op = self.next_op_id();
        let dst: Vec<usize> = pairs.iter().map(|p| p.1).collect();
        let transfer = BlockTransfer {
            id: op,
            request_id: Some(id.clone()),
            src: tier,
            dst: TierKind::Device,
            pairs,
        };
        let load = self.load_op(transfer, &src);
        self.outbox.operations.push(load);
        self.track(op, Some(id.clone()), Holds::Load { tier, src, dst });
        if let Some(slot) = self.slots.get_mut(id) {
            slot.loads_in_flight += 1;
        }
    }

    /// A load of `transfer` from the blocks `src`: keyed from a persisted disk tier (the worker
    /// checks each source block still holds its key, by its own index), plain otherwise.
    fn load_op(&self, transfer: BlockTransfer, src: &[ImmutableBlock]) -> Box<dyn Operation> {
        if transfer.src == TierKind::Disk && self.config.disk.reopens() {
            let keys = src.iter().map(|b| b.sequence_hash().0).collect();
            Box::new(KeyedLoad { transfer, keys })
        } else {
            Box::new(Load(transfer))
        }
    }

    /// The loads of `staged` (just taken from request `id`'s slot) into the device blocks
    /// `block_ids` the engine allocated, in the next metadata: one [`Load`] per local tier that
    /// serves any block and one [`RemoteLoad`] for the remote store's, each tracked until every
    /// rank completed it. A destination that is the engine's placeholder is not loaded: its
    /// source is released here (its tokens stay matched).
    fn queue_loads(
        &mut self,
        id: &RequestId,
        staged: Staged,
        block_ids: &[usize],
        placeholder: Option<usize>,
    ) {
        let real = |d: usize| Some(d) != placeholder;
        let Staged {
            start,
            skip,
            host,
            disk,
            remote,
        } = staged;
        let start = start + skip;
        let disk_start = start + host.len();
        let remote_start = disk_start + disk.len();
        let (host_pairs, host_src) = keep_real(host, &block_ids[start..], &real);
        let (disk_pairs, disk_src) = keep_real(disk, &block_ids[disk_start..], &real);
        let mut remote_pairs: Vec<(usize, usize)> = Vec::with_capacity(remote.len());
        let mut remote_keys = Vec::with_capacity(remote.len());
        for (k, key) in remote.into_iter().enumerate() {
            let d = block_ids[remote_start + k];
            if real(d) {
                remote_pairs.push((remote_keys.len(), d));
                remote_keys.push(key);
            }
        }
        for (tier, pairs, src) in [
            (TierKind::Host, host_pairs, host_src),
            (TierKind::Disk, disk_pairs, disk_src),
        ] {
            if !pairs.is_empty() {
                self.queue_tier_load(id, tier, pairs, src);
            }
        }
        if !remote_pairs.is_empty() {
            let op = self.next_op_id();
            let dst: Vec<usize> = remote_pairs.iter().map(|p| p.1).collect();
            self.outbox.operations.push(Box::new(RemoteLoad {
                transfer: BlockTransfer {
                    id: op,
                    request_id: Some(id.clone()),
                    src: TierKind::Remote,
                    dst: TierKind::Device,
                    pairs: remote_pairs,
                },
                keys: remote_keys.iter().map(|h| h.0).collect(),
            }));
            self.track(
                op,
                Some(id.clone()),
                Holds::Remote {
                    keys: remote_keys,
                    dst,
                },
            );
            if let Some(slot) = self.slots.get_mut(id) {
                slot.loads_in_flight += 1;
            }
        }
    }
}

/// The `(source, destination)` pairs of `src` onto `dst` (in order) whose destination is `real`,
/// and those sources; the others are dropped (released).
fn keep_real(
    src: Vec<ImmutableBlock>,
    dst: &[usize],
    real: &impl Fn(usize) -> bool,
) -> (Vec<(usize, usize)>, Vec<ImmutableBlock>) {
    let mut pairs = Vec::with_capacity(src.len());
    let mut kept = Vec::with_capacity(src.len());
    for (b, &d) in src.into_iter().zip(dst) {
        if real(d) {
            pairs.push((b.block_id(), d));
            kept.push(b);
        }
    }
    (pairs, kept)
}
