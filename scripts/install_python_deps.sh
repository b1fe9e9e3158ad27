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
stamp="${pins[*]} $(python3 -c 'import sys; print("python%d.%d" % sys.version_info[:2])')"
if [ "$(cat "$dest/VERSIONS" 2>/dev/null)" = "$stamp" ]; then
  echo "[python] ${pins[*]} present in $dest"
  exit 0
fi
echo "[python] installing ${pins[*]} into $dest"
mkdir -p "$(dirname "$dest")"
# Installed beside the destination and moved into place, so an interrupted install leaves no half folder.
stage="$(mktemp -d "$(dirname "$dest")/.python-stage.XXXXXX")"
trap 'rm -rf "$stage"' EXIT
if ! python3 -m pip install --quiet --no-deps --only-binary=:all: --no-compile --disable-pip-version-check \
     --root-user-action=ignore --target "$stage/pkg" "${pins[@]}" >"$stage/log" 2>&1; then
  cat "$stage/log" >&2
  echo "[python] could not install ${pins[*]} (output above): the Python interoperability tests will skip" >&2
  exit 0
fi
echo "$stamp" >"$stage/pkg/VERSIONS"
rm -rf "$dest"
mv "$stage/pkg" "$dest"
echo "[python] done: $(du -sh "$dest" | cut -f1) in $dest"
