#!/usr/bin/env bash
# Installs the pinned Python packages of the interoperability tests (tests/test_checkpoint.cpp opens a
# checkpoint with Python's safetensors) into .deps/python (ignored by git); CTest puts that folder on the
# tests' PYTHONPATH (CMakeLists.txt). The engine itself needs no Python. Idempotent: does nothing when the
# stamp names the pinned versions and this python3. Without network access it says so and returns 0: the
# Python tests then skip, naming this script.
#   scripts/install_python_deps.sh               into ./.deps/python
#   PYTHON_DEPS_DEST=/path scripts/install_python_deps.sh
set -euo pipefail
cd "$(dirname "$0")/.."
pins=(safetensors==0.4.5 numpy==1.26.4)
dest="${PYTHON_DEPS_DEST:-.deps/python}"
# shellcheck source=scripts/pip_pinned.sh
. scripts/pip_pinned.sh
pip_install_pinned python "$dest" "the Python interoperability tests will skip" --no-deps -- "${pins[@]}"
