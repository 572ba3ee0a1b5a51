"""The GPU path, as far as a machine without a GPU can check it: the wheel carries CUDA support;
CUDA tensor-likes (``device.type == "cuda"``, ``device.index``, ``data_ptr()``, shape, strides,
dtype) reach the CUDA tier and get the driver probe's error without a driver; registrations that
mix devices are refused before anything is opened; and the engine classes order their stream
calls (store gate before every store submission, load gate before the loads) through the
scripted engine loops, with a recording stand-in for the ``GpuCache`` handle.

The same registrations on a GPU are tests/python/test_gpu.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import _engines as E
from kvbm_connector import KvbmError, _kvbm, _streams, trtllm, vllm


def cuda_probe_error():
    """The probe's error text, or ``None`` when a CUDA driver and GPU are usable here."""
    if not _kvbm.HAVE_CUDA:
        return "this wheel has no CUDA support"
    try:
        _kvbm.cuda_probe()
    except KvbmError as e:
        return str(e)
    return None


no_driver = pytest.mark.skipif(
    cuda_probe_error() is None, reason="a CUDA driver and GPU are usable here: see test_gpu.py"
)


class CudaDevice:
    """``torch.device('cuda', index)``."""

    def __init__(self, index) -> None:
        self.type = "cuda"
        self.index = index

    def __str__(self) -> str:
        return "cuda" if self.index is None else f"cuda:{self.index}"


class CudaTensor:
    """What a CUDA ``torch.Tensor`` shows the connector: ``data_ptr()`` (a made-up device
    address), ``shape``, ``stride()``, ``dtype``, ``device``, ``element_size()``."""

    def __init__(self, shape, index=0, itemsize=2, ptr=0x7F00_0000_0000, strides=None) -> None:
        self.shape = tuple(shape)
        self.device = CudaDevice(index)
        self.dtype = E.FakeDtype(np.float16 if itemsize == 2 else np.float32)
        self._ptr = ptr
        c = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            c[i] = c[i + 1] * shape[i + 1]
        self._strides = tuple(strides or c)

    def data_ptr(self) -> int:
        return self._ptr

    def stride(self):
        return self._strides

    def element_size(self) -> int:
        return self.dtype.itemsize

    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


def vllm_caches(num_blocks=8, backend="flash_attn", devices=(0, 0)):
    shape = {
        "flash_attn": (2, num_blocks, E.BS, E.HEADS, E.HEAD_DIM),
        "flashinfer": (num_blocks, 2, E.BS, E.HEADS, E.HEAD_DIM),
        "mla": (num_blocks, E.BS, 2 * E.HEADS * E.HEAD_DIM),
    }[backend]
    out, ptr = {}, 0x7F00_0000_0000
    for l, d in enumerate(devices):
        t = CudaTensor(shape, index=d, ptr=ptr)
        out[E.layer_name(l)] = t
        ptr += t.nbytes() + 4096
    return out


def vllm_worker():
    return vllm.KvbmConnector(E.VllmConfig(), vllm.KVConnectorRole.WORKER)


def trtllm_worker():
    return trtllm.KvbmConnectorWorker(E.TrtLlmArgs())


def test_the_wheel_carries_cuda_support():
    # Fails on a wheel built without the `cuda` feature (pyproject.toml and scripts/test.sh
    # build with it).
    assert _kvbm.HAVE_CUDA is True
    assert hasattr(_kvbm, "GpuCache") and hasattr(_kvbm, "cuda_probe")


@no_driver
def test_the_probe_names_what_is_missing():
    with pytest.raises(KvbmError) as ei:
        _kvbm.cuda_probe()
    e = ei.value
    assert e.kind == "unsupported"
    assert "libcuda.so" in e.message, e.message


@no_driver
@pytest.mark.parametrize("backend", ["flash_attn", "flashinfer", "mla"])
def test_vllm_cuda_caches_without_a_driver_get_the_probe_error(backend):
    w = vllm_worker()
    with pytest.raises(KvbmError) as ei:
        w.register_kv_caches(vllm_caches(backend=backend, devices=(0, 0)))
    e = ei.value
    assert e.kind == "unsupported", str(e)
    assert "libcuda.so" in e.message, e.message
    assert e.context["device"] == "cuda:0"
    # Nothing was registered: the same worker still takes a CPU cache (no crash, no half state).
    w.register_kv_caches(E.VllmCache(8, "flash_attn").tensors)


@no_driver
@pytest.mark.parametrize("index", [0, 1])
def test_trtllm_cuda_pool_without_a_driver_gets_the_probe_error(index):
    # Each rank's worker opens its own tensors' GPU (one rank per GPU in one process).
    w = trtllm_worker()
    pool = CudaTensor((8, E.LAYERS, 2, E.BS * E.INNER), index=index)
    with pytest.raises(KvbmError) as ei:
        w.register_kv_caches(pool)
    e = ei.value
    assert e.kind == "unsupported" and "libcuda.so" in e.message, str(e)
    assert e.context["device"] == f"cuda:{index}"


@pytest.mark.parametrize(
    "devices,bad,want",
    [((0, 1), "model.layers.1.self_attn.attn", ("cuda:1", "cuda:0")),
     ((1, 0), "model.layers.1.self_attn.attn", ("cuda:0", "cuda:1"))],
)
def test_a_registration_on_two_gpus_is_refused_naming_the_tensor_and_both_devices(
    devices, bad, want
):
    with pytest.raises(KvbmError) as ei:
        vllm_worker().register_kv_caches(vllm_caches(devices=devices))
    e = ei.value
    assert e.kind == "invalid_argument", str(e)
    assert e.context["tensor"] == bad
    assert (e.context["device"], e.context["expected_device"]) == want
    assert want[0] in e.message and want[1] in e.message and bad in e.message


def test_cpu_and_cuda_tensors_in_one_registration_are_refused():
    cpu = E.VllmCache(8, "flash_attn").tensors
    gpu = vllm_caches(devices=(0,))
    mixed = {E.layer_name(0): cpu[E.layer_name(0)], E.layer_name(1): gpu[E.layer_name(0)]}
    with pytest.raises(KvbmError) as ei:
        vllm_worker().register_kv_caches(mixed)
    e = ei.value
    assert e.kind == "invalid_argument"
    assert (e.context["device"], e.context["expected_device"]) == ("cuda:0", "cpu")


def test_a_cuda_device_without_an_index_is_refused():
    with pytest.raises(KvbmError) as ei:
        vllm_worker().register_kv_caches(vllm_caches(devices=(None, None)))
    assert ei.value.kind == "invalid_argument" and "index" in ei.value.message


def test_a_strided_cuda_view_is_refused_before_the_driver():
    t = CudaTensor((8, E.LAYERS, 2, E.BS * E.INNER), strides=(1, 8, 16, 32))
    with pytest.raises(KvbmError) as ei:
        trtllm_worker().register_kv_caches(t)
    assert ei.value.kind == "invalid_layout" and "contiguous" in ei.value.message


def test_overlapping_cuda_layers_are_refused_before_the_driver():
    caches = vllm_caches(devices=(0, 0))
    a, b = caches.values()
    b._ptr = a._ptr + 64  # layer 1 inside layer 0
    with pytest.raises(KvbmError) as ei:
        vllm_worker().register_kv_caches(caches)
    assert ei.value.kind == "invalid_layout" and "share memory" in ei.value.message


# -------------------------------------------------------------------------------------------------
# Stream ordering, with a recording stand-in for _kvbm.GpuCache
# -------------------------------------------------------------------------------------------------


class RecordingGpu:
    """Records the stream calls the engine classes make; the worker proxy records the calls
    that submit stores and loads, into the same log."""

    def __init__(self, log, index=0) -> None:
        self.log = log
        self.device_index = index

    def gate_stores(self, stream):
        self.log.append(("gate_stores", stream))

    def gate_loads(self, stream):
        self.log.append(("gate_loads", stream))

    def order_after_loads(self, stream):
        self.log.append(("order_after_loads", stream))

    def copy_stats(self):
        return {"copies_1d": 0, "copies_2d": 0, "bytes": 0, "batches": 0}


class Recording:
    """Wraps a ``_kvbm`` worker: logs the calls that submit transfers, forwards everything."""

    SUBMITS = {"start_load_kv", "save_kv_layer", "wait_for_save"}

    def __init__(self, inner, log) -> None:
        self._inner = inner
        self._log = log

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in self.SUBMITS:
            return attr

        def call(*a, **kw):
            self._log.append((name, None))
            return attr(*a, **kw)

        return call


def check_order(log):
    """Every store submission directly follows a store gate, every load submission a load
    gate, and the gates name the engine's stream."""
    assert log, "nothing was recorded"
    for i, (name, _) in enumerate(log):
        if name in ("save_kv_layer", "wait_for_save"):
            assert i > 0 and log[i - 1][0] == "gate_stores", log[max(0, i - 3) : i + 1]
            assert log[i - 1][1] == ENGINE_STREAM
        if name == "start_load_kv":
            assert i > 0 and log[i - 1][0] == "gate_loads", log[max(0, i - 3) : i + 1]
            assert log[i - 1][1] == ENGINE_STREAM
    assert not any(n == "order_after_loads" for n, _ in log)


ENGINE_STREAM = 0x5EED


def test_vllm_gates_every_store_and_load_on_the_current_stream(vllm_engine, monkeypatch):
    seen = []
    monkeypatch.setattr(_streams, "current_stream", lambda index: seen.append(index) or ENGINE_STREAM)
    engine = vllm_engine(num_blocks=32)
    conn = engine.worker
    log = []
    conn._streams = _streams.StreamOrder(RecordingGpu(log, index=0))
    conn._worker = Recording(conn._worker, log)
    p = E.prompt(1, 3 * E.BS)
    engine.add("a", p)
    engine.run()
    engine.add("b", p + [7])  # a prefix hit: loads
    engine.run()
    check_order(log)
    assert any(n == "start_load_kv" for n, _ in log) and any(n == "save_kv_layer" for n, _ in log)
    assert set(seen) == {0}
    assert engine.verified_blocks >= 3


class TrtStream:
    """``torch.cuda.Stream``: the connector reads ``cuda_stream``."""

    cuda_stream = ENGINE_STREAM


def test_trtllm_gates_on_the_stream_its_hooks_are_given(trtllm_engine, monkeypatch):
    def no_current(index):
        raise AssertionError("TensorRT-LLM passes its stream: the current stream is not read")

    monkeypatch.setattr(_streams, "current_stream", no_current)
    engine = trtllm_engine(num_blocks=48)
    w = engine.worker
    log = []
    w._streams = _streams.StreamOrder(RecordingGpu(log))
    w._inner = Recording(w._inner, log)
    # The scripted loop passes None; TensorRT-LLM passes its torch stream.
    for hook in ("start_load_kv", "save_kv_layer", "wait_for_save", "wait_for_layer_load"):
        orig = getattr(w, hook)
        monkeypatch.setattr(
            w, hook, (lambda f: lambda *a: f(*a[:-1], TrtStream()))(orig)
        )
    p = E.prompt(2, 3 * E.BS)
    engine.submit(1, list(p))
    engine.run()
    engine.submit(2, list(p) + [5])
    engine.run()
    check_order(log)
    assert engine.verified_blocks >= 3


def test_stream_handles():
    assert _streams.stream_handle(7, 0) == 7
    assert _streams.stream_handle(TrtStream(), 0) == ENGINE_STREAM
    with pytest.raises(KvbmError) as ei:
        _streams.stream_handle("s", 0)
    assert ei.value.kind == "invalid_argument"
    # A CPU cache: every call is a no-op, even without torch.
    order = _streams.StreamOrder(None)
    order.before_stores()
    order.before_loads()
    assert order.copy_stats() is None and not order.on_gpu


def test_no_torch_no_stream_is_a_clear_error(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_torch(name, *a, **kw):
        if name == "torch":
            raise ImportError("No module named 'torch'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    monkeypatch.setattr(_streams, "current_stream", None)
    import importlib

    monkeypatch.setattr(importlib, "import_module", lambda n: no_torch(n))
    with pytest.raises(KvbmError) as ei:
        _streams.StreamOrder(RecordingGpu([])).before_stores()
    assert ei.value.kind == "unsupported" and "torch" in ei.value.message


def test_probe_answer_is_json_when_a_driver_exists():
    if cuda_probe_error() is not None:
        pytest.skip(f"no CUDA driver here: {cuda_probe_error()}")
    info = json.loads(_kvbm.cuda_probe())
    assert info["devices"]
