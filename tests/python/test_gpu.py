"""The Python package on a GPU: our vLLM and TensorRT-LLM classes with real CUDA tensors (torch),
driven by the scripted engine loops of ``_engines.py``.

The caches below have the interface of ``_engines.VllmCache`` / ``TrtllmCache`` (``write``,
``read_block``, ``fill``, ``tensors`` / ``tensor``) over CUDA tensors, so the loops, the model
stand-in and the byte checks are the ones the CPU tests use: every onboarded block is read back
from GPU memory and compared byte for byte with its prefix's KV (junk is written into every freed
block, so a block compares equal only if the load wrote it).

The model's writes go on the engine's current stream without the CPU waiting (pinned sources,
``non_blocking``); with ``slow=True`` each layer's writes queue behind a ~50 ms GPU sleep, so a
store that did not wait for the engine's stream would copy the junk: the stream-ordering tests
check the stored bytes are the written ones, and (the control) that they are not when the store
gate is switched off.

Without torch or a CUDA GPU every test is skipped with the reason; with ``KVBM_REQUIRE_GPU=1``
(scripts/gpu-check.sh) that is a failure instead.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import _engines as E
import test_trtllm as T
import test_vllm as V
from kvbm_connector import KvbmError, _kvbm, _streams

REQUIRE = os.environ.get("KVBM_REQUIRE_GPU") == "1"
DEVICE_INDEX = int(os.environ.get("KVBM_CUDA_DEVICE", "0"))
SLEEP_CYCLES = int(os.environ.get("KVBM_GPU_TEST_SLEEP_CYCLES", str(100_000_000)))  # ~50 ms


def _gpu_missing():
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install
        return f"torch is not importable ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    if torch.cuda.device_count() <= DEVICE_INDEX:
        return f"no GPU {DEVICE_INDEX} (torch sees {torch.cuda.device_count()})"
    if not _kvbm.HAVE_CUDA:
        return "this kvbm_connector wheel was built without the cuda feature"
    try:
        _kvbm.cuda_probe()
    except KvbmError as e:
        return f"kvbm's CUDA probe failed: {e}"
    return None


MISSING = _gpu_missing()


@pytest.fixture(autouse=True)
def gpu():
    if MISSING is not None:
        if REQUIRE:
            pytest.fail(f"KVBM_REQUIRE_GPU=1 but {MISSING}")
        print(f"SKIP test_gpu.py: {MISSING}")
        pytest.skip(MISSING)
    import torch

    torch.cuda.set_device(DEVICE_INDEX)
    yield torch
    torch.cuda.synchronize()


def _dev():
    return f"cuda:{DEVICE_INDEX}"


class _GpuCacheBase:
    """Per-layer uint8 views ``[..., TOKEN_BYTES]`` of CUDA tensors; ``_run(block, layer, kv)``
    is one (block, layer, K/V) run ``[BS, TOKEN_BYTES]``."""

    slow = False
    #: The stream the model writes on (``None``: the current stream).
    stream = None
    STAGING = 1 << 20

    def __init__(self) -> None:
        import torch

        self._last_layer = None
        # The model's writes come from one pinned ring, never reused while a copy may be pending
        # (no allocation, no synchronisation between the GPU sleep and the writes behind it).
        self._staging = torch.empty(self.STAGING, dtype=torch.uint8, pin_memory=True)
        self._staging_np = self._staging.numpy()
        self._off = 0

    def write(self, block: int, layer: int, kv: int, slot: int, data: bytes) -> None:
        import torch

        stream = self.stream or torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            if self.slow and layer != self._last_layer:
                torch.cuda._sleep(SLEEP_CYCLES)  # the forward pass of this layer takes a while
            self._last_layer = layer
            n = len(data)
            if self._off + n > self.STAGING:
                stream.synchronize()
                self._off = 0
            self._staging_np[self._off : self._off + n] = np.frombuffer(data, dtype=np.uint8)
            src = self._staging[self._off : self._off + n]
            self._off += n
            self._run(block, layer, kv)[slot].copy_(src, non_blocking=True)

    def read_block(self, block: int) -> bytes:
        import torch

        self._last_layer = None
        parts = [self._run(block, l, kv) for l in range(E.LAYERS) for kv in range(2)]
        return torch.cat([p.reshape(-1) for p in parts]).cpu().numpy().tobytes()

    def fill(self, block: int, data: bytes) -> None:
        import torch

        run = E.BS * E.TOKEN_BYTES
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(_dev())
        for l in range(E.LAYERS):
            for kv in range(2):
                o = (l * 2 + kv) * run
                self._run(block, l, kv).copy_(src[o : o + run].view(E.BS, E.TOKEN_BYTES))
        # The engine's allocator hands the block out only after this (writes may go on another
        # stream: test_trtllm_stores_wait_for_the_hook_stream).
        torch.cuda.current_stream().synchronize()

    def block_on_gpu(self, block: int):
        """The block's bytes as a CUDA uint8 tensor, in the model's order."""
        import torch

        parts = [self._run(block, l, kv) for l in range(E.LAYERS) for kv in range(2)]
        return torch.cat([p.reshape(-1) for p in parts])


class GpuVllmCache(_GpuCacheBase):
    """vLLM's per-layer CUDA caches: FlashAttention ``[2, num_blocks, BS, heads, head_dim]``,
    FlashInfer ``[num_blocks, 2, BS, heads, head_dim]``, or MLA's latent cache
    ``[num_blocks, BS, 2 * heads * head_dim]`` (K then V per token, in this model)."""

    def __init__(self, num_blocks: int, backend: str = "flash_attn") -> None:
        import torch

        super().__init__()
        self.num_blocks = num_blocks
        self.backend = backend
        shape = {
            "flash_attn": (2, num_blocks, E.BS, E.HEADS, E.HEAD_DIM),
            "flashinfer": (num_blocks, 2, E.BS, E.HEADS, E.HEAD_DIM),
            "mla": (num_blocks, E.BS, 2 * E.HEADS * E.HEAD_DIM),
        }[backend]
        self.tensors = {
            E.layer_name(l): torch.zeros(shape, dtype=torch.float16, device=_dev())
            for l in range(E.LAYERS)
        }
        self._u8 = [t.view(torch.uint8) for t in self.tensors.values()]

    def _run(self, block: int, layer: int, kv: int):
        u = self._u8[layer]
        if self.backend == "flash_attn":
            return u[kv, block].reshape(E.BS, E.TOKEN_BYTES)
        if self.backend == "flashinfer":
            return u[block, kv].reshape(E.BS, E.TOKEN_BYTES)
        return u[block].reshape(E.BS, 2, E.TOKEN_BYTES)[:, kv]


class GpuTrtllmCache(_GpuCacheBase):
    """TensorRT-LLM's primary pool ``[num_blocks, num_layers, 2, BS * inner]`` on the GPU."""

    def __init__(self, num_blocks: int) -> None:
        import torch

        super().__init__()
        self.num_blocks = num_blocks
        self.tensor = torch.zeros(
            (num_blocks, E.LAYERS, 2, E.BS * E.INNER), dtype=torch.float16, device=_dev()
        )
        self._u8 = self.tensor.view(torch.uint8)

    def _run(self, block: int, layer: int, kv: int):
        return self._u8[block, layer, kv].reshape(E.BS, E.TOKEN_BYTES)


def gpu_copies(stream_order) -> dict:
    stats = stream_order.copy_stats()
    assert stats is not None, "the connector registered the CUDA tensors as a CPU cache"
    return stats


def check_onboarded_on_gpu(cache, tokens, blocks, n_blocks) -> None:
    """The onboarded blocks, compared on the GPU with their prefix's KV."""
    import torch

    for b in range(n_blocks):
        want = torch.frombuffer(bytearray(E.expected_block(tokens, b)), dtype=torch.uint8).to(_dev())
        assert torch.equal(cache.block_on_gpu(blocks[b]), want), f"block {b} differs on the GPU"


# -------------------------------------------------------------------------------------------------
# The CPU suite's scenarios, on GPU caches
# -------------------------------------------------------------------------------------------------


@pytest.fixture
def gpu_vllm(vllm_engine):
    """``vllm_engine`` with CUDA caches; ``gpu_vllm.made`` lists the engines built."""

    def make(num_blocks: int = 32, backend: str = "flash_attn", **kw):
        e = vllm_engine(num_blocks=num_blocks, backend=backend,
                        cache=GpuVllmCache(num_blocks, backend), **kw)
        assert e.worker._streams.on_gpu, "CUDA tensors registered as a CPU cache"
        assert e.worker._streams.gpu.device_index == DEVICE_INDEX
        make.made.append(e)
        return e

    make.made = []
    return make


@pytest.fixture
def gpu_trtllm(trtllm_engine):
    """``trtllm_engine`` with a CUDA pool; ``gpu_trtllm.made`` lists the engines built."""

    def make(num_blocks: int = 48, **kw):
        e = trtllm_engine(num_blocks=num_blocks, cache=GpuTrtllmCache(num_blocks), **kw)
        assert e.worker._streams.on_gpu, "a CUDA pool registered as a CPU cache"
        make.made.append(e)
        return e

    make.made = []
    return make


def report_copies(what, engine) -> None:
    stats = gpu_copies(engine.worker._streams)
    assert stats["bytes"] > 0 and stats["batches"] > 0, stats
    print(f"{what} on {_dev()}: {stats}")


@pytest.mark.parametrize("backend", ["flash_attn", "flashinfer", "mla"])
def test_vllm_prefix_hit_from_host_on_the_gpu(gpu_vllm, backend):
    # Stores, then a load from the pinned host tier, every onboarded block read back from the
    # GPU and compared byte for byte.
    V.test_prefix_hit_from_host_is_byte_exact(gpu_vllm, backend)
    report_copies(f"vLLM {backend}", gpu_vllm.made[0])


def test_vllm_disk_hit_on_the_gpu(gpu_vllm, monkeypatch):
    # Device <-> disk through the pinned bounce.
    V.test_disk_hit_after_host_eviction(gpu_vllm, monkeypatch)


def test_vllm_abort_while_loading_on_the_gpu(gpu_vllm):
    V.test_abort_while_loading(gpu_vllm)
    e = gpu_vllm.made[0]
    # The cache still works after the abort: another request loads the same prefix.
    e.add("c", E.prompt(6, 16) + [2])  # test_abort_while_loading's prompt
    e.run()
    assert e.matches["c"] == (16, True)
    assert e.verified_blocks >= 4


def test_trtllm_chunked_prefill_and_decode_on_the_gpu(gpu_trtllm):
    T.test_chunked_prefill_and_decode(gpu_trtllm)
    report_copies("TensorRT-LLM pool", gpu_trtllm.made[0])


def test_trtllm_disk_hit_on_the_gpu(gpu_trtllm, monkeypatch):
    T.test_disk_hit_after_host_eviction(gpu_trtllm, monkeypatch)


def test_trtllm_abort_while_load_in_flight_on_the_gpu(gpu_trtllm):
    T.test_abort_while_load_in_flight_releases_blocks(gpu_trtllm)


def test_trtllm_loaded_blocks_compare_equal_on_the_gpu(gpu_trtllm):
    e = gpu_trtllm()
    cache = e.cache
    a = E.prompt(5, 16)
    e.submit(1, a, max_new=1)
    e.run()
    loaded = []
    orig = e.verify_onboarded

    def verify(req):
        check_onboarded_on_gpu(cache, req.tokens, req.blocks, req.loaded // E.BS)
        loaded.append(req.request_id)
        return orig(req)

    e.verify_onboarded = verify
    e.submit(2, a + [3], max_new=1)
    e.run()
    assert loaded == [2] and e.verified_blocks == 4


# -------------------------------------------------------------------------------------------------
# Stream ordering
# -------------------------------------------------------------------------------------------------


def _vllm_slow_store_then_load(gpu_vllm):
    e = gpu_vllm()
    cache = e.runners[0].cache
    cache.slow = True
    a = E.prompt(3, 16)
    e.add("a", a)
    e.run()
    cache.slow = False
    e.add("b", a + [4])
    e.run()
    return e


def test_vllm_stores_wait_for_the_forward_pass_on_the_engine_stream(gpu_vllm):
    e = _vllm_slow_store_then_load(gpu_vllm)
    assert e.matches["b"] == (16, True)
    assert e.verified_blocks == 4, "stored bytes are the ones the slow forward pass wrote"


def test_control_without_the_store_gate_the_stored_bytes_are_stale(gpu_vllm, monkeypatch):
    # Shows the previous test can fail: with the gate off, stores copy before the writes land.
    monkeypatch.setattr(_streams.StreamOrder, "before_stores", lambda self, stream=None: None)
    with pytest.raises(AssertionError, match="does not hold its prefix's KV|differs"):
        _vllm_slow_store_then_load(gpu_vllm)


def test_vllm_real_cuda_tensors_refused_when_mixed_or_strided():
    import torch

    from kvbm_connector import vllm

    w = vllm.KvbmConnector(E.VllmConfig(), vllm.KVConnectorRole.WORKER)
    good = GpuVllmCache(8).tensors
    names = list(good)
    mixed = {names[0]: good[names[0]], names[1]: good[names[1]].cpu()}
    with pytest.raises(KvbmError) as ei:
        w.register_kv_caches(mixed)
    assert ei.value.kind == "invalid_argument" and ei.value.context["device"] == "cpu"
    strided = {n: t.transpose(2, 3) for n, t in good.items()}
    with pytest.raises(KvbmError) as ei:
        w.register_kv_caches(strided)
    assert ei.value.kind == "invalid_layout"
    if torch.cuda.device_count() > 1:
        other = (DEVICE_INDEX + 1) % torch.cuda.device_count()
        two = {names[0]: good[names[0]], names[1]: good[names[1]].to(f"cuda:{other}")}
        with pytest.raises(KvbmError) as ei:
            w.register_kv_caches(two)
        assert ei.value.context["device"] == f"cuda:{other}"


def test_engine_stream_can_wait_for_loads(gpu_vllm):
    import torch

    e = gpu_vllm()
    a = E.prompt(12, 16)
    e.add("a", a)
    e.run()
    s = torch.cuda.Stream()
    e.worker._streams.engine_waits_for_loads(s)
    e.worker._streams.engine_waits_for_loads()  # the current stream
    s.synchronize()


def test_trtllm_stores_wait_for_the_hook_stream(gpu_trtllm):
    import torch

    e = gpu_trtllm()
    cache = e.cache
    # TensorRT-LLM passes its stream to the hooks. Here the model writes (slowly) on a side
    # stream that is *not* the current one, and the hooks are given it: gating on the current
    # stream instead would store stale bytes.
    side = torch.cuda.Stream()
    w = e.worker
    hooks = ("start_load_kv", "save_kv_layer", "wait_for_save", "wait_for_layer_load")
    for hook in hooks:
        orig = getattr(w, hook)
        setattr(w, hook, (lambda f: lambda *a: f(*a[:-1], side))(orig))
    cache.slow, cache.stream = True, side
    a = E.prompt(8, 16)
    e.submit(1, a, max_new=1)
    e.run()
    side.synchronize()
    for hook in hooks:
        delattr(w, hook)  # back to the class's hooks: the scripted loop passes None
    cache.slow, cache.stream = False, None
    e.submit(2, a + [6], max_new=1)
    e.run()
    assert e.matched[2] == (16, True)
    assert e.verified_blocks == 4, "stored bytes are the ones the slow forward pass wrote"

