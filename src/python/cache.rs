//! Which device tier an engine's cache tensors become: CPU tensors the [`TensorTier`] over their
//! memory; CUDA tensors the CUDA device tier (feature `cuda`, [`super::cuda`]), whose host tier
//! the worker then builds in pinned memory on the same GPU (`backends::StandardTiers`).
//!
//! Every tensor of one registration is on one device: a registration that mixes devices (two
//! GPUs, or CPU and GPU) is refused, naming the tensor and both devices, before anything is
//! opened.

use std::sync::Arc;

use pyo3::prelude::*;

use super::error::to_py_err;
use super::tensor::{TensorDevice, TensorInfo, TensorTier};
use crate::error::Error;
use crate::layout::Layout;
use crate::tier::StorageTier;

/// A registered cache: the device tier for the worker, and for CUDA tensors the
/// `_kvbm.GpuCache` handle the Python classes follow the engine's streams with (`None` for CPU
/// tensors).
pub(crate) struct Registered {
    pub tier: Arc<dyn StorageTier>,
    pub gpu: Option<Py<PyAny>>,
}

/// The one device every tensor is on; the error names the first tensor on another one.
pub(crate) fn common_device(tensors: &[TensorInfo]) -> Result<TensorDevice, Error> {
    let Some(first) = tensors.first() else {
        return Err(Error::invalid_layout("no cache tensors registered"));
    };
    match tensors.iter().find(|t| t.device != first.device) {
        None => Ok(first.device),
        Some(t) => Err(Error::invalid_argument(format!(
            "cache tensor {} is on {} but cache tensor {} is on {}: all tensors of one registration must be on one device (one rank per GPU)",
            t.name, t.device, first.name, first.device
        ))
        .with("tensor", &t.name)
        .with("device", t.device)
        .with("expected_device", first.device)),
    }
}

/// The device tier over `tensors` (one per allocation of `layout`, in order).
pub(crate) fn register_cache(
    py: Python<'_>,
    layout: Layout,
    tensors: Vec<TensorInfo>,
) -> PyResult<Registered> {
    match common_device(&tensors).map_err(|e| to_py_err(py, e))? {
        TensorDevice::Cpu => {
            // SAFETY: `read_tensor` took each address and size from its tensor object, which the
            // tier keeps alive; see `TensorTier::from_tensors`.
            let tier = unsafe { TensorTier::from_tensors(layout, tensors) }
                .map_err(|e| to_py_err(py, e))?;
            Ok(Registered {
                tier: Arc::new(tier),
                gpu: None,
            })
        }
        #[cfg(feature = "cuda")]
        TensorDevice::Cuda(index) => super::cuda::register(py, index, layout, tensors),
        #[cfg(not(feature = "cuda"))]
        TensorDevice::Cuda(index) => {
            let name = tensors.first().map_or("", |t| t.name.as_str());
            Err(to_py_err(
                py,
                Error::unsupported(format!(
                    "cache tensor {name} is on cuda:{index}, but this build of kvbm_connector has no CUDA support (built without the `cuda` feature)"
                ))
                .with("tensor", name)
                .with("device", format!("cuda:{index}")),
            ))
        }
    }
}
