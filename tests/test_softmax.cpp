// softmax over the last dim: gradient check and properties of the CPU reference, errors, and CUDA
// vs CPU (f32 and bf16, forward and backward) over edge shapes up to a 50257-wide vocab row.
#include <algorithm>
#include <cmath>
#include <limits>

#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

double max_abs(const Tensor& t) {
  double m = 0;
  for (double v : t.to_doubles()) m = std::max(m, std::fabs(v));
  return m;
}

Variable softmax_fn(const std::vector<Variable>& v) { return softmax(v[0]); }

// How far a bf16 dx = y (dy - dot), dot = sum_j y_j dy_j, may be from the f32 one on the same inputs, per
// element: the kernel reads y rounded to bf16 (|dy_i| y_i 2^-9 in the first factor, up to S 2^-9 in dot,
// S = sum_j y_j |dy_j|) and rounds dx (|dx_i| 2^-9). Where dy_i is close to dot the difference cancels,
// so the bound is on the terms, not on dx: twice 2^-9 (|dx_i| + y_i (|dy_i| + 2 S)).
void expect_bf16_dx_within_rounding(const Tensor& dx, const Tensor& ref_y, const Tensor& ref_dx, const Tensor& d_y) {
  const std::vector<double> got = dx.to_doubles(), y = ref_y.to_doubles(), want = ref_dx.to_doubles();
  const std::vector<double> dy = d_y.to_doubles();
  const int64_t cols = ref_y.dim() > 0 ? ref_y.size(-1) : 0;
  for (int64_t r = 0; cols > 0 && r < int64_t(y.size()) / cols; ++r) {
    double s = 0;
    for (int64_t j = 0; j < cols; ++j) s += y[size_t(r * cols + j)] * std::fabs(dy[size_t(r * cols + j)]);
    for (int64_t j = 0; j < cols; ++j) {
      const size_t i = size_t(r * cols + j);
      const double bound = 2.0 / 512 * (std::fabs(want[i]) + y[i] * (std::fabs(dy[i]) + 2 * s)) + 1e-30;
      ASSERT_LE(std::fabs(got[i] - want[i]), bound) << "row " << r << " column " << j << ": " << got[i] << " vs "
                                                    << want[i] << " (y " << y[i] << ", dy " << dy[i] << ")";
    }
  }
}

}  // namespace

TEST(Softmax, Gradcheck) {
  Rng rng(test_seed());
  for (const Shape& s : {Shape{3, 5}, Shape{2, 3, 4}, Shape{1, 1}, Shape{6}}) {
    SCOPED_TRACE(shape_str(s));
    Tensor x = random_tensor(rng, s, DType::f64, Device::cpu(), -3, 3);
    EXPECT_TRUE(gradcheck(softmax_fn, {x}));
  }
}

TEST(Softmax, RowsSumToOneAndShiftInvariant) {
  // Row r is row 0 shifted by shifts[r]: every row must give row 0's softmax, and a lost max-subtract
  // would overflow exp in the shifted rows.
  Rng rng(test_seed());
  const int64_t cols = 37;
  const double shifts[] = {0, 100, 1000, -1000, 1e6};
  std::vector<double> base = random_tensor(rng, {cols}, DType::f64, Device::cpu(), -5, 5).to_doubles(), x;
  for (double s : shifts)
    for (double v : base) x.push_back(v + s);
  std::vector<double> y = softmax(Variable(Tensor::from_doubles(x, {5, cols}))).data().to_doubles();
  for (int r = 0; r < 5; ++r) {
    double row_sum = 0;
    for (int64_t c = 0; c < cols; ++c) {
      row_sum += y[size_t(r * cols + c)];
      EXPECT_NEAR(y[size_t(r * cols + c)], y[size_t(c)], 1e-9) << "row " << r << " col " << c;
    }
    EXPECT_NEAR(row_sum, 1.0, 1e-12) << "row " << r;
  }
}

TEST(Softmax, MaskedEntriesGetZero) {
  const float inf = std::numeric_limits<float>::infinity();
  Tensor x = Tensor::from_floats({1, -inf, 2, -inf, -inf, 0.5f}, {2, 3});
  std::vector<float> y = softmax(Variable(x)).data().to_floats();
  float e = std::exp(1.f - 2.f);
  EXPECT_FLOAT_EQ(y[0], e / (e + 1));
  EXPECT_EQ(y[1], 0.f);
  EXPECT_FLOAT_EQ(y[2], 1 / (e + 1));
  EXPECT_EQ(y[3], 0.f);
  EXPECT_EQ(y[4], 0.f);
  EXPECT_FLOAT_EQ(y[5], 1.f);
}

TEST(Softmax, EmptyShapes) {
  for (const Shape& s : {Shape{0, 7}, Shape{3, 0}}) {
    SCOPED_TRACE(shape_str(s));
    Variable x(Tensor::zeros(s, DType::f32), true);
    Variable y = softmax(x);
    EXPECT_EQ(y.shape(), s);
    y.backward(Tensor::zeros(s, DType::f32));
    EXPECT_EQ(x.grad().shape(), s);
  }
}

TEST(Softmax, Errors) {
  EXPECT_THROW(softmax(Variable(Tensor::full({}, 1.0, DType::f32))), ShapeError);  // no last dim
  EXPECT_THROW(softmax(Variable(Tensor::zeros({2, 3}, DType::i32))), DTypeError);
  EXPECT_THROW(softmax(Variable(Tensor::zeros({2, 3}, DType::bf16))), DTypeError);  // bf16 is GPU-only
  Variable x(Tensor::zeros({2, 3}, DType::f64), true);
  EXPECT_THROW(softmax(x).backward(Tensor::zeros({2, 3}, DType::f32)), DTypeError);  // gradient dtype
}

// f32: same math, different summation order and expf -> 1e-5 relative on y; dx = y * (dy - dot)
// cancels where dy ~ dot, so its absolute tolerance scales with max |dx|.
// bf16: y and dx are rounded to bf16 (2^-9 relative each) and dx uses the rounded y
// (expect_bf16_dx_within_rounding).
TEST(SoftmaxCuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const Shape shapes[] = {{0, 7}, {3, 0}, {1, 1}, {1, 33}, {5, 127}, {3, 1000}, {2, 3, 129}, {300, 64}, {4, 50257}};
  for (const Shape& s : shapes)
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(shape_str(s) + " " + dtype_name(dt));
      Tensor x = random_tensor(rng, s, DType::f32, Device::cpu(), -8, 8).to(dt);
      Tensor d_y = random_tensor(rng, s).to(dt);
      auto run = [&](Device dev, DType t) {
        Variable v(x.to(t).to(dev), true);
        Variable y = softmax(v);
        y.backward(d_y.to(t).to(dev));
        return std::make_pair(y.data().to(Device::cpu()), v.grad().to(Device::cpu()));
      };
      auto [ref_y, ref_dx] = run(Device::cpu(), DType::f32);  // the same (rounded) values, in f32
      auto [y, dx] = run(Device::cuda(), dt);
      EXPECT_EQ(y.dtype(), dt);
      EXPECT_EQ(dx.dtype(), dt);
      if (dt == DType::f32) {
        EXPECT_TRUE(all_close(y, ref_y, 1e-5, 1e-12));
        EXPECT_TRUE(all_close(dx, ref_dx, 1e-4, 1e-6 * max_abs(ref_dx)));
      } else {
        EXPECT_TRUE(all_close(y, ref_y, 1.0 / 128, 1e-12));
        expect_bf16_dx_within_rounding(dx, ref_y, ref_dx, d_y.to(DType::f32));
      }
    }
}

TEST(SoftmaxCuda, MaskedAndShiftedRows) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const int64_t rows = 6, cols = 300;
  std::vector<float> x = random_tensor(rng, {rows, cols}, DType::f32, Device::cpu(), -4, 4).to_floats();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float& v = x[size_t(r * cols + c)];
      if ((c + r) % 3 == 0) v = -std::numeric_limits<float>::infinity();  // masked
      v += 1000.f * float(r % 2);                                         // large, exp would overflow
    }
  Tensor xt = Tensor::from_floats(x, {rows, cols});
  Tensor ref = softmax(Variable(xt)).data();
  Tensor got = softmax(Variable(xt.to(Device::cuda()))).data();
  EXPECT_TRUE(all_close(got, ref, 1e-5, 1e-12));
}
