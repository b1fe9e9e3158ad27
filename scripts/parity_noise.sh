#!/usr/bin/env bash
# How the parity study's noise floor depends on the tokens per step and on the EMA's span: for each
# global batch in BATCHES, one `flowmoe parity` of bf16 against CANDIDATE with CONTROLS controls,
# trained once; then its report again for each alpha in ALPHAS (--resume keeps the finished runs, so
# only the report is recomputed). Prints one "noise ..." line per (batch, alpha) and writes
# OUT_DIR/noise.md: tokens per step, the controls' largest and mean EMA relative error after warmup
# (the worst control's), and the candidate's. The study that wants controls under 0.1% picks its
# batch and alpha from this table (docs/PARITY.md).
#   scripts/parity_noise.sh BUILD_DIR CONFIG OUT_DIR
#   BATCHES (default: the config's train.batch_size), ALPHAS ("0.9 0.97 0.99"), CONTROLS (3), CONTROL
#   (eps: the same batches, so the band is the recipe's noise; data compares other batches at each step, whose
#   spread is far larger), CANDIDATE (fp8_flow), STEPS (the config's), NP (1: one process; N: mpirun -np N, a
#   GPU per rank), EXTRA (more flowmoe parity arguments, e.g. "--set train.device=cpu"), TIMEOUT (3000 s a study)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
usage="usage: scripts/parity_noise.sh BUILD_DIR CONFIG OUT_DIR"
build=${1:?$usage}
config=${2:?$usage}
out=${3:?$usage}
mkdir -p "$out"
# shellcheck source=scripts/multi_gpu_env.sh
. scripts/multi_gpu_env.sh
np=${NP:-1}
launch=(timeout -k "$kill_after" "${TIMEOUT:-3000}")
[ "$np" -gt 1 ] && launch+=(mpirun --oversubscribe --bind-to none -np "$np")
# shellcheck disable=SC2086
resolved=$("$build/flowmoe" train --config "$config" ${EXTRA:-} --print-config)
batches=${BATCHES:-$(config_value "$resolved" train batch_size)}
seq_len=$(config_value "$resolved" data seq_len)
steps=()
[ -n "${STEPS:-}" ] && steps=(--steps "$STEPS")
echo "| global batch | tokens per step | EMA alpha | controls: max EMA err | controls: mean | ${CANDIDATE:-fp8_flow}: max | mean |" \
  >"$out/noise.md"
echo "| --- | --- | --- | --- | --- | --- | --- |" >>"$out/noise.md"
rc=0
for batch in $batches; do
  dir="$out/batch$batch"
  resume=()
  for alpha in ${ALPHAS:-0.9 0.97 0.99}; do
    # shellcheck disable=SC2086
    "${launch[@]}" "$build/flowmoe" parity --config "$config" --out "$dir" --recipes "bf16,${CANDIDATE:-fp8_flow}" \
      --controls "${CONTROLS:-3}" --control "${CONTROL:-eps}" --ema-alpha "$alpha" "${steps[@]}" "${resume[@]}" \
      --set train.batch_size="$batch" --set logging.progress=plain ${EXTRA:-} >"$dir.alpha$alpha.log" 2>&1
    status=$?
    resume=(--resume)
    # 0, 1 and 4 are verdicts; anything else is a failed study.
    if [ "$status" -ne 0 ] && [ "$status" -ne 1 ] && [ "$status" -ne 4 ]; then
      echo "noise batch $batch alpha $alpha: FAILED (exit $status, see $dir.alpha$alpha.log)"
      rc=1
      break
    fi
    python3 - "$dir/parity.json" "$batch" "$seq_len" "$alpha" "$out/noise.md" <<'PY'
import json, sys
path, batch, seq_len, alpha, table = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
j = json.load(open(path))
controls = [c for c in j["candidates"] if c["control"]]
cands = [c for c in j["candidates"] if not c["control"]]
pct = lambda x: "-" if x is None else "%.3f%%" % (100 * x)
cmax = max((c["max_rel_err"] for c in controls if c["max_rel_err"] is not None), default=None)
cmean = max((c["mean_rel_err"] for c in controls if c["mean_rel_err"] is not None), default=None)
c = cands[0]
print("noise batch %d (%d tokens per step) alpha %s: controls max %s mean %s, %s max %s mean %s"
      % (batch, batch * seq_len, alpha, pct(cmax), pct(cmean), c["name"], pct(c["max_rel_err"]), pct(c["mean_rel_err"])))
with open(table, "a") as f:
    f.write("| %d | %d | %s | %s | %s | %s | %s |\n" % (batch, batch * seq_len, alpha, pct(cmax), pct(cmean),
                                                       pct(c["max_rel_err"]), pct(c["mean_rel_err"])))
PY
  done
done
exit $rc
