#!/usr/bin/env bash
# Opt-in: installs the pinned transformers and torch that tests/interop/ checks `flowmoe export --format hf`
# against (a big download: PyPI's torch for Linux x86_64 is its CUDA build with the CUDA libraries as
# packages, some 3 GB, which runs on the CPU alone; the tests use the CPU) into .deps/interop (ignored by
# git). CTest puts that folder on the interop test's PYTHONPATH (tests/interop/CMakeLists.txt); without it
# the test skips, naming this script. scripts/test.sh does not call it. Idempotent: does nothing when the
# stamp names the pinned versions and this python3. Without network access it says so and returns 0.
#   scripts/install_interop_deps.sh              into ./.deps/interop
#   INTEROP_DEPS_DEST=/path scripts/install_interop_deps.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# transformers' glm4_moe as checkpoint/hf_format.h's kHfTransformersVersion names it; torch for its CPU forward.
pins=(transformers==5.25.0 torch==2.15.0)
dest="${INTEROP_DEPS_DEST:-.deps/interop}"
# shellcheck source=scripts/pip_pinned.sh
. scripts/pip_pinned.sh
pip_install_pinned interop "$dest" "the interop tests will skip" -- "${pins[@]}"
