// The dequantize -> requantize baseline of bench/bench_fp8_transpose.cpp (declarations:
// bench/baselines/fp8_transpose_baseline.h). Step 1 dequantizes q to bf16 with 8 elements per thread; step 2
// quantizes y colwise with a CTA per (128-row block, 64 columns) over the same segment table
// (kernels/cuda/fp8_segments.cuh) as the transpose kernel of kernels/cuda/fp8_transpose.cu.
#include "bench/baselines/fp8_transpose_baseline.h"

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

// ---- kernels ----------------------------------------------------------------------------------

// Baseline step 1: y = bf16(e4m3_to_f32(q) * s_inv), 8 elements per thread (K % 8 == 0).
__global__ void baseline_dequantize_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scale_inv,
                                           int64_t M, int64_t K, __nv_bfloat16* __restrict__ y) {
  const int64_t groups = M * K / 8, nb = fp8_num_blocks(K);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < groups; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i * 8 / K, col = i * 8 % K;
    const float s = scale_inv[row * nb + col / kFp8BlockSize];
    const uint2 in = *reinterpret_cast<const uint2*>(q + i * 8);
    __align__(16) __nv_bfloat16 out[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const uint8_t byte = uint8_t((e < 4 ? in.x : in.y) >> (8 * (e & 3)));
      const float x = __half2float(__half(__nv_cvt_fp8_to_halfraw(byte, __NV_E4M3)));
      out[e] = __float2bfloat16_rn(__fmul_rn(x, s));
    }
    *reinterpret_cast<uint4*>(y + i * 8) = *reinterpret_cast<const uint4*>(out);
  }
}

// Baseline step 2: an ordinary colwise quantize of y. CTA per (128-row block, 64 columns): the tile
// goes to shared memory transposed (f32), thread (j, part) takes the amax of column j over the block
// (4 parts of 32 rows), then quantizes its 32 rows and stores them as 2 x 16 bytes.
constexpr int kBaseCols = 64;
__global__ void __launch_bounds__(kThreads)
    baseline_quantize_colwise_kernel(const __nv_bfloat16* __restrict__ y, int64_t M, int64_t K,
                                     uint8_t* __restrict__ q_t, float* __restrict__ scale_inv_t, int num_col_tiles,
                                     bool vec_out, const __grid_constant__ SegmentChunk chunk) {
  __shared__ float tile_t[kBaseCols][kTile + 1];
  __shared__ float part_amax[4][kBaseCols];
  const int tid = threadIdx.x, col_tile = int(blockIdx.x % unsigned(num_col_tiles));
  const TileRows tr = find_tile_rows(chunk, int(blockIdx.x / unsigned(num_col_tiles)));
  const int64_t col0 = int64_t(col_tile) * kBaseCols;
  for (int i = tid; i < kTile * kBaseCols / 8; i += kThreads) {  // 8 bf16 (16 bytes) per load
    const int r = i / (kBaseCols / 8), c = 8 * (i % (kBaseCols / 8));
    uint4 in = make_uint4(0, 0, 0, 0);
    if (r < tr.num_rows && col0 + c < K) in = *reinterpret_cast<const uint4*>(y + (tr.first_row + r) * K + col0 + c);
    const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&in);
#pragma unroll
    for (int k = 0; k < 8; ++k) tile_t[c + k][r] = __bfloat162float(e[k]);
  }
  __syncthreads();
  const int j = tid % kBaseCols, part = tid / kBaseCols;
  float amax = 0.f;
  for (int t = 0; t < 32; ++t) amax = fp8_amax_update(amax, tile_t[j][32 * part + t]);
  part_amax[part][j] = amax;
  __syncthreads();
  for (int p = 0; p < 4; ++p) amax = fp8_amax_update(amax, part_amax[p][j]);
  const float s_inv = fp8_scale_inv(amax), scale = fp8_scale_from_inv(s_inv);
  if (col0 + j >= K) return;
  if (part == 0) scale_inv_t[tr.block * K + col0 + j] = s_inv;
  __align__(16) uint8_t out[32];
#pragma unroll
  for (int t = 0; t < 32; ++t)
    out[t] = __nv_cvt_float_to_fp8(__fmul_rn(tile_t[j][32 * part + t], scale), __NV_SATFINITE, __NV_E4M3);
  const int r_first = 32 * part;
  uint8_t* dst = q_t + (col0 + j) * M + tr.first_row + r_first;
  if (vec_out && r_first + 32 <= tr.num_rows && ((tr.first_row + r_first) & 15) == 0) {
    reinterpret_cast<uint4*>(dst)[0] = reinterpret_cast<const uint4*>(out)[0];
    reinterpret_cast<uint4*>(dst)[1] = reinterpret_cast<const uint4*>(out)[1];
  } else {
    for (int t = 0; t < 32 && r_first + t < tr.num_rows; ++t) dst[t] = out[t];
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

// ---- launchers --------------------------------------------------------------------------------

void fp8_transpose_baseline_dequantize_cuda(const uint8_t* q, const float* scale_inv, int64_t M, int64_t K, uint16_t* y,
                                            cudaStream_t stream) {
  FLOWMOE_CHECK(M >= 0 && K >= 0 && K % 8 == 0 && aligned16(y), ShapeError,
                "fp8_transpose_baseline_dequantize_cuda: needs K % 8 == 0 and aligned y, got M ", M, ", K ", K);
  if (M == 0 || K == 0) return;
  baseline_dequantize_kernel<<<grid_size(M * K / 8, kThreads), kThreads, 0, stream>>>(
      q, scale_inv, M, K, reinterpret_cast<__nv_bfloat16*>(y));
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void fp8_transpose_baseline_quantize_colwise_cuda(const uint16_t* y, int64_t M, int64_t K,
                                                  const int64_t* rows_per_segment, int64_t num_segments, uint8_t* q_t,
                                                  float* scale_inv_t, cudaStream_t stream) {
  const char* what = "fp8_transpose_baseline_quantize_colwise_cuda";
  FLOWMOE_CHECK(K >= 0 && K % 8 == 0 && aligned16(y), ShapeError, what, ": needs K % 8 == 0 and aligned y, got K ", K);
  fp8_transpose_num_blocks(rows_per_segment, num_segments, M);
  if (M == 0 || K == 0) return;
  const int64_t num_col_tiles = (K + kBaseCols - 1) / kBaseCols;
  const bool vec_out = M % 16 == 0 && aligned16(q_t);
  const int64_t total =
      for_each_chunk(rows_per_segment, num_segments, num_col_tiles, what, [&](const SegmentChunk& c, unsigned grid) {
        baseline_quantize_colwise_kernel<<<grid, kThreads, 0, stream>>>(
            reinterpret_cast<const __nv_bfloat16*>(y), M, K, q_t, scale_inv_t, int(num_col_tiles), vec_out, c);
        FLOWMOE_CUDA_CHECK_LAUNCH();
      });
  if (total < M) FLOWMOE_CUDA_CHECK(cudaMemset2DAsync(q_t + total, size_t(M), 0, size_t(M - total), size_t(K), stream));
}

}  // namespace flowmoe
