// Causal multi-head self-attention with RoPE (DESIGN.md §5: no MLA).
//   q, k, v = x·Wqᵀ, x·Wkᵀ, x·Wvᵀ  -> [B,T,nh,hd];  q, k rotated by RoPE (one rope_qk node);
//   o = softmax(q·kᵀ/sqrt(hd), causal)·v -> [B,T,H];  y = o·Woᵀ.
// Parameters (HF names): <prefix>.{q,k,v,o}_proj.weight, each [H, H].
// In FP8 (the fp8_full recipe; layers/moe.h MoeFlow::fp8_linears) the four projections are fp8_linear: x is
// quantized once for q, k and v, o once for o_proj, and each backward quantizes its dy (casts at "self_attn: x",
// "self_attn.o_proj: x", "self_attn.q_proj.dgrad: dy rowwise", ...); RoPE and the attention core stay bf16/f32.
#pragma once
#include <string>

#include "layers/fp8_weight.h"
#include "layers/param.h"

namespace flowmoe {

class Attention {
 public:
  // fp8: the projections run in FP8 from the f32 weights (read in f32, ParamShard::reads_f32); hidden must then
  // be a multiple of 128 (ShapeError naming the prefix).
  Attention(ParamFactory& f, const std::string& prefix, int64_t hidden, int64_t num_heads, double rope_theta,
            double init_std, double out_init_std, bool fp8 = false);
  Variable forward(const Variable& x /*[B,T,H]*/, DType compute) const;  // -> [B,T,H]
  // Inference with a K/V cache (layers/kv_cache.h: keys and values [nh, capacity, hd] of this layer): x holds one
  // sequence's positions [pos, pos + T), which are rotated at those positions and written into the cache. The
  // prompt (pos 0) runs the training forward's causal attention; a later call takes one token, whose attention
  // reads the cached positions [0, pos] head by head through linear, softmax and matmul. Under NoGradGuard only.
  // In FP8 the projections run in the compute dtype here: one row is no FP8 GEMM's row count.
  Variable forward_cached(const Variable& x /*[1,T,H]*/, DType compute, const Tensor& keys, const Tensor& values,
                          int64_t pos) const;

  // In FP8: the forward from x already quantized, e4m3 [B·T, H] with rowwise scales (the block's fused norm
  // emits it, counting its cast at input_site()). -> [B,T,H].
  Variable forward_quantized(const Variable& xq, int64_t b, int64_t t, DType compute) const;
  std::string input_site() const { return site_ + ": x"; }  // where x's quantize is counted ("self_attn: x")

 private:
  int64_t hidden_, num_heads_;
  double rope_theta_;
  bool fp8_;
  std::string site_;  // the casts' site: the prefix's last part
  Variable q_proj_, k_proj_, v_proj_, o_proj_;
  Fp8WeightCache q_fp8_, k_fp8_, v_fp8_, o_fp8_;
};

}  // namespace flowmoe
