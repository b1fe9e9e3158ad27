// Fused RMSNorm + rowwise 1x128 FP8 quantize on the GPU (kernels/rmsnorm_quant.h): x, y [rows, hidden] f32 or
// bf16, weight [hidden]; q [rows, hidden] e4m3, scale_inv [rows, ceil(hidden/128)].
//   pass 1: rstd = rsqrt(mean(x^2) + eps) (kernels/cuda/rmsnorm_row.cuh, rmsnorm.cu's CTA size and order);
//   pass 2: y_j = round((x_j * rstd) * w_j) to the dtype, written when asked; each 128-column block's amax
//           over the rounded y, scale_inv = fp8_scale_inv(amax), q = e4m3(y * scale) (quantize_rows.cuh).
// One CTA per row; both passes are kernels/cuda/rmsnorm_row.cuh's (pass 2: a group of 128/V lanes per block).
// It equals rmsnorm_forward_cuda then quantize_rowwise_cuda bit for bit; the CPU reference is that
// composition (kernels/cpu/rmsnorm_quant.cpp). Tests: tests/test_rmsnorm_quant.cpp.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/rmsnorm_row.cuh"
#include "kernels/fp8.h"
#include "kernels/rmsnorm_quant.h"

namespace flowmoe {

// ---- kernels ----------------------------------------------------------------------------------

// kVec: the vector path of rmsnorm_write_row (rmsnorm_rows_vectorizable).
template <class T, bool kVec>
__global__ void rmsnorm_quant_kernel(T* __restrict__ y, uint8_t* __restrict__ q, float* __restrict__ scale_inv,
                                     const T* __restrict__ x, const T* __restrict__ weight, int64_t hidden, float eps) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const T* xr = x + r * hidden;
  const float rstd = rmsnorm_row_rstd(hidden, eps, scratch, [&](int64_t j) { return to_float(xr[j]); });
  rmsnorm_write_row<T, kVec>(y ? y + r * hidden : nullptr, q + r * hidden, scale_inv + r * fp8_num_blocks(hidden),
                             weight, hidden, rstd,
                             [&](int64_t j0, float(&v)[vec_elems<T>()]) { load_chunk<T, kVec>(xr, j0, hidden, v); });
}

// ---- launchers --------------------------------------------------------------------------------

void rmsnorm_quant_forward_cuda(DType dtype, void* y, uint8_t* q, float* scale_inv, const void* x, const void* weight,
                                int64_t rows, int64_t hidden, double eps, cudaStream_t stream) {
  const char* what = "rmsnorm_quant_forward_cuda";
  check_rmsnorm_args(what, dtype, rows, hidden, eps);
  if (rows == 0 || hidden == 0) return;
  const int threads = rmsnorm_threads(hidden);  // rmsnorm.cu's, so rstd sums in its order
  dispatch_cuda_float(dtype, what, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto launch = [&](auto kernel) {
      kernel<<<unsigned(rows), threads, 0, stream>>>(static_cast<T*>(y), q, scale_inv, static_cast<const T*>(x),
                                                     static_cast<const T*>(weight), hidden, float(eps));
    };
    if (rmsnorm_rows_vectorizable<T>(hidden, {x, weight, y}, q))
      launch(rmsnorm_quant_kernel<T, true>);
    else
      launch(rmsnorm_quant_kernel<T, false>);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
