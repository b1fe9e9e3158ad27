// Multi-head latent attention and multi-token prediction under data and expert parallelism, through the built
// command as a user launches it: `mpirun -np N flowmoe train --config configs/tiny_mla.yaml` (MLA, one MTP module,
// layer 0 dense, layers 1-2 and the MTP block MoE) against the plain single-process run on the same global batch,
// made small as test_dp_train.cpp's runs are. Every MLA weight (the q/kv down- and up-projections, their norms,
// the output projection) is a dense weight every rank holds: a gradient reduction or optimizer shard that left one
// out would train the ranks apart, and an MTP loss not averaged over the ranks would print another mtp_loss.
//
// Tolerances: those of test_dp_train.cpp and test_ep_train.cpp (kF32Rel, kFirstStepRel, kFp8Rel), for the same
// reasons; 2 data-parallel ranks are one process that runs the batch as 2 micro-batches of 4, bit for bit, in bf16
// and in fp8_full alike. Leaving one MLA weight's gradient out of the reduction moves the losses by 1e-3 at step 2.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/mpi/train_launch.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

// flowmoe train reads the last --config it is given: this one replaces train_args' configs/tiny_moe.yaml.
const std::string kMla = " --config " + std::string(FLOWMOE_SOURCE_DIR) + "/configs/tiny_mla.yaml";

// The MTP losses of `got` against `ref`, step by step, within rel_tol.
void expect_same_mtp_losses(const std::vector<StepMetrics>& ref, const std::vector<StepMetrics>& got, double rel_tol,
                            const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(ref[i].mtp_loss)) << what << " step " << ref[i].step;
    EXPECT_NEAR(got[i].mtp_loss, ref[i].mtp_loss, rel_tol * std::abs(ref[i].mtp_loss)) << what << " step " << i + 1;
  }
}

}  // namespace

// Data parallelism at 2 and 4 ranks, with the sharded optimizer (the default) and with a full copy on every rank.
TEST(MlaDataParallel, LossesAndMtpLossesMatchOneProcess) {
  const fs::path d = fresh_dir("mla_dp");
  const std::vector<StepMetrics> one = train_run(d, 0, "np1", kMla);
  const std::vector<StepMetrics> halves =
      train_run(d, 0, "np1_halves", kMla + " --set train.batch_size=4 --set train.grad_accum_steps=2");
  ASSERT_EQ(one.size(), 20u);
  ASSERT_EQ(halves.size(), 20u);
  EXPECT_LT(one.back().mtp_loss, one.front().mtp_loss);
  for (const bool shard : {true, false}) {
    const std::string name = std::string("np2_shard_") + (shard ? "on" : "off");
    Launch launch;
    const std::vector<StepMetrics> two = train_and_compare(
        d, one, 2, name, kMla + " --set parallel.shard_optimizer=" + (shard ? "true" : "false"), kF32Rel, &launch);
    ASSERT_EQ(two.size(), 20u) << launch.err;
    expect_same_mtp_losses(one, two, kF32Rel, name + " vs one process");
    for (size_t i = 0; i < two.size(); ++i) {
      EXPECT_EQ(two[i].loss, halves[i].loss) << name << " step " << i + 1;
      EXPECT_EQ(two[i].mtp_loss, halves[i].mtp_loss) << name << " step " << i + 1;
      EXPECT_EQ(two[i].grad_norm, halves[i].grad_norm) << name << " step " << i + 1;
    }
  }
  Launch launch;
  const std::vector<StepMetrics> four = train_and_compare(d, one, 4, "np4", kMla, kF32Rel, &launch);
  expect_same_mtp_losses(one, four, kF32Rel, "np4 vs one process");
  fs::remove_all(d);
}

// Expert parallelism 2 at 2 ranks (each rank 4 of the 8 experts) and at 4 ranks (two data-parallel copies of it).
TEST(MlaExpertParallel, LossesAndMtpLossesMatchOneProcess) {
  const fs::path d = fresh_dir("mla_ep");
  const std::vector<StepMetrics> one = train_run(d, 0, "np1", kMla);
  ASSERT_EQ(one.size(), 20u);
  for (const int np : {2, 4}) {
    const std::string name = "np" + std::to_string(np) + "_ep2";
    Launch launch;
    const std::vector<StepMetrics> many =
        train_and_compare(d, one, np, name, kMla + " --set parallel.expert_parallel_size=2", kF32Rel, &launch);
    expect_same_mtp_losses(one, many, kF32Rel, name + " vs one process");
    for (const StepMetrics& m : many) EXPECT_GT(m.exchange_ms, 0.0) << "step " << m.step << " of " << name;
  }
  fs::remove_all(d);
}

// fp8_full: MLA's q_a, q_b, kv_b and o projections are fp8_linear, their weights quantized from the f32 masters
// that the sharded optimizer updates by segment and all-gathers. 2 data-parallel ranks are one process in 2
// micro-batches of 4, bit for bit, the MTP losses too. Expert parallelism 2 runs the dense layers as those 2
// micro-batches do, and each expert's GEMM over the rows of both ranks, whose 1x128 wgrad blocks hold other rows:
// within kFp8Rel of them. One process on whole batches of 8 is no reference here: its own FP8 noise against 2
// micro-batches of 4 (the experts' blocks hold other rows there too) grows through this model's gradient spikes to
// 0.6-1.3% of the loss by step 10 (0.08% for configs/tiny_moe.yaml), with no parallelism at all.
TEST(MlaFp8Full, DataAndExpertParallelMatchOneProcessInTwoMicroBatches) {
  const fs::path d = fresh_dir("mla_fp8_full");
  const std::string fp8 = kMla + " --set precision.recipe=fp8_full";
  const std::vector<StepMetrics> halves =
      train_run(d, 0, "np1_halves", fp8 + " --set train.batch_size=4 --set train.grad_accum_steps=2");
  ASSERT_EQ(halves.size(), 20u);
  Launch two_launch, ep_launch;
  const std::vector<StepMetrics> two = train_run(d, 2, "np2", fp8, &two_launch),
                                 ep2 = train_run(d, 2, "np2_ep2", fp8 + " --set parallel.expert_parallel_size=2",
                                                 &ep_launch);
  ASSERT_EQ(two.size(), 20u) << two_launch.err;
  ASSERT_EQ(ep2.size(), 20u) << ep_launch.err;
  for (size_t i = 0; i < two.size(); ++i) {
    ASSERT_TRUE(std::isfinite(halves[i].mtp_loss)) << "step " << i + 1;
    EXPECT_EQ(two[i].loss, halves[i].loss) << "step " << i + 1;
    EXPECT_EQ(two[i].mtp_loss, halves[i].mtp_loss) << "step " << i + 1;
    EXPECT_NEAR(ep2[i].loss, halves[i].loss, kFp8Rel * halves[i].loss) << "np2_ep2 step " << i + 1;
    EXPECT_NEAR(ep2[i].mtp_loss, halves[i].mtp_loss, kFp8Rel * halves[i].mtp_loss) << "np2_ep2 step " << i + 1;
  }
  fs::remove_all(d);
}
