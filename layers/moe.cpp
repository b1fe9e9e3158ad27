#include "layers/moe.h"

#include <cmath>

#include "engine/ops/fp8_grouped_linear.h"
#include "engine/ops/grouped_linear.h"
#include "engine/ops/permute.h"
#include "engine/ops/swiglu_quant.h"
#include "engine/ops/unpermute.h"

namespace flowmoe {

MoeRecipe moe_recipe_from_name(const std::string& name) {
  if (name == "bf16") return MoeRecipe::bf16;
  if (name == "fp8_blockwise") return MoeRecipe::fp8_blockwise;
  if (name == "fp8_flow") return MoeRecipe::fp8_flow;
  FLOWMOE_THROW(ConfigError, "precision.recipe: '", name, "' is not one of bf16, fp8_blockwise, fp8_flow");
}

const char* moe_recipe_name(MoeRecipe r) {
  switch (r) {
    case MoeRecipe::bf16: return "bf16";
    case MoeRecipe::fp8_blockwise: return "fp8_blockwise";
    case MoeRecipe::fp8_flow: return "fp8_flow";
  }
  return "?";
}

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

MoeLayer::MoeLayer(ParamFactory& f, const ModelConfig& cfg, const std::string& prefix, const MoeOptions& options,
                   Device device)
    : router_(router_config(cfg)),
      num_experts_(cfg.n_routed_experts),
      intermediate_(cfg.moe_intermediate_size),
      options_(options),
      bias_update_rate_(cfg.bias_update_rate),
      bias_update_rule_(bias_update_rule_from_name(cfg.bias_update_rule)) {
  validate_router_config(router_);
  const int64_t H = cfg.hidden_size, F = cfg.moe_intermediate_size, E = cfg.n_routed_experts;
  if (options.recipe != MoeRecipe::bf16)
    FLOWMOE_CHECK(H % 128 == 0 && F % 128 == 0, ShapeError, prefix, ": the ", moe_recipe_name(options.recipe),
                  " recipe needs hidden_size (", H, ") and moe_intermediate_size (", F,
                  ") to be multiples of 128 (FP8 blocks are 128 wide)");
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

const QuantizedWeight& MoeLayer::quantized(const Variable& w, WeightCache& cache) const {
  if (!cache.wq.q.defined() || cache.version != w.version()) {  // set_data and in-place updates bump it
    cache.wq = quantize_weight(w.data(), w.name());
    cache.version = w.version();
  }
  return cache.wq;
}

// fc1 → SwiGLU → fc2 over the permuted rows. fc1 and SwiGLU (the part recompute re-runs) go through
// one function so the recomputed and the original forward are the same code.
Variable MoeLayer::experts(const Variable& rows, const Variable& probs, const std::vector<int64_t>& counts) const {
  const MoeRecipe recipe = options_.recipe;
  const Fp8Wgrad wgrad = recipe == MoeRecipe::fp8_flow ? Fp8Wgrad::transpose : Fp8Wgrad::requantize;
  const QuantizedWeight* w1q = recipe == MoeRecipe::bf16 ? nullptr : &quantized(fc1_, fc1_cache_);
  auto fc1_swiglu = [this, recipe, wgrad, w1q, counts](const std::vector<Variable>& in) -> std::vector<Variable> {
    if (recipe == MoeRecipe::bf16) return {swiglu(grouped_linear(in[0], fc1_, counts))};
    if (recipe == MoeRecipe::fp8_blockwise) {
      Variable h = fp8_grouped_linear(quantize_rowwise(in[0], "fc1.fprop: x"), fc1_, *w1q, counts, wgrad, "fc1");
      return {quantize_rowwise(swiglu(h), "fc2.fprop: x")};
    }
    // fp8_flow: the rows arrive FP8; SwiGLU applies the probs and emits FP8 for fc2 in one kernel.
    Variable h = fp8_grouped_linear(in[0], fc1_, *w1q, counts, wgrad, "fc1");
    return {swiglu_quant(h, in[1], /*quantize_grad=*/true)};
  };
  std::vector<Variable> in = {rows};
  if (recipe == MoeRecipe::fp8_flow) in.push_back(probs);
  Variable a = options_.recompute_expert ? checkpoint(fc1_swiglu, in)[0] : fc1_swiglu(in)[0];
  if (recipe == MoeRecipe::bf16) return grouped_linear(a, fc2_, counts);
  return fp8_grouped_linear(a, fc2_, quantized(fc2_, fc2_cache_), counts, wgrad, "fc2");
}

int64_t moe_permuted_rows(int64_t num_tokens, int top_k, int num_experts, int align_size, MoeRecipe recipe) {
  const int64_t worst = permute_worst_case_rows(num_tokens, top_k, num_experts, align_size);
  return recipe == MoeRecipe::bf16 ? worst : (worst + 15) / 16 * 16;
}

int64_t MoeLayer::permuted_rows(int64_t num_tokens) const {
  return moe_permuted_rows(num_tokens, router_.top_k, int(num_experts_), options_.align_size, options_.recipe);
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

  // unpermute takes f32 probs on the GPU, and probs of the rows' dtype on the CPU (f32 or f64).
  Variable topk_prob = r.topk_prob;
  if (x2.device().is_cpu() && topk_prob.dtype() != x2.dtype()) topk_prob = cast(topk_prob, x2.dtype());
  Variable y;
  if (options_.recipe == MoeRecipe::fp8_flow) {
    // Quantize once, before dispatch; the probs travel with the rows and are applied in SwiGLU.
    Variable xq = quantize_rowwise(x2, "dispatch: x");
    PermuteResult p = permute_pad(xq, r.topk_idx, topk_prob, int(num_experts_), options_.align_size, 0, -1,
                                  permuted_rows(x2.size(0)));
    // THE host synchronisation of this layer: fc1 and fc2 need each expert's M on the host.
    std::vector<int64_t> counts = read_counts_once(p.padded_tokens_per_expert);
    y = unpermute_unpad_fp8_grad(experts(p.rows, p.probs, counts), p);
  } else {
    // Probabilities are applied once, at the unpermute (fp32 accumulation), not in the permute.
    PermuteResult p = permute_pad(x2, r.topk_idx, Variable(), int(num_experts_), options_.align_size, 0, -1,
                                  permuted_rows(x2.size(0)));
    // THE host synchronisation of this layer: fc1 and fc2 need each expert's M on the host.
    std::vector<int64_t> counts = read_counts_once(p.padded_tokens_per_expert);
    y = unpermute_unpad(experts(p.rows, Variable(), counts), p, topk_prob);  // [T, H]
  }
  if (shared_) y = add(y, shared_->forward(x2, compute));
  return reshape(y, in_shape);
}

LoadStats MoeLayer::update_bias(double rate_scale) {
  Tensor bias = expert_bias_.data();  // shares storage: the kernel updates the buffer in place
  update_expert_bias(bias, tokens_since_update_, bias_update_rate_ * rate_scale, bias_update_rule_);
  LoadStats s = load_stats(tokens_since_update_);
  tokens_since_update_.zero_();
  return s;
}

}  // namespace flowmoe
