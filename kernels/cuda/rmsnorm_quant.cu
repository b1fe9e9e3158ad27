// Fused RMSNorm + rowwise 1x128 FP8 quantize on the GPU (kernels/rmsnorm_quant.h): x, y [rows, hidden] f32 or
// bf16, weight [hidden]; q [rows, hidden] e4m3, scale_inv [rows, ceil(hidden/128)].
//   pass 1: rstd = rsqrt(mean(x^2) + eps) (kernels/cuda/rmsnorm_row.cuh, rmsnorm.cu's CTA size and order);
//   pass 2: y_j = round((x_j * rstd) * w_j) to the dtype, written when asked; each 128-column block's amax
//           over the rounded y, scale_inv = fp8_scale_inv(amax), q = e4m3(y * scale) (quantize_rows.cuh).
// One CTA per row; pass 2 gives each block a group of 128/V lanes with V elements each (one 16-byte load).
// It equals rmsnorm_forward_cuda then quantize_rowwise_cuda bit for bit; the CPU reference is that
// composition (kernels/cpu/rmsnorm_quant.cpp). Tests: tests/test_rmsnorm_quant.cpp.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/packed.cuh"
#include "kernels/cuda/quantize_rows.cuh"
#include "kernels/cuda/rmsnorm_row.cuh"
#include "kernels/fp8.h"
#include "kernels/rmsnorm_quant.h"

namespace flowmoe {

// ---- kernels ----------------------------------------------------------------------------------

// kVec: x, weight, y and q allow 16-byte (and V-byte) accesses at every V-column chunk (hidden % V == 0, aligned
// bases), so each lane's V columns lie all inside or all outside the row.
template <class T, bool kVec>
__global__ void rmsnorm_quant_kernel(T* __restrict__ y, uint8_t* __restrict__ q, float* __restrict__ scale_inv,
                                     const T* __restrict__ x, const T* __restrict__ weight, int64_t hidden, float eps) {
  constexpr int V = vec_elems<T>(), L = kFp8BlockSize / V, kGroupsPerWarp = 32 / L;
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x, nb = fp8_num_blocks(hidden);
  const T* xr = x + r * hidden;
  const float rstd = rmsnorm_row_rstd(xr, hidden, eps, scratch);

  const int lane = threadIdx.x & 31, sub = lane % L;
  const int64_t warps = blockDim.x >> 5;
  // The trip count depends on the warp only, so every lane joins quantize_group's shuffles.
  for (int64_t base = (threadIdx.x >> 5) * kGroupsPerWarp; base < nb; base += warps * kGroupsPerWarp) {
    const int64_t b = base + lane / L, j0 = b * kFp8BlockSize + sub * V;
    const bool in = b < nb && j0 < hidden;
    float v[V];
    if (in) {
      float xv[V], wv[V];
      load_chunk<T, kVec>(xr, j0, hidden, xv);
      load_chunk<T, kVec>(weight, j0, hidden, wv);
      Packed<T, 16> yp;  // y as rounded to T: what the plain kernel writes and the quantize reads
#pragma unroll
      for (int e = 0; e < V; ++e) {
        yp.set(e, rmsnorm_value(xv[e], rstd, wv[e]));
        v[e] = yp.get(e);
      }
      if (y != nullptr) {
        if constexpr (kVec) {
          yp.store(y + r * hidden + j0);
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e)
            if (j0 + e < hidden) y[r * hidden + j0 + e] = from_float<T>(v[e]);
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) v[e] = 0.f;
    }
    quantize_group<L, kVec>(v, in, sub, q + r * hidden + j0, scale_inv + r * nb + b, j0, hidden);
  }
}

// ---- launchers --------------------------------------------------------------------------------

void rmsnorm_quant_forward_cuda(DType dtype, void* y, uint8_t* q, float* scale_inv, const void* x, const void* weight,
                                int64_t rows, int64_t hidden, double eps, cudaStream_t stream) {
  const char* what = "rmsnorm_quant_forward_cuda";
  FLOWMOE_CHECK(dtype == DType::f32 || dtype == DType::bf16, DTypeError, what, " supports f32 and bf16, got ",
                dtype_name(dtype));
  FLOWMOE_CHECK(rows >= 0 && hidden >= 0, ShapeError, what, ": bad shape rows ", rows, ", hidden ", hidden);
  FLOWMOE_CHECK(rows <= int64_t(0x7fffffff), ShapeError, what, ": ", rows, " rows exceed the grid limit");
  FLOWMOE_CHECK(eps >= 0, Error, what, ": eps must be >= 0, got ", eps);
  if (rows == 0 || hidden == 0) return;
  const int threads = rmsnorm_threads(hidden);  // rmsnorm.cu's, so rstd sums in its order
  dispatch_cuda_float(dtype, what, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int V = vec_elems<T>();
    const bool vec =
        hidden % V == 0 &&
        (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(weight) | reinterpret_cast<uintptr_t>(y)) % 16 ==
            0 &&
        reinterpret_cast<uintptr_t>(q) % V == 0;
    auto launch = [&](auto kernel) {
      kernel<<<unsigned(rows), threads, 0, stream>>>(static_cast<T*>(y), q, scale_inv, static_cast<const T*>(x),
                                                     static_cast<const T*>(weight), hidden, float(eps));
    };
    if (vec)
      launch(rmsnorm_quant_kernel<T, true>);
    else
      launch(rmsnorm_quant_kernel<T, false>);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
