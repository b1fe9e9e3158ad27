// The unfused baseline of bench/bench_swiglu_quant.cpp (declarations and math:
// bench/baselines/swiglu_quant_baseline.h): a grid-stride row scale, a CTA-per-row dot, and the rowwise
// quantize loop of kernels/cuda/quantize_rows.cuh fed straight from x, so it quantizes exactly as the
// fused kernels of kernels/cuda/swiglu_quant.cu do and the difference measured is the fusion alone.
#include "bench/baselines/swiglu_quant_baseline.h"

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/quantize_rows.cuh"
#include "kernels/fp8.h"

namespace flowmoe {

namespace {

constexpr int kThreads = 256;

// ---- kernels ----------------------------------------------------------------------------------

template <class T>
__global__ void row_scale_kernel(T* out, const T* x, const float* __restrict__ row_scale, int64_t M, int64_t K) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < K; j += int64_t(gridDim.x) * blockDim.x)
    for (int64_t r = blockIdx.y; r < M; r += gridDim.y)
      out[r * K + j] = from_float<T>(to_float(x[r * K + j]) * row_scale[r]);
}

template <class T>
__global__ void row_dot_kernel(float* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b, int64_t M,
                               int64_t K) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < M; r += gridDim.x) {
    float s = 0.f;
    for (int64_t k = threadIdx.x; k < K; k += blockDim.x) s += to_float(a[r * K + k]) * to_float(b[r * K + k]);
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) out[r] = s;
  }
}

template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const T* __restrict__ x, int64_t M, int64_t K, uint8_t* __restrict__ q, float* __restrict__ s) {
  constexpr int N = vec_elems<T>();
  quantize_rows<N, kVec>(M, K, q, s,
                         [&](int64_t r, int64_t j0, float(&v)[N]) { load_chunk<T, kVec>(x + r * K, j0, K, v); });
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Blocks for the quantize grid: one group of 128/N lanes per (row, block), grid-stride beyond.
unsigned quantize_grid(int64_t M, int64_t K, int N) {
  return grid_size(M * fp8_num_blocks(K) * (kFp8BlockSize / N), kThreads);
}

}  // namespace

// ---- launchers --------------------------------------------------------------------------------

void swiglu_quant_baseline_row_scale_cuda(DType dtype, void* out, const void* x, const float* row_scale, int64_t M,
                                          int64_t K, cudaStream_t stream) {
  if (M == 0 || K == 0) return;
  dispatch_cuda_float(dtype, "swiglu_quant_baseline_row_scale_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t col_blocks = (K + kThreads - 1) / kThreads;
    dim3 grid(unsigned(col_blocks < 65536 ? col_blocks : 65536), unsigned(M < 65535 ? M : 65535));
    row_scale_kernel<<<grid, kThreads, 0, stream>>>(static_cast<T*>(out), static_cast<const T*>(x), row_scale, M, K);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void swiglu_quant_baseline_row_dot_cuda(DType dtype, float* out, const void* a, const void* b, int64_t M, int64_t K,
                                        cudaStream_t stream) {
  if (M == 0) return;
  dispatch_cuda_float(dtype, "swiglu_quant_baseline_row_dot_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const unsigned grid = unsigned(M < (int64_t(1) << 30) ? M : (int64_t(1) << 30));
    row_dot_kernel<<<grid, kThreads, 0, stream>>>(out, static_cast<const T*>(a), static_cast<const T*>(b), M, K);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void swiglu_quant_baseline_quantize_cuda(DType dtype, const void* x, int64_t M, int64_t K, uint8_t* q, float* s,
                                         cudaStream_t stream) {
  if (M == 0 || K == 0) return;
  dispatch_cuda_float(dtype, "swiglu_quant_baseline_quantize_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int N = vec_elems<T>();
    const bool vec = K % N == 0 && aligned(x, 16) && aligned(q, N);
    auto kernel = vec ? quantize_kernel<T, true> : quantize_kernel<T, false>;
    kernel<<<quantize_grid(M, K, N), kThreads, 0, stream>>>(static_cast<const T*>(x), M, K, q, s);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
