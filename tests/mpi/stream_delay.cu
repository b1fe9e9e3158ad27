// Test-only kernels on a caller's stream (see stream_delay.h).
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/common/cuda_check.h"
#include "tests/mpi/stream_delay.h"

namespace flowmoe::test {

namespace {

__device__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin_kernel(uint64_t ns) {
  const uint64_t start = global_ns();
  while (global_ns() - start < ns) {
  }
}

__global__ void scale_kernel(float* data, int64_t n, float factor) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    data[i] *= factor;
}

}  // namespace

void spin_on_stream(cudaStream_t stream, int64_t microseconds) {
  spin_kernel<<<1, 1, 0, stream>>>(uint64_t(microseconds) * 1000);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void scale_on_stream(cudaStream_t stream, float* data, int64_t n, float factor) {
  if (n == 0) return;
  const int blocks = int(std::min<int64_t>((n + 255) / 256, 1024));
  scale_kernel<<<blocks, 256, 0, stream>>>(data, n, factor);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe::test
