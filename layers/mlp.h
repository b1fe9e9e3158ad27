// The dense SwiGLU MLP: y = (silu(x·Wgᵀ) * (x·Wuᵀ))·Wdᵀ.
// Parameters (HF names): <prefix>.gate_proj.weight [F,H], up_proj.weight [F,H], down_proj.weight [H,F].
// In FP8 (the fp8_full recipe; layers/moe.h MoeFlow::fp8_linears) its three GEMMs are fp8_linear: x is quantized
// once for gate and up, silu(gate)·up once for down, and each backward quantizes its dy (casts counted at sites
// named by the prefix's last part, "mlp" or "shared_experts": "mlp: x", "mlp.gate_proj.dgrad: dy rowwise").
#pragma once
#include <string>

#include "engine/fp8_weight.h"
#include "layers/param.h"

namespace flowmoe {

class Mlp {
 public:
  // fp8: the GEMMs run in FP8 from the f32 weights (read in f32, ParamShard::reads_f32); hidden and intermediate
  // must then be multiples of 128 (ShapeError naming the prefix).
  Mlp(ParamFactory& f, const std::string& prefix, int64_t hidden, int64_t intermediate, double init_std,
      double out_init_std, bool fp8 = false);
  // x [..., H]; in FP8 also an already quantized x (e4m3 [M, H] with rowwise scales: the MoE layer's dispatch
  // input), whose cast the caller counted. -> [..., H].
  Variable forward(const Variable& x, DType compute) const;
  std::string input_site() const { return site_ + ": x"; }  // where x's quantize is counted ("mlp: x")

 private:
  Variable forward_fp8(const Variable& x, DType compute) const;

  bool fp8_;
  std::string site_;  // the casts' site: the prefix's last part
  Variable gate_proj_, up_proj_, down_proj_;
  Fp8WeightCache gate_fp8_, up_fp8_, down_fp8_;
};

}  // namespace flowmoe
