// Scaling-aware FP8 transpose on the GPU (math: kernels/fp8_transpose.h), bit-identical to the CPU
// reference kernels/cpu/fp8_transpose.cpp. One CTA per (128-row block of a segment, 128-column block):
// 16-byte loads of the q tile into registers, the block's S from its 128 row scales, each row's bytes
// re-encoded at S (e4m3 -> half, times 2^-k, -> e4m3 RNE: exact in half wherever the e4m3 result is not
// zero), a row-swizzled shared tile, a 4x4 byte transpose in registers, 16-byte stores of q_t.
// The tile's rows come from kernels/cuda/fp8_segments.cuh: a host segment table in the launch parameters,
// or the device counts (every CTA scans them; the grid covers the worst case and the CTAs past the real
// blocks write the zero columns and the scale rows 1.0f of the unused tail). The dequantize -> requantize
// baseline of bench/bench_fp8_transpose.cpp lives in bench/baselines/fp8_transpose_baseline.cu.
// Tests: tests/test_fp8_transpose.cpp, tests/test_fp8_colwise_device.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/fp8_segments.cuh"
#include "kernels/fp8.h"
#include "kernels/fp8_transpose.h"

namespace flowmoe {

namespace {

constexpr int kThreads = 256;
static_assert(kThreads == kCountScanThreads, "a CTA scans the device counts, one thread per expert");
constexpr int kHalfMaxShift = 24;  // 2^-24 is the smallest half; 448 * 2^-24 rounds to zero in e4m3
constexpr uint32_t kNanBits = 0x7FC00000u;

// ---- kernels ----------------------------------------------------------------------------------

__device__ __forceinline__ int exponent_field(float x) { return int((__float_as_uint(x) >> 23) & 0xFF); }

// Four e4m3 bytes times 2^-k (f: that power as a half pair), rounded to nearest even by the cvt.
__device__ __forceinline__ uint32_t shift_word(uint32_t w, __half2 f) {
  __half2 lo = __half2(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w & 0xFFFFu), __NV_E4M3));
  __half2 hi = __half2(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w >> 16), __NV_E4M3));
  const uint32_t out_lo = __nv_cvt_halfraw2_to_fp8x2(__half2_raw(__hmul2(lo, f)), __NV_SATFINITE, __NV_E4M3);
  const uint32_t out_hi = __nv_cvt_halfraw2_to_fp8x2(__half2_raw(__hmul2(hi, f)), __NV_SATFINITE, __NV_E4M3);
  return out_lo | (out_hi << 16);
}

// NaN bytes of `in` become the positive NaN code 0x7F in `out`, whatever sign the cvt kept.
__device__ __forceinline__ uint32_t canonical_nans(uint32_t out, uint32_t in) {
  const uint32_t nan = __vcmpeq4(in & 0x7F7F7F7Fu, 0x7F7F7F7Fu);
  return (out & ~nan) | (0x7F7F7F7Fu & nan);
}

// Grid: 1D over (128-row block) x (column tile), column tiles fastest so neighbours share the sectors of
// the scale gather. Thread t loads 16-byte group t%8 of rows t/8 + 32*it. Segments: SegmentChunk or
// CountSegments (fp8_segments.cuh); a fill tile reads nothing, so its rows are zeros and its S is 1.
template <class Segments>
__global__ void __launch_bounds__(kThreads)
    fp8_transpose_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scale_inv, int64_t M, int64_t K,
                         uint8_t* __restrict__ q_t, float* __restrict__ scale_inv_t, int num_col_tiles, bool vec_in,
                         bool vec_out, const __grid_constant__ Segments segments) {
  __shared__ __align__(16) uint32_t tile[kTile * kTile / 4];  // [row][32 words]; 16-byte group g at g ^ (row/16)
  __shared__ int32_t warp_max[kThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, group = tid & 7;
  const int col_tile = int(blockIdx.x % unsigned(num_col_tiles));
  const TileRows tr = find_tile_rows(segments, int(blockIdx.x / unsigned(num_col_tiles)));
  const int64_t col0 = int64_t(col_tile) * kTile;
  const int num_cols = int(K - col0 < kTile ? K - col0 : kTile);

  uint4 v[4];
  float s[4];
  int32_t best = 0;  // max of the taking-part scales' bits (positive floats order as ints; NaN above inf)
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    const int r = (tid >> 3) + 32 * it;
    v[it] = make_uint4(0, 0, 0, 0);
    s[it] = 1.f;
    if (r < tr.num_rows && !tr.fill) {
      const int64_t row = tr.first_row + r;
      s[it] = scale_inv[row * num_col_tiles + col_tile];
      const uint8_t* src = q + row * K + col0 + 16 * group;
      if (vec_in) {
        if (16 * group < num_cols) v[it] = __ldcs(reinterpret_cast<const uint4*>(src));
      } else {
        uint32_t w[4] = {0, 0, 0, 0};
        for (int b = 0; b < 16 && 16 * group + b < num_cols; ++b) w[b >> 2] |= uint32_t(src[b]) << (8 * (b & 3));
        v[it] = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }
#pragma unroll
  for (int it = 0; it < 4; ++it) {  // after all four loads are in flight
    const int r = (tid >> 3) + 32 * it;
    uint32_t nz = (v[it].x | v[it].y | v[it].z | v[it].w) & 0x7F7F7F7Fu;
    nz |= __shfl_xor_sync(0xFFFFFFFFu, nz, 1);
    nz |= __shfl_xor_sync(0xFFFFFFFFu, nz, 2);
    nz |= __shfl_xor_sync(0xFFFFFFFFu, nz, 4);
    const bool nan = s[it] != s[it];
    if (r < tr.num_rows && (nz != 0 || nan)) best = max(best, nan ? int32_t(kNanBits) : __float_as_int(s[it]));
  }
  best = __reduce_max_sync(0xFFFFFFFFu, best);
  if (lane == 0) warp_max[warp] = best;
  __syncthreads();
  int32_t s_bits = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) s_bits = max(s_bits, warp_max[w]);
  const bool nan_scale = s_bits > int32_t(0x7F800000u);
  const float S = s_bits == 0 ? 1.f : __int_as_float(s_bits);
  if (tid < num_cols) scale_inv_t[tr.block * K + col0 + tid] = S;

#pragma unroll
  for (int it = 0; it < 4; ++it) {
    const int r = (tid >> 3) + 32 * it;
    const int k = nan_scale ? 0 : min(max(exponent_field(S) - exponent_field(s[it]), 0), kHalfMaxShift);
    uint4 o = v[it];
    if (k != 0) {
      const uint32_t h = k <= 14 ? uint32_t(15 - k) << 10 : 1u << (24 - k);  // 2^-k as half bits
      const __half2 f = __half2(__half2_raw{uint16_t(h), uint16_t(h)});
      o = make_uint4(shift_word(o.x, f), shift_word(o.y, f), shift_word(o.z, f), shift_word(o.w, f));
    }
    o = make_uint4(canonical_nans(o.x, v[it].x), canonical_nans(o.y, v[it].y), canonical_nans(o.z, v[it].z),
                   canonical_nans(o.w, v[it].w));
    *reinterpret_cast<uint4*>(&tile[r * 32 + 4 * (group ^ (r >> 4))]) = o;
  }
  __syncthreads();

  // Thread (rg, cw): rows 16*rg..+15 of the 4 columns in word cw; 8 lanes cover 128 bytes of one q_t row.
  const int rg = lane & 7, cw = 4 * warp + (lane >> 3);
  uint32_t col[4][4];  // [column of the word][rows 4g..4g+3]
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    const int r = 16 * rg + 4 * g, pw = cw ^ (rg << 2);
    const uint32_t a = tile[r * 32 + pw], b = tile[(r + 1) * 32 + pw];
    const uint32_t c = tile[(r + 2) * 32 + pw], d = tile[(r + 3) * 32 + pw];
    const uint32_t ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);
    const uint32_t cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
    col[0][g] = __byte_perm(ab_lo, cd_lo, 0x5410);
    col[1][g] = __byte_perm(ab_lo, cd_lo, 0x7632);
    col[2][g] = __byte_perm(ab_hi, cd_hi, 0x5410);
    col[3][g] = __byte_perm(ab_hi, cd_hi, 0x7632);
  }
  const int r_first = 16 * rg;
  if (r_first >= tr.num_rows) return;
  const bool full = vec_out && r_first + 16 <= tr.num_rows && ((tr.first_row + r_first) & 15) == 0;
#pragma unroll
  for (int x = 0; x < 4; ++x) {
    const int j = 4 * cw + x;
    if (j >= num_cols) continue;
    uint8_t* dst = q_t + (col0 + j) * M + tr.first_row + r_first;
    if (full) {
      __stcs(reinterpret_cast<uint4*>(dst), make_uint4(col[x][0], col[x][1], col[x][2], col[x][3]));
    } else {
      for (int t = 0; t < 16 && r_first + t < tr.num_rows; ++t) dst[t] = uint8_t(col[x][t >> 2] >> (8 * (t & 3)));
    }
  }
}

// ---- launchers --------------------------------------------------------------------------------

// One launch of the kernel over `grid` CTAs with these segments.
template <class Segments>
void launch_transpose(const uint8_t* q, const float* scale_inv, int64_t M, int64_t K, uint8_t* q_t, float* scale_inv_t,
                      const Segments& segments, unsigned grid, cudaStream_t stream) {
  const bool vec_in = K % 16 == 0 && aligned_to(q, 16), vec_out = M % 16 == 0 && aligned_to(q_t, 16);
  fp8_transpose_kernel<Segments><<<grid, kThreads, 0, stream>>>(q, scale_inv, M, K, q_t, scale_inv_t,
                                                                int(fp8_num_blocks(K)), vec_in, vec_out, segments);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void fp8_transpose_cuda(const uint8_t* q, const float* scale_inv, int64_t M, int64_t K, const int64_t* rows_per_segment,
                        int64_t num_segments, uint8_t* q_t, float* scale_inv_t, cudaStream_t stream) {
  FLOWMOE_CHECK(K >= 0, ShapeError, "fp8_transpose_cuda: bad K ", K);
  fp8_transpose_num_blocks(rows_per_segment, num_segments, M);
  if (M == 0 || K == 0) return;
  const int64_t total = for_each_chunk(rows_per_segment, num_segments, fp8_num_blocks(K), "fp8_transpose_cuda",
                                       [&](const SegmentChunk& c, unsigned grid) {
                                         launch_transpose(q, scale_inv, M, K, q_t, scale_inv_t, c, grid, stream);
                                       });
  if (total < M) FLOWMOE_CUDA_CHECK(cudaMemset2DAsync(q_t + total, size_t(M), 0, size_t(M - total), size_t(K), stream));
}

void fp8_transpose_device_cuda(const uint8_t* q, const float* scale_inv, int64_t M, int64_t K, const int32_t* counts,
                               int64_t num_experts, uint8_t* q_t, float* scale_inv_t, cudaStream_t stream) {
  const char* what = "fp8_transpose_device_cuda";
  const int64_t max_blocks = fp8_colwise_device_check(what, M, K, counts, num_experts);
  if (K == 0 || max_blocks == 0) return;
  launch_transpose(q, scale_inv, M, K, q_t, scale_inv_t, CountSegments{counts, int(num_experts), M},
                   unsigned(max_blocks * fp8_num_blocks(K)), stream);
}

}  // namespace flowmoe
