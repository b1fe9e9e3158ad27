// Rowwise 1x128 FP8 quantize building blocks on the GPU (layout: kernels/fp8.h): 16-byte chunk loads,
// the e4m3 conversion, a lane group's amax and the grid-stride quantize loop over (row, block) groups.
// Used by the fused SwiGLU quantize (kernels/cuda/swiglu_quant.cu), the fused RMSNorm quantize
// (kernels/cuda/rmsnorm_quant.cu) and the SwiGLU's unfused baseline in bench/baselines/swiglu_quant_baseline.cu,
// so the baseline's quantize runs the same instructions.
#pragma once
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/packed.cuh"
#include "kernels/fp8.h"

namespace flowmoe {

// Elements of T in one 16-byte load.
template <class T>
constexpr int vec_elems() {
  return 16 / int(sizeof(T));
}

// N values of `row` from column j0, zero at columns >= n. kVec: one 16-byte load (the caller
// guarantees n % N == 0, so j0 < n means the whole chunk is in range).
template <class T, bool kVec, int N>
__device__ __forceinline__ void load_chunk(const T* __restrict__ row, int64_t j0, int64_t n, float (&v)[N]) {
  if constexpr (kVec) {
    const Packed<T, 16> p = Packed<T, 16>::load(row + j0);
#pragma unroll
    for (int e = 0; e < N; ++e) v[e] = p.get(e);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) v[e] = j0 + e < n ? to_float(row[j0 + e]) : 0.f;
  }
}

__device__ __forceinline__ uint32_t e4m3_bits(float x) {
  return uint32_t(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// amax over a group of L lanes (L a power of two <= 32, groups aligned): NaN propagates.
template <int L>
__device__ __forceinline__ float group_amax(float amax) {
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) amax = fp8_amax_update(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  return amax;
}

// Quantizes N values (columns j0.. of one row) with the group's scale; N bytes stored at out (kVec:
// as one N-byte store) or fewer at a row's end (only columns < n).
template <bool kVec, int N>
__device__ __forceinline__ void store_e4m3(uint8_t* __restrict__ out, const float (&v)[N], float scale, int64_t j0,
                                           int64_t n) {
  if constexpr (kVec) {
    uint32_t w[N / 4];
#pragma unroll
    for (int k = 0; k < N / 4; ++k)
      w[k] = e4m3_bits(__fmul_rn(v[4 * k], scale)) | e4m3_bits(__fmul_rn(v[4 * k + 1], scale)) << 8 |
             e4m3_bits(__fmul_rn(v[4 * k + 2], scale)) << 16 | e4m3_bits(__fmul_rn(v[4 * k + 3], scale)) << 24;
    if constexpr (N == 8)
      *reinterpret_cast<uint2*>(out) = make_uint2(w[0], w[1]);
    else
      *reinterpret_cast<uint32_t*>(out) = w[0];
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e)
      if (j0 + e < n) out[e] = uint8_t(e4m3_bits(__fmul_rn(v[e], scale)));
  }
}

// One (row, block) group's quantize once each of its L lanes holds its N values v (zeros past the row): the
// group's amax, scale_inv stored by its first lane (sub 0), the bytes stored at q_at (the row's column j0). Every
// lane of the warp calls it, for the shuffles; a lane with `in` false only joins them.
template <int L, bool kVec, int N>
__device__ __forceinline__ void quantize_group(const float (&v)[N], bool in, int sub, uint8_t* __restrict__ q_at,
                                               float* __restrict__ scale_inv_at, int64_t j0, int64_t n) {
  float amax = 0.f;
#pragma unroll
  for (int e = 0; e < N; ++e) amax = fp8_amax_update(amax, v[e]);
  amax = group_amax<L>(amax);
  if (!in) return;
  const float s_inv = fp8_scale_inv(amax);
  if (sub == 0) *scale_inv_at = s_inv;
  store_e4m3<kVec>(q_at, v, fp8_scale_from_inv(s_inv), j0, n);
}

// Rowwise 1x128 quantize of M rows of K values made on the fly by produce(r, j0, v) (v[0..N) =
// columns j0.. of row r). A group of L = 128 / N lanes per (row, block); the loop's trip count is
// warp-uniform so the shuffles always see the whole warp.
template <int N, bool kVec, class Produce>
__device__ __forceinline__ void quantize_rows(int64_t M, int64_t K, uint8_t* __restrict__ q,
                                              float* __restrict__ scale_inv, Produce produce) {
  constexpr int L = kFp8BlockSize / N, kGroupsPerWarp = 32 / L;
  const int64_t nb = fp8_num_blocks(K), num_groups = M * nb;
  const int sub = (threadIdx.x & 31) % L;
  const int64_t num_warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; w * kGroupsPerWarp < num_groups;
       w += num_warps) {
    const int64_t group = w * kGroupsPerWarp + (threadIdx.x & 31) / L;
    const bool valid = group < num_groups;
    const int64_t r = valid ? group / nb : 0, b = valid ? group - r * nb : 0, j0 = b * kFp8BlockSize + sub * N;
    float v[N];
    if (valid && j0 < K) {
      produce(r, j0, v);
    } else {
#pragma unroll
      for (int e = 0; e < N; ++e) v[e] = 0.f;
    }
    quantize_group<L, kVec>(v, valid && j0 < K, sub, q + r * K + j0, scale_inv + r * nb + b, j0, K);
  }
}

}  // namespace flowmoe
