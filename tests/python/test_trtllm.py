"""``kvbm_connector.trtllm`` end to end: scheduler and worker of one rank in one process, driven by
``_engines.TrtllmEngine`` in TensorRT-LLM's call order with objects shaped as TensorRT-LLM passes
them; every onboarded block is compared byte for byte with what the model computed."""

from __future__ import annotations

import inspect

import pytest

import _engines as E
from kvbm_connector import KvbmError, trtllm

# TensorRT-LLM's abstract methods and their parameters after ``self``, from the reference (§5, §6)
# and ``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py`` (newer trees:
# ``connectors/kv_cache_connector.py``, same abstract methods). TensorRT-LLM itself cannot be
# installed here (its PyPI package is a placeholder that downloads from NVIDIA's index), so the
# interface is pinned by this list.
REFERENCE_SCHEDULER = {
    "get_num_new_matched_tokens": ["request", "num_computed_tokens"],
    "update_state_after_alloc": ["request", "block_ids"],
    "build_connector_meta": ["scheduler_output"],
    "request_finished": ["request", "cache_block_ids"],
}
REFERENCE_WORKER = {
    "register_kv_caches": ["kv_cache_tensor"],
    "start_load_kv": ["stream"],
    "wait_for_layer_load": ["layer_idx", "stream"],
    "save_kv_layer": ["layer_idx", "stream"],
    "wait_for_save": ["stream"],
    "get_finished": ["finished_gen_req_ids", "started_loading_req_ids"],
    # Non-abstract in TensorRT-LLM, overridden here (the worker needs the bytes).
    "bind_connector_meta": ["metadata"],
}


def params(cls, name):
    sig = inspect.signature(getattr(cls, name))
    return [p.name for p in sig.parameters.values() if p.name != "self"]


@pytest.mark.parametrize(
    "cls,reference",
    [
        (trtllm.KvbmConnectorScheduler, REFERENCE_SCHEDULER),
        (trtllm.KvbmConnectorWorker, REFERENCE_WORKER),
    ],
)
def test_method_signatures_match_tensorrt_llm(cls, reference):
    for name, expected in reference.items():
        assert params(cls, name) == expected, f"{cls.__name__}.{name}"
    # The constructor takes llm_args positionally, as TensorRT-LLM calls it.
    init = inspect.signature(cls.__init__).parameters
    positional = [p for p in init.values() if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self"]
    assert [p.name for p in positional] == ["llm_args"]


def test_module_lists_agree_with_reference():
    assert {k: list(v) for k, v in trtllm.SCHEDULER_METHODS.items()} == REFERENCE_SCHEDULER
    worker = {k: list(v) for k, v in trtllm.WORKER_METHODS.items()}
    assert worker == {k: v for k, v in REFERENCE_WORKER.items() if k != "bind_connector_meta"}


def test_subclasses_tensorrt_llm_bases_when_importable():
    if not trtllm.HAVE_TRTLLM:
        pytest.skip("tensorrt_llm is not importable here (its PyPI package is a placeholder)")
    import importlib  # pragma: no cover

    bases = importlib.import_module(trtllm.TRTLLM_BASES_MODULE)
    KvCacheConnectorScheduler = bases.KvCacheConnectorScheduler
    KvCacheConnectorWorker = bases.KvCacheConnectorWorker
    assert issubclass(trtllm.KvbmConnectorScheduler, KvCacheConnectorScheduler)
    assert issubclass(trtllm.KvbmConnectorWorker, KvCacheConnectorWorker)


def transferred(sched, src, dst):
    return sum(
        t["blocks"] for t in sched.metrics()["transfers"] if t["src"] == src and t["dst"] == dst
    )


# -------------------------------------------------------------------------------------------------
# Scenarios
# -------------------------------------------------------------------------------------------------


def test_cold_request_stores_its_full_blocks(trtllm_engine):
    e = trtllm_engine()
    e.submit(1, E.prompt(1, 14), max_new=2)  # 3 full blocks and 2 tokens, then 2 generated
    e.run()
    assert e.matched[1] == (0, False)
    assert transferred(e.sched, "device", "host") == 3
    assert e.free == set(range(48)), "device blocks leaked"
    assert all(isinstance(m, bytes) for m in e.metas)


def test_prefix_hit_from_host_is_byte_exact(trtllm_engine):
    e = trtllm_engine()
    a = E.prompt(7, 16)
    e.submit(1, a, max_new=1)
    e.run()
    e.submit(2, a + E.prompt(8, 6), max_new=2)
    e.run()
    assert e.matched[2] == (16, True)
    assert e.verified_blocks == 4
    assert 2 in e.loaded_ids
    m = e.sched.metrics()
    assert m["host_hit_tokens"] == 16
    assert e.free == set(range(48))


def test_full_prompt_match_leaves_one_block_to_compute(trtllm_engine):
    e = trtllm_engine()
    a = E.prompt(3, 12)
    e.submit(1, a, max_new=1)
    e.run()
    e.submit(2, list(a), max_new=1)
    e.run()
    assert e.matched[2] == (8, True)
    assert e.verified_blocks == 2


def test_disk_hit_after_host_eviction(trtllm_engine, monkeypatch):
    monkeypatch.setenv("KVBM_HOST_CACHE_BLOCKS", "4")
    e = trtllm_engine()
    a = E.prompt(11, 16)
    e.submit(1, a, max_new=1)
    e.run()
    for i in range(3):  # push request 1's blocks out of the 4-block host tier
        e.submit(10 + i, E.prompt(20 + i, 16), max_new=1)
        e.run()
    e.submit(2, a + [5, 6, 7], max_new=1)
    e.run()
    assert e.matched[2] == (16, True)
    assert e.verified_blocks == 4
    assert e.sched.metrics()["disk_hit_tokens"] > 0


def test_chunked_prefill_and_decode(trtllm_engine):
    e = trtllm_engine(chunk=5)
    a = E.prompt(4, 13)
    e.submit(1, a, max_new=7)  # 13 + 7 tokens: the KV of 19 of them is computed
    e.run()
    done = e.done[1].tokens
    e.submit(2, done[:16] + [1, 2], max_new=1)
    e.run()
    assert e.matched[2] == (16, True), "blocks filled while decoding were stored"
    assert e.verified_blocks == 4


def test_abort_while_load_in_flight_releases_blocks(trtllm_engine):
    e = trtllm_engine()
    a = E.prompt(9, 16)
    e.submit(1, a, max_new=1)
    e.run()
    e.submit(2, a + [1], max_new=1)
    e.iteration += 1
    e._admit()  # matched and allocated; its load is in this iteration's metadata
    assert e.matched[2] == (16, True)
    held = e.abort(2)
    e._execute()  # the iteration that admitted it builds and binds its metadata
    e.run()
    assert 2 in e.done
    assert e.free == set(range(48))
    assert isinstance(held, bool)


# -------------------------------------------------------------------------------------------------
# Bad input
# -------------------------------------------------------------------------------------------------


def test_bad_engine_input_raises_kvbm_errors(trtllm_engine):
    e = trtllm_engine(num_blocks=8)
    e.submit(1, E.prompt(1, 8), max_new=1)
    e._admit()

    out = E.TrtSchedulerOutput(
        new_requests=[E.RequestData(1, E.prompt(1, 8), [0, 99], 0, 8)]
    )
    with pytest.raises(KvbmError) as ei:
        e.sched.build_connector_meta(out)
    assert ei.value.kind in ("out_of_range", "invalid_argument")
    assert "99" in str(ei.value)

    class NoTokens:
        request_id = 5

    with pytest.raises(KvbmError) as ei:
        e.sched.get_num_new_matched_tokens(NoTokens(), 0)
    assert ei.value.kind == "invalid_argument" and "get_tokens" in ei.value.message

    with pytest.raises(KvbmError) as ei:
        e.sched.update_state_after_alloc(E.LlmRequest(77, [1, 2], 1), ["x"])
    assert ei.value.kind == "invalid_argument"

    with pytest.raises(KvbmError) as ei:
        e.worker.bind_connector_meta(b"\x00not metadata")
    assert ei.value.kind == "decode"
    with pytest.raises(KvbmError) as ei:
        e.worker.bind_connector_meta("text")
    assert ei.value.kind == "invalid_argument"
    with pytest.raises(KvbmError) as ei:
        e.worker.wait_for_layer_load(E.LAYERS, None)
    assert ei.value.kind == "out_of_range" and ei.value.context.get("layer") == str(E.LAYERS)
    with pytest.raises(KvbmError) as ei:
        e.worker.register_kv_caches(E.TrtllmCache(8).tensor)
    assert ei.value.kind == "already_exists"
    with pytest.raises(OverflowError):
        e.sched.get_num_new_matched_tokens(E.LlmRequest(6, [1, 2, 3], 1), -1)


def test_missing_tokens_per_block_is_a_config_error():
    class Args:
        kv_cache_config = None

    with pytest.raises(KvbmError) as ei:
        trtllm.KvbmConnectorScheduler(Args())
    assert ei.value.kind == "invalid_config"
    assert "tokens_per_block" in str(ei.value)


def test_worker_registration_refuses_a_wrong_shape():
    args = E.TrtLlmArgs()
    sched = trtllm.KvbmConnectorScheduler(args)
    worker = trtllm.KvbmConnectorWorker(args)
    import numpy as np

    bad = E.FakeTensor(np.zeros((8, E.LAYERS, 3, E.BS * E.INNER), dtype=E.DTYPE))  # kv_factor 3
    with pytest.raises(KvbmError) as ei:
        worker.register_kv_caches(bad)
    assert ei.value.kind == "invalid_layout" and "outer_dim" in str(ei.value)
    del sched
