#!/usr/bin/env python3
"""The PyTorch speed peer of `flowmoe train`: the same model, trained the way a PyTorch user would.

It reads a flowmoe YAML config and builds the model flowmoe builds from it, with the same shapes
and the same parameter count:
  layers/model_config.h         the model keys (Hugging Face DeepSeek-V3 names) and their defaults
  layers/transformer.{h,cpp}    embedding, blocks of RMSNorm -> attention -> residual, RMSNorm ->
                                MLP or MoE -> residual, final RMSNorm, untied LM head (tied when
                                tie_word_embeddings), cross-entropy; blocks < first_k_dense_replace
                                stay dense
  layers/attention.{h,cpp}      MHA, q/k/v/o [H, H] without biases, RoPE on interleaved pairs
                                (kernels/cpu/rope.cpp)
  layers/mlp.{h,cpp}            the SwiGLU MLP: down(silu(gate(x)) * up(x))
  layers/moe.{h,cpp}            the DeepSeek-V3 MoE block: router gate [E, H] in fp32, experts
                                fc1 [E, 2F, H] (gate rows, then up rows) and fc2 [E, H, F], shared
                                experts as one SwiGLU MLP of width n_shared_experts * F; tokens
                                permuted into expert segments padded to precision.align_size rows,
                                probabilities applied at the combine in fp32
  engine/ops/router.cpp,        sigmoid or softmax scores; group-limited top-k (group score: the sum
  kernels/cpu/router.cpp        of the group's two best biased scores; topk_group groups kept); the
                                aux-loss-free expert bias added for the selection only;
                                norm_topk_prob (sum + 1e-20) and routed_scaling_factor; the
                                sequence-wise balance loss aux_loss_alpha * L_Bal; the bias update
                                after each step (sign or proportional rule, constant or lr schedule)
  train/optimizer.cpp           AdamW with decay on matrices only, the router's lr scaled by
                                optimizer.router_lr_scale, linear warmup then cosine to min_lr,
                                clipping of the global gradient norm at optimizer.grad_clip
  train/memory_estimate.cpp     the parameter count (checked against the built module)

The training step is written for speed as a Megatron or llm.c user would write it in plain
PyTorch: fp32 master weights under torch.autocast(bfloat16), torch.compile of the model (default
mode; --mode eager skips it), F.scaled_dot_product_attention(is_causal=True), the experts as two
bf16 grouped GEMMs (torch._grouped_mm over the expert-sorted, padded rows, int32 offsets) or, with
--experts loop, one GEMM per expert; torch.optim.AdamW(fused=True). The data are random token ids
(a fixed seed): a speed peer's data do not matter.

Where the peer differs from flowmoe's step (none of it changes the work by more than a few rows):
  - the routed experts compute in bf16 whatever precision.recipe says: the FP8 recipes are
    flowmoe's own, so they are compared against this bf16 peer;
  - AdamW's moments stay f32 (torch's fused AdamW keeps them in the masters' dtype) whatever
    optimizer.moment_dtype says;
  - an expert that gets no tokens still computes align_size zero rows (see MoeLayer.forward);
  - the weights start from torch's RNG (the same distributions, not flowmoe's bits), and top-k
    ties go wherever torch.topk puts them (flowmoe: the lower expert id);
  - no host reads inside a step: flowmoe reads the loss and the gradient norm every step for its
    metrics and its train.nonfinite policy; the peer has no such policy and reads nothing;
  - no evaluation, checkpoints or metrics files.

It times --steps steps after --warmup steps (torch.compile compiles in the first of them), between
two torch.cuda.synchronize() calls, and prints the parameter count as flowmoe does, then one line
    BENCH peer=torch mode=compiled config=gpu_moe tokens_per_s=... peak_gib=... params=... step_ms=...
where tokens_per_s = steps * batch_size * grad_accum_steps * seq_len / seconds and peak_gib is
torch.cuda.max_memory_allocated() over the timed steps (the process's peak RSS on the CPU).
bench/peer_compare.sh runs it beside `flowmoe train` on the same GPU.

  python3 bench/torch_peer.py --config configs/gpu_moe.yaml                   compiled, grouped_mm
  python3 bench/torch_peer.py --config configs/gpu_moe.yaml --mode eager
  python3 bench/torch_peer.py --config configs/gpu_moe_wide.yaml --compile-mode max-autotune
  python3 bench/torch_peer.py --config configs/tiny_moe.yaml --device cpu --mode eager \\
      --experts loop --warmup 1 --steps 3
  python3 bench/torch_peer.py --config configs/gpu_moe.yaml --set train.batch_size=16 --print-config

The config is read with PyYAML when it is installed, else with a small reader of the two-level
`section: / key: value` form flowmoe's configs use (--yaml builtin forces it). Python is optional
tooling here: flowmoe itself needs none.
"""

import argparse
import json
import math
import os
import resource
import sys
import time

# ---- the config ------------------------------------------------------------------------------------

# Every key flowmoe's config schema knows (config/config_schema.cpp) with its default (config/config.h,
# layers/model_config.h). The peer uses the model, data.seq_len, train and optimizer keys and
# precision.align_size; the others are accepted so that any flowmoe config loads, and an unknown key
# is refused as flowmoe refuses it.
DEFAULTS = {
    "model": {
        "vocab_size": 256,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 384,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "n_routed_experts": 0,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "first_k_dense_replace": 0,
        "n_group": 1,
        "topk_group": 1,
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "aux_loss_alpha": 0.0,
        "bias_update_rate": 0.001,
        "bias_update_schedule": "constant",
        "bias_update_rule": "sign",
        "attention": "mha",
        "q_lora_rank": None,  # null, or an integer
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "attention_kernel": "auto",  # flowmoe's GPU kernels only: no effect on the peer's math
        "num_nextn_predict_layers": 0,
    },
    "data": {
        "source": "synthetic",
        "path": "",
        "seq_len": 128,
        "val_fraction": 0.05,
        "seed": 1234,
        "synthetic_tokens": 1 << 20,
        "synthetic_kind": "words",
    },
    "train": {
        "device": "auto",
        "steps": 300,
        "batch_size": 8,
        "grad_accum_steps": 1,
        "eval_every": 100,
        "sample_every": 0,
        "eval_batches": 4,
        "seed": 42,
        "nonfinite": "skip",
        "recompute": [],
        "max_skipped_steps": 10,
        "mtp_loss_weight": 0.3,
        "cuda_graph": "auto",
    },
    "optimizer": {
        "lr": 3e-3,
        "min_lr": 3e-4,
        "warmup_steps": 20,
        "weight_decay": 0.1,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-8,
        "grad_clip": 1.0,
        "router_lr_scale": 1.0,
        "moment_dtype": "f32",
    },
    "precision": {"recipe": "bf16", "align_size": 16, "param_dtype": "auto", "fp8_weights": "optimizer",
                  "fp8_weight_transpose": "stored"},
    "parallel": {"expert_parallel_size": 1, "backend": "auto", "ep_dispatch": "auto",
                 "shared_expert_overlap": "auto", "exchange_chunks": 1, "exchange_sms": 0,
                 "ep_capacity_factor": 0.0, "dual_microbatch": False,
                 "overlap_grad_reduce": True, "grad_reduce_sms": 0,
                 "shard_optimizer": True, "timeout_s": 600.0},
    "checkpoint": {"dir": "", "every": 0, "final": True, "keep_last": 3, "resume": "false",
                   "partial_load": False, "allow_nonfinite": False, "init_from": ""},
    "logging": {"out_dir": "", "metrics_format": "jsonl", "log_every": 10, "progress": "auto"},
}


class ConfigError(Exception):
    pass


def parse_scalar(text):
    """One YAML scalar or flow list as flowmoe's configs write them: 42, 1.0e-6, true, sigmoid,
    'quoted', [moe_expert]."""
    s = text.strip()
    if s.startswith("[") and s.endswith("]"):
        inner = s[1:-1].strip()
        return [parse_scalar(item) for item in inner.split(",")] if inner else []
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        return s[1:-1]
    low = s.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("", "~", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(s)
        except ValueError:
            pass
    return s


def strip_comment(line):
    """The line without a trailing '# comment' (a '#' inside quotes is kept)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
    return line


def read_yaml_builtin(text, path):
    """The two-level maps flowmoe's configs are: `section:` at column 0, then indented `key: value`
    lines, with comments and blank lines anywhere."""
    out, section = {}, None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = strip_comment(raw).rstrip()
        if not line.strip() or line.strip() == "---":
            continue
        where = f"{path}:{lineno}"
        key, sep, value = line.strip().partition(":")
        if not sep:
            raise ConfigError(f"{where}: expected 'key: value', got '{raw.strip()}'")
        if line[0] not in " \t":
            if value.strip():
                raise ConfigError(f"{where}: a top-level key must be a section, got '{raw.strip()}'")
            section = out.setdefault(key.strip(), {})
            continue
        if section is None:
            raise ConfigError(f"{where}: '{key.strip()}' is indented but under no section")
        section[key.strip()] = parse_scalar(value)
    return out


def read_yaml(path, reader):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if reader in ("auto", "pyyaml"):
        try:
            import yaml  # noqa: PLC0415  (optional: the built-in reader covers flowmoe's configs)
        except ImportError:
            if reader == "pyyaml":
                raise ConfigError("--yaml pyyaml: PyYAML is not installed")
        else:
            data = yaml.safe_load(text)
            if not isinstance(data, dict):
                raise ConfigError(f"{path}: the top level must be a mapping of sections")
            return data
    return read_yaml_builtin(text, path)


def set_key(cfg, dotted, value, origin):
    section, _, key = dotted.partition(".")
    if section not in DEFAULTS:
        raise ConfigError(f"{origin}: unknown section '{section}' (one of {', '.join(DEFAULTS)})")
    if key not in DEFAULTS[section]:
        raise ConfigError(f"{origin}: unknown key '{key}' in section '{section}'")
    default = DEFAULTS[section][key]
    if isinstance(value, str) and not isinstance(default, str):
        value = parse_scalar(value)  # PyYAML reads 1e-06 (YAML 1.1: no dot) as a string
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(default, list) and not isinstance(value, list):
        value = [] if value is None else [value]
    if isinstance(default, str) and value is None:
        value = ""
    if default is None:  # model.q_lora_rank: null or an integer
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{origin}: {dotted} expects null or an int, got {value!r}")
        cfg[section][key] = value
        return
    if type(value) is not type(default) and not (isinstance(default, str) and isinstance(value, (int, float))):
        raise ConfigError(f"{origin}: {dotted} expects a {type(default).__name__}, got {value!r}")
    cfg[section][key] = str(value) if isinstance(default, str) else value


def load_config(path, overrides, reader="auto", check=True):
    """DEFAULTS, then the file, then each `--set section.key=value`, as flowmoe applies them; check: refuse what
    this peer cannot build (a reader of flowmoe's own run, such as peer_compare.sh's summary, passes False)."""
    cfg = {s: dict(keys) for s, keys in DEFAULTS.items()}
    for section, keys in (read_yaml(path, reader) or {}).items():
        if not isinstance(keys, dict):
            raise ConfigError(f"{path}: section '{section}' must be a mapping")
        for key, value in keys.items():
            set_key(cfg, f"{section}.{key}", value, path)
    for item in overrides:
        dotted, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item}: expected section.key=value")
        set_key(cfg, dotted.strip(), parse_scalar(value), f"--set {item}")
    if check:
        check_config(cfg)
    return cfg


def check_config(cfg):
    """The checks the model needs before it is built (flowmoe's validation has more)."""
    m = cfg["model"]
    H, nh = m["hidden_size"], m["num_attention_heads"]
    if H % nh or (H // nh) % 2:
        raise ConfigError(f"model.hidden_size {H} with {nh} heads needs an even head size")
    if cfg["data"]["seq_len"] > m["max_position_embeddings"]:
        raise ConfigError("data.seq_len exceeds model.max_position_embeddings")
    if m["attention"] != "mha":
        raise ConfigError("model.attention: this peer has plain multi-head attention only (use mha)")
    if m["num_nextn_predict_layers"] != 0:
        raise ConfigError("model.num_nextn_predict_layers: this peer has no multi-token prediction modules (use 0)")
    E = m["n_routed_experts"]
    if E > 0:
        if E % m["n_group"] or m["topk_group"] > m["n_group"]:
            raise ConfigError("model.n_group must divide n_routed_experts and be >= topk_group")
        if m["num_experts_per_tok"] > m["topk_group"] * (E // m["n_group"]):
            raise ConfigError("model.num_experts_per_tok exceeds the experts in the kept groups")
        if m["scoring_func"] not in ("sigmoid", "softmax"):
            raise ConfigError("model.scoring_func must be sigmoid or softmax")
        if m["bias_update_rule"] not in ("sign", "proportional"):
            raise ConfigError("model.bias_update_rule must be sign or proportional")
    if cfg["precision"]["align_size"] not in (16, 32, 64, 128):
        raise ConfigError("precision.align_size must be 16, 32, 64 or 128")


def num_moe_layers(m):
    if m["n_routed_experts"] <= 0:
        return 0
    return max(0, m["num_hidden_layers"] - m["first_k_dense_replace"])


def expected_parameters(m):
    """flowmoe's count (train/memory_estimate.cpp, parameter_groups): what the module must hold."""
    H, L, V = m["hidden_size"], m["num_hidden_layers"], m["vocab_size"]
    moe = num_moe_layers(m)
    E, F = m["n_routed_experts"], m["moe_intermediate_size"]
    n = (1 if m["tie_word_embeddings"] else 2) * V * H  # embed_tokens, lm_head
    n += (2 * L + 1) * H  # two norms per block and the final one
    n += 4 * L * H * H  # q, k, v, o
    n += 3 * (L - moe) * m["intermediate_size"] * H  # the dense blocks' MLPs
    n += moe * (E * H + E * 3 * F * H + 3 * m["n_shared_experts"] * F * H)  # router, experts, shared
    return n


def format_count(n):
    """As flowmoe prints a parameter count (train/memory_estimate.cpp, format_count)."""
    if n < 1e9:
        return f"{n / 1e6:.2f}M"
    if n < 1e12:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e12:.2f}T"


def learning_rate(o, step, total_steps):
    """train/optimizer.cpp: linear warmup to lr, then a cosine down to min_lr at total_steps."""
    if o["warmup_steps"] > 0 and step <= o["warmup_steps"]:
        return o["lr"] * step / o["warmup_steps"]
    decay_steps = total_steps - o["warmup_steps"]
    if decay_steps <= 0:
        return o["lr"]
    progress = min(1.0, (step - o["warmup_steps"]) / decay_steps)
    return o["min_lr"] + 0.5 * (o["lr"] - o["min_lr"]) * (1.0 + math.cos(math.pi * progress))


# ---- the model -------------------------------------------------------------------------------------
# The classes are made from the torch module that main() imports once the config is read, so the
# config reader and --print-config work where torch is not installed.


def build_model_classes(torch):
    nn, F = torch.nn, torch.nn.functional

    def normal_(p, std):
        nn.init.normal_(p, mean=0.0, std=std)
        return p

    class RMSNorm(nn.Module):
        def __init__(self, hidden, eps):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden))
            self.eps = eps

        def forward(self, x):
            # Statistics in fp32, the output in the stream's dtype (bf16 under autocast), as flowmoe's
            # rmsnorm; elementwise ops are left alone by autocast, so the dtype is explicit here.
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (y * self.weight).to(x.dtype)

    class Mlp(nn.Module):
        def __init__(self, hidden, intermediate, std, out_std):
            super().__init__()
            self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
            self.up_proj = nn.Linear(hidden, intermediate, bias=False)
            self.down_proj = nn.Linear(intermediate, hidden, bias=False)
            normal_(self.gate_proj.weight, std)
            normal_(self.up_proj.weight, std)
            normal_(self.down_proj.weight, out_std)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def rope(x, cos, sin):
        """Rotates the pairs (2i, 2i+1) of each head by position * theta^(-2i/hd) (x [B,T,nh,hd])."""
        pairs = x.unflatten(-1, (-1, 2))
        x0, x1 = pairs[..., 0], pairs[..., 1]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)

    class Attention(nn.Module):
        def __init__(self, m, std, out_std):
            super().__init__()
            H = m["hidden_size"]
            self.num_heads = m["num_attention_heads"]
            self.q_proj = nn.Linear(H, H, bias=False)
            self.k_proj = nn.Linear(H, H, bias=False)
            self.v_proj = nn.Linear(H, H, bias=False)
            self.o_proj = nn.Linear(H, H, bias=False)
            for lin in (self.q_proj, self.k_proj, self.v_proj):
                normal_(lin.weight, std)
            normal_(self.o_proj.weight, out_std)

        def forward(self, x, cos, sin):
            B, T, H = x.shape
            heads = (B, T, self.num_heads, H // self.num_heads)
            cos, sin = cos[:T].to(x.dtype), sin[:T].to(x.dtype)
            q = rope(self.q_proj(x).view(heads), cos, sin)
            k = rope(self.k_proj(x).view(heads), cos, sin)
            v = self.v_proj(x).view(heads)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            return self.o_proj(o.transpose(1, 2).reshape(B, T, H))

    class Weight(nn.Module):
        """Holds one tensor as `.weight`, so the expert weights carry flowmoe's names
        (model.layers.1.mlp.experts.fc1.weight)."""

        def __init__(self, shape, std):
            super().__init__()
            self.weight = nn.Parameter(normal_(torch.empty(shape), std))

    class Experts(nn.Module):
        """The routed experts' weights, as flowmoe lays them out (layers/moe.h)."""

        def __init__(self, E, H, Fw, std, out_std):
            super().__init__()
            self.fc1 = Weight((E, 2 * Fw, H), std)  # gate rows, then up rows
            self.fc2 = Weight((E, H, Fw), out_std)

    def swiglu(h):
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    def experts_grouped_mm(rows, offs, fc1, fc2, recompute):
        """fc1 -> SwiGLU -> fc2 over the expert-sorted rows: two bf16 grouped GEMMs. offs[e] is the
        end row of expert e's segment (int32); the rows after offs[-1] are not computed."""

        def fc1_swiglu(r):
            return swiglu(torch._grouped_mm(r, fc1.transpose(-2, -1), offs=offs))

        if recompute:
            a = torch.utils.checkpoint.checkpoint(fc1_swiglu, rows, use_reentrant=False)
        else:
            a = fc1_swiglu(rows)
        return torch._grouped_mm(a, fc2.transpose(-2, -1), offs=offs)

    @torch.compiler.disable
    def experts_loop(rows, offs, fc1, fc2, recompute):
        """The same with one GEMM per expert, for where torch._grouped_mm is missing. Reads the
        segment ends to the host (one sync per layer, as flowmoe's dispatch does for cuBLASLt);
        kept out of torch.compile, whose graphs would specialize on every segment size."""
        # One unbind, not fc1[e] per expert: each indexing's backward would add a zero-filled
        # gradient of the whole [E, ...] weight, E times per layer.
        w1, w2 = fc1.unbind(0), fc2.unbind(0)
        outs, start = [], 0
        for e, end in enumerate(offs.tolist()):
            if end > start:  # the segments are adjacent: their outputs concatenate into [0, offs[-1])

                def fc1_swiglu(r, e=e):
                    return swiglu(r @ w1[e].t())

                seg = rows[start:end]
                if recompute:
                    a = torch.utils.checkpoint.checkpoint(fc1_swiglu, seg, use_reentrant=False)
                else:
                    a = fc1_swiglu(seg)
                outs.append(a @ w2[e].t())
            start = end
        outs.append(rows.new_zeros(rows.shape[0] - start, fc2.shape[1]))  # the unused tail rows
        return torch.cat(outs)

    class MoeLayer(nn.Module):
        def __init__(self, m, align_size, experts_impl, recompute, std, out_std):
            super().__init__()
            H, E, Fw = m["hidden_size"], m["n_routed_experts"], m["moe_intermediate_size"]
            self.m, self.E, self.k, self.align = m, E, m["num_experts_per_tok"], align_size
            self.experts_impl, self.recompute = experts_impl, recompute
            self.gate = nn.Linear(H, E, bias=False)  # the router: <prefix>.mlp.gate.weight [E, H]
            normal_(self.gate.weight, std)
            self.experts = Experts(E, H, Fw, std, out_std)
            self.shared_experts = Mlp(H, Fw * m["n_shared_experts"], std, out_std) if m["n_shared_experts"] > 0 else None
            # Aux-loss-free balancing: a buffer, not a parameter (HF's name for it).
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(E))

        def route(self, x2, seq_len):
            """-> topk_idx [T,k], topk_prob [T,k] fp32, the balance loss (or None)."""
            m, E, k = self.m, self.E, self.k
            T = x2.shape[0]
            # fp32 router logits, as flowmoe and DeepSeek-V3: the top-k choice is sensitive to rounding.
            with torch.autocast(x2.device.type, enabled=False):
                logits = F.linear(x2.float(), self.gate.weight)
            scores = torch.sigmoid(logits) if m["scoring_func"] == "sigmoid" else logits.softmax(dim=-1)
            with torch.no_grad():
                # The bias steers the choice only; the probabilities come from the unbiased scores.
                key = scores + self.gate.e_score_correction_bias
                G = m["n_group"]
                if G > 1:
                    grouped = key.view(T, G, E // G)
                    best = grouped.topk(min(2, E // G), dim=-1).values.sum(dim=-1)  # [T, G]
                    kept = torch.zeros(T, G, dtype=torch.bool, device=x2.device)
                    kept.scatter_(1, best.topk(m["topk_group"], dim=-1).indices, True)
                    key = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(T, E)
                topk_idx = key.topk(k, dim=-1).indices
            prob = scores.gather(1, topk_idx)
            if m["norm_topk_prob"] and k > 1:
                prob = prob / (prob.sum(dim=-1, keepdim=True) + 1e-20)
            prob = prob * m["routed_scaling_factor"]
            aux = None
            if m["aux_loss_alpha"] > 0:
                # DeepSeek-V3's sequence-wise balance loss: alpha * mean over sequences of
                # sum_e f_e * P_e, f_e = E / (k S) * (copies routed to e), P_e = mean_t s'_{t,e}.
                B = T // seq_len
                p = (scores / scores.sum(dim=-1, keepdim=True)).view(B, seq_len, E).mean(dim=1)
                with torch.no_grad():
                    counts = torch.zeros(B, E, device=x2.device, dtype=torch.float32)
                    counts.scatter_add_(1, topk_idx.view(B, seq_len * k), torch.ones(B, seq_len * k, device=x2.device))
                    f = counts * (E / (k * seq_len))
                aux = m["aux_loss_alpha"] * (f * p).sum(dim=-1).mean()
            return topk_idx, prob, aux

        def forward(self, x):
            B, S, H = x.shape
            x2 = x.reshape(B * S, H)
            T, E, k, a = B * S, self.E, self.k, self.align
            topk_idx, prob, aux = self.route(x2, S)

            # Permute + pad, with static shapes (no host sync, nothing for torch.compile to
            # specialize on): copy (t, j) goes to row seg_start[e] + (its rank among e's copies) of
            # a buffer sized for the worst case, each expert's segment padded to align_size rows
            # (flowmoe's permute_pad, kernels/cpu/permute.cpp). Unlike flowmoe, an expert with no
            # tokens still gets align_size zero rows: torch's CUTLASS grouped GEMM asserts on an
            # empty group in some operand layouts of its backward (GroupMMCommon.cuh), and
            # torchtitan pads the same way.
            with torch.no_grad():
                flat = topk_idx.reshape(-1)
                N = flat.numel()
                counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
                padded = ((counts + (a - 1)) // a * a).clamp_min(a)
                seg_end = padded.cumsum(0)
                seg_start = seg_end - padded
                order = torch.argsort(flat, stable=True)
                sorted_expert = flat[order]
                first = counts.cumsum(0) - counts  # where expert e's copies start in sorted order
                slot = seg_start[sorted_expert] + torch.arange(N, device=x.device) - first[sorted_expert]
                dest = torch.empty_like(flat).scatter_(0, order, slot)  # the buffer row of copy i
                offs = seg_end.to(torch.int32)
            rows_total = N + E * a  # the most the padded segments can take
            copies = x2.unsqueeze(1).expand(T, k, H).reshape(N, H)
            rows = x2.new_zeros(rows_total, H).index_copy(0, dest, copies)

            # fc1 -> SwiGLU -> fc2, each weight cast to the compute dtype once per use, explicitly:
            # torch._grouped_mm wants bf16 operands whatever autocast does with it.
            fc1 = self.experts.fc1.weight.to(x.dtype)
            fc2 = self.experts.fc2.weight.to(x.dtype)
            impl = experts_grouped_mm if self.experts_impl == "grouped_mm" else experts_loop
            out_rows = impl(rows, offs, fc1, fc2, self.recompute)

            # Combine: each token sums its k expert rows weighted by their probabilities, in fp32.
            picked = out_rows.index_select(0, dest).view(T, k, H)
            y = (picked.float() * prob.unsqueeze(-1)).sum(dim=1).to(x.dtype)
            if self.shared_experts is not None:
                y = y + self.shared_experts(x2)
            return y.view(B, S, H), aux, counts

    class Block(nn.Module):
        def __init__(self, m, i, align_size, experts_impl, recompute, recompute_attention=False):
            super().__init__()
            std = m["initializer_range"]
            # flowmoe's output projections (o_proj, down_proj, fc2) start smaller so the residual
            # stream's variance does not grow with depth (layers/transformer.cpp, out_std).
            out_std = std / math.sqrt(2.0 * m["num_hidden_layers"])
            H = m["hidden_size"]
            self.input_layernorm = RMSNorm(H, m["rms_norm_eps"])
            self.self_attn = Attention(m, std, out_std)
            self.post_attention_layernorm = RMSNorm(H, m["rms_norm_eps"])
            self.recompute_attention = recompute_attention
            self.is_moe = m["n_routed_experts"] > 0 and i >= m["first_k_dense_replace"]
            if self.is_moe:
                self.mlp = MoeLayer(m, align_size, experts_impl, recompute, std, out_std)
            else:
                self.mlp = Mlp(H, m["intermediate_size"], std, out_std)

        def attention_branch(self, x, cos, sin):
            return self.self_attn(self.input_layernorm(x), cos, sin)

        def forward(self, x, cos, sin):
            if self.recompute_attention:  # train.recompute: [attention]
                h = x + torch.utils.checkpoint.checkpoint(self.attention_branch, x, cos, sin, use_reentrant=False)
            else:
                h = x + self.attention_branch(x, cos, sin)
            n = self.post_attention_layernorm(h)
            if self.is_moe:
                y, aux, counts = self.mlp(n)
                return h + y, aux, counts
            return h + self.mlp(n), None, None

    class Decoder(nn.Module):
        def __init__(self, m, align_size, experts_impl, recompute, recompute_attention):
            super().__init__()
            self.embed_tokens = nn.Embedding(m["vocab_size"], m["hidden_size"])
            normal_(self.embed_tokens.weight, m["initializer_range"])
            self.layers = nn.ModuleList(
                Block(m, i, align_size, experts_impl, recompute, recompute_attention)
                for i in range(m["num_hidden_layers"])
            )
            self.norm = RMSNorm(m["hidden_size"], m["rms_norm_eps"])

    class Transformer(nn.Module):
        """Parameter names as flowmoe's (Hugging Face's): model.layers.1.mlp.gate.weight, ..."""

        def __init__(self, m, align_size=16, experts_impl="grouped_mm", recompute=False, recompute_attention=False):
            super().__init__()
            self.m = m
            self.model = Decoder(m, align_size, experts_impl, recompute, recompute_attention)
            self.lm_head = nn.Linear(m["hidden_size"], m["vocab_size"], bias=False)
            if m["tie_word_embeddings"]:
                self.lm_head.weight = self.model.embed_tokens.weight
            else:
                normal_(self.lm_head.weight, m["initializer_range"])
            hd = m["hidden_size"] // m["num_attention_heads"]
            pos = torch.arange(m["max_position_embeddings"], dtype=torch.float64)
            inv_freq = m["rope_theta"] ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
            angles = pos[:, None] * inv_freq[None, :]
            self.register_buffer("rope_cos", angles.cos().float(), persistent=False)
            self.register_buffer("rope_sin", angles.sin().float(), persistent=False)

        def moe_layers(self):
            return [b.mlp for b in self.model.layers if b.is_moe]

        def forward(self, ids, targets, compute_dtype):
            """-> (the LM loss, the summed balance loss or None, per-MoE-layer counts [L, E])."""
            # The embedding table cast to the compute dtype, as flowmoe's embedding (the residual
            # stream is bf16 under autocast, as in flowmoe).
            h = F.embedding(ids, self.model.embed_tokens.weight.to(compute_dtype))
            aux_total, counts = None, []
            for block in self.model.layers:
                h, aux, c = block(h, self.rope_cos, self.rope_sin)
                if aux is not None:
                    aux_total = aux if aux_total is None else aux_total + aux
                if c is not None:
                    counts.append(c)
            logits = self.lm_head(self.model.norm(h))
            lm = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            return lm, aux_total, torch.stack(counts) if counts else None

    return Transformer


# ---- training --------------------------------------------------------------------------------------


def make_optimizer(torch, model, o, device):
    """AdamW as train/optimizer.cpp: weight decay on tensors of 2 or more dims (matrices, the
    embedding and the expert weights), none on the norms; the routers' gate weights at
    lr * router_lr_scale."""
    groups = {"decay": [], "no_decay": [], "router": []}
    for name, p in model.named_parameters():
        if name.endswith(".mlp.gate.weight"):
            groups["router"].append(p)
        elif p.dim() >= 2:
            groups["decay"].append(p)
        else:
            groups["no_decay"].append(p)
    param_groups = [
        {"params": groups["decay"], "weight_decay": o["weight_decay"], "lr_scale": 1.0},
        {"params": groups["no_decay"], "weight_decay": 0.0, "lr_scale": 1.0},
        {"params": groups["router"], "weight_decay": o["weight_decay"], "lr_scale": o["router_lr_scale"]},
    ]
    param_groups = [g for g in param_groups if g["params"]]
    return torch.optim.AdamW(
        param_groups,
        lr=o["lr"],
        betas=(o["beta1"], o["beta2"]),
        eps=o["eps"],
        fused=True,  # one kernel over all tensors on the GPU (torch 2.4+ has a CPU one too)
    )


def update_expert_bias(torch, moe_layers, counts, rate, rule):
    """engine/ops/router.cpp, update_expert_bias: each expert's bias moves toward the mean load, by
    rate * sign(mean - load) or rate * (mean - load) / mean; nothing moves when no tokens came."""
    with torch.no_grad():
        c = counts.to(torch.float32)  # [L, E]
        E = c.shape[1]
        total = c.sum(dim=1, keepdim=True)
        diff = total - E * c  # (mean - load) * E, exactly
        if rule == "sign":
            delta = rate * torch.sign(diff)
        else:
            delta = rate * diff / total.clamp_min(1.0)
        delta = torch.where(total > 0, delta, torch.zeros_like(delta))
        for layer, d in zip(moe_layers, delta):
            layer.gate.e_score_correction_bias.add_(d)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="PyTorch speed peer of `flowmoe train`: the same model from the same YAML config.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", required=True, help="a flowmoe YAML config (configs/gpu_moe.yaml)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config key, as flowmoe's --set (repeatable)")
    ap.add_argument("--mode", choices=["compiled", "eager"], default="compiled",
                    help="compiled: torch.compile(model) (default mode); eager: no compilation")
    ap.add_argument("--compile-mode", default="default",
                    choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                    help="torch.compile's mode with --mode compiled (default: default, which runs the "
                         "grouped GEMMs as torch's CUTLASS kernels; max-autotune also tries Triton ones)")
    ap.add_argument("--experts", choices=["auto", "grouped_mm", "loop"], default="auto",
                    help="the routed experts as torch._grouped_mm or one GEMM per expert; auto: "
                         "grouped_mm on the GPU where torch has it, else loop")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                    help="compute dtype: bf16 autocast over fp32 master weights, or fp32 (auto: bf16 on "
                         "the GPU, fp32 on the CPU, as flowmoe)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation happens there)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--seed", type=int, default=None, help="init and data seed (default: train.seed)")
    ap.add_argument("--yaml", choices=["auto", "pyyaml", "builtin"], default="auto",
                    help="the config reader: PyYAML when installed (auto), or the built-in one")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    args = ap.parse_args(argv)

    try:
        cfg = load_config(args.config, args.overrides, args.yaml)
    except (ConfigError, OSError) as e:
        print(f"torch_peer: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(cfg, indent=1, sort_keys=True))
        return 0
    if args.warmup < 0 or args.steps < 1:
        print("torch_peer: error: --warmup must be >= 0 and --steps >= 1", file=sys.stderr)
        return 2

    try:
        import torch  # noqa: PLC0415
        import torch.utils.checkpoint  # noqa: PLC0415,F401  (train.recompute: [moe_expert, attention])
    except ImportError:
        print("torch_peer: error: PyTorch is not installed for this Python (pip install torch)", file=sys.stderr)
        return 1

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("torch_peer: error: no CUDA device is visible to torch (use --device cpu on a CPU)", file=sys.stderr)
        return 1
    if device.type == "cuda":
        if device.index is None:  # "cuda": the current device, named by its index for the calls below
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    dtype_name = args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    compute_dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    experts_impl = args.experts
    if experts_impl == "auto":  # torch._grouped_mm compiles for bf16 only; the CPU computes in fp32
        experts_impl = "grouped_mm" if hasattr(torch, "_grouped_mm") and device.type == "cuda" else "loop"
    if experts_impl == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        print(f"torch_peer: error: torch {torch.__version__} has no torch._grouped_mm; use --experts loop",
              file=sys.stderr)
        return 2

    m, tc, o = cfg["model"], cfg["train"], cfg["optimizer"]
    B, S, accum = tc["batch_size"], cfg["data"]["seq_len"], tc["grad_accum_steps"]
    seed = tc["seed"] if args.seed is None else args.seed
    config_name = os.path.splitext(os.path.basename(args.config))[0]
    recompute = "moe_expert" in tc["recompute"]
    recompute_attention = "attention" in tc["recompute"]

    torch.manual_seed(seed)
    Transformer = build_model_classes(torch)
    with torch.device(device):  # made where it trains: a 2B-parameter init on the host would be slow
        model = Transformer(m, cfg["precision"]["align_size"], experts_impl, recompute, recompute_attention)
    num_params = sum(p.numel() for p in model.parameters())  # all of them, as flowmoe counts
    expected = expected_parameters(m)
    if num_params != expected:
        print(f"torch_peer: error: the module holds {num_params} parameters, flowmoe's count for this config "
              f"is {expected}", file=sys.stderr)
        return 1
    moe_layers = model.moe_layers()
    if not moe_layers:
        experts_impl = "none"  # a dense model
    moe_desc = ""
    if moe_layers:
        moe_desc = (f", {len(moe_layers)} MoE layers of {m['n_routed_experts']} experts top-{m['num_experts_per_tok']}"
                    f" + {m['n_shared_experts']} shared")
    print(f"torch_peer: {format_count(num_params)} parameters ({num_params}; {m['num_hidden_layers']} layers, hidden "
          f"{m['hidden_size']}, vocab {m['vocab_size']}{moe_desc})")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch_peer: torch {torch.__version__} on {where}; {args.mode}, experts {experts_impl}, {dtype_name} "
          f"compute, fp32 master weights; {B} x {S} tokens x {accum} micro-batches per step")

    opt = make_optimizer(torch, model, o, device)
    step_fn = torch.compile(model, mode=args.compile_mode) if args.mode == "compiled" else model
    autocast = compute_dtype != torch.float32

    # Random token ids, made once on the device and reused in turn: no host work in the loop.
    gen = torch.Generator(device="cpu").manual_seed(seed)
    num_batches = 4
    data = torch.randint(0, m["vocab_size"], (num_batches * accum, B, S + 1), generator=gen).to(device)

    total_steps = args.warmup + args.steps
    bias_rule, bias_rate = m["bias_update_rule"], m["bias_update_rate"]
    step = 0
    balance_sum = torch.zeros((), device=device)  # mean over MoE layers of max/mean load, summed over steps

    def train_step():
        nonlocal step, balance_sum
        step += 1
        lr = learning_rate(o, step, max(tc["steps"], total_steps))
        for g in opt.param_groups:
            g["lr"] = lr * g["lr_scale"]
        counts_sum = None
        for micro in range(accum):
            batch = data[((step - 1) * accum + micro) % data.shape[0]]
            with torch.autocast(device.type, dtype=compute_dtype, enabled=autocast):
                lm, aux, counts = step_fn(batch[:, :-1], batch[:, 1:], compute_dtype)
            loss = lm if aux is None else lm + aux
            (loss / accum if accum > 1 else loss).backward()
            if counts is not None:
                counts_sum = counts if counts_sum is None else counts_sum + counts
        if o["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"], foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if counts_sum is not None:
            scale = 1.0
            if m["bias_update_schedule"] == "lr":
                scale = lr / o["lr"] if o["lr"] > 0 else 0.0
            update_expert_bias(torch, moe_layers, counts_sum, bias_rate * scale, bias_rule)
            c = counts_sum.float()
            balance_sum = balance_sum + (c.amax(dim=1) / c.mean(dim=1).clamp_min(1e-9)).mean()
        return lm.detach()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if args.mode == "compiled":
        print("torch_peer: the first step compiles the model (a minute or more)", flush=True)
    t0 = time.perf_counter()
    first_loss = None
    for _ in range(args.warmup):
        lm = train_step()
        if first_loss is None:
            first_loss = float(lm)  # one host read, before the timed window
    sync()
    warm_s = time.perf_counter() - t0
    if args.warmup:
        print(f"torch_peer: {args.warmup} warmup steps in {warm_s:.1f} s"
              f"{' (compilation included)' if args.mode == 'compiled' else ''}; first loss {first_loss:.4f}")

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    balance_sum.zero_()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        lm = train_step()
    sync()
    seconds = time.perf_counter() - t0

    if device.type == "cuda":
        peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # KiB on Linux
    tokens = args.steps * B * S * accum
    tokens_per_s = tokens / seconds
    step_ms = seconds / args.steps * 1e3
    balance = float(balance_sum) / args.steps if moe_layers else float("nan")
    print(f"torch_peer: {args.steps} timed steps in {seconds:.3f} s: {step_ms:.1f} ms/step, {tokens_per_s:.0f} tok/s, "
          f"peak {peak_gib:.2f} GiB; last loss {float(lm):.4f}"
          + (f"; MoE max/mean load {balance:.3f}" if moe_layers else ""))
    line = (f"BENCH peer=torch mode={args.mode} config={config_name} tokens_per_s={tokens_per_s:.1f} "
            f"peak_gib={peak_gib:.3f} params={num_params} step_ms={step_ms:.2f} experts={experts_impl} "
            f"dtype={dtype_name} device={device.type}")
    if args.mode == "compiled" and args.compile_mode != "default":
        line += f" compile_mode={args.compile_mode}"
    if moe_layers:
        line += f" moe_max_over_mean={balance:.3f}"
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
