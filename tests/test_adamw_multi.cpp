// The multi-tensor AdamW update and sums (kernels/adamw.h): many tensors of mixed sizes (0, 1, not multiples
// of a block, several launches' worth), steps and weight copies in one call give, bit for bit, what each
// tensor gives alone, on the CPU and on the GPU, and the GPU agrees with the CPU. The optimizer class over
// more parameters than one launch takes: tests/test_adamw.cpp (OptimizerClassMatchesCpu).
#include <cmath>
#include <cstring>

#include "kernels/adamw.h"
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

// More tensors than two launches take, so the table is split; sizes around a block of 256 and a zero.
constexpr int kNumTensors = 2 * kTensorsPerLaunch + 7;
int64_t tensor_size(int i) {
  const int64_t sizes[] = {0, 1, 255, 256, 257, 4097, (1 << 16) + 3, 31};
  return sizes[i % 8] + (i % 3);
}

// One tensor's buffers on a device, and the AdamWTensor that points at them.
struct Buffers {
  Tensor param, grad, exp_avg, exp_avg_sq, copy;
  AdamWTensor table(const AdamWStep& step, double lr_multiplier) {
    AdamWTensor t;
    t.param = param.data<float>();
    t.grad = grad.data<float>();
    t.exp_avg = exp_avg.data<float>();
    t.exp_avg_sq = exp_avg_sq.data<float>();
    t.n = param.numel();
    t.step = step;
    t.lr_multiplier = lr_multiplier;
    if (copy.defined()) t.copy = {copy.raw_data(), copy.dtype()};
    return t;
  }
  // A copy on dev, even where the buffers are there already (Tensor::to would hand back the same storage,
  // and the updates below work in place).
  Buffers to(Device dev) const {
    auto copy_of = [&](const Tensor& t) { return t.defined() ? t.to(dev).clone() : Tensor(); };
    return {copy_of(param), copy_of(grad), copy_of(exp_avg), copy_of(exp_avg_sq), copy_of(copy)};
  }
};

// Tensor i: random buffers, no copy / an f32 copy / a bf16 copy in turn.
std::vector<Buffers> make_buffers(Rng& rng) {
  std::vector<Buffers> out;
  for (int i = 0; i < kNumTensors; ++i) {
    const int64_t n = tensor_size(i);
    Buffers b{random_tensor(rng, {n}), random_tensor(rng, {n}, DType::f32, Device::cpu(), -3, 3),
              random_tensor(rng, {n}, DType::f32, Device::cpu(), -0.1, 0.1),
              random_tensor(rng, {n}, DType::f32, Device::cpu(), 0, 0.1), Tensor()};
    if (i % 3 == 1) b.copy = Tensor::zeros({n}, DType::f32);
    if (i % 3 == 2) b.copy = Tensor::zeros({n}, DType::bf16);
    out.push_back(b);
  }
  return out;
}

// Tensor i's step: its own weight decay, clip factor and (scheduled) lr multiplier.
AdamWStep step_of(int i) {
  AdamWStep s;
  s.lr = 1e-3f * float(1 + i % 4);
  s.beta1 = 0.9f;
  s.beta2 = 0.95f;
  s.weight_decay = i % 2 ? 0.1f : 0.0f;
  s.grad_scale = 0.5f;
  s.bias_correction1 = float(1 - std::pow(0.9, 3));
  s.bias_correction2 = float(1 - std::pow(0.95, 3));
  return s;
}
double lr_multiplier_of(int i) { return i % 5 == 0 ? 0.25 : 1.0; }

// Tensor i's step under the step scalars c, written out here rather than taken from scheduled_adamw_step (the
// code under test): its own betas, eps and weight decay, c's lr times its multiplier, c's clip factor and
// bias corrections.
AdamWStep scheduled_step_of(int i, const StepScalars& c) {
  AdamWStep s = step_of(i);
  s.lr = float(c.lr * lr_multiplier_of(i));
  s.grad_scale = float(c.grad_scale);
  s.bias_correction1 = c.bias_correction1;
  s.bias_correction2 = c.bias_correction2;
  return s;
}

StepScalars scalars(bool apply) {
  StepScalars c{};
  c.apply = apply;
  c.lr = 2e-3;
  c.grad_scale = 0.75;
  c.bias_correction1 = float(1 - std::pow(0.9, 2));
  c.bias_correction2 = float(1 - std::pow(0.95, 2));
  return c;
}

// The step's scalars as device bytes, where the CUDA update reads them.
Tensor on_device(const StepScalars& c) {
  Tensor host = Tensor::zeros({int64_t(sizeof c)}, DType::u8);
  std::memcpy(host.raw_data(), &c, sizeof c);
  return host.to(Device::cuda());
}

void expect_same_bits(const std::vector<Buffers>& got, const std::vector<Buffers>& want, const char* what) {
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE(std::string(what) + ", tensor " + std::to_string(i) + " of " + std::to_string(got[i].param.numel()));
    EXPECT_TRUE(bit_equal(got[i].param, want[i].param));
    EXPECT_TRUE(bit_equal(got[i].exp_avg, want[i].exp_avg));
    EXPECT_TRUE(bit_equal(got[i].exp_avg_sq, want[i].exp_avg_sq));
    ASSERT_EQ(got[i].copy.defined(), want[i].copy.defined());
    if (got[i].copy.defined()) {
      EXPECT_TRUE(bit_equal(got[i].copy, want[i].copy));
    }
  }
}

// Every non-empty tensor's weights and moments moved: the comparisons above are between updates, not copies.
void expect_updated(const std::vector<Buffers>& got, const std::vector<Buffers>& init) {
  for (size_t i = 0; i < got.size(); ++i) {
    if (init[i].param.numel() == 0) continue;
    SCOPED_TRACE("updated, tensor " + std::to_string(i));
    EXPECT_FALSE(bit_equal(got[i].param, init[i].param));
    EXPECT_FALSE(bit_equal(got[i].exp_avg, init[i].exp_avg));
  }
}

std::vector<Buffers> clone_to(const std::vector<Buffers>& bs, Device dev) {
  std::vector<Buffers> out;
  for (const Buffers& b : bs) out.push_back(b.to(dev));
  return out;
}

// Updates every tensor in one multi-tensor call (CPU or CUDA by the buffers' device); control: host scalars
// (copied to the device for CUDA) or null for each tensor's own step.
void update_all(std::vector<Buffers>& bs, const StepScalars* control) {
  std::vector<AdamWTensor> tables;
  for (size_t i = 0; i < bs.size(); ++i) tables.push_back(bs[i].table(step_of(int(i)), lr_multiplier_of(int(i))));
  if (bs[0].param.device().is_cpu()) return adamw_multi_cpu(tables.data(), int64_t(tables.size()), control);
  const Tensor scalars = control ? on_device(*control) : Tensor();
  adamw_multi_cuda(tables.data(), int64_t(tables.size()),
                   control ? static_cast<const StepScalars*>(scalars.raw_data()) : nullptr, current_stream(0));
}

// A skipped step (the step scalars' apply false) on copies of init on dev moves nothing.
void expect_skip_moves_nothing(const std::vector<Buffers>& init, Device dev) {
  const StepScalars skip = scalars(false);
  std::vector<Buffers> skipped = clone_to(init, dev);
  update_all(skipped, &skip);
  expect_same_bits(skipped, init, "a skipped step");
}

}  // namespace

// On the CPU the multi-tensor call is the one-tensor reference over each tensor; a skipped step moves nothing.
TEST(AdamWMulti, CpuIsEachTensorAlone) {
  Rng rng(test_seed());
  const std::vector<Buffers> init = make_buffers(rng);
  for (int scheduled = 0; scheduled < 2; ++scheduled) {
    SCOPED_TRACE(scheduled ? "step scalars" : "steps given");
    const StepScalars c = scalars(true);
    std::vector<Buffers> all = clone_to(init, Device::cpu()), each = clone_to(init, Device::cpu());
    update_all(all, scheduled ? &c : nullptr);
    for (size_t i = 0; i < each.size(); ++i) {
      const AdamWTensor t = each[i].table(step_of(int(i)), lr_multiplier_of(int(i)));
      adamw_cpu(t.param, t.grad, t.exp_avg, t.exp_avg_sq, t.n, scheduled ? scheduled_step_of(int(i), c) : t.step,
                t.copy);
    }
    expect_same_bits(all, each, "multi against each");
    expect_updated(all, init);
  }
  expect_skip_moves_nothing(init, Device::cpu());
}

// On the GPU: one call over every tensor equals each tensor's own launch bit for bit (the blocks a tensor
// owns change with the table, the bits must not), with step scalars and without, and agrees with the CPU;
// the copies are the updated weights cast; a skipped step moves nothing.
TEST(AdamWMultiCuda, EachTensorsBitsAloneOrTogetherAndTheCpus) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const std::vector<Buffers> init = make_buffers(rng);
  for (int scheduled = 0; scheduled < 2; ++scheduled) {
    SCOPED_TRACE(scheduled ? "step scalars" : "steps given");
    const StepScalars c = scalars(true);
    const StepScalars* control = scheduled ? &c : nullptr;
    const Tensor scalars = on_device(c);
    std::vector<Buffers> all = clone_to(init, Device::cuda()), cpu = clone_to(init, Device::cpu());
    update_all(all, control);
    update_all(cpu, control);
    expect_updated(all, init);
    expect_updated(cpu, init);
    for (size_t i = 0; i < init.size(); ++i) {
      std::vector<Buffers> alone = {init[i].to(Device::cuda())};
      std::vector<AdamWTensor> one = {alone[0].table(step_of(int(i)), lr_multiplier_of(int(i)))};
      adamw_multi_cuda(one.data(), 1, control ? static_cast<const StepScalars*>(scalars.raw_data()) : nullptr,
                       current_stream(0));
      expect_same_bits({all[i]}, alone, "multi against one");
      SCOPED_TRACE("tensor " + std::to_string(i));
      EXPECT_TRUE(all_close(all[i].param, cpu[i].param, 1e-5, 1e-7));
      EXPECT_TRUE(all_close(all[i].exp_avg, cpu[i].exp_avg, 1e-6, 1e-8));
      EXPECT_TRUE(all_close(all[i].exp_avg_sq, cpu[i].exp_avg_sq, 1e-6, 1e-8));
      if (all[i].copy.defined()) {
        EXPECT_TRUE(bit_equal(all[i].copy, all[i].param.to(all[i].copy.dtype())));
      }
    }
  }
  expect_skip_moves_nothing(init, Device::cuda());
}

// Bad tables are refused before anything moves, naming the tensor.
TEST(AdamWMultiCuda, RefusesABadTableBeforeUpdating) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const std::vector<Buffers> init = make_buffers(rng);
  std::vector<Buffers> bs = clone_to(init, Device::cuda());
  std::vector<AdamWTensor> tables;
  for (size_t i = 0; i < bs.size(); ++i) tables.push_back(bs[i].table(step_of(int(i)), 1.0));
  tables.back().copy.dtype = DType::e4m3;
  tables.back().copy.data = tables.back().param;
  const std::string last = "tensor " + std::to_string(tables.size() - 1);
  EXPECT_TRUE(throws_naming<DTypeError>(
      [&] { adamw_multi_cuda(tables.data(), int64_t(tables.size()), nullptr, current_stream(0)); },
      {last.c_str(), "f32 or bf16"}));
  tables.back().copy = {};
  tables.back().n = -1;
  EXPECT_TRUE(throws_naming<Error>(
      [&] { adamw_multi_cuda(tables.data(), int64_t(tables.size()), nullptr, current_stream(0)); }, {"negative size"}));
  expect_same_bits(bs, clone_to(init, Device::cuda()), "after a refused table");
}

// The sums of many slices at once are each slice's own sum, bit for bit, and near the CPU's double sums.
TEST(AdamWMultiCuda, SumsOfManySlicesAreEachSlicesBits) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  std::vector<Tensor> xs;
  for (int i = 0; i < kNumTensors; ++i) xs.push_back(random_tensor(rng, {tensor_size(i) * (i % 7 == 3 ? 40 : 1)}));
  std::vector<Tensor> on_device;
  for (const Tensor& x : xs) on_device.push_back(x.to(Device::cuda()));
  const int64_t n = int64_t(xs.size());
  Tensor partials = Tensor::zeros({int64_t(kTensorsPerLaunch) * kReduceMaxBlocks}, DType::f32, Device::cuda());
  for (int square = 0; square < 2; ++square) {
    SCOPED_TRACE(square ? "squares" : "values");
    Tensor together = Tensor::full({n}, -1.0, DType::f32, Device::cuda());  // zero-size slices must write 0
    Tensor alone = Tensor::zeros({n}, DType::f32, Device::cuda());
    std::vector<SumSlice> slices;
    for (int64_t i = 0; i < n; ++i)
      slices.push_back({on_device[size_t(i)].data<float>(), xs[size_t(i)].numel(), together.data<float>() + i});
    (square ? sum_squares_multi_cuda : sum_values_multi_cuda)(slices.data(), n, partials.data<float>(),
                                                              current_stream(0));
    for (int64_t i = 0; i < n; ++i)
      (square ? sum_squares_cuda : sum_values_cuda)(on_device[size_t(i)].data<float>(), xs[size_t(i)].numel(),
                                                    alone.data<float>() + i, partials.data<float>(), current_stream(0));
    EXPECT_TRUE(bit_equal(together, alone));
    const std::vector<float> got = together.to_floats();
    for (int64_t i = 0; i < n; ++i) {
      double want = 0;
      for (float v : xs[size_t(i)].to_floats()) want += square ? double(v) * v : double(v);
      EXPECT_NEAR(got[size_t(i)], want, 1e-5 * std::fabs(want) + 1e-4 * std::sqrt(double(xs[size_t(i)].numel())))
          << "slice " << i;
    }
  }
}
