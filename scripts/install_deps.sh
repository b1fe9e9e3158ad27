#!/usr/bin/env bash
# Installs the Debian packages flowmoe builds with. Skips apt entirely when all are present.
# The CUDA toolkit is not installed here: when nvcc exists (/usr/local/cuda or PATH) it is used, and
# scripts/install_cutlass.sh then puts the pinned CUTLASS headers into .deps/cutlass (the CUDA backend's
# grouped GEMMs build on them; it skips when they are already there).
# Open MPI (openmpi-bin, libopenmpi-dev) builds the mpi backend of parallel/ and runs its tests under
# mpirun; flowmoe still builds without it (single process only). clang-format (14 on Debian 12) checks
# the sources' format in the test command (scripts/check_format.sh).
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config libeigen3-dev libyaml-cpp-dev libgtest-dev gnuplot-nox
      openmpi-bin libopenmpi-dev clang-format)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "[deps] all present: ${pkgs[*]}"
else
  echo "[deps] installing: ${missing[*]}"
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  "$(dirname "$0")/install_cutlass.sh"
fi
