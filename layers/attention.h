// Causal multi-head self-attention with RoPE (DESIGN.md §5: no MLA).
//   q, k, v = x·Wqᵀ, x·Wkᵀ, x·Wvᵀ  -> [B,T,nh,hd];  q, k rotated by RoPE;
//   o = softmax(q·kᵀ/sqrt(hd), causal)·v -> [B,T,H];  y = o·Woᵀ.
// Parameters (HF names): <prefix>.{q,k,v,o}_proj.weight, each [H, H].
#pragma once
#include <string>

#include "layers/param.h"

namespace flowmoe {

class Attention {
 public:
  Attention(ParamFactory& f, const std::string& prefix, int64_t hidden, int64_t num_heads, double rope_theta,
            double init_std, double out_init_std);
  Variable forward(const Variable& x /*[B,T,H]*/, DType compute) const;  // -> [B,T,H]

 private:
  int64_t hidden_, num_heads_;
  double rope_theta_;
  Variable q_proj_, k_proj_, v_proj_, o_proj_;
};

}  // namespace flowmoe
