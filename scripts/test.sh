#!/usr/bin/env bash
# One-command test: ruff, then pytest (CI selection: everything not marked slow).
# pytest's exit code 5 (no tests collected) counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check . || exit 1
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 0 ] && [ "$#" -eq 0 ]; then
  # vLLM's own prefix-caching suite, with and without the lease-carrying pool.
  ./scripts/vllm_compat.sh || exit 1
fi
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi
exit "$rc"
