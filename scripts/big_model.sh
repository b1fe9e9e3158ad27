#!/usr/bin/env bash
# A model one GPU cannot hold (configs/gpu_moe_deep.yaml: DeepSeek-V2-Lite's layer shape, 6.0B
# parameters at 11 layers), trained at expert parallelism N on this machine's N GPUs, 8 sequences of
# 2048 tokens per GPU, in bf16 and in fp8_flow. Prints one "big_model ..." line per recipe:
#   tokens/s per GPU   the median of the steps after the first third
#   MFU                model FLOPs per token x tokens/s per GPU over 989 TFLOP/s (the H100/H200 SXM
#                      bf16 dense peak); model FLOPs = 6 x the parameters a token uses (its dense
#                      weights, k routed experts and the shared ones; the embedding lookup left out)
#                      + 6 x layers x seq_len x hidden for attention's two matrix products, causal halved
#   memory             peak tensor memory per GPU, and the start-up estimate
# and the fp8_flow / bf16 ratio. Every launch has a time limit.
#   scripts/big_model.sh BUILD_DIR OUT_DIR      LAYERS (default: the config's), STEPS (20), TIMEOUT (500 s a run)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=scripts/multi_gpu_env.sh
. scripts/multi_gpu_env.sh
take_build_and_out "scripts/big_model.sh BUILD_DIR OUT_DIR" "$@"
skip_below_two_gpus "big_model"
config=configs/gpu_moe_deep.yaml
steps=${STEPS:-20}
sets=(--set train.steps="$steps" --set optimizer.warmup_steps=3 --set train.eval_every=0 --set checkpoint.every=0
      --set checkpoint.final=false --set logging.progress=plain --set logging.log_every=5
      --set train.batch_size=$((8 * ngpu)) --set parallel.expert_parallel_size="$ngpu" --set parallel.backend=nccl)
[ -n "${LAYERS:-}" ] && sets+=(--set model.num_hidden_layers="$LAYERS")
rc=0
for recipe in bf16 fp8_flow; do
  name="deep_${recipe}"
  if timeout -k "$kill_after" "${TIMEOUT:-500}" mpirun --oversubscribe --bind-to none -np "$ngpu" \
       "$build/flowmoe" train --config "$config" \
       "${sets[@]}" --set precision.recipe=$recipe --set logging.out_dir="$out/$name" >"$out/$name.log" 2>&1; then
    python3 - "$out/$name" "$out/$name.log" "$ngpu" "$recipe" <<'PY'
import json, re, statistics, sys
d, log, n, recipe = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
cfg, section = {}, None  # the resolved config.yaml: "section:" lines, then "  key: value"
for line in open(d + "/config.yaml"):
    if re.match(r"^[a-z_]+:\s*$", line):
        section = cfg.setdefault(line.split(":")[0], {})
    elif section is not None and re.match(r"^  [a-z_]+: ", line):
        key, value = line.strip().split(": ", 1)
        section[key] = int(value) if re.fullmatch(r"-?[0-9]+", value) else value
m = cfg["model"]
h, L, T = m["hidden_size"], m["num_hidden_layers"], cfg["data"]["seq_len"]
attn = 4 * h * h
dense_mlp = 3 * h * m["intermediate_size"]
expert = 3 * h * m["moe_intermediate_size"]
moe_layers = L - m["first_k_dense_replace"]
active = (L * attn + m["first_k_dense_replace"] * dense_mlp
          + moe_layers * (m["num_experts_per_tok"] + m["n_shared_experts"]) * expert + moe_layers * h * m["n_routed_experts"]
          + h * m["vocab_size"])  # the LM head
total = (L * attn + m["first_k_dense_replace"] * dense_mlp
         + moe_layers * (m["n_routed_experts"] + m["n_shared_experts"]) * expert + 2 * h * m["vocab_size"])
flops_per_token = 6 * active + 6 * L * T * h  # causal attention: 12 L T h halved
rows = [json.loads(l) for l in open(d + "/metrics.jsonl") if l.strip()]
late = rows[len(rows) // 3:]
tps = statistics.median(r["tokens_per_s"] for r in late) / n
mfu = flops_per_token * tps / 989e12
peak = max(r["peak_mem_bytes"] for r in rows) / 2**30
est = re.search(r"memory: (about [0-9.]+ \S+)", open(log).read())
print("big_model %s: %.2fB parameters (%d layers), EP %d on %d GPUs: %.1fk tok/s per GPU, MFU %.3f, peak %.1f GiB per GPU "
      "(estimate %s)" % (recipe, total / 1e9, L, n, n, tps / 1e3, mfu, peak, est.group(1) if est else "-"))
open(d + "/tps.txt", "w").write("%.3f\n" % tps)
PY
  else
    echo "big_model $recipe: FAILED (exit $?, see $name.log)"; tail -3 "$out/$name.log"; rc=1
    pkill -KILL -f "$build/flowmoe train" 2>/dev/null  # a rank that outlived the time limit holds its GPU
  fi
done
if [ -s "$out/deep_bf16/tps.txt" ] && [ -s "$out/deep_fp8_flow/tps.txt" ]; then
  echo "big_model fp8_flow / bf16: $(python3 -c "print('%.2fx' % (float(open('$out/deep_fp8_flow/tps.txt').read()) / float(open('$out/deep_bf16/tps.txt').read())))")"
fi
exit $rc
