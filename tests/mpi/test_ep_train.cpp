// Expert-parallel training through the built command, as a user launches it: `mpirun -np N flowmoe
// train --set parallel.expert_parallel_size=E` against the plain single-process run on the same global
// batch, for each recipe (bf16 also with parallel.ep_dispatch: zero_sync); checkpoints that resume at another
// expert-parallel size; evaluation with empty slices; train.sample_every's collective sample; and the start-up errors
// of a size that does not fit the launch, which every rank must report without leaving a peer waiting.
//
// Tolerance: the data-parallel ones (test_dp_train.cpp says why), for the same reasons. Every rank
// still runs its B/N sequences through the dense layers and sums the dense gradients over the world.
// An expert now multiplies the rows of its whole expert-parallel group in one GEMM and sums their
// weight gradient in that GEMM, where one process (or data parallelism) sums the same products in
// another order and blocking: f32 roundings in another order (bf16 on the CPU computes in f32), and in
// the FP8 recipes 1x128 column blocks of the wgrad operands that hold other rows. Neither grows with E.
// Measured: bf16 at most 5e-8 relative (within kF32Rel = 2e-5), FP8 at most 1.2e-3 (kFp8Rel = 5e-3).
// The bf16 bound is the one that catches a wrong reduction: expert gradients divided by the group
// size instead of the world size move the losses by 4e-4 to 2e-3.
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "checkpoint/safetensors.h"
#include "tests/mpi/train_launch.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

class ExpertParallel : public ::testing::TestWithParam<Recipe> {};

std::string ep(int size) { return " --set parallel.expert_parallel_size=" + std::to_string(size); }

// Every one of the np ranks stops at start-up with `message` as its one error line, exit status 2.
void expect_error_on_every_rank(const Launch& r, int np, const std::string& message) {
  EXPECT_EQ(r.status, 2) << r.out << r.err;
  EXPECT_EQ(count(r.err, message), size_t(np)) << r.err;
  EXPECT_EQ(lines_starting(r.err, "flowmoe: error: "), 1u) << r.err;
  for (int rank = 1; rank < np; ++rank)
    EXPECT_EQ(lines_starting(r.err, "[rank " + std::to_string(rank) + "] flowmoe: error: "), 1u) << r.err;
}

// Rank 0's start-up line for np ranks at expert-parallel size e, 8 experts and batches of 8.
std::string ranks_line(int np, int e) {
  const std::string k = std::to_string(8 / e);
  return "expert-parallel " + std::to_string(e) + " x data-parallel " + std::to_string(np / e) + ": " +
         std::to_string(np) + " ranks (backend mpi), each reads " + std::to_string(8 / np) +
         " of every batch of 8 sequences and holds " + k + " of the 8 routed experts: rank r the experts [" + k +
         "p, " + k + "p + " + k + ") with p = r mod " + std::to_string(e);
}

}  // namespace

TEST_P(ExpertParallel, LossesMatchOneProcessOnTheSameGlobalBatch) {
  const Recipe& recipe = GetParam();
  const fs::path d = fresh_dir(std::string("ep_losses_") + recipe.name);
  const std::vector<StepMetrics> one = train_run(d, 0, "np1", recipe.sets);
  ASSERT_EQ(one.size(), 20u);
  for (const StepMetrics& m : one) EXPECT_TRUE(std::isnan(m.exchange_ms)) << "one process exchanges nothing";
  // Every expert on its own rank, then experts and data both split (bf16 alone, to keep CI short).
  std::vector<std::pair<int, int>> layouts = {{2, 2}, {4, 4}};
  if (recipe.rel_tol == kF32Rel) layouts.push_back({4, 2});
  for (const auto& [np, e] : layouts) {
    const std::string name = std::string(recipe.name) + "_np" + std::to_string(np) + "_ep" + std::to_string(e);
    Launch launch;
    const std::vector<StepMetrics> rows =
        train_and_compare(d, one, np, name, std::string(recipe.sets) + ep(e), recipe.rel_tol, &launch);
    for (const StepMetrics& m : rows) EXPECT_GT(m.exchange_ms, 0.0) << "step " << m.step << " of " << name;
    EXPECT_EQ(count(launch.out, ranks_line(np, e)), 1u) << launch.out;  // rank 0 alone prints
  }
  if (recipe.rel_tol == kF32Rel) {  // the zero-sync exchange (worst-case buffers, device layout): the same losses
    Launch launch;
    const std::string zero_sync = std::string(recipe.sets) + ep(2) + " --set parallel.ep_dispatch=zero_sync";
    const std::vector<StepMetrics> rows = train_and_compare(d, one, 2, std::string(recipe.name) + "_np2_ep2_zero_sync",
                                                            zero_sync, recipe.rel_tol, &launch);
    for (const StepMetrics& m : rows) EXPECT_GT(m.exchange_ms, 0.0) << "step " << m.step << " of zero_sync";
    // Receive buffers of 0.3 of an even load: step 1 needs more, is void, and runs again with larger buffers
    // (as may a later step); the run is the worst-case buffers' run bit for bit. The same with two data-parallel
    // copies of the group (np 4, EP 2: a copy that overflows voids the step for both) and with dual
    // micro-batches (either half may overflow).
    const std::string capacity = " --set parallel.ep_capacity_factor=0.3";
    const std::string ep2x2 = std::string(recipe.sets) + ep(2) + " --set parallel.ep_dispatch=zero_sync";
    const std::string dual = zero_sync + " --set parallel.dual_microbatch=true";
    const std::vector<std::tuple<std::string, int, std::string>> bounded_runs = {
        {"np2_ep2", 2, zero_sync}, {"np4_ep2", 4, ep2x2}, {"np2_ep2_dual", 2, dual}};
    for (const auto& [layout, np, sets] : bounded_runs) {
      SCOPED_TRACE(layout);
      const std::string name = std::string(recipe.name) + "_" + layout;
      const std::vector<StepMetrics> worst = layout == "np2_ep2" ? rows : train_run(d, np, name + "_worst", sets);
      Launch bounded;
      const std::vector<StepMetrics> capped = train_run(d, np, name + "_capacity", sets + capacity, &bounded);
      ASSERT_EQ(capped.size(), worst.size()) << bounded.out << bounded.err;
      for (size_t i = 0; i < worst.size(); ++i) {
        EXPECT_EQ(capped[i].step, worst[i].step);
        EXPECT_EQ(capped[i].loss, worst[i].loss) << "step " << worst[i].step;
        EXPECT_EQ(capped[i].grad_norm, worst[i].grad_norm) << "step " << worst[i].step;
      }
      EXPECT_EQ(count(bounded.out, "step 1: an expert exchange needed "), 1u) << bounded.out;
      EXPECT_GE(count(bounded.out, "rows and the step runs again"), 1u) << bounded.out;
    }
  }
  fs::remove_all(d);
}

INSTANTIATE_TEST_SUITE_P(Recipes, ExpertParallel, ::testing::ValuesIn(kRecipes),
                         [](const auto& info) { return std::string(info.param.name); });

// With an MTP module (an MoE block, as configs/tiny_moe.yaml's last layer is), 2 ranks of expert parallelism train
// as one process does: the LM losses and the MTP losses alike, within the f32 tolerance.
TEST(ExpertParallelMtp, LossesAndMtpLossesMatchOneProcess) {
  const fs::path d = fresh_dir("expertparallelmtp");
  const std::string mtp = " --set model.num_nextn_predict_layers=1";
  const std::vector<StepMetrics> one = train_run(d, 0, "np1", mtp);
  ASSERT_EQ(one.size(), 20u);
  Launch launch;
  const std::vector<StepMetrics> many = train_and_compare(d, one, 2, "np2", mtp + ep(2), kF32Rel, &launch);
  ASSERT_EQ(many.size(), 20u);
  for (size_t i = 0; i < many.size(); ++i) {
    ASSERT_TRUE(std::isfinite(one[i].mtp_loss)) << "step " << i + 1;
    EXPECT_NEAR(many[i].mtp_loss, one[i].mtp_loss, kF32Rel * std::abs(one[i].mtp_loss)) << "step " << i + 1;
  }
  EXPECT_LT(one.back().mtp_loss, one.front().mtp_loss);
  fs::remove_all(d);
}

// A checkpoint holds the full expert tensors, as one process writes them: a run saved at expert-
// parallel size 4 continues under one process, and one process's run continues at size 2, on the
// losses of the run that did not stop. Its evaluation at size 4 matches one process's, with validation
// batches of 2 sequences, so that 2 of the 4 ranks hold empty slices and still take part in every forward.
TEST(ExpertParallelResume, CheckpointsDoNotDependOnTheExpertParallelSize) {
  const fs::path d = fresh_dir("ep_resume");
  const std::string sets = kRecipes[0].sets;
  const std::vector<StepMetrics> one = train_run(d, 0, "np1", sets), four = train_run(d, 4, "np4_ep4", sets + ep(4));
  ASSERT_EQ(one.size(), 20u);
  ASSERT_EQ(four.size(), 20u);
  const std::string step10 = "/checkpoints/step_00000010";
  for (const char* file : {"/model.safetensors", "/optimizer.safetensors"}) {
    const std::vector<NamedTensor> a = read_safetensors((d / "np1").string() + step10 + file),
                                   b = read_safetensors((d / "np4_ep4").string() + step10 + file);
    ASSERT_EQ(a.size(), b.size()) << file;
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].name, b[i].name) << file;
      EXPECT_EQ(a[i].tensor.shape(), b[i].tensor.shape()) << a[i].name;
    }
  }
  resume_and_compare(d, four, "np4_ep4", 0, "ep4_np1", sets);
  resume_and_compare(d, one, "np1", 2, "np1_ep2", sets + ep(2));
  expect_same_eval(d, "np4_ep4", 4, "--set train.batch_size=2", ep(4));
  // The run's own config.yaml (expert_parallel_size 4) evaluates it in one process as well, E taken as 1
  // with a note: the same loss as through the one-process run's config, and fp8-error reads it too.
  const std::string ckpt = " --checkpoint " + (d / "np4_ep4" / "checkpoints" / "step_00000020").string();
  const Launch own = run_shell(d, kBinary + " eval --config " + (d / "np4_ep4" / "config.yaml").string() + ckpt),
               plain = run_shell(d, kBinary + " eval --config " + (d / "np1" / "config.yaml").string() + ckpt);
  ASSERT_EQ(own.status, 0) << own.err;
  ASSERT_EQ(plain.status, 0) << plain.err;
  EXPECT_EQ(count(own.out,
                  "parallel.expert_parallel_size = 4 does not divide the 1 rank; evaluating with "
                  "expert_parallel_size 1"),
            1u)
      << own.out;
  EXPECT_EQ(printed_val_loss(own.out), printed_val_loss(plain.out)) << own.out << plain.out;
  const Launch error = run_shell(d, kBinary + " fp8-error --config " + (d / "np4_ep4" / "config.yaml").string() + ckpt);
  EXPECT_EQ(error.status, 0) << error.err;
  EXPECT_EQ(count(error.out, "parallel.expert_parallel_size = 4 taken as 1"), 1u) << error.out;
  fs::remove_all(d);
}

// train.sample_every under expert parallelism: every rank takes the sample (its forwards are collective), rank 0
// alone prints it, and the losses are those of the same launch without samples, bit for bit.
TEST(ExpertParallelSample, SampleEveryIsTakenByEveryRankAndPrintedByRankZero) {
  const fs::path d = fresh_dir("ep_sample");
  const std::string sets = std::string(kRecipes[0].sets) + ep(2);
  Launch sampled;
  const std::vector<StepMetrics> plain = train_run(d, 2, "np2_ep2", sets),
                                 with_samples = train_run(d, 2, "np2_ep2_sampled",
                                                          sets + " --set train.sample_every=10", &sampled);
  ASSERT_EQ(plain.size(), 20u);
  ASSERT_EQ(with_samples.size(), plain.size()) << sampled.out << sampled.err;
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_EQ(with_samples[i].loss, plain[i].loss) << "step " << plain[i].step;
    EXPECT_EQ(with_samples[i].grad_norm, plain[i].grad_norm) << "step " << plain[i].step;
  }
  EXPECT_EQ(count(sampled.out, "step 10: sample ["), 1u) << sampled.out;
  EXPECT_EQ(count(sampled.out, "step 20: sample ["), 1u) << sampled.out;
  fs::remove_all(d);
}

TEST(ExpertParallelErrors, SizesThatDoNotFitTheLaunchFailOnEveryRank) {
  const fs::path d = fresh_dir("ep_errors");
  // Every rank checks before any collective, so the run ends at once (the time limit would say 124).
  const Launch ranks = run_shell(d, launcher(4) + kBinary + " " + train_args(d / "run", ep(3)), 120);
  expect_error_on_every_rank(
      ranks, 4, "--set parallel.expert_parallel_size=3: parallel.expert_parallel_size: 3 does not divide the 4 ranks");
  const Launch experts =
      run_shell(d, launcher(4) + kBinary + " " + train_args(d / "run", ep(4) + " --set model.n_routed_experts=6"), 120);
  expect_error_on_every_rank(experts, 4, "parallel.expert_parallel_size: 4 does not divide model.n_routed_experts 6");
  const Launch alone = run_shell(d, kBinary + " " + train_args(d / "run", ep(2)), 60);
  expect_error_on_every_rank(alone, 1, "parallel.expert_parallel_size: 2 does not divide the 1 ranks");
  // A dense model has no experts to share out: the config itself is refused, on every rank.
  const Launch dense =
      run_shell(d, launcher(2) + kBinary + " " + train_args(d / "run", ep(2) + " --set model.n_routed_experts=0"), 120);
  EXPECT_NE(dense.status, 0);
  EXPECT_NE(dense.status, 124) << "the ranks hung";
  EXPECT_EQ(count(dense.err,
                  "--set parallel.expert_parallel_size=2: parallel.expert_parallel_size: 2 needs routed "
                  "experts to share out over the ranks, but model.n_routed_experts (--set "
                  "model.n_routed_experts=0) is 0"),
            2u)
      << dense.err;
  EXPECT_FALSE(fs::exists(d / "run" / "metrics.jsonl"));
  // A capacity for the receive buffers of an exchange that is sync here (auto, with no device puts on the CPU).
  const Launch capacity = run_shell(
      d, launcher(2) + kBinary + " " + train_args(d / "run", ep(2) + " --set parallel.ep_capacity_factor=1.5"), 120);
  expect_error_on_every_rank(capacity, 2,
                             "parallel.ep_capacity_factor: 1.5 bounds the zero-sync exchange's receive buffers, but "
                             "this run's exchange is sync");
  fs::remove_all(d);
}

// A short loss-parity study under the launcher at expert-parallel size 2 (`mpirun -np 2 flowmoe parity`,
// tiny_moe for 30 steps): the report has every field, the figures are finite and below a loose bound,
// and the plot is a PNG. The bound checks the harness, not FP8: the verdict comes from the GPU runs
// (docs/PARITY.md).
// --layout-control: the reference's recipe at expert-parallel size 1 on the same ranks joins the
// controls, so the report says what expert parallelism itself moves the loss by.
TEST(ExpertParallelParity, LayoutControlTrainsTheReferenceWithoutExpertParallelism) {
  const fs::path d = fresh_dir("ep_parity_layout");
  const Launch r = run_shell(d,
                             launcher(2) + kBinary + " parity --config " + kConfig + " --out " + (d / "p").string() +
                                 " --recipes bf16,fp8_flow --steps 12 --warmup-steps 4 --layout-control"
                                 " --threshold 0.05" +
                                 ep(2) +
                                 " --set train.device=cpu --set train.eval_every=0 --set data.seq_len=64"
                                 " --set data.synthetic_tokens=40000 --set train.batch_size=8"
                                 " --set optimizer.warmup_steps=4 --set checkpoint.every=0",
                             420);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const YAML::Node j = YAML::LoadFile((d / "p" / "parity.json").string());
  ASSERT_EQ(j["runs"].size(), 3u);  // bf16, fp8_flow, control_ep1
  EXPECT_EQ(j["runs"][2]["name"].as<std::string>(), "control_ep1");
  EXPECT_EQ(j["runs"][2]["role"].as<std::string>(), "control");
  const YAML::Node ep1 = YAML::LoadFile((d / "p" / "control_ep1" / "config.yaml").string());
  const YAML::Node ref = YAML::LoadFile((d / "p" / "bf16" / "config.yaml").string());
  EXPECT_EQ(ep1["parallel"]["expert_parallel_size"].as<int>(), 1);
  EXPECT_EQ(ref["parallel"]["expert_parallel_size"].as<int>(), 2);
  // Data parallelism on the same batch trains the same model up to the order of the float sums.
  for (const YAML::Node& c : j["candidates"]) {
    if (c["name"].as<std::string>() == "control_ep1") {
      EXPECT_LT(c["max_rel_err"].as<double>(), 1e-3);
    }
  }
  fs::remove_all(d);
}

TEST(ExpertParallelParity, ThreeRecipesAndAControlUnderTheLauncher) {
  const fs::path d = fresh_dir("ep_parity");
  const Launch r = run_shell(d,
                             launcher(2) + kBinary + " parity --config " + kConfig + " --out " + (d / "p").string() +
                                 " --steps 30 --warmup-steps 10 --control eps --threshold 0.05" + ep(2) +
                                 " --set train.device=cpu --set train.eval_every=15 --set train.eval_batches=2"
                                 " --set data.seq_len=64 --set data.synthetic_tokens=40000 --set train.batch_size=8"
                                 " --set optimizer.warmup_steps=10 --set checkpoint.every=0",
                             420);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const YAML::Node j = YAML::LoadFile((d / "p" / "parity.json").string());
  for (const char* key : {"config", "reference", "threshold", "warmup_steps", "ema_alpha", "world_size",
                          "expert_parallel_size", "pass", "runs", "candidates", "steps"})
    EXPECT_TRUE(j[key].IsDefined()) << key;
  EXPECT_EQ(j["world_size"].as<int>(), 2);
  EXPECT_EQ(j["expert_parallel_size"].as<int>(), 2);
  EXPECT_TRUE(j["pass"].as<bool>());
  ASSERT_EQ(j["runs"].size(), 4u);  // bf16, fp8_blockwise, fp8_flow, control
  for (const YAML::Node& run : j["runs"]) {
    for (const char* key : {"name", "recipe", "role", "config_hash", "steps", "final_loss", "final_val_loss",
                            "tokens_per_s", "peak_mem_bytes", "moe_casts", "host_syncs"})
      EXPECT_TRUE(run[key].IsDefined() && !run[key].IsNull()) << run["name"] << " " << key;
    EXPECT_EQ(run["steps"].as<int>(), 30);
    const double loss = run["final_loss"].as<double>(), val = run["final_val_loss"].as<double>();
    EXPECT_TRUE(std::isfinite(loss) && loss > 0 && loss < std::log(256.0)) << run["name"];
    EXPECT_TRUE(std::isfinite(val) && val > 0 && val < std::log(256.0)) << run["name"];
    EXPECT_GT(run["tokens_per_s"].as<double>(), 0);
  }
  EXPECT_EQ(j["runs"][3]["role"].as<std::string>(), "control");
  EXPECT_EQ(j["runs"][2]["moe_casts"].as<double>(), 2);   // fp8_flow
  EXPECT_EQ(j["runs"][1]["moe_casts"].as<double>(), 10);  // fp8_blockwise
  ASSERT_EQ(j["candidates"].size(), 3u);
  for (const YAML::Node& c : j["candidates"]) {
    EXPECT_EQ(c["compared_steps"].as<int>(), 20) << c["name"];
    const double max_err = c["max_rel_err"].as<double>(), mean_err = c["mean_rel_err"].as<double>();
    EXPECT_TRUE(std::isfinite(max_err) && max_err < 0.05 && mean_err <= max_err) << c["name"] << " " << max_err;
    EXPECT_EQ(c["nonfinite_steps"].size(), 0u) << c["name"];
    EXPECT_EQ(c["verdict"].as<std::string>(), "pass") << c["name"];
  }
  ASSERT_EQ(j["steps"].size(), 30u);
  for (const YAML::Node& s : j["steps"]) {
    EXPECT_EQ(s["loss"].size(), 4u);
    EXPECT_EQ(s["ema"].size(), 4u);
    EXPECT_EQ(s["rel_err"].size(), 3u);
  }
  EXPECT_EQ(count(r.out, " vs bf16: max EMA rel err"), 3u) << r.out;
  // A PNG: its 8-byte signature, then the IHDR chunk with a picture of some size. The test command
  // installs gnuplot; elsewhere the report may come without its image, and then says so.
  const bool no_plotter =
      std::system("command -v gnuplot >/dev/null 2>&1") != 0 && count(r.out, "(no parity.png:") == 1;
  const std::string png = no_plotter ? std::string() : read_text(d / "p" / "parity.png");
  if (!no_plotter) {
    ASSERT_GT(png.size(), 1000u) << "parity.png missing or empty\n" << r.out;
    EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
    EXPECT_EQ(png.substr(12, 4), "IHDR");
    const auto be32 = [&](size_t at) {
      return (uint32_t(uint8_t(png[at])) << 24) | (uint32_t(uint8_t(png[at + 1])) << 16) |
             (uint32_t(uint8_t(png[at + 2])) << 8) | uint32_t(uint8_t(png[at + 3]));
    };
    EXPECT_GE(be32(16), 400u);  // width
    EXPECT_GE(be32(20), 300u);  // height
  }
  fs::remove_all(d);
}
