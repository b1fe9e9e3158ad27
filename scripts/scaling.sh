#!/usr/bin/env bash
# Weak scaling on one machine's GPUs: the per-GPU batch held at each config's one-GPU batch, so N GPUs
# train N times the tokens per step. For each config and recipe, one run on one GPU (the baseline,
# from the same invocation), then at each size N: data parallelism (dp), expert parallelism over all N
# (ep_sync, ep_zero_sync), EP N/2 x DP 2 (epdp, at 4 and more), dp with a full optimizer copy on every
# rank (dp_unsharded: parallel.shard_optimizer=false), dp without the overlapped gradient reduction
# (dp_serial), dp with each block's attention half recomputed in backward (dp_recompute:
# train.recompute=attention, against the one-GPU run without it; dp_recompute_all: attention and
# moe_expert) and ep_zero_sync with the shared experts on the compute stream (ep_serial_shared:
# parallel.shared_expert_overlap=off), ep_chunks<C>[_sms<S>] (zero_sync in C token chunks whose exchanges
# overlap the experts, the grouped GEMMs leaving S SMs to them: parallel.exchange_chunks, exchange_sms) and
# ep_capacity<F> (zero_sync with receive buffers of F times an even load: parallel.ep_capacity_factor),
# ep_dual[_sms<S>] (zero_sync with the batch as two micro-batches against each other:
# parallel.dual_microbatch, the exchanges on S SMs). Prints one "scaling ..." line per run (scripts/gpu_check.sh
# puts them in its summary) and a Markdown table into OUT_DIR/scaling.md. Every launch has a time limit.
#   scripts/scaling.sh BUILD_DIR OUT_DIR
#   CONFIGS (default "gpu_moe gpu_moe_wide"), RECIPES ("bf16 fp8_flow"), SIZES (2, 4, 8: those the GPUs
#   allow), MODES ("dp ep_sync ep_zero_sync epdp dp_serial"), STEPS (30), PROFILE_STEP (STEPS - 5),
#   BACKEND (nccl), RUN_LIMIT_S (400: each run's time limit), STALL_S (120: a run that prints nothing for
#   that long is ended and reported as stalled), EXTRA_SETS (more --set arguments for every run: "--set train.device=cpu" with
#   BACKEND=mpi and a CPU config tries the script itself on a host without GPUs, GPUS=2 standing in
#   for the count)
# Per run:
#   tok/s/GPU    the median tokens/s of the steps after the first third, over N (the profiled step left out)
#   vs 1 GPU     that over the one-GPU run's: 1.00 is perfect weak scaling
#   exposed      communication the compute stream waited for in the profiled step (--profile): the
#                gradient sync's wait ("gradient sync"), the sharded optimizer's weight gather the forward
#                waited for ("weight gather") and the token exchange ("exchange", which runs on the
#                compute stream), as a share of that step's wall time
#   peak         peak tensor memory per GPU; host syncs per step
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=scripts/multi_gpu_env.sh
. scripts/multi_gpu_env.sh
take_build_and_out "scripts/scaling.sh BUILD_DIR OUT_DIR" "$@"
skip_below_two_gpus "scaling"
sizes=()
for n in 2 4 8; do [ "$n" -le "$ngpu" ] && sizes+=("$n"); done
[ -n "${SIZES:-}" ] && read -r -a sizes <<<"$SIZES"
steps=${STEPS:-30}
profile=${PROFILE_STEP:-$((steps - 5))}
rc=0
echo "| config | recipe | GPUs | layout | tok/s per GPU | vs 1 GPU | exposed comm | peak GiB/GPU | host syncs |" >"$out/scaling.md"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |" >>"$out/scaling.md"

# run NAME NP EP [--set ...]: one training run of STEPS steps (NP 1: a plain process), profiled at PROFILE_STEP.
run() {
  local name=$1 np=$2 ep=$3
  shift 3
  local cmd=("$build/flowmoe" train --config "$config" --profile "$profile" --set logging.out_dir="$out/$name"
             --set train.steps="$steps" --set optimizer.warmup_steps=3 --set train.eval_every=0
             --set checkpoint.every=0 --set checkpoint.final=false --set logging.progress=plain
             --set logging.log_every=10 --set precision.recipe="$recipe" ${EXTRA_SETS:-} "$@")
  if [ "$np" -eq 1 ]; then
    run_watched "$out/$name.log" "${RUN_LIMIT_S:-400}" "${STALL_S:-120}" "${cmd[@]}"
  else
    run_watched "$out/$name.log" "${RUN_LIMIT_S:-400}" "${STALL_S:-120}" \
      mpirun --oversubscribe --bind-to none -np "$np" "${cmd[@]}" --set parallel.backend="${BACKEND:-nccl}" \
      --set parallel.expert_parallel_size="$ep"
  fi
  local rc=$?
  # A rank that outlived its launcher's time limit would hold its GPU's memory through the next run.
  pkill -KILL -f "$build/flowmoe train" 2>/dev/null
  return $rc
}
# report NAME NP LAYOUT: the run's line and table row, against the one-GPU run's tok/s (BASE).
report() {
  python3 - "$out/$1" "$2" "$3" "$config_name" "$recipe" "${base:-0}" "$profile" "$out/scaling.md" "$out/$1.log" <<'PY'
import json, re, statistics, sys
d, np_, layout, cfg, recipe, base, prof, table, log = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], float(sys.argv[6]), int(sys.argv[7]), sys.argv[8], sys.argv[9]
# Steps whose exchange ran out of receive rows (parallel.ep_capacity_factor) and ran again.
reruns = sum("and the step runs again" in l for l in open(log, errors="replace"))
rows = [json.loads(l) for l in open(d + "/metrics.jsonl") if l.strip()]
late = [r for r in rows[len(rows) // 3:] if r["step"] != prof]
tps = statistics.median(r["tokens_per_s"] for r in late) / np_
wall, exposed = None, 0.0
try:
    text = open(d + "/profile.txt").read()
    wall = float(re.search(r"profile of step \d+ on \S+: ([0-9.]+) ms wall", text).group(1))
    for m in re.finditer(r"^\s+\S+\s+(gradient sync|weight gather|exchange)\s+\S+\s+\d+\s+([0-9.]+)", text, re.M):
        exposed += float(m.group(2))
except (OSError, AttributeError):
    pass
share = "%.1f%% (%.1f of %.1f ms)" % (100 * exposed / wall, exposed, wall) if wall else "-"
ratio = "%.2f" % (tps / base) if base > 0 else "1.00"
peak = max(r["peak_mem_bytes"] for r in rows) / 2**30
syncs = max(r["host_syncs"] for r in late)
print("scaling %s %s %d GPU%s %s: %.1fk tok/s per GPU, %s of one GPU's, exposed comm %s, peak %.2f GiB per GPU, "
      "host syncs per step %d%s" % (cfg, recipe, np_, "" if np_ == 1 else "s", layout, tps / 1e3, ratio, share, peak,
                                    syncs, ", steps run again %d" % reruns if reruns else ""))
with open(table, "a") as f:
    f.write("| %s | %s | %d | %s | %.1fk | %s | %s | %.2f | %d |\n" % (cfg, recipe, np_, layout, tps / 1e3, ratio, share, peak, syncs))
open(d + "/tps.txt", "w").write("%.3f\n" % tps)  # the baseline the larger runs are divided by
PY
}

for config_name in ${CONFIGS:-gpu_moe gpu_moe_wide}; do
  config=configs/$config_name.yaml
  # shellcheck disable=SC2086
  batch=$(config_value "$("$build/flowmoe" train --config "$config" ${EXTRA_SETS:-} --print-config)" train batch_size)
  for recipe in ${RECIPES:-bf16 fp8_flow}; do
    name="${config_name}_${recipe}_1gpu"
    base=0
    run "$name" 1 1 && report "$name" 1 "one GPU" && base=$(cat "$out/$name/tps.txt")
    [ "$base" != 0 ] || {
      echo "scaling $config_name $recipe 1 GPU: FAILED ($(tail -1 "$out/$name.log" | cut -c1-160); see $name.log)"
      rc=1
      continue
    }
    for n in "${sizes[@]}"; do
      for mode in ${MODES:-dp ep_sync ep_zero_sync epdp dp_unsharded dp_serial}; do
        case $mode in
          dp) ep=1; extra=() ;;
          dp_unsharded) ep=1; extra=(--set parallel.shard_optimizer=false) ;;
          dp_serial) ep=1; extra=(--set parallel.overlap_grad_reduce=false) ;;
          dp_recompute) ep=1; extra=(--set train.recompute=attention) ;;
          dp_recompute_all) ep=1; extra=(--set 'train.recompute=[attention,moe_expert]') ;;
          ep_sync) ep=$n; extra=(--set parallel.ep_dispatch=sync) ;;
          ep_zero_sync) ep=$n; extra=(--set parallel.ep_dispatch=zero_sync) ;;
          ep_capacity*)  # ep_capacity<F>: zero_sync, receive buffers of F times an even load
            [[ $mode =~ ^ep_capacity([0-9.]+)$ ]] || { echo "unknown mode '$mode'"; exit 2; }
            ep=$n; extra=(--set parallel.ep_dispatch=zero_sync --set "parallel.ep_capacity_factor=${BASH_REMATCH[1]}") ;;
          ep_serial_shared) ep=$n; extra=(--set parallel.ep_dispatch=zero_sync --set parallel.shared_expert_overlap=off) ;;
          ep_dual*)  # ep_dual[_sms<S>]: the exchanges' kernels on S SMs, the GEMMs leaving them (0)
            [[ $mode =~ ^ep_dual(_sms([0-9]+))?$ ]] || { echo "unknown mode '$mode'"; exit 2; }
            ep=$n; extra=(--set parallel.ep_dispatch=zero_sync --set parallel.dual_microbatch=true
                          --set "parallel.exchange_sms=${BASH_REMATCH[2]:-0}") ;;
          epdp) [ "$n" -ge 4 ] || continue; ep=$((n / 2)); extra=(--set parallel.ep_dispatch=auto) ;;
          ep_chunks*)  # ep_chunks<C>[_sms<S>]: zero_sync in C token chunks, the GEMMs leaving S SMs (0)
            [[ $mode =~ ^ep_chunks([0-9]+)(_sms([0-9]+))?$ ]] || { echo "unknown mode '$mode'"; exit 2; }
            ep=$n; extra=(--set parallel.ep_dispatch=zero_sync --set "parallel.exchange_chunks=${BASH_REMATCH[1]}"
                          --set "parallel.exchange_sms=${BASH_REMATCH[3]:-0}") ;;
          *) echo "unknown mode '$mode'"; exit 2 ;;
        esac
        name="${config_name}_${recipe}_${n}gpu_${mode}"
        layout="$mode (EP $ep x DP $((n / ep)))"
        if run "$name" "$n" "$ep" --set train.batch_size=$((batch * n)) "${extra[@]}"; then
          report "$name" "$n" "$layout" || { echo "scaling $name: no metrics"; rc=1; }
        else
          echo "scaling $config_name $recipe $n GPUs $layout: FAILED ($(tail -1 "$out/$name.log" | cut -c1-160); see $name.log)"; rc=1
        fi
      done
    done
  done
done
exit $rc
