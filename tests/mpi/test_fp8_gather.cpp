// The sharded optimizer's FP8 weights (parallel/grad_reducer.h, Megatron-LM's --fp8-param-gather) on the world this
// test runs in, under precision.fp8_weights: optimizer: each rank's AdamW writes the FP8 data and scales of its block
// rows, the all-gather moves those in place of the weights, and each rank rebuilds the transpose. Against the unsharded
// optimizer, whose AdamW writes every whole copy, on the same world: the same losses and checkpoints bit for bit under
// fp8_flow and fp8_full, and no weight quantized in a steady-state step. Clipping is off: the sharded norm sums its
// segments in another order. At 4 ranks MPI's reduce-scatter may add the ranks in another order than its all-reduce
// (tests/mpi/test_dp_train.cpp), and an f32 ulp moves e4m3 roundings: there the losses agree within the FP8
// recipes' noise. A sharded resume quantizes each FP8 weight once, from the whole weights the load wrote. Under the
// default (forward) the gather moves the weights, each step quantizes each FP8 weight, and the losses are the same.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "engine/cast_stats.h"
#include "tests/mpi/comm_test_util.h"
#include "tests/support/train_fixtures.h"
#include "train/trainer.h"

namespace flowmoe::test {
namespace {

namespace fs = std::filesystem;

// One directory for every rank (rank 0 writes the checkpoints, every rank reads them), fresh for this world size.
fs::path shared_fresh_dir(Communicator& world, const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("flowmoe_" + name + "_np" + std::to_string(world.size()));
  if (world.rank() == 0) {
    fs::remove_all(d);
    fs::create_directories(d);
  }
  world.barrier();
  return d;
}

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  EXPECT_TRUE(in.good()) << p;
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The FP8 weights of the model below under fp8_full: the MoE layer's fc1 and fc2, 4 attention projections per
// block, the dense MLP's 3 and the shared expert's 3 (fp8_flow: fc1 and fc2).
constexpr int64_t kNumFp8Full = 2 * 4 + 3 + 2 + 3;

struct TinyRun {
  std::vector<double> losses;
  std::vector<int64_t> weight_quantizes;  // in each step's forward and backward
  std::string checkpoint;
};

// A tiny MoE model in `recipe`, every width 128 (the FP8 weights' block), 4 steps and a checkpoint at the last;
// precision.fp8_weights: optimizer unless `sets` says otherwise.
TinyRun train_tiny(const std::string& recipe, bool shard, const fs::path& dir,
                   const std::vector<std::string>& sets = {}, int64_t stop_after = -1) {
  Config c = parse_config(
      "model: {vocab_size: 64, hidden_size: 128, num_hidden_layers: 2, num_attention_heads: 4,"
      " intermediate_size: 128, max_position_embeddings: 32, n_routed_experts: 4, num_experts_per_tok: 2,"
      " moe_intermediate_size: 128, n_shared_experts: 1, first_k_dense_replace: 1}\n"
      "data: {seq_len: 16, synthetic_tokens: 20000, val_fraction: 0.1}\n"
      "train: {device: cpu, steps: 4, batch_size: 4, eval_every: 0}\n"
      "optimizer: {lr: 0.01, min_lr: 0.001, warmup_steps: 1, grad_clip: 0}\n"
      "checkpoint: {every: 4}\n"
      "logging: {progress: plain}\n",
      "fp8_gather.yaml",
      {"precision.recipe=" + recipe, std::string("parallel.shard_optimizer=") + (shard ? "true" : "false"),
       "logging.out_dir=" + dir.string(), "precision.fp8_weights=optimizer"});
  for (const std::string& set : sets) apply_override(c, set);
  TinyRun out;
  TrainOptions o = quiet();
  o.stop_after = stop_after;
  o.world = test_runtime().world;
  o.after_backward = [&](int64_t, const std::vector<Variable>&) {
    out.weight_quantizes.push_back(cast_counts().weight_quantize);
  };
  const TrainResult r = train(c, o);
  out.losses = r.losses;
  out.checkpoint = r.last_checkpoint;
  return out;
}

TEST(Fp8Gather, ShardedEqualsUnshardedAndQuantizesNoWeight) {
  Communicator& world = test_world();
  const fs::path d = shared_fresh_dir(world, "fp8_gather");
  // fc1 and fc2 of the MoE layer; fp8_full also 4 attention projections per block, the dense MLP's 3 and the
  // shared expert's 3.
  for (const auto& [recipe, num_fp8] :
       {std::pair<std::string, int64_t>{"fp8_flow", 2}, {"fp8_full", 2 * 4 + 3 + 2 + 3}}) {
    SCOPED_TRACE(recipe);
    const TinyRun sharded = train_tiny(recipe, true, d / (recipe + "_sharded"));
    const TinyRun whole = train_tiny(recipe, false, d / (recipe + "_whole"));
    const TinyRun forward = train_tiny(recipe, true, d / (recipe + "_forward"), {"precision.fp8_weights=forward"});
    // Copies without their transposes: the gather moves data and scales alone, and dgrad rebuilds each transpose.
    const TinyRun rebuilt =
        train_tiny(recipe, true, d / (recipe + "_rebuilt"), {"precision.fp8_weight_transpose=rebuilt"});
    ASSERT_EQ(sharded.losses.size(), 4u);
    EXPECT_EQ(rebuilt.losses, sharded.losses);  // bit for bit: the same sums in the same order
    EXPECT_EQ(rebuilt.weight_quantizes, sharded.weight_quantizes);
    ASSERT_EQ(whole.losses.size(), 4u);
    ASSERT_EQ(forward.losses.size(), 4u);
    EXPECT_EQ(sharded.weight_quantizes, (std::vector<int64_t>{num_fp8, 0, 0, 0}));
    EXPECT_EQ(whole.weight_quantizes, (std::vector<int64_t>{num_fp8, 0, 0, 0}));
    EXPECT_EQ(forward.weight_quantizes, (std::vector<int64_t>(4, num_fp8)));
    const bool same_sums = world.size() <= 2;
    for (size_t i = 0; i < whole.losses.size(); ++i) {
      if (same_sums) {
        EXPECT_EQ(sharded.losses[i], whole.losses[i]) << "step " << i + 1;
        EXPECT_EQ(forward.losses[i], whole.losses[i]) << "step " << i + 1;
      } else {
        EXPECT_NEAR(sharded.losses[i], whole.losses[i], 5e-3 * whole.losses[i]) << "step " << i + 1;
        EXPECT_NEAR(forward.losses[i], whole.losses[i], 5e-3 * whole.losses[i]) << "step " << i + 1;
      }
    }
    if (world.rank() != 0 || !same_sums) continue;
    for (const char* file : {"model.safetensors", "optimizer.safetensors"})
      EXPECT_TRUE(file_bytes(fs::path(sharded.checkpoint) / file) == file_bytes(fs::path(whole.checkpoint) / file))
          << file;
  }
  world.barrier();
  if (world.rank() == 0) fs::remove_all(d);
}

// A sharded resume: the load writes every rank's weights whole, so its first forward quantizes each FP8 weight from
// them once; the gathers take over after its first step, and 2 + 2 steps repeat 4 straight ones bit for bit.
TEST(Fp8Gather, ShardedResumeQuantizesOnceThenRepeatsTheStraightRun) {
  Communicator& world = test_world();
  const fs::path d = shared_fresh_dir(world, "fp8_gather_resume");
  const std::vector<std::string> every2 = {"checkpoint.every=2"};
  const TinyRun straight = train_tiny("fp8_full", true, d / "straight", every2);
  const TinyRun first = train_tiny("fp8_full", true, d / "split", every2, 2);
  const TinyRun second = train_tiny("fp8_full", true, d / "split", {"checkpoint.every=2", "checkpoint.resume=true"});
  ASSERT_EQ(straight.losses.size(), 4u);
  ASSERT_EQ(first.losses.size(), 2u);
  ASSERT_EQ(second.losses.size(), 2u);
  for (size_t i = 0; i < 4; ++i)
    EXPECT_EQ(straight.losses[i], i < 2 ? first.losses[i] : second.losses[i - 2]) << "step " << i + 1;
  EXPECT_EQ(second.weight_quantizes, (std::vector<int64_t>{kNumFp8Full, 0}));
  world.barrier();
  if (world.rank() == 0) fs::remove_all(d);
}

}  // namespace
}  // namespace flowmoe::test
