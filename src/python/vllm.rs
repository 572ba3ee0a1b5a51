//! `VllmScheduler` and `VllmWorker`: [`crate::frameworks::vllm`] over plain Python values.
//! `kvbm_connector.vllm` reads vLLM's objects into these calls.

use std::collections::{HashMap, HashSet};

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::cache::register_cache;
use super::tensor::{parse_layout_kind, read_layer_tensors, vllm_layout};
use super::transport::{PyLeaderTransport, PyWorkerTransport};
use super::{common, detached, Guarded, PyConfig};
use crate::frameworks::vllm::{
    CachedRequestData, NewRequestData, Request, SchedulerOutput, VllmScheduler, VllmWorker,
};

/// `(req_id, prompt_token_ids, block_ids, num_computed_tokens)`: vLLM's `NewRequestData`.
type NewTuple = (String, Vec<u32>, Vec<Vec<usize>>, usize);

/// `(req_ids, resumed_from_preemption, new_token_ids, new_block_ids, num_computed_tokens)`:
/// vLLM's `CachedRequestData` (parallel lists).
type CachedTuple = (
    Vec<String>,
    Vec<bool>,
    Vec<Vec<u32>>,
    Vec<Option<Vec<Vec<usize>>>>,
    Vec<usize>,
);

fn request<'a>(
    request_id: &'a str,
    all_token_ids: &'a [u32],
    cache_salt: Option<&'a str>,
    lora_name: Option<&'a str>,
    num_computed_tokens: usize,
) -> Request<'a> {
    Request {
        request_id,
        all_token_ids,
        cache_salt,
        lora_name,
        num_computed_tokens,
    }
}

/// The scheduler role of `KVConnectorBase_V1`. Its start-up barrier runs inline (vLLM's engine
/// definition, `frameworks::vllm::Vllm`): vLLM builds it after the workers registered their caches.
#[pyclass(module = "kvbm_connector._kvbm", name = "VllmScheduler", frozen)]
pub(crate) struct PyVllmScheduler {
    inner: Guarded<VllmScheduler>,
}

#[pymethods]
impl PyVllmScheduler {
    #[new]
    #[pyo3(signature = (config, block_size, transport))]
    fn new(
        py: Python<'_>,
        config: &PyConfig,
        block_size: usize,
        transport: &PyLeaderTransport,
    ) -> PyResult<Self> {
        let (config, transport) = (config.inner.clone(), transport.inner.clone());
        let s = detached(py, "VllmScheduler", move || {
            VllmScheduler::new(config, block_size, transport)
        })?;
        Ok(Self {
            inner: Guarded::new("VllmScheduler", s),
        })
    }

    /// `(num_external_tokens, load_async)`.
    #[pyo3(signature = (request_id, all_token_ids, num_computed_tokens, cache_salt=None, lora_name=None))]
    fn get_num_new_matched_tokens(
        &self,
        py: Python<'_>,
        request_id: String,
        all_token_ids: Vec<u32>,
        num_computed_tokens: usize,
        cache_salt: Option<String>,
        lora_name: Option<String>,
    ) -> PyResult<(Option<usize>, bool)> {
        self.inner.call(py, "get_num_new_matched_tokens", move |s| {
            s.get_num_new_matched_tokens(
                &request(
                    &request_id,
                    &all_token_ids,
                    cache_salt.as_deref(),
                    lora_name.as_deref(),
                    0,
                ),
                num_computed_tokens,
            )
        })
    }

    /// `block_ids`: one list per KV-cache group (`blocks.get_block_ids()`).
    fn update_state_after_alloc(
        &self,
        py: Python<'_>,
        request_id: String,
        block_ids: Vec<Vec<usize>>,
        num_external_tokens: usize,
    ) -> PyResult<()> {
        self.inner.call(py, "update_state_after_alloc", move |s| {
            s.update_state_after_alloc(
                &request(&request_id, &[], None, None, 0),
                &block_ids,
                num_external_tokens,
            )
        })
    }

    /// The metadata bytes of this step.
    fn build_connector_meta<'py>(
        &self,
        py: Python<'py>,
        scheduled_new_reqs: Vec<NewTuple>,
        scheduled_cached_reqs: CachedTuple,
        num_scheduled_tokens: HashMap<String, usize>,
        finished_req_ids: HashSet<String>,
        preempted_req_ids: HashSet<String>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (req_ids, resumed_from_preemption, new_token_ids, new_block_ids, num_computed_tokens) =
            scheduled_cached_reqs;
        let output = SchedulerOutput {
            scheduled_new_reqs: scheduled_new_reqs
                .into_iter()
                .map(
                    |(req_id, prompt_token_ids, block_ids, num_computed_tokens)| NewRequestData {
                        req_id,
                        prompt_token_ids,
                        block_ids,
                        num_computed_tokens,
                    },
                )
                .collect(),
            scheduled_cached_reqs: CachedRequestData {
                req_ids,
                resumed_from_preemption,
                new_token_ids,
                new_block_ids,
                num_computed_tokens,
            },
            num_scheduled_tokens,
            finished_req_ids,
            preempted_req_ids,
        };
        let bytes = self.inner.call(py, "build_connector_meta", move |s| {
            s.build_connector_meta(&output)
        })?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// True while operations on the request's device blocks are in flight.
    fn request_finished(
        &self,
        py: Python<'_>,
        request_id: String,
        all_token_ids: Vec<u32>,
        num_computed_tokens: usize,
        block_ids: Vec<usize>,
    ) -> PyResult<bool> {
        self.inner.call(py, "request_finished", move |s| {
            s.request_finished(
                &request(&request_id, &all_token_ids, None, None, num_computed_tokens),
                &block_ids,
            )
            .map(|(held, _)| held)
        })
    }

    /// `(external_tokens, load_async, host_tokens, disk_tokens)` of the most recent match: where
    /// the matched tokens are held.
    fn last_match(&self, py: Python<'_>) -> PyResult<(usize, bool, usize, usize)> {
        self.inner.call(py, "last_match", |s| {
            let m = s.leader().last_match();
            Ok((
                m.external_tokens,
                m.load_async,
                m.host_tokens,
                m.disk_tokens,
            ))
        })
    }

    /// Applies operation completions that arrived.
    fn update_connector_output(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.call(py, "update_connector_output", |s| {
            s.update_connector_output();
            Ok(())
        })
    }

    /// True once the start-up barrier completed; raises its error if it failed.
    fn is_ready(&self, py: Python<'_>) -> PyResult<bool> {
        self.inner
            .call(py, "is_ready", |s| common::leader_ready(s.leader_mut()))
    }

    /// Waits (GIL released) until the barrier completed; raises on failure or at the deadline.
    fn wait_ready(&self, py: Python<'_>, timeout_secs: f64) -> PyResult<()> {
        self.inner.call(py, "wait_ready", move |s| {
            common::wait_until(timeout_secs, "the scheduler's start-up barrier", || {
                common::leader_ready(s.leader_mut())
            })
        })
    }

    /// True while operations are in flight or queued.
    fn has_pending_work(&self, py: Python<'_>) -> PyResult<bool> {
        self.inner.call(py, "has_pending_work", |s| {
            Ok(s.leader().has_pending_work())
        })
    }

    /// The counters as JSON text.
    fn metrics_json(&self, py: Python<'_>) -> PyResult<String> {
        self.inner.call(py, "metrics_json", |s| {
            common::metrics_json(s.leader().metrics())
        })
    }

    /// The counters in Prometheus text format.
    fn metrics_prometheus(&self, py: Python<'_>) -> PyResult<String> {
        self.inner.call(py, "metrics_prometheus", |s| {
            Ok(s.leader().metrics().render_prometheus())
        })
    }
}

/// The worker role of `KVConnectorBase_V1`. Its barrier runs in the background after
/// `register_kv_caches` (vLLM's engine definition, `frameworks::vllm::Vllm`).
#[pyclass(module = "kvbm_connector._kvbm", name = "VllmWorker", frozen)]
pub(crate) struct PyVllmWorker {
    inner: Guarded<VllmWorker>,
    block_size: usize,
}

#[pymethods]
impl PyVllmWorker {
    #[new]
    #[pyo3(signature = (config, block_size, world_size, transport))]
    fn new(
        py: Python<'_>,
        config: &PyConfig,
        block_size: usize,
        world_size: usize,
        transport: &PyWorkerTransport,
    ) -> PyResult<Self> {
        let (config, transport) = (config.inner.clone(), transport.inner.clone());
        let w = detached(py, "VllmWorker", move || {
            VllmWorker::new(config, block_size, world_size, transport)
        })?;
        Ok(Self {
            inner: Guarded::new("VllmWorker", w),
            block_size,
        })
    }

    /// Registers the per-layer cache tensors (a dict layer name → tensor, in model order; CPU or
    /// CUDA memory, all on one device, kept alive). `num_blocks` (the engine's block count)
    /// settles which dimension is the block dimension; `layout` overrides the reading of the
    /// shapes and is refused if it contradicts them. Returns the `GpuCache` handle for CUDA
    /// tensors (the stream ordering), `None` for CPU tensors.
    #[pyo3(signature = (kv_caches, num_blocks=None, layout=None))]
    fn register_kv_caches(
        &self,
        py: Python<'_>,
        kv_caches: &Bound<'_, PyAny>,
        num_blocks: Option<usize>,
        layout: Option<&str>,
    ) -> PyResult<Option<Py<PyAny>>> {
        let override_kind = parse_layout_kind(py, layout)?;
        let tensors = read_layer_tensors(py, kv_caches)?;
        let l = vllm_layout(py, &tensors, self.block_size, num_blocks, override_kind)?;
        let layers: Vec<(String, Vec<usize>)> = tensors
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect();
        let itemsize = tensors[0].itemsize;
        let cache = register_cache(py, l, tensors)?;
        let tier = cache.tier;
        self.inner.call(py, "register_kv_caches", move |w| {
            w.register_kv_caches(&layers, itemsize, num_blocks, override_kind, tier)
        })?;
        Ok(cache.gpu)
    }

    /// Takes this step's metadata bytes.
    fn bind_connector_metadata(&self, py: Python<'_>, metadata: &[u8]) -> PyResult<()> {
        let metadata = metadata.to_vec();
        self.inner.call(py, "bind_connector_metadata", move |w| {
            w.bind_connector_metadata(&metadata)
        })
    }

    /// Drops this step's metadata.
    fn clear_connector_metadata(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.call(py, "clear_connector_metadata", |w| {
            w.clear_connector_metadata()
        })
    }

    /// Submits this step's loads.
    fn start_load_kv(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.call(py, "start_load_kv", |w| w.start_load_kv())
    }

    /// Checks the layer name (loads finish before vLLM schedules their request).
    fn wait_for_layer_load(&self, py: Python<'_>, layer_name: String) -> PyResult<()> {
        self.inner.call(py, "wait_for_layer_load", move |w| {
            w.wait_for_layer_load(&layer_name)
        })
    }

    /// Starts the stores after the last layer.
    fn save_kv_layer(&self, py: Python<'_>, layer_name: String) -> PyResult<()> {
        self.inner
            .call(py, "save_kv_layer", move |w| w.save_kv_layer(&layer_name))
    }

    /// Starts the stores if the last layer did not.
    fn wait_for_save(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.call(py, "wait_for_save", |w| w.wait_for_save())
    }

    /// `(finished_sending, finished_recving)`, `None` for an empty set.
    #[allow(clippy::type_complexity)]
    fn get_finished(
        &self,
        py: Python<'_>,
        finished_req_ids: HashSet<String>,
    ) -> PyResult<(Option<HashSet<String>>, Option<HashSet<String>>)> {
        self.inner.call(py, "get_finished", move |w| {
            Ok(w.get_finished(&finished_req_ids))
        })
    }

    /// Device blocks whose load failed since the last call.
    fn get_block_ids_with_load_errors(&self, py: Python<'_>) -> PyResult<HashSet<usize>> {
        self.inner.call(py, "get_block_ids_with_load_errors", |w| {
            Ok(w.get_block_ids_with_load_errors())
        })
    }

    /// True once the barrier completed; raises its error if it failed.
    fn is_ready(&self, py: Python<'_>) -> PyResult<bool> {
        self.inner
            .call(py, "is_ready", |w| common::worker_ready(w.worker()))
    }

    /// Waits (GIL released) until the barrier completed; raises on failure or at the deadline.
    fn wait_ready(&self, py: Python<'_>, timeout_secs: f64) -> PyResult<()> {
        self.inner.call(py, "wait_ready", move |w| {
            common::wait_until(timeout_secs, "the worker's start-up barrier", || {
                common::worker_ready(w.worker())
            })
        })
    }

    /// Waits (GIL released) until every submitted operation completed.
    fn wait_idle(&self, py: Python<'_>, timeout_secs: f64) -> PyResult<()> {
        self.inner.call(py, "wait_idle", move |w| {
            w.worker().wait_idle(common::secs(timeout_secs)?)
        })
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyVllmScheduler>()?;
    m.add_class::<PyVllmWorker>()?;
    Ok(())
}
