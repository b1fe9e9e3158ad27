# Sourced by the scripts that start ranks on this machine's GPUs (multi_gpu_runs.sh, scaling.sh,
# big_model.sh, parity_noise.sh): Open MPI's settings for root in a container, NVLink multicast off,
# and ngpu, the GPU count (GPUS overrides it: a host without GPUs can try a script on the CPU).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
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
