// The MoE layer's FP8 recipes (layers/moe.cpp): against the bf16/f32 layer with a stated tolerance,
// cast counts per recipe (the flow's 2), weights quantized once per parameter version, moe_expert
// recompute with bitwise-identical gradients, CUDA against the CPU, a tiny model that trains, and the
// backward's order against the reading guide beside MoeLayer::forward.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "engine/allocator.h"
#include "engine/cast_stats.h"
#include "engine/profiler.h"
#include "layers/moe.h"
#include "tests/support/checks.h"
#include "tests/support/moe_config.h"
#include "tests/support/train_fixtures.h"
#include "train/metrics.h"
#include "train/trainer.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

ModelConfig fp8_config(int64_t E, int64_t k, int64_t H, int64_t F, int64_t shared) {
  return moe_test_config(E, k, H, F, shared, 0.05);
}

MoeOptions options(MoeRecipe recipe, bool recompute = false, int align = 16) {
  MoeOptions o(align);
  o.recipe = recipe;
  o.recompute_expert = recompute;
  return o;
}

const MoeRecipe kFp8Recipes[] = {MoeRecipe::fp8_blockwise, MoeRecipe::fp8_flow};

}  // namespace

// FP8 against the f32 layer on the CPU: same routing (the router runs in fp32 on the same x), so
// the difference is the FP8 rounding of activations, gradients and weights (e4m3: up to 2^-4
// relative per element and operand, averaging down over the GEMMs' sums; with T = 1 a weight
// gradient is one outer product and nothing averages, hence the looser bound on gradients).
TEST(MoeFp8, CloseToTheF32Layer) {
  Rng rng(test_seed());
  for (int64_t T : {0, 1, 37, 200}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    ModelConfig c = fp8_config(4, 2, 128, 128, 1);
    Tensor x = random_tensor(rng, {T, 128}), dy = random_tensor(rng, {T, 128});
    LayerRun ref = run_layer(c, options(MoeRecipe::bf16), x, dy, Device::cpu(), DType::f32);
    for (MoeRecipe recipe : kFp8Recipes) {
      SCOPED_TRACE(moe_recipe_name(recipe));
      LayerRun got = run_layer(c, options(recipe), x, dy, Device::cpu(), DType::f32);
      if (T == 0) {
        EXPECT_EQ(got.y.numel(), 0);
        continue;
      }
      EXPECT_LT(rel_error(got.y, ref.y), 0.06);
      EXPECT_LT(rel_error(got.dx, ref.dx), 0.08);
      // Parameter 0 is the router gate: its gradient is a sum of differences of FP8 dot products
      // (the probs are normalized) that nearly cancel, so its relative error shrinks only as T grows:
      // with one token it is not compared; at T=37 it measured up to 0.107 over 550 seeds (0.15
      // allowed), at T=200 below 0.1. A wrong scale or block gives errors of order 1.
      for (size_t i = T == 1 ? 1 : 0; i < ref.grads.size(); ++i) {
        const double bound = T == 1 ? 0.2 : (i == 0 && T < 100 ? 0.15 : 0.1);
        EXPECT_LT(rel_error(got.grads[i], ref.grads[i]), bound) << "parameter " << i;
      }
    }
  }
}

// The point of the flow: 2 explicit casts per layer per step (quantize x before dispatch, quantize
// dy before the gradient's dispatch); the classic recipe quantizes and re-quantizes at every GEMM.
TEST(MoeFp8, CastCountsPerRecipe) {
  Rng rng(test_seed());
  ModelConfig c = fp8_config(4, 2, 128, 256, 0);
  Tensor x = random_tensor(rng, {50, 128}), dy = random_tensor(rng, {50, 128});
  struct Expect {
    MoeRecipe recipe;
    int64_t quantize, dequantize;
  };
  for (Expect e :
       {Expect{MoeRecipe::bf16, 0, 0}, Expect{MoeRecipe::fp8_blockwise, 8, 2}, Expect{MoeRecipe::fp8_flow, 2, 0}}) {
    SCOPED_TRACE(moe_recipe_name(e.recipe));
    reset_cast_counts();
    run_layer(c, options(e.recipe), x, dy, Device::cpu(), DType::f32);
    CastCounts n = cast_counts();
    EXPECT_EQ(n.quantize, e.quantize);
    EXPECT_EQ(n.dequantize, e.dequantize);
    EXPECT_EQ(n.weight_quantize, e.recipe == MoeRecipe::bf16 ? 0 : 2);  // fc1 and fc2
    if (e.recipe == MoeRecipe::fp8_flow) {
      EXPECT_EQ(n.by_site["quantize dispatch: x"], 1);
      EXPECT_EQ(n.by_site["quantize combine backward: dy"], 1);
    }
  }
}

// Weights are quantized once per parameter version: a second forward reuses them, an in-place
// update (the optimizer bumps the version) re-quantizes.
TEST(MoeFp8, WeightsQuantizedOncePerVersion) {
  Rng rng(test_seed());
  ModelConfig c = fp8_config(4, 2, 128, 128, 0);
  ParamFactory f(3, Device::cpu());
  MoeLayer layer(f, c, "mlp", options(MoeRecipe::fp8_flow), Device::cpu());
  Tensor x = random_tensor(rng, {20, 128});
  reset_cast_counts();
  NoGradGuard ng;
  Tensor y1 = layer.forward(Variable(x), DType::f32).data();
  layer.forward(Variable(x), DType::f32);
  EXPECT_EQ(cast_counts().weight_quantize, 2);
  Variable fc1 = f.params()[1];
  ASSERT_NE(fc1.name().find("experts.fc1"), std::string::npos) << fc1.name();
  Tensor w = fc1.data();
  w.zero_();
  fc1.bump_version();
  Tensor y2 = layer.forward(Variable(x), DType::f32).data();
  EXPECT_EQ(cast_counts().weight_quantize, 3);
  EXPECT_GT(rel_error(y1, y2), 0.0) << "the zeroed fc1 was not re-quantized";
}

// recompute: [moe_expert] keeps only the expert input and re-runs fc1 → SwiGLU(+quantize) in
// backward; the gradients must not change by a single bit.
TEST(MoeFp8, RecomputeGivesBitwiseIdenticalGradients) {
  Rng rng(test_seed());
  ModelConfig c = fp8_config(4, 2, 128, 128, 1);
  Tensor x = random_tensor(rng, {61, 128}), dy = random_tensor(rng, {61, 128});
  std::vector<Device> devices = {Device::cpu()};
  if (cuda_available()) devices.push_back(Device::cuda());
  for (Device dev : devices)
    for (MoeRecipe recipe : {MoeRecipe::bf16, MoeRecipe::fp8_blockwise, MoeRecipe::fp8_flow}) {
      SCOPED_TRACE(std::string(moe_recipe_name(recipe)) + " on " + dev.str());
      DType compute = dev.is_cpu() ? DType::f32 : DType::bf16;
      LayerRun a = run_layer(c, options(recipe, false), x, dy, dev, compute);
      LayerRun b = run_layer(c, options(recipe, true), x, dy, dev, compute);
      EXPECT_TRUE(bit_equal(b.y, a.y));
      EXPECT_TRUE(bit_equal(b.dx, a.dx));
      for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_TRUE(bit_equal(b.grads[i], a.grads[i])) << "parameter " << i;
    }
}

// ... and what it is for: with the graph held for backward, the layer keeps less, by at least half of fc1's output
// over the routed rows (f32 [T k, 2F] here; measured: all of it in bf16 and fp8_flow, 0.73 of it in fp8_blockwise).
// The test above compares recompute with itself switched off, which a layer ignoring the option would pass.
TEST(MoeFp8, RecomputeKeepsLessForTheBackward) {
  Rng rng(test_seed());
  const int64_t T = 200, k = 2, F = 128;
  const ModelConfig c = fp8_config(4, k, 128, F, 0);
  const Tensor x = random_tensor(rng, {T, 128});
  for (MoeRecipe recipe : {MoeRecipe::bf16, MoeRecipe::fp8_blockwise, MoeRecipe::fp8_flow}) {
    SCOPED_TRACE(moe_recipe_name(recipe));
    const auto held = [&](bool recompute) {
      ParamFactory f(11, Device::cpu());
      MoeLayer layer(f, c, "mlp", options(recipe, recompute), Device::cpu());
      Variable xv(x.clone(), true);
      const int64_t before = int64_t(memory_stats(Device::cpu()).live_bytes);
      const Variable y = layer.forward(xv, DType::f32);  // alive: its graph holds what the backward needs
      return int64_t(memory_stats(Device::cpu()).live_bytes) - before;
    };
    const int64_t plain = held(false), recomputed = held(true);
    EXPECT_GE(plain - recomputed, T * k * F * 4) << plain << " bytes kept without recompute, " << recomputed << " with";
  }
}

TEST(MoeFp8, RejectsWidthsFp8CannotServe) {
  ParamFactory f(1, Device::cpu());
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] { MoeLayer(f, fp8_config(4, 2, 96, 128, 0), "mlp", options(MoeRecipe::fp8_flow), Device::cpu()); },
      {"hidden_size", "96", "not a multiple of 128", "fp8_flow"}));
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] { MoeLayer(f, fp8_config(4, 2, 128, 100, 0), "mlp", options(MoeRecipe::fp8_blockwise), Device::cpu()); },
      {"moe_intermediate_size", "100"}));
}

// The GPU (bf16 compute, cuBLASLt block-scaled GEMMs) against the CPU (f32 compute, dequantized
// reference GEMMs) for each FP8 recipe, with inputs redrawn until both route identically.
TEST(MoeFp8Cuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (int64_t T : {0, 1, 100, 1000}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    ModelConfig c = fp8_config(8, 2, 256, 128, 1);
    for (MoeRecipe recipe : kFp8Recipes)
      for (int align : {16, 128}) {
        SCOPED_TRACE(std::string(moe_recipe_name(recipe)) + " align " + std::to_string(align));
        Tensor x = random_tensor(rng, {T, 256}).to(DType::bf16).to(DType::f32);
        Tensor dy = random_tensor(rng, {T, 256}).to(DType::bf16).to(DType::f32);
        LayerRun cpu = run_layer(c, options(recipe, false, align), x, dy, Device::cpu(), DType::f32);
        LayerRun gpu = run_layer(c, options(recipe, false, align), x, dy, Device::cuda(), DType::bf16);
        if (T == 0) continue;
        // One token's output is one row: a single FP8 rounding that the bf16 inputs move (a step of
        // 2^-4 of a value) is not averaged out over tokens either (measured: 0.0375 with one seed).
        EXPECT_LT(rel_error(gpu.y, cpu.y), T == 1 ? 6e-2 : 3e-2);
        EXPECT_LT(rel_error(gpu.dx, cpu.dx), T == 1 ? 0.1 : 5e-2);
        // The router gate's gradient (parameter 0) is ill-conditioned with one token (see CloseToTheF32Layer).
        // With one token an expert weight's gradient is one outer product: bf16 inputs on the GPU
        // move single FP8 roundings (steps of 2^-4) and nothing averages them out, hence 0.1 there.
        for (size_t i = T == 1 ? 1 : 0; i < cpu.grads.size(); ++i)
          EXPECT_LT(rel_error(gpu.grads[i], cpu.grads[i]), T == 1 ? 0.1 : 5e-2) << "parameter " << i;
      }
  }
}

// A tiny MoE model trains in each FP8 recipe on the CPU and follows the f32 run where FP8 error can
// be bounded. Step 1 runs the same weights on the same batch, so the losses differ by FP8's rounding
// of x, h and the expert weights alone (e4m3: up to 2^-4 per element, averaging down over the GEMMs'
// sums and the 128 tokens' mean; measured 1e-4 relative): 0.5% allows 50x that and still fails a
// wrong scale or a misplaced block. After a few updates at lr 0.01 the runs take different paths
// (different roundings pick different experts), as two f32 runs on different vector units do, so a
// per-step bound there would test the trajectory, not FP8. Steps 2-3 stay within 1% (measured
// <= 0.2% over init seeds); from then on the check is that every recipe learns as f32 does. fp8_full rounds
// every linear but the head (and the attention's inputs) too: the same bounds hold for it (measured 0.02%, 0.08%
// and 0.4% at steps 1-3 of a model of this size). Its moe_casts is every cast of the step over the MoE layers:
// 2 attentions' 6, the dense MLP's 5 and the MoE layer's 6 (tests/test_fp8_full.cpp has them by site).
TEST(MoeFp8, TinyModelTrainsNearTheF32Curve) {
  fs::path d = fresh_dir("fp8");
  const uint64_t seed = test_seed() % 1000000;
  auto config = [&](const std::string& recipe) {
    Config c = parse_config(
        "model: {vocab_size: 64, hidden_size: 128, num_hidden_layers: 2, num_attention_heads: 2,"
        " intermediate_size: 128, max_position_embeddings: 16, first_k_dense_replace: 1, n_routed_experts: 4,"
        " num_experts_per_tok: 2, moe_intermediate_size: 128, n_shared_experts: 1, bias_update_rate: 0.01}\n"
        "data: {seq_len: 16, synthetic_tokens: 20000, val_fraction: 0.1}\n"
        "train: {device: cpu, steps: 15, batch_size: 8, eval_every: 0, eval_batches: 2, seed: " +
            std::to_string(seed) +
            "}\n"
            "optimizer: {lr: 0.01, min_lr: 0.001, warmup_steps: 3}\n"
            "precision: {recipe: " +
            recipe +
            "}\n"
            "logging: {progress: plain}\n",
        "tiny_fp8_test.yaml");
    c.logging.out_dir = (d / recipe).string();
    return c;
  };
  // The mean of the last 3 losses must fall below 3/4 of ln(vocab), the loss of a uniform guess.
  const double learned = 0.75 * std::log(64.0);
  auto tail_mean = [](const std::vector<double>& l) {
    return (l[l.size() - 1] + l[l.size() - 2] + l[l.size() - 3]) / 3;
  };
  TrainResult ref = train(config("bf16"), quiet());
  ASSERT_EQ(ref.losses.size(), 15u);
  EXPECT_LT(tail_mean(ref.losses), learned) << "the f32 run did not learn (init seed " << seed << ")";
  const std::map<std::string, double> casts = {{"fp8_blockwise", 10}, {"fp8_flow", 2}, {"fp8_full", 2 * 6 + 5 + 6}};
  for (const auto& [recipe, moe_casts] : casts) {
    SCOPED_TRACE(recipe + ", init seed " + std::to_string(seed));
    TrainResult r = train(config(recipe), quiet());
    ASSERT_EQ(r.losses.size(), ref.losses.size());
    EXPECT_NEAR(r.losses[0], ref.losses[0], 0.005 * ref.losses[0]) << "step 1: same weights, same batch";
    for (size_t i = 1; i < 3; ++i) EXPECT_NEAR(r.losses[i], ref.losses[i], 0.01 * ref.losses[i]) << "step " << i + 1;
    EXPECT_LT(tail_mean(r.losses), learned);
    std::vector<StepMetrics> rows = read_metrics(r.metrics_file);
    ASSERT_FALSE(rows.empty());
    EXPECT_EQ(rows.back().moe_casts, moe_casts);
  }
  fs::remove_all(d);
}

// The reading guide beside MoeLayer::forward lists the backward in the order it runs: the vjps it names
// appear in that order in the comment, and the profiler sees the layer's backward run those ops in
// the same order (fp8_flow on one rank: no exchange; each op's first backward call counts).
TEST(MoeFp8, BackwardRunsInTheOrderTheLayersCommentLists) {
  const std::vector<std::pair<std::string, std::string>> steps = {
      {"Binary::vjp", "add"},                // 6. + shared experts
      {"CombineGradToFp8::vjp", "combine"},  // 5. combine
      {"UnpermuteUnpad::vjp", "unpermute_unpad"},
      {"fp8_grouped_linear.cpp", "fp8_grouped_linear"},  // 4. fc2 (fc1's calls come after SwiGLU's)
      {"SwigluQuant::vjp", "swiglu_quant"},
      {"PermutePad::vjp", "permute_pad"},            // 3. dispatch
      {"QuantizeRowwise::vjp", "quantize_rowwise"},  // 2. quantize
      {"RouterTopk::vjp", "router_topk"}};           // 1. router
  std::ifstream in(std::string(FLOWMOE_SOURCE_DIR) + "/layers/moe.cpp");
  const std::string source((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t begin = source.find("// Backward, in order");
  const size_t end = source.find("Variable MoeLayer::forward", begin);
  ASSERT_NE(begin, std::string::npos);
  ASSERT_NE(end, std::string::npos);
  const std::string guide = source.substr(begin, end - begin);
  size_t at = 0;
  for (const auto& [vjp, op] : steps) {
    const size_t found = guide.find(vjp, at);
    EXPECT_NE(found, std::string::npos) << "the guide names " << vjp << " out of order, or not at all";
    if (found != std::string::npos) at = found;
  }

  const ModelConfig c = fp8_config(4, 2, 128, 128, 1);
  Rng rng(test_seed());
  const Tensor x = rng.normal({24, 128}, 0, 1), dy = rng.normal({24, 128}, 0, 1);
  ParamFactory f(11, Device::cpu());
  MoeLayer layer(f, c, "mlp", options(MoeRecipe::fp8_flow), Device::cpu());
  Variable xv(x, true);
  Variable y = layer.forward(xv, DType::f32);
  profile_begin();
  y.backward(dy);
  std::vector<std::string> ran;
  for (const OpTiming& t : profile_end()) {
    if (t.phase != OpPhase::backward) continue;
    for (const auto& [vjp, op] : steps)
      if (t.op == op && std::find(ran.begin(), ran.end(), op) == ran.end()) ran.push_back(op);
  }
  std::vector<std::string> listed;
  for (const auto& [vjp, op] : steps) listed.push_back(op);
  EXPECT_EQ(ran, listed);
}
