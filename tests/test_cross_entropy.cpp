// cross_entropy: gradient check of the CPU reference, agreement with the unfused softmax reference,
// ignored rows, errors, and CUDA vs CPU (f32 and bf16 logits, forward and backward, determinism,
// out-of-range targets trapping) over edge shapes up to a 50257-wide vocab.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

double max_abs(const Tensor& t) {
  double m = 0;
  for (double v : t.to_doubles()) m = std::max(m, std::fabs(v));
  return m;
}

// Targets uniform in [0, V); rows ignore_every-1, 2*ignore_every-1, ... get ignore_index (none when 0).
Tensor random_targets(Rng& rng, int64_t N, int64_t V, int ignore_every, int ignore_index = -100) {
  std::vector<int64_t> t = rng.randint({N}, 0, std::max<int64_t>(V, 1), DType::i64).to_ints();
  for (int64_t i = 0; i < N; ++i)
    if (ignore_every > 0 && i % ignore_every == ignore_every - 1) t[size_t(i)] = ignore_index;
  return Tensor::from_ints(t, {N});
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(CrossEntropy, Gradcheck) {
  Rng rng(test_seed());
  Tensor logits = random_tensor(rng, {5, 7}, DType::f64, Device::cpu(), -3, 3);
  Tensor targets = Tensor::from_ints({3, -100, 0, 6, 2}, {5});
  EXPECT_TRUE(gradcheck([&](const std::vector<Variable>& v) { return cross_entropy(v[0], targets); }, {logits}));
  Tensor other = Tensor::from_ints({1, 1, 4, 0, 6}, {5});  // ignore_index 1 drops rows 0 and 1
  EXPECT_TRUE(gradcheck([&](const std::vector<Variable>& v) { return cross_entropy(v[0], other, 1); }, {logits}));
  Tensor one = random_tensor(rng, {1, 1}, DType::f64);
  EXPECT_TRUE(gradcheck([](const std::vector<Variable>& v) { return cross_entropy(v[0], Tensor::from_ints({0}, {1})); },
                        {one}));
}

// The fused op equals its unfused reference: mean over kept rows of -log softmax(row)[t], and
// d_logits = (softmax - onehot) * d / count.
TEST(CrossEntropy, MatchesSoftmaxComposition) {
  Rng rng(test_seed());
  const int64_t N = 9, V = 11;
  Tensor logits = random_tensor(rng, {N, V}, DType::f64, Device::cpu(), -4, 4);
  Tensor targets = random_targets(rng, N, V, 4);  // rows 3 and 7 ignored
  std::vector<int64_t> t = targets.to_ints();
  std::vector<double> p = softmax(Variable(logits)).data().to_doubles();
  double ref = 0;
  int count = 0;
  for (int64_t r = 0; r < N; ++r)
    if (t[size_t(r)] != -100) ref -= std::log(p[size_t(r * V + t[size_t(r)])]), ++count;
  ref /= count;

  Variable x(logits, true);
  Variable loss = cross_entropy(x, targets);
  EXPECT_EQ(loss.shape(), Shape{});
  EXPECT_EQ(loss.dtype(), DType::f64);
  EXPECT_NEAR(loss.data().to_doubles()[0], ref, 1e-12);
  loss.backward(Tensor::full({}, 1.5, DType::f64));
  std::vector<double> g = x.grad().to_doubles();
  for (int64_t r = 0; r < N; ++r)
    for (int64_t c = 0; c < V; ++c) {
      double want = t[size_t(r)] == -100 ? 0.0 : (p[size_t(r * V + c)] - (c == t[size_t(r)])) * 1.5 / count;
      EXPECT_NEAR(g[size_t(r * V + c)], want, 1e-12) << "row " << r << " col " << c;
    }
}

TEST(CrossEntropy, LargeLogitsStayFinite) {
  Tensor logits = Tensor::from_floats({1e4f, 0, -1e4f, 1e4f, 0, -1e4f}, {2, 3});
  Variable loss = cross_entropy(Variable(logits), Tensor::from_ints({0, 1}, {2}));
  EXPECT_EQ(loss.dtype(), DType::f32);
  EXPECT_FLOAT_EQ(loss.data().to_floats()[0], 5000.f);  // (0 + 1e4) / 2
}

TEST(CrossEntropy, AllIgnoredOrNoRowsGivesZero) {
  for (int64_t N : {0, 3}) {
    SCOPED_TRACE(N);
    Variable x(Tensor::full({N, 4}, 0.5, DType::f32), true);
    Variable loss = cross_entropy(x, Tensor::from_ints(std::vector<int64_t>(size_t(N), -100), {N}));
    EXPECT_EQ(loss.data().to_floats()[0], 0.f);
    loss.backward();
    EXPECT_EQ(x.grad().shape(), (Shape{N, 4}));
    for (float g : x.grad().to_floats()) EXPECT_EQ(g, 0.f);
  }
}

TEST(CrossEntropy, Errors) {
  Variable x(Tensor::zeros({3, 5}, DType::f32));
  std::string msg = error_of([&] { cross_entropy(x, Tensor::from_ints({0, 7, 1}, {3})); });
  EXPECT_NE(msg.find("target 7 of row 1"), std::string::npos) << msg;
  msg = error_of([&] { cross_entropy(x, Tensor::from_ints({0, 1, -1}, {3})); });  // -1 is not ignore_index
  EXPECT_NE(msg.find("target -1 of row 2"), std::string::npos) << msg;
  EXPECT_THROW(cross_entropy(x, Tensor::from_ints({0, 1}, {2})), ShapeError);
  EXPECT_THROW(cross_entropy(x, Tensor::from_ints({0, 1, 2}, {3}, DType::i64)), DTypeError);
  EXPECT_THROW(cross_entropy(Variable(Tensor::zeros({3, 5, 1}, DType::f32)), Tensor::from_ints({0, 1, 2}, {3})),
               ShapeError);
  EXPECT_THROW(cross_entropy(Variable(Tensor::zeros({3, 0}, DType::f32)), Tensor::from_ints({0, 1, 2}, {3})),
               ShapeError);
  EXPECT_THROW(cross_entropy(Variable(Tensor::zeros({3, 5}, DType::bf16)), Tensor::from_ints({0, 1, 2}, {3})),
               DTypeError);  // bf16 is GPU-only
  EXPECT_THROW(cross_entropy(x, Tensor()), Error);
}

// Loss: both sides compute in fp32 (CPU accumulates in double) on the same rounded logits and give
// f32: 1e-5 relative. Gradient: f32 1e-4 relative (expf vs exp, lse differences), absolute floor
// scaled to max |d_logits|; bf16 adds one rounding of the output (2^-9 relative).
TEST(CrossEntropyCuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (int64_t N : {0, 1, 7, 300})
    for (int64_t V : {1, 33, 1000, 50257})
      for (DType dt : {DType::f32, DType::bf16}) {
        SCOPED_TRACE("N " + std::to_string(N) + " V " + std::to_string(V) + " " + dtype_name(dt));
        Tensor logits = random_tensor(rng, {N, V}, DType::f32, Device::cpu(), -4, 4).to(dt);
        Tensor targets = random_targets(rng, N, V, 5);  // rows 4, 9, ... ignored
        auto run = [&](Device dev, DType t) {
          Variable x(logits.to(t).to(dev), true);
          Variable loss = cross_entropy(x, targets.to(dev));
          loss.backward(Tensor::full({}, 2.5, DType::f32, dev));
          return std::make_pair(loss.data().to(Device::cpu()), x.grad().to(Device::cpu()));
        };
        auto [ref_loss, ref_grad] = run(Device::cpu(), DType::f32);
        auto [loss, grad] = run(Device::cuda(), dt);
        EXPECT_EQ(loss.dtype(), DType::f32);
        EXPECT_EQ(loss.shape(), Shape{});
        EXPECT_EQ(grad.dtype(), dt);
        EXPECT_TRUE(all_close(loss, ref_loss, 1e-5, 1e-6));
        double rtol = dt == DType::f32 ? 1e-4 : 1.0 / 128;
        EXPECT_TRUE(all_close(grad, ref_grad, rtol, 1e-6 * max_abs(ref_grad)));
      }
}

TEST(CrossEntropyCuda, IgnoredRowsAndOtherIgnoreIndex) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  Tensor logits = random_tensor(rng, {6, 129}, DType::f32, Device::cpu(), -2, 2);
  for (int ignore_index : {-100, 0}) {
    SCOPED_TRACE(ignore_index);
    Tensor all_ignored = Tensor::from_ints(std::vector<int64_t>(6, ignore_index), {6});
    Variable x(logits.to(Device::cuda()), true);
    Variable loss = cross_entropy(x, all_ignored.to(Device::cuda()), ignore_index);
    EXPECT_EQ(loss.data().to_floats()[0], 0.f);
    loss.backward();
    EXPECT_EQ(max_abs(x.grad()), 0.0);

    Tensor some = random_targets(rng, 6, 129, 2, ignore_index);
    Variable cx(logits, true), gx(logits.to(Device::cuda()), true);
    Variable ref = cross_entropy(cx, some, ignore_index);
    Variable got = cross_entropy(gx, some.to(Device::cuda()), ignore_index);
    EXPECT_TRUE(all_close(got.data(), ref.data(), 1e-5, 1e-6));
    ref.backward();
    got.backward();
    EXPECT_TRUE(all_close(gx.grad(), cx.grad(), 1e-4, 1e-6 * max_abs(cx.grad())));
  }
}

TEST(CrossEntropyCuda, Deterministic) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  Tensor logits = random_tensor(rng, {4096, 1000}, DType::f32, Device::cuda(), -4, 4).to(DType::bf16);
  Tensor targets = random_targets(rng, 4096, 1000, 7).to(Device::cuda());
  auto run = [&] {
    Variable x(logits, true);
    Variable loss = cross_entropy(x, targets);
    loss.backward();
    return std::make_pair(loss.data(), x.grad());
  };
  auto [l1, g1] = run();
  auto [l2, g2] = run();
  EXPECT_TRUE(bit_equal(l1, l2));
  EXPECT_TRUE(bit_equal(g1, g2));
}

// The kernel traps on a bad target, which leaves the CUDA context unusable: run it in a fresh
// process (threadsafe death tests re-execute the binary) and expect the next sync to fail.
TEST(CrossEntropyCudaDeathTest, OutOfRangeTargetTraps) {
  FLOWMOE_REQUIRE_CUDA();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        Tensor logits = Tensor::zeros({3, 5}, DType::f32, Device::cuda());
        Tensor targets = Tensor::from_ints({0, 9, 1}, {3}, DType::i32, Device::cuda());
        try {
          Variable loss = cross_entropy(Variable(logits), targets);
          cuda_synchronize(0);
        } catch (const Error& e) {  // CudaError from the sync after the trap
          std::fprintf(stderr, "trapped: %s\n", e.what());
          std::abort();
        }
      },
      "trapped");
}
