#!/usr/bin/env bash
# Installs the Debian packages flowmoe builds with. Skips apt entirely when all are present.
# The CUDA toolkit is not installed here: when nvcc runs (/usr/local/cuda or PATH) it is used, and
# scripts/install_cutlass.sh then puts the pinned CUTLASS headers into .deps/cutlass (the CUDA backend's
# grouped GEMMs build on them) and scripts/install_cudnn.sh the pinned cuDNN and cudnn-frontend into .deps/cudnn and
# .deps/cudnn_frontend (the cuDNN attention backend; a build without them leaves it out); each skips when its
# pinned version is already there. Without nvcc (a CPU build) neither is fetched.
# Open MPI (openmpi-bin, libopenmpi-dev) builds the mpi backend of parallel/ and runs its tests under
# mpirun; flowmoe still builds without it (single process only). clang-format (14 on Debian 12) checks
# the sources' format in the test command (scripts/check_format.sh). python3-pip installs the pinned
# CUTLASS headers and the interoperability tests' Python packages (scripts/install_python_deps.sh).
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config libeigen3-dev libyaml-cpp-dev libgtest-dev gnuplot-nox
      openmpi-bin libopenmpi-dev clang-format python3-pip)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "[deps] all present: ${pkgs[*]}"
else
  # apt's own output (hundreds of lines) goes to a log, shown only when apt fails.
  log="$(mktemp "${TMPDIR:-/tmp}/flowmoe-apt.XXXXXX.log")"
  echo "[deps] installing ${#missing[@]} Debian packages (${missing[*]}); apt's output: $log"
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  if ! { $sudo apt-get update -qq && $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "[deps] apt-get failed (its output is above, and in $log)" >&2
    exit 1
  fi
fi
if nvcc --version >/dev/null 2>&1 || /usr/local/cuda/bin/nvcc --version >/dev/null 2>&1; then
  "$(dirname "$0")/install_cutlass.sh"
  "$(dirname "$0")/install_cudnn.sh"
fi
