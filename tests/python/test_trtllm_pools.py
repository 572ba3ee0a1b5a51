"""``kvbm_connector.trtllm`` with TensorRT-LLM layer groups in pools of their own (issue 25):
Gemma 3's shape, a sliding-window group of five layers and a full-attention group of one, whose
pages differ in size, each group in a region (pool) of its own (KV cache manager V2's
``KvCacheLayout``; TensorRT-LLM cannot be installed here, so the layout and the engine's calls
are stood in for, shaped as its ``connectors/kv_cache_layout.py`` and ``kv_cache_connector.py``
define them). One kvbm stack serves each pool (``kvbm_connector._trtllm_pools``)."""

from __future__ import annotations

import hashlib
import types

import numpy as np
import pytest

import _engines as E
from kvbm_connector import KvbmError, trtllm

W = 2 * E.BS  # the sliding window: two blocks
SLOTS = 48
BAD = trtllm.BAD_PAGE_INDEX


class _Group:
    def __init__(self, gid, layer_ids, window, pool, replicated=()):
        self.layer_group_id = gid
        self.layer_ids = tuple(layer_ids)
        self.window_size = window
        self.regions = (E.PoolRegion(pool, layer_ids),)
        self.replicated_regions = tuple(replicated)


class _Layout:
    def __init__(self, groups):
        self.tokens_per_block = E.BS
        self.groups = tuple(groups)
        self.dtype = E.FakeDtype(E.DTYPE)

    def as_single_pool_tensor(self):
        return None


class _Pool:
    """One pool's memory and its pages as bytes."""

    def __init__(self, layers, slots=SLOTS):
        self.array = np.zeros((slots, layers, 2, E.BS * E.INNER), dtype=E.DTYPE)
        self.u8 = self.array.view(np.uint8).reshape(slots, -1)

    def fill(self, page, data):
        self.u8[page] = np.frombuffer(data, dtype=np.uint8)

    def read(self, page):
        return self.u8[page].tobytes()

    @property
    def page_bytes(self):
        return self.u8.shape[1]


def _args():
    return E.TrtLlmArgs(
        kv_cache_config=E.TrtKvCacheConfig(max_attention_window=[W, 4096]), max_seq_len=4096
    )


def _image(k, tokens, i, n):
    """Pool ``k``'s bytes of full block ``i`` of ``tokens`` (the KV its prefix gives)."""
    seed = hashlib.sha256(repr((k, tuple(tokens[: (i + 1) * E.BS]))).encode()).digest()
    return (seed * (n // len(seed) + 1))[:n]


class _Engine:
    """The two pools, the connector's scheduler and worker, and the engine's call order."""

    def __init__(self):
        self.sched = trtllm.KvbmConnectorScheduler(_args())
        self.worker = trtllm.KvbmConnectorWorker(_args())
        self.pools = [_Pool(5), _Pool(1)]
        self.layout = _Layout(
            [
                _Group(0, range(5), W, self.pools[0].array),
                _Group(1, (5,), None, self.pools[1].array),
            ]
        )
        self.worker.register_kv_cache_layout(self.layout)
        self.sched.wait_for_initialization()

    def step(self, new=(), cached=(), finished=(), loading=()):
        out = E.TrtSchedulerOutput(new_requests=list(new), cached_requests=list(cached))
        self.worker.bind_connector_meta(self.sched.build_connector_meta(out))
        self.worker.start_load_kv(None)
        for layer in range(6):
            self.worker.wait_for_layer_load(layer, None)
            self.worker.save_kv_layer(layer, None)
        self.worker.wait_for_save(None)
        self.worker.wait_idle(10)
        return self.worker.get_finished(list(finished), list(loading))

    def until(self, which, rid, **first):
        got = self.step(**first)[which]
        for _ in range(50):
            if rid in got:
                return got
            got = self.step()[which]
        return got

    def fill(self, tokens, pages, blocks):
        for k, pool in enumerate(self.pools):
            for i in blocks:
                if pages[k][i] != BAD:
                    pool.fill(pages[k][i], _image(k, tokens, i, pool.page_bytes))

    def run(self, rid, tokens, pages, computed=0):
        """Request ``rid`` computes its prompt (its pages filled with its KV), generates one
        token and finishes; returns whether it was held, after its stores completed."""
        r = E.LlmRequest(rid, tokens, 1)
        full = (len(tokens) - 1) // E.BS
        self.fill(tokens, pages, range(computed // E.BS, full))
        self.sched.update_state_after_alloc_by_layer_group(r, pages)
        self.step(new=[_data(rid, tokens, pages, computed)])
        r.tokens.append(7)
        held = self.sched.request_finished_by_layer_group(r, pages)
        if held:
            assert self.until(0, rid, finished=[rid]) == [rid]
        return held

    def pool_metrics(self, k):
        return self.sched.metrics()["pools"][k]


def _data(rid, tokens, lists, computed):
    return types.SimpleNamespace(
        request_id=rid, new_tokens=list(tokens), new_block_ids=[], computed_position=computed,
        new_block_ids_by_layer_group=lists,
    )


def _blocks(m, src, dst):
    return sum(t["blocks"] for t in m["transfers"] if t["src"] == src and t["dst"] == dst)


def test_two_pools_of_different_page_sizes_store_and_load_every_byte():
    """Request 1 (8 full blocks) is stored in both pools, the sliding one only from the window
    before its prompt's end (2 of 8 pages); with every device page clobbered, request 2 sharing
    its 32 tokens matches all of them and loads 8 pages of the full pool (1 layer each) and 2 of
    the sliding pool (5 layers each), every byte its own pool's, into page numbers both pools
    use (each pool its own page space); its 6 BAD_PAGE_INDEX blocks are never transferred
    (every other page of the sliding pool is unchanged), and it is reported loaded once both
    pools loaded. One stack for both pools, pages of one pool written into the other, or a
    BAD_PAGE_INDEX block loaded fail here."""
    e = _Engine()
    assert e.pools[0].page_bytes == 5 * e.pools[1].page_bytes
    a = E.prompt(31, 8 * E.BS + 1)
    r1 = E.LlmRequest(1, a, 1)
    assert e.sched.get_num_new_matched_tokens(r1, 0) == (0, False)
    assert e.run(1, a, [list(range(0, 9)), list(range(0, 9))]) is True
    sliding, full = e.pool_metrics(0), e.pool_metrics(1)
    assert (_blocks(sliding, "device", "host"), sliding["window_skipped_blocks"]) == (2, 6)
    assert _blocks(full, "device", "host") == 8

    b = a[: 8 * E.BS] + [5, 6]
    r2 = E.LlmRequest(2, b, 1)
    assert e.sched.get_num_new_matched_tokens(r2, 0) == (8 * E.BS, True)
    pages = [[BAD] * 6 + [20, 21, 22], list(range(20, 29))]
    for k, pool in enumerate(e.pools):
        for p in range(SLOTS):
            pool.fill(p, bytes([0xA5 ^ p ^ k]) * pool.page_bytes)
    before = [e.pools[0].read(p) for p in range(SLOTS)]
    e.sched.update_state_after_alloc_by_layer_group(r2, pages)
    assert e.until(1, 2, new=[_data(2, b, pages, 8 * E.BS)], loading=[2]) == [2]
    for i in range(8):
        assert e.pools[1].read(20 + i) == _image(1, a, i, e.pools[1].page_bytes), f"full {i}"
    assert e.pools[0].read(20) == _image(0, a, 6, e.pools[0].page_bytes)
    assert e.pools[0].read(21) == _image(0, a, 7, e.pools[0].page_bytes)
    for p in range(SLOTS):
        if p not in (20, 21):
            assert e.pools[0].read(p) == before[p], f"sliding pool page {p} was written"
    assert _blocks(e.pool_metrics(0), "host", "device") == 2
    assert _blocks(e.pool_metrics(1), "host", "device") == 8
    assert e.sched.metrics()["load_error_blocks"] == 0
    assert e.worker.get_block_ids_with_load_errors() == []


def test_the_hit_is_the_smallest_pools():
    """After request 1, the full pool holds every block of its prompt, the sliding pool only
    the window before its end. Request 3 shares 5 blocks: the full pool alone would serve 5, the
    sliding pool none (the window before block 5 was never stored): the hit is 0, and the full
    pool's staging is dropped (nothing loads). Request 4 shares all 8: both serve 8. A hit taken
    from the largest pool, or a staging left behind, fails here."""
    e = _Engine()
    a = E.prompt(41, 8 * E.BS + 1)
    e.sched.get_num_new_matched_tokens(E.LlmRequest(1, a, 1), 0)
    assert e.run(1, a, [list(range(0, 9)), list(range(0, 9))]) is True
    c = a[: 5 * E.BS] + [9, 9, 9]
    r3 = E.LlmRequest(3, c, 1)
    assert e.sched.get_num_new_matched_tokens(r3, 0) == (0, False)
    e.sched.update_state_after_alloc_by_layer_group(r3, [list(range(10, 16))] * 2)
    e.step(new=[_data(3, c, [list(range(10, 16))] * 2, 0)])
    assert _blocks(e.pool_metrics(1), "host", "device") == 0
    assert _blocks(e.pool_metrics(0), "host", "device") == 0
    r4 = E.LlmRequest(4, a[: 8 * E.BS] + [1], 1)
    assert e.sched.get_num_new_matched_tokens(r4, 0) == (8 * E.BS, True)


def test_a_request_held_by_one_pool_is_reported_once_both_release_it():
    """Request 5's sliding-group pages are all BAD_PAGE_INDEX (the window keeps none), so that
    pool stores nothing and does not hold it; the full pool stores its 4 blocks and does. The
    engine frees the pages once every worker reports the request: the sliding pool is told to
    hold it too, and the request comes back once both pools release it. Without that hold the
    sliding pool never reports it (the loop gives up)."""
    e = _Engine()
    a = E.prompt(51, 4 * E.BS + 1)
    e.sched.get_num_new_matched_tokens(E.LlmRequest(5, a, 1), 0)
    assert e.run(5, a, [[BAD] * 5, list(range(0, 5))]) is True
    assert _blocks(e.pool_metrics(0), "device", "host") == 0
    assert _blocks(e.pool_metrics(1), "device", "host") == 4


def test_pools_salt_their_keys_apart():
    """Pool 1's keys carry the pool: the same request's blocks in two pools are two keys."""
    from kvbm_connector import _trtllm_pools as P

    assert P.pool_salt(None, 0) is None and P.pool_salt("t", 0) == "t"
    assert len({P.pool_salt(None, 1), P.pool_salt("t", 1), P.pool_salt(None, 2)}) == 3
    parts = [b"", b"ab", b"c" * 70]
    assert P.unframe(P.frame(parts), 3) == parts
    with pytest.raises(KvbmError) as ei:
        P.unframe(P.frame(parts)[:-1], 3)
    assert ei.value.kind == "invalid_argument" and "frame of 3 pools" in ei.value.message


def _two_pool_layout(**change):
    pools = [_Pool(5, 8), _Pool(1, 8)]
    groups = [_Group(0, range(5), W, pools[0].array), _Group(1, (5,), None, pools[1].array)]
    layout = _Layout(groups)
    layout._keep = pools
    for what, value in change.items():
        if what == "window":
            groups[0].window_size = value
        elif what == "replicated":
            groups[1].replicated_regions = (groups[1].regions[0],)
        elif what == "overlap":
            r = groups[1].regions[0]
            r.base = groups[0].regions[0].base + 8
        elif what == "regions":
            groups[1].regions = groups[1].regions * 2
    return layout


@pytest.mark.parametrize(
    "change,kind,words",
    [
        ({"window": 3 * E.BS}, "invalid_layout", "max_attention_window says 8"),
        ({"replicated": True}, "unsupported", "replicated regions"),
        ({"overlap": True}, "invalid_layout", "overlap"),
        ({"regions": True}, "unsupported", "layer group 1 has 2 region(s)"),
    ],
)
def test_bad_pool_layouts_are_refused_by_name(change, kind, words):
    worker = trtllm.KvbmConnectorWorker(_args())
    with pytest.raises(KvbmError) as ei:
        worker.register_kv_cache_layout(_two_pool_layout(**change))
    assert ei.value.kind == kind and words in ei.value.message, ei.value


def test_pools_need_the_connectors_own_transports():
    """A worker given one transport cannot serve several pools: refused by name."""
    from kvbm_connector._wiring import worker_transport

    t = worker_transport(0, 1, instance="trtllm-pools-given", transport="in_process")
    worker = trtllm.KvbmConnectorWorker(_args(), transport=t)
    with pytest.raises(KvbmError) as ei:
        worker.register_kv_cache_layout(_two_pool_layout())
    assert ei.value.kind == "unsupported" and "one transport per pool" in ei.value.message


class _FakeLeader:
    """A pool's leader that serves the hits ``serves(h)`` accepts, up to ``top`` (uncapped:
    the largest; capped at ``c``: the largest at most ``c``); a sliding group serves only hits
    whose window it holds, a full one any below its top."""

    def __init__(self, top, serves=lambda h: True):
        self.top, self.serves, self.calls = top, serves, []

    def set_layer_groups(self, windows):
        self.windows = windows

    def get_num_new_matched_tokens(self, rid, tokens, computed, salt, lora, cap=None):
        self.calls.append((cap, salt))
        c = self.top if cap is None else min(cap, self.top)
        n = max([h for h in range(0, c + 1, E.BS) if h == 0 or self.serves(h)])
        return n, n > 0


def test_pools_agree_on_the_largest_hit_each_can_serve(monkeypatch):
    """Pool 0 (full) would serve 8 blocks, pool 1 (sliding) 6 or 5, pool 2 (sliding) 7 or 5:
    each pool that found more is matched again at the smallest hit until all agree on 5 (pool
    0 trimmed to 6, then 5; not left at 8); pools 1 and 2 salt their keys with the pool."""
    from kvbm_connector import _trtllm_pools as P

    arrays = [_Pool(1, 8), _Pool(5, 8), _Pool(5, 8)]
    pools = [P.Pool((k,), E.PoolRegion(a.array, range(1)), 1) for k, a in enumerate(arrays)]
    leaders = [
        _FakeLeader(8 * E.BS),
        _FakeLeader(6 * E.BS, lambda h: h in (6 * E.BS, 5 * E.BS)),
        _FakeLeader(7 * E.BS, lambda h: h in (7 * E.BS, 5 * E.BS)),
    ]
    monkeypatch.setattr(P, "leader_transport", lambda *a, **k: None)
    made = iter(leaders)
    ps = P.PoolSchedulers(pools, [None, W, W], trtllm.load_config(), E.BS, 1, "fake",
                          make=lambda *a: next(made))
    assert ps.match(1, [0] * 40, 0, "t", None) == (5 * E.BS, True)
    assert [c for c, _ in leaders[0].calls] == [None, 6 * E.BS, 5 * E.BS]
    assert [c for c, _ in leaders[1].calls] == [None, 5 * E.BS]
    assert [c for c, _ in leaders[2].calls] == [None, 6 * E.BS]
    assert {s for _, s in leaders[0].calls} == {"t"}
    assert {s for _, s in leaders[1].calls} == {P.pool_salt("t", 1)}
    assert [l.windows for l in leaders] == [[None], [W], [W]]


def test_holding_a_request_a_pool_still_tracks_is_refused():
    """A pool holds a finished request for another only once its own answer let it go: asked
    while it still tracks the request (a live one), the pool refuses, naming the request."""
    e = _Engine()
    a = E.prompt(61, 3 * E.BS + 1)
    e.sched.get_num_new_matched_tokens(E.LlmRequest(6, a, 1), 0)
    with pytest.raises(KvbmError) as ei:
        e.sched._pools.inner[1].hold_finished(6)
    assert ei.value.kind == "invalid_state" and "request 6" in ei.value.message, ei.value


def test_a_request_is_reported_once_every_pool_reported_it():
    """Pool 0 reports requests 1 and 2 done, pool 1 only 2: 2 is done; 1 once pool 1 reports
    it too, and each once (a union, or one pool's word, fails here)."""
    from kvbm_connector import _trtllm_pools as P

    per_pool = [set(), set()]
    per_pool[0].update([1, 2])
    per_pool[1].update([2])
    assert P.PoolWorkers._whole(per_pool) == [2]
    assert P.PoolWorkers._whole(per_pool) == []
    per_pool[1].add(1)
    assert P.PoolWorkers._whole(per_pool) == [1]
    assert per_pool == [set(), set()]
