#!/usr/bin/env bash
# Paper profile on one NVIDIA GPU (Qwen2.5-7B shape, dummy weights): controlled
# cohort-8, one seed, FIFO vs LADS. Finishes inside 10 minutes on an H100/H200
# class GPU; prints the comparison and, last, one JSON line.
# Needs: ./scripts/install.sh done on that machine (vllm==0.32.0) and the
# prepared model folder in $LADSD_HOME (the tokenizer of the shape profile).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
SEED=${SEED:-1}
nvidia-smi -L
timeout 560 .venv/bin/ladsd compare --profile paper --workload controlled --cohort 8 \
  --seeds "$SEED" --policies fifo,lads --out "$OUT" --no-resume
.venv/bin/python - "$OUT" "$SEED" <<'PY'
import json, sys
from pathlib import Path
from ladsd.metrics import events, summary
out, seed = Path(sys.argv[1]), int(sys.argv[2])
runs = {p: events.load(out / f"controlled-c8-paper-{p}-s{seed}.json") for p in ("fifo", "lads")}
m = {p: summary.mean_latency(r) for p, r in runs.items()}
print(json.dumps({"profile": "paper", "workload": "controlled-c8", "seed": seed,
                  "fifo_mean_s": m["fifo"], "lads_mean_s": m["lads"],
                  "reduction_pct": summary.reduction(m["fifo"], m["lads"]),
                  "machine": runs["lads"].meta.get("machine")}))
PY
