// The bf16 tensor-core attention kernels (kernels/cuda/flash_attention.cu, flash_attention_backward.cu) called
// directly through the launchers of kernels/attention.h: against the f64 CPU reference and the fp32 CUDA-core
// kernels, with their lse, at one head width and at the wide heads (q, k 192, v 128); masking checked exactly
// (future and past rows that must not matter); the zero-query mean; the launchers' errors. The op through the
// engine: tests/test_attention.cpp.
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "kernels/attention.h"
#include "tests/support/attention_checks.h"
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

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

// The outputs and gradients of the tensor-core kernels against `want` within the tensor-core tolerances.
void expect_flash(const KernelResult& r, const Result& want, const char* what) {
  expect_tensor_core_close({r.out, r.d_q, r.d_k, r.d_v}, want, what);
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

}  // namespace

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
    const AttentionCase c = attention_case(rng, s, v_hd);
    const Device gpu = Device::cuda();
    KernelResult flash =
        run_kernels(Kernel::flash, Kernel::flash, c.q.to(gpu), c.k.to(gpu), c.v.to(gpu), c.d_out.to(gpu));
    ASSERT_EQ(flash.out.shape(), c.v.shape());
    EXPECT_TRUE(all_close(flash.lse, reference_lse(c.q.to(DType::f64), c.k.to(DType::f64)), 0, 1e-3)) << "lse";
    expect_flash(flash, c.ref, "flash vs f64");
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
