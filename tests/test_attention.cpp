// causal_attention: identities and gradient check of the CPU reference; CUDA vs a CPU f64 reference
// (f32, bf16), forward and backward, over edge shapes, MLA's value heads of their own width and the wide heads
// (q, k 192, v 128); shape and dtype errors. The kernels called directly: tests/test_flash_attention.cpp.
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "tests/support/attention_checks.h"
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v) {
  NoGradGuard no_grad;
  return causal_attention(Variable(q), Variable(k), Variable(v)).data();
}

// The GPU's output and gradients for q, k [s] and v, d_out [s with head width v_hd] against the CPU's f64 kernels.
// f32: elementwise within 1e-3 relative + 1e-5 * max|ref|, and 2e-5 normwise; bf16: the tensor-core tolerances.
void expect_cuda_matches_f64(Rng& rng, const Shape& s, int64_t v_hd, DType dtype) {
  SCOPED_TRACE(shape_str(s) + " v " + std::to_string(v_hd) + " " + dtype_name(dtype));
  const Shape vs = {s[0], s[1], s[2], v_hd};
  Tensor q = random_tensor(rng, s, dtype), k = random_tensor(rng, s, dtype), v = random_tensor(rng, vs, dtype);
  Tensor d_out = random_tensor(rng, vs, dtype);
  Result ref = attend_with_grads(q.to(DType::f64), k.to(DType::f64), v.to(DType::f64), d_out.to(DType::f64));
  Result got =
      attend_with_grads(q.to(Device::cuda()), k.to(Device::cuda()), v.to(Device::cuda()), d_out.to(Device::cuda()));
  ASSERT_EQ(got.out.dtype(), dtype);
  ASSERT_EQ(got.out.shape(), vs);
  ASSERT_EQ(got.d_v.shape(), vs);
  const bool f32 = dtype == DType::f32;
  const double rtol = f32 ? 1e-3 : kFlashRtol, atol_frac = f32 ? 1e-5 : kFlashAtolFrac;
  const double max_rel = f32 ? 2e-5 : kFlashMaxRel;
  EXPECT_TRUE(close_to(got.out, ref.out, rtol, atol_frac, max_rel)) << "out";
  EXPECT_TRUE(close_to(got.d_q, ref.d_q, rtol, atol_frac, max_rel)) << "d_q";
  EXPECT_TRUE(close_to(got.d_k, ref.d_k, rtol, atol_frac, max_rel)) << "d_k";
  EXPECT_TRUE(close_to(got.d_v, ref.d_v, rtol, atol_frac, max_rel)) << "d_v";
}

}  // namespace

TEST(Attention, Gradcheck) {
  Rng rng(test_seed());
  for (const Shape& s : {Shape{2, 5, 2, 3}, Shape{1, 1, 1, 4}, Shape{1, 7, 1, 8}}) {
    SCOPED_TRACE(shape_str(s));
    Tensor q = random_tensor(rng, s, DType::f64), k = random_tensor(rng, s, DType::f64);
    Tensor v = random_tensor(rng, s, DType::f64);
    EXPECT_TRUE(
        gradcheck([](const std::vector<Variable>& x) { return causal_attention(x[0], x[1], x[2]); }, {q, k, v}));
  }
}

// MLA's value head is a width of its own (layers/mla.h). Gradients in f64 for a narrower and a wider v.
TEST(Attention, ValueHeadOfItsOwnWidthGradcheck) {
  Rng rng(test_seed());
  for (int64_t v_hd : {2, 5}) {
    SCOPED_TRACE(v_hd);
    const Shape s = {2, 5, 2, 3};
    Tensor q = random_tensor(rng, s, DType::f64), k = random_tensor(rng, s, DType::f64);
    Tensor v = random_tensor(rng, {2, 5, 2, v_hd}, DType::f64);
    EXPECT_TRUE(
        gradcheck([](const std::vector<Variable>& x) { return causal_attention(x[0], x[1], x[2]); }, {q, k, v}));
  }
}

// A narrower v gives the first columns of the same attention over a wider v (whose other columns change
// nothing), and a v wider than q equals attention with q and k padded by zeros to its width, q scaled so that the
// scores keep their 1/sqrt(q's width).
TEST(Attention, ValueHeadOfItsOwnWidthMatchesOneWidth) {
  Rng rng(test_seed());
  const Shape s = {2, 6, 3, 4};
  Tensor q = random_tensor(rng, s, DType::f64), k = random_tensor(rng, s, DType::f64);
  Tensor v_wide = random_tensor(rng, s, DType::f64);
  Tensor narrow = attend(q, k, v_wide.slice(3, 0, 3).contiguous());
  ASSERT_EQ(narrow.shape(), (Shape{2, 6, 3, 3}));
  EXPECT_TRUE(all_close(narrow, attend(q, k, v_wide).slice(3, 0, 3).contiguous(), 1e-12, 1e-12));

  const int64_t wide = 7;
  Tensor v = random_tensor(rng, {2, 6, 3, wide}, DType::f64);
  auto pad = [&](const Tensor& x, double scale) {
    std::vector<double> in = x.to_doubles(), out(size_t(2 * 6 * 3 * wide), 0.0);
    for (size_t r = 0; r < size_t(2 * 6 * 3); ++r)
      for (size_t c = 0; c < 4; ++c) out[r * size_t(wide) + c] = scale * in[r * 4 + c];
    return Tensor::from_doubles(out, {2, 6, 3, wide}, DType::f64);
  };
  EXPECT_TRUE(all_close(attend(q, k, v), attend(pad(q, std::sqrt(7.0 / 4.0)), pad(k, 1.0), v), 1e-12, 1e-12));
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

// GPU vs the CPU reference run in f64 on the same (rounded) values, through the op (bf16 takes the
// tensor-core kernels, except head_dim 12, which is not a multiple of 8 and takes the CUDA-core ones).
// f32: elementwise within 1e-3 relative + 1e-5 * max|ref|, and 2e-5 normwise.
// bf16: the tensor-core tolerances above (the CUDA-core kernels, fp32 inside with only the outputs and
// gradients rounded, stay within 1e-2 relative + 5e-3 * max|ref| and 5e-3 normwise).
TEST(AttentionCuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const Shape shapes[] = {{1, 1, 1, 16},   {2, 37, 3, 16}, {1, 100, 2, 64},  {2, 65, 2, 128},
                          {1, 129, 1, 24}, {1, 64, 2, 32}, {2, 1024, 8, 64}, {1, 2048, 1, 128},
                          {2, 33, 2, 12},  {0, 16, 2, 64}, {2, 0, 2, 64}};
  for (const Shape& s : shapes)
    for (DType dtype : {DType::f32, DType::bf16}) expect_cuda_matches_f64(rng, s, s[3], dtype);
}

// MLA's narrower value head on the GPU (v padded to q's width in engine/ops/attention.cpp), forward and backward,
// against the CPU's f64 kernels that take it as it is; flash (head 24) and CUDA-core (head 12) shapes.
TEST(AttentionCuda, ValueHeadNarrowerThanQkMatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (const auto& [s, v_hd] : std::vector<std::pair<Shape, int64_t>>{{{2, 37, 3, 24}, 16}, {{1, 20, 2, 12}, 6}})
    for (DType dtype : {DType::f32, DType::bf16}) expect_cuda_matches_f64(rng, s, v_hd, dtype);
}

// The wide heads (kernels/attention.h: q, k up to 192 wide, v up to 128, flash only) through the op against the
// CPU's f64 kernels: DeepSeek-V3's 192 / 128 at T = 1, T not a multiple of any tile (32-key forward tiles, 64-row
// backward tiles and their 32- and 16-row steps) and T past several tiles; a query/key head between 128 and 192
// (136) with a value head the op pads to a multiple of 8 (100 -> 104).
TEST(AttentionCuda, WideHeadsMatchCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (const auto& [s, v_hd] : std::vector<std::pair<Shape, int64_t>>{{{1, 1, 1, 192}, 128},
                                                                      {{2, 77, 3, 192}, 128},
                                                                      {{1, 300, 2, 192}, 128},
                                                                      {{1, 1024, 1, 192}, 128},
                                                                      {{2, 45, 2, 136}, 100},
                                                                      {{1, 70, 1, 192}, 64}})
    expect_cuda_matches_f64(rng, s, v_hd, DType::bf16);
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
  // Wide heads: a value head past 128 beside a query/key head past 128, a query/key head past 192 or past 128
  // and not a multiple of 8; in f32 (the flash kernels are bf16 only).
  auto zeros = [](int64_t hd, DType dtype) { return Variable(Tensor::zeros({1, 4, 2, hd}, dtype, Device::cuda())); };
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] { causal_attention(zeros(192, DType::bf16), zeros(192, DType::bf16), zeros(192, DType::bf16)); },
      {"[1, 4, 2, 192]", "no shape the CUDA kernels take"}));
  EXPECT_THROW(causal_attention(zeros(200, DType::bf16), zeros(200, DType::bf16), zeros(128, DType::bf16)), ShapeError);
  EXPECT_THROW(causal_attention(zeros(140, DType::bf16), zeros(140, DType::bf16), zeros(128, DType::bf16)), ShapeError);
  EXPECT_THROW(causal_attention(zeros(192, DType::f32), zeros(192, DType::f32), zeros(128, DType::f32)), DTypeError);
  Variable q(Tensor::zeros({1, 4, 2, 8}, DType::f32, Device::cuda()));
  Variable k(Tensor::zeros({1, 4, 2, 16}, DType::f32, Device::cuda()));
  EXPECT_THROW(causal_attention(q, k, q), ShapeError);
  EXPECT_THROW(causal_attention(q, q, k), ShapeError);  // a value head wider than q's: the GPU pads v only
  Variable on_cpu(Tensor::zeros({1, 4, 2, 8}, DType::f32));
  EXPECT_THROW(causal_attention(q, on_cpu, q), DeviceError);
}
