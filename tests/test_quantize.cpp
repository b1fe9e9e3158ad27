// Blockwise FP8 quantize / dequantize (engine/ops/quantize.h): the CPU kernels against scalar loops
// written here (fp8.h's scale rule, dtype.h's conversions), known values (scales, NaN/inf, subnormal
// rounding, signed zero), round trips, colwise = rowwise of the transpose per segment, the exact
// weight transpose, the autograd ops and cast counts, errors, and CUDA vs CPU bit for bit.
#include <cmath>
#include <cstring>
#include <numeric>

#include "engine/cast_stats.h"
#include "engine/ops/quantize.h"
#include "kernels/fp8.h"
#include "kernels/quantize.h"
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

const std::vector<int64_t> kAllRows;  // no segments given: one segment of all rows

const float kNaN = std::nanf("");

bool same_float(float a, float b) {  // bit equality, any NaN equal to any NaN
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 4) == 0;
}

::testing::AssertionResult floats_equal(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << got.size() << " vs " << want.size() << " values";
  for (size_t i = 0; i < got.size(); ++i)
    if (!same_float(got[i], want[i]))
      return ::testing::AssertionFailure() << "value " << i << ": got " << got[i] << ", want " << want[i];
  return ::testing::AssertionSuccess();
}

std::vector<uint8_t> bytes_of(const Tensor& q) {
  Tensor h = q.to(Device::cpu()).contiguous();
  const auto* p = static_cast<const uint8_t*>(h.raw_data());
  return std::vector<uint8_t>(p, p + h.numel());
}

::testing::AssertionResult bytes_equal(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << got.size() << " vs " << want.size() << " bytes";
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i])
      return ::testing::AssertionFailure()
             << "byte " << i << ": got 0x" << std::hex << int(got[i]) << ", want 0x" << int(want[i]);
  return ::testing::AssertionSuccess();
}

std::vector<float> scales_of(const Tensor& q) { return q.fp8_scales()->scale_inv.to_floats(); }

// The test's own amax (NaN and inf poison the block) and quantization of a list of values.
float ref_scale_inv(const std::vector<float>& block) {
  float amax = 0.f;
  for (float v : block) {
    if (std::isnan(v) || std::isinf(v)) return kNaN;
    amax = std::max(amax, std::fabs(v));
  }
  return fp8_scale_inv(amax);
}
uint8_t ref_q(float v, float scale_inv) { return f32_to_e4m3(v * (1.0f / scale_inv)); }

struct RefQ {
  std::vector<uint8_t> q;
  std::vector<float> s;
};

// Rowwise 1x128 of x [M,K] (as floats), by plain loops.
RefQ ref_rowwise(const std::vector<float>& x, int64_t M, int64_t K) {
  RefQ r{std::vector<uint8_t>(size_t(M * K)), {}};
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k0 = 0; k0 < K; k0 += 128) {
      int64_t k1 = std::min(K, k0 + 128);
      float s = ref_scale_inv(std::vector<float>(x.begin() + i * K + k0, x.begin() + i * K + k1));
      r.s.push_back(s);
      for (int64_t k = k0; k < k1; ++k) r.q[size_t(i * K + k)] = ref_q(x[size_t(i * K + k)], s);
    }
  return r;
}

// Values over a large dynamic range: each run of 16 elements has magnitude 10^U(-6, 3); some runs are
// zero, a few elements NaN or inf (when `specials`).
std::vector<float> wide_values(std::mt19937_64& gen, int64_t n, bool specials) {
  std::uniform_real_distribution<double> u(-1, 1), e(-6, 3), p(0, 1);
  std::vector<float> v(static_cast<size_t>(n));
  double mag = 1;
  for (int64_t i = 0; i < n; ++i) {
    if (i % 16 == 0) mag = p(gen) < 0.1 ? 0.0 : std::pow(10.0, e(gen));
    v[size_t(i)] = float(u(gen) * mag);
    if (specials && p(gen) < 2e-4) v[size_t(i)] = p(gen) < 0.5 ? kNaN : (p(gen) < 0.5 ? INFINITY : -INFINITY);
  }
  return v;
}

Tensor wide_tensor(std::mt19937_64& gen, const Shape& shape, DType dtype, bool specials = true) {
  return Tensor::from_floats(wide_values(gen, shape_numel(shape), specials), shape, dtype);
}

// An FP8 tensor moved to `device` with all of its scales (Tensor::to keeps no segments).
Tensor fp8_to(const Tensor& q, Device device) {
  const Fp8Scales& s = *q.fp8_scales();
  return q.to(device).with_scales(s.scale_inv.to(device), s.mode, s.rows_per_segment);
}

}  // namespace

// ---- rowwise -----------------------------------------------------------------------------------

TEST(QuantizeRowwise, MatchesScalarLoop) {
  std::mt19937_64 gen(test_seed());
  for (DType dt : {DType::f32, DType::bf16})
    for (auto [M, K] :
         std::vector<std::pair<int64_t, int64_t>>{{0, 128}, {1, 1}, {3, 129}, {5, 300}, {17, 256}, {2, 7}}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " M " << M << " K " << K);
      Tensor x = wide_tensor(gen, {M, K}, dt);
      Tensor q = quantize_rowwise_tensor(x, "test");
      ASSERT_EQ(q.dtype(), DType::e4m3);
      ASSERT_EQ(q.shape(), (Shape{M, K}));
      ASSERT_NE(q.fp8_scales(), nullptr);
      EXPECT_EQ(q.fp8_scales()->mode, ScalingMode::rowwise_1x128);
      EXPECT_EQ(q.fp8_scales()->scale_inv.shape(), (Shape{M, fp8_num_blocks(K)}));
      RefQ ref = ref_rowwise(x.to_floats(), M, K);
      EXPECT_TRUE(bytes_equal(bytes_of(q), ref.q));
      EXPECT_TRUE(floats_equal(scales_of(q), ref.s));
    }
  // [..., K]: the leading dims are rows.
  Tensor x3 = wide_tensor(gen, {2, 3, 130}, DType::f32);
  Tensor q3 = quantize_rowwise_tensor(x3, "test");
  EXPECT_EQ(q3.fp8_scales()->scale_inv.shape(), (Shape{6, 2}));
  EXPECT_TRUE(bytes_equal(bytes_of(q3), ref_rowwise(x3.to_floats(), 6, 130).q));
}

TEST(QuantizeRowwise, KnownValues) {
  const float sub = std::ldexp(1.0f, -9);  // the smallest e4m3 subnormal (with scale 1)
  // Block 0: amax 448 -> scale 1; subnormals round to nearest even, signed zero kept.
  std::vector<float> b0 = {448,        -1,          0.5f,       -0.0f,      0.0f,       0.5f * sub,
                           1.5f * sub, 1.25f * sub, 2.5f * sub, 3.5f * sub, -1.5f * sub};
  std::vector<uint8_t> q0 = {0x7E, 0xB8, 0x30, 0x80, 0x00, 0x00, 0x02, 0x01, 0x02, 0x04, 0x82};
  b0.resize(128, 0.f), q0.resize(128, 0);
  std::vector<float> b1(128, 0.f), b2(128, -0.0f), b3(128, 1.f), b4(128, 1.f), b5(128, 0.f), b6(128, 0.f);
  b1[3] = 1.f, b1[4] = -0.75f;   // amax 1 -> scale 256, scale_inv 2^-8
  b3[7] = kNaN;                  // NaN block
  b4[9] = -INFINITY;             // inf block
  b5[0] = 1e-40f;                // f32 subnormal amax: 448 / amax overflows, the exponent clamps to 126
  b6[0] = 1e30f, b6[1] = 1e22f;  // large amax: scale < 1
  std::vector<float> all;
  for (auto* b : {&b0, &b1, &b2, &b3, &b4, &b5, &b6}) all.insert(all.end(), b->begin(), b->end());
  Tensor q = quantize_rowwise_tensor(Tensor::from_floats(all, {7, 128}), "test");
  std::vector<float> s = scales_of(q);
  std::vector<uint8_t> bytes = bytes_of(q);
  EXPECT_EQ(s[0], 1.f);
  EXPECT_TRUE(bytes_equal(std::vector<uint8_t>(bytes.begin(), bytes.begin() + 128), q0));
  EXPECT_EQ(s[1], std::ldexp(1.0f, -8));
  EXPECT_EQ(bytes[128 + 3], 0x78);  // 1 * 256 = 2^8
  EXPECT_EQ(bytes[128 + 4], 0xF4);  // -0.75 * 256 = -192 = -1.5 * 2^7: 1.1110.100
  EXPECT_EQ(s[2], 1.f);             // amax 0 (all -0)
  for (int k = 0; k < 128; ++k) EXPECT_EQ(bytes[2 * 128 + k], 0x80) << k;
  EXPECT_TRUE(std::isnan(s[3]));
  EXPECT_TRUE(std::isnan(s[4]));
  for (int k = 0; k < 128; ++k) {
    EXPECT_EQ(bytes[3 * 128 + k], 0x7F) << k;
    EXPECT_EQ(bytes[4 * 128 + k], 0x7F) << k;
  }
  EXPECT_EQ(s[5], std::ldexp(1.0f, -126));
  EXPECT_EQ(s[6], std::ldexp(1.0f, 91));  // 448 / 1e30 = 2^-90.85: scale 2^-91
  EXPECT_TRUE(bytes_equal(bytes, ref_rowwise(all, 7, 128).q));
  // Dequantize: NaN blocks stay NaN, the others are exact multiples.
  std::vector<float> y = dequantize_tensor(q, DType::f32, "").to_floats();
  EXPECT_EQ(y[0], 448.f);
  EXPECT_EQ(y[6], 2 * sub);
  EXPECT_TRUE(std::signbit(y[3]) && y[3] == 0.f);
  EXPECT_EQ(y[128 + 4], -0.75f);
  EXPECT_TRUE(std::isnan(y[3 * 128 + 5]) && std::isnan(y[4 * 128]));
}

TEST(QuantizeRowwise, RoundTripWithinE4m3Precision) {
  std::mt19937_64 gen(test_seed());
  std::uniform_real_distribution<double> mag(0.01, 1), e(-6, 3);
  for (DType out : {DType::f32, DType::bf16}) {
    int64_t M = 9, K = 300;
    std::vector<float> v(size_t(M * K));
    double m = 1;
    for (int64_t i = 0; i < M; ++i)
      for (int64_t k = 0; k < K; ++k) {  // within a factor 100 of the block's amax: normal after scaling
        if (k % 128 == 0) m = std::pow(10.0, e(gen));
        v[size_t(i * K + k)] = float((k % 3 ? 1 : -1) * mag(gen) * m);
      }
    Tensor x = Tensor::from_floats(v, {M, K});
    Tensor y = dequantize_tensor(quantize_rowwise_tensor(x, "test"), out, "test");
    EXPECT_EQ(y.dtype(), out);
    // e4m3 keeps 3 mantissa bits: |err| <= 2^-4 |x| (the bf16 output holds e4m3 * 2^e exactly).
    EXPECT_TRUE(all_close(y, x, 0.0625, 0));
  }
}

// ---- colwise -----------------------------------------------------------------------------------

// Colwise over segments equals, per segment, the rowwise quantize of that segment's transpose.
TEST(QuantizeColwise, EqualsRowwiseOfTransposePerSegment) {
  std::mt19937_64 gen(test_seed());
  struct Case {
    std::vector<int64_t> seg;
    int64_t tail, K;
  };
  for (const Case& c : {Case{{0, 5, 130, 128, 1}, 7, 33}, Case{{300}, 0, 129}, Case{{}, 0, 5}, Case{{0, 0}, 4, 3},
                        Case{{1, 256, 0, 2}, 0, 1}, Case{{3}, 10, 0}})
    for (DType dt : {DType::f32, DType::bf16}) {
      int64_t total = std::accumulate(c.seg.begin(), c.seg.end(), int64_t(0));
      int64_t M = (c.seg.empty() ? 50 : total) + c.tail, K = c.K;
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " M " << M << " K " << K << " segments " << c.seg.size());
      std::vector<float> xv = Tensor::from_floats(wide_values(gen, M * K, true), {M, K}, dt).to_floats();
      Tensor x = Tensor::from_floats(xv, {M, K}, dt);
      Tensor q = quantize_colwise_tensor(x, c.seg, "test");
      ASSERT_EQ(q.shape(), (Shape{K, M}));
      ASSERT_EQ(q.fp8_scales()->mode, ScalingMode::colwise_1x128);
      EXPECT_EQ(q.fp8_scales()->rows_per_segment, c.seg);
      std::vector<int64_t> seg = c.seg.empty() ? std::vector<int64_t>{M} : c.seg;
      int64_t nb = 0;
      for (int64_t r : seg) nb += fp8_num_blocks(r);
      ASSERT_EQ(q.fp8_scales()->scale_inv.shape(), (Shape{nb, K}));
      std::vector<uint8_t> qb = bytes_of(q);
      std::vector<float> s = scales_of(q);
      std::vector<float> y = dequantize_tensor(q, DType::f32, "test").to_floats();
      int64_t row = 0, blk = 0;
      for (size_t si = 0; si < seg.size(); ++si) {
        int64_t r = seg[si];
        std::vector<float> xt(size_t(K * r));  // the segment's transpose [K, r]
        for (int64_t i = 0; i < r; ++i)
          for (int64_t k = 0; k < K; ++k) xt[size_t(k * r + i)] = xv[size_t((row + i) * K + k)];
        RefQ ref = ref_rowwise(xt, K, r);
        int64_t nbs = fp8_num_blocks(r);
        for (int64_t k = 0; k < K; ++k) {
          for (int64_t i = 0; i < r; ++i)
            ASSERT_EQ(qb[size_t(k * M + row + i)], ref.q[size_t(k * r + i)])
                << "segment " << si << " k " << k << " i " << i;
          for (int64_t b = 0; b < nbs; ++b)
            ASSERT_TRUE(same_float(s[size_t((blk + b) * K + k)], ref.s[size_t(k * nbs + b)]))
                << "segment " << si << " k " << k << " block " << b;
        }
        // The round trip: y is the dequantized rowwise transpose, transposed back.
        for (int64_t i = 0; i < r; ++i)
          for (int64_t k = 0; k < K; ++k) {
            float s_inv = ref.s[size_t(k * nbs + i / 128)];
            float want = e4m3_to_f32(ref.q[size_t(k * r + i)]) * s_inv;
            ASSERT_TRUE(same_float(y[size_t((row + i) * K + k)], want)) << "y row " << row + i << " col " << k;
          }
        row += r, blk += nbs;
      }
      for (int64_t k = 0; k < K; ++k)  // columns past the segments are zero, and rows of y past them
        for (int64_t i = row; i < M; ++i) {
          ASSERT_EQ(qb[size_t(k * M + i)], 0) << "tail column " << i;
          ASSERT_EQ(y[size_t(i * K + k)], 0.f) << "tail row " << i;
        }
    }
}

// ---- block 128x128 -----------------------------------------------------------------------------

TEST(QuantizeWeight, BlockGridAndExactTranspose) {
  std::mt19937_64 gen(test_seed());
  for (const Shape& shape : {Shape{1, 1}, Shape{129, 300}, Shape{1, 200, 130}, Shape{3, 257, 129}, Shape{3, 128, 256}})
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " " << shape_str(shape));
      Tensor w = wide_tensor(gen, shape, dt, true);
      std::vector<float> wv = w.to_floats();
      reset_cast_counts();
      QuantizedWeight qw = quantize_weight(w, "test.w");
      EXPECT_EQ(cast_counts().weight_quantize, 1);
      EXPECT_EQ(cast_counts().activation_casts(), 0);
      bool batched = shape.size() == 3;
      int64_t B = batched ? shape[0] : 1, N = shape[shape.size() - 2], K = shape.back();
      int64_t nbn = fp8_num_blocks(N), nbk = fp8_num_blocks(K);
      Shape s_shape = batched ? Shape{B, nbn, nbk} : Shape{nbn, nbk},
            st_shape = batched ? Shape{B, nbk, nbn} : Shape{nbk, nbn};
      Shape t_shape = batched ? Shape{B, K, N} : Shape{K, N};
      ASSERT_EQ(qw.q.shape(), shape);
      ASSERT_EQ(qw.q_t.shape(), t_shape);
      ASSERT_EQ(qw.q.fp8_scales()->mode, ScalingMode::block_128x128);
      ASSERT_EQ(qw.q_t.fp8_scales()->mode, ScalingMode::block_128x128);
      ASSERT_EQ(qw.q.fp8_scales()->scale_inv.shape(), s_shape);
      ASSERT_EQ(qw.q_t.fp8_scales()->scale_inv.shape(), st_shape);
      std::vector<uint8_t> q = bytes_of(qw.q), qt = bytes_of(qw.q_t);
      std::vector<float> s = scales_of(qw.q), st = scales_of(qw.q_t);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t bn = 0; bn < nbn; ++bn)
          for (int64_t bk = 0; bk < nbk; ++bk) {
            std::vector<float> tile;
            for (int64_t n = bn * 128; n < std::min(N, bn * 128 + 128); ++n)
              for (int64_t k = bk * 128; k < std::min(K, bk * 128 + 128); ++k)
                tile.push_back(wv[size_t((b * N + n) * K + k)]);
            float want = ref_scale_inv(tile);
            ASSERT_TRUE(same_float(s[size_t((b * nbn + bn) * nbk + bk)], want))
                << "tile " << b << "," << bn << "," << bk;
            ASSERT_TRUE(same_float(st[size_t((b * nbk + bk) * nbn + bn)], want)) << "transposed tile";
            for (int64_t n = bn * 128; n < std::min(N, bn * 128 + 128); ++n)
              for (int64_t k = bk * 128; k < std::min(K, bk * 128 + 128); ++k) {
                uint8_t v = q[size_t((b * N + n) * K + k)];
                ASSERT_EQ(v, ref_q(wv[size_t((b * N + n) * K + k)], want)) << "n " << n << " k " << k;
                ASSERT_EQ(qt[size_t((b * K + k) * N + n)], v) << "q_t is not the transpose at n " << n << " k " << k;
              }
          }
      // Dequantize: each element times its tile's scale_inv; the transpose dequantizes to the transpose.
      std::vector<float> y = dequantize_tensor(qw.q, DType::f32, "").to_floats();
      std::vector<float> yt = dequantize_tensor(qw.q_t, DType::f32, "").to_floats();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t n = 0; n < N; ++n)
          for (int64_t k = 0; k < K; ++k) {
            float want = e4m3_to_f32(q[size_t((b * N + n) * K + k)]) * s[size_t((b * nbn + n / 128) * nbk + k / 128)];
            ASSERT_TRUE(same_float(y[size_t((b * N + n) * K + k)], want)) << "n " << n << " k " << k;
            ASSERT_TRUE(same_float(yt[size_t((b * K + k) * N + n)], want)) << "transposed n " << n << " k " << k;
          }
    }
}

// ---- autograd ops and counts -------------------------------------------------------------------

TEST(QuantizeOps, StraightThroughGradientAndCounts) {
  Rng rng(test_seed());
  reset_cast_counts();
  Variable x(random_tensor(rng, {4, 200}, DType::f32, Device::cpu(), -3, 3), true);
  Variable q = quantize_rowwise(x, "t.fwd");
  ASSERT_EQ(q.dtype(), DType::e4m3);
  ASSERT_NE(q.data().fp8_scales(), nullptr);
  EXPECT_EQ(q.data().fp8_scales()->scale_inv.shape(), (Shape{4, 2}));
  EXPECT_TRUE(q.requires_grad());
  Variable y = dequantize(q, DType::f32, "t.bwd");
  EXPECT_EQ(y.dtype(), DType::f32);
  sum(y).backward();
  ASSERT_TRUE(x.grad().defined());
  EXPECT_EQ(x.grad().dtype(), DType::f32);
  EXPECT_TRUE(bit_equal(x.grad(), Tensor::full({4, 200}, 1.0, DType::f32)));
  CastCounts c = cast_counts();
  EXPECT_EQ(c.quantize, 1);
  EXPECT_EQ(c.dequantize, 1);
  EXPECT_EQ(c.by_site["quantize t.fwd"], 1);
  EXPECT_EQ(c.by_site["dequantize t.bwd"], 1);

  // A bf16 cotangent is converted to x's dtype; an FP8 one is dequantized without being counted.
  Variable x2(random_tensor(rng, {3, 130}, DType::f32), true);
  Variable q2 = quantize_rowwise(x2, "t.fwd");
  Tensor d_bf16 = random_tensor(rng, {3, 130}, DType::bf16);
  q2.backward(d_bf16, true);
  EXPECT_TRUE(bit_equal(x2.grad(), d_bf16.to(DType::f32)));
  x2.zero_grad();
  reset_cast_counts();
  Tensor d_fp8 = quantize_rowwise_tensor(random_tensor(rng, {3, 130}), "t.grad");
  q2.backward(d_fp8);
  EXPECT_TRUE(bit_equal(x2.grad(), dequantize_tensor(d_fp8, DType::f32, "")));
  EXPECT_EQ(cast_counts().quantize, 1);  // only the explicit quantize of d_fp8 above
  EXPECT_EQ(cast_counts().dequantize, 0);

  // Tensor helpers count too (dequantize_tensor only with a site); the empty segment list is one
  // segment of all rows.
  reset_cast_counts();
  Tensor xt = random_tensor(rng, {20, 8});
  Tensor qc = quantize_colwise_tensor(xt, kAllRows, "t.col");
  EXPECT_TRUE(bit_equal(qc, quantize_colwise_tensor(xt, {20}, "t.col")));
  dequantize_tensor(qc, DType::bf16, "t.deq");
  dequantize_tensor(qc, DType::bf16, "");
  EXPECT_EQ(cast_counts().quantize, 2);
  EXPECT_EQ(cast_counts().dequantize, 1);
  EXPECT_EQ(cast_counts().by_site["quantize t.col"], 2);
}

TEST(QuantizeOps, Errors) {
  Tensor xi = Tensor::zeros({2, 4}, DType::i32), x64 = Tensor::zeros({2, 4}, DType::f64);
  EXPECT_TRUE(
      throws_naming<DTypeError>([&] { quantize_rowwise(Variable(xi), "s"); }, {"i32[2, 4] on cpu", "f32 or bf16"}));
  EXPECT_TRUE(throws_naming<DTypeError>([&] { quantize_rowwise_tensor(x64, "s"); }, {"f64[2, 4] on cpu"}));
  EXPECT_TRUE(throws_naming<DTypeError>([&] { quantize_weight(x64, "s"); }, {"f64[2, 4] on cpu"}));
  EXPECT_TRUE(
      throws_naming<ShapeError>([&] { quantize_weight(Tensor::zeros({4}, DType::f32), "s"); }, {"f32[4] on cpu"}));
  Tensor x = Tensor::zeros({10, 4}, DType::f32);
  EXPECT_TRUE(throws_naming<ShapeError>([&] { quantize_colwise_tensor(x, {5, 6}, "s"); }, {"11", "f32[10, 4] on cpu"}));
  std::vector<int64_t> negative = {3, -1};
  EXPECT_TRUE(throws_naming<ShapeError>([&] { quantize_colwise_tensor(x, negative, "s"); },
                                        {"rows_per_segment[1] = -1", "negative"}));
  Tensor x3 = Tensor::zeros({2, 3, 4}, DType::f32);
  EXPECT_TRUE(throws_naming<ShapeError>([&] { quantize_colwise_tensor(x3, kAllRows, "s"); }, {"f32[2, 3, 4] on cpu"}));
  // The raw kernels check the same.
  std::vector<uint8_t> q(40);
  std::vector<float> s(40);
  int64_t bad[] = {4, -2};
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] { quantize_colwise_cpu(DType::f32, x.raw_data(), 10, 4, bad, 2, q.data(), s.data()); },
      {"rows_per_segment[1] = -2"}));
  int64_t big[] = {8, 8};
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] { quantize_colwise_cpu(DType::f32, x.raw_data(), 10, 4, big, 2, q.data(), s.data()); }, {"16", "M = 10"}));
  EXPECT_TRUE(throws_naming<DTypeError>(
      [&] { quantize_rowwise_cpu(DType::f64, x.raw_data(), 1, 4, q.data(), s.data()); }, {"f64"}));
  // Dequantize: FP8 data with fitting scales, to f32 or bf16.
  Tensor plain = Tensor::zeros({2, 4}, DType::e4m3);
  EXPECT_TRUE(
      throws_naming<Error>([&] { dequantize_tensor(plain, DType::f32, ""); }, {"e4m3[2, 4] on cpu", "no FP8 scales"}));
  Tensor wrong = plain.with_scales(Tensor::zeros({3, 1}, DType::f32), ScalingMode::rowwise_1x128);
  EXPECT_TRUE(
      throws_naming<ShapeError>([&] { dequantize_tensor(wrong, DType::f32, ""); }, {"f32[3, 1] on cpu", "[2, 1]"}));
  Tensor q_ok = quantize_rowwise_tensor(x, "s");
  EXPECT_TRUE(throws_naming<DTypeError>([&] { dequantize_tensor(q_ok, DType::f64, ""); }, {"f64"}));
  EXPECT_TRUE(throws_naming<DTypeError>([&] { dequantize_tensor(x, DType::f32, ""); }, {"f32[10, 4] on cpu"}));
  Tensor qc = quantize_colwise_tensor(x, {10}, "s");
  EXPECT_TRUE(throws_naming<Error>([&] { dequantize(Variable(qc), DType::f32, "s"); }, {"colwise"}));
  Tensor blk = quantize_weight(x, "s").q;
  Tensor blk_bad = blk.with_scales(Tensor::zeros({2, 1}, DType::f32), ScalingMode::block_128x128);
  EXPECT_TRUE(
      throws_naming<ShapeError>([&] { dequantize_tensor(blk_bad, DType::f32, ""); }, {"f32[2, 1] on cpu", "[1, 1]"}));
}

// ---- CUDA vs CPU, bit for bit ------------------------------------------------------------------

TEST(QuantizeCuda, RowwiseMatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  for (DType dt : {DType::f32, DType::bf16})
    for (auto [M, K] : std::vector<std::pair<int64_t, int64_t>>{{0, 128},
                                                                {0, 0},
                                                                {5, 0},
                                                                {1, 1},
                                                                {3, 129},
                                                                {1000, 7168},
                                                                {37, 300},
                                                                {64, 136},
                                                                {1000, 130},
                                                                {333, 2048}}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " M " << M << " K " << K);
      Tensor x = wide_tensor(gen, {M, K}, dt);
      Tensor ref = quantize_rowwise_tensor(x, "");
      Tensor got = quantize_rowwise_tensor(x.to(Device::cuda()), "");
      EXPECT_TRUE(bit_equal(got, ref));
      EXPECT_TRUE(bit_equal(got.fp8_scales()->scale_inv, ref.fp8_scales()->scale_inv));
      for (DType out : {DType::f32, DType::bf16}) {
        Tensor y_ref = dequantize_tensor(ref, out, "");
        Tensor y_got = dequantize_tensor(fp8_to(ref, Device::cuda()), out, "");
        EXPECT_TRUE(bit_equal(y_got, y_ref)) << "dequantize to " << dtype_name(out);
      }
    }
}

TEST(QuantizeCuda, ColwiseMatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  std::uniform_int_distribution<int64_t> small(0, 40);
  std::vector<int64_t> many(1024);  // more segments than one launch takes
  for (auto& r : many) r = small(gen) == 0 ? 0 : small(gen) * (small(gen) % 4 == 0 ? 9 : 1);
  many[100] = 1000, many[700] = 129;  // hot segments
  struct Case {
    std::vector<int64_t> seg;
    int64_t tail, K;
  };
  for (const Case& c : {Case{{0, 5, 130, 128, 1}, 7, 129}, Case{{}, 0, 1}, Case{{1000}, 0, 7168}, Case{{0}, 0, 64},
                        Case{{0, 5, 130, 128, 1}, 3, 7168}, Case{many, 5, 129}, Case{{600, 0, 400}, 24, 2048},
                        Case{{16, 32, 48}, 0, 130}, Case{{2, 3}, 1, 0}})
    for (DType dt : {DType::f32, DType::bf16}) {
      int64_t total = std::accumulate(c.seg.begin(), c.seg.end(), int64_t(0));
      int64_t M = (c.seg.empty() ? 77 : total) + c.tail, K = c.K;
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " M " << M << " K " << K << " segments " << c.seg.size());
      Tensor x = wide_tensor(gen, {M, K}, dt);
      Tensor ref = quantize_colwise_tensor(x, c.seg, "");
      Tensor got = quantize_colwise_tensor(x.to(Device::cuda()), c.seg, "");
      EXPECT_TRUE(bit_equal(got, ref));
      EXPECT_TRUE(bit_equal(got.fp8_scales()->scale_inv, ref.fp8_scales()->scale_inv));
      EXPECT_EQ(got.fp8_scales()->rows_per_segment, c.seg);
      for (DType out : {DType::f32, DType::bf16}) {
        Tensor y_ref = dequantize_tensor(ref, out, "");
        Tensor y_got = dequantize_tensor(got, out, "");
        EXPECT_TRUE(bit_equal(y_got, y_ref)) << "dequantize to " << dtype_name(out);
      }
    }
}

TEST(QuantizeCuda, BlockMatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  for (const Shape& shape : {Shape{1, 1}, Shape{0, 5}, Shape{129, 300}, Shape{1, 200, 130}, Shape{3, 257, 129},
                             Shape{2, 256, 7168}, Shape{3, 0, 128}, Shape{2, 136, 72}})
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " " << shape_str(shape));
      Tensor w = wide_tensor(gen, shape, dt);
      QuantizedWeight ref = quantize_weight(w, "");
      QuantizedWeight got = quantize_weight(w.to(Device::cuda()), "");
      EXPECT_TRUE(bit_equal(got.q, ref.q));
      EXPECT_TRUE(bit_equal(got.q_t, ref.q_t));
      EXPECT_TRUE(bit_equal(got.q.fp8_scales()->scale_inv, ref.q.fp8_scales()->scale_inv));
      EXPECT_TRUE(bit_equal(got.q_t.fp8_scales()->scale_inv, ref.q_t.fp8_scales()->scale_inv));
      for (DType out : {DType::f32, DType::bf16}) {
        EXPECT_TRUE(bit_equal(dequantize_tensor(got.q, out, ""), dequantize_tensor(ref.q, out, "")));
        EXPECT_TRUE(bit_equal(dequantize_tensor(got.q_t, out, ""), dequantize_tensor(ref.q_t, out, "")));
      }
    }
}

TEST(QuantizeCuda, OpsOnGpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::bf16}) {
    Variable x(random_tensor(rng, {6, 300}, dt, Device::cuda(), -2, 2), true);
    Variable y = dequantize(quantize_rowwise(x, "g"), dt, "g");
    EXPECT_EQ(y.device(), Device::cuda());
    sum(y).backward();
    EXPECT_EQ(x.grad().dtype(), dt);
    EXPECT_TRUE(bit_equal(x.grad(), Tensor::full({6, 300}, 1.0, dt)));
  }
}
