#!/usr/bin/env bash
# One-command test: ruff; vLLM's own prefix-caching suite with and without the
# lease-carrying block pool (identical pass sets); then pytest (everything not
# marked slow; pass -m slow for the long runs). pytest's exit code 5 (no tests
# collected) counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check . || exit 1
if [ "$#" -eq 0 ]; then
  ./scripts/vllm_compat.sh || exit 1
fi
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi
exit "$rc"
