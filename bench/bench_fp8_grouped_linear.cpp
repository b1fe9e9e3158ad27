// bench_fp8_grouped_linear: the FP8 block-scaled grouped GEMMs of kernels/fp8_grouped_linear.h (one
// cuBLASLt VEC128 x BLK128x128 call per expert, fp32 compute) against the BF16 grouped GEMMs of
// kernels/grouped_linear.h on the same shapes, measured in the same run:
//   "dsv3"  fprop only, 32 experts x 1024 rows, K 7168, N 4096, bf16 out (the DESIGN.md §6 shape);
//   "fc1"/"fc2" the MoE layer's GEMMs (64 x 1536 rows): fprop (bf16 out), dgrad (bf16 out, the fprop call
//           on w_t), wgrad (VEC128 x VEC128, fp32 out), vs bf16 forward + dgrad + wgrad.
// FP8 times include the x-scale re-layout kernel. FLOPs 2·M·N·K per GEMM; "of 1275" is the fraction of
// the measured ceiling for blockwise FP8 through cuBLASLt (DESIGN.md §6); "x bf16" = bf16 time / fp8 time.
// Data: random e4m3 bytes (no NaN codes), power-of-two scales. Medians of 30 runs. No GPU: skip, exit 0.
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "bench/bench_fp8_data.h"
#include "bench/bench_util.h"
#include "engine/tensor.h"
#include "kernels/common/cuda_check.h"
#include "kernels/common/device_api.h"
#include "kernels/fp8.h"
#include "kernels/fp8_grouped_linear.h"
#include "kernels/grouped_linear.h"

using namespace flowmoe;
using namespace flowmoe::bench;  // the shared FP8 operand data

namespace {

constexpr double kCeilingTflops = 1275.0;

struct Case {
  const char* name;
  int64_t num_experts, padded_tokens_per_expert, k, n;
  bool fprop_only;
};

struct Result {
  Case c;
  double fp8_fwd, fp8_dgrad, fp8_wgrad, bf16_fwd, bf16_dgrad, bf16_wgrad;  // ms
};

Result bench_case(const Case& c, const Chunks& ch, cudaStream_t stream) {
  const int64_t e = c.num_experts, m = e * c.padded_tokens_per_expert, n = c.n, k = c.k;
  const std::vector<int64_t> rows(size_t(e), c.padded_tokens_per_expert);
  Result r{c, 0, 0, 0, 0, 0, 0};
  const Device dev = Device::cuda(0);
  {  // FP8
    Tensor x = device_fill(ch.fp8, {m, k}, DType::e4m3, stream),
           xs = device_fill(ch.scales, {m, k / 128}, DType::f32, stream);
    Tensor w = device_fill(ch.fp8, {e, n, k}, DType::e4m3, stream);
    Tensor ws = device_fill(ch.scales, {e, n / 128, k / 128}, DType::f32, stream);
    Tensor y = Tensor::empty({m, n}, DType::bf16, dev);
    const size_t work_bytes =
        std::max(fp8_grouped_gemm_workspace_bytes(m, k, e, n), fp8_grouped_gemm_workspace_bytes(m, n, e, k));
    Tensor work = Tensor::empty({int64_t(work_bytes)}, DType::u8, dev);
    r.fp8_fwd = median_ms(
        [&] {
          fp8_grouped_gemm_cuda(DType::bf16, x.data<uint8_t>(), xs.data<float>(), w.data<uint8_t>(), ws.data<float>(),
                                y.raw_data(), rows.data(), e, m, n, k, work.raw_data(), stream);
        },
        stream);
    if (!c.fprop_only) {
      Tensor dy = device_fill(ch.fp8, {m, n}, DType::e4m3, stream),
             dys = device_fill(ch.scales, {m, n / 128}, DType::f32, stream);
      Tensor w_t = device_fill(ch.fp8, {e, k, n}, DType::e4m3, stream);
      Tensor w_ts = device_fill(ch.scales, {e, k / 128, n / 128}, DType::f32, stream);
      Tensor dx = Tensor::empty({m, k}, DType::bf16, dev);
      r.fp8_dgrad = median_ms(
          [&] {
            fp8_grouped_gemm_cuda(DType::bf16, dy.data<uint8_t>(), dys.data<float>(), w_t.data<uint8_t>(),
                                  w_ts.data<float>(), dx.raw_data(), rows.data(), e, m, k, n, work.raw_data(), stream);
          },
          stream);
      WgradOperands w = wgrad_operands(ch, e, m, n, k, e * fp8_num_blocks(c.padded_tokens_per_expert), stream);
      r.fp8_wgrad = median_ms([&] { w.run_per_expert(rows.data(), e, m, n, k, stream); }, stream);
    }
  }
  {  // BF16 baseline (fp32 compute), the same shapes
    Tensor x = device_fill(ch.bf16, {m, k}, DType::bf16, stream),
           w = device_fill(ch.bf16, {e, n, k}, DType::bf16, stream);
    Tensor y = Tensor::empty({m, n}, DType::bf16, dev);
    r.bf16_fwd = median_ms(
        [&] {
          grouped_linear_forward_cuda(DType::bf16, x.raw_data(), w.raw_data(), y.raw_data(), rows.data(), e, m, n, k,
                                      stream);
        },
        stream);
    if (!c.fprop_only) {
      Tensor dy = device_fill(ch.bf16, {m, n}, DType::bf16, stream), dx = Tensor::empty({m, k}, DType::bf16, dev);
      Tensor dw = Tensor::empty({e, n, k}, DType::f32, dev);
      r.bf16_dgrad = median_ms(
          [&] {
            grouped_linear_dgrad_cuda(DType::bf16, dy.raw_data(), w.raw_data(), dx.raw_data(), rows.data(), e, m, n, k,
                                      stream);
          },
          stream);
      r.bf16_wgrad = median_ms(
          [&] {
            grouped_linear_wgrad_cuda(DType::bf16, x.raw_data(), dy.raw_data(), dw.data<float>(), rows.data(), e, m, n,
                                      k, false, stream);
          },
          stream);
    }
  }
  FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return r;
}

double tflops(const Case& c, int num_gemms, double ms) {
  return 2.0 * num_gemms * double(c.num_experts * c.padded_tokens_per_expert) * double(c.n) * double(c.k) /
         (ms * 1e-3) / 1e12;
}

}  // namespace

int main() {
  return bench_main("bench_fp8_grouped_linear", [&](const cudaDeviceProp& prop, cudaStream_t stream) {
    std::printf("bench_fp8_grouped_linear on %s: FP8 1x128 x 128x128 grouped GEMMs (cuBLASLt) vs bf16, median of 30\n",
                prop.name);
    const Chunks ch = make_chunks();
    const Case cases[] = {{"dsv3_32x1024", 32, 1024, 7168, 4096, true},
                          {"fc1_E64", 64, 1536, 2048, 2816, false},
                          {"fc2_E64", 64, 1536, 1408, 2048, false}};
    std::vector<Result> results;
    for (const Case& c : cases) {
      std::printf("  %-13s E %3lld  rows/expert %5lld  K %5lld  N %5lld ...\n", c.name, (long long)c.num_experts,
                  (long long)c.padded_tokens_per_expert, (long long)c.k, (long long)c.n);
      std::fflush(stdout);
      results.push_back(bench_case(c, ch, stream));
    }
    std::printf("\n%-13s %9s %9s %9s %9s %8s %8s %9s %8s %8s\n", "case", "fp8 fwd", "dgrad", "wgrad", "fp8 step",
                "TF/s", "of 1275", "bf16 step", "TF/s", "x bf16");
    for (const Result& r : results) {
      const int g = r.c.fprop_only ? 1 : 3;
      const double fp8 = r.fp8_fwd + r.fp8_dgrad + r.fp8_wgrad, bf = r.bf16_fwd + r.bf16_dgrad + r.bf16_wgrad;
      std::printf("%-13s %9.3f %9.3f %9.3f %9.3f %8.1f %8.3f %9.3f %8.1f %8.3f\n", r.c.name, r.fp8_fwd, r.fp8_dgrad,
                  r.fp8_wgrad, fp8, tflops(r.c, g, fp8), tflops(r.c, g, fp8) / kCeilingTflops, bf, tflops(r.c, g, bf),
                  bf / fp8);
    }
    for (const Result& r : results) {
      const Case& c = r.c;
      auto line = [&](const char* pass, double fp8_ms, double bf16_ms) {
        const double tf = tflops(c, 1, fp8_ms);
        std::printf(
            "BENCH fp8_grouped_linear case=%s pass=%s E=%lld padded_tokens_per_expert=%lld K=%lld N=%lld fp8_ms=%.4f "
            "fp8_tflops=%.1f frac_1275_ceiling=%.4f bf16_ms=%.4f bf16_tflops=%.1f ratio_bf16_fp8=%.4f\n",
            c.name, pass, (long long)c.num_experts, (long long)c.padded_tokens_per_expert, (long long)c.k,
            (long long)c.n, fp8_ms, tf, tf / kCeilingTflops, bf16_ms, tflops(c, 1, bf16_ms), bf16_ms / fp8_ms);
      };
      line("fprop", r.fp8_fwd, r.bf16_fwd);
      if (!c.fprop_only) {
        line("dgrad", r.fp8_dgrad, r.bf16_dgrad);
        line("wgrad", r.fp8_wgrad, r.bf16_wgrad);
        const double fp8 = r.fp8_fwd + r.fp8_dgrad + r.fp8_wgrad, bf = r.bf16_fwd + r.bf16_dgrad + r.bf16_wgrad;
        const double tf = tflops(c, 3, fp8);
        std::printf(
            "BENCH fp8_grouped_linear case=%s pass=step E=%lld fp8_ms=%.4f fp8_tflops=%.1f "
            "frac_1275_ceiling=%.4f bf16_ms=%.4f bf16_tflops=%.1f ratio_bf16_fp8=%.4f\n",
            c.name, (long long)c.num_experts, fp8, tf, tf / kCeilingTflops, bf, tflops(c, 3, bf), bf / fp8);
      }
    }
    FLOWMOE_CUDA_CHECK(cudaDeviceSynchronize());
  });
}
