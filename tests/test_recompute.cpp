// train.recompute: a recomputed region runs the same code again in backward (checkpoint(), engine/autograd.h),
// so training with it gives the same losses, gradient norms and weights bit for bit as without. attention (each
// block's norm, q/k/v, RoPE, attention and output projection), alone and with moe_expert, on an MoE model, on the
// CPU and on the GPU (the step graphed, as by default); in bf16 and in fp8_full, whose recomputed attention
// quantizes its input and o again (the same bytes: the casts are deterministic). What it saves is
// tests/test_memory_estimate.cpp's.
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

// 8 steps of configs/tiny_moe.yaml (a dense block, then two MoE blocks) on `device`, its final checkpoint in out.
std::vector<StepMetrics> train_tiny_moe(const fs::path& out, const std::string& device, const std::string& recipe,
                                        const std::string& recompute, const std::string& config = "tiny_moe") {
  const Config c = load_config(std::string(FLOWMOE_SOURCE_DIR) + "/configs/" + config + ".yaml",
                               {"train.device=" + device, "train.steps=8", "train.batch_size=4", "data.seq_len=64",
                                "optimizer.warmup_steps=2", "train.eval_every=4", "precision.recipe=" + recipe,
                                "train.recompute=[" + recompute + "]", "logging.out_dir=" + out.string()});
  return read_metrics(train(c, quiet()).metrics_file);
}

void expect_recompute_changes_nothing(const std::string& device, const std::string& recipe,
                                      const std::string& config = "tiny_moe") {
  SCOPED_TRACE(recipe + " " + config);
  const fs::path d = fresh_dir("recompute_" + device + "_" + recipe + "_" + config);
  const std::vector<StepMetrics> plain = train_tiny_moe(d / "plain", device, recipe, "", config);
  ASSERT_EQ(plain.size(), 8u);
  for (const std::string recompute : {"attention", "attention,moe_expert"}) {
    SCOPED_TRACE(recompute);
    const fs::path out = d / (recompute == "attention" ? "attention" : "both");
    const std::vector<StepMetrics> rows = train_tiny_moe(out, device, recipe, recompute, config);
    ASSERT_EQ(rows.size(), plain.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      EXPECT_EQ(rows[i].loss, plain[i].loss) << "step " << i + 1;
      EXPECT_EQ(rows[i].grad_norm, plain[i].grad_norm) << "step " << i + 1;
      EXPECT_EQ(std::isnan(rows[i].val_loss), std::isnan(plain[i].val_loss)) << "step " << i + 1;
      if (!std::isnan(plain[i].val_loss)) {
        EXPECT_EQ(rows[i].val_loss, plain[i].val_loss) << "step " << i + 1;
      }
    }
    for (const char* f : {"model.safetensors", "optimizer.safetensors"})
      EXPECT_EQ(read_bytes(out / "checkpoints" / "step_00000008" / f),
                read_bytes(d / "plain" / "checkpoints" / "step_00000008" / f))
          << f;
  }
  fs::remove_all(d);
}

}  // namespace

TEST(Recompute, AttentionGivesTheSameTrainingBitForBit) {
  for (const char* recipe : {"bf16", "fp8_full"}) expect_recompute_changes_nothing("cpu", recipe);
}

// MLA (layers/mla.h) with an MTP module: its q_a/kv_a norms, splits and joins recomputed too.
TEST(Recompute, MlaAttentionGivesTheSameTrainingBitForBit) {
  for (const char* recipe : {"bf16", "fp8_full"}) expect_recompute_changes_nothing("cpu", recipe, "tiny_mla");
}

TEST(RecomputeCuda, AttentionGivesTheSameTrainingBitForBit) {
  FLOWMOE_REQUIRE_CUDA();
  for (const char* recipe : {"bf16", "fp8_full"}) {
    expect_recompute_changes_nothing("cuda", recipe);
    expect_recompute_changes_nothing("cuda", recipe, "tiny_mla");
  }
}
