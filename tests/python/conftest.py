"""Shared fixtures: an isolated kvbm environment per test, and engine factories.

The connector classes read their configuration the way they do in an engine: from the
``KVBM_*`` / ``DYN_KVBM_*`` environment variables and ``$KVBM_CONFIG`` (``Config::load``). Every
test starts with those cleared and a small host and disk tier under its own temporary directory.
"""

from __future__ import annotations

import os

# Where the real vLLM is installed (test_vllm_real.py), it runs on the CPU platform, offline. Set
# before anything imports vLLM: its platform is resolved once.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

import kvbm_connector  # noqa: E402
from kvbm_connector import trtllm, vllm  # noqa: E402

import _engines as E  # noqa: E402


@pytest.fixture(autouse=True)
def kvbm_env(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith(("KVBM_", "DYN_KVBM_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVBM_HOST_CACHE_BLOCKS", "16")
    monkeypatch.setenv("KVBM_DISK_CACHE_BLOCKS", "64")
    monkeypatch.setenv("KVBM_DISK_CACHE_DIR", str(tmp_path / "disk"))
    monkeypatch.setenv("KVBM_INIT_TIMEOUT_SECS", "20")
    yield tmp_path
    # An in-process pairing a failed test left half taken must not leak into the next test.
    from kvbm_connector import _wiring

    with _wiring._registry_lock:
        _wiring._registry.clear()


@pytest.fixture
def trtllm_engine():
    """Builds a one-rank TensorRT-LLM engine the way TensorRT-LLM does: the scheduler (rank 0,
    non-blocking), the worker, then ``register_kv_caches`` (blocking until the barrier), then the
    scheduler's ``wait_for_initialization``."""

    def make(num_blocks: int = 48, chunk=None, cache=None) -> E.TrtllmEngine:
        # ``cache``: another cache with TrtllmCache's interface (test_gpu.py: on a GPU).
        args = E.TrtLlmArgs()
        sched = trtllm.KvbmConnectorScheduler(args)
        worker = trtllm.KvbmConnectorWorker(args)
        cache = cache if cache is not None else E.TrtllmCache(num_blocks)
        worker.register_kv_caches(cache.tensor)
        assert worker.is_ready(), "blocking registration returned before the barrier completed"
        sched.wait_for_initialization()
        assert sched.is_ready()
        return E.TrtllmEngine(sched, worker, cache, chunk=chunk)

    return make


@pytest.fixture
def vllm_engine():
    """Builds a one-rank vLLM engine the way vLLM does: the worker-role connector registers its
    caches (non-blocking), then the scheduler-role connector is built (blocking)."""

    def make(num_blocks: int = 32, backend: str = "flash_attn", budget: int = 32,
             extra=None, cache=None) -> E.VllmEngine:
        # ``cache``: another cache with VllmCache's interface (test_gpu.py: on a GPU).
        cfg = E.VllmConfig()
        if extra:
            cfg.kv_transfer_config.kv_connector_extra_config.update(extra)
        worker = vllm.KvbmConnector(cfg, vllm.KVConnectorRole.WORKER)
        cache = cache if cache is not None else E.VllmCache(num_blocks, backend)
        worker.register_kv_caches(cache.tensors)
        sched = vllm.KvbmConnector(cfg, vllm.KVConnectorRole.SCHEDULER)
        assert sched.is_ready(), "blocking scheduler init returned before the barrier completed"
        worker.wait_ready(10)
        engine = E.VllmEngine(sched, [E.VllmRunner(worker, cache)], num_blocks, budget=budget)
        engine.worker = worker
        return engine

    return make


__all__ = ["kvbm_connector"]
