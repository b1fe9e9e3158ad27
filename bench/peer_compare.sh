#!/usr/bin/env bash
# flowmoe's training speed against its PyTorch speed peer (bench/torch_peer.py: the same model from
# the same config, trained with torch.compile, autocast bf16, grouped GEMM experts and fused AdamW),
# one after the other on the same GPU in one run.
#   bench/peer_compare.sh BUILD_DIR CONFIG [RECIPES...]
#   bench/peer_compare.sh build-gpu configs/gpu_moe.yaml bf16 fp8_flow
# For each recipe (default bf16) it trains `BUILD_DIR/flowmoe train` for FLOWMOE_STEPS steps and
# averages the metrics' per-step tokens_per_s over the steps after FLOWMOE_SKIP (each row's rate is
# that step's alone: tokens per step / the step's wall time, evaluation and checkpoints outside it),
# as total tokens over total time. peak_gib is the largest peak_mem_bytes of those rows (the
# allocator's peak since the start). Then it runs the peer compiled and eager (PEER_MODES) with
# PEER_WARMUP untimed and PEER_STEPS timed steps, and prints one BENCH line per run:
#   BENCH peer=flowmoe recipe=bf16 config=gpu_moe tokens_per_s=... peak_gib=... step_ms=... ratio_vs_peer_compiled=...
#   BENCH peer=torch mode=compiled config=gpu_moe tokens_per_s=... peak_gib=... params=... step_ms=...
# moe_max_over_mean on both sides is the mean over MoE layers and timed steps of the busiest
# expert's load over the mean: routing balance changes expert GEMM efficiency, and flowmoe trains on
# its config's corpus while the peer reads random tokens.
# Environment (defaults in brackets):
#   FLOWMOE_STEPS [30]  FLOWMOE_SKIP [10]      flowmoe steps per recipe, and the first ones left out
#   PEER_WARMUP [10]    PEER_STEPS [20]        the peer's untimed steps (compilation) and timed steps
#   PEER_MODES ["compiled eager"]  PEER_EXPERTS [grouped_mm]   passed to torch_peer.py
#   PEER_ARGS [""]      more torch_peer.py options (--compile-mode max-autotune)
#   COMPARE_SET [""]    "section.key=value ..." applied to flowmoe and the peer alike
#   FLOWMOE_SET [""]    "section.key=value ..." applied to flowmoe alone (precision.param_dtype=f32: its
#                       weights kept in f32 and cast at each use; PEER_MODES="" then runs no peer)
#   PYTHON [python3]    the Python with torch (2.8 or later for torch._grouped_mm)
#   OUT [out]           logs and run directories go under OUT/peer_compare/<config name>/
#   CHECKPOINT_DIR [""] where flowmoe writes the final checkpoint it always writes (removed after
#                       each run; default: the run directory). gpu_moe_wide's is 22 GB: a tmpfs
#                       such as /dev/shm, where it has the room, saves the disk write.
# The learning-rate warmup is stretched over each run, so the routers stay near their start on both
# sides. Exit status: 0 when every run gave a number, 1 otherwise, 2 for a usage error.
set -euo pipefail

usage() {  # the comment block above
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 2
}
[ $# -ge 2 ] || usage
build=$1
config=$2
shift 2
recipes=("$@")
[ ${#recipes[@]} -gt 0 ] || recipes=(bf16)

here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
python=${PYTHON:-python3}
flowmoe_steps=${FLOWMOE_STEPS:-30}
flowmoe_skip=${FLOWMOE_SKIP:-10}
peer_warmup=${PEER_WARMUP:-10}
peer_steps=${PEER_STEPS:-20}
read -r -a peer_modes <<<"${PEER_MODES-compiled eager}"  # set but empty: no peer
peer_experts=${PEER_EXPERTS:-grouped_mm}
read -r -a extra <<<"${COMPARE_SET:-}"
read -r -a flowmoe_extra <<<"${FLOWMOE_SET:-}"
read -r -a peer_args <<<"${PEER_ARGS:-}"

die() {
  echo "peer_compare: error: $*" >&2
  exit "${2:-1}"
}
[ -x "$build/flowmoe" ] || die "$build/flowmoe not found: build flowmoe first (cmake --build $build)" 2
[ -f "$config" ] || die "config '$config' not found" 2
[ "$flowmoe_skip" -lt "$flowmoe_steps" ] || die "FLOWMOE_SKIP ($flowmoe_skip) must be less than FLOWMOE_STEPS ($flowmoe_steps)" 2
command -v "$python" >/dev/null || die "'$python' not found (set PYTHON to a Python with torch)"
if ! "$python" -c 'import torch' 2>/dev/null; then
  die "$python cannot import torch: install PyTorch (pip install torch) or set PYTHON to a Python that has it"
fi
"$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' ||
  die "torch ($("$python" -c 'import torch; print(torch.__version__)')) sees no CUDA device: this comparison runs on a GPU"

# shellcheck source=scripts/train_run.sh disable=SC1091
. "$root/scripts/train_run.sh"

name=$(basename "$config")
name=${name%.*}
out="${OUT:-out}/peer_compare/$name"
mkdir -p "$out"
sets=()
for kv in "${extra[@]}"; do sets+=(--set "$kv"); done
flowmoe_sets=()
for kv in "${flowmoe_extra[@]}"; do flowmoe_sets+=(--set "$kv"); done

# Averages a flowmoe run's metrics.jsonl over the steps after the skipped ones; prints
# "tokens_per_s=... peak_gib=... step_ms=... moe_max_over_mean=..." (the resolved config.yaml beside
# it gives the tokens per step, read with torch_peer.py's reader).
flowmoe_summary() {
  "$python" - "$1" "$flowmoe_skip" "$here" <<'EOF'
import json, os, sys
run_dir, skip, bench = sys.argv[1], int(sys.argv[2]), sys.argv[3]
sys.path.insert(0, bench)
from torch_peer import load_config
cfg = load_config(os.path.join(run_dir, "config.yaml"), [], "builtin", check=False)  # any model flowmoe ran
tokens_per_step = cfg["train"]["batch_size"] * cfg["data"]["seq_len"] * cfg["train"]["grad_accum_steps"]
rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
timed = [r for r in rows if r["step"] > skip and r.get("tokens_per_s")]
if not timed:
    sys.exit(f"{run_dir}: no metrics rows after step {skip}")
seconds = sum(tokens_per_step / r["tokens_per_s"] for r in timed)
peak = max(r["peak_mem_bytes"] for r in timed) / 2**30
loads = [x for r in timed for x in (r.get("moe_max_over_mean") or []) if x is not None]
line = (f"tokens_per_s={tokens_per_step * len(timed) / seconds:.1f} peak_gib={peak:.3f} "
        f"step_ms={seconds / len(timed) * 1e3:.2f} steps={len(timed)}")
if loads:
    line += f" moe_max_over_mean={sum(loads) / len(loads):.3f}"
print(line)
EOF
}

# value KEY LINE: the value of KEY=... in a BENCH line.
value() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<" $2"; }

failed=0
flowmoe_count=""
declare -A flowmoe_line
for recipe in "${recipes[@]}"; do
  run_dir="$out/flowmoe_$recipe"
  log="$out/flowmoe_$recipe.log"
  rm -rf "$run_dir"
  echo "flowmoe $recipe: $flowmoe_steps steps of $config (log $log)"
  ckpt=()
  [ -z "${CHECKPOINT_DIR:-}" ] || ckpt=(--set checkpoint.dir="$CHECKPOINT_DIR/peer_compare_${name}_$recipe")
  rc=0
  train_run "$build" "$config" "$run_dir" "$log" --set train.steps="$flowmoe_steps" \
    --set optimizer.warmup_steps="$flowmoe_steps" --set precision.recipe="$recipe" \
    --set train.eval_batches=1 "${ckpt[@]}" "${sets[@]}" "${flowmoe_sets[@]}" || rc=$?
  [ -z "${CHECKPOINT_DIR:-}" ] || rm -rf "$CHECKPOINT_DIR/peer_compare_${name}_$recipe"
  if [ $rc -ne 0 ]; then
    echo "flowmoe $recipe: FAILED (exit $rc); the end of its log:"
    tail -5 "$log"
    flowmoe_line[$recipe]="FAILED"
    failed=1
    continue
  fi
  count_line=$(grep -m1 '^flowmoe: .* parameters' "$log" || true)
  echo "$count_line"
  flowmoe_count=$(cut -d' ' -f2 <<<"$count_line")
  if ! flowmoe_line[$recipe]=$(flowmoe_summary "$run_dir"); then
    flowmoe_line[$recipe]="FAILED"
    failed=1
  fi
done

declare -A peer_line
for mode in "${peer_modes[@]}"; do
  log="$out/peer_$mode.log"
  echo "torch peer $mode: $peer_warmup + $peer_steps steps (log $log)"
  rc=0
  "$python" "$here/torch_peer.py" --config "$config" --mode "$mode" --experts "$peer_experts" \
    --warmup "$peer_warmup" --steps "$peer_steps" --set optimizer.warmup_steps=$((peer_warmup + peer_steps)) \
    "${sets[@]}" "${peer_args[@]}" >"$log" 2>&1 || rc=$?
  line=$(grep '^BENCH ' "$log" | tail -1 || true)
  if [ $rc -ne 0 ] || [ -z "$line" ]; then
    echo "torch peer $mode: FAILED (exit $rc); the end of its log:"
    tail -5 "$log"
    peer_line[$mode]="FAILED"
    failed=1
    continue
  fi
  grep '^torch_peer: ' "$log" | sed 's/^/  /'
  peer_line[$mode]=${line#BENCH }
done

# The same model on both sides: flowmoe's printed count against the peer's, in flowmoe's format.
peer_count=""
for mode in "${peer_modes[@]}"; do
  [ "${peer_line[$mode]}" = FAILED ] || peer_count=$(value params "${peer_line[$mode]}")
done
if [ -n "$flowmoe_count" ] && [ -n "$peer_count" ]; then
  shown=$("$python" -c "import sys; sys.path.insert(0, sys.argv[1]); from torch_peer import format_count; print(format_count(int(sys.argv[2])))" "$here" "$peer_count")
  if [ "$shown" != "$flowmoe_count" ]; then
    echo "peer_compare: warning: flowmoe prints $flowmoe_count parameters, the peer holds $peer_count ($shown): not the same model"
    failed=1
  fi
fi

# The summary: ratios against the compiled peer, where it ran.
ref=""
if [ -n "${peer_line[compiled]:-}" ] && [ "${peer_line[compiled]}" != FAILED ]; then
  ref=$(value tokens_per_s "${peer_line[compiled]}")
fi
ratio() {
  if [ -n "$ref" ]; then
    awk -v a="$1" -v b="$ref" 'BEGIN { printf "%.3f", a / b }'
  else
    echo nan
  fi
}
echo
for recipe in "${recipes[@]}"; do
  line=${flowmoe_line[$recipe]}
  if [ "$line" = FAILED ]; then
    echo "BENCH peer=flowmoe recipe=$recipe config=$name FAILED"
    continue
  fi
  echo "BENCH peer=flowmoe recipe=$recipe config=$name $line ratio_vs_peer_compiled=$(ratio "$(value tokens_per_s "$line")")"
done
for mode in "${peer_modes[@]}"; do
  line=${peer_line[$mode]}
  if [ "$line" = FAILED ]; then
    echo "BENCH peer=torch mode=$mode config=$name FAILED"
  elif [ "$mode" = compiled ]; then
    echo "BENCH $line"
  else
    echo "BENCH $line ratio_vs_peer_compiled=$(ratio "$(value tokens_per_s "$line")")"
  fi
done
exit $failed
