"""A short run of ``benches/python_class.py`` (the vLLM class's hot-path bench): the calls it
times must do the engine's work -- lookups that hit the shared prefixes stored before them, misses
for new prompts, every full block stored, nothing failed. Correctness only; its timings are the
bench's business (docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benches" / "python_class.py"


def _bench():
    spec = importlib.util.spec_from_file_location("python_class_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _stored_blocks(metrics: dict) -> int:
    return sum(
        t["blocks"] for t in metrics["transfers"] if t["src"] == "device" and t["dst"] == "host"
    )


def test_bench_calls_do_the_engines_work(monkeypatch):
    monkeypatch.setenv("KVBM_HOST_CACHE_BLOCKS", "4096")
    monkeypatch.delenv("KVBM_DISK_CACHE_BLOCKS")
    b = _bench()
    n = 40
    r = b.run_once(n, n)
    bs = b.BLOCK
    # Trace: requests are run to completion 20 at a time, so from the second batch on every
    # request's 4-block system prompt was stored before its lookup.
    for i in range(20, n):
        m = r["trace_matched"][f"t{i}"]
        assert m >= 4 * bs and m % bs == 0, (i, m)
    assert r["trace_hits"] >= n - 20
    tm = r["trace_metrics"]
    assert tm["matched_tokens"] == sum(r["trace_matched"].values()) > 0
    assert tm["operations_failed"] == 0 and tm["load_error_blocks"] == 0
    # Throughput: new prompts miss; all 8 full blocks of each are stored.
    assert set(r["tput_matched"].values()) == {0} and len(r["tput_matched"]) == n
    m = r["metrics"]
    assert _stored_blocks(m) - _stored_blocks(tm) == 8 * n
    assert m["operations_failed"] == 0
    # The timed calls: every lookup, one request_finished per request, and the limits.
    assert r["tput_lookups"] == n
    assert r["empty_py_ns"] > 0 and r["empty_pyo3_ns"] > 0
    assert set(b.report(r, out=open("/dev/null", "w"))) >= {"lookup_us", "request_us"}


def test_bench_refuses_to_time_a_debug_build(capsys, monkeypatch):
    """A timing run on an unoptimised wheel would print figures 20-30x off: refused unless asked
    for. The flag is the wheel's own; it is forced on here so the check runs on either build."""
    from kvbm_connector import _kvbm

    assert isinstance(_kvbm.DEBUG_BUILD, bool)
    monkeypatch.setattr(_kvbm, "DEBUG_BUILD", True)
    b = _bench()
    assert b.main([]) == 2
    err = capsys.readouterr().err
    assert "debug build" in err and "--allow-debug" in err
