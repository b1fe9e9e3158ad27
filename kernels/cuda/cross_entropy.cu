// Fused cross-entropy on the GPU over logits [N, V] (f32 or bf16; fp32 math; f32 loss).
//   rows:     one block per row: lse = max + log(sum(exp(x - max))) (online pass), row_loss = lse - x[t]
//   mean:     one block sums row_loss and counts rows with t != ignore_index in a fixed order
//             (deterministic), writes loss = sum / count and inv_count = 1 / count (0 when count is 0)
//   backward: one block per row: dx = (exp(x - lse) - [c == t]) * d_loss * inv_count, 0 on ignored rows
// CPU reference: kernels/cpu/cross_entropy.cpp. Tests: tests/test_cross_entropy.cpp.
#include <cuda_bf16.h>

#include <climits>
#include <cstdio>

#include "kernels/common/cuda_check.h"
#include "kernels/cross_entropy.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/softmax.cuh"

namespace flowmoe {

// ---- kernels ----------------------------------------------------------------------------------

template <class T>
__global__ void cross_entropy_rows_kernel(float* __restrict__ lse, float* __restrict__ row_loss,
                                          const T* __restrict__ logits, const int32_t* __restrict__ targets, int64_t V,
                                          int ignore_index) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int32_t t = targets[row];
  if (t == ignore_index) {  // the whole block leaves together, before any barrier
    if (threadIdx.x == 0) lse[row] = 0.f, row_loss[row] = 0.f;
    return;
  }
  if (t < 0 || t >= V) {
    if (threadIdx.x == 0)
      printf("cross_entropy: target %d of row %lld is outside [0, %lld) and is not ignore_index (%d)\n", t,
             (long long)row, (long long)V, ignore_index);
    __syncthreads();  // t is uniform over the block: let thread 0 print before anyone traps
    __trap();
  }
  const T* x = logits + row * V;
  RowMaxSum st = block_row_max_sum(x, V, scratch);
  if (threadIdx.x == 0) {
    float l = st.max + logf(st.sum);
    lse[row] = l;
    row_loss[row] = l - to_float(x[t]);
  }
}

// Single block; blockDim.x a multiple of 32.
__global__ void cross_entropy_mean_kernel(float* __restrict__ loss, float* __restrict__ inv_count,
                                          const float* __restrict__ row_loss, const int32_t* __restrict__ targets,
                                          int64_t N, int ignore_index) {
  __shared__ float scratch[32];
  __shared__ int count_scratch[32];
  float s = 0.f;
  int c = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    s += row_loss[i];  // 0 on ignored rows
    c += targets[i] != ignore_index;
  }
  float total = block_sum(s, scratch);
  // Integer count (exact at any N): warp reduce, then the first warp adds the warps' counts.
  c = __reduce_add_sync(0xffffffffu, c);
  if ((threadIdx.x & 31) == 0) count_scratch[threadIdx.x >> 5] = c;
  __syncthreads();
  if (threadIdx.x < 32) {
    c = threadIdx.x < (blockDim.x >> 5) ? count_scratch[threadIdx.x] : 0;
    c = __reduce_add_sync(0xffffffffu, c);
    if (threadIdx.x == 0) {
      *loss = c > 0 ? total / float(c) : 0.f;
      *inv_count = c > 0 ? 1.f / float(c) : 0.f;
    }
  }
}

template <class T>
__global__ void cross_entropy_backward_kernel(T* __restrict__ d_logits, const float* __restrict__ d_loss,
                                              const float* __restrict__ inv_count, const T* __restrict__ logits,
                                              const float* __restrict__ lse, const int32_t* __restrict__ targets,
                                              int64_t V, int ignore_index) {
  const int64_t row = blockIdx.x;
  const int32_t t = targets[row];
  T* dx = d_logits + row * V;
  if (t == ignore_index) {
    for (int64_t c = threadIdx.x; c < V; c += blockDim.x) dx[c] = from_float<T>(0.f);
    return;
  }
  const T* x = logits + row * V;
  const float scale = d_loss[0] * inv_count[0], l = lse[row];
  for (int64_t c = threadIdx.x; c < V; c += blockDim.x)
    dx[c] = from_float<T>((expf(to_float(x[c]) - l) - (c == t ? 1.f : 0.f)) * scale);
}

// ---- launchers --------------------------------------------------------------------------------

static void check_shape(const char* what, int64_t N, int64_t V) {
  FLOWMOE_CHECK(N >= 0 && V >= 0, ShapeError, what, ": negative shape [", N, ", ", V, "]");
  FLOWMOE_CHECK(N <= INT_MAX, ShapeError, what, ": ", N, " rows exceed one grid (", INT_MAX, ")");
  FLOWMOE_CHECK(N == 0 || V > 0, ShapeError, what, ": ", N, " rows of 0 classes");
}

void cross_entropy_forward_cuda(DType dtype, float* loss, float* inv_count, float* lse, float* row_loss,
                                const void* logits, const int32_t* targets, int64_t N, int64_t V, int ignore_index,
                                cudaStream_t stream) {
  check_shape("cross_entropy_forward_cuda", N, V);
  dispatch_cuda_float(dtype, "cross_entropy_forward_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (N > 0) {
      cross_entropy_rows_kernel<<<unsigned(N), row_block_threads(V), 0, stream>>>(
          lse, row_loss, static_cast<const T*>(logits), targets, V, ignore_index);
      FLOWMOE_CUDA_CHECK_LAUNCH();
    }
  });
  // Runs for N == 0 too: it writes loss = 0 and inv_count = 0.
  cross_entropy_mean_kernel<<<1, 1024, 0, stream>>>(loss, inv_count, row_loss, targets, N, ignore_index);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void cross_entropy_backward_cuda(DType dtype, void* d_logits, const float* d_loss, const float* inv_count,
                                 const void* logits, const float* lse, const int32_t* targets, int64_t N, int64_t V,
                                 int ignore_index, cudaStream_t stream) {
  check_shape("cross_entropy_backward_cuda", N, V);
  dispatch_cuda_float(dtype, "cross_entropy_backward_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (N == 0) return;
    cross_entropy_backward_kernel<<<unsigned(N), row_block_threads(V), 0, stream>>>(
        static_cast<T*>(d_logits), d_loss, inv_count, static_cast<const T*>(logits), lse, targets, V, ignore_index);
    FLOWMOE_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace flowmoe
