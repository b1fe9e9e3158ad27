// bench_linear: bf16 linear forward + backward, i.e. three GEMMs (fp32 compute, bf16 out):
//   fprop  y[M,N]  = x[M,K] · w[N,K]ᵀ
//   dgrad  dx[M,K] = dy[M,N] · w[N,K]
//   wgrad  dw[N,K] = dy[M,N]ᵀ · x[M,K]        (M = tokens, N = out features, K = in features)
// "engine" is the engine's launcher (kernels/linear.h: the heuristic's first algorithm, cached);
// "best" is, per GEMM, the fastest of cuBLASLt's top 16 heuristic algorithms, timed in the same run;
// "op" is linear() + backward() through autograd (adds allocation and the leaf-gradient copies).
// Each time is the median of kReps event-timed runs after kWarmup. FLOPs = 3 · 2MNK; the ceiling is
// the measured BF16 GEMM 707 TFLOP/s (DESIGN.md §6). No GPU: prints a skip line and exits 0.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "bench/bench_util.h"
#include "engine/ops/ops.h"
#include "engine/rng.h"
#include "kernels/common/cuda_check.h"
#include "kernels/common/device_api.h"
#include "kernels/linear.h"

using namespace flowmoe;

namespace {

constexpr int kWarmup = 5;
constexpr int kReps = 30;
constexpr int kNumAlgos = 16;
constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // as the engine's launcher
constexpr double kBf16CeilingTflops = 707.0;

// One row-major GEMM c[m,n] = op(a)·op(b), all bf16, packed.
struct Gemm {
  const char* name;
  bool ta, tb;
  int64_t m, n, k;
  const void* a;
  const void* b;
  void* c;
  int64_t lda() const { return ta ? m : k; }
  int64_t ldb() const { return tb ? k : n; }
};

double engine_ms(const Gemm& g, cudaStream_t stream) {
  return median_ms(
      [&] {
        gemm_cuda(g.ta, g.tb, g.m, g.n, g.k, DType::bf16, g.a, g.lda(), g.b, g.ldb(), DType::bf16, g.c, g.n, nullptr,
                  false, stream);
      },
      stream);
}

// cuBLASLt descriptors for g, built independently of the engine: row-major c is column-major cᵀ =
// op(b)ᵀ·op(a)ᵀ, so cuBLASLt's A is our b and its B our a.
struct LtProblem {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  explicit LtProblem(const Gemm& g) {
    FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t op_a = g.tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = g.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
    FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
    uint64_t m = uint64_t(g.m), n = uint64_t(g.n), k = uint64_t(g.k);
    FLOWMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, g.tb ? k : n, g.tb ? n : k, g.ldb()));
    FLOWMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, g.ta ? m : k, g.ta ? k : m, g.lda()));
    FLOWMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d, CUDA_R_16BF, n, m, g.n));
    FLOWMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t ws = kWorkspaceBytes;
    FLOWMOE_CUBLAS_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  }
  ~LtProblem() {
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(d);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatmulDescDestroy(op);
  }
  LtProblem(const LtProblem&) = delete;
  LtProblem& operator=(const LtProblem&) = delete;
};

double best_cublaslt_ms(cublasLtHandle_t handle, const Gemm& g, void* workspace, cudaStream_t stream) {
  LtProblem p(g);
  cublasLtMatmulHeuristicResult_t results[kNumAlgos] = {};
  int num_results = 0;
  FLOWMOE_CUBLAS_CHECK(
      cublasLtMatmulAlgoGetHeuristic(handle, p.op, p.a, p.b, p.d, p.d, p.pref, kNumAlgos, results, &num_results));
  const float alpha = 1.f, beta = 0.f;
  double best = INFINITY;
  for (int i = 0; i < num_results; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    auto call = [&] {
      return cublasLtMatmul(handle, p.op, &alpha, g.b, p.a, g.a, p.b, &beta, g.c, p.d, g.c, p.d, &results[i].algo,
                            workspace, kWorkspaceBytes, stream);
    };
    if (call() != CUBLAS_STATUS_SUCCESS) continue;  // an algorithm may still refuse at launch
    best = std::min(best, median_ms([&] { FLOWMOE_CUBLAS_CHECK(call()); }, stream));
  }
  FLOWMOE_CHECK(std::isfinite(best), CudaError, "no cuBLASLt algorithm ran for ", g.name, " m=", g.m, " n=", g.n,
                " k=", g.k);
  return best;
}

struct Result {
  double engine_ms = 0, best_ms = 0, op_ms = 0;
};

Result bench_shape(int64_t m, int64_t n, int64_t k, cublasLtHandle_t handle, void* workspace, Rng& rng) {
  const Device dev = Device::cuda(0);
  cudaStream_t stream = current_stream(0);
  // Random, not zero: data-dependent power draw changes GEMM clocks.
  auto draw = [&](const Shape& s) { return rng.uniform(s, -1.0, 1.0, DType::f32).to(DType::bf16).to(dev); };
  Tensor x = draw({m, k}), w = draw({n, k}), dy = draw({m, n});
  Tensor y = Tensor::empty({m, n}, DType::bf16, dev), dx = Tensor::empty({m, k}, DType::bf16, dev);
  Tensor dw = Tensor::empty({n, k}, DType::bf16, dev);
  const Gemm gemms[] = {{"fprop", false, true, m, n, k, x.raw_data(), w.raw_data(), y.raw_data()},
                        {"dgrad", false, false, m, k, n, dy.raw_data(), w.raw_data(), dx.raw_data()},
                        {"wgrad", true, false, n, k, m, dy.raw_data(), x.raw_data(), dw.raw_data()}};
  Result r;
  for (const Gemm& g : gemms) {
    double e = engine_ms(g, stream), b = best_cublaslt_ms(handle, g, workspace, stream);
    std::printf("    %-5s  m %6lld  n %6lld  k %6lld   engine %8.3f ms   best %8.3f ms   ratio %.3f\n", g.name,
                (long long)g.m, (long long)g.n, (long long)g.k, e, b, e / b);
    r.engine_ms += e;
    r.best_ms += b;
  }
  Variable vx(x, true), vw(w, true);
  r.op_ms = median_ms(
      [&] {
        vx.zero_grad();
        vw.zero_grad();
        linear(vx, vw).backward(dy);
      },
      stream);
  FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return r;
}

}  // namespace

int main() {
  return bench_main("bench_linear", [&](const cudaDeviceProp& prop, cudaStream_t /*stream*/) {
    std::printf("bench_linear on %s: bf16 linear fwd + bwd (fprop, dgrad, wgrad), median of %d reps\n", prop.name,
                kReps);
    cublasLtHandle_t handle = nullptr;
    FLOWMOE_CUBLAS_CHECK(cublasLtCreate(&handle));
    void* workspace = cuda_malloc_raw(kWorkspaceBytes, 0);
    Rng rng(2026);

    struct Shape3 {
      int64_t m, n, k;
    };
    const Shape3 shapes[] = {{4096, 4096, 4096}, {16384, 1024, 4096}};
    std::vector<std::pair<Shape3, Result>> results;
    for (const Shape3& s : shapes) {
      std::printf("  M %lld  N %lld  K %lld\n", (long long)s.m, (long long)s.n, (long long)s.k);
      results.push_back({s, bench_shape(s.m, s.n, s.k, handle, workspace, rng)});
    }

    std::printf("\n%-20s %10s %10s %10s %12s %10s %12s\n", "shape MxNxK", "engine ms", "best ms", "op ms",
                "engine TF/s", "of 707", "engine/best");
    for (const auto& [s, r] : results) {
      double tflops = 6.0 * double(s.m) * double(s.n) * double(s.k) / (r.engine_ms * 1e-3) / 1e12;
      char shape[64];
      std::snprintf(shape, sizeof(shape), "%lldx%lldx%lld", (long long)s.m, (long long)s.n, (long long)s.k);
      std::printf("%-20s %10.3f %10.3f %10.3f %12.1f %10.3f %12.3f\n", shape, r.engine_ms, r.best_ms, r.op_ms, tflops,
                  tflops / kBf16CeilingTflops, r.engine_ms / r.best_ms);
    }
    for (const auto& [s, r] : results) {
      double tflops = 6.0 * double(s.m) * double(s.n) * double(s.k) / (r.engine_ms * 1e-3) / 1e12;
      std::printf(
          "BENCH linear dtype=bf16 M=%lld N=%lld K=%lld engine_ms=%.4f best_ms=%.4f op_ms=%.4f "
          "engine_tflops=%.1f frac_bf16_ceiling=%.4f ratio_engine_best=%.4f\n",
          (long long)s.m, (long long)s.n, (long long)s.k, r.engine_ms, r.best_ms, r.op_ms, tflops,
          tflops / kBf16CeilingTflops, r.engine_ms / r.best_ms);
    }
    cuda_free_raw(workspace, 0);
    FLOWMOE_CUBLAS_CHECK(cublasLtDestroy(handle));
    FLOWMOE_CUDA_CHECK(cudaDeviceSynchronize());
  });
}
