// One-row softmax statistics shared by the softmax and cross-entropy kernels: a block walks one row
// once, keeping a running max that rescales a running sum of exp (online softmax).
#pragma once
#include <algorithm>

#include "kernels/cuda/cuda_utils.cuh"

namespace flowmoe {

struct RowMaxSum {
  float max;  // max over the row
  float sum;  // sum over the row of exp(x - max)
};

// Every thread of the block gets the row's statistics. -inf entries add 0; a NaN makes sum NaN.
// `scratch` holds 32 floats of shared memory.
template <class T>
__device__ __forceinline__ RowMaxSum block_row_max_sum(const T* __restrict__ x /*[cols]*/, int64_t cols,
                                                       float* scratch) {
  float m = -INFINITY, s = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float v = to_float(x[c]);
    if (v > m) {
      s = s * expf(m - v) + 1.f;
      m = v;
    } else if (v != -INFINITY) {  // (-inf) - (-inf) would be NaN
      s += expf(v - m);
    }
  }
  float row_max = block_max(m, scratch);
  float part = s == 0.f ? 0.f : s * expf(m - row_max);  // a thread that saw nothing adds 0
  return {row_max, block_sum(part, scratch)};
}

// Threads for one block per row: the width rounded up to a warp, between 32 and 1024.
inline int row_block_threads(int64_t cols) { return int(std::clamp<int64_t>((cols + 31) / 32 * 32, 32, 1024)); }

}  // namespace flowmoe
