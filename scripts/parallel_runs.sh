#!/usr/bin/env bash
# Short training runs of configs/gpu_moe.yaml through the multi-process paths one GPU allows; prints
# "name: result" lines (scripts/gpu_check.sh puts them in its summary) and exits nonzero on a failure.
#   scripts/parallel_runs.sh BUILD_DIR OUT_DIR [all|nccl|ep]      (default all)
#   PARALLEL_RUNS_CONFIG=configs/tiny_moe.yaml PARALLEL_RUNS_STEPS=5 ...   another config, fewer steps
# 1. the nccl backend at world size 1 against the default backend (none): the same loss sequence,
#    and the tokens/s ratio;
# 2. expert parallelism 2 and 4 on this one GPU, ranks sharing it through the mpi backend's host
#    staging (a test transport, so its tokens/s say nothing about speed): the loss sequence against
#    the one-process run's, and the most host syncs of any step (every read of a GPU tensor to the host counts: the counts and the staged exchanges' tables, a few per MoE layer). bf16 GEMMs over a half or quarter batch may round differently, and the
#    gradients are summed over the ranks in another order, so the losses agree to about 1e-3, not bitwise.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/train_run.sh
build=$1 out=$2 which=${3:-all}
config=${PARALLEL_RUNS_CONFIG:-configs/gpu_moe.yaml}
mkdir -p "$out"
# shellcheck source=scripts/multi_gpu_env.sh
. scripts/multi_gpu_env.sh
steps=${PARALLEL_RUNS_STEPS:-20}
common=(--set data.synthetic_tokens=1000000 --set train.steps=$steps --set optimizer.warmup_steps=$(( (steps + 3) / 4 )) --set logging.log_every=1)
rc=0

losses() { python3 -c 'import json,sys; print(" ".join("%.6f" % json.loads(l)["loss"] for l in open(sys.argv[1]) if l.strip()))' "$1/metrics.jsonl"; }
rate() { grep -E '^done:' "$1" | grep -oE '[0-9.]+k? tok/s' | head -1; }
max_rel() { python3 - "$1" "$2" <<'PY'
import sys
a = [float(v) for v in sys.argv[1].split()]; b = [float(v) for v in sys.argv[2].split()]
print("%.2e" % max(abs(x - y) / abs(y) for x, y in zip(a, b)) if a and len(a) == len(b) else "n/a (lengths differ)")
PY
}

if [ "$which" != ep ]; then
  train_run "$build" "$config" "$out/par_none" "$out/par_none.log" "${common[@]}" || rc=1
  train_run "$build" "$config" "$out/par_nccl" "$out/par_nccl.log" "${common[@]}" \
    --set parallel.backend=nccl || rc=1
  ref=$(losses "$out/par_none" 2>/dev/null)
  got=$(losses "$out/par_nccl" 2>/dev/null)
  same=no; [ -n "$ref" ] && [ "$ref" = "$got" ] && same=yes
  echo "nccl world 1 ($steps steps): losses identical to backend none: $same; $(rate "$out/par_nccl.log") vs $(rate "$out/par_none.log")"
  [ "$same" = yes ] || rc=1
fi

# Host staging is slow (each exchange and the gradient all-reduce cross host memory), so these runs
# take a quarter batch for a few steps, against a one-process run with the same settings.
if [ "$which" != nccl ]; then
  ep_steps=${PARALLEL_RUNS_EP_STEPS:-6}
  ep_common=(--set data.synthetic_tokens=1000000 --set train.steps=$ep_steps --set optimizer.warmup_steps=$(( (ep_steps + 3) / 4 )) --set logging.log_every=1
             --set train.batch_size=8)
  train_run "$build" "$config" "$out/par_ep1" "$out/par_ep1.log" "${ep_common[@]}" || rc=1
  ref=$(losses "$out/par_ep1" 2>/dev/null)
  for ep in 2 4; do
    timeout -k "$kill_after" 300 mpirun --oversubscribe --bind-to none -np $ep bash -c ". scripts/train_run.sh; train_run '$build' '$config' \
      '$out/par_ep$ep' '$out/par_ep$ep.log'.\$OMPI_COMM_WORLD_RANK ${ep_common[*]} --set parallel.backend=mpi \
      --set parallel.expert_parallel_size=$ep" >"$out/par_ep$ep.mpirun.log" 2>&1 || rc=1
    got=$(losses "$out/par_ep$ep" 2>/dev/null)
    syncs=$(python3 -c 'import json,sys; print(max(json.loads(l)["host_syncs"] for l in open(sys.argv[1]) if l.strip()))' \
      "$out/par_ep$ep/metrics.jsonl" 2>/dev/null)
    echo "EP $ep on one GPU, mpi staging ($ep_steps steps, batch 8): max relative loss difference vs one process $(max_rel "$got" "$ref"); final $(echo "$got" | awk '{print $NF}') vs $(echo "$ref" | awk '{print $NF}'); host syncs per step ${syncs:-?}"
  done
fi
exit $rc
