#!/usr/bin/env bash
# The spec's comparisons on this machine at the `cpu` profile (1/4 token scale):
#   controlled cohort-8 on 5 seeds, cohort-16 on 3, web-burst on 3, captured on 3,
#   captured-scaled on 3 at its calibrated pool (CAPTURED_POOL blocks; README, Results);
#   every policy plus the infinite-cache reference; FIFO, Cache-first, LADS and the
#   infinite cache twice per seed (their repeats are the A/A noise floor), the
#   others once; each (seed, repeat) block in a rotated policy order.
# Resumable: finished runs are read back from OUT (default bench/results/cpu-quarter)
# after checking that they were made with the same configuration.
# One link dilation for the whole pass: the first compare that runs anything measures
# kappa once (a probe engine start) and writes OUT/dilation.json; every other compare
# (and a resume) uses that one, and every run scales its link rate and time constants
# by it (docs/profiles.md). --dilation D sets it instead of measuring.
# A fresh OUT (no run files yet) first checks the calibration on this CPU at the pass's
# dtype (bench/calibrate.py, seed 1, ~2 min; OUT/calibration.json): whether the regime's
# two ratios land in the spec's band here at the dilation a pass measures. Never stops.
# --dtype D runs the engine in D (the cpu profile's own is float32; docs/profiles.md).
#   bench/paper_cpu.sh [--workload controlled|controlled-c16|web-burst|captured|captured-scaled]
#                      [--policies a,b] [--seeds 1,2] [--repeats N] [--kv-blocks N]
#                      [--profile NAME] [--peers] [--dilation D] [--dtype D]
#                      (OUT=dir to write elsewhere)
#   --peers adds the neighbouring designs (augserve, hear-*, ttl-pin, augserve+lads;
#   README, Peers) to every workload, cohort-16 too (issue 23's must-show asks for
#   them everywhere; before 2026-12-03 cohort-16 ran none).
# The earlier 1/8-scale results re-render (nothing runs) with
#   OUT=bench/results/cpu-eighth bench/paper_cpu.sh --profile cpu-eighth --repeats 1
#   (and --workload controlled-c16 --policies fifo,lads,infinite-cache for their c16 row).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/cpu-quarter}
PROFILE=cpu
# The tables' eight, from the one policy registry (ladsd/delivery/registry.py).
EIGHT=$(.venv/bin/python -c 'from ladsd.delivery.registry import PAPER; print(",".join(PAPER))')
POLICIES=""
ONLY=""
SEEDS=""
REPEATS=2
EXTRA=()
PEERS=()
DILATION=()
DTYPE=()
while [ $# -gt 0 ]; do
  case "$1" in
    --workload) ONLY=$2; shift 2 ;;
    --policies) POLICIES=$2; shift 2 ;;
    --seeds) SEEDS=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    --profile) PROFILE=$2; shift 2 ;;
    --kv-blocks) EXTRA=(--kv-blocks "$2"); shift 2 ;;
    --peers) PEERS=(--peers); shift ;;
    --dilation) DILATION=(--dilation "$2"); shift 2 ;;
    --dtype) DTYPE=(--dtype "$2"); shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
# The earlier 1/8-scale runs had the eight policies; lads-denial (an ablation) and
# lads-adaptive (the paper's LADS with three rules of ours) came later.
[ -n "$POLICIES" ] || { [ "$PROFILE" = cpu-eighth ] && POLICIES=$EIGHT || POLICIES=$EIGHT,lads-denial,lads-adaptive; }
if ! compgen -G "$OUT/*-s*.json" > /dev/null; then
  mkdir -p "$OUT"
  .venv/bin/python bench/calibrate.py --profile "$PROFILE" --seed 1 "${DTYPE[@]}" \
    --json "$OUT/calibration.json" | grep -v '^{' || true
fi
compare() {  # name workload default-seeds [extra args]
  local name=$1 wl=$2 seeds=${SEEDS:-$3}; shift 3
  [ -z "$ONLY" ] || [ "$ONLY" = "$name" ] || return 0
  .venv/bin/ladsd compare --profile "$PROFILE" --workload "$wl" --seeds "$seeds" \
    --policies "$POLICIES" --repeats "$REPEATS" --out "$OUT" "${EXTRA[@]}" "${DILATION[@]}" "${DTYPE[@]}" "$@"
}
compare controlled controlled 1,2,3,4,5 --cohort 8 "${PEERS[@]}"
compare controlled-c16 controlled 1,2,3 --cohort 16 "${PEERS[@]}"
compare web-burst web-burst 1,2,3 "${PEERS[@]}"
compare captured captured 1,2,3 "${PEERS[@]}"
# The pool rule leaves captured-scaled on the thrash side of a cliff (README, Results):
# its pool is the seed-1 calibration's unless --kv-blocks says otherwise.
[ ${#EXTRA[@]} -gt 0 ] || EXTRA=(--kv-blocks "${CAPTURED_POOL:-2300}")
compare captured-scaled captured-scaled 1,2,3 "${PEERS[@]}"
