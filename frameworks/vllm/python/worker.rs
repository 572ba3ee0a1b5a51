//! `VllmWorker`: the worker role of vLLM's connector over [`crate::frameworks::vllm::VllmWorker`].

use super::*;

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
            #[allow(unused_mut)]
            let mut w = VllmWorker::new(config, block_size, world_size, transport)?;
            #[cfg(feature = "python-test-hooks")]
            test_faults(&mut w)?;
            Ok(w)
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

    /// Takes this step's metadata bytes. Decoded in place with the GIL held (no copy of the
    /// bytes; decoding a step's metadata takes microseconds, less than releasing the GIL costs
    /// the engine's other threads).
    fn bind_connector_metadata(&self, py: Python<'_>, metadata: &[u8]) -> PyResult<()> {
        let op = "bind_connector_metadata";
        self.inner.call_attached(py, op, |w| {
            w.bind_connector_metadata(metadata)
                .map_err(rust_err(py, op))
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

    /// Checks the layer name (loads finish before vLLM schedules their request). Called once
    /// per layer, so it keeps the GIL: a name lookup costs less than releasing it.
    fn wait_for_layer_load(&self, py: Python<'_>, layer_name: &str) -> PyResult<()> {
        let op = "wait_for_layer_load";
        self.inner.call_attached(py, op, |w| {
            w.wait_for_layer_load(layer_name).map_err(rust_err(py, op))
        })
    }

    /// Starts the stores after the last layer. Called once per layer, so it keeps the GIL (the
    /// last layer's submission only queues the copies; they run on the worker's threads).
    fn save_kv_layer(&self, py: Python<'_>, layer_name: &str) -> PyResult<()> {
        let op = "save_kv_layer";
        self.inner.call_attached(py, op, |w| {
            w.save_kv_layer(layer_name).map_err(rust_err(py, op))
        })
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

    /// The model's KV-cache groups (as the scheduler's).
    fn set_kv_cache_groups(&self, py: Python<'_>, n: usize) -> PyResult<()> {
        self.inner
            .call(py, "set_kv_cache_groups", move |w| w.set_kv_cache_groups(n))
    }

    /// Every layer's name in model order, when aliased layers (one cache shared by several
    /// layers) were registered once each.
    fn set_layer_names(&self, py: Python<'_>, names: Vec<String>) -> PyResult<()> {
        self.inner
            .call(py, "set_layer_names", move |w| w.set_layer_names(&names))
    }

    /// Every registered layer's name in model order.
    fn layer_names(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.inner.call(py, "layer_names", |w| Ok(w.layer_names()))
    }

    /// Request ids whose load failed since the last call (`failed_recving`).
    fn take_failed_loads(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.inner
            .call(py, "take_failed_loads", |w| Ok(w.take_failed_loads()))
    }
}

common::worker_methods!(PyVllmWorker);

/// Test wheels only (feature `python-test-hooks`): with `KVBM_TEST_FAULTS` set to a fault plan
/// (`backends::faults::FaultPlan::parse`, e.g. `host.read:fail`), the worker's host and disk tiers
/// fail, stall or corrupt on that schedule, so tests in a real engine can make loads fail on
/// purpose. A bad plan is an error naming the variable.
#[cfg(feature = "python-test-hooks")]
fn test_faults(w: &mut VllmWorker) -> crate::error::Result<()> {
    use crate::backends::faults::{FaultPlan, FaultyTiers};
    match std::env::var("KVBM_TEST_FAULTS") {
        Ok(spec) if !spec.trim().is_empty() => {
            let plan =
                FaultPlan::parse(&spec).map_err(|e| e.with("variable", "KVBM_TEST_FAULTS"))?;
            w.worker_mut()
                .set_tier_factory(std::sync::Arc::new(FaultyTiers::new(
                    crate::backends::StandardTiers::shared(),
                    plan,
                )))
        }
        _ => Ok(()),
    }
}
