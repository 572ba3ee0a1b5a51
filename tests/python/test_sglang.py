"""kvbm_connector.sglang against the real SGLang package (sglang 0.5.23, installed by
scripts/test.sh into a cached target directory beside the vLLM venv's torch: ``KVBM_SGLANG_PATH``).

The backend is built by SGLang's own ``StorageBackendFactory`` from the dynamic extra config, over
a real ``MHATokenToKVPoolHost`` on CPU tensors (SGLang's host pool class, built here from CPU
K/V buffers standing in for the device pool), and driven through the calls SGLang's cache
controller makes: the zero-copy ``batch_set_v1``/``batch_get_v1`` (``interface_v1``), the classic
``batch_set``/``batch_get`` with the pool's own page tensors, ``batch_exists`` and the KV pool of
the ``*_v2`` calls. Every page read is compared byte for byte with the page written. Under
``CI=true`` a missing SGLang fails the module instead of skipping it.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
import warnings

import pytest

SGLANG_PATH = os.environ.get("KVBM_SGLANG_PATH")
# Read at import: the autouse fixture clears every KVBM_* variable before each test.
REDIS_URL = os.environ.get("KVBM_TEST_REDIS_URL")
if SGLANG_PATH:
    sys.path.insert(0, SGLANG_PATH)
    # IPython's own dependencies go after the venv's packages, never shadowing them.
    sys.path.append(os.path.join(SGLANG_PATH, "_ipy"))

try:
    warnings.filterwarnings("ignore", category=UserWarning)
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorageConfig,
        HiCacheStorageFailureInjector,
        PoolName,
        PoolTransfer,
    )
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except ImportError as e:  # pragma: no cover - depends on the environment
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        raise
    pytest.skip(f"sglang is not importable ({e}); scripts/test.sh installs it", allow_module_level=True)

from kvbm_connector import KvbmError
from kvbm_connector.sglang import KvbmHiCacheStorage

LAYERS, HEADS, DIM, PAGE, TOKENS = 2, 2, 8, 4, 64
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def host_pool(layout: str, dtype=torch.float32, dim: int = DIM) -> MHATokenToKVPoolHost:
    k = tuple(torch.zeros(TOKENS, HEADS, dim, dtype=dtype) for _ in range(LAYERS))
    v = tuple(torch.zeros(TOKENS, HEADS, dim, dtype=dtype) for _ in range(LAYERS))
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=PAGE,
        head_num=HEADS,
        head_dim=dim,
        v_head_dim=dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    pool = MHATokenToKVPoolHost(
        info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS,
    )
    pool._keep = (k, v)
    return pool


def storage_config(extra: dict, *, tp_rank=0, tp_size=1, mla=False, model="kvbm-test") -> HiCacheStorageConfig:
    base = {
        "backend_name": "kvbm",
        "module_path": "kvbm_connector.sglang",
        "class_name": "KvbmHiCacheStorage",
        "interface_v1": 1,
    }
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=True, is_page_first_layout=True,
        model_name=model, extra_config={**base, **extra},
    )


def backend(extra: dict, pool, **kw):
    """Built by SGLang's factory and given the pool as its cache controller does."""
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **kw), pool)
    b.register_mem_pool_host(pool)
    return b


def fill(pool, pages: int, seed: int):
    """Allocates `pages` pages of the pool, fills them with seeded values; their host indices
    and a copy of each page."""
    idx = pool.alloc(pages * PAGE)
    g = torch.Generator().manual_seed(seed)
    for i in range(pages):
        page = pool.get_data_page(int(idx[i * PAGE]), flat=True)
        pool.set_from_flat_data_page(int(idx[i * PAGE]), torch.randn(page.shape, generator=g))
    return idx, [pool.get_data_page(int(idx[i * PAGE])).clone() for i in range(pages)]


def page_of(pool, idx, i):
    return pool.get_data_page(int(idx[i * PAGE]))


def disk_extra(tmp_path, name="disk") -> dict:
    return {"host_cache_blocks": 0, "disk_cache_blocks": 64, "disk_cache_dir": str(tmp_path / name)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_built_by_sglangs_factory_and_pages_round_trip(tmp_path, layout):
    pool = host_pool(layout)
    b = backend(disk_extra(tmp_path), pool)
    assert isinstance(b, KvbmHiCacheStorage)
    keys = [f"k{i}" for i in range(3)]
    idx, want = fill(pool, 3, seed=1)
    assert b.batch_set_v1(keys, idx) == [True] * 3
    assert b.batch_exists(keys + ["absent", "k0"]) == 3
    assert b.exists("k1") and not b.exists("absent")
    pool.kv_buffer.zero_()
    assert b.batch_get_v1(keys, idx) == [True] * 3
    for i in range(3):
        assert torch.equal(page_of(pool, idx, i), want[i]), f"page {i} ({layout})"
    # The classic calls with the pool's own flat page tensors, as SGLang's generic path makes
    # them: read back byte for byte in that form.
    flat = [pool.get_data_page(int(idx[i * PAGE]), flat=True).clone() for i in range(3)]
    assert b.batch_set(["c0", "c1"], flat[:2]) is True
    dst = [pool.get_dummy_flat_data_page() for _ in range(2)]
    got = b.batch_get(["c0", "c1"], dst)
    for i in range(2):
        assert got[i] is dst[i] and torch.equal(got[i], flat[i])
    assert b.batch_get(["absent"], [pool.get_dummy_flat_data_page()]) == [None]
    # A page written in one form is never read in the other form with its bytes out of order:
    # layer-first's two forms differ, so there it is a miss; elsewhere they are the same bytes.
    got = b.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    for i in range(3):
        if layout == "layer_first":
            assert got[i] is None
        else:
            assert torch.equal(got[i], want[i].flatten())
    # The KV pool of the multi-pool calls.
    b.register_mem_host_pool_v2(pool, PoolName.KV)
    pool.kv_buffer.zero_()
    res = b.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=idx, keys=keys)])
    assert res == {PoolName.KV: [True] * 3}
    assert all(torch.equal(page_of(pool, idx, i), want[i]) for i in range(3))
    assert b.batch_exists_v2(keys).kv_hit_pages == 3
    stats = b.get_stats()
    assert type(stats).__name__ == "StorageMetrics" and sum(stats.backup_pgs) == 5
    assert b.stats()["disk_pages"] == 5
    assert b.metrics_addr is None


def test_our_counters_are_served_over_http_with_the_engine_label(tmp_path):
    import urllib.request

    pool = host_pool("page_first")
    b = backend({**disk_extra(tmp_path), "metrics_addr": "127.0.0.1:0"}, pool)
    idx, _ = fill(pool, 2, seed=9)
    assert b.batch_set_v1(["m0", "m1"], idx) == [True, True]
    assert b.batch_get_v1(["m0", "m1", "none"], pool.alloc(3 * PAGE)) == [True, True, False]
    with urllib.request.urlopen(f"http://{b.metrics_addr}/metrics", timeout=30) as r:
        page = r.read().decode()
    assert 'kvbm_page_store_hits_total{engine="sglang",tier="disk"} 2' in page, page
    assert 'kvbm_page_store_misses_total{engine="sglang"} 1' in page, page
    assert 'kvbm_page_store_pages{engine="sglang",tier="disk"} 2' in page, page
    b.close()


def test_layouts_do_not_share_pages(tmp_path):
    """A page-first page and a layer-first page of the same key are different bytes: the
    layout is in the namespace, so one layout never reads the other's pages."""
    url = f"memory://layouts-{uuid.uuid4().hex}"
    a_pool, b_pool = host_pool("page_first"), host_pool("layer_first")
    a = backend({"host_cache_blocks": 0, "disk_cache_blocks": 0, "remote_url": url}, a_pool)
    b = backend({"host_cache_blocks": 0, "disk_cache_blocks": 0, "remote_url": url}, b_pool)
    idx, _ = fill(a_pool, 1, seed=2)
    assert a.batch_set_v1(["p"], idx) == [True]
    assert b.batch_exists(["p"]) == 0


def test_shared_through_a_real_redis_server_between_instances(tmp_path):
    url = REDIS_URL
    if not url:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("KVBM_TEST_REDIS_URL is not set (scripts/redis-servers.sh)")
        pytest.skip("no Redis server (scripts/redis-servers.sh)")
    model = f"shared-{uuid.uuid4().hex}"
    extra = {"host_cache_blocks": 0, "disk_cache_blocks": 0, "remote_url": url, "remote_secret": "s3cret"}
    writer_pool = host_pool("page_first")
    writer = backend(extra, writer_pool, model=model)
    assert writer._store.tiers == ["remote"]
    keys = [f"r{i}" for i in range(4)]
    idx, want = fill(writer_pool, 4, seed=3)
    assert writer.batch_set_v1(keys, idx) == [True] * 4
    reader_pool = host_pool("page_first")
    reader = backend(extra, reader_pool, model=model)
    assert reader.batch_exists(keys) == 4
    ridx = reader_pool.alloc(4 * PAGE)
    assert reader.batch_get_v1(keys, ridx) == [True] * 4
    for i in range(4):
        assert torch.equal(page_of(reader_pool, ridx, i), want[i])
    assert reader.stats()["remote_hits"] == 4


def test_tp_ranks_never_share_pages_and_mla_ranks_do():
    url = f"memory://tp-{uuid.uuid4().hex}"
    extra = {"host_cache_blocks": 0, "disk_cache_blocks": 0, "remote_url": url}
    p0, p1 = host_pool("page_first"), host_pool("page_first")
    r0 = backend(extra, p0, tp_rank=0, tp_size=2)
    r1 = backend(extra, p1, tp_rank=1, tp_size=2)
    idx, want = fill(p0, 2, seed=4)
    assert r0.batch_set_v1(["a", "b"], idx) == [True, True]
    assert r1.batch_exists(["a", "b"]) == 0
    assert r1.batch_get_v1(["a"], p1.alloc(PAGE)) == [False]
    # MLA: the latent is the same on every rank, so ranks share pages.
    m0 = backend(extra, p0, tp_rank=0, tp_size=2, mla=True)
    m1 = backend(extra, p1, tp_rank=1, tp_size=2, mla=True)
    assert m0.batch_set_v1(["a", "b"], idx) == [True, True]
    assert m1.batch_exists(["a", "b"]) == 2
    dst = p1.alloc(2 * PAGE)
    assert m1.batch_get_v1(["a", "b"], dst) == [True, True]
    assert torch.equal(page_of(p1, dst, 1), want[1])


def _disk_file(tmp_path):
    files = [f for f in (tmp_path / "disk").iterdir() if f.is_file()]
    assert len(files) == 1, files
    return files[0]


def test_corrupt_truncated_and_missing_pages_are_misses_never_wrong_bytes(tmp_path):
    pool = host_pool("page_first")
    b = backend(disk_extra(tmp_path), pool)
    keys = ["x0", "x1", "x2"]
    idx, want = fill(pool, 3, seed=5)
    assert b.batch_set_v1(keys, idx) == [True] * 3
    f = _disk_file(tmp_path)
    slot = (pool.get_dummy_flat_data_page().numel() * 4 + 4095) // 4096 * 4096
    with open(f, "r+b") as fh:  # damage every slot
        for s in range(64):
            fh.seek(s * slot + 100)
            fh.write(b"\xab\xcd\xef")
    pool.kv_buffer.zero_()
    assert b.batch_get_v1(keys + ["never-set"], pool.alloc(4 * PAGE)) == [False] * 4
    assert b.stats()["corrupt"] == 3
    assert b.batch_exists(keys) == 0, "damaged pages are withdrawn"
    # Written again, then the file cut short: reads of the lost slots are misses too.
    idx, want = fill(pool, 3, seed=6)
    assert b.batch_set_v1(keys, idx) == [True] * 3
    os.truncate(f, 0)
    out = pool.alloc(3 * PAGE)
    assert b.batch_get_v1(keys, out) == [False] * 3


def test_bad_input_is_a_typed_error_naming_the_field(tmp_path):
    pool = host_pool("page_first")
    with pytest.raises(KvbmError) as e:
        StorageBackendFactory.create_backend("dynamic", storage_config({"disk_size": 3}), pool)
    assert e.value.kind == "invalid_config" and "disk_size" in str(e.value)
    with pytest.raises(KvbmError) as e:
        StorageBackendFactory.create_backend("dynamic", storage_config({"eviction": "nope"}), pool)
    assert e.value.kind == "invalid_config"
    b = backend(disk_extra(tmp_path), pool)
    with pytest.raises(KvbmError) as e:
        b.batch_exists(["ok", 7])
    assert e.value.kind == "invalid_argument" and "keys[1]" in str(e.value)
    with pytest.raises(KvbmError) as e:
        b.batch_set(["short"], [torch.zeros(3)])
    assert e.value.kind == "invalid_argument" and "page 0" in str(e.value)
    assert b.batch_exists(["short"]) == 0
    with pytest.raises(KvbmError) as e:
        b.batch_set_v1(["a", "b"], torch.arange(PAGE))
    assert e.value.kind == "invalid_argument" and "host_indices" in str(e.value)
    with pytest.raises(KvbmError) as e:
        b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.arange(PAGE), keys=["a"])])
    assert e.value.kind == "unsupported" and "mamba" in str(e.value)
    with pytest.raises(KvbmError) as e:
        b.register_mem_host_pool_v2(pool, PoolName.SWA)
    assert "swa" in str(e.value)
    # An address outside the registered pool is refused before it is used.
    with pytest.raises(KvbmError) as e:
        b._store.get_runs(["a"], [16], [pool.get_dummy_flat_data_page().numel() * 4])
    assert "not inside a registered buffer" in str(e.value)


def test_sglangs_failure_injector_around_our_backend(tmp_path):
    """SGLang's own injector fails calls at random: every page a read reports served is the
    page that was written, whatever failed around it."""
    pool = host_pool("page_first")
    b = HiCacheStorageFailureInjector(backend(disk_extra(tmp_path), pool), 0.0, 0.4)
    written = {}
    for round_ in range(30):
        keys = [f"f{round_}-{i}" for i in range(2)]
        idx, want = fill(pool, 2, seed=100 + round_)
        if b.batch_set_v1(keys, idx) == [True, True]:
            written.update(zip(keys, want))
        pool.free(idx)
    assert written, "the injector failed every write"
    keys = list(written)
    served = 0
    # Five passes: the injector fails a call with p=0.4, so some pass serves pages (all twenty-odd
    # calls failing has p < 1e-8); every page served is checked.
    for at in [a for _ in range(5) for a in range(0, len(keys), 8)]:  # the pool holds 33 pages
        chunk = keys[at : at + 8]
        out = pool.alloc(len(chunk) * PAGE)
        pool.kv_buffer.zero_()
        ok = b.batch_get_v1(chunk, out)
        for i, k in enumerate(chunk):
            if ok[i]:
                served += 1
                assert torch.equal(page_of(pool, out, i), written[k]), k
        pool.free(out)
    assert served > 0, "the injector failed every read"
    assert json.loads(json.dumps(b._backend.stats()))["corrupt"] == 0


def test_a_persisted_disk_tier_survives_a_process_restart(tmp_path):
    """Pages written by one SGLang process are read by the next one (``disk_persist``): a child
    process writes them and exits without closing the backend (as SGLang does); this process
    then opens the same directory and reads them back byte for byte."""
    import subprocess

    extra = {**disk_extra(tmp_path), "disk_persist": True}
    child = f"""
import sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import test_sglang as T
pool = T.host_pool("page_first")
b = T.backend({extra!r}, pool, model="persisted")
idx, _ = T.fill(pool, 3, seed=42)
assert b.batch_set_v1(["p0", "p1", "p2"], idx) == [True] * 3
"""
    env = {**os.environ, "KVBM_SGLANG_PATH": SGLANG_PATH or ""}
    subprocess.run([sys.executable, "-c", child], env=env, check=True, timeout=300)
    pool = host_pool("page_first")
    b = backend(extra, pool, model="persisted")
    _, want = fill(host_pool("page_first"), 3, seed=42)
    assert b.batch_exists(["p0", "p1", "p2"]) == 3
    out = pool.alloc(3 * PAGE)
    assert b.batch_get_v1(["p0", "p1", "p2"], out) == [True] * 3
    for i in range(3):
        assert torch.equal(page_of(pool, out, i), want[i])
    # Another model in the same directory: its own file, nothing shared.
    other = backend(extra, host_pool("page_first"), model="another")
    assert other.batch_exists(["p0"]) == 0
    b.close()
    other.close()
    # The same model with another disk size: refused when SGLang builds the backend.
    with pytest.raises(KvbmError) as e:
        backend({**extra, "disk_cache_blocks": 32}, host_pool("page_first"), model="persisted")
    assert e.value.kind == "invalid_config" and "num_blocks" in str(e.value)


def test_a_layout_we_cannot_read_is_refused_when_sglang_builds_the_backend(tmp_path):
    """A host pool whose pages the zero-copy calls cannot address (``get_page_buffer_meta``
    raises, as SGLang's MLA pool in ``layer_first`` did before 0.5.23) is refused at registration
    with a KvbmError naming the layout, not on the first prefetch."""
    pool = host_pool("page_first")

    def no_runs(indices):
        raise ValueError("Unsupported layout: layer_first")

    pool.get_page_buffer_meta = no_runs
    with pytest.raises(KvbmError) as e:
        backend(disk_extra(tmp_path), pool)
    assert e.value.kind == "unsupported" and e.value.context.get("field") == "layout"
    # The classic calls do not need the runs: the same pool is served without interface_v1.
    extra = {**disk_extra(tmp_path, "classic"), "interface_v1": 0}
    b = backend(extra, pool)
    idx, want = fill(pool, 1, seed=11)
    assert b.batch_set(["c"], [pool.get_data_page(int(idx[0]))]) is True
    got = b.batch_get(["c"], [pool.get_dummy_flat_data_page()])
    assert torch.equal(got[0], want[0].flatten())



def test_buffered_disk_io_by_default_unless_a_setting_says_otherwise(tmp_path, monkeypatch):
    """SGLang's backend defaults to buffered disk I/O (KVBM_DISK_DIRECT_IO=false) unless the extra
    config, the environment or the config file sets disk.direct_io (how it fails: the file's
    setting overridden, as before, gives "false" in the third case)."""
    from kvbm_connector.sglang import _overrides

    monkeypatch.delenv("KVBM_DISK_DIRECT_IO", raising=False)
    monkeypatch.delenv("KVBM_CONFIG", raising=False)
    assert _overrides({})[0]["KVBM_DISK_DIRECT_IO"] == "false"
    assert _overrides({"disk_direct_io": True})[0]["KVBM_DISK_DIRECT_IO"] == "true"
    with_direct = tmp_path / "direct.toml"
    with_direct.write_text("[disk]\ndirect_io = true\n")
    out, path = _overrides({"config": str(with_direct)})
    assert path == str(with_direct) and "KVBM_DISK_DIRECT_IO" not in out
    monkeypatch.setenv("KVBM_CONFIG", str(with_direct))
    assert "KVBM_DISK_DIRECT_IO" not in _overrides({})[0]
    other = tmp_path / "other.toml"
    other.write_text("[disk]\ncache_blocks = 8\n")
    assert _overrides({"config": str(other)})[0]["KVBM_DISK_DIRECT_IO"] == "false"
    monkeypatch.setenv("KVBM_DISK_DIRECT_IO", "true")
    assert "KVBM_DISK_DIRECT_IO" not in _overrides({})[0]


# --- what SGLang's own deployments do (found by reading its 0.5.23 cache controllers) ---------


def test_mla_over_several_ranks_needs_the_shared_store_and_is_refused_by_name_without_it(tmp_path):
    """SGLang backs MLA pages up from one rank and takes the smallest hit of all ranks: local
    tiers alone would never serve a page on more than one rank."""
    with pytest.raises(KvbmError) as e:
        backend(disk_extra(tmp_path), host_pool("page_first"), tp_rank=1, tp_size=2, mla=True)
    assert e.value.kind == "invalid_config" and e.value.context.get("field") == "remote_url", e.value
    # One rank, or MHA over several, or MLA with a shared store: built.
    backend(disk_extra(tmp_path, "a"), host_pool("page_first"), tp_rank=0, tp_size=1, mla=True).close()
    backend(disk_extra(tmp_path, "b"), host_pool("page_first"), tp_rank=1, tp_size=2).close()
    url = f"memory://mla-{uuid.uuid4().hex}"
    backend({**disk_extra(tmp_path, "c"), "remote_url": url}, host_pool("page_first"),
            tp_rank=1, tp_size=2, mla=True).close()


def _persisting_child(extra: dict, then: str):
    """A child SGLang process that stores pages p0..p29 (seeds 42 + batch) through a persisted
    backend, runs `then`, says READY and waits to be ended."""
    import subprocess

    child = f"""
import sys, time
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import test_sglang as T
pool = T.host_pool("page_first")
b = T.backend({extra!r}, pool, model="persisted")
for batch in range(3):
    idx, _ = T.fill(pool, 10, seed=42 + batch)
    assert b.batch_set_v1([f"p{{batch * 10 + i}}" for i in range(10)], idx) == [True] * 10
    pool.free(idx)
{then}
print("READY", flush=True)
time.sleep(600)
"""
    env = {**os.environ, "KVBM_SGLANG_PATH": SGLANG_PATH or ""}
    p = subprocess.Popen([sys.executable, "-c", child], env=env, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if line.strip() != "READY":
        p.kill()
        raise AssertionError(f"the child ended before READY: {line!r}, rc {p.wait()}")
    return p


def _served_pages(extra: dict) -> int:
    """How many of p0..p29 a new process's backend serves, each compared with its bytes."""
    pool = host_pool("page_first")
    b = backend(extra, pool, model="persisted")
    keys = [f"p{i}" for i in range(30)]
    want = []
    for batch in range(3):
        _, w = fill(host_pool("page_first"), 10, seed=42 + batch)
        want.extend(w)
    served = 0
    for at in range(0, 30, 10):
        out = pool.alloc(10 * PAGE)
        ok = b.batch_get_v1(keys[at : at + 10], out)
        for i in range(10):
            if ok[i]:
                assert torch.equal(page_of(pool, out, i), want[at + i]), keys[at + i]
                served += 1
        pool.free(out)
    b.close()
    return served


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_persisted_tier_stopped_by_sigterm_or_sighup_keeps_its_pages(tmp_path, sig):
    """How systemd and Kubernetes stop a process: SIGTERM (SIGHUP when its terminal goes), which
    skip Python's exit hooks. The pages stored before it are served by the next process, and
    the process still ends by the signal. (0 of 30 when the index was saved only by a later put
    or a clean exit. Here the signal's save or the tier's timed one may be the one that saves;
    tests/durability.rs isolates the signal's.)"""
    import signal

    extra = {**disk_extra(tmp_path), "disk_persist": True}
    p = _persisting_child(extra, "")
    p.send_signal(getattr(signal, sig))
    assert p.wait(timeout=60) == -getattr(signal, sig)
    assert _served_pages(extra) == 30


def test_a_clear_of_a_persisted_tier_survives_a_sigkill(tmp_path):
    """SGLang's ``clear()`` (e.g. after a weight update that keeps the model's name) is on disk
    when it returns: killed right after it, the next process serves none of the cleared pages
    (all 30 came back before)."""
    import signal

    extra = {**disk_extra(tmp_path), "disk_persist": True}
    p = _persisting_child(extra, "b.clear()")
    p.send_signal(signal.SIGKILL)
    assert p.wait(timeout=60) == -signal.SIGKILL
    assert _served_pages(extra) == 0


def test_ranks_with_the_same_namespace_each_get_a_persisted_file_and_a_metrics_port(tmp_path):
    """MLA ranks share a namespace, and so do data-parallel replicas without DP attention (SGLang
    gives them all dp_rank 0): each process takes the next free persisted file and the next
    block of metrics ports instead of failing to start; a restart reopens the files."""
    import socket
    import urllib.request

    with socket.socket() as s:  # a free port, and the two after it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"memory://replicas-{uuid.uuid4().hex}"
    extra = {
        **disk_extra(tmp_path), "disk_persist": True, "remote_url": url,
        "remote_min_frequency": 1000, "metrics_addr": f"127.0.0.1:{port}",
    }
    pools = [host_pool("page_first"), host_pool("page_first")]
    a = backend(extra, pools[0], tp_rank=0, tp_size=2, mla=True)
    b = backend(extra, pools[1], tp_rank=1, tp_size=2, mla=True)
    assert a.metrics_addr.endswith(f":{port}"), a.metrics_addr
    # Rank 1's own port is port + 1; it is free, so it serves there.
    assert b.metrics_addr.endswith(f":{port + 1}"), b.metrics_addr
    # A second replica of rank 0 (same config): the next block of ports (stride 2).
    c = backend(extra, host_pool("page_first"), tp_rank=0, tp_size=2, mla=True)
    assert c.metrics_addr.endswith(f":{port + 2}"), c.metrics_addr
    with urllib.request.urlopen(f"http://{c.metrics_addr}/metrics", timeout=30) as r:
        assert 'engine="sglang"' in r.read().decode()
    files = sorted(f.name for f in (tmp_path / "disk").iterdir() if f.name.endswith(".blocks"))
    assert len(files) == 3 and len({f.split(".")[0] for f in files}) == 1, files
    # Each writes its own pages to its own disk (remote_min_frequency keeps them off the store).
    idx_a, want_a = fill(pools[0], 2, seed=31)
    idx_b, want_b = fill(pools[1], 2, seed=32)
    assert a.batch_set_v1(["a0", "a1"], idx_a) == [True, True]
    assert b.batch_set_v1(["b0", "b1"], idx_b) == [True, True]
    for x in (a, b, c):
        x.close()
    # Restarted (one process each again): every page is served by whichever reopened its file,
    # byte for byte; together they hold both ranks' pages.
    again = [backend(extra, host_pool("page_first"), tp_rank=r, tp_size=2, mla=True) for r in (0, 1)]
    held = {k: x for x in again for k in ("a0", "a1", "b0", "b1") if x.batch_exists([k]) == 1}
    assert set(held) == {"a0", "a1", "b0", "b1"}, held
    for keys, want in ((["a0", "a1"], want_a), (["b0", "b1"], want_b)):
        x = held[keys[0]]
        dst = x.mem_pool_host.alloc(2 * PAGE)
        assert x.batch_get_v1(keys, dst) == [True, True]
        for i in range(2):
            assert torch.equal(page_of(x.mem_pool_host, dst, i), want[i])
    for x in again:
        x.close()


def test_sglangs_prefetch_keys_are_left_to_it():
    """SGLang's decode-side offload manager hands the extra config on with its own prefetch
    keys still in it."""
    extra = {
        "host_cache_blocks": 16, "disk_cache_blocks": 0, "prefetch_threshold": 256,
        "prefetch_timeout_base": 1, "prefetch_timeout_per_ki_token": 0.25,
        "hicache_storage_pass_prefix_keys": True,
    }
    backend(extra, host_pool("page_first")).close()


def test_batch_exists_of_a_whole_long_request_answers_across_chunks(monkeypatch):
    """SGLang's hybrid controller asks about every page of a request in one call (beyond the
    page store's 65,536 a call): the answer is the prefix count across chunks."""
    import kvbm_connector.sglang as ours

    pool = host_pool("page_first")
    b = backend({"host_cache_blocks": 16, "disk_cache_blocks": 0}, pool)
    idx, _ = fill(pool, 5, seed=33)
    keys = [f"x{i}" for i in range(5)]
    assert b.batch_set_v1(keys, idx) == [True] * 5
    assert b.batch_exists(keys + [f"y{i}" for i in range(70_000)]) == 5
    monkeypatch.setattr(ours, "EXISTS_CHUNK", 2)
    assert b.batch_exists(keys + ["y0", "x0"]) == 5
    assert b.batch_exists(keys[:3] + ["y0"] + keys[3:]) == 3
    assert b.batch_exists(keys[:4]) == 4


def test_k_and_v_of_different_head_dims_are_served_by_the_zero_copy_calls():
    """SGLang's pool for K and V of different head dims cannot give a flat page, only the
    zero-copy runs: the page is what those runs add up to."""
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

    k = tuple(torch.zeros(TOKENS, HEADS, DIM) for _ in range(LAYERS))
    v = tuple(torch.zeros(TOKENS, HEADS, DIM // 2) for _ in range(LAYERS))
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=PAGE, head_num=HEADS, head_dim=DIM, v_head_dim=DIM // 2,
        dtype=torch.float32, device=torch.device("cpu"),
    )
    cls = get_mha_host_pool_cls(info)
    pool = cls(info, 2.0, 0, PAGE, "page_first", pin_memory=False, device="cpu",
               device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS)
    pool._keep = (k, v)
    b = backend({"host_cache_blocks": 16, "disk_cache_blocks": 0}, pool)
    assert b._store.page_bytes == PAGE * LAYERS * HEADS * (DIM + DIM // 2) * 4
    idx = pool.alloc(2 * PAGE)
    for buf in (pool.k_buffer, pool.v_buffer):
        buf.copy_(torch.randn(buf.shape))
    ptr_list, sizes = pool.get_page_buffer_meta(idx)
    import ctypes

    def snapshot():
        return [ctypes.string_at(int(p), int(n)) for p, n in zip(ptr_list, sizes)]

    want = snapshot()
    assert b.batch_set_v1(["k0", "k1"], idx) == [True, True]
    for buf in (pool.k_buffer, pool.v_buffer):
        buf.zero_()
    assert snapshot() != want
    assert b.batch_get_v1(["k0", "k1"], idx) == [True, True]
    assert snapshot() == want
    # The classic calls cannot read such a pool: refused by name at registration.
    with pytest.raises(KvbmError) as e:
        KvbmHiCacheStorage(storage_config({"host_cache_blocks": 16, "interface_v1": 0}), {"mem_pool_host": pool})
    assert e.value.context.get("field") == "layout", e.value


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("v1", [1, 0])
def test_sglangs_mla_host_pool_shares_pages_between_ranks(layout, v1):
    """SGLang's own MLA host pool (one latent buffer, the same on every rank): rank 0 writes,
    rank 1 reads the same bytes through the shared store, in every layout and both interfaces."""
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    rank, rope = 12, 4

    def mla_pool():
        bufs = tuple(torch.zeros(TOKENS, 1, rank + rope) for _ in range(LAYERS))
        info = MLABufferInfo(
            buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
            layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS, page_size=PAGE,
            kv_lora_rank=rank, qk_rope_head_dim=rope, kv_cache_dim=rank + rope,
            dtype=torch.float32, device=torch.device("cpu"),
        )
        pool = MLATokenToKVPoolHost(
            info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS,
        )
        pool._keep = bufs
        return pool

    url = f"memory://mla-pool-{uuid.uuid4().hex}"
    extra = {"host_cache_blocks": 0, "disk_cache_blocks": 0, "remote_url": url, "interface_v1": v1}
    p0, p1 = mla_pool(), mla_pool()
    r0 = backend(extra, p0, tp_rank=0, tp_size=2, mla=True)
    r1 = backend(extra, p1, tp_rank=1, tp_size=2, mla=True)
    idx, want = fill(p0, 3, seed=41)
    keys = ["m0", "m1", "m2"]
    if v1:
        assert r0.batch_set_v1(keys, idx) == [True] * 3
    else:
        assert r0.batch_set(keys, [p0.get_data_page(int(idx[i * PAGE])) for i in range(3)]) is True
    assert r1.batch_exists(keys + ["none"]) == 3
    dst = p1.alloc(3 * PAGE)
    if v1:
        assert r1.batch_get_v1(keys, dst) == [True] * 3
    else:
        got = r1.batch_get(keys, [p1.get_dummy_flat_data_page() for _ in range(3)])
        for i, t in enumerate(got):
            p1.set_from_flat_data_page(int(dst[i * PAGE]), t)
    for i in range(3):
        assert torch.equal(page_of(p1, dst, i), want[i]), f"page {i}"


def test_the_v2_calls_find_what_they_wrote_whatever_interface_v1_says():
    """The multi-pool calls move the pool's runs; in layer_first those are another byte order
    than the classic calls' flat page, so their existence query must look for the runs' form
    even on a backend launched for the classic calls."""
    pool = host_pool("layer_first")
    b = backend({"host_cache_blocks": 16, "disk_cache_blocks": 0, "interface_v1": 0}, pool)
    idx, want = fill(pool, 2, seed=51)
    kv = str(PoolName.KV)
    put = b.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=idx, keys=["v0", "v1"])])
    assert list(put.values()) == [[True, True]]
    found = b.batch_exists_v2(["v0", "v1", "none"], [])
    assert found.kv_hit_pages == 2 and found.extra_pool_hit_pages.get(kv) == 2, found
    dst = pool.alloc(2 * PAGE)
    got = b.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=dst, keys=["v0", "v1"])])
    assert list(got.values()) == [[True, True]]
    for i in range(2):
        assert torch.equal(page_of(pool, dst, i), want[i])
    # The classic calls' flat pages are another form: not found by the classic query.
    assert b.batch_exists(["v0"]) == 0


def test_a_fresh_instance_sees_the_shared_stores_pages_at_its_first_lookup():
    """An instance whose first call is a lookup (SGLang's hit query after a restart or on a new
    replica) finds what another instance wrote to the shared store: the page store is opened
    when the host pool is registered, as SGLang does when it attaches the backend. A backend
    given no pool cannot name a page (the name holds the pool's format): its calls are refused
    by name, never answered 0 while the store holds the pages."""
    url = f"memory://fresh-{uuid.uuid4().hex}"
    keys = ["f0", "f1", "f2"]
    for v1 in (1, 0):
        extra = {"host_cache_blocks": 0, "disk_cache_blocks": 0, "remote_url": url, "interface_v1": v1}
        wpool = host_pool("page_first")
        writer = backend(extra, wpool, model=f"fresh-{v1}")
        idx, want = fill(wpool, 3, seed=61)
        if v1:
            assert writer.batch_set_v1(keys, idx) == [True] * 3
        else:
            flat = [wpool.get_data_page(int(idx[i * PAGE]), flat=True) for i in range(3)]
            assert writer.batch_set(keys, flat) is True
        # As SGLang's controller attaches a backend: built by the factory, then the pool.
        rpool = host_pool("page_first")
        reader = StorageBackendFactory.create_backend("dynamic", storage_config(extra, model=f"fresh-{v1}"), rpool)
        with pytest.raises(KvbmError) as e:
            reader.batch_exists(keys)
        assert e.value.kind == "not_ready" and e.value.context.get("field") == "mem_pool_host", e.value
        with pytest.raises(KvbmError) as e:
            reader.batch_get(keys[:1], [rpool.get_dummy_flat_data_page()])
        assert e.value.context.get("field") == "mem_pool_host", e.value
        with pytest.raises(KvbmError) as e:
            reader.batch_set(["never"], [rpool.get_dummy_flat_data_page()])
        assert e.value.context.get("field") == "mem_pool_host", e.value
        reader.register_mem_pool_host(rpool)
        assert reader.batch_exists(keys + ["none"]) == 3, f"interface_v1={v1}"
        assert reader.exists("f2") and not reader.exists("none")
        assert reader.stats()["get_pages"] == 0
        dst = rpool.alloc(3 * PAGE)
        if v1:
            assert reader.batch_get_v1(keys, dst) == [True] * 3
            got = [page_of(rpool, dst, i) for i in range(3)]
        else:
            got = reader.batch_get(keys, [rpool.get_dummy_flat_data_page() for _ in keys])
        for i in range(3):
            assert torch.equal(got[i].flatten(), want[i].flatten()), f"page {i}"
        reader.close()
        with pytest.raises(KvbmError) as e:
            reader.batch_exists(keys)
        assert "closed" in str(e.value) and e.value.context.get("field") == "mem_pool_host"


def test_a_second_host_pool_of_another_format_is_refused_by_name():
    """SGLang registers one storage pool per attach (again as the KV entry of the *_v2 calls:
    the same pool). A pool of another layout or dtype with the same page size in bytes would
    have its pages named as the first pool's, other bytes under the same names: refused,
    naming what differs, and the first pool keeps serving."""
    pool = host_pool("page_first")
    b = backend({"host_cache_blocks": 16, "disk_cache_blocks": 0}, pool)
    page_bytes = b._store.page_bytes
    others = {
        "layout": host_pool("layer_first"),
        "dtype": host_pool("page_first", dtype=torch.float16, dim=2 * DIM),
    }
    for what, other in others.items():
        for register in (
            b.register_mem_pool_host,
            lambda p: b.register_mem_host_pool_v2(p, PoolName.KV),
        ):
            with pytest.raises(KvbmError) as e:
                register(other)
            assert e.value.kind == "invalid_argument", e.value
            assert e.value.context.get("field") == "mem_pool_host", e.value
            assert what in e.value.context.get("differs", "").split(","), e.value
            assert b.mem_pool_host is pool
    assert b._store.page_bytes == page_bytes
    # The same pool again, and one of the same format, are taken.
    b.register_mem_pool_host(pool)
    b.register_mem_host_pool_v2(pool, PoolName.KV)
    same = host_pool("page_first")
    b.register_mem_pool_host(same)
    idx, want = fill(same, 2, seed=71)
    assert b.batch_set_v1(["s0", "s1"], idx) == [True, True]
    same.kv_buffer.zero_()
    assert b.batch_get_v1(["s0", "s1"], idx) == [True, True]
    assert all(torch.equal(page_of(same, idx, i), want[i]) for i in range(2))


def test_keys_and_host_indices_that_cannot_be_used_are_typed_errors_naming_the_field():
    pool = host_pool("page_first")
    b = backend({"host_cache_blocks": 16, "disk_cache_blocks": 0}, pool)
    idx, _ = fill(pool, 1, seed=81)
    # A str with a lone surrogate has no UTF-8 form.
    for call in (
        lambda: b.batch_exists(["ok", "\ud800"]),
        lambda: b.batch_set_v1(["\udfff"], idx),
        lambda: b.batch_get_v1(["\ud800"], idx),
        lambda: b.batch_set(["\ud800"], [pool.get_dummy_flat_data_page()]),
    ):
        with pytest.raises(KvbmError) as e:
            call()
        assert e.value.kind == "invalid_argument" and e.value.context.get("field") == "keys", e.value
    # Host indices outside the pool (past the address space, negative, beyond its slots, not
    # integers) are refused before SGLang computes an address from them.
    slots = int(pool.size)
    for bad in (
        torch.arange(PAGE, dtype=torch.int64) + 2**60,
        torch.arange(PAGE, dtype=torch.int64) - 2**40,
        torch.arange(PAGE, dtype=torch.int64) + slots,
        torch.arange(PAGE, dtype=torch.float32),
    ):
        for call in (b.batch_set_v1, b.batch_get_v1):
            with pytest.raises(KvbmError) as e:
                call(["h"], bad)
            assert e.value.kind == "invalid_argument", e.value
            assert e.value.context.get("field") == "host_indices", e.value
    # The store's own runs: an address past the address space or negative is named.
    for ptrs, sizes, field in (([2**64 + 16], [16], "ptrs"), ([-16], [16], "ptrs"), ([16], [-1], "sizes")):
        with pytest.raises(KvbmError) as e:
            b._store.put_runs(["h"], ptrs, sizes)
        assert e.value.context.get("field") == field, e.value
    assert b.batch_exists(["h"]) == 0
    assert b.stats()["put_pages"] == 0


def test_a_write_from_a_read_only_tensor_is_taken_and_a_read_into_one_refused():
    """A store only reads its source page, which may be read-only (a numpy array SGLang did
    not make writable); a read writes into its target, which must be writable."""
    pool = host_pool("page_first")
    b = backend({"host_cache_blocks": 16, "disk_cache_blocks": 0, "interface_v1": 0}, pool)
    src = torch.randn(pool.get_dummy_flat_data_page().shape).numpy()
    src.setflags(write=False)
    assert b.batch_set(["ro"], [src]) is True
    got = b.batch_get(["ro"], [pool.get_dummy_flat_data_page()])
    assert torch.equal(got[0], torch.from_numpy(src.copy()))
    dst = src.copy()
    dst.setflags(write=False)
    with pytest.raises(KvbmError) as e:
        b.batch_get(["ro"], [dst])
    assert e.value.kind == "invalid_argument", e.value
    assert e.value.context.get("field") == "target_locations", e.value
