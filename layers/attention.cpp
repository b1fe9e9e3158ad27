#include "layers/attention.h"

namespace flowmoe {

Attention::Attention(ParamFactory& f, const std::string& prefix, int64_t hidden, int64_t num_heads, double rope_theta,
                     double init_std, double out_init_std)
    : hidden_(hidden), num_heads_(num_heads), rope_theta_(rope_theta) {
  FLOWMOE_CHECK(hidden % num_heads == 0 && (hidden / num_heads) % 2 == 0, ShapeError, "attention: hidden ", hidden,
                " with ", num_heads, " heads needs an even head size");
  q_proj_ = f.normal(prefix + ".q_proj.weight", {hidden, hidden}, init_std);
  k_proj_ = f.normal(prefix + ".k_proj.weight", {hidden, hidden}, init_std);
  v_proj_ = f.normal(prefix + ".v_proj.weight", {hidden, hidden}, init_std);
  o_proj_ = f.normal(prefix + ".o_proj.weight", {hidden, hidden}, out_init_std);
}

Variable Attention::forward(const Variable& x, DType compute) const {
  FLOWMOE_CHECK(x.data().dim() == 3 && x.size(2) == hidden_, ShapeError, "attention: input ", x.data().describe(),
                ", expected [B, T, ", hidden_, "]");
  const int64_t b = x.size(0), t = x.size(1), hd = hidden_ / num_heads_;
  const Shape heads = {b, t, num_heads_, hd};
  Variable q = rope(reshape(linear(x, compute_weight(q_proj_, compute)), heads), rope_theta_);
  Variable k = rope(reshape(linear(x, compute_weight(k_proj_, compute)), heads), rope_theta_);
  Variable v = reshape(linear(x, compute_weight(v_proj_, compute)), heads);
  Variable o = reshape(causal_attention(q, k, v), {b, t, hidden_});
  return linear(o, compute_weight(o_proj_, compute));
}

}  // namespace flowmoe
