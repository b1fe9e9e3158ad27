// bench_fp8_transpose: the scaling-aware FP8 transpose (kernels/cuda/fp8_transpose.cu) of a rowwise
// 1x128 e4m3 tensor [32768, 7168] into colwise 1x128 over segments, for one segment, 64 equal segments
// (align 128), 64 ragged segments aligned to 16 (the FP8 GEMM minimum) and 64 ragged unaligned ones.
// Baseline in the same run: the "double quantization" the classic recipe does (dequantize rowwise to
// bf16, then an ordinary colwise quantize; bench/baselines/fp8_transpose_baseline.cu). Ceiling: the device's D2D
// cudaMemcpyAsync bandwidth (read + written) measured in the same run, and the H200 figure of DESIGN.md §6.
// Bytes = q read + its scales read + q_t written (all K x M, the zeroed tail too) + colwise scales written.
// Data: realistic activations (rows ~ N(0,1) x a per-row log-normal magnitude, 8 outlier channels x20),
// quantized rowwise on the host (4096 rows, tiled 8 times). The error study of those 4096 rows (one
// segment) is printed: relative error vs x of the transpose, the baseline and a direct colwise quantize.
// Times are medians of event-timed runs. No GPU: prints a skip line and exits 0.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/baselines/fp8_transpose_baseline.h"
#include "bench/bench_util.h"
#include "kernels/common/cuda_check.h"
#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"
#include "kernels/fp8.h"
#include "kernels/fp8_transpose.h"

using namespace flowmoe;

namespace {

constexpr int64_t kM = 32768, kK = 7168, kHostRows = 4096;
constexpr int kSegments = 64;

// Rows ~ N(0,1) * exp(N(0,1)), 8 channels x20: x [kHostRows, kK].
std::vector<float> realistic_activations(std::mt19937_64& gen) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> channel(size_t(kK), 1.f);
  for (int c = 0; c < 8; ++c) channel[size_t(std::uniform_int_distribution<int64_t>(0, kK - 1)(gen))] = 20.f;
  std::vector<float> x(size_t(kHostRows * kK));
  for (int64_t i = 0; i < kHostRows; ++i) {
    const float mag = std::exp(normal(gen));
    for (int64_t j = 0; j < kK; ++j) x[size_t(i * kK + j)] = normal(gen) * mag * channel[size_t(j)];
  }
  return x;
}

// Scalar rowwise 1x128 quantization (kernels/fp8.h).
void quantize_rowwise_host(const std::vector<float>& x, std::vector<uint8_t>& q, std::vector<float>& s) {
  const int64_t nb = fp8_num_blocks(kK);
  q.resize(x.size()), s.resize(size_t(kHostRows * nb));
  for (int64_t i = 0; i < kHostRows; ++i)
    for (int64_t b = 0; b < nb; ++b) {
      float amax = 0;
      for (int64_t j = b * 128; j < b * 128 + 128; ++j) amax = fp8_amax_update(amax, x[size_t(i * kK + j)]);
      const float s_inv = fp8_scale_inv(amax), scale = fp8_scale_from_inv(s_inv);
      s[size_t(i * nb + b)] = s_inv;
      for (int64_t j = b * 128; j < b * 128 + 128; ++j)
        q[size_t(i * kK + j)] = f32_to_e4m3(x[size_t(i * kK + j)] * scale);
    }
}

// 64 segments with random sizes (weights in [0.2, 1.8]) rounded down to `align`, leaving a tail.
std::vector<int64_t> ragged_segments(std::mt19937_64& gen, int64_t align) {
  std::uniform_real_distribution<double> w(0.2, 1.8);
  std::vector<double> weights(kSegments);
  double sum = 0;
  for (double& v : weights) sum += (v = w(gen));
  std::vector<int64_t> segs;
  for (double v : weights) segs.push_back(int64_t(v / sum * double(kM - 1000)) / align * align);
  return segs;
}

struct Config {
  std::string name;
  std::vector<int64_t> segs;
};

// Relative error ||deq - x|| / ||x|| of a colwise result over the first kHostRows rows (128-row blocks).
double colwise_rel_error(const std::vector<uint8_t>& q_t /*[kK, kHostRows]*/, const std::vector<float>& s_t,
                         const std::vector<float>& x) {
  double num = 0, den = 0;
  for (int64_t j = 0; j < kK; ++j)
    for (int64_t i = 0; i < kHostRows; ++i) {
      const double ref = x[size_t(i * kK + j)];
      const double d = double(e4m3_to_f32(q_t[size_t(j * kHostRows + i)])) * s_t[size_t((i / 128) * kK + j)] - ref;
      num += d * d, den += ref * ref;
    }
  return std::sqrt(num / den);
}

}  // namespace

int main() {
  return bench_main("bench_fp8_transpose", [&](const cudaDeviceProp& prop, cudaStream_t stream) {
    const double copy = copy_gbps(stream).queued;
    std::printf("bench_fp8_transpose on %s: e4m3 [%lld, %lld] rowwise 1x128 -> colwise 1x128\n", prop.name,
                (long long)kM, (long long)kK);
    std::printf("  device D2D copy (read + write): %.0f GB/s (%.3f of the H200's %.0f)\n", copy, copy / kH200CopyGbps,
                kH200CopyGbps);

    std::mt19937_64 gen(2026);
    const std::vector<float> x = realistic_activations(gen);
    std::vector<uint8_t> hq;
    std::vector<float> hs;
    quantize_rowwise_host(x, hq, hs);
    const int64_t nb = fp8_num_blocks(kK);
    uint8_t* q = static_cast<uint8_t*>(cuda_malloc_raw(size_t(kM * kK), 0));
    float* s = static_cast<float*>(cuda_malloc_raw(size_t(kM * nb) * 4, 0));
    for (int64_t t = 0; t < kM / kHostRows; ++t) {
      FLOWMOE_CUDA_CHECK(cudaMemcpy(q + t * kHostRows * kK, hq.data(), hq.size(), cudaMemcpyHostToDevice));
      FLOWMOE_CUDA_CHECK(cudaMemcpy(s + t * kHostRows * nb, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
    }
    const int64_t max_blocks = kM / 128 + kSegments;
    uint8_t* q_t = static_cast<uint8_t*>(cuda_malloc_raw(size_t(kK * kM), 0));
    uint8_t* q_t_base = static_cast<uint8_t*>(cuda_malloc_raw(size_t(kK * kM), 0));
    float* s_t = static_cast<float*>(cuda_malloc_raw(size_t(max_blocks * kK) * 4, 0));
    float* s_t_base = static_cast<float*>(cuda_malloc_raw(size_t(max_blocks * kK) * 4, 0));
    uint16_t* y = static_cast<uint16_t*>(cuda_malloc_raw(size_t(kM * kK) * 2, 0));

    const std::vector<Config> configs = {{"1", {kM}},
                                         {"64x512", std::vector<int64_t>(kSegments, kM / kSegments)},
                                         {"64ragged16", ragged_segments(gen, 16)},
                                         {"64ragged1", ragged_segments(gen, 1)}};
    std::printf("\n%-12s %7s %7s | %9s %8s %6s %6s | %9s %9s %9s | %7s\n", "segments", "rows", "blocks", "xpose us",
                "GB/s", "copy", "h200", "deq us", "req us", "base us", "speedup");
    std::vector<std::string> bench_lines;
    for (const Config& c : configs) {
      const int64_t n = int64_t(c.segs.size());
      const int64_t blocks = fp8_transpose_num_blocks(c.segs.data(), n, kM);
      int64_t rows = 0;
      for (int64_t r : c.segs) rows += r;
      const double bytes =
          double(rows) * double(kK) + double(rows * nb) * 4 + double(kK) * double(kM) + double(blocks * kK) * 4;
      const double ms =
          median_ms([&] { fp8_transpose_cuda(q, s, kM, kK, c.segs.data(), n, q_t, s_t, stream); }, stream);
      const double deq_ms = median_ms([&] { fp8_transpose_baseline_dequantize_cuda(q, s, kM, kK, y, stream); }, stream);
      auto requantize = [&] {
        fp8_transpose_baseline_quantize_colwise_cuda(y, kM, kK, c.segs.data(), n, q_t_base, s_t_base, stream);
      };
      const double req_ms = median_ms(requantize, stream);
      const double base_ms = median_ms(
          [&] {
            fp8_transpose_baseline_dequantize_cuda(q, s, kM, kK, y, stream);
            requantize();
          },
          stream);
      const double g = gbps(bytes, ms);
      std::printf("%-12s %7lld %7lld | %9.1f %8.0f %6.3f %6.3f | %9.1f %9.1f %9.1f | %7.2f\n", c.name.c_str(),
                  (long long)rows, (long long)blocks, ms * 1e3, g, g / copy, g / kH200CopyGbps, deq_ms * 1e3,
                  req_ms * 1e3, base_ms * 1e3, base_ms / ms);
      char line[512];
      std::snprintf(line, sizeof(line),
                    "BENCH fp8_transpose %lldx%lld seg=%s: %.1f us, %.1f GB/s (%.3f of copy), %.2f x faster than "
                    "dequant+requant (rows=%lld blocks=%lld frac_h200=%.3f copy_gbps=%.1f baseline_us=%.1f "
                    "baseline_gbps=%.1f)",
                    (long long)kM, (long long)kK, c.name.c_str(), ms * 1e3, g, g / copy, base_ms / ms, (long long)rows,
                    (long long)blocks, g / kH200CopyGbps, copy, base_ms * 1e3, gbps(bytes, base_ms));
      bench_lines.push_back(line);

      if (c.segs.size() == 1) {  // error study on the host block: the first 4096 rows, 32 whole blocks
        std::vector<uint8_t> a(size_t(kK * kHostRows)), b(a.size());
        std::vector<float> sa(size_t(kHostRows / 128 * kK)), sb(sa.size());
        FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
        FLOWMOE_CUDA_CHECK(cudaMemcpy2D(a.data(), kHostRows, q_t, kM, kHostRows, kK, cudaMemcpyDeviceToHost));
        FLOWMOE_CUDA_CHECK(cudaMemcpy2D(b.data(), kHostRows, q_t_base, kM, kHostRows, kK, cudaMemcpyDeviceToHost));
        FLOWMOE_CUDA_CHECK(cudaMemcpy(sa.data(), s_t, sa.size() * 4, cudaMemcpyDeviceToHost));
        FLOWMOE_CUDA_CHECK(cudaMemcpy(sb.data(), s_t_base, sb.size() * 4, cudaMemcpyDeviceToHost));
        // (c): colwise quantization of x itself, on the host.
        std::vector<uint8_t> cq(a.size());
        std::vector<float> cs(sa.size());
        for (int64_t r0 = 0; r0 < kHostRows; r0 += 128)
          for (int64_t j = 0; j < kK; ++j) {
            float amax = 0;
            for (int64_t i = r0; i < r0 + 128; ++i) amax = fp8_amax_update(amax, x[size_t(i * kK + j)]);
            const float s_inv = fp8_scale_inv(amax), scale = fp8_scale_from_inv(s_inv);
            cs[size_t(r0 / 128 * kK + j)] = s_inv;
            for (int64_t i = r0; i < r0 + 128; ++i)
              cq[size_t(j * kHostRows + i)] = f32_to_e4m3(x[size_t(i * kK + j)] * scale);
          }
        std::printf(
            "  [fp8_transpose error study] %lld x %lld realistic activations, rel. error vs x: (a) "
            "scaling-aware transpose %.5f, (b) dequantize+requantize %.5f, (c) direct colwise quantize %.5f\n",
            (long long)kHostRows, (long long)kK, colwise_rel_error(a, sa, x), colwise_rel_error(b, sb, x),
            colwise_rel_error(cq, cs, x));
      }
    }
    for (const std::string& l : bench_lines) std::printf("%s\n", l.c_str());
    std::fflush(stdout);
    FLOWMOE_CUDA_CHECK(cudaDeviceSynchronize());
    for (void* p : std::initializer_list<void*>{q, s, q_t, q_t_base, s_t, s_t_base, y}) cuda_free_raw(p, 0);
  });
}
