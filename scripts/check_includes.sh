#!/usr/bin/env bash
# Checks that each include of a project header is used: for every `#include "..."` in a .cpp, .h, .cu or .cuh
# file that names a file of the tree, at least one name the header declares must appear in the including file.
# A header's declared names, gathered without a compiler (a conservative heuristic: it reports an include only
# when none of them is used):
#   - macros (#define NAME), types (struct, class, union, enum NAME, at any depth), aliases (using NAME =);
#   - at namespace level (lines not indented, a '::' first or not): the name before a declaration's first '(' (functions) and the
#     name before '=', ';', '[' or '{' (constants, variables).
# A header's family (the headers of its folder whose names extend its own after a '_', as config/config.h includes
# config/config_types.h) counts as its own. Comments are left out on both sides. Not judged: a file's own header
# (the .h of the same path as the .cpp), an include with a comment on its line (a header included for the
# includer's own users, the comment says what for), headers in which no name is found, and the pairs of the
# allow-list (check_includes.allow beside this script: "file header  # why", the why required).
# An allow-list entry that no longer matches a finding is reported too, so the list keeps only what it must.
# Each finding is printed as file:line: header (no name of it used); the exit status is 1 when there is one.
#   scripts/check_includes.sh               check this repository
#   scripts/check_includes.sh --root DIR    check the tree at DIR (its allow-list: DIR/scripts/check_includes.allow)
#   scripts/check_includes.sh --self-test   show that an unused include fails and a used one passes
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"

if [[ "${1:-}" == "--self-test" ]]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/engine" "$tmp/train" "$tmp/scripts"
  printf '#pragma once\nnamespace flowmoe {\nstruct Shape {};\nint num_elements(const Shape& s);\nconstexpr int kMaxDims = 8;\n}\n' \
    >"$tmp/engine/shape.h"
  check="$self"
  source "$(dirname "$self")/self_test.sh"  # expect NAME STATUS PATTERN
  printf '#include "engine/shape.h"\n\nint f() { return flowmoe::kMaxDims; }\n' >"$tmp/train/run.cpp"
  expect "an include whose constant is used passes" 0 ""
  printf '#include "engine/shape.h"\n\n// Shape and num_elements in a comment are no use.\nint f() { return 1; }\n' \
    >"$tmp/train/run.cpp"
  expect "an include none of whose names is used fails" 1 "train/run.cpp:1: engine/shape.h (no name of it used)"
  printf 'train/run.cpp engine/shape.h\n' >"$tmp/scripts/check_includes.allow"
  expect "an allow-list entry without its why fails" 1 "an entry is 'file header  # why'"
  printf 'train/run.cpp engine/shape.h  # kept for the test\n' >"$tmp/scripts/check_includes.allow"
  expect "an allowed include passes" 0 ""
  printf '#include "engine/shape.h"\n\nint f(const flowmoe::Shape& s) { return flowmoe::num_elements(s); }\n' \
    >"$tmp/train/run.cpp"
  expect "an allow-list entry that matches nothing fails" 1 "no longer needed"
  exit $((failures > 0))
fi

root="$(dirname "$self")/.."
if [[ "${1:-}" == "--root" ]]; then root="$2"; fi
cd "$root"
allow_file=scripts/check_includes.allow
dirs=()
for d in kernels engine parallel layers io config dataset checkpoint train studies examples tests bench; do
  [[ -d "$d" ]] && dirs+=("$d")
done
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# The allow-list: "file header  # why"; an entry without its why is itself an error.
declare -A allowed=()
bad=0
if [[ -f "$allow_file" ]]; then
  n=0
  while IFS= read -r line; do
    n=$((n + 1))
    [[ "$line" =~ ^[[:space:]]*(#.*)?$ ]] && continue
    if [[ ! "$line" =~ ^([^[:space:]]+)[[:space:]]+([^[:space:]]+)[[:space:]]+#[[:space:]]*[^[:space:]] ]]; then
      echo "$allow_file:$n: an entry is 'file header  # why': $line"
      bad=$((bad + 1))
      continue
    fi
    allowed["${BASH_REMATCH[1]} ${BASH_REMATCH[2]}"]=1
  done <"$allow_file"
fi

# A file without its // comments.
code() { sed -e 's://.*$::' "$1"; }

# The names header $1 declares, one a line (see the top).
declared_names() {
  code "$1" >"$tmp/h"
  {
    grep -oE '^[[:space:]]*#[[:space:]]*define[[:space:]]+[A-Za-z_][A-Za-z0-9_]*' "$tmp/h" | awk '{print $NF}'
    grep -oE '\b(struct|class|union|enum)[[:space:]]+((class|struct)[[:space:]]+)?[A-Za-z_][A-Za-z0-9_]*' "$tmp/h" |
      awk '{print $NF}'
    grep -oE '\busing[[:space:]]+[A-Za-z_][A-Za-z0-9_]*[[:space:]]*=' "$tmp/h" | sed -E 's/using[[:space:]]+//; s/[[:space:]]*=//'
    sed -nE 's/^.*\btypedef\b.*[^A-Za-z0-9_]([A-Za-z_][A-Za-z0-9_]*)[[:space:]]*;.*/\1/p' "$tmp/h"
    grep -E '^(::)?[A-Za-z_]' "$tmp/h" |
      grep -vE '^(namespace|template|using|typedef|static_assert|public|private|protected|extern "C")\b' >"$tmp/top" || true
    sed -nE 's/^([^(]*[^A-Za-z0-9_(])?([A-Za-z_][A-Za-z0-9_]*)[[:space:]]*\(.*/\2/p' "$tmp/top"
    sed -nE 's/^([^(=;{[]*[^A-Za-z0-9_(=;{[])?([A-Za-z_][A-Za-z0-9_]*)[[:space:]]*(=|;|\[|\{).*/\2/p' "$tmp/top"
  } | grep -vxE '.{0,2}|operator|const|override|final|noexcept' || true
  # The header's family is part of its interface.
  local stem="${1%.h}"
  { grep -oE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"[^"]+"' "$1" || true; } | sed -E 's/^[^"]*"//; s/"$//' |
    while IFS= read -r inc; do
      if [[ "$inc" == "${stem}_"*.h && -f "$inc" ]]; then declared_names "$inc"; fi
    done
}

declare -A names_of=()  # header -> file of its names
findings=0
checked=0
while IFS= read -r file; do
  dir="$(dirname "$file")"
  stem="${file%.*}"
  code "$file" | grep -vE '^[[:space:]]*#[[:space:]]*include' >"$tmp/body"
  while IFS=: read -r num header; do
    header="${header#*\"}"
    header="${header%%\"*}"
    if [[ -f "$header" ]]; then
      path="$header"
    elif [[ -f "$dir/$header" ]]; then
      path="$dir/$header"
    else
      continue  # not a file of the tree
    fi
    [[ "${path%.*}" == "$stem" ]] && continue
    if [[ -z "${names_of[$path]:-}" ]]; then
      names_of[$path]="$tmp/names.${#names_of[@]}"
      declared_names "$path" | sort -u >"${names_of[$path]}"
    fi
    [[ -s "${names_of[$path]}" ]] || continue
    checked=$((checked + 1))
    if ! grep -qwFf "${names_of[$path]}" "$tmp/body"; then
      if [[ -n "${allowed["$file $header"]:-}" ]]; then
        allowed["$file $header"]=used
        continue
      fi
      echo "$file:$num: $header (no name of it used)"
      findings=$((findings + 1))
    fi
  done < <(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"[^"]*"[[:space:]]*$' "$file")
done < <(find "${dirs[@]}" -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) | sort)

for entry in "${!allowed[@]}"; do
  if [[ "${allowed[$entry]}" != used ]]; then
    echo "$allow_file: '$entry' is no longer needed (the check reports no such include): remove the entry"
    bad=$((bad + 1))
  fi
done

if ((findings + bad > 0)); then
  echo "check_includes: $findings unused include(s), $bad allow-list problem(s)" >&2
  exit 1
fi
echo "check_includes: each of $checked includes of project headers uses a name of its header (or is allowed)"
