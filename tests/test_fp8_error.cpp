// The FP8 error study of the expert GEMMs (studies/fp8_error.h, `flowmoe fp8-error`): the error sums on
// operands whose every FP8 path is exact, on rows of equal scales (where the transpose and double
// quantization agree bit for bit) and of spread magnitudes, over ragged segments with an empty
// expert and a tail to ignore; then the study on a tiny_moe checkpoint trained on the CPU, and the
// command's table, JSON and usage errors.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>

#include "engine/op_tensor_hook.h"
#include "studies/fp8_error.h"
#include "tests/support/train_fixtures.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

Tensor reshape_tensor(const Tensor& t, const Shape& shape) { return Tensor::from_floats(t.to_floats(), shape); }

// Values from {±0.5, ±1, ±1.5} with a 2 in every row's and every 128-row block's column: any 1x128
// block of it has amax 2, so every quantization of it is exact.
Tensor exact_operand(std::mt19937_64& gen, int64_t M, int64_t C) {
  const float values[] = {0.5f, 1.f, 1.5f, -0.5f, -1.f, -1.5f};
  std::vector<float> v(size_t(M * C));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < C; ++j) v[size_t(i * C + j)] = (i % 128 == 0 || j % 128 == 0) ? 2.f : values[gen() % 6];
  return Tensor::from_floats(v, {M, C});
}

// Rows ~ N(0,1) · exp(2·N(0,1)): magnitudes spread over decades, as routed activations' are.
Tensor spread_operand(std::mt19937_64& gen, int64_t M, int64_t C) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> v(size_t(M * C));
  for (int64_t i = 0; i < M; ++i) {
    const float mag = std::exp(2.f * normal(gen));
    for (int64_t j = 0; j < C; ++j) v[size_t(i * C + j)] = normal(gen) * mag;
  }
  return Tensor::from_floats(v, {M, C});
}

}  // namespace

TEST(Fp8Error, ExactOperandsGiveNoErrorOnAnyPath) {
  std::mt19937_64 gen(test_seed());
  const std::vector<int64_t> segments = {128, 0, 256};  // blocks start where a 2 sits
  // The weight [3,128,256]: every 128x128 block holds a 2 as well.
  const Tensor w = reshape_tensor(exact_operand(gen, 3 * 128, 256), {3, 128, 256});
  const GemmErrorSums s = gemm_error_sums(exact_operand(gen, 384, 256), exact_operand(gen, 384, 128), w, segments, 2);
  EXPECT_EQ(s.rows, 384);
  EXPECT_GT(s.ref_sq, 0);
  EXPECT_GT(s.fprop_ref_sq, 0);
  EXPECT_GT(s.dgrad_ref_sq, 0);
  EXPECT_EQ(s.fprop_sq, 0);
  EXPECT_EQ(s.dgrad_sq, 0);
  EXPECT_EQ(s.x_err_sq, 0);
  EXPECT_EQ(s.dy_err_sq, 0);
  EXPECT_EQ(s.transpose_sq, 0);
  EXPECT_EQ(s.requantize_sq, 0);
  EXPECT_EQ(s.colwise_sq, 0);
  EXPECT_EQ(s.x_amax, 2);
}

// With power-of-two scales both ways to colwise operands are exact wherever the values stay normal
// e4m3: rescaling by a power of two moves only the exponent. They differ where a row far below its
// column block's largest falls to the subnormal grid: the transpose rounds it there at the block's
// largest row scale, double quantization at the scale of the block's own amax, never coarser.
TEST(Fp8Error, TheTransposeAndDoubleQuantizationDifferOnlyOnTheSubnormalGrid) {
  std::mt19937_64 gen(test_seed());
  // Rows of N(0,1) clipped to ±2.9 with a 3 in every 1x128 block: every row has the same scales, so
  // every value is normal in both colwise layouts and the two paths give the same operands.
  std::normal_distribution<float> normal(0.f, 1.f);
  auto same_scale_rows = [&](int64_t M, int64_t C) {
    std::vector<float> v(size_t(M * C));
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < C; ++j) v[size_t(i * C + j)] = j % 128 == 0 ? 3.f : std::clamp(normal(gen), -2.9f, 2.9f);
    return Tensor::from_floats(v, {M, C});
  };
  const std::vector<int64_t> equal_segments = {200, 56};
  const Tensor w_equal = reshape_tensor(spread_operand(gen, 2 * 128, 256), {2, 128, 256});
  const GemmErrorSums same =
      gemm_error_sums(same_scale_rows(256, 256), same_scale_rows(256, 128), w_equal, equal_segments);
  EXPECT_GT(same.transpose_sq, 0);  // the rowwise quantization's own error
  EXPECT_EQ(same.transpose_sq, same.requantize_sq);

  // Spread rows, ragged segments (not multiples of 128, one empty), and 40 tail rows of NaN past them
  // that the study must not read.
  const std::vector<int64_t> segments = {37, 0, 200, 16, 131};
  const int64_t M = 384 + 40;
  Tensor x = spread_operand(gen, M, 256), dy = spread_operand(gen, M, 384);
  for (int64_t i = 384; i < M; ++i) {
    for (int64_t j = 0; j < 256; ++j) x.data<float>()[i * 256 + j] = NAN;
    for (int64_t j = 0; j < 384; ++j) dy.data<float>()[i * 384 + j] = NAN;
  }
  const Tensor w = reshape_tensor(spread_operand(gen, 5 * 384, 256), {5, 384, 256});
  GemmErrorRow r{"w", gemm_error_sums(x, dy, w, segments)};
  EXPECT_EQ(r.sums.rows, 384);
  for (double e : {r.x_rel_err(), r.dy_rel_err(), r.fprop(), r.dgrad(), r.transpose(), r.requantize(), r.colwise()}) {
    EXPECT_TRUE(std::isfinite(e));
    EXPECT_GT(e, 0);
    EXPECT_LT(e, 0.2);  // e4m3 keeps 3 mantissa bits: a few percent
  }
  // The large rows carry the norm, and their values are normal on both paths.
  EXPECT_NEAR(r.ratio(), 1.0, 0.02) << "transpose " << r.transpose() << " requantize " << r.requantize();
  // One thread or several: the same sums up to the order the experts are added in.
  const GemmErrorSums one = gemm_error_sums(x, dy, w, segments, 1);
  EXPECT_NEAR(one.transpose_sq, r.sums.transpose_sq, 1e-9 * r.sums.transpose_sq);
  EXPECT_THROW(gemm_error_sums(x, dy, w, {500, 0, 0, 0, 0}), ShapeError);  // more rows than x has
  EXPECT_THROW(gemm_error_sums(x, dy, w, {384}), ShapeError);              // one segment, five experts
}

TEST(Fp8Error, TheStudyOfATinyMoeCheckpointNamesEveryExpertGemm) {
  const fs::path d = fresh_dir("fp8_error");
  Config cfg = load_config(std::string(FLOWMOE_SOURCE_DIR) + "/configs/tiny_moe.yaml",
                           {"train.device=cpu", "train.steps=4", "train.eval_every=0", "data.seq_len=32",
                            "data.synthetic_tokens=20000", "train.batch_size=4", "optimizer.warmup_steps=2",
                            "precision.recipe=fp8_flow", "logging.out_dir=" + (d / "run").string()});
  const TrainResult trained = train(cfg, quiet());
  ASSERT_FALSE(trained.last_checkpoint.empty());

  const Fp8ErrorStudy s = fp8_error_study(cfg, trained.last_checkpoint, 2);
  EXPECT_EQ(s.step, 4);
  EXPECT_EQ(s.split, "validation");
  EXPECT_EQ(s.num_tokens, 2 * 4 * 32);
  ASSERT_EQ(s.rows.size(), 4u);  // layers 1 and 2 (layer 0 is dense), fc1 then fc2
  EXPECT_EQ(s.rows[0].weight, "model.layers.1.mlp.experts.fc1.weight");
  EXPECT_EQ(s.rows[1].weight, "model.layers.1.mlp.experts.fc2.weight");
  EXPECT_EQ(s.rows[3].weight, "model.layers.2.mlp.experts.fc2.weight");
  for (const GemmErrorRow& r : s.rows) {
    EXPECT_EQ(r.sums.rows % 16, 0) << r.weight;          // padded segments
    EXPECT_GE(r.sums.rows, 2 * 4 * 32 * 2) << r.weight;  // every token's top-2 copies, both batches
    for (double e : {r.fprop(), r.dgrad(), r.transpose()})
      EXPECT_TRUE(std::isfinite(e) && e > 0 && e < 0.2) << r.weight;
  }
  EXPECT_NEAR(s.pooled.ratio(), 1.0, 0.1);
  EXPECT_FALSE(op_tensor_hook_installed());  // the study's hook is gone with it
  ASSERT_EQ(s.recipe_losses.size(), 4u);
  EXPECT_EQ(s.recipe_losses[0].first, "bf16");
  EXPECT_EQ(s.recipe_losses[3].first, "fp8_full");
  for (const auto& [recipe, loss] : s.recipe_losses)  // the same weights: FP8 moves the loss a little
    EXPECT_NEAR(loss, s.recipe_losses[0].second, 0.05 * s.recipe_losses[0].second) << recipe;

  // The batch the run trained on at step 3 (its data order), one micro-batch.
  const Fp8ErrorStudy step3 = fp8_error_study(cfg, trained.last_checkpoint, 5, 3);
  EXPECT_EQ(step3.split, "step 3's training");
  EXPECT_EQ(step3.num_batches, 1);
  EXPECT_EQ(step3.num_tokens, 4 * 32);
  EXPECT_THROW(fp8_error_study(cfg, trained.last_checkpoint, 1, 5), ConfigError);  // the run has 4 steps
  // Sequences fp8_full's dense FP8 GEMMs cannot take: its loss is left out, the others' stay.
  Config odd = cfg;
  odd.data.seq_len = 40;
  const Fp8ErrorStudy without_full = fp8_error_study(odd, trained.last_checkpoint, 1);
  ASSERT_EQ(without_full.recipe_losses.size(), 3u);
  EXPECT_EQ(without_full.recipe_losses[2].first, "fp8_flow");

  // The command: the table, the JSON file, and its usage errors.
  const std::string cmd = std::string(FLOWMOE_BINARY_DIR) + "/flowmoe fp8-error --config " + FLOWMOE_SOURCE_DIR +
                          "/configs/tiny_moe.yaml --set train.device=cpu --set data.seq_len=32"
                          " --set data.synthetic_tokens=20000 --set train.batch_size=4 --checkpoint " +
                          trained.last_checkpoint;
  const fs::path json = d / "fp8_error.json";
  ASSERT_EQ(std::system((cmd + " --json " + json.string() + " > " + (d / "out.txt").string()).c_str()), 0);
  const YAML::Node j = YAML::LoadFile(json.string());
  EXPECT_EQ(j["gemms"].size(), 4u);
  EXPECT_EQ(j["pooled"]["weight"].as<std::string>(), "all");
  EXPECT_GT(j["pooled"]["wgrad_rel_err"]["requantize"].as<double>(), 0);
  EXPECT_GT(j["lm_loss"]["fp8_flow"].as<double>(), 0);
  EXPECT_GT(j["lm_loss"]["fp8_full"].as<double>(), 0);
  EXPECT_EQ(WEXITSTATUS(std::system((cmd + " --batches 0 2>/dev/null").c_str())), 2);
  EXPECT_EQ(WEXITSTATUS(std::system((cmd + " --bogus 2>/dev/null").c_str())), 2);
  EXPECT_EQ(WEXITSTATUS(std::system((cmd + " --train-step 1000 2>/dev/null").c_str())), 2);  // past train.steps
  fs::remove_all(d);
}
