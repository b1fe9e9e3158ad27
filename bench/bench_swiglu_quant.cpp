// bench_swiglu_quant: the fused SwiGLU x prob + rowwise 1x128 FP8 quantize (kernels/cuda/swiglu_quant.cu),
// forward and backward, bf16 h with probs, against the unfused chain it replaces:
//   forward  swiglu_forward_cuda -> act bf16; act *= prob; quantize(act)                       (3 kernels)
//   backward d_prob = rowdot(d_a, act) (act saved); dy = d_a * prob; swiglu_backward_cuda -> d_h bf16;
//            quantize(d_h)                                                                     (4 kernels)
// (the baseline's prob product, row dot and quantize kernels: bench/baselines/swiglu_quant_baseline.cu).
// Bytes are the fused op's minimal traffic: forward reads h and prob, writes q and scale_inv;
// backward reads d_a, h and prob, writes q, scale_inv and d_prob. Times are GPU time only (a 256 MiB
// memset queued first hides launch latency), median of kReps after kWarmup; the ceiling is the device's
// own D2D copy (read + write) measured the same way in the same run, and the H200 figure of DESIGN.md §6.
// No GPU: prints a skip line and exits 0.
#include <algorithm>
#include <cstdio>
#include <vector>

#include "bench/baselines/swiglu_quant_baseline.h"
#include "bench/bench_util.h"
#include "engine/rng.h"
#include "kernels/common/cuda_check.h"
#include "kernels/common/device_api.h"
#include "kernels/fp8.h"
#include "kernels/swiglu.h"
#include "kernels/swiglu_quant.h"

using namespace flowmoe;

namespace {

constexpr int kWarmup = 5;
constexpr int kReps = 30;
// GPU time only (bench_util.h): launch latency out of the measurement.
template <class F>
double median_gpu_ms(F&& run, cudaStream_t stream) {
  return flowmoe::median_gpu_ms([] {}, run, stream, true, kWarmup, kReps);
}

struct Config {
  int64_t M, F;
  const char* what;
};
const Config kConfigs[] = {{98304, 1408, "16384 tokens x top-6, F 1408"}, {32768, 512, "32768 rows, F 512"}};

struct Result {
  Config c;
  double fwd_bytes, bwd_bytes;
  double fwd_ms, fwd_unfused_ms, bwd_ms, bwd_unfused_ms;
};

Result bench(const Config& c, Rng& rng, cudaStream_t stream) {
  const Device dev = Device::cuda(0);
  const int64_t M = c.M, F = c.F, nb = fp8_num_blocks(F), nb2 = fp8_num_blocks(2 * F);
  Tensor h = random_tiled_device(rng, {M, 2 * F}, -4, 4, DType::bf16, stream);
  Tensor d_a = random_tiled_device(rng, {M, F}, -1, 1, DType::bf16, stream);
  Tensor prob = rng.uniform({M}, 0, 1, DType::f32, dev);
  Tensor q = Tensor::empty({M, F}, DType::e4m3, dev), s = Tensor::empty({M, nb}, DType::f32, dev);
  Tensor q2 = Tensor::empty({M, 2 * F}, DType::e4m3, dev), s2 = Tensor::empty({M, nb2}, DType::f32, dev);
  Tensor d_prob = Tensor::empty({M}, DType::f32, dev);
  Tensor act = Tensor::empty({M, F}, DType::bf16, dev), dy = Tensor::empty({M, F}, DType::bf16, dev);
  Tensor d_h = Tensor::empty({M, 2 * F}, DType::bf16, dev);
  auto* qp = static_cast<uint8_t*>(q.raw_data());
  auto* q2p = static_cast<uint8_t*>(q2.raw_data());
  const float* pp = prob.data<float>();

  Result r{c, 0, 0, 0, 0, 0, 0};
  r.fwd_bytes = double(M) * double(2 * F) * 2 + double(M) * 4 + double(M * F) + double(M * nb) * 4;
  r.bwd_bytes = double(M * F) * 2 + double(M) * double(2 * F) * 2 + double(M) * 4 + double(M * 2 * F) +
                double(M * nb2) * 4 + double(M) * 4;
  r.fwd_ms = median_gpu_ms(
      [&] { swiglu_quant_forward_cuda(DType::bf16, h.raw_data(), pp, M, F, qp, s.data<float>(), stream); }, stream);
  r.fwd_unfused_ms = median_gpu_ms(
      [&] {
        swiglu_forward_cuda(DType::bf16, act.raw_data(), h.raw_data(), M, F, stream);
        swiglu_quant_baseline_row_scale_cuda(DType::bf16, act.raw_data(), act.raw_data(), pp, M, F, stream);
        swiglu_quant_baseline_quantize_cuda(DType::bf16, act.raw_data(), M, F, qp, s.data<float>(), stream);
      },
      stream);
  r.bwd_ms = median_gpu_ms(
      [&] {
        swiglu_quant_backward_cuda(DType::bf16, d_a.raw_data(), h.raw_data(), pp, M, F, q2p, s2.data<float>(), nullptr,
                                   d_prob.data<float>(), stream);
      },
      stream);
  r.bwd_unfused_ms = median_gpu_ms(
      [&] {
        swiglu_quant_baseline_row_dot_cuda(DType::bf16, d_prob.data<float>(), d_a.raw_data(), act.raw_data(), M, F,
                                           stream);
        swiglu_quant_baseline_row_scale_cuda(DType::bf16, dy.raw_data(), d_a.raw_data(), pp, M, F, stream);
        swiglu_backward_cuda(DType::bf16, d_h.raw_data(), dy.raw_data(), h.raw_data(), M, F, stream);
        swiglu_quant_baseline_quantize_cuda(DType::bf16, d_h.raw_data(), M, 2 * F, q2p, s2.data<float>(), stream);
      },
      stream);
  FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return r;
}

void print_results(const std::vector<Result>& results, double copy) {
  std::printf("\n%-30s %4s | %9s %8s %6s %6s | %10s %8s | %7s\n", "config", "dir", "fused ms", "GB/s", "copy", "h200",
              "unfused ms", "GB/s", "speedup");
  for (const Result& r : results)
    for (int bwd = 0; bwd < 2; ++bwd) {
      const double bytes = bwd ? r.bwd_bytes : r.fwd_bytes, ms = bwd ? r.bwd_ms : r.fwd_ms;
      const double ums = bwd ? r.bwd_unfused_ms : r.fwd_unfused_ms, g = gbps(bytes, ms);
      std::printf("%-30s %4s | %9.4f %8.0f %6.3f %6.3f | %10.4f %8.0f | %7.2f\n", r.c.what, bwd ? "bwd" : "fwd", ms, g,
                  g / copy, g / kH200CopyGbps, ums, gbps(bytes, ums), ums / ms);
    }
  for (const Result& r : results)
    for (int bwd = 0; bwd < 2; ++bwd) {
      const double bytes = bwd ? r.bwd_bytes : r.fwd_bytes, ms = bwd ? r.bwd_ms : r.fwd_ms;
      const double ums = bwd ? r.bwd_unfused_ms : r.fwd_unfused_ms, g = gbps(bytes, ms);
      std::printf(
          "BENCH swiglu_quant dir=%s M=%lld F=%lld dtype=bf16 prob=1 ms=%.4f gbps=%.1f frac_copy=%.4f "
          "frac_h200=%.4f unfused_ms=%.4f unfused_gbps=%.1f speedup=%.3f copy_gbps=%.1f\n",
          bwd ? "bwd" : "fwd", (long long)r.c.M, (long long)r.c.F, ms, g, g / copy, g / kH200CopyGbps, ums,
          gbps(bytes, ums), ums / ms, copy);
    }
  std::fflush(stdout);
}

}  // namespace

int main() {
  return bench_main("bench_swiglu_quant", [&](const cudaDeviceProp& prop, cudaStream_t stream) {
    std::printf("bench_swiglu_quant on %s: bf16 h with probs, GPU time only, median of %d reps\n", prop.name, kReps);
    const double copy = copy_gbps(stream, true).gpu_only;
    std::printf("  device D2D copy (read + write): %.0f GB/s (%.3f of the H200's %.0f)\n", copy, copy / kH200CopyGbps,
                kH200CopyGbps);
    Rng rng(2026);
    std::vector<Result> results;
    for (const Config& c : kConfigs) results.push_back(bench(c, rng, stream));
    print_results(results, copy);
    FLOWMOE_CUDA_CHECK(cudaDeviceSynchronize());
  });
}
