// RMSNorm's forward over one row on the GPU, shared by the plain kernel (kernels/cuda/rmsnorm.cu) and the fused
// ones (kernels/cuda/rmsnorm_quant.cu, kernels/cuda/add_rmsnorm.cu): all take rstd and each y_j from these
// functions, with the same CTA size, so a fused kernel's y is the plain one's bit for bit (and its quantize that
// of quantize_rowwise_cuda on that y). The row pass of the fused kernels writes y and/or quantizes it in 1x128
// blocks (kernels/cuda/quantize_rows.cuh), a group of 128/V lanes per block, V columns a lane.
#pragma once
#include <cstdint>
#include <initializer_list>

#include "kernels/common/error.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/packed.cuh"
#include "kernels/cuda/quantize_rows.cuh"
#include "kernels/fp8.h"

namespace flowmoe {

// Threads of the CTA that owns a row: about 4 columns per thread, a multiple of 32 in [32, 1024]
// (what block_sum needs). It fixes rstd's summation order, so the plain and the fused kernels share it.
inline int rmsnorm_threads(int64_t hidden) {
  int64_t t = ((hidden + 3) / 4 + 31) / 32 * 32;
  return int(t < 32 ? 32 : (t > 1024 ? 1024 : t));
}

// The launchers' checks: dtype f32 or bf16, a shape the grid (one CTA per row) takes, eps >= 0.
inline void check_rmsnorm_args(const char* what, DType dtype, int64_t rows, int64_t hidden, double eps) {
  FLOWMOE_CHECK(dtype == DType::f32 || dtype == DType::bf16, DTypeError, what, " supports f32 and bf16, got ",
                dtype_name(dtype));
  FLOWMOE_CHECK(rows >= 0 && hidden >= 0, ShapeError, what, ": bad shape rows ", rows, ", hidden ", hidden);
  FLOWMOE_CHECK(rows <= int64_t(0x7fffffff), ShapeError, what, ": ", rows, " rows exceed the grid limit");
  FLOWMOE_CHECK(eps >= 0, Error, what, ": eps must be >= 0, got ", eps);
}

// Whether rmsnorm_write_row may use its vector path: rows of T a whole number of 16-byte chunks, and every base
// (null ones aside) aligned for them (q: for the V-byte stores).
template <class T>
bool rmsnorm_rows_vectorizable(int64_t hidden, std::initializer_list<const void*> bases16, const void* q) {
  if (hidden % vec_elems<T>() != 0 || reinterpret_cast<uintptr_t>(q) % vec_elems<T>() != 0) return false;
  for (const void* p : bases16)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// rsqrt(mean(h^2) + eps) of a row whose column j value(j) gives, every thread of the CTA taking part and getting
// it: thread t sums columns t, t + blockDim.x, ... in order, then block_sum. scratch: 32 floats of shared memory.
template <class Value>
__device__ __forceinline__ float rmsnorm_row_rstd(int64_t hidden, float eps, float* scratch, Value value) {
  float sum_sq = 0.f;
  for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
    const float v = value(j);
    sum_sq += v * v;
  }
  return rsqrtf(block_sum(sum_sq, scratch) / float(hidden) + eps);
}

// y_j before its rounding to the output dtype: (h_j * rstd) * w_j.
__device__ __forceinline__ float rmsnorm_value(float h, float rstd, float w) { return h * rstd * w; }

// The fused kernels' second pass over a row: y_j = round((h_j * rstd) * w_j) to T, with load_h(j0, v) giving the
// V values of h at columns j0.. (zeros past the row); y written where y_row is non-null, and the rounded y
// quantized where q_row is non-null (scale_inv of the row at s_row). kVec: see rmsnorm_rows_vectorizable.
template <class T, bool kVec, class LoadH>
__device__ __forceinline__ void rmsnorm_write_row(T* __restrict__ y_row, uint8_t* __restrict__ q_row,
                                                  float* __restrict__ s_row, const T* __restrict__ weight,
                                                  int64_t hidden, float rstd, LoadH load_h) {
  constexpr int V = vec_elems<T>(), L = kFp8BlockSize / V, kGroupsPerWarp = 32 / L;
  const int64_t nb = fp8_num_blocks(hidden), warps = blockDim.x >> 5;
  const int lane = threadIdx.x & 31, sub = lane % L;
  // The trip count depends on the warp only, so every lane joins quantize_group's shuffles.
  for (int64_t base = (threadIdx.x >> 5) * kGroupsPerWarp; base < nb; base += warps * kGroupsPerWarp) {
    const int64_t b = base + lane / L, j0 = b * kFp8BlockSize + sub * V;
    const bool in = b < nb && j0 < hidden;
    float v[V];
    if (in) {
      float hv[V], wv[V];
      load_h(j0, hv);
      load_chunk<T, kVec>(weight, j0, hidden, wv);
      Packed<T, 16> yp;  // y as rounded to T: what the plain kernel writes and the quantize reads
#pragma unroll
      for (int e = 0; e < V; ++e) {
        yp.set(e, rmsnorm_value(hv[e], rstd, wv[e]));
        v[e] = yp.get(e);
      }
      if (y_row != nullptr) {
        if constexpr (kVec) {
          yp.store(y_row + j0);
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e)
            if (j0 + e < hidden) y_row[j0 + e] = from_float<T>(v[e]);
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) v[e] = 0.f;
    }
    if (q_row != nullptr) quantize_group<L, kVec>(v, in, sub, q_row + j0, s_row + b, j0, hidden);
  }
}

}  // namespace flowmoe
