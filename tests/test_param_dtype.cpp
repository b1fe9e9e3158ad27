// precision.param_dtype: on the GPU the model's weights are kept in bf16 (auto), written once per step by AdamW
// from its f32 masters, or kept in f32 and cast at each use (f32). The two train the same weights bit for bit,
// and a run with bf16 weights resumes from its checkpoint (the masters) bit for bit. The AdamW side is
// tests/test_adamw.cpp (WholeMastersUpdateAsF32Parameters); the sharded form, tests/mpi/test_dp_train.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "config/config.h"
#include "tests/support/train_fixtures.h"
#include "train/metrics.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

Config moe_config(const fs::path& out, const std::vector<std::string>& sets) {
  std::vector<std::string> all = {"train.device=cuda",  "train.steps=12",     "optimizer.warmup_steps=3",
                                  "train.eval_every=6", "checkpoint.every=6", "logging.out_dir=" + out.string()};
  all.insert(all.end(), sets.begin(), sets.end());
  return load_config(std::string(FLOWMOE_SOURCE_DIR) + "/configs/tiny_moe.yaml", all);
}

void expect_same_checkpoints(const fs::path& a, const fs::path& b) {
  for (const char* f : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_EQ(read_bytes(a / "checkpoints" / "step_00000012" / f), read_bytes(b / "checkpoints" / "step_00000012" / f))
        << f;
}

}  // namespace

// bf16 weights with f32 masters against f32 weights cast at each use: the forward reads the same bf16 values
// and each gradient reaches the f32 sum as the cast's would, so losses, norms, evaluations and checkpoints agree
// bit for bit. bf16 (a tied embedding too: read by two ops, its two gradients summed in f32), fp8_flow
// (whose expert weights stay f32: they are quantized from it) and fp8_full (so do its attention, dense MLP and
// shared expert weights); the step graphed, as by default.
TEST(ParamDtypeCuda, Bf16WeightsTrainAsF32WeightsCastAtUse) {
  FLOWMOE_REQUIRE_CUDA();
  const fs::path d = fresh_dir("param_dtype");
  for (const std::string recipe : {"bf16", "fp8_flow", "fp8_full"}) {
    SCOPED_TRACE(recipe);
    const std::vector<std::string> sets = {"precision.recipe=" + recipe, std::string("model.tie_word_embeddings=") +
                                                                             (recipe == "bf16" ? "true" : "false")};
    auto run = [&](const std::string& dtype) {
      std::vector<std::string> s = sets;
      s.push_back("precision.param_dtype=" + dtype);
      const TrainResult r = train(moe_config(d / recipe / dtype, s), quiet());
      return read_metrics(r.metrics_file);
    };
    const std::vector<StepMetrics> narrow = run("auto"), wide = run("f32");
    ASSERT_EQ(narrow.size(), 12u);
    ASSERT_EQ(wide.size(), narrow.size());
    for (size_t i = 0; i < narrow.size(); ++i) {
      SCOPED_TRACE("step " + std::to_string(i + 1));
      EXPECT_EQ(narrow[i].loss, wide[i].loss);
      EXPECT_EQ(narrow[i].grad_norm, wide[i].grad_norm);
      EXPECT_EQ(std::isnan(narrow[i].val_loss), std::isnan(wide[i].val_loss));
      if (!std::isnan(wide[i].val_loss)) {
        EXPECT_EQ(narrow[i].val_loss, wide[i].val_loss);
      }
    }
    expect_same_checkpoints(d / recipe / "auto", d / recipe / "f32");
  }
  fs::remove_all(d);
}

// A checkpoint of a run with bf16 weights holds the f32 masters; the resumed run loads them and casts the
// model's weights from them, so 6 + 6 steps repeat 12 straight ones bit for bit.
TEST(ParamDtypeCuda, Bf16WeightsResumeBitForBit) {
  FLOWMOE_REQUIRE_CUDA();
  const fs::path d = fresh_dir("param_dtype_resume");
  const TrainResult straight = train(moe_config(d / "straight", {}), quiet());
  TrainOptions stop6 = quiet();
  stop6.stop_after = 6;
  Config split = moe_config(d / "split", {});
  const TrainResult first = train(split, stop6);
  apply_override(split, "checkpoint.resume=true");
  const TrainResult second = train(split, quiet());
  ASSERT_EQ(straight.losses.size(), 12u);
  ASSERT_EQ(first.losses.size(), 6u);
  ASSERT_EQ(second.losses.size(), 6u);
  for (size_t i = 0; i < 12; ++i)
    EXPECT_EQ(straight.losses[i], i < 6 ? first.losses[i] : second.losses[i - 6]) << "step " << i + 1;
  expect_same_checkpoints(d / "straight", d / "split");
  fs::remove_all(d);
}
