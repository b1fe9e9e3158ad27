#include "layers/transformer.h"

#include <algorithm>
#include <cmath>

#include "engine/profiler.h"

namespace flowmoe {

static std::string layer_prefix(int64_t i) { return "model.layers." + std::to_string(i); }

// Output projections start smaller so the residual stream's variance does not grow with depth.
static double out_std(const ModelConfig& c) {
  return c.initializer_range / std::sqrt(2.0 * double(c.num_hidden_layers));
}

TransformerBlock::TransformerBlock(ParamFactory& f, const ModelConfig& c, int64_t i, const MoeOptions& moe,
                                   Device device)
    : eps_(c.rms_norm_eps),
      scope_("layers." + std::to_string(i)),
      input_layernorm_(f.ones(layer_prefix(i) + ".input_layernorm.weight", {c.hidden_size})),
      self_attn_(f, layer_prefix(i) + ".self_attn", c.hidden_size, c.num_attention_heads, c.rope_theta,
                 c.initializer_range, out_std(c)) {
  if (c.n_routed_experts > 0 && i >= c.first_k_dense_replace)
    moe_ = std::make_unique<MoeLayer>(f, c, layer_prefix(i) + ".mlp", moe, device);
  else
    mlp_ = std::make_unique<Mlp>(f, layer_prefix(i) + ".mlp", c.hidden_size, c.intermediate_size, c.initializer_range,
                                 out_std(c));
  post_attention_layernorm_ = f.ones(layer_prefix(i) + ".post_attention_layernorm.weight", {c.hidden_size});
}

// The profiler's scopes (engine/profiler.h): "layers.3.attention", then "layers.3.moe" or ".mlp".
Variable TransformerBlock::forward(const Variable& x, DType compute) const {
  ProfileScope layer(scope_);
  Variable h;
  {
    ProfileScope part("attention");
    h = add(x, self_attn_.forward(rmsnorm(x, compute_weight(input_layernorm_, compute), eps_), compute));
  }
  ProfileScope part(moe_ ? "moe" : "mlp");
  Variable n = rmsnorm(h, compute_weight(post_attention_layernorm_, compute), eps_);
  return add(h, moe_ ? moe_->forward(n, compute) : mlp_->forward(n, compute));
}

Transformer::Transformer(const ModelConfig& cfg, Device device, DType compute, uint64_t seed, const MoeOptions& moe)
    : cfg_(cfg), device_(device), compute_(compute) {
  FLOWMOE_CHECK(compute == DType::f32 || (compute == DType::bf16 && device.is_cuda()), DTypeError,
                "Transformer: compute dtype ", dtype_name(compute), " on ", device.str(),
                " (the CPU computes in f32, the GPU in bf16 or f32)");
  ParamFactory f(seed, device);
  embed_tokens_ = f.normal("model.embed_tokens.weight", {cfg.vocab_size, cfg.hidden_size}, cfg.initializer_range);
  stages_.push_back(0);
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    layers_.push_back(std::make_unique<TransformerBlock>(f, cfg, i, moe, device));
    if (layers_.back()->moe()) buffers_.push_back(layers_.back()->moe()->expert_bias());
    stages_.resize(f.params().size(), 1 + i);
  }
  norm_ = f.ones("model.norm.weight", {cfg.hidden_size});
  lm_head_ = cfg.tie_word_embeddings
                 ? embed_tokens_
                 : f.normal("lm_head.weight", {cfg.vocab_size, cfg.hidden_size}, cfg.initializer_range);
  stages_.resize(f.params().size(), cfg.num_hidden_layers + 1);
  params_ = f.params();
  shards_ = f.shards();
}

int64_t Transformer::num_parameters() const {
  int64_t n = 0;
  for (const Variable& p : params_) n += p.data().numel();
  return n;
}

Variable Transformer::forward(const Tensor& ids) const {
  FLOWMOE_CHECK(ids.dim() == 2 && ids.dtype() == DType::i32, ShapeError, "Transformer: ids ", ids.describe(),
                ", expected [B, T] i32");
  FLOWMOE_CHECK(ids.size(1) <= cfg_.max_position_embeddings, ShapeError, "Transformer: sequence of ", ids.size(1),
                " tokens exceeds max_position_embeddings ", cfg_.max_position_embeddings);
  const auto stage = [&](int64_t s) {
    if (stage_hook_) stage_hook_(s);
  };
  Variable h;
  {
    ProfileScope scope("embed");
    stage(0);
    h = embedding(compute_weight(embed_tokens_, compute_), ids.to(device_));
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    stage(int64_t(i) + 1);
    h = layers_[i]->forward(h, compute_);
  }
  stage(int64_t(layers_.size()) + 1);
  ProfileScope scope("head");
  h = rmsnorm(h, compute_weight(norm_, compute_), cfg_.rms_norm_eps);
  // A tied head casts the embedding again, so each use's gradient returns to f32 before they are added.
  return linear(h, compute_weight(lm_head_, compute_));
}

Variable Transformer::Losses::total() const { return aux.defined() ? add(lm, aux) : lm; }

Transformer::Losses Transformer::losses(const Tensor& ids, const Tensor& targets) const {
  FLOWMOE_CHECK(targets.shape() == ids.shape(), ShapeError, "Transformer::loss: targets ", targets.describe(),
                " vs ids ", ids.describe());
  Variable logits = forward(ids);
  const int64_t n = ids.numel();
  ProfileScope scope("head");
  Losses out;
  out.lm = cross_entropy(reshape(logits, {n, cfg_.vocab_size}), targets.to(device_).reshape({n}));
  for (const auto& layer : layers_) {
    if (!layer->moe() || !layer->moe()->aux_loss().defined()) continue;
    const Variable& a = layer->moe()->aux_loss();
    const Variable term = a.dtype() == out.lm.dtype() ? a : cast(a, out.lm.dtype());
    out.aux = out.aux.defined() ? add(out.aux, term) : term;
  }
  return out;
}

int64_t Transformer::num_moe_layers() const {
  return std::count_if(layers_.begin(), layers_.end(), [](const auto& l) { return l->moe() != nullptr; });
}

bool Transformer::exchanges_in_chunks() const {
  return std::any_of(layers_.begin(), layers_.end(),
                     [](const auto& l) { return l->moe() && l->moe()->num_chunks() > 1; });
}

std::vector<Tensor> Transformer::moe_load_counts() const {
  std::vector<Tensor> counts;
  for (const auto& layer : layers_)
    if (layer->moe()) counts.push_back(layer->moe()->load_counts());
  return counts;
}

std::vector<Tensor> Transformer::update_moe_bias(const StepScalars* control) {
  std::vector<Tensor> loads;
  for (const auto& layer : layers_)
    if (layer->moe()) loads.push_back(layer->moe()->update_bias(control));
  return loads;
}

}  // namespace flowmoe
