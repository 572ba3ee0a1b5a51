//! TensorRT-LLM adapter: the method set of `KvCacheConnectorScheduler` and
//! `KvCacheConnectorWorker`, in Rust types shaped like what TensorRT-LLM passes.
//!
//! What differs from vLLM, and how it is handled:
//! * request ids are integers (`u64`);
//! * `update_state_after_alloc(request, block_ids)` carries no external-token count: the count
//!   loaded is the leader's staged match of the request ([`Leader::staged_match`]);
//! * a `num_computed_tokens` that is not block-aligned (partial device reuse) matches nothing:
//!   `(0, false)`;
//! * the scheduler output has no scheduled-token count, only `computed_position`: offload is by
//!   computed position ([`ComputedPosition`]), and the blocks computed in a request's last
//!   iteration are stored when it finishes;
//! * one fully contiguous cache tensor `[num_blocks, num_layers, kv_factor, ...]` is registered;
//! * the scheduler initialises non-blocking and the worker blocking (TensorRT-LLM builds both at
//!   once; the engine is ready when the worker is): `register_kv_caches` returns once the
//!   scheduler is ready too (the barrier's step 3), since TensorRT-LLM's older API admits
//!   requests right after it, with no `wait_for_initialization`;
//! * `get_finished(finished_gen_req_ids, started_loading_req_ids)` returns an id only after the
//!   engine passed it in;
//! * layer groups (KV cache manager V2, `*_by_layer_group`): each group of a request is served as
//!   its own request (see [`crate::connector::groups`]), matched by its window
//!   ([`TrtllmScheduler::set_layer_groups`]); the workers serve several groups when they share
//!   the registered pool ([`TrtllmWorker::set_layer_groups`]). Groups in pools of their own get
//!   one scheduler and one worker per rank per pool (Python's `kvbm_connector._trtllm_pools`),
//!   matched to one hit ([`TrtllmScheduler::get_num_new_matched_tokens_capped`]) and held
//!   together ([`TrtllmScheduler::hold_finished`]).

// The engine's Python binding (`kvbm_connector._kvbm.TrtllmScheduler` / `TrtllmWorker`),
// built with `python` only; it alone in this folder uses the bindings' building blocks.
#[cfg(feature = "python")]
pub(crate) mod python;

use std::collections::HashMap;
use std::sync::Arc;

use crate::backends::StandardTiers;
use crate::config::Config;
use crate::connector::adapter::{ComputedPosition, ScheduledRequest, SchedulerStep};
use crate::connector::groups::KvCacheGroups;
use crate::connector::leader::{Leader, RequestInfo};
use crate::connector::transport::{LeaderTransport, WorkerTransport};
use crate::connector::worker::Worker;
use crate::connector::RequestId;
use crate::connector::{Blocking, Engine, NonBlocking};
use crate::error::{Error, Result};
use crate::identity::Token;
use crate::layout::{KvLayout, Layout, LayoutDims, LayoutKind};
use crate::tier::StorageTier;

use super::detect::{fmt_shape, inner_from_tail};

/// The parts of TensorRT-LLM's `LlmRequest` the connector reads.
#[derive(Debug, Clone, Copy)]
pub struct LlmRequest<'a> {
    /// `request.request_id`.
    pub request_id: u64,
    /// `request.get_tokens(0)`: prompt and generated tokens so far.
    pub tokens: &'a [Token],
    /// Cache salt (tenant isolation), if the request has one.
    pub cache_salt: Option<&'a str>,
    /// LoRA adapter name, if any.
    pub lora_name: Option<&'a str>,
}

/// TensorRT-LLM's `RequestData`: one request in the scheduler output.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestData {
    /// The request id.
    pub request_id: u64,
    /// Tokens new since the request last appeared (all tokens the first time).
    pub new_tokens: Vec<Token>,
    /// Device blocks allocated since the request last appeared.
    pub new_block_ids: Vec<usize>,
    /// Position up to which the request's KV is computed.
    pub computed_position: usize,
    /// With several layer groups (`new_block_ids_by_layer_group`): each group's new pages, in
    /// layer-group order. Empty for a one-group model, whose pages are `new_block_ids`.
    pub new_block_ids_by_layer_group: Vec<Vec<usize>>,
}

/// TensorRT-LLM's `SchedulerOutput`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    /// Requests scheduled for the first time (each appears here once).
    pub new_requests: Vec<RequestData>,
    /// Requests scheduled before.
    pub cached_requests: Vec<RequestData>,
}

/// The TensorRT-LLM engine as the connector sees it: its adapter and its start-up order.
///
/// TensorRT-LLM builds its scheduler (rank 0) and its workers at once, and the engine is ready when
/// the workers are: the scheduler's barrier runs in the background, each worker's inline in
/// `register_kv_caches`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Trtllm;

impl Engine for Trtllm {
    type Adapter = ComputedPosition;
    type LeaderInit = NonBlocking;
    type WorkerInit = Blocking;
    /// TensorRT-LLM's `BAD_PAGE_INDEX` (-1: a block with no page in its layer group, before or
    /// behind a sliding window), which the Python layer passes as `usize::MAX`.
    const PLACEHOLDER_BLOCK: Option<usize> = Some(NO_PAGE);
}

/// The block id standing for TensorRT-LLM's `BAD_PAGE_INDEX` ([`Engine::PLACEHOLDER_BLOCK`]).
pub const NO_PAGE: usize = usize::MAX;

/// `KvCacheConnectorScheduler`.
#[derive(Debug)]
pub struct TrtllmScheduler {
    leader: Leader<ComputedPosition>,
    /// The model's one layer group: full attention, or a sliding window on every layer.
    groups: KvCacheGroups,
    /// Tokens the engine has reported per request through the scheduler output.
    reported: HashMap<u64, usize>,
    /// Prompt length per request, from its first match.
    prompt_len: HashMap<u64, usize>,
}

impl TrtllmScheduler {
    /// The scheduler side; its barrier runs in the background (non-blocking).
    pub fn new(
        config: Config,
        tokens_per_block: usize,
        transport: Arc<dyn LeaderTransport>,
    ) -> Result<Self> {
        let mut leader =
            Leader::new::<Trtllm>(ComputedPosition, config, tokens_per_block, transport)?;
        leader.set_tier_factory(StandardTiers::shared());
        Ok(Self {
            leader,
            groups: KvCacheGroups::default(),
            reported: HashMap::new(),
            prompt_len: HashMap::new(),
        })
    }

    /// The model's layer groups, in TensorRT-LLM's layer-group order, and how each attends: a
    /// sliding-window group's hit needs only the window before it (the engine's
    /// `BAD_PAGE_INDEX` pages before it), and it stores only the windows a later hit needs (see
    /// [`crate::connector::groups`]); each group of a request is served under its own id and
    /// keys. Set before the first request. Errors: requests already seen.
    pub fn set_layer_groups(&mut self, groups: KvCacheGroups) -> Result<()> {
        self.leader
            .check_groups_change(&self.groups, &groups, "layer groups")?;
        self.groups = groups;
        Ok(())
    }

    /// The model's layer groups.
    pub fn layer_groups(&self) -> &KvCacheGroups {
        &self.groups
    }

    /// A flat call's block list as per-group lists: the list itself for a one-group model; with
    /// several groups TensorRT-LLM makes a flat call only for a request with no KV (an empty
    /// list: every group's list empty), and anything else is refused by the group count.
    fn flat_lists(&self, block_ids: &[usize]) -> Vec<Vec<usize>> {
        if self.groups.len() > 1 && block_ids.is_empty() {
            vec![Vec::new(); self.groups.len()]
        } else {
            vec![block_ids.to_vec()]
        }
    }

    /// The per-group lists of `request`, checked against the model's group count.
    fn check_lists(&self, request_id: u64, what: &str, lists: &[Vec<usize>]) -> Result<()> {
        if lists.len() != self.groups.len() {
            return Err(Error::invalid_argument(format!(
                "request {request_id}: {what} has {} layer-group lists; the model has {} layer groups",
                lists.len(),
                self.groups.len()
            ))
            .with("request", request_id));
        }
        Ok(())
    }

    /// The core leader (metrics, status).
    pub fn leader(&self) -> &Leader<ComputedPosition> {
        &self.leader
    }

    /// Mutable access to the core leader.
    pub fn leader_mut(&mut self) -> &mut Leader<ComputedPosition> {
        &mut self.leader
    }

    /// `get_num_new_matched_tokens(request, num_computed_tokens) -> (num_tokens, load_async)`.
    pub fn get_num_new_matched_tokens(
        &mut self,
        request: &LlmRequest<'_>,
        num_computed_tokens: usize,
    ) -> Result<(usize, bool)> {
        self.get_num_new_matched_tokens_capped(request, num_computed_tokens, None)
    }

    /// [`TrtllmScheduler::get_num_new_matched_tokens`] with the hit at most `cap` tokens beyond
    /// `num_computed_tokens` (`None`: no cap). Layer groups in pools of their own are served by
    /// one scheduler per pool: the request is matched in every pool, then each again capped at
    /// the smallest hit, so every pool loads the same tokens (the Python layer's
    /// `kvbm_connector._trtllm_pools`). Matching again replaces the request's staging.
    pub fn get_num_new_matched_tokens_capped(
        &mut self,
        request: &LlmRequest<'_>,
        num_computed_tokens: usize,
        cap: Option<usize>,
    ) -> Result<(usize, bool)> {
        self.prompt_len
            .entry(request.request_id)
            .or_insert(request.tokens.len());
        // An unaligned count (partial reuse of a device block) matches nothing: the leader
        // answers (0, false) for it, and still tracks the request.
        let id = RequestId::from(request.request_id);
        let m = self.leader.match_groups_capped(
            &self.groups,
            RequestInfo {
                id: &id,
                tokens: request.tokens,
                cache_salt: request.cache_salt,
                lora_name: request.lora_name,
            },
            0,
            num_computed_tokens,
            cap,
        )?;
        Ok((m.external_tokens, m.load_async))
    }

    /// `update_state_after_alloc(request, block_ids)`: uses the count remembered from the match.
    /// A model with several layer groups takes [`TrtllmScheduler::update_state_after_alloc_by_layer_group`].
    pub fn update_state_after_alloc(
        &mut self,
        request: &LlmRequest<'_>,
        block_ids: &[usize],
    ) -> Result<()> {
        let lists = self.flat_lists(block_ids);
        self.update_state_after_alloc_by_layer_group(request, &lists)
    }

    /// `update_state_after_alloc_by_layer_group(request, block_ids_by_layer_group)`: one page
    /// list per layer group (every group loads the count remembered from the match).
    pub fn update_state_after_alloc_by_layer_group(
        &mut self,
        request: &LlmRequest<'_>,
        lists: &[Vec<usize>],
    ) -> Result<()> {
        self.check_lists(request.request_id, "block_ids_by_layer_group", lists)?;
        let real = request.request_id.to_string();
        for (g, blocks) in lists.iter().enumerate() {
            let id = KvCacheGroups::request_id(&real, g);
            // What the match staged for this group (every group was trimmed to one count).
            let external = self.leader.staged_match(&id).external_tokens;
            self.leader
                .update_state_after_alloc(&id, blocks, external)?;
        }
        Ok(())
    }

    /// `build_connector_meta(scheduler_output) -> bytes`.
    pub fn build_connector_meta(&mut self, output: &SchedulerOutput) -> Result<Vec<u8>> {
        let mut step = SchedulerStep::default();
        for (data, new) in output
            .new_requests
            .iter()
            .map(|d| (d, true))
            .chain(output.cached_requests.iter().map(|d| (d, false)))
        {
            let first = if new {
                0
            } else {
                self.reported.get(&data.request_id).copied().unwrap_or(0)
            };
            let lists: &[Vec<usize>] = if self.groups.len() == 1 {
                std::slice::from_ref(&data.new_block_ids)
            } else {
                self.check_lists(
                    data.request_id,
                    "new_block_ids_by_layer_group",
                    &data.new_block_ids_by_layer_group,
                )?;
                &data.new_block_ids_by_layer_group
            };
            let real = data.request_id.to_string();
            for (g, blocks) in lists.iter().enumerate() {
                step.requests.push(ScheduledRequest {
                    request_id: KvCacheGroups::request_id(&real, g),
                    new_tokens: data.new_tokens.clone(),
                    first_token_index: Some(first),
                    new_block_ids: blocks.clone(),
                    // A request's first appearance carries its whole block list.
                    replace_block_ids: new,
                    num_computed_tokens: data.computed_position,
                    num_scheduled_tokens: None,
                    computed_position: Some(data.computed_position),
                });
            }
        }
        let bytes = self.leader.build_connector_meta(&step)?;
        for (data, new) in output
            .new_requests
            .iter()
            .map(|d| (d, true))
            .chain(output.cached_requests.iter().map(|d| (d, false)))
        {
            let e = self.reported.entry(data.request_id).or_insert(0);
            if new {
                *e = 0;
            }
            *e += data.new_tokens.len();
        }
        Ok(bytes)
    }

    /// `request_finished(request, cache_block_ids) -> bool`: true while stores (or loads) on the
    /// request's device blocks are in flight; the engine frees them once every worker returned the
    /// id from `get_finished`.
    pub fn request_finished(
        &mut self,
        request: &LlmRequest<'_>,
        cache_block_ids: &[usize],
    ) -> Result<bool> {
        let lists = self.flat_lists(cache_block_ids);
        self.request_finished_by_layer_group(request, &lists)
    }

    /// `request_finished_by_layer_group(request, cache_block_ids_by_layer_group) -> bool`: as
    /// [`TrtllmScheduler::request_finished`] for every layer group; true while any group's
    /// operations are in flight.
    pub fn request_finished_by_layer_group(
        &mut self,
        request: &LlmRequest<'_>,
        lists: &[Vec<usize>],
    ) -> Result<bool> {
        self.check_lists(request.request_id, "cache_block_ids_by_layer_group", lists)?;
        self.reported.remove(&request.request_id);
        let prompt_len = self.prompt_len.remove(&request.request_id);
        // Once a token was generated, every token but the last has its KV computed. A request
        // that ends before that (aborted while loading or mid-prefill) has computed only what its
        // last computed_position said: let the leader use that.
        let computed = match prompt_len {
            Some(p) if request.tokens.len() > p => Some(request.tokens.len() - 1),
            _ => None,
        };
        // TensorRT-LLM builds no metadata while nothing is scheduled: the request's last stores
        // and its hold go to the workers at once (ordered after the last metadata built).
        let real = request.request_id.to_string();
        let mut held = false;
        for g in 0..self.groups.len() {
            let id = KvCacheGroups::request_id(&real, g);
            held |= self
                .leader
                .request_finished_now(&id, Some(request.tokens), computed)?;
        }
        Ok(held)
    }
}

impl TrtllmScheduler {
    /// Holds finished request `request_id`'s pages in every layer group of this scheduler on
    /// every worker although [`TrtllmScheduler::request_finished_by_layer_group`] answered false:
    /// another pool's scheduler holds the request, and TensorRT-LLM frees its pages once every
    /// worker returned it from `get_finished`, so each pool's workers must report it (see
    /// [`Leader::hold_finished_now`]). Errors: a request still tracked here.
    pub fn hold_finished(&mut self, request_id: u64) -> Result<()> {
        let real = request_id.to_string();
        for g in 0..self.groups.len() {
            self.leader
                .hold_finished_now(&KvCacheGroups::request_id(&real, g))?;
        }
        Ok(())
    }
}

/// `KvCacheConnectorWorker`.
#[derive(Debug)]
pub struct TrtllmWorker {
    worker: Worker,
    tokens_per_block: usize,
    num_layers: usize,
    saved_this_iteration: bool,
    /// Layer groups sharing the registered pool (1: the model's one group).
    groups: usize,
    /// The model's layers (`save_kv_layer`'s indices) when several groups share the pool, whose
    /// tensor holds one group's layers; else the tensor's.
    model_layers: Option<usize>,
}

impl TrtllmWorker {
    /// A worker of rank `transport.rank()` among `world_size`; its barrier runs inline (blocking)
    /// in [`TrtllmWorker::register_kv_caches`], which returns once the scheduler is ready too.
    pub fn new(
        config: Config,
        tokens_per_block: usize,
        world_size: usize,
        transport: Arc<dyn WorkerTransport>,
    ) -> Result<Self> {
        if tokens_per_block == 0 {
            return Err(Error::invalid_argument(
                "tokens_per_block must be at least 1",
            ));
        }
        Ok(Self {
            worker: Worker::new::<Trtllm>(config, world_size, transport, StandardTiers::shared())?,
            tokens_per_block,
            num_layers: 0,
            saved_this_iteration: false,
            groups: 1,
            model_layers: None,
        })
    }

    /// Several layer groups share the registered pool (TensorRT-LLM's KV cache manager V2 puts
    /// groups whose pages are the same size in one pool group, with disjoint live pages): a
    /// request is reported done once every group is, and `save_kv_layer` counts the model's
    /// `num_model_layers`. Errors: no group, more than
    /// [`MAX_KV_CACHE_GROUPS`](crate::connector::groups::MAX_KV_CACHE_GROUPS), or no layer.
    pub fn set_layer_groups(&mut self, n: usize, num_model_layers: usize) -> Result<()> {
        let n = KvCacheGroups::full(n)?.len();
        if num_model_layers == 0 {
            return Err(Error::invalid_argument("a model has at least one layer"));
        }
        self.groups = n;
        self.model_layers = Some(num_model_layers);
        Ok(())
    }

    fn layer_count(&self) -> usize {
        self.model_layers.unwrap_or(self.num_layers)
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

    /// `register_kv_caches(kv_cache_tensor)`: the tensor's `shape` and element size, and the cache
    /// storage behind it. The layout read from the shape must be the storage's layout.
    pub fn register_kv_caches(
        &mut self,
        shape: &[usize],
        dtype_bytes: usize,
        cache: Arc<dyn StorageTier>,
    ) -> Result<()> {
        let layout = detect_trtllm(
            shape,
            dtype_bytes,
            self.tokens_per_block,
            Some(LayoutKind::FullyContiguous),
        )?;
        super::check_registered(&layout, cache.as_ref())?;
        self.num_layers = layout.dims().num_layers;
        self.worker.register(cache)
    }

    /// `bind_connector_meta(metadata)`.
    pub fn bind_connector_meta(&mut self, metadata: &[u8]) -> Result<()> {
        self.saved_this_iteration = false;
        self.worker.bind_metadata(metadata)
    }

    /// `start_load_kv(stream)`: loads run asynchronously.
    pub fn start_load_kv(&mut self) -> Result<()> {
        self.worker.start_load()
    }

    /// `wait_for_layer_load(layer_idx, stream)`: loads are asynchronous and finish before the
    /// engine schedules the request, so nothing to wait for; the index is checked.
    pub fn wait_for_layer_load(&mut self, layer_idx: usize) -> Result<()> {
        self.check_layer(layer_idx)
    }

    /// `save_kv_layer(layer_idx, stream)`: stores start after the last layer.
    pub fn save_kv_layer(&mut self, layer_idx: usize) -> Result<()> {
        self.check_layer(layer_idx)?;
        if layer_idx + 1 == self.layer_count() && !self.saved_this_iteration {
            self.saved_this_iteration = true;
            self.worker.save()?;
        }
        Ok(())
    }

    /// `wait_for_save(stream)`: starts the stores if the last layer did not; does not block on them.
    pub fn wait_for_save(&mut self) -> Result<()> {
        if !self.saved_this_iteration {
            self.saved_this_iteration = true;
            self.worker.save()?;
        }
        Ok(())
    }

    /// `get_finished(finished_gen_req_ids, started_loading_req_ids) -> (saved, loaded)`.
    pub fn get_finished(
        &mut self,
        finished_gen_req_ids: &[u64],
        started_loading_req_ids: &[u64],
    ) -> (Vec<u64>, Vec<u64>) {
        let n = self.groups;
        let ids = |v: &[u64]| -> Vec<RequestId> {
            v.iter()
                .flat_map(|&i| (0..n).map(move |g| KvCacheGroups::request_id(&i.to_string(), g)))
                .collect()
        };
        let (finished, loading) = (ids(finished_gen_req_ids), ids(started_loading_req_ids));
        let (mut saved, mut loaded) = self.worker.get_finished(&finished, Some(&loading));
        if n > 1 {
            let w = &self.worker;
            saved = crate::connector::groups::whole_requests(saved, n, |id| w.tracks(id));
            loaded = crate::connector::groups::whole_requests(loaded, n, |id| w.load_pending(id));
        }
        let to_u64 = |v: Vec<RequestId>| -> Vec<u64> {
            let mut out: Vec<u64> = v.iter().filter_map(|id| id.as_str().parse().ok()).collect();
            out.sort_unstable();
            out
        };
        (to_u64(saved), to_u64(loaded))
    }

    /// Device blocks whose load failed (recompute them). TensorRT-LLM's connector API has no call
    /// for this in the version targeted; an integration should poll it after `get_finished`.
    pub fn get_block_ids_with_load_errors(&mut self) -> Vec<usize> {
        self.worker.take_load_errors()
    }

    /// The layers `save_kv_layer` counts (the model's, with several layer groups; else the
    /// registered cache's): the last one's save submits the stores. 0 before registration.
    pub fn num_layers(&self) -> usize {
        self.layer_count()
    }

    fn check_layer(&self, layer_idx: usize) -> Result<()> {
        if layer_idx >= self.layer_count() {
            return Err(Error::out_of_range("layer", layer_idx, self.layer_count()));
        }
        Ok(())
    }
}

/// Layout of TensorRT-LLM's single registered cache tensor
/// `[num_blocks, num_layers, outer_dim, ...]` (trailing dims hold `page_size × inner_dim` elements).
///
/// `override_kind`, when given, must be [`LayoutKind::FullyContiguous`]: a single tensor cannot be
/// read as layer separate.
pub fn detect_trtllm(
    shape: &[usize],
    dtype_bytes: usize,
    page_size: usize,
    override_kind: Option<LayoutKind>,
) -> Result<Layout> {
    if shape.len() < 4 {
        return Err(Error::invalid_layout(format!(
            "TensorRT-LLM cache tensor must be [num_blocks, num_layers, outer_dim, ...], got {}",
            fmt_shape(shape)
        )));
    }
    if let Some(k) = override_kind {
        if k != LayoutKind::FullyContiguous {
            return Err(Error::invalid_layout(format!(
                "layout override {k} contradicts the single tensor of shape {}, which is fully_contiguous",
                fmt_shape(shape)
            )));
        }
    }
    let dims = LayoutDims {
        num_layers: shape[1],
        outer_dim: shape[2],
        page_size,
        inner_dim: inner_from_tail(&shape[3..], page_size, shape)?,
        dtype_bytes,
    };
    if !matches!(dims.outer_dim, 1 | 2) {
        return Err(Error::invalid_layout(format!(
            "outer_dim (dim 2 of {}) must be 1 or 2, got {}",
            fmt_shape(shape),
            dims.outer_dim
        )));
    }
    Layout::fully_contiguous(dims, shape[0])
}
