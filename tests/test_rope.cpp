// rope: rotation identities and gradient check of the CPU reference; CUDA vs CPU (f32, bf16), forward
// and backward, over edge shapes; shape errors. rope_qk: the queries' and keys' rope in one node, each output and
// gradient rope's own bit for bit (CPU, and on the GPU where one launch does both), its gradient check and errors.
#include <cmath>

#include "layers/attention.h"
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

Tensor rope_of(const Tensor& x, double theta, int64_t pos_offset) {
  NoGradGuard no_grad;
  return rope(Variable(x), theta, pos_offset).data();
}

// Gradient of sum(rope(x) * d_out) with respect to x, on x's device.
Tensor rope_grad(const Tensor& x, const Tensor& d_out, double theta, int64_t pos_offset) {
  Variable xv(x, true);
  rope(xv, theta, pos_offset).backward(d_out);
  return xv.grad();
}

// Same shape, dtype and bits (read back on the CPU).
bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         a.to(Device::cpu()).to_doubles() == b.to(Device::cpu()).to_doubles();
}

// rope_qk of q and k, and the gradients of sum(q' * d_q + k' * d_k) with respect to q and k: {q', k', dq, dk}.
std::vector<Tensor> rope_qk_run(const Tensor& q, const Tensor& k, const Tensor& d_q, const Tensor& d_k, double theta,
                                int64_t pos_offset) {
  Variable qv(q, true), kv(k, true);
  const auto [qr, kr] = rope_qk(qv, kv, theta, pos_offset);
  backward({qr, kr}, {d_q, d_k});
  return {qr.data(), kr.data(), qv.grad(), kv.grad()};
}

// rope_qk's outputs and gradients are rope's of q and of k alone, bit for bit, on q's device.
void expect_rope_qk_is_rope_of_each(const Tensor& q, const Tensor& k, const Tensor& d_q, const Tensor& d_k,
                                    double theta, int64_t pos_offset) {
  const std::vector<Tensor> got = rope_qk_run(q, k, d_q, d_k, theta, pos_offset);
  EXPECT_TRUE(bitwise_equal(got[0], rope_of(q, theta, pos_offset)));
  EXPECT_TRUE(bitwise_equal(got[1], rope_of(k, theta, pos_offset)));
  EXPECT_TRUE(bitwise_equal(got[2], rope_grad(q, d_q, theta, pos_offset)));
  EXPECT_TRUE(bitwise_equal(got[3], rope_grad(k, d_k, theta, pos_offset)));
}

}  // namespace

// Queries of 3 heads beside keys of 3 heads, and of 1 (a shared rope key), at position offsets 0 and 5.
TEST(RopeQk, IsRopeOfEachBitwise) {
  Rng rng(test_seed());
  for (int64_t k_heads : {3, 1}) {
    for (DType dt : {DType::f32, DType::f64}) {
      SCOPED_TRACE(std::to_string(k_heads) + " key heads, " + dtype_name(dt));
      const Tensor q = random_tensor(rng, {2, 5, 3, 8}, dt), d_q = random_tensor(rng, {2, 5, 3, 8}, dt);
      const Tensor k = random_tensor(rng, {2, 5, k_heads, 8}, dt), d_k = random_tensor(rng, {2, 5, k_heads, 8}, dt);
      expect_rope_qk_is_rope_of_each(q, k, d_q, d_k, 10000.0, 0);
      expect_rope_qk_is_rope_of_each(q, k, d_q, d_k, 500.0, 5);
    }
  }
}

TEST(RopeQk, Gradcheck) {
  Rng rng(test_seed());
  const Tensor q = random_tensor(rng, {2, 3, 2, 6}, DType::f64), k = random_tensor(rng, {2, 3, 1, 6}, DType::f64);
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Variable>& v) {
        const auto [q2, k2] = rope_qk(v[0], v[1], 500.0, 7);
        return add(sum(mul(q2, q2)), sum(k2));  // both outputs reach the result
      },
      {q, k}));
}

TEST(RopeQk, Errors) {
  const Variable q(Tensor::zeros({1, 4, 2, 8}, DType::f32));
  EXPECT_THROW(rope_qk(q, Variable(Tensor::zeros({1, 3, 2, 8}, DType::f32)), 10000.0), ShapeError);  // T
  EXPECT_THROW(rope_qk(q, Variable(Tensor::zeros({1, 4, 2, 6}, DType::f32)), 10000.0), ShapeError);  // head_dim
  EXPECT_THROW(rope_qk(q, Variable(Tensor::zeros({1, 4, 2, 8}, DType::f64)), 10000.0), DTypeError);
  EXPECT_THROW(rope_qk(q, Variable(Tensor::zeros({1, 4, 2, 7}, DType::f32)), 10000.0), ShapeError);  // odd
}

TEST(Rope, Gradcheck) {
  Rng rng(test_seed());
  Tensor x = random_tensor(rng, {2, 3, 2, 6}, DType::f64);
  EXPECT_TRUE(gradcheck([](const std::vector<Variable>& v) { return rope(v[0], 10000.0, 0); }, {x}));
  EXPECT_TRUE(gradcheck([](const std::vector<Variable>& v) { return rope(v[0], 500.0, 7); }, {x}));
}

// Pair i of a head at position p holds (i + 1, 0): it must come out as (i + 1) (cos a, sin a),
// a = p * theta^(-2i/hd). Heads get distinct scales so a wrong head or pair is named by its value.
TEST(Rope, RotatesEachPairByItsAngle) {
  const int64_t B = 2, T = 5, nh = 3, hd = 8, offset = 11;
  const double theta = 100.0;
  std::vector<double> xs(size_t(B * T * nh * hd), 0.0);
  for (int64_t r = 0; r < B * T * nh; ++r)
    for (int64_t i = 0; i < hd / 2; ++i) xs[size_t(r * hd + 2 * i)] = double((r % nh + 1) * 10 + i + 1);
  Tensor out = rope_of(Tensor::from_doubles(xs, {B, T, nh, hd}), theta, offset);
  std::vector<double> got = out.to_doubles();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t i = 0; i < hd / 2; ++i) {
          const size_t e = size_t(((b * T + t) * nh + h) * hd + 2 * i);
          const double a = double(offset + t) * std::pow(theta, -2.0 * double(i) / double(hd));
          const double r = xs[e];
          EXPECT_NEAR(got[e], r * std::cos(a), 1e-12) << "b " << b << " t " << t << " h " << h << " pair " << i;
          EXPECT_NEAR(got[e + 1], r * std::sin(a), 1e-12) << "b " << b << " t " << t << " h " << h << " pair " << i;
        }
}

TEST(Rope, PositionZeroIsIdentityAndBackwardInverts) {
  Rng rng(test_seed());
  Tensor x = random_tensor(rng, {1, 1, 4, 16}, DType::f64);
  EXPECT_TRUE(all_close(rope_of(x, 10000.0, 0), x, 0, 0));  // angle 0 at t = 0, offset 0
  Tensor y = random_tensor(rng, {2, 9, 3, 16}, DType::f64);
  // The vjp of a rotation is the inverse rotation: grad of sum(rope(x) * rope(y)) is y.
  EXPECT_TRUE(all_close(rope_grad(y, rope_of(y, 10000.0, 5), 10000.0, 5), y, 1e-12, 1e-12));
}

// f32 rounds cos/sin once and the two products: within 1e-6 absolute of f64 for |x| <= 1.
TEST(Rope, F32MatchesF64) {
  Rng rng(test_seed());
  Tensor x = random_tensor(rng, {2, 33, 3, 64}), dy = random_tensor(rng, {2, 33, 3, 64});
  EXPECT_TRUE(all_close(rope_of(x, 10000.0, 1000), rope_of(x.to(DType::f64), 10000.0, 1000), 0, 1e-6));
  EXPECT_TRUE(all_close(rope_grad(x, dy, 10000.0, 1000), rope_grad(x.to(DType::f64), dy.to(DType::f64), 10000.0, 1000),
                        0, 1e-6));
}

TEST(Rope, EmptyShapes) {
  for (const Shape& s : {Shape{0, 4, 2, 8}, Shape{2, 0, 2, 8}, Shape{2, 3, 0, 8}}) {
    Tensor x = Tensor::zeros(s, DType::f32);
    EXPECT_EQ(rope_of(x, 10000.0, 0).shape(), s);
    EXPECT_EQ(rope_grad(x, x, 10000.0, 0).shape(), s);
  }
}

TEST(Rope, Errors) {
  Variable odd(Tensor::zeros({1, 2, 2, 7}, DType::f32));
  try {
    rope(odd, 10000.0);
    FAIL() << "odd head_dim accepted";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("[1, 2, 2, 7]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(rope(Variable(Tensor::zeros({2, 2, 8}, DType::f32)), 10000.0), ShapeError);
  EXPECT_THROW(rope(Variable(Tensor::zeros({1, 2, 2, 8}, DType::f32)), 0.0), Error);
  EXPECT_THROW(rope(Variable(Tensor::zeros({1, 2, 2, 8}, DType::bf16)), 10000.0), DTypeError);  // CPU: f32/f64
}

// Angles and cos/sin are computed in double on both sides, so f32 differs only in the final
// x0 c - x1 s (fused on the GPU): |got - ref| <= 1e-6 + 1e-5 |ref| for |x| <= 1. bf16 is computed in
// fp32 from the same bf16 inputs and rounded once: within one bf16 ulp (at most 2^-7 relative) of the
// CPU's f32 result rounded to bf16.
TEST(RopeCuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  struct Case {
    Shape shape;
    double theta;
    int64_t offset;
  };
  const Case cases[] = {{{1, 1, 1, 2}, 10000.0, 0},        {{2, 37, 3, 16}, 10000.0, 0},
                        {{1, 100, 4, 128}, 500000.0, 3},   {{2, 1024, 8, 64}, 10000.0, 0},
                        {{3, 65, 2, 64}, 10000.0, 100000}, {{0, 5, 2, 16}, 10000.0, 0},
                        {{2, 0, 2, 16}, 10000.0, 0}};
  for (const Case& c : cases) {
    SCOPED_TRACE(shape_str(c.shape) + " offset " + std::to_string(c.offset));
    Tensor x = random_tensor(rng, c.shape), dy = random_tensor(rng, c.shape);
    Tensor gx = x.to(Device::cuda()), gdy = dy.to(Device::cuda());
    EXPECT_TRUE(all_close(rope_of(gx, c.theta, c.offset), rope_of(x, c.theta, c.offset), 1e-5, 1e-6));
    EXPECT_TRUE(all_close(rope_grad(gx, gdy, c.theta, c.offset), rope_grad(x, dy, c.theta, c.offset), 1e-5, 1e-6));

    Tensor xb = x.to(DType::bf16), dyb = dy.to(DType::bf16);
    Tensor ref = rope_of(xb.to(DType::f32), c.theta, c.offset).to(DType::bf16);
    Tensor ref_grad = rope_grad(xb.to(DType::f32), dyb.to(DType::f32), c.theta, c.offset).to(DType::bf16);
    Tensor got = rope_of(xb.to(Device::cuda()), c.theta, c.offset);
    Tensor got_grad = rope_grad(xb.to(Device::cuda()), dyb.to(Device::cuda()), c.theta, c.offset);
    EXPECT_EQ(got.dtype(), DType::bf16);
    EXPECT_TRUE(all_close(got, ref, 1.0 / 128, 1e-6));
    EXPECT_TRUE(all_close(got_grad, ref_grad, 1.0 / 128, 1e-6));
  }
}

TEST(RopeCuda, Errors) {
  FLOWMOE_REQUIRE_CUDA();
  EXPECT_THROW(rope(Variable(Tensor::zeros({1, 2, 2, 9}, DType::f32, Device::cuda())), 10000.0), ShapeError);
}

// The attention layer rotates q and k in one rope_qk node: its output and every gradient are those of two separate
// ropes bit for bit (the gradient sums run in the same order), with the layer's own weights.
TEST(RopeQk, AttentionLayerGivesTheBitsOfSeparateRopes) {
  ParamFactory f(3, Device::cpu());
  const Attention attn(f, "self_attn", 16, 2, 10000.0, 0.2, 0.2);
  const std::vector<Variable>& w = f.params();  // q, k, v, o
  ASSERT_EQ(w.size(), 4u);
  Rng rng(test_seed());
  const Tensor x = random_tensor(rng, {2, 5, 16}), dy = random_tensor(rng, {2, 5, 16});
  std::vector<Tensor> got, want;
  for (bool layer : {true, false}) {
    for (Variable p : w) p.zero_grad();  // a handle: clears the parameter's own gradient
    Variable xv(x, true), y;
    if (layer) {
      y = attn.forward(xv, DType::f32);
    } else {
      const Shape heads = {2, 5, 2, 8};
      const Variable q = rope(reshape(linear(xv, w[0]), heads), 10000.0);
      const Variable k = rope(reshape(linear(xv, w[1]), heads), 10000.0);
      const Variable v = reshape(linear(xv, w[2]), heads);
      y = linear(reshape(causal_attention(q, k, v), {2, 5, 16}), w[3]);
    }
    y.backward(dy);
    std::vector<Tensor>& out = layer ? got : want;
    out = {y.data(), xv.grad()};
    for (const Variable& p : w) out.push_back(p.grad());
  }
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(bitwise_equal(got[i], want[i])) << i;
}

// One launch for q and k gives each tensor's own launch bit for bit (f32, bf16: the same table and arithmetic), and
// the CPU's within rope's tolerances; key heads 1 and as many as the queries', edge shapes included.
TEST(RopeQkCuda, MatchesRopeOfEachAndCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const Shape q_shapes[] = {{2, 37, 3, 16}, {1, 100, 4, 128}, {2, 0, 2, 16}, {1, 3, 8, 64}};
  for (const Shape& qs : q_shapes) {
    for (int64_t k_heads : {qs[2], int64_t(1)}) {
      const Shape ks = {qs[0], qs[1], k_heads, qs[3]};
      SCOPED_TRACE(shape_str(qs) + " keys " + shape_str(ks));
      const Tensor q = random_tensor(rng, qs), k = random_tensor(rng, ks);
      const Tensor d_q = random_tensor(rng, qs), d_k = random_tensor(rng, ks);
      const Tensor cpu[2] = {rope_of(q, 10000.0, 3), rope_of(k, 10000.0, 3)};
      const Tensor cpu_grad[2] = {rope_grad(q, d_q, 10000.0, 3), rope_grad(k, d_k, 10000.0, 3)};
      for (DType dt : {DType::f32, DType::bf16}) {
        SCOPED_TRACE(dtype_name(dt));
        const Tensor gq = q.to(dt).to(Device::cuda()), gk = k.to(dt).to(Device::cuda());
        const Tensor gdq = d_q.to(dt).to(Device::cuda()), gdk = d_k.to(dt).to(Device::cuda());
        expect_rope_qk_is_rope_of_each(gq, gk, gdq, gdk, 10000.0, 3);
        const std::vector<Tensor> got = rope_qk_run(gq, gk, gdq, gdk, 10000.0, 3);
        // bf16: the inputs' rounding (2^-9 relative, |x| <= 1) and the output's.
        const double rtol = dt == DType::f32 ? 1e-5 : 1.0 / 64, atol = dt == DType::f32 ? 1e-6 : 1e-2;
        const Tensor want[4] = {cpu[0], cpu[1], cpu_grad[0], cpu_grad[1]};
        for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(all_close(got[i].to(DType::f32), want[i], rtol, atol)) << i;
      }
    }
  }
}
