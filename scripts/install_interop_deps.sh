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
stamp="${pins[*]} $(python3 -c 'import sys; print("python%d.%d" % sys.version_info[:2])')"
if [ "$(cat "$dest/VERSIONS" 2>/dev/null)" = "$stamp" ]; then
  echo "[interop] ${pins[*]} present in $dest"
  exit 0
fi
echo "[interop] installing ${pins[*]} and their dependencies into $dest"
mkdir -p "$(dirname "$dest")"
# Installed beside the destination and moved into place, so an interrupted install leaves no half folder.
stage="$(mktemp -d "$(dirname "$dest")/.interop-stage.XXXXXX")"
trap 'rm -rf "$stage"' EXIT
if ! python3 -m pip install --quiet --only-binary=:all: --no-compile --disable-pip-version-check \
     --root-user-action=ignore --target "$stage/pkg" "${pins[@]}" >"$stage/log" 2>&1; then
  cat "$stage/log" >&2
  echo "[interop] could not install ${pins[*]} (output above): the interop tests will skip" >&2
  exit 0
fi
echo "$stamp" >"$stage/pkg/VERSIONS"
rm -rf "$dest"
mv "$stage/pkg" "$dest"
echo "[interop] done: $(du -sh "$dest" | cut -f1) in $dest"
