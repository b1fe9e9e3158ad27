// The trainer: the LR schedule, a tiny model that learns, gradient accumulation, the non-finite
// policy, metrics files and plots, and CPU-vs-GPU agreement of the loss curve.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <thread>

#include "checkpoint/checkpoint.h"
#include "kernels/common/device_api.h"
#include "kernels/common/error.h"
#include "studies/plot.h"
#include "tests/support/train_fixtures.h"
#include "train/lap_timer.h"
#include "train/metrics.h"
#include "train/optimizer.h"
#include "train/trainer.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

Config small_config(const fs::path& out_dir, const std::vector<std::string>& sets = {}) {
  Config c = parse_config(
      "model: {vocab_size: 64, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,"
      " intermediate_size: 128, max_position_embeddings: 32}\n"
      "data: {seq_len: 32, synthetic_tokens: 40000, val_fraction: 0.1}\n"
      "train: {device: cpu, steps: 60, batch_size: 8, eval_every: 30, eval_batches: 2}\n"
      "optimizer: {lr: 0.01, min_lr: 0.001, warmup_steps: 5}\n"
      "logging: {progress: plain}\n",
      "small_test.yaml", sets);
  c.logging.out_dir = out_dir.string();
  return c;
}

}  // namespace

TEST(Schedule, WarmupThenCosine) {
  OptimizerConfig o;
  o.lr = 1.0;
  o.min_lr = 0.1;
  o.warmup_steps = 10;
  EXPECT_DOUBLE_EQ(learning_rate(o, 1, 110), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(o, 5, 110), 0.5);
  EXPECT_DOUBLE_EQ(learning_rate(o, 10, 110), 1.0);
  EXPECT_NEAR(learning_rate(o, 60, 110), 0.55, 1e-12);  // halfway through the cosine
  EXPECT_NEAR(learning_rate(o, 110, 110), 0.1, 1e-12);
  for (int64_t s = 11; s < 110; ++s) EXPECT_LT(learning_rate(o, s + 1, 110), learning_rate(o, s, 110));
  // Without warmup there is no ramp: step 1 is already on the cosine, just under the peak.
  o.warmup_steps = 0;
  EXPECT_NEAR(learning_rate(o, 1, 100), 0.1 + 0.45 * (1 + std::cos(M_PI * 0.01)), 1e-12);
  EXPECT_NEAR(learning_rate(o, 50, 100), 0.55, 1e-12);
  EXPECT_DOUBLE_EQ(clip_scale(2.0, 1.0), 0.5);
  EXPECT_DOUBLE_EQ(clip_scale(0.5, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(clip_scale(5.0, 0.0), 1.0);  // clipping off
}

// The run's one timer (the summary's parts and the training time): its laps add up to its total, and the time
// between a lap and the next restart (an evaluation, a checkpoint) is not in it.
TEST(Trainer, LapTimerLeavesOutTheTimeBeforeARestart) {
  using std::chrono::milliseconds;
  const LapTimer outer;
  LapTimer t;
  std::this_thread::sleep_for(milliseconds(20));
  const double first = t.lap();
  std::this_thread::sleep_for(milliseconds(60));
  t.restart();
  std::this_thread::sleep_for(milliseconds(20));
  EXPECT_GE(t.running(), 0.02);
  const double second = t.lap();
  EXPECT_GE(first, 0.02);
  EXPECT_GE(second, 0.02);
  EXPECT_DOUBLE_EQ(t.seconds(), first + second);
  EXPECT_LE(t.seconds(), outer.running() - 0.06);
}

TEST(Trainer, TinyModelLearns) {
  fs::path d = fresh_dir("trainer_learns");
  Config c = small_config(d / "run");
  TrainResult r = train(c, quiet());
  ASSERT_EQ(r.losses.size(), 60u);
  double ln_vocab = std::log(64.0);
  EXPECT_NEAR(r.losses.front(), ln_vocab, 0.3) << "the first loss should be about ln(vocab)";
  double tail = 0;
  for (size_t i = r.losses.size() - 5; i < r.losses.size(); ++i) tail += r.losses[i] / 5;
  EXPECT_LT(tail, 0.5 * ln_vocab) << "loss " << r.losses.front() << " -> " << tail;
  EXPECT_LT(r.final_val_loss, r.first_val_loss);
  EXPECT_GT(r.tokens_per_s, 0);
  fs::remove_all(d);
}

// Gradient accumulation: 2 micro-batches of 4 sequences step as one batch of 8, up to the order of the float
// sums: the same losses and gradient norms (before clipping), and, with clipping off so that nothing renormalises
// a gradient of the wrong scale, the same weights and AdamW moments in the final checkpoint.
TEST(Trainer, GradAccumulationMatchesOneBigBatch) {
  fs::path d = fresh_dir("trainer_accum");
  for (const std::string clip : {"1.0", "0"}) {
    SCOPED_TRACE("optimizer.grad_clip=" + clip);
    const auto run = [&](const std::string& name, int batch_size, int accum) {
      return train(small_config(d / (name + clip), {"train.steps=4", "train.batch_size=" + std::to_string(batch_size),
                                                    "train.grad_accum_steps=" + std::to_string(accum),
                                                    "optimizer.warmup_steps=1", "optimizer.grad_clip=" + clip}),
                   quiet());
    };
    const TrainResult big = run("big", 8, 1), acc = run("acc", 4, 2);
    ASSERT_EQ(big.losses.size(), acc.losses.size());
    for (size_t i = 0; i < big.losses.size(); ++i)
      EXPECT_NEAR(acc.losses[i], big.losses[i], 1e-4 * big.losses[i]) << "step " << i + 1;
    const std::vector<StepMetrics> big_rows = read_metrics(big.metrics_file), acc_rows = read_metrics(acc.metrics_file);
    ASSERT_EQ(big_rows.size(), acc_rows.size());
    for (size_t i = 0; i < big_rows.size(); ++i)
      EXPECT_NEAR(acc_rows[i].grad_norm, big_rows[i].grad_norm, 1e-4 * big_rows[i].grad_norm) << "step " << i + 1;
    if (clip != "0") continue;
    for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
      const std::vector<NamedTensor> want = read_safetensors((fs::path(big.last_checkpoint) / f).string());
      const std::vector<NamedTensor> got = read_safetensors((fs::path(acc.last_checkpoint) / f).string());
      ASSERT_EQ(got.size(), want.size()) << f;
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_EQ(got[i].name, want[i].name);
        EXPECT_LT(rel_error(got[i].tensor, want[i].tensor), 1e-4) << f << ": " << want[i].name;
      }
    }
  }
  fs::remove_all(d);
}

// parallel.dual_microbatch: the batch as two interleaved halves trains as the batch at once (to f32
// rounding: the loss is the mean of the halves'); it conflicts with exchange_chunks, and an odd batch is refused.
TEST(Trainer, DualMicrobatchMatchesTheBatchAtOnce) {
  fs::path d = fresh_dir("trainer_dual");
  const std::vector<std::string> moe = {"model.n_routed_experts=4",
                                        "model.num_experts_per_tok=2",
                                        "model.moe_intermediate_size=32",
                                        "model.first_k_dense_replace=1",
                                        "train.steps=4",
                                        "optimizer.warmup_steps=1"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> sets = moe;
    sets.insert(sets.end(), extra.begin(), extra.end());
    return sets;
  };
  TrainResult plain = train(small_config(d / "plain", moe), quiet());
  TrainResult dual = train(small_config(d / "dual", with({"parallel.dual_microbatch=true"})), quiet());
  ASSERT_EQ(plain.losses.size(), dual.losses.size());
  for (size_t i = 0; i < plain.losses.size(); ++i)
    EXPECT_NEAR(dual.losses[i], plain.losses[i], 1e-4 * plain.losses[i]) << "step " << i + 1;
  EXPECT_TRUE(throws_naming<ConfigError>(
      [&] {
        train(small_config(d / "odd", with({"parallel.dual_microbatch=true", "train.batch_size=7"})), quiet());
      },
      {"parallel.dual_microbatch", "7 sequences", "even"}));
  EXPECT_TRUE(throws_naming<ConfigError>(
      [&] {
        small_config(d / "both", with({"parallel.dual_microbatch=true", "parallel.exchange_chunks=2"}));
      },
      {"parallel.exchange_chunks", "choose one"}));
  fs::remove_all(d);
}

// A NaN planted in one gradient: skip leaves the weights alone and goes on; stop throws.
TEST(Trainer, NonFinitePolicy) {
  fs::path d = fresh_dir("trainer_nonfinite");
  auto poison_at = [](std::set<int64_t> steps) {
    TrainOptions o = quiet();
    o.after_backward = [steps](int64_t step, const std::vector<Variable>& params) {
      if (steps.count(step)) params[1].grad().data<float>()[0] = NAN;
    };
    return o;
  };
  Config skip = small_config(d / "skip", {"train.steps=6", "optimizer.warmup_steps=1", "checkpoint.every=0"});
  TrainResult r = train(skip, poison_at({3}));
  EXPECT_EQ(r.skipped_steps, 1);
  EXPECT_EQ(r.losses.size(), 6u);
  for (double l : r.losses) EXPECT_TRUE(std::isfinite(l));
  auto rows = read_metrics(r.metrics_file);
  ASSERT_EQ(rows.size(), 6u);
  EXPECT_TRUE(rows[2].skipped);
  EXPECT_FALSE(std::isfinite(rows[2].grad_norm));
  EXPECT_FALSE(rows[3].skipped);

  Config stop = small_config(d / "stop", {"train.steps=6", "optimizer.warmup_steps=1", "train.nonfinite=stop"});
  try {
    train(stop, poison_at({2}));
    FAIL() << "no error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("step 2: non-finite gradients"), std::string::npos) << m;
    EXPECT_NE(m.find("train.nonfinite"), std::string::npos) << m;
  }
  Config limit = small_config(d / "limit", {"train.steps=6", "optimizer.warmup_steps=1", "train.max_skipped_steps=1"});
  try {
    train(limit, poison_at({2, 4}));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_skipped_steps"), std::string::npos) << e.what();
  }
  fs::remove_all(d);
}

// Snapshots of every parameter as they stand after the backward of each step in `steps`, i.e. the
// weights the previous steps left.
struct WeightLog {
  std::map<int64_t, std::vector<Tensor>> at;
  using Hook = std::function<void(int64_t, const std::vector<Variable>&)>;
  void hook_into(TrainOptions& o, std::set<int64_t> steps, Hook inner) {
    o.after_backward = [this, steps, inner](int64_t step, const std::vector<Variable>& params) {
      if (steps.count(step))
        for (const Variable& p : params) at[step].push_back(p.data().clone());
      if (inner) inner(step, params);
    };
  }
};

void expect_same_weights(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bit_equal(b[i], a[i])) << "parameter " << i;
}

// A NaN loss (the planted value stands for a loss that overflowed) is skipped like a NaN gradient:
// counted, logged, and the step leaves every weight as it was, bit for bit.
TEST(Trainer, NonFiniteLossOrGradientLeavesTheWeightsBitForBit) {
  fs::path d = fresh_dir("trainer_nonfinite_bits");
  for (bool poison_loss : {true, false}) {
    SCOPED_TRACE(poison_loss ? "NaN loss" : "NaN gradient");
    TrainOptions o = quiet();
    WeightLog log;
    log.hook_into(o, {3, 4}, [poison_loss](int64_t step, const std::vector<Variable>& params) {
      if (!poison_loss && step == 3) params[1].grad().data<float>()[0] = NAN;
    });
    if (poison_loss)
      o.after_loss = [](int64_t step, double* loss) {
        if (step == 3) *loss = NAN;
      };
    Config c = small_config(d / (poison_loss ? "loss" : "grad"),
                            {"train.steps=5", "optimizer.warmup_steps=1", "checkpoint.every=0"});
    TrainResult r = train(c, o);
    EXPECT_EQ(r.skipped_steps, 1);
    auto rows = read_metrics(r.metrics_file);
    ASSERT_EQ(rows.size(), 5u);
    EXPECT_TRUE(rows[2].skipped);
    EXPECT_FALSE(rows[1].skipped);
    EXPECT_FALSE(rows[3].skipped);
    ASSERT_EQ(log.at.size(), 2u);
    expect_same_weights(log.at[3], log.at[4]);  // before step 3 == after step 3
  }
  fs::remove_all(d);
}

// nonfinite: stop ends the run with a message and a checkpoint of the weights before the bad step,
// which a resumed run starts from.
TEST(Trainer, NonFiniteStopLeavesAUsableCheckpoint) {
  fs::path d = fresh_dir("trainer_nonfinite_stop");
  TrainOptions o = quiet();
  WeightLog before;
  before.hook_into(o, {3}, nullptr);
  o.after_loss = [](int64_t step, double* loss) {
    if (step == 3) *loss = INFINITY;
  };
  Config stop =
      small_config(d, {"train.steps=6", "optimizer.warmup_steps=1", "train.nonfinite=stop", "checkpoint.every=0"});
  try {
    train(stop, o);
    FAIL() << "no error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("step 3: non-finite loss"), std::string::npos) << m;
    EXPECT_NE(m.find("train.nonfinite"), std::string::npos) << m;
    EXPECT_NE(m.find("step_00000003"), std::string::npos) << m;
  }
  const std::string ckpt = latest_checkpoint(stop.checkpoint_dir());
  ASSERT_FALSE(ckpt.empty()) << "no checkpoint after the stop";
  EXPECT_EQ(fs::path(ckpt).filename().string(), "step_00000003");

  TrainOptions again = quiet();
  WeightLog resumed;
  resumed.hook_into(again, {4}, nullptr);
  Config resume =
      small_config(d, {"train.steps=6", "optimizer.warmup_steps=1", "checkpoint.resume=true", "checkpoint.every=0"});
  TrainResult r = train(resume, again);
  EXPECT_EQ(r.first_step, 4);
  EXPECT_EQ(r.last_step, 6);
  EXPECT_EQ(r.skipped_steps, 1);  // the stopped step counts as skipped
  ASSERT_EQ(resumed.at.size(), 1u);
  expect_same_weights(before.at[3], resumed.at[4]);
  fs::remove_all(d);
}

TEST(Trainer, WritesResolvedConfigAndMetrics) {
  fs::path d = fresh_dir("trainer_outputs");
  for (const char* format : {"jsonl", "csv"}) {
    SCOPED_TRACE(format);
    Config c = small_config(d / format, {"train.steps=4", "optimizer.warmup_steps=1", "train.eval_every=2",
                                         std::string("logging.metrics_format=") + format});
    TrainResult r = train(c, quiet());
    EXPECT_EQ(fs::path(r.metrics_file).filename().string(), std::string("metrics.") + format);
    auto rows = read_metrics(r.metrics_file);
    ASSERT_EQ(rows.size(), 4u);
    for (size_t i = 0; i < rows.size(); ++i) {
      EXPECT_EQ(rows[i].step, int64_t(i) + 1);
      EXPECT_FLOAT_EQ(float(rows[i].loss), float(r.losses[i]));
      EXPECT_GT(rows[i].lr, 0);
      EXPECT_GT(rows[i].grad_norm, 0);
      EXPECT_GT(rows[i].tokens_per_s, 0);
      EXPECT_GT(rows[i].peak_mem_bytes, 0);
      EXPECT_EQ(std::isfinite(rows[i].val_loss), i % 2 == 1) << "validation at steps 2 and 4 only";
    }
    Config back = load_config((d / format / "config.yaml").string());
    auto body = [](const std::string& y) { return y.substr(y.find('\n')); };  // past the comment line
    EXPECT_EQ(body(to_yaml(back)), body(to_yaml(c)));
  }
  fs::remove_all(d);
}

TEST(Trainer, PlotsSeveralRuns) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0 &&
      std::system("python3 -c 'import matplotlib' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "neither gnuplot nor matplotlib is installed: plot not checked";
  fs::path d = fresh_dir("trainer_plot");
  train(small_config(d / "a", {"train.steps=4", "optimizer.warmup_steps=1", "train.eval_every=2"}), quiet());
  train(small_config(d / "b", {"train.steps=4", "optimizer.warmup_steps=1", "logging.metrics_format=csv"}), quiet());
  std::string png = (d / "loss.png").string();
  plot_runs({(d / "a").string(), (d / "b" / "metrics.csv").string()}, png, "test");
  std::ifstream in(png, std::ios::binary);
  char magic[8] = {};
  in.read(magic, 8);
  EXPECT_EQ(std::string(magic + 1, 3), "PNG");
  EXPECT_THROW(plot_runs({(d / "missing").string()}, png, "x"), IoError);
  fs::remove_all(d);
}

TEST(Trainer, CudaWithoutAGpuIsAConfigError) {
  if (cuda_available()) GTEST_SKIP() << "a GPU is present";
  fs::path d = fresh_dir("trainer_nocuda");
  Config c = small_config(d, {"train.device=cuda"});
  try {
    train(c, quiet());
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("train.device"), std::string::npos) << e.what();
  }
  fs::remove_all(d);
}

// The default config's first steps on the GPU (bf16 compute, fp32 master weights) follow the CPU's
// (fp32) within a relative 2e-2 per step: bf16 rounds each matmul input to 8 mantissa bits.
TEST(TrainerCuda, CpuAndGpuLossCurvesAgree) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
  fs::path d = fresh_dir("trainer_cpu_gpu");
  auto run = [&](const std::string& device) {
    Config c = load_config(std::string(FLOWMOE_SOURCE_DIR) + "/configs/tiny.yaml",
                           {"train.device=" + device, "train.steps=20", "optimizer.warmup_steps=5",
                            "checkpoint.every=0", "logging.out_dir=" + (d / device).string()});
    return train(c, quiet());
  };
  TrainResult cpu = run("cpu"), gpu = run("cuda");
  ASSERT_EQ(cpu.losses.size(), gpu.losses.size());
  const double rtol = 2e-2;
  for (size_t i = 0; i < cpu.losses.size(); ++i)
    EXPECT_NEAR(gpu.losses[i], cpu.losses[i], rtol * cpu.losses[i]) << "step " << i + 1;
  EXPECT_LT(gpu.losses.back(), gpu.losses.front());
  fs::remove_all(d);
}

// On one GPU a step's scalars (loss, norm, clip, skip, lr) stay on the device and the host reads them
// a step later; a run with a loss hook computes them on the host instead. The two agree bit for bit,
// a skipped step included, and the device path still counts and logs the skip.
TEST(TrainerCuda, DeviceStepScalarsMatchTheHostPath) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
  fs::path d = fresh_dir("trainer_device_scalars");
  auto run = [&](bool host_path) {
    Config c = load_config(std::string(FLOWMOE_SOURCE_DIR) + "/configs/tiny_moe.yaml",
                           {"train.device=cuda", "train.steps=12", "optimizer.warmup_steps=3", "checkpoint.every=0",
                            "train.eval_every=6", "logging.out_dir=" + (d / (host_path ? "host" : "device")).string()});
    TrainOptions o = quiet();
    o.after_backward = [](int64_t step, const std::vector<Variable>& params) {
      const float nan = NAN;
      if (step == 4) copy_bytes(params[1].grad().raw_data(), params[1].device().index, &nan, -1, sizeof(float));
    };
    if (host_path) o.after_loss = [](int64_t, double*) {};
    TrainResult r = train(c, o);
    return std::make_pair(r, read_metrics(r.metrics_file));
  };
  const auto [dev, dev_rows] = run(false);
  const auto [host, host_rows] = run(true);
  ASSERT_EQ(dev.losses.size(), 12u);
  ASSERT_EQ(dev_rows.size(), host_rows.size());
  EXPECT_EQ(dev.skipped_steps, 1);
  EXPECT_EQ(host.skipped_steps, 1);
  for (size_t i = 0; i < dev_rows.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    EXPECT_EQ(dev_rows[i].loss, host_rows[i].loss);
    EXPECT_EQ(dev_rows[i].skipped, host_rows[i].skipped);
    EXPECT_EQ(dev_rows[i].skipped, i == 3);
    if (i != 3) {
      EXPECT_EQ(dev_rows[i].grad_norm, host_rows[i].grad_norm);
    }
    EXPECT_EQ(dev_rows[i].moe_max_over_mean, host_rows[i].moe_max_over_mean);
    EXPECT_EQ(std::isnan(dev_rows[i].val_loss), std::isnan(host_rows[i].val_loss));
    if (!std::isnan(dev_rows[i].val_loss)) {
      EXPECT_EQ(dev_rows[i].val_loss, host_rows[i].val_loss) << "evaluation sees the same weights";
    }
  }
  fs::remove_all(d);
}

// train.cuda_graph: the step captured once and replayed gives the eager step's losses, norms, loads and
// final weights bit for bit, and its rows count no host synchronisation, in every recipe (on one GPU the
// expert GEMMs and the FP8 recipes' colwise wgrad layouts read their counts on the device). The graph
// runs the shared experts on the side stream (parallel.shared_expert_overlap), the eager step on one.
TEST(TrainerCuda, GraphReplayMatchesEagerBitForBit) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
  fs::path d = fresh_dir("trainer_cuda_graph");
  for (const std::string recipe : {"bf16", "fp8_flow", "fp8_blockwise", "fp8_full"}) {
    SCOPED_TRACE("precision.recipe " + recipe);
    auto run = [&](const std::string& mode) {
      Config c =
          load_config(std::string(FLOWMOE_SOURCE_DIR) + "/configs/tiny_moe.yaml",
                      {"train.device=cuda", "train.steps=10", "optimizer.warmup_steps=3", "checkpoint.every=0",
                       "train.eval_every=5", "train.cuda_graph=" + mode, "precision.recipe=" + recipe,
                       "parallel.shared_expert_overlap=" + mode, "logging.out_dir=" + (d / recipe / mode).string()});
      TrainResult r = train(c, quiet());
      return std::make_pair(r, read_metrics(r.metrics_file));
    };
    const auto [graph, graph_rows] = run("on");
    const auto [eager, eager_rows] = run("off");
    ASSERT_EQ(graph_rows.size(), 10u);
    ASSERT_EQ(eager_rows.size(), 10u);
    for (size_t i = 0; i < graph_rows.size(); ++i) {
      SCOPED_TRACE("step " + std::to_string(i + 1));
      EXPECT_EQ(graph_rows[i].loss, eager_rows[i].loss);
      EXPECT_EQ(graph_rows[i].grad_norm, eager_rows[i].grad_norm);
      EXPECT_EQ(graph_rows[i].moe_max_over_mean, eager_rows[i].moe_max_over_mean);
      EXPECT_TRUE(std::isnan(eager_rows[i].moe_casts) ? std::isnan(graph_rows[i].moe_casts)
                                                      : graph_rows[i].moe_casts == eager_rows[i].moe_casts);
      EXPECT_EQ(graph_rows[i].host_syncs, 0);
      EXPECT_EQ(eager_rows[i].host_syncs, 0);
      if (!std::isnan(eager_rows[i].val_loss)) {
        EXPECT_EQ(graph_rows[i].val_loss, eager_rows[i].val_loss);
      }
    }
    EXPECT_TRUE(same_model_weights(graph.last_checkpoint, eager.last_checkpoint));
  }
  fs::remove_all(d);
}
