#!/usr/bin/env bash
# The first command: installs the Debian packages, builds flowmoe (with CUDA when nvcc is found),
# and trains the default config, configs/tiny.yaml: on the GPU when one is present, else on the
# CPU (about 1 minute on 2 cores). Then draws the loss curve to runs/tiny_loss.png.
#   scripts/quickstart.sh                         # as is
#   scripts/quickstart.sh --set train.steps=100   # extra arguments go to `flowmoe train`
#   BUILD_DIR=/tmp/b FLOWMOE_CUDA=OFF scripts/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
build="${BUILD_DIR:-build}"
mkdir -p "$build"
echo "[quickstart] configuring $build (FLOWMOE_CUDA=${FLOWMOE_CUDA:-AUTO})"
cmake -G Ninja -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DFLOWMOE_CUDA="${FLOWMOE_CUDA:-AUTO}" >"$build/configure.log" 2>&1 \
  || { cat "$build/configure.log"; exit 1; }
grep "flowmoe:" "$build/configure.log" || true
echo "[quickstart] building the flowmoe command"
cmake --build "$build" --target flowmoe -j"$(nproc)"
echo "[quickstart] training configs/tiny.yaml"
"$build"/flowmoe train --config configs/tiny.yaml "$@"
"$build"/flowmoe plot runs/tiny --output runs/tiny_loss.png --title "configs/tiny.yaml" \
  || echo "[quickstart] (no plot: install gnuplot-nox or matplotlib)"
