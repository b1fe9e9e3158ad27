// bench_attention: causal attention on bf16, forward and backward, through the launchers of
// kernels/attention.h: the tensor-core kernels (kernels/cuda/flash_attention.cu, the engine's flash backend)
// against the fp32 CUDA-core kernels (kernels/cuda/attention.cu) timed in the same run, and, in a build with cuDNN,
// cuDNN's fused SDPA (kernels/attention_cudnn.h, the engine's cudnn backend) on the same inputs: a "cudnn" row per
// shape (all shapes, the wide heads too) and cudnn_* fields on its BENCH line, with cudnn_rel_diff its largest
// normwise difference from flash.
// FLOPs as engine/ops/attention.cpp counts them: forward B·nh·T²·(hd + v_hd) (q·kᵀ and p·v over the causal
// half), backward 2.5 times that. The wide heads (DeepSeek-V3's q, k 192 and v 128) run on the tensor-core
// kernels alone: no CUDA-core row, no rel_diff. The ceiling is a bf16 8192³ GEMM through gemm_cuda (kernels/linear.h),
// timed in this run (707 TFLOP/s on the H200, DESIGN.md §6). Each time is the median of kReps event-timed
// runs after kWarmup. rel_diff is the largest normwise difference between the two kernel families' o,
// d_q, d_k and d_v (a few 1e-3: P and dS in bf16), a check that the timed kernels agree. No GPU: prints a
// skip line and exits 0.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "bench/bench_util.h"
#include "engine/rng.h"
#include "kernels/attention.h"
#include "kernels/attention_cudnn.h"
#include "kernels/common/cuda_check.h"
#include "kernels/common/device_api.h"
#include "kernels/linear.h"

using namespace flowmoe;

namespace {

constexpr int kWarmup = 3;
constexpr int kReps = 20;
constexpr int64_t kCeilingSize = 8192;

struct AttnShape {
  int64_t batch, seq_len, num_heads, head_dim, v_head_dim;
  bool simt() const { return head_dim == v_head_dim && head_dim <= kAttentionMaxHeadDimCuda; }
};

// One kernel family's buffers for a shape, all on the GPU.
struct Buffers {
  Tensor out, lse, delta, d_q, d_k, d_v;
  Buffers(const AttnShape& s, Device dev)
      : out(Tensor::empty({s.batch, s.seq_len, s.num_heads, s.v_head_dim}, DType::bf16, dev)),
        lse(Tensor::empty({s.batch, s.num_heads, s.seq_len}, DType::f32, dev)),
        delta(Tensor::empty({s.batch, s.num_heads, s.seq_len}, DType::f32, dev)),
        d_q(Tensor::empty({s.batch, s.seq_len, s.num_heads, s.head_dim}, DType::bf16, dev)),
        d_k(Tensor::empty(d_q.shape(), DType::bf16, dev)),
        d_v(Tensor::empty(out.shape(), DType::bf16, dev)) {}
};

struct Times {
  double fwd_ms = 0, bwd_ms = 0, fwdbwd_ms = 0;
};

// The forward and backward timed alone and together; the backward reads the o and lse the forward left.
template <class Fwd, class Bwd>
Times time_pair(const Fwd& fwd, const Bwd& bwd, cudaStream_t stream) {
  Times t;
  t.fwd_ms = median_ms(fwd, stream, kWarmup, kReps);
  t.bwd_ms = median_ms(bwd, stream, kWarmup, kReps);  // reads the o and lse the forward left
  t.fwdbwd_ms = median_ms(
      [&] {
        fwd();
        bwd();
      },
      stream, kWarmup, kReps);
  FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return t;
}

Times time_family(AttentionKernel kernel, const AttnShape& s, Buffers& b, const Tensor& q, const Tensor& k,
                  const Tensor& v, const Tensor& d_out, cudaStream_t stream) {
  auto fwd = [&] {
    attention_forward_cuda(DType::bf16, b.out.raw_data(), b.lse.data<float>(), q.raw_data(), k.raw_data(), v.raw_data(),
                           s.batch, s.seq_len, s.num_heads, s.head_dim, s.v_head_dim, stream, kernel);
  };
  auto bwd = [&] {
    attention_backward_cuda(DType::bf16, b.d_q.raw_data(), b.d_k.raw_data(), b.d_v.raw_data(), b.delta.data<float>(),
                            d_out.raw_data(), q.raw_data(), k.raw_data(), v.raw_data(), b.out.raw_data(),
                            b.lse.data<float>(), s.batch, s.seq_len, s.num_heads, s.head_dim, s.v_head_dim, stream,
                            kernel);
  };
  return time_pair(fwd, bwd, stream);
}

// cuDNN's backend, with its workspaces allocated once outside the timed runs (the engine's allocator hands the op
// cached blocks, so a step pays no cudaMalloc either).
Times time_cudnn(const AttentionCudnnShape& shape, Buffers& b, const Tensor& q, const Tensor& k, const Tensor& v,
                 const Tensor& d_out, cudaStream_t stream) {
  const Device dev = q.device();
  Tensor fwd_ws = Tensor::empty({attention_cudnn_workspace_bytes(shape, false)}, DType::u8, dev);
  Tensor bwd_ws = Tensor::empty({attention_cudnn_workspace_bytes(shape, true)}, DType::u8, dev);
  auto fwd = [&] {
    attention_forward_cudnn(b.out.raw_data(), b.lse.data<float>(), q.raw_data(), k.raw_data(), v.raw_data(), shape,
                            fwd_ws.raw_data(), stream);
  };
  auto bwd = [&] {
    attention_backward_cudnn(b.d_q.raw_data(), b.d_k.raw_data(), b.d_v.raw_data(), d_out.raw_data(), q.raw_data(),
                             k.raw_data(), v.raw_data(), b.out.raw_data(), b.lse.data<float>(), shape,
                             bwd_ws.raw_data(), stream);
  };
  return time_pair(fwd, bwd, stream);
}

// The largest normwise difference between two runs' o, d_q, d_k and d_v (relative to b's).
double rel_diff(const Buffers& a, const Buffers& b) {
  double worst = 0;
  for (auto [x_t, y_t] :
       {std::pair{&a.out, &b.out}, std::pair{&a.d_q, &b.d_q}, std::pair{&a.d_k, &b.d_k}, std::pair{&a.d_v, &b.d_v}}) {
    const std::vector<double> x = x_t->to_doubles(), y = y_t->to_doubles();
    double num = 0, den = 0;
    for (size_t i = 0; i < x.size(); ++i) num += (x[i] - y[i]) * (x[i] - y[i]), den += y[i] * y[i];
    worst = std::max(worst, den > 0 ? std::sqrt(num / den) : 0.0);
  }
  return worst;
}

double tflops(double flops, double ms) { return flops / (ms * 1e-3) / 1e12; }

// The bf16 GEMM ceiling of this device, measured now: c[n,n] = a[n,n]·b[n,n]ᵀ.
double gemm_ceiling_tflops(Rng& rng, cudaStream_t stream) {
  const int64_t n = kCeilingSize;
  const Device dev = Device::cuda(0);
  Tensor a = rng.uniform({n, n}, -1.0, 1.0, DType::f32).to(DType::bf16).to(dev);
  Tensor b = rng.uniform({n, n}, -1.0, 1.0, DType::f32).to(DType::bf16).to(dev);
  Tensor c = Tensor::empty({n, n}, DType::bf16, dev);
  const double ms = median_ms(
      [&] {
        gemm_cuda(false, true, n, n, n, DType::bf16, a.raw_data(), n, b.raw_data(), n, DType::bf16, c.raw_data(), n,
                  nullptr, false, stream);
      },
      stream, kWarmup, kReps);
  return tflops(2.0 * double(n) * double(n) * double(n), ms);
}

}  // namespace

int main() {
  return bench_main("bench_attention", [&](const cudaDeviceProp& prop, cudaStream_t stream) {
    std::printf(
        "bench_attention on %s: causal attention, bf16, tensor-core (flash) vs CUDA-core (simt) kernels%s, "
        "median of %d reps\n",
        prop.name, attention_cudnn_built() ? " and cuDNN's fused SDPA (cudnn)" : "", kReps);
    Rng rng(2026);
    const double ceiling = gemm_ceiling_tflops(rng, stream);
    std::printf("  bf16 GEMM %lld^3 ceiling: %.1f TFLOP/s\n", (long long)kCeilingSize, ceiling);

    // gpu_moe's and gpu_moe_wide's heads, and DeepSeek-V3's MLA heads (q, k 192, v 128) at gpu_moe_wide's B, T, nh.
    const AttnShape shapes[] = {{32, 512, 8, 128, 128}, {4, 2048, 16, 128, 128}, {4, 2048, 16, 192, 128}};
    std::printf("\n%-26s %-6s %9s %9s %9s %9s %9s %9s %8s\n", "B x T x nh x hd (/ v_hd)", "kernel", "fwd ms", "bwd ms",
                "f+b ms", "fwd TF/s", "bwd TF/s", "f+b TF/s", "of ceil");
    for (const AttnShape& s : shapes) {
      const Device dev = Device::cuda(0);
      // Random, not zero: data-dependent power draw changes clocks.
      auto draw = [&](int64_t hd) {
        return rng.uniform({s.batch, s.seq_len, s.num_heads, hd}, -1.0, 1.0, DType::f32).to(DType::bf16).to(dev);
      };
      Tensor q = draw(s.head_dim), k = draw(s.head_dim), v = draw(s.v_head_dim), d_out = draw(s.v_head_dim);
      Buffers flash(s, dev), simt(s, dev), cudnn(s, dev);
      const Times tf = time_family(AttentionKernel::flash, s, flash, q, k, v, d_out, stream);
      const Times ts = s.simt() ? time_family(AttentionKernel::simt, s, simt, q, k, v, d_out, stream) : Times{};
      const double simt_diff = s.simt() ? rel_diff(flash, simt) : 0;
      const AttentionCudnnShape cudnn_shape{s.batch, s.seq_len, s.num_heads, s.head_dim, s.v_head_dim};
      std::string cudnn_why;
      const bool with_cudnn = attention_cudnn_supports(cudnn_shape, &cudnn_why);
      const Times tc = with_cudnn ? time_cudnn(cudnn_shape, cudnn, q, k, v, d_out, stream) : Times{};
      const double cudnn_diff = with_cudnn ? rel_diff(cudnn, flash) : 0;

      const double fwd_flops = double(s.batch) * double(s.num_heads) * double(s.seq_len) * double(s.seq_len) *
                               double(s.head_dim + s.v_head_dim);
      const double bwd_flops = 2.5 * fwd_flops, all_flops = fwd_flops + bwd_flops;
      char name[64];
      std::snprintf(name, sizeof(name), "%lldx%lldx%lldx%lld", (long long)s.batch, (long long)s.seq_len,
                    (long long)s.num_heads, (long long)s.head_dim);
      if (s.v_head_dim != s.head_dim)
        std::snprintf(name + std::strlen(name), sizeof(name) - std::strlen(name), " / %lld", (long long)s.v_head_dim);
      for (const auto& [label, t] : {std::pair{"flash", tf}, std::pair{"simt", ts}, std::pair{"cudnn", tc}})
        if (t.fwdbwd_ms > 0)
          std::printf("%-26s %-6s %9.3f %9.3f %9.3f %9.1f %9.1f %9.1f %8.3f\n", name, label, t.fwd_ms, t.bwd_ms,
                      t.fwdbwd_ms, tflops(fwd_flops, t.fwd_ms), tflops(bwd_flops, t.bwd_ms),
                      tflops(all_flops, t.fwdbwd_ms), tflops(all_flops, t.fwdbwd_ms) / ceiling);
      std::printf(
          "BENCH attention dtype=bf16 B=%lld T=%lld nh=%lld hd=%lld v_hd=%lld fwd_ms=%.4f bwd_ms=%.4f fwdbwd_ms=%.4f "
          "fwd_tflops=%.1f bwd_tflops=%.1f fwdbwd_tflops=%.1f ceiling_tflops=%.1f frac_ceiling=%.4f",
          (long long)s.batch, (long long)s.seq_len, (long long)s.num_heads, (long long)s.head_dim,
          (long long)s.v_head_dim, tf.fwd_ms, tf.bwd_ms, tf.fwdbwd_ms, tflops(fwd_flops, tf.fwd_ms),
          tflops(bwd_flops, tf.bwd_ms), tflops(all_flops, tf.fwdbwd_ms), ceiling,
          tflops(all_flops, tf.fwdbwd_ms) / ceiling);
      if (s.simt())
        std::printf(
            " simt_fwdbwd_ms=%.4f speedup_vs_simt=%.2f fwd_speedup_vs_simt=%.2f bwd_speedup_vs_simt=%.2f "
            "rel_diff=%.2e",
            ts.fwdbwd_ms, ts.fwdbwd_ms / tf.fwdbwd_ms, ts.fwd_ms / tf.fwd_ms, ts.bwd_ms / tf.bwd_ms, simt_diff);
      if (with_cudnn)
        std::printf(
            " cudnn_fwd_ms=%.4f cudnn_bwd_ms=%.4f cudnn_fwdbwd_ms=%.4f cudnn_fwdbwd_tflops=%.1f "
            "cudnn_frac_ceiling=%.4f cudnn_speedup_vs_flash=%.2f cudnn_rel_diff=%.2e",
            tc.fwd_ms, tc.bwd_ms, tc.fwdbwd_ms, tflops(all_flops, tc.fwdbwd_ms),
            tflops(all_flops, tc.fwdbwd_ms) / ceiling, tf.fwdbwd_ms / tc.fwdbwd_ms, cudnn_diff);
      std::printf("\n");
      if (!with_cudnn && attention_cudnn_built())
        std::printf("  %s: cudnn does not run it: %s\n", name, cudnn_why.c_str());
    }
    FLOWMOE_CUDA_CHECK(cudaDeviceSynchronize());
  });
}
