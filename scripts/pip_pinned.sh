#!/usr/bin/env bash
# pip_install_pinned TAG DEST SKIPS [PIP_OPTION ...] -- PIN ...: installs the pinned PyPI wheels into the folder
# DEST (a PYTHONPATH entry, ignored by git) unless DEST/VERSIONS already names these pins and this python3.
# The install is staged beside DEST and moved into place, so an interrupted one leaves no half folder. Without
# network access it prints pip's output and "[TAG] could not install ...: SKIPS" and returns 0 (what needs the
# packages then skips). Sourced by install_python_deps.sh and install_interop_deps.sh.
pip_install_pinned() {
  local tag=$1 dest=$2 skips=$3 opts=() pins=() stamp
  shift 3
  while [ $# -gt 0 ] && [ "$1" != -- ]; do opts+=("$1"); shift; done
  shift
  pins=("$@")
  stamp="${pins[*]} $(python3 -c 'import sys; print("python%d.%d" % sys.version_info[:2])')"
  if [ "$(cat "$dest/VERSIONS" 2>/dev/null)" = "$stamp" ]; then
    echo "[$tag] ${pins[*]} present in $dest"
    return 0
  fi
  echo "[$tag] installing ${pins[*]} into $dest"
  mkdir -p "$(dirname "$dest")"
  pip_pinned_stage="$(mktemp -d "$(dirname "$dest")/.$tag-stage.XXXXXX")"
  trap 'rm -rf "$pip_pinned_stage"' EXIT
  if ! python3 -m pip install --quiet "${opts[@]}" --only-binary=:all: --no-compile --disable-pip-version-check \
       --root-user-action=ignore --target "$pip_pinned_stage/pkg" "${pins[@]}" >"$pip_pinned_stage/log" 2>&1; then
    cat "$pip_pinned_stage/log" >&2
    echo "[$tag] could not install ${pins[*]} (output above): $skips" >&2
    return 0
  fi
  echo "$stamp" >"$pip_pinned_stage/pkg/VERSIONS"
  rm -rf "$dest"
  mv "$pip_pinned_stage/pkg" "$dest"
  echo "[$tag] done: $(du -sh "$dest" | cut -f1) in $dest"
}
