// add / mul / scale / cast / reshape: gradient checks of the CPU reference and CUDA vs CPU.
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

TEST(Elementwise, Gradcheck) {
  Rng rng(test_seed());
  Tensor a = random_tensor(rng, {4, 7}, DType::f64), b = random_tensor(rng, {4, 7}, DType::f64);
  EXPECT_TRUE(gradcheck([](const std::vector<Variable>& v) { return add(v[0], v[1]); }, {a, b}));
  EXPECT_TRUE(gradcheck([](const std::vector<Variable>& v) { return mul(v[0], v[1]); }, {a, b}));
  EXPECT_TRUE(gradcheck([](const std::vector<Variable>& v) { return scale(v[0], -2.5); }, {a}));
  EXPECT_TRUE(gradcheck([](const std::vector<Variable>& v) { return reshape(v[0], {7, 4}); }, {a}));
  EXPECT_TRUE(gradcheck([](const std::vector<Variable>& v) { return cast(cast(v[0], DType::f32), DType::f64); }, {a},
                        1e-3, 1e-3));
}

TEST(Elementwise, CastGradientReturnsInInputDtype) {
  Variable x(Tensor::full({3}, 1.5, DType::f32), true);
  Variable y = cast(x, DType::bf16);
  EXPECT_EQ(y.dtype(), DType::bf16);
  EXPECT_THROW(sum(y).backward(), DTypeError);  // bf16 math is GPU-only: the CPU refuses clearly
}

TEST(ElementwiseCuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (int64_t n : {0, 1, 127, 4099, 1 << 20}) {
    SCOPED_TRACE(n);
    Tensor a = random_tensor(rng, {n}), b = random_tensor(rng, {n});
    Tensor ga = a.to(Device::cuda()), gb = b.to(Device::cuda());
    EXPECT_TRUE(bit_equal(tensor_add(ga, gb), tensor_add(a, b)));
    EXPECT_TRUE(bit_equal(tensor_mul(ga, gb), tensor_mul(a, b)));
    EXPECT_TRUE(all_close(tensor_scale(ga, 0.3), tensor_scale(a, 0.3), 1e-6, 0));
    // bf16: computed in fp32 and rounded once, as the CPU does through f32.
    Tensor ref = tensor_add(a.to(DType::bf16).to(DType::f32), b.to(DType::bf16).to(DType::f32)).to(DType::bf16);
    EXPECT_TRUE(bit_equal(tensor_add(ga.to(DType::bf16), gb.to(DType::bf16)), ref));
  }
}

TEST(ElementwiseCuda, BackwardMatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  Tensor a = random_tensor(rng, {33, 65}), b = random_tensor(rng, {33, 65});
  auto grads = [&](Device d) {
    Variable x(a.to(d), true), y(b.to(d), true);
    sum(mul(add(x, y), scale(x, 2.0))).backward();
    return std::make_pair(x.grad(), y.grad());
  };
  auto [cx, cy] = grads(Device::cpu());
  auto [gx, gy] = grads(Device::cuda());
  EXPECT_TRUE(all_close(gx, cx, 1e-5, 1e-6));
  EXPECT_TRUE(all_close(gy, cy, 1e-5, 1e-6));
}
