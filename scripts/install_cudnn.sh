#!/usr/bin/env bash
# Installs cuDNN and the header-only C++ cudnn-frontend that the cuDNN attention backend builds on
# (kernels/cuda/attention_cudnn.cpp) into .deps/ (ignored by git; CMake's FLOWMOE_CUDNN_ROOT points there):
#   .deps/cudnn/{include,lib}       cuDNN's headers and libcudnn*.so.9, from the pinned PyPI wheel nvidia-cudnn-cu13
#   .deps/cudnn_frontend/include    cudnn-frontend's C++ headers, from the pinned PyPI wheel nvidia-cudnn-frontend
# The wheels are downloaded, not installed: only those files, the licenses and a VERSION stamp are kept (about
# 900 MB, nearly all of it cuDNN's engines). The frontend's headers are the same in each of its Python builds, so
# one build is named. Idempotent: does nothing when the stamps name the pinned versions.
#   scripts/install_cudnn.sh                   into ./.deps
#   CUDNN_DEST=/path scripts/install_cudnn.sh  into /path/cudnn and /path/cudnn_frontend
set -euo pipefail
cd "$(dirname "$0")/.."
cudnn_version="9.28.1.4"
frontend_version="1.32.0"
dest="${CUDNN_DEST:-.deps}"
if [ "$(cat "$dest/cudnn/VERSION" 2>/dev/null)" = "$cudnn_version" ] && [ -f "$dest/cudnn/lib/libcudnn.so.9" ] &&
   [ "$(cat "$dest/cudnn_frontend/VERSION" 2>/dev/null)" = "$frontend_version" ] &&
   [ -f "$dest/cudnn_frontend/include/cudnn_frontend.h" ]; then
  echo "[cudnn] nvidia-cudnn-cu13 $cudnn_version and nvidia-cudnn-frontend $frontend_version present in $dest"
  exit 0
fi
# shellcheck source=scripts/ensure_pip.sh
. scripts/ensure_pip.sh
ensure_pip cudnn "pip fetches the cuDNN wheels"
echo "[cudnn] installing nvidia-cudnn-cu13 $cudnn_version and nvidia-cudnn-frontend $frontend_version into $dest"
mkdir -p "$dest"
# The staging folder sits beside the destination, so the final moves stay on one file system.
stage="$(mktemp -d "$dest/.cudnn-stage.XXXXXX")"
trap 'rm -rf "$stage"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: --disable-pip-version-check \
  --python-version 3.11 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --dest "$stage/whl" \
  "nvidia-cudnn-cu13==$cudnn_version" "nvidia-cudnn-frontend==$frontend_version"
# unpack WHEEL PREFIX OUT: the wheel's members under PREFIX into OUT (a wheel is a zip; no unzip needed).
unpack() {
  python3 - "$1" "$2" "$3" <<'PY'
import os, shutil, sys, zipfile
wheel, prefix, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    for m in z.infolist():
        if m.is_dir() or not m.filename.startswith(prefix):
            continue
        path = os.path.join(out, m.filename[len(prefix):])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with z.open(m) as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
PY
}
mkdir -p "$stage/cudnn" "$stage/cudnn_frontend"
unpack "$stage"/whl/nvidia_cudnn_cu13-*.whl nvidia/cudnn/ "$stage/cudnn"
unpack "$stage"/whl/nvidia_cudnn_cu13-*.whl "nvidia_cudnn_cu13-$cudnn_version.dist-info/licenses/" "$stage/cudnn"
unpack "$stage"/whl/nvidia_cudnn_frontend-*.whl include/ "$stage/cudnn_frontend/include"
unpack "$stage"/whl/nvidia_cudnn_frontend-*.whl "nvidia_cudnn_frontend-$frontend_version.dist-info/licenses/" \
  "$stage/cudnn_frontend"
if [ ! -f "$stage/cudnn/lib/libcudnn.so.9" ] || [ ! -f "$stage/cudnn/include/cudnn.h" ] ||
   [ ! -f "$stage/cudnn_frontend/include/cudnn_frontend.h" ]; then
  echo "[cudnn] the wheels hold no lib/libcudnn.so.9, include/cudnn.h or include/cudnn_frontend.h" >&2
  exit 1
fi
echo "$cudnn_version" >"$stage/cudnn/VERSION"
echo "$frontend_version" >"$stage/cudnn_frontend/VERSION"
rm -rf "$dest/cudnn" "$dest/cudnn_frontend"
mv "$stage/cudnn" "$dest/cudnn"
mv "$stage/cudnn_frontend" "$dest/cudnn_frontend"
echo "[cudnn] done: $(du -sh "$dest/cudnn" | cut -f1) in $dest/cudnn, frontend in $dest/cudnn_frontend"
