#!/usr/bin/env bash
# The one command for a machine with an H100/H200: build for sm_90a, run every test (GPU tests
# included), run every benchmark and three GPU training runs (configs/gpu_moe.yaml as shipped: its
# loss and its load balance after warmup), the multi-process runs one GPU allows
# (scripts/parallel_runs.sh), with several GPUs the nccl expert-parallel runs (scripts/multi_gpu_runs.sh)
# and weak scaling (scripts/scaling.sh), and end with a summary table.
#   scripts/gpu_check.sh                 logs go to $OUT if set, else ./out
#   GPU_CHECK_SKIP_BENCH=1 scripts/gpu_check.sh      tests only
#   GPU_CHECK_SKIP_TRAIN=1 scripts/gpu_check.sh     tests and benchmarks, no training runs
#   GPU_CHECK_TRAIN=1 scripts/gpu_check.sh          with several GPUs, the one-GPU training runs too
#                                                    (by default they give way to the multi-GPU runs,
#                                                    which keeps the check within 10 minutes)
#   GPU_CHECK_PARITY=1 scripts/gpu_check.sh          also the 500-step FP8 loss parity (scripts/fp8_parity.sh)
#   GPU_CHECK_PEER=1 scripts/gpu_check.sh            also flowmoe against the compiled PyTorch peer
#                                                    (bench/peer_compare.sh: about 1.5 minutes, most of
#                                                    it torch.compile; left out by default to keep a cold
#                                                    run within 10 minutes)
#   GPU_CHECK_SANITIZE=1 scripts/gpu_check.sh        also compute-sanitizer over the CUDA tests
#                                                    (scripts/sanitize_cuda_tests.sh)
#   GPU_CHECK_EXCLUDE=REGEX scripts/gpu_check.sh     leaves out the tests whose names match (ctest -E),
#                                                    e.g. the CPU-only mpirun launches CI runs, to keep a
#                                                    cold tests-only check within a 10-minute slot
#   GPU_CHECK_JOBS=N scripts/gpu_check.sh            runs N tests at once on the GPU (default 6)
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/train_run.sh
. scripts/train_run.sh
# NVLink multicast stays off for NCCL, NVSHMEM and torch symmetric memory.
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

ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
# Several GPUs: the multi-GPU runs take the one-GPU training runs' place (their figures come from a
# one-GPU machine), unless GPU_CHECK_TRAIN asks for both.
if [ "$ngpu" -ge 2 ] && [ -z "${GPU_CHECK_TRAIN:-}" ] && [ -z "${GPU_CHECK_SKIP_TRAIN:-}" ]; then
  GPU_CHECK_SKIP_TRAIN=1
  row "training runs" "skipped: $ngpu GPUs, the multi-GPU runs instead (GPU_CHECK_TRAIN=1 runs both)"
fi

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

t_build=$(( $(date +%s) - t0 ))
t0=$(date +%s)
# Expert parallelism on this one GPU through the mpi backend's host staging (scripts/parallel_runs.sh
# ep): nothing in it is timed, so it runs beside the tests.
ep_pid=
if [ -z "${GPU_CHECK_SKIP_TRAIN:-}" ] && [ -z "${GPU_CHECK_SKIP_BENCH:-}" ]; then
  scripts/parallel_runs.sh "$build" "$out" ep >"$out/parallel_ep.txt" 2>&1 &
  ep_pid=$!
fi
# Tests: every test, GPU ones included. Runs 6 at a time: they share one GPU, and the longest
# (the README's quick start, over a minute) then overlaps the rest.
exclude=()
[ -n "${GPU_CHECK_EXCLUDE:-}" ] && { exclude=(-E "$GPU_CHECK_EXCLUDE"); row "tests left out" "matching $GPU_CHECK_EXCLUDE"; }
ctest --test-dir "$build" --output-on-failure -j"${GPU_CHECK_JOBS:-6}" --timeout 900 "${exclude[@]}" >"$out/ctest.log" 2>&1
test_rc=$?
grep -E "tests passed|tests failed" "$out/ctest.log" | tail -1 | sed 's/^/    /'
row "tests" "$(grep -E 'tests passed' "$out/ctest.log" | tail -1)"
nskip=$(grep -c '(Skipped)' "$out/ctest.log")
row "tests skipped" "$nskip"
if [ $test_rc -ne 0 ]; then
  grep -E "\(Failed\)|\(Timeout\)|\(SEGFAULT\)|\(Subprocess" "$out/ctest.log" | head -30 | tee -a "$summary"
fi

t_tests=$(( $(date +%s) - t0 ))
t_bench=0 t_train=0
bench_rc=0
if [ -z "${GPU_CHECK_SKIP_BENCH:-}" ]; then
  t0=$(date +%s)
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
  # bench_dispatch across processes (the loop above ran it as one): 2 ranks sharing GPU 0 through the
  # mpi backend's host staging (toy shape, the sync exchange, 10 reps: staging is slow), and one rank per GPU on nccl when
  # there are 2 or more. Open MPI needs these variables as root in a container (tests/mpi/CMakeLists.txt).
  # ep_bench LABEL LOG NP COMMAND...: one mpirun, its BENCH lines (or its skip line) as summary rows.
  ep_bench() {
    local label=$1 log="$out/$2.log" rc
    shift 2
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none \
      timeout -k 15 90 mpirun --oversubscribe --bind-to none -np "$@" >"$log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then
      grep -q '^BENCH' "$log" || row "$label" "$(tail -1 "$log")"
      grep '^BENCH' "$log" | while read -r line; do row "$label" "${line#BENCH }"; done
    else
      bench_rc=1
      row "$label" "FAILED$([ $rc -eq 124 ] && echo ' (over 90 s)') (see $(basename "$log"))"
      tail -20 "$log"
    fi
  }
  # With several GPUs the nccl bench below takes its place (ctest's test_comm_np2 still checks the
  # staged path), which keeps the check within 10 minutes.
  if [ "$ngpu" -lt 2 ] && [ -x "$build/bench/bench_dispatch" ] && command -v mpirun >/dev/null; then
    ep_bench "bench_dispatch np2 mpi" bench_dispatch_np2_mpi 2 env CUDA_VISIBLE_DEVICES=0 \
      "$build/bench/bench_dispatch" --backend mpi --shapes toy --modes sync --reps 10 --warmup 1
  fi
  # Several GPUs: expert parallelism over nccl, a GPU per rank (scripts/multi_gpu_runs.sh: EP = N against
  # one process, resume across EP sizes, bench_dispatch at each size the GPUs allow). ctest's
  # test_comm_np2/np4 above already ran every dispatch/combine check through nccl where each rank has a GPU.
  if [ "$ngpu" -ge 2 ]; then
    # To keep the check within 10 minutes: the toy shape only (the DeepEP shape: multi_gpu_runs.sh bench),
    # and equality for bf16 and fp8_flow (each equality pair starts NCCL and builds the model twice;
    # fp8_blockwise: multi_gpu_runs.sh equality).
    RECIPES="bf16 fp8_flow" BENCH_SHAPES=toy scripts/multi_gpu_runs.sh "$build" "$out/multi_gpu" equality resume bench >"$out/multi_gpu.txt" 2>&1 ||
      bench_rc=1
    grep -v '^bench_dispatch' "$out/multi_gpu.txt" | while read -r line; do row "${line%%:*}" "${line#*: }"; done
    grep '^bench_dispatch' "$out/multi_gpu.txt" | grep -E 'op=(dispatch|combine) ' |
      sed -E 's/^(bench_dispatch np[0-9]+ nccl): .*shape=([a-z]+).*payload=([a-z0-9]+) op=([a-z.]+) mode=([a-z_]+).* gbps=([0-9.]+).*frac_ceiling=([0-9.]+).*host_syncs=([0-9]+).*/\1 \2 \3 \4 \5: \6 GB\/s, \7 of all-to-all, \8 host syncs/' |
      while read -r line; do row "${line%%:*}" "${line#*: }"; done
    # Weak scaling (scripts/scaling.sh): gpu_moe_wide in bf16, data and expert parallelism over every
    # GPU against one GPU, in the same run (SCALING_CONFIGS/RECIPES/MODES widen it; the full table:
    # scripts/scaling.sh alone).
    CONFIGS="${SCALING_CONFIGS:-gpu_moe_wide}" RECIPES="${SCALING_RECIPES:-bf16}" MODES="${SCALING_MODES:-dp ep_sync ep_zero_sync}" \
      scripts/scaling.sh "$build" "$out/scaling" >"$out/scaling.txt" 2>&1 || bench_rc=1
    sed 's/^scaling //' "$out/scaling.txt" | while read -r line; do row "scaling ${line%%:*}" "${line#*: }"; done
  fi
  t_bench=$(( $(date +%s) - t0 ))
  t0=$(date +%s)
  # Short GPU training runs (scripts/train_run.sh): tokens/s, loss and (MoE) load balance for
  # docs/PERF.md. gpu_moe_text is gpu_moe on real text (byte-level: the Python standard library's
  # sources on this machine) instead of its synthetic bigram corpus, with DeepSeek-V3's sign bias step
  # (0.01): gpu_moe's proportional step costs loss on byte-level text (docs/PERF.md, MoE load balance).
  pylib="$(python3 -c 'import os; print(os.path.dirname(os.__file__))' 2>/dev/null)"
  # STEPS 0: the config as shipped (gpu_moe: the "balanced load after warmup" check); otherwise
  # STEPS steps with a tenth of them as warmup.
  runs=("gpu_small 60" "gpu_moe 0" "gpu_moe_text 400")
  [ -n "${GPU_CHECK_SKIP_TRAIN:-}" ] && runs=()
  for run in "${runs[@]}"; do
    set -- $run
    name=$1 cfg="configs/$1.yaml" extra=() label="$2 steps"
    if [ "$name" = gpu_moe_text ]; then
      cfg=configs/gpu_moe.yaml
      [ -d "$pylib" ] || { row "train $name" "skipped (no python3 library sources found)"; continue; }
      extra=(--set data.source=text --set data.path="$pylib" --set model.bias_update_rule=sign
             --set model.bias_update_rate=0.01)
    fi
    [ "$2" -gt 0 ] && extra+=(--set train.steps="$2" --set optimizer.warmup_steps=$(( $2 / 10 ))) || label="as shipped"
    [ -x "$build/flowmoe" ] && [ -f "$cfg" ] || continue
    if train_run "$build" "$cfg" "$out/run_$name" "$out/train_$name.log" "${extra[@]}"; then
      row "train $name ($label)" "$(grep -E '^done:' "$out/train_$name.log" | tail -1)"
      row "  time $name" "$(grep -E '^time:' "$out/train_$name.log" | tail -1 | sed 's/^time: //')"
      # Load balance (scripts/load_balance.py): after the warmup for a run as shipped, else over the
      # last quarter of the steps.
      after=()
      [ "$2" -eq 0 ] && after=(--after warmup)
      bal=$(python3 scripts/load_balance.py "${after[@]}" "$out/run_$name" 2>/dev/null | grep 'worst layer' | sed 's/^[^:]*: //')
      [ -n "$bal" ] && row "  load $name" "$bal"
    else
      bench_rc=1
      row "train $name" "FAILED (see train_$name.log)"
      tail -20 "$out/train_$name.log"
    fi
  done
  # flowmoe's training speed against the PyTorch peer (bench/peer_compare.sh: the same model compiled),
  # one after the other on this GPU: gpu_moe in bf16 against the compiled peer (fp8_flow's step: the
  # profile rows below).
  if [ -z "${GPU_CHECK_SKIP_TRAIN:-}" ] && [ -n "${GPU_CHECK_PEER:-}" ] && python3 -c 'import torch' 2>/dev/null; then
    if PEER_MODES=compiled CHECKPOINT_DIR="${TMPDIR:-/tmp}/flowmoe_peer_ck" OUT="$out" \
        bench/peer_compare.sh "$build" configs/gpu_moe.yaml bf16 >"$out/peer_compare.log" 2>&1; then
      # "flowmoe bf16: 326793.7 tok/s, 12.418 GiB, 0.922 of the compiled peer"
      grep '^BENCH' "$out/peer_compare.log" | awk '{
          for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
          line = f["peer"] " " (f["recipe"] != "" ? f["recipe"] : f["mode"]) ": " f["tokens_per_s"] " tok/s, " f["peak_gib"] " GiB"
          if (f["ratio_vs_peer_compiled"] != "") line = line ", " f["ratio_vs_peer_compiled"] " of the compiled peer"
          print line; delete f }' |
        while read -r line; do row "peer ${line%%:*}" "${line#*: }"; done
    else
      bench_rc=1
      row "peer_compare" "FAILED (see peer_compare.log)"
      tail -20 "$out/peer_compare.log"
    fi
  fi
  # Where a step's time goes (flowmoe train --profile), gpu_moe in each recipe: the profile's first line.
  if [ -z "${GPU_CHECK_SKIP_TRAIN:-}" ]; then
    for recipe in bf16 fp8_flow; do
      if train_run "$build" configs/gpu_moe.yaml "$out/run_profile_$recipe" "$out/profile_$recipe.log" \
          --set precision.recipe=$recipe --set train.steps=30 --set optimizer.warmup_steps=10 --profile 25; then
        row "profile gpu_moe $recipe" "$(grep -E '^profile of step' "$out/profile_$recipe.log" | sed 's/^profile of //')"
      else
        bench_rc=1
        row "profile gpu_moe $recipe" "FAILED (see profile_$recipe.log)"
      fi
    done
  fi
  # The nccl backend at world size 1 against the default backend: the same losses, and tokens/s.
  if [ -z "${GPU_CHECK_SKIP_TRAIN:-}" ]; then
    scripts/parallel_runs.sh "$build" "$out" nccl >"$out/parallel_nccl.txt" 2>&1 || bench_rc=1
    while read -r line; do row "${line%%:*}" "${line#*: }"; done <"$out/parallel_nccl.txt"
  fi
  t_train=$(( $(date +%s) - t0 ))
fi
if [ -n "$ep_pid" ]; then
  wait "$ep_pid" || bench_rc=1
  while read -r line; do row "${line%%:*}" "${line#*: }"; done <"$out/parallel_ep.txt"
fi
# How long each phase took.
row "time (s)" "build ${t_build}, tests ${t_tests}, benchmarks ${t_bench}, training ${t_train}"

sanitize_rc=0
if [ -n "${GPU_CHECK_SANITIZE:-}" ]; then
  t0=$(date +%s)
  scripts/sanitize_cuda_tests.sh "$build" "$out/sanitize" >"$out/sanitize.log" 2>&1
  sanitize_rc=$?
  grep '^sanitize' "$out/sanitize.log" | while read -r line; do row "compute-sanitizer" "${line#sanitize }"; done
  row "time sanitizer (s)" "$(( $(date +%s) - t0 ))"
fi

parity_rc=0
if [ -n "${GPU_CHECK_PARITY:-}" ]; then
  scripts/fp8_parity.sh "$build" >"$out/parity.log" 2>&1
  parity_rc=$?
  grep -E '^parity|^casts|^load' "$out/parity.log" | while read -r line; do row "fp8 parity" "$line"; done
fi

echo
echo "==================== flowmoe gpu_check summary ===================="
cat "$summary"
echo "==================================================================="
[ $test_rc -eq 0 ] && [ $bench_rc -eq 0 ] && [ $parity_rc -eq 0 ] && [ $sanitize_rc -eq 0 ]
