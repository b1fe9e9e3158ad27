#!/usr/bin/env bash
# examples/example_moe.cpp runs on the CPU and says what it promises: per recipe a line for each step, the
# casting-free flow's 2 activation casts against the classic recipe's 10, and a loss that went down by
# a tenth in every recipe. Registered in examples/CMakeLists.txt.
#   tests/scripts/test_example_moe.sh build/flowmoe_example_moe
set -uo pipefail
exe="${1:?usage: $0 path/to/flowmoe_example_moe}"
steps=6
out="$(timeout 120 "$exe" --steps "$steps" 2>&1)"
rc=$?
if [[ $rc -ne 0 ]]; then
  echo "FAIL: $exe exited $rc:"
  echo "$out"
  exit 1
fi
echo "$out"
# awk reads the output once: each recipe's header, its step lines, casts and first and last loss.
awk -v steps="$steps" '
  function finish() {
    if (recipe == "") return
    if (n != steps) { printf "FAIL %s: %d step lines, expected %d\n", recipe, n, steps; bad++ }
    # 10% in 6 steps: the example falls by a third; a wrong sign or a lost gradient does not fall at all.
    if (!(last < 0.9 * first)) { printf "FAIL %s: loss did not go down (%s -> %s)\n", recipe, first, last; bad++ }
    else printf "ok   %s: loss %s -> %s\n", recipe, first, last
  }
  /^[a-z0-9_]+$/ { finish(); recipe = $1; seen[recipe] = 1; n = 0; next }
  /^  step / {
    n++
    if (n == 1) first = $4
    last = $4
    casts = $7
    if (recipe == "bf16" && casts != 0) { printf "FAIL bf16: %s activation casts, expected 0\n", casts; bad++ }
    if (recipe == "fp8_blockwise" && casts != 10) { printf "FAIL fp8_blockwise: %s activation casts, expected 10\n", casts; bad++ }
    if (recipe == "fp8_flow" && casts != 2) { printf "FAIL fp8_flow: %s activation casts, expected 2\n", casts; bad++ }
  }
  END {
    finish()
    split("bf16 fp8_blockwise fp8_flow fp8_full", want, " ")
    for (i in want) if (!(want[i] in seen)) { printf "FAIL: no %s section\n", want[i]; bad++ }
    exit bad > 0
  }' <<<"$out"
