// fp8_linear (engine/ops/fp8_linear.h): a dense FP8 linear, fp8_grouped_linear with one group.
//
// Inputs: x and dy of values u·2^(a_i + b_j) (tests/support/fp8_operands.h: neighbouring blocks get different
// power-of-two scales), x with edge rows (zero, one outlier that pushes the rest of its block into e4m3's
// subnormals, tiny and huge magnitudes), weights N(0, 0.05²); row counts with a partial last 128-row block and 0.
//
// 1. Against the FP8 products of its own operands, on the CPU: y = x̂·Ŵᵀ, dx = d̂y·Ŵ, dW = d̂yᶜᵒˡᵀ·x̂ᶜᵒˡ, where x̂,
//    Ŵ are the dequantized FP8 operands, d̂y = dequantize(quantize_rowwise(dy)) and the colwise ones come from
//    the scaling-aware transpose; in f64. The references and the op differ only by f32 accumulation, so the
//    bound is elementwise 2·inner·2^-24·Σ|a||b| + 2^-24·|ref| (inner: the summed dimension).
// 2. Against the exact composition y = x̂·Ŵᵀ in f64, whose analytic gradients dx = dy·Ŵ and dW = dyᵀ·x̂ are
//    first checked by central differences (exact for a bilinear function up to f64 rounding). FP8 is lossy; the
//    bound comes from e4m3's step: a value v quantized in a block of scale_inv s is off by at most
//    2^-4·|v| (half an ulp of 3 mantissa bits while v/s is normal) + 2^-10·s (half the subnormal step 2^-9),
//    and the transpose, which re-expresses v at its 128-row column block's scale S ≥ s, adds at most 2^-10·S
//    (exact while normal). So, with e(v) those per-element bounds, |dx - dy·Ŵ| ≤ Σ e(dy)|Ŵ| and
//    |dW - dyᵀ·x̂| ≤ Σ (e(dy)|x̂| + |dy|e(x̂) + e(dy)e(x̂)), each plus the f32 accumulation term of 1.
// 3. CUDA against the CPU on the same inputs (skipped without a GPU): y and dx bf16, dW f32, no host sync.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/cast_stats.h"
#include "engine/ops/fp8_linear.h"
#include "engine/ops/fp8_transpose.h"
#include "kernels/fp8.h"
#include "tests/support/checks.h"
#include "tests/support/fp8_operands.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

constexpr double kU = 0x1p-24;  // f32's unit roundoff

struct Shape3 {
  int64_t m, k, n;
};

Tensor host_f32(const std::vector<float>& v, int64_t rows, int64_t cols) {
  Tensor t = Tensor::empty({rows, cols}, DType::f32);
  if (!v.empty()) std::memcpy(t.raw_data(), v.data(), v.size() * sizeof(float));
  return t;
}

// x [m, k]: scaled random values; with `edges` (m >= 16) rows 0-3 are zero, one outlier among tiny values,
// all tiny (2^-100), all large (2^40).
Tensor make_x(std::mt19937_64& gen, int64_t m, int64_t k, bool edges) {
  std::vector<float> v = make_values(gen, m, k, m);
  if (edges && m >= 16)
    for (int64_t j = 0; j < k; ++j) {
      v[size_t(j)] = 0.f;
      v[size_t(k + j)] = j == 5 ? 3.0e4f : v[size_t(k + j)] * 1e-3f;
      v[size_t(2 * k + j)] = std::ldexp(v[size_t(2 * k + j)], -100);
      v[size_t(3 * k + j)] = std::ldexp(v[size_t(3 * k + j)], 40);
    }
  return host_f32(v, m, k);
}

// dy with bf16 values (the GPU's gradient dtype), so both devices quantize the same numbers.
Tensor make_dy(std::mt19937_64& gen, int64_t m, int64_t n) {
  return host_f32(make_values(gen, m, n, m), m, n).to(DType::bf16).to(DType::f32);
}

Tensor make_w(uint64_t seed, int64_t n, int64_t k) { return Rng(seed).normal({n, k}, 0.0, 0.05); }

// One forward and backward of fp8_linear on `device`; every result back on the CPU in f32.
struct LinearRun {
  Tensor y, dx, dw;
  CastCounts backward_casts;
  uint64_t host_syncs = 0;
};
// with_transpose false: the weight's copy keeps no transpose, and the backward rebuilds it (weight_transpose).
LinearRun run_fp8_linear(const Tensor& x, const Tensor& w, const Tensor& dy, Device device,
                         bool with_transpose = true) {
  Variable xv(x.to(device), true), wv(w.to(device), true, "test.weight");
  const Variable xq = quantize_rowwise(xv, "test: x");
  const uint64_t syncs = num_host_syncs();
  const Variable y = fp8_linear(xq, wv, quantize_linear_weight(wv.data(), wv.name(), with_transpose), "test");
  reset_cast_counts();
  y.backward(dy.to(device).to(y.dtype()));
  const uint64_t host_syncs = num_host_syncs() - syncs;  // before this test's own reads to the host, which count
  LinearRun r{y.data().to(Device::cpu()).to(DType::f32), xv.grad().to(Device::cpu()).to(DType::f32),
              wv.grad().to(Device::cpu()), cast_counts(), host_syncs};
  return r;
}

// A row-major f64 matrix with its shape.
struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;
  double at(int64_t i, int64_t j) const { return v[size_t(i * cols + j)]; }
};
Mat mat(const Tensor& t) { return {t.size(0), t.size(1), t.to_doubles()}; }
Mat deq(const Tensor& q) { return mat(dequantize_tensor(q, DType::f32, "")); }

// c[i, j] = Σ_p a(i, p)·b(j, p) over p < inner, and the same sum of |a||b| (the accumulation bounds' scale).
template <class A, class B>
void products(int64_t rows, int64_t cols, int64_t inner, A a, B b, Mat& c, Mat& abs_c) {
  c = {rows, cols, std::vector<double>(size_t(rows * cols), 0.0)};
  abs_c = c;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      double s = 0, sa = 0;
      for (int64_t p = 0; p < inner; ++p) {
        const double t = a(i, p) * b(j, p);
        s += t;
        sa += std::fabs(t);
      }
      c.v[size_t(i * cols + j)] = s;
      abs_c.v[size_t(i * cols + j)] = sa;
    }
}

// |got - ref| <= bound elementwise; the failure names the first bad element. Prints the largest got/bound.
::testing::AssertionResult within(const Tensor& got_t, const Mat& ref, const std::vector<double>& bound,
                                  const char* what) {
  const std::vector<double> got = got_t.to_doubles();
  if (got.size() != ref.v.size()) return ::testing::AssertionFailure() << what << ": " << got.size() << " elements";
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - ref.v[i]);
    if (!(err <= bound[i]))
      return ::testing::AssertionFailure() << what << "[" << i / size_t(ref.cols) << ", " << i % size_t(ref.cols)
                                           << "] = " << got[i] << ", reference " << ref.v[i] << ", bound " << bound[i];
    if (bound[i] > 0) worst = std::max(worst, err / bound[i]);
  }
  std::printf("%s: largest error / bound %.3g\n", what, worst);
  return ::testing::AssertionSuccess();
}

// The f32 accumulation term: 2·inner·u·Σ|a||b| + u·|ref|.
std::vector<double> accumulation_bound(const Mat& ref, const Mat& abs_ref, int64_t inner) {
  std::vector<double> b(ref.v.size());
  for (size_t i = 0; i < b.size(); ++i) b[i] = 2.0 * double(inner) * kU * abs_ref.v[i] + kU * std::fabs(ref.v[i]);
  return b;
}

const Shape3 kCpuShapes[] = {{16, 128, 128}, {48, 256, 384}, {272, 384, 256}, {0, 128, 256}};

}  // namespace

TEST(Fp8LinearCpu, MatchesTheFp8ProductsOfItsOperands) {
  std::mt19937_64 gen(test_seed());
  for (const Shape3& s : kCpuShapes) {
    SCOPED_TRACE(::testing::Message() << "M " << s.m << " K " << s.k << " N " << s.n);
    const Tensor x = make_x(gen, s.m, s.k, true), w = make_w(gen(), s.n, s.k), dy = make_dy(gen, s.m, s.n);
    const LinearRun r = run_fp8_linear(x, w, dy, Device::cpu());
    ASSERT_EQ(r.y.shape(), (Shape{s.m, s.n}));
    ASSERT_EQ(r.dw.shape(), (Shape{s.n, s.k}));
    // The backward quantizes dy once, rowwise, at the linear's site; the transposes are no casts.
    EXPECT_EQ(r.backward_casts.quantize, 1);
    EXPECT_EQ(r.backward_casts.dequantize, 0);
    EXPECT_EQ(r.backward_casts.by_site.at("quantize test.dgrad: dy rowwise"), 1);

    const Tensor xq = quantize_rowwise_tensor(x, "ref"), dyq = quantize_rowwise_tensor(dy, "ref");
    const QuantizedWeight wq = quantize_linear_weight(w, "ref");
    const Mat xh = deq(xq), dyh = deq(dyq), wh = mat(dequantize_tensor(wq.q, DType::f32, "").reshape({s.n, s.k}));
    EXPECT_TRUE(bit_equal(dequantize_tensor(wq.q_t, DType::f32, "").reshape({s.k, s.n}),
                          dequantize_tensor(wq.q, DType::f32, "").reshape({s.n, s.k}).transpose(0, 1).contiguous()))
        << "the dgrad weight is the exact transpose";
    const Mat dyc = deq(fp8_transpose(dyq, std::vector<int64_t>{})),
              xc = deq(fp8_transpose(xq, std::vector<int64_t>{}));
    Mat y, y_abs, dx, dx_abs, dw, dw_abs;
    products(
        s.m, s.n, s.k, [&](int64_t i, int64_t p) { return xh.at(i, p); },
        [&](int64_t j, int64_t p) { return wh.at(j, p); }, y, y_abs);
    products(
        s.m, s.k, s.n, [&](int64_t i, int64_t p) { return dyh.at(i, p); },
        [&](int64_t j, int64_t p) { return wh.at(p, j); }, dx, dx_abs);
    products(
        s.n, s.k, s.m, [&](int64_t i, int64_t p) { return dyc.at(p, i); },
        [&](int64_t j, int64_t p) { return xc.at(p, j); }, dw, dw_abs);
    EXPECT_TRUE(within(r.y, y, accumulation_bound(y, y_abs, s.k), "y"));
    EXPECT_TRUE(within(r.dx, dx, accumulation_bound(dx, dx_abs, s.n), "dx"));
    EXPECT_TRUE(within(r.dw, dw, accumulation_bound(dw, dw_abs, s.m), "dW"));
  }
}

TEST(Fp8LinearCpu, GradientsStayWithinE4m3sStepOfTheDequantizedComposition) {
  std::mt19937_64 gen(test_seed());
  for (const Shape3& s : {Shape3{48, 256, 128}, Shape3{272, 128, 256}}) {
    SCOPED_TRACE(::testing::Message() << "M " << s.m << " K " << s.k << " N " << s.n);
    const Tensor x = make_x(gen, s.m, s.k, true), w = make_w(gen(), s.n, s.k), dy = make_dy(gen, s.m, s.n);
    const LinearRun r = run_fp8_linear(x, w, dy, Device::cpu());
    const Tensor xq = quantize_rowwise_tensor(x, "ref"), dyq = quantize_rowwise_tensor(dy, "ref");
    const Mat xh = deq(xq),
              wh = mat(dequantize_tensor(quantize_linear_weight(w, "ref").q, DType::f32, "").reshape({s.n, s.k}));
    const Mat d = mat(dy);

    // The composition's analytic gradients, checked by central differences of L = Σ dy ⊙ (x̂·Ŵᵀ).
    Mat dx, dx_abs, dw, dw_abs;
    products(
        s.m, s.k, s.n, [&](int64_t i, int64_t p) { return d.at(i, p); },
        [&](int64_t j, int64_t p) { return wh.at(p, j); }, dx, dx_abs);
    products(
        s.n, s.k, s.m, [&](int64_t i, int64_t p) { return d.at(p, i); },
        [&](int64_t j, int64_t p) { return xh.at(p, j); }, dw, dw_abs);
    // L and Σ|terms| (the difference's f64 rounding is about 2^-52·Σ|terms| per evaluation).
    auto loss = [&](const Mat& a, const Mat& b) {
      double l = 0, l_abs = 0;
      for (int64_t i = 0; i < s.m; ++i)
        for (int64_t j = 0; j < s.n; ++j)
          for (int64_t p = 0; p < s.k; ++p) {
            const double t = d.at(i, j) * a.at(i, p) * b.at(j, p);
            l += t;
            l_abs += std::fabs(t);
          }
      return std::make_pair(l, l_abs);
    };
    // ∂L/∂x̂[at] (or ∂L/∂Ŵ[at]) by central differences, and their f64 rounding bound.
    auto central = [&](bool wrt_w, size_t at, double h) {
      Mat a = xh, b = wh;
      Mat& perturbed = wrt_w ? b : a;
      perturbed.v[at] += h;
      const auto [up, up_abs] = loss(a, b);
      perturbed.v[at] -= 2 * h;
      const auto [down, down_abs] = loss(a, b);
      return std::make_pair((up - down) / (2 * h), 0x1p-48 * (up_abs + down_abs) / (2 * h));
    };
    std::uniform_int_distribution<int64_t> row(0, s.m - 1), col(0, s.k - 1), out(0, s.n - 1);
    for (int t = 0; t < 4; ++t) {
      const int64_t i = row(gen), j = col(gen), n = out(gen);
      const auto [fd_x, tol_x] = central(false, size_t(i * s.k + j), 1.0);  // h = 1: L is linear in each entry
      EXPECT_NEAR(fd_x, dx.at(i, j), tol_x) << "dx[" << i << ", " << j << "]";
      const auto [fd_w, tol_w] = central(true, size_t(n * s.k + j), 1.0);
      EXPECT_NEAR(fd_w, dw.at(n, j), tol_w) << "dW[" << n << ", " << j << "]";
    }

    // Per-element FP8 error bounds: e(v) = 2^-4·|v| + 2^-10·s (rowwise quantize), + 2^-10·S (transpose).
    const std::vector<double> sdy = dyq.fp8_scales()->scale_inv.to_doubles(),
                              sx = xq.fp8_scales()->scale_inv.to_doubles();
    auto block_max = [&](const std::vector<double>& scales, int64_t cols, int64_t i, int64_t j) {
      const int64_t nb = fp8_num_blocks(cols), b = j / 128, r0 = i / 128 * 128;
      double S = 0;
      for (int64_t r = r0; r < std::min(s.m, r0 + 128); ++r) S = std::max(S, scales[size_t(r * nb + b)]);
      return S;
    };
    auto e_dy_row = [&](int64_t i, int64_t j) {
      return 0x1p-4 * std::fabs(d.at(i, j)) + 0x1p-10 * sdy[size_t(i * fp8_num_blocks(s.n) + j / 128)];
    };
    auto e_dy_col = [&](int64_t i, int64_t j) { return e_dy_row(i, j) + 0x1p-10 * block_max(sdy, s.n, i, j); };
    auto e_x_col = [&](int64_t i, int64_t j) { return 0x1p-10 * block_max(sx, s.k, i, j); };
    std::vector<double> dx_bound = accumulation_bound(dx, dx_abs, s.n), dw_bound = accumulation_bound(dw, dw_abs, s.m);
    for (int64_t i = 0; i < s.m; ++i)
      for (int64_t j = 0; j < s.k; ++j) {
        double b = 0;
        for (int64_t n = 0; n < s.n; ++n) b += e_dy_row(i, n) * std::fabs(wh.at(n, j));
        dx_bound[size_t(i * s.k + j)] = (1 + 4 * double(s.n) * kU) * (dx_bound[size_t(i * s.k + j)] + b);
      }
    for (int64_t n = 0; n < s.n; ++n)
      for (int64_t j = 0; j < s.k; ++j) {
        double b = 0;
        for (int64_t i = 0; i < s.m; ++i) {
          const double ed = e_dy_col(i, n), ex = e_x_col(i, j);
          b += ed * std::fabs(xh.at(i, j)) + std::fabs(d.at(i, n)) * ex + ed * ex;
        }
        dw_bound[size_t(n * s.k + j)] = (1 + 4 * double(s.m) * kU) * (dw_bound[size_t(n * s.k + j)] + b);
      }
    EXPECT_TRUE(within(r.dx, dx, dx_bound, "dx vs dy·Ŵ"));
    EXPECT_TRUE(within(r.dw, dw, dw_bound, "dW vs dyᵀ·x̂"));
    // Norm-wise the error is far below the per-element step (random signs cancel).
    EXPECT_LE(rel_error(r.dx, host_f32(std::vector<float>(dx.v.begin(), dx.v.end()), s.m, s.k)), 0x1p-4);
    EXPECT_LE(rel_error(r.dw, host_f32(std::vector<float>(dw.v.begin(), dw.v.end()), s.n, s.k)), 0x1p-4);
  }
}

// One quantized x feeds three linears (attention's q, k and v): one cast in the forward, the three dgrads
// summed into x's gradient, and one dy cast per linear in the backward.
TEST(Fp8LinearCpu, OneQuantizedInputFeedsSeveralLinears) {
  std::mt19937_64 gen(test_seed());
  const int64_t m = 32, k = 128, n = 256;
  const Tensor x = make_x(gen, m, k, false);
  std::vector<Tensor> ws, dys;
  for (int i = 0; i < 3; ++i) {
    ws.push_back(make_w(gen(), n, k));
    dys.push_back(make_dy(gen, m, n));
  }
  reset_cast_counts();
  Variable xv(x, true);
  const Variable xq = quantize_rowwise(xv, "shared: x");
  const std::vector<std::string> names = {"lin0", "lin1", "lin2"};
  std::vector<Variable> wv, ys;
  for (size_t i = 0; i < 3; ++i) {
    wv.emplace_back(ws[i], true, names[i] + ".weight");
    ys.push_back(fp8_linear(xq, wv.back(), quantize_linear_weight(ws[i], wv.back().name()), names[i]));
  }
  backward({ys[0], ys[1], ys[2]}, {dys[0], dys[1], dys[2]});
  const CastCounts c = cast_counts();
  EXPECT_EQ(c.quantize, 4);  // x once, each dy once
  EXPECT_EQ(c.weight_quantize, 3);
  EXPECT_EQ(c.by_site.at("quantize shared: x"), 1);
  for (const std::string& name : names) EXPECT_EQ(c.by_site.at("quantize " + name + ".dgrad: dy rowwise"), 1);
  Tensor sum = Tensor::zeros({m, k}, DType::f32);
  for (int i = 0; i < 3; ++i) {
    const LinearRun one = run_fp8_linear(x, ws[size_t(i)], dys[size_t(i)], Device::cpu());
    sum = tensor_add(sum, one.dx);
    EXPECT_TRUE(bit_equal(wv[size_t(i)].grad(), one.dw)) << "linear " << i;
  }
  EXPECT_TRUE(all_close(xv.grad(), sum, 1e-6, 1e-6 * (1 + std::sqrt(double(m * k)))));
}

TEST(Fp8LinearCpu, RefusesShapesItCannotRun) {
  std::mt19937_64 gen(test_seed());
  auto run = [&](int64_t m, int64_t k, int64_t n) {
    const Tensor x = make_x(gen, m, k, false), w = make_w(1, n, k);
    Variable wv(w, true, "w");
    fp8_linear(quantize_rowwise(Variable(x), "x"), wv, quantize_linear_weight(w, "w"), "proj");
  };
  EXPECT_TRUE(throws_naming<ShapeError>([&] { run(24, 128, 128); }, {"proj", "24 rows", "multiple of 16"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { run(16, 192, 128); }, {"proj", "in_features 192", "128"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { run(16, 128, 200); }, {"proj", "out_features 200"}));
  const Tensor w = make_w(2, 128, 128);
  Variable wv(w, true, "w");
  const QuantizedWeight wq = quantize_linear_weight(w, "w");
  EXPECT_TRUE(
      throws_naming<DTypeError>([&] { fp8_linear(Variable(make_x(gen, 16, 128, false)), wv, wq, "p"); }, {"e4m3"}));
  EXPECT_TRUE(throws_naming<DTypeError>(
      [&] {
        fp8_linear(quantize_rowwise(Variable(make_x(gen, 16, 128, false)), "x"), Variable(w.to(DType::bf16)), wq, "p");
      },
      {"'p'", "f32 master [N, K]"}));
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] { fp8_linear(quantize_rowwise(Variable(make_x(gen, 16, 256, false)), "x"), wv, wq, "p"); }, {"[M, 128]"}));
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        quantize_linear_weight(Tensor::zeros({1, 128, 128}, DType::f32), "w3");
      },
      {"w3", "[N, K]"}));
}

// The GPU path (one cuBLASLt call per GEMM over host counts, the transposes' kernels) against the CPU reference
// on the same numbers: y and dx bf16 within the f32 bound plus a bf16 rounding (relative 2^-9) on each side
// (tests/test_fp8_grouped_linear.cpp's measured bounds), dW f32, empty x exact; no host synchronisation.
TEST(Fp8LinearCuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  for (const Shape3& s :
       {Shape3{16, 128, 128}, Shape3{48, 256, 384}, Shape3{272, 384, 256}, Shape3{0, 128, 256}, Shape3{1024, 512, 640}})
    for (bool edges : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "M " << s.m << " K " << s.k << " N " << s.n << (edges ? " edges" : ""));
      const Tensor x = make_x(gen, s.m, s.k, edges), w = make_w(gen(), s.n, s.k), dy = make_dy(gen, s.m, s.n);
      const LinearRun cpu = run_fp8_linear(x, w, dy, Device::cpu());
      const LinearRun gpu = run_fp8_linear(x, w, dy, Device::cuda());
      EXPECT_EQ(gpu.host_syncs, 0u);
      EXPECT_EQ(gpu.backward_casts.by_site, cpu.backward_casts.by_site);
      ASSERT_EQ(gpu.y.shape(), cpu.y.shape());
      const double bf16 = 5e-4 + 2 * 0x1p-9;
      if (s.m == 0) {
        EXPECT_EQ(gpu.dw.to_doubles(), std::vector<double>(size_t(s.n * s.k), 0.0)) << "no rows: dW 0";
        continue;
      }
      EXPECT_LE(rel_error(gpu.y, cpu.y), bf16) << "y";
      EXPECT_LE(rel_error(gpu.dx, cpu.dx), bf16) << "dx";
      EXPECT_LE(rel_error(gpu.dw, cpu.dw), 5e-4) << "dW";
      const std::vector<double> ref = cpu.dw.to_doubles();
      double amax = 0;
      for (double v : ref) amax = std::max(amax, std::fabs(v));
      EXPECT_TRUE(all_close(gpu.dw, cpu.dw, 1e-3, 2e-3 * amax)) << "dW";
    }
}

// precision.fp8_weight_transpose rebuilt: a copy quantized without its transpose has none, weight_transpose rebuilds
// the one quantize_weight writes bit for bit (data and scales), and the linear's y, dx and dW are those of the copy
// that keeps it, bit for bit, with no cast more. On the GPU, the rebuild is the kernel of kernels/cuda/adamw_fp8.cu.
static void check_rebuilt_transpose(Device device) {
  std::mt19937_64 gen(test_seed());
  for (const Shape3& s : {Shape3{16, 128, 128}, Shape3{48, 256, 384}, Shape3{272, 384, 256}, Shape3{144, 640, 512}}) {
    SCOPED_TRACE(::testing::Message() << "M " << s.m << " K " << s.k << " N " << s.n);
    const Tensor x = make_x(gen, s.m, s.k, true), w = make_w(gen(), s.n, s.k), dy = make_dy(gen, s.m, s.n);
    const Tensor wd = w.to(device);
    const QuantizedWeight with = quantize_linear_weight(wd, "ref"), without = quantize_linear_weight(wd, "ref", false);
    EXPECT_FALSE(without.q_t.defined());
    ASSERT_TRUE(bit_equal(without.q.to(Device::cpu()), with.q.to(Device::cpu())));
    const Tensor rebuilt = weight_transpose(without);
    ASSERT_EQ(rebuilt.shape(), with.q_t.shape());
    EXPECT_TRUE(bit_equal(rebuilt.to(Device::cpu()), with.q_t.to(Device::cpu()))) << "data";
    EXPECT_TRUE(bit_equal(rebuilt.fp8_scales()->scale_inv.to(Device::cpu()),
                          with.q_t.fp8_scales()->scale_inv.to(Device::cpu())))
        << "scales";
    EXPECT_EQ(weight_transpose(with).raw_data(), with.q_t.raw_data()) << "a stored transpose is used as it is";
    const LinearRun stored = run_fp8_linear(x, w, dy, device), rebuilt_run = run_fp8_linear(x, w, dy, device, false);
    EXPECT_TRUE(bit_equal(rebuilt_run.y, stored.y)) << "y";
    EXPECT_TRUE(bit_equal(rebuilt_run.dx, stored.dx)) << "dx";
    EXPECT_TRUE(bit_equal(rebuilt_run.dw, stored.dw)) << "dW";
    EXPECT_EQ(rebuilt_run.backward_casts.by_site, stored.backward_casts.by_site);
  }
}

TEST(Fp8LinearCpu, ABackwardWithoutAStoredTransposeRebuildsItBitForBit) { check_rebuilt_transpose(Device::cpu()); }

TEST(Fp8LinearCuda, ABackwardWithoutAStoredTransposeRebuildsItBitForBit) {
  FLOWMOE_REQUIRE_CUDA();
  check_rebuilt_transpose(Device::cuda());
}
