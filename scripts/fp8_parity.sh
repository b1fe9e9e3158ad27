#!/usr/bin/env bash
# Loss parity of the FP8 recipes against bf16 on the GPU toy config (docs/PERF.md, FP8 loss parity):
# trains configs/gpu_moe.yaml as shipped (its warmup and schedule) for STEPS (default 500) steps in
# each recipe on the same data and seed, compares every recipe's loss curve with bf16's
# (scripts/compare_runs.py) and prints each run's MoE load balance after warmup (scripts/load_balance.py).
#   scripts/fp8_parity.sh [build_dir]         logs and runs go to $OUT if set, else ./out
#   STEPS=500 RECIPES="bf16 fp8_blockwise fp8_flow" EXTRA="--set train.recompute=[moe_expert]" scripts/fp8_parity.sh
#   CONTROL=1 scripts/fp8_parity.sh           also a bf16 run with AdamW eps 2e-8 instead of 1e-8: the
#                                             run-to-run noise floor the FP8 deviations are read against
set -uo pipefail
cd "$(dirname "$0")/.."
build="${1:-${BUILD_DIR:-build-gpu}}"
out="${OUT:-out}"
steps="${STEPS:-500}"
recipes="${RECIPES:-bf16 fp8_blockwise fp8_flow}"
mkdir -p "$out"
rc=0
runs=""
# shellcheck source=scripts/train_run.sh
. scripts/train_run.sh
# parity_run NAME RECIPE [ARGS...]: one STEPS-step run into $out/parity_NAME, its summary line and casts.
parity_run() {
  local name=$1 recipe=$2
  shift 2
  # shellcheck disable=SC2086
  if train_run "$build" configs/gpu_moe.yaml "$out/parity_$name" "$out/parity_$name.log" \
       --set precision.recipe="$recipe" --set train.steps="$steps" "$@" ${EXTRA:-}; then
    echo "parity $name: $(grep -E '^done:' "$out/parity_$name.log" | tail -1)"
    grep -E '^casts per MoE layer' "$out/parity_$name.log" | tail -1
  else
    rc=1
    echo "parity $name: FAILED"
    tail -20 "$out/parity_$name.log"
  fi
  runs="$runs $out/parity_$name"
}
for r in $recipes; do parity_run "$r" "$r"; done
[ -n "${CONTROL:-}" ] && parity_run control bf16 --set optimizer.eps=2e-8
# shellcheck disable=SC2086
python3 scripts/compare_runs.py --tolerance 0.01 $runs || rc=1
# shellcheck disable=SC2086
python3 scripts/load_balance.py --after warmup $runs | grep 'worst layer' | sed 's/^/load /'
exit $rc
