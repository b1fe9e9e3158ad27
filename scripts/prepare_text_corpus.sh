#!/usr/bin/env bash
# The real-text corpus of configs/parity_text.yaml: the English reStructuredText sources of the Python
# 3 and Linux kernel documentation (Debian's python3-doc and linux-doc packages, about 40 MB; the
# kernel's translations/ are left out), BPE-tokenized by `flowmoe prepare-data` to a 16384-token vocab.
# Writes data/text/docs.bin (the token file) and data/text/docs.bpe (the tokenizer), and prints the
# package versions it read: the token file is the same wherever those versions are.
#   scripts/prepare_text_corpus.sh [build_dir]        (default build; builds flowmoe there if missing)
#   VOCAB=16384 OUT=data/text/docs.bin scripts/prepare_text_corpus.sh
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
out="${OUT:-data/text/docs.bin}"
vocab="${VOCAB:-16384}"
pkgs=(python3-doc linux-doc)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "[corpus] installing: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# The Sphinx sources the HTML was built from (_sources/*.rst.txt), one folder per package.
# Debian links several package folders to one (python3-doc -> python3.11): each real folder once.
mapfile -t inputs < <(for d in /usr/share/doc/python3*/html/_sources /usr/share/doc/linux-doc*/html/_sources; do
  [ -d "$d" ] && readlink -f "$d"
done | sort -u)
[ ${#inputs[@]} -eq 2 ] || { echo "[corpus] expected the Python and kernel _sources folders, found: ${inputs[*]:-none}" >&2; exit 1; }
for p in $(dpkg-query -W -f '${Package}\n' 'python3*-doc' 'linux-doc*' 2>/dev/null | sort -u); do
  dpkg -s "$p" 2>/dev/null | grep -q '^Status: install ok installed' &&
    echo "[corpus] $p $(dpkg-query -W -f '${Version}' "$p")"
done
[ -x "$build/flowmoe" ] || { cmake -G Ninja -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build "$build" --target flowmoe; }
mkdir -p "$(dirname "$out")"
"$build/flowmoe" prepare-data --bpe-vocab "$vocab" --exclude 'translations/*' --output "$out" "${inputs[@]}"
sha256sum "$out"
