#include "layers/mlp.h"

namespace flowmoe {

Mlp::Mlp(ParamFactory& f, const std::string& prefix, int64_t hidden, int64_t intermediate, double init_std,
         double out_init_std) {
  gate_proj_ = f.normal(prefix + ".gate_proj.weight", {intermediate, hidden}, init_std);
  up_proj_ = f.normal(prefix + ".up_proj.weight", {intermediate, hidden}, init_std);
  down_proj_ = f.normal(prefix + ".down_proj.weight", {hidden, intermediate}, out_init_std);
}

Variable Mlp::forward(const Variable& x, DType compute) const {
  Variable gate = linear(x, compute_weight(gate_proj_, compute));
  Variable up = linear(x, compute_weight(up_proj_, compute));
  return linear(mul(silu(gate), up), compute_weight(down_proj_, compute));
}

}  // namespace flowmoe
