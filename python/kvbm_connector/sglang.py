"""SGLang: kvbm's tiers as HiCache's storage backend (L3), loaded by SGLang unmodified.

Launch SGLang with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvbm",
        "module_path": "kvbm_connector.sglang", "class_name": "KvbmHiCacheStorage",
        "interface_v1": 1, "disk_cache_gb": 64, "remote_url": "redis://cache:6379"}'

SGLang's factory builds :class:`KvbmHiCacheStorage` as ``cls(storage_config, kwargs)``; the host
pool arrives later (``register_mem_pool_host``), and the page store over our tiers is built then,
when the page size and layout are known (a call before that is refused by name: no page can be
named yet; a second pool of another format is refused too). Keys are SGLang's page hashes; a page is stored as the
bytes of one page of the host pool in its layout, named in a namespace of the model, the rank's
share (``tp_rank``/``tp_size``; MLA pages are shared by all ranks), the pipeline and context
shards, the layout, the dtype and the page size, so different models or shards never share one.

Our keys in the extra config are the ``KVBM_*`` settings in lower case without the prefix
(``host_cache_gb``, ``disk_cache_gb``, ``disk_cache_dir``, ``remote_url``, ``eviction``...), plus
``config`` (a kvbm TOML file); they win over the environment. Any other key that SGLang does not
itself read is refused with a :class:`~kvbm_connector.KvbmError` naming it. See docs/sglang.md.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
import weakref
from typing import Any, List, Optional

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolName,
    PoolTransferResult,
)

from . import _kvbm
from ._kvbm import Config
from ._wiring import error as _error

logger = logging.getLogger(__name__)

# Every live backend, so the persisted disk tiers' indexes are saved when the process exits
# normally, also where SGLang does not close its storage backend at shutdown (a put also saves
# every few seconds, so a killed process loses only the last few seconds of pages).
_LIVE: "weakref.WeakSet[KvbmHiCacheStorage]" = weakref.WeakSet()


@atexit.register
def _flush_all() -> None:
    for backend in list(_LIVE):
        try:
            backend.flush()
        except Exception as e:  # noqa: BLE001 - at exit, a failure is only reported
            logger.warning("kvbm: saving the disk index at exit failed: %s", e)

__all__ = ["KvbmHiCacheStorage"]

# Keys of the extra config that SGLang itself (or its factory) reads. The prefetch keys are
# usually taken out by SGLang before the backend sees the config, but its decode-side offload
# manager passes them through.
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)
# Keys one batch_exists asks the page store about at once (its calls take at most 65,536);
# SGLang's hybrid controller asks about a whole request's pages in one call.
EXISTS_CHUNK = 4096
# Pools whose pages we serve through the *_v2 calls: the KV pool only.
KV_POOLS = frozenset({str(PoolName.KV)})


def _overrides(extra: dict) -> tuple[dict, Optional[str]]:
    """The extra config's own keys as ``KVBM_*`` settings (and the config file path)."""
    known = {name for name, _key, _secret in _kvbm.env_vars()}
    out: dict = {}
    path = None
    for key, value in extra.items():
        if key in SGLANG_KEYS:
            continue
        if key == "config":
            path = str(value)
            continue
        name = "KVBM_" + str(key).upper()
        if not isinstance(key, str) or name not in known:
            raise _error(
                "invalid_config",
                f"unknown key {key!r} in --hicache-storage-backend-extra-config (kvbm's keys "
                "are the KVBM_* settings in lower case without the prefix, e.g. disk_cache_gb)",
                field=key,
            )
        if isinstance(value, bool):
            value = "true" if value else "false"
        out[name] = str(value)
    # Buffered disk I/O unless asked otherwise: SGLang reads back what it backed up moments ago,
    # and the page cache serves that from memory, as SGLang's own file backend does (measured:
    # docs/benchmarks.md, "SGLang's storage backend beside its file backend"). The engines'
    # connectors keep O_DIRECT by default. An explicit disk_direct_io (extra config),
    # KVBM_DISK_DIRECT_IO or the config file's disk.direct_io wins.
    if (
        "KVBM_DISK_DIRECT_IO" not in out
        and "KVBM_DISK_DIRECT_IO" not in os.environ
        and not _file_sets_direct_io(path or os.environ.get("KVBM_CONFIG"))
    ):
        out["KVBM_DISK_DIRECT_IO"] = "false"
    return out, path


def _file_sets_direct_io(path: Optional[str]) -> bool:
    """Whether the TOML config file at ``path`` sets ``disk.direct_io``. A file that cannot be
    read or parsed answers False: loading it next reports its error by name."""
    if not path or not str(path).strip():
        return False
    try:
        import tomllib
    except ImportError:  # Python < 3.11: read by the loader only, the buffered default applies
        return False
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, ValueError):
        return False
    disk = doc.get("disk")
    return isinstance(disk, dict) and "direct_io" in disk


def _namespace(cfg: HiCacheStorageConfig, pool: Any, page_bytes: int) -> str:
    """What makes two instances' pages the same bytes (see the module docs)."""
    shard = "mla" if cfg.is_mla_model else f"tp{cfg.tp_rank}/{cfg.tp_size}"
    parts = {
        "engine": "sglang",
        "model": cfg.model_name or "",
        "shard": shard,
        "pp": f"{cfg.pp_rank}/{cfg.pp_size}",
        "cp": f"{cfg.attn_cp_rank}/{cfg.attn_cp_size}",
        "layout": str(getattr(pool, "layout", "")),
        "dtype": str(getattr(pool, "dtype", "")),
        "page_size": int(getattr(pool, "page_size", 0) or 0),
        "page_bytes": page_bytes,
    }
    if getattr(cfg, "dcp_size", 1) > 1:
        parts["dcp"] = f"{cfg.dcp_rank}/{cfg.dcp_size}/{cfg.logical_page_size}"
    return json.dumps(parts, sort_keys=True)


# A host pool's attributes that say what its pages' bytes are (beside the page size in bytes):
# two pools that differ in one of them hold different bytes under the same page size.
_FORMAT_ATTRS = (
    "layout",
    "dtype",
    "page_size",
    "layer_num",
    "head_num",
    "head_dim",
    "v_head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
)


def _pool_format(pool: Any, page_bytes: int) -> dict:
    """What makes a host pool's pages the bytes they are: its class, layout, dtype, page size
    (tokens and bytes) and the geometry attributes it has."""
    out: dict = {"pool": type(pool).__name__, "page_bytes": int(page_bytes)}
    for attr in _FORMAT_ATTRS:
        value = getattr(pool, attr, None)
        if value is not None:
            out[attr] = value if isinstance(value, (int, float, bool)) else str(value)
    return out


def _check_shared_writer(cfg: HiCacheStorageConfig, config: Config) -> None:
    """MLA ranks share pages that one rank writes (SGLang backs up from its storage writer only,
    and takes the smallest hit of all ranks): the other ranks can only read them through the
    shared store, so MLA with several ranks per page and no remote store is refused by name —
    it would serve no page while holding the tiers' memory on every rank."""
    if not cfg.is_mla_model:
        return
    sharing = int(cfg.tp_size) // max(int(getattr(cfg, "dcp_size", 1) or 1), 1)
    if sharing <= 1:
        return
    try:
        import tomllib

        remote = tomllib.loads(config.to_toml()).get("remote") or {}
        has_remote = bool(str(remote.get("url") or "").strip())
    except ImportError:  # Python < 3.11: read the rendered line
        has_remote = "\nurl = " in config.to_toml()
    if not has_remote:
        raise _error(
            "invalid_config",
            f"an MLA model over {cfg.tp_size} tensor-parallel ranks: SGLang writes each page "
            "from one rank only and every rank must find it, so kvbm needs a store the ranks "
            "share: set remote_url (a Redis/Valkey server); local tiers alone would never serve "
            "a page",
            field="remote_url",
        )


def _unreadable(calls: str, layout: str, cause: Exception, instead: str) -> Exception:
    """The error for a host pool whose pages one of SGLang's interfaces cannot give us."""
    return _error(
        "unsupported",
        f"kvbm's {calls} calls cannot read the host pool's pages (layout {layout!r}: {cause}); "
        f"launch {instead} to use the other calls",
        field="layout",
    )


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


class KvbmHiCacheStorage(HiCacheStorage):
    """HiCache's storage backend over kvbm's host, disk and shared tiers."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        if storage_config is None:
            raise _error("invalid_argument", "storage_config is required", field="storage_config")
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        overrides, path = _overrides(extra)
        # Settings are checked now, when SGLang builds the backend; the store itself needs the
        # host pool's page size, and is built when the pool is registered.
        self._config = Config.load_with(overrides, path)
        _check_shared_writer(storage_config, self._config)
        self.mem_pool_host = (kwargs or {}).get("mem_pool_host") if isinstance(kwargs, dict) else None
        self._store: Optional[Any] = None
        self._closed = False
        _LIVE.add(self)
        # SGLang moves a page in one of two forms: the flat page tensor of the classic calls
        # (get_data_page) or the pool's runs of the zero-copy calls (get_page_buffer_meta). In
        # the layer-first layout their byte orders differ, so the flat form's pages get keys of
        # their own (``flat/``): a page is only ever read back in the form it was written in.
        self._form = "runs" if extra.get("interface_v1") else "flat"
        self._flat_differs = False
        # The format of the registered host pool (_pool_format), once one is.
        self._pool_format: Optional[dict] = None
        self._metrics_lock = threading.Lock()
        self._metrics = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []}
        if self.mem_pool_host is not None:
            self.register_mem_pool_host(self.mem_pool_host)

    # --- the pool -----------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        if mem_pool_host is None:
            super().register_mem_pool_host(mem_pool_host)
            return
        layout = str(getattr(mem_pool_host, "layout", ""))
        if self._form == "runs":
            # The zero-copy calls move the pool's runs: a page is what they add up to (pools
            # whose flat page SGLang cannot give, e.g. K and V of different head dims, too).
            page_bytes = self._check_runs(mem_pool_host, layout)
        else:
            try:
                page_bytes = _nbytes(mem_pool_host.get_dummy_flat_data_page())
            except Exception as e:  # noqa: BLE001 - SGLang raises its own kinds
                raise _unreadable("classic", layout, e, "with interface_v1") from e
        # One backend stores one pool's pages, named by that pool's format: SGLang registers
        # its storage pool once per attach (again as the KV entry of the *_v2 calls: the same
        # pool). A pool of another format would have its pages named as the first pool's,
        # so it is refused, and nothing of it is taken.
        shape = _pool_format(mem_pool_host, page_bytes)
        first = self._pool_format
        if first is not None and shape != first:
            differ = [k for k in sorted(set(shape) | set(first)) if shape.get(k) != first.get(k)]
            said = ", ".join(f"{k} {shape.get(k)!r} (registered: {first.get(k)!r})" for k in differ)
            raise _error(
                "invalid_argument",
                f"a second host pool of another format: {said}; one backend stores the pages "
                "of one pool (attach a backend per pool)",
                field="mem_pool_host",
                differs=",".join(differ),
            )
        super().register_mem_pool_host(mem_pool_host)
        self._flat_differs = layout == "layer_first"
        self._open(page_bytes, mem_pool_host)
        self._pool_format = shape
        for attr in ("kv_buffer", "k_buffer", "v_buffer"):
            buf = getattr(mem_pool_host, attr, None)
            if buf is not None and hasattr(buf, "data_ptr"):
                self._store.register_region(buf, attr)

    @staticmethod
    def _check_runs(pool: Any, layout: str) -> int:
        """The bytes of one page as the zero-copy calls move it: the runs
        ``get_page_buffer_meta`` gives for the pool's first page. Refused at registration,
        naming the layout, when the pool cannot give them, they are empty, or the second page's
        runs add up to another size."""
        import torch

        try:
            page_size = int(pool.page_size)
            totals = []
            for first in (0, page_size):
                _ptrs, sizes = pool.get_page_buffer_meta(
                    torch.arange(first, first + page_size, dtype=torch.int64)
                )
                totals.append(sum(int(x) for x in sizes))
        except Exception as e:  # noqa: BLE001 - SGLang raises its own kinds
            raise _unreadable("zero-copy", layout, e, "without interface_v1") from e
        if totals[0] <= 0 or totals[0] != totals[1]:
            raise _error(
                "unsupported",
                f"the host pool's zero-copy runs of a page add up to {totals[0]} bytes for its "
                f"first page and {totals[1]} for its second (layout {layout!r})",
                field="layout",
            )
        return totals[0]

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if str(host_pool_name) not in KV_POOLS:
            raise _error(
                "unsupported",
                f"kvbm stores the KV pool's pages only; the {host_pool_name} pool is not supported",
                pool=host_pool_name,
            )
        if host_pool is not self.mem_pool_host:
            self.register_mem_pool_host(host_pool)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _open(self, page_bytes: int, pool: Any) -> None:
        """The page store of the registered pool's pages, named by its format (once: the pool
        registered again, or one of the same format, keeps it)."""
        if self._store is not None:
            return
        ns = _namespace(self.storage_config, pool, page_bytes)
        cfg = self.storage_config
        # One metrics port per rank (tcp.metrics_addr's port + this rank's index); data-parallel
        # replicas without DP attention have the same index, so a port in use moves the store
        # to the next block of `stride` ports.
        cp_size = max(int(cfg.attn_cp_size or 1), 1)
        offset = (
            (cfg.dp_rank * cfg.pp_size + cfg.pp_rank) * cp_size + int(cfg.attn_cp_rank or 0)
        ) * cfg.tp_size + cfg.tp_rank
        stride = cfg.pp_size * cp_size * cfg.tp_size
        self._store = _kvbm.PageStore(self._config, ns, page_bytes, "sglang", offset, stride)
        self._closed = False
        logger.info("kvbm page store: %s-byte pages on %s", page_bytes, self._store.tiers)

    def _names(self, keys: List[Any], form: str) -> List[Any]:
        if form == "flat" and self._flat_differs:
            return [("flat/" + k) if isinstance(k, str) else k for k in keys]
        return keys

    def _need_store(self) -> Any:
        """The page store. There is none before a host pool is registered (SGLang registers
        it when it attaches the backend): a page's name holds the pool's format and page size,
        so before then no page can be stored, read or looked up, and a call is refused by name
        rather than answered with a miss."""
        store = self._store
        if store is None:
            raise _error(
                "not_ready",
                "this backend is closed"
                if self._closed
                else "no host pool is registered yet (register_mem_pool_host, which SGLang calls "
                "when it attaches the backend): kvbm names a page by the pool's format",
                field="mem_pool_host",
            )
        return store

    # --- classic calls (tensors) --------------------------------------------------------------

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        keys, values = list(keys), list(values or [])
        if not keys:
            return True
        store = self._need_store()
        started = time.perf_counter()
        held = store.put_tensors(self._names(keys, "flat"), values)
        self._record("backup", sum(held), started)
        return all(held)

    def get(self, key, target_location=None, target_sizes=None):
        out = self.batch_get([key], [target_location])
        return out[0]

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        keys = list(keys)
        targets = list(target_locations or [])
        if len(targets) != len(keys) or any(t is None for t in targets):
            raise _error(
                "invalid_argument",
                "kvbm reads into the caller's tensors: give one target location per key",
                field="target_locations",
            )
        if not keys:
            return []
        store = self._need_store()
        started = time.perf_counter()
        served = store.get_tensors(self._names(keys, "flat"), targets)
        self._record("prefetch", sum(x is not None for x in served), started)
        return [t if s is not None else None for t, s in zip(targets, served)]

    def exists(self, key) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys, extra_info=None) -> int:
        return self._prefix(keys, self._form)

    def _prefix(self, keys, form: str) -> int:
        """How many of ``keys``, from the first, are stored in ``form`` (SGLang's semantics)."""
        keys = list(keys)
        if not keys:
            return 0
        store = self._need_store()
        names = self._names(keys, form)
        found = 0
        for start in range(0, len(names), EXISTS_CHUNK):
            chunk = names[start : start + EXISTS_CHUNK]
            n = store.prefix_len(chunk)
            found += n
            if n < len(chunk):
                break
        return found

    # --- zero-copy calls (host indices into the registered pool) -----------------------------

    def _runs(self, pool: Any, keys: List[str], host_indices: Any):
        """The runs of the pages at ``host_indices`` in ``pool``: the indices checked first (an
        integer tensor of ``len(keys) × page_size`` slots of the pool), so that SGLang computes
        addresses only from slots the pool has."""
        page_size = int(pool.page_size)
        want = len(keys) * page_size
        if not hasattr(host_indices, "numel") or not hasattr(host_indices, "dtype"):
            raise _error(
                "invalid_argument",
                f"host_indices must be a tensor of the pool's slots, not "
                f"{type(host_indices).__name__}",
                field="host_indices",
            )
        if int(host_indices.numel()) != want:
            raise _error(
                "invalid_argument",
                f"{len(keys)} keys need {want} host indices, got {int(host_indices.numel())}",
                field="host_indices",
            )
        dtype = host_indices.dtype
        if getattr(dtype, "is_floating_point", False) or getattr(dtype, "is_complex", False) or (
            str(dtype) == "torch.bool"
        ):
            raise _error(
                "invalid_argument",
                f"host_indices are {dtype}; the pool's slots are integers",
                field="host_indices",
            )
        slots = int(getattr(pool, "size", 0) or 0)
        lo, hi = int(host_indices.min()), int(host_indices.max())
        if lo < 0 or hi >= slots:
            raise _error(
                "invalid_argument",
                f"host_indices run from {lo} to {hi}; the host pool has slots 0 to {slots - 1}",
                field="host_indices",
            )
        try:
            return pool.get_page_buffer_meta(host_indices)
        except Exception as e:  # noqa: BLE001 - SGLang raises its own kinds
            raise _error(
                "invalid_argument",
                f"the host pool gives no runs for these host indices: {e!r}",
                field="host_indices",
            ) from e

    def _zero_copy(self, kind: str, keys, host_indices) -> List[bool]:
        """One zero-copy batch: the pages' runs in the registered pool, written (``backup``) or
        read (``prefetch``) in place; per page, whether it was."""
        keys = list(keys)
        if not keys:
            return []
        store = self._need_store()
        ptrs, sizes = self._runs(self.mem_pool_host, keys, host_indices)
        started = time.perf_counter()
        if kind == "backup":
            ok = list(store.put_runs(keys, ptrs, sizes))
        else:
            ok = [s is not None for s in store.get_runs(keys, ptrs, sizes)]
        self._record(kind, sum(ok), started)
        return ok

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> List[bool]:
        return self._zero_copy("backup", keys, host_indices)

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> List[bool]:
        return self._zero_copy("prefetch", keys, host_indices)

    # --- multi-pool calls: the KV pool only ---------------------------------------------------

    def _check_pools(self, transfers) -> None:
        for t in transfers or []:
            if str(t.name) not in KV_POOLS:
                raise _error(
                    "unsupported",
                    f"kvbm stores the KV pool's pages only; the {t.name} pool is not supported",
                    pool=t.name,
                )

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None) -> PoolTransferResult:
        self._check_pools(pool_transfers)
        # The *_v2 calls move the pool's runs (host indices), whatever interface_v1 says.
        n = self._prefix(keys, "runs")
        return PoolTransferResult(n, {str(PoolName.KV): n} if n else {}, list(range(1, n + 1)))

    def _v2(self, transfers, op) -> dict:
        self._check_pools(transfers)
        return {
            t.name: op(list(t.keys or []), t.host_indices) if t.keys else []
            for t in transfers or []
        }

    def batch_get_v2(self, transfers, extra_info=None) -> dict:
        return self._v2(transfers, self.batch_get_v1)

    def batch_set_v2(self, transfers, extra_info=None) -> dict:
        return self._v2(transfers, self.batch_set_v1)

    # --- the rest ----------------------------------------------------------------------------

    def clear(self) -> None:
        if self._store is not None:
            self._store.clear()

    def _record(self, kind: str, pages: int, started: float) -> None:
        """Pages and GB/s of one read (``prefetch``) or write (``backup``), for get_stats."""
        if not getattr(self.storage_config, "enable_storage_metrics", False) or pages == 0:
            return
        secs = max(time.perf_counter() - started, 1e-9)
        gb = pages * (self._store.page_bytes if self._store is not None else 0) / 1e9
        with self._metrics_lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(gb / secs)

    def get_stats(self):
        """SGLang's own ``StorageMetrics`` (pages and GB/s per read and write since the last
        call), as its other backends return them."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._metrics_lock:
            taken = self._metrics
            self._metrics = {k: [] for k in taken}
        return StorageMetrics(**taken)

    @property
    def metrics_addr(self) -> Optional[str]:
        """Where our counters are served over HTTP (``metrics_addr`` in the extra config or
        ``KVBM_METRICS_ADDR``; its port + the rank's index), labelled ``engine="sglang"``."""
        return None if self._store is None else self._store.metrics_addr

    def stats(self) -> dict:
        """Our counters (pages put/stored/read, hits per tier, misses, corrupt pages...)."""
        if self._store is None:
            return {}
        return json.loads(self._store.stats_json())

    def flush(self) -> None:
        """Saves the persisted disk tier's index (``disk_persist``) now."""
        if self._store is not None:
            self._store.flush()

    def close(self) -> None:
        """Saves the index and lets the tiers go (the disk file is unlocked)."""
        store, self._store = self._store, None
        self._closed = True
        self._pool_format = None
        if store is not None:
            store.flush()
