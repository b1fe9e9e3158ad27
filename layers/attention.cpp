#include "layers/attention.h"

#include <cmath>
#include <vector>

#include "layers/kv_cache.h"

namespace flowmoe {

Attention::Attention(ParamFactory& f, const std::string& prefix, int64_t hidden, int64_t num_heads, double rope_theta,
                     double init_std, double out_init_std, bool fp8, AttentionBackend backend)
    : hidden_(hidden),
      num_heads_(num_heads),
      rope_theta_(rope_theta),
      fp8_(fp8),
      backend_(backend),
      site_(prefix.substr(prefix.rfind('.') + 1)) {
  FLOWMOE_CHECK(hidden % num_heads == 0 && (hidden / num_heads) % 2 == 0, ShapeError, "attention: hidden ", hidden,
                " with ", num_heads, " heads needs an even head size");
  q_proj_ = f.normal(prefix + ".q_proj.weight", {hidden, hidden}, init_std);
  k_proj_ = f.normal(prefix + ".k_proj.weight", {hidden, hidden}, init_std);
  v_proj_ = f.normal(prefix + ".v_proj.weight", {hidden, hidden}, init_std);
  o_proj_ = f.normal(prefix + ".o_proj.weight", {hidden, hidden}, out_init_std);
  if (fp8) {
    check_fp8_linear_dims(hidden, hidden, prefix);
    f.read_in_fp8(q_proj_, q_fp8_);  // quantized from f32
    f.read_in_fp8(k_proj_, k_fp8_);
    f.read_in_fp8(v_proj_, v_fp8_);
    f.read_in_fp8(o_proj_, o_fp8_);
  }
}

Variable Attention::forward(const Variable& x, DType compute) const {
  FLOWMOE_CHECK(x.data().dim() == 3 && x.size(2) == hidden_, ShapeError, "attention: input ", x.data().describe(),
                ", expected [B, T, ", hidden_, "]");
  if (fp8_)
    return forward_quantized(quantize_rowwise(reshape(x, {x.size(0) * x.size(1), hidden_}), input_site()), x, x.size(0),
                             x.size(1), compute);
  const int64_t b = x.size(0), t = x.size(1), hd = hidden_ / num_heads_;
  const Shape heads = {b, t, num_heads_, hd};
  // q's projection before k's (named, not rope_qk's arguments, whose order C++ leaves open): the backward walk runs
  // the later-recorded node first, so this keeps the order of x's gradient sum, and its bits, of two separate ropes.
  const Variable q_raw = reshape(linear(x, compute_weight(q_proj_, compute)), heads);
  const Variable k_raw = reshape(linear(x, compute_weight(k_proj_, compute)), heads);
  const auto [q, k] = rope_qk(q_raw, k_raw, rope_theta_);
  Variable v = reshape(linear(x, compute_weight(v_proj_, compute)), heads);
  Variable o = reshape(causal_attention(q, k, v, backend_), {b, t, hidden_});
  return linear(o, compute_weight(o_proj_, compute));
}

Variable Attention::forward_cached(const Variable& x, DType compute, const Tensor& keys, const Tensor& values,
                                   int64_t pos) const {
  FLOWMOE_CHECK(!grad_enabled(), Error, "attention: the cached forward is for inference (under NoGradGuard)");
  FLOWMOE_CHECK(x.data().dim() == 3 && x.size(0) == 1 && x.size(2) == hidden_, ShapeError, "attention: input ",
                x.data().describe(), ", expected one sequence [1, T, ", hidden_, "]");
  const int64_t t = x.size(1), hd = hidden_ / num_heads_;
  const Shape heads = {1, t, num_heads_, hd};
  const Variable q_raw = reshape(linear(x, compute_weight(q_proj_, compute)), heads);
  const Variable k_raw = reshape(linear(x, compute_weight(k_proj_, compute)), heads);
  const auto [q, k] = rope_qk(q_raw, k_raw, rope_theta_, pos);
  const Variable v = reshape(linear(x, compute_weight(v_proj_, compute)), heads);
  const Variable o = attend_with_cache(q, k, v, keys, values, pos, backend_, "attention");
  return linear(reshape(o, {1, t, hidden_}), compute_weight(o_proj_, compute));
}

// The same with fp8_linear projections over [B·T, H] rows: x quantized once for q, k and v.
Variable Attention::forward_quantized(const Variable& xq, const Variable&, int64_t b, int64_t t, DType compute) const {
  FLOWMOE_CHECK(fp8_ && is_fp8(xq.dtype()) && xq.data().dim() == 2 && xq.size(0) == b * t && xq.size(1) == hidden_,
                ShapeError, "attention: quantized input ", xq.data().describe(), ", expected FP8 [", b * t, ", ",
                hidden_, "] for an FP8 attention");
  const int64_t hd = hidden_ / num_heads_;
  const Shape heads = {b, t, num_heads_, hd};
  auto project = [&](const Variable& w, const Fp8WeightCache& cache, const char* name) {
    return reshape(cached_fp8_linear(xq, w, cache, site_ + "." + name, compute), heads);
  };
  const Variable q_raw = project(q_proj_, q_fp8_, "q_proj");  // before k's, as in forward
  const Variable k_raw = project(k_proj_, k_fp8_, "k_proj");
  const auto [q, k] = rope_qk(q_raw, k_raw, rope_theta_);
  const Variable v = project(v_proj_, v_fp8_, "v_proj");
  const Variable oq =
      quantize_rowwise(reshape(causal_attention(q, k, v, backend_), {b * t, hidden_}), site_ + ".o_proj: x");
  return reshape(cached_fp8_linear(oq, o_proj_, o_fp8_, site_ + ".o_proj", compute), {b, t, hidden_});
}

}  // namespace flowmoe
