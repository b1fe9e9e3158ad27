#include "layers/transformer.h"

#include <algorithm>

#include "engine/profiler.h"
#include "engine/stream_lane.h"
#include "layers/mla.h"
#include "layers/mtp.h"

namespace flowmoe {

static std::string layer_prefix(int64_t i) { return "model.layers." + std::to_string(i); }

TransformerBlock::TransformerBlock(ParamFactory& f, const ModelConfig& c, int64_t i, const MoeOptions& moe,
                                   Device device)
    : eps_(c.rms_norm_eps),
      fp8_norms_(moe_flow(moe.recipe).fp8_linears),
      scope_("layers." + std::to_string(i)),
      input_layernorm_(f.ones(layer_prefix(i) + ".input_layernorm.weight", {c.hidden_size})) {
  if (c.attention == AttentionType::mla)
    self_attn_ = std::make_unique<LatentAttention>(f, layer_prefix(i) + ".self_attn", c, output_init_std(c),
                                                   moe_flow(moe.recipe).fp8_linears);
  else
    self_attn_ = std::make_unique<Attention>(f, layer_prefix(i) + ".self_attn", c.hidden_size, c.num_attention_heads,
                                             c.rope_theta, c.initializer_range, output_init_std(c),
                                             moe_flow(moe.recipe).fp8_linears, c.attention_kernel);
  if (is_moe_layer(c, i))
    moe_ = std::make_unique<MoeLayer>(f, c, layer_prefix(i) + ".mlp", moe, device);
  else
    mlp_ = std::make_unique<Mlp>(f, layer_prefix(i) + ".mlp", c.hidden_size, c.intermediate_size, c.initializer_range,
                                 output_init_std(c), moe_flow(moe.recipe).fp8_linears);
  post_attention_layernorm_ = f.ones(layer_prefix(i) + ".post_attention_layernorm.weight", {c.hidden_size});
}

Variable Residual::sum() const { return pending.defined() ? add(h, pending) : h; }

AddNormed norm_residual(const Residual& x, const Variable& weight, double eps, const std::string& site, bool keep_y) {
  if (x.pending.defined()) return add_rmsnorm(x.h, x.pending, weight, eps, site, keep_y);
  if (site.empty()) return {x.h, {Variable(), rmsnorm(x.h, weight, eps)}};
  return {x.h, rmsnorm_quantize(x.h, weight, eps, site, keep_y)};
}

// The profiler's scopes (engine/profiler.h): "layers.3.attention" (with the previous block's residual add and the
// input norm, one kernel, and this block's first add and the norm after it, another), then "layers.3.moe" or ".mlp".
Residual TransformerBlock::forward(const Residual& x, DType compute) const {
  const AddNormed a = attention_half(x, compute);
  ProfileScope layer(scope_);
  ProfileScope part(moe_ ? "moe" : "mlp");
  if (moe_) return hand_on(a.h, moe_->forward(a.n.y, compute, a.n.q));
  if (a.n.q.defined()) return hand_on(a.h, reshape(mlp_->forward(a.n.q, compute), a.h.shape()));
  return hand_on(a.h, mlp_->forward(a.n.y, compute));
}

// A cached forward runs the bf16 recipe (Transformer::forward_cached): no norm quantizes.
Residual TransformerBlock::forward_cached(const Residual& x, DType compute, const Tensor& keys, const Tensor& values,
                                          int64_t pos) const {
  const AddNormed in = input_norm(x, compute);
  const Variable attn = self_attn_->forward_cached(in.n.y, compute, keys, values, pos);
  const AddNormed a = add_rmsnorm(in.h, attn, compute_weight(post_attention_layernorm_, compute), eps_);
  return hand_on(a.h, moe_ ? moe_->forward(a.n.y, compute) : mlp_->forward(a.n.y, compute));
}

Residual TransformerBlock::hand_on(const Variable& h, const Variable& out) const {
  if (fused_residual_) return {h, out};
  return {add(h, out), Variable()};
}

// fp8_full: the input norm emits attention's FP8 input alone (counting the cast at attention's site).
AddNormed TransformerBlock::input_norm(const Residual& x, DType compute) const {
  const Variable w = compute_weight(input_layernorm_, compute);
  if (!fp8_norms_) return norm_residual(x, w, eps_);
  return norm_residual(x, w, eps_, self_attn_->input_site(), self_attn_->keeps_norm_output());
}

// h = x + attn(rmsnorm(x)) and the post-attention norm of h in one kernel (add_rmsnorm): its y, and under fp8_full
// its FP8 copy from the same pass, the MLP reading that alone, the MoE layer both (the router reads y).
AddNormed TransformerBlock::attention_half(const Residual& x, DType compute) const {
  ProfileScope layer(scope_);
  ProfileScope part("attention");
  Variable h, attn;
  if (!recompute_attention_) {
    const AddNormed in = input_norm(x, compute);
    h = in.h;
    attn = attention_branch(in, compute);
  } else {
    // The checkpoint keeps the stream alone, so the pending add runs before it and the norm inside.
    h = x.sum();
    const CheckpointFn branch = [this, compute](const std::vector<Variable>& in) {
      return std::vector<Variable>{attention_branch(input_norm(Residual{in[0], Variable()}, compute), compute)};
    };
    attn = checkpoint(branch, {h})[0];
  }
  const Variable w = compute_weight(post_attention_layernorm_, compute);
  if (!fp8_norms_) return add_rmsnorm(h, attn, w, eps_);
  if (moe_) return add_rmsnorm(h, attn, w, eps_, MoeLayer::input_site(), /*keep_y=*/true);
  return add_rmsnorm(h, attn, w, eps_, mlp_->input_site(), /*keep_y=*/false);
}

Variable TransformerBlock::attention_branch(const AddNormed& in, DType compute) const {
  if (!in.n.q.defined()) return self_attn_->forward(in.n.y, compute);
  return self_attn_->forward_quantized(in.n.q, in.n.y, in.h.size(0), in.h.size(1), compute);
}

MoeInFlight TransformerBlock::moe_begin(const AddNormed& a, DType compute) const {
  ProfileScope layer(scope_);
  ProfileScope part("moe");
  return flowmoe::moe_begin(*moe_, a.n.y, compute, a.n.q);
}

void TransformerBlock::moe_experts(MoeInFlight& p) const {
  ProfileScope layer(scope_);
  ProfileScope part("moe");
  moe_run_experts(*moe_, p);
}

Residual TransformerBlock::moe_finish(const Variable& h, MoeInFlight& p) const {
  ProfileScope layer(scope_);
  ProfileScope part("moe");
  return hand_on(h, flowmoe::moe_finish(*moe_, p));
}

Transformer::Transformer(const ModelConfig& cfg, Device device, DType compute, uint64_t seed, const MoeOptions& moe)
    : cfg_(cfg), device_(device), compute_(compute), recipe_(moe.recipe), comm_stream_(moe.exchange_comm_stream) {
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
  // After every other parameter, so that the model's draws do not depend on the MTP depth.
  for (int64_t k = 1; k <= cfg.num_nextn_predict_layers; ++k) {
    mtp_.push_back(std::make_shared<MtpModule>(f, cfg, k, moe, device));
    if (mtp_.back()->block().moe()) buffers_.push_back(mtp_.back()->block().moe()->expert_bias());
    stages_.resize(f.params().size(), cfg.num_hidden_layers + 1 + k);
  }
  params_ = f.params();
  shards_ = f.shards();
}

std::vector<TransformerBlock*> Transformer::all_blocks() const {
  std::vector<TransformerBlock*> blocks;
  for (const std::unique_ptr<TransformerBlock>& block : layers_) blocks.push_back(block.get());
  for (const std::shared_ptr<MtpModule>& m : mtp_) blocks.push_back(&m->block());
  return blocks;
}

void Transformer::set_recompute_attention(bool on) {
  for (TransformerBlock* block : all_blocks()) block->set_recompute_attention(on);
}

void Transformer::set_fused_residual(bool on) {
  for (TransformerBlock* block : all_blocks()) block->set_fused_residual(on);
}

int64_t Transformer::num_parameters() const {
  int64_t n = 0;
  for (const Variable& p : params_) n += p.data().numel();
  return n;
}

void Transformer::check_ids(const Tensor& ids) const {
  FLOWMOE_CHECK(ids.dim() == 2 && ids.dtype() == DType::i32, ShapeError, "Transformer: ids ", ids.describe(),
                ", expected [B, T] i32");
  FLOWMOE_CHECK(ids.size(1) <= cfg_.max_position_embeddings, ShapeError, "Transformer: sequence of ", ids.size(1),
                " tokens exceeds max_position_embeddings ", cfg_.max_position_embeddings);
}

void Transformer::stage(int64_t s) const {
  if (stage_hook_) stage_hook_(s);
}

Variable Transformer::embed(const Tensor& ids) const {
  ProfileScope scope("embed");
  return embedding(compute_weight(embed_tokens_, compute_), ids.to(device_));
}

AddNormed Transformer::head_norm(const Residual& x, const Variable& norm) const {
  ProfileScope scope("head");
  return norm_residual(x, compute_weight(norm, compute_), cfg_.rms_norm_eps);
}

Variable Transformer::head(const Variable& normed) const {
  ProfileScope scope("head");
  // A tied head casts the embedding again, so each use's gradient returns to f32 before they are added.
  return linear(normed, compute_weight(lm_head_, compute_));
}

Residual Transformer::stream(const Tensor& ids) const {
  check_ids(ids);
  stage(0);
  Residual h{embed(ids), Variable()};
  for (size_t i = 0; i < layers_.size(); ++i) {
    stage(int64_t(i) + 1);
    h = layers_[i]->forward(h, compute_);
  }
  stage(int64_t(layers_.size()) + 1);
  return h;
}

Variable Transformer::hidden(const Tensor& ids) const { return stream(ids).sum(); }

Variable Transformer::forward(const Tensor& ids) const { return head(head_norm(stream(ids), norm_).n.y); }

Variable Transformer::forward_cached(const Tensor& ids, KvCache& cache) const {
  check_ids(ids);
  FLOWMOE_CHECK(ids.size(0) == 1, ShapeError, "Transformer: a cached forward takes one sequence, got ids ",
                ids.describe());
  FLOWMOE_CHECK(recipe_ == MoeRecipe::bf16, ConfigError, "Transformer: a cached forward runs the bf16 recipe, not ",
                moe_recipe_name(recipe_), " (build the model for inference with precision.recipe bf16)");
  FLOWMOE_CHECK(cache.keys.size() == layers_.size(), ShapeError, "Transformer: a K/V cache of ", cache.keys.size(),
                " layers for a model of ", layers_.size());
  const int64_t pos = cache.length;
  Residual h{embed(ids), Variable()};
  for (size_t i = 0; i < layers_.size(); ++i)
    h = layers_[i]->forward_cached(h, compute_, cache.keys[i], cache.values[i], pos);
  cache.length += ids.size(1);
  return head(head_norm(h, norm_).n.y);
}

Variable Transformer::lm_loss(const Variable& logits, const Tensor& targets) const {
  ProfileScope scope("head");
  const int64_t n = targets.numel();
  return cross_entropy(reshape(logits, {n, cfg_.vocab_size}), targets.contiguous().to(device_).reshape({n}));
}

Variable Transformer::Losses::total() const {
  Variable t = aux.defined() ? add(lm, aux) : lm;
  return mtp.defined() ? add(t, scale(mtp, mtp_weight)) : t;
}

namespace {

// An aux term in the LM loss's dtype, added to the sum so far.
Variable add_aux(const Variable& sum, const Variable& a, DType dtype) {
  const Variable term = a.dtype() == dtype ? a : cast(a, dtype);
  return sum.defined() ? add(sum, term) : term;
}

}  // namespace

Transformer::Losses Transformer::losses(const Tensor& ids, const Tensor& targets) const {
  FLOWMOE_CHECK(targets.shape() == ids.shape(), ShapeError, "Transformer::loss: targets ", targets.describe(),
                " vs ids ", ids.describe());
  if (dual_microbatch_ && grad_enabled()) return dual_losses(ids, targets);
  Losses out;
  if (!mtp_.empty() && grad_enabled())
    joint_losses(ids, targets, out);
  else
    out.lm = lm_loss(forward(ids), targets);
  ProfileScope scope("head");
  const std::vector<TransformerBlock*> blocks = all_blocks();
  // The MTP blocks' aux terms only where they ran.
  const size_t num_run = out.mtp.defined() ? blocks.size() : layers_.size();
  for (size_t i = 0; i < num_run; ++i)
    if (blocks[i]->moe() && blocks[i]->moe()->aux_loss().defined())
      out.aux = add_aux(out.aux, blocks[i]->moe()->aux_loss(), out.lm.dtype());
  return out;
}

// Two halves of the batch through every layer in step: a dense block runs one half then the other; an MoE
// block runs both halves' attention and dispatch, then both halves' experts, then both combines, with the
// exchanges on the comm lane. The weights of each stage are waited for once.
Transformer::Losses Transformer::dual_losses(const Tensor& ids, const Tensor& targets) const {
  check_ids(ids);
  const int64_t B = ids.size(0);
  FLOWMOE_CHECK(B % 2 == 0, ShapeError, "parallel.dual_microbatch: a batch of ", B,
                " sequences on this rank does not split into two equal halves");
  const Tensor half_ids[2] = {ids.slice(0, 0, B / 2), ids.slice(0, B / 2, B)};
  const Tensor half_targets[2] = {targets.slice(0, 0, B / 2), targets.slice(0, B / 2, B)};
  LaneScope lane(Lane::comm, device_, comm_stream_);
  Residual h[2];
  std::vector<Variable> layer_aux[2];
  stage(0);
  for (int k = 0; k < 2; ++k) h[k] = {embed(half_ids[k].contiguous()), Variable()};
  for (size_t i = 0; i < layers_.size(); ++i) {
    stage(int64_t(i) + 1);
    const TransformerBlock& block = *layers_[i];
    if (!block.moe()) {
      for (Residual& x : h) x = block.forward(x, compute_);
      continue;
    }
    AddNormed a[2];
    MoeInFlight p[2];
    for (int k = 0; k < 2; ++k) {
      a[k] = block.attention_half(h[k], compute_);
      p[k] = block.moe_begin(a[k], compute_);  // k's dispatch travels beside the other half's work
    }
    for (MoeInFlight& pk : p) block.moe_experts(pk);
    for (int k = 0; k < 2; ++k) {
      h[k] = block.moe_finish(a[k].h, p[k]);
      if (p[k].t.aux_loss.defined()) layer_aux[k].push_back(p[k].t.aux_loss);
    }
  }
  comm_lane_join(device_);
  stage(int64_t(layers_.size()) + 1);
  Variable lm[2], top[2];  // top: the last block's output, h^0 of the MTP modules
  for (int k = 0; k < 2; ++k) {
    const AddNormed n = head_norm(h[k], norm_);
    top[k] = n.h;
    lm[k] = lm_loss(head(n.n.y), half_targets[k]);
  }
  Losses out;
  out.lm = scale(add(lm[0], lm[1]), 0.5);
  if (!mtp_.empty()) {
    Variable mtp[2];
    for (int k = 0; k < 2; ++k) {
      mtp[k] = mtp_loss(top[k], half_ids[k], half_targets[k]);
      for (const std::shared_ptr<MtpModule>& m : mtp_)
        if (m->block().moe() && m->block().moe()->aux_loss().defined())
          layer_aux[k].push_back(m->block().moe()->aux_loss());
    }
    comm_lane_join(device_);
    out.mtp = scale(add(mtp[0], mtp[1]), 0.5);
    out.mtp_weight = mtp_weight_;
  }
  for (size_t j = 0; j < layer_aux[0].size(); ++j)
    out.aux = add_aux(out.aux, scale(add(layer_aux[0][j], layer_aux[1][j]), 0.5), out.lm.dtype());
  return out;
}

int64_t Transformer::num_moe_layers() const {
  const std::vector<TransformerBlock*> blocks = all_blocks();
  return std::count_if(blocks.begin(), blocks.end(), [](const auto* l) { return l->moe() != nullptr; });
}

bool Transformer::overlaps_exchanges() const {
  if (dual_microbatch_ && num_moe_layers() > 0) return true;
  const std::vector<TransformerBlock*> blocks = all_blocks();
  return std::any_of(blocks.begin(), blocks.end(),
                     [](const auto* l) { return l->moe() && l->moe()->num_chunks() > 1; });
}

std::vector<Tensor> Transformer::moe_load_counts() const {
  std::vector<Tensor> counts;
  for (TransformerBlock* layer : all_blocks())
    if (layer->moe()) counts.push_back(layer->moe()->load_counts());
  return counts;
}

bool Transformer::exchanges_zero_sync() const {
  const std::vector<TransformerBlock*> blocks = all_blocks();
  return std::any_of(blocks.begin(), blocks.end(), [](const auto* l) { return l->moe() && l->moe()->zero_sync(); });
}

void Transformer::set_exchange_buffers(double capacity_factor, int64_t min_rows, const Tensor& overflow) {
  for (TransformerBlock* layer : all_blocks())
    if (layer->moe()) layer->moe()->set_exchange_buffers(capacity_factor, min_rows, overflow);
}

std::vector<Tensor> Transformer::update_moe_bias(const StepScalars* control) {
  std::vector<Tensor> loads;
  for (TransformerBlock* layer : all_blocks())
    if (layer->moe()) loads.push_back(layer->moe()->update_bias(control));
  return loads;
}

}  // namespace flowmoe
