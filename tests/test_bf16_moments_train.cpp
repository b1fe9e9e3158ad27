// optimizer.moment_dtype bf16 above the kernels: the AdamW class keeps bf16 moments, a range of a parameter
// (a sharded optimizer's) rounds as the whole parameter does, the scheduled step rounds as the step given by
// value; a tiny model trains with bf16 moments as with f32 ones; checkpoints hold the moments in their dtype
// and load into either dtype (f32 to bf16 rounded to nearest even, bf16 to f32 exactly), so a run resumes
// after the key changed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "kernels/common/error.h"
#include "tests/support/train_fixtures.h"
#include "train/optimizer.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

OptimizerConfig bf16_moments() {
  OptimizerConfig cfg;
  cfg.weight_decay = 0.1;
  cfg.moment_dtype = DType::bf16;
  return cfg;
}

// The file's tensor `name`.
Tensor file_tensor(const std::vector<NamedTensor>& file, const std::string& name) {
  for (const NamedTensor& t : file)
    if (t.name == name) return t.tensor;
  ADD_FAILURE() << "no tensor " << name;
  return Tensor();
}

// The tiny test model, `steps` steps, with `sets` overrides.
Config tiny(const fs::path& out, int64_t steps, const std::vector<std::string>& sets) {
  Config c = tiny_config(out);
  apply_override(c, "train.steps=" + std::to_string(steps));
  for (const std::string& s : sets) apply_override(c, s);
  validate(c);
  return c;
}

double max_rel_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    worst = std::max(worst, std::fabs(a[i] - b[i]) / std::fabs(b[i]));
  return worst;
}

}  // namespace

// Two "ranks" holding [0, 6) and [6, 20) of a parameter with f32 masters against one optimizer holding it
// whole, three steps: the same bf16 moments and weights, bit for bit (the rounding takes each element's index
// in the parameter, not in the range). The moments are bf16 tensors of the parameter's (or range's) shape.
TEST(Bf16MomentsOptimizer, RangesRoundAsTheWholeParameter) {
  Rng rng(test_seed());
  const Tensor w0 = random_tensor(rng, {4, 5});
  const OptimizerConfig cfg = bf16_moments();
  Variable whole(w0.clone(), true, "w");
  AdamW plain({whole}, cfg);
  plain.set_rounding_seed(77);
  std::vector<Variable> copies;
  std::vector<Tensor> masters;
  std::vector<AdamW> ranks;
  const std::pair<int64_t, int64_t> ranges[] = {{0, 6}, {6, 20}};
  for (const auto& [begin, end] : ranges) {
    copies.emplace_back(w0.clone(), true, "w");
    masters.push_back(w0.reshape({20}).slice(0, begin, end).clone());
    ranks.emplace_back(std::vector<Variable>{copies.back()}, cfg,
                       std::vector<std::pair<int64_t, int64_t>>{{begin, end}}, std::vector<Tensor>{masters.back()});
    ranks.back().set_rounding_seed(77);
  }
  EXPECT_EQ(plain.exp_avg()[0].dtype(), DType::bf16);
  EXPECT_EQ(plain.exp_avg_sq()[0].shape(), (Shape{4, 5}));
  EXPECT_EQ(ranks[1].exp_avg_sq()[0].shape(), (Shape{14}));
  for (int t = 0; t < 3; ++t) {
    const Tensor g = random_tensor(rng, {4, 5}, DType::f32, Device::cpu(), -2, 2);
    whole.set_grad(g.clone());
    plain.step(0.01, 1.0);
    for (size_t r = 0; r < ranks.size(); ++r) {
      ranks[r].set_range_grads({g.reshape({20}).slice(0, ranges[r].first, ranges[r].second).clone()});
      ranks[r].step(0.01, 1.0);
    }
  }
  for (size_t r = 0; r < ranks.size(); ++r) {
    SCOPED_TRACE("range " + std::to_string(r));
    const auto [begin, end] = ranges[r];
    EXPECT_TRUE(bit_equal(ranks[r].exp_avg()[0], plain.exp_avg()[0].reshape({20}).slice(0, begin, end)));
    EXPECT_TRUE(bit_equal(ranks[r].exp_avg_sq()[0], plain.exp_avg_sq()[0].reshape({20}).slice(0, begin, end)));
    EXPECT_TRUE(bit_equal(masters[r], whole.data().reshape({20}).slice(0, begin, end)));
  }
}

// The trainer's step reads its scalars (kernels/step_control.h): the update count there seeds the rounding
// as AdamW's own count does for a step given by value, so both give the same moments.
TEST(Bf16MomentsOptimizer, ScheduledStepRoundsAsTheStepGivenByValue) {
  Rng rng(test_seed());
  const Tensor w0 = random_tensor(rng, {3, 7}), g = random_tensor(rng, {3, 7});
  const OptimizerConfig cfg = bf16_moments();
  Variable a(w0.clone(), true, "a"), b(w0.clone(), true, "a");
  AdamW by_value({a}, cfg), scheduled({b}, cfg);
  for (int64_t t = 1; t <= 2; ++t) {
    a.set_grad(g.clone());
    b.set_grad(g.clone());
    by_value.step(0.01, 1.0);
    StepScalars c{};
    c.apply = 1;
    c.num_updates = t;
    c.lr = 0.01;
    c.grad_scale = 1.0;
    c.bias_correction1 = float(1.0 - std::pow(cfg.beta1, double(t)));
    c.bias_correction2 = float(1.0 - std::pow(cfg.beta2, double(t)));
    scheduled.step(&c);
  }
  EXPECT_TRUE(bit_equal(scheduled.exp_avg()[0], by_value.exp_avg()[0]));
  EXPECT_TRUE(bit_equal(scheduled.exp_avg_sq()[0], by_value.exp_avg_sq()[0]));
  EXPECT_TRUE(bit_equal(b.data(), a.data()));
}

// 60 steps of the tiny model with bf16 moments against f32 moments, on the same batches (the loss falls from 4.17
// to 0.80): every loss within 0.5% of the f32 run's (measured: 0.16% at most), the last ten within 0.25% on
// average (measured: 0.08%), and not the same run (the bf16 path was taken). Why that close: a stochastic
// rounding moves a moment by less than one bf16 ulp (2^-7 of it), by zero on average, so each element's update
// m / sqrt(v) is off by a fraction of a percent in a random direction, step by step and element by element; the
// loss sums many weights' effects, so it moves by less again, and nothing adds the errors up into a drift.
TEST(Bf16MomentsTraining, TinyModelLossStaysNearF32Moments) {
  const fs::path d = fresh_dir("bf16_moments_loss");
  const TrainResult f32 = train(tiny(d / "f32", 60, {"checkpoint.every=0"}), quiet());
  const TrainResult b16 = train(tiny(d / "bf16", 60, {"checkpoint.every=0", "optimizer.moment_dtype=bf16"}), quiet());
  ASSERT_EQ(f32.losses.size(), 60u);
  ASSERT_EQ(b16.losses.size(), 60u);
  const double worst = max_rel_difference(b16.losses, f32.losses);
  double tail = 0;
  for (size_t i = 50; i < 60; ++i) tail += std::fabs(b16.losses[i] - f32.losses[i]) / f32.losses[i] / 10;
  std::printf(
      "bf16 moments against f32: largest relative loss difference %.2e, last ten steps' mean %.2e; loss %.4f "
      "-> %.4f against %.4f -> %.4f\n",
      worst, tail, b16.losses.front(), b16.losses.back(), f32.losses.front(), f32.losses.back());
  EXPECT_LT(worst, 0.005);
  EXPECT_LT(tail, 0.0025);
  EXPECT_GT(worst, 0.0) << "bf16 moments trained the f32 run bit for bit: the bf16 path was not taken";
  EXPECT_LT(b16.losses.back(), 0.7 * b16.losses.front()) << "the model did not learn";
  fs::remove_all(d);
}

// A checkpoint holds the moments in the run's dtype (BF16 tensors in optimizer.safetensors), and either dtype
// loads into either: an f32 checkpoint's moments into bf16 ones are the file's rounded to nearest even, a bf16
// checkpoint's into f32 ones the file's exactly. A run saved with f32 moments resumes with bf16 ones, and back,
// and continues the losses of the uninterrupted f32 run as closely as bf16 moments train (the test above).
TEST(Bf16MomentsTraining, CheckpointsResumeAcrossMomentDtypes) {
  const fs::path d = fresh_dir("bf16_moments_resume");
  const TrainResult straight = train(tiny(d / "straight", 12, {}), quiet());
  ASSERT_EQ(straight.losses.size(), 12u);
  TrainOptions stop6 = quiet();
  stop6.stop_after = 6;
  for (const auto& [first, then] : {std::pair{"f32", "bf16"}, {"bf16", "f32"}}) {
    SCOPED_TRACE(std::string(first) + " moments, resumed with " + then);
    const fs::path run = d / (std::string(first) + "_then_" + then);
    const TrainResult a = train(tiny(run, 12, {std::string("optimizer.moment_dtype=") + first}), stop6);
    ASSERT_EQ(a.losses.size(), 6u);
    const std::string saved = a.last_checkpoint;
    const std::vector<NamedTensor> optim = read_safetensors(saved + "/optimizer.safetensors");
    const std::vector<NamedTensor> model = read_safetensors(saved + "/model.safetensors");
    DType saved_dtype = DType::f64, other = DType::f64;
    ASSERT_TRUE(dtype_from_name(first, &saved_dtype) && dtype_from_name(then, &other));
    for (const NamedTensor& t : optim) EXPECT_EQ(t.tensor.dtype(), saved_dtype) << t.name;
    // Loaded into the other dtype: the file's values converted.
    std::vector<Variable> params;
    std::vector<Tensor> m, v;
    for (const NamedTensor& t : model) {
      params.emplace_back(Tensor::zeros(t.tensor.shape(), DType::f32), false, t.name);
      m.push_back(Tensor::zeros(t.tensor.shape(), other));
      v.push_back(Tensor::zeros(t.tensor.shape(), other));
    }
    load_checkpoint(saved, params, &m, &v);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(bit_equal(m[i], file_tensor(optim, params[i].name() + ".exp_avg").to(other))) << params[i].name();
      EXPECT_TRUE(bit_equal(v[i], file_tensor(optim, params[i].name() + ".exp_avg_sq").to(other))) << params[i].name();
      if (other == DType::f32) {  // widened exactly: back to bf16 gives the file's bits
        EXPECT_TRUE(bit_equal(v[i].to(DType::bf16), file_tensor(optim, params[i].name() + ".exp_avg_sq")));
      }
    }
    // The run itself, resumed with the other dtype.
    const TrainResult b =
        train(tiny(run, 12, {std::string("optimizer.moment_dtype=") + then, "checkpoint.resume=" + saved}), quiet());
    ASSERT_EQ(b.first_step, 7);
    ASSERT_EQ(b.losses.size(), 6u);
    std::vector<double> resumed = a.losses;
    resumed.insert(resumed.end(), b.losses.begin(), b.losses.end());
    EXPECT_LT(max_rel_difference(resumed, straight.losses), 0.005);
    for (const NamedTensor& t : read_safetensors(b.last_checkpoint + "/optimizer.safetensors"))
      EXPECT_EQ(t.tensor.dtype(), other) << t.name;
  }
  fs::remove_all(d);
}

// A bf16 moment holding NaN or Inf is refused as an f32 one is, naming the tensor and the element, whether it
// loads into bf16 or f32 moments; checkpoint.allow_nonfinite loads it anyway.
TEST(Bf16MomentsTraining, NanOrInfInABf16MomentIsRefusedByName) {
  const fs::path d = fresh_dir("bf16_moments_nonfinite");
  const Variable w(Tensor::from_floats({1, 2, 3, 4}, {4}), true, "w");
  CheckpointMeta meta;
  meta.step = meta.num_updates = 1;
  for (const auto& [bad, holds] : {std::pair{INFINITY, "holds inf at element 2"}, {NAN, "holds nan at element 2"}}) {
    const Tensor m = Tensor::from_floats({0.1f, 0.2f, 0.3f, 0.4f}, {4}, DType::bf16);
    const Tensor v = Tensor::from_floats({0.1f, 0.2f, bad, 0.4f}, {4}, DType::bf16);
    const std::string dir = save_checkpoint(d.string(), meta, {w}, {m}, {v}, 1);
    for (DType into : {DType::bf16, DType::f32}) {
      SCOPED_TRACE(std::string(holds) + " into " + dtype_name(into));
      const Variable loaded(Tensor::zeros({4}, DType::f32), false, "w");
      std::vector<Tensor> ms = {Tensor::zeros({4}, into)}, vs = {Tensor::zeros({4}, into)};
      EXPECT_TRUE(throws_naming<IoError>([&] { load_checkpoint(dir, {loaded}, &ms, &vs); },
                                         {"optimizer.safetensors': tensor 'w.exp_avg_sq' ", holds}));
      load_checkpoint(dir, {loaded}, &ms, &vs, {}, {}, {.allow_nonfinite = true});
      EXPECT_FALSE(std::isfinite(vs[0].to_floats()[2]));
      EXPECT_TRUE(bit_equal(ms[0], m.to(into)));
    }
  }
  fs::remove_all(d);
}
