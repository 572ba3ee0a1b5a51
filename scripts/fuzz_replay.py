"""Randomized `kvbm replay` runs: settings drawn at random, every onboarded byte verified.

Each run draws the engine's call order (vLLM or TensorRT-LLM), the workload and its seed, the
request count, block size, device / host / disk blocks, the device prefix cache, the chunk size,
the batch size, a sliding window or several KV-cache groups (`--layer-groups`, or neither) and
a storage fault plan (or none), runs the replay
and checks that it exits 0 with `integrity_errors` 0 (a load error is fine: the engine recomputes
the block; a wrong byte never is). A failing run prints its whole command line, faults included,
so it can be rerun as it is (the replay is deterministic).

    python3 scripts/fuzz_replay.py [--seed S] [--runs N] [--bin target/debug/kvbm] \
        [--remote-url redis://127.0.0.1:PORT]

A fifth of the runs use two tensor-parallel ranks (worker processes); with `--remote-url` a
third also share a Redis/Valkey store (each run in a namespace of its own).

It found the TensorRT-LLM sliding-window store that read a freed block (docs/benchmarks.md,
"TensorRT-LLM's trailing stores and a sliding window"). Not part of the test suite: 60 runs take
about 5 minutes on 2 cores; the settings it found are tests of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile


def draw(rng: random.Random) -> tuple[list[str], str | None]:
    args = [
        "--framework", rng.choice(["vllm", "trtllm"]),
        "--workload", rng.choice(["multi-turn", "shared-prefix", "random"]),
        "--seed", str(rng.randrange(1000)),
        "--requests", str(rng.choice([60, 120, 200])),
        "--block-size", str(rng.choice([16, 32])),
        "--host-blocks", str(rng.choice([16, 64, 512, 4096])),
        "--disk-blocks", str(rng.choice([0, 0, 64, 1024])),
        "--device-blocks", str(rng.choice([128, 256, 1024])),
        "--device-prefix-cache", rng.choice(["on", "off"]),
        "--chunk-tokens", str(rng.choice([64, 256, 2048])),
        "--max-batch", str(rng.choice([2, 8, 32])),
    ]
    if rng.random() < 0.2:
        args += ["--tp", "2"]
    window = rng.choice([None, None, 17, 48, 64, 100, 256, 1000, "groups", "groups"])
    if window == "groups":
        kinds = ["full", "sliding:17", "sliding:48", "sliding:64", "sliding:256"]
        args += ["--layer-groups", ",".join(rng.choice(kinds) for _ in range(rng.choice([2, 3])))]
    elif window:
        args += ["--sliding-window", str(window)]
    faults = rng.choice([
        None,
        None,
        "seed=3; host.read:fail:p=0.2",
        "seed=4; disk.read:corrupt:p=0.3; host.write:fail:p=0.1",
    ])
    return args, faults


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--bin", default="target/debug/kvbm")
    ap.add_argument("--remote-url", default="",
                    help="a Redis/Valkey URL: a third of the runs also use it as the shared tier")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    bad = 0
    for _ in range(a.runs):
        args, faults = draw(rng)
        if a.remote_url and rng.random() < 0.33:
            args += ["--remote-url", a.remote_url]
        env = dict(os.environ)
        env.pop("KVBM_REPLAY_FAULTS", None)
        if faults:
            env["KVBM_REPLAY_FAULTS"] = faults
        with tempfile.TemporaryDirectory() as d:
            report = os.path.join(d, "report.json")
            env["KVBM_DISK_CACHE_DIR"] = d
            env["KVBM_REMOTE_NAMESPACE"] = "fuzz-" + os.path.basename(d)
            cmd = [a.bin, "replay", "--quiet", *args, "--report", report]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            s = json.load(open(report))["summary"] if os.path.exists(report) else None
            shown = " ".join(args) + (f"  (KVBM_REPLAY_FAULTS={faults!r})" if faults else "")
            if p.returncode != 0 or s is None or s["integrity_errors"] != 0:
                bad += 1
                tail = p.stderr.strip().splitlines()[-2:]
                print(f"FAIL rc={p.returncode}: {shown}\n     {tail}")
            else:
                print(
                    f"ok   matched {s['matched_tokens']:>7} verified {s['blocks_verified']:>5} "
                    f"load errors {s['load_errors']:>3}: {shown}"
                )
            sys.stdout.flush()
    print(f"{bad} of {a.runs} runs failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
