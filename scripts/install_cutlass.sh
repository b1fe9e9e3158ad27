#!/usr/bin/env bash
# Installs the C++ headers of CUTLASS (include/cutlass, include/cute) that kernels/cuda/grouped_gemm_*.cu
# build on into .deps/cutlass/include (ignored by git; CMake's FLOWMOE_CUTLASS_DIR points there). They come
# from the pinned PyPI package nvidia-cutlass, whose wheel carries them under cutlass_library/source/include;
# only those headers, the license and a VERSION stamp are kept (about 27 MB). Nothing else of the package is
# used. Idempotent: does nothing when the stamp already names the pinned version.
#   scripts/install_cutlass.sh                   into ./.deps/cutlass
#   CUTLASS_DEST=/path scripts/install_cutlass.sh
set -euo pipefail
cd "$(dirname "$0")/.."
version="4.2.0.0"
dest="${CUTLASS_DEST:-.deps/cutlass}"
if [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$version" ] && [ -f "$dest/include/cutlass/cutlass.h" ] &&
   [ -f "$dest/include/cute/tensor.hpp" ]; then
  echo "[cutlass] nvidia-cutlass $version present in $dest"
  exit 0
fi
# shellcheck source=scripts/ensure_pip.sh
. scripts/ensure_pip.sh
ensure_pip cutlass "pip fetches the nvidia-cutlass wheel"
echo "[cutlass] installing nvidia-cutlass $version headers into $dest"
mkdir -p "$(dirname "$dest")"
# The staging folder sits beside the destination, so the final moves stay on one file system.
stage="$(mktemp -d "$(dirname "$dest")/.cutlass-stage.XXXXXX")"
trap 'rm -rf "$stage"' EXIT
python3 -m pip install --quiet --no-deps --no-compile --disable-pip-version-check --root-user-action=ignore \
  --target "$stage/pkg" "nvidia-cutlass==$version"
headers="$stage/pkg/cutlass_library/source/include"
if [ ! -f "$headers/cutlass/cutlass.h" ] || [ ! -f "$headers/cute/tensor.hpp" ]; then
  echo "[cutlass] nvidia-cutlass $version has no cutlass/ and cute/ headers under cutlass_library/source/include" >&2
  exit 1
fi
mkdir -p "$stage/out"
mv "$headers" "$stage/out/include"
cp "$stage"/pkg/nvidia_cutlass-*.dist-info/licenses/LICENSE.txt "$stage/out/LICENSE.txt"
echo "$version" >"$stage/out/VERSION"
rm -rf "$dest"
mv "$stage/out" "$dest"
echo "[cutlass] done: $(du -sh "$dest" | cut -f1) in $dest"
