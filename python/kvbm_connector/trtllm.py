"""TensorRT-LLM connector classes: ``KvbmConnectorScheduler`` and ``KvbmConnectorWorker``.

Load them through the LLM API's ``kv_connector_config``::

    kv_connector_config:
      connector_module: kvbm_connector.trtllm
      connector_scheduler_class: KvbmConnectorScheduler
      connector_worker_class: KvbmConnectorWorker

They implement the method sets of TensorRT-LLM's ``KvCacheConnectorScheduler`` and
``KvCacheConnectorWorker`` and subclass them when ``tensorrt_llm`` is importable. Newer trees
define the bases in ``tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector``, older ones
in ``tensorrt_llm._torch.pyexecutor.kv_cache_connector``: the newer path is tried first
(:data:`TRTLLM_BASES_MODULE` says which was found). Without TensorRT-LLM they subclass local
stand-ins with the same non-abstract helpers, so the classes can be built and tested anyway.

Both API generations are served: the older one (``register_kv_caches``, flat block lists) and the
newer one's additions — ``wait_for_initialization`` on the scheduler (blocks until the start-up
barrier completed, within the init timeout), ``register_kv_cache_layout`` (a one-group,
one-region layout, full attention or one sliding window, is registered as its single pool tensor;
several layer groups sharing one pool as that pool, each group's pages its own; layer groups in
pools of their own by one kvbm stack per pool, :mod:`kvbm_connector._trtllm_pools`; anything
else is refused, naming what), the ``*_by_layer_group`` methods (one page list per layer group;
``BAD_PAGE_INDEX`` entries, -1, are pages a sliding window keeps none of) and
``supports_attention_dp`` (False: see :class:`KvbmConnectorScheduler`).

What is read from TensorRT-LLM's objects (the shapes its ``KvCacheConnectorManager`` passes):

* ``llm_args`` (``TorchLlmArgs``): ``kv_cache_config.tokens_per_block``; the layer groups' windows
  from ``kv_cache_config.max_attention_window`` and ``max_seq_len``; the world size from
  ``parallel_config.world_size`` (else ``tensor_parallel_size * pipeline_parallel_size``);
* ``LlmRequest``: ``request_id`` (int), ``get_tokens(0)`` (prompt and generated tokens),
  the cache salt and ``lora_task_id`` when present (tenant isolation; see :func:`cache_salt`);
* ``SchedulerOutput``: ``new_requests`` and ``cached_requests``, lists of ``RequestData`` with
  ``request_id``, ``new_tokens``, ``new_block_ids`` and ``computed_position`` (offload is by
  computed position; a ``num_scheduled_tokens`` field, in newer versions, is not needed);
* ``register_kv_caches(kv_cache_tensor)``: one fully contiguous tensor
  ``[num_blocks, num_layers, kv_factor, ...]``, CPU or CUDA; on a GPU, stores wait (on the GPU) for
  the ``stream`` the hooks are given and loads for its earlier work (``kvbm_connector._streams``).

The scheduler lives on rank 0 only and initialises non-blocking; every rank has a worker, whose
``register_kv_caches`` blocks until the start-up barrier completed, the scheduler included: it
returns once the scheduler is ready (TensorRT-LLM builds both at once, and its older API starts
admitting requests right after the registration, with no ``wait_for_initialization``; the engine
is ready when the worker is). The metadata is ``bytes``.

A finished request's last stores are decided in ``request_finished``, after that iteration's
metadata was built; TensorRT-LLM may build no further metadata (an idle engine calls only
``get_finished``), so the scheduler sends them to every worker at once over the transport, ordered
after the last metadata; each worker's ``get_finished`` runs them and reports the request once
they are done (docs/adapters.md, "TensorRT-LLM call order").
"""

from __future__ import annotations

import importlib
from typing import Any, List, Optional, Sequence, Tuple

from . import _kvbm
from . import _trtllm_pools as _pools
from ._streams import StreamOrder
from ._wiring import (
    as_bytes,
    env_rank,
    error,
    int_list,
    leader_transport,
    load_config,
    worker_transport,
)

#: Where TensorRT-LLM defines the connector bases, newest first.
TRTLLM_BASES_MODULES = (
    "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",
    "tensorrt_llm._torch.pyexecutor.kv_cache_connector",
)


def _import_bases() -> Tuple[Optional[str], Any, Any]:
    for name in TRTLLM_BASES_MODULES:
        try:
            module = importlib.import_module(name)
            return name, module.KvCacheConnectorScheduler, module.KvCacheConnectorWorker
        except Exception:  # ImportError, or anything a broken install raises on import
            continue
    return None, None, None


#: The module the bases came from (one of :data:`TRTLLM_BASES_MODULES`), or None.
TRTLLM_BASES_MODULE, _sched_base, _worker_base = _import_bases()
HAVE_TRTLLM = TRTLLM_BASES_MODULE is not None

if HAVE_TRTLLM:
    _SchedulerBase = _sched_base
    _WorkerBase = _worker_base
else:
    class _SchedulerBase:  # type: ignore[no-redef]
        """Stand-in for ``KvCacheConnectorScheduler`` (its constructor)."""

        def __init__(self, llm_args: Any) -> None:
            self._llm_args = llm_args
            super().__init__()

    class _WorkerBase:  # type: ignore[no-redef]
        """Stand-in for ``KvCacheConnectorWorker`` (its constructor and non-abstract helpers)."""

        def __init__(self, llm_args: Any) -> None:
            self._llm_args = llm_args
            self._metadata = None
            super().__init__()

        def bind_connector_meta(self, metadata: object) -> None:
            self._metadata = metadata

        def get_connector_meta(self) -> object:
            return self._metadata

        def _clear_connector_meta(self) -> None:
            self._metadata = None

        def register_forward_pass_callable(self) -> Any:
            return None


#: TensorRT-LLM's abstract methods and their parameters (after ``self``), as the reference and
#: ``kv_cache_connector.py`` list them; a test checks our classes against these.
SCHEDULER_METHODS = {
    "build_connector_meta": ("scheduler_output",),
    "get_num_new_matched_tokens": ("request", "num_computed_tokens"),
    "request_finished": ("request", "cache_block_ids"),
    "update_state_after_alloc": ("request", "block_ids"),
}
WORKER_METHODS = {
    "register_kv_caches": ("kv_cache_tensor",),
    "start_load_kv": ("stream",),
    "wait_for_layer_load": ("layer_idx", "stream"),
    "save_kv_layer": ("layer_idx", "stream"),
    "wait_for_save": ("stream",),
    "get_finished": ("finished_gen_req_ids", "started_loading_req_ids"),
}

_INSTANCE = "trtllm"

#: Why neither class declares ``supports_attention_dp``: under attention data parallelism
#: TensorRT-LLM builds a scheduler on every attention-DP rank, each owning its requests and
#: completing them on its own worker's report alone, while this connector's scheduler waits for
#: every one of the ``tensor_parallel_size * pipeline_parallel_size`` workers (start-up barrier and
#: every operation's completion). Opting in needs one connector per attention-DP rank with a world
#: of its own worker only; until then the manager refuses the combination at start-up.
ATTENTION_DP_UNSUPPORTED = (
    "kvbm_connector's TensorRT-LLM scheduler waits for all tp x pp workers, not for its own "
    "attention-DP rank's workers alone"
)

#: The tag an integer ``cache_salt_id`` gets before it becomes a cache salt string.
SALT_ID_TAG = "cache_salt_id:"


def _tokens_per_block(llm_args: Any) -> int:
    kv = getattr(llm_args, "kv_cache_config", None)
    tpb = getattr(kv, "tokens_per_block", None) if kv is not None else None
    if tpb is None:
        raise error(
            "invalid_config",
            "llm_args.kv_cache_config.tokens_per_block is not set; the connector needs the "
            "cache's tokens per block",
            setting="kv_cache_config.tokens_per_block",
        )
    return int(tpb)


def _attention_windows(llm_args: Any) -> List[Optional[int]]:
    """Each layer group's sliding window in tokens (``None``: full attention), in TensorRT-LLM's
    layer-group order, from ``llm_args.kv_cache_config.max_attention_window`` (one window per
    layer, repeated over the layers; a window at or past ``llm_args.max_seq_len`` is full
    attention; groups are numbered by each window's first appearance). ``[None]`` without it."""
    kv = getattr(llm_args, "kv_cache_config", None)
    raw = getattr(kv, "max_attention_window", None) if kv is not None else None
    if raw is None:
        return [None]
    try:
        values = list(raw)
    except TypeError:
        values = [raw]
    max_seq = getattr(llm_args, "max_seq_len", None)
    out: List[Optional[int]] = []
    for w in values:
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise error(
                "invalid_config",
                f"llm_args.kv_cache_config.max_attention_window holds {w!r}: windows are whole "
                "numbers of tokens, at least 1",
                setting="kv_cache_config.max_attention_window",
            )
        eff = None if isinstance(max_seq, int) and w >= max_seq else w
        if eff not in out:
            out.append(eff)
    return out or [None]


def _world_size(llm_args: Any) -> int:
    pc = getattr(llm_args, "parallel_config", None)
    ws = getattr(pc, "world_size", None) if pc is not None else None
    if isinstance(ws, int) and ws > 0:
        return ws
    tp = getattr(llm_args, "tensor_parallel_size", None) or 1
    pp = getattr(llm_args, "pipeline_parallel_size", None) or 1
    return int(tp) * int(pp)


def _rank() -> int:
    try:  # pragma: no cover - TensorRT-LLM only
        from tensorrt_llm._utils import mpi_rank

        return int(mpi_rank())
    except Exception:
        return env_rank()


def _tokens(request: Any) -> List[int]:
    get = getattr(request, "get_tokens", None)
    if get is None:
        raise error(
            "invalid_argument",
            f"request {getattr(request, 'request_id', '?')} has no get_tokens(beam); "
            "expected a TensorRT-LLM LlmRequest",
            argument="request",
        )
    return int_list(get(0), "request.get_tokens(0)")


def _opt_str(request: Any, attr: str) -> Optional[str]:
    v = getattr(request, attr, None)
    return None if v is None else str(v)


def cache_salt(request: Any) -> Optional[str]:
    """The request's cache salt, as the string the connector mixes into every block key.

    * ``request.cache_salt`` (newer TensorRT-LLM: a ``str``) is used as it is — the same string
      gives the same keys as vLLM's ``cache_salt``;
    * else ``request.cache_salt_id`` (older TensorRT-LLM: an ``int``) becomes
      ``"cache_salt_id:<decimal>"`` (:data:`SALT_ID_TAG`), so the id ``42`` and the string
      ``"42"`` name different caches;
    * neither present (or both None): no salt.

    When both are set the string wins (newer trees derive the id from it). A salt that is
    present but of another type (a ``bytes`` salt, a ``str`` or ``bool`` id, ...) is an
    ``invalid_argument`` error: guessing could silently share one tenant's cache with another.
    """
    rid = getattr(request, "request_id", "?")
    salt = getattr(request, "cache_salt", None)
    if salt is not None:
        if not isinstance(salt, str):
            raise error(
                "invalid_argument",
                f"request {rid}: cache_salt must be a str, got {type(salt).__name__}",
                argument="request.cache_salt",
            )
        return salt
    salt_id = getattr(request, "cache_salt_id", None)
    if salt_id is None:
        return None
    if isinstance(salt_id, bool) or not isinstance(salt_id, int):
        raise error(
            "invalid_argument",
            f"request {rid}: cache_salt_id must be an int, got {type(salt_id).__name__}",
            argument="request.cache_salt_id",
        )
    return f"{SALT_ID_TAG}{salt_id}"


#: TensorRT-LLM's ``BAD_PAGE_INDEX``: a block ordinal with no page in the layer group (before a
#: sliding window, or left behind by it). It travels to the core as :data:`NO_PAGE`, the block id
#: the TensorRT-LLM engine declares as its placeholder: never loaded into, never stored from.
BAD_PAGE_INDEX = -1
#: The placeholder block id a ``BAD_PAGE_INDEX`` becomes (``usize::MAX`` in the core).
NO_PAGE = (1 << 64) - 1


def _pages(values: Any, what: str) -> List[int]:
    """Page indices as the core takes them: ``BAD_PAGE_INDEX`` becomes :data:`NO_PAGE`; any
    other negative index is refused, naming the list and the value."""
    ids = int_list(values, what)
    for i, p in enumerate(ids):
        if p < 0:
            if p != BAD_PAGE_INDEX:
                raise error(
                    "invalid_argument",
                    f"{what}[{i}] is {p}: a page index is >= 0, or {BAD_PAGE_INDEX} "
                    "(BAD_PAGE_INDEX: no page for that block)",
                    argument=what,
                )
            ids[i] = NO_PAGE
    return ids


def _group_pages(what: str, groups: Sequence[Any], n: int) -> List[List[int]]:
    """One page list per layer group (``BAD_PAGE_INDEX`` where a sliding window keeps no page),
    as many as the model has groups; another count is refused, naming both."""
    try:
        got = len(groups)
    except TypeError:
        raise error(
            "invalid_argument",
            f"{what} must be a list with one entry per layer group, got {type(groups).__name__}",
            argument=what,
        ) from None
    if got != n:
        raise error(
            "invalid_argument",
            f"{what} has {got} layer groups; the model has {n} "
            "(llm_args.kv_cache_config.max_attention_window)",
            argument=what,
        )
    return [_pages(g, f"{what}[{i}]") for i, g in enumerate(groups)]


def _request_data(r: Any, groups: int) -> Tuple[int, List[int], List[int], int, List[List[int]]]:
    by_group: List[List[int]] = []
    if groups > 1:
        by_group = _group_pages(
            "RequestData.new_block_ids_by_layer_group",
            getattr(r, "new_block_ids_by_layer_group", None) or [],
            groups,
        )
    return (
        int(r.request_id),
        int_list(r.new_tokens, "RequestData.new_tokens"),
        _pages(r.new_block_ids, "RequestData.new_block_ids") if groups == 1 else [],
        int(r.computed_position),
        by_group,
    )


def _shared_pool_tensor(layout: Any, groups: Sequence[Any]) -> Any:
    """The pool ``groups`` share (one layer group or several), as ``[num_slots, layers per group,
    kv_factor, block elements]`` of the layout's dtype: every group must have one region, all of
    them the same (base, slot stride, slot count, bytes) and the same number of layers (the
    layout's groups are split by pool first, :func:`_trtllm_pools.plan_pools`); otherwise
    refused by name."""
    regions = _pools.one_region_each(groups)
    shape = lambda r: tuple(int(getattr(r, k, -1)) for k in ("base", "stride", "num_slots", "size"))
    layer_counts = {len(tuple(getattr(g, "layer_ids", ()) or ())) for g in groups}
    if len({shape(r) for r in regions}) != 1 or len(layer_counts) != 1:
        raise error(
            "unsupported",
            f"the KV cache layout's {len(groups)} layer groups were taken for one pool but their "
            "regions or layer counts differ",
            argument="layout",
        )
    region = regions[0]
    layers = layer_counts.pop()
    buffers = tuple(getattr(region, "buffers", ()) or ())
    kv = len(buffers) // layers if buffers and len(buffers) % layers == 0 else 2
    if layers < 1 or kv < 1:
        raise error("invalid_layout", "a layer group has no layers", argument="layout")
    raw = region.as_tensor()  # [num_slots, bytes per page], the pool's own memory
    return raw.view(layout.dtype).view(int(region.num_slots), layers, kv, -1)


class KvbmConnectorScheduler(_SchedulerBase):
    """TensorRT-LLM's ``KvCacheConnectorScheduler``: the leader, on rank 0.

    ``config`` (a :class:`kvbm_connector.Config`) defaults to :func:`kvbm_connector.load_config`;
    ``transport`` (a leader transport) to TCP on ``$KVBM_LEADER_ADDR`` when set or with several
    ranks, else the in-process transport shared with this process's worker.

    ``supports_attention_dp`` is False: see :data:`ATTENTION_DP_UNSUPPORTED`.
    """

    supports_attention_dp = False

    def __init__(
        self,
        llm_args: Any,
        *,
        config: Optional[_kvbm.Config] = None,
        transport: Optional[_kvbm.LeaderTransport] = None,
    ) -> None:
        super().__init__(llm_args)
        self.tokens_per_block = _tokens_per_block(llm_args)
        self.world_size = _world_size(llm_args)
        self._config = config if config is not None else load_config()
        self._own_transport = transport is None
        if transport is None:
            transport = leader_transport(self.world_size, instance=_INSTANCE)
        self._inner = _kvbm.TrtllmScheduler(
            self._config, self.tokens_per_block, transport
        )
        # The layer groups (TensorRT-LLM numbers them by each window's first appearance): each
        # matched and stored by its window; several are served as vLLM's KV-cache groups are.
        self._windows = _attention_windows(llm_args)
        self._inner.set_layer_groups(self._windows)
        # Layer groups in pools of their own: one leader per pool, built when rank 0's worker
        # (this process) publishes the pools (kvbm_connector._trtllm_pools).
        self._pools: Optional[_pools.PoolSchedulers] = None
        _pools.attach(_INSTANCE, self)

    def _adopt_pools(self, pools: List[_pools.Pool]) -> None:
        """Rank 0's worker found layer groups in pools of their own: one leader per pool
        replaces the one-pool leader (whose workers never register)."""
        if not self._own_transport:
            raise error(
                "unsupported",
                f"the KV cache layout has layer groups in {len(pools)} pools of their own, "
                "which need one transport per pool: the scheduler was given one transport",
                argument="transport",
            )
        self._pools = _pools.PoolSchedulers(
            pools, self._windows, self._config, self.tokens_per_block, self.world_size, _INSTANCE
        )
        self._inner = None

    def _flat(self, request: Any, block_ids: Any, what: str) -> List[List[int]]:
        """A flat page list with layer groups in pools of their own: TensorRT-LLM makes a flat
        call then only for a request with no KV (every group's list empty)."""
        ids = _pages(block_ids, what)
        if ids:
            raise error(
                "invalid_argument",
                f"request {getattr(request, 'request_id', '?')}: {what} is one flat list; the "
                f"model has {len(self._windows)} layer groups (the *_by_layer_group call)",
                argument=what,
            )
        return [[] for _ in self._windows]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        if self._pools is not None:
            return self._pools.match(
                int(request.request_id),
                _tokens(request),
                int(num_computed_tokens),
                cache_salt(request),
                _opt_str(request, "lora_task_id"),
            )
        return self._inner.get_num_new_matched_tokens(
            int(request.request_id),
            _tokens(request),
            int(num_computed_tokens),
            cache_salt(request),
            _opt_str(request, "lora_task_id"),
        )

    def update_state_after_alloc(self, request: Any, block_ids: List[int]) -> None:
        if self._pools is not None:
            lists = self._flat(request, block_ids, "block_ids")
            return self._pools.update_state_after_alloc(int(request.request_id), lists)
        self._inner.update_state_after_alloc(
            int(request.request_id), _pages(block_ids, "block_ids")
        )

    def build_connector_meta(self, scheduler_output: Any) -> bytes:
        n = len(self._windows)
        if self._pools is not None:
            return self._pools.build_connector_meta(
                [_request_data(r, n) for r in scheduler_output.new_requests],
                [_request_data(r, n) for r in scheduler_output.cached_requests],
            )
        return self._inner.build_connector_meta(
            [_request_data(r, n) for r in scheduler_output.new_requests],
            [_request_data(r, n) for r in scheduler_output.cached_requests],
        )

    def request_finished(self, request: Any, cache_block_ids: List[int]) -> bool:
        if self._pools is not None:
            lists = self._flat(request, cache_block_ids, "cache_block_ids")
            return self._pools.request_finished(int(request.request_id), _tokens(request), lists)
        return self._inner.request_finished(
            int(request.request_id),
            _tokens(request),
            _pages(cache_block_ids, "cache_block_ids"),
        )

    # -- newer TensorRT-LLM (connectors/kv_cache_connector.py) ---------------------------------

    def wait_for_initialization(self) -> None:
        """Blocks (GIL released) until the start-up barrier completed, at most the configured
        init timeout; raises the barrier's error, or a timeout. TensorRT-LLM calls it after
        ``register_kv_caches`` and before its executor loop starts; rank 0's registration
        already returned with the scheduler ready (older trees, which do not call this, rely on
        that). With layer groups in pools of their own, every pool's barrier."""
        self.wait_ready(max(self._config.init_timeout_secs, 0.001))

    def update_state_after_alloc_by_layer_group(
        self, request: Any, block_ids_by_layer_group: List[List[int]]
    ) -> None:
        """One page list per layer group, as many as the model has (see
        :func:`_attention_windows`)."""
        lists = _group_pages(
            "block_ids_by_layer_group", block_ids_by_layer_group, len(self._windows)
        )
        if self._pools is not None:
            return self._pools.update_state_after_alloc(int(request.request_id), lists)
        self._inner.update_state_after_alloc_by_layer_group(int(request.request_id), lists)

    def request_finished_by_layer_group(
        self, request: Any, cache_block_ids_by_layer_group: List[List[int]]
    ) -> bool:
        """As :meth:`request_finished`, one page list per layer group."""
        lists = _group_pages(
            "cache_block_ids_by_layer_group", cache_block_ids_by_layer_group, len(self._windows)
        )
        if self._pools is not None:
            return self._pools.request_finished(int(request.request_id), _tokens(request), lists)
        return self._inner.request_finished_by_layer_group(
            int(request.request_id), _tokens(request), lists
        )

    # -- beyond TensorRT-LLM's interface --------------------------------------------------------

    def is_ready(self) -> bool:
        """True once the start-up barrier completed (raises its error if it failed)."""
        return self._pools.is_ready() if self._pools is not None else self._inner.is_ready()

    def wait_ready(self, timeout_secs: float = 60.0) -> None:
        """Blocks (GIL released) until the barrier completed (every pool's)."""
        (self._pools or self._inner).wait_ready(timeout_secs)

    def process_completions(self) -> None:
        """Applies the operation completions that arrived (every call does this too; an idle
        engine may call it so stored blocks become matchable sooner)."""
        (self._pools or self._inner).process_completions()

    def has_pending_work(self) -> bool:
        """True while operations are in flight or queued for the next metadata."""
        return (self._pools or self._inner).has_pending_work()

    def metrics(self) -> dict:
        """The leader's counters. With layer groups in pools of their own, pool 0's, and every
        pool's under ``"pools"`` (a list, in pool order)."""
        import json

        if self._pools is not None:
            per_pool = [json.loads(s.metrics_json()) for s in self._pools.inner]
            return dict(per_pool[0], pools=per_pool)
        return json.loads(self._inner.metrics_json())

    def metrics_prometheus(self) -> str:
        """The leader's counters in Prometheus text format (pool 0's with pools of their own)."""
        leader = self._pools.inner[0] if self._pools is not None else self._inner
        return leader.metrics_prometheus()


class KvbmConnectorWorker(_WorkerBase):
    """TensorRT-LLM's ``KvCacheConnectorWorker``: one per rank.

    ``rank`` defaults to TensorRT-LLM's MPI rank (else ``$KVBM_RANK``, else 0); ``config`` and
    ``transport`` as for :class:`KvbmConnectorScheduler`. ``supports_attention_dp`` is False
    (:data:`ATTENTION_DP_UNSUPPORTED`).
    """

    supports_attention_dp = False

    def __init__(
        self,
        llm_args: Any,
        *,
        config: Optional[_kvbm.Config] = None,
        transport: Optional[_kvbm.WorkerTransport] = None,
        rank: Optional[int] = None,
    ) -> None:
        super().__init__(llm_args)
        self.tokens_per_block = _tokens_per_block(llm_args)
        self.world_size = _world_size(llm_args)
        self.rank = _rank() if rank is None else int(rank)
        self._windows = _attention_windows(llm_args)
        self._config = config if config is not None else load_config()
        self._own_transport = transport is None
        # Layer groups in pools of their own: one worker per pool (register_kv_cache_layout).
        self._pools: Optional[_pools.PoolWorkers] = None
        if transport is None:
            transport = worker_transport(
                self.rank,
                self.world_size,
                instance=_INSTANCE,
                connect_timeout_secs=max(self._config.init_timeout_secs, 1.0),
            )
        self._inner = _kvbm.TrtllmWorker(
            self._config, self.tokens_per_block, self.world_size, transport
        )
        self._streams = StreamOrder(None)  # the engine's CUDA stream ordering (GPU caches)
        # The layers save_kv_layer counts, once registered (the per-layer hooks of the layers
        # before the last are answered here, without crossing into Rust: see _layer_hook).
        self._num_layers = 0

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        self._streams = StreamOrder(self._inner.register_kv_caches(kv_cache_tensor))
        self._num_layers = int(self._inner.num_layers())

    def register_kv_cache_layout(self, layout: Any) -> None:
        """Newer TensorRT-LLM (``KvCacheLayout``, KV cache manager V2). One layer group — full
        attention, or a sliding window on every layer — in one region, with no replicated side
        cache, is registered as the single pool tensor ``layout.as_single_pool_tensor()`` gives
        (``[num_slots, num_layers, kv_factor, block elements]``). Several layer groups are served
        when they share one pool (TensorRT-LLM puts groups whose pages are the same size, e.g.
        sliding and full layers alternating, in one pool group: one base, one page space,
        disjoint live pages): the pool is registered once and each group's pages are its own
        requests' (as vLLM's hybrid manager). Groups in pools of their own (pages of different
        sizes: a region, base and slot space each) get one kvbm stack per pool
        (:meth:`_register_pools`). Any other layout is refused with an ``unsupported`` or
        ``invalid_layout`` error naming what; a window that differs from ``llm_args`` with
        ``invalid_layout``."""
        groups = sorted(
            tuple(getattr(layout, "groups", ()) or ()),
            key=lambda g: int(getattr(g, "layer_group_id", 0) or 0),
        )
        if not groups:
            raise error("unsupported", "the KV cache layout has no layer group", argument="layout")
        if len(groups) > 1 and len(groups) != len(self._windows):
            raise error(
                "invalid_layout",
                f"the KV cache layout has {len(groups)} layer groups but "
                f"llm_args.kv_cache_config.max_attention_window gives {len(self._windows)} "
                f"({self._windows}): the scheduler serves the groups it gives",
                argument="layout",
            )
        for g, group in enumerate(groups):
            window = getattr(group, "window_size", None)
            if window is not None and (not isinstance(window, int) or window <= 0):
                raise error(
                    "invalid_layout",
                    f"the KV cache layout's layer group {g} has a sliding window of {window!r} "
                    "tokens; want a positive whole number (or None for full attention)",
                    argument="layout",
                )
            # Pages a window left behind come as BAD_PAGE_INDEX and are never loaded into or
            # stored from; a hit loads the pages the engine allocated (the window before it).
            # The scheduler reads the windows from llm_args and matches and stores by them: a
            # layout that slides otherwise would get loads it cannot take, and — TensorRT-LLM's
            # stores trailing its compute by an iteration — stores of pages the window already
            # left, which the engine may have given to another request (wrong bytes). So a
            # sliding layout needs its window in llm_args too.
            expected = self._windows[g] if g < len(self._windows) else None
            if window != expected:
                raise error(
                    "invalid_layout",
                    f"the KV cache layout's layer group {g} has a sliding window of {window!r} "
                    "tokens but llm_args.kv_cache_config.max_attention_window says "
                    f"{expected} (None: not set, or at least max_seq_len: full attention); "
                    "set it to the model's windows",
                    argument="layout",
                )
            if tuple(getattr(group, "replicated_regions", ()) or ()):
                raise error(
                    "unsupported",
                    "the KV cache layout has replicated regions (a side cache identical on every "
                    "shard); kvbm_connector does not store them",
                    argument="layout",
                )
        self.window_size = getattr(groups[0], "window_size", None)
        tpb = getattr(layout, "tokens_per_block", self.tokens_per_block)
        if int(tpb) != self.tokens_per_block:
            raise error(
                "invalid_layout",
                f"the KV cache layout has {tpb} tokens per block but kv_cache_config says "
                f"{self.tokens_per_block}",
                argument="layout",
            )
        if len(groups) > 1:
            pools = _pools.plan_pools(groups)
            if len(pools) > 1:
                return self._register_pools(layout, groups, pools)
            tensor = _shared_pool_tensor(layout, groups)
            layers = sum(len(tuple(getattr(g, "layer_ids", ()) or ())) for g in groups)
            self._inner.set_layer_groups(len(groups), layers)
        else:
            single = getattr(layout, "as_single_pool_tensor", None)
            tensor = single() if callable(single) else None
            if tensor is None:
                regions = len(tuple(getattr(groups[0], "regions", ()) or ()))
                raise error(
                    "unsupported",
                    f"the KV cache layout cannot be read as one pool tensor (its layer group has "
                    f"{regions} region(s), or a page expansion factor other than 1); "
                    "kvbm_connector supports one uniform region",
                    argument="layout",
                )
        is_contiguous = getattr(tensor, "is_contiguous", None)
        if callable(is_contiguous) and not is_contiguous():
            region = next(iter(getattr(groups[0], "regions", ()) or ()), None)
            stride, size = getattr(region, "stride", "?"), getattr(region, "size", "?")
            raise error(
                "unsupported",
                f"the KV cache layout's page slots are not contiguous (slot stride {stride} bytes "
                f"for {size} bytes of KV: other buffers share the pool); kvbm_connector needs a "
                "pool that holds only this layer group's KV",
                argument="layout",
            )
        self.register_kv_caches(tensor)

    def _register_pools(self, layout: Any, groups: Sequence[Any], pools: List[Any]) -> None:
        """Layer groups in pools of their own (pages of different sizes): one worker per pool,
        registered with that pool's tensor; rank 0 first tells this process's scheduler."""
        if not self._own_transport:
            raise error(
                "unsupported",
                f"the KV cache layout has layer groups in {len(pools)} pools of their own, "
                "which need one transport per pool: the worker was given one transport",
                argument="transport",
            )
        tensors = []
        for pool in pools:
            tensor = _shared_pool_tensor(layout, [groups[g] for g in pool.groups])
            is_contiguous = getattr(tensor, "is_contiguous", None)
            if callable(is_contiguous) and not is_contiguous():
                raise error(
                    "unsupported",
                    f"the KV cache layout's pool of layer group {pool.groups[0]} has page slots "
                    f"that are not contiguous (slot stride {pool.region.stride} bytes for "
                    f"{pool.region.size} bytes of KV); kvbm_connector needs a pool that holds "
                    "only its layer groups' KV",
                    argument="layout",
                )
            tensors.append(tensor)
        layers = sum(len(tuple(getattr(g, "layer_ids", ()) or ())) for g in groups)
        if self.rank == 0:
            _pools.publish(_INSTANCE, pools)
        self._inner = None  # the one-pool worker, never registered
        self._pools = _pools.PoolWorkers(
            pools, tensors, layers, self._config, self.tokens_per_block, self.world_size,
            self.rank, _INSTANCE,
        )
        self._num_layers = layers

    def bind_connector_meta(self, metadata: object) -> None:
        super().bind_connector_meta(metadata)
        if self._pools is not None:
            return self._pools.bind(as_bytes(metadata, "metadata"))
        self._inner.bind_connector_meta(as_bytes(metadata, "metadata"))

    def start_load_kv(self, stream: Any) -> None:
        if self._pools is not None:
            self._pools.before("before_loads", stream)
            return self._pools.each("start_load_kv")
        self._streams.before_loads(stream)
        self._inner.start_load_kv()

    def _layer_hook(self, op: str, layer_idx: Any) -> bool:
        """True when ``layer_idx`` is a registered layer before the last (nothing to do in
        Rust: loads finish before their request is scheduled, stores start after the last
        layer); raises ``out_of_range`` for an index past the layers, as Rust does; False for
        the last layer, or before registration (Rust then answers). Each call into Rust releases
        and retakes the GIL, and on a busy host a thread that gives anything up may wait a time
        slice to run again (docs/benchmarks.md, vLLM's per-layer hooks)."""
        n = self._num_layers
        if n <= 0:
            return False
        i = int(layer_idx)
        if i < 0 or i >= n:
            raise error("out_of_range", f"layer {i} out of range (0..{n})", op=op, layer=i)
        return i + 1 < n

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        if self._num_layers > 0:
            self._layer_hook("wait_for_layer_load", layer_idx)
            return
        self._inner.wait_for_layer_load(int(layer_idx))

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        if self._layer_hook("save_kv_layer", layer_idx):
            return
        if self._pools is not None:
            self._pools.before("before_stores", stream)
            return self._pools.each("save_kv_layer", int(layer_idx))
        self._streams.before_stores(stream)
        self._inner.save_kv_layer(int(layer_idx))

    def wait_for_save(self, stream: Any) -> None:
        if self._pools is not None:
            self._pools.before("before_stores", stream)
            return self._pools.each("wait_for_save")
        self._streams.before_stores(stream)
        self._inner.wait_for_save()

    def get_finished(
        self, finished_gen_req_ids: List[int], started_loading_req_ids: List[int]
    ) -> Tuple[List[int], List[int]]:
        finished = int_list(finished_gen_req_ids, "finished_gen_req_ids")
        loading = int_list(started_loading_req_ids, "started_loading_req_ids")
        if self._pools is not None:
            return self._pools.get_finished(finished, loading)
        saved, loaded = self._inner.get_finished(finished, loading)
        return list(saved), list(loaded)

    # -- beyond TensorRT-LLM's interface --------------------------------------------------------

    def get_block_ids_with_load_errors(self) -> List[int]:
        """Device blocks whose load failed since the last call (recompute them). TensorRT-LLM's
        interface has no such call; poll it after ``get_finished``. With layer groups in pools of
        their own, every pool's (merged; :meth:`get_block_ids_with_load_errors_by_pool` keeps
        them apart, each pool being a page space of its own)."""
        if self._pools is not None:
            return sorted({b for pool in self._pools.load_errors_by_pool() for b in pool})
        return list(self._inner.get_block_ids_with_load_errors())

    def get_block_ids_with_load_errors_by_pool(self) -> List[List[int]]:
        """Each pool's failed pages (one list with one pool)."""
        if self._pools is not None:
            return self._pools.load_errors_by_pool()
        return [list(self._inner.get_block_ids_with_load_errors())]

    def is_ready(self) -> bool:
        if self._pools is not None:
            return all([w.is_ready() for w in self._pools.inner])
        return self._inner.is_ready()

    def wait_ready(self, timeout_secs: float = 60.0) -> None:
        if self._pools is not None:
            return self._pools.wait("wait_ready", timeout_secs)
        self._inner.wait_ready(timeout_secs)

    def wait_idle(self, timeout_secs: float = 60.0) -> None:
        """Blocks (GIL released) until every submitted operation completed."""
        if self._pools is not None:
            return self._pools.wait("wait_idle", timeout_secs)
        self._inner.wait_idle(timeout_secs)


__all__ = [
    "ATTENTION_DP_UNSUPPORTED",
    "HAVE_TRTLLM",
    "SALT_ID_TAG",
    "TRTLLM_BASES_MODULE",
    "TRTLLM_BASES_MODULES",
    "cache_salt",
    "KvbmConnectorScheduler",
    "KvbmConnectorWorker",
    "SCHEDULER_METHODS",
    "WORKER_METHODS",
]
