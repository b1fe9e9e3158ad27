#!/usr/bin/env bash
# Loss parity of the FP8 recipes against bf16 on the GPU toy config (FP8 issue, "Done when"):
# trains configs/gpu_moe.yaml as shipped (its warmup and schedule) for STEPS (default 500) steps in
# each recipe on the same data and seed, compares every recipe's loss curve with bf16's
# (scripts/compare_runs.py) and prints each run's MoE load balance after warmup (scripts/load_balance.py).
#   scripts/fp8_parity.sh [build_dir]         logs and runs go to $OUT (device tool) or ./out
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
for r in $recipes; do
  # shellcheck disable=SC2086
  if "$build/flowmoe" train --config configs/gpu_moe.yaml --set precision.recipe="$r" --set train.steps="$steps" \
       --set train.eval_every=0 --set checkpoint.every=0 \
       --set logging.progress=plain --set logging.log_every=100 --set logging.out_dir="$out/parity_$r" ${EXTRA:-} \
       >"$out/parity_$r.log" 2>&1; then
    echo "parity $r: $(grep -E '^done:' "$out/parity_$r.log" | tail -1)"
    grep -E '^casts per MoE layer' "$out/parity_$r.log" | tail -1
  else
    rc=1
    echo "parity $r: FAILED"
    tail -20 "$out/parity_$r.log"
  fi
done
if [ -n "${CONTROL:-}" ]; then
  # shellcheck disable=SC2086
  "$build/flowmoe" train --config configs/gpu_moe.yaml --set precision.recipe=bf16 --set train.steps="$steps" \
    --set train.eval_every=0 --set checkpoint.every=0 --set logging.progress=plain --set logging.log_every=100 \
    --set logging.out_dir="$out/parity_control" --set optimizer.eps=2e-8 ${EXTRA:-} >"$out/parity_control.log" 2>&1 ||
    { rc=1; echo "parity control: FAILED"; }
fi
runs=""
for r in $recipes; do runs="$runs $out/parity_$r"; done
[ -n "${CONTROL:-}" ] && runs="$runs $out/parity_control"
# shellcheck disable=SC2086
python3 scripts/compare_runs.py --tolerance 0.01 $runs || rc=1
warmup=$(sed -n 's/^ *warmup_steps: *\([0-9]*\).*/\1/p' configs/gpu_moe.yaml | head -1)
# shellcheck disable=SC2086
python3 scripts/load_balance.py --after "${warmup:-0}" $runs | grep 'worst layer' | sed 's/^/load /'
exit $rc
