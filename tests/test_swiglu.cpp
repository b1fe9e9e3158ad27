// swiglu: gradient check, equality with the composition mul(silu(gate), up), errors, and CUDA vs
// CPU (f32, bf16) over edge shapes.
#include <cmath>
#include <cstring>

#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

struct SwigluResult {
  Tensor out, d_gate_up;  // on the CPU
};

SwigluResult run_swiglu(const Tensor& gate_up, const Tensor& d_out, Device device) {
  Variable x(gate_up.to(device), true);
  Variable out = swiglu(x);
  out.backward(d_out.to(device));
  return {out.data().to(Device::cpu()), x.grad().to(Device::cpu())};
}

// The unfused composition on `device`: gate and up as contiguous copies of the two halves.
SwigluResult run_composition(const Tensor& gate_up, const Tensor& d_out, Device device) {
  int64_t F = gate_up.size(-1) / 2;
  Tensor x = gate_up.to(device);
  Variable gate(x.slice(-1, 0, F).contiguous(), true), up(x.slice(-1, F, 2 * F).contiguous(), true);
  Variable out = mul(silu(gate), up);
  out.backward(d_out.to(device));
  // Reassemble [d_gate | d_up] row by row on the CPU.
  Tensor dg = gate.grad().to(Device::cpu()), du = up.grad().to(Device::cpu());
  int64_t rows = F > 0 ? dg.numel() / F : 0;
  Tensor d = Tensor::empty(gate_up.shape(), dg.dtype());
  auto* pd = static_cast<char*>(d.raw_data());
  auto *pg = static_cast<const char*>(dg.raw_data()), *pu = static_cast<const char*>(du.raw_data());
  size_t es = dtype_size(dg.dtype()), row = size_t(F) * es;
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(pd + size_t(r) * 2 * row, pg + size_t(r) * row, row);
    std::memcpy(pd + size_t(r) * 2 * row + row, pu + size_t(r) * row, row);
  }
  return {out.data().to(Device::cpu()), d};
}

}  // namespace

TEST(Swiglu, Gradcheck) {
  Rng rng(test_seed());
  Tensor x = random_tensor(rng, {3, 10}, DType::f64, Device::cpu(), -3, 3);
  EXPECT_TRUE(gradcheck([](const std::vector<Variable>& v) { return swiglu(v[0]); }, {x}));
  Tensor x3 = random_tensor(rng, {2, 2, 6}, DType::f64, Device::cpu(), -3, 3);
  EXPECT_TRUE(gradcheck([](const std::vector<Variable>& v) { return swiglu(v[0]); }, {x3}));
}

// The fused reference is the composition of the unfused references, bit for bit (f32 and f64),
// forward and backward.
TEST(Swiglu, EqualsSiluTimesUp) {
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64}) {
    Tensor x = random_tensor(rng, {6, 2 * 37}, dt, Device::cpu(), -5, 5);
    Tensor d_out = random_tensor(rng, {6, 37}, dt);
    SwigluResult fused = run_swiglu(x, d_out, Device::cpu());
    SwigluResult comp = run_composition(x, d_out, Device::cpu());
    EXPECT_TRUE(bit_equal(fused.out, comp.out));
    EXPECT_TRUE(bit_equal(fused.d_gate_up, comp.d_gate_up));
  }
}

TEST(Swiglu, Shapes) {
  EXPECT_EQ(swiglu(Variable(Tensor::zeros({2, 3, 8}, DType::f32))).shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(swiglu(Variable(Tensor::zeros({0, 8}, DType::f32))).shape(), (Shape{0, 4}));
  EXPECT_EQ(swiglu(Variable(Tensor::zeros({5, 0}, DType::f32))).shape(), (Shape{5, 0}));
  // gate = [1, -2], up = [3, 0.5]
  Tensor x = Tensor::from_doubles({1, -2, 3, 0.5}, {1, 4}, DType::f64);
  std::vector<double> y = swiglu(Variable(x)).data().to_doubles();
  EXPECT_NEAR(y[0], 3 * (1 / (1 + std::exp(-1.0))), 1e-15);
  EXPECT_NEAR(y[1], 0.5 * (-2 / (1 + std::exp(2.0))), 1e-15);
}

TEST(Swiglu, Errors) {
  try {
    swiglu(Variable(Tensor::zeros({3, 7}, DType::f32)));
    FAIL() << "expected ShapeError";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("f32[3, 7]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(swiglu(Variable(Tensor::zeros({}, DType::f32))), ShapeError);
  EXPECT_THROW(swiglu(Variable(Tensor::zeros({2, 4}, DType::i32))), DTypeError);
  EXPECT_THROW(swiglu(Variable(Tensor::zeros({2, 4}, DType::bf16))), DTypeError);  // bf16 is GPU-only
  Variable x(Tensor::zeros({2, 4}, DType::f32), true);
  Variable y = swiglu(x);
  try {
    y.backward(Tensor::zeros({2, 2}, DType::f64));
    FAIL() << "expected DTypeError";
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("f64"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("f32"), std::string::npos) << e.what();
  }
}

// f32: silu(g) (expf <= 2 ulp on the GPU) times u: rtol 2e-6. d_gate = dy * u * silu'(g), where
// silu' loses absolute precision (cancellation near g = -1.28, and 1 - s for large |g|: ~1.2e-7
// absolute in s, times |g s| <= 4, per side): with |g|, |u| <= 4 and |dy| <= 1 the two sides
// differ by at most ~4e-6, hence atol 2e-5.
// bf16: both sides round the same fp32 math once; at most one bf16 ulp apart (<= 2^-7 relative).
TEST(SwigluCuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  struct Case {
    int64_t rows, F;
  };
  for (Case c : {Case{0, 7}, Case{1, 1}, Case{1, 129}, Case{5, 7}, Case{3, 1000}, Case{70000, 3}, Case{4096, 2048}}) {
    SCOPED_TRACE(::testing::Message() << "rows " << c.rows << " F " << c.F);
    Tensor x = random_tensor(rng, {c.rows, 2 * c.F}, DType::f32, Device::cpu(), -4, 4);
    Tensor d_out = random_tensor(rng, {c.rows, c.F});
    SwigluResult ref = run_swiglu(x, d_out, Device::cpu());
    SwigluResult got = run_swiglu(x, d_out, Device::cuda());
    EXPECT_TRUE(all_close(got.out, ref.out, 2e-6, 1e-12));
    EXPECT_TRUE(all_close(got.d_gate_up, ref.d_gate_up, 1e-5, 2e-5));

    Tensor xb = x.to(DType::bf16), d_outb = d_out.to(DType::bf16);
    SwigluResult ref_b = run_swiglu(xb.to(DType::f32), d_outb.to(DType::f32), Device::cpu());
    SwigluResult got_b = run_swiglu(xb, d_outb, Device::cuda());
    EXPECT_EQ(got_b.out.dtype(), DType::bf16);
    EXPECT_TRUE(all_close(got_b.out, ref_b.out.to(DType::bf16), 8e-3, 1e-5));
    EXPECT_TRUE(all_close(got_b.d_gate_up, ref_b.d_gate_up.to(DType::bf16), 8e-3, 2e-5));
  }
}

// On the GPU too the fused kernel runs the silu kernel's code (kernels/cuda/silu.cuh) followed by a
// product, so in f32 it equals the composition bit for bit.
TEST(SwigluCuda, EqualsSiluTimesUp) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  Tensor x = random_tensor(rng, {33, 2 * 257}, DType::f32, Device::cpu(), -5, 5);
  Tensor d_out = random_tensor(rng, {33, 257});
  SwigluResult fused = run_swiglu(x, d_out, Device::cuda());
  SwigluResult comp = run_composition(x, d_out, Device::cuda());
  EXPECT_TRUE(bit_equal(fused.out, comp.out));
  EXPECT_TRUE(bit_equal(fused.d_gate_up, comp.d_gate_up));
}
