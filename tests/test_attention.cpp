// causal_attention: identities and gradient check of the CPU reference; CUDA vs a CPU f64 reference
// (f32, bf16), forward and backward, over edge shapes; shape and dtype errors.
#include <algorithm>
#include <cmath>

#include "tests/test_util.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v) {
  NoGradGuard no_grad;
  return causal_attention(Variable(q), Variable(k), Variable(v)).data();
}

struct Result {
  Tensor out, d_q, d_k, d_v;
};

// Output and the gradients of sum(o * d_out), on the inputs' device.
Result attend_with_grads(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& d_out) {
  Variable qv(q, true), kv(k, true), vv(v, true);
  Variable o = causal_attention(qv, kv, vv);
  o.backward(d_out);
  return {o.data(), qv.grad(), kv.grad(), vv.grad()};
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (double x : t.to_doubles()) m = std::max(m, std::fabs(x));
  return m;
}

// Elementwise within rtol plus an absolute slack of atol_frac * max|ref|, and normwise within max_rel.
::testing::AssertionResult close_to(const Tensor& got, const Tensor& ref, double rtol, double atol_frac,
                                    double max_rel) {
  // Inputs are O(1), so the absolute floor never drops below atol_frac: a gradient that is exactly
  // zero in exact math (T = 1: d_q = d_k = 0) still gets fp32 rounding residue on the GPU.
  const double ref_max = max_abs(ref);
  ::testing::AssertionResult r = all_close(got, ref, rtol, atol_frac * std::max(ref_max, 1.0));
  if (!r || ref_max == 0) return r;
  double e = rel_error(got, ref);
  if (e > max_rel) return ::testing::AssertionFailure() << "relative error " << e << " > " << max_rel;
  return ::testing::AssertionSuccess();
}

}  // namespace

TEST(Attention, Gradcheck) {
  Rng rng(test_seed());
  for (const Shape& s : {Shape{2, 5, 2, 3}, Shape{1, 1, 1, 4}, Shape{1, 7, 1, 8}}) {
    SCOPED_TRACE(shape_str(s));
    Tensor q = random_tensor(rng, s, DType::f64), k = random_tensor(rng, s, DType::f64);
    Tensor v = random_tensor(rng, s, DType::f64);
    EXPECT_TRUE(gradcheck([](const std::vector<Variable>& x) { return causal_attention(x[0], x[1], x[2]); },
                          {q, k, v}));
  }
}

// With q = 0 every visible key gets the same weight, so o_t is the mean of v_0..v_t. v encodes its
// batch, head, position and column, so a wrong row or a leak from the future shows in the value.
TEST(Attention, ZeroQueriesAverageThePast) {
  const int64_t B = 2, T = 6, nh = 3, hd = 4;
  std::vector<double> vs(size_t(B * T * nh * hd));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t d = 0; d < hd; ++d)
          vs[size_t(((b * T + t) * nh + h) * hd + d)] =
              double(t + 1) + 100.0 * double(h) + 1000.0 * double(b) + 0.01 * double(d);
  Rng rng(test_seed());
  Tensor q = Tensor::zeros({B, T, nh, hd}, DType::f64), k = random_tensor(rng, {B, T, nh, hd}, DType::f64);
  std::vector<double> got = attend(q, k, Tensor::from_doubles(vs, {B, T, nh, hd})).to_doubles();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t d = 0; d < hd; ++d) {
          double want = double(t + 2) / 2 + 100.0 * double(h) + 1000.0 * double(b) + 0.01 * double(d);
          EXPECT_NEAR(got[size_t(((b * T + t) * nh + h) * hd + d)], want, 1e-9)
              << "b " << b << " t " << t << " h " << h << " d " << d;
        }
}

TEST(Attention, SingleTokenReturnsValueAndFutureDoesNotLeak) {
  Rng rng(test_seed());
  const Shape s{2, 9, 2, 8};
  Tensor q = random_tensor(rng, s, DType::f64), k = random_tensor(rng, s, DType::f64);
  Tensor v = random_tensor(rng, s, DType::f64);
  Tensor q1 = q.slice(1, 0, 1).contiguous(), k1 = k.slice(1, 0, 1).contiguous(), v1 = v.slice(1, 0, 1).contiguous();
  EXPECT_TRUE(all_close(attend(q1, k1, v1), v1, 1e-15, 0));
  // Changing keys and values after position 4 leaves o[:, :5] unchanged, bit for bit.
  auto scramble_future = [&](const Tensor& x) {
    std::vector<double> xs = x.to_doubles();
    for (int64_t b = 0; b < 2; ++b)
      for (size_t e = size_t((b * 9 + 5) * 16); e < size_t((b * 9 + 9) * 16); ++e) xs[e] = 3.0 * rng.next_uniform();
    return Tensor::from_doubles(xs, s);
  };
  Tensor k2 = scramble_future(k), v2 = scramble_future(v);
  EXPECT_TRUE(bit_equal(attend(q, k, v).slice(1, 0, 5).contiguous(), attend(q, k2, v2).slice(1, 0, 5).contiguous()));
}

TEST(Attention, NonContiguousInputs) {
  Rng rng(test_seed());
  Tensor qkv = random_tensor(rng, {2, 7, 3, 24}, DType::f64);  // q, k, v side by side in the last dim
  Tensor q = qkv.slice(3, 0, 8), k = qkv.slice(3, 8, 16), v = qkv.slice(3, 16, 24);
  ASSERT_FALSE(q.is_contiguous());
  EXPECT_TRUE(bit_equal(attend(q, k, v), attend(q.contiguous(), k.contiguous(), v.contiguous())));
}

// The f32 instantiation of the reference against f64 on the same values (1e-3 relative + 1e-5 max|ref|).
TEST(Attention, F32MatchesF64) {
  Rng rng(test_seed());
  const Shape s{2, 50, 3, 16};
  Tensor q = random_tensor(rng, s), k = random_tensor(rng, s), v = random_tensor(rng, s), d_out = random_tensor(rng, s);
  Result got = attend_with_grads(q, k, v, d_out);
  Result ref = attend_with_grads(q.to(DType::f64), k.to(DType::f64), v.to(DType::f64), d_out.to(DType::f64));
  EXPECT_EQ(got.out.dtype(), DType::f32);
  EXPECT_TRUE(close_to(got.out, ref.out, 1e-3, 1e-5, 1e-5)) << "out";
  EXPECT_TRUE(close_to(got.d_q, ref.d_q, 1e-3, 1e-5, 1e-5)) << "d_q";
  EXPECT_TRUE(close_to(got.d_k, ref.d_k, 1e-3, 1e-5, 1e-5)) << "d_k";
  EXPECT_TRUE(close_to(got.d_v, ref.d_v, 1e-3, 1e-5, 1e-5)) << "d_v";
}

TEST(Attention, EmptyShapes) {
  for (const Shape& s : {Shape{0, 4, 2, 8}, Shape{2, 0, 2, 8}, Shape{2, 3, 0, 8}}) {
    SCOPED_TRACE(shape_str(s));
    Tensor x = Tensor::zeros(s, DType::f32);
    Result r = attend_with_grads(x, x, x, x);
    EXPECT_EQ(r.out.shape(), s);
    EXPECT_EQ(r.d_q.shape(), s);
    EXPECT_EQ(r.d_k.shape(), s);
    EXPECT_EQ(r.d_v.shape(), s);
  }
}

TEST(Attention, Errors) {
  Variable q(Tensor::zeros({2, 4, 2, 8}, DType::f32)), k(Tensor::zeros({2, 5, 2, 8}, DType::f32));
  try {
    causal_attention(q, k, q);
    FAIL() << "q/k shape mismatch accepted";
  } catch (const ShapeError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("[2, 4, 2, 8]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[2, 5, 2, 8]"), std::string::npos) << msg;
  }
  EXPECT_THROW(causal_attention(q, q, k), ShapeError);  // v differs
  Variable flat(Tensor::zeros({4, 2, 8}, DType::f32));
  EXPECT_THROW(causal_attention(flat, flat, flat), ShapeError);
  Variable q64(Tensor::zeros({2, 4, 2, 8}, DType::f64));
  EXPECT_THROW(causal_attention(q, q64, q), DTypeError);
  Variable qb(Tensor::zeros({2, 4, 2, 8}, DType::bf16));
  EXPECT_THROW(causal_attention(qb, qb, qb), DTypeError);  // bf16 math is GPU-only
}

// GPU vs the CPU reference run in f64 on the same (rounded) values.
// f32: elementwise within 1e-3 relative + 1e-5 * max|ref|, and 2e-5 normwise.
// bf16 (fp32 inside, outputs and gradients rounded once; delta uses the rounded o as flash attention
// does): elementwise within 1e-2 relative + 5e-3 * max|ref|, and 5e-3 normwise (typical: 1.5e-3 to 2e-3).
TEST(AttentionCuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const Shape shapes[] = {{1, 1, 1, 16},  {2, 37, 3, 16},  {1, 100, 2, 64},  {2, 65, 2, 128}, {1, 129, 1, 24},
                          {1, 64, 2, 32}, {2, 1024, 8, 64}, {1, 2048, 1, 128}, {0, 16, 2, 64},  {2, 0, 2, 64}};
  for (const Shape& s : shapes) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(shape_str(s) + " " + dtype_name(dtype));
      Tensor q = random_tensor(rng, s, dtype), k = random_tensor(rng, s, dtype), v = random_tensor(rng, s, dtype);
      Tensor d_out = random_tensor(rng, s, dtype);
      Result ref = attend_with_grads(q.to(DType::f64), k.to(DType::f64), v.to(DType::f64), d_out.to(DType::f64));
      Result got = attend_with_grads(q.to(Device::cuda()), k.to(Device::cuda()), v.to(Device::cuda()),
                                     d_out.to(Device::cuda()));
      ASSERT_EQ(got.out.dtype(), dtype);
      const bool f32 = dtype == DType::f32;
      const double rtol = f32 ? 1e-3 : 1e-2, atol_frac = f32 ? 1e-5 : 5e-3, max_rel = f32 ? 2e-5 : 5e-3;
      EXPECT_TRUE(close_to(got.out, ref.out, rtol, atol_frac, max_rel)) << "out";
      EXPECT_TRUE(close_to(got.d_q, ref.d_q, rtol, atol_frac, max_rel)) << "d_q";
      EXPECT_TRUE(close_to(got.d_k, ref.d_k, rtol, atol_frac, max_rel)) << "d_k";
      EXPECT_TRUE(close_to(got.d_v, ref.d_v, rtol, atol_frac, max_rel)) << "d_v";
    }
  }
}

// No atomics: two runs give the same bits.
TEST(AttentionCuda, Deterministic) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const Shape s{2, 300, 4, 64};
  auto draw = [&] { return random_tensor(rng, s, DType::bf16, Device::cuda()); };
  Tensor q = draw(), k = draw(), v = draw(), d_out = draw();
  Result a = attend_with_grads(q, k, v, d_out), b = attend_with_grads(q, k, v, d_out);
  EXPECT_TRUE(bit_equal(a.out, b.out));
  EXPECT_TRUE(bit_equal(a.d_q, b.d_q));
  EXPECT_TRUE(bit_equal(a.d_k, b.d_k));
  EXPECT_TRUE(bit_equal(a.d_v, b.d_v));
}

TEST(AttentionCuda, Errors) {
  FLOWMOE_REQUIRE_CUDA();
  Variable big(Tensor::zeros({1, 4, 1, 256}, DType::f32, Device::cuda()));
  EXPECT_THROW(causal_attention(big, big, big), ShapeError);  // head_dim > 128
  Variable q(Tensor::zeros({1, 4, 2, 8}, DType::f32, Device::cuda()));
  Variable k(Tensor::zeros({1, 4, 2, 16}, DType::f32, Device::cuda()));
  EXPECT_THROW(causal_attention(q, k, q), ShapeError);
  Variable on_cpu(Tensor::zeros({1, 4, 2, 8}, DType::f32));
  EXPECT_THROW(causal_attention(q, on_cpu, q), DeviceError);
}
