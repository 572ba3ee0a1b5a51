"""TensorRT-LLM layer groups in pools of their own: one kvbm stack per pool.

TensorRT-LLM's KV cache manager V2 puts layer groups whose page slots are the same size in one
*pool group* (one base, one slot space) and the others in pools of their own: Gemma 3's five
sliding-window layers to one full layer give two layer groups whose pages differ in size, each
in a region of its own (``KvCacheLayout.groups[g].regions``; ``tensorrt_llm/_torch/pyexecutor/
connectors/kv_cache_layout.py``). The page indices of ``*_by_layer_group`` lists are scoped to
their group and index that group's regions.

The core serves one device tier, and one host/disk block size, per worker. So each pool gets a
stack of its own: a scheduler-side leader and one worker per rank, on a transport of its own
(instance ``trtllm/pool{k}``; over TCP, ``$KVBM_LEADER_ADDR``'s port plus ``1 + k``), with the
pool's region as its device tier, the pool's layer groups as its KV-cache groups, and the host
and disk tiers split between the pools in proportion to their bytes per page (sizes in GB; a
size in blocks is every pool's). Keys of pool ``k >= 1`` are salted with the pool (pool 0 keeps
the request's own), so two pools never share a block, in a shared store either.

The engine's calls fan out by pool and are combined:

* a hit is what every pool can serve: each pool is matched, then each that found more is
  matched again capped at the smallest hit (a sliding-window group then takes the window before
  the shorter hit), until all agree;
* every pool is told its own groups' pages; the metadata is one frame holding each pool's;
* a finished request is held when any pool holds it, and the pools that did not are told to
  hold it too (TensorRT-LLM waits for every worker's report, and a pool's workers report only
  what they hold); a request is reported saved, or loaded, once every pool reported it;
* load errors are merged (each pool's pages are its own page space: see
  :meth:`PoolWorkers.load_errors_by_pool`).

How the scheduler learns the pools: TensorRT-LLM tells only the workers
(``register_kv_cache_layout``), and its scheduler lives on rank 0, in the process of rank 0's
worker, which registers before the engine calls ``wait_for_initialization``. Rank 0's worker
publishes the pools in a per-process registry keyed by instance; the scheduler of that instance
(built before or after) builds the pools' leaders at once, before that worker's registration
blocks on their start-up barriers, and drops the one-pool leader it started with.
"""

from __future__ import annotations

import os
import struct
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import _kvbm
from ._streams import StreamOrder
from ._wiring import LEADER_ADDR_ENV, error, leader_transport, worker_transport

#: What a metadata frame of several pools starts with.
FRAME_MAGIC = b"KVBM-POOLS\x01"
#: What the salt of pool ``k >= 1``'s keys adds to the request's salt.
POOL_SALT_TAG = "\x1fkv-cache-pool-"


class Pool:
    """One pool: the positions (layer-group order) of the layer groups it backs, its region
    (shared by those groups), their layers each, and its bytes per page."""

    def __init__(self, groups: Tuple[int, ...], region: Any, layers: int) -> None:
        self.groups = groups
        self.region = region
        self.layers = layers
        self.bytes_per_page = int(region.size)


def _span(r: Any) -> Tuple[int, int]:
    keys = ("base", "stride", "num_slots", "size")
    base, stride, slots, size = (int(getattr(r, k)) for k in keys)
    return base, base + stride * max(slots - 1, 0) + size


def one_region_each(groups: Sequence[Any]) -> List[Any]:
    """Each layer group's one region, in order; a group with none or several is refused by
    name (with several layer groups, each is served as one region)."""
    regions = []
    for g, group in enumerate(groups):
        rs = tuple(getattr(group, "regions", ()) or ())
        if len(rs) != 1:
            raise error(
                "unsupported",
                f"the KV cache layout's layer group {g} has {len(rs)} region(s); with several "
                "layer groups kvbm_connector serves one region each",
                argument="layout",
            )
        regions.append(rs[0])
    return regions


def plan_pools(groups: Sequence[Any]) -> List[Pool]:
    """The layout's layer groups (in layer-group order) by pool: groups whose one region starts
    at the same base share that pool, and must agree on its slot stride, slot count, bytes per
    page and layers per group; pools must not overlap. Anything else is refused by name."""
    by_base: Dict[int, List[int]] = {}
    regions = one_region_each(groups)
    for g, region in enumerate(regions):
        by_base.setdefault(int(getattr(region, "base", -1)), []).append(g)
    layers = [len(tuple(getattr(group, "layer_ids", ()) or ())) for group in groups]
    shape = lambda r: tuple(int(getattr(r, k, -1)) for k in ("stride", "num_slots", "size"))
    pools = []
    for base, members in by_base.items():
        first = members[0]
        for g in members[1:]:
            if shape(regions[g]) != shape(regions[first]) or layers[g] != layers[first]:
                raise error(
                    "invalid_layout",
                    f"the KV cache layout's layer groups {first} and {g} share a pool (base "
                    f"{base:#x}) but disagree on it: (stride, slots, bytes per page) "
                    f"{shape(regions[first])} and {shape(regions[g])}, {layers[first]} and "
                    f"{layers[g]} layers; the regions are inconsistent",
                    argument="layout",
                )
        if layers[first] < 1:
            raise error("invalid_layout", f"layer group {first} has no layers", argument="layout")
        pools.append(Pool(tuple(members), regions[first], layers[first]))
    spans = sorted((_span(p.region), p.groups[0]) for p in pools)
    for (a, ga), (b, gb) in zip(spans, spans[1:]):
        if b[0] < a[1]:
            raise error(
                "invalid_layout",
                f"the KV cache layout's pools of layer groups {ga} and {gb} overlap "
                f"([{a[0]:#x}, {a[1]:#x}) and [{b[0]:#x}, {b[1]:#x})); the regions are "
                "inconsistent",
                argument="layout",
            )
    pools.sort(key=lambda p: p.groups[0])
    return pools


def pool_instance(instance: str, k: int) -> str:
    return f"{instance}/pool{k}"


def pool_address(k: int) -> Optional[str]:
    """Pool ``k``'s TCP address: ``$KVBM_LEADER_ADDR`` with its port plus ``1 + k`` (None
    without it, as for one pool)."""
    raw = os.environ.get(LEADER_ADDR_ENV)
    if not raw:
        return None
    host, _, port = raw.rpartition(":")
    try:
        return f"{host}:{int(port) + 1 + k}"
    except ValueError:
        raise error(
            "invalid_config",
            f"{LEADER_ADDR_ENV}={raw!r} has no port; several pools listen on its port + 1 + k",
            setting=LEADER_ADDR_ENV,
        ) from None


def pool_salt(salt: Optional[str], k: int) -> Optional[str]:
    return salt if k == 0 else f"{salt or ''}{POOL_SALT_TAG}{k}"


def shares(pools: Sequence[Pool]) -> List[float]:
    total = sum(p.bytes_per_page for p in pools)
    return [p.bytes_per_page / total for p in pools]


# -- the registry through which rank 0's worker tells the scheduler --------------------------

_lock = threading.Lock()
_plans: Dict[str, List[Pool]] = {}
_schedulers: Dict[str, Any] = {}


def attach(instance: str, scheduler: Any) -> None:
    """Scheduler ``scheduler`` (with an ``_adopt_pools(pools)`` method) serves ``instance``:
    pools published already are adopted now, later ones when published."""
    with _lock:
        _schedulers[instance] = weakref.ref(scheduler)
        plan = _plans.pop(instance, None)
    if plan is not None:
        scheduler._adopt_pools(plan)


def publish(instance: str, pools: List[Pool]) -> None:
    """Rank 0's worker found ``pools``: the scheduler of ``instance`` adopts them (now, or when
    it attaches)."""
    with _lock:
        ref = _schedulers.get(instance)
        sched = ref() if ref is not None else None
        if sched is None:
            _plans[instance] = pools
    if sched is not None:
        sched._adopt_pools(pools)


# -- scheduler side -----------------------------------------------------------------------------


def frame(parts: Sequence[bytes]) -> bytes:
    head = FRAME_MAGIC + struct.pack("<I", len(parts)) + b"".join(
        struct.pack("<Q", len(p)) for p in parts
    )
    return head + b"".join(parts)


def unframe(data: bytes, n: int) -> List[bytes]:
    if not data:
        return [b""] * n
    bad = lambda why: error(
        "invalid_argument",
        f"metadata is not the frame of {n} pools the scheduler builds ({why})",
        argument="metadata",
    )
    if not data.startswith(FRAME_MAGIC) or len(data) < len(FRAME_MAGIC) + 4:
        raise bad("no frame header")
    at = len(FRAME_MAGIC)
    (count,) = struct.unpack_from("<I", data, at)
    if count != n:
        raise bad(f"{count} pools")
    at += 4
    if len(data) < at + 8 * n:
        raise bad("truncated")
    lens = struct.unpack_from(f"<{n}Q", data, at)
    at += 8 * n
    if at + sum(lens) != len(data):
        raise bad("lengths do not add up")
    out = []
    for ln in lens:
        out.append(data[at : at + ln])
        at += ln
    return out


class PoolSchedulers:
    """The leaders of every pool (``TrtllmScheduler`` each), and the engine's calls fanned out
    to them and combined."""

    def __init__(
        self,
        pools: List[Pool],
        windows: Sequence[Optional[int]],
        config: Any,
        tokens_per_block: int,
        world_size: int,
        instance: str,
        make: Callable[..., Any] = _kvbm.TrtllmScheduler,
    ) -> None:
        self.pools = pools
        self.inner = []
        for k, (pool, share) in enumerate(zip(pools, shares(pools))):
            transport = leader_transport(
                world_size, instance=pool_instance(instance, k), address=pool_address(k)
            )
            s = make(config.tier_share(share), tokens_per_block, transport)
            s.set_layer_groups([windows[g] for g in pool.groups])
            self.inner.append(s)

    def match(self, rid: int, tokens: List[int], computed: int, salt: Optional[str],
              lora: Optional[str]) -> Tuple[int, bool]:
        got = [
            s.get_num_new_matched_tokens(rid, tokens, computed, pool_salt(salt, k), lora)
            for k, s in enumerate(self.inner)
        ]
        # Each pool that found more is matched again at the smallest hit, until all agree (the
        # hit only falls, by whole blocks: this ends).
        while len({n for n, _ in got}) > 1:
            hit = min(n for n, _ in got)
            for k, s in enumerate(self.inner):
                if got[k][0] != hit:
                    got[k] = s.get_num_new_matched_tokens(
                        rid, tokens, computed, pool_salt(salt, k), lora, cap=hit
                    )
        hit = got[0][0]
        return hit, hit > 0 and any(a for _, a in got)

    def _split(self, lists: List[List[int]]) -> List[List[List[int]]]:
        return [[lists[g] for g in p.groups] for p in self.pools]

    def update_state_after_alloc(self, rid: int, lists: List[List[int]]) -> None:
        for s, sub in zip(self.inner, self._split(lists)):
            s.update_state_after_alloc_by_layer_group(rid, sub)

    def build_connector_meta(self, new: List[tuple], cached: List[tuple]) -> bytes:
        def per_pool(req: tuple, pool: Pool) -> tuple:
            rid, tokens, _, computed, by_group = req
            sub = [by_group[g] for g in pool.groups]
            # A one-group pool takes its pages flat, as a one-group model does.
            return (rid, tokens, sub[0], computed, []) if len(sub) == 1 else (
                rid, tokens, [], computed, sub)

        return frame([
            s.build_connector_meta([per_pool(r, p) for r in new], [per_pool(r, p) for r in cached])
            for s, p in zip(self.inner, self.pools)
        ])

    def request_finished(self, rid: int, tokens: List[int], lists: List[List[int]]) -> bool:
        held = [
            s.request_finished_by_layer_group(rid, tokens, sub)
            for s, sub in zip(self.inner, self._split(lists))
        ]
        if any(held):
            for s, h in zip(self.inner, held):
                if not h:
                    s.hold_finished(rid)
        return any(held)

    def wait_ready(self, timeout_secs: float) -> None:
        deadline = time.monotonic() + timeout_secs
        for s in self.inner:
            s.wait_ready(max(deadline - time.monotonic(), 0.001))

    def is_ready(self) -> bool:
        return all([s.is_ready() for s in self.inner])

    def process_completions(self) -> None:
        for s in self.inner:
            s.process_completions()

    def has_pending_work(self) -> bool:
        return any([s.has_pending_work() for s in self.inner])


# -- worker side --------------------------------------------------------------------------------


class PoolWorkers:
    """Every pool's worker on this rank (``TrtllmWorker`` each), registered with its pool."""

    def __init__(
        self,
        pools: List[Pool],
        tensors: List[Any],
        model_layers: int,
        config: Any,
        tokens_per_block: int,
        world_size: int,
        rank: int,
        instance: str,
        make: Callable[..., Any] = _kvbm.TrtllmWorker,
    ) -> None:
        self.pools = pools
        self.inner = []
        for k, share in enumerate(shares(pools)):
            transport = worker_transport(
                rank,
                world_size,
                instance=pool_instance(instance, k),
                address=pool_address(k),
                connect_timeout_secs=max(config.init_timeout_secs, 1.0),
            )
            w = make(config.tier_share(share), tokens_per_block, world_size, transport)
            w.set_layer_groups(len(pools[k].groups), model_layers)
            self.inner.append(w)
        # Registered in pool order on every rank: each blocks until its pool's barrier.
        self.streams = [StreamOrder(w.register_kv_caches(t)) for w, t in zip(self.inner, tensors)]
        self._saved: List[set] = [set() for _ in pools]
        self._loaded: List[set] = [set() for _ in pools]

    def bind(self, metadata: bytes) -> None:
        for w, part in zip(self.inner, unframe(metadata, len(self.inner))):
            w.bind_connector_meta(part)

    def each(self, op: str, *args: Any) -> None:
        for w in self.inner:
            getattr(w, op)(*args)

    def before(self, what: str, stream: Any) -> None:
        for s in self.streams:
            getattr(s, what)(stream)

    def get_finished(self, finished: List[int], loading: List[int]) -> Tuple[List[int], List[int]]:
        for k, w in enumerate(self.inner):
            saved, loaded = w.get_finished(finished, loading)
            self._saved[k].update(saved)
            self._loaded[k].update(loaded)
        return self._whole(self._saved), self._whole(self._loaded)

    @staticmethod
    def _whole(per_pool: List[set]) -> List[int]:
        done = set.intersection(*per_pool)
        for s in per_pool:
            s -= done
        return sorted(done)

    def load_errors_by_pool(self) -> List[List[int]]:
        return [list(w.get_block_ids_with_load_errors()) for w in self.inner]

    def wait(self, op: str, timeout_secs: float) -> None:
        deadline = time.monotonic() + timeout_secs
        for w in self.inner:
            getattr(w, op)(max(deadline - time.monotonic(), 0.001))
