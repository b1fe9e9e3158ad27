// sum / mean over all elements: gradient check and values of the CPU reference, empty inputs,
// errors, and CUDA vs CPU (f32 and bf16, forward and backward, determinism) up to 3M elements.
#include <algorithm>
#include <cmath>

#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

double sum_abs(const Tensor& t) {
  double s = 0;
  for (double v : t.to_doubles()) s += std::fabs(v);
  return s;
}

}  // namespace

TEST(Reduce, Gradcheck) {
  Rng rng(test_seed());
  for (const Shape& s : {Shape{3, 4}, Shape{5}, Shape{}, Shape{2, 1, 3}}) {
    SCOPED_TRACE(shape_str(s));
    Tensor x = random_tensor(rng, s, DType::f64);
    EXPECT_TRUE(gradcheck([](const std::vector<Variable>& v) { return sum(v[0]); }, {x}));
    EXPECT_TRUE(gradcheck([](const std::vector<Variable>& v) { return mean(v[0]); }, {x}));
  }
}

TEST(Reduce, Values) {
  for (DType dt : {DType::f32, DType::f64}) {
    Variable x(Tensor::from_floats({1, 2, 3, 4, 5, 6}, {2, 3}, dt));
    Variable s = sum(x), m = mean(x);
    EXPECT_EQ(s.shape(), Shape{});
    EXPECT_EQ(s.dtype(), dt);
    EXPECT_EQ(m.dtype(), dt);
    EXPECT_EQ(s.data().to_doubles()[0], 21.0);
    EXPECT_EQ(m.data().to_doubles()[0], 3.5);
    // A strided view reduces like its contiguous copy.
    EXPECT_EQ(sum(Variable(x.data().transpose(0, 1))).data().to_doubles()[0], 21.0);
  }
}

TEST(Reduce, EmptyIsZero) {
  for (const Shape& s : {Shape{0}, Shape{3, 0}}) {
    SCOPED_TRACE(shape_str(s));
    Variable x(Tensor::zeros(s, DType::f32), true);
    Variable s_out = sum(x), m_out = mean(x);
    EXPECT_EQ(s_out.data().to_doubles()[0], 0.0);
    EXPECT_EQ(m_out.data().to_doubles()[0], 0.0);
    m_out.backward();
    EXPECT_EQ(x.grad().shape(), s);
  }
}

TEST(Reduce, BackwardBroadcastsScaledGradient) {
  Variable x(Tensor::zeros({4, 6}, DType::f32), true);
  mean(x).backward(Tensor::full({}, 3.0, DType::f32));
  for (float g : x.grad().to_floats()) EXPECT_EQ(g, 0.125f);
  Variable y(Tensor::zeros({5}, DType::f64), true);
  sum(y).backward(Tensor::full({}, -2.0, DType::f64));
  for (double g : y.grad().to_doubles()) EXPECT_EQ(g, -2.0);
}

TEST(Reduce, Errors) {
  EXPECT_THROW(sum(Variable(Tensor::zeros({3}, DType::i32))), DTypeError);
  EXPECT_THROW(mean(Variable(Tensor::zeros({3}, DType::bf16))), DTypeError);  // bf16 is GPU-only
  Variable x(Tensor::zeros({3}, DType::f64), true);
  EXPECT_THROW(sum(x).backward(Tensor::full({}, 1.0, DType::f32)), DTypeError);  // gradient dtype
}

// Forward: fp32 tree sums vs a double-accumulated reference of the same (rounded) values; the error
// bound scales with sum |x| (2e-6 of it covers log2(3M) levels of fp32 rounding). Backward is a fill
// of d / n computed in f32 on both sides, so it is bit-exact.
TEST(ReduceCuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (int64_t n : {0, 1, 31, 1000, 4099, 1 << 20, 3'000'017})
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::to_string(n) + " " + dtype_name(dt));
      Tensor x = random_tensor(rng, {n}, DType::f32, Device::cpu(), -1, 2).to(dt);
      Tensor ref_x = x.to(DType::f32);
      double scale_n = n > 0 ? double(n) : 1.0;
      for (bool is_mean : {false, true}) {
        auto op = [&](const Variable& v) { return is_mean ? mean(v) : sum(v); };
        Variable cx(ref_x, true), gx(x.to(Device::cuda()), true);
        Variable ref = op(cx), got = op(gx);
        EXPECT_EQ(got.shape(), Shape{});
        EXPECT_EQ(got.dtype(), DType::f32);
        double tol = 2e-6 * sum_abs(ref_x) / (is_mean ? scale_n : 1.0) + 1e-30;
        EXPECT_TRUE(all_close(got.data(), ref.data(), 0, tol)) << (is_mean ? "mean" : "sum");
        ref.backward(Tensor::full({}, 2.5, DType::f32));
        got.backward(Tensor::full({}, 2.5, DType::f32, Device::cuda()));
        EXPECT_EQ(gx.grad().dtype(), dt);
        EXPECT_TRUE(bit_equal(gx.grad(), cx.grad().to(dt))) << (is_mean ? "mean" : "sum");
      }
    }
}

TEST(ReduceCuda, DeterministicAndStrided) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  Tensor x = random_tensor(rng, {(1 << 22) + 5}, DType::f32, Device::cuda());
  EXPECT_TRUE(bit_equal(sum(Variable(x)).data(), sum(Variable(x)).data()));
  EXPECT_TRUE(bit_equal(mean(Variable(x.to(DType::bf16))).data(), mean(Variable(x.to(DType::bf16))).data()));
  Tensor m = random_tensor(rng, {123, 77}, DType::f32);
  Tensor ref = sum(Variable(m.transpose(0, 1))).data();
  Tensor got = sum(Variable(m.to(Device::cuda()).transpose(0, 1))).data();
  EXPECT_TRUE(all_close(got, ref, 0, 2e-6 * sum_abs(m)));
}
