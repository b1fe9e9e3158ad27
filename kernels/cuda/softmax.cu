// Softmax over the last dim on the GPU, one block per row of [rows, cols] (any width: the block
// loops over columns, so vocab-sized rows work).
//   forward:  y = exp(x - max) / sum(exp(x - max)), max and sum found in one online pass
//   backward: dx = y * (dy - sum(dy * y))
// f32 or bf16 in and out, fp32 math. CPU reference: kernels/cpu/softmax.cpp. Tests: tests/test_softmax.cpp.
#include <cuda_bf16.h>

#include <climits>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/softmax.cuh"
#include "kernels/softmax.h"

namespace flowmoe {

// ---- kernels ----------------------------------------------------------------------------------

template <class T>
__global__ void softmax_forward_kernel(T* __restrict__ y, const T* __restrict__ x, int64_t cols) {
  __shared__ float scratch[32];
  const T* xr = x + blockIdx.x * cols;
  T* yr = y + blockIdx.x * cols;
  RowMaxSum st = block_row_max_sum(xr, cols, scratch);
  float inv = 1.f / st.sum;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = from_float<T>(expf(to_float(xr[c]) - st.max) * inv);
}

template <class T>
__global__ void softmax_backward_kernel(T* __restrict__ d_x, const T* __restrict__ d_y, const T* __restrict__ y,
                                        int64_t cols) {
  __shared__ float scratch[32];
  const int64_t base = blockIdx.x * cols;
  float part = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) part += to_float(d_y[base + c]) * to_float(y[base + c]);
  float dot = block_sum(part, scratch);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    d_x[base + c] = from_float<T>(to_float(y[base + c]) * (to_float(d_y[base + c]) - dot));
}

// ---- launchers --------------------------------------------------------------------------------

static void check_rows(const char* what, int64_t rows, int64_t cols) {
  FLOWMOE_CHECK(rows >= 0 && cols >= 0, ShapeError, what, ": negative shape [", rows, ", ", cols, "]");
  FLOWMOE_CHECK(rows <= INT_MAX, ShapeError, what, ": ", rows, " rows exceed one grid (", INT_MAX, ")");
}

void softmax_forward_cuda(DType dtype, void* y, const void* x, int64_t rows, int64_t cols, cudaStream_t stream) {
  check_rows("softmax_forward_cuda", rows, cols);
  dispatch_cuda_float(dtype, "softmax_forward_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (rows == 0 || cols == 0) return;
    softmax_forward_kernel<<<unsigned(rows), row_block_threads(cols), 0, stream>>>(static_cast<T*>(y),
                                                                                   static_cast<const T*>(x), cols);
    FLOWMOE_CUDA_CHECK_LAUNCH();
  });
}

void softmax_backward_cuda(DType dtype, void* d_x, const void* d_y, const void* y, int64_t rows, int64_t cols,
                           cudaStream_t stream) {
  check_rows("softmax_backward_cuda", rows, cols);
  dispatch_cuda_float(dtype, "softmax_backward_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (rows == 0 || cols == 0) return;
    softmax_backward_kernel<<<unsigned(rows), row_block_threads(cols), 0, stream>>>(
        static_cast<T*>(d_x), static_cast<const T*>(d_y), static_cast<const T*>(y), cols);
    FLOWMOE_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace flowmoe
