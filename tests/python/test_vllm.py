"""``kvbm_connector.vllm`` end to end: the worker-role and scheduler-role ``KvbmConnector`` of one
rank in one process, driven by ``_engines.VllmEngine`` in vLLM v1's call order with objects shaped
as vLLM passes them; every onboarded block is compared byte for byte."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import _engines as E
from kvbm_connector import KvbmError, vllm

# KVConnectorBase_V1's methods the connector implements and their parameters after ``self``
# (vLLM v1, ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``).
REFERENCE = {
    "__init__": ["vllm_config", "role", "kv_cache_config"],
    # scheduler side
    "get_num_new_matched_tokens": ["request", "num_computed_tokens"],
    "update_state_after_alloc": ["request", "blocks", "num_external_tokens"],
    "build_connector_meta": ["scheduler_output"],
    "request_finished": ["request", "block_ids"],
    "update_connector_output": ["connector_output"],
    # worker side
    "register_kv_caches": ["kv_caches"],
    "bind_connector_metadata": ["connector_metadata"],
    "clear_connector_metadata": [],
    "start_load_kv": ["forward_context", "kwargs"],
    "wait_for_layer_load": ["layer_name"],
    "save_kv_layer": ["layer_name", "kv_layer", "attn_metadata", "kwargs"],
    "wait_for_save": [],
    "get_finished": ["finished_req_ids"],
    "get_block_ids_with_load_errors": [],
}


def test_method_signatures_match_vllm():
    for name, expected in REFERENCE.items():
        sig = inspect.signature(getattr(vllm.KvbmConnector, name))
        got = [p.name for p in sig.parameters.values() if p.name != "self"]
        assert got == expected, name


def transferred(conn, src, dst):
    return sum(
        t["blocks"] for t in conn.metrics()["transfers"] if t["src"] == src and t["dst"] == dst
    )


@pytest.mark.parametrize("backend", ["flash_attn", "flashinfer"])
def test_prefix_hit_from_host_is_byte_exact(vllm_engine, backend):
    e = vllm_engine(backend=backend)
    a = E.prompt(7, 16)
    e.add("a", a, max_tokens=2)
    e.run()
    assert e.held["a"] in (True, False)
    assert transferred(e.sched, "device", "host") == 4
    e.add("b", a + E.prompt(8, 5), max_tokens=2)
    e.run()
    assert e.matches["b"] == (16, True)
    assert e.verified_blocks == 4
    assert e.sched.metrics()["host_hit_tokens"] == 16
    assert e.hit_sources["b"] == {"host": 16}
    assert e.free == set(range(1, 32)), "device blocks leaked"


def test_chunked_prefill_stores_each_block_once(vllm_engine):
    e = vllm_engine(budget=6)
    a = E.prompt(2, 22)
    e.add("a", a, max_tokens=3)
    e.run()
    assert transferred(e.sched, "device", "host") == 6  # 24 tokens computed: 6 full blocks
    e.add("b", a[:20], max_tokens=1)
    e.run()
    assert e.matches["b"] == (16, True)  # the whole-prompt match drops its last block
    assert e.verified_blocks == 4


def test_disk_hit_after_host_eviction(vllm_engine, monkeypatch):
    monkeypatch.setenv("KVBM_HOST_CACHE_BLOCKS", "4")
    e = vllm_engine()
    a = E.prompt(11, 16)
    e.add("a", a)
    e.run()
    for i in range(3):
        e.add(f"x{i}", E.prompt(30 + i, 16))
        e.run()
    e.add("b", a + [1, 2, 3])
    e.run()
    assert e.matches["b"] == (16, True)
    assert e.verified_blocks == 4
    assert e.sched.metrics()["disk_hit_tokens"] > 0
    sources = e.hit_sources["b"]
    assert sum(sources.values()) == 16 and sources.get("disk", 0) > 0, sources


def test_salt_and_lora_isolate_tenants(vllm_engine):
    e = vllm_engine()
    a = E.prompt(5, 16)
    e.add("a", a, cache_salt="tenant-1")
    e.run()
    e.add("b", a + [9], cache_salt="tenant-2")
    e.add("c", a + [9], lora_request=E.LoRARequest("adapter"))
    e.run()
    assert e.matches["b"] == (0, False)
    assert e.matches["c"] == (0, False)
    e.add("d", a + [9], cache_salt="tenant-1")
    e.run()
    assert e.matches["d"] == (16, True)


def test_abort_while_loading(vllm_engine):
    e = vllm_engine()
    a = E.prompt(6, 16)
    e.add("a", a)
    e.run()
    e.add("b", a + [1])
    e.step()  # b matched, allocated, its load submitted
    assert e.reqs["b"].status in ("waiting_for_remote_kvs", "running")
    e.finish("b")
    e.run()
    assert e.free == set(range(1, 32))


def test_metadata_crosses_processes_as_a_picklable_object(vllm_engine):
    import pickle

    e = vllm_engine()
    e.add("a", E.prompt(1, 9))
    out, _ = e._schedule()
    meta = e.sched.build_connector_meta(out)
    assert isinstance(meta, vllm.KvbmConnectorMetadata)
    assert isinstance(meta.data, bytes) and meta.data
    copy = pickle.loads(pickle.dumps(meta))
    e.worker.bind_connector_metadata(copy)
    e.worker.clear_connector_metadata()


# -------------------------------------------------------------------------------------------------
# Bad input and roles
# -------------------------------------------------------------------------------------------------


def test_bad_engine_input_raises_kvbm_errors(vllm_engine):
    e = vllm_engine(num_blocks=8)
    r = e.add("a", E.prompt(1, 8))
    e.sched.get_num_new_matched_tokens(r, 0)

    two_groups = E.SchedulerOutput(
        scheduled_new_reqs=[E.NewRequestData("a", r.prompt_token_ids, ([0, 1], [2, 3]), 0)],
        num_scheduled_tokens={"a": 8},
    )
    with pytest.raises(KvbmError) as ei:  # a one-group model (kv_cache_config has one group)
        e.sched.build_connector_meta(two_groups)
    assert ei.value.kind == "invalid_argument" and "groups" in ei.value.message, ei.value

    missing_count = E.SchedulerOutput(
        scheduled_new_reqs=[E.NewRequestData("a", r.prompt_token_ids, ([0, 1],), 0)],
    )
    with pytest.raises(KvbmError) as ei:
        e.sched.build_connector_meta(missing_count)
    assert ei.value.kind == "invalid_argument" and "num_scheduled_tokens" in ei.value.message

    with pytest.raises(KvbmError) as ei:
        e.sched.update_state_after_alloc(E.Request("zz", [1, 2], 1), E.KVCacheBlocks([0]), 4)
    assert ei.value.kind in ("not_found", "invalid_argument", "invalid_state")

    with pytest.raises(KvbmError) as ei:
        e.worker.wait_for_layer_load("no.such.layer")
    assert ei.value.kind == "invalid_argument" and ei.value.context["layer"] == "no.such.layer"

    with pytest.raises(KvbmError) as ei:
        e.worker.build_connector_meta(E.SchedulerOutput())
    assert ei.value.kind == "invalid_state"
    with pytest.raises(KvbmError) as ei:
        e.sched.start_load_kv(None)
    assert ei.value.kind == "invalid_state"


def test_pipeline_parallelism_is_refused():
    cfg = E.VllmConfig(parallel_config=E.ParallelConfig(pipeline_parallel_size=2))
    with pytest.raises(KvbmError) as ei:
        vllm.KvbmConnector(cfg, vllm.KVConnectorRole.WORKER)
    assert ei.value.kind == "unsupported"


def test_unknown_transport_is_a_config_error():
    cfg = E.VllmConfig()
    cfg.kv_transfer_config.kv_connector_extra_config["transport"] = "carrier-pigeon"
    with pytest.raises(KvbmError) as ei:
        vllm.KvbmConnector(cfg, vllm.KVConnectorRole.WORKER)
    assert ei.value.kind == "invalid_config"


def test_ambiguous_shapes_need_num_blocks_or_layout():
    # [2, 2, block_size, ...] reads as outer-major with 2 blocks or block-major with 2 blocks.
    cfg = E.VllmConfig()
    cfg.kv_transfer_config.engine_id = "ambiguous"
    worker = vllm.KvbmConnector(cfg, vllm.KVConnectorRole.WORKER)
    caches = {
        E.layer_name(l): E.FakeTensor(np.zeros((2, 2, E.BS, E.HEADS, E.HEAD_DIM), E.DTYPE))
        for l in range(E.LAYERS)
    }
    with pytest.raises(KvbmError) as ei:
        worker.register_kv_caches(caches)
    assert ei.value.kind == "invalid_layout" and "ambiguous" in ei.value.message
    worker._layout = "layer_separate_outer_major"
    worker.register_kv_caches(caches)
    sched = vllm.KvbmConnector(cfg, vllm.KVConnectorRole.SCHEDULER)
    assert sched.is_ready()


def test_subclasses_vllm_base_when_importable():
    if not vllm.HAVE_VLLM:
        pytest.skip("vllm is not importable here; test_vllm_real.py covers the real package")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # pragma: no cover
        KVConnectorBase_V1,
        KVConnectorMetadata,
    )

    assert issubclass(vllm.KvbmConnector, KVConnectorBase_V1)
    assert issubclass(vllm.KvbmConnectorMetadata, KVConnectorMetadata)


def test_shutdown_closes_both_halves_at_once(vllm_engine, caplog):
    """vLLM calls ``shutdown()`` on the scheduler's and each worker's connector when the engine
    stops: both halves close then (not when garbage collected, which was seen ~20 s later, with a
    'connection lost' warning in the next engine's log), calls after it are typed errors, and a
    second shutdown does nothing."""
    import logging

    e = vllm_engine()
    a = E.prompt(3, 12)
    e.add("a", a)
    e.run()
    worker, sched = e.worker, e.sched
    with caplog.at_level(logging.WARNING, logger="kvbm_connector"):
        worker.shutdown()  # the worker first (as vLLM's executor does): it waits for its saves
        sched.shutdown()
        worker.shutdown()
        sched.shutdown()
    assert not [r for r in caplog.records if "still running" in r.getMessage()], caplog.text
    for call in (sched.has_pending_work, lambda: worker.wait_idle(1)):
        with pytest.raises(KvbmError) as ei:
            call()
        assert ei.value.kind == "invalid_state" and "shutdown" in ei.value.message
    # A new engine after it starts and serves as usual.
    e2 = vllm_engine()
    e2.add("b", E.prompt(4, 12))
    e2.run()
    assert e2.sched.metrics()["operations_failed"] == 0


def test_a_persisted_disk_tier_is_named_after_the_served_model(monkeypatch):
    """KVBM_DISK_PERSIST needs a namespace naming the model: the connector uses vLLM's model
    name when none is set, and leaves an explicit one alone."""
    import json
    from types import SimpleNamespace

    from kvbm_connector import load_config
    from kvbm_connector.vllm import _with_model_namespace

    vc = SimpleNamespace(model_config=SimpleNamespace(model="org/model-7b"))
    monkeypatch.setenv("KVBM_DISK_PERSIST", "1")
    cfg = _with_model_namespace(load_config(), vc, {})
    assert json.loads(cfg.to_json())["remote"]["namespace"] == "org/model-7b"
    monkeypatch.setenv("KVBM_REMOTE_NAMESPACE", "mine")
    cfg = _with_model_namespace(load_config(), vc, {})
    assert json.loads(cfg.to_json())["remote"]["namespace"] == "mine"
    monkeypatch.delenv("KVBM_REMOTE_NAMESPACE")
    monkeypatch.delenv("KVBM_DISK_PERSIST")
    cfg = _with_model_namespace(load_config(), vc, {})
    assert (json.loads(cfg.to_json()).get("remote") or {}).get("namespace") is None
