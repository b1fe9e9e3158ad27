// Who writes the FP8 weights in training (precision.fp8_weights): under forward the forward quantizes each FP8 weight
// once per step; under optimizer (the default) AdamW writes them (kernels/adamw_fp8.h, train/optimizer.h) and the
// forward quantizes none in steady state under fp8_flow and fp8_full. The losses are the same bit for bit; a resumed
// run quantizes each weight once, then repeats the straight run. The kernels' own tests: test_adamw_fp8.cpp.
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "engine/cast_stats.h"
#include "engine/fp8_weight.h"
#include "engine/rng.h"
#include "tests/support/checks.h"
#include "tests/support/train_fixtures.h"
#include "train/run_setup.h"
#include "train/trainer.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

// A tiny MoE model in `recipe`, every width 128 (the FP8 GEMMs' block), on the CPU: one dense block, one MoE block.
Config fp8_config(const std::string& recipe) {
  Config c = parse_config(
      "model: {vocab_size: 64, hidden_size: 128, num_hidden_layers: 2, num_attention_heads: 4,"
      " intermediate_size: 128, max_position_embeddings: 32, n_routed_experts: 4, num_experts_per_tok: 2,"
      " moe_intermediate_size: 128, n_shared_experts: 1, first_k_dense_replace: 1}\n"
      "data: {seq_len: 16, synthetic_tokens: 20000, val_fraction: 0.1}\n"
      "train: {device: cpu, steps: 4, batch_size: 2, eval_every: 0}\n"
      "optimizer: {lr: 0.01, min_lr: 0.001, warmup_steps: 1}\n"
      "logging: {progress: plain}\n",
      "fp8_weights.yaml", {"precision.recipe=" + recipe});
  c.logging.out_dir = fresh_dir("adamw_fp8_" + recipe).string();
  return c;
}

struct Steps {
  std::vector<double> losses;
  std::vector<int64_t> weight_quantizes;  // in each step's forward and backward
};

// The FP8 copies' count per step of the model above: the MoE layer's fc1 and fc2 (and, under fp8_full, 4
// attention projections per block, the dense MLP's 3 and the shared expert's 3).
int64_t num_fp8_weights(const std::string& recipe) { return recipe == "fp8_flow" ? 2 : 2 * 4 + 3 + 2 + 3; }

// `steps` steps; with by_optimizer precision.fp8_weights is optimizer (the default), else forward.
Steps train_steps(const std::string& recipe, bool by_optimizer, const std::string& out_dir = "",
                  const std::vector<std::string>& sets = {}, int64_t stop_after = -1) {
  Steps out;
  TrainOptions o = quiet();
  o.stop_after = stop_after;
  Config c = fp8_config(recipe);
  if (!out_dir.empty()) c.logging.out_dir = out_dir;
  apply_override(c, by_optimizer ? "precision.fp8_weights=optimizer" : "precision.fp8_weights=forward");
  for (const std::string& s : sets) apply_override(c, s);
  o.after_backward = [&](int64_t, const std::vector<Variable>&) {
    out.weight_quantizes.push_back(cast_counts().weight_quantize);
  };
  out.losses = train(c, o).losses;
  return out;
}

}  // namespace

// Under precision.fp8_weights: forward every step's forward quantizes each FP8 weight once. Under optimizer the first
// forward quantizes each once; from then on AdamW writes them and no step quantizes one, and the losses are, bit for
// bit, those of the forward quantizing each weight after every update.
TEST(AdamWFp8, ForwardQuantizesEachStepOptimizerNoneInSteadyStateSameLosses) {
  for (const std::string recipe : {"fp8_flow", "fp8_full"}) {
    SCOPED_TRACE(recipe);
    const Steps by_optimizer = train_steps(recipe, true), by_forward = train_steps(recipe, false);
    const int64_t num_fp8 = num_fp8_weights(recipe);
    EXPECT_EQ(by_optimizer.weight_quantizes, (std::vector<int64_t>{num_fp8, 0, 0, 0}));
    EXPECT_EQ(by_forward.weight_quantizes, (std::vector<int64_t>(4, num_fp8)));
    ASSERT_EQ(by_optimizer.losses.size(), 4u);
    ASSERT_EQ(by_forward.losses.size(), 4u);
    for (size_t i = 0; i < by_optimizer.losses.size(); ++i)
      EXPECT_EQ(by_optimizer.losses[i], by_forward.losses[i]) << "step " << i + 1;  // bit for bit
  }
}

// precision.fp8_weight_transpose rebuilt: the set-up marks every FP8 copy as keeping no transpose, a cache so marked
// quantizes without one, and the losses and weight quantizes are those of stored, bit for bit, whoever writes the
// copies (AdamW then writes no transpose: the kernel's null q_t).
TEST(AdamWFp8, ARebuiltTransposeKeepsNoneAndRepeatsTheStoredRun) {
  for (const std::string recipe : {"fp8_flow", "fp8_full"}) {
    SCOPED_TRACE(recipe);
    Config c = fp8_config(recipe);
    apply_override(c, "precision.fp8_weight_transpose=rebuilt");
    RunSetup setup(c);
    setup.build_model();
    int64_t num_copies = 0;
    for (const ParamShard& s : setup.model().parameter_shards())
      if (s.fp8) {
        ++num_copies;
        EXPECT_FALSE(s.fp8->keeps_transpose);
      }
    EXPECT_EQ(num_copies, num_fp8_weights(recipe));
    for (const bool by_optimizer : {true, false}) {
      SCOPED_TRACE(by_optimizer ? "fp8_weights optimizer" : "fp8_weights forward");
      const Steps stored = train_steps(recipe, by_optimizer);
      const Steps rebuilt = train_steps(recipe, by_optimizer, "", {"precision.fp8_weight_transpose=rebuilt"});
      ASSERT_EQ(rebuilt.losses.size(), 4u);
      EXPECT_EQ(rebuilt.losses, stored.losses);  // bit for bit
      EXPECT_EQ(rebuilt.weight_quantizes, stored.weight_quantizes);
    }
  }
  Rng rng(12);
  const Variable w(random_tensor(rng, {256, 128}), false, "w");
  const Fp8WeightCache cache;
  cache.copy()->keeps_transpose = false;
  EXPECT_FALSE(cache.get(w).q_t.defined());
  EXPECT_TRUE(cache.get(w).q.defined());
}

// Under precision.fp8_weights: optimizer a checkpoint load moves the weights without their FP8 copies: the resumed
// run's first forward quantizes each once, then AdamW writes them again; 2 + 2 steps repeat 4 straight ones bit for
// bit.
TEST(AdamWFp8, ResumedRunQuantizesOnceThenRepeatsTheStraightRun) {
  const std::filesystem::path d = fresh_dir("adamw_fp8_resume");
  const std::string recipe = "fp8_full";
  const std::vector<std::string> every2 = {"checkpoint.every=2"};
  const Steps straight = train_steps(recipe, true, (d / "straight").string(), every2);
  const Steps first = train_steps(recipe, true, (d / "split").string(), every2, 2);
  std::vector<std::string> resume = every2;
  resume.push_back("checkpoint.resume=true");
  const Steps second = train_steps(recipe, true, (d / "split").string(), resume);
  ASSERT_EQ(straight.losses.size(), 4u);
  ASSERT_EQ(first.losses.size(), 2u);
  ASSERT_EQ(second.losses.size(), 2u);
  for (size_t i = 0; i < 4; ++i)
    EXPECT_EQ(straight.losses[i], i < 2 ? first.losses[i] : second.losses[i - 2]) << "step " << i + 1;
  EXPECT_EQ(second.weight_quantizes, (std::vector<int64_t>{num_fp8_weights(recipe), 0}));
  std::filesystem::remove_all(d);
}

// A forward's quantize goes into a copy's buffers only where others hold them (AdamW writes them, the all-gather
// moves them, a captured step reads them): there the buffers stay and take the fresh bytes; elsewhere the fresh
// quantize takes their place, with no copy.
TEST(AdamWFp8, AQuantizeIsStoredIntoHeldBuffersAndReplacesTheOthers) {
  Rng rng(11);
  const Variable w(random_tensor(rng, {256, 128}), false, "w");
  const Fp8WeightCache cache;
  const uint8_t* first = cache.get(w).q.data<uint8_t>();
  w.bump_version();
  const uint8_t* fresh = cache.get(w).q.data<uint8_t>();
  EXPECT_NE(fresh, first);  // replaced: the new quantize was made while the old buffers were alive

  cache.copy()->held = true;
  w.data().data<float>()[5] = 100.0f;  // new values, new scales
  w.bump_version();
  const QuantizedWeight& stored = cache.get(w);
  EXPECT_EQ(stored.q.data<uint8_t>(), fresh);  // the same buffers, holding the new quantize's bytes
  const QuantizedWeight expected = quantize_linear_weight(w.data(), "w");
  const auto bytes = [](const Tensor& q) {
    const uint8_t* p = q.data<uint8_t>();
    return std::vector<uint8_t>(p, p + q.numel());
  };
  for (const auto& [got, want] : {std::pair{stored.q, expected.q}, std::pair{stored.q_t, expected.q_t}}) {
    EXPECT_EQ(bytes(got), bytes(want));
    EXPECT_EQ(got.fp8_scales()->scale_inv.to_floats(), want.fp8_scales()->scale_inv.to_floats());
  }
}
