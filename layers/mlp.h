// The dense SwiGLU MLP: y = (silu(x·Wgᵀ) * (x·Wuᵀ))·Wdᵀ.
// Parameters (HF names): <prefix>.gate_proj.weight [F,H], up_proj.weight [F,H], down_proj.weight [H,F].
#pragma once
#include <string>

#include "layers/param.h"

namespace flowmoe {

class Mlp {
 public:
  Mlp(ParamFactory& f, const std::string& prefix, int64_t hidden, int64_t intermediate, double init_std,
      double out_init_std);
  Variable forward(const Variable& x /*[..., H]*/, DType compute) const;  // -> [..., H]

 private:
  Variable gate_proj_, up_proj_, down_proj_;
};

}  // namespace flowmoe
