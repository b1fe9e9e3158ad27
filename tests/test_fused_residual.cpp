// A block's second residual add fused into the norm that reads the stream next (layers/transformer.h Residual:
// the next block's input norm, the final norm, an MTP module's head norm): training gives the losses of the
// unfused arithmetic bit for bit in every recipe, with MTP, dual micro-batches and attention recompute; a cached
// forward gives its logits; gradients through a pending add match finite differences; and on the GPU the fused
// norms give the unfused loss and gradients.
#include <string>
#include <vector>

#include "layers/kv_cache.h"
#include "layers/transformer.h"
#include "tests/support/checks.h"
#include "train/optimizer.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

// Three blocks, the first dense, then two MoE (4 experts, top-2, one shared expert); every width 128 (FP8 GEMMs).
ModelConfig small_model(int64_t mtp_depth) {
  ModelConfig c;
  c.vocab_size = 64;
  c.hidden_size = 128;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.intermediate_size = 128;
  c.max_position_embeddings = 16;
  c.n_routed_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 128;
  c.n_shared_experts = 1;
  c.first_k_dense_replace = 1;
  c.num_nextn_predict_layers = mtp_depth;
  return c;
}

struct Variant {
  std::string name;
  int64_t mtp_depth = 0;
  bool dual_microbatch = false, recompute_attention = false;
};

// Every step's total loss and the last step's parameters, training `steps` AdamW steps on fixed batches.
struct TrainRun {
  std::vector<double> losses;
  std::vector<std::vector<double>> params;
};

TrainRun train_steps(MoeRecipe recipe, const Variant& v, bool fused, int steps) {
  MoeOptions o(16);
  o.recipe = recipe;
  Transformer model(small_model(v.mtp_depth), Device::cpu(), DType::f32, 5, o);
  model.set_fused_residual(fused);
  model.set_dual_microbatch(v.dual_microbatch);
  model.set_recompute_attention(v.recompute_attention);
  model.set_mtp_loss_weight(0.3);
  OptimizerConfig cfg;
  cfg.lr = 1e-2;
  AdamW opt(model.parameters(), cfg);
  Rng rng(13);
  TrainRun r;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    for (int micro = 0; micro < 2; ++micro) {  // gradients accumulated over 2 micro-batches
      const Tensor ids = rng.randint({4, 16}, 0, 64), targets = rng.randint({4, 16}, 0, 64);
      const Variable loss = model.loss(ids, targets);
      loss.backward();
      r.losses.push_back(loss.data().to_doubles()[0]);
    }
    opt.step(cfg.lr, 1.0);
  }
  for (const Variable& p : model.parameters()) r.params.push_back(p.data().to_doubles());
  return r;
}

}  // namespace

TEST(FusedResidual, TrainingLossesMatchTheUnfusedAddsBitwise) {
  const std::vector<Variant> variants = {
      {"plain", 0, false, false}, {"mtp", 1, false, false}, {"dual", 1, true, false}, {"recompute", 0, false, true}};
  for (MoeRecipe recipe : {MoeRecipe::bf16, MoeRecipe::fp8_blockwise, MoeRecipe::fp8_flow, MoeRecipe::fp8_full}) {
    for (const Variant& v : variants) {
      SCOPED_TRACE(std::string(moe_recipe_name(recipe)) + ", " + v.name);
      const TrainRun unfused = train_steps(recipe, v, false, 3), fused = train_steps(recipe, v, true, 3);
      ASSERT_EQ(fused.losses.size(), 6u);
      for (size_t s = 0; s < fused.losses.size(); ++s)
        EXPECT_EQ(fused.losses[s], unfused.losses[s]) << "step " << s + 1;
      ASSERT_EQ(fused.params.size(), unfused.params.size());
      for (size_t i = 0; i < fused.params.size(); ++i) EXPECT_EQ(fused.params[i], unfused.params[i]) << "param " << i;
    }
  }
}

TEST(FusedResidual, CachedForwardGivesTheUnfusedLogits) {
  Transformer model(small_model(0), Device::cpu(), DType::f32, 5);
  Rng rng(3);
  const Tensor prompt = rng.randint({1, 5}, 0, 64), next = rng.randint({1, 1}, 0, 64);
  NoGradGuard no_grad;
  std::vector<std::vector<double>> logits[2];
  for (bool fused : {false, true}) {
    model.set_fused_residual(fused);
    KvCache cache(model.config(), 8, DType::f32, Device::cpu());
    logits[fused].push_back(model.forward_cached(prompt, cache).data().to_doubles());
    logits[fused].push_back(model.forward_cached(next, cache).data().to_doubles());
  }
  EXPECT_EQ(logits[1], logits[0]);
  // The prompt's pass is the training forward's.
  EXPECT_EQ(model.forward(prompt).data().to_doubles(), logits[1][0]);
}

// d/d(h, pending, weight) of a norm reading a pending add, and of a dense block through to the next norm.
TEST(FusedResidual, GradientsThroughAPendingAddMatchFiniteDifferences) {
  Rng rng(4);
  const Tensor h = random_tensor(rng, {2, 3, 16}, DType::f64), pending = random_tensor(rng, {2, 3, 16}, DType::f64);
  const Tensor w = random_tensor(rng, {16}, DType::f64);
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Variable>& in) {
        const AddNormed n = norm_residual(Residual{in[0], in[1]}, in[2], 1e-6);
        return add(mul(n.h, n.h), n.n.y);  // both outputs reach the loss
      },
      {h, pending, w}));
  ModelConfig c = small_model(0);
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.n_routed_experts = 0;
  ParamFactory f(6, Device::cpu());
  const TransformerBlock block(f, c, 1, MoeOptions(16), Device::cpu());
  const Tensor w2 = random_tensor(rng, {16}, DType::f64);
  EXPECT_TRUE(gradcheck(
      [&block](const std::vector<Variable>& in) {
        const Residual out = block.forward(Residual{in[0], in[1]}, DType::f64);
        const AddNormed n = norm_residual(out, in[2], 1e-6);
        return add(n.h, n.n.y);
      },
      {h, pending, w2}));
}

// On the GPU (bf16 compute) the fused norms give the unfused adds' loss and gradients bit for bit too, with an MTP
// module, in the bf16 recipe and in fp8_full (whose input norms quantize).
TEST(FusedResidualCuda, GradientsMatchTheUnfusedAddsBitwise) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(8);
  const Tensor ids = rng.randint({4, 16}, 0, 64), targets = rng.randint({4, 16}, 0, 64);
  for (MoeRecipe recipe : {MoeRecipe::bf16, MoeRecipe::fp8_full}) {
    SCOPED_TRACE(moe_recipe_name(recipe));
    MoeOptions o(16);
    o.recipe = recipe;
    std::vector<std::vector<double>> run[2];  // [fused]: the loss, then every parameter's gradient
    for (bool fused : {false, true}) {
      Transformer model(small_model(1), Device::cuda(), DType::bf16, 5, o);
      model.set_fused_residual(fused);
      model.set_mtp_loss_weight(0.3);
      const Variable loss = model.loss(ids, targets);
      loss.backward();
      run[fused].push_back(loss.data().to_doubles());
      for (const Variable& p : model.parameters()) run[fused].push_back(p.grad().to_doubles());
    }
    ASSERT_EQ(run[1].size(), run[0].size());
    for (size_t i = 0; i < run[1].size(); ++i) EXPECT_EQ(run[1][i], run[0][i]) << (i == 0 ? "loss" : "gradient");
  }
}
