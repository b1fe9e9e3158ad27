// The optimizer step's scalars (kernels/step_control.h): the host function against the trainer's
// schedule and clipping, skips and the sticky halt; the CUDA kernel bit for bit against the host
// function; AdamW and the expert-bias update reading them on the device against their by-value forms.
#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "engine/ops/router.h"
#include "kernels/adamw.h"
#include "kernels/step_control.h"
#include "tests/support/train_fixtures.h"
#include "train/optimizer.h"
#include "train/step_state.h"
#include "train/trainer.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

StepSchedule test_schedule() {
  StepSchedule p;
  p.lr = 3e-3;
  p.min_lr = 3e-4;
  p.warmup_steps = 3;
  p.total_steps = 10;
  p.beta1 = 0.9;
  p.beta2 = 0.95;
  p.grad_clip = 1.0;
  p.num_micro_batches = 2;
  p.has_aux = 1;
  p.bias_follows_lr = 1;
  return p;
}

// Per step: two micro-batch losses, two aux losses, two squared-norm sums.
struct StepInputs {
  float lm[2], aux[2], sq[2];
};

std::vector<StepInputs> test_steps() {
  return {{{2.5f, 2.25f}, {0.01f, 0.02f}, {0.25f, 0.5f}},   // norm 0.87: no clipping
          {{2.0f, 1.75f}, {0.01f, 0.01f}, {3.0f, 1.0f}},    // norm 2: clipped by half
          {{NAN, 1.5f}, {0.01f, 0.01f}, {1.0f, 0.0f}},      // non-finite loss: skipped
          {{1.5f, 1.25f}, {0.02f, 0.0f}, {INFINITY, 0.f}},  // non-finite norm: skipped
          {{1.25f, 1.0f}, {0.0f, 0.0f}, {0.5f, 0.25f}}};
}

bool same_bits(const StepScalars& a, const StepScalars& b) { return std::memcmp(&a, &b, sizeof(StepScalars)) == 0; }

}  // namespace

TEST(StepControl, FollowsTheTrainersScheduleClipAndSkips) {
  const StepSchedule p = test_schedule();
  OptimizerConfig o;
  o.lr = p.lr, o.min_lr = p.min_lr, o.warmup_steps = p.warmup_steps;
  StepScalars s;
  s.step = 0;
  int64_t applied = 0;
  for (const StepInputs& in : test_steps()) {
    advance_step_from_sums(s, p, in.lm, in.aux, in.sq);
    const double loss = (double(in.lm[0]) + double(in.lm[1])) / 2, aux = (double(in.aux[0]) + double(in.aux[1])) / 2;
    const double norm = std::sqrt(double(in.sq[0]) + double(in.sq[1]));
    const bool finite = std::isfinite(loss + aux) && std::isfinite(norm);
    applied += finite;
    SCOPED_TRACE("step " + std::to_string(s.step));
    EXPECT_EQ(s.lr, learning_rate(o, s.step, p.total_steps));
    EXPECT_EQ(s.apply, finite ? 1 : 0);
    EXPECT_EQ(s.num_updates, applied);
    EXPECT_EQ(s.halted, 0) << "a skip does not halt";
    if (finite) {
      EXPECT_EQ(s.loss, loss);
      EXPECT_EQ(s.aux_loss, aux);
      EXPECT_EQ(s.grad_norm, norm);
      EXPECT_EQ(s.grad_scale, clip_scale(norm, p.grad_clip));
      EXPECT_EQ(s.bias_correction1, float(1.0 - std::pow(p.beta1, double(applied))));
      EXPECT_EQ(s.bias_rate_scale, s.lr / p.lr);
    } else {
      EXPECT_EQ(s.bias_rate_scale, 0.0) << "a skipped step moves no bias";
    }
  }
  EXPECT_EQ(s.step, 5);
}

TEST(StepControl, StopHaltsEveryLaterUpdate) {
  StepSchedule p = test_schedule();
  p.stop_on_nonfinite = 1;
  p.bias_follows_lr = 0;
  StepScalars s;
  const std::vector<StepInputs> steps = test_steps();
  advance_step_from_sums(s, p, steps[0].lm, steps[0].aux, steps[0].sq);
  EXPECT_EQ(s.apply, 1);
  EXPECT_EQ(s.bias_rate_scale, 1.0) << "a constant bias rate";
  advance_step_from_sums(s, p, steps[2].lm, steps[2].aux, steps[2].sq);
  EXPECT_EQ(s.halted, 1);
  advance_step_from_sums(s, p, steps[4].lm, steps[4].aux, steps[4].sq);
  EXPECT_EQ(s.apply, 0) << "finite, but after a halt";
  EXPECT_EQ(s.num_updates, 1);
}

// A step whose exchange ran out of buffer rows changes nothing but the sticky overflow (the running maximum),
// and voids every later step until it is cleared; then the steps go on as if the void ones never ran.
TEST(StepControl, AnExchangeOverflowVoidsEveryStepUntilCleared) {
  const StepSchedule p = test_schedule();
  const std::vector<StepInputs> steps = test_steps();
  const int32_t overflow[3] = {300, 0, 500};
  StepScalars s, plain;
  advance_step_from_sums(s, p, steps[0].lm, steps[0].aux, steps[0].sq);
  advance_step_from_sums(plain, p, steps[0].lm, steps[0].aux, steps[0].sq);
  const StepScalars before = s;
  for (int i = 0; i < 3; ++i) {
    advance_step_from_sums(s, p, steps[1].lm, steps[1].aux, steps[1].sq, &overflow[i]);
    EXPECT_EQ(s.step, before.step) << "void step " << i;
    EXPECT_EQ(s.num_updates, before.num_updates);
    EXPECT_EQ(s.apply, 0);
    EXPECT_EQ(s.bias_rate_scale, 0.0);
    EXPECT_EQ(s.exchange_overflow, i < 2 ? 300 : 500) << "sticky, the most rows needed";
  }
  s.exchange_overflow = 0;  // the host ran the step again with larger buffers
  const int32_t none = 0;
  advance_step_from_sums(s, p, steps[1].lm, steps[1].aux, steps[1].sq, &none);
  advance_step_from_sums(plain, p, steps[1].lm, steps[1].aux, steps[1].sq);
  EXPECT_TRUE(same_bits(s, plain)) << "the step after the void ones is the plain run's next step";
}

TEST(StepControl, NoBalanceLossReadsNoAux) {
  StepSchedule p = test_schedule();
  p.has_aux = 0;
  StepScalars s;
  const float lm[2] = {1.f, 2.f}, aux[2] = {NAN, NAN}, sq[2] = {1.f, 0.f};
  advance_step_from_sums(s, p, lm, aux, sq);
  EXPECT_EQ(s.apply, 1);
  EXPECT_TRUE(std::isnan(s.aux_loss));
  EXPECT_EQ(s.loss, 1.5);
}

// The learning rate and bias corrections, computed per step, are the values the table of every step held
// before (scheduled_lr and float(1 - pow(beta, t)) at each index), at steps near the start and the end of a
// run of 1e12 steps; the window the device reads gives the same bits whichever way the pending steps went.
TEST(StepControl, TheScheduleIsComputedPerStepWithTheTablesValues) {
  StepSchedule p = test_schedule();
  p.total_steps = 1000000000000;
  p.warmup_steps = 1000;
  const auto table_lr = [&](int64_t i) { return scheduled_lr(p, i); };
  const auto table_bc = [](double beta, int64_t i) { return float(1.0 - std::pow(beta, double(i))); };
  const int64_t starts[] = {0, 3, 999, 1000, 123456789, p.total_steps / 2, p.total_steps - 3};
  for (const int64_t last : starts) {
    SCOPED_TRACE("after step " + std::to_string(last));
    // Every pattern of the step still pending before this one and this one: applied, skipped or (pending) void.
    for (int pattern = 0; pattern < 9; ++pattern) {
      StepScalars direct;
      direct.step = last;
      direct.num_updates = last / 2;
      StepScalars windowed = direct;
      const ScheduleWindow w = schedule_window(p, direct);
      StepSchedule p_window = p;
      p_window.window = &w;
      const StepInputs finite = test_steps()[0], nonfinite = test_steps()[2];
      const int32_t overflow = 5;
      for (const int kind : {pattern / 3, pattern % 3}) {  // 0 applied, 1 skipped, 2 void
        const StepInputs& in = kind == 1 ? nonfinite : finite;
        const int32_t* void_step = kind == 2 ? &overflow : nullptr;
        advance_step_from_sums(direct, p, in.lm, in.aux, in.sq, void_step);
        advance_step_from_sums(windowed, p_window, in.lm, in.aux, in.sq, void_step);
        EXPECT_TRUE(same_bits(direct, windowed)) << "pattern " << pattern;
        if (kind == 2) {  // nothing moved but the overflow, which the host clears before it runs the step again
          direct.exchange_overflow = windowed.exchange_overflow = 0;
          continue;
        }
        EXPECT_EQ(direct.lr, table_lr(direct.step));
        EXPECT_EQ(direct.bias_correction1, table_bc(p.beta1, direct.num_updates));
        EXPECT_EQ(direct.bias_correction2, table_bc(p.beta2, direct.num_updates));
      }
    }
  }
  // A window filled for other steps gives NaN, not another step's rate.
  StepScalars s;
  s.step = 9;
  const ScheduleWindow stale = schedule_window(p, s);
  StepSchedule p_stale = p;
  p_stale.window = &stale;
  s.step = 20;
  const StepInputs in = test_steps()[0];
  advance_step_from_sums(s, p_stale, in.lm, in.aux, in.sq);
  EXPECT_TRUE(std::isnan(s.lr));
}

// A run of any allowed length starts at once: nothing is sized by train.steps (a table of every step's
// learning rate and bias corrections took 16 bytes a step, 16 GB and 111 s before step 1 at 1e9 steps).
TEST(StepControl, ARunOfOneTrillionStepsStartsAtOnce) {
  StepSchedule p = test_schedule();
  p.total_steps = 1000000000000;
  const auto t0 = std::chrono::steady_clock::now();
  StepState state(Device::cpu(), p);
  state.reset(p.total_steps - 1, 7);
  const fs::path d = fresh_dir("trillion_steps");
  Config cfg = parse_config(
      "model: {vocab_size: 64, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,"
      " intermediate_size: 64, max_position_embeddings: 16}\n"
      "data: {seq_len: 16, synthetic_tokens: 20000, val_fraction: 0}\n"
      "train: {device: cpu, steps: 1000000000000, batch_size: 4, eval_every: 0}\n"
      "checkpoint: {final: false}\n",
      "trillion.yaml");
  cfg.logging.out_dir = d.string();
  TrainOptions o = quiet();
  o.stop_after = 1;
  const TrainResult r = train(cfg, o);
  EXPECT_EQ(r.last_step, 1);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  EXPECT_LT(usage.ru_maxrss, 1L << 20) << "peak resident KiB";  // below 1 GiB
  fs::remove_all(d);
}

// The trainer's StepState on its host path gives, step by step and bit for bit, the scalars of the formulas
// (scheduled_lr, 1 - beta^t) that advance_step computes: from the start and from a resume.
TEST(StepControl, StepStateGivesTheFormulasStepByStep) {
  const StepSchedule p = test_schedule();
  const std::vector<StepInputs> steps = test_steps();
  for (const auto& [last_step, num_updates] : {std::pair<int64_t, int64_t>{0, 0}, {3, 2}}) {
    SCOPED_TRACE("from step " + std::to_string(last_step));
    StepState state(Device::cpu(), p);
    state.reset(last_step, num_updates);
    StepScalars want{};
    want.step = last_step;
    want.num_updates = num_updates;
    for (int64_t step = last_step + 1; step <= p.total_steps; ++step) {
      const StepInputs& in = steps[size_t(step) % steps.size()];
      const double loss = (double(in.lm[0]) + double(in.lm[1])) / 2, aux = (double(in.aux[0]) + double(in.aux[1])) / 2;
      const double norm = std::sqrt(double(in.sq[0]) + double(in.sq[1]));
      const bool finite = std::isfinite(loss + aux) && std::isfinite(norm);
      state.advance_on_host(loss, aux, norm, finite);
      advance_step(want, p, loss, aux, norm, finite);
      EXPECT_TRUE(same_bits(*state.scalars(), want)) << "step " << step;
    }
    EXPECT_EQ(state.scalars()->step, p.total_steps);
  }
}

// With the host's window of values (as the trainer gives it: the device's cos and pow may round differently),
// refilled before each step as StepState::prepare_device_step does.
TEST(StepControlCuda, KernelMatchesTheHostBitForBit) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
  const StepSchedule p = test_schedule();
  StepSchedule p_dev = p;
  Tensor window = Tensor::zeros({int64_t(sizeof(ScheduleWindow))}, DType::u8, Device::cuda(0));
  p_dev.window = static_cast<const ScheduleWindow*>(window.raw_data());
  const auto fill_window = [&](const StepScalars& last) {
    const ScheduleWindow w = schedule_window(p, last);
    copy_bytes(window.raw_data(), 0, &w, -1, sizeof w);
  };
  Tensor dev = Tensor::zeros({int64_t(sizeof(StepScalars))}, DType::u8, Device::cuda(0));
  Tensor inputs = Tensor::zeros({6}, DType::f32, Device::cuda(0));
  StepScalars host;
  for (const StepInputs& in : test_steps()) {
    fill_window(host);
    advance_step_from_sums(host, p, in.lm, in.aux, in.sq);
    const float flat[6] = {in.lm[0], in.lm[1], in.aux[0], in.aux[1], in.sq[0], in.sq[1]};
    copy_bytes(inputs.raw_data(), 0, flat, -1, sizeof(flat));
    const float* d = inputs.data<float>();
    advance_step_cuda(static_cast<StepScalars*>(dev.raw_data()), p_dev, d, d + 2, d + 4, nullptr, current_stream(0));
    StepScalars got;
    copy_bytes(&got, -1, dev.raw_data(), 0, sizeof(StepScalars));
    EXPECT_TRUE(same_bits(got, host)) << "step " << host.step << ": lr " << got.lr << " vs " << host.lr;
  }
  // A void step: the overflow read on the device.
  const int32_t overflow = 7;
  Tensor overflow_dev = Tensor::from_ints({overflow}, {1}, DType::i32, Device::cuda(0));
  const StepInputs in = test_steps().front();
  fill_window(host);
  advance_step_from_sums(host, p, in.lm, in.aux, in.sq, &overflow);
  const float* d = inputs.data<float>();
  advance_step_cuda(static_cast<StepScalars*>(dev.raw_data()), p_dev, d, d + 2, d + 4, overflow_dev.data<int32_t>(),
                    current_stream(0));
  StepScalars got;
  copy_bytes(&got, -1, dev.raw_data(), 0, sizeof(StepScalars));
  EXPECT_EQ(got.exchange_overflow, 7);
  EXPECT_TRUE(same_bits(got, host)) << "a void step";
}

// A scheduled AdamW step equals the by-value step it describes, and a skipped one changes nothing.
TEST(StepControlCuda, AdamWAndExpertBiasReadTheScalars) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
  Rng rng(test_seed());
  const int64_t n = 3000;
  const Device gpu = Device::cuda(0);
  StepScalars c;
  c.step = 4, c.num_updates = 3, c.lr = 2e-3, c.grad_scale = 0.5, c.apply = 1;
  c.bias_correction1 = 0.271f, c.bias_correction2 = 0.142625f, c.bias_rate_scale = 0.25;
  Tensor control = Tensor::zeros({int64_t(sizeof(StepScalars))}, DType::u8, gpu);
  const auto upload = [&](const StepScalars& s) { copy_bytes(control.raw_data(), 0, &s, -1, sizeof(s)); };
  const auto* ctrl = static_cast<const StepScalars*>(control.raw_data());
  for (int apply : {1, 0}) {
    SCOPED_TRACE(apply ? "applied" : "skipped");
    c.apply = apply;
    upload(c);
    Tensor p0 = random_tensor(rng, {n}, DType::f32, gpu), g = random_tensor(rng, {n}, DType::f32, gpu);
    Tensor m0 = random_tensor(rng, {n}, DType::f32, gpu), v0 = random_tensor(rng, {n}, DType::f32, gpu, 0, 1);
    Tensor p1 = p0.clone(), m1 = m0.clone(), v1 = v0.clone();
    AdamWStep base;
    base.beta1 = 0.9f, base.beta2 = 0.95f, base.eps = 1e-8f, base.weight_decay = 0.1f;
    adamw_scheduled_cuda(p1.data<float>(), g.data<float>(), m1.data<float>(), v1.data<float>(), n, base, ctrl, 0.5,
                         current_stream(0));
    Tensor p2 = p0.clone(), m2 = m0.clone(), v2 = v0.clone();
    if (apply)
      adamw_cuda(p2.data<float>(), g.data<float>(), m2.data<float>(), v2.data<float>(), n,
                 scheduled_adamw_step(base, c, 0.5), current_stream(0));
    EXPECT_TRUE(bit_equal(p1, p2));
    EXPECT_TRUE(bit_equal(m1, m2));
    EXPECT_TRUE(bit_equal(v1, v2));

    // The expert bias moves by rate × bias_rate_scale; the CPU reference gives the expected bits.
    c.bias_rate_scale = apply ? 0.25 : 0.0;
    upload(c);
    const std::vector<int64_t> loads = {5, 0, 9, 2, 7, 1, 0, 8};
    Tensor counts_cpu = Tensor::from_ints(loads, {8}, DType::i32, Device::cpu());
    Tensor bias_cpu = random_tensor(rng, {8});
    Tensor bias_gpu = bias_cpu.to(gpu);
    update_expert_bias(bias_gpu, counts_cpu.to(gpu), 0.1, BiasUpdateRule::proportional, ctrl);
    update_expert_bias(bias_cpu, counts_cpu, 0.1 * c.bias_rate_scale, BiasUpdateRule::proportional);
    EXPECT_TRUE(bit_equal(bias_gpu.to(Device::cpu()), bias_cpu));
  }
}
