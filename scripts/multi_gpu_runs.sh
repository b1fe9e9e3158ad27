#!/usr/bin/env bash
# Expert parallelism on a machine with several GPUs, one rank per GPU through NCCL (docs/PERF.md,
# Several GPUs; docs/PARITY.md for the parity part). Prints "name: result" lines (scripts/gpu_check.sh
# puts them in its summary) and exits nonzero on a failure. Every mpirun has a time limit: a hang fails.
#   scripts/multi_gpu_runs.sh BUILD_DIR OUT_DIR [tests] [equality] [resume] [speed] [bench] [twonode] [parity]
#   (default: tests equality resume speed bench twonode; parity, 2000 steps of each recipe, only by name;
#   EP_SIZES, e.g. "4", limits the expert-parallel sizes: by default 2, 4 and 8, those the GPUs allow)
# tests     test_comm under mpirun on 2 and 4 GPUs: the collectives and every dispatch/combine check
#           through nccl, each rank on its own GPU (rank- and token-encoded rows; skewed, empty-rank,
#           one-rank and empty-expert routings; FP8 bytes; gradients; the MoE layer in each recipe)
# equality  configs/gpu_moe.yaml (small corpus) at EP = N on N GPUs against one process, for each
#           recipe (RECIPES): the largest relative loss difference over the first EQ_STEPS steps, within
#           5e-3 (bf16 GEMMs over another split of the batch round otherwise; the CPU tests hold f32 to
#           2e-5, tests/mpi/test_ep_train.cpp); and at the largest N, zero_sync with receive buffers of
#           0.6 of an even load (parallel.ep_capacity_factor) against the worst case, all 20 steps exactly
# resume    the largest EP size's step-4 checkpoint resumed at the next smaller size (EP 4 -> EP 2; on 2 GPUs
#           EP 2 -> one process): its steps 5 to EQ_STEPS against the first run's own
# speed     gpu_moe as shipped (batch 32 in all), 30 steps, bf16 and fp8_flow at EP 1, 2, 4, each EP size
#           with the one-sync and the zero-sync dispatch (EP_DISPATCH, default "sync zero_sync"):
#           tokens/s per GPU, peak memory per GPU and host syncs per step
# bench     bench_dispatch on 2 and 4 GPUs (toy and DeepEP shapes, or BENCH_SHAPES) against nccl all-to-all
#           of the same bytes
# twonode   the largest EP size's fp8_flow equality run and bench_dispatch with NCCL's peer-to-peer and shared-memory
#           transports off (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1): the network path two nodes would take
# parity    flowmoe parity on configs/parity_text.yaml under mpirun -np 4 at EP 4 (scripts/parity_text.sh
#           ep4; STEPS sets the steps, default the config's 2000)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
build=${1:?usage: scripts/multi_gpu_runs.sh BUILD_DIR OUT_DIR [parts...]}
out=${2:?usage: scripts/multi_gpu_runs.sh BUILD_DIR OUT_DIR [parts...]}
shift 2
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests equality resume speed bench twonode)
mkdir -p "$out"
# shellcheck source=scripts/multi_gpu_env.sh
. scripts/multi_gpu_env.sh
skip_below_two_gpus "multi-GPU runs"
# One rank per GPU: nccl refuses two ranks on one GPU, so the sizes stop at the GPU count.
sizes=()
for n in 2 4 8; do [ "$n" -le "$ngpu" ] && sizes+=("$n"); done
[ -n "${EP_SIZES:-}" ] && read -r -a sizes <<<"$EP_SIZES"  # e.g. EP_SIZES=4: only those sizes
big=${sizes[-1]}                                          # resume and twonode run at the largest size
smaller=1
for n in "${sizes[@]}"; do [ "$n" -lt "$big" ] && smaller=$n; done
rc=0
config=configs/gpu_moe.yaml
# The toy model's loss spikes from about step 10 on at these rates, in one process too, and a spike
# turns rounding differences into different trajectories: the runs take 20 steps, and equality and
# resume compare the steps before the spikes (EQ_STEPS, default 9).
eq_steps=${EQ_STEPS:-9}
small=(--set data.synthetic_tokens=1000000 --set train.steps=20 --set optimizer.warmup_steps=20 --set logging.log_every=1
       --set train.eval_every=0 --set logging.progress=plain --set checkpoint.final=false)

# launch NP TIMEOUT LOG COMMAND...: one mpirun of NP ranks, a GPU each.
launch() {
  local np=$1 limit=$2 log=$3
  shift 3
  timeout -k "$kill_after" "$limit" mpirun --oversubscribe --bind-to none -np "$np" "$@" >"$log" 2>&1
}
# train_ep NP EP NAME [--set ...]: gpu_moe trained by NP ranks at expert-parallel size EP (NP 1: one process).
train_ep() {
  local np=$1 ep=$2 name=$3
  shift 3
  local cmd=("$build/flowmoe" train --config "$config" --set logging.out_dir="$out/$name" "$@")
  if [ "$np" -eq 1 ]; then
    timeout -k "$kill_after" 300 "${cmd[@]}" >"$out/$name.log" 2>&1
  else
    launch "$np" 300 "$out/$name.log" "${cmd[@]}" --set parallel.backend=nccl --set parallel.expert_parallel_size="$ep"
  fi
}
losses() { python3 -c 'import json,sys; print(" ".join(repr(json.loads(l)["loss"]) for l in open(sys.argv[1]) if l.strip()))' "$1/metrics.jsonl" 2>/dev/null; }
# compare "A" "B" LIMIT: the largest relative difference of two loss lists, and ok/FAIL against LIMIT.
compare() {
  python3 - "$1" "$2" "$3" <<'PY'
import sys
a = [float(v) for v in sys.argv[1].split()]; b = [float(v) for v in sys.argv[2].split()]; limit = float(sys.argv[3])
if not a or len(a) != len(b):
    print("FAIL (%d vs %d steps)" % (len(a), len(b))); sys.exit(1)
d = max(abs(x - y) / abs(y) for x, y in zip(a, b))
print("max rel diff %.2e over %d steps: %s" % (d, len(a), "ok" if d <= limit else "FAIL (limit %g)" % limit))
sys.exit(0 if d <= limit else 1)
PY
}
max_syncs() { python3 -c 'import json,sys; print(max(json.loads(l)["host_syncs"] for l in open(sys.argv[1]) if l.strip()))' "$1/metrics.jsonl" 2>/dev/null; }

for part in "${parts[@]}"; do
  case $part in
    tests)
      for np in "${sizes[@]}"; do
        if launch "$np" 300 "$out/test_comm_np$np.log" "$build/tests/mpi/test_comm" --gtest_color=no; then
          if grep -q 'OK \] Exchange.EveryCheckThroughNcclOnAGpuPerRank' "$out/test_comm_np$np.log" &&
             grep -q 'OK \] CollectivesCuda.NcclCommunicator' "$out/test_comm_np$np.log"; then
            echo "test_comm np$np: $(grep -E '^\[  PASSED  \]' "$out/test_comm_np$np.log" | head -1), the nccl checks among them"
          else
            echo "test_comm np$np: the nccl checks did not run (see test_comm_np$np.log)"; rc=1
          fi
        else
          echo "test_comm np$np: FAILED (exit $?, see test_comm_np$np.log)"; rc=1
          grep -E 'FAILED|Failure' "$out/test_comm_np$np.log" | head -10
        fi
      done ;;
    equality)
      for r in ${RECIPES:-bf16 fp8_blockwise fp8_flow}; do
        train_ep 1 1 "eq_${r}_np1" "${small[@]}" --set precision.recipe=$r || { echo "equality $r: one process FAILED"; rc=1; continue; }
        ref=$(losses "$out/eq_${r}_np1" | cut -d' ' -f1-"$eq_steps")
        for np in "${sizes[@]}"; do
          train_ep "$np" "$np" "eq_${r}_ep$np" "${small[@]}" --set precision.recipe=$r ||
            { echo "equality $r EP $np: FAILED (exit $?, see eq_${r}_ep$np.log)"; rc=1; continue; }
          got=$(losses "$out/eq_${r}_ep$np" | cut -d' ' -f1-"$eq_steps")
          echo "equality $r EP $np vs one process: $(compare "$got" "$ref" 5e-3 || echo); host syncs per step $(max_syncs "$out/eq_${r}_ep$np")"
          compare "$got" "$ref" 5e-3 >/dev/null || rc=1
        done
        # Bounded receive buffers at the largest size: void steps run again, so the losses are the
        # worst-case buffers' bit for bit (zero_sync both, 20 steps, CUDA graphs).
        cap=()
        for c in 0 0.6; do
          train_ep "$big" "$big" "eq_${r}_ep${big}_cap$c" "${small[@]}" --set precision.recipe=$r \
            --set parallel.ep_dispatch=zero_sync --set parallel.ep_capacity_factor=$c ||
            { echo "equality $r EP $big capacity $c: FAILED (see eq_${r}_ep${big}_cap$c.log)"; rc=1; continue 2; }
          cap+=("$(losses "$out/eq_${r}_ep${big}_cap$c")")
        done
        reruns=$(grep -c "and the step runs again" "$out/eq_${r}_ep${big}_cap0.6.log")
        echo "equality $r EP $big capacity 0.6 vs the worst case ($reruns steps run again): $(compare "${cap[1]}" "${cap[0]}" 0 || echo)"
        compare "${cap[1]}" "${cap[0]}" 0 >/dev/null || rc=1
      done ;;
    resume)
      train_ep "$big" "$big" "res_ep$big" "${small[@]}" --set checkpoint.every=4 --set checkpoint.keep_last=10 &&
        train_ep "$smaller" "$smaller" "res_ep$smaller" "${small[@]}" --resume "$out/res_ep$big/checkpoints/step_00000004"
      if [ -s "$out/res_ep$smaller/metrics.jsonl" ]; then
        want=$(losses "$out/res_ep$big" | cut -d' ' -f5-"$eq_steps")
        got=$(losses "$out/res_ep$smaller" | cut -d' ' -f1-$((eq_steps - 4)))
        echo "resume EP $big -> EP $smaller at step 4: $(compare "$got" "$want" 5e-3 || { rc=1; echo; })"
      else
        echo "resume EP $big -> EP $smaller: FAILED (see res_ep$big.log, res_ep$smaller.log)"; rc=1
      fi ;;
    speed)
      for r in bf16 fp8_flow; do
        for np in 1 "${sizes[@]}"; do
          for mode in ${EP_DISPATCH:-sync zero_sync}; do
            [ "$np" -eq 1 ] && [ "$mode" != sync ] && continue  # one process never exchanges
            name="speed_${r}_ep${np}_${mode}"
            train_ep "$np" "$np" "$name" --set train.steps=30 --set optimizer.warmup_steps=3 --set train.eval_every=0 \
              --set checkpoint.every=0 --set checkpoint.final=false --set logging.progress=plain \
              --set logging.log_every=10 --set precision.recipe=$r --set parallel.ep_dispatch=$mode ||
              { echo "speed $r EP $np $mode: FAILED"; rc=1; continue; }
            python3 - "$out/$name/metrics.jsonl" "$np" "$r" "$mode" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
np_, r, mode = int(sys.argv[2]), sys.argv[3], sys.argv[4]
late = rows[len(rows) // 3:]  # past the first steps' warm-up
tps = sum(x["tokens_per_s"] for x in late) / len(late)
print("speed gpu_moe %s EP %d%s: %.1fk tok/s per GPU (%.1fk in all), peak %.2f GiB per GPU, exchange %s ms per step, "
      "host syncs per step %d"
      % (r, np_, "" if np_ == 1 else " " + mode, tps / np_ / 1e3, tps / 1e3,
         max(x["peak_mem_bytes"] for x in rows) / 2**30,
         "%.1f" % (sum(x["exchange_ms"] for x in late) / len(late)) if late[0].get("exchange_ms") is not None else "-",
         max(x["host_syncs"] for x in late)))
PY
            # Where the run's wall time went (set-up by part, checkpoints): the summary's time line.
            echo "time gpu_moe $r EP $np$([ "$np" -eq 1 ] || echo " $mode"): $(grep -E '^time:' "$out/$name.log" | tail -1 | sed 's/^time: //')"
          done
        done
      done ;;
    bench)
      for np in "${sizes[@]}"; do
        if launch "$np" 300 "$out/bench_dispatch_np$np.log" "$build/bench/bench_dispatch" --backend nccl \
             ${BENCH_SHAPES:+--shapes "$BENCH_SHAPES"}; then
          grep '^BENCH' "$out/bench_dispatch_np$np.log" | sed "s/^BENCH/bench_dispatch np$np nccl:/"
        else
          echo "bench_dispatch np$np: FAILED (see bench_dispatch_np$np.log)"; rc=1
        fi
      done ;;
    twonode)
      export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
      train_ep "$big" "$big" "net_ep$big" "${small[@]}" --set precision.recipe=fp8_flow ||
        { echo "two nodes simulated: EP $big FAILED (see net_ep$big.log)"; rc=1; }
      [ -s "$out/eq_fp8_flow_ep$big/metrics.jsonl" ] &&
        echo "two nodes simulated (no P2P, no SHM): fp8_flow EP $big vs the same over NVLink:"\
" $(compare "$(losses "$out/net_ep$big" | cut -d' ' -f1-"$eq_steps")" "$(losses "$out/eq_fp8_flow_ep$big" | cut -d' ' -f1-"$eq_steps")" 5e-3 || echo)"\
"; $(python3 -c 'import json,sys; r=[json.loads(l) for l in open(sys.argv[1])][5:]; print("%.1fk tok/s, exchange %.0f ms per step" % (sum(x["tokens_per_s"] for x in r) / len(r) / 1e3, sum(x["exchange_ms"] for x in r) / len(r)))' "$out/net_ep$big/metrics.jsonl" 2>/dev/null)"
      if launch "$big" 300 "$out/bench_dispatch_net.log" "$build/bench/bench_dispatch" --backend nccl --reps 10; then
        grep '^BENCH' "$out/bench_dispatch_net.log" | sed "s/^BENCH/bench_dispatch np$big nccl, no P2P or SHM:/"
      else
        echo "bench_dispatch, no P2P or SHM: FAILED"; rc=1
      fi
      unset NCCL_P2P_DISABLE NCCL_SHM_DISABLE ;;
    parity) OUT="$out/parity_text" scripts/parity_text.sh "$build" ep4 || rc=1 ;;
    *) echo "unknown part '$part'"; exit 2 ;;
  esac
done
exit $rc
