"""TTFT of a repeated long prompt on sliding-window models, with and without the kvbm connector
(docs/benchmarks.md, "Sliding-window and hybrid models").

A random-weight Mistral (every layer a sliding window) and a Gemma 2 (sliding and full layers
alternating; vLLM's hybrid manager on) built with transformers, in vLLM's CPU build (in-process
executor). Per round and model: an engine without the connector computes the prompt after
``reset_prefix_cache()``; an engine with the connector computes it once, resets vLLM's own prefix
cache, and is timed on the repeat (served by the connector: only the blocks a window needs are
loaded). Arms interleaved, ROUNDS rounds, a fresh engine per arm and round (two vLLM engines
cannot share a process: their connector state is process-wide).
Prints the median wall of the timed ``generate`` (1 output token: the prefill), its ratio,
tokens cached, and the connector's host hits (tokens loaded). Needs a release wheel of
kvbm_connector in the vLLM venv (refuses a debug build unless --allow-debug).

    python3 scripts/bench_vllm_window.py [--rounds 5] [--tokens 4000] [--window 256] [--load spin:2]
    python3 scripts/bench_vllm_window.py --capacity [--max-len 16384] [--window 256]
    python3 scripts/bench_vllm_window.py --stored [--tokens 4000] [--window 256] [--layers 8]

``--capacity``: the KV-cache capacity vLLM reports for the Gemma 2 model with the connector, with
vLLM's hybrid manager on (the connector's ``SupportsHMA``) and forced off
(``disable_hybrid_kv_cache_manager``, what vLLM did for a connector without it), under
``VLLM_CPU_KVCACHE_SPACE`` (GiB, default 1 here).

``--stored``: bytes the connector offloads (device -> host) for one request (``--tokens`` prompt
tokens, 8 output tokens) on the Gemma 2 model with vLLM's hybrid manager on (a sliding-window
group stores only the windows a later hit needs) and forced off (every layer kept and stored
whole: the same model with all layers full), and whether the repeat after
``reset_prefix_cache()`` is served whole with the same greedy tokens in both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "--capacity" not in sys.argv:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def capacity(a) -> None:
    from _vllm_cpu import build_windowed_model, make_llm, shutdown

    work = tempfile.mkdtemp(prefix="kvbm-window-")
    toml = os.path.join(work, "kvbm.toml")
    with open(toml, "w") as f:
        f.write("init_timeout_secs = 120.0\n[host]\ncache_blocks = 64\n[disk]\ncache_blocks = 0\n")
    path = build_windowed_model(os.path.join(work, "gemma2"), "gemma2", a.window, layers=4, std=0.04)
    print(f"Gemma 2, 4 layers, window {a.window}, max_model_len {a.max_len}, "
          f"VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB, with the connector")
    for hma in (False, True):
        kw = {} if hma else dict(disable_hybrid_kv_cache_manager=True)
        llm = make_llm(path, config=toml, max_model_len=a.max_len, **kw)
        try:
            core = llm.llm_engine.engine_core.engine_core
            cfg = core.scheduler.kv_cache_config
            cc = core.vllm_config.cache_config
            print(f"hybrid manager {'on ' if hma else 'off'}: {len(cfg.kv_cache_groups)} group(s), "
                  f"{cfg.num_blocks} blocks, {cc.kv_cache_size_tokens:,} tokens, max concurrency "
                  f"{cc.kv_cache_max_concurrency:.2f}x")
        finally:
            shutdown(llm)


def stored(a) -> None:
    from _vllm_cpu import build_windowed_model, generate, make_llm, prompt, reset, shutdown

    work = tempfile.mkdtemp(prefix="kvbm-window-")
    toml = os.path.join(work, "kvbm.toml")
    with open(toml, "w") as f:
        f.write("init_timeout_secs = 120.0\n[host]\ncache_blocks = 2048\n[disk]\ncache_blocks = 0\n")
    path = build_windowed_model(os.path.join(work, "gemma2"), "gemma2", a.window,
                                layers=a.layers, std=0.04)
    p = prompt(4242, a.tokens)
    print(f"Gemma 2, {a.layers} layers alternating sliding ({a.window} tokens) and full, "
          f"a {a.tokens}-token prompt and 8 output tokens, with the connector")
    got = {}
    for hma in (False, True):
        kw = {} if hma else dict(disable_hybrid_kv_cache_manager=True)
        llm = make_llm(path, config=toml, max_model_len=a.tokens + 64, **kw)
        try:
            conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
            toks, _, _ = generate(llm, p, 8)
            reset(llm)
            m = conn.metrics()
            t = next(x for x in m["transfers"] if x["src"] == "device" and x["dst"] == "host")
            again, _, cached = generate(llm, p, 8)
            got[hma] = t["bytes"]
            print(f"hybrid manager {'on ' if hma else 'off'}: device->host {t['blocks']} blocks, "
                  f"{t['bytes'] / 1e6:.2f} MB; sliding-window blocks not stored "
                  f"{m['window_skipped_blocks']}; repeat: {cached} tokens cached, greedy tokens "
                  f"{'identical' if again == toks else 'DIFFERENT'}")
        finally:
            shutdown(llm)
    print(f"bytes stored, hybrid manager on / all layers full: {got[True] / got[False]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--load", default="", help="spin:K (K busy processes while measuring)")
    ap.add_argument("--allow-debug", action="store_true")
    ap.add_argument("--capacity", action="store_true")
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--stored", action="store_true")
    a = ap.parse_args()
    if a.stored:
        return stored(a)
    if a.capacity:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        return capacity(a)

    from kvbm_connector import _kvbm
    if getattr(_kvbm, "DEBUG_BUILD", False) and not a.allow_debug:
        sys.exit("kvbm_connector is a debug build: install a release wheel (or --allow-debug)")
    from _vllm_cpu import build_windowed_model, generate, make_llm, prompt, reset, shutdown

    work = tempfile.mkdtemp(prefix="kvbm-window-")
    toml = os.path.join(work, "kvbm.toml")
    with open(toml, "w") as f:
        f.write("init_timeout_secs = 120.0\n[host]\ncache_blocks = 2048\n[disk]\ncache_blocks = 0\n")
    spinners = []
    if a.load.startswith("spin:"):
        for _ in range(int(a.load.split(":")[1])):
            spinners.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"CPU: {cpu}; load: {a.load or 'none'}; loadavg {os.getloadavg()[0]:.2f}; "
          f"prompt {a.tokens} tokens, window {a.window}, {a.layers} layers, {a.rounds} rounds")
    try:
        for family in ("mistral", "gemma2"):
            path = build_windowed_model(os.path.join(work, family), family, a.window,
                                        layers=a.layers, std=0.08 if family == "mistral" else 0.04)
            walls = {"none": [], "kvbm": []}
            cached = {"none": [], "kvbm": []}
            loaded = []
            outputs = set()
            for r in range(a.rounds):
                p = prompt(1000 + r, a.tokens)
                for arm in ("none", "kvbm"):
                    llm = make_llm(path, connector=(arm == "kvbm"), config=toml,
                                   max_model_len=a.tokens + 64)
                    try:
                        if arm == "kvbm":
                            generate(llm, p, 1)
                            reset(llm)
                            before = llm.llm_engine.engine_core.engine_core.scheduler.connector.metrics()
                        else:
                            reset(llm)
                        t = time.perf_counter()
                        toks, _, c = generate(llm, p, 1)
                        walls[arm].append(time.perf_counter() - t)
                        cached[arm].append(c)
                        outputs.add((r, tuple(toks), arm))
                        if arm == "kvbm":
                            after = llm.llm_engine.engine_core.engine_core.scheduler.connector.metrics()
                            loaded.append(after["host_hit_tokens"] - before["host_hit_tokens"])
                    finally:
                        shutdown(llm)
            same = all(
                {t for (rr, t, arm) in outputs if rr == r and arm == "none"}
                == {t for (rr, t, arm) in outputs if rr == r and arm == "kvbm"}
                for r in range(a.rounds)
            )
            mn, mk = statistics.median(walls["none"]), statistics.median(walls["kvbm"])
            print(f"{family}: none {mn*1000:.1f} ms (min {min(walls['none'])*1000:.1f}, max "
                  f"{max(walls['none'])*1000:.1f}), kvbm {mk*1000:.1f} ms (min "
                  f"{min(walls['kvbm'])*1000:.1f}, max {max(walls['kvbm'])*1000:.1f}); "
                  f"kvbm/none {mk/mn:.2f}; cached none {cached['none']}, kvbm {cached['kvbm']}; "
                  f"tokens loaded by kvbm {loaded}; first token identical: {same}")
    finally:
        for s in spinners:
            s.kill()


if __name__ == "__main__":
    main()
