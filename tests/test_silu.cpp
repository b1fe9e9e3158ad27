// silu: gradient check of the CPU reference, known values, errors, and CUDA vs CPU (f32, bf16).
#include <cmath>

#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

struct SiluResult {
  Tensor y, d_x;  // on the CPU
};

// silu forward and backward on `device` (inputs are copied there as they are).
SiluResult run_silu(const Tensor& x, const Tensor& d_y, Device device) {
  Variable xv(x.to(device), true);
  Variable y = silu(xv);
  y.backward(d_y.to(device));
  return {y.data().to(Device::cpu()), xv.grad().to(Device::cpu())};
}

}  // namespace

TEST(Silu, Gradcheck) {
  Rng rng(test_seed());
  Tensor x = random_tensor(rng, {3, 5}, DType::f64, Device::cpu(), -4, 4);
  EXPECT_TRUE(gradcheck([](const std::vector<Variable>& v) { return silu(v[0]); }, {x}));
}

TEST(Silu, KnownValues) {
  Tensor x = Tensor::from_doubles({0.0, 1.0, -1.0, 20.0, -20.0}, {5}, DType::f64);
  std::vector<double> y = silu(Variable(x)).data().to_doubles();
  for (size_t i = 0; i < y.size(); ++i) {
    double xi = x.to_doubles()[i];
    EXPECT_NEAR(y[i], xi / (1.0 + std::exp(-xi)), 1e-15) << "x = " << xi;
  }
  EXPECT_NEAR(y[1], 0.7310585786300049, 1e-15);
}

TEST(Silu, Errors) {
  EXPECT_THROW(silu(Variable(Tensor::zeros({4}, DType::i32))), DTypeError);
  EXPECT_THROW(silu(Variable(Tensor::zeros({4}, DType::bf16))), DTypeError);  // bf16 is GPU-only
  // A gradient of another dtype than x names both.
  Variable x(Tensor::zeros({2, 3}, DType::f32), true);
  Variable y = silu(x);
  try {
    y.backward(Tensor::zeros({2, 3}, DType::f64));
    FAIL() << "expected DTypeError";
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("f32"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("f64"), std::string::npos) << e.what();
  }
}

TEST(Silu, EmptyAndScalar) {
  EXPECT_EQ(silu(Variable(Tensor::zeros({0, 3}, DType::f32))).shape(), (Shape{0, 3}));
  EXPECT_EQ(silu(Variable(Tensor::zeros({}, DType::f32))).data().to_doubles()[0], 0.0);
}

// f32: expf on the GPU (<= 2 ulp) vs glibc on the CPU, then 2-3 roundings: y within rtol 2e-6.
// The derivative s + x s (1 - s) cancels near x = -1.28 and loses absolute precision in (1 - s)
// for large |x|: with |x| <= 6 its absolute error stays below ~1e-6, so d_x uses atol 1e-5.
// bf16: both sides round the same fp32 math once; they may land one bf16 ulp apart (<= 2^-7 relative).
TEST(SiluCuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (Shape shape : {Shape{0}, Shape{1}, Shape{7}, Shape{129}, Shape{3, 1000}, Shape{4096, 2048}}) {
    SCOPED_TRACE(shape_str(shape));
    Tensor x = random_tensor(rng, shape, DType::f32, Device::cpu(), -6, 6);
    Tensor d_y = random_tensor(rng, shape);
    SiluResult ref = run_silu(x, d_y, Device::cpu());
    SiluResult got = run_silu(x, d_y, Device::cuda());
    EXPECT_TRUE(all_close(got.y, ref.y, 2e-6, 1e-12));
    EXPECT_TRUE(all_close(got.d_x, ref.d_x, 1e-5, 1e-5));

    Tensor xb = x.to(DType::bf16), d_yb = d_y.to(DType::bf16);
    SiluResult ref_b = run_silu(xb.to(DType::f32), d_yb.to(DType::f32), Device::cpu());
    SiluResult got_b = run_silu(xb, d_yb, Device::cuda());
    EXPECT_EQ(got_b.y.dtype(), DType::bf16);
    EXPECT_EQ(got_b.d_x.dtype(), DType::bf16);
    EXPECT_TRUE(all_close(got_b.y, ref_b.y.to(DType::bf16), 8e-3, 1e-5));
    EXPECT_TRUE(all_close(got_b.d_x, ref_b.d_x.to(DType::bf16), 8e-3, 1e-5));
  }
}

TEST(SiluCuda, Errors) {
  FLOWMOE_REQUIRE_CUDA();
  EXPECT_THROW(silu(Variable(Tensor::zeros({4}, DType::i32, Device::cuda()))), DTypeError);
  EXPECT_THROW(silu(Variable(Tensor::zeros({4}, DType::f64, Device::cuda()))), DTypeError);
}
