#!/usr/bin/env bash
# Loss parity of the FP8 recipes against bf16 on the GPU toy config (FP8 issue, "Done when"):
# trains configs/gpu_moe.yaml for STEPS (default 500) steps in each recipe on the same data and seed,
# then compares every recipe's loss curve with bf16's (scripts/compare_runs.py).
#   scripts/fp8_parity.sh [build_dir]         logs and runs go to $OUT (device tool) or ./out
#   STEPS=500 RECIPES="bf16 fp8_blockwise fp8_flow" EXTRA="--set train.recompute=[moe_expert]" scripts/fp8_parity.sh
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
       --set optimizer.warmup_steps=$(( steps / 10 )) --set train.eval_every=0 --set checkpoint.every=0 \
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
runs=""
for r in $recipes; do runs="$runs $out/parity_$r"; done
# shellcheck disable=SC2086
python3 scripts/compare_runs.py --tolerance 0.01 $runs || rc=1
exit $rc
