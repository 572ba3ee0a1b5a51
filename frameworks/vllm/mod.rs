//! vLLM adapter: the method set of `KVConnectorBase_V1` (scheduler and worker roles), in Rust
//! types shaped like what vLLM passes.
//!
//! What differs from TensorRT-LLM, and how it is handled:
//! * request ids are strings;
//! * `update_state_after_alloc(request, blocks, num_external_tokens)` carries the count, and is
//!   called a second time with 0 after an asynchronous load finished;
//! * the scheduler output has `num_scheduled_tokens` per request: offload is by scheduled tokens
//!   ([`ScheduledTokens`]), so a block is stored in the iteration that computes it;
//! * preempted requests come back through `get_num_new_matched_tokens` (their blocks were freed)
//!   and are rescheduled with `resumed_from_preemption` and a new block list;
//! * per-layer cache tensors are registered (layer separate, block- or outer-major, read from the
//!   shapes);
//! * the scheduler initialises blocking and the worker non-blocking (vLLM registers caches before
//!   it builds the scheduler; the engine is ready when the scheduler is);
//! * `get_finished(finished_req_ids) -> (finished_sending, finished_recving)` and
//!   `get_block_ids_with_load_errors()`.
//!
//! KV-cache groups (vLLM's hybrid manager, `SupportsHMA`: e.g. sliding-window and full layers
//! alternating): each group of a request has its own block list. The leader and the workers see
//! group `g >= 1` of request `R` as a request of its own, `R` + [`GROUP_SEP`] + `g`, whose keys
//! are salted with the group (no two groups share a block; group 0 keeps the request's own id
//! and keys, so a one-group model is unchanged). A hit is what every group can serve (the
//! smallest group match; the others are trimmed to it), and a request is done loading or
//! storing once every group is. Set the count with [`VllmScheduler::set_kv_cache_groups`] and
//! [`VllmWorker::set_kv_cache_groups`] (default 1).

// The engine's Python binding (`kvbm_connector._kvbm.VllmScheduler` / `VllmWorker`): vLLM's
// objects, read by `kvbm_connector.vllm`, into this adapter's calls. Built with `python` only;
// it alone in this folder uses the bindings' building blocks (in `src/python/`).
#[cfg(feature = "python")]
pub(crate) mod python;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::backends::StandardTiers;
use crate::config::Config;
use crate::connector::adapter::{ScheduledRequest, ScheduledTokens, SchedulerStep};
use crate::connector::groups::{AttentionKind, KvCacheGroups};
use crate::connector::leader::{Leader, RequestInfo};
use crate::connector::transport::{LeaderTransport, WorkerTransport};
use crate::connector::worker::Worker;
use crate::connector::RequestId;
use crate::connector::{Blocking, Engine, NonBlocking};
use crate::error::{Error, Result};
use crate::identity::Token;
use crate::layout::{BlockOrder, Layout, LayoutDims, LayoutKind};
use crate::tier::StorageTier;

use super::detect::{fmt_shape, inner_from_tail};

/// The parts of vLLM's `Request` the connector reads.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// `request.request_id`.
    pub request_id: &'a str,
    /// `request.all_token_ids`: prompt and generated tokens so far.
    pub all_token_ids: &'a [Token],
    /// `request.cache_salt`.
    pub cache_salt: Option<&'a str>,
    /// `request.lora_request.lora_name`, if any.
    pub lora_name: Option<&'a str>,
    /// `request.num_computed_tokens`.
    pub num_computed_tokens: usize,
}

/// vLLM's `NewRequestData`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NewRequestData {
    /// `req_id`.
    pub req_id: String,
    /// `prompt_token_ids`, from index `first_token_index` of the prompt on.
    pub prompt_token_ids: Vec<Token>,
    /// Index in the prompt of `prompt_token_ids[0]`: 0 for the whole prompt, as vLLM sends it; a
    /// binding that knows the leader holds the first [`VllmScheduler::known_tokens`] tokens
    /// (from `get_num_new_matched_tokens`) passes only the rest.
    pub first_token_index: usize,
    /// `block_ids`: one list per KV-cache group (exactly one supported).
    pub block_ids: Vec<Vec<usize>>,
    /// `num_computed_tokens` (local prefix-cache hits plus loaded tokens).
    pub num_computed_tokens: usize,
}

/// vLLM's `CachedRequestData` (parallel lists, one entry per request).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CachedRequestData {
    /// `req_ids`.
    pub req_ids: Vec<String>,
    /// `resumed_from_preemption`.
    pub resumed_from_preemption: Vec<bool>,
    /// `new_token_ids` (may be empty lists when vLLM does not send them).
    pub new_token_ids: Vec<Vec<Token>>,
    /// `new_block_ids`: per request, `None` or one list per KV-cache group.
    pub new_block_ids: Vec<Option<Vec<Vec<usize>>>>,
    /// `num_computed_tokens`.
    pub num_computed_tokens: Vec<usize>,
    /// Index in the request of `new_token_ids[i][0]`, where it is not `num_computed_tokens[i]`
    /// (vLLM's own lists start there). A binding that reads a running request's tokens itself
    /// (vLLM sends them only with pipeline parallelism) passes those the leader does not hold,
    /// from [`VllmScheduler::known_tokens`] on. Empty: every list starts at
    /// `num_computed_tokens`.
    pub new_token_index: Vec<Option<usize>>,
}

/// vLLM's `SchedulerOutput` (the fields the connector reads).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    /// `scheduled_new_reqs`.
    pub scheduled_new_reqs: Vec<NewRequestData>,
    /// `scheduled_cached_reqs`.
    pub scheduled_cached_reqs: CachedRequestData,
    /// `num_scheduled_tokens`.
    pub num_scheduled_tokens: HashMap<String, usize>,
    /// `finished_req_ids`.
    pub finished_req_ids: HashSet<String>,
    /// `preempted_req_ids` (newer vLLM; empty otherwise).
    pub preempted_req_ids: HashSet<String>,
}

pub use crate::connector::groups::{GROUP_SEP, MAX_KV_CACHE_GROUPS};

/// The id the leader and workers use for group `g` of request `real`.
fn group_id(real: &str, g: usize) -> RequestId {
    KvCacheGroups::request_id(real, g)
}

/// The request id of a leader or worker id, and its group.
fn real_of(id: &str) -> (&str, usize) {
    KvCacheGroups::real_of(id)
}

/// A request's per-group block lists, checked against the model's group count (an empty list of
/// lists: no blocks in any group).
fn per_group<'a>(id: &str, groups: &'a [Vec<usize>], n: usize) -> Result<Vec<&'a [usize]>> {
    if groups.is_empty() {
        return Ok(vec![&[][..]; n]);
    }
    if groups.len() != n {
        return Err(Error::invalid_argument(format!(
            "request {id} has {} KV-cache group block lists; the model has {n} groups",
            groups.len()
        ))
        .with("request", id));
    }
    Ok(groups.iter().map(Vec::as_slice).collect())
}

/// The vLLM engine as the connector sees it: its adapter and its start-up order.
///
/// vLLM registers the workers' caches before it builds the scheduler: each worker's barrier runs in
/// the background (its `register_kv_caches` returns at once), the scheduler's inline.
#[derive(Debug, Clone, Copy, Default)]
pub struct Vllm;

impl Engine for Vllm {
    type Adapter = ScheduledTokens;
    type LeaderInit = Blocking;
    type WorkerInit = NonBlocking;
    // vLLM keeps a request waiting when the count is `None` and asks again next step.
    const DEFERRED_MATCH: bool = true;
    // vLLM's block pool hands out block 0 to no request: it is the null block, which stands in
    // the block table for blocks a sliding-window layer no longer needs.
    const PLACEHOLDER_BLOCK: Option<usize> = Some(0);
}

/// The scheduler role of `KVConnectorBase_V1`.
#[derive(Debug)]
pub struct VllmScheduler {
    leader: Leader<ScheduledTokens>,
    groups: KvCacheGroups,
}

impl VllmScheduler {
    /// The scheduler side; its barrier runs inline (blocking): vLLM builds it after the workers
    /// registered their caches.
    pub fn new(
        config: Config,
        block_size: usize,
        transport: Arc<dyn LeaderTransport>,
    ) -> Result<Self> {
        let mut leader = Leader::new::<Vllm>(ScheduledTokens, config, block_size, transport)?;
        leader.set_tier_factory(StandardTiers::shared());
        Ok(Self {
            leader,
            groups: KvCacheGroups::default(),
        })
    }

    /// The model's KV-cache groups (`len(kv_cache_config.kv_cache_groups)` with vLLM's hybrid
    /// manager on; 1, the default, otherwise), all full attention. Set before the first request.
    pub fn set_kv_cache_groups(&mut self, n: usize) -> Result<()> {
        self.set_kv_cache_group_kinds(KvCacheGroups::full(n)?)
    }

    /// The model's KV-cache groups and how each attends (a sliding-window group is matched and
    /// stored by its window, see [`crate::connector::groups`]). Set before the first request.
    pub fn set_kv_cache_group_kinds(&mut self, groups: KvCacheGroups) -> Result<()> {
        self.leader
            .check_groups_change(&self.groups, &groups, "KV-cache groups")?;
        self.groups = groups;
        Ok(())
    }

    /// The model's KV-cache groups.
    pub fn kv_cache_groups(&self) -> usize {
        self.groups.len()
    }

    /// The model's KV-cache groups' attention kinds.
    pub fn kv_cache_group_kinds(&self) -> &[AttentionKind] {
        self.groups.kinds()
    }

    /// The core leader (metrics, status).
    pub fn leader(&self) -> &Leader<ScheduledTokens> {
        &self.leader
    }

    /// Mutable access to the core leader.
    pub fn leader_mut(&mut self) -> &mut Leader<ScheduledTokens> {
        &mut self.leader
    }

    /// `get_num_new_matched_tokens(request, num_computed_tokens) -> (Optional[int], bool)`.
    /// `None` while a remote (G4) lookup for the request is running: vLLM keeps the request
    /// waiting and asks again next step (the scheduler never waits for the store).
    pub fn get_num_new_matched_tokens(
        &mut self,
        request: &Request<'_>,
        num_computed_tokens: usize,
    ) -> Result<(Option<usize>, bool)> {
        self.get_num_new_matched_tokens_from(request, 0, num_computed_tokens)
    }

    /// How many of the request's tokens the leader holds (0 for a request it does not track):
    /// the calls ending in `_from` take only the tokens after these.
    pub fn known_tokens(&self, request_id: &str) -> usize {
        if self.groups.len() == 1 {
            return self.leader.known_tokens(request_id).unwrap_or(0);
        }
        (0..self.groups.len())
            .map(|g| {
                self.leader
                    .known_tokens(group_id(request_id, g).as_str())
                    .unwrap_or(0)
            })
            .min()
            .unwrap_or(0)
    }

    /// [`VllmScheduler::get_num_new_matched_tokens`] where `request.all_token_ids` holds the
    /// request's tokens from index `first_token` on (see [`VllmScheduler::known_tokens`]).
    pub fn get_num_new_matched_tokens_from(
        &mut self,
        request: &Request<'_>,
        first_token: usize,
        num_computed_tokens: usize,
    ) -> Result<(Option<usize>, bool)> {
        let id = RequestId::from(request.request_id);
        let m = self.leader.match_groups(
            &self.groups,
            RequestInfo {
                id: &id,
                tokens: request.all_token_ids,
                cache_salt: request.cache_salt,
                lora_name: request.lora_name,
            },
            first_token,
            num_computed_tokens,
        )?;
        if m.pending {
            return Ok((None, false));
        }
        Ok((Some(m.external_tokens), m.load_async))
    }

    /// `update_state_after_alloc(request, blocks, num_external_tokens)`; `block_ids` is
    /// `blocks.get_block_ids()`: one list per KV-cache group.
    pub fn update_state_after_alloc(
        &mut self,
        request: &Request<'_>,
        block_ids: &[Vec<usize>],
        num_external_tokens: usize,
    ) -> Result<()> {
        let lists = per_group(request.request_id, block_ids, self.groups.len())?;
        for (g, blocks) in lists.into_iter().enumerate() {
            self.leader.update_state_after_alloc(
                &group_id(request.request_id, g),
                blocks,
                num_external_tokens,
            )?;
        }
        Ok(())
    }

    /// `build_connector_meta(scheduler_output) -> KVConnectorMetadata` (as bytes).
    pub fn build_connector_meta(&mut self, output: &SchedulerOutput) -> Result<Vec<u8>> {
        let mut step = SchedulerStep::default();
        let scheduled = |id: &str| -> Result<usize> {
            output.num_scheduled_tokens.get(id).copied().ok_or_else(|| {
                Error::invalid_argument(format!(
                    "request {id} is scheduled but has no num_scheduled_tokens"
                ))
                .with("request", id)
            })
        };
        let n_groups = self.groups.len();
        for r in &output.scheduled_new_reqs {
            let lists = per_group(&r.req_id, &r.block_ids, n_groups)?;
            let n = scheduled(&r.req_id)?;
            for (g, blocks) in lists.into_iter().enumerate() {
                step.requests.push(ScheduledRequest {
                    request_id: group_id(&r.req_id, g),
                    new_tokens: r.prompt_token_ids.clone(),
                    first_token_index: Some(r.first_token_index),
                    new_block_ids: blocks.to_vec(),
                    replace_block_ids: true,
                    num_computed_tokens: r.num_computed_tokens,
                    num_scheduled_tokens: Some(n),
                    computed_position: None,
                });
            }
        }
        let c = &output.scheduled_cached_reqs;
        let n = c.req_ids.len();
        if c.resumed_from_preemption.len() != n
            || c.new_token_ids.len() != n
            || c.new_block_ids.len() != n
            || c.num_computed_tokens.len() != n
            || !(c.new_token_index.is_empty() || c.new_token_index.len() == n)
        {
            return Err(Error::invalid_argument(format!(
                "scheduled_cached_reqs lists differ in length: {n} ids, {} resumed, {} token lists, {} block lists, {} computed counts, {} token indices",
                c.resumed_from_preemption.len(),
                c.new_token_ids.len(),
                c.new_block_ids.len(),
                c.num_computed_tokens.len(),
                c.new_token_index.len()
            )));
        }
        for i in 0..n {
            let id = &c.req_ids[i];
            let none = Vec::new();
            let lists = per_group(id, c.new_block_ids[i].as_ref().unwrap_or(&none), n_groups)?;
            let count = scheduled(id)?;
            let first = c
                .new_token_index
                .get(i)
                .copied()
                .flatten()
                .unwrap_or(c.num_computed_tokens[i]);
            for (g, blocks) in lists.into_iter().enumerate() {
                step.requests.push(ScheduledRequest {
                    request_id: group_id(id, g),
                    new_tokens: c.new_token_ids[i].clone(),
                    first_token_index: Some(first),
                    new_block_ids: blocks.to_vec(),
                    replace_block_ids: c.resumed_from_preemption[i],
                    num_computed_tokens: c.num_computed_tokens[i],
                    num_scheduled_tokens: Some(count),
                    computed_position: None,
                });
            }
        }
        let mut preempted: Vec<&String> = output.preempted_req_ids.iter().collect();
        preempted.sort();
        step.preempted = preempted
            .into_iter()
            .flat_map(|s| (0..n_groups).map(move |g| group_id(s, g)))
            .collect();
        self.leader.build_connector_meta(&step)
    }

    /// `request_finished(request, block_ids) -> (bool, Optional[dict])`: true while operations on
    /// the request's device blocks are in flight (vLLM then frees them when a worker reports the
    /// id in `finished_sending`). No transfer parameters are returned.
    pub fn request_finished(
        &mut self,
        request: &Request<'_>,
        block_ids: &[usize],
    ) -> Result<(bool, Option<()>)> {
        self.request_finished_from(request, 0, block_ids)
    }

    /// [`VllmScheduler::request_finished`] where `request.all_token_ids` holds the request's
    /// tokens from index `first_token` on (see [`VllmScheduler::known_tokens`]).
    pub fn request_finished_from(
        &mut self,
        request: &Request<'_>,
        first_token: usize,
        block_ids: &[usize],
    ) -> Result<(bool, Option<()>)> {
        let _ = block_ids;
        let mut held = false;
        for g in 0..self.groups.len() {
            let id = group_id(request.request_id, g);
            let tokens = if first_token == 0 {
                Some(request.all_token_ids)
            } else {
                self.leader
                    .append_request_tokens(id.as_str(), first_token, request.all_token_ids);
                None
            };
            held |= self
                .leader
                .request_finished(&id, tokens, Some(request.num_computed_tokens))?;
        }
        Ok((held, None))
    }

    /// `update_connector_output(connector_output)`: completions arrive over the transport, so this
    /// only applies them early.
    pub fn update_connector_output(&mut self) {
        self.leader.process_completions();
    }
}

/// The worker role of `KVConnectorBase_V1`.
#[derive(Debug)]
pub struct VllmWorker {
    worker: Worker,
    block_size: usize,
    layers: HashMap<String, usize>,
    saved_this_iteration: bool,
    groups: usize,
}

impl VllmWorker {
    /// A worker of rank `transport.rank()` among `world_size`; its barrier runs in the
    /// background (non-blocking) after [`VllmWorker::register_kv_caches`].
    pub fn new(
        config: Config,
        block_size: usize,
        world_size: usize,
        transport: Arc<dyn WorkerTransport>,
    ) -> Result<Self> {
        if block_size == 0 {
            return Err(Error::invalid_argument("block_size must be at least 1"));
        }
        Ok(Self {
            worker: Worker::new::<Vllm>(config, world_size, transport, StandardTiers::shared())?,
            block_size,
            layers: HashMap::new(),
            saved_this_iteration: false,
            groups: 1,
        })
    }

    /// The model's KV-cache groups (as [`VllmScheduler::set_kv_cache_groups`]).
    pub fn set_kv_cache_groups(&mut self, n: usize) -> Result<()> {
        self.groups = KvCacheGroups::full(n)?.len();
        Ok(())
    }

    /// Names every layer in model order, when some of them share another's cache tensor (vLLM's
    /// hybrid manager: layer `l` of each KV-cache group is a view of the same memory) and only
    /// one of each was registered. The last name is the layer whose save starts the stores.
    pub fn set_layer_names(&mut self, names: &[String]) -> Result<()> {
        let mut map = HashMap::with_capacity(names.len());
        for (i, name) in names.iter().enumerate() {
            if map.insert(name.clone(), i).is_some() {
                return Err(Error::invalid_argument(format!(
                    "layer name {name:?} registered twice"
                )));
            }
        }
        self.layers = map;
        Ok(())
    }

    /// The core worker.
    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    /// Mutable access to the core worker; its tiers are built by the backends' [`StandardTiers`]
    /// unless [`Worker::set_tier_factory`] names another factory before the caches are registered.
    pub fn worker_mut(&mut self) -> &mut Worker {
        &mut self.worker
    }

    /// `register_kv_caches(kv_caches: dict[str, Tensor])`: each layer's name and shape (in
    /// model order), the element size, the engine's block count when known, an optional layout
    /// override (refused if it contradicts the shapes), and the cache storage behind the tensors.
    pub fn register_kv_caches(
        &mut self,
        layers: &[(String, Vec<usize>)],
        dtype_bytes: usize,
        num_blocks: Option<usize>,
        layout_override: Option<LayoutKind>,
        cache: Arc<dyn StorageTier>,
    ) -> Result<()> {
        let shapes: Vec<Vec<usize>> = layers.iter().map(|(_, s)| s.clone()).collect();
        let layout = detect_vllm(
            &shapes,
            dtype_bytes,
            self.block_size,
            num_blocks,
            layout_override,
        )?;
        super::check_registered(&layout, cache.as_ref())?;
        let mut names = HashMap::with_capacity(layers.len());
        for (i, (name, _)) in layers.iter().enumerate() {
            if names.insert(name.clone(), i).is_some() {
                return Err(Error::invalid_argument(format!(
                    "layer name {name:?} registered twice"
                )));
            }
        }
        self.worker.register(cache)?;
        self.layers = names;
        Ok(())
    }

    /// `bind_connector_metadata(metadata)`.
    pub fn bind_connector_metadata(&mut self, metadata: &[u8]) -> Result<()> {
        self.saved_this_iteration = false;
        self.worker.bind_metadata(metadata)
    }

    /// `clear_connector_metadata()`.
    pub fn clear_connector_metadata(&mut self) -> Result<()> {
        self.worker.clear_metadata()
    }

    /// `start_load_kv(forward_context)`: loads run asynchronously.
    pub fn start_load_kv(&mut self) -> Result<()> {
        self.worker.start_load()
    }

    /// `wait_for_layer_load(layer_name)`: loads are asynchronous and finish before vLLM schedules
    /// the request, so nothing to wait for; the name is checked.
    pub fn wait_for_layer_load(&mut self, layer_name: &str) -> Result<()> {
        self.layer_index(layer_name).map(|_| ())
    }

    /// `save_kv_layer(layer_name, kv_layer, attn_metadata)`: stores start after the last layer.
    pub fn save_kv_layer(&mut self, layer_name: &str) -> Result<()> {
        let i = self.layer_index(layer_name)?;
        if i + 1 == self.layers.len() && !self.saved_this_iteration {
            self.saved_this_iteration = true;
            self.worker.save()?;
        }
        Ok(())
    }

    /// `wait_for_save()`: starts the stores if the last layer did not; does not block on them
    /// (the engine keeps finished requests' blocks until `get_finished` reports them).
    pub fn wait_for_save(&mut self) -> Result<()> {
        if !self.saved_this_iteration {
            self.saved_this_iteration = true;
            self.worker.save()?;
        }
        Ok(())
    }

    /// `get_finished(finished_req_ids) -> (finished_sending, finished_recving)`; `None` for an
    /// empty set, as vLLM expects.
    pub fn get_finished(
        &mut self,
        finished_req_ids: &HashSet<String>,
    ) -> (Option<HashSet<String>>, Option<HashSet<String>>) {
        let mut ids: Vec<&String> = finished_req_ids.iter().collect();
        ids.sort();
        let groups = self.groups;
        let finished: Vec<RequestId> = ids
            .into_iter()
            .flat_map(|s| (0..groups).map(move |g| group_id(s, g)))
            .collect();
        let (sending, recving) = self.worker.get_finished(&finished, None);
        let (sending, mut recving) = if groups == 1 {
            (sending, recving)
        } else {
            (
                self.whole_requests(sending, Worker::tracks),
                self.whole_requests(recving, Worker::load_pending),
            )
        };
        // A request aborted while loading is done on both counts at once; vLLM frees it on the
        // first report and must not see it again, so it is reported as sending only.
        recving.retain(|id| !sending.contains(id));
        let set = |v: Vec<RequestId>| -> Option<HashSet<String>> {
            if v.is_empty() {
                None
            } else {
                Some(v.into_iter().map(|id| id.as_str().to_string()).collect())
            }
        };
        (set(sending), set(recving))
    }

    /// The requests of `done` (group ids) whose every group is done: no other group of theirs
    /// is still `busy` here.
    fn whole_requests(
        &self,
        done: Vec<RequestId>,
        busy: fn(&Worker, &RequestId) -> bool,
    ) -> Vec<RequestId> {
        crate::connector::groups::whole_requests(done, self.groups, |id| busy(&self.worker, id))
    }

    /// `get_block_ids_with_load_errors() -> set[int]`: device blocks to recompute.
    pub fn get_block_ids_with_load_errors(&mut self) -> HashSet<usize> {
        self.worker.take_load_errors().into_iter().collect()
    }

    /// Requests whose load failed since the last call (`KVConnectorTransferResults
    /// .failed_recving`, which makes vLLM recompute the whole request): for a model with a
    /// sliding window, where recomputing from the first failed block would attend over the null
    /// block's bytes in the window before it.
    pub fn take_failed_loads(&mut self) -> Vec<String> {
        let mut out: Vec<String> = self
            .worker
            .take_failed_loads()
            .into_iter()
            .map(|id| real_of(id.as_str()).0.to_string())
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Every registered layer's name, in model order (the last one's `save_kv_layer` submits
    /// the iteration's stores). The Python connector keeps these to answer the per-layer hooks
    /// of the layers before the last without crossing into Rust.
    pub fn layer_names(&self) -> Vec<String> {
        let mut names: Vec<(&String, usize)> = self.layers.iter().map(|(n, &i)| (n, i)).collect();
        names.sort_unstable_by_key(|&(_, i)| i);
        names.into_iter().map(|(n, _)| n.clone()).collect()
    }

    fn layer_index(&self, name: &str) -> Result<usize> {
        self.layers.get(name).copied().ok_or_else(|| {
            Error::invalid_argument(format!("unknown layer {name:?}")).with("layer", name)
        })
    }
}

/// Layout of vLLM's per-layer cache tensors, all of which must share one shape.
///
/// Accepted per-layer shapes (page dims after the block/outer dims hold `page_size × inner_dim`
/// elements):
/// * `[outer_dim, num_blocks, ...]` → outer-major (FlashAttention: `[2, N, page, heads, dim]`);
/// * `[num_blocks, outer_dim, ...]` → block-major (FlashInfer: `[N, 2, page, heads, dim]`);
/// * `[num_blocks, page_size, ...]` → block-major with `outer_dim = 1` (MLA latent);
/// * `[num_blocks, heads, page_size, 2 × head_dim]` → head-major
///   ([`LayoutKind::LayerSeparateHeadMajor`]: vLLM's CPU attention, `CPU_ATTN`, whose
///   `(block, head)` slabs hold all of K then all of V).
///
/// The reading is taken from the dimension equal to `num_blocks` when it is given; without it,
/// from which leading dimension can be an outer dim (1 or 2). When several readings fit the shape
/// the caller must say which (`override_kind`; the Python connector passes
/// `layer_separate_head_major` when vLLM's attention backend is `CPU_ATTN`). An override that
/// contradicts the shape is refused, because the readings have the same byte size and a wrong one
/// silently mixes up K, V and heads. A 4-dim shape with 1 or 2 heads is always ambiguous without
/// one (`[N, 2, page, C]` is also block-major K/V): the shape alone cannot tell.
pub fn detect_vllm(
    layer_shapes: &[Vec<usize>],
    dtype_bytes: usize,
    page_size: usize,
    num_blocks: Option<usize>,
    override_kind: Option<LayoutKind>,
) -> Result<Layout> {
    let shape = common_shape(layer_shapes)?;
    let num_layers = layer_shapes.len();
    let candidates = shape_readings(shape, page_size, num_blocks);
    let chosen = choose_reading(
        &candidates,
        shape,
        num_layers,
        page_size,
        num_blocks,
        override_kind,
    )?;
    let (kind, n, outer_dim, tail) = chosen;
    if kind == LayoutKind::LayerSeparateHeadMajor {
        let (heads, head_dim) = (shape[1], shape[3] / 2);
        let dims = LayoutDims {
            num_layers,
            outer_dim,
            page_size,
            inner_dim: heads.checked_mul(head_dim).ok_or_else(|| {
                Error::invalid_layout(format!("per-layer shape {} overflows", fmt_shape(shape)))
            })?,
            dtype_bytes,
        };
        return Layout::layer_separate_head_major(dims, n, heads);
    }
    // vLLM keeps the page (block_size) as its own dimension right after the block/outer dims.
    if shape.get(tail) != Some(&page_size) {
        return Err(Error::invalid_layout(format!(
            "per-layer shape {} has {} tokens per block where page_size {page_size} was expected (dim {tail})",
            fmt_shape(shape),
            shape.get(tail).copied().unwrap_or(0)
        )));
    }
    let dims = LayoutDims {
        num_layers,
        outer_dim,
        page_size,
        inner_dim: inner_from_tail(&shape[tail..], page_size, shape)?,
        dtype_bytes,
    };
    let order = if kind == LayoutKind::LayerSeparateOuterMajor {
        BlockOrder::OuterMajor
    } else {
        BlockOrder::BlockMajor
    };
    Layout::layer_separate(dims, n, order)
}

/// One reading of a per-layer shape: (kind, num_blocks, outer_dim, the dim where the page
/// starts).
type ShapeReading = (LayoutKind, usize, usize, usize);

/// The one shape every layer's tensor shares: refused when there are no layers, when a layer's
/// shape differs from layer 0's (naming it), or when it has fewer than 3 dims.
fn common_shape(layer_shapes: &[Vec<usize>]) -> Result<&[usize]> {
    let Some(first) = layer_shapes.first() else {
        return Err(Error::invalid_layout(
            "no per-layer cache tensors registered",
        ));
    };
    for (i, s) in layer_shapes.iter().enumerate() {
        if s != first {
            return Err(Error::invalid_layout(format!(
                "layer {i} has shape {} but layer 0 has {}",
                fmt_shape(s),
                fmt_shape(first)
            ))
            .with("layer", i));
        }
    }
    let shape = first.as_slice();
    if shape.len() < 3 {
        return Err(Error::invalid_layout(format!(
            "per-layer cache tensor must have at least 3 dims, got {}",
            fmt_shape(shape)
        )));
    }
    Ok(shape)
}

/// Every reading that fits the shape (and `num_blocks`, when given), in the order outer-major,
/// block-major, MLA, head-major; an outer-major reading with outer dim 1 is dropped where the MLA
/// reading covers the same bytes.
fn shape_readings(
    shape: &[usize],
    page_size: usize,
    num_blocks: Option<usize>,
) -> Vec<ShapeReading> {
    let mut candidates: Vec<ShapeReading> = Vec::with_capacity(3);
    let fits_blocks = |n: usize| num_blocks.is_none_or(|want| want == n);
    // Outer-major: [outer, N, ...]
    if matches!(shape[0], 1 | 2) && fits_blocks(shape[1]) {
        candidates.push((LayoutKind::LayerSeparateOuterMajor, shape[1], shape[0], 2));
    }
    // Block-major with explicit outer dim: [N, outer, ...]
    if matches!(shape[1], 1 | 2) && fits_blocks(shape[0]) && shape[1] != page_size {
        candidates.push((LayoutKind::LayerSeparateBlockMajor, shape[0], shape[1], 2));
    }
    // MLA: [N, page_size, ...] with outer_dim 1.
    if shape[1] == page_size && fits_blocks(shape[0]) {
        candidates.push((LayoutKind::LayerSeparateBlockMajor, shape[0], 1, 1));
    }
    // Outer-major with outer 1 is the same bytes as block-major with outer 1; keep one reading.
    candidates.retain(|c| {
        !(c.0 == LayoutKind::LayerSeparateOuterMajor && c.2 == 1 && shape[1] == page_size)
    });
    // Head-major (CPU attention): [N, heads, page, 2 × head_dim].
    if shape.len() == 4 && shape[2] == page_size && shape[3] % 2 == 0 && fits_blocks(shape[0]) {
        candidates.push((LayoutKind::LayerSeparateHeadMajor, shape[0], 2, 1));
    }
    candidates
}

/// The one reading to use: the override's, when it names one that fits (fully contiguous, none
/// or several fitting are refused); without an override, the only reading, refused when none or
/// several fit.
fn choose_reading(
    candidates: &[ShapeReading],
    shape: &[usize],
    num_layers: usize,
    page_size: usize,
    num_blocks: Option<usize>,
    override_kind: Option<LayoutKind>,
) -> Result<ShapeReading> {
    match override_kind {
        Some(LayoutKind::FullyContiguous) => {
            Err(Error::invalid_layout(format!(
                "layout override fully_contiguous contradicts {num_layers} per-layer tensors of shape {}",
                fmt_shape(shape)
            )))
        }
        Some(k) => {
            let fitting: Vec<_> = candidates.iter().filter(|c| c.0 == k).collect();
            match fitting.as_slice() {
                [one] => Ok(**one),
                [] => {
                    Err(Error::invalid_layout(format!(
                        "layout override {k} contradicts per-layer shape {}{}",
                        fmt_shape(shape),
                        num_blocks.map_or(String::new(), |n| format!(" with num_blocks {n}"))
                    )))
                }
                _ => {
                    Err(Error::invalid_layout(format!(
                        "per-layer shape {} is ambiguous even with override {k}",
                        fmt_shape(shape)
                    )))
                }
            }
        }
        None => match candidates {
            [one] => Ok(*one),
            [] => {
                Err(Error::invalid_layout(format!(
                    "cannot read per-layer shape {} as [outer, blocks, ...], [blocks, outer, ...], [blocks, page_size, ...] or [blocks, heads, page_size, 2 × head_dim]{}",
                    fmt_shape(shape),
                    num_blocks.map_or(String::new(), |n| format!(" with num_blocks {n} and page_size {page_size}"))
                )))
            }
            _ => {
                let kinds: Vec<String> = candidates.iter().map(|c| c.0.to_string()).collect();
                Err(Error::invalid_layout(format!(
                    "per-layer shape {} is ambiguous ({}); pass num_blocks or a layout override (layer_separate_head_major for vLLM's CPU attention backend)",
                    fmt_shape(shape),
                    kinds.join(" or ")
                )))
            }
        },
    }
}
