//! What differs between the simulated engines, behind one trait per process side.
//!
//! [`Framework`] names an engine (the `--framework` flag, the report's `framework`); the one
//! `match` on it is [`engine_of`], which hands out the engine's [`SimEngine`]. Everything
//! else the replay does is the same code for both engines, asking the engine's
//! [`SchedulerSide`] (in the scheduler process) or [`WorkerSide`] (in each rank) where they differ:
//!
//! | | TensorRT-LLM ([`trtllm`]) | vLLM ([`vllm`]) |
//! |---|---|---|
//! | device blocks at admission | prompt and output, reserved (never evicted) | the tokens so far; more on demand |
//! | out of device blocks | cannot happen (an error) | preempts the newest running request |
//! | start-up order | scheduler (non-blocking), then workers (blocking) | workers (non-blocking), then scheduler (blocking) |
//! | progress reported to the connector | `RequestData` with `computed_position` | `SchedulerOutput`: new / cached requests, scheduled tokens, finished, preempted |
//! | after a load | nothing | `update_state_after_alloc` again with 0 |
//! | worker's `get_finished` | finished-saving and started-loading ids, once each | last step's finished ids |
//! | call order ([`CallOrder`]) | metadata only with a non-empty batch; `request_finished` before the step's `get_finished`; nothing scheduled: `get_finished` only | metadata every step; `get_finished` before `request_finished` |
//! | first `computed_position` after a load | the loaded count (it counts the loaded tokens) | — |
//! | device cache layout | fully contiguous | layer-separate (K, V outer) |
//!
//! This module depends on the engine names and the request, report and message types only; the
//! simulator and the ranks depend on it, never the other way round.

pub mod trtllm;
pub mod vllm;

use std::sync::Arc;

use kvbm_connector::backends::faults::{FaultPlan, FaultyTiers, FAULTS_ENV};
use kvbm_connector::backends::StandardTiers;
use kvbm_connector::config::Config;
use kvbm_connector::connector::adapter::SchedulerAdapter;
use kvbm_connector::connector::groups::AttentionKind;
use kvbm_connector::connector::leader::{Leader, LeaderStatus, MatchResult};
use kvbm_connector::connector::lifecycle::RequestState;
use kvbm_connector::connector::metrics::MetricsSnapshot;
use kvbm_connector::connector::remote::RemoteStoreStats;
use kvbm_connector::connector::transport::{LeaderTransport, WorkerTransport};
use kvbm_connector::connector::worker::{TierFactory, Worker};
use kvbm_connector::connector::RequestId;
use kvbm_connector::error::{Error, Result};
use kvbm_connector::layout::{Layout, LayoutDims};
use kvbm_connector::tier::StorageTier;

use super::framework::Framework;
use super::messages::StepReply;
use super::report::Timings;
use super::request::Req;

/// The behaviour of the engine `framework` names.
pub fn engine_of(framework: Framework) -> &'static dyn SimEngine {
    match framework {
        Framework::Trtllm => &trtllm::TensorRtLlm,
        Framework::Vllm => &vllm::Vllm,
    }
}

/// How an engine orders the connector calls of one iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOrder {
    /// vLLM: every step builds metadata and runs the workers (the model runner calls
    /// `get_finished` right after the forward pass); the scheduler then finishes requests.
    EveryStep,
    /// TensorRT-LLM's executor loop and `KvCacheConnectorManager`: metadata is built, bound and
    /// its loads started only when the iteration's batch is not empty (the forward pass and
    /// `wait_for_save` only when a request computes); `request_finished` runs after that, then
    /// every worker's `get_finished`. An iteration with an empty batch calls `get_finished` only.
    Manager,
}

/// One simulated engine: how it starts its two sides and lays out its device cache.
pub trait SimEngine: Sync {
    /// True when the engine's workers register before its scheduler starts (vLLM: the workers
    /// non-blocking, then the scheduler blocking); false for the other order (TensorRT-LLM).
    fn workers_first(&self) -> bool;

    /// Starts the scheduler side over the leader's `transport`, for a model whose KV-cache
    /// groups are `groups` (`--layer-groups`; `[Full]` for a plain model).
    fn scheduler(
        &self,
        config: Config,
        block_size: usize,
        transport: Arc<dyn LeaderTransport>,
        groups: &[AttentionKind],
    ) -> Result<Box<dyn SchedulerSide>>;

    /// The layout of one rank's device cache of `blocks` blocks of `dims`.
    fn cache_layout(&self, dims: LayoutDims, blocks: usize) -> Result<Layout>;

    /// Starts one rank's worker over `transport` and registers `device` (of `blocks` blocks of
    /// `dims`, laid out as [`SimEngine::cache_layout`] says) as the engine registers its cache;
    /// `groups` KV-cache groups share it (layer `l` of every group is a view of the same
    /// memory, a block belonging to one group at a time). `tiers` builds its tiers instead of
    /// [`tier_factory`] when given.
    #[allow(clippy::too_many_arguments)]
    fn worker(
        &self,
        config: Config,
        dims: LayoutDims,
        blocks: usize,
        world_size: usize,
        groups: usize,
        transport: Arc<dyn WorkerTransport>,
        device: Arc<dyn StorageTier>,
        tiers: Option<Arc<dyn TierFactory>>,
    ) -> Result<Box<dyn WorkerSide>>;
}

/// The scheduler process of one engine: its block policy and its calls to the connector's leader,
/// with the per-step bookkeeping those calls need.
pub trait SchedulerSide: Send {
    /// The leader, for the calls both engines make alike.
    fn leader(&self) -> &dyn LeaderCalls;
    /// The leader, mutably.
    fn leader_mut(&mut self) -> &mut dyn LeaderCalls;

    /// The connector's id of `r` (also what the ranks report it as).
    fn request_id(&self, r: &Req) -> RequestId;

    /// Device blocks `r` takes at admission.
    fn blocks_at_admission(&self, r: &Req, block_size: usize) -> usize;

    /// True when the engine preempts the newest running request when device blocks run out;
    /// false when running out cannot happen (every block reserved at admission).
    fn preempts(&self) -> bool;

    /// How an iteration orders the connector calls.
    fn call_order(&self) -> CallOrder;

    /// `get_num_new_matched_tokens` for `r` with `local` tokens found in the device cache: tokens
    /// the connector will load, or `None`: not known yet (a remote lookup is running; vLLM
    /// keeps the request waiting and asks again next step).
    fn get_num_new_matched_tokens(
        &mut self,
        r: &Req,
        local: usize,
        timings: &mut Timings,
    ) -> Result<Option<usize>>;

    /// `update_state_after_alloc` for `r` at admission, `external` tokens to load.
    fn update_state_after_alloc(
        &mut self,
        r: &Req,
        external: usize,
        timings: &mut Timings,
    ) -> Result<()>;

    /// `r`'s load started.
    fn load_started(&mut self, r: &Req);

    /// `r`'s load finished; it rejoins the running batch.
    fn load_finished(&mut self, r: &Req, timings: &mut Timings) -> Result<()>;

    /// `r` was preempted; `had_run`: the engine had reported it to the connector.
    fn preempted(&mut self, r: &Req, had_run: bool);

    /// `build_connector_meta` for this step's `scheduled` (request index, tokens); records what
    /// the connector was told in each request.
    fn build_connector_meta(
        &mut self,
        reqs: &mut [Req],
        scheduled: &[(usize, usize)],
        timings: &mut Timings,
    ) -> Result<Vec<u8>>;

    /// `request_finished` for `r`: true while the connector holds its blocks (saving).
    fn request_finished(&mut self, r: &Req, timings: &mut Timings) -> Result<bool>;

    /// What the workers pass to `get_finished` this step: (finished, started loading).
    fn worker_finished_lists(&mut self) -> (Vec<String>, Vec<String>);
}

/// One rank of one engine: its calls to the connector's worker in the engine's order.
pub trait WorkerSide: Send {
    /// The core worker (readiness, idleness, statistics).
    fn worker(&self) -> &Worker;
    /// Binds the step's metadata.
    fn bind_connector_meta(&mut self, metadata: &[u8]) -> Result<()>;
    /// Starts the step's loads.
    fn start_load_kv(&mut self) -> Result<()>;
    /// Waits for layer `layer`'s loads.
    fn wait_for_layer_load(&mut self, layer: usize) -> Result<()>;
    /// Saves layer `layer`.
    fn save_kv_layer(&mut self, layer: usize) -> Result<()>;
    /// Waits for the step's saves.
    fn wait_for_save(&mut self) -> Result<()>;
    /// `get_finished` and the load errors: what this rank reports for the step.
    fn get_finished(
        &mut self,
        finished: &[String],
        started_loading: &[String],
    ) -> Result<StepReply>;
}

/// The leader calls the simulator makes the same way for both engines (the adapter type erased).
pub trait LeaderCalls {
    /// True once the start-up barrier finished.
    fn ready(&mut self) -> bool;
    /// The start-up error, if the barrier failed.
    fn init_error(&self) -> Option<Error>;
    /// Applies the workers' completions.
    fn apply_completions(&mut self);
    /// True while transfers are queued or in flight.
    fn pending_work(&self) -> bool;
    /// The leader's state of a request (diagnostics).
    fn state_of(&self, id: &RequestId) -> Option<RequestState>;
    /// The last match's split by tier.
    fn match_split(&self) -> MatchResult;
    /// The leader's counters.
    fn metrics(&self) -> MetricsSnapshot;
    /// The remote store's name and counters (the leader's store and every rank's, added), when
    /// the remote tier is on.
    fn remote_store(&self) -> Option<(String, RemoteStoreStats)>;
    /// Builds the remote store with `factory` (set before the connector is first asked
    /// whether it is ready, so the standard factory's store is never built).
    fn set_tier_factory(&mut self, factory: Arc<dyn TierFactory>);
}

impl<A: SchedulerAdapter> LeaderCalls for Leader<A> {
    fn ready(&mut self) -> bool {
        self.is_ready()
    }
    fn init_error(&self) -> Option<Error> {
        match self.status() {
            LeaderStatus::Failed(e) => Some(e),
            _ => None,
        }
    }
    fn apply_completions(&mut self) {
        self.process_completions();
    }
    fn pending_work(&self) -> bool {
        self.has_pending_work()
    }
    fn state_of(&self, id: &RequestId) -> Option<RequestState> {
        self.request_state(id)
    }
    fn match_split(&self) -> MatchResult {
        self.last_match()
    }
    fn metrics(&self) -> MetricsSnapshot {
        Leader::metrics(self).snapshot()
    }
    fn remote_store(&self) -> Option<(String, RemoteStoreStats)> {
        let store = Leader::remote_store(self)?;
        Some((store.describe(), self.remote_store_stats()?))
    }
    fn set_tier_factory(&mut self, factory: Arc<dyn TierFactory>) {
        Leader::set_tier_factory(self, factory);
    }
}

/// The factory of a rank's tiers: the standard one, wrapped in fault injection when
/// [`FAULTS_ENV`] (`KVBM_REPLAY_FAULTS`, a test hook) holds a fault plan
/// ([`FaultPlan::parse`]); a bad plan is an error naming the variable.
pub fn tier_factory() -> Result<Arc<dyn TierFactory>> {
    match std::env::var(FAULTS_ENV) {
        Ok(spec) if !spec.trim().is_empty() => Ok(Arc::new(FaultyTiers::new(
            StandardTiers::shared(),
            FaultPlan::parse(&spec)?,
        ))),
        _ => Ok(StandardTiers::shared()),
    }
}
