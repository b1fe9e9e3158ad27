// Causal multi-head self-attention with RoPE (model.attention: mha; DeepSeek-V3's latent attention, mla, is
// layers/mla.h). Both are an AttentionLayer, the block's self_attn.
//   q, k, v = x·Wqᵀ, x·Wkᵀ, x·Wvᵀ  -> [B,T,nh,hd];  q, k rotated by RoPE (one rope_qk node);
//   o = softmax(q·kᵀ/sqrt(hd), causal)·v -> [B,T,H];  y = o·Woᵀ.
// Parameters (HF names): <prefix>.{q,k,v,o}_proj.weight, each [H, H].
// In FP8 (the fp8_full recipe; layers/moe.h MoeFlow::fp8_linears) the four projections are fp8_linear: x is
// quantized once for q, k and v, o once for o_proj, and each backward quantizes its dy (casts at "self_attn: x",
// "self_attn.o_proj: x", "self_attn.q_proj.dgrad: dy rowwise", ...); RoPE and the attention core stay bf16/f32.
#pragma once
#include <string>

#include "engine/fp8_weight.h"
#include "layers/param.h"

namespace flowmoe {

// What a TransformerBlock calls on its self_attn (layers/transformer.h).
class AttentionLayer {
 public:
  virtual ~AttentionLayer() = default;
  virtual Variable forward(const Variable& x /*[B,T,H]*/, DType compute) const = 0;  // -> [B,T,H]
  // With the layer's K/V cache (layers/kv_cache.h) at positions [pos, pos + T); under NoGradGuard only.
  virtual Variable forward_cached(const Variable& x /*[1,T,H]*/, DType compute, const Tensor& keys,
                                  const Tensor& values, int64_t pos) const = 0;
  // In FP8 (fp8_full): from the block's input norm, its FP8 copy xq [B·T, H] and, where keeps_norm_output(), its
  // output y [B,T,H] for a projection that stays in the compute dtype.
  virtual Variable forward_quantized(const Variable& xq, const Variable& y, int64_t b, int64_t t,
                                     DType compute) const = 0;
  virtual bool keeps_norm_output() const { return false; }
  virtual std::string input_site() const = 0;  // where x's quantize is counted ("self_attn: x")
};

class Attention : public AttentionLayer {
 public:
  // fp8: the projections run in FP8 from the f32 weights (read in f32, ParamShard::reads_f32); hidden must then
  // be a multiple of 128 (ShapeError naming the prefix). backend: the attention core's GPU kernels
  // (model.attention_kernel).
  Attention(ParamFactory& f, const std::string& prefix, int64_t hidden, int64_t num_heads, double rope_theta,
            double init_std, double out_init_std, bool fp8 = false, AttentionBackend backend = AttentionBackend::flash);
  Variable forward(const Variable& x /*[B,T,H]*/, DType compute) const override;  // -> [B,T,H]
  // Inference with a K/V cache (layers/kv_cache.h: keys and values [nh, capacity, hd] of this layer): x holds one
  // sequence's positions [pos, pos + T), which are rotated at those positions and written into the cache. The
  // prompt (pos 0) runs the training forward's causal attention; a later call takes one token, whose attention
  // reads the cached positions [0, pos] head by head through linear, softmax and matmul (attend_with_cache).
  // In FP8 the projections run in the compute dtype here: one row is no FP8 GEMM's row count.
  Variable forward_cached(const Variable& x /*[1,T,H]*/, DType compute, const Tensor& keys, const Tensor& values,
                          int64_t pos) const override;

  // In FP8: the forward from x already quantized, e4m3 [B·T, H] with rowwise scales (the block's fused norm
  // emits it, counting its cast at input_site()). -> [B,T,H]. y is not read.
  Variable forward_quantized(const Variable& xq, const Variable& y, int64_t b, int64_t t, DType compute) const override;
  std::string input_site() const override { return site_ + ": x"; }

 private:
  int64_t hidden_, num_heads_;
  double rope_theta_;
  bool fp8_;
  AttentionBackend backend_;
  std::string site_;  // the casts' site: the prefix's last part
  Variable q_proj_, k_proj_, v_proj_, o_proj_;
  Fp8WeightCache q_fp8_, k_fp8_, v_fp8_, o_fp8_;
};

}  // namespace flowmoe
