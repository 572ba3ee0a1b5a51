"""Cache registration from tensor-like objects: what is accepted, what is refused and why, and
that the connector keeps the engine's tensor alive."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import _engines as E
from kvbm_connector import KvbmError, detect_trtllm_layout, detect_vllm_layout, trtllm


def trt_array(n=8):
    return np.zeros((n, E.LAYERS, 2, E.BS * E.INNER), dtype=E.DTYPE)


def test_trtllm_layout_from_the_shape():
    d = detect_trtllm_layout(E.FakeTensor(trt_array()), E.BS)
    assert d == {
        "kind": "fully_contiguous", "num_blocks": 8, "num_layers": E.LAYERS, "outer_dim": 2,
        "page_size": E.BS, "inner_dim": E.INNER, "dtype_bytes": 2, "bytes_per_block": E.BLOCK_BYTES,
    }


@pytest.mark.parametrize(
    "backend,kind", [("flash_attn", "layer_separate_outer_major"),
                     ("flashinfer", "layer_separate_block_major")]
)
def test_vllm_layout_from_the_shapes(backend, kind):
    d = detect_vllm_layout(E.VllmCache(16, backend).tensors, E.BS)
    assert (d["kind"], d["num_blocks"], d["num_layers"], d["bytes_per_block"]) == (
        kind, 16, E.LAYERS, E.BLOCK_BYTES)


def test_a_plain_numpy_array_is_accepted():
    assert detect_trtllm_layout(trt_array(), E.BS)["num_blocks"] == 8


def test_cuda_tensors_have_a_layout_and_other_devices_are_refused():
    # Layout detection reads shapes only: a CUDA tensor's layout needs no driver.
    d = detect_trtllm_layout(E.FakeTensor(trt_array(), device="cuda:0"), E.BS)
    assert (d["kind"], d["num_blocks"]) == ("fully_contiguous", 8)
    with pytest.raises(KvbmError) as ei:
        detect_trtllm_layout(E.FakeTensor(trt_array(), device="meta"), E.BS)
    assert ei.value.kind == "unsupported"
    assert "meta" in ei.value.message and ei.value.context["device"] == "meta"


def test_non_contiguous_and_read_only_tensors_are_refused():
    a = np.zeros((E.BS * E.INNER, 2, E.LAYERS, 8), dtype=E.DTYPE).transpose(3, 2, 1, 0)
    with pytest.raises(KvbmError) as ei:
        detect_trtllm_layout(E.FakeTensor(a), E.BS)
    assert ei.value.kind == "invalid_layout" and "contiguous" in ei.value.message
    with pytest.raises(KvbmError) as ei:
        detect_trtllm_layout(a, E.BS)  # numpy's own strides say so too
    assert ei.value.kind == "invalid_layout"
    ro = trt_array()
    ro.flags.writeable = False
    with pytest.raises(KvbmError) as ei:
        detect_trtllm_layout(ro, E.BS)
    assert ei.value.kind == "invalid_argument" and "read-only" in ei.value.message


class Partial:
    def __init__(self, **attrs):
        self.__dict__.update(attrs)


@pytest.mark.parametrize(
    "obj,needle",
    [
        (Partial(device="cpu"), "shape"),
        (Partial(shape=(8, 2, 2, 16)), "element_size"),
        (Partial(shape=(8, 2, 2, 16), dtype=E.FakeDtype(np.float16)), "data_ptr"),
        (Partial(shape=(8, -2, 2, 16), dtype=E.FakeDtype(np.float16)), "shape"),
        ("not a tensor", "shape"),
    ],
)
def test_objects_missing_tensor_attributes_are_refused(obj, needle):
    with pytest.raises(KvbmError) as ei:
        detect_trtllm_layout(obj, E.BS)
    assert ei.value.kind == "invalid_argument"
    assert needle in ei.value.message


def test_bad_shapes_are_refused_with_the_shape_named():
    with pytest.raises(KvbmError) as ei:
        detect_trtllm_layout(E.FakeTensor(np.zeros((8, 2, 2, 6), E.DTYPE)), E.BS)
    assert ei.value.kind == "invalid_layout" and "[8, 2, 2, 6]" in str(ei.value)
    with pytest.raises(KvbmError) as ei:
        detect_trtllm_layout(E.FakeTensor(np.zeros((8, 16), E.DTYPE)), E.BS)
    assert ei.value.kind == "invalid_layout"
    caches = E.VllmCache(8).tensors
    caches["extra"] = E.FakeTensor(np.zeros((2, 9, E.BS, E.HEADS, E.HEAD_DIM), E.DTYPE))
    with pytest.raises(KvbmError) as ei:
        detect_vllm_layout(caches, E.BS)
    assert ei.value.kind == "invalid_layout" and "layer 2" in ei.value.message
    with pytest.raises(KvbmError) as ei:
        detect_vllm_layout({}, E.BS)
    assert ei.value.kind == "invalid_layout"
    mixed = E.VllmCache(8).tensors
    mixed[E.layer_name(1)] = E.FakeTensor(np.zeros((2, 8, E.BS, E.HEADS, E.HEAD_DIM), np.float32))
    with pytest.raises(KvbmError) as ei:
        detect_vllm_layout(mixed, E.BS)
    assert ei.value.kind == "invalid_layout" and "byte elements" in ei.value.message
    with pytest.raises(KvbmError) as ei:
        detect_vllm_layout(E.VllmCache(8).tensors, E.BS, layout="diagonal")
    assert ei.value.kind == "invalid_argument"


def test_layers_sharing_memory_are_refused():
    from kvbm_connector import vllm

    cfg = E.VllmConfig()
    worker = vllm.KvbmConnector(cfg, vllm.KVConnectorRole.WORKER)
    one = E.FakeTensor(np.zeros((2, 8, E.BS, E.HEADS, E.HEAD_DIM), E.DTYPE))
    with pytest.raises(KvbmError) as ei:
        worker.register_kv_caches({E.layer_name(0): one, E.layer_name(1): one})
    assert ei.value.kind == "invalid_layout" and "share memory" in ei.value.message


def test_the_registered_tensor_is_kept_alive():
    args = E.TrtLlmArgs()
    sched = trtllm.KvbmConnectorScheduler(args)
    worker = trtllm.KvbmConnectorWorker(args)
    cache = E.TrtllmCache(16)
    tensor = E.FakeTensor(cache.array)  # a second handle on the same memory, registered
    ref = weakref.ref(tensor)
    worker.register_kv_caches(tensor)
    sched.wait_ready(10)
    del tensor
    gc.collect()
    assert ref() is not None, "the connector let go of the engine's tensor while using its memory"
    # The memory is the connector's to use: a store and a byte-exact load through it.
    e = E.TrtllmEngine(sched, worker, cache)
    a = E.prompt(2, 12)
    e.submit(1, a)
    e.run()
    e.submit(2, a + [1])
    e.run()
    assert e.verified_blocks == 3
