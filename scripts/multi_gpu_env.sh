# Sourced by the scripts that start ranks with mpirun (multi_gpu_runs.sh, scaling.sh, big_model.sh,
# parity_noise.sh, parallel_runs.sh, parity_text.sh): Open MPI's settings for root in a container and for
# stopping a run, NVLink multicast off, and ngpu, the GPU count (GPUS overrides it: a host without GPUs can
# try a script on the CPU).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
# mpirun ends its ranks on SIGINT or SIGTERM (Ctrl-C, `timeout`, a stalled run below) by passing SIGTERM on
# after odls_base_sigkill_timeout seconds and sending SIGKILL as long after that (Open MPI 4; 1 s by default:
# too short for the ranks to finish a step and write its checkpoint, docs/TRAINING.md "Stopping a run").
# 30 s each; kill_after, the time `timeout -k` gives mpirun after its SIGTERM, covers both.
export OMPI_MCA_odls_base_sigkill_timeout=${OMPI_MCA_odls_base_sigkill_timeout:-30}
kill_after=$((2 * OMPI_MCA_odls_base_sigkill_timeout + 15))
export NCCL_NVLS_ENABLE=0  # no NVLink multicast
ngpu=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}

# take_build_and_out USAGE BUILD_DIR OUT_DIR: sets build and out from a script's two arguments (the usage
# line when one is missing) and creates out.
take_build_and_out() {
  build=${2:?usage: $1}
  out=${3:?usage: $1}
  mkdir -p "$out"
}

# skip_below_two_gpus NAME: ends the script (status 0) with a line when fewer than 2 GPUs are there.
skip_below_two_gpus() {
  if [ "$ngpu" -lt 2 ]; then
    echo "$1: skipped ($ngpu GPU found, 2 or more needed)"
    exit 0
  fi
}

# config_value RESOLVED SECTION KEY: KEY's value in SECTION of a resolved config (the output of
# `flowmoe train --config FILE --print-config`, read once by the caller).
config_value() {
  awk -v section="$2:" -v key="  $3:" '$0 == section {t=1} t && index($0, key) == 1 {print $2; exit}' <<<"$1"
}

# run_watched LOG LIMIT_S STALL_S COMMAND...: runs COMMAND, its output to LOG, under a time limit of
# LIMIT_S, and ends it sooner when LOG has not grown for STALL_S seconds: a run that stalls says so at
# once, with the last line it printed, instead of using up the limit. Returns COMMAND's status, 124 at
# the time limit, 125 for a stall.
run_watched() {
  local log=$1 limit=$2 stall=$3
  shift 3
  timeout -k "$kill_after" "$limit" "$@" >"$log" 2>&1 &
  local pid=$! size=-1 still=0 now last
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    now=$(stat -c %s "$log" 2>/dev/null || echo 0)
    if [ "$now" = "$size" ]; then still=$((still + 1)); else still=0 size=$now; fi
    if [ "$still" -ge "$stall" ]; then
      last=$(tail -1 "$log")
      kill -TERM "$pid" 2>/dev/null  # timeout passes it on to the launcher, which ends its ranks
      for _ in $(seq "$kill_after"); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
      kill -KILL "$pid" 2>/dev/null
      wait "$pid" 2>/dev/null
      echo "stalled: no output for $stall s after: $last" >>"$log"
      return 125
    fi
  done
  wait "$pid"
}
