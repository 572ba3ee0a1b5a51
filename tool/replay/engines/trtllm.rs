//! TensorRT-LLM as the replay imitates it: device blocks for prompt and output reserved at
//! admission (guaranteed no evict), context chunks then generation reported as `RequestData` with
//! `computed_position` (a request's first appearance after an asynchronous load already counts the
//! loaded tokens), `get_finished(finished_gen_req_ids, started_loading_req_ids)` with each id
//! passed once, and the manager's call order ([`CallOrder::Manager`]): `request_finished` after the
//! iteration's metadata and `wait_for_save`, before `get_finished`; nothing scheduled, only
//! `get_finished`. Its cache is fully contiguous; the scheduler starts non-blocking, the workers
//! register blocking.

use std::sync::Arc;

use kvbm_connector::config::Config;
use kvbm_connector::connector::groups::{AttentionKind, KvCacheGroups};
use kvbm_connector::connector::transport::{LeaderTransport, WorkerTransport};
use kvbm_connector::connector::worker::{TierFactory, Worker};
use kvbm_connector::connector::RequestId;
use kvbm_connector::error::Result;
use kvbm_connector::frameworks::trtllm::{
    LlmRequest, RequestData, SchedulerOutput, TrtllmScheduler, TrtllmWorker, NO_PAGE,
};
use kvbm_connector::layout::{Layout, LayoutDims};
use kvbm_connector::tier::StorageTier;

use super::{CallOrder, LeaderCalls, SchedulerSide, SimEngine, WorkerSide};
use crate::replay::messages::StepReply;
use crate::replay::report::Timings;
use crate::replay::request::Req;
use crate::replay::simulator::schedule::NULL_BLOCK;

/// TensorRT-LLM.
pub struct TensorRtLlm;

impl SimEngine for TensorRtLlm {
    fn workers_first(&self) -> bool {
        false
    }

    fn scheduler(
        &self,
        config: Config,
        block_size: usize,
        transport: Arc<dyn LeaderTransport>,
        groups: &[AttentionKind],
    ) -> Result<Box<dyn SchedulerSide>> {
        let mut sched = TrtllmScheduler::new(config, block_size, transport)?;
        if groups != [AttentionKind::Full] {
            // Layer groups in one pool (KV cache manager V2), each matched and stored by its
            // kind; a sliding group's pages before its window are BAD_PAGE_INDEX in its list.
            sched.set_layer_groups(KvCacheGroups::new(groups.to_vec())?)?;
        }
        Ok(Box::new(Scheduler {
            sched,
            new_saving: Vec::new(),
            new_loading: Vec::new(),
            windowed: groups
                .iter()
                .any(|k| matches!(k, AttentionKind::SlidingWindow { .. })),
            groups: groups.len(),
        }))
    }

    fn cache_layout(&self, dims: LayoutDims, blocks: usize) -> Result<Layout> {
        Layout::fully_contiguous(dims, blocks)
    }

    fn worker(
        &self,
        config: Config,
        d: LayoutDims,
        blocks: usize,
        world_size: usize,
        groups: usize,
        transport: Arc<dyn WorkerTransport>,
        device: Arc<dyn StorageTier>,
        tiers: Option<Arc<dyn TierFactory>>,
    ) -> Result<Box<dyn WorkerSide>> {
        let mut w = TrtllmWorker::new(config, d.page_size, world_size, transport)?;
        let tiers = match tiers {
            Some(t) => t,
            None => super::tier_factory()?,
        };
        w.worker_mut().set_tier_factory(tiers)?;
        if groups > 1 {
            // Every group's layers are views of the one registered pool.
            w.set_layer_groups(groups, d.num_layers)?;
        }
        w.register_kv_caches(
            &[blocks, d.num_layers, 2, d.page_size * d.inner_dim],
            d.dtype_bytes,
            device,
        )?;
        Ok(Box::new(w))
    }
}

/// The scheduler side, with the ids `get_finished` is told about once.
struct Scheduler {
    sched: TrtllmScheduler,
    /// Newly finished with saving, for the next `get_finished`.
    new_saving: Vec<u64>,
    /// Newly loading, for the next `get_finished`.
    new_loading: Vec<u64>,
    /// A sliding window: the simulator's null block is TensorRT-LLM's `BAD_PAGE_INDEX`.
    windowed: bool,
    /// Layer groups (more than one: the `*_by_layer_group` calls).
    groups: usize,
}

impl Scheduler {
    /// Every group's page list from block position `from` on.
    fn lists(&self, r: &Req, from: usize) -> Vec<Vec<usize>> {
        r.blocks
            .iter()
            .map(|t| self.pages(&t[from.min(t.len())..]))
            .collect()
    }

    /// A block list as TensorRT-LLM passes it: with a window, no page before it.
    fn pages(&self, blocks: &[usize]) -> Vec<usize> {
        if !self.windowed {
            return blocks.to_vec();
        }
        blocks
            .iter()
            .map(|&b| if b == NULL_BLOCK { NO_PAGE } else { b })
            .collect()
    }
}

fn llm_request(r: &Req) -> LlmRequest<'_> {
    LlmRequest {
        request_id: r.num_id,
        tokens: &r.tokens,
        cache_salt: None,
        lora_name: None,
    }
}

impl SchedulerSide for Scheduler {
    fn leader(&self) -> &dyn LeaderCalls {
        self.sched.leader()
    }

    fn leader_mut(&mut self) -> &mut dyn LeaderCalls {
        self.sched.leader_mut()
    }

    fn request_id(&self, r: &Req) -> RequestId {
        r.num_id.into()
    }

    fn blocks_at_admission(&self, r: &Req, block_size: usize) -> usize {
        (r.prompt_len + r.max_tokens).div_ceil(block_size)
    }

    fn preempts(&self) -> bool {
        false
    }

    fn call_order(&self) -> CallOrder {
        CallOrder::Manager
    }

    fn get_num_new_matched_tokens(
        &mut self,
        r: &Req,
        local: usize,
        timings: &mut Timings,
    ) -> Result<Option<usize>> {
        let req = llm_request(r);
        let sched = &mut self.sched;
        let (n, _) = timings.time("get_num_new_matched_tokens", || {
            sched.get_num_new_matched_tokens(&req, local)
        })?;
        Ok(Some(n))
    }

    fn update_state_after_alloc(
        &mut self,
        r: &Req,
        _external: usize,
        timings: &mut Timings,
    ) -> Result<()> {
        // TensorRT-LLM calls it once per admission and passes no count.
        let req = llm_request(r);
        let lists = self.lists(r, 0);
        let by_group = self.groups > 1;
        let sched = &mut self.sched;
        timings.time("update_state_after_alloc", || match lists.first() {
            Some(pages) if !by_group => sched.update_state_after_alloc(&req, pages),
            _ => sched.update_state_after_alloc_by_layer_group(&req, &lists),
        })
    }

    fn load_started(&mut self, r: &Req) {
        self.new_loading.push(r.num_id);
    }

    fn load_finished(&mut self, _r: &Req, _timings: &mut Timings) -> Result<()> {
        Ok(())
    }

    fn preempted(&mut self, _r: &Req, _had_run: bool) {}

    fn build_connector_meta(
        &mut self,
        reqs: &mut [Req],
        scheduled: &[(usize, usize)],
        timings: &mut Timings,
    ) -> Result<Vec<u8>> {
        let mut out = SchedulerOutput::default();
        for &(i, _) in scheduled {
            let r = &mut reqs[i];
            let is_new = r.sent_tokens == 0 && r.sent_blocks == 0;
            // The context's current position: after an asynchronous load it counts the loaded
            // tokens, first appearance included (TensorRT-LLM leaves out only synchronously
            // loaded tokens, which this connector never asks for).
            let computed_position = if r.computed >= r.prompt_len {
                r.tokens.len().saturating_sub(1)
            } else {
                r.computed
            };
            let mut lists = self.lists(r, r.sent_blocks);
            let (new_block_ids, new_block_ids_by_layer_group) = if self.groups > 1 {
                (Vec::new(), lists)
            } else {
                (lists.pop().unwrap_or_default(), Vec::new())
            };
            let data = RequestData {
                request_id: r.num_id,
                new_tokens: r.tokens[r.sent_tokens..].to_vec(),
                new_block_ids,
                computed_position,
                new_block_ids_by_layer_group,
            };
            r.sent_tokens = r.tokens.len();
            r.sent_blocks = r.table_len();
            if is_new {
                out.new_requests.push(data);
            } else {
                out.cached_requests.push(data);
            }
        }
        let sched = &mut self.sched;
        timings.time("build_connector_meta", || sched.build_connector_meta(&out))
    }

    fn request_finished(&mut self, r: &Req, timings: &mut Timings) -> Result<bool> {
        let req = llm_request(r);
        let lists = self.lists(r, 0);
        let by_group = self.groups > 1;
        let sched = &mut self.sched;
        let held = timings.time("request_finished", || match lists.first() {
            Some(pages) if !by_group => sched.request_finished(&req, pages),
            _ => sched.request_finished_by_layer_group(&req, &lists),
        })?;
        if held {
            self.new_saving.push(r.num_id);
        }
        Ok(held)
    }

    fn worker_finished_lists(&mut self) -> (Vec<String>, Vec<String>) {
        let ids = |v: Vec<u64>| v.iter().map(u64::to_string).collect();
        (
            ids(std::mem::take(&mut self.new_saving)),
            ids(std::mem::take(&mut self.new_loading)),
        )
    }
}

impl WorkerSide for TrtllmWorker {
    fn worker(&self) -> &Worker {
        TrtllmWorker::worker(self)
    }

    fn bind_connector_meta(&mut self, metadata: &[u8]) -> Result<()> {
        TrtllmWorker::bind_connector_meta(self, metadata)
    }

    fn start_load_kv(&mut self) -> Result<()> {
        TrtllmWorker::start_load_kv(self)
    }

    fn wait_for_layer_load(&mut self, layer: usize) -> Result<()> {
        TrtllmWorker::wait_for_layer_load(self, layer)
    }

    fn save_kv_layer(&mut self, layer: usize) -> Result<()> {
        TrtllmWorker::save_kv_layer(self, layer)
    }

    fn wait_for_save(&mut self) -> Result<()> {
        TrtllmWorker::wait_for_save(self)
    }

    fn get_finished(
        &mut self,
        finished: &[String],
        started_loading: &[String],
    ) -> Result<StepReply> {
        let ids = |v: &[String]| -> Vec<u64> { v.iter().filter_map(|s| s.parse().ok()).collect() };
        let (saved, loaded) =
            TrtllmWorker::get_finished(self, &ids(finished), &ids(started_loading));
        Ok(StepReply {
            released: saved.iter().map(u64::to_string).collect(),
            loaded: loaded.iter().map(u64::to_string).collect(),
            load_errors: self.get_block_ids_with_load_errors(),
        })
    }
}
