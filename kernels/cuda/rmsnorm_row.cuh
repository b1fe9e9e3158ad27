// RMSNorm's forward over one row on the GPU, shared by the plain kernel (kernels/cuda/rmsnorm.cu) and the
// fused quantize (kernels/cuda/rmsnorm_quant.cu): both take rstd and each y_j from these functions, with the
// same CTA size, so the fused kernel's y is the plain one's bit for bit (its quantize then matches the
// unfused quantize_rowwise_cuda of that y).
#pragma once
#include <cstdint>

#include "kernels/cuda/cuda_utils.cuh"

namespace flowmoe {

// Threads of the CTA that owns a row: about 4 columns per thread, a multiple of 32 in [32, 1024]
// (what block_sum needs). It fixes rstd's summation order, so the plain and the fused kernels share it.
inline int rmsnorm_threads(int64_t hidden) {
  int64_t t = ((hidden + 3) / 4 + 31) / 32 * 32;
  return int(t < 32 ? 32 : (t > 1024 ? 1024 : t));
}

// rsqrt(mean(x^2) + eps) of row xr, every thread of the CTA taking part and getting it: thread t sums
// columns t, t + blockDim.x, ... in order, then block_sum. scratch: 32 floats of shared memory.
template <class T>
__device__ __forceinline__ float rmsnorm_row_rstd(const T* __restrict__ xr, int64_t hidden, float eps, float* scratch) {
  float sum_sq = 0.f;
  for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
    float v = to_float(xr[j]);
    sum_sq += v * v;
  }
  return rsqrtf(block_sum(sum_sq, scratch) / float(hidden) + eps);
}

// y_j before its rounding to the output dtype: (x_j * rstd) * w_j.
__device__ __forceinline__ float rmsnorm_value(float x, float rstd, float w) { return x * rstd * w; }

}  // namespace flowmoe
