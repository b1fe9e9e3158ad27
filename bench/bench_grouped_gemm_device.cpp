// bench_grouped_gemm_device: the one-launch grouped GEMMs with device row counts (kernels/grouped_gemm_device.h,
// CUTLASS) against the per-expert cuBLASLt launchers they replace (kernels/grouped_linear.h,
// kernels/fp8_grouped_linear.h, host counts), same shapes, same run:
//   "dsv3"     32 experts x 1024 rows, K 7168, N 4096 (the DESIGN.md §6 shape);
//   "fc1"/"fc2" the small MoE layer (T 8192, H 1024, F 512, E 32, top-4: 1024 rows per expert),
//              fc1 N 1024 (2F) K 1024, fc2 N 1024 K 512;
// each for bf16 and FP8 (1x128 activations x 128x128 weights; wgrad 1x128 x 1x128 along the tokens) and
// each pass: fprop (bf16 out), dgrad (bf16 out; FP8: the fprop kernel on w_t), wgrad (fp32 out).
// "ms": median of 30 runs with the host's queueing (median_ms, what a step sees); "gpu": GPU time only
// (median_gpu_ms). The one-launch times include its setup kernel (and the FP8 per-expert ones the scale
// re-layout). FLOPs 2·M·N·K; frac_ceiling against the DESIGN.md §6 ceilings (bf16 grouped 679 TFLOP/s,
// blockwise FP8 1275); speedup = per-expert ms / one-launch ms. Data random. No GPU: skip, exit 0.
#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_fp8_data.h"
#include "bench/bench_util.h"
#include "engine/tensor.h"
#include "kernels/common/cuda_check.h"
#include "kernels/common/device_api.h"
#include "kernels/fp8.h"
#include "kernels/fp8_grouped_linear.h"
#include "kernels/grouped_gemm_device.h"
#include "kernels/grouped_linear.h"

using namespace flowmoe;
using namespace flowmoe::bench;  // the shared FP8 operand data

namespace {

constexpr double kBf16CeilingTflops = 679.0;
constexpr double kFp8CeilingTflops = 1275.0;

struct Case {
  const char* name;
  int64_t num_experts, rows_per_expert, k, n;
};

struct Timing {
  double ms = 0, gpu_ms = 0;
};
template <class F>
Timing time_both(F&& run, cudaStream_t stream) {
  return {median_ms(run, stream), median_gpu_ms([] {}, run, stream, true)};
}

struct Line {
  std::string name, dtype, pass;
  Case c;
  Timing per_expert, one_launch;
};

double tflops(const Case& c, double ms) {
  return 2.0 * double(c.num_experts * c.rows_per_expert) * double(c.n) * double(c.k) / (ms * 1e-3) / 1e12;
}

// One case: each pass through the per-expert launchers and the one-launch one on the same data, bf16 then FP8.
void bench_case(const Case& c, const Chunks& ch, cudaStream_t stream, std::vector<Line>& out) {
  const int64_t e = c.num_experts, m = e * c.rows_per_expert, n = c.n, k = c.k;
  const std::vector<int64_t> rows(size_t(e), c.rows_per_expert);  // the per-expert launchers' host counts
  const Device dev = Device::cuda(0);
  Tensor counts = Tensor::from_ints(rows, {e}, DType::i32, dev);
  Tensor ws = Tensor::empty({int64_t(grouped_gemm_device_workspace_bytes(e))}, DType::u8, dev);
  const size_t ws_bytes = ws.nbytes();
  const int32_t* cnt = counts.data<int32_t>();
  auto add = [&](const char* dtype, const char* pass, auto&& per_expert, auto&& one_launch) {
    out.push_back({c.name, dtype, pass, c, time_both(per_expert, stream), time_both(one_launch, stream)});
  };
  {  // bf16
    Tensor x = device_fill(ch.bf16, {m, k}, DType::bf16, stream),
           w = device_fill(ch.bf16, {e, n, k}, DType::bf16, stream);
    Tensor dy = device_fill(ch.bf16, {m, n}, DType::bf16, stream);
    Tensor y = Tensor::empty({m, n}, DType::bf16, dev), dx = Tensor::empty({m, k}, DType::bf16, dev);
    Tensor dw = Tensor::empty({e, n, k}, DType::f32, dev);
    // fprop (x into y) and dgrad (dy into dx) take the same arguments: a row operand times w.
    struct RowsPass {
      const char* pass;
      const Tensor &a, &result;
      decltype(&grouped_linear_forward_cuda) per_expert;
      decltype(&grouped_gemm_fprop_device_cuda) one_launch;
    };
    for (const RowsPass& p : {RowsPass{"fprop", x, y, grouped_linear_forward_cuda, grouped_gemm_fprop_device_cuda},
                              RowsPass{"dgrad", dy, dx, grouped_linear_dgrad_cuda, grouped_gemm_dgrad_device_cuda}})
      add(
          "bf16", p.pass,
          [&] {
            p.per_expert(DType::bf16, p.a.raw_data(), w.raw_data(), p.result.raw_data(), rows.data(), e, m, n, k,
                         stream);
          },
          [&] {
            p.one_launch(DType::bf16, p.a.raw_data(), w.raw_data(), p.result.raw_data(), cnt, e, m, n, k, ws.raw_data(),
                         ws_bytes, stream, true);
          });
    add(
        "bf16", "wgrad",
        [&] {
          grouped_linear_wgrad_cuda(DType::bf16, x.raw_data(), dy.raw_data(), dw.data<float>(), rows.data(), e, m, n, k,
                                    false, stream);
        },
        [&] {
          grouped_gemm_wgrad_device_cuda(DType::bf16, x.raw_data(), dy.raw_data(), dw.data<float>(), cnt, e, m, n, k,
                                         false, ws.raw_data(), ws_bytes, stream);
        });
  }
  // FP8; the per-expert launchers take a cuBLASLt workspace.
  const size_t lt_bytes =
      std::max(fp8_grouped_gemm_workspace_bytes(m, k, e, n), fp8_grouped_gemm_workspace_bytes(m, n, e, k));
  Tensor lt_ws = Tensor::empty({int64_t(lt_bytes)}, DType::u8, dev);
  // fprop: x rowwise [m, k] times w [e, n, k] in 128x128 blocks; dgrad: dy rowwise [m, n] times w_t [e, k, n],
  // the fprop kernel with n and k swapped.
  struct RowsShape {
    const char* pass;
    int64_t out_cols, inner;
  };
  for (const RowsShape& p : {RowsShape{"fprop", n, k}, RowsShape{"dgrad", k, n}}) {
    Tensor a = device_fill(ch.fp8, {m, p.inner}, DType::e4m3, stream),
           a_scale = device_fill(ch.scales, {m, p.inner / 128}, DType::f32, stream);
    Tensor b = device_fill(ch.fp8, {e, p.out_cols, p.inner}, DType::e4m3, stream);
    Tensor b_scale = device_fill(ch.scales, {e, p.out_cols / 128, p.inner / 128}, DType::f32, stream);
    Tensor result = Tensor::empty({m, p.out_cols}, DType::bf16, dev);
    add(
        "fp8", p.pass,
        [&] {
          fp8_grouped_gemm_cuda(DType::bf16, a.data<uint8_t>(), a_scale.data<float>(), b.data<uint8_t>(),
                                b_scale.data<float>(), result.raw_data(), rows.data(), e, m, p.out_cols, p.inner,
                                lt_ws.raw_data(), stream);
        },
        [&] {
          fp8_grouped_gemm_device_cuda(DType::bf16, a.data<uint8_t>(), a_scale.data<float>(), b.data<uint8_t>(),
                                       b_scale.data<float>(), result.raw_data(), cnt, e, m, p.out_cols, p.inner,
                                       ws.raw_data(), ws_bytes, stream);
        });
  }
  WgradOperands w = wgrad_operands(ch, e, m, n, k, e * fp8_num_blocks(c.rows_per_expert), stream);
  add(
      "fp8", "wgrad", [&] { w.run_per_expert(rows.data(), e, m, n, k, stream); },
      [&] {
        fp8_grouped_wgrad_device_cuda(w.dy_t.data<uint8_t>(), w.dy_t_scales.data<float>(), w.x_t.data<uint8_t>(),
                                      w.x_t_scales.data<float>(), w.dw.data<float>(), cnt, e, m, n, k, false,
                                      ws.raw_data(), ws_bytes, stream);
      });
}

}  // namespace

int main() {
  return bench_main("bench_grouped_gemm_device", [&](const cudaDeviceProp& prop, cudaStream_t stream) {
    std::printf(
        "bench_grouped_gemm_device on %s: one-launch grouped GEMMs (device counts, CUTLASS) vs per-expert "
        "cuBLASLt, median of 30\n",
        prop.name);
    const Chunks ch = make_chunks();
    const Case cases[] = {{"dsv3_32x1024", 32, 1024, 7168, 4096},
                          {"fc1_T8192_E32", 32, 1024, 1024, 1024},
                          {"fc2_T8192_E32", 32, 1024, 512, 1024}};
    std::vector<Line> lines;
    for (const Case& c : cases) {
      std::printf("  %-14s E %3lld  rows/expert %5lld  K %5lld  N %5lld ...\n", c.name, (long long)c.num_experts,
                  (long long)c.rows_per_expert, (long long)c.k, (long long)c.n);
      std::fflush(stdout);
      bench_case(c, ch, stream, lines);
    }
    std::printf("\n%-14s %-5s %-6s %10s %8s %10s %10s %8s %10s %7s %8s\n", "case", "dtype", "pass", "expert ms", "TF/s",
                "gpu ms", "1-launch", "TF/s", "gpu ms", "of ceil", "speedup");
    for (const Line& l : lines) {
      const double ceiling = l.dtype == "fp8" ? kFp8CeilingTflops : kBf16CeilingTflops;
      const double tf = tflops(l.c, l.one_launch.ms);
      std::printf("%-14s %-5s %-6s %10.4f %8.1f %10.4f %10.4f %8.1f %10.4f %7.3f %8.3f\n", l.name.c_str(),
                  l.dtype.c_str(), l.pass.c_str(), l.per_expert.ms, tflops(l.c, l.per_expert.ms), l.per_expert.gpu_ms,
                  l.one_launch.ms, tf, l.one_launch.gpu_ms, tf / ceiling, l.per_expert.ms / l.one_launch.ms);
    }
    for (const Line& l : lines) {
      const double ceiling = l.dtype == "fp8" ? kFp8CeilingTflops : kBf16CeilingTflops;
      const double tf = tflops(l.c, l.one_launch.ms);
      std::printf(
          "BENCH grouped_gemm_device case=%s dtype=%s pass=%s E=%lld rows_per_expert=%lld K=%lld N=%lld "
          "per_expert_ms=%.4f per_expert_tflops=%.1f per_expert_gpu_ms=%.4f one_launch_ms=%.4f "
          "one_launch_tflops=%.1f one_launch_gpu_ms=%.4f one_launch_gpu_tflops=%.1f ceiling_tflops=%.0f "
          "frac_ceiling=%.4f speedup=%.4f gpu_speedup=%.4f\n",
          l.name.c_str(), l.dtype.c_str(), l.pass.c_str(), (long long)l.c.num_experts, (long long)l.c.rows_per_expert,
          (long long)l.c.k, (long long)l.c.n, l.per_expert.ms, tflops(l.c, l.per_expert.ms), l.per_expert.gpu_ms,
          l.one_launch.ms, tf, l.one_launch.gpu_ms, tflops(l.c, l.one_launch.gpu_ms), ceiling, tf / ceiling,
          l.per_expert.ms / l.one_launch.ms, l.per_expert.gpu_ms / l.one_launch.gpu_ms);
    }
    FLOWMOE_CUDA_CHECK(cudaDeviceSynchronize());
  });
}
