#!/usr/bin/env bash
# The first command: installs the Debian packages, builds the flowmoe command, and trains
# configs/tiny.yaml's small model on a short English text, one token per byte (configs/tiny_text.yaml,
# whose text is configs/corpus/quickstart.txt), on the GPU when one is present, else on the CPU (about
# 1 minute on 2 cores). Then draws the loss curve to runs/tiny_text/loss.png and continues a prompt in
# words with the trained model (`flowmoe generate` on the run's last checkpoint). It builds what it
# will run: the CUDA kernels only when nvcc is found AND a GPU is visible (on 2 cores they are most of
# a build's time); FLOWMOE_CUDA=ON|OFF decides instead.
#   scripts/quickstart.sh                         # as is
#   scripts/quickstart.sh --set train.steps=100   # extra arguments go to `flowmoe train`
#   BUILD_DIR=/tmp/b FLOWMOE_CUDA=ON scripts/quickstart.sh
#   QUICKSTART_DRY_RUN=1 scripts/quickstart.sh    # says what it would build, and why, and stops
set -euo pipefail
cd "$(dirname "$0")/.."
have_nvcc=no
{ command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; } && have_nvcc=yes
have_gpu=no
nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && have_gpu=yes
if [ -n "${FLOWMOE_CUDA:-}" ]; then
  cuda="$FLOWMOE_CUDA"
  echo "[quickstart] FLOWMOE_CUDA=$cuda as set (nvcc: $have_nvcc, GPU: $have_gpu)"
elif [ "$have_gpu" = yes ] && [ "$have_nvcc" = yes ]; then
  cuda=ON
  echo "[quickstart] building with CUDA: nvcc and a GPU found ($(nvidia-smi -L | head -1))"
elif [ "$have_nvcc" = yes ]; then
  cuda=OFF
  echo "[quickstart] building the CPU engine: nvcc found but no GPU (FLOWMOE_CUDA=ON builds the kernels anyway)"
else
  cuda=OFF
  echo "[quickstart] building the CPU engine: no nvcc found"
fi
[ -n "${QUICKSTART_DRY_RUN:-}" ] && { echo "[quickstart] would configure with -DFLOWMOE_CUDA=$cuda"; exit 0; }
scripts/install_deps.sh
build="${BUILD_DIR:-build}"
mkdir -p "$build"
cmake -G Ninja -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DFLOWMOE_CUDA="$cuda" >"$build/configure.log" 2>&1 \
  || { cat "$build/configure.log"; exit 1; }
grep "flowmoe:" "$build/configure.log" || true
echo "[quickstart] building the flowmoe command"
cmake --build "$build" --target flowmoe -j"$(nproc)"
echo "[quickstart] training configs/tiny_text.yaml"
"$build"/flowmoe train --config configs/tiny_text.yaml "$@"
"$build"/flowmoe plot runs/tiny_text --output runs/tiny_text/loss.png --title "configs/tiny_text.yaml" \
  || echo "[quickstart] (no plot: install gnuplot-nox or matplotlib)"
# The checkpoint names are zero-padded step numbers: the last in order is the run's final one.
final=$(ls -d runs/tiny_text/checkpoints/step_* | tail -n 1)
echo "[quickstart] continuing a prompt with $final"
"$build"/flowmoe generate --checkpoint "$final" --prompt "The router" --max-new-tokens 63 --temperature 0.3 --seed 1
