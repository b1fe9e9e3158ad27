#!/usr/bin/env bash
# The C++ and CUDA sources are formatted by .clang-format: clang-format --dry-run -Werror over every
# tracked .cpp, .h, .cu and .cuh file, with the clang-format 14 that scripts/install_deps.sh installs
# (Debian 12's). Another major version formats some constructs differently, so it is not used: the
# check says so and passes. To format: clang-format -i FILE ... (or every file: see below).
#   scripts/check_format.sh          check
#   scripts/check_format.sh --fix    format every tracked file in place
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format >/dev/null 2>&1; then
  echo "[format] clang-format not found (scripts/install_deps.sh installs it): not checked"
  exit 0
fi
major=$(clang-format --version | grep -o 'version [0-9]*' | grep -o '[0-9]*')
if [ "$major" != 14 ]; then
  echo "[format] clang-format $major is not the pinned 14: not checked"
  exit 0
fi
mapfile -t files < <(git ls-files '*.cpp' '*.h' '*.cu' '*.cuh')
if [ "${1:-}" = --fix ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
if ! clang-format --dry-run -Werror "${files[@]}" 2>/tmp/flowmoe_format.$$; then
  grep -E '^[^ ].*: error:' /tmp/flowmoe_format.$$ | cut -d: -f1 | sort -u | sed 's/^/[format] not formatted: /'
  echo "[format] run scripts/check_format.sh --fix (or clang-format -i on those files)"
  rm -f /tmp/flowmoe_format.$$
  exit 1
fi
rm -f /tmp/flowmoe_format.$$
echo "[format] ${#files[@]} files formatted as .clang-format says"
