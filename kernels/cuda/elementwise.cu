// Elementwise add / mul / scale on the GPU.
//   out[i] = a[i] + b[i] | a[i] * b[i] | s * a[i], for n elements, f32 or bf16 (fp32 math).
// CPU reference: kernels/cpu/elementwise.cpp. Tests: tests/test_elementwise.cpp.
#include <cuda_bf16.h>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/elementwise.h"

namespace flowmoe {

// ---- kernels ----------------------------------------------------------------------------------

template <class T>
__global__ void binary_kernel(BinaryOp op, T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b,
                              int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float x = to_float(a[i]), y = to_float(b[i]);
    out[i] = from_float<T>(op == BinaryOp::add ? x + y : x * y);
  }
}

template <class T>
__global__ void scale_kernel(T* __restrict__ out, const T* __restrict__ a, float s, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = from_float<T>(s * to_float(a[i]));
}

// ---- launchers --------------------------------------------------------------------------------

void binary_cuda(BinaryOp op, DType dtype, void* out, const void* a, const void* b, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  const int threads = 256;
  dispatch_cuda_float(dtype, "binary_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    binary_kernel<<<grid_size(n, threads), threads, 0, stream>>>(op, static_cast<T*>(out), static_cast<const T*>(a),
                                                                 static_cast<const T*>(b), n);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void scale_cuda(DType dtype, void* out, const void* a, double s, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  const int threads = 256;
  dispatch_cuda_float(dtype, "scale_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    scale_kernel<<<grid_size(n, threads), threads, 0, stream>>>(static_cast<T*>(out), static_cast<const T*>(a),
                                                                float(s), n);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
