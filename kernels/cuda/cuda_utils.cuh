// Small device helpers shared by the kernels: bf16/f32 conversion, grid sizing, warp reductions, the
// counted rows of a worst-case buffer, pointer alignment, and a dtype -> C++ type dispatch for launchers.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common/counted_rows.h"
#include "kernels/common/dtype.h"
#include "kernels/common/error.h"

namespace flowmoe {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Sum / max over each aligned group of kLanes lanes (a power of two, at most 32) by xor shuffles; every lane
// of a group gets its group's result. All 32 lanes must take part.
template <int kLanes>
__device__ __forceinline__ float lane_group_sum(float v) {
  for (int o = kLanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <int kLanes>
__device__ __forceinline__ float lane_group_max(float v) {
  for (int o = kLanes / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) { return lane_group_sum<32>(v); }
__device__ __forceinline__ float warp_max(float v) { return lane_group_max<32>(v); }

// Sum over a block whose size is a multiple of 32 (<= 1024). `scratch` holds 32 floats of shared
// memory. Every thread gets the total.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : 0.f;
  return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : -INFINITY;
  return warp_max(v);
}

// The rows of `rows` a kernel computes (kernels/common/counted_rows.h): all, or the sum of the counts.
__device__ __forceinline__ int64_t counted_rows(int64_t rows, CountedRows c) {
  if (!c.counts) return rows;
  int64_t sum = 0;
  for (int i = 0; i < c.num; ++i) sum += __ldg(c.counts + i);
  return sum < rows ? sum : rows;
}

// Whether p is aligned to `bytes`: the condition of a vector access that wide (16 bytes: also TMA's base
// alignment), checked by launchers on the host and by kernels on the device.
__host__ __device__ __forceinline__ bool aligned_to(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Blocks for a grid-stride loop over n elements (capped; the loop covers the rest).
inline unsigned grid_size(int64_t n, int threads) {
  int64_t blocks = (n + threads - 1) / threads;
  return unsigned(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

// Calls f(T*) with a null pointer of the CUDA type for f32 or bf16; other dtypes throw.
template <class F>
void dispatch_cuda_float(DType t, const char* what, F&& f) {
  if (t == DType::f32)
    f(static_cast<float*>(nullptr));
  else if (t == DType::bf16)
    f(static_cast<__nv_bfloat16*>(nullptr));
  else
    FLOWMOE_THROW(DTypeError, what, " on cuda supports f32 and bf16, got ", dtype_name(t));
}

}  // namespace flowmoe
