"""Helpers shared by tests/python/test_vllm_forward.py and scripts/bench_vllm_ttft.py: random-weight
Llamas built with ``transformers``, ``vllm.LLM`` engines with or without the kvbm connector, greedy
generation from token ids, and ``reset_prefix_cache()`` retried until it succeeds."""

from __future__ import annotations

import gc
import os
import random
import time

BLOCK = 32
HEAD_DIM = 64
VOCAB = 1024


def build_model(path: str, kv_heads: int, layers: int = 2, hidden: int = 256, heads: int = 4):
    """A random-weight Llama saved at ``path`` (fixed seed; weights normal(0, 0.08), so greedy
    argmax is decisive): head dim 64, vocab 1024, ``intermediate_size = 2 × hidden``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234 + kv_heads)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=16384,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return path


def make_llm(model: str, dtype: str = "float32", connector: bool = True, *, config=None,
             module: str = "kvbm_connector.vllm", cls: str = "KvbmConnector", extra=None,
             in_process: bool = True, max_model_len: int = 8192, **engine_args):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    ktc = None
    if connector:
        ktc = KVTransferConfig(
            kv_connector=cls,
            kv_connector_module_path=module,
            kv_role="kv_both",
            kv_connector_extra_config={"config": config, **(extra or {})},
        )
    kwargs = dict(distributed_executor_backend="uni") if in_process else {}
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype=dtype,
        block_size=BLOCK,
        max_model_len=max_model_len,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=ktc,
        **kwargs,
        **engine_args,
    )


def shutdown(llm) -> None:
    """Stops an engine and clears vLLM's process-wide connector (``ensure_kv_transfer_initialized``
    keeps the first connector of the process and reuses it for any later engine)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()
        del llm
        gc.collect()


def prompt(seed: int, n: int) -> list:
    r = random.Random(seed)
    return [r.randrange(VOCAB) for _ in range(n)]


def generate(llm, tokens, max_tokens: int = 8):
    """Greedy: ``(token ids, their logprobs, num_cached_tokens)``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1)
    out = llm.generate([TokensPrompt(prompt_token_ids=list(tokens))], sp, use_tqdm=False)[0]
    c = out.outputs[0]
    lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
    return list(c.token_ids), lps, out.num_cached_tokens


def reset(llm, in_process: bool = True) -> None:
    """``reset_prefix_cache()`` must succeed (it returns False while blocks are held): retried a
    bounded number of times, stepping the in-process engine so held requests drain."""
    for _ in range(200):
        if llm.reset_prefix_cache():
            return
        if in_process:
            llm.llm_engine.step()
        time.sleep(0.02)
    raise AssertionError("reset_prefix_cache() kept returning False (blocks still held)")


def full_blocks(n_tokens: int) -> int:
    """Tokens vLLM can take from a cache for an n-token prompt: every full block, less the one
    holding the last token when the prompt is block aligned (one token is always computed)."""
    return (n_tokens - 1) // BLOCK * BLOCK
