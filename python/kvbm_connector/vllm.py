"""vLLM connector class: ``KvbmConnector``, a ``KVConnectorBase_V1``.

Load it with ``--kv-transfer-config`` (or ``KVTransferConfig``)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvbmConnector",
        "kv_connector_module_path": "kvbm_connector.vllm", "kv_role": "kv_both"}'

When vLLM is importable the class subclasses the real
``vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorBase_V1`` (and its metadata class
``KVConnectorMetadata``), so vLLM's ``KVConnectorFactory`` can build it for either role;
otherwise it subclasses a local stand-in with the same non-abstract helpers.

What is read from vLLM's objects (vLLM v1):

* ``vllm_config``: ``cache_config.block_size``; ``parallel_config.tensor_parallel_size`` (and
  ``pipeline_parallel_size``, which must be 1); ``kv_transfer_config.engine_id`` and
  ``kv_transfer_config.kv_connector_extra_config`` (see below);
* ``Request``: ``request_id``, ``all_token_ids`` (only the tokens appended since the connector
  last saw the request), ``num_computed_tokens``, ``cache_salt`` and ``lora_request.lora_name``
  when present. The scheduler side keeps a reference to each ``Request`` from
  ``update_state_after_alloc`` until ``request_finished`` and reads a running request's new
  tokens from it in ``build_connector_meta`` (the scheduler output carries them only with
  pipeline parallelism), so a block that fills with generated tokens is stored in the step that
  computes it and a finished request's device blocks are rarely held for a last store;
* ``KVCacheBlocks``: ``get_block_ids()`` (one list per KV-cache group);
* ``kv_cache_config.kv_cache_groups`` (each group's ``kv_cache_spec`` and ``block_size``): the
  class implements vLLM's ``SupportsHMA``, so vLLM keeps its hybrid KV-cache manager on and a
  model whose layers alternate sliding-window and full attention has one group of each, each
  with its own blocks (a sliding-window group keeps only its window's). Full-attention and
  sliding-window groups are served; any other kind (Mamba state, chunked local attention) is
  refused at start-up, naming the group;
* ``SchedulerOutput``: ``scheduled_new_reqs`` (``NewRequestData``: ``req_id``,
  ``prompt_token_ids``, ``block_ids``, ``num_computed_tokens``), ``scheduled_cached_reqs``
  (``CachedRequestData``: ``req_ids``, ``resumed_from_preemption`` or, in newer versions,
  ``resumed_req_ids``, ``new_token_ids``, ``new_block_ids``, ``num_computed_tokens``),
  ``num_scheduled_tokens`` (of the scheduled requests) and ``preempted_req_ids`` when present;
* ``register_kv_caches(kv_caches)``: a dict layer name -> tensor, each
  ``[2, num_blocks, block_size, heads, head_dim]`` (outer-major),
  ``[num_blocks, 2, block_size, ...]`` (block-major), ``[num_blocks, block_size, ...]`` (MLA) or
  ``[num_blocks, heads, block_size, 2 * head_dim]`` (CPU attention, head-major; see below);
  CPU or CUDA tensors, all on one GPU per worker (see ``kvbm_connector._streams`` for how stores
  and loads follow the engine's current CUDA stream);
* ``compilation_config.static_forward_context``: each registered layer's attention backend.

``kv_connector_extra_config`` keys (all optional): ``config`` (a kvbm TOML file, else
``$KVBM_CONFIG``), ``transport`` (``rendezvous``, ``in_process`` or ``tcp``), ``leader_addr``
(else ``$KVBM_LEADER_ADDR``), ``instance`` (the rendezvous or in-process pairing name, else the
engine id),
``rank`` (a worker's rank, else vLLM's tensor-parallel rank), ``num_blocks``, ``layout``
(how to read the cache shapes when they are ambiguous: ``layer_separate_outer_major``,
``layer_separate_block_major`` or ``layer_separate_head_major``) and ``load_failure_policy``.

``load_failure_policy`` (``recompute``, the default, or ``fail``) is what vLLM does when a load
from our tiers fails (a block withdrawn for a bad checksum, a disk error, a lost worker): the
connector sets vLLM's ``kv_transfer_config.kv_load_failure_policy`` to it. vLLM's own default,
``fail``, ends the request with an error (its output empty), which suits a disaggregated
prefill peer but not a cache: a block our tiers cannot supply is one vLLM can compute, so with
``recompute`` a failed load costs time, never the output.

vLLM's CPU attention backend (``CPU_ATTN``) registers per layer
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` whose ``(block, head)`` slabs hold all
of K, then all of V (``layer_separate_head_major``); with 1 or 2 KV heads that shape also reads as
block-major K/V, so the worker reads each layer's attention backend from
``vllm_config.compilation_config.static_forward_context`` and passes the layout when it is
``CPU_ATTN`` (an explicit ``layout`` wins).

With no ``transport`` and no address, the halves meet by *rendezvous* on the engine id (see
``kvbm_connector._wiring``): it works with vLLM's default multiprocess executor (scheduler in the
EngineCore process, workers in their own) and in process alike, with no setting.

The scheduler initialises blocking (vLLM builds it after the workers registered their caches);
the workers non-blocking.
"""

from __future__ import annotations

import enum
import inspect
import json
import logging
from typing import Any, Iterable, List, Optional, Set, Tuple

from . import _kvbm
from ._events import BlockEventTranslator, events_enabled, group_specs
from ._streams import StreamOrder
from ._wiring import (
    as_bytes,
    env_rank,
    error,
    leader_transport,
    load_config,
    worker_transport,
)

_log = logging.getLogger("kvbm_connector")

try:  # pragma: no cover - exercised where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1 as _Base,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata as _MetadataBase,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    HAVE_VLLM = True
except Exception:  # ImportError, or anything a partial install raises on import
    HAVE_VLLM = False

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorRole``."""

        SCHEDULER = 0
        WORKER = 1

    class _MetadataBase:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorMetadata``."""

    class _Base:  # type: ignore[no-redef]
        """Stand-in for ``KVConnectorBase_V1``: its constructor and metadata helpers."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._role = role
            self._kv_cache_config = kv_cache_config

        @property
        def role(self) -> Any:
            return self._role

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self) -> Any:
            return self._connector_metadata

        def take_events(self) -> Iterable[Any]:
            return ()

        def get_kv_connector_stats(self) -> Any:
            return None


try:  # pragma: no cover - vLLM's connector-stats classes (0.11+)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics as _PromMetricsBase,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats as _StatsBase,
    )
    from vllm.v1.metrics.utils import create_metric_per_engine as _per_engine
except Exception:
    _PromMetricsBase = None

    class _StatsBase:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorStats``."""

        def __init__(self, data: Optional[dict] = None) -> None:
            self.data = dict(data or {})


# The leader's counters vLLM's stats carry (deltas per interval), and their Prometheus names
# (``vllm:kvbm_<name>_total`` once prometheus_client adds the suffix).
STAT_COUNTERS = (
    "lookup_tokens",
    "matched_tokens",
    "host_hit_tokens",
    "disk_hit_tokens",
    "remote_hit_tokens",
    "load_error_blocks",
    "host_store_error_blocks",
    "disk_store_error_blocks",
    "offload_dropped_blocks",
    "finish_holds",
    "finish_hold_us",
)


class KvbmConnectorStats(_StatsBase):
    """The connector's counters as vLLM's ``KVConnectorStats``: ``data`` maps each name of
    ``STAT_COUNTERS`` to how much it grew since the previous interval."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: Any) -> "KvbmConnectorStats":
        for k, v in (getattr(other, "data", None) or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict:
        return {k: self.data.get(k, 0) for k in STAT_COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.values())


if _PromMetricsBase is not None:

    class KvbmPromMetrics(_PromMetricsBase):
        """One Prometheus counter per ``STAT_COUNTERS`` name in vLLM's own registry
        (``vllm:kvbm_host_hit_tokens_total``, ...), per engine."""

        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._counters = {
                name: _per_engine(
                    self._counter_cls(
                        name=f"vllm:kvbm_{name}",
                        documentation=f"kvbm connector: {name.replace('_', ' ')}",
                        labelnames=labelnames,
                    ),
                    self.per_engine_labelvalues,
                )
                for name in STAT_COUNTERS
            }

        def observe(self, transfer_stats_data: dict, engine_idx: int = 0) -> None:
            for name, per_engine in self._counters.items():
                delta = (transfer_stats_data or {}).get(name, 0)
                if delta > 0 and engine_idx in per_engine:
                    per_engine[engine_idx].inc(delta)


try:  # pragma: no cover - newer vLLM
    from vllm.v1.metrics.cache_hit_source import CacheHitSource as _CacheHitSource

    _HIT_HOST = _CacheHitSource.HOST
    _HIT_DISK = _CacheHitSource.DISK
    _HIT_UNSPECIFIED = _CacheHitSource.EXTERNAL_UNSPECIFIED
except Exception:
    _HIT_HOST, _HIT_DISK, _HIT_UNSPECIFIED = "host", "disk", "external_unspecified"


try:  # pragma: no cover - vLLM 0.32+: get_transfer_results with failed_recving
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults as _TransferResults,
    )
except Exception:
    _TransferResults = None


def _base_init_takes_kv_cache_config() -> bool:
    try:
        return "kv_cache_config" in inspect.signature(_Base.__init__).parameters
    except (TypeError, ValueError):
        return False


_BASE_TAKES_KV_CACHE_CONFIG = _base_init_takes_kv_cache_config()


class KvbmConnectorMetadata(_MetadataBase):
    """The per-step metadata: the bytes the scheduler built for the workers."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __repr__(self) -> str:
        return f"KvbmConnectorMetadata({len(self.data)} bytes)"


def _role_name(role: Any) -> str:
    name = getattr(role, "name", None)
    if name is None:
        name = {0: "SCHEDULER", 1: "WORKER"}.get(role, str(role))
    name = str(name).upper()
    if name not in ("SCHEDULER", "WORKER"):
        raise error("invalid_argument", f"unknown connector role {role!r}", argument="role")
    return name


try:  # pragma: no cover - vLLM's hybrid-manager mixin
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA as _SupportsHMA

    _BASES: tuple = (_Base, _SupportsHMA)
except Exception:
    _BASES = (_Base,)


# KV-cache spec classes (and their subclasses) the connector serves.
_SERVED_SPECS = ("FullAttentionSpec", "SlidingWindowSpec")


def _kv_cache_groups(kv_cache_config: Any, block_size: int) -> List[Optional[int]]:
    """The sliding window (tokens) of each KV-cache group of ``kv_cache_config``, ``None`` for a
    full-attention group (one full group without a config), after checking that each group is a
    kind the connector serves and uses the engine's block size. A sliding-window group's block
    table holds the null block before its window."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    windows: List[Optional[int]] = []
    for i, g in enumerate(groups):
        spec = getattr(g, "kv_cache_spec", None)
        if spec is None:
            windows.append(None)
            continue
        names = {c.__name__ for c in type(spec).__mro__}
        kind = type(spec).__name__
        layers = list(getattr(g, "layer_names", None) or ())
        if not names.intersection(_SERVED_SPECS):
            raise error(
                "unsupported",
                f"KV-cache group {i} is {kind} (layers {layers[:3]}{'...' if len(layers) > 3 else ''}):"
                " the kvbm connector serves full-attention and sliding-window groups only",
                group=i,
                kind=kind,
            )
        bs = getattr(spec, "block_size", block_size)
        if int(bs) != int(block_size):
            raise error(
                "unsupported",
                f"KV-cache group {i} ({kind}) has block size {bs}; the engine's is {block_size}:"
                " the kvbm connector needs one block size for every group",
                group=i,
                block_size=bs,
            )
        if "FullAttentionSpec" in names:
            windows.append(None)
            continue
        window = getattr(spec, "sliding_window", None)
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise error(
                "unsupported",
                f"KV-cache group {i} ({kind}) has sliding window {window!r}: a whole number of"
                " tokens, at least 1, is needed",
                group=i,
                sliding_window=repr(window),
            )
        windows.append(window)
    return windows or [None]


def _events_capacity(extra: dict) -> int:
    """``kv_events_capacity`` of the extra config (default 65,536): the KV events kept between
    two steps at most; anything but a whole number from 1 up is refused by name."""
    value = extra.get("kv_events_capacity", 65536)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        value = repr(value)
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1 or n > 1 << 24:
        raise error(
            "invalid_config",
            f"kv_events_capacity {value!r}: want a whole number of events, 1 to {1 << 24}",
            setting="kv_events_capacity",
        )
    return n


def _with_model_namespace(config: Any, vllm_config: Any, extra: dict) -> Any:
    """A persisted disk tier (``KVBM_DISK_PERSIST``) is reopened only by the same model: with no
    namespace set, the served model's name is the namespace (``remote.namespace``), so a
    restarted server with another model never reads these blocks. Anything set explicitly wins."""
    settings = json.loads(config.to_json())
    if not settings.get("disk", {}).get("persist") or (settings.get("remote") or {}).get("namespace"):
        return config
    model = getattr(getattr(vllm_config, "model_config", None), "model", None)
    if not model:
        return config
    return _kvbm.Config.load_with({"KVBM_REMOTE_NAMESPACE": str(model)}, extra.get("config"))


class KvbmConnector(*_BASES):
    """vLLM's ``KVConnectorBase_V1`` over the kvbm block manager, for either role (and vLLM's
    ``SupportsHMA``: KV-cache groups)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        if _BASE_TAKES_KV_CACHE_CONFIG:
            super().__init__(vllm_config, role, kv_cache_config)
        else:  # pragma: no cover - older vLLM
            super().__init__(vllm_config, role)
        self._kvbm_role = _role_name(role)
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        self._extra = extra
        self.block_size = int(vllm_config.cache_config.block_size)
        pc = vllm_config.parallel_config
        if int(getattr(pc, "pipeline_parallel_size", 1) or 1) != 1:
            raise error(
                "unsupported",
                "pipeline parallelism is not supported by the kvbm connector yet",
                setting="pipeline_parallel_size",
            )
        self.world_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        instance = str(extra.get("instance") or getattr(ktc, "engine_id", None) or "default")
        self._config = _with_model_namespace(load_config(extra.get("config")), vllm_config, extra)
        transport = extra.get("transport")
        address = extra.get("leader_addr")
        self._num_blocks = extra.get("num_blocks")
        if self._num_blocks is None and kv_cache_config is not None:
            self._num_blocks = getattr(kv_cache_config, "num_blocks", None)
        self._layout = extra.get("layout")
        self._kvbm_vllm_config = vllm_config
        self._windows = _kv_cache_groups(kv_cache_config, self.block_size)
        self._groups = len(self._windows)
        windowed = any(w is not None for w in self._windows)
        # With several groups vLLM refuses block-level load errors; with a sliding window they
        # would recompute over the null block: such requests are reported whole.
        self._whole_request_failures = (self._groups > 1 or windowed) and (
            _TransferResults is not None
        )
        _set_load_failure_policy(ktc, extra.get("load_failure_policy", "recompute"))
        self._scheduler = None
        self._worker = None
        self._worker_ready = False
        self._streams = StreamOrder(None)  # the engine's CUDA stream ordering (GPU caches)
        # The registered layer names and the last of them (register_kv_caches sets them): the
        # per-layer hooks of the layers before the last are answered here (_known_layer).
        self._layer_names: Optional[frozenset] = None
        self._last_layer: Optional[str] = None
        self._stats_last: dict = {}  # the counters at the last get_kv_connector_stats
        self._events: Optional[BlockEventTranslator] = None  # set when vLLM publishes KV events
        if self._kvbm_role == "SCHEDULER":
            warning = self._config.tier_warning()
            if warning:
                _log.warning("kvbm connector: %s", warning)
            self._scheduler = _kvbm.VllmScheduler(
                self._config,
                self.block_size,
                leader_transport(
                    self.world_size,
                    instance=instance,
                    transport=transport,
                    address=address,
                    default="rendezvous",
                    config=self._config,
                ),
            )
            self._scheduler.set_kv_cache_groups(self._groups, self._windows)
            # vLLM's KV events for our tiers, when vLLM publishes events (kv_events_config).
            if events_enabled(vllm_config):
                self._events = BlockEventTranslator(
                    self._scheduler,
                    self.block_size,
                    group_specs(kv_cache_config, self._groups),
                    _events_capacity(extra),
                )
        else:
            self.rank = int(extra["rank"]) if "rank" in extra else _tp_rank()
            self._worker = _kvbm.VllmWorker(
                self._config,
                self.block_size,
                self.world_size,
                worker_transport(
                    self.rank,
                    self.world_size,
                    instance=instance,
                    transport=transport,
                    address=address,
                    connect_timeout_secs=max(self._config.init_timeout_secs, 1.0),
                    default="rendezvous",
                    config=self._config,
                ),
            )
            self._worker.set_kv_cache_groups(self._groups)

    # -- scheduler side --------------------------------------------------------------------------

    def _sched(self, op: str) -> Any:
        if self._scheduler is None:
            if getattr(self, "_shut_down", False):
                raise error("invalid_state", f"{op} after shutdown(): this connector is closed",
                            op=op)
            raise error("invalid_state", f"{op} is a scheduler call; this connector is a worker",
                        op=op)
        return self._scheduler

    # Each hot-path call hands vLLM's objects to the binding in one crossing: it reads the
    # attributes it needs and, of a request's token list, only the tokens the leader does not hold
    # yet (the leader keeps each request's tokens and block hashes, so a call hashes only what is
    # new); build_connector_meta reads the whole SchedulerOutput in one call.

    # The per-request calls read ``self._scheduler`` themselves (one Python call less than
    # ``_sched``, which they use only to raise its error on a worker).

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> Tuple[Optional[int], bool]:
        s = self._scheduler
        if s is None:
            s = self._sched("get_num_new_matched_tokens")
        return s.match_request(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict:
        """Splits the tokens loaded for ``request`` by the tier that held them (host, disk)."""
        n = int(num_external_tokens)
        s = self._scheduler
        if s is None:
            s = self._sched("get_external_cache_hit_sources")
        host, disk = s.take_hit_sources(str(request.request_id))
        if n == 0:
            return {}
        if host + disk != n:
            return {_HIT_UNSPECIFIED: n}
        return {k: v for k, v in ((_HIT_HOST, host), (_HIT_DISK, disk)) if v}

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        s = self._scheduler
        if s is None:
            s = self._sched("update_state_after_alloc")
        s.alloc_request(request, blocks, num_external_tokens)
        if self._events is not None:
            self._events.alloc(request)

    def build_connector_meta(self, scheduler_output: Any) -> KvbmConnectorMetadata:
        return KvbmConnectorMetadata(
            self._sched("build_connector_meta").build_meta(scheduler_output)
        )

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[dict]]:
        s = self._scheduler
        if s is None:
            s = self._sched("request_finished")
        delay = s.finish_request(request)
        if self._events is not None:
            self._events.finished(request.request_id)
        return delay, None

    def request_finished_all_groups(
        self, request: Any, block_ids: Tuple[List[int], ...]
    ) -> Tuple[bool, Optional[dict]]:
        """``SupportsHMA``: ``request_finished`` for every KV-cache group at once."""
        s = self._scheduler
        if s is None:
            s = self._sched("request_finished_all_groups")
        delay = s.finish_request(request)
        if self._events is not None:
            self._events.finished(request.request_id)
        return delay, None

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched("update_connector_output").update_connector_output()

    def take_events(self) -> Iterable[Any]:
        """vLLM's KV-cache events for our tiers (see ``kvbm_connector._events``): empty unless
        vLLM publishes events."""
        if self._events is None:
            return ()
        return self._events.take()

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: withdraws every block the host
        and disk tiers hold (the shared store is left to the other instances), announced as
        ``AllBlocksCleared``."""
        self._sched("reset_cache").clear_tiers()
        return True

    # -- worker side -----------------------------------------------------------------------------

    def _work(self, op: str) -> Any:
        if self._worker is None:
            if getattr(self, "_shut_down", False):
                raise error("invalid_state", f"{op} after shutdown(): this connector is closed",
                            op=op)
            raise error("invalid_state", f"{op} is a worker call; this connector is the scheduler",
                        op=op)
        return self._worker

    def shutdown(self) -> None:
        """vLLM's engine shutdown (both roles): the worker waits for its operations in flight
        (at most ``transfer.load_timeout_secs``; what is still running then is dropped), then the
        leader or worker is closed at once: its threads and connections end, and its rendezvous
        file is removed, instead of lingering until the object is garbage collected. Later calls
        raise ``KvbmError`` (``invalid_state``). Idempotent."""
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        worker, self._worker = self._worker, None
        scheduler, self._scheduler = self._scheduler, None
        if worker is not None:
            try:
                worker.wait_idle(float(self._config.load_timeout_secs))
            except Exception as e:  # noqa: BLE001 - shutting down: say why, close anyway
                _log.warning("kvbm connector: operations still running at shutdown are dropped: %s", e)
        del worker, scheduler

    def register_kv_caches(self, kv_caches: Any) -> None:
        worker = self._work("register_kv_caches")
        caches = dict(kv_caches)
        # vLLM's hybrid manager gives layer l of every KV-cache group a view of the same memory
        # (a block id belongs to one group at a time): each cache is registered once.
        unique = _unique_caches(caches)
        layout = self._layout
        if layout is None:
            layout = _backend_layout(self._kvbm_vllm_config, list(unique))
        gpu = worker.register_kv_caches(
            unique,
            None if self._num_blocks is None else int(self._num_blocks),
            layout,
        )
        if len(unique) < len(caches):
            worker.set_layer_names([str(n) for n in caches])
        self._streams = StreamOrder(gpu)
        # The per-layer hooks run twice per layer per step on the engine's thread; only the last
        # layer's save_kv_layer has work (it submits the stores), so the others are answered
        # here. Each call into Rust releases and retakes the GIL, and on a busy host a thread
        # that gives up anything may wait a time slice to run again: measured at a quarter of
        # these calls taking over 1 ms with one busy process per core (docs/benchmarks.md).
        names = list(worker.layer_names())
        self._layer_names = frozenset(names)
        self._last_layer = names[-1] if names else None

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        data = getattr(connector_metadata, "data", connector_metadata)
        worker = self._work("bind_connector_metadata")
        if not self._worker_ready:
            # The worker's barrier runs in the background; the scheduler that built this metadata
            # has finished its side, so the worker's is about to: wait for it (bounded by the
            # init timeout; a failed barrier raises its error) rather than refuse the first step.
            worker.wait_ready(max(self._config.init_timeout_secs, 1.0))
            self._worker_ready = True
        worker.bind_connector_metadata(as_bytes(data, "connector_metadata"))

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._work("clear_connector_metadata").clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker = self._work("start_load_kv")
        self._streams.before_loads()
        worker.start_load_kv()

    def _known_layer(self, op: str, name: str) -> bool:
        """True when ``name`` is a registered layer other than the last (nothing to do in
        Rust); raises ``invalid_argument`` for a name never registered; False for the last
        layer, or before the caches are registered (Rust then answers)."""
        known = self._layer_names
        if known is None:
            return False
        if name not in known:
            raise error("invalid_argument", f"unknown layer {name!r}", op=op, layer=name)
        return name != self._last_layer

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads complete before vLLM schedules their request: nothing to wait for per layer.
        worker = self._work("wait_for_layer_load")
        name = str(layer_name)
        if self._layer_names is None:
            worker.wait_for_layer_load(name)
        else:
            self._known_layer("wait_for_layer_load", name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        worker = self._work("save_kv_layer")
        name = str(layer_name)
        if self._known_layer("save_kv_layer", name):
            return
        self._streams.before_stores()
        worker.save_kv_layer(name)

    def wait_for_save(self) -> None:
        worker = self._work("wait_for_save")
        self._streams.before_stores()
        worker.wait_for_save()

    def get_finished(
        self, finished_req_ids: Set[str]
    ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        return self._work("get_finished").get_finished({str(i) for i in finished_req_ids})

    def get_transfer_results(self, finished_req_ids: Set[str]) -> Any:
        """vLLM's newer form of ``get_finished`` (0.32+): also ``failed_recving``, the requests
        whose load failed, which vLLM then recomputes whole. Used where the model has a
        KV-cache group that is not full attention (a sliding window): vLLM's block-level
        recovery (``get_block_ids_with_load_errors``) recomputes from the first failed block,
        and the window before that block is the null block there, not the request's KV."""
        sending, recving = self.get_finished(finished_req_ids)
        failed: Set[str] = set()
        if self._whole_request_failures:
            failed = set(self._work("get_transfer_results").take_failed_loads())
        return _TransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> Set[int]:
        worker = self._work("get_block_ids_with_load_errors")
        blocks = set(worker.get_block_ids_with_load_errors())
        if self._whole_request_failures:
            # Their requests went to failed_recving (get_transfer_results): vLLM recomputes them
            # from token 0; no block-level truncation.
            return set()
        return blocks

    # -- beyond vLLM's interface -----------------------------------------------------------------

    def is_ready(self) -> bool:
        """True once the start-up barrier completed on this side (raises its error if failed)."""
        return (self._scheduler or self._worker).is_ready()

    def wait_ready(self, timeout_secs: float = 60.0) -> None:
        (self._scheduler or self._worker).wait_ready(timeout_secs)

    def wait_idle(self, timeout_secs: float = 60.0) -> None:
        """Worker: blocks (GIL released) until every submitted operation completed."""
        self._work("wait_idle").wait_idle(timeout_secs)

    def has_pending_work(self) -> bool:
        """Scheduler: true while operations are in flight or queued for the next metadata."""
        return self._sched("has_pending_work").has_pending_work()

    def metrics(self) -> dict:
        """Scheduler: the leader's counters."""
        return json.loads(self._sched("metrics").metrics_json())

    def pool_stats(self) -> Optional[dict]:
        """Scheduler: the host and disk pools' block counts, ``{"host": {...}, "disk": {...}}``
        (``free``, ``mutable``: being written, ``active``: held, ``inactive``, ``registered``,
        ``evictions``; a tier that is off is ``None``), or ``None`` before the tiers exist."""
        return json.loads(self._sched("pool_stats").pool_stats_json())

    # vLLM's connector-stats hooks: the scheduler asks every step; what grew since the last
    # answer goes to vLLM's stats logger and, through ``build_prom_metrics``, to its Prometheus
    # registry (``LLM.get_metrics()``, the server's /metrics).
    def get_kv_connector_stats(self) -> Optional[KvbmConnectorStats]:
        if self._scheduler is None:
            return None
        now = self.metrics()
        last = self._stats_last
        delta = {k: int(now.get(k, 0)) - int(last.get(k, 0)) for k in STAT_COUNTERS}
        self._stats_last = {k: int(now.get(k, 0)) for k in STAT_COUNTERS}
        stats = KvbmConnectorStats(data={k: v for k, v in delta.items() if v > 0})
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict] = None) -> KvbmConnectorStats:
        return KvbmConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        if _PromMetricsBase is None:
            return None
        return KvbmPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


# Attention backends whose per-layer cache is [num_blocks, num_kv_heads, block_size,
# 2 * head_size] with each (block, head) slab K then V (cpu_attn.py views it as
# [num_blocks, num_kv_heads, 2 * block_size, head_size] and chunks dim 2).
_HEAD_MAJOR_BACKENDS = frozenset({"CPU_ATTN"})


def _backend_layout(vllm_config: Any, layer_names: List[str]) -> Optional[str]:
    """The layout the layers' attention backend implies, where the shapes alone are ambiguous:
    ``layer_separate_head_major`` when every registered layer uses ``CPU_ATTN``; else None (the
    shapes decide). Reads ``compilation_config.static_forward_context[name].get_attn_backend()``
    (populated when the model is loaded, before the caches are registered)."""
    ctx = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None)
    if not ctx or not layer_names:
        return None
    names = set()
    for name in layer_names:
        get = getattr(ctx.get(name), "get_attn_backend", None)
        if get is None:
            return None
        try:
            names.add(str(get().get_name()))
        except Exception:
            return None
    if names and names <= _HEAD_MAJOR_BACKENDS:
        return "layer_separate_head_major"
    return None


def _unique_caches(caches: dict) -> dict:
    """``caches`` without the layers whose tensor is a view of an earlier layer's memory (same
    address, shape, strides and dtype), in order."""
    seen = set()
    out = {}
    for name, t in caches.items():
        ptr = getattr(t, "data_ptr", None)
        if ptr is None:
            out[name] = t
            continue
        try:
            key = (int(ptr()), tuple(t.shape), tuple(t.stride()), str(t.dtype))
        except Exception:
            out[name] = t
            continue
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


_LOAD_FAILURE_POLICIES = ("recompute", "fail")


def _set_load_failure_policy(ktc: Any, policy: Any) -> None:
    """Sets vLLM's ``kv_load_failure_policy`` (read by its scheduler after it built the
    connector) to ``policy``; versions without the setting always recompute."""
    if policy not in _LOAD_FAILURE_POLICIES:
        raise error(
            "invalid_argument",
            f"kv_connector_extra_config load_failure_policy={policy!r}: expected one of "
            f"{', '.join(_LOAD_FAILURE_POLICIES)}",
            argument="load_failure_policy",
        )
    if ktc is None or not hasattr(ktc, "kv_load_failure_policy"):
        return
    if ktc.kv_load_failure_policy != policy:
        _log.info(
            "kvbm connector: vLLM's kv_load_failure_policy %r -> %r (a failed load from kvbm's "
            "tiers is recomputed; set kv_connector_extra_config load_failure_policy to 'fail' "
            "to keep failing the request)",
            ktc.kv_load_failure_policy,
            policy,
        )
        ktc.kv_load_failure_policy = policy


def _tp_rank() -> int:
    try:  # pragma: no cover - needs vLLM's distributed state
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return env_rank()


__all__ = ["HAVE_VLLM", "KVConnectorRole", "KvbmConnector", "KvbmConnectorMetadata"]
