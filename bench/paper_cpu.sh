#!/usr/bin/env bash
# The spec's three comparisons on this machine at the `cpu` profile:
#   controlled cohort-8 on 5 seeds, web-burst on 3, captured on 3;
#   every policy plus the infinite-cache reference.
# Opt-in: --workload controlled-c16 runs the spec's cohort-16 row (seeds 1-3;
#   FIFO, LADS and the infinite cache unless --policies says otherwise).
# Resumable (finished runs are read back from bench/results/cpu) and selectable:
#   bench/paper_cpu.sh [--workload controlled|web-burst|captured] [--policies a,b] [--seeds 1,2]
#                      [--kv-blocks N]   (OUT=dir to write elsewhere)
# Writes run JSON, the comparison table (markdown) and plots under bench/results/cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/cpu}
POLICIES=fifo,size-first,tail-release,cache-first,cache-first-noleases,turnover-off,lads,infinite-cache
POLICIES_GIVEN=""
ONLY=""
SEEDS=""
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --workload) ONLY=$2; shift 2 ;;
    --policies) POLICIES=$2; POLICIES_GIVEN=1; shift 2 ;;
    --seeds) SEEDS=$2; shift 2 ;;
    --kv-blocks) EXTRA=(--kv-blocks "$2"); shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
compare() {  # workload default-seeds [extra args]
  local wl=$1 seeds=${SEEDS:-$2}; shift 2
  [ -z "$ONLY" ] || [ "$ONLY" = "$wl" ] || return 0
  .venv/bin/ladsd compare --profile cpu --workload "$wl" --seeds "$seeds" \
    --policies "$POLICIES" --out "$OUT" "${EXTRA[@]}" "$@"
}
compare controlled 1,2,3,4,5 --cohort 8
compare web-burst 1,2,3
compare captured 1,2,3
if [ "$ONLY" = "controlled-c16" ]; then
  [ -n "$POLICIES_GIVEN" ] || POLICIES=fifo,lads,infinite-cache
  ONLY="" compare controlled 1,2,3 --cohort 16  # ONLY cleared for this call only
fi
