"""kvbm_connector.sglang driven by SGLang's own cache controllers (sglang 0.5.23), on CPU.

test_sglang.py calls the backend the way the controllers do; here the controllers themselves
drive it: ``HiCacheController`` and ``HybridCacheController`` (the one SGLang builds for every
model, plain MHA included) attach it by name through ``attach_storage_backend("dynamic", …)``,
their backup thread writes host pages (``write_storage``), their prefetch threads ask for hits
(``batch_exists``) and read pages into other host slots, through the zero-copy path
(``interface_v1``) and the generic one, in two host layouts. What the scheduler does around
them (the radix tree, allocating host slots for a hit, handing the operation to the I/O thread)
is done here by hand, as SGLang's ``UnifiedRadixCache`` does it.

Set-up, nothing patched: a gloo process group of one rank (over a file store: no port) for the
controllers' ``tp_group``; SGLang's parallel state published as one rank; the device pool a real
``MHATokenToKVPool`` on CPU tensors. SGLang hashes pages with a native extension it compiles on
first use (C++, ``-lcrypto``, through torch's cpp_extension with ninja): scripts/test.sh installs
g++ and libssl-dev; the build is cached in ``$HOME/.cache/kvbm/torch_extensions``.

The controller threads catch a backend's exceptions and only log them, so any WARNING record
during a case fails it. Under ``CI=true`` a missing SGLang fails the module instead of skipping.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
import uuid
import warnings
from array import array

import pytest

SGLANG_PATH = os.environ.get("KVBM_SGLANG_PATH")
if SGLANG_PATH:
    sys.path.insert(0, SGLANG_PATH)
    sys.path.append(os.path.join(SGLANG_PATH, "_ipy"))
# The page-hash extension's build: ninja from this interpreter's venv, into a kept cache.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", os.path.join(os.path.expanduser("~"), ".cache", "kvbm", "torch_extensions")
)
os.environ.setdefault("MAX_JOBS", "2")

try:
    warnings.filterwarnings("ignore", category=UserWarning)
    import torch
    import torch.distributed as dist
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host import HostPoolGroup
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.srt.runtime_context import get_parallel
except ImportError as e:  # pragma: no cover - depends on the environment
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        raise
    pytest.skip(f"sglang is not importable ({e}); scripts/test.sh installs it", allow_module_level=True)

from kvbm_connector.sglang import KvbmHiCacheStorage

LAYERS, HEADS, DIM, PAGE, DEVICE_TOKENS, PAGES = 2, 2, 8, 4, 256, 6
# Generous: each wait is for a few small pages; a loaded host must not fail the test.
WAIT_SECS = 120.0


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(f"{record.levelname} {record.name}: {record.getMessage()[:200]}")


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    """A gloo group of one rank and SGLang's parallel state for it, for the whole module."""
    store = os.path.join(tempfile.mkdtemp(prefix="kvbm-sglang-ctl-"), "store")
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    group = dist.new_group([0], backend="gloo")
    get_parallel().override_permanently(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_rank=0, attn_dcp_size=1
    )
    yield group
    if started:
        dist.destroy_process_group()


@pytest.fixture
def warnings_seen():
    handler = _Warnings()
    logging.getLogger().addHandler(handler)
    yield handler.records
    logging.getLogger().removeHandler(handler)


def _seeded_pages(host, seed: int):
    """PAGES pages of `host` filled with seeded values: their host indices and a copy of each."""
    src = host.alloc(PAGES * PAGE)
    g = torch.Generator().manual_seed(seed)
    for i in range(PAGES):
        page = host.get_data_page(int(src[i * PAGE]), flat=True)
        host.set_from_flat_data_page(int(src[i * PAGE]), torch.randn(page.shape, generator=g))
    return src, [host.get_data_page(int(src[i * PAGE])).clone() for i in range(PAGES)]


def _wait(q, what):
    try:
        return q.get(timeout=WAIT_SECS)
    except Exception as e:  # queue.Empty
        raise AssertionError(f"no {what} within {WAIT_SECS:.0f} s") from e


def _controller(kind, layout, group):
    kv = MHATokenToKVPool(DEVICE_TOKENS, PAGE, torch.float32, HEADS, DIM, LAYERS, "cpu", False,
                          enable_alt_stream=False)
    alloc = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, torch.float32, "cpu", kv, need_sort=False)
    info = kv.get_device_pool_infos()[0].buffer_info
    host = MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=LAYERS)
    if kind == "hybrid":
        pools = HostPoolGroup([build_pool_entry(
            name=PoolName.KV, host_pool=host, device_pool=kv, layer_mapping={i: i for i in range(LAYERS)},
            transfer_layer_id_max=LAYERS, is_anchor=True,
        )])
        ctl = HybridCacheController(alloc, pools, PAGE, group, threading.Event(), io_backend="direct",
                                    transfer_layer_id_max=LAYERS)
        return ctl, host, {"host_pools": pools.entries}
    ctl = HiCacheController(alloc, host, PAGE, group, threading.Event(), io_backend="direct")
    return ctl, host, {}


def _hit_query(ctl, kind, rid, tokens):
    """Starts a prefetch as the scheduler does; returns the operation after its hit query."""
    if kind == "hybrid":
        op = ctl.submit_prefetch(CacheRequestHandle(rid, 0), RadixKey(array("q", tokens)),
                                 None, None, [], None).operation
    else:
        op = ctl.prefetch(rid, tokens)
    hit = _wait(ctl.prefetch_hit_queue, f"hit query of {rid}")
    assert hit is op
    return hit


def _read(ctl, hit):
    """Hands a hit to the prefetch I/O thread as the scheduler does; its acks until the last."""
    ctl.prefetch_tokens_occupied += hit.storage_hit_count
    ctl.prefetch_buffer.put(hit)
    acks = []
    while True:
        ack = _wait(ctl.ack_prefetch_queue, "prefetch ack")
        acks.append(ack.completed_tokens)
        if ack.completed_req:
            return acks


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("v1", [1, 0])
@pytest.mark.parametrize("kind", ["base", "hybrid"])
def test_sglangs_controllers_back_up_and_prefetch_through_our_backend(one_rank, warnings_seen, tmp_path, kind, v1, layout):
    ctl, host, kw = _controller(kind, layout, one_rank)
    extra = {
        "backend_name": "kvbm", "module_path": "kvbm_connector.sglang", "class_name": "KvbmHiCacheStorage",
        "interface_v1": v1, "host_cache_blocks": 0, "disk_cache_blocks": 64, "disk_cache_dir": str(tmp_path),
    }
    ctl.attach_storage_backend("dynamic", prefetch_threshold=PAGE, model_name=f"ctl-{uuid.uuid4().hex[:8]}",
                               storage_backend_extra_config=dict(extra), **kw)
    try:
        assert isinstance(ctl.storage_backend, KvbmHiCacheStorage)
        # The interface the controller chose from interface_v1.
        want_set = "_page_set_zero_copy" if v1 else "_generic_page_set"
        assert ctl.page_set_func.__name__ == want_set

        # Backup: host pages of seeded values, written by the controller's backup thread.
        tokens = list(range(1000, 1000 + PAGES * PAGE))
        src, want = _seeded_pages(host, 7)
        op_id = ctl.write_storage(src, tokens, hash_value=get_storage_hash_str(tokens, None, page_size=PAGE))
        ack = _wait(ctl.ack_backup_queue, "backup ack")
        assert (ack.id, ack.completed_tokens) == (op_id, PAGES * PAGE)

        # Prefetch the same tokens and one page never written: the hit is the written prefix,
        # read into other host slots byte for byte.
        hit = _hit_query(ctl, kind, "r1", tokens + list(range(5000, 5000 + PAGE)))
        assert (hit.storage_hit_count, len(hit.hash_value)) == (PAGES * PAGE, PAGES)
        if kind == "hybrid":
            dst, n = ctl.allocate_storage_hit(hit, hit.storage_hit_count, allow_partial=True,
                                              min_tokens=PAGE, evict_host=lambda n: 0)
            assert n == hit.storage_hit_count
        else:
            dst = ctl.alloc_prefetch_host_buffers(hit, hit.storage_hit_count)
        assert dst is not None and not set(dst.tolist()) & set(src.tolist())
        hit.host_indices = dst
        acks = _read(ctl, hit)
        assert max(a for a in acks if a is not None) == PAGES * PAGE, acks
        for i in range(PAGES):
            assert torch.equal(host.get_data_page(int(dst[i * PAGE])), want[i]), f"page {i}"

        # Tokens never written: no hit.
        miss = _hit_query(ctl, kind, "r2", list(range(9000, 9000 + 2 * PAGE)))
        assert (miss.storage_hit_count, list(miss.hash_value)) == (0, [])

        # A prefetch the scheduler ends before its I/O: nothing read, and it completes.
        late = _hit_query(ctl, kind, "r3", list(tokens))
        assert late.storage_hit_count == PAGES * PAGE
        late.host_indices = ctl.alloc_prefetch_host_buffers(late, late.storage_hit_count)
        ctl.terminate_prefetch(late)
        assert all(a in (None, 0) for a in _read(ctl, late))

        assert warnings_seen == [], warnings_seen
    finally:
        ctl.detach_storage_backend()


@pytest.mark.parametrize("v1", [1, 0])
@pytest.mark.parametrize("kind", ["base", "hybrid"])
def test_a_fresh_controllers_first_hit_query_finds_the_shared_stores_pages(one_rank, warnings_seen, kind, v1):
    """Two SGLang instances over one shared store: the second attaches kvbm and its very first
    call is a hit query (no read or write before it); it finds what the first one backed up,
    and reads it byte for byte."""
    url = f"memory://ctl-shared-{uuid.uuid4().hex}"
    model = f"ctl-shared-{uuid.uuid4().hex[:8]}"
    extra = {
        "backend_name": "kvbm", "module_path": "kvbm_connector.sglang", "class_name": "KvbmHiCacheStorage",
        "interface_v1": v1, "host_cache_blocks": 0, "disk_cache_blocks": 0, "remote_url": url,
    }
    writer, wh, wkw = _controller(kind, "page_first", one_rank)
    writer.attach_storage_backend("dynamic", prefetch_threshold=PAGE, model_name=model,
                                  storage_backend_extra_config=dict(extra), **wkw)
    reader = None
    try:
        tokens = list(range(2000, 2000 + PAGES * PAGE))
        src, want = _seeded_pages(wh, 11)
        op_id = writer.write_storage(src, tokens, hash_value=get_storage_hash_str(tokens, None, page_size=PAGE))
        assert _wait(writer.ack_backup_queue, "backup ack").id == op_id

        reader, rh, rkw = _controller(kind, "page_first", one_rank)
        reader.attach_storage_backend("dynamic", prefetch_threshold=PAGE, model_name=model,
                                      storage_backend_extra_config=dict(extra), **rkw)
        assert reader.storage_backend.stats()["get_pages"] == 0
        hit = _hit_query(reader, kind, "fresh", tokens)
        assert hit.storage_hit_count == PAGES * PAGE
        if kind == "hybrid":
            dst, n = reader.allocate_storage_hit(hit, hit.storage_hit_count, allow_partial=True,
                                                 min_tokens=PAGE, evict_host=lambda n: 0)
            assert n == hit.storage_hit_count
        else:
            dst = reader.alloc_prefetch_host_buffers(hit, hit.storage_hit_count)
        hit.host_indices = dst
        acks = _read(reader, hit)
        assert max(a for a in acks if a is not None) == PAGES * PAGE, acks
        for i in range(PAGES):
            assert torch.equal(rh.get_data_page(int(dst[i * PAGE])), want[i]), f"page {i}"
        assert warnings_seen == [], warnings_seen
    finally:
        if reader is not None:
            reader.detach_storage_backend()
        writer.detach_storage_backend()
