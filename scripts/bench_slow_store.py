"""A slow or half-broken shared store against none (docs/benchmarks.md, "A slow shared store").

Runs ``kvbm replay`` on one workload without a remote tier, with a local redis-server, and through
scripts/delay_proxy.py at each reply delay (and, with --half-broken, through a proxy that passes
small replies but never a block's value), ROUNDS times each, interleaved, and prints the median
time to serve every request (``serve_s``: the replay's wall less the drain of background stores at
the end) and its ratio to the no-remote run of the same rounds. Every run must report 0 integrity
errors. Needs redis-server and a release kvbm:

    cargo build --release --bin kvbm
    python3 scripts/bench_slow_store.py [--delays 0,50,200,500] [--rounds 5] [--half-broken]
        [--framework vllm|trtllm] [--load spin:2] [--pace] [--replay-args "..."]

``--pace`` runs every replay with ``kvbm replay --pace``: each step takes its simulated compute
time in real time, as a GPU's forward pass would, so the store's round trips overlap the model's
time as they do in an engine; without it the stand-in's steps take microseconds and every round
trip the engine would hide shows in the wall.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_proxy(target: int, delay_ms: float, stall_over: int = 0):
    p = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "scripts", "delay_proxy.py"), "--listen", "127.0.0.1:0",
         "--target", f"127.0.0.1:{target}", "--delay-ms", str(delay_ms),
         "--stall-over", str(stall_over), "--max-secs", "3600"],
        stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    assert line.startswith("listening "), line
    return p, int(line.rsplit(":", 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvbm", default=os.path.join(ROOT, "target", "release", "kvbm"))
    ap.add_argument("--delays", default="0,50,200,500")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--half-broken", action="store_true")
    ap.add_argument("--framework", default="vllm")
    ap.add_argument("--load", default="", help="spin:K (K busy processes while measuring)")
    ap.add_argument("--replay-args", default="--workload shared-prefix --seed 3 --host-blocks 512 --disk-blocks 0")
    ap.add_argument("--pace", action="store_true", help="kvbm replay --pace (steps take their simulated time)")
    a = ap.parse_args()
    if a.pace:
        a.replay_args += " --pace"
    work = tempfile.mkdtemp(prefix="kvbm-slow-store-")
    port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", work], stdout=subprocess.DEVNULL)
    procs = [redis]
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    arms = [("none", None), ("redis", f"redis://127.0.0.1:{port}")]
    for d in [float(x) for x in a.delays.split(",") if x]:
        p, pp = start_proxy(port, d)
        procs.append(p)
        arms.append((f"proxy {d:g} ms", f"redis://127.0.0.1:{pp}"))
    if a.half_broken:
        p, pp = start_proxy(port, 0, stall_over=4096)
        procs.append(p)
        arms.append(("half-broken", f"redis://127.0.0.1:{pp}"))
    if a.load.startswith("spin:"):
        for _ in range(int(a.load.split(":")[1])):
            procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"CPU: {cpu}; load before: {os.getloadavg()[0]:.2f}; framework {a.framework}; {a.replay_args}")
    results = {name: [] for name, _ in arms}
    states = {name: set() for name, _ in arms}
    try:
        for r in range(a.rounds):
            for name, url in arms:
                subprocess.run(["redis-cli", "-p", str(port), "flushall"], check=True,
                               stdout=subprocess.DEVNULL)
                report = os.path.join(work, "report.json")
                cmd = [a.kvbm, "replay", "--framework", a.framework, *a.replay_args.split(),
                       "--disk-dir", os.path.join(work, "disk"), "--report", report]
                if url:
                    cmd += ["--remote-url", url]
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if out.returncode != 0:
                    sys.exit(f"{name}: kvbm replay failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
                s = json.load(open(report))["summary"]
                assert s["integrity_errors"] == 0, s
                results[name].append((s["serve_s"], s["wall_s"]))
                if s.get("remote"):
                    states[name].add(s["remote"]["state"])
        base = statistics.median(x[0] for x in results["none"])
        print(f"{'arm':<16} {'serve min/med/max s':>24} {'wall med s':>11} {'serve/none':>11}  store state")
        for name, _ in arms:
            serve = [x[0] for x in results[name]]
            wall = statistics.median(x[1] for x in results[name])
            med = statistics.median(serve)
            print(f"{name:<16} {min(serve):>8.2f}/{med:>6.2f}/{max(serve):>6.2f} {wall:>11.2f} "
                  f"{med / base:>11.2f}  {','.join(sorted(states[name])) or '-'}")
        print(f"load after: {os.getloadavg()[0]:.2f}")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
