#!/usr/bin/env bash
# The FP8 loss-parity study of docs/PARITY.md on one GPU, on configs/parity_text.yaml (real text;
# scripts/prepare_text_corpus.sh writes its token file). Each part is one `flowmoe parity` (or
# `flowmoe fp8-error`) and writes under $OUT (default out/parity_text):
#   main       bf16 (reference), fp8_blockwise, fp8_flow and a bf16 control (AdamW eps doubled: the
#              noise floor), STEPS steps (default: the config's 2000)
#   recompute  the same recipes with train.recompute=[moe_expert]; each curve must equal its run in
#              main bit for bit (recompute re-runs fc1 -> SwiGLU exactly): checked when main is there,
#              else by the part check once it is (the two may run at once, on two GPUs)
#   fp8error   flowmoe fp8-error on fp8_flow's final checkpoint: the wgrad error of the scaling-aware
#              transpose against double quantization, on the run's own activations and gradients
#   ep         the study under mpirun -np 2 at expert-parallel size 2, both ranks on this one GPU
#              through the mpi backend's host staging (slow: EP_STEPS steps of EP_BATCH sequences),
#              and the same settings in one process: the verdicts must agree
#   ep4        the whole study under mpirun -np 4 at expert-parallel size 4 over nccl: four GPUs
#   band       the study with a noise band (configs/parity_text_16k.yaml, 16384 tokens per step): bf16, both
#              FP8 recipes and 3 bf16 controls with AdamW's eps x2, x3, x4, EMA 0.99, data parallel over
#              BAND_NP GPUs (default 4)
#   band_ep4   the same at expert-parallel size 4 over nccl (4 GPUs), with the layout control (bf16 at
#              expert-parallel size 1) as a fourth control
#   band_again the band study with another initialization and data order (train.seed 43, data.seed 1235):
#              its verdicts must be band's
#   band_seed  the band study with 3 controls of another initialization each (train.seed 43, 44, 45): the
#              band of a different model, the upper end of what a recipe may move
#   scripts/parity_text.sh BUILD_DIR [main] [recompute] [fp8error] [ep] [ep4] [band] [band_ep4] [band_again]
#                          [band_seed] [check]
#   (default: the first four)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
build=${1:?usage: scripts/parity_text.sh BUILD_DIR [main] [recompute] [fp8error] [ep] [ep4] [band] [band_ep4] [band_again] [band_seed] [check]}
shift
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(main recompute fp8error ep)
out="${OUT:-out/parity_text}"
config=configs/parity_text.yaml
mkdir -p "$out"
steps=()
[ -n "${STEPS:-}" ] && steps=(--steps "$STEPS")
rc=0
# shellcheck source=scripts/multi_gpu_env.sh
. scripts/multi_gpu_env.sh
# parity NAME NP [args...]: one study into $out/NAME, by NP processes under mpirun (1: the plain
# command), its summary lines printed; a study under mpirun that runs past TIMEOUT s (default 3000) fails.
parity() {
  local name=$1 np=$2 launch=()
  shift 2
  [ "$np" -gt 1 ] && launch=(timeout -k "$kill_after" "${TIMEOUT:-3000}" mpirun --oversubscribe --bind-to none -np "$np")
  "${launch[@]}" "$build/flowmoe" parity --config "$config" --out "$out/$name" --set logging.progress=plain "$@" \
    >"$out/$name.log" 2>&1
  local r=$?
  echo "== $name ($np process(es), exit $r)"
  grep -E '^(parity:|.* vs .*: max EMA rel err|casts per MoE layer)' "$out/$name.log"
  # 0, 1 and 4 are verdicts (docs/TRAINING.md, Loss parity); anything else is a study that failed.
  case $r in
    0 | 1 | 4) ;;
    *) tail -20 "$out/$name.log"; rc=1 ;;
  esac
  return 0
}
same_losses() {  # same_losses DIR_A DIR_B: every logged loss bit for bit
  python3 - "$1/metrics.jsonl" "$2/metrics.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p) if l.strip()] for p in sys.argv[1:3])
print("identical (%d steps)" % len(a) if a == b and a else "DIFFERENT (%d vs %d steps)" % (len(a), len(b)))
PY
}
for part in "${parts[@]}"; do
  case $part in
    main) parity main 1 "${steps[@]}" --control eps ;;
    recompute)
      parity recompute 1 "${steps[@]}" --set 'train.recompute=[moe_expert]'
      rm -rf "$out"/recompute/*/checkpoints
      [ -s "$out/main/parity.json" ] && { scripts/parity_text.sh "$build" check || rc=1; } ;;
    check)
      for r in bf16 fp8_blockwise fp8_flow; do
        verdict=$(same_losses "$out/main/$r" "$out/recompute/$r")
        echo "recompute $r vs no recompute: $verdict"
        case $verdict in identical*) ;; *) rc=1 ;; esac
      done ;;
    fp8error)
      ckpt=$(ls -d "$out"/main/fp8_flow/checkpoints/step_* 2>/dev/null | tail -1)
      if [ -z "$ckpt" ]; then echo "fp8-error: no fp8_flow checkpoint under $out/main"; rc=1; continue; fi
      "$build/flowmoe" fp8-error --config "$config" --checkpoint "$ckpt" --batches "${FP8_ERROR_BATCHES:-2}" \
        --json "$out/fp8_error.json" | tee "$out/fp8_error.txt" || rc=1 ;;
    ep)
      ep_sets=(--steps "${EP_STEPS:-150}" --warmup-steps 30 --set train.batch_size="${EP_BATCH:-4}"
               --set optimizer.warmup_steps=30 --set train.eval_every=0 --set checkpoint.every=0 --set logging.log_every=10)
      parity ep_np1 1 "${ep_sets[@]}"
      parity ep_np2 2 "${ep_sets[@]}" --set parallel.backend=mpi --set parallel.expert_parallel_size=2 ;;
    ep4) parity ep4 4 "${steps[@]}" --set parallel.backend=nccl --set parallel.expert_parallel_size=4 ;;
    band | band_ep4 | band_again | band_seed)
      control=eps
      [ "$part" = band_seed ] && control=seed
      band_args=("${steps[@]}" --controls 3 --control "$control" --ema-alpha 0.99)
      [ "$part" = band_ep4 ] && band_args+=(--layout-control --set parallel.backend=nccl
                                           --set parallel.expert_parallel_size=4)
      [ "$part" = band_again ] && band_args+=(--set train.seed=43 --set data.seed=1235)
      np=${BAND_NP:-4}
      [ "$part" = band_ep4 ] && np=4
      config=configs/parity_text_16k.yaml parity "$part" "$np" "${band_args[@]}"
      rm -rf "$out/$part"/*/checkpoints ;;
    *) echo "unknown part '$part' (main, recompute, fp8error, ep, ep4, band, band_ep4, band_again, band_seed, check)"
       exit 2 ;;
  esac
done
exit $rc
