#!/usr/bin/env bash
# The CUDA backend's GPU check (issue 8), one script, under 6 minutes on one H200:
#
#   1. build with `--features cuda` (release): the `kvbm` binary and the tests/cuda.rs binary;
#   2. run the CUDA tests with KVBM_REQUIRE_GPU=1, so a missing or unusable GPU fails them instead
#      of skipping: round trips device <-> pinned/pageable host in every layout (bytes verified),
#      merging of adjacent runs, store gating on an engine event, disk <-> device through the
#      pinned bounce, and the connector (leader + worker) offloading and onboarding through a GPU
#      device tier with every onboarded block verified;
#   3. `kvbm bench --cuda`: device <-> pinned host against one plain cuMemcpy of the same bytes
#      (contiguous D2H and H2D: target ratio >= 0.9), layer-separate gather and scatter, scattered
#      blocks, and the transfer engine with its default batches.
#
#   4. `kvbm replay --device cuda` for both engines: the replay's device cache in GPU memory, a
#      pinned host tier, every onboarded block verified (integrity errors must be 0).
#
# Usage:
#   scripts/gpu-check.sh               build here (needs the crates: network or a warm cargo
#                                      cache), then run
#   scripts/gpu-check.sh --build-only  build and stage the binaries in target/gpu-check/ (no GPU
#                                      needed), e.g. on a machine with network
#   scripts/gpu-check.sh --prebuilt    run the binaries staged in target/gpu-check/ (a GPU machine
#                                      without network; about 30 s)
# Environment: KVBM_CUDA_DEVICE (GPU ordinal, default 0); KVBM_GPU_CHECK_MIN_RATIO (default 0.9).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-all}
case "$mode" in all | --build-only | --prebuilt) ;; *)
  echo "usage: $0 [--build-only | --prebuilt]" >&2
  exit 2
  ;;
esac
stage=target/gpu-check
gpu=${KVBM_CUDA_DEVICE:-0}
min_ratio=${KVBM_GPU_CHECK_MIN_RATIO:-0.9}
start=$(date +%s)
step() { echo; echo "=== $* ($(($(date +%s) - start))s)"; }

build() {
  mkdir -p "$stage"
  step "build: kvbm (release, --features cuda)"
  timeout 300 cargo build --release --features cuda --bin kvbm
  step "build: tests/cuda.rs (release, --features cuda)"
  timeout 240 cargo test --release --features cuda --test cuda --no-run 2>&1 | tee "$stage/build.log"
  local test_bin
  test_bin=$(sed -n 's/.*Executable tests\/cuda\.rs (\(.*\))$/\1/p' "$stage/build.log" | tail -n 1)
  if [ -z "$test_bin" ] || [ ! -x "$test_bin" ]; then
    echo "could not find the tests/cuda.rs binary in the cargo output" >&2
    exit 1
  fi
  cp "$test_bin" "$stage/cuda-tests"
  cp target/release/kvbm "$stage/kvbm"
  echo "staged: $stage/kvbm $stage/cuda-tests"
}

run() {
  for f in kvbm cuda-tests; do
    if [ ! -x "$stage/$f" ]; then
      echo "$stage/$f is missing: run $0 --build-only first" >&2
      exit 1
    fi
  done
  step "GPU"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
      --format=csv || true
  else
    echo "(nvidia-smi not found; the probe below reports what the driver says)"
  fi

  step "CUDA tests on GPU $gpu (KVBM_REQUIRE_GPU=1: no GPU is a failure here)"
  # The probe's line (driver, GPUs) is printed past the capture; failures show their output.
  KVBM_REQUIRE_GPU=1 KVBM_CUDA_DEVICE="$gpu" timeout 180 "$stage/cuda-tests" --test-threads 4

  step "replay with a GPU device tier (both engines; integrity errors must be 0)"
  local rdir
  rdir=$(mktemp -d)
  for fw in trtllm vllm; do
    # exit 1 on any integrity error, 2 on any other failure
    KVBM_DISK_CACHE_DIR="$rdir" timeout 120 "$stage/kvbm" replay --device cuda --framework "$fw" \
      --report "$rdir/replay-$fw.json"
  done
  rm -rf "$rdir"

  step "kvbm bench --cuda (device <-> pinned host vs one plain cuMemcpy of the same bytes)"
  local tmp json
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  json="$stage/bench.json"
  # --blocks/--rounds keep the non-CUDA paths (memory, disk, leader) short; the CUDA paths move
  # 256 blocks of 2 MiB (512 MiB) per transfer.
  timeout 240 "$stage/kvbm" bench --cuda --cuda-device "$gpu" --cuda-blocks 256 --blocks 16 \
    --rounds 7 --dir "$tmp" --json >"$json"
  if command -v python3 >/dev/null; then
    python3 - "$json" "$min_ratio" <<'PY'
import json, sys
paths = json.load(open(sys.argv[1]))["paths"]
floor = float(sys.argv[2])
targets = {"device->pinned (contiguous)", "pinned->device (contiguous)"}
bad = []
print(f"{'path':<44} {'ours GB/s':>10} {'limit':>10} {'ratio':>7}")
for p in paths:
    mark = ""
    if p["path"] in targets:
        ok = p["ratio"] >= floor
        mark = "  target >= %.2f: %s" % (floor, "ok" if ok else "BELOW")
        if not ok:
            bad.append(p["path"])
    print(f"{p['path']:<44} {p['ours']:>10.2f} {p['limit']:>10.2f} {p['ratio']:>7.3f}{mark}")
    if p["path"].startswith(("device->", "pinned->")):
        print(f"{'':<44} {p['limit_source']}")
missing = targets - {p["path"] for p in paths}
if missing:
    sys.exit(f"bench did not report: {sorted(missing)}")
if bad:
    sys.exit(f"below the {floor} target: {bad}")
PY
  else
    cat "$json"
    echo "(python3 not found: ratios printed raw, not checked)"
  fi
  echo "bench JSON: $json"
}

case "$mode" in
--build-only) build ;;
--prebuilt) run ;;
all)
  build
  run
  ;;
esac
elapsed=$(($(date +%s) - start))
step "done in ${elapsed}s"
if [ "$elapsed" -gt 360 ]; then
  echo "over the 6-minute budget" >&2
  exit 1
fi
