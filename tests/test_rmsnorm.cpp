// rmsnorm: gradient check of the CPU reference, known values, errors, and CUDA vs CPU (f32, bf16)
// forward and backward over edge shapes, with error bounds scaled by the terms each output sums.
#include <cmath>

#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

constexpr double kEps = 1e-6;  // DeepSeek-V3's rms_norm_eps

struct NormResult {
  Tensor y, d_x, d_w;  // on the CPU
};

NormResult run_rmsnorm(const Tensor& x, const Tensor& w, const Tensor& d_y, Device device) {
  Variable xv(x.to(device), true), wv(w.to(device), true);
  Variable y = rmsnorm(xv, wv, kEps);
  y.backward(d_y.to(device));
  return {y.data().to(Device::cpu()), xv.grad().to(Device::cpu()), wv.grad().to(Device::cpu())};
}

// Per output, the size of the terms it is built from (in double). d_x = r dy w - x r^3 g / H and
// d_w = sum_rows dy x r can cancel to near zero, so their rounding error is bounded by these sums,
// not by the result.
struct TermScales {
  std::vector<double> y, d_x, d_w;
};
TermScales term_scales(const Tensor& x, const Tensor& w, const Tensor& d_y) {
  std::vector<double> xs = x.to_doubles(), ws = w.to_doubles(), dys = d_y.to_doubles();
  size_t H = ws.size(), rows = H ? xs.size() / H : 0;
  TermScales s{std::vector<double>(xs.size()), std::vector<double>(xs.size()), std::vector<double>(H, 0.0)};
  for (size_t r = 0; r < rows; ++r) {
    double sum_sq = 0, g_abs = 0;
    for (size_t j = 0; j < H; ++j) {
      size_t i = r * H + j;
      sum_sq += xs[i] * xs[i];
      g_abs += std::fabs(dys[i] * ws[j] * xs[i]);
    }
    double rstd = 1.0 / std::sqrt(sum_sq / double(H) + kEps);
    for (size_t j = 0; j < H; ++j) {
      size_t i = r * H + j;
      s.y[i] = std::fabs(xs[i] * ws[j]) * rstd;
      s.d_x[i] = std::fabs(dys[i] * ws[j]) * rstd + std::fabs(xs[i]) * rstd * rstd * rstd * g_abs / double(H);
      s.d_w[j] += std::fabs(dys[i] * xs[i]) * rstd;
    }
  }
  return s;
}

// |got - ref| <= k * scale + rtol * |ref| elementwise; names the first element that is not.
::testing::AssertionResult within(const Tensor& got, const Tensor& ref, const std::vector<double>& scale, double k,
                                  double rtol) {
  if (got.shape() != ref.shape())
    return ::testing::AssertionFailure() << "shape " << shape_str(got.shape()) << " vs " << shape_str(ref.shape());
  std::vector<double> g = got.to_doubles(), r = ref.to_doubles();
  for (size_t i = 0; i < g.size(); ++i) {
    double bound = k * scale[i] + rtol * std::fabs(r[i]);
    if (!(std::fabs(g[i] - r[i]) <= bound))
      return ::testing::AssertionFailure() << "element " << i << " of " << g.size() << ": got " << g[i] << ", want "
                                           << r[i] << " (bound " << bound << ", term scale " << scale[i] << ")";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace

TEST(Rmsnorm, Gradcheck) {
  Rng rng(test_seed());
  auto fn = [](const std::vector<Variable>& v) { return rmsnorm(v[0], v[1], 1e-5); };
  Tensor x = random_tensor(rng, {3, 7}, DType::f64), w = random_tensor(rng, {7}, DType::f64, Device::cpu(), 0.5, 1.5);
  EXPECT_TRUE(gradcheck(fn, {x, w}));
  Tensor x3 = random_tensor(rng, {2, 2, 5}, DType::f64), w3 = random_tensor(rng, {5}, DType::f64);
  EXPECT_TRUE(gradcheck(fn, {x3, w3}));
}

TEST(Rmsnorm, KnownValues) {
  // mean(x^2) = 12.5 for x = [3, 4]
  Tensor x = Tensor::from_doubles({3, 4}, {1, 2}), w = Tensor::from_doubles({1, 2}, {2});
  std::vector<double> y = rmsnorm(Variable(x), Variable(w), 0.0).data().to_doubles();
  EXPECT_NEAR(y[0], 3 / std::sqrt(12.5), 1e-15);
  EXPECT_NEAR(y[1], 8 / std::sqrt(12.5), 1e-15);
}

TEST(Rmsnorm, NoRows) {
  Variable x(Tensor::zeros({0, 4}, DType::f32), true), w(Tensor::full({4}, 1.0, DType::f32), true);
  Variable y = rmsnorm(x, w, kEps);
  EXPECT_EQ(y.shape(), (Shape{0, 4}));
  y.backward(Tensor::zeros({0, 4}, DType::f32));
  EXPECT_TRUE(bit_equal(w.grad(), Tensor::zeros({4}, DType::f32)));
}

TEST(Rmsnorm, Errors) {
  auto expect_names_both = [](auto&& call, const char* a, const char* b) {
    try {
      call();
      ADD_FAILURE() << "expected a throw naming " << a << " and " << b;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(a), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(b), std::string::npos) << e.what();
    }
  };
  Variable x(Tensor::zeros({2, 4}, DType::f32)), w5(Tensor::zeros({5}, DType::f32)),
      w14(Tensor::zeros({1, 4}, DType::f32)), w64(Tensor::zeros({4}, DType::f64));
  EXPECT_THROW(rmsnorm(x, w5, kEps), ShapeError);
  expect_names_both([&] { rmsnorm(x, w5, kEps); }, "f32[5]", "f32[2, 4]");
  expect_names_both([&] { rmsnorm(x, w14, kEps); }, "f32[1, 4]", "f32[2, 4]");
  EXPECT_THROW(rmsnorm(x, w64, kEps), DTypeError);
  expect_names_both([&] { rmsnorm(x, w64, kEps); }, "f32", "f64");
  EXPECT_THROW(rmsnorm(Variable(Tensor::zeros({}, DType::f32)), Variable(Tensor::zeros({1}, DType::f32)), kEps),
               ShapeError);
  EXPECT_THROW(rmsnorm(x, Variable(Tensor::zeros({4}, DType::f32)), -1.0), Error);
  EXPECT_THROW(rmsnorm(Variable(Tensor::zeros({2, 4}, DType::bf16)), Variable(Tensor::zeros({4}, DType::bf16)), kEps),
               DTypeError);  // bf16 is GPU-only
}

// Tolerances. f32: |got - ref| <= 1e-5 * (sum of |terms|) per element. The GPU's fp32 error is a
// few ulp of the terms for y and d_x (rsqrtf <= 2 ulp, row sums as trees) and, for d_weight, at most
// ~60 roundings of the column's partial sums (rows / 512 per block, then 16 + 32 in the second
// pass): ~60 * 6e-8 = 3.6e-6 of the terms. The CPU reference sums in double.
// bf16: the same plus one bf16 ulp (<= 2^-7 relative) for the two sides' final roundings.
TEST(RmsnormCuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  struct Case {
    int64_t rows, hidden;
  };
  for (Case c : {Case{0, 64}, Case{1, 1}, Case{3, 7}, Case{5, 129}, Case{7, 1000}, Case{2, 16384}, Case{600, 33},
                 Case{4096, 2048}}) {
    SCOPED_TRACE(::testing::Message() << "rows " << c.rows << " hidden " << c.hidden);
    Tensor x = random_tensor(rng, {c.rows, c.hidden}), d_y = random_tensor(rng, {c.rows, c.hidden});
    Tensor w = random_tensor(rng, {c.hidden}, DType::f32, Device::cpu(), 0.5, 1.5);
    NormResult ref = run_rmsnorm(x, w, d_y, Device::cpu());
    NormResult got = run_rmsnorm(x, w, d_y, Device::cuda());
    TermScales s = term_scales(x, w, d_y);
    EXPECT_TRUE(within(got.y, ref.y, s.y, 1e-5, 0));
    EXPECT_TRUE(within(got.d_x, ref.d_x, s.d_x, 1e-5, 0));
    EXPECT_TRUE(within(got.d_w, ref.d_w, s.d_w, 1e-5, 0));

    Tensor xb = x.to(DType::bf16), wb = w.to(DType::bf16), d_yb = d_y.to(DType::bf16);
    NormResult ref_b = run_rmsnorm(xb.to(DType::f32), wb.to(DType::f32), d_yb.to(DType::f32), Device::cpu());
    NormResult got_b = run_rmsnorm(xb, wb, d_yb, Device::cuda());
    TermScales sb = term_scales(xb, wb, d_yb);
    EXPECT_EQ(got_b.y.dtype(), DType::bf16);
    EXPECT_EQ(got_b.d_w.dtype(), DType::bf16);
    EXPECT_TRUE(within(got_b.y, ref_b.y.to(DType::bf16), sb.y, 1e-5, 8e-3));
    EXPECT_TRUE(within(got_b.d_x, ref_b.d_x.to(DType::bf16), sb.d_x, 1e-5, 8e-3));
    EXPECT_TRUE(within(got_b.d_w, ref_b.d_w.to(DType::bf16), sb.d_w, 1e-5, 8e-3));
  }
}

// d_weight is summed in a fixed order on the GPU: two runs give the same bits.
TEST(RmsnormCuda, Deterministic) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  Tensor x = random_tensor(rng, {3000, 777}), d_y = random_tensor(rng, {3000, 777}), w = random_tensor(rng, {777});
  NormResult a = run_rmsnorm(x, w, d_y, Device::cuda()), b = run_rmsnorm(x, w, d_y, Device::cuda());
  EXPECT_TRUE(bit_equal(a.d_w, b.d_w));
  EXPECT_TRUE(bit_equal(a.d_x, b.d_x));
}

TEST(RmsnormCuda, Errors) {
  FLOWMOE_REQUIRE_CUDA();
  Variable x(Tensor::zeros({2, 4}, DType::f32, Device::cuda()));
  EXPECT_THROW(rmsnorm(x, Variable(Tensor::zeros({5}, DType::f32, Device::cuda())), kEps), ShapeError);
  EXPECT_THROW(rmsnorm(x, Variable(Tensor::zeros({4}, DType::bf16, Device::cuda())), kEps), DTypeError);
  EXPECT_THROW(rmsnorm(x, Variable(Tensor::zeros({4}, DType::f32)), kEps), DeviceError);  // weight on the CPU
  EXPECT_THROW(rmsnorm(Variable(Tensor::zeros({2, 4}, DType::f64, Device::cuda())),
                       Variable(Tensor::zeros({4}, DType::f64, Device::cuda())), kEps),
               DTypeError);
}
