// Sum / mean over all n elements on the GPU, deterministic (no atomics), fp32 accumulation.
//   pass 1: block b sums a fixed grid-stride subset of x into partials[b] (at most kReducePartials)
//   pass 2: one block sums the partials in a fixed order, out = total (sum) or total / n (mean, 0 if n == 0)
//   backward: d_x[i] = d_out[0] (sum) or d_out[0] / n (mean), read on the device
// x f32 or bf16, out f32. CPU reference: kernels/cpu/reduce.cpp. Tests: tests/test_reduce.cpp.
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/reduce.h"

namespace flowmoe {

// ---- kernels ----------------------------------------------------------------------------------

template <class T>
__global__ void reduce_partials_kernel(float* __restrict__ partials, const T* __restrict__ x, int64_t n) {
  __shared__ float scratch[32];
  float s = 0.f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    s += to_float(x[i]);
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// Single block; divisor is 1 for sum, n for mean (0 gives 0).
__global__ void reduce_final_kernel(float* __restrict__ out, const float* __restrict__ partials, int num_partials,
                                    int64_t divisor) {
  __shared__ float scratch[32];
  float s = 0.f;
  for (int i = threadIdx.x; i < num_partials; i += blockDim.x) s += partials[i];
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) *out = divisor > 0 ? s / float(divisor) : 0.f;
}

template <class T>
__global__ void fill_from_scalar_kernel(T* __restrict__ d_x, const float* __restrict__ d_out, int64_t divisor,
                                        int64_t n) {
  const T v = from_float<T>(d_out[0] / float(divisor));
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    d_x[i] = v;
}

// ---- launchers --------------------------------------------------------------------------------

void reduce_cuda(ReduceOp op, DType dtype, float* out, float* partials, const void* x, int64_t n, cudaStream_t stream) {
  FLOWMOE_CHECK(n >= 0, ShapeError, "reduce_cuda: negative element count ", n);
  const int threads = 256;
  // At least 4 elements per thread before another block is worth its partial.
  const int num_partials = int(std::min<int64_t>((n + threads * 4 - 1) / (threads * 4), kReducePartials));
  dispatch_cuda_float(dtype, "reduce_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (num_partials == 0) return;
    reduce_partials_kernel<<<num_partials, threads, 0, stream>>>(partials, static_cast<const T*>(x), n);
    FLOWMOE_CUDA_CHECK_LAUNCH();
  });
  // Runs for n == 0 too (no partials): it writes 0.
  reduce_final_kernel<<<1, 1024, 0, stream>>>(out, partials, num_partials, op == ReduceOp::mean ? n : 1);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void reduce_backward_cuda(ReduceOp op, DType dtype, void* d_x, const float* d_out, int64_t n, cudaStream_t stream) {
  FLOWMOE_CHECK(n >= 0, ShapeError, "reduce_backward_cuda: negative element count ", n);
  const int threads = 256;
  dispatch_cuda_float(dtype, "reduce_backward_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (n == 0) return;
    fill_from_scalar_kernel<<<grid_size(n, threads), threads, 0, stream>>>(static_cast<T*>(d_x), d_out,
                                                                           op == ReduceOp::mean ? n : 1, n);
    FLOWMOE_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace flowmoe
