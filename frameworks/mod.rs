//! Engine adapters: each translates one engine's connector calls, in that engine's call order and
//! with its argument shapes, into the framework-agnostic [`crate::connector`] core.
//!
//! * `trtllm` (feature `trtllm`) — TensorRT-LLM's `KvCacheConnectorScheduler` /
//!   `KvCacheConnectorWorker`: integer request ids, offload by computed position, one fully
//!   contiguous cache tensor, leader non-blocking / worker blocking.
//! * `vllm` (feature `vllm`) — vLLM's `KVConnectorBase_V1`: string request ids, offload by
//!   scheduled tokens, per-layer cache tensors, leader blocking / worker non-blocking.
//!
//! Each adapter also owns its engine's cache shapes: `trtllm::detect_trtllm` and
//! `vllm::detect_vllm` read a [`crate::layout::Layout`] from the tensors the engine registers
//! (shared shape reading in `detect`), and registration refuses storage whose layout differs.
//!
//! * `sglang` (feature `python`) — SGLang's HiCache storage backend: the core's page store
//!   behind a Python binding only (SGLang keeps its own scheduler and host pool).
//!
//! An engine is one folder here — its adapter (`mod.rs`) and, with the `python` feature, its
//! Python binding (`python.rs`: the engine's objects, read by its Python module in
//! `python/kvbm_connector/`, into the adapter's calls) — plus that Python module and, for
//! `kvbm replay`, its engine model (`tool/replay/engines/`). Only the `python` submodules use the
//! bindings' building blocks (in `src/python/`); `tests/architecture.rs` checks it.
//!
//! A third engine outside the crate needs no change here: see `docs/adapters.md` and
//! `examples/toy_engine.rs`.

#[cfg(any(feature = "trtllm", feature = "vllm"))]
mod detect;
#[cfg(feature = "python")]
pub(crate) mod sglang;
#[cfg(feature = "trtllm")]
pub mod trtllm;
#[cfg(feature = "vllm")]
pub mod vllm;

#[cfg(any(feature = "trtllm", feature = "vllm"))]
use crate::error::{Error, Result};
#[cfg(any(feature = "trtllm", feature = "vllm"))]
use crate::layout::{KvLayout, Layout};

/// Refuses a registered cache whose storage layout is not the layout its shapes describe.
#[cfg(any(feature = "trtllm", feature = "vllm"))]
fn check_registered(detected: &Layout, cache: &dyn crate::tier::StorageTier) -> Result<()> {
    if cache.layout() != detected {
        return Err(Error::invalid_layout(format!(
            "registered cache storage is {} with {:?} over {} blocks, but its tensor shapes describe {} with {:?} over {} blocks",
            cache.layout().kind(),
            cache.layout().dims(),
            cache.layout().num_blocks(),
            detected.kind(),
            detected.dims(),
            detected.num_blocks()
        )));
    }
    Ok(())
}
