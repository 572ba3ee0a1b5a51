"""Following the engine's CUDA streams (GPU caches only).

``register_kv_caches`` answers a ``_kvbm.GpuCache`` for CUDA tensors (``None`` for CPU ones);
:class:`StreamOrder` wraps it and the engine classes call it at their hooks:

* **stores** (``save_kv_layer``, ``wait_for_save``): before the stores are submitted, our store
  stream is made to wait, on the GPU, for the work enqueued on the engine's stream so far -- the
  forward pass that wrote the blocks. The CPU never waits.
* **loads** (``start_load_kv``): before the loads are submitted, our load stream waits for the
  engine's earlier work, so a load never overwrites a block that work still reads or writes.
  The other direction needs no GPU wait: loads are asynchronous (``load_async``), the engine
  schedules a loading request only after ``get_finished`` reported it, and that report comes
  after our copy's completion event was waited for. Making the engine's stream wait on the load
  stream at ``wait_for_layer_load`` would instead stall the forward pass behind loads of requests
  not yet scheduled. :meth:`StreamOrder.engine_waits_for_loads` exists for engines that read
  loaded blocks without that report.

The engine's stream: the ``stream`` TensorRT-LLM passes to its hooks (a ``torch.cuda.Stream`` or
a raw handle), else ``torch.cuda.current_stream(device).cuda_stream`` (vLLM passes none). torch
is imported only then -- it is not a dependency of this package; an engine with CUDA tensors has
it loaded already. With a CPU cache every call here does nothing.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional

from ._wiring import error

#: Returns the raw handle of the engine's current stream on GPU ``index``; replaceable (tests, an
#: engine without torch).
current_stream: Optional[Callable[[int], int]] = None


def _torch_current_stream(index: int) -> int:
    try:
        torch = importlib.import_module("torch")
    except Exception as e:  # ImportError, or a broken install
        raise error(
            "unsupported",
            "cannot find the engine's CUDA stream: torch is not importable "
            f"({type(e).__name__}: {e}); pass the stream to the hook, or set "
            "kvbm_connector._streams.current_stream",
            device=f"cuda:{index}",
        ) from None
    return int(torch.cuda.current_stream(index).cuda_stream)


def stream_handle(stream: Any, index: int) -> int:
    """The raw ``CUstream`` of ``stream``: an int as is, an object's ``cuda_stream`` (torch's
    ``Stream``), else (``None``) the engine's current stream on GPU ``index``."""
    if stream is None:
        provider = current_stream or _torch_current_stream
        return int(provider(index))
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    handle = getattr(stream, "cuda_stream", None)
    if isinstance(handle, int) and not isinstance(handle, bool):
        return handle
    raise error(
        "invalid_argument",
        f"cannot read a CUDA stream handle from {type(stream).__name__} "
        "(expected a torch.cuda.Stream, an int handle, or None for the current stream)",
        argument="stream",
    )


class StreamOrder:
    """The stream ordering of one registered cache (a no-op for a CPU cache)."""

    def __init__(self, gpu: Any = None) -> None:
        self.gpu = gpu

    @property
    def on_gpu(self) -> bool:
        return self.gpu is not None

    def _handle(self, stream: Any) -> int:
        return stream_handle(stream, int(self.gpu.device_index))

    def before_stores(self, stream: Any = None) -> None:
        """Stores submitted after this read what the engine's stream wrote before it."""
        if self.gpu is not None:
            self.gpu.gate_stores(self._handle(stream))

    def before_loads(self, stream: Any = None) -> None:
        """Loads submitted after this write only after the engine's earlier work."""
        if self.gpu is not None:
            self.gpu.gate_loads(self._handle(stream))

    def engine_waits_for_loads(self, stream: Any = None) -> None:
        """The engine's stream waits, on the GPU, for every load enqueued so far."""
        if self.gpu is not None:
            self.gpu.order_after_loads(self._handle(stream))

    def copy_stats(self) -> Optional[dict]:
        """The CUDA tier's copy counters, ``None`` for a CPU cache."""
        return None if self.gpu is None else dict(self.gpu.copy_stats())


__all__ = ["StreamOrder", "current_stream", "stream_handle"]
