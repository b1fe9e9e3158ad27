// causal_attention: identities and gradient check of the CPU reference; CUDA vs a CPU f64 reference
// (f32, bf16), forward and backward, over edge shapes; shape and dtype errors. The bf16 tensor-core
// kernels (kernels/cuda/flash_attention.cu) also against the f64 reference and the fp32 CUDA-core kernels,
// called directly, with their lse; masking checked exactly (future and past rows that must not matter).
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "kernels/attention.h"
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
  // zero in exact math (T = 1: d_q = d_k = 0) still gets fp32 rounding residue on the GPU, and the f64
  // reference's own residue (about 1e-17) is no scale to measure a relative error against.
  const double ref_max = max_abs(ref);
  ::testing::AssertionResult r = all_close(got, ref, rtol, atol_frac * std::max(ref_max, 1.0));
  if (!r || ref_max <= atol_frac) return r;
  double e = rel_error(got, ref);
  if (e > max_rel) return ::testing::AssertionFailure() << "relative error " << e << " > " << max_rel;
  return ::testing::AssertionSuccess();
}

// The tensor-core kernels round P and dS to bf16 before their products (as flash attention does), on
// top of the bf16 outputs: elementwise 2e-2 relative + 1e-2 * max|ref|, normwise 1e-2 (expected: 2e-3 to 4e-3).
constexpr double kFlashRtol = 2e-2, kFlashAtolFrac = 1e-2, kFlashMaxRel = 1e-2;

using Kernel = AttentionKernel;

struct KernelResult {
  Tensor out, lse, d_q, d_k, d_v;  // on the GPU; lse [B, nh, T] f32
};

// Forward by `fwd`, then the backward by `bwd` with that forward's o and lse, through the launchers of
// kernels/attention.h. Inputs are bf16 on the GPU; v and d_out may be narrower than q and k (wide heads).
KernelResult run_kernels(Kernel fwd, Kernel bwd, const Tensor& q, const Tensor& k, const Tensor& v,
                         const Tensor& d_out) {
  const Shape& s = q.shape();
  const int64_t v_hd = v.size(3);
  const Device dev = q.device();
  cudaStream_t stream = current_stream(dev.index);
  KernelResult r;
  r.out = Tensor::empty(v.shape(), q.dtype(), dev);
  r.lse = Tensor::empty({s[0], s[2], s[1]}, DType::f32, dev);
  attention_forward_cuda(q.dtype(), r.out.raw_data(), r.lse.data<float>(), q.raw_data(), k.raw_data(), v.raw_data(),
                         s[0], s[1], s[2], s[3], v_hd, stream, fwd);
  Tensor delta = Tensor::empty({s[0], s[2], s[1]}, DType::f32, dev);
  r.d_q = Tensor::empty(s, q.dtype(), dev);
  r.d_k = Tensor::empty(s, q.dtype(), dev);
  r.d_v = Tensor::empty(v.shape(), q.dtype(), dev);
  attention_backward_cuda(q.dtype(), r.d_q.raw_data(), r.d_k.raw_data(), r.d_v.raw_data(), delta.data<float>(),
                          d_out.raw_data(), q.raw_data(), k.raw_data(), v.raw_data(), r.out.raw_data(),
                          r.lse.data<float>(), s[0], s[1], s[2], s[3], v_hd, stream, bwd);
  cuda_synchronize(dev.index);
  return r;
}

// lse[b, h, i] = log sum_{j<=i} exp(q_i·k_j / sqrt(hd)) in f64.
Tensor reference_lse(const Tensor& q, const Tensor& k) {
  const Shape& s = q.shape();
  const int64_t B = s[0], T = s[1], nh = s[2], hd = s[3];
  const std::vector<double> qs = q.to_doubles(), ks = k.to_doubles();
  std::vector<double> lse(static_cast<size_t>(B * nh * T)), scores(static_cast<size_t>(T));
  const double scale = 1.0 / std::sqrt(double(hd));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t i = 0; i < T; ++i) {
        double m = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < hd; ++d)
            dot += qs[size_t(((b * T + i) * nh + h) * hd + d)] * ks[size_t(((b * T + j) * nh + h) * hd + d)];
          scores[size_t(j)] = dot * scale;
          m = std::max(m, scores[size_t(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(scores[size_t(j)] - m);
        lse[size_t((b * nh + h) * T + i)] = m + std::log(sum);
      }
  return Tensor::from_doubles(lse, {B, nh, T});
}

// The outputs and gradients of the tensor-core kernels against `want` within the tensor-core tolerances.
void expect_flash(const KernelResult& r, const Result& want, const char* what) {
  SCOPED_TRACE(what);
  EXPECT_TRUE(close_to(r.out, want.out, kFlashRtol, kFlashAtolFrac, kFlashMaxRel)) << "out";
  EXPECT_TRUE(close_to(r.d_q, want.d_q, kFlashRtol, kFlashAtolFrac, kFlashMaxRel)) << "d_q";
  EXPECT_TRUE(close_to(r.d_k, want.d_k, kFlashRtol, kFlashAtolFrac, kFlashMaxRel)) << "d_k";
  EXPECT_TRUE(close_to(r.d_v, want.d_v, kFlashRtol, kFlashAtolFrac, kFlashMaxRel)) << "d_v";
}

// Equal values elementwise (+0 == -0).
::testing::AssertionResult same_values(const Tensor& got, const Tensor& ref) { return all_close(got, ref, 0, 0); }

// x with rows [t0, t1) of dim 1 redrawn (bf16, uniform in [-1, 1)).
Tensor redraw_rows(Rng& rng, const Tensor& x, int64_t t0, int64_t t1) {
  const Shape& s = x.shape();
  std::vector<double> xs = x.to_doubles();
  for (int64_t b = 0; b < s[0]; ++b)
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t e = 0; e < s[2] * s[3]; ++e)
        xs[size_t((b * s[1] + t) * s[2] * s[3] + e)] = 2 * rng.next_uniform() - 1;
  return Tensor::from_doubles(xs, s, DType::bf16, x.device());
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

// The tensor-core kernels (flash) and the CUDA-core kernels (simt), called directly, against the f64 CPU
// reference on the same bf16 values, and against each other: lse within 1e-3 (absolute, both fp32); the
// outputs and gradients of flash within the tensor-core tolerances, those of simt within its own, and
// flash vs simt within 1e-2 normwise. Each backward also runs on the other family's o and lse (the two
// agree on what lse means). Shapes: T = 1, T not a multiple of 64 or 128, T past one tile, head_dim 64,
// 128 and the padded 8, 16, 40, 96, B·nh = 1.
TEST(AttentionCuda, FlashMatchesCpuAndSimt) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const Shape shapes[] = {{1, 1, 1, 64},    {1, 17, 1, 128}, {2, 100, 3, 64},   {1, 129, 2, 128},
                          {1, 300, 1, 40},  {2, 300, 2, 96}, {1, 1024, 1, 128}, {1, 64, 1, 8},
                          {1, 128, 2, 128}, {3, 200, 1, 16}, {1, 257, 2, 72}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE(shape_str(s));
    Tensor q = random_tensor(rng, s, DType::bf16), k = random_tensor(rng, s, DType::bf16);
    Tensor v = random_tensor(rng, s, DType::bf16), d_out = random_tensor(rng, s, DType::bf16);
    Result ref = attend_with_grads(q.to(DType::f64), k.to(DType::f64), v.to(DType::f64), d_out.to(DType::f64));
    Tensor ref_lse = reference_lse(q.to(DType::f64), k.to(DType::f64));
    const Device gpu = Device::cuda();
    Tensor qg = q.to(gpu), kg = k.to(gpu), vg = v.to(gpu), dg = d_out.to(gpu);
    KernelResult flash = run_kernels(Kernel::flash, Kernel::flash, qg, kg, vg, dg);
    KernelResult simt = run_kernels(Kernel::simt, Kernel::simt, qg, kg, vg, dg);
    KernelResult flash_fwd = run_kernels(Kernel::flash, Kernel::simt, qg, kg, vg, dg);
    KernelResult simt_fwd = run_kernels(Kernel::simt, Kernel::flash, qg, kg, vg, dg);

    EXPECT_TRUE(all_close(flash.lse, ref_lse, 0, 1e-3)) << "flash lse";
    EXPECT_TRUE(all_close(simt.lse, ref_lse, 0, 1e-3)) << "simt lse";
    expect_flash(flash, ref, "flash vs f64");
    expect_flash(flash_fwd, ref, "flash forward, simt backward vs f64");
    expect_flash(simt_fwd, ref, "simt forward, flash backward vs f64");
    EXPECT_TRUE(close_to(simt.out, ref.out, 1e-2, 5e-3, 5e-3)) << "simt out";
    EXPECT_TRUE(close_to(simt.d_q, ref.d_q, 1e-2, 5e-3, 5e-3)) << "simt d_q";
    EXPECT_TRUE(close_to(simt.d_k, ref.d_k, 1e-2, 5e-3, 5e-3)) << "simt d_k";
    EXPECT_TRUE(close_to(simt.d_v, ref.d_v, 1e-2, 5e-3, 5e-3)) << "simt d_v";
    const auto f64 = [](const Tensor& t) { return t.to(Device::cpu()).to(DType::f64); };
    Result simt_as_ref{f64(simt.out), f64(simt.d_q), f64(simt.d_k), f64(simt.d_v)};
    expect_flash(flash, simt_as_ref, "flash vs simt");
  }
}

// The wide heads (q, k 192 or 136, v 128 or 64) on the tensor-core kernels called directly, against the f64 CPU
// reference on the same bf16 values: lse within 1e-3 (absolute), outputs and gradients within the tensor-core
// tolerances. T = 1, T inside the forward's first 32-key tile, T not a multiple of 32, 64 or 128, T past several
// tiles; B·nh = 1 and more.
TEST(AttentionCuda, FlashWideHeadsMatchCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (const auto& [s, v_hd] : std::vector<std::pair<Shape, int64_t>>{{{1, 1, 1, 192}, 128},
                                                                      {{1, 17, 2, 192}, 128},
                                                                      {{2, 100, 3, 192}, 128},
                                                                      {{1, 257, 2, 192}, 128},
                                                                      {{1, 1024, 1, 192}, 128},
                                                                      {{3, 200, 1, 136}, 64}}) {
    SCOPED_TRACE(shape_str(s) + " v " + std::to_string(v_hd));
    const Shape v_shape = {s[0], s[1], s[2], v_hd};
    Tensor q = random_tensor(rng, s, DType::bf16), k = random_tensor(rng, s, DType::bf16);
    Tensor v = random_tensor(rng, v_shape, DType::bf16), d_out = random_tensor(rng, v_shape, DType::bf16);
    Result ref = attend_with_grads(q.to(DType::f64), k.to(DType::f64), v.to(DType::f64), d_out.to(DType::f64));
    const Device gpu = Device::cuda();
    KernelResult flash = run_kernels(Kernel::flash, Kernel::flash, q.to(gpu), k.to(gpu), v.to(gpu), d_out.to(gpu));
    ASSERT_EQ(flash.out.shape(), v_shape);
    EXPECT_TRUE(all_close(flash.lse, reference_lse(q.to(DType::f64), k.to(DType::f64)), 0, 1e-3)) << "lse";
    expect_flash(flash, ref, "flash vs f64");
  }
}

// Masking, exactly. Rows t <= p of o, lse and d_q depend only on rows <= p of q, k, v and d_out: redrawing
// every input after p leaves their values unchanged. Rows t >= p of d_k and d_v see only queries >= p
// (through q, d_out and those rows' lse and delta, which do not change): redrawing q and d_out before p
// leaves them unchanged. Values, not bits: a hidden entry adds a zero whose sign follows the redrawn data,
// and a gradient that is 0 in exact math (d_q of row 0) may keep that sign. p sits inside a tile, and T is
// not a multiple of one.
TEST(AttentionCuda, FlashMaskingIsExact) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  // (q's shape, v's head width): one width, and the wide heads' 192 / 128.
  for (const auto& shape_v : std::vector<std::pair<Shape, int64_t>>{
           {{2, 300, 2, 128}, 128}, {{1, 200, 3, 64}, 64}, {{2, 300, 2, 192}, 128}}) {
    const Shape& s = shape_v.first;
    const int64_t v_hd = shape_v.second;
    SCOPED_TRACE(shape_str(s) + " v " + std::to_string(v_hd));
    const Device gpu = Device::cuda();
    auto draw = [&](int64_t hd) { return random_tensor(rng, {s[0], s[1], s[2], hd}, DType::bf16, gpu); };
    Tensor q = draw(s[3]), k = draw(s[3]), v = draw(v_hd), d_out = draw(v_hd);
    KernelResult base = run_kernels(Kernel::flash, Kernel::flash, q, k, v, d_out);
    for (int64_t p : {int64_t(0), int64_t(70), int64_t(129), s[1] - 2}) {
      SCOPED_TRACE("p = " + std::to_string(p));
      auto head = [&](const Tensor& x) { return x.slice(1, 0, p + 1).contiguous(); };
      KernelResult future =
          run_kernels(Kernel::flash, Kernel::flash, redraw_rows(rng, q, p + 1, s[1]), redraw_rows(rng, k, p + 1, s[1]),
                      redraw_rows(rng, v, p + 1, s[1]), redraw_rows(rng, d_out, p + 1, s[1]));
      EXPECT_TRUE(same_values(head(future.out), head(base.out))) << "out";
      EXPECT_TRUE(same_values(future.lse.slice(2, 0, p + 1).contiguous(), base.lse.slice(2, 0, p + 1).contiguous()))
          << "lse";
      EXPECT_TRUE(same_values(head(future.d_q), head(base.d_q))) << "d_q";
      auto tail = [&](const Tensor& x) { return x.slice(1, p, s[1]).contiguous(); };
      KernelResult past =
          run_kernels(Kernel::flash, Kernel::flash, redraw_rows(rng, q, 0, p), k, v, redraw_rows(rng, d_out, 0, p));
      EXPECT_TRUE(same_values(tail(past.d_k), tail(base.d_k))) << "d_k";
      EXPECT_TRUE(same_values(tail(past.d_v), tail(base.d_v))) << "d_v";
    }
  }
}

// With q = 0 every visible key weighs the same, so o_i is the mean of v_0..v_i: fp32 sums of exact bf16
// products (P = 1 before the division), so the only error is o's bf16 rounding. A key wrongly hidden or
// shown changes the mean by about |v_j - o_i| / (i + 1), far above that rounding up to T = 1024. The wide heads
// (q, k 192, v 128) at a T past several of their 32-key tiles and not a multiple of one.
TEST(AttentionCuda, FlashZeroQueriesAverageThePast) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (const auto& [s, hd] : std::vector<std::pair<Shape, int64_t>>{
           {{1, 1024, 2, 128}, 128}, {{2, 333, 1, 64}, 64}, {{1, 130, 1, 96}, 96}, {{2, 333, 2, 192}, 128}}) {
    SCOPED_TRACE(shape_str(s) + " v " + std::to_string(hd));
    const int64_t B = s[0], T = s[1], nh = s[2], qk_hd = s[3];
    const Shape v_shape = {B, T, nh, hd};
    Tensor q = Tensor::zeros(s, DType::bf16, Device::cuda());
    Tensor k = random_tensor(rng, s, DType::bf16, Device::cuda()), v = random_tensor(rng, v_shape, DType::bf16);
    Tensor out = Tensor::empty(v_shape, DType::bf16, Device::cuda());
    Tensor lse = Tensor::empty({B, nh, T}, DType::f32, Device::cuda());
    Tensor vg = v.to(Device::cuda());
    attention_forward_cuda(DType::bf16, out.raw_data(), lse.data<float>(), q.raw_data(), k.raw_data(), vg.raw_data(), B,
                           T, nh, qk_hd, hd, current_stream(0), Kernel::flash);
    const std::vector<double> vs = v.to_doubles(), got = out.to_doubles(), got_lse = lse.to_doubles();
    int64_t bad = 0;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < nh; ++h) {
        std::vector<double> sum(size_t(hd), 0.0);
        for (int64_t i = 0; i < T; ++i) {
          const double want_lse = std::log(double(i + 1));
          if (std::fabs(got_lse[size_t((b * nh + h) * T + i)] - want_lse) > 1e-5 * (1 + want_lse) && bad++ < 5)
            ADD_FAILURE() << "lse b " << b << " h " << h << " i " << i;
          for (int64_t d = 0; d < hd; ++d) {
            const size_t e = size_t(((b * T + i) * nh + h) * hd + d);
            sum[size_t(d)] += vs[e];
            const double want = sum[size_t(d)] / double(i + 1);
            if (std::fabs(got[e] - want) > std::ldexp(std::fabs(want), -8) + 1e-6 && bad++ < 5)
              ADD_FAILURE() << "b " << b << " i " << i << " h " << h << " d " << d << ": " << got[e] << " vs " << want;
          }
        }
      }
    EXPECT_EQ(bad, 0);
  }
}

TEST(AttentionCuda, FlashErrors) {
  FLOWMOE_REQUIRE_CUDA();
  float lse = 0;
  int64_t dummy[4] = {};
  cudaStream_t stream = current_stream(0);
  auto forward = [&](DType dtype, void* out, const void* q, int64_t seq_len, int64_t head_dim,
                     int64_t v_head_dim = -1) {
    attention_forward_cuda(dtype, out, &lse, q, dummy, dummy, 1, seq_len, 1, head_dim,
                           v_head_dim < 0 ? head_dim : v_head_dim, stream, Kernel::flash);
  };
  EXPECT_THROW(forward(DType::f32, dummy, dummy, 4, 64), DTypeError);
  EXPECT_THROW(forward(DType::bf16, dummy, dummy, 4, 12), ShapeError);  // head_dim not a multiple of 8
  // Wide heads: v past 128, q/k past 192, v not a multiple of 8, and two widths both up to 128.
  EXPECT_TRUE(throws_naming<ShapeError>([&] { forward(DType::bf16, dummy, dummy, 4, 136); },
                                        {"head_dim 136 with v_head_dim 136", "not a shape the kernels take"}));
  EXPECT_THROW(forward(DType::bf16, dummy, dummy, 4, 200, 128), ShapeError);
  EXPECT_THROW(forward(DType::bf16, dummy, dummy, 4, 192, 100), ShapeError);
  EXPECT_THROW(forward(DType::bf16, dummy, dummy, 4, 128, 64), ShapeError);
  EXPECT_THROW(attention_backward_cuda(DType::f32, dummy, dummy, dummy, &lse, dummy, dummy, dummy, dummy, dummy, &lse,
                                       1, 4, 1, 64, 64, stream, Kernel::flash),
               DTypeError);
  // The CUDA-core kernels take one width.
  EXPECT_THROW(
      attention_forward_cuda(DType::f32, dummy, &lse, dummy, dummy, dummy, 1, 4, 1, 192, 128, stream, Kernel::simt),
      ShapeError);
  Tensor x = Tensor::zeros({1, 4, 1, 72}, DType::bf16, Device::cuda());
  const char* base = static_cast<const char*>(x.raw_data());
  EXPECT_THROW(forward(DType::bf16, x.raw_data(), base + 2, 2, 64), Error);  // misaligned q
}
