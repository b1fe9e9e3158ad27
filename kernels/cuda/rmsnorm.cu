// RMSNorm on the GPU, f32 or bf16 in and out, fp32 math. x, y, d_y, d_x [rows, hidden]; weight [hidden].
//   forward:  y = x * rstd * w,  rstd = rsqrt(mean(x^2) + eps); one block per row (rows up to 16K+ wide).
//   backward: dx = rstd * dy * w - x * rstd^3 * g / hidden, g = sum(dy * w * x); rstd is recomputed
//             (same pass as g). d_weight = sum_rows dy * x * rstd: each block adds its rows into its
//             own fp32 partial row, a second kernel sums the partials in a fixed order (deterministic).
// The forward's row pieces live in kernels/cuda/rmsnorm_row.cuh (the fused quantize shares them).
// CPU reference: kernels/cpu/rmsnorm.cpp. Tests: tests/test_rmsnorm.cpp.
#include <cuda_bf16.h>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/rmsnorm_row.cuh"
#include "kernels/rmsnorm.h"

namespace flowmoe {

// Blocks of the backward kernel, fixed (not per-GPU) so d_weight's summation order never changes.
constexpr int64_t kRmsnormPartials = 512;

// ---- kernels ----------------------------------------------------------------------------------

template <class T>
__global__ void rmsnorm_forward_kernel(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ weight,
                                       int64_t rows, int64_t hidden, float eps) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * hidden;
    const float rstd = rmsnorm_row_rstd(hidden, eps, scratch, [&](int64_t j) { return to_float(xr[j]); });
    for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x)
      y[r * hidden + j] = from_float<T>(rmsnorm_value(to_float(xr[j]), rstd, to_float(weight[j])));
  }
}

// Block b handles rows b, b + gridDim.x, ... and owns partial row b of d_weight_partial; each
// thread owns its columns there, so the read-modify-write needs no synchronisation.
template <class T>
__global__ void rmsnorm_backward_kernel(T* __restrict__ d_x, float* __restrict__ d_weight_partial /*[grid, hidden]*/,
                                        const T* __restrict__ d_y, const T* __restrict__ x,
                                        const T* __restrict__ weight, int64_t rows, int64_t hidden, float eps) {
  __shared__ float scratch[32];
  float* partial = d_weight_partial + blockIdx.x * hidden;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * hidden;
    const T* dyr = d_y + r * hidden;
    float sum_sq = 0.f, g = 0.f;
    for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
      float xv = to_float(xr[j]);
      sum_sq += xv * xv;
      g += to_float(dyr[j]) * to_float(weight[j]) * xv;
    }
    sum_sq = block_sum(sum_sq, scratch);
    g = block_sum(g, scratch);
    float rstd = rsqrtf(sum_sq / float(hidden) + eps);
    float coef = rstd * rstd * rstd * g / float(hidden);
    bool first = r == blockIdx.x;
    for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
      float xv = to_float(xr[j]), dyv = to_float(dyr[j]);
      d_x[r * hidden + j] = from_float<T>(rstd * dyv * to_float(weight[j]) - xv * coef);
      float dw = dyv * xv * rstd;
      partial[j] = first ? dw : partial[j] + dw;
    }
  }
}

// Block (32 x 32) per 32 columns: thread (tx, ty) sums partials ty, ty + 32, ... of column tx, then
// row ty == 0 adds the 32 results in order. Fixed order, so the result is reproducible.
template <class T>
__global__ void rmsnorm_dweight_kernel(T* __restrict__ d_weight,
                                       const float* __restrict__ partial
                                       /*[num_partials, hidden]*/,
                                       int64_t num_partials, int64_t hidden) {
  __shared__ float sums[32][33];
  int64_t j = blockIdx.x * int64_t(32) + threadIdx.x;
  float acc = 0.f;
  if (j < hidden)
    for (int64_t p = threadIdx.y; p < num_partials; p += 32) acc += partial[p * hidden + j];
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && j < hidden) {
    float total = 0.f;
    for (int k = 0; k < 32; ++k) total += sums[k][threadIdx.x];
    d_weight[j] = from_float<T>(total);
  }
}

// ---- launchers --------------------------------------------------------------------------------

void rmsnorm_forward_cuda(DType dtype, void* y, const void* x, const void* weight, int64_t rows, int64_t hidden,
                          double eps, cudaStream_t stream) {
  check_rmsnorm_args("rmsnorm_forward_cuda", dtype, rows, hidden, eps);
  if (rows == 0 || hidden == 0) return;
  int threads = rmsnorm_threads(hidden);
  dispatch_cuda_float(dtype, "rmsnorm_forward_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rmsnorm_forward_kernel<<<unsigned(rows), threads, 0, stream>>>(
        static_cast<T*>(y), static_cast<const T*>(x), static_cast<const T*>(weight), rows, hidden, float(eps));
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

int64_t rmsnorm_backward_workspace_floats(int64_t rows, int64_t hidden) {
  return (rows < kRmsnormPartials ? rows : kRmsnormPartials) * hidden;
}

void rmsnorm_backward_cuda(DType dtype, void* d_x, void* d_weight, const void* d_y, const void* x, const void* weight,
                           int64_t rows, int64_t hidden, double eps, float* workspace, int64_t workspace_floats,
                           cudaStream_t stream) {
  check_rmsnorm_args("rmsnorm_backward_cuda", dtype, rows, hidden, eps);
  FLOWMOE_CHECK(workspace_floats >= rmsnorm_backward_workspace_floats(rows, hidden), ShapeError,
                "rmsnorm_backward_cuda: workspace of ", workspace_floats, " floats, need ",
                rmsnorm_backward_workspace_floats(rows, hidden));
  if (hidden == 0) return;
  if (rows == 0) {  // no rows: d_weight is an empty sum
    FLOWMOE_CUDA_CHECK(cudaMemsetAsync(d_weight, 0, size_t(hidden) * dtype_size(dtype), stream));
    return;
  }
  int64_t num_partials = rows < kRmsnormPartials ? rows : kRmsnormPartials;
  int threads = rmsnorm_threads(hidden);
  dispatch_cuda_float(dtype, "rmsnorm_backward_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rmsnorm_backward_kernel<<<unsigned(num_partials), threads, 0, stream>>>(
        static_cast<T*>(d_x), workspace, static_cast<const T*>(d_y), static_cast<const T*>(x),
        static_cast<const T*>(weight), rows, hidden, float(eps));
    FLOWMOE_CUDA_CHECK_LAUNCH();
    rmsnorm_dweight_kernel<<<unsigned((hidden + 31) / 32), dim3(32, 32), 0, stream>>>(static_cast<T*>(d_weight),
                                                                                      workspace, num_partials, hidden);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
