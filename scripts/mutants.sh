#!/usr/bin/env bash
# Mutation check of the tests (README.md, Tests): each scripts/mutants/NN-name.patch puts one small bug into a
# scratch copy of the tree; the test targets its header names are rebuilt there, its test commands run, and the
# copy is restored. A mutant whose tests all pass "survived": the tests would let that bug in. Prints each mutant
# as killed (with the tests that failed) or SURVIVED; exits 1 when one survived, 2 when the check could not be
# made (a patch no longer applies or builds, or a test command fails without any mutant).
#   scripts/mutants.sh               every mutant
#   scripts/mutants.sh adamw 06      the mutants whose file names contain "adamw" or "06"
# Environment: MUTANTS_DIR, the scratch copy and its CPU-only build (default build-mutants/ in the repository;
# kept between runs, so a later run rebuilds only what changed); MUTANT_TIMEOUT, seconds per test command
# (default 300); JOBS, build jobs (default 2); MUTANTS_BASELINE=0 skips running the test commands unmutated first.
# A patch file holds header lines, then a unified diff against the repository root (patch -p1):
#   # what: the bug, in words
#   # build: test_adamw test_adamw_multi                ninja targets to rebuild
#   # run: test_adamw --gtest_filter=AdamW.*            a test in the build directory and its arguments
#   # run: mpi2 tests/mpi/test_comm --gtest_filter=G*   the same under mpiexec with 2 processes
# One "# run:" line per command; every command gets --gtest_color=no and the time limit.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
scratch="${MUTANTS_DIR:-$root/build-mutants}"
mkdir -p "$scratch"
scratch="$(cd "$scratch" && pwd)"
tree="$scratch/tree"
build="$tree/build-cpu"  # the layout of the usual build-cpu/, so that ccache serves both
timeout_s="${MUTANT_TIMEOUT:-300}"
jobs="${JOBS:-2}"
logs="$scratch/logs"
start=$SECONDS

say() { echo "[mutants] $*"; }
fail_setup() {
  say "$*" >&2
  exit 2
}

# ---- the scratch copy: the repository's files (tracked and untracked, not ignored), copied where they differ ----
sync_tree() {
  local f
  local -A kept=()
  while IFS= read -r -d '' f; do
    [ -f "$root/$f" ] || continue
    kept["$f"]=1
    if ! cmp -s "$root/$f" "$tree/$f"; then
      mkdir -p "$(dirname "$tree/$f")"
      cp "$root/$f" "$tree/$f"  # a fresh mtime: whatever was built from another version is rebuilt
    fi
  done < <(git -C "$root" ls-files -z --cached --others --exclude-standard)
  # A file the repository no longer has (moved or removed) leaves the copy too, or the build would still see it.
  while IFS= read -r -d '' f; do
    f=${f#./}
    [ -n "${kept[$f]:-}" ] || rm -f "$tree/$f"
  done < <(cd "$tree" && find . \( -path ./build-cpu -o -path ./.deps \) -prune -o -type f -print0)
}

# ---- the mutants ------------------------------------------------------------------------------------------------
header() { sed -n "s/^# $2: *//p" "$1"; }             # header lines of one kind
patched_files() { sed -n 's|^+++ b/\([^[:space:]]*\).*|\1|p' "$1"; }

patches=()
for p in "$root"/scripts/mutants/*.patch; do
  name="$(basename "$p" .patch)"
  if [ $# -gt 0 ]; then
    keep=0
    for pattern in "$@"; do [[ "$name" == *"$pattern"* ]] && keep=1; done
    [ "$keep" = 1 ] || continue
  fi
  if [ -z "$(header "$p" build)" ] || [ -z "$(header "$p" run)" ]; then fail_setup "$name: no '# build:' or '# run:' line"; fi
  if header "$p" run | grep -q '^mpi'; then command -v mpiexec >/dev/null || fail_setup "$name runs under mpiexec"; fi
  patches+=("$p")
done
[ ${#patches[@]} -gt 0 ] || fail_setup "no mutant matches: $*"

applied=""  # the patch in the tree now, restored on any exit
restore() {
  [ -n "$applied" ] || return 0
  local f
  for f in $(patched_files "$applied"); do cp "$root/$f" "$tree/$f"; done
  applied=""
}
trap restore EXIT
trap 'exit 130' INT TERM

# ---- running a test command: "[mpi2] binary args..."; prints the failed tests' names, returns its status -------
# Open MPI refuses more processes than cores unless told (the flags tests/mpi/CMakeLists.txt passes).
mpi_flags=()
if command -v mpiexec >/dev/null && mpiexec --version 2>/dev/null | grep -q "Open MPI\|OpenRTE"; then
  mpi_flags=(--oversubscribe)
fi
run_command() {
  local line="$1" log="$2" prefix=()
  read -r -a words <<<"$line"
  if [[ "${words[0]}" == mpi* ]]; then
    prefix=(mpiexec -n "${words[0]#mpi}" ${mpi_flags[@]+"${mpi_flags[@]}"})
    words=("${words[@]:1}")
  fi
  local status=0
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none \
    TMPDIR="$scratch/tmp" timeout --kill-after=10 "$timeout_s" "${prefix[@]}" "$build/${words[0]}" \
    "${words[@]:1}" --gtest_color=no </dev/null >"$log" 2>&1 || status=$?
  if [ "$status" -ne 0 ]; then
    local failed
    failed="$(sed -n 's/^\[  FAILED  \] \([A-Za-z0-9_/.]*\)\( (.*)\)\{0,1\}$/\1/p' "$log" | sort -u | paste -sd ' ')"
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
      echo "${words[0]} (timed out after ${timeout_s} s)"
    elif [ -n "$failed" ]; then
      echo "$failed"
    else
      echo "${words[0]} (exit $status)"
    fi
  fi
  return "$status"
}

build_targets() {  # targets...; the build's output in $logs/build.log
  ninja -C "$build" -j"$jobs" "$@" >"$logs/build.log" 2>&1
}

# ---- set up -----------------------------------------------------------------------------------------------------
mkdir -p "$tree" "$logs" "$scratch/tmp"
sync_tree
# The pinned Python packages (scripts/install_python_deps.sh) for the tests that read files with them.
if [ -d "$root/.deps" ] && [ ! -e "$tree/.deps" ]; then ln -s "$root/.deps" "$tree/.deps"; fi
if [ ! -f "$build/build.ninja" ]; then
  launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cmake -G Ninja -S "$tree" -B "$build" -DCMAKE_BUILD_TYPE=Release -DFLOWMOE_CUDA=OFF -DFLOWMOE_WERROR=ON \
    "${launcher[@]}" >"$logs/configure.log" 2>&1 || fail_setup "configuring failed: $logs/configure.log"
fi
all_targets="$(for p in "${patches[@]}"; do header "$p" build; done | tr ' ' '\n' | sed '/^$/d' | sort -u | paste -sd ' ')"
say "${#patches[@]} mutants; building $all_targets in $build"
# shellcheck disable=SC2086
build_targets $all_targets || fail_setup "the unmutated tree does not build: $logs/build.log"

if [ "${MUTANTS_BASELINE:-1}" != 0 ]; then
  t0=$SECONDS
  n=0
  while IFS= read -r line; do
    n=$((n + 1))
    failed="$(run_command "$line" "$logs/baseline.log")" ||
      fail_setup "without a mutant, '$line' fails: $failed (its output: $logs/baseline.log)"
  done < <(for p in "${patches[@]}"; do header "$p" run; done | sort -u)
  say "without a mutant the $n test commands pass ($((SECONDS - t0)) s)"
fi

# ---- each mutant: apply, build, run, restore ----------------------------------------------------------------------
survived=()
broken=()
for p in "${patches[@]}"; do
  name="$(basename "$p" .patch)"
  t0=$SECONDS
  if ! patch -p1 -d "$tree" --batch --forward --fuzz=0 --no-backup-if-mismatch -s <"$p" >"$logs/$name.patch.log" 2>&1; then
    applied="$p"
    restore
    say "$name: DOES NOT APPLY (rebase it): $(head -c 300 "$logs/$name.patch.log")"
    broken+=("$name")
    continue
  fi
  applied="$p"
  # shellcheck disable=SC2046
  if ! build_targets $(header "$p" build); then
    cp "$logs/build.log" "$logs/$name.build.log"
    restore
    say "$name: DOES NOT BUILD (see $logs/$name.build.log)"
    broken+=("$name")
    continue
  fi
  killers=()
  i=0
  while IFS= read -r line; do
    i=$((i + 1))
    if failed="$(run_command "$line" "$logs/$name.run$i.log")"; then :; else killers+=("$failed"); fi
  done < <(header "$p" run)
  restore
  if [ ${#killers[@]} -gt 0 ]; then
    say "$name: killed in $((SECONDS - t0)) s by ${killers[*]}"
  else
    say "$name: SURVIVED ($((SECONDS - t0)) s): $(header "$p" what)"
    survived+=("$name")
  fi
done

say "${#patches[@]} mutants: $((${#patches[@]} - ${#survived[@]} - ${#broken[@]})) killed," \
  "${#survived[@]} survived${survived[*]:+ (${survived[*]})}," \
  "${#broken[@]} not checked${broken[*]:+ (${broken[*]})}; $((SECONDS - start)) s"
[ ${#broken[@]} -eq 0 ] || exit 2
[ ${#survived[@]} -eq 0 ] || exit 1
