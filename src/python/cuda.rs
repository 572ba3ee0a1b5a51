//! CUDA caches in the Python bindings (features `python` + `cuda`): an engine's CUDA tensors as a
//! [`CudaDeviceTier`], and `_kvbm.GpuCache`, the handle the Python classes follow the engine's
//! streams with.
//!
//! Registration: the tensors' addresses (`data_ptr()`), checked as for CPU tensors (one per
//! allocation of the layout, sizes, no overlap), then [`CudaDevice::open`] on their GPU — which
//! goes through [`probe`](crate::backends::cuda::probe): no driver, no GPU, or an index past the
//! GPUs is the probe's error, never a crash — then [`CudaDeviceTier::register`], which checks
//! each allocation's first and last byte are device memory of that GPU. The tier keeps the tensor
//! objects alive ([`CudaDeviceTier::keep_alive`]).
//!
//! Streams (`GpuCache`), every call returning at once (no CPU wait):
//!
//! * `gate_stores(stream)`: the tier's store stream waits, on the GPU, for the work enqueued on
//!   the engine's `stream` so far (its forward pass wrote the blocks); called before the stores
//!   are submitted ([`CudaDeviceTier::gate_stores_on_stream`]);
//! * `gate_loads(stream)`: the load stream waits for the engine's earlier work (a load never
//!   overwrites a block the engine's earlier kernels still touch);
//! * `order_after_loads(stream)`: the engine's stream waits for every load enqueued so far.
//!
//! A stream handle is the raw `CUstream` as an int (`torch.cuda.Stream.cuda_stream`; `0` is the
//! legacy default stream). Like `data_ptr()`, it is trusted: it must be a live stream of the
//! tier's GPU.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::cache::Registered;
use super::error::to_py_err;
use super::tensor::{check_tensors, TensorInfo};
use crate::backends::cuda::cudarc::driver::sys::CUstream;
use crate::backends::cuda::{CudaDevice, CudaDeviceTier};
use crate::error::Result;
use crate::layout::Layout;

/// The CUDA device tier over `tensors` (all on GPU `index`).
pub(crate) fn register(
    py: Python<'_>,
    index: usize,
    layout: Layout,
    tensors: Vec<TensorInfo>,
) -> PyResult<Registered> {
    let tier = py
        .detach(|| -> Result<Arc<CudaDeviceTier>> {
            check_tensors(&layout, &tensors)?;
            let device =
                CudaDevice::open(index).map_err(|e| e.with("device", format!("cuda:{index}")))?;
            let ptrs: Vec<u64> = tensors.iter().map(|t| t.ptr as u64).collect();
            // SAFETY: each address is a tensor's `data_ptr()` with its size checked above; the
            // tier keeps the tensor objects (below), so the engine's memory outlives it.
            let tier = unsafe { CudaDeviceTier::register(device, layout, &ptrs) }?;
            Ok(tier)
        })
        .map_err(|e| to_py_err(py, e))?;
    for t in tensors {
        tier.keep_alive(Box::new(t.owner));
    }
    let handle = Py::new(
        py,
        PyGpuCache {
            tier: tier.clone(),
            index,
        },
    )?;
    Ok(Registered {
        tier,
        gpu: Some(handle.into_any()),
    })
}

/// A registered CUDA cache: the engine's stream ordering (see the module doc).
#[pyclass(module = "kvbm_connector._kvbm", name = "GpuCache", frozen)]
pub(crate) struct PyGpuCache {
    tier: Arc<CudaDeviceTier>,
    index: usize,
}

impl PyGpuCache {
    fn call(
        &self,
        py: Python<'_>,
        op: &'static str,
        f: impl FnOnce(&CudaDeviceTier) -> Result<()> + Send,
    ) -> PyResult<()> {
        let tier = &self.tier;
        py.detach(|| f(tier))
            .map_err(|e| to_py_err(py, e.with("op", op).with("device", self.index)))
    }
}

#[pymethods]
impl PyGpuCache {
    /// The GPU's index (`device.index` of the registered tensors).
    #[getter]
    fn device_index(&self) -> usize {
        self.index
    }

    /// The store stream waits for the work enqueued on `stream` so far.
    fn gate_stores(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        // SAFETY: the handle is trusted as `data_ptr()` is (module doc).
        self.call(py, "gate_stores", |t| unsafe {
            t.gate_stores_on_stream(stream as CUstream)
        })
    }

    /// The load stream waits for the work enqueued on `stream` so far.
    fn gate_loads(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        // SAFETY: as for `gate_stores`.
        self.call(py, "gate_loads", |t| unsafe {
            t.gate_loads_on_stream(stream as CUstream)
        })
    }

    /// `stream` waits for every load enqueued so far.
    fn order_after_loads(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        // SAFETY: as for `gate_stores`.
        self.call(py, "order_after_loads", |t| unsafe {
            t.order_stream_after_loads(stream as CUstream)
        })
    }

    /// The copies the tier issued: `copies_1d`, `copies_2d`, `bytes`, `batches`.
    fn copy_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.tier.copy_stats();
        let d = PyDict::new(py);
        d.set_item("copies_1d", s.copies_1d)?;
        d.set_item("copies_2d", s.copies_2d)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("batches", s.batches)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!("GpuCache(cuda:{}, {:?})", self.index, self.tier)
    }
}

/// `cuda_probe()`: what the CUDA driver reports, as JSON text (`library`, `driver_version`,
/// `devices`); raises the probe's `KvbmError` (kind `unsupported`, naming the library or the
/// driver call) when there is no usable driver or GPU.
#[pyfunction]
fn cuda_probe(py: Python<'_>) -> PyResult<String> {
    super::detached(py, "cuda_probe", || {
        let info = crate::backends::cuda::probe()?;
        serde_json::to_string(&info).map_err(|e| {
            crate::error::Error::internal(format!("cannot encode the probe's answer: {e}"))
        })
    })
}

pub(super) fn register_class(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyGpuCache>()?;
    m.add_function(wrap_pyfunction!(cuda_probe, m)?)
}
