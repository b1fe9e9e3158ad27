// Row-major GEMM and the bias pieces of linear.
//   C[m,n] = op(A)·op(B) (+ C when accumulating) (+ bias[n] on every row), op(X) = X or Xᵀ;
//   d_bias[n] = Σ_rows dy[:, n].
// CPU reference: kernels/cpu/linear.cpp (Eigen, f32 and f64). CUDA: kernels/cuda/linear.cu (cuBLASLt,
// f32 or bf16 operands, fp32 compute without TF32). Nodes: engine/ops/linear.cpp. Tests: tests/test_linear.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

// ---- CPU reference (packed row-major) ----------------------------------------------------------

template <class T>
void gemm_cpu(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const T* a /*[m,k], or [k,m] when trans_a*/,
              const T* b /*[k,n], or [n,k] when trans_b*/, T* c /*[m,n]*/, bool accumulate);
template <class T>
void add_bias_cpu(T* c /*[m,n]*/, const T* bias /*[n]*/, int64_t m, int64_t n);
template <class T>
void bias_grad_cpu(T* d_bias /*[n]*/, const T* dy /*[m,n]*/, int64_t m, int64_t n);

// ---- CUDA launchers ---------------------------------------------------------------------------

// a and b share ab_dtype (f32 or bf16); c is f32 or bf16 (bf16 operands may write an f32 c, e.g. to
// accumulate weight gradients in fp32); bias, when given, has c's dtype. lda/ldb/ldc are row strides
// in elements (>= the row length). k = 0 writes zeros (or leaves c when accumulating), then adds
// bias; m = 0 or n = 0 does nothing. Runs on `stream` of the current device. Host cost: the first
// call of an exact problem builds a plan (descriptors + algorithm; the algorithm is shared by the row
// counts in one quarter-octave bucket, m or, for trans_a without trans_b, k, so a new count costs no
// heuristic query); later calls are a lock-free lookup and cublasLtMatmul. Thread-safe.
void gemm_cuda(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, DType ab_dtype,
               const void* a /*[m,k], or [k,m] when trans_a*/, int64_t lda,
               const void* b /*[k,n], or [n,k] when trans_b*/, int64_t ldb, DType c_dtype, void* c /*[m,n]*/,
               int64_t ldc, const void* bias /*[n] or nullptr*/, bool accumulate, cudaStream_t stream);

// Counters of gemm_cuda's plan cache since the process started (all devices and threads), for
// benchmarks and tests: cuBLASLt heuristic queries, exact-problem plans built, and bucket algorithms
// refused for an exact problem (by cublasLtMatmulAlgoCheck or cublasLtMatmul; each costs a query).
struct GemmPlanStats {
  uint64_t heuristic_queries = 0, plans_built = 0, bucket_rejects = 0;
};
GemmPlanStats gemm_cuda_plan_stats();

// Column sums in two deterministic passes: each chunk of kBiasGradRows rows is summed into one row
// of `partial`, then the partials are added in chunk order (no atomics, so runs are bit-identical).
constexpr int64_t kBiasGradRows = 256;
inline int64_t bias_grad_num_chunks(int64_t m) { return (m + kBiasGradRows - 1) / kBiasGradRows; }
// dtype f32 or bf16 for d_bias and dy; fp32 sums.
void bias_grad_cuda(DType dtype, void* d_bias /*[n]*/, const void* dy /*[m,n]*/, int64_t m, int64_t n,
                    float* partial /*[bias_grad_num_chunks(m), n]*/, cudaStream_t stream);

}  // namespace flowmoe
