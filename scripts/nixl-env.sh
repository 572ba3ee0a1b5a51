#!/usr/bin/env bash
# Sets up NIXL for the `nixl` feature (backends/nixl.rs), idempotently:
#   * installs libclang-dev (bindgen, for building nixl-sys) when it is missing;
#   * downloads the PyPI wheel `nixl-cu12` once (no dependencies, no torch) into a cache folder and
#     unpacks it there: it ships libnixl_capi.so and the POSIX and UCX plugins;
#   * exports LD_LIBRARY_PATH (the wheel's library folder first) and NIXL_PLUGIN_DIR.
#
# Source it to get the variables in your shell:   source scripts/nixl-env.sh
# Run it to see what it set up:                   bash scripts/nixl-env.sh
#
# Settings (environment):
#   KVBM_NIXL_CACHE    cache folder; default $HOME/.cache/kvbm/nixl
#   KVBM_NIXL_WHEEL    wheel to fetch; default nixl-cu12==1.5.1 (the C API nixl-sys 1.5 binds)
#   KVBM_NIXL_PIP_TAGS wheel tags asked of pip; default CPython 3.11, manylinux_2_28, this
#                      machine's architecture (only the wheel's C libraries are used, so the
#                      local Python's version does not matter)
#   KVBM_NIXL_NO_APT=1 never call apt-get (then libclang-dev must already be there)
#
# It installs no RDMA library. On a host with the system's (libibverbs1, ibverbs-providers), a UCX
# backend runs without UCX's InfiniBand modules unless asked: see docs/nixl.md, "RDMA hosts".
#
# A second run with a filled cache touches no network. Failures print what failed and return 1
# (a sourcing shell is not exited).

_kvbm_nixl_setup() {
  local cache="${KVBM_NIXL_CACHE:-${HOME:-/root}/.cache/kvbm/nixl}"
  local wheel_req="${KVBM_NIXL_WHEEL:-nixl-cu12==1.5.1}"
  local tag
  tag="$(printf '%s' "$wheel_req" | tr -c 'A-Za-z0-9._-' '_')"
  local root="$cache/$tag"
  local libs="$root/.nixl_cu12.mesonpy.libs"

  # 1. libclang for bindgen (nixl-sys's build script).
  if ! ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/x86_64-linux-gnu/libclang*.so* >/dev/null 2>&1; then
    if [ "${KVBM_NIXL_NO_APT:-0}" = 1 ]; then
      echo "nixl-env: libclang (libclang-dev) is missing and KVBM_NIXL_NO_APT=1" >&2
      return 1
    fi
    echo "nixl-env: installing libclang-dev (bindgen needs it)" >&2
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq libclang-dev; } >&2 \
      || { echo "nixl-env: apt-get install libclang-dev failed" >&2; return 1; }
  fi

  # 2. The wheel, once.
  if [ ! -f "$root/.complete" ]; then
    local py
    py="$(command -v python3 || command -v python || true)"
    if [ -z "$py" ]; then
      echo "nixl-env: python3 (for pip download) not found" >&2
      return 1
    fi
    mkdir -p "$cache" || return 1
    local tmp
    tmp="$(mktemp -d "$cache/.download.XXXXXX")" || return 1
    echo "nixl-env: downloading $wheel_req into $cache (once)" >&2
    local tags="${KVBM_NIXL_PIP_TAGS:---python-version 3.11 --implementation cp --abi cp311 --platform manylinux_2_28_$(uname -m)}"
    # shellcheck disable=SC2086 # the tags are words on purpose
    if ! "$py" -m pip download --quiet --no-deps --only-binary=:all: $tags "$wheel_req" -d "$tmp/wheel" >&2; then
      echo "nixl-env: pip download $wheel_req failed" >&2
      rm -rf "$tmp"
      return 1
    fi
    local whl
    whl="$(ls "$tmp"/wheel/*.whl 2>/dev/null | head -n1)"
    mkdir -p "$tmp/unpacked"
    # unzip when present, else Python's zipfile (always there with pip).
    if command -v unzip >/dev/null 2>&1; then
      unzip -q -o "$whl" -d "$tmp/unpacked" || { rm -rf "$tmp"; return 1; }
    else
      "$py" -m zipfile -e "$whl" "$tmp/unpacked" || { rm -rf "$tmp"; return 1; }
    fi
    if [ ! -f "$tmp/unpacked/.nixl_cu12.mesonpy.libs/libnixl_capi.so" ]; then
      echo "nixl-env: $whl has no .nixl_cu12.mesonpy.libs/libnixl_capi.so" >&2
      rm -rf "$tmp"
      return 1
    fi
    rm -rf "$root"
    mv "$tmp/unpacked" "$root" && basename "$whl" > "$root/.complete"
    rm -rf "$tmp"
  fi

  local f
  for f in libnixl_capi.so plugins/libplugin_POSIX.so plugins/libplugin_UCX.so; do
    if [ ! -f "$libs/$f" ]; then
      echo "nixl-env: $libs/$f is missing (delete $root to download again)" >&2
      return 1
    fi
  done

  # 3. The variables.
  case ":${LD_LIBRARY_PATH:-}:" in
    *":$libs:"*) ;;
    *) export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
  esac
  export NIXL_PLUGIN_DIR="$libs/plugins"
  echo "nixl-env: $(cat "$root/.complete")" >&2
  echo "export LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  echo "export NIXL_PLUGIN_DIR=$NIXL_PLUGIN_DIR"
}

if (return 0 2>/dev/null); then
  _kvbm_nixl_setup
else
  set -euo pipefail
  _kvbm_nixl_setup
fi
