#!/usr/bin/env python3
"""`flowmoe export --format hf` against transformers itself (CPU, f32).

For four small models (an MoE with a dense first layer, shared experts and group-limited routing trained on
BPE tokens; an MoE without shared experts, with tied embeddings and top-1 routing trained on bytes; the first
with multi-head latent attention and an MTP module, exported as deepseek_v3; a latent-attention one with a direct
query projection, q_lora_rank null), it trains a few steps with the built `flowmoe`, exports the checkpoint and
checks that
  - AutoModelForCausalLM.from_pretrained loads the folder with no missing, unexpected or mismatched tensors;
  - its logits on a text sample equal flowmoe's (tests/interop/hf_reference.cpp) within 1e-4 relative;
  - AutoTokenizer's encoding of the sample equals flowmoe's (prepare-data --tokenizer);
  - the folder transformers saves back (save_pretrained) imports with `flowmoe import --format hf` into a
    checkpoint whose logits are transformers' too.
Exit status 77 (CTest's SKIP_RETURN_CODE) with one line when transformers or torch cannot be imported:
scripts/install_interop_deps.sh installs the pinned versions.
  check_hf_export.py --flowmoe BUILD/flowmoe --reference BUILD/hf_reference --work DIR
"""
import argparse
import pathlib
import shutil
import struct
import subprocess
import sys

SKIP = 77
TOLERANCE = 1e-4

# Words, digits, punctuation, runs of spaces and newlines, and UTF-8 letters: every branch of the word split.
SAMPLE = ("The quick brown fox jumps over 12 lazy dogs, again and again!  Naïve café owners   count 3.14159 "
          "coins\n\n\tthen sleep... Über-fast résumé writing (2024) isn't hard:  x = y + 42;\n")

MODELS = {
    "moe_bpe": {
        "bpe_vocab": 320,
        "yaml": """model: {vocab_size: 336, hidden_size: 64, num_hidden_layers: 3, num_attention_heads: 4,
  intermediate_size: 96, max_position_embeddings: 256, rope_theta: 5000.0, rms_norm_eps: 1.0e-5,
  n_routed_experts: 8, n_shared_experts: 1, num_experts_per_tok: 2, moe_intermediate_size: 32,
  first_k_dense_replace: 1, n_group: 2, topk_group: 1, routed_scaling_factor: 2.5, bias_update_rate: 0.05}
data: {source: tokens, path: DATA, seq_len: 32, val_fraction: 0.0}
""",
    },
    "moe_bytes_tied": {
        "bpe_vocab": 0,
        "yaml": """model: {vocab_size: 256, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2,
  intermediate_size: 64, max_position_embeddings: 256, tie_word_embeddings: true,
  n_routed_experts: 4, n_shared_experts: 0, num_experts_per_tok: 1, moe_intermediate_size: 16,
  first_k_dense_replace: 0, bias_update_rate: 0.05}
data: {source: text, path: TEXT, seq_len: 32, val_fraction: 0.0}
""",
    },
    "mla_mtp_bpe": {
        "bpe_vocab": 320,
        "yaml": """model: {vocab_size: 336, hidden_size: 64, num_hidden_layers: 3, num_attention_heads: 4,
  attention: mla, q_lora_rank: 24, kv_lora_rank: 16, qk_nope_head_dim: 12, qk_rope_head_dim: 8, v_head_dim: 10,
  intermediate_size: 96, max_position_embeddings: 256, rope_theta: 5000.0, rms_norm_eps: 1.0e-5,
  n_routed_experts: 8, n_shared_experts: 1, num_experts_per_tok: 2, moe_intermediate_size: 32,
  first_k_dense_replace: 1, n_group: 2, topk_group: 1, routed_scaling_factor: 2.5, bias_update_rate: 0.05,
  num_nextn_predict_layers: 1}
data: {source: tokens, path: DATA, seq_len: 32, val_fraction: 0.0}
""",
    },
    "mla_direct_q_bytes": {
        "bpe_vocab": 0,
        "yaml": """model: {vocab_size: 256, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2,
  attention: mla, q_lora_rank: null, kv_lora_rank: 12, qk_nope_head_dim: 6, qk_rope_head_dim: 4, v_head_dim: 8,
  intermediate_size: 64, max_position_embeddings: 256, n_routed_experts: 4, n_shared_experts: 1,
  num_experts_per_tok: 2, moe_intermediate_size: 16, first_k_dense_replace: 1, bias_update_rate: 0.05}
data: {source: text, path: TEXT, seq_len: 32, val_fraction: 0.0}
""",
    },
}
TRAIN = """train: {device: cpu, steps: 6, batch_size: 4, eval_every: 0}
optimizer: {lr: 0.01, warmup_steps: 1}
logging: {progress: plain, out_dir: OUT}
"""


def run(cmd):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        sys.exit(f"FAIL: {' '.join(map(str, cmd))} exited {r.returncode}:\n{r.stdout}{r.stderr}")
    return r.stdout


def read_tokens(path):
    data = pathlib.Path(path).read_bytes()
    count = struct.unpack_from("<i", data, 8)[0]
    return list(struct.unpack_from(f"<{count}H", data, 256 * 4))


def corpus_text():
    words = SAMPLE.split() + ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "über", "naïve", "1234"]
    lines = []
    for i in range(400):
        line = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(8 + i % 5))
        lines.append(line + ("  " if i % 3 == 0 else "") + ("!" if i % 4 == 0 else "."))
    return "\n".join(lines) + "\n" + SAMPLE


def relative_error(a, b):
    return float((a - b).norm() / b.norm()), float((a - b).abs().max() / b.abs().max())


def check(name, spec, args, torch, transformers):
    work = args.work / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    text = work / "corpus.txt"
    text.write_text(corpus_text(), encoding="utf-8")
    sample = work / "sample.txt"
    sample.write_text(SAMPLE, encoding="utf-8")
    data = work / "data.bin"
    if spec["bpe_vocab"]:
        run([args.flowmoe, "prepare-data", "--bpe-vocab", spec["bpe_vocab"], "--output", data, text])
    config = work / "model.yaml"
    config.write_text(spec["yaml"].replace("DATA", str(data)).replace("TEXT", str(text)) +
                      TRAIN.replace("OUT", str(work / "run")))
    run([args.flowmoe, "train", "--config", config])
    checkpoint = work / "run" / "checkpoints" / "step_00000006"
    hf = work / "hf"
    print(run([args.flowmoe, "export", "--format", "hf", checkpoint, hf]), end="")

    # The sample's tokens as flowmoe makes them, and flowmoe's logits on them.
    sample_tokens = work / "sample.bin"
    bpe = ["--tokenizer", data.with_suffix(".bpe")] if spec["bpe_vocab"] else []
    run([args.flowmoe, "prepare-data", *bpe, "--output", sample_tokens, sample])
    tokens = read_tokens(sample_tokens)
    run([args.reference, checkpoint, sample_tokens, work / "flowmoe.f32"])
    vocab = transformers.AutoConfig.from_pretrained(hf).vocab_size
    ours = torch.frombuffer(bytearray((work / "flowmoe.f32").read_bytes()), dtype=torch.float32).view(-1, vocab)

    model, info = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        sys.exit(f"FAIL {name}: from_pretrained({hf}): {bad}")
    model.eval()
    with torch.no_grad():
        theirs = model(torch.tensor([tokens])).logits[0].float()
    norm, peak = relative_error(theirs, ours)
    print(f"{name}: {type(model).__name__} loaded with no missing/unexpected/mismatched tensors; logits "
          f"[{len(tokens)}, {vocab}] relative error {norm:.2e} (norm), {peak:.2e} (max)")
    if not norm <= TOLERANCE or not peak <= TOLERANCE:
        sys.exit(f"FAIL {name}: logits differ from flowmoe's by more than {TOLERANCE}")

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    encoded = tokenizer(SAMPLE, add_special_tokens=False)["input_ids"]
    if encoded != tokens:
        first = next((i for i, (a, b) in enumerate(zip(encoded, tokens)) if a != b), min(len(encoded), len(tokens)))
        sys.exit(f"FAIL {name}: {type(tokenizer).__name__} encodes the sample as {len(encoded)} tokens, flowmoe "
                 f"as {len(tokens)}; first difference at {first}: {encoded[first:first + 5]} vs {tokens[first:first + 5]}")
    if tokenizer.decode(encoded) != SAMPLE:
        sys.exit(f"FAIL {name}: the tokenizer does not decode the sample back")
    print(f"{name}: {type(tokenizer).__name__} encodes the {len(SAMPLE)}-character sample as flowmoe does "
          f"({len(tokens)} tokens) and decodes it back")

    # The other way: the folder transformers saves, imported, gives transformers' logits.
    saved = work / "saved"
    model.save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    imported = work / "imported"
    print(run([args.flowmoe, "import", "--format", "hf", saved, "--config-out", work / "imported.yaml",
               "--checkpoint-dir", imported]), end="")
    run([args.reference, imported / "step_00000000", sample_tokens, work / "imported.f32"])
    back = torch.frombuffer(bytearray((work / "imported.f32").read_bytes()), dtype=torch.float32).view(-1, vocab)
    norm, peak = relative_error(back, theirs)
    saved_files = sorted(p.name for p in saved.iterdir())
    print(f"{name}: save_pretrained's folder ({', '.join(saved_files)}) imported; logits relative error "
          f"{norm:.2e} (norm), {peak:.2e} (max)")
    if not norm <= TOLERANCE or not peak <= TOLERANCE:
        sys.exit(f"FAIL {name}: the imported model's logits differ from transformers' by more than {TOLERANCE}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--flowmoe", type=pathlib.Path, required=True)
    ap.add_argument("--reference", type=pathlib.Path, required=True)
    ap.add_argument("--work", type=pathlib.Path, required=True)
    args = ap.parse_args()
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"SKIP: {e} (scripts/install_interop_deps.sh installs the pinned transformers and torch)")
        return SKIP
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    torch.manual_seed(0)
    for name, spec in MODELS.items():
        check(name, spec, args, torch, transformers)
    print("hf interop: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
