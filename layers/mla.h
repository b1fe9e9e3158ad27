// DeepSeek-V3's multi-head latent attention (model.attention: mla), as transformers' DeepseekV3Attention
// computes it. Per token x [H], with nope = qk_nope_head_dim, rope = qk_rope_head_dim, qk = nope + rope:
//   q = q_b_proj(q_a_layernorm(q_a_proj(x)))  (q_proj(x) when q_lora_rank is 0)   -> [nh, qk] = [q_nope, q_pe]
//   [c, k_pe] = kv_a_proj_with_mqa(x)                       c [kv_lora_rank], k_pe [rope], one for every head
//   [k_nope, v] = kv_b_proj(kv_a_layernorm(c))              -> [nh, nope + v_head_dim]
//   q_pe, k_pe rotated by RoPE at the token's position;  k = [k_nope, k_pe] (k_pe broadcast to every head)
//   o = softmax(q·kᵀ / sqrt(qk), causal) · v  -> [nh, v_head_dim];  y = o_proj(o)
// RoPE rotates pairs (x[2i], x[2i+1]) as transformers' deepseek_v3 does with rope_interleave (its interleaved
// layout permuted to halves before rotate_half: the same rotation, the same products q·k). No rope_scaling.
// Parameters under <prefix> (HF names): q_a_proj [q_lora, H], q_a_layernorm [q_lora], q_b_proj [nh·qk, q_lora]
// (or q_proj [nh·qk, H]), kv_a_proj_with_mqa [kv_lora + rope, H], kv_a_layernorm [kv_lora],
// kv_b_proj [nh·(nope + v), kv_lora], o_proj [H, nh·v].
// In FP8 (fp8_full) q_a_proj, q_b_proj (or q_proj), kv_b_proj and o_proj are fp8_linear, each input quantized
// once (x by the block's norm; q_a_layernorm's and kv_a_layernorm's outputs and o at "self_attn.q_b_proj: x",
// ".kv_b_proj: x", ".o_proj: x"). kv_a_proj_with_mqa stays in the compute dtype, from the norm's y: its
// kv_lora_rank + qk_rope_head_dim outputs (DeepSeek-V3's 576) are no multiple of the 128-wide FP8 blocks.
#pragma once
#include <string>

#include "layers/attention.h"
#include "layers/model_config.h"

namespace flowmoe {

class LatentAttention : public AttentionLayer {
 public:
  // fp8: the FP8 projections' widths must be multiples of 128 (ShapeError naming the prefix; the config checks
  // them first, with the keys).
  LatentAttention(ParamFactory& f, const std::string& prefix, const ModelConfig& cfg, double out_init_std, bool fp8);
  Variable forward(const Variable& x /*[B,T,H]*/, DType compute) const override;
  Variable forward_cached(const Variable& x /*[1,T,H]*/, DType compute, const Tensor& keys, const Tensor& values,
                          int64_t pos) const override;
  Variable forward_quantized(const Variable& xq, const Variable& y, int64_t b, int64_t t, DType compute) const override;
  bool keeps_norm_output() const override { return true; }  // kv_a_proj_with_mqa reads y
  std::string input_site() const override { return site_ + ": x"; }

 private:
  struct Heads {
    Variable q, k, v;  // [B,T,nh,qk], [B,T,nh,qk], [B,T,nh,v] after RoPE
  };
  // xq: x's FP8 rows for the FP8 projections (undefined: every projection in the compute dtype from y).
  Heads heads(const Variable& xq, const Variable& y /*[B,T,H]*/, DType compute, int64_t pos) const;
  // A projection of rows in [N, K]: fp8_linear from their FP8 copy where xq-style input is FP8, else linear.
  Variable project(const Variable& in, const Variable& w, const Fp8WeightCache& cache, const char* name,
                   DType compute) const;
  Variable output(const Variable& o /*[B,T,nh,v]*/, bool fp8, DType compute) const;  // o_proj -> [B,T,H]

  int64_t hidden_, num_heads_, q_lora_rank_, kv_lora_rank_, nope_, rope_, v_dim_;
  double rope_theta_, eps_;
  bool fp8_;
  AttentionBackend backend_;  // model.attention_kernel
  std::string site_;
  Variable q_a_proj_, q_a_layernorm_, q_b_proj_, q_proj_, kv_a_proj_, kv_a_layernorm_, kv_b_proj_, o_proj_;
  Fp8WeightCache q_a_fp8_, q_b_fp8_, q_fp8_, kv_b_fp8_, o_fp8_;
};

}  // namespace flowmoe
