// RMSNorm over the last dim: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps), per row.
// Backward, with g = sum_j dy_j * w_j * x_j over the row:
//   dx = rstd * dy * w - x * rstd^3 * g / hidden;   d_weight = sum over rows of dy * x * rstd.
// CPU reference: kernels/cpu/rmsnorm.cpp (f32 and f64, sums in double); CUDA: kernels/cuda/rmsnorm.cu
// (f32 and bf16, fp32 math, deterministic d_weight). Node: engine/ops/rmsnorm.cpp. Tests: tests/test_rmsnorm.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

template <class T>
void rmsnorm_forward_cpu(T* y /*[rows, hidden]*/, const T* x /*[rows, hidden]*/, const T* weight /*[hidden]*/,
                         int64_t rows, int64_t hidden, double eps);
template <class T>
void rmsnorm_backward_cpu(T* d_x /*[rows, hidden]*/, T* d_weight /*[hidden]*/, const T* d_y /*[rows, hidden]*/,
                          const T* x /*[rows, hidden]*/, const T* weight /*[hidden]*/, int64_t rows, int64_t hidden,
                          double eps);

// dtype f32 or bf16 (bf16 as raw bits, fp32 math, outputs rounded to nearest even once).
void rmsnorm_forward_cuda(DType dtype, void* y /*[rows, hidden]*/, const void* x /*[rows, hidden]*/,
                          const void* weight /*[hidden]*/, int64_t rows, int64_t hidden, double eps,
                          cudaStream_t stream);
// fp32 elements of device workspace rmsnorm_backward_cuda needs (per-block partial sums of d_weight).
int64_t rmsnorm_backward_workspace_floats(int64_t rows, int64_t hidden);
void rmsnorm_backward_cuda(DType dtype, void* d_x /*[rows, hidden]*/, void* d_weight /*[hidden]*/,
                           const void* d_y /*[rows, hidden]*/, const void* x /*[rows, hidden]*/,
                           const void* weight /*[hidden]*/, int64_t rows, int64_t hidden, double eps,
                           float* workspace /*[rmsnorm_backward_workspace_floats]*/, int64_t workspace_floats,
                           cudaStream_t stream);

}  // namespace flowmoe
