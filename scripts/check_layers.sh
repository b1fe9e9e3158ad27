#!/usr/bin/env bash
# The folders' include order, checked without a build:
#   kernels -> engine -> parallel -> layers -> io -> config -> dataset -> checkpoint -> train -> studies -> examples
# A file in one of these folders may include (#include "<folder>/...") only its own folder and the
# folders before it. Each include of a later folder, or of a folder outside the order (tests/,
# bench/), is reported as file:line with its arrow, and the check fails. The build enforces the same
# order through each library's include root (CMakeLists.txt, docs/ARCHITECTURE.md).
#   scripts/check_layers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
order=(kernels engine parallel layers io config dataset checkpoint train studies examples)
present=()
for d in "${order[@]}"; do [[ -d "$d" ]] && present+=("$d"); done
[[ ${#present[@]} -gt 0 ]] || { echo "check_layers: none of ${order[*]} found" >&2; exit 1; }
# Every repository folder is a possible include target; the order ranks those that are libraries.
folders=$(find . -mindepth 1 -maxdepth 1 -type d ! -name '.*' -printf '%f ')
{ grep -rnE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"[^"/]+/' "${present[@]}" || [[ $? -eq 1 ]]; } |
  awk -v order="${order[*]}" -v folders="$folders" '
    BEGIN {
      n = split(order, names, " ")
      for (i = 1; i <= n; ++i) rank[names[i]] = i
      m = split(folders, f, " ")
      for (i = 1; i <= m; ++i) folder[f[i]] = 1
      bad = 0
    }
    {
      # file:line:text; file names hold no colon in this repository
      file = $0; sub(/:.*/, "", file)
      rest = substr($0, length(file) + 2); line = rest; sub(/:.*/, "", line)
      target = rest; sub(/^[^"]*"/, "", target); sub(/\/.*/, "", target)
      from = file; sub(/\/.*/, "", from)
      if (!(target in folder)) next  # not a repository folder (a relative path): not ours to judge
      if ((target in rank) && rank[target] <= rank[from]) next
      allowed = ""
      for (i = 1; i <= rank[from]; ++i) allowed = allowed (i > 1 ? ", " : "") names[i]
      printf "%s:%s: %s -> %s: %s/ may include only %s\n", file, line, from, target, from, allowed
      ++bad
    }
    END {
      if (bad) { printf "check_layers: %d include(s) against the order %s\n", bad, order > "/dev/stderr"; exit 1 }
    }'
echo "check_layers: includes follow ${order[*]}"
