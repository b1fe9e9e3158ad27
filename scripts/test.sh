#!/usr/bin/env bash
# The test command: check the folders' include order (scripts/check_layers.sh), that the docs cite only
# files of the tree (scripts/check_docs.sh) and that each include of a project header is used
# (scripts/check_includes.sh), install Debian deps and
# the interoperability tests' pinned Python packages (scripts/install_python_deps.sh),
# check the sources' format (scripts/check_format.sh), configure (CUDA auto-detected: kernels are
# compiled when nvcc is present, GPU tests skip without a device), build warning-free, run every test.
#   scripts/test.sh            build dir ./build
#   BUILD_DIR=/tmp/b scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/check_layers.sh
scripts/check_docs.sh
scripts/check_includes.sh --self-test
scripts/check_includes.sh
scripts/install_deps.sh
scripts/install_python_deps.sh
scripts/check_format.sh
build="${BUILD_DIR:-build}"
jobs="$(nproc)"
cmake -G Ninja -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DFLOWMOE_CUDA="${FLOWMOE_CUDA:-AUTO}" -DFLOWMOE_WERROR=ON
cmake --build "$build" -j"$jobs"
ctest --test-dir "$build" --output-on-failure -j"$jobs" --timeout 900
