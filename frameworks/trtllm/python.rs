//! `TrtllmScheduler` and `TrtllmWorker`: [`crate::frameworks::trtllm`] over plain Python values.
//! `kvbm_connector.trtllm` reads TensorRT-LLM's objects into these calls.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::connector::groups::KvCacheGroups;
use crate::frameworks::trtllm::detect_trtllm;
use crate::frameworks::trtllm::{
    LlmRequest, RequestData, SchedulerOutput, TrtllmScheduler, TrtllmWorker,
};
use crate::layout::LayoutKind;
use crate::python::cache::register_cache;
use crate::python::tensor::read_tensor;
use crate::python::transport::{PyLeaderTransport, PyWorkerTransport};
use crate::python::{common, detached, to_py_err, Guarded, PyConfig};

/// `(request_id, new_tokens, new_block_ids, computed_position)`: TensorRT-LLM's `RequestData`.
type RequestTuple = (u64, Vec<u32>, Vec<usize>, usize, Vec<Vec<usize>>);

fn request_data(v: Vec<RequestTuple>) -> Vec<RequestData> {
    v.into_iter()
        .map(
            |(request_id, new_tokens, new_block_ids, computed_position, by_group)| RequestData {
                request_id,
                new_tokens,
                new_block_ids,
                computed_position,
                new_block_ids_by_layer_group: by_group,
            },
        )
        .collect()
}

/// The parts of a request the per-request calls past matching read: its id (and tokens).
fn req(request_id: u64, tokens: &[u32]) -> LlmRequest<'_> {
    LlmRequest {
        request_id,
        tokens,
        cache_salt: None,
        lora_name: None,
    }
}

/// The scheduler side (`KvCacheConnectorScheduler`), on rank 0. Its start-up barrier runs in
/// the background (TensorRT-LLM's engine definition, `frameworks::trtllm::Trtllm`).
#[pyclass(module = "kvbm_connector._kvbm", name = "TrtllmScheduler", frozen)]
pub(crate) struct PyTrtllmScheduler {
    inner: Guarded<TrtllmScheduler>,
}

#[pymethods]
impl PyTrtllmScheduler {
    #[new]
    #[pyo3(signature = (config, tokens_per_block, transport))]
    fn new(
        py: Python<'_>,
        config: &PyConfig,
        tokens_per_block: usize,
        transport: &PyLeaderTransport,
    ) -> PyResult<Self> {
        let (config, transport) = (config.inner.clone(), transport.inner.clone());
        let s = detached(py, "TrtllmScheduler", move || {
            TrtllmScheduler::new(config, tokens_per_block, transport)
        })?;
        Ok(Self {
            inner: Guarded::new("TrtllmScheduler", s),
        })
    }

    /// The model's layer groups: each one's sliding window in tokens (`None`: full attention),
    /// in layer-group order; set before the first request.
    #[pyo3(signature = (windows))]
    fn set_layer_groups(&self, py: Python<'_>, windows: Vec<Option<i64>>) -> PyResult<()> {
        self.inner.call(py, "set_layer_groups", move |s| {
            s.set_layer_groups(KvCacheGroups::from_windows(&windows)?)
        })
    }

    /// `(num_external_tokens, load_async)` for the request's tokens beyond `num_computed_tokens`;
    /// with `cap`, at most that many (a pool matched again at the smallest pool's hit).
    #[pyo3(signature = (request_id, tokens, num_computed_tokens, cache_salt=None, lora_name=None, cap=None))]
    #[allow(clippy::too_many_arguments)]
    fn get_num_new_matched_tokens(
        &self,
        py: Python<'_>,
        request_id: u64,
        tokens: Vec<u32>,
        num_computed_tokens: usize,
        cache_salt: Option<String>,
        lora_name: Option<String>,
        cap: Option<usize>,
    ) -> PyResult<(usize, bool)> {
        self.inner.call(py, "get_num_new_matched_tokens", move |s| {
            s.get_num_new_matched_tokens_capped(
                &LlmRequest {
                    request_id,
                    tokens: &tokens,
                    cache_salt: cache_salt.as_deref(),
                    lora_name: lora_name.as_deref(),
                },
                num_computed_tokens,
                cap,
            )
        })
    }

    /// Holds the finished request's pages on every worker although this scheduler answered
    /// false: another pool's scheduler holds it.
    fn hold_finished(&self, py: Python<'_>, request_id: u64) -> PyResult<()> {
        self.inner
            .call(py, "hold_finished", move |s| s.hold_finished(request_id))
    }

    /// The engine allocated `block_ids` (the request's whole block list) for the request.
    fn update_state_after_alloc(
        &self,
        py: Python<'_>,
        request_id: u64,
        block_ids: Vec<usize>,
    ) -> PyResult<()> {
        self.inner.call(py, "update_state_after_alloc", move |s| {
            s.update_state_after_alloc(&req(request_id, &[]), &block_ids)
        })
    }

    /// `update_state_after_alloc_by_layer_group`: one page list per layer group.
    fn update_state_after_alloc_by_layer_group(
        &self,
        py: Python<'_>,
        request_id: u64,
        block_ids_by_layer_group: Vec<Vec<usize>>,
    ) -> PyResult<()> {
        self.inner
            .call(py, "update_state_after_alloc_by_layer_group", move |s| {
                s.update_state_after_alloc_by_layer_group(
                    &req(request_id, &[]),
                    &block_ids_by_layer_group,
                )
            })
    }

    /// `request_finished_by_layer_group`: true while operations on the request's device blocks
    /// (of any group) are in flight.
    fn request_finished_by_layer_group(
        &self,
        py: Python<'_>,
        request_id: u64,
        tokens: Vec<u32>,
        cache_block_ids_by_layer_group: Vec<Vec<usize>>,
    ) -> PyResult<bool> {
        self.inner
            .call(py, "request_finished_by_layer_group", move |s| {
                s.request_finished_by_layer_group(
                    &req(request_id, &tokens),
                    &cache_block_ids_by_layer_group,
                )
            })
    }

    /// The metadata bytes of this iteration; each request is
    /// `(request_id, new_tokens, new_block_ids, computed_position, new_block_ids_by_layer_group)`
    /// (the last empty for a one-group model).
    fn build_connector_meta<'py>(
        &self,
        py: Python<'py>,
        new_requests: Vec<RequestTuple>,
        cached_requests: Vec<RequestTuple>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let output = SchedulerOutput {
            new_requests: request_data(new_requests),
            cached_requests: request_data(cached_requests),
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
        request_id: u64,
        tokens: Vec<u32>,
        cache_block_ids: Vec<usize>,
    ) -> PyResult<bool> {
        self.inner.call(py, "request_finished", move |s| {
            s.request_finished(&req(request_id, &tokens), &cache_block_ids)
        })
    }
}

/// The worker side (`KvCacheConnectorWorker`), one per rank. Its barrier runs inside
/// `register_kv_caches` (TensorRT-LLM's engine definition, `frameworks::trtllm::Trtllm`).
#[pyclass(module = "kvbm_connector._kvbm", name = "TrtllmWorker", frozen)]
pub(crate) struct PyTrtllmWorker {
    inner: Guarded<TrtllmWorker>,
    tokens_per_block: usize,
}

#[pymethods]
impl PyTrtllmWorker {
    #[new]
    #[pyo3(signature = (config, tokens_per_block, world_size, transport))]
    fn new(
        py: Python<'_>,
        config: &PyConfig,
        tokens_per_block: usize,
        world_size: usize,
        transport: &PyWorkerTransport,
    ) -> PyResult<Self> {
        let (config, transport) = (config.inner.clone(), transport.inner.clone());
        let w = detached(py, "TrtllmWorker", move || {
            TrtllmWorker::new(config, tokens_per_block, world_size, transport)
        })?;
        Ok(Self {
            inner: Guarded::new("TrtllmWorker", w),
            tokens_per_block,
        })
    }

    /// Several layer groups share the registered pool (one page space): `n` groups of the
    /// model's `num_model_layers` layers.
    fn set_layer_groups(&self, py: Python<'_>, n: usize, num_model_layers: usize) -> PyResult<()> {
        self.inner.call(py, "set_layer_groups", move |w| {
            w.set_layer_groups(n, num_model_layers)
        })
    }

    /// Registers the one fully contiguous cache tensor `[num_blocks, num_layers, kv_factor, ...]`
    /// (CPU or CUDA memory; the tensor object is kept alive) and runs the start-up barrier.
    /// Returns the `GpuCache` handle for a CUDA tensor (the stream ordering), `None` for a CPU one.
    fn register_kv_caches(
        &self,
        py: Python<'_>,
        kv_cache_tensor: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Py<PyAny>>> {
        let t = read_tensor(py, kv_cache_tensor, "kv_cache_tensor")?;
        let (shape, itemsize) = (t.shape.clone(), t.itemsize);
        let layout = detect_trtllm(
            &shape,
            itemsize,
            self.tokens_per_block,
            Some(LayoutKind::FullyContiguous),
        )
        .map_err(|e| to_py_err(py, e.with("tensor", "kv_cache_tensor")))?;
        let cache = register_cache(py, layout, vec![t])?;
        let tier = cache.tier;
        self.inner.call(py, "register_kv_caches", move |w| {
            w.register_kv_caches(&shape, itemsize, tier)
        })?;
        Ok(cache.gpu)
    }

    /// Takes this iteration's metadata bytes.
    fn bind_connector_meta(&self, py: Python<'_>, metadata: &[u8]) -> PyResult<()> {
        let metadata = metadata.to_vec();
        self.inner.call(py, "bind_connector_meta", move |w| {
            w.bind_connector_meta(&metadata)
        })
    }

    /// Submits this iteration's loads.
    fn start_load_kv(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.call(py, "start_load_kv", |w| w.start_load_kv())
    }

    /// The layers `save_kv_layer` counts (0 before registration).
    fn num_layers(&self, py: Python<'_>) -> PyResult<usize> {
        self.inner.call(py, "num_layers", |w| Ok(w.num_layers()))
    }

    /// Checks the layer index (loads finish before the engine schedules their request).
    fn wait_for_layer_load(&self, py: Python<'_>, layer_idx: usize) -> PyResult<()> {
        self.inner.call(py, "wait_for_layer_load", move |w| {
            w.wait_for_layer_load(layer_idx)
        })
    }

    /// Starts the stores after the last layer.
    fn save_kv_layer(&self, py: Python<'_>, layer_idx: usize) -> PyResult<()> {
        self.inner
            .call(py, "save_kv_layer", move |w| w.save_kv_layer(layer_idx))
    }

    /// Starts the stores if the last layer did not.
    fn wait_for_save(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.call(py, "wait_for_save", |w| w.wait_for_save())
    }

    /// `(finished_saving, finished_loading)` request ids.
    fn get_finished(
        &self,
        py: Python<'_>,
        finished_gen_req_ids: Vec<u64>,
        started_loading_req_ids: Vec<u64>,
    ) -> PyResult<(Vec<u64>, Vec<u64>)> {
        self.inner.call(py, "get_finished", move |w| {
            Ok(w.get_finished(&finished_gen_req_ids, &started_loading_req_ids))
        })
    }

    /// Device blocks whose load failed since the last call.
    fn get_block_ids_with_load_errors(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        self.inner.call(py, "get_block_ids_with_load_errors", |w| {
            Ok(w.get_block_ids_with_load_errors())
        })
    }
}

common::scheduler_methods!(PyTrtllmScheduler);
common::worker_methods!(PyTrtllmWorker);

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTrtllmScheduler>()?;
    m.add_class::<PyTrtllmWorker>()?;
    Ok(())
}
