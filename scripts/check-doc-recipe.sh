#!/usr/bin/env bash
# Runs docs/python.md's "Tests" recipe as written, as a newcomer would: the first ```bash block
# under its "## Tests" heading, in a fresh copy of the tracked files (so its `.venv` and the
# `_kvbm` module `maturin develop` puts in python/kvbm_connector/ land there, not here), with a
# fresh venv, outside CI (without CI=true the vLLM and Redis tests skip, as the doc says). Fails
# when the recipe fails, or when the doc has no such block. .ci/run calls it after scripts/test.sh.
#
# CARGO_TARGET_DIR (default: this checkout's target/) is shared, so `maturin develop` reuses the
# dependencies scripts/test.sh compiled. Needs python3 with venv and network access to PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

recipe=$(awk '
  /^## Tests[[:space:]]*$/ { in_tests = 1; next }
  in_tests && /^## / { exit }
  in_tests && /^```bash[[:space:]]*$/ { in_block = 1; next }
  in_block && /^```[[:space:]]*$/ { exit }
  in_block { print }
' docs/python.md)
if [ -z "$recipe" ]; then
  echo "docs/python.md has no \`\`\`bash block under '## Tests'" >&2
  exit 1
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/kvbm-recipe.XXXXXX")
trap 'rm -rf "$work"' EXIT
git ls-files -z | xargs -0 cp --parents -t "$work"
echo "=== docs/python.md's test recipe, in $work:"
printf '%s\n' "$recipe"

cd "$work"
# A newcomer's shell: no CI, none of scripts/test.sh's test servers or venvs.
env -u CI -u VIRTUAL_ENV $(env | sed -n 's/^\(KVBM_TEST_[A-Z_]*\)=.*/-u \1/p') \
  CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}" PYTHONDONTWRITEBYTECODE=1 \
  bash -euo pipefail -c "$recipe"
echo "=== the recipe passed"
