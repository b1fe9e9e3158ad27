// bench_rmsnorm_quant: the fused RMSNorms, bf16, against the unfused kernels they replace:
//   rmsnorm_quant (kernels/cuda/rmsnorm_quant.cu), q or q + y   vs  rmsnorm_forward_cuda, quantize_rowwise_cuda(y)
//   add_rmsnorm (kernels/cuda/add_rmsnorm.cu), h + y, h + q or h + q + y  vs  binary_cuda's add, then the above
// (q: fp8_full's attention input norm; q + y: its MoE input norm, whose router reads y; h + y: the residual add and
// post-attention norm of the other recipes; h + q (+ y): fp8_full's). Bytes are the fused op's minimal traffic:
// x (and a) read, h, y, q and scale_inv written as asked, the weight's [H] left out. Times are GPU time only (a 256 MiB
// memset queued first hides launch latency), median of kReps after kWarmup; the ceiling is the device's own D2D copy
// (read + write) measured the same way in the same run, and the H200 figure of DESIGN.md §6. No GPU: prints a skip line
// and exits 0.
#include <cstdio>
#include <vector>

#include "bench/bench_util.h"
#include "kernels/add_rmsnorm.h"
#include "kernels/elementwise.h"
#include "kernels/fp8.h"
#include "kernels/quantize.h"
#include "kernels/rmsnorm.h"
#include "kernels/rmsnorm_quant.h"

using namespace flowmoe;

namespace {

constexpr int kWarmup = 5;
constexpr int kReps = 30;
constexpr double kEps = 1e-6;

struct Config {
  int64_t rows, hidden;
  const char* what;
};
const Config kConfigs[] = {{16384, 7168, "16384 tokens, H 7168 (V3)"},
                           {32768, 2048, "32768 tokens, H 2048 (V2-Lite)"},
                           {8192, 4096, "8192 tokens, H 4096"}};

// What a fused op is asked to write: its FP8 copy of the norm (q), the bf16 norm (y), and, with the residual add
// fused in (add_rmsnorm), the sum h.
struct Form {
  bool add, y, q;
  const char* name;
};
const Form kForms[] = {{false, false, true, "q"},
                       {false, true, true, "q+y"},
                       {true, true, false, "h+y"},
                       {true, false, true, "h+q"},
                       {true, true, true, "h+q+y"}};

struct Result {
  Config c;
  Form f;
  double bytes, fused_ms, unfused_ms;
};

Result bench(const Config& c, const Form& f, Rng& rng, cudaStream_t stream) {
  const Device dev = Device::cuda(0);
  const int64_t M = c.rows, H = c.hidden, nb = fp8_num_blocks(H);
  const Tensor x = random_tiled_device(rng, {M, H}, -2, 2, DType::bf16, stream);
  const Tensor a = random_tiled_device(rng, {M, H}, -2, 2, DType::bf16, stream);
  const Tensor w = random_tiled_device(rng, {H}, 0.5, 1.5, DType::bf16, stream);
  Tensor h = Tensor::empty({M, H}, DType::bf16, dev), y = Tensor::empty({M, H}, DType::bf16, dev);
  Tensor q = Tensor::empty({M, H}, DType::e4m3, dev), s = Tensor::empty({M, nb}, DType::f32, dev);
  auto* qp = static_cast<uint8_t*>(q.raw_data());
  float* sp = s.data<float>();
  void* y_out = f.y ? y.raw_data() : nullptr;
  auto gpu_ms = [&](auto run) { return median_gpu_ms([] {}, run, stream, true, kWarmup, kReps); };

  const double elems = double(M * H);
  Result r{c, f, elems * 2 * (f.add ? 3 : 1) + (f.y ? elems * 2 : 0) + (f.q ? elems + double(M * nb) * 4 : 0), 0, 0};
  r.fused_ms = gpu_ms([&] {
    if (f.add)
      add_rmsnorm_forward_cuda(DType::bf16, h.raw_data(), y_out, f.q ? qp : nullptr, sp, x.raw_data(), a.raw_data(),
                               w.raw_data(), M, H, kEps, stream);
    else
      rmsnorm_quant_forward_cuda(DType::bf16, y_out, qp, sp, x.raw_data(), w.raw_data(), M, H, kEps, stream);
  });
  r.unfused_ms = gpu_ms([&] {
    const void* normed = x.raw_data();
    if (f.add) {
      binary_cuda(BinaryOp::add, DType::bf16, h.raw_data(), x.raw_data(), a.raw_data(), M * H, stream);
      normed = h.raw_data();
    }
    rmsnorm_forward_cuda(DType::bf16, y.raw_data(), normed, w.raw_data(), M, H, kEps, stream);
    if (f.q) quantize_rowwise_cuda(DType::bf16, y.raw_data(), M, H, qp, sp, stream);
  });
  FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return r;
}

void print_results(const std::vector<Result>& results, double copy) {
  std::printf("\n%-32s %-6s | %9s %8s %6s %6s | %10s %8s %6s | %7s\n", "config", "out", "fused ms", "GB/s", "copy",
              "h200", "unfused ms", "GB/s", "copy", "speedup");
  for (const Result& r : results) {
    const double g = gbps(r.bytes, r.fused_ms), ug = gbps(r.bytes, r.unfused_ms);
    std::printf("%-32s %-6s | %9.4f %8.0f %6.3f %6.3f | %10.4f %8.0f %6.3f | %7.2f\n", r.c.what, r.f.name, r.fused_ms,
                g, g / copy, g / kH200CopyGbps, r.unfused_ms, ug, ug / copy, r.unfused_ms / r.fused_ms);
  }
  for (const Result& r : results) {
    const double g = gbps(r.bytes, r.fused_ms), ug = gbps(r.bytes, r.unfused_ms);
    std::printf(
        "BENCH rmsnorm_quant rows=%lld H=%lld dtype=bf16 out=%s ms=%.4f gbps=%.1f frac_copy=%.4f frac_h200=%.4f "
        "unfused_ms=%.4f unfused_gbps=%.1f unfused_frac_copy=%.4f speedup=%.3f copy_gbps=%.1f\n",
        (long long)r.c.rows, (long long)r.c.hidden, r.f.name, r.fused_ms, g, g / copy, g / kH200CopyGbps, r.unfused_ms,
        ug, ug / copy, r.unfused_ms / r.fused_ms, copy);
  }
  std::fflush(stdout);
}

}  // namespace

int main() {
  return bench_main("bench_rmsnorm_quant", [&](const cudaDeviceProp& prop, cudaStream_t stream) {
    std::printf("bench_rmsnorm_quant on %s: bf16 x, GPU time only, median of %d reps\n", prop.name, kReps);
    const double copy = copy_gbps(stream, true).gpu_only;
    std::printf("  device D2D copy (read + write): %.0f GB/s (%.3f of the H200's %.0f)\n", copy, copy / kH200CopyGbps,
                kH200CopyGbps);
    Rng rng(2026);
    std::vector<Result> results;
    for (const Config& c : kConfigs)
      for (const Form& f : kForms) results.push_back(bench(c, f, rng, stream));
    print_results(results, copy);
    FLOWMOE_CUDA_CHECK(cudaDeviceSynchronize());
  });
}
