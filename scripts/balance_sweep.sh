#!/usr/bin/env bash
# MoE load-balance sweep on the GPU toy config: trains configs/gpu_moe.yaml once per variant, JOBS
# runs at a time on one GPU (the toy model leaves most of an H100/H200 idle), then prints each run's
# balance after warmup (scripts/load_balance.py). This is how docs/PERF.md's "MoE load balance" table
# is measured.
#   scripts/balance_sweep.sh VARIANTS [build_dir]
# VARIANTS is a file with one variant per line: a name, then the --set overrides of that variant
# (blank lines and # comments skipped), e.g.
#   shipped
#   alpha_0.02   --set model.aux_loss_alpha=0.02
#   flow         --set precision.recipe=fp8_flow
# Logs and runs go to $OUT if set, else ./out; STEPS (default 500), JOBS (default 4) and CONFIG
# (default configs/gpu_moe.yaml).
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/train_run.sh
. scripts/train_run.sh
variants="${1:?usage: scripts/balance_sweep.sh VARIANTS [build_dir]}"
build="${2:-${BUILD_DIR:-build-gpu}}"
out="${OUT:-out}"
steps="${STEPS:-500}"
jobs_max="${JOBS:-4}"
config="${CONFIG:-configs/gpu_moe.yaml}"
[ -r "$variants" ] || { echo "balance_sweep: cannot read $variants"; exit 2; }
mkdir -p "$out"
names=()
while read -r name args; do
  case "$name" in "" | \#*) continue ;; esac
  names+=("$name")
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; done
  # shellcheck disable=SC2086
  train_run "$build" "$config" "$out/balance_$name" "$out/balance_$name.log" --set train.steps="$steps" $args &
done <"$variants"
wait
rc=0
for name in "${names[@]}"; do
  log="$out/balance_$name.log"
  if ! grep -qE '^done:' "$log"; then
    echo "$name: FAILED"; tail -5 "$log"; rc=1; continue
  fi
  echo "$name: $(grep -E '^done:' "$log" | tail -1)"
  python3 scripts/load_balance.py --after warmup "$out/balance_$name" | sed "s|^$out/balance_||"
done
exit $rc
