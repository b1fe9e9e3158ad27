#!/usr/bin/env bash
# The one command for the GPU machine: build for sm_90a, run every test (GPU tests included), run
# every benchmark and a short GPU training run, and end with a summary table.
#   scripts/gpu_check.sh                 logs go to $OUT (device tool) or ./out
#   GPU_CHECK_SKIP_BENCH=1 scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off (shared hosts: see the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out="${OUT:-out}"
mkdir -p "$out"
build="${BUILD_DIR:-build-gpu}"
summary="$out/summary.txt"
: >"$summary"
row() { printf '%-28s %s\n' "$1" "$2" | tee -a "$summary" >/dev/null; }

device="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
row "device" "${device:-none found}"
row "nvcc" "$(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' | head -1)"

t0=$(date +%s)
if cmake -G Ninja -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DFLOWMOE_CUDA=ON -DFLOWMOE_WERROR=ON >"$out/configure.log" 2>&1 &&
   cmake --build "$build" -j"$(nproc)" -- -k 0 >"$out/build.log" 2>&1; then
  nwarn=$(grep -ci 'warning' "$out/build.log")
  row "build (sm_90a)" "ok in $(( $(date +%s) - t0 )) s, ${nwarn} warning lines"
else
  row "build (sm_90a)" "FAILED (see build.log)"
  tail -40 "$out/build.log"
  cat "$summary"
  exit 1
fi

# Tests: every test, GPU ones included. Runs 4 at a time: they share one GPU.
ctest --test-dir "$build" --output-on-failure -j4 --timeout 900 >"$out/ctest.log" 2>&1
test_rc=$?
grep -E "tests passed|tests failed" "$out/ctest.log" | tail -1 | sed 's/^/    /'
row "tests" "$(grep -E 'tests passed' "$out/ctest.log" | tail -1)"
nskip=$(grep -c '(Skipped)' "$out/ctest.log")
row "tests skipped" "$nskip"
if [ $test_rc -ne 0 ]; then
  grep -E "\(Failed\)|\(Timeout\)|\(SEGFAULT\)|\(Subprocess" "$out/ctest.log" | head -30 | tee -a "$summary"
fi

bench_rc=0
if [ -z "${GPU_CHECK_SKIP_BENCH:-}" ]; then
  for b in "$build"/bench/bench_*; do
    [ -x "$b" ] || continue
    name=$(basename "$b")
    if "$b" >"$out/$name.log" 2>&1; then
      grep '^BENCH' "$out/$name.log" | while read -r line; do row "$name" "${line#BENCH }"; done
    else
      bench_rc=1
      row "$name" "FAILED (see $name.log)"
      tail -20 "$out/$name.log"
    fi
  done
  # A short GPU training run of the small config: tokens/s and loss for docs/PERF.md.
  if [ -x "$build/examples/flowmoe" ] && [ -f configs/gpu_small.yaml ]; then
    if "$build/examples/flowmoe" train --config configs/gpu_small.yaml --set train.steps=60 \
         --set logging.out_dir="$out/run_gpu_small" --set logging.progress=plain >"$out/train_gpu_small.log" 2>&1; then
      row "train gpu_small (60 steps)" "$(grep -E 'tok/s|tokens/s' "$out/train_gpu_small.log" | tail -1)"
    else
      bench_rc=1
      row "train gpu_small" "FAILED (see train_gpu_small.log)"
      tail -20 "$out/train_gpu_small.log"
    fi
  fi
fi

echo
echo "==================== flowmoe gpu_check summary ===================="
cat "$summary"
echo "==================================================================="
[ $test_rc -eq 0 ] && [ $bench_rc -eq 0 ]
