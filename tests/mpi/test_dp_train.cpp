// Data-parallel training through the built command, as a user launches it: `mpirun -np N flowmoe
// train` against the plain single-process run on the same global batch, for each recipe; resume
// across world sizes; and the start-up errors every rank must report without leaving a peer waiting.
// configs/tiny_moe.yaml is made small by --set (sequences of 64 tokens, 20 steps).
//
// Tolerance. The ranks sum their gradients in another order than one process sums them over the
// batch (and the GEMMs block a smaller batch differently), so the bits differ; nothing else may:
//  - step 1's loss is a forward on the same weights, only its sums are ordered otherwise: rel 1e-6.
//  - bf16 (f32 on the CPU): every loss within rel 2e-5. One f32 rounding is 6e-8 relative; a sum of
//    n terms taken in another order moves by about sqrt(n) of them, and 20 AdamW steps carry that
//    along without growing it much (measured: at most 3e-7).
//  - fp8_blockwise, fp8_flow, fp8_full: within rel 5e-3. A rank's forward sees B/N sequences, so the 1x128
//    column blocks that scale its wgrad operands hold other tokens than one forward of B; and an f32
//    ulp in a weight can move a value across an e4m3 rounding boundary (3 mantissa bits: a step of
//    6-12% of it), which later steps carry on. Both are the FP8 recipes' own noise (fp8_flow costs up
//    to 0.5% of loss against bf16, docs/PERF.md); measured: 1.2e-3. That this is all of it is checked
//    exactly: 2 ranks equal one process that runs the batch as 2 micro-batches of B/2, bit for bit
//    (the same forwards, and a + b summed once either way).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/common/device_api.h"
#include "parallel/backends.h"
#include "tests/mpi/train_launch.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

class DataParallel : public ::testing::TestWithParam<Recipe> {};

}  // namespace

TEST_P(DataParallel, LossesMatchOneProcessOnTheSameGlobalBatch) {
  const Recipe& recipe = GetParam();
  const fs::path d = fresh_dir(std::string("dp_losses_") + recipe.name);
  const std::vector<StepMetrics> one = train_run(d, 0, "np1", recipe.sets);
  ASSERT_EQ(one.size(), 20u);
  for (int np : {2, 4}) {
    Launch launch;
    const std::vector<StepMetrics> many = train_and_compare(
        d, one, np, std::string(recipe.name) + "_np" + std::to_string(np), recipe.sets, recipe.rel_tol, &launch);
    ASSERT_EQ(many.size(), 20u);
    // tokens_per_s counts every rank's tokens, tflops is per rank: per token, 1/np of one process's (to the
    // rounding of the written digits).
    for (size_t i = 0; i < many.size(); ++i) {
      const double per_token = one[i].tflops / one[i].tokens_per_s;
      EXPECT_NEAR(many[i].tflops / many[i].tokens_per_s * np, per_token, 2e-4 * per_token) << "step " << i + 1;
    }
    // Rank 0 alone prints: one start-up line about the ranks, one summary naming them.
    EXPECT_EQ(count(launch.out, "data-parallel: " + std::to_string(np) + " ranks (backend mpi), each reads " +
                                    std::to_string(8 / np) + " of every batch of 8 sequences"),
              1u)
        << launch.out;
    EXPECT_EQ(count(launch.out, "(max over ranks) | " + std::to_string(np) + " ranks"), 1u) << launch.out;
    if (np != 2 || !recipe.one_micro_batch) continue;
    const std::vector<StepMetrics> halves = train_run(
        d, 0, "np1_halves", std::string(recipe.sets) + " --set train.batch_size=4 --set train.grad_accum_steps=2");
    ASSERT_EQ(halves.size(), 20u);
    for (size_t i = 0; i < halves.size(); ++i)  // the validation batches differ in size: train losses only
      EXPECT_EQ(halves[i].loss, many[i].loss)
          << recipe.name << " step " << halves[i].step << ": np2 vs one process in 2 micro-batches of 4";
  }
  fs::remove_all(d);
}

INSTANTIATE_TEST_SUITE_P(Recipes, DataParallel, ::testing::ValuesIn(kRecipes),
                         [](const auto& info) { return std::string(info.param.name); });

// With an MTP module (an MoE block, as configs/tiny_moe.yaml's last layer is), 2 data-parallel ranks train as one
// process that runs the batch as 2 micro-batches of 4 does, bit for bit: the LM losses, the MTP losses and the
// gradient norms (the same forwards, and a + b summed once either way). Against one batch of 8 the sums are
// ordered otherwise, and the MTP block's routing, moved by its expert bias, carries that along: within 1e-4.
TEST(DataParallelMtp, LossesAndMtpLossesMatchOneProcess) {
  const fs::path d = fresh_dir("dataparallelmtp");
  const std::string mtp = " --set model.num_nextn_predict_layers=1";
  const std::vector<StepMetrics> halves =
      train_run(d, 0, "np1_halves", mtp + " --set train.batch_size=4 --set train.grad_accum_steps=2");
  const std::vector<StepMetrics> one = train_run(d, 0, "np1", mtp);
  Launch launch;
  const std::vector<StepMetrics> many = train_run(d, 2, "np2", mtp, &launch);
  ASSERT_EQ(halves.size(), 20u);
  ASSERT_EQ(many.size(), 20u) << launch.out << launch.err;
  ASSERT_EQ(one.size(), 20u);
  for (size_t i = 0; i < many.size(); ++i) {
    ASSERT_TRUE(std::isfinite(halves[i].mtp_loss)) << "step " << i + 1;
    EXPECT_EQ(many[i].loss, halves[i].loss) << "step " << i + 1;
    EXPECT_EQ(many[i].mtp_loss, halves[i].mtp_loss) << "step " << i + 1;
    EXPECT_EQ(many[i].grad_norm, halves[i].grad_norm) << "step " << i + 1;
    EXPECT_NEAR(many[i].mtp_loss, one[i].mtp_loss, 1e-4 * one[i].mtp_loss) << "step " << i + 1;
    EXPECT_NEAR(many[i].loss, one[i].loss, 1e-4 * one[i].loss) << "step " << i + 1;
  }
  EXPECT_LT(one.back().mtp_loss, one.front().mtp_loss);
  fs::remove_all(d);
}

// The checkpoint holds the global data position and the state every rank shares: a run saved by
// two processes continues under one, and the reverse, on the losses of the run that did not stop.
// np2 runs with the sharded optimizer (the default): its checkpoint holds whole moments, so one process
// resumes it, and a one-process checkpoint resumes sharded.
TEST(DataParallelResume, AcrossWorldSizesContinuesTheSameLosses) {
  const fs::path d = fresh_dir("dp_resume");
  const std::string sets = kRecipes[0].sets;
  const std::vector<StepMetrics> one = train_run(d, 0, "np1", sets), two = train_run(d, 2, "np2", sets);
  ASSERT_EQ(one.size(), 20u);
  ASSERT_EQ(two.size(), 20u);
  resume_and_compare(d, two, "np2", 0, "np2_np1", sets);
  resume_and_compare(d, one, "np1", 2, "np1_np2", sets);
  // eval of the same checkpoint: each rank evaluates its slice, the means agree.
  expect_same_eval(d, "np1", 2, "", "");
  fs::remove_all(d);
}

// Ranks given different configs all stop with the error (none waits in a collective for a peer).
TEST(DataParallelErrors, DifferentConfigsFailOnEveryRank) {
  const fs::path d = fresh_dir("dp_mismatch");
  const std::string args = train_args(d / "run", "--set train.steps=4 --set optimizer.warmup_steps=1");
  const std::string mpmd = std::string(FLOWMOE_MPIEXEC) + " " + FLOWMOE_MPIEXEC_FLAGS + " " +
                           FLOWMOE_MPIEXEC_NUMPROC_FLAG + " 1 " + kBinary + " " + args + " : " +
                           FLOWMOE_MPIEXEC_NUMPROC_FLAG + " 1 " + kBinary + " " + args;
  // Both configs are valid: the ranks reach the check and disagree there.
  const Launch differ = run_shell(d, mpmd + " --set train.steps=5", 120);
  EXPECT_NE(differ.status, 0);
  EXPECT_NE(differ.status, 124) << "the ranks hung";
  const std::string message = "flowmoe: error: the ranks were given different configs (rank 0 hash ";
  EXPECT_EQ(lines_starting(differ.err, message), 1u) << differ.err;
  EXPECT_EQ(lines_starting(differ.err, "[rank 1] " + message), 1u) << differ.err;
  // Both name the first key that differs, not only two hashes.
  EXPECT_EQ(count(differ.err, "train.steps is 4 on rank 0 and 5 on rank 1"), 2u) << differ.err;
  EXPECT_FALSE(fs::exists(d / "run" / "metrics.jsonl"));

  // Rank 1's override is invalid: it fails before MPI starts, and its peer must not wait for it.
  const Launch broken = run_shell(d, mpmd + " --set train.steps=many", 120);
  EXPECT_NE(broken.status, 0);
  EXPECT_NE(broken.status, 124) << "rank 0 waited for rank 1 forever";
  EXPECT_EQ(lines_starting(broken.err, "[rank 1] flowmoe: error: --set train.steps=many"), 1u) << broken.err;
  fs::remove_all(d);
}

// The gradient buckets reduced during the backward (parallel.overlap_grad_reduce, the default) or after
// it: the same sums, so the same losses and the same checkpoint, bit for bit; with accumulation, data
// and expert parallelism, and an FP8 recipe.
TEST(DataParallelOverlap, OverlappedReductionTrainsTheSameWeightsBitForBit) {
  const fs::path d = fresh_dir("dp_overlap");
  const std::string ep2 = " --set parallel.expert_parallel_size=2";
  for (const auto& [np, extra] : {std::pair{2, std::string(" --set train.grad_accum_steps=2")}, {4, ep2}}) {
    const std::string name = "np" + std::to_string(np);
    const std::vector<StepMetrics> on = train_run(d, np, name + "_on", extra),
                                   off = train_run(d, np, name + "_off",
                                                   extra + " --set parallel.overlap_grad_reduce=false");
    ASSERT_EQ(on.size(), 20u);
    ASSERT_EQ(off.size(), on.size());
    for (size_t i = 0; i < on.size(); ++i) {
      EXPECT_EQ(on[i].loss, off[i].loss) << name << " step " << on[i].step;
      EXPECT_EQ(on[i].grad_norm, off[i].grad_norm) << name << " step " << on[i].step;
    }
    for (const char* file : {"model.safetensors", "optimizer.safetensors"})
      EXPECT_EQ(read_text(d / (name + "_on") / "checkpoints" / "step_00000020" / file),
                read_text(d / (name + "_off") / "checkpoints" / "step_00000020" / file))
          << name << " " << file;
  }
  fs::remove_all(d);
}

// train.recompute attention under data parallelism: each block's parameters get their gradients from the
// recompute's own walk inside the backward, where the overlapped, sharded reduction starts a bucket as soon as
// its last gradient is final (parallel/grad_reducer.h); the same weights bit for bit as without recompute.
TEST(DataParallelOverlap, RecomputedAttentionTrainsTheSameWeightsBitForBit) {
  const fs::path d = fresh_dir("dp_recompute");
  const std::vector<StepMetrics> plain = train_run(d, 2, "plain", ""),
                                 recomputed = train_run(d, 2, "recomputed", " --set train.recompute=attention");
  ASSERT_EQ(plain.size(), 20u);
  ASSERT_EQ(recomputed.size(), plain.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_EQ(recomputed[i].loss, plain[i].loss) << "step " << plain[i].step;
    EXPECT_EQ(recomputed[i].grad_norm, plain[i].grad_norm) << "step " << plain[i].step;
  }
  for (const char* file : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_EQ(read_text(d / "recomputed" / "checkpoints" / "step_00000020" / file),
              read_text(d / "plain" / "checkpoints" / "step_00000020" / file))
        << file;
  fs::remove_all(d);
}

// The sharded optimizer (parallel.shard_optimizer, the default) against a full copy on every rank: the
// same buckets, reduce-scattered instead of all-reduced, and AdamW on each rank's segments, so the same
// weights, moments and losses bit for bit where the sums are the same. Clipping is off: the gradient
// norm is summed by segment, in another order (compared to rel 2e-5, the metrics' 6 printed digits),
// and a clip factor an ulp apart would move every weight. At 2 ranks a + b is one sum either way; at 4,
// MPI's reduce-scatter may add the ranks in another order than its all-reduce, so there the bound is
// the f32 one. Expert parallelism 2 at 4 ranks shards the expert buckets over their pairs of replicas.
TEST(DataParallelSharded, ShardedOptimizerTrainsTheSameWeights) {
  const fs::path d = fresh_dir("dp_sharded");
  const std::string ep2 = " --set parallel.expert_parallel_size=2";
  for (const auto& [np, extra] : {std::pair{2, std::string(" --set train.grad_accum_steps=2")},
                                  {4, std::string(" --set train.grad_accum_steps=1")},
                                  {4, ep2}}) {
    const std::string name = "np" + std::to_string(np) + (extra.find("expert") != std::string::npos ? "_ep2" : "");
    const std::string base = extra + " --set optimizer.grad_clip=0";
    const std::vector<StepMetrics> on = train_run(d, np, name + "_on", base);
    const std::vector<StepMetrics> off =
        train_run(d, np, name + "_off", base + " --set parallel.shard_optimizer=false");
    ASSERT_EQ(on.size(), 20u);
    ASSERT_EQ(off.size(), on.size());
    const bool same_sums = np == 2;
    for (size_t i = 0; i < on.size(); ++i) {
      if (same_sums)
        EXPECT_EQ(on[i].loss, off[i].loss) << name << " step " << on[i].step;
      else
        EXPECT_NEAR(on[i].loss, off[i].loss, kF32Rel * std::abs(off[i].loss)) << name << " step " << on[i].step;
      // At 4 the weights themselves drift apart by f32 roundings, which the norm feels more than the loss.
      const double norm_rel = same_sums ? 2e-5 : 1e-4;
      EXPECT_NEAR(on[i].grad_norm, off[i].grad_norm, norm_rel * off[i].grad_norm) << name << " step " << on[i].step;
    }
    if (!same_sums) continue;
    for (const char* file : {"model.safetensors", "optimizer.safetensors"})
      EXPECT_EQ(read_text(d / (name + "_on") / "checkpoints" / "step_00000020" / file),
                read_text(d / (name + "_off") / "checkpoints" / "step_00000020" / file))
          << name << " " << file;
  }
  fs::remove_all(d);
}

// bf16 moments (optimizer.moment_dtype) round stochastically from each element's index in its whole parameter,
// so 2 ranks that each keep the moments of their segments train the same weights, bf16 moments and losses, bit
// for bit, as 2 ranks that keep them whole (clipping off, as above); and the whole run's step-10 checkpoint
// resumes sharded (each rank keeps its ranges of the bf16 moments) on the sharded run's losses.
TEST(DataParallelSharded, Bf16MomentsTrainTheSameWeights) {
  const fs::path d = fresh_dir("dp_sharded_bf16_moments");
  const std::string base = " --set optimizer.moment_dtype=bf16 --set optimizer.grad_clip=0";
  const std::vector<StepMetrics> on = train_run(d, 2, "on", base);
  const std::vector<StepMetrics> off = train_run(d, 2, "off", base + " --set parallel.shard_optimizer=false");
  ASSERT_EQ(on.size(), 20u);
  ASSERT_EQ(off.size(), on.size());
  for (size_t i = 0; i < on.size(); ++i) EXPECT_EQ(on[i].loss, off[i].loss) << "step " << on[i].step;
  for (const char* file : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_EQ(read_text(d / "on" / "checkpoints" / "step_00000020" / file),
              read_text(d / "off" / "checkpoints" / "step_00000020" / file))
        << file;
  resume_and_compare(d, on, "off", 2, "off_resumed_sharded", base);
  fs::remove_all(d);
}

// The sharded optimizer on the GPU, where the model's weights are bf16 copies of f32 masters that AdamW writes
// once per step (parallel/grad_reducer.h), against a full copy on every rank, with bf16 weights and whole masters
// (precision.param_dtype auto) and with f32 weights cast at each use (f32): the same losses and checkpoints,
// bit for bit at 2 ranks. bf16 and fp8_flow (whose expert weights stay f32: they are quantized from it). Both
// ranks on one GPU through the mpi backend, so one GPU suffices.
TEST(DataParallelCuda, ShardedBf16WeightsTrainTheSameWeights) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  const fs::path d = fresh_dir("dp_sharded_cuda");
  const std::string gpu = " --set train.device=cuda --set parallel.backend=mpi --set optimizer.grad_clip=0";
  for (const std::string recipe : {"bf16", "fp8_flow"}) {
    SCOPED_TRACE(recipe);
    const std::string base = gpu + " --set precision.recipe=" + recipe;
    const std::vector<StepMetrics> on = train_run(d, 2, recipe + "_on", base);
    const std::string unsharded = base + " --set parallel.shard_optimizer=false";
    for (const std::string dtype : {"auto", "f32"}) {
      const std::string name = recipe + "_off_" + dtype;
      const std::vector<StepMetrics> off = train_run(d, 2, name, unsharded + " --set precision.param_dtype=" + dtype);
      ASSERT_EQ(on.size(), 20u);
      ASSERT_EQ(off.size(), on.size());
      for (size_t i = 0; i < on.size(); ++i) {
        EXPECT_EQ(on[i].loss, off[i].loss) << name << " step " << on[i].step;
        EXPECT_NEAR(on[i].grad_norm, off[i].grad_norm, 2e-5 * off[i].grad_norm) << name << " step " << on[i].step;
      }
      for (const char* file : {"model.safetensors", "optimizer.safetensors"})
        EXPECT_EQ(read_text(d / (recipe + "_on") / "checkpoints" / "step_00000020" / file),
                  read_text(d / name / "checkpoints" / "step_00000020" / file))
            << name << " " << file;
    }
  }
  fs::remove_all(d);
}

// The multi-process step as one CUDA graph (train.cuda_graph over nccl): captured at step 2 and replayed,
// the same losses, norms and checkpoint bit for bit as the eager step, with no host synchronisation. Data
// parallelism: the overlapped reduce-scatter, the sharded AdamW and the weight gather inside the graph.
// Expert parallelism (EP 2, zero-sync exchange): the device puts inside it, and the shared experts on the
// side stream there against the compute stream in the eager run; the layer in two token chunks, their
// exchanges on the comm stream (parallel.exchange_chunks), in both runs; and the batch as two micro-batches
// against each other (parallel.dual_microbatch), in both runs. Two GPUs.
TEST(DataParallelCuda, GraphReplayUnderTheLauncherMatchesEagerBitForBit) {
  if (!built_with_nccl()) GTEST_SKIP() << "built without NCCL";
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs, " << cuda_device_count() << " found";
  const fs::path d = fresh_dir("dp_cuda_graph");
  const std::string gpu = " --set train.device=cuda --set parallel.backend=nccl";
  const std::string ep2 = " --set parallel.expert_parallel_size=2 --set parallel.ep_dispatch=zero_sync";
  for (const auto& [name, extra, eager_extra] :
       {std::make_tuple(std::string("dp"), std::string(), std::string()),
        std::make_tuple(std::string("ep"), ep2, std::string(" --set parallel.shared_expert_overlap=off")),
        // The chunks' exchanges on the comm stream, captured with the step (the same chunks eagerly).
        std::make_tuple(std::string("ep_chunks"), ep2 + " --set parallel.exchange_chunks=2", std::string()),
        // Two micro-batches against each other, their exchanges on the comm stream (parallel.dual_microbatch).
        std::make_tuple(std::string("ep_dual"), ep2 + " --set parallel.dual_microbatch=true", std::string())}) {
    SCOPED_TRACE(name);
    Launch launch;
    const std::vector<StepMetrics> graph =
        train_run(d, 2, name + "_graph", gpu + extra + " --set train.cuda_graph=on", &launch);
    const std::vector<StepMetrics> eager =
        train_run(d, 2, name + "_eager", gpu + extra + eager_extra + " --set train.cuda_graph=off");
    EXPECT_EQ(count(launch.out, "train.cuda_graph: step 2 captured"), 1u) << launch.out;
    ASSERT_EQ(graph.size(), 20u);
    ASSERT_EQ(eager.size(), graph.size());
    for (size_t i = 0; i < graph.size(); ++i) {
      EXPECT_EQ(graph[i].loss, eager[i].loss) << "step " << graph[i].step;
      EXPECT_EQ(graph[i].grad_norm, eager[i].grad_norm) << "step " << graph[i].step;
      EXPECT_EQ(graph[i].host_syncs, 0) << "step " << graph[i].step;
    }
    for (const char* file : {"model.safetensors", "optimizer.safetensors"})
      EXPECT_EQ(read_text(d / (name + "_graph") / "checkpoints" / "step_00000020" / file),
                read_text(d / (name + "_eager") / "checkpoints" / "step_00000020" / file))
          << file;
  }
  fs::remove_all(d);
}

// A rank that ends without a run (--print-config, --help) while its peer starts one: they meet and
// leave together (it used to exit alone and leave the peer in MPI's start-up forever), every time.
TEST(DataParallelErrors, ARankThatEndsEarlyLeavesWithItsPeers) {
  const fs::path d = fresh_dir("dp_early_exit");
  const std::string args = train_args(d / "run", "--set train.steps=4 --set optimizer.warmup_steps=1");
  const std::string mpi = std::string(FLOWMOE_MPIEXEC) + " " + FLOWMOE_MPIEXEC_FLAGS + " " +
                          FLOWMOE_MPIEXEC_NUMPROC_FLAG + " 1 " + kBinary + " " + args;
  for (const char* early : {"--print-config", "--help"}) {
    for (int attempt = 0; attempt < 3; ++attempt) {
      const Launch r =
          run_shell(d, mpi + " " + early + " : " + FLOWMOE_MPIEXEC_NUMPROC_FLAG + " 1 " + kBinary + " " + args, 60);
      EXPECT_EQ(r.status, 2) << early << " attempt " << attempt << "\n" << r.err;
      EXPECT_EQ(count(r.err, std::string("command is train ") + early +
                                 " (ends without a run) on rank 0 and train on "
                                 "rank 1"),
                2u)
          << r.err;
    }
    // Every rank ending early is no error: they leave together at once.
    const Launch all = run_shell(d, launcher(2) + kBinary + " " + args + " " + early, 60);
    EXPECT_EQ(all.status, 0) << early << "\n" << all.err;
  }
  EXPECT_FALSE(fs::exists(d / "run" / "metrics.jsonl"));
  fs::remove_all(d);
}

// logging.progress: auto under mpirun prints plain lines, which the redirected log keeps: Open MPI hands
// each rank a pseudo-terminal whatever mpirun's own output is, so the rank's isatty() says nothing.
TEST(DataParallelOutput, AutoProgressUnderALauncherWritesPlainLines) {
  const fs::path d = fresh_dir("dp_progress");
  std::string args = train_args(d / "run", "--set train.steps=4 --set optimizer.warmup_steps=1");
  args.replace(args.find("logging.progress=plain"), 22, "logging.progress=auto");
  const Launch r = run_shell(d, launcher(2) + kBinary + " " + args, 120);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(count(r.out, "\r"), 0u) << r.out;
  EXPECT_EQ(count(r.out, "/4 | loss"), 4u) << r.out;  // a line per step (log_every 1)
  fs::remove_all(d);
}

// A rank killed mid-run: the launcher signals the survivor, whose message must not promise the
// checkpoint that its dead peer makes impossible; the job ends within seconds.
TEST(DataParallelErrors, ASurvivorOfAKilledRankPromisesNoCheckpoint) {
  const fs::path d = fresh_dir("dp_killed");
  const fs::path run = d / "run";
  const std::string args = train_args(run, "--set train.steps=100000 --set checkpoint.every=0");
  // Rank 0 writes its pid into run.lock; the other child of mpirun is rank 1.
  const std::string script = launcher(2) + kBinary + " " + args +
                             " & m=$!; "
                             "for i in $(seq 1 600); do [ -s " +
                             (run / "metrics.jsonl").string() +
                             " ] && break; "
                             "sleep 0.1; done; r0=$(cat " +
                             (run / "run.lock").string() +
                             "); "
                             "for p in $(pgrep -P $m); do [ \"$p\" != \"$r0\" ] && kill -9 $p; done; wait $m";
  const Launch r = run_shell(d, "sh -c '" + script + "'", 120);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.status, 124) << "the survivor hung";
  EXPECT_EQ(count(r.err, "saving a checkpoint"), 0u) << r.err;
  EXPECT_EQ(count(r.out, "interrupted at step"), 0u) << r.out;
  EXPECT_FALSE(fs::exists(run / "checkpoints" / "step_00000001"));
  fs::remove_all(d);
}

TEST(DataParallelErrors, BatchThatDoesNotSplitOverTheRanks) {
  const fs::path d = fresh_dir("dp_indivisible");
  const Launch r = run_shell(d, launcher(3) + kBinary + " " + train_args(d / "run", ""), 120);
  EXPECT_EQ(r.status, 2) << r.err;
  const std::string message = "train.batch_size: 8 sequences do not split evenly over 3 processes";
  EXPECT_EQ(count(r.err, message), 3u) << r.err;  // every rank says it
  for (const char* who : {"flowmoe: error: ", "[rank 1] flowmoe: error: ", "[rank 2] flowmoe: error: "})
    EXPECT_EQ(lines_starting(r.err, who), 1u) << who << "\n" << r.err;
  fs::remove_all(d);
}
// `flowmoe parity` under mpiexec: every run trains on both ranks, and rank 0 alone writes the report.
TEST(DataParallelParity, EveryRunOnBothRanksOneReport) {
  const fs::path d = fresh_dir("dp_parity");
  const Launch r = run_shell(d,
                             launcher(2) + kBinary + " parity --config " + kConfig + " --out " + (d / "p").string() +
                                 " --recipes bf16,fp8_flow --steps 4 --threshold 1 --set train.device=cpu"
                                 " --set train.eval_every=0 --set data.seq_len=32 --set data.synthetic_tokens=20000"
                                 " --set train.batch_size=4 --set optimizer.warmup_steps=1",
                             240);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_EQ(count(r.out, "fp8_flow vs bf16: max EMA rel err"), 1u) << r.out;
  EXPECT_EQ(count(r.out, "data-parallel: 2 ranks"), 2u) << r.out;  // one start-up line per run
  EXPECT_EQ(count(read_text(d / "p" / "parity.json"), "\"world_size\": 2,"), 1u);
  fs::remove_all(d);
}
