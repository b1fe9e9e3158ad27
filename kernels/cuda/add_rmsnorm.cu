// Fused residual add + RMSNorm (+ rowwise 1x128 FP8 quantize) on the GPU (kernels/add_rmsnorm.h): x, a, h, y
// [rows, hidden] f32 or bf16, weight [hidden]; q [rows, hidden] e4m3, scale_inv [rows, ceil(hidden/128)].
//   pass 1: h_j = round(x_j + a_j), written; rstd from the rounded h (kernels/cuda/rmsnorm_row.cuh, rmsnorm.cu's
//           CTA size and order);
//   pass 2: h recomputed from x and a (not read back: the read-only loads may not see this kernel's stores),
//           y_j = round((h_j * rstd) * w_j) written and/or quantized (rmsnorm_write_row).
// It equals binary_cuda's add then rmsnorm_forward_cuda (then quantize_rowwise_cuda) bit for bit; the CPU
// reference is that composition (kernels/cpu/add_rmsnorm.cpp). Tests: tests/test_add_rmsnorm.cpp.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/add_rmsnorm.h"
#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/rmsnorm_row.cuh"
#include "kernels/fp8.h"

namespace flowmoe {

// ---- kernels ----------------------------------------------------------------------------------

// kVec: the vector path of rmsnorm_write_row (rmsnorm_rows_vectorizable), for x and a too.
template <class T, bool kVec>
__global__ void add_rmsnorm_kernel(T* __restrict__ h, T* __restrict__ y, uint8_t* __restrict__ q,
                                   float* __restrict__ scale_inv, const T* __restrict__ x, const T* __restrict__ a,
                                   const T* __restrict__ weight, int64_t hidden, float eps) {
  constexpr int V = vec_elems<T>();
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const T *xr = x + r * hidden, *ar = a + r * hidden;
  T* hr = h + r * hidden;
  const float rstd = rmsnorm_row_rstd(hidden, eps, scratch, [&](int64_t j) {
    const T hv = from_float<T>(to_float(xr[j]) + to_float(ar[j]));  // binary_cuda's add
    hr[j] = hv;
    return to_float(hv);
  });
  rmsnorm_write_row<T, kVec>(y ? y + r * hidden : nullptr, q ? q + r * hidden : nullptr,
                             q ? scale_inv + r * fp8_num_blocks(hidden) : nullptr, weight, hidden, rstd,
                             [&](int64_t j0, float(&v)[V]) {
                               float xv[V], av[V];
                               load_chunk<T, kVec>(xr, j0, hidden, xv);
                               load_chunk<T, kVec>(ar, j0, hidden, av);
                               Packed<T, 16> hp;  // h as rounded to T, as pass 1 wrote it
#pragma unroll
                               for (int e = 0; e < V; ++e) {
                                 hp.set(e, xv[e] + av[e]);
                                 v[e] = hp.get(e);
                               }
                             });
}

// ---- launchers --------------------------------------------------------------------------------

void add_rmsnorm_forward_cuda(DType dtype, void* h, void* y, uint8_t* q, float* scale_inv, const void* x, const void* a,
                              const void* weight, int64_t rows, int64_t hidden, double eps, cudaStream_t stream) {
  const char* what = "add_rmsnorm_forward_cuda";
  check_rmsnorm_args(what, dtype, rows, hidden, eps);
  if (rows == 0 || hidden == 0) return;  // (an empty tensor's data may be null)
  FLOWMOE_CHECK(y != nullptr || q != nullptr, Error, what, ": neither y nor q asked for");
  const int threads = rmsnorm_threads(hidden);  // rmsnorm.cu's, so rstd sums in its order
  dispatch_cuda_float(dtype, what, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto launch = [&](auto kernel) {
      kernel<<<unsigned(rows), threads, 0, stream>>>(static_cast<T*>(h), static_cast<T*>(y), q, scale_inv,
                                                     static_cast<const T*>(x), static_cast<const T*>(a),
                                                     static_cast<const T*>(weight), hidden, float(eps));
    };
    if (rmsnorm_rows_vectorizable<T>(hidden, {x, a, weight, y}, q))
      launch(add_rmsnorm_kernel<T, true>);
    else
      launch(add_rmsnorm_kernel<T, false>);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
