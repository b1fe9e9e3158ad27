#include "layers/mlp.h"

namespace flowmoe {

Mlp::Mlp(ParamFactory& f, const std::string& prefix, int64_t hidden, int64_t intermediate, double init_std,
         double out_init_std, bool fp8)
    : fp8_(fp8), site_(prefix.substr(prefix.rfind('.') + 1)) {
  gate_proj_ = f.normal(prefix + ".gate_proj.weight", {intermediate, hidden}, init_std);
  up_proj_ = f.normal(prefix + ".up_proj.weight", {intermediate, hidden}, init_std);
  down_proj_ = f.normal(prefix + ".down_proj.weight", {hidden, intermediate}, out_init_std);
  if (fp8) {
    check_fp8_linear_dims(intermediate, hidden, prefix);
    f.read_in_fp8(gate_proj_, gate_fp8_);  // quantized from f32
    f.read_in_fp8(up_proj_, up_fp8_);
    f.read_in_fp8(down_proj_, down_fp8_);
  }
}

Variable Mlp::forward(const Variable& x, DType compute) const {
  if (fp8_) return forward_fp8(x, compute);
  Variable gate = linear(x, compute_weight(gate_proj_, compute));
  Variable up = linear(x, compute_weight(up_proj_, compute));
  return linear(mul(silu(gate), up), compute_weight(down_proj_, compute));
}

Variable Mlp::forward_fp8(const Variable& x, DType compute) const {
  const bool quantized = is_fp8(x.dtype());
  const Shape shape = x.shape();
  const Variable xq = quantized ? x : quantize_rowwise(reshape(x, {-1, shape.back()}), input_site());
  const Variable gate = cached_fp8_linear(xq, gate_proj_, gate_fp8_, site_ + ".gate_proj", compute);
  const Variable up = cached_fp8_linear(xq, up_proj_, up_fp8_, site_ + ".up_proj", compute);
  const Variable a = quantize_rowwise(mul(silu(gate), up), site_ + ".down_proj: x");
  const Variable y = cached_fp8_linear(a, down_proj_, down_fp8_, site_ + ".down_proj", compute);
  return quantized ? y : reshape(y, shape);
}

}  // namespace flowmoe
