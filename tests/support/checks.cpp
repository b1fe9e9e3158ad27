#include "tests/support/checks.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>

namespace flowmoe::test {

uint64_t test_seed() {
  static uint64_t seed = [] {
    const char* env = std::getenv("FLOWMOE_TEST_SEED");
    uint64_t s =
        env ? std::strtoull(env, nullptr, 10) : (uint64_t(std::random_device{}()) << 32 | std::random_device{}());
    std::printf("[flowmoe] test seed %llu (set FLOWMOE_TEST_SEED to replay)\n", (unsigned long long)s);
    return s;
  }();
  return seed;
}

FuzzPlan fuzz_plan(uint64_t default_seed, int64_t default_cases) {
  const char* cases = std::getenv("FLOWMOE_FUZZ_CASES");
  FuzzPlan plan{std::getenv("FLOWMOE_TEST_SEED") ? test_seed() : default_seed, default_cases};
  if (cases && std::atoll(cases) > 0) plan.num_cases = std::atoll(cases);
  std::printf("[fuzz] %lld cases from seed %llu (FLOWMOE_FUZZ_CASES, FLOWMOE_TEST_SEED)\n",
              static_cast<long long>(plan.num_cases), static_cast<unsigned long long>(plan.seed));
  return plan;
}

Tensor random_tensor(Rng& rng, const Shape& shape, DType dtype, Device device, double lo, double hi) {
  return rng.uniform(shape, lo, hi, dtype, device);
}

::testing::AssertionResult all_close(const Tensor& got, const Tensor& ref, double rtol, double atol) {
  if (got.shape() != ref.shape())
    return ::testing::AssertionFailure() << "shape " << shape_str(got.shape()) << " vs " << shape_str(ref.shape());
  std::vector<double> g = got.to_doubles(), r = ref.to_doubles();
  for (size_t i = 0; i < g.size(); ++i) {
    bool both_nan = std::isnan(g[i]) && std::isnan(r[i]);
    if (both_nan) continue;
    if (!(std::fabs(g[i] - r[i]) <= atol + rtol * std::fabs(r[i])))
      return ::testing::AssertionFailure() << "element " << i << " of " << g.size() << ": got " << g[i] << ", want "
                                           << r[i] << " (rtol " << rtol << ", atol " << atol << ")";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult bit_equal(const Tensor& got, const Tensor& ref) {
  if (got.shape() != ref.shape() || got.dtype() != ref.dtype())
    return ::testing::AssertionFailure() << got.describe() << " vs " << ref.describe();
  Tensor a = got.to(Device::cpu()).contiguous(), b = ref.to(Device::cpu()).contiguous();
  size_t es = dtype_size(a.dtype());
  auto* pa = static_cast<const unsigned char*>(a.raw_data());
  auto* pb = static_cast<const unsigned char*>(b.raw_data());
  for (int64_t i = 0; i < a.numel(); ++i)
    if (std::memcmp(pa + i * es, pb + i * es, es) != 0) {
      return ::testing::AssertionFailure() << "element " << i << " of " << a.numel() << " differs: got "
                                           << a.to_doubles()[size_t(i)] << ", want " << b.to_doubles()[size_t(i)];
    }
  return ::testing::AssertionSuccess();
}

double rel_error(const Tensor& got, const Tensor& ref) {
  std::vector<double> g = got.to_doubles(), r = ref.to_doubles();
  double num = 0, den = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    num += (g[i] - r[i]) * (g[i] - r[i]);
    den += r[i] * r[i];
  }
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return std::sqrt(num / den);
}

// L(inputs) = sum(fn(inputs) * R) for a fixed random R; dL/dx by backward vs central differences.
::testing::AssertionResult gradcheck(const GradFn& fn, const std::vector<Tensor>& inputs, double eps, double tol,
                                     std::vector<int> wrt) {
  if (wrt.empty())
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].defined() && is_floating(inputs[i].dtype())) wrt.push_back(int(i));
  std::vector<Variable> vars;
  for (size_t i = 0; i < inputs.size(); ++i) {
    bool want = std::find(wrt.begin(), wrt.end(), int(i)) != wrt.end();
    if (want && inputs[i].dtype() != DType::f64)
      return ::testing::AssertionFailure() << "gradcheck input " << i << " must be f64, is " << inputs[i].describe();
    vars.push_back(Variable(inputs[i].clone(), want));
  }
  Variable out = fn(vars);
  Rng rng(12345);
  Tensor proj = rng.uniform(out.shape(), -1, 1, out.dtype());
  auto loss_of = [&](const std::vector<Variable>& vs) {
    NoGradGuard ng;
    std::vector<double> o = fn(vs).data().to_doubles(), p = proj.to_doubles();
    double s = 0;
    for (size_t i = 0; i < o.size(); ++i) s += o[i] * p[i];
    return s;
  };
  out.backward(proj);
  for (int idx : wrt) {
    Tensor x = vars[size_t(idx)].data();
    std::vector<double> analytic = vars[size_t(idx)].grad().defined() ? vars[size_t(idx)].grad().to_doubles()
                                                                      : std::vector<double>(size_t(x.numel()), 0.0);
    auto* px = x.data<double>();
    for (int64_t j = 0; j < x.numel(); ++j) {
      double orig = px[j];
      px[j] = orig + eps;
      double lp = loss_of(vars);
      px[j] = orig - eps;
      double lm = loss_of(vars);
      px[j] = orig;
      double numeric = (lp - lm) / (2 * eps);
      double a = analytic[size_t(j)];
      if (std::fabs(a - numeric) > tol * (1.0 + std::fabs(numeric)))
        return ::testing::AssertionFailure() << "input " << idx << " element " << j << ": analytic " << a
                                             << " vs numeric " << numeric << " (tol " << tol << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

Tensor random_topk(std::mt19937_64& gen, int64_t num_tokens, int top_k, int num_experts, std::vector<int> allowed) {
  if (allowed.empty()) {
    allowed.resize(size_t(num_experts));
    std::iota(allowed.begin(), allowed.end(), 0);
  }
  std::vector<int64_t> idx;
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::vector<int> pool = allowed;
    for (int j = 0; j < top_k; ++j) {  // partial Fisher-Yates: distinct experts per token
      std::uniform_int_distribution<size_t> pick(size_t(j), pool.size() - 1);
      std::swap(pool[size_t(j)], pool[pick(gen)]);
      idx.push_back(pool[size_t(j)]);
    }
  }
  return Tensor::from_ints(idx, {num_tokens, top_k});
}

Variable times_probs(const Variable& rows, const Variable& probs) {
  Variable ones(Tensor::full({1, rows.size(1)}, 1.0, rows.dtype(), rows.device()));
  return mul(rows, matmul(reshape(probs, {-1, 1}), ones));
}

}  // namespace flowmoe::test
