"""Time to first token of a repeated prompt in a real vLLM engine on the CPU, with and without the
kvbm connector (docs/benchmarks.md, "vLLM on the CPU: TTFT of a repeated prompt").

Run with the vLLM CPU venv scripts/test.sh builds, after installing the wheel there:

    ~/.cache/kvbm/vllm-cpu-venv/bin/python scripts/bench_vllm_ttft.py [--runs 5] [--sizes 2048,8192]

Model: a random-weight Llama (transformers, fixed seed; tests/python/_vllm_cpu.py), 8 layers, hidden 512, 8 heads / 4 KV
heads, head dim 64, vocab 1024, fp32 (about 25M parameters); block size 32; in-process executor.
For each prompt length, three numbers, each the median of ``--runs`` timings of
``generate(A, max_tokens=1)`` in one run of this script:

* ``recompute``: engine without the connector, ``reset_prefix_cache()`` before each repeat;
* ``kvbm``: engine with the connector (host tier 1 GB), A generated once, then
  ``reset_prefix_cache()`` before each repeat: every full block is loaded from the host tier;
* ``vllm prefix cache``: the same engine, A repeated without a reset (vLLM's own cache; the floor).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

# The model builder and engine helpers shared with tests/python/test_vllm_forward.py.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from _vllm_cpu import BLOCK, build_model, generate, make_llm, prompt, reset, shutdown  # noqa: E402

ENGINE = dict(max_model_len=9000, max_num_batched_tokens=9000)


def ttft(llm, tokens) -> tuple:
    t = time.perf_counter()
    tokens_out, _, cached = generate(llm, tokens, max_tokens=1)
    return time.perf_counter() - t, cached, tokens_out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sizes", default="2048,8192")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    work = tempfile.mkdtemp(prefix="kvbm-ttft-")
    model = build_model(os.path.join(work, "model"), kv_heads=4, layers=8, hidden=512, heads=8)
    prompts = {n: prompt(n, n) for n in sizes}
    results = {n: {} for n in sizes}
    first_tokens = {}

    llm = make_llm(model, connector=False, **ENGINE)
    ttft(llm, prompts[sizes[0]][:64])  # warm-up
    for n in sizes:
        times = []
        for _ in range(args.runs):
            reset(llm)
            t, cached, tok = ttft(llm, prompts[n])
            assert cached == 0, cached
            times.append(t)
        results[n]["recompute"] = statistics.median(times)
        first_tokens[n] = tok
    shutdown(llm)

    config = os.path.join(work, "kvbm.toml")
    with open(config, "w") as f:
        f.write(f'[host]\ncache_gb = 1.0\n[disk]\ncache_gb = 0.0\ndir = "{work}/disk"\n')
    llm = make_llm(model, config=config, **ENGINE)
    ttft(llm, prompts[sizes[0]][:64])
    for n in sizes:
        ttft(llm, prompts[n])  # stores A's blocks in the host tier
        times = []
        for _ in range(args.runs):
            reset(llm)
            t, cached, tok = ttft(llm, prompts[n])
            assert cached == (n - 1) // BLOCK * BLOCK, (cached, n)
            assert tok == first_tokens[n]
            times.append(t)
        results[n]["kvbm"] = statistics.median(times)
        times = []
        for _ in range(args.runs):
            t, cached, _ = ttft(llm, prompts[n])
            times.append(t)
        results[n]["vllm prefix cache"] = statistics.median(times)
    shutdown(llm)

    print(f"median of {args.runs}, seconds")
    print("| prompt tokens | recompute (no connector) | kvbm (host tier) | vLLM prefix cache | speed-up |")
    print("|---:|---:|---:|---:|---:|")
    for n in sizes:
        r = results[n]
        print(
            f"| {n} | {r['recompute']:.3f} | {r['kvbm']:.3f} | {r['vllm prefix cache']:.3f} "
            f"| {r['recompute'] / r['kvbm']:.1f}x |"
        )


if __name__ == "__main__":
    main()
