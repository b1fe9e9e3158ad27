// SiLU on the GPU, elementwise over n values, f32 or bf16 in and out, fp32 math:
//   y = x * sigmoid(x);   dx = dy * (s + x * s * (1 - s)),  s = sigmoid(x).
// expf is the accurate (not fast-math) version, so f32 results are within a few ulp of the CPU.
// CPU reference: kernels/cpu/silu.cpp. Tests: tests/test_silu.cpp.
#include <cuda_bf16.h>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/silu.cuh"
#include "kernels/silu.h"

namespace flowmoe {

// ---- kernels ----------------------------------------------------------------------------------

template <class T>
__global__ void silu_forward_kernel(T* __restrict__ y, const T* __restrict__ x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = from_float<T>(silu_f32(to_float(x[i])));
}

template <class T>
__global__ void silu_backward_kernel(T* __restrict__ d_x, const T* __restrict__ d_y, const T* __restrict__ x,
                                     int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    d_x[i] = from_float<T>(to_float(d_y[i]) * silu_grad_f32(to_float(x[i])));
}

// ---- launchers --------------------------------------------------------------------------------

void silu_forward_cuda(DType dtype, void* y, const void* x, int64_t n, cudaStream_t stream) {
  FLOWMOE_CHECK(n >= 0, ShapeError, "silu_forward_cuda: negative element count ", n);
  if (n == 0) return;
  const int threads = 256;
  dispatch_cuda_float(dtype, "silu_forward_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_forward_kernel<<<grid_size(n, threads), threads, 0, stream>>>(static_cast<T*>(y), static_cast<const T*>(x), n);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void silu_backward_cuda(DType dtype, void* d_x, const void* d_y, const void* x, int64_t n, cudaStream_t stream) {
  FLOWMOE_CHECK(n >= 0, ShapeError, "silu_backward_cuda: negative element count ", n);
  if (n == 0) return;
  const int threads = 256;
  dispatch_cuda_float(dtype, "silu_backward_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_backward_kernel<<<grid_size(n, threads), threads, 0, stream>>>(
        static_cast<T*>(d_x), static_cast<const T*>(d_y), static_cast<const T*>(x), n);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
