# Sourced by scripts/gpu_check.sh and balance_sweep.sh: the one way they train.
#   train_run BUILD_DIR CONFIG OUT_DIR LOG [--set key=value ...]
# One `flowmoe train` run without evaluation or checkpoints (checkpoint.final=false: gpu_moe's takes
# 5-10 s to write, more than its 30 steps), with plain progress every 100 steps, writing its metrics
# and resolved config.yaml to OUT_DIR and its output to LOG. A checkpoint a stop request still writes
# is removed: these runs keep only their metrics (a sweep of checkpoints would fill a disk).
# Returns the trainer's exit status.
train_run() {
  local build=$1 config=$2 out_dir=$3 log=$4
  shift 4
  "$build/flowmoe" train --config "$config" --set train.eval_every=0 --set checkpoint.every=0 \
    --set checkpoint.final=false --set logging.progress=plain --set logging.log_every=100 \
    --set logging.out_dir="$out_dir" "$@" >"$log" 2>&1
  local rc=$?
  rm -rf "$out_dir/checkpoints"
  return $rc
}
