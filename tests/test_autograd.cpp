// The autograd graph: accumulation where a value is used twice, leaf gradient accumulation across
// backward calls, no-grad scopes, checkpoint equality, and clear errors.
#include "engine/allocator.h"
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

TEST(Autograd, DiamondAccumulatesAndLeavesAccumulateAcrossCalls) {
  Rng rng(test_seed());
  Variable x(random_tensor(rng, {5}, DType::f64), true);
  Variable y = mul(x, x);              // y = x^2
  Variable z = add(y, scale(x, 3.0));  // z = x^2 + 3x, x used twice
  z.backward(Tensor::full({5}, 1.0, DType::f64));
  auto xv = x.data().to_doubles(), g = x.grad().to_doubles();
  for (size_t i = 0; i < 5; ++i) EXPECT_NEAR(g[i], 2 * xv[i] + 3, 1e-12);
  Variable z2 = scale(x, 2.0);
  z2.backward(Tensor::full({5}, 1.0, DType::f64));
  g = x.grad().to_doubles();
  for (size_t i = 0; i < 5; ++i) EXPECT_NEAR(g[i], 2 * xv[i] + 5, 1e-12);
}

// A leaf stored in a narrower dtype (Variable::store_as: a sharded optimizer's bf16 model weights) keeps its
// gradient in the dtype it had: each use's gradient is cast back as it arrives, then they are summed there, bit
// for bit as a wide leaf cast at every use (layers/param.h, compute_weight) gets them. The CPU computes in f32,
// so there the wide dtype is f64; the GPU's case is f32 weights against bf16 ones through two linears.
static void expect_stored_leaf_matches_casts(Device dev, DType wide, DType narrow) {
  Rng rng(test_seed());
  const Tensor w0 = random_tensor(rng, {6, 8}, DType::f32).to(narrow).to(wide).to(dev);  // narrow-representable
  const Tensor x = random_tensor(rng, {4, 8}, DType::f32).to(narrow).to(dev);
  const Tensor dy = random_tensor(rng, {4, 6}, DType::f32).to(narrow).to(dev);
  Variable cast_each(w0.clone(), true, "w");
  Variable xv(x);
  add(linear(xv, cast(cast_each, narrow)), scale(linear(xv, cast(cast_each, narrow)), 3.0)).backward(dy);
  Variable stored(w0.clone(), true, "w");
  stored.store_as(w0.to(narrow));
  EXPECT_EQ(stored.dtype(), narrow);
  add(linear(xv, stored), scale(linear(xv, stored), 3.0)).backward(dy);
  ASSERT_EQ(stored.grad().dtype(), wide);
  EXPECT_EQ(stored.grad().to(Device::cpu()).to_doubles(), cast_each.grad().to(Device::cpu()).to_doubles());
  EXPECT_THROW(stored.store_as(Tensor::zeros({6, 9}, narrow, dev)), ShapeError);
}
TEST(Autograd, StoredLeafKeepsItsGradientDtype) {
  expect_stored_leaf_matches_casts(Device::cpu(), DType::f64, DType::f32);
}
TEST(AutogradCuda, StoredLeafKeepsItsGradientDtype) {
  FLOWMOE_REQUIRE_CUDA();
  expect_stored_leaf_matches_casts(Device::cuda(), DType::f32, DType::bf16);
}

TEST(Autograd, NoGradRecordsNothing) {
  Variable x(Tensor::full({3}, 2.0, DType::f32), true);
  NoGradGuard ng;
  Variable y = mul(x, x);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(y.is_leaf());
}

TEST(Autograd, SecondBackwardWithoutRetainThrows) {
  Variable x(Tensor::full({3}, 2.0, DType::f32), true);
  Variable y = sum(mul(x, x));
  y.backward();
  EXPECT_THROW(y.backward(), Error);
  Variable y2 = sum(mul(x, x));
  y2.backward(Tensor(), /*retain_graph=*/true);
  EXPECT_NO_THROW(y2.backward());
}

TEST(Autograd, ScalarBackwardNeedsOneElement) {
  Variable x(Tensor::full({3}, 2.0, DType::f32), true);
  EXPECT_THROW(mul(x, x).backward(), ShapeError);
}

TEST(Autograd, IntegerVariablesCannotRequireGrad) {
  EXPECT_THROW(Variable(Tensor::zeros({2}, DType::i32), true), DTypeError);
}

TEST(Autograd, MismatchesThrowNamingBothSides) {
  Variable a(Tensor::zeros({2, 3}, DType::f32)), b(Tensor::zeros({3, 2}, DType::f32));
  EXPECT_THROW(add(a, b), ShapeError);
  Variable c(Tensor::zeros({2, 3}, DType::f64));
  try {
    add(a, c);
    FAIL();
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("f32 vs f64"), std::string::npos);
  }
  if (cuda_available()) {
    Variable g(Tensor::zeros({2, 3}, DType::f32, Device::cuda()));
    try {
      add(a, g);
      FAIL();
    } catch (const DeviceError& e) {
      EXPECT_NE(std::string(e.what()).find("cpu vs cuda:0"), std::string::npos) << e.what();
    }
  }
}

// A two-layer block run plainly and under checkpoint gives identical gradients, for inputs and for
// parameters the block captures; under checkpoint its inner activations are not kept.
static void checkpoint_equality(Device dev, DType dt) {
  Rng rng(test_seed());
  Tensor x0 = random_tensor(rng, {8, 16}, dt, dev);
  Tensor w0 = random_tensor(rng, {16, 16}, dt, dev);
  auto run = [&](bool use_ckpt) {
    Variable x(x0.clone(), true), w(w0.clone(), true);
    auto block = [&](const std::vector<Variable>& in) {
      Variable h = silu(linear(in[0], w));
      return std::vector<Variable>{mul(h, h)};
    };
    Variable y = use_ckpt ? checkpoint(block, {x})[0] : block({x})[0];
    sum(y).backward();
    return std::make_pair(x.grad(), w.grad());
  };
  auto [gx1, gw1] = run(false);
  auto [gx2, gw2] = run(true);
  EXPECT_TRUE(bit_equal(gx1, gx2));
  EXPECT_TRUE(bit_equal(gw1, gw2));
}

TEST(Checkpoint, GradientsEqualWithAndWithout) { checkpoint_equality(Device::cpu(), DType::f32); }
TEST(CheckpointCuda, GradientsEqualWithAndWithout) {
  FLOWMOE_REQUIRE_CUDA();
  checkpoint_equality(Device::cuda(), DType::bf16);
}

TEST(Checkpoint, DropsActivationsInForward) {
  // Memory check on the host allocator: a checkpointed chain keeps only its input alive.
  Rng rng(1);
  Variable w(random_tensor(rng, {256, 256}), true);
  auto block = [&](const std::vector<Variable>& in) {
    Variable h = in[0];
    for (int i = 0; i < 8; ++i) h = silu(linear(h, w));
    return std::vector<Variable>{h};
  };
  Variable x(random_tensor(rng, {512, 256}), true);
  size_t base = memory_stats(Device::cpu()).live_bytes;
  Variable plain = block({x})[0];
  size_t plain_bytes = memory_stats(Device::cpu()).live_bytes - base;
  plain = Variable();
  size_t base2 = memory_stats(Device::cpu()).live_bytes;
  Variable ck = checkpoint(block, {x})[0];
  size_t ck_bytes = memory_stats(Device::cpu()).live_bytes - base2;
  EXPECT_LT(ck_bytes * 4, plain_bytes) << "checkpoint kept " << ck_bytes << " bytes, plain " << plain_bytes;
  sum(ck).backward();
  EXPECT_TRUE(w.grad().defined());
}

TEST(Autograd, GradcheckOfElementwiseComposition) {
  Rng rng(test_seed());
  auto fn = [](const std::vector<Variable>& v) { return add(mul(v[0], v[1]), scale(v[0], -0.5)); };
  EXPECT_TRUE(gradcheck(fn, {random_tensor(rng, {3, 4}, DType::f64), random_tensor(rng, {3, 4}, DType::f64)}));
}
