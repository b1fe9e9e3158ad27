// swiglu_quant: the fused CPU op against the composition of the unfused references (swiglu_*_cpu, the
// prob product, a rowwise quantize written here from kernels/fp8.h), bit for bit; a finite-difference
// check of the fused backward formula (its unquantized entry); the autograd node; errors; CUDA vs CPU.
// CUDA vs CPU: device expf differs from the host's by an ulp or two, so end to end the codes may move
// by one e4m3 step (rarely, and a block's scale by a factor 2 when its amax sits on a power-of-two
// boundary); with gates >= 17, where silu(g) = g and silu'(g) = 1 exactly on both, every byte matches.
#include <cmath>
#include <cstring>
#include <memory>

#include "engine/cast_stats.h"
#include "engine/ops/swiglu_quant.h"
#include "kernels/fp8.h"
#include "kernels/silu.h"
#include "kernels/swiglu.h"
#include "kernels/swiglu_quant.h"
#include "tests/support/checks.h"
#include "tests/support/fp8_rows_check.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

// ---- references -------------------------------------------------------------------------------

// Rowwise 1x128 quantize (DESIGN.md §3) from the fp8.h helpers and dtype.h's f32_to_e4m3.
Fp8Rows quantize_ref(const std::vector<float>& x, int64_t M, int64_t K) {
  const int64_t nb = fp8_num_blocks(K);
  Fp8Rows out{std::vector<uint8_t>(size_t(M * K)), std::vector<float>(size_t(M * nb))};
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t lo = b * 128, hi = std::min(K, lo + 128);
      float amax = 0.f;
      for (int64_t c = lo; c < hi; ++c) amax = fp8_amax_update(amax, x[size_t(r * K + c)]);
      const float s_inv = fp8_scale_inv(amax), scale = fp8_scale_from_inv(s_inv);
      out.s[size_t(r * nb + b)] = s_inv;
      for (int64_t c = lo; c < hi; ++c) out.q[size_t(r * K + c)] = f32_to_e4m3(x[size_t(r * K + c)] * scale);
    }
  return out;
}

// The quantize contract itself: each block's amax lands in (224, 448] and every value is within half
// an e4m3 step (relative 2^-4, or 2^-10 in the subnormal range) of its dequantized code.
::testing::AssertionResult quantize_contract(const Fp8Rows& f, const std::vector<float>& x, int64_t K) {
  const int64_t nb = fp8_num_blocks(K), M = K > 0 ? int64_t(x.size()) / K : 0;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float s_inv = f.s[size_t(r * nb + b)];
      double amax = 0;
      for (int64_t c = b * 128; c < std::min(K, b * 128 + 128); ++c) {
        const double v = x[size_t(r * K + c)], deq = double(e4m3_to_f32(f.q[size_t(r * K + c)])) * s_inv;
        amax = std::max(amax, std::fabs(v));
        if (std::fabs(deq - v) > std::ldexp(std::fabs(v), -4) + std::ldexp(double(s_inv), -10))
          return ::testing::AssertionFailure() << "[" << r << ", " << c << "] " << v << " dequantizes to " << deq;
      }
      if (amax == 0 ? s_inv != 1.f : !(amax / s_inv > 224 && amax / s_inv <= 448))
        return ::testing::AssertionFailure()
               << "block [" << r << ", " << b << "]: amax " << amax << ", scale_inv " << s_inv;
    }
  return ::testing::AssertionSuccess();
}

// GPU d_prob vs the CPU's: fp32 products and a tree sum against a double sum, so per row
// |got - ref| <= 4e-6 * sum_j |d_a * silu(g) * u| (a few ulps of the terms' magnitude per level).
::testing::AssertionResult d_prob_close(const Tensor& got, const Tensor& ref, const Tensor& h_in, const Tensor& d_a) {
  const int64_t M = h_in.size(0), F = h_in.size(1) / 2;
  const std::vector<float> h = h_in.to(DType::f32).to_floats(), da = d_a.to(DType::f32).to_floats();
  const std::vector<float> g = got.to_floats(), r = ref.to_floats();
  for (int64_t i = 0; i < M; ++i) {
    double sum_abs = 0;
    for (int64_t j = 0; j < F; ++j)
      sum_abs += std::fabs(double(da[size_t(i * F + j)]) * silu_value(double(h[size_t(i * 2 * F + j)])) *
                           double(h[size_t(i * 2 * F + F + j)]));
    const double gi = g[size_t(i)], ri = r[size_t(i)];
    if (std::isnan(gi) && std::isnan(ri)) continue;
    if (!(std::fabs(gi - ri) <= 4e-6 * sum_abs))
      return ::testing::AssertionFailure()
             << "d_prob[" << i << "] = " << gi << ", want " << ri << " (sum |terms| " << sum_abs << ")";
  }
  return ::testing::AssertionSuccess();
}

void zero_row(Tensor& t, int64_t r) {  // t: contiguous, on the CPU
  const size_t row = size_t(t.size(1)) * dtype_size(t.dtype());
  std::memset(static_cast<char*>(t.raw_data()) + size_t(r) * row, 0, row);
}

const float* prob_ptr(const Tensor& p) { return p.defined() ? p.data<float>() : nullptr; }

struct Case {
  int64_t M, F;
};

// h [M,2F] in [-6,6] with its last row zero (a pad row), prob [M] in [0, 1.5) or undefined, d_a [M,F].
struct Inputs {
  Tensor h, prob, d_a;
};
Inputs make_inputs(Rng& rng, Case c, DType dtype, bool with_prob) {
  Inputs in;
  in.h = random_tensor(rng, {c.M, 2 * c.F}, dtype, Device::cpu(), -6, 6);
  in.d_a = random_tensor(rng, {c.M, c.F}, dtype, Device::cpu(), -1, 1);
  if (c.M > 1) zero_row(in.h, c.M - 1), zero_row(in.d_a, c.M - 1);
  if (with_prob) in.prob = random_tensor(rng, {c.M}, DType::f32, Device::cpu(), 0, 1.5);
  return in;
}

// ---- fused CPU op vs the unfused composition ---------------------------------------------------

TEST(SwigluQuant, ForwardEqualsComposition) {
  Rng rng(test_seed());
  for (DType dtype : {DType::f32, DType::bf16})
    for (bool with_prob : {false, true})
      for (Case c : {Case{0, 64}, Case{1, 64}, Case{5, 7}, Case{3, 130}, Case{17, 128}, Case{9, 704}, Case{4, 1408}}) {
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(dtype) << " prob " << with_prob << " M " << c.M << " F " << c.F);
        Inputs in = make_inputs(rng, c, dtype, with_prob);
        std::vector<float> h = in.h.to(DType::f32).to_floats(), a(size_t(c.M * c.F));
        swiglu_forward_cpu<float>(a.data(), h.data(), c.M, c.F);
        if (with_prob) {
          std::vector<float> p = in.prob.to_floats();
          for (int64_t r = 0; r < c.M; ++r)
            for (int64_t j = 0; j < c.F; ++j) a[size_t(r * c.F + j)] *= p[size_t(r)];
        }
        Fp8Rows ref = quantize_ref(a, c.M, c.F);
        Fp8Rows got{std::vector<uint8_t>(size_t(c.M * c.F)), std::vector<float>(size_t(c.M * fp8_num_blocks(c.F)))};
        swiglu_quant_forward_cpu(dtype, in.h.raw_data(), prob_ptr(in.prob), c.M, c.F, got.q.data(), got.s.data());
        EXPECT_TRUE(bytes_equal(got, ref, c.F));
        EXPECT_TRUE(quantize_contract(got, a, c.F));
        if (c.M > 1) {  // the pad row: zero codes, scale 1
          for (int64_t j = 0; j < c.F; ++j) EXPECT_EQ(got.q[size_t((c.M - 1) * c.F + j)], 0);
          EXPECT_EQ(got.s[size_t((c.M - 1) * fp8_num_blocks(c.F))], 1.f);
        }
      }
}

TEST(SwigluQuant, BackwardEqualsComposition) {
  Rng rng(test_seed());
  for (DType dtype : {DType::f32, DType::bf16})
    for (bool with_prob : {false, true})
      for (Case c : {Case{0, 64}, Case{1, 64}, Case{5, 7}, Case{3, 130}, Case{17, 128}, Case{9, 704}, Case{4, 1408}}) {
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(dtype) << " prob " << with_prob << " M " << c.M << " F " << c.F);
        const int64_t M = c.M, F = c.F;
        Inputs in = make_inputs(rng, c, dtype, with_prob);
        std::vector<float> h = in.h.to(DType::f32).to_floats(), da = in.d_a.to(DType::f32).to_floats();
        std::vector<float> p = with_prob ? in.prob.to_floats() : std::vector<float>(size_t(M), 1.f);
        // mul's backward (dy = d_a * p, d_prob = sum d_a * swiglu), then swiglu's, then the quantize.
        std::vector<float> dy(size_t(M * F)), dh(size_t(M * 2 * F));
        std::vector<double> d_prob_ref(size_t(M), 0.0), d_prob_abs(size_t(M), 0.0);
        for (int64_t r = 0; r < M; ++r)
          for (int64_t j = 0; j < F; ++j) {
            dy[size_t(r * F + j)] = da[size_t(r * F + j)] * p[size_t(r)];
            const double g = h[size_t(r * 2 * F + j)], u = h[size_t(r * 2 * F + F + j)];
            const double term = double(da[size_t(r * F + j)]) * silu_value(g) * u;
            d_prob_ref[size_t(r)] += term, d_prob_abs[size_t(r)] += std::fabs(term);
          }
        swiglu_backward_cpu<float>(dh.data(), dy.data(), h.data(), M, F);
        Fp8Rows ref = quantize_ref(dh, M, 2 * F);

        Fp8Rows got{std::vector<uint8_t>(size_t(M * 2 * F)), std::vector<float>(size_t(M * fp8_num_blocks(2 * F)))};
        std::vector<float> d_prob(size_t(M), -1.f);
        swiglu_quant_backward_cpu(dtype, in.d_a.raw_data(), in.h.raw_data(), prob_ptr(in.prob), M, F, got.q.data(),
                                  got.s.data(), nullptr, d_prob.data());
        EXPECT_TRUE(bytes_equal(got, ref, 2 * F));
        EXPECT_TRUE(quantize_contract(got, dh, 2 * F));
        for (int64_t r = 0; r < M; ++r)
          EXPECT_NEAR(d_prob[size_t(r)], d_prob_ref[size_t(r)], 1e-6 * d_prob_abs[size_t(r)] + 1e-6) << "row " << r;

        // The unquantized entry: d_h in the input dtype, rounded once from the same fp32 values.
        Tensor d_h = Tensor::empty({M, 2 * F}, dtype);
        swiglu_quant_backward_cpu(dtype, in.d_a.raw_data(), in.h.raw_data(), prob_ptr(in.prob), M, F, nullptr, nullptr,
                                  d_h.raw_data(), nullptr);
        EXPECT_TRUE(bit_equal(d_h, Tensor::from_floats(dh, {M, 2 * F}, dtype)));
        // Only d_prob asked for: the same values.
        std::vector<float> d_prob_only(size_t(M), -1.f);
        swiglu_quant_backward_cpu(dtype, in.d_a.raw_data(), in.h.raw_data(), prob_ptr(in.prob), M, F, nullptr, nullptr,
                                  nullptr, d_prob_only.data());
        EXPECT_EQ(d_prob_only, d_prob);
      }
}

// ---- finite differences of the fused backward formula -------------------------------------------

// a = silu(g) * u * p computed here in f64 (no quantize); its vjp is the fused CPU backward's
// unquantized entry (f32), so gradcheck tests that formula against central differences.
class SwigluProbF64 : public Primitive {
 public:
  const char* name() const override { return "swiglu_prob_f64"; }
  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    const int64_t M = in[0].size(0), F = in[0].size(1) / 2;
    std::vector<double> h = in[0].to_doubles(),
                        p = in[1].defined() ? in[1].to_doubles() : std::vector<double>(size_t(M), 1);
    std::vector<double> a(size_t(M * F));
    for (int64_t r = 0; r < M; ++r)
      for (int64_t j = 0; j < F; ++j)
        a[size_t(r * F + j)] = silu_value(h[size_t(r * 2 * F + j)]) * h[size_t(r * 2 * F + F + j)] * p[size_t(r)];
    return {Tensor::from_doubles(a, {M, F})};
  }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>&) override { throw_no_cuda(name()); }
  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>&) override {
    const int64_t M = in[0].size(0), F = in[0].size(1) / 2;
    Tensor h = in[0].to(DType::f32), d_a = d_out[0].to(DType::f32);
    Tensor p = in[1].defined() ? in[1].to(DType::f32) : Tensor();
    Tensor d_h = Tensor::empty({M, 2 * F}, DType::f32), d_prob = Tensor::empty({M}, DType::f32);
    swiglu_quant_backward_cpu(DType::f32, d_a.raw_data(), h.raw_data(), prob_ptr(p), M, F, nullptr, nullptr,
                              d_h.raw_data(), d_prob.data<float>());
    return {d_h.to(DType::f64), p.defined() ? d_prob.to(DType::f64) : Tensor()};
  }
};

TEST(SwigluQuant, Gradcheck) {
  Rng rng(test_seed());
  // f32-representable points, so the f32 backward sees exactly the point being differenced.
  Tensor h = random_tensor(rng, {4, 2 * 5}, DType::f32, Device::cpu(), -4, 4).to(DType::f64);
  Tensor p = random_tensor(rng, {4}, DType::f32, Device::cpu(), 0.1, 2).to(DType::f64);
  auto fn = [](const std::vector<Variable>& v) {
    return apply(std::make_shared<SwigluProbF64>(), {v[0], v.size() > 1 ? v[1] : Variable()})[0];
  };
  EXPECT_TRUE(gradcheck(fn, {h, p}));
  EXPECT_TRUE(gradcheck(fn, {h}));
  Tensor h2 = random_tensor(rng, {2, 2 * 130}, DType::f32, Device::cpu(), -4, 4).to(DType::f64);
  Tensor p2 = random_tensor(rng, {2}, DType::f32, Device::cpu(), 0.1, 2).to(DType::f64);
  EXPECT_TRUE(gradcheck(fn, {h2, p2}));
}

// ---- the autograd node -------------------------------------------------------------------------

struct NodeResult {
  Fp8Rows a, d_h_q;
  Tensor d_h, d_prob, d_prob_q;  // d_h unquantized (h's dtype); d_prob from both runs
};

// Forward, then backward with quantize_grad true and false, on `device`; results on the CPU.
NodeResult run_node(const Inputs& in, Device device) {
  NodeResult res;
  for (bool quantize_grad : {true, false}) {
    Variable h(in.h.to(device), true), prob = in.prob.defined() ? Variable(in.prob.to(device), true) : Variable();
    Variable a = swiglu_quant(h, prob, quantize_grad);
    EXPECT_EQ(a.dtype(), DType::e4m3);
    EXPECT_EQ(a.shape(), (Shape{in.h.size(0), in.h.size(1) / 2}));
    const auto& scales = a.data().fp8_scales();
    EXPECT_TRUE(scales && scales->mode == ScalingMode::rowwise_1x128);
    if (!scales) return res;
    EXPECT_EQ(scales->scale_inv.shape(), (Shape{in.h.size(0), fp8_num_blocks(in.h.size(1) / 2)}));
    a.backward(in.d_a.to(device));
    if (quantize_grad) {
      res.a = fp8_of(a.data(), scales->scale_inv);
      const Tensor& g = h.grad();
      EXPECT_EQ(g.dtype(), DType::e4m3);
      EXPECT_TRUE(g.fp8_scales() && g.fp8_scales()->mode == ScalingMode::rowwise_1x128);
      if (!g.fp8_scales()) return res;
      EXPECT_EQ(g.fp8_scales()->scale_inv.shape(), (Shape{in.h.size(0), fp8_num_blocks(in.h.size(1))}));
      res.d_h_q = fp8_of(g, g.fp8_scales()->scale_inv);
      if (prob.defined()) res.d_prob_q = prob.grad().to(Device::cpu());
    } else {
      res.d_h = h.grad().to(Device::cpu());
      EXPECT_EQ(res.d_h.dtype(), in.h.dtype());
      EXPECT_FALSE(res.d_h.fp8_scales());
      if (prob.defined()) res.d_prob = prob.grad().to(Device::cpu());
    }
  }
  return res;
}

TEST(SwigluQuant, NodeMatchesKernels) {
  Rng rng(test_seed());
  for (DType dtype : {DType::f32, DType::bf16})
    for (bool with_prob : {false, true}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " prob " << with_prob);
      const Case c{6, 200};
      Inputs in = make_inputs(rng, c, dtype, with_prob);
      reset_cast_counts();
      NodeResult got = run_node(in, Device::cpu());
      EXPECT_EQ(cast_counts().activation_casts(), 0);  // a fused producer of FP8, not a cast

      Fp8Rows a{std::vector<uint8_t>(size_t(c.M * c.F)), std::vector<float>(size_t(c.M * fp8_num_blocks(c.F)))};
      swiglu_quant_forward_cpu(dtype, in.h.raw_data(), prob_ptr(in.prob), c.M, c.F, a.q.data(), a.s.data());
      EXPECT_TRUE(bytes_equal(got.a, a, c.F));
      Fp8Rows d{std::vector<uint8_t>(size_t(c.M * 2 * c.F)), std::vector<float>(size_t(c.M * fp8_num_blocks(2 * c.F)))};
      Tensor d_h = Tensor::empty({c.M, 2 * c.F}, dtype), d_prob = Tensor::empty({c.M}, DType::f32);
      swiglu_quant_backward_cpu(dtype, in.d_a.raw_data(), in.h.raw_data(), prob_ptr(in.prob), c.M, c.F, d.q.data(),
                                d.s.data(), d_h.raw_data(), d_prob.data<float>());
      EXPECT_TRUE(bytes_equal(got.d_h_q, d, 2 * c.F));
      EXPECT_TRUE(bit_equal(got.d_h, d_h));
      if (with_prob) {
        EXPECT_TRUE(bit_equal(got.d_prob, d_prob));
        EXPECT_TRUE(bit_equal(got.d_prob_q, d_prob));
      }
    }
}

// The gradient of an FP8 output may arrive as bf16 (autograd's zero-fill) or f32 whatever h is: the
// node computes in f32 when they differ (exact widening), so it equals its all-f32 run on the same
// device (and, on the CPU, the f32 kernel); unquantized, d_h comes back in h's dtype.
void check_either_grad_dtype(Device dev) {
  Rng rng(test_seed());
  const int64_t M = 5, F = 136;
  Tensor h = random_tensor(rng, {M, 2 * F}, DType::bf16, Device::cpu(), -6, 6).to(dev);
  Tensor d_a = random_tensor(rng, {M, F}, DType::bf16, Device::cpu(), -1, 1).to(dev);
  Tensor prob = random_tensor(rng, {M}, DType::f32, Device::cpu(), 0, 1).to(dev);
  Tensor h32 = h.to(DType::f32), d_a32 = d_a.to(DType::f32);
  auto run = [&](const Tensor& hh, const Tensor& dd, bool quantize_grad) {
    Variable hv(hh, true);
    Variable a = swiglu_quant(hv, Variable(prob), quantize_grad);
    a.backward(dd);
    return hv.grad();
  };
  const Tensor want = run(h32, d_a32, true), want_h = run(h32, d_a32, false);
  if (dev.is_cpu()) {
    Fp8Rows k{std::vector<uint8_t>(size_t(M * 2 * F)), std::vector<float>(size_t(M * fp8_num_blocks(2 * F)))};
    swiglu_quant_backward_cpu(DType::f32, d_a32.raw_data(), h32.raw_data(), prob.data<float>(), M, F, k.q.data(),
                              k.s.data(), nullptr, nullptr);
    EXPECT_TRUE(bytes_equal(fp8_of(want, want.fp8_scales()->scale_inv), k, 2 * F));
  }
  for (auto [hh, dd] : {std::pair{h32, d_a}, std::pair{h, d_a32}}) {
    SCOPED_TRACE(::testing::Message() << "h " << dtype_name(hh.dtype()) << ", d_a " << dtype_name(dd.dtype()));
    const Tensor got = run(hh, dd, true);
    ASSERT_TRUE(got.fp8_scales());
    EXPECT_TRUE(
        bytes_equal(fp8_of(got, got.fp8_scales()->scale_inv), fp8_of(want, want.fp8_scales()->scale_inv), 2 * F));
    const Tensor got_h = run(hh, dd, false);
    EXPECT_EQ(got_h.dtype(), hh.dtype());
    EXPECT_TRUE(bit_equal(got_h, want_h.to(hh.dtype())));
  }
}

TEST(SwigluQuant, NodeAcceptsEitherGradDtype) { check_either_grad_dtype(Device::cpu()); }

TEST(SwigluQuantCuda, NodeAcceptsEitherGradDtype) {
  FLOWMOE_REQUIRE_CUDA();
  check_either_grad_dtype(Device::cuda());
}

TEST(SwigluQuant, Errors) {
  auto f32 = [](Shape s) { return Variable(Tensor::zeros(s, DType::f32)); };
  EXPECT_TRUE(throws_naming<ShapeError>([&] { swiglu_quant(f32({3, 7}), Variable(), true); }, {"f32[3, 7]"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { swiglu_quant(f32({2, 3, 8}), Variable(), true); }, {"f32[2, 3, 8]"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { swiglu_quant(f32({3, 8}), f32({4}), true); }, {"f32[4]", "[3]"}));
  EXPECT_TRUE(throws_naming<DTypeError>(
      [&] {
        swiglu_quant(Variable(Tensor::zeros({3, 8}, DType::i32)), Variable(), true);
      },
      {"i32"}));
  EXPECT_TRUE(throws_naming<DTypeError>(
      [&] {
        swiglu_quant(f32({3, 8}), Variable(Tensor::zeros({3}, DType::f64)), true);
      },
      {"f64"}));
  Variable h(Tensor::zeros({3, 8}, DType::f32), true);
  Variable a = swiglu_quant(h, Variable(), true);
  EXPECT_TRUE(throws_naming<DTypeError>([&] { a.backward(Tensor::zeros({3, 4}, DType::f64), true); }, {"f64"}));
  uint8_t q[4];
  float s[1];
  EXPECT_TRUE(throws_naming<ShapeError>([&] { swiglu_quant_forward_cpu(DType::f32, nullptr, nullptr, -1, 4, q, s); },
                                        {"M -1"}));
  EXPECT_TRUE(
      throws_naming<DTypeError>([&] { swiglu_quant_forward_cpu(DType::f64, nullptr, nullptr, 1, 4, q, s); }, {"f64"}));
  // F = 0: nothing to quantize, d_prob is an empty sum.
  float d_prob[2] = {-1.f, -1.f};
  swiglu_quant_backward_cpu(DType::f32, nullptr, nullptr, nullptr, 2, 0, nullptr, nullptr, nullptr, d_prob);
  EXPECT_EQ(d_prob[0], 0.f);
  EXPECT_EQ(d_prob[1], 0.f);
}

// ---- CUDA vs CPU -------------------------------------------------------------------------------

// Bitwise equality, except that any two NaNs match: an f32 NaN from arithmetic keeps a payload that
// differs between the CPU and the GPU (bf16 and FP8 conversions canonicalise it, f32 does not).
static ::testing::AssertionResult bit_equal_or_both_nan(const Tensor& got, const Tensor& want) {
  if (got.shape() != want.shape()) return ::testing::AssertionFailure() << "shapes differ";
  std::vector<float> g = got.to_floats(), w = want.to_floats();
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(g[i]) && std::isnan(w[i])) continue;
    if (std::memcmp(&g[i], &w[i], sizeof(float)) != 0)
      return ::testing::AssertionFailure() << "element " << i << " differs: got " << g[i] << ", want " << w[i];
  }
  return ::testing::AssertionSuccess();
}

// Gates in [17, 40) make silu(g) = g and silu'(g) = 1 exactly on both backends, so the fused outputs
// must match byte for byte; u spans 2^-24..2^4 so blocks reach the e4m3 subnormals. One pad row and
// one NaN (in an up value) per case; shapes cover the vector and scalar paths and partial blocks.
TEST(SwigluQuantCuda, BitExactForIdenticalActivations) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (DType dtype : {DType::f32, DType::bf16})
    for (bool with_prob : {false, true})
      for (Case c : {Case{1, 64}, Case{3, 7}, Case{64, 130}, Case{300, 704}, Case{40, 1000}, Case{8, 1408}}) {
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(dtype) << " prob " << with_prob << " M " << c.M << " F " << c.F);
        const int64_t M = c.M, F = c.F;
        std::vector<float> hv(size_t(M * 2 * F));
        for (int64_t r = 0; r < M; ++r)
          for (int64_t j = 0; j < F; ++j) {
            hv[size_t(r * 2 * F + j)] = float(17 + 23 * rng.next_uniform());
            const double mag = std::ldexp(1 + rng.next_uniform(), int(std::floor(-24 + 28 * rng.next_uniform())));
            hv[size_t(r * 2 * F + F + j)] = float(rng.next_uniform() < 0.5 ? -mag : mag);
          }
        if (M > 2) std::fill(hv.begin() + (M - 1) * 2 * F, hv.end(), 0.f);  // pad row
        if (M > 1) hv[size_t(F + F / 2)] = NAN;                             // row 0, up column F/2
        Inputs in;
        in.h = Tensor::from_floats(hv, {M, 2 * F}, dtype);
        in.d_a = random_tensor(rng, {M, F}, dtype, Device::cpu(), -1, 1);
        if (M > 2) zero_row(in.d_a, M - 1);
        if (with_prob) in.prob = random_tensor(rng, {M}, DType::f32, Device::cpu(), 0.01, 2);
        NodeResult ref = run_node(in, Device::cpu());
        NodeResult got = run_node(in, Device::cuda());
        EXPECT_TRUE(bytes_equal(got.a, ref.a, F));
        EXPECT_TRUE(bytes_equal(got.d_h_q, ref.d_h_q, 2 * F));
        EXPECT_TRUE(bit_equal_or_both_nan(got.d_h, ref.d_h));
        if (with_prob) {
          EXPECT_TRUE(d_prob_close(got.d_prob, ref.d_prob, in.h, in.d_a));
        }
        if (M > 1) {
          EXPECT_TRUE(std::isnan(got.a.s[size_t(F / 2 / 128)]));  // the NaN's block is NaN, not hidden
          if (with_prob) {
            EXPECT_TRUE(std::isnan(got.d_prob.to_floats()[0]));
          }
        }
        if (M > 2) {
          const int64_t nb = fp8_num_blocks(2 * F);
          for (int64_t b = 0; b < nb; ++b) EXPECT_EQ(got.d_h_q.s[size_t((M - 1) * nb + b)], 1.f);
          for (int64_t j = 0; j < 2 * F; ++j) EXPECT_EQ(got.d_h_q.q[size_t((M - 1) * 2 * F + j)], 0);
        }
      }
}

// Generic inputs end to end (see the header): codes within one e4m3 step, d_h (unquantized) and
// d_prob within fp32 rounding of silu/silu' (f32: like tests/test_swiglu.cpp with |g|, |u| <= 6;
// bf16: one bf16 ulp). d_prob sums in a different order: tolerance relative to sum |terms|.
TEST(SwigluQuantCuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (DType dtype : {DType::f32, DType::bf16})
    for (bool with_prob : {false, true})
      for (int64_t M : {0, 1, 1000})
        for (int64_t F : {64, 128, 704, 1408}) {
          SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " prob " << with_prob << " M " << M << " F " << F);
          Inputs in = make_inputs(rng, Case{M, F}, dtype, with_prob);
          NodeResult ref = run_node(in, Device::cpu());
          NodeResult got = run_node(in, Device::cuda());
          EXPECT_TRUE(fp8_close(got.a, ref.a, F, 1e-3));
          EXPECT_TRUE(fp8_close(got.d_h_q, ref.d_h_q, 2 * F, 1e-3));
          if (dtype == DType::f32)
            EXPECT_TRUE(all_close(got.d_h, ref.d_h, 1e-5, 1e-4));
          else
            EXPECT_TRUE(all_close(got.d_h, ref.d_h, 8e-3, 1e-4));
          if (with_prob) {
            EXPECT_TRUE(d_prob_close(got.d_prob, ref.d_prob, in.h, in.d_a));
            EXPECT_TRUE(bit_equal(got.d_prob, got.d_prob_q));  // same reduction order with or without d_h
          }
          if (M > 1) {  // the pad row
            for (int64_t j = 0; j < F; ++j) EXPECT_EQ(got.a.q[size_t((M - 1) * F + j)], 0);
            EXPECT_EQ(got.a.s[size_t((M - 1) * fp8_num_blocks(F))], 1.f);
          }
        }
}

// Deterministic: two runs give the same bits (no atomics in the d_prob reduction); and d_prob alone
// (h not requiring grad) equals the d_prob of the full backward.
TEST(SwigluQuantCuda, Deterministic) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  Inputs in = make_inputs(rng, Case{513, 1408}, DType::bf16, true);
  NodeResult r1 = run_node(in, Device::cuda()), r2 = run_node(in, Device::cuda());
  EXPECT_TRUE(bytes_equal(r1.a, r2.a, 1408));
  EXPECT_TRUE(bytes_equal(r1.d_h_q, r2.d_h_q, 2 * 1408));
  EXPECT_TRUE(bit_equal(r1.d_prob, r2.d_prob));
  Variable prob(in.prob.to(Device::cuda()), true);
  Variable a = swiglu_quant(Variable(in.h.to(Device::cuda())), prob, true);
  a.backward(in.d_a.to(Device::cuda()));
  EXPECT_TRUE(bit_equal(prob.grad(), r1.d_prob));
}

}  // namespace
