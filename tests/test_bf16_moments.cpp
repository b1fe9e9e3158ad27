// AdamW with bf16 moments (kernels/adamw.h, kernels/stochastic_round.h): the update against the f32 formula
// and a stochastic rounding written out here, independently of the code under test; the rounding's mean is
// the value (unbiased), its bits repeat for the same inputs and differ between updates, tensors and elements;
// v keeps tracking g^2 where round-to-nearest would freeze it; the multi-tensor call equals the one-tensor one;
// and the GPU equals the CPU bit for bit, one tensor and many, on the 16-byte path and off it.
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/adamw.h"
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

// ---- the reference, written out: SplitMix64 over (seed, update, tensor, element), then add-and-truncate ----

uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t draw(uint64_t seed, uint64_t update, uint64_t tensor, uint64_t element) {
  const uint64_t gamma = 0x9E3779B97F4A7C15ull;
  const uint64_t key = mix(mix(seed + gamma) + (tensor + 1) * gamma);
  const uint64_t stream = mix(key ^ mix(update + gamma));
  return mix(stream + (element + 1) * gamma);
}

float as_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// x's bf16 neighbour toward zero, plus one ulp (away from zero) when the 16 random bits and x's 16 dropped
// bits carry into the bf16 mantissa: probability (dropped bits) / 2^16.
uint16_t stochastic_bf16(float x, uint32_t random) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if (std::isnan(x)) return 0x7FFF;
  const uint32_t toward_zero = u >> 16, dropped = u & 0xFFFFu;
  return uint16_t(toward_zero + ((random & 0xFFFFu) + dropped >= 0x10000u ? 1 : 0));
}

float bf16_value(uint16_t b) { return as_float(uint32_t(b) << 16); }

AdamWStep step_at(uint32_t t) {
  AdamWStep s;
  s.lr = 1e-2f;
  s.beta1 = 0.9f;
  s.beta2 = 0.95f;
  s.eps = 1e-8f;
  s.weight_decay = 0.1f;
  s.grad_scale = 0.75f;
  s.bias_correction1 = float(1 - std::pow(0.9, t));
  s.bias_correction2 = float(1 - std::pow(0.95, t));
  s.update = t;
  return s;
}

// One tensor's buffers for the GPU tests: f32 weights and gradient, moments of `moments`, an optional copy;
// each an allocation of offset + n elements whose last n are the tensor (offset 1: 2 or 4 bytes past the
// 16-byte boundary the vector path needs, so the kernel takes its one-element path).
struct Buffers {
  Tensor p, g, m, v, copy;
  int64_t offset = 0, n = 0;
  DType moments = DType::f32;

  static Buffers random(Rng& rng, int64_t n, int64_t offset, DType moments, bool with_copy, DType copy_dtype) {
    const int64_t a = n + offset;
    return {random_tensor(rng, {a}),
            random_tensor(rng, {a}, DType::f32, Device::cpu(), -3, 3),
            random_tensor(rng, {a}, moments, Device::cpu(), -0.1, 0.1),
            random_tensor(rng, {a}, moments, Device::cpu(), 0, 0.1),
            with_copy ? Tensor::zeros({a}, copy_dtype) : Tensor(),
            offset,
            n,
            moments};
  }
  Buffers to(Device dev) const {
    auto copy_of = [&](const Tensor& t) { return t.defined() ? t.to(dev).clone() : Tensor(); };
    return {copy_of(p), copy_of(g), copy_of(m), copy_of(v), copy_of(copy), offset, n, moments};
  }
  void* at(const Tensor& t) const { return static_cast<char*>(t.raw_data()) + offset * int64_t(dtype_size(t.dtype())); }
  Tensor view(const Tensor& t) const { return t.slice(0, offset, offset + n).to(Device::cpu()); }
  AdamWTensor table(const AdamWStep& s, MomentRounding r) const {
    AdamWTensor t;
    t.param = static_cast<float*>(at(p));
    t.grad = static_cast<const float*>(at(g));
    t.exp_avg = at(m);
    t.exp_avg_sq = at(v);
    t.n = n;
    t.step = s;
    t.moment_dtype = moments;
    t.rounding = r;
    if (copy.defined()) t.copy = {at(copy), copy.dtype()};
    return t;
  }
};

::testing::AssertionResult same_bits(const Buffers& got, const Buffers& want) {
  for (const auto& [name, a, b] : {std::tuple{"weights", got.p, want.p},
                                   {"exp_avg", got.m, want.m},
                                   {"exp_avg_sq", got.v, want.v},
                                   {"copy", got.copy, want.copy}}) {
    if (!a.defined()) continue;
    if (::testing::AssertionResult r = bit_equal(got.view(a), want.view(b)); !r) return r << " (" << name << ")";
  }
  return ::testing::AssertionSuccess();
}

std::vector<uint16_t> bits16(const Tensor& t) {
  std::vector<uint16_t> out(size_t(t.numel()));
  const Tensor host = t.to(Device::cpu()).contiguous();
  if (!out.empty()) std::memcpy(out.data(), host.raw_data(), out.size() * 2);
  return out;
}

}  // namespace

// Three updates of a tensor's range [first, first + n) of a parameter: each element is the f32 formula on the
// stored bf16 moments (exact in f32), the moments rounded stochastically from the hash of (seed, t, tensor,
// first + element), the weights and their bf16 copy as the f32 update gives them.
TEST(Bf16Moments, UpdateIsTheF32MathThenStochasticRounding) {
  Rng rng(test_seed());
  const uint64_t seed = 1234, tensor = 5;
  for (int64_t first : {0, 37}) {
    const int64_t n = 1000;
    SCOPED_TRACE("first element " + std::to_string(first));
    std::vector<float> p = random_tensor(rng, {n}).to_floats(), want_p = p;
    Tensor m = random_tensor(rng, {n}, DType::bf16, Device::cpu(), -0.1, 0.1);
    Tensor v = random_tensor(rng, {n}, DType::bf16, Device::cpu(), 0, 0.1);
    std::vector<uint16_t> want_m = bits16(m), want_v = bits16(v);
    Tensor copy = Tensor::zeros({n}, DType::bf16);
    for (uint32_t t = 1; t <= 3; ++t) {
      const std::vector<float> g = random_tensor(rng, {n}, DType::f32, Device::cpu(), -3, 3).to_floats();
      const AdamWStep s = step_at(t);
      adamw_cpu(p.data(), g.data(), m.raw_data(), v.raw_data(), n, s, {copy.raw_data(), DType::bf16}, DType::bf16,
                {rounding_key(seed, tensor), first});
      for (int64_t i = 0; i < n; ++i) {
        const size_t k = size_t(i);
        const float gi = s.grad_scale * g[k];
        const float mi = s.beta1 * bf16_value(want_m[k]) + (1.0f - s.beta1) * gi;
        const float vi = s.beta2 * bf16_value(want_v[k]) + (1.0f - s.beta2) * gi * gi;
        const float update = (mi / s.bias_correction1) / (std::sqrt(vi / s.bias_correction2) + s.eps);
        want_p[k] -= s.lr * (update + s.weight_decay * want_p[k]);
        const uint64_t r = draw(seed, t, tensor, uint64_t(first + i));
        want_m[k] = stochastic_bf16(mi, uint32_t(r));
        want_v[k] = stochastic_bf16(vi, uint32_t(r >> 32));
      }
      ASSERT_EQ(std::memcmp(p.data(), want_p.data(), p.size() * 4), 0) << "weights, update " << t;
      ASSERT_EQ(bits16(m), want_m) << "exp_avg, update " << t;
      ASSERT_EQ(bits16(v), want_v) << "exp_avg_sq, update " << t;
      ASSERT_TRUE(bit_equal(copy, Tensor::from_floats(p, {n}).to(DType::bf16)));
    }
  }
}

// Between two bf16 neighbours a fraction f apart from the one toward zero, 2^16 roundings (elements of one
// stream) average to the value within 5 standard deviations of the mean of f's Bernoulli draws, where
// round-to-nearest would be min(f, 1 - f) ulps off; the same inputs give the same bits; exact bf16 values, infs
// and NaN stay as they are.
TEST(Bf16Moments, StochasticRoundingIsUnbiasedAndDeterministic) {
  const int64_t n = 1 << 16;
  const uint64_t stream = rounding_stream(rounding_key(7, 3), 11);
  for (float base : {1.0f, -3.0f, 0.0625f, 1e-30f}) {
    for (double f : {0.1, 0.3, 0.5, 0.9}) {
      uint32_t u;
      std::memcpy(&u, &base, sizeof u);
      const float lower = as_float(u & 0xFFFF0000u), upper = as_float((u & 0xFFFF0000u) + 0x10000u);
      const float x = float(double(lower) + f * (double(upper) - double(lower)));
      double sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t r = uint32_t(rounding_bits(stream, uint64_t(i)));
        const uint16_t b = bf16_bits_stochastic(x, r);
        ASSERT_EQ(b, bf16_bits_stochastic(x, r));
        ASSERT_EQ(b, stochastic_bf16(x, r));
        sum += double(bf16_value(b));
      }
      const double gap = std::fabs(double(upper) - double(lower)), sigma = gap * std::sqrt(f * (1 - f) / double(n));
      EXPECT_NEAR(sum / double(n), double(x), 5 * sigma) << "x = " << x << " (" << f << " of the way up)";
    }
  }
  for (float exact : {0.0f, -0.0f, 1.0f, -2.5f, INFINITY, -INFINITY}) {
    uint32_t u;
    std::memcpy(&u, &exact, sizeof u);
    for (uint32_t r : {0u, 0x8000u, 0xFFFFu, 0xFFFFFFFFu}) EXPECT_EQ(bf16_bits_stochastic(exact, r), u >> 16) << exact;
  }
  EXPECT_EQ(bf16_bits_stochastic(NAN, 0xFFFFu), 0x7FFF);
}

// Halfway between two neighbours, the roundings of 4096 elements differ from element to element and between
// two updates, two tensors and two seeds (each time about half of them; more than a quarter here); the AdamW
// update itself rounds its moments differently at another update count.
TEST(Bf16Moments, StepsTensorsAndElementsDrawDifferentRoundings) {
  const int64_t n = 4096;
  const float x = as_float(0x3F808000u);  // halfway between bf16 1.0 and 1.0078125
  auto pattern = [&](uint64_t seed, uint64_t update, uint64_t tensor) {
    std::vector<uint16_t> out;
    const uint64_t stream = rounding_stream(rounding_key(seed, tensor), update);
    for (int64_t i = 0; i < n; ++i)
      out.push_back(bf16_bits_stochastic(x, uint32_t(rounding_bits(stream, uint64_t(i)))));
    return out;
  };
  const std::vector<uint16_t> base = pattern(1, 1, 0);
  int64_t ups = 0;
  for (uint16_t b : base) ups += b == 0x3F81;
  EXPECT_GT(ups, n / 4);
  EXPECT_LT(ups, 3 * n / 4);
  for (const auto& [what, other] :
       {std::pair{"update", pattern(1, 2, 0)}, {"tensor", pattern(1, 1, 1)}, {"seed", pattern(2, 1, 0)}}) {
    int64_t differ = 0;
    for (int64_t i = 0; i < n; ++i) differ += base[size_t(i)] != other[size_t(i)];
    EXPECT_GT(differ, n / 4) << "another " << what << " rounds " << differ << " of " << n << " elements otherwise";
  }
  std::vector<float> g(size_t(n), 1.0f), p0(size_t(n), 0.0f);
  std::vector<uint16_t> v_after[2];
  for (uint32_t t : {1u, 2u}) {
    std::vector<float> p = p0;
    Tensor m = Tensor::zeros({n}, DType::bf16), v = Tensor::full({n}, 1.0, DType::bf16);
    adamw_cpu(p.data(), g.data(), m.raw_data(), v.raw_data(), n, step_at(t), {}, DType::bf16, {rounding_key(1, 0), 0});
    v_after[t - 1] = bits16(v);
  }
  EXPECT_NE(v_after[0], v_after[1]);
}

// The reason for stochastic rounding. v = 1 and g^2 = 1.003 at beta2 = 0.95: v's relative change per step,
// 0.05 * 0.003 = 1.5e-4, is far under bf16's half ulp (2^-9), so round-to-nearest gives v = 1 back at every
// step; stochastically rounded v's mean over 4096 elements reaches g^2 (0.95^200: converged) within 5e-4,
// where the elements' spread is 6e-5 of it.
TEST(Bf16Moments, SecondMomentTracksTheGradientWhereRoundToNearestFreezesIt) {
  const int64_t n = 4096;
  const float grad = std::sqrt(1.003f);
  std::vector<float> p(size_t(n), 0.0f), g(size_t(n), grad);
  Tensor m = Tensor::full({n}, double(grad), DType::bf16), v = Tensor::full({n}, 1.0, DType::bf16);
  float nearest = 1.0f;  // the same update with round-to-nearest, one element (all are alike)
  AdamWStep s = step_at(1);
  s.lr = 0;
  s.grad_scale = 1;
  for (uint32_t t = 1; t <= 200; ++t) {
    s.update = t;
    adamw_cpu(p.data(), g.data(), m.raw_data(), v.raw_data(), n, s, {}, DType::bf16, {rounding_key(3, 0), 0});
    nearest = bf16_value(f32_to_bf16_bits(s.beta2 * nearest + (1.0f - s.beta2) * grad * grad));
  }
  EXPECT_EQ(nearest, 1.0f) << "round-to-nearest moved v after all";
  double mean = 0;
  for (float x : v.to_floats()) mean += double(x) / double(n);
  EXPECT_NEAR(mean, double(grad) * double(grad), 5e-4);
}

// The multi-tensor call on the CPU: tensors of both moment dtypes, their own ranges' first elements and
// steps, with and without copies, equal one call per tensor bit for bit.
TEST(Bf16Moments, MultiTensorIsEachTensorAloneOnTheCpu) {
  Rng rng(test_seed());
  struct Buffers {
    Tensor p, g, m, v, copy;
  };
  std::vector<Buffers> all, each;
  std::vector<AdamWTensor> tables;
  for (int i = 0; i < 11; ++i) {
    const int64_t n = (i * 97) % 301;
    const DType moments = i % 3 == 0 ? DType::f32 : DType::bf16;
    Buffers b{random_tensor(rng, {n}), random_tensor(rng, {n}, DType::f32, Device::cpu(), -3, 3),
              random_tensor(rng, {n}, moments, Device::cpu(), -0.1, 0.1),
              random_tensor(rng, {n}, moments, Device::cpu(), 0, 0.1),
              i % 2 ? Tensor::zeros({n}, DType::bf16) : Tensor()};
    all.push_back({b.p.clone(), b.g, b.m.clone(), b.v.clone(), b.copy.defined() ? b.copy.clone() : Tensor()});
    each.push_back(b);
    AdamWTensor t;
    t.param = all.back().p.data<float>();
    t.grad = b.g.data<float>();
    t.exp_avg = all.back().m.raw_data();
    t.exp_avg_sq = all.back().v.raw_data();
    t.n = n;
    t.step = step_at(uint32_t(1 + i % 4));
    t.moment_dtype = moments;
    t.rounding = {rounding_key(9, uint64_t(i)), int64_t(i) * 13};
    if (b.copy.defined()) t.copy = {all.back().copy.raw_data(), DType::bf16};
    tables.push_back(t);
  }
  adamw_multi_cpu(tables.data(), int64_t(tables.size()));
  for (size_t i = 0; i < each.size(); ++i) {
    Buffers& b = each[i];
    const AdamWTensor& t = tables[i];
    adamw_cpu(b.p.data<float>(), b.g.data<float>(), b.m.raw_data(), b.v.raw_data(), t.n, t.step,
              b.copy.defined() ? WeightCopy{b.copy.raw_data(), DType::bf16} : WeightCopy{}, t.moment_dtype, t.rounding);
    SCOPED_TRACE("tensor " + std::to_string(i));
    EXPECT_TRUE(bit_equal(all[i].p, b.p));
    EXPECT_TRUE(bit_equal(all[i].m, b.m));
    EXPECT_TRUE(bit_equal(all[i].v, b.v));
    if (b.copy.defined()) {
      EXPECT_TRUE(bit_equal(all[i].copy, b.copy));
    }
  }
}

// One tensor on the GPU against the CPU reference, bit for bit: sizes around the 8-element vector step, the
// 16-byte path and the one-element path (offset 1), both moment dtypes, no copy, an f32 and a bf16 copy; the
// steps given by value, then with the step's scalars read on the device (whose update count seeds the rounding).
TEST(Bf16MomentsCuda, OneTensorMatchesTheCpuBitForBit) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  int c = 0;
  for (int64_t n : {0, 1, 7, 8, 9, 255, 4097, (1 << 20) + 3})
    for (int64_t offset : {0, 1})
      for (DType moments : {DType::bf16, DType::f32})
        for (int copy = 0; copy < 3; ++copy, ++c) {
          SCOPED_TRACE(std::to_string(n) + " elements at offset " + std::to_string(offset) + ", " +
                       dtype_name(moments) + " moments, copy " + std::to_string(copy));
          const Buffers init = Buffers::random(rng, n, offset, moments, copy > 0, copy == 1 ? DType::f32 : DType::bf16);
          Buffers cpu = init.to(Device::cpu()), gpu = init.to(Device::cuda());
          const MomentRounding r{rounding_key(uint64_t(c), uint64_t(c % 5)), int64_t(c) * 3};
          for (uint32_t t = 1; t <= 2; ++t) {
            const AdamWTensor a = cpu.table(step_at(t), r), b = gpu.table(step_at(t), r);
            adamw_cpu(a.param, a.grad, a.exp_avg, a.exp_avg_sq, n, a.step, a.copy, moments, r);
            adamw_cuda(b.param, b.grad, b.exp_avg, b.exp_avg_sq, n, b.step, current_stream(0), b.copy, moments, r);
          }
          ASSERT_TRUE(same_bits(gpu, cpu));
          StepScalars sc{};
          sc.apply = 1;
          sc.num_updates = 3;
          sc.lr = 2e-3;
          sc.grad_scale = 0.5;
          sc.bias_correction1 = float(1 - std::pow(0.9, 3));
          sc.bias_correction2 = float(1 - std::pow(0.95, 3));
          Tensor control = Tensor::zeros({int64_t(sizeof sc)}, DType::u8);
          std::memcpy(control.raw_data(), &sc, sizeof sc);
          control = control.to(Device::cuda());
          const AdamWTensor a = cpu.table(step_at(1), r), b = gpu.table(step_at(1), r);
          adamw_cpu(a.param, a.grad, a.exp_avg, a.exp_avg_sq, n, scheduled_adamw_step(a.step, sc, 0.5), a.copy, moments,
                    r);
          adamw_scheduled_cuda(b.param, b.grad, b.exp_avg, b.exp_avg_sq, n, b.step,
                               static_cast<const StepScalars*>(control.raw_data()), 0.5, current_stream(0), b.copy,
                               moments, r);
          ASSERT_TRUE(same_bits(gpu, cpu)) << "with the step's scalars";
        }
}

// More tensors than two launches take, of both moment dtypes, on and off the 16-byte path, with their own
// ranges' first elements, steps and copies: one multi-tensor call equals each tensor's own launch and the CPU,
// bit for bit.
TEST(Bf16MomentsCuda, MultiTensorMatchesOneTensorAndTheCpuBitForBit) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  std::vector<Buffers> init;
  std::vector<MomentRounding> rounding;
  for (int i = 0; i < 2 * kTensorsPerLaunch + 5; ++i) {
    const int64_t sizes[] = {0, 1, 8, 255, 4097, (1 << 16) + 3, 31};
    init.push_back(Buffers::random(rng, sizes[i % 7], (i / 7) % 2, i % 3 ? DType::bf16 : DType::f32, i % 4 != 0,
                                   i % 2 ? DType::bf16 : DType::f32));
    rounding.push_back({rounding_key(42, uint64_t(i)), int64_t(i % 4) * 1000});
  }
  std::vector<Buffers> all, cpu;
  std::vector<AdamWTensor> gpu_tables, cpu_tables;
  for (size_t i = 0; i < init.size(); ++i) {
    all.push_back(init[i].to(Device::cuda()));
    cpu.push_back(init[i].to(Device::cpu()));
    gpu_tables.push_back(all.back().table(step_at(uint32_t(1 + i % 3)), rounding[i]));
    cpu_tables.push_back(cpu.back().table(step_at(uint32_t(1 + i % 3)), rounding[i]));
  }
  adamw_multi_cuda(gpu_tables.data(), int64_t(gpu_tables.size()), nullptr, current_stream(0));
  adamw_multi_cpu(cpu_tables.data(), int64_t(cpu_tables.size()));
  for (size_t i = 0; i < init.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i) + " of " + std::to_string(init[i].n));
    Buffers alone = init[i].to(Device::cuda());
    const AdamWTensor t = alone.table(step_at(uint32_t(1 + i % 3)), rounding[i]);
    adamw_multi_cuda(&t, 1, nullptr, current_stream(0));
    EXPECT_TRUE(same_bits(all[i], alone)) << "multi against one";
    EXPECT_TRUE(same_bits(all[i], cpu[i])) << "GPU against CPU";
  }
}
