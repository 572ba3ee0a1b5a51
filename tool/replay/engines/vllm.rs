//! vLLM as the replay imitates it: continuous batching with device blocks allocated on demand and
//! preemption of the newest running request when they run out; a `SchedulerOutput` per step (new
//! and cached requests, scheduled tokens, last step's finished ids, preempted ids); asynchronous
//! loads (`WAITING_FOR_REMOTE_KVS`) followed by a second `update_state_after_alloc` with 0;
//! `request_finished` holding blocks until the workers report `finished_sending`. Its cache is
//! layer-separate with K and V outermost; the workers register non-blocking, then the scheduler
//! starts blocking.

use std::collections::HashSet;
use std::sync::Arc;

use kvbm_connector::config::Config;
use kvbm_connector::connector::groups::{AttentionKind, KvCacheGroups};
use kvbm_connector::connector::transport::{LeaderTransport, WorkerTransport};
use kvbm_connector::connector::worker::{TierFactory, Worker};
use kvbm_connector::connector::RequestId;
use kvbm_connector::error::Result;
use kvbm_connector::frameworks::vllm::{
    NewRequestData, Request, SchedulerOutput, VllmScheduler, VllmWorker,
};
use kvbm_connector::layout::{BlockOrder, Layout, LayoutDims};
use kvbm_connector::tier::StorageTier;

use super::{CallOrder, LeaderCalls, SchedulerSide, SimEngine, WorkerSide};
use crate::replay::messages::StepReply;
use crate::replay::report::Timings;
use crate::replay::request::Req;

/// vLLM.
pub struct Vllm;

/// Name of layer `l` in the simulated vLLM model.
fn layer_name(l: usize) -> String {
    format!("model.layers.{l}.self_attn.attn")
}

impl SimEngine for Vllm {
    fn workers_first(&self) -> bool {
        true
    }

    fn scheduler(
        &self,
        config: Config,
        block_size: usize,
        transport: Arc<dyn LeaderTransport>,
        groups: &[AttentionKind],
    ) -> Result<Box<dyn SchedulerSide>> {
        let mut sched = VllmScheduler::new(config, block_size, transport)?;
        if groups != [AttentionKind::Full] {
            // The hybrid KV-cache manager's groups (or one group whose layers all slide): each
            // matched and stored by its kind.
            sched.set_kv_cache_group_kinds(KvCacheGroups::new(groups.to_vec())?)?;
        }
        Ok(Box::new(Scheduler {
            sched,
            finished_last_step: HashSet::new(),
            pending_preempted: Vec::new(),
            finished_for_worker: HashSet::new(),
        }))
    }

    fn cache_layout(&self, dims: LayoutDims, blocks: usize) -> Result<Layout> {
        Layout::layer_separate(dims, blocks, BlockOrder::OuterMajor)
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
        let layer_names: Vec<String> = (0..d.num_layers).map(layer_name).collect();
        let mut w = VllmWorker::new(config, d.page_size, world_size, transport)?;
        let tiers = match tiers {
            Some(t) => t,
            None => super::tier_factory()?,
        };
        w.worker_mut().set_tier_factory(tiers)?;
        w.set_kv_cache_groups(groups)?;
        let layers: Vec<(String, Vec<usize>)> = layer_names
            .iter()
            .map(|n| (n.clone(), vec![2, blocks, d.page_size, d.inner_dim]))
            .collect();
        w.register_kv_caches(&layers, d.dtype_bytes, Some(blocks), None, device)?;
        Ok(Box::new(Rank { w, layer_names }))
    }
}

/// The scheduler side, with what the next scheduler output and `get_finished` carry.
struct Scheduler {
    sched: VllmScheduler,
    /// Ids finished last step (the next scheduler output carries them).
    finished_last_step: HashSet<String>,
    /// Requests preempted since the last scheduler output.
    pending_preempted: Vec<String>,
    /// The finished ids of this step's scheduler output, for the workers' `get_finished`.
    finished_for_worker: HashSet<String>,
}

fn request(r: &Req, num_computed_tokens: usize) -> Request<'_> {
    Request {
        request_id: &r.id,
        all_token_ids: &r.tokens,
        cache_salt: None,
        lora_name: None,
        num_computed_tokens,
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
        r.id.as_str().into()
    }

    fn blocks_at_admission(&self, r: &Req, block_size: usize) -> usize {
        r.tokens.len().div_ceil(block_size)
    }

    fn preempts(&self) -> bool {
        true
    }

    fn call_order(&self) -> CallOrder {
        CallOrder::EveryStep
    }

    fn get_num_new_matched_tokens(
        &mut self,
        r: &Req,
        local: usize,
        timings: &mut Timings,
    ) -> Result<Option<usize>> {
        let req = request(r, local);
        let sched = &mut self.sched;
        let (n, _) = timings.time("get_num_new_matched_tokens", || {
            sched.get_num_new_matched_tokens(&req, local)
        })?;
        Ok(n)
    }

    fn update_state_after_alloc(
        &mut self,
        r: &Req,
        external: usize,
        timings: &mut Timings,
    ) -> Result<()> {
        let req = request(r, r.computed);
        let sched = &mut self.sched;
        timings.time("update_state_after_alloc", || {
            sched.update_state_after_alloc(&req, &r.blocks, external)
        })
    }

    fn load_started(&mut self, _r: &Req) {}

    fn load_finished(&mut self, r: &Req, timings: &mut Timings) -> Result<()> {
        self.update_state_after_alloc(r, 0, timings)
    }

    fn preempted(&mut self, r: &Req, had_run: bool) {
        // Only a request the engine ran is "preempted" for the connector; one admitted this step
        // and put back before it ran is simply matched again when it is next admitted.
        if had_run {
            self.pending_preempted.push(r.id.clone());
        }
    }

    fn build_connector_meta(
        &mut self,
        reqs: &mut [Req],
        scheduled: &[(usize, usize)],
        timings: &mut Timings,
    ) -> Result<Vec<u8>> {
        let mut out = SchedulerOutput {
            finished_req_ids: std::mem::take(&mut self.finished_last_step),
            ..Default::default()
        };
        for p in self.pending_preempted.drain(..) {
            out.preempted_req_ids.insert(p);
        }
        for &(i, n) in scheduled {
            let r = &mut reqs[i];
            out.num_scheduled_tokens.insert(r.id.clone(), n);
            if !r.announced {
                r.announced = true;
                r.sent_blocks = r.table_len();
                out.scheduled_new_reqs.push(NewRequestData {
                    req_id: r.id.clone(),
                    prompt_token_ids: r.tokens.clone(),
                    first_token_index: 0,
                    block_ids: r.blocks.clone(),
                    num_computed_tokens: r.computed,
                });
            } else {
                let c = &mut out.scheduled_cached_reqs;
                c.req_ids.push(r.id.clone());
                c.resumed_from_preemption.push(false);
                let lo = r.computed.min(r.tokens.len());
                let hi = (r.computed + n).min(r.tokens.len());
                c.new_token_ids.push(r.tokens[lo..hi].to_vec());
                let from = r.sent_blocks.min(r.table_len());
                r.sent_blocks = r.table_len();
                c.new_block_ids.push(if from == r.table_len() {
                    None
                } else {
                    Some(
                        r.blocks
                            .iter()
                            .map(|t| t[from.min(t.len())..].to_vec())
                            .collect(),
                    )
                });
                c.num_computed_tokens.push(r.computed);
            }
        }
        self.finished_for_worker = out.finished_req_ids.clone();
        let sched = &mut self.sched;
        timings.time("build_connector_meta", || sched.build_connector_meta(&out))
    }

    fn request_finished(&mut self, r: &Req, timings: &mut Timings) -> Result<bool> {
        let req = request(r, r.computed);
        let sched = &mut self.sched;
        let (held, _) = timings.time("request_finished", || {
            sched.request_finished(&req, r.blocks.first().map_or(&[][..], Vec::as_slice))
        })?;
        self.finished_last_step.insert(r.id.clone());
        Ok(held)
    }

    fn worker_finished_lists(&mut self) -> (Vec<String>, Vec<String>) {
        let mut f: Vec<String> = std::mem::take(&mut self.finished_for_worker)
            .into_iter()
            .collect();
        f.sort();
        (f, Vec::new())
    }
}

/// One rank's vLLM worker, with the layer names its per-layer calls take.
struct Rank {
    w: VllmWorker,
    layer_names: Vec<String>,
}

/// The name of layer `l` ("" past the last layer: the worker rejects it).
fn name_of(names: &[String], l: usize) -> &str {
    names.get(l).map_or("", String::as_str)
}

impl WorkerSide for Rank {
    fn worker(&self) -> &Worker {
        self.w.worker()
    }

    fn bind_connector_meta(&mut self, metadata: &[u8]) -> Result<()> {
        self.w.bind_connector_metadata(metadata)
    }

    fn start_load_kv(&mut self) -> Result<()> {
        self.w.start_load_kv()
    }

    fn wait_for_layer_load(&mut self, layer: usize) -> Result<()> {
        self.w
            .wait_for_layer_load(name_of(&self.layer_names, layer))
    }

    fn save_kv_layer(&mut self, layer: usize) -> Result<()> {
        self.w.save_kv_layer(name_of(&self.layer_names, layer))
    }

    fn wait_for_save(&mut self) -> Result<()> {
        self.w.wait_for_save()
    }

    fn get_finished(
        &mut self,
        finished: &[String],
        _started_loading: &[String],
    ) -> Result<StepReply> {
        let finished: HashSet<String> = finished.iter().cloned().collect();
        let (sending, recving) = self.w.get_finished(&finished);
        let mut errors: Vec<usize> = self
            .w
            .get_block_ids_with_load_errors()
            .into_iter()
            .collect();
        errors.sort_unstable();
        self.w.clear_connector_metadata()?;
        let sorted = |s: Option<HashSet<String>>| -> Vec<String> {
            let mut v: Vec<String> = s.unwrap_or_default().into_iter().collect();
            v.sort();
            v
        };
        Ok(StepReply {
            released: sorted(sending),
            loaded: sorted(recving),
            load_errors: errors,
        })
    }
}
