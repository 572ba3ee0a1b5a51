"""``kvbm_connector.trtllm`` under TensorRT-LLM's connector-manager semantics (issue 12, part 2):
idle iterations that call only ``get_finished``, the first ``computed_position`` after an
asynchronous load, both import paths of the connector bases and the newer API's methods, and the
cache salt of both API generations.

TensorRT-LLM cannot be installed here: the bases are stood in for by fake modules injected into
``sys.modules`` at the two paths TensorRT-LLM has used, shaped as its sources define them
(``KvCacheConnectorScheduler`` / ``KvCacheConnectorWorker`` as ABCs with the same abstract
methods; the newer generation adds ``wait_for_initialization``, ``supports_attention_dp``,
``register_kv_cache_layout`` and the ``*_by_layer_group`` methods)."""

from __future__ import annotations

import abc
import importlib
import sys
import threading
import time
import types

import numpy as np
import pytest

import _engines as E
from kvbm_connector import KvbmError, trtllm

OLD_PATH = "tensorrt_llm._torch.pyexecutor.kv_cache_connector"
NEW_PATH = "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector"


# -------------------------------------------------------------------------------------------------
# Fake TensorRT-LLM bases
# -------------------------------------------------------------------------------------------------


def _bases(newer: bool):
    class KvCacheConnectorWorker(abc.ABC):
        supports_attention_dp = False

        def __init__(self, llm_args):
            self._llm_args = llm_args
            self._metadata = None

        def bind_connector_meta(self, metadata):
            self._metadata = metadata

        def get_connector_meta(self):
            return self._metadata

        def _clear_connector_meta(self):
            self._metadata = None

        def register_forward_pass_callable(self):
            return None

        @abc.abstractmethod
        def register_kv_caches(self, kv_cache_tensor): ...

        @abc.abstractmethod
        def start_load_kv(self, stream): ...

        @abc.abstractmethod
        def wait_for_layer_load(self, layer_idx, stream): ...

        @abc.abstractmethod
        def save_kv_layer(self, layer_idx, stream): ...

        @abc.abstractmethod
        def wait_for_save(self, stream): ...

        @abc.abstractmethod
        def get_finished(self, finished_gen_req_ids, started_loading_req_ids): ...

    class KvCacheConnectorScheduler(abc.ABC):
        def __init__(self, llm_args):
            self._llm_args = llm_args

        @abc.abstractmethod
        def build_connector_meta(self, scheduler_output): ...

        @abc.abstractmethod
        def get_num_new_matched_tokens(self, request, num_computed_tokens): ...

        @abc.abstractmethod
        def request_finished(self, request, cache_block_ids): ...

        @abc.abstractmethod
        def update_state_after_alloc(self, request, block_ids): ...

    if newer:

        def wait_for_initialization(self):
            return

        def register_kv_cache_layout(self, layout):
            raise NotImplementedError("base default")

        KvCacheConnectorScheduler.wait_for_initialization = wait_for_initialization
        KvCacheConnectorScheduler.supports_attention_dp = False
        KvCacheConnectorWorker.register_kv_cache_layout = register_kv_cache_layout
    return KvCacheConnectorScheduler, KvCacheConnectorWorker


def _install(monkeypatch, path, newer):
    sched, worker = _bases(newer)
    parts = path.split(".")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    mod = types.ModuleType(path)
    mod.KvCacheConnectorScheduler = sched
    mod.KvCacheConnectorWorker = worker
    monkeypatch.setitem(sys.modules, path, mod)
    return sched, worker


@pytest.fixture
def fake_trtllm(monkeypatch):
    """Installs fake bases at the paths asked for and reloads ``kvbm_connector.trtllm``; restores
    the module (local stand-ins) afterwards."""
    if trtllm.HAVE_TRTLLM:
        pytest.skip("a real tensorrt_llm is importable here")

    def install(*paths):
        found = {}
        for path in paths:
            found[path] = _install(monkeypatch, path, newer=path == NEW_PATH)
        importlib.reload(trtllm)
        return found

    yield install
    monkeypatch.undo()
    importlib.reload(trtllm)
    assert not trtllm.HAVE_TRTLLM


def _engine(sched_cls=None, worker_cls=None, num_blocks=48):
    args = E.TrtLlmArgs()
    sched = (sched_cls or trtllm.KvbmConnectorScheduler)(args)
    worker = (worker_cls or trtllm.KvbmConnectorWorker)(args)
    cache = E.TrtllmCache(num_blocks)
    worker.register_kv_caches(cache.tensor)
    sched.wait_for_initialization()
    return E.TrtllmEngine(sched, worker, cache)


# -------------------------------------------------------------------------------------------------
# 1. Idle engine: only get_finished
# -------------------------------------------------------------------------------------------------


def test_idle_engine_completes_a_held_request_with_get_finished_only(trtllm_engine):
    e = trtllm_engine()
    a = E.prompt(5, 12)  # 3 full blocks; all computed in the request's only iteration
    e.submit(1, a, max_new=1)
    e.step()
    assert e.held[1] is True, "its last stores are in flight: the engine keeps its blocks"
    builds = len(e.metas)
    for _ in range(3):
        e.step()
    assert len(e.metas) == builds, "an idle engine builds no metadata"
    assert e.idle_iterations == 3
    assert 1 in e.done, "the held request was never released by get_finished alone"
    assert e.free == set(range(48))
    # Its stores ran: the next request with the same prefix is served from host.
    e.submit(2, a + [3], max_new=1)
    e.run()
    assert e.matched[2] == (12, True)
    assert e.verified_blocks == 3


def test_idle_engine_serves_a_request_that_finishes_while_another_loads(trtllm_engine):
    e = trtllm_engine()
    a = E.prompt(6, 16)
    e.submit(1, a, max_new=1)
    e.run()
    e.submit(2, a + [1], max_new=1)  # loads 16 tokens asynchronously
    e.submit(3, E.prompt(7, 9), max_new=1)  # computes, finishes held in the same iteration
    e.run()
    assert e.matched[2] == (16, True) and e.verified_blocks == 4
    assert {2, 3} <= set(e.done)
    assert e.free == set(range(48))


# -------------------------------------------------------------------------------------------------
# 4. The first computed_position after an asynchronous load
# -------------------------------------------------------------------------------------------------


def test_first_position_after_async_load_counts_the_loaded_tokens(trtllm_engine):
    e = trtllm_engine()
    a = E.prompt(8, 16)
    e.submit(1, a, max_new=1)
    e.run()
    e.submit(2, a + E.prompt(9, 6), max_new=3)
    e.run()
    assert e.matched[2] == (16, True)
    first = [r for out in e.outputs for r in out.new_requests if r.request_id == 2]
    assert len(first) == 1
    assert first[0].computed_position == 16, "TensorRT-LLM reports the loaded count, not 0"
    assert len(first[0].new_block_ids) == 6, "all its blocks, the loaded ones included"
    # Nothing loaded is stored again; the 5th block (computed by the prefill) and the 6th (filled
    # by the decode: 22 prompt tokens and 2 fed back, the request's last stores at its finish)
    # are. The engine ran until the 6th's store was reported, and reading the metrics applies
    # that completion (before, the read came first and showed 5).
    assert e.verified_blocks == 4
    host = sum(
        t["blocks"] for t in e.sched.metrics()["transfers"]
        if (t["src"], t["dst"]) == ("device", "host")
    )
    assert host == 4 + 2
    e.submit(3, e.done[2].tokens[:21], max_new=1)
    e.run()
    assert e.matched[3] == (20, True)
    assert e.verified_blocks == 9


# -------------------------------------------------------------------------------------------------
# 2. Import paths and the newer API
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [OLD_PATH, NEW_PATH])
def test_bases_are_found_at_either_path(fake_trtllm, path):
    (sched_base, worker_base), = fake_trtllm(path).values()
    assert trtllm.HAVE_TRTLLM and trtllm.TRTLLM_BASES_MODULE == path
    assert issubclass(trtllm.KvbmConnectorScheduler, sched_base)
    assert issubclass(trtllm.KvbmConnectorWorker, worker_base)
    # Every abstract method is implemented: both classes can be built and run.
    e = _engine()
    e.submit(1, E.prompt(1, 9), max_new=1)
    e.run()
    assert 1 in e.done


def test_newer_path_wins_when_both_exist(fake_trtllm):
    found = fake_trtllm(OLD_PATH, NEW_PATH)
    assert trtllm.TRTLLM_BASES_MODULE == NEW_PATH
    assert issubclass(trtllm.KvbmConnectorScheduler, found[NEW_PATH][0])
    assert not issubclass(trtllm.KvbmConnectorScheduler, found[OLD_PATH][0])


def test_attention_dp_is_declared_unsupported(fake_trtllm):
    fake_trtllm(NEW_PATH)
    assert trtllm.KvbmConnectorScheduler.supports_attention_dp is False
    assert trtllm.KvbmConnectorWorker.supports_attention_dp is False
    assert "tp x pp" in trtllm.ATTENTION_DP_UNSUPPORTED


def test_wait_for_initialization_blocks_until_the_barrier_completed():
    args = E.TrtLlmArgs()
    sched = trtllm.KvbmConnectorScheduler(args)
    worker = trtllm.KvbmConnectorWorker(args)
    cache = E.TrtllmCache(48)
    # The worker registers late, on another thread (another rank, in TensorRT-LLM).
    t = threading.Thread(target=lambda: (time.sleep(0.3), worker.register_kv_caches(cache.tensor)))
    t.start()
    assert not sched.is_ready()
    sched.wait_for_initialization()
    assert sched.is_ready()
    t.join()
    # A request admitted right away is matched and offloaded.
    e = E.TrtllmEngine(sched, worker, cache)
    a = E.prompt(2, 12)
    e.submit(1, a, max_new=1)
    e.run()
    e.submit(2, a + [4], max_new=1)
    e.run()
    assert e.matched[2] == (12, True)


def test_without_wait_for_initialization_the_first_request_is_offloaded():
    """Issue 42 item 7. TensorRT-LLM's older connector API has no ``wait_for_initialization``:
    the executor admits requests as soon as the worker's ``register_kv_caches`` returned. The
    registration returns only once the scheduler is ready too (the barrier's step 3), so a
    one-token request admitted and finished right away is offloaded, and a later request with its
    prompt loads it. (Before step 3, the scheduler was not yet ready after the registration in 5 of
    6 start-ups on a busy host, and such a request was never offloaded; tests/e2e_trtllm.rs
    holds the scheduler back deterministically.)"""
    args = E.TrtLlmArgs()
    sched = trtllm.KvbmConnectorScheduler(args)
    worker = trtllm.KvbmConnectorWorker(args)
    cache = E.TrtllmCache(48)
    worker.register_kv_caches(cache.tensor)
    assert sched.is_ready(), "register_kv_caches returned before the scheduler was ready"
    e = E.TrtllmEngine(sched, worker, cache)
    a = E.prompt(3, 12)
    e.submit(1, a, max_new=1)
    e.run()
    e.submit(2, a + [4], max_new=1)
    e.run()
    assert e.matched[2] == (12, True)


def test_wait_for_initialization_gives_up_at_the_init_timeout(monkeypatch):
    monkeypatch.setenv("KVBM_INIT_TIMEOUT_SECS", "0.5")
    sched = trtllm.KvbmConnectorScheduler(E.TrtLlmArgs())  # no worker ever registers
    t0 = time.monotonic()
    with pytest.raises(KvbmError) as ei:
        sched.wait_for_initialization()
    assert ei.value.kind == "timeout"
    assert time.monotonic() - t0 < 5


class _Region:
    def __init__(self, n=1):
        self.n = n


class _Group:
    def __init__(self, regions=1, window=None, replicated=()):
        self.layer_group_id = 0
        self.layer_ids = tuple(range(E.LAYERS))
        self.window_size = window
        self.regions = tuple(_Region() for _ in range(regions))
        self.replicated_regions = tuple(replicated)


class _Layout:
    def __init__(self, tensor, groups=None, tpb=E.BS):
        self.tokens_per_block = tpb
        self.groups = tuple(groups if groups is not None else [_Group()])
        self._tensor = tensor

    def as_single_pool_tensor(self):
        if len(self.groups) != 1 or len(self.groups[0].regions) != 1:
            return None
        return self._tensor


def test_register_kv_cache_layout_registers_its_single_pool_tensor():
    args = E.TrtLlmArgs()
    sched = trtllm.KvbmConnectorScheduler(args)
    worker = trtllm.KvbmConnectorWorker(args)
    cache = E.TrtllmCache(48)
    worker.register_kv_cache_layout(_Layout(cache.tensor))
    sched.wait_for_initialization()
    e = E.TrtllmEngine(sched, worker, cache)
    a = E.prompt(3, 12)
    e.submit(1, a, max_new=1)
    e.run()
    e.submit(2, a + [1], max_new=1)
    e.run()
    assert e.matched[2] == (12, True) and e.verified_blocks == 3


def test_a_sliding_window_layout_loads_only_the_pages_the_window_keeps():
    """One layer group with a sliding window (KV cache manager V2): a hit's blocks before the
    window come as BAD_PAGE_INDEX (-1) in the flat list, the scheduler output and at finish;
    nothing is loaded into or stored from them, the window's pages load with the prefix's KV.
    The scheduler knows the window from llm_args (max_attention_window, one value below
    max_seq_len): only the pages from the window before the prompt's end on are stored."""
    args = E.TrtLlmArgs(
        kv_cache_config=E.TrtKvCacheConfig(max_attention_window=[2 * E.BS]), max_seq_len=4096
    )
    sched = trtllm.KvbmConnectorScheduler(args)
    worker = trtllm.KvbmConnectorWorker(args)
    cache = E.TrtllmCache(48)
    worker.register_kv_cache_layout(_Layout(cache.tensor, groups=[_Group(window=2 * E.BS)]))
    assert worker.window_size == 2 * E.BS
    sched.wait_for_initialization()
    e = E.TrtllmEngine(sched, worker, cache, window_blocks=2)
    a = E.prompt(21, 8 * E.BS)
    e.submit(1, a, max_new=2)
    e.run()
    e.submit(2, a + [7], max_new=2)
    e.run()
    assert e.matched[2] == (8 * E.BS, True)
    b = e.done[2]
    assert b.blocks[:6] == [trtllm.BAD_PAGE_INDEX] * 6, b.blocks
    assert all(p >= 0 for p in b.blocks[6:]), b.blocks
    # The window's two pages were loaded, and hold the prefix's KV (checked by the engine).
    assert e.verified_blocks == 2
    m = sched.metrics()
    assert m["load_error_blocks"] == 0
    # Of request 1's 8 full blocks (the prompt's last block is 7), blocks 6-7 are stored: 0-4
    # lie before every window a later hit needs, and 5 leaves the window in the iteration its
    # store would run (TensorRT-LLM's stores trail the compute by one iteration, and a page that
    # left the window may be another request's by then).
    assert m["window_skipped_blocks"] == 6, m
    # Pages taken back at the end are whole again (no -1 reached the free list).
    assert e.free == set(range(48))


def test_a_layout_whose_window_differs_from_llm_args_is_refused():
    args = E.TrtLlmArgs(
        kv_cache_config=E.TrtKvCacheConfig(max_attention_window=[2 * E.BS]), max_seq_len=4096
    )
    worker = trtllm.KvbmConnectorWorker(args)
    with pytest.raises(KvbmError) as ei:
        worker.register_kv_cache_layout(_Layout(E.TrtllmCache(8).tensor, groups=[_Group()]))
    assert ei.value.kind == "invalid_layout"
    assert "max_attention_window says 8" in ei.value.message, ei.value.message
    with pytest.raises(KvbmError) as ei:
        trtllm.KvbmConnectorScheduler(
            E.TrtLlmArgs(kv_cache_config=E.TrtKvCacheConfig(max_attention_window=[0]))
        )
    assert ei.value.kind == "invalid_config"


def test_a_sliding_layout_whose_window_llm_args_does_not_give_is_refused():
    """Without the window in llm_args the scheduler would store pages by computed position, one
    iteration late, some after the window left them (another request's by then): refused,
    naming the setting."""
    worker = trtllm.KvbmConnectorWorker(E.TrtLlmArgs())
    with pytest.raises(KvbmError) as ei:
        worker.register_kv_cache_layout(
            _Layout(E.TrtllmCache(8).tensor, groups=[_Group(window=2 * E.BS)])
        )
    assert ei.value.kind == "invalid_layout"
    assert "max_attention_window says None" in ei.value.message, ei.value.message


class _SharedGroup:
    def __init__(self, gid, layer_ids, window, pool):
        self.layer_group_id = gid
        self.layer_ids = tuple(layer_ids)
        self.window_size = window
        self.regions = (E.PoolRegion(pool, layer_ids),)
        self.replicated_regions = ()


class _SharedLayout:
    def __init__(self, groups):
        self.tokens_per_block = E.BS
        self.groups = tuple(groups)
        self.dtype = E.FakeDtype(E.DTYPE)

    def as_single_pool_tensor(self):
        return None  # TensorRT-LLM gives none for several groups


def test_two_layer_groups_in_one_pool_store_and_load_each_groups_own_pages():
    """Sliding (2 blocks) and full layers alternating, both groups in one pool (KV cache
    manager V2 for pages of one size), the windows from llm_args: request 1 (8 full blocks) is
    stored in both groups, the sliding one only from the window before its prompt's end (2 of
    8 pages); request 2 sharing its 32 tokens matches all of them, loads 8 pages of the full
    group and 2 of the sliding one (its 6 before are BAD_PAGE_INDEX), each with its own group's
    bytes, and is reported loaded once both groups are. Keys not salted by group, or the
    sliding group matched like a full one, or a request reported per group, fail here."""
    args = E.TrtLlmArgs(
        kv_cache_config=E.TrtKvCacheConfig(max_attention_window=[2 * E.BS, 4096]),
        max_seq_len=4096,
    )
    sched = trtllm.KvbmConnectorScheduler(args)
    worker = trtllm.KvbmConnectorWorker(args)
    cache = E.TrtllmCache(48)
    layout = _SharedLayout(
        [_SharedGroup(0, (0, 2), 2 * E.BS, cache.array), _SharedGroup(1, (1, 3), None, cache.array)]
    )
    worker.register_kv_cache_layout(layout)
    sched.wait_for_initialization()
    image = lambda g, tokens, i: E.expected_block(tokens, i, rank=5 + g)

    def step(new, finished=(), loading=()):
        out = E.TrtSchedulerOutput(new_requests=new)
        worker.bind_connector_meta(sched.build_connector_meta(out))
        worker.start_load_kv(None)
        for layer in range(4):
            worker.save_kv_layer(layer, None)
        worker.wait_for_save(None)
        worker.wait_idle(10)
        return worker.get_finished(list(finished), list(loading))

    def data(rid, tokens, lists, computed):
        return types.SimpleNamespace(request_id=rid, new_tokens=tokens, new_block_ids=[],
                                     computed_position=computed, new_block_ids_by_layer_group=lists)

    a = E.prompt(31, 8 * E.BS + 1)
    r1 = E.LlmRequest(1, a, 1)
    assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)
    pages = [list(range(0, 9)), list(range(9, 18))]
    sched.update_state_after_alloc_by_layer_group(r1, pages)
    for g in range(2):
        for i in range(8):
            cache.fill(pages[g][i], image(g, a, i))
    step([data(1, a, pages, 0)])
    r1.tokens.append(7)
    assert sched.request_finished_by_layer_group(r1, pages) is True
    saved = []
    for _ in range(50):
        saved, _ = step([], finished=[] if saved else [1])
        if 1 in saved:
            break
    assert saved == [1], saved
    m = sched.metrics()
    host = next(t for t in m["transfers"] if t["src"] == "device" and t["dst"] == "host")
    assert (host["blocks"], m["window_skipped_blocks"]) == (8 + 2, 6), m

    b = a[: 8 * E.BS] + [5, 6]
    r2 = E.LlmRequest(2, b, 1)
    assert sched.get_num_new_matched_tokens(r2, 0) == (8 * E.BS, True)
    pages = [[trtllm.BAD_PAGE_INDEX] * 6 + [20, 21, 22], list(range(30, 39))]
    for p in (20, 21, *range(30, 38)):
        cache.fill(p, E.junk(p))
    sched.update_state_after_alloc_by_layer_group(r2, pages)
    _, loaded = step([data(2, b, pages, 8 * E.BS)], loading=[2])
    for _ in range(50):
        if 2 in loaded:
            break
        _, loaded = step([])
    assert loaded == [2], loaded
    for i in range(8):
        assert cache.read_block(30 + i) == image(1, a, i), f"full group block {i}"
    assert cache.read_block(20) == image(0, a, 6) and cache.read_block(21) == image(0, a, 7)
    assert sched.metrics()["load_error_blocks"] == 0


def test_groups_sharing_a_base_but_not_its_shape_are_refused():
    """Two layer groups whose regions start at one base (one pool) but disagree on its page
    size: the regions are inconsistent, refused by name (tests/python/test_trtllm_pools.py
    serves groups in pools of their own)."""
    args = E.TrtLlmArgs(
        kv_cache_config=E.TrtKvCacheConfig(max_attention_window=[2 * E.BS, 4096]),
        max_seq_len=4096,
    )
    worker = trtllm.KvbmConnectorWorker(args)
    cache = E.TrtllmCache(8)
    layout = _SharedLayout(
        [_SharedGroup(0, (0, 2), 2 * E.BS, cache.array), _SharedGroup(1, (1, 3), None, cache.array)]
    )
    layout.groups[1].regions[0].size //= 2
    with pytest.raises(KvbmError) as ei:
        worker.register_kv_cache_layout(layout)
    assert ei.value.kind == "invalid_layout" and "inconsistent" in ei.value.message


def test_layer_groups_llm_args_does_not_give_are_refused():
    layout = _SharedLayout(
        [
            _SharedGroup(0, (0, 2), 2 * E.BS, E.TrtllmCache(8).array),
            _SharedGroup(1, (1, 3), None, E.TrtllmCache(8).array),
        ]
    )
    with pytest.raises(KvbmError) as ei:
        trtllm.KvbmConnectorWorker(E.TrtLlmArgs()).register_kv_cache_layout(layout)
    assert ei.value.kind == "invalid_layout" and "2 layer groups" in ei.value.message


@pytest.mark.parametrize(
    "layout,words",
    [
        (lambda t: _Layout(t, groups=[_Group(), _Group()]), "2 layer groups"),
        (lambda t: _Layout(t, groups=[_Group(window=0)]), "sliding window of 0"),
        (lambda t: _Layout(t, groups=[_Group(window=2.5)]), "sliding window of 2.5"),
        (lambda t: _Layout(t, groups=[_Group(replicated=[_Region()])]), "replicated regions"),
        (lambda t: _Layout(t, groups=[_Group(regions=2)]), "2 region(s)"),
        (lambda t: _Layout(t, tpb=E.BS * 2), f"{E.BS * 2} tokens per block"),
    ],
)
def test_register_kv_cache_layout_refuses_what_it_cannot_serve(layout, words):
    worker = trtllm.KvbmConnectorWorker(E.TrtLlmArgs())
    with pytest.raises(KvbmError) as ei:
        worker.register_kv_cache_layout(layout(E.TrtllmCache(8).tensor))
    assert ei.value.kind in ("unsupported", "invalid_layout")
    assert words in ei.value.message


def test_layer_group_methods_serve_one_group_and_refuse_several(trtllm_engine):
    e = trtllm_engine()
    a = E.prompt(4, 12)
    e.submit(1, a, max_new=1)
    e.run()
    req = E.LlmRequest(2, a + [9], 1)
    n, load_async = e.sched.get_num_new_matched_tokens(req, 0)
    assert (n, load_async) == (12, True)
    req.blocks = [e._alloc() for _ in range(4)]
    with pytest.raises(KvbmError) as ei:
        e.sched.update_state_after_alloc_by_layer_group(req, [req.blocks, req.blocks])
    assert ei.value.kind == "invalid_argument", ei.value
    assert "2 layer groups; the model has 1" in ei.value.message
    # -1 is BAD_PAGE_INDEX (no page there: a sliding window); any other negative is refused.
    with pytest.raises(KvbmError) as ei:
        e.sched.update_state_after_alloc_by_layer_group(req, [[-2] + req.blocks[1:]])
    assert ei.value.kind == "invalid_argument" and "is -2" in ei.value.message
    e.sched.update_state_after_alloc_by_layer_group(req, [list(req.blocks)])
    with pytest.raises(KvbmError) as ei:
        e.sched.request_finished_by_layer_group(req, [req.blocks, []])
    assert ei.value.kind == "invalid_argument"
    # One group: the flat answer (its load is in flight, so its blocks are held).
    assert e.sched.request_finished_by_layer_group(req, [list(req.blocks)]) is True


# -------------------------------------------------------------------------------------------------
# 3. Salt: cache_salt_id (int, older) and cache_salt (str, newer)
# -------------------------------------------------------------------------------------------------


def test_salt_derivation():
    R = E.LlmRequest
    assert trtllm.cache_salt(R(1, [1], 1)) is None
    assert trtllm.cache_salt(R(1, [1], 1, cache_salt_id=None)) is None
    assert trtllm.cache_salt(R(1, [1], 1, cache_salt_id=42)) == "cache_salt_id:42"
    assert trtllm.cache_salt(R(1, [1], 1, cache_salt="42")) == "42"
    assert trtllm.cache_salt(R(1, [1], 1, cache_salt="t", cache_salt_id=7)) == "t"


@pytest.mark.parametrize(
    "salt,attr",
    [
        ({"cache_salt": b"tenant"}, "cache_salt"),
        ({"cache_salt": 42}, "cache_salt"),
        ({"cache_salt_id": "42"}, "cache_salt_id"),
        ({"cache_salt_id": True}, "cache_salt_id"),
        ({"cache_salt_id": 4.0}, "cache_salt_id"),
    ],
)
def test_unreadable_salt_is_an_error(trtllm_engine, salt, attr):
    e = trtllm_engine()
    with pytest.raises(KvbmError) as ei:
        e.sched.get_num_new_matched_tokens(E.LlmRequest(1, E.prompt(1, 9), 1, **salt), 0)
    assert ei.value.kind == "invalid_argument"
    assert attr in ei.value.message


@pytest.mark.parametrize(
    "first,same,other",
    [
        # Older TensorRT-LLM: an int id; the same id shares, another id or none does not.
        ({"cache_salt_id": 42}, {"cache_salt_id": 42}, [{"cache_salt_id": 43}, {}]),
        # Newer: a string; the int 42 and the string "42" are different caches.
        ({"cache_salt": "42"}, {"cache_salt": "42"}, [{"cache_salt_id": 42}, {"cache_salt": "4"}, {}]),
    ],
)
def test_salt_isolates_caches(trtllm_engine, first, same, other):
    e = trtllm_engine()
    a = E.prompt(12, 12)
    e.submit(1, a, max_new=1, **first)
    e.run()
    for i, salt in enumerate(other):
        e.submit(10 + i, a + [1], max_new=1, **salt)
        e.run()
        assert e.matched[10 + i] == (0, False), f"salt {salt} shared the cache of {first}"
    e.submit(2, a + [1], max_new=1, **same)
    e.run()
    assert e.matched[2] == (12, True)
    assert e.verified_blocks == 3


def test_layout_with_interleaved_slots_is_refused():
    # A layout whose single pool tensor is a strided view (slot stride above its size: other
    # buffers share the pool) is refused with a clear error, never misread.
    worker = trtllm.KvbmConnectorWorker(E.TrtLlmArgs())
    base = np.zeros((8, E.LAYERS * 2 * E.BS * E.INNER * 2), dtype=E.DTYPE)
    strided = base[:, : E.LAYERS * 2 * E.BS * E.INNER].reshape(8, E.LAYERS, 2, E.BS * E.INNER)
    layout = _Layout(E.FakeTensor(strided))
    layout.groups[0].regions[0].stride, layout.groups[0].regions[0].size = 256, 128
    with pytest.raises(KvbmError) as ei:
        worker.register_kv_cache_layout(layout)
    assert ei.value.kind == "unsupported"
    assert "slot stride 256 bytes for 128 bytes" in ei.value.message
