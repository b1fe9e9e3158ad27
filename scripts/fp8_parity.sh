#!/usr/bin/env bash
# Loss parity of the FP8 recipes against bf16 on the GPU toy config (docs/PERF.md, FP8 loss parity):
# `flowmoe parity` on configs/gpu_moe.yaml as shipped (its warmup and schedule) for STEPS (default
# 500) steps in each recipe on the same data and seed; the report is $out/parity/parity.json and
# parity.png (docs/TRAINING.md, Loss parity). Then each run's MoE load balance after warmup
# (scripts/load_balance.py).
#   scripts/fp8_parity.sh [build_dir]         logs and runs go to $OUT if set, else ./out
#   STEPS=500 RECIPES="bf16 fp8_blockwise fp8_flow" EXTRA="--set train.recompute=[moe_expert]" scripts/fp8_parity.sh
#   CONTROL=1 scripts/fp8_parity.sh           also a bf16 run with AdamW eps 2e-8 instead of 1e-8: the
#                                             run-to-run noise floor the FP8 deviations are read against
#   THRESHOLD=0.01                            the largest relative EMA error after warmup that passes
#                                             (default 1%, the tolerance this script has always used)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
build="${1:-${BUILD_DIR:-build-gpu}}"
out="${OUT:-out}"
recipes="${RECIPES:-bf16 fp8_blockwise fp8_flow}"
mkdir -p "$out"
control=()
[ -n "${CONTROL:-}" ] && control=(--control eps)
# shellcheck disable=SC2086
"$build/flowmoe" parity --config configs/gpu_moe.yaml --out "$out/parity" --recipes "${recipes// /,}" \
  --steps "${STEPS:-500}" --threshold "${THRESHOLD:-0.01}" "${control[@]}" \
  --set train.eval_every=0 --set checkpoint.every=0 --set logging.progress=plain --set logging.log_every=100 \
  ${EXTRA:-} >"$out/parity.log" 2>&1
rc=$?
grep -E '^(parity:|.* vs .*: max EMA rel err|casts per MoE layer)' "$out/parity.log"
[ $rc -ne 0 ] && [ $rc -ne 1 ] && tail -20 "$out/parity.log"
# The final checkpoints are only kept for --resume: gpu_moe's is 1.2 GB a run.
rm -rf "$out"/parity/*/checkpoints
runs=$(ls -d "$out"/parity/*/ 2>/dev/null)
# shellcheck disable=SC2086
[ -n "$runs" ] && python3 scripts/load_balance.py --after warmup $runs | grep 'worst layer' | sed 's/^/load /'
exit $rc
