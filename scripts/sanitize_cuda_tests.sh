#!/usr/bin/env bash
# compute-sanitizer over the CUDA tests of a CUDA build (the *Cuda* test cases of every test binary):
#   scripts/sanitize_cuda_tests.sh BUILD_DIR [LOG_DIR]
# - memcheck checks every kernel.
# - racecheck checks flowmoe's own kernels (every kernel lives in namespace flowmoe, so its mangled
#   name holds "flowmoe"). A binary that launches cuBLASLt's Hopper GEMMs (nvjet_* kernels) breaks
#   the tool ("Internal Sanitizer Error") whenever those kernels run uninstrumented or with their TMA
#   copies tracked; such a binary runs again with every kernel instrumented and asynchronous copies
#   untracked, and only hazards outside nvjet_* count: racecheck reports write-after-read hazards
#   inside them, whose mbarrier pipelines order shared memory in ways it cannot follow. Our kernels'
#   own cp.async use is covered by the first pass, in the binaries that test them.
# Death tests are left out: they trip device asserts on purpose.
# Prints "sanitize ..." summary lines; exits non-zero if a tool reports an error or a binary runs past
# SANITIZE_TIMEOUT seconds (default 300). SANITIZE_TOOLS picks the tools (default "memcheck
# racecheck"), SANITIZE_JOBS how many binaries run at once (default 4).
set -uo pipefail
build=${1:?usage: sanitize_cuda_tests.sh BUILD_DIR [LOG_DIR]}
logs=${2:-$build/sanitize}
mkdir -p "$logs"
command -v compute-sanitizer >/dev/null || { echo "sanitize: compute-sanitizer not found"; exit 1; }
filter='*Cuda*:-*DeathTest*'
# The fully instrumented rerun also leaves out whole training runs: under full instrumentation one
# takes longer than SANITIZE_TIMEOUT, and every kernel it launches is checked in the per-op binaries.
rerun_filter="$filter:Trainer*"
echo "sanitize version: $(compute-sanitizer --version | grep -o 'Version [0-9.]*' | head -1)"

# True when the tests of a racecheck log passed and every hazard it reports lies in cuBLASLt's
# nvjet_* kernels. A hazard names both accesses: "Read Thread (127,0,0) at KERNEL+0x9b0" (with
# --racecheck-report hazard) or "... access at KERNEL+0x..". The rerun prints every hazard
# (--print-limit 0), so none hides behind the default limit of 100.
only_library_hazards() {  # only_library_hazards LOG
  local log=$1
  grep -q '^\[  PASSED  \]' "$log" && ! grep -q '^\[  FAILED  \]' "$log" || return 1
  ! grep -oE '(Thread \([0-9,]+\)|access) at [^+ ]+\+0x' "$log" | sed -E 's/.* at ([^+ ]+)\+0x$/\1/' |
    grep -qv '^nvjet_'
}

# One binary under the tool; the log is $logs/LABEL-NAME.log. Returns 0 when clean, 3 when the tool
# itself broke down ("Internal Sanitizer Error"), else 1.
sanitize_one() {  # sanitize_one LABEL BINARY TOOL-ARGS...
  local label=$1 t=$2
  shift 2
  local log
  log="$logs/$label-$(basename "$t").log"
  local f=$filter
  [ "$label" = racecheck-all ] && f=$rerun_filter
  timeout -k 15 "${SANITIZE_TIMEOUT:-300}" compute-sanitizer --error-exitcode 99 "$@" "$t" --gtest_filter="$f" \
    >"$log" 2>&1 && return 0
  grep -q 'Internal Sanitizer Error' "$log" && return 3
  [ "$label" = racecheck-all ] && only_library_hazards "$log" && return 0
  return 1
}

# Runs BINARIES (an array name) under the tool, SANITIZE_JOBS at a time, and fills the arrays
# `failed` and `broken` with the names of those that failed or broke the tool.
sanitize_all() {  # sanitize_all LABEL BINARIES-ARRAY TOOL-ARGS...
  local label=$1
  local -n list=$2
  shift 2
  local i status pids=()
  failed=() broken=()
  for i in "${!list[@]}"; do
    sanitize_one "$label" "${list[$i]}" "$@" &
    pids[$i]=$!
    while [ "$(jobs -rp | wc -l)" -ge "${SANITIZE_JOBS:-4}" ]; do sleep 0.2; done
  done
  for i in "${!list[@]}"; do
    wait "${pids[$i]}"
    status=$?
    [ $status -eq 3 ] && broken+=("${list[$i]}")
    [ $status -ne 0 ] && [ $status -ne 3 ] && failed+=("${list[$i]}")
  done
}

# The summary line of one tool; returns non-zero when anything failed or broke.
report() {  # report LABEL NUM_BINARIES
  local label=$1 total=$2
  if [ ${#failed[@]} -eq 0 ] && [ ${#broken[@]} -eq 0 ]; then
    echo "sanitize $label: clean on $total test binaries"
    return 0
  fi
  echo "sanitize $label: errors in $(for b in "${failed[@]}" "${broken[@]}"; do basename "$b"; done | xargs)" \
       "(of $total; logs in $logs)"
  for b in "${failed[@]}" "${broken[@]}"; do
    grep -h -m5 -E 'ERROR SUMMARY|RACECHECK SUMMARY|Internal Sanitizer|Error:' "$logs"/*-"$(basename "$b")".log
  done
  return 1
}

binaries=()
for t in "$build"/test_*; do
  [ -x "$t" ] || continue
  "$t" --gtest_list_tests --gtest_filter="$filter" 2>/dev/null | grep -q '^  ' && binaries+=("$t")
done
if [ ${#binaries[@]} -eq 0 ]; then
  echo "sanitize: no test binary with CUDA test cases in $build (build it first)"
  exit 1
fi

rc=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
  case $tool in
    memcheck)
      sanitize_all memcheck binaries --tool memcheck
      report memcheck ${#binaries[@]} || rc=1
      ;;
    racecheck)
      sanitize_all racecheck binaries --tool racecheck --racecheck-report hazard --kernel-name regex=flowmoe
      again=() skipped=()
      for b in "${broken[@]}"; do
        if "$b" --gtest_list_tests --gtest_filter="$rerun_filter" 2>/dev/null | grep -q '^  '; then
          again+=("$b")
        else
          skipped+=("$b")
        fi
      done
      all_failed=("${failed[@]}")
      [ ${#skipped[@]} -gt 0 ] &&
        echo "sanitize racecheck: $(for b in "${skipped[@]}"; do basename "$b"; done | xargs) not rerun" \
             "(only whole training runs left; their kernels are checked in the per-op binaries)"
      if [ ${#again[@]} -gt 0 ]; then
        echo "sanitize racecheck: $(for b in "${again[@]}"; do basename "$b"; done | xargs)" \
             "again with async copies untracked, counting hazards outside nvjet_* (the tool broke on cuBLASLt)"
        sanitize_all racecheck-all again --tool racecheck --racecheck-report hazard --racecheck-memcpy-async no \
          --print-limit 0 --show-backtrace no
      else
        broken=()
      fi
      failed+=("${all_failed[@]}")
      report racecheck ${#binaries[@]} || rc=1
      ;;
    *) echo "sanitize: unknown tool '$tool' (memcheck, racecheck)"; rc=1 ;;
  esac
done
exit $rc
