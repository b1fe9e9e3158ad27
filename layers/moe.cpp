#include "layers/moe.h"

#include <cmath>

#include "engine/ops/grouped_linear.h"
#include "engine/ops/permute.h"
#include "engine/ops/unpermute.h"

namespace flowmoe {

RouterConfig router_config(const ModelConfig& cfg) {
  RouterConfig r;
  r.num_experts = int(cfg.n_routed_experts);
  r.top_k = int(cfg.num_experts_per_tok);
  r.n_group = int(cfg.n_group);
  r.topk_group = int(cfg.topk_group);
  r.scoring_func = cfg.scoring_func;
  r.norm_topk_prob = cfg.norm_topk_prob;
  r.routed_scaling_factor = cfg.routed_scaling_factor;
  r.aux_loss_alpha = cfg.aux_loss_alpha;
  return r;
}

MoeLayer::MoeLayer(ParamFactory& f, const ModelConfig& cfg, const std::string& prefix, int align_size,
                   Device device)
    : router_(router_config(cfg)),
      num_experts_(cfg.n_routed_experts),
      intermediate_(cfg.moe_intermediate_size),
      align_size_(align_size),
      bias_update_rate_(cfg.bias_update_rate) {
  validate_router_config(router_);
  const int64_t H = cfg.hidden_size, F = cfg.moe_intermediate_size, E = cfg.n_routed_experts;
  const double out_std = cfg.initializer_range / std::sqrt(2.0 * double(cfg.num_hidden_layers));
  gate_ = f.normal(prefix + ".gate.weight", {E, H}, cfg.initializer_range);
  fc1_ = f.normal(prefix + ".experts.fc1.weight", {E, 2 * F, H}, cfg.initializer_range);
  fc2_ = f.normal(prefix + ".experts.fc2.weight", {E, H, F}, out_std);
  if (cfg.n_shared_experts > 0)
    shared_ = std::make_unique<Mlp>(f, prefix + ".shared_experts", H, F * cfg.n_shared_experts,
                                    cfg.initializer_range, out_std);
  expert_bias_ = Variable(Tensor::zeros({E}, DType::f32, device), false, prefix + ".gate.e_score_correction_bias");
  tokens_since_update_ = Tensor::zeros({E}, DType::i32, device);
}

Variable MoeLayer::forward(const Variable& x, DType compute) const {
  const Shape in_shape = x.shape();
  const int64_t H = in_shape.back();
  Variable x2 = reshape(x, {-1, H});
  // Router logits in fp32 as DeepSeek-V3 does: the top-k choice is sensitive to rounding.
  RouterConfig rc = router_;
  if (x.data().dim() == 3) rc.seq_len = int(in_shape[1]);
  Variable x_router = x2.dtype() == DType::f32 ? x2 : cast(x2, DType::f32);
  RouterOutput r = route(x_router, gate_, expert_bias_.data(), rc);
  add_tokens_per_expert(tokens_since_update_, r.tokens_per_expert);
  aux_loss_ = r.aux_loss;

  // Probabilities are applied once, at the unpermute (fp32 accumulation), not in the permute.
  PermuteResult p = permute_pad(x2, r.topk_idx, Variable(), int(num_experts_), align_size_);
  // THE host synchronisation of this layer: fc1 and fc2 need each expert's M on the host.
  std::vector<int64_t> counts = read_counts_once(p.padded_tokens_per_expert);
  Variable h = grouped_linear(p.rows, fc1_, counts);  // [M, 2F]
  Variable a = swiglu(h);                             // [M, F]
  Variable o = grouped_linear(a, fc2_, counts);       // [M, H]
  // unpermute takes f32 probs on the GPU, and probs of the rows' dtype on the CPU (f32 or f64).
  Variable topk_prob = r.topk_prob;
  if (o.device().is_cpu() && topk_prob.dtype() != o.dtype()) topk_prob = cast(topk_prob, o.dtype());
  Variable y = unpermute_unpad(o, p, topk_prob);  // [T, H]
  if (shared_) y = add(y, shared_->forward(x2, compute));
  return reshape(y, in_shape);
}

LoadStats MoeLayer::update_bias() {
  Tensor bias = expert_bias_.data();  // shares storage: the kernel updates the buffer in place
  update_expert_bias(bias, tokens_since_update_, bias_update_rate_);
  LoadStats s = load_stats(tokens_since_update_);
  tokens_since_update_.zero_();
  return s;
}

}  // namespace flowmoe
