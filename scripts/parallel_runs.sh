#!/usr/bin/env bash
# Short training runs of configs/gpu_moe.yaml through the multi-process paths one GPU allows; prints
# "name: result" lines (scripts/gpu_check.sh puts them in its summary) and exits nonzero on a failure.
#   scripts/parallel_runs.sh BUILD_DIR OUT_DIR
# 1. the nccl backend at world size 1 against the default backend (none): the same loss sequence,
#    and the tokens/s ratio;
# 2. expert parallelism 2 and 4 on this one GPU, ranks sharing it through the mpi backend's host
#    staging (a test transport, so its tokens/s say nothing about speed): the loss sequence against
#    the one-process run's. bf16 GEMMs over a half or quarter batch may round differently, and the
#    gradients are summed over the ranks in another order, so the losses agree to about 1e-3, not bitwise.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/train_run.sh
build=$1 out=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
steps=40
common=(--set train.steps=$steps --set optimizer.warmup_steps=10 --set logging.log_every=1)
rc=0

losses() { python3 -c 'import json,sys; print(" ".join("%.6f" % json.loads(l)["loss"] for l in open(sys.argv[1]) if l.strip()))' "$1/metrics.jsonl"; }
rate() { grep -E '^done:' "$1" | grep -oE '[0-9.]+k? tok/s' | head -1; }
max_rel() { python3 - "$1" "$2" <<'PY'
import sys
a = [float(v) for v in sys.argv[1].split()]; b = [float(v) for v in sys.argv[2].split()]
print("%.2e" % max(abs(x - y) / abs(y) for x, y in zip(a, b)) if a and len(a) == len(b) else "n/a (lengths differ)")
PY
}

train_run "$build" configs/gpu_moe.yaml "$out/par_none" "$out/par_none.log" "${common[@]}" || rc=1
train_run "$build" configs/gpu_moe.yaml "$out/par_nccl" "$out/par_nccl.log" "${common[@]}" \\
  --set parallel.backend=nccl || rc=1
ref=$(losses "$out/par_none" 2>/dev/null)
got=$(losses "$out/par_nccl" 2>/dev/null)
same=no; [ -n "$ref" ] && [ "$ref" = "$got" ] && same=yes
echo "nccl world 1 ($steps steps): losses identical to backend none: $same; $(rate "$out/par_nccl.log") vs $(rate "$out/par_none.log")"
[ "$same" = yes ] || rc=1

for ep in 2 4; do
  timeout 600 mpirun --oversubscribe -np $ep bash -c ". scripts/train_run.sh; train_run '$build' configs/gpu_moe.yaml \\
    '$out/par_ep$ep' '$out/par_ep$ep.log'.\$OMPI_COMM_WORLD_RANK ${common[*]} --set parallel.backend=mpi \\
    --set parallel.expert_parallel_size=$ep" >"$out/par_ep$ep.mpirun.log" 2>&1 || rc=1
  got=$(losses "$out/par_ep$ep" 2>/dev/null)
  echo "EP $ep on one GPU, mpi staging ($steps steps): max relative loss difference vs one process $(max_rel "$got" "$ref"); final $(echo "$got" | awk '{print $NF}') vs $(echo "$ref" | awk '{print $NF}')"
done
exit $rc
