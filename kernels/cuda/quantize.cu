// Blockwise FP8 e4m3 quantize / dequantize on the GPU (formats and layouts: kernels/fp8.h):
//   scale_inv = fp8_scale_inv(amax of the block), q = cvt.rn.satfinite.e4m3(x * scale), y = e4m3(q) * scale_inv
// rowwise [M,K] 1x128: a group of 128/V lanes per block (V elements per 16-byte access), shuffle amax.
// colwise [M,K] -> [K,M] over segments, and block 128x128 (+ exact transpose): shared-memory tiles.
// The colwise segments come from kernels/cuda/fp8_segments.cuh: a host table in the launch parameters,
// or device counts (the grid then covers the worst case; fill tiles quantize zeros: data 0, scale 1).
// Only exact f32 operations (x * 2^e, max), so the CPU reference kernels/cpu/quantize.cpp agrees bit
// for bit. Tests: tests/test_quantize.cpp, tests/test_fp8_colwise_device.cpp.
// One file: the rowwise, colwise and 128x128 quantize kernels and their dequantize twins share the
// block-scale and packing functions below.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/fp8_segments.cuh"
#include "kernels/fp8.h"
#include "kernels/quantize.h"

namespace flowmoe {

namespace {

constexpr int kBlk = kFp8BlockSize;  // 128
constexpr int kThreads = 256, kWarps = kThreads / 32;
static_assert(kThreads == kCountScanThreads, "a CTA scans the device counts, one thread per expert");
constexpr int kColTile = 64;  // columns per colwise CTA (one 128-row block of a segment)
static_assert(kTile == kBlk, "a colwise CTA covers one scaling block of rows");

// ---- kernels ----------------------------------------------------------------------------------

template <class T>
constexpr int kVec = 16 / int(sizeof(T));  // elements per 16-byte access: f32 4, bf16 8

__device__ __forceinline__ float e4m3_value(uint32_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(b), __NV_E4M3)));  // exact
}
// NaN as the canonical 0x7FFFFFFF, as the CPU reference writes it.
__device__ __forceinline__ float dequant(uint32_t b, float s_inv) {
  float v = __fmul_rn(e4m3_value(b & 0xFFu), s_inv);
  return v != v ? __int_as_float(0x7FFFFFFF) : v;
}
// Two e4m3 bytes (a low, b high) from x * scale; the same cvt instruction as the one-value form.
__device__ __forceinline__ uint32_t quant2(float a, float b, float scale) {
  return __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(a, scale), __fmul_rn(b, scale)), __NV_SATFINITE, __NV_E4M3);
}

template <class T>
__device__ __forceinline__ void load_vec(const T* p, float* v) {  // 16 bytes, aligned
  uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i) v[i] = to_float(e[i]);
}
template <class T>
__device__ __forceinline__ void store_vec(T* p, const float* v) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i) e[i] = from_float<T>(v[i]);
  *reinterpret_cast<uint4*>(p) = raw;
}
// V bytes (4 or 8), aligned.
template <int V>
__device__ __forceinline__ void store_bytes(uint8_t* p, const uint32_t* words) {
  if constexpr (V == 4)
    *reinterpret_cast<uint32_t*>(p) = words[0];
  else
    *reinterpret_cast<uint2*>(p) = make_uint2(words[0], words[1]);
}

// a / b and a % b, in 32 bits when both fit (64-bit division is a long subroutine on the GPU).
__device__ __forceinline__ void div_mod(int64_t a, int64_t b, int64_t& quot, int64_t& rem) {
  if (((a | b) >> 32) == 0)
    quot = int64_t(uint32_t(a) / uint32_t(b));
  else
    quot = a / b;
  rem = a - quot * b;
}

__device__ __forceinline__ float warp_amax(float a, int width) {  // NaN-propagating, over `width` lanes
  for (int o = width / 2; o > 0; o >>= 1) a = fp8_amax_update(a, __shfl_xor_sync(0xffffffffu, a, o));
  return a;
}

// Lane l holds the bytes of rows l + 32m (m = 0..3) in `word`; returns rows 4l..4l+3 (a 4-byte store).
__device__ __forceinline__ uint32_t rows_strided_to_packed(uint32_t word, int lane) {
  uint32_t out = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t w = __shfl_sync(0xffffffffu, word, (4 * lane + j) & 31);
    out |= ((w >> (8 * (lane >> 3))) & 0xFFu) << (8 * j);
  }
  return out;
}
// The inverse: lane l holds rows 4l..4l+3; returns rows l + 32m in byte m.
__device__ __forceinline__ uint32_t rows_packed_to_strided(uint32_t word, int lane) {
  uint32_t out = 0;
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    uint32_t w = __shfl_sync(0xffffffffu, word, (lane >> 2) + 8 * m);
    out |= ((w >> (8 * (lane & 3))) & 0xFFu) << (8 * m);
  }
  return out;
}

// Rowwise: group g of G = 128/V lanes quantizes block g (row g / nbk). kAligned: 16-byte loads are
// legal (K * sizeof(T) % 16 == 0), so each lane's V elements lie all inside or all outside the row.
template <class T, bool kAligned>
__global__ void quantize_rowwise_kernel(const T* __restrict__ x, int64_t M, int64_t K, uint8_t* __restrict__ q,
                                        float* __restrict__ scale_inv) {
  constexpr int V = kVec<T>, G = kBlk / V;
  int64_t tid = blockIdx.x * int64_t(kThreads) + threadIdx.x, blk = tid / G;
  int64_t nbk = fp8_num_blocks(K);
  bool active = blk < M * nbk;  // inactive lanes still join the shuffles
  int64_t row = 0, kb = 0;
  if (active) div_mod(blk, nbk, row, kb);
  int64_t k = kb * kBlk + (tid % G) * V;
  bool in = active && k < K;
  float v[V], amax = 0.f;
  if (kAligned && in) load_vec(x + row * K + k, v);
#pragma unroll
  for (int i = 0; i < V; ++i) {
    if (!kAligned) v[i] = active && k + i < K ? to_float(x[row * K + k + i]) : 0.f;
    if (kAligned && !in) v[i] = 0.f;
    amax = fp8_amax_update(amax, v[i]);
  }
  amax = warp_amax(amax, G);
  if (!active) return;
  float s_inv = fp8_scale_inv(amax), scale = fp8_scale_from_inv(s_inv);
  if (tid % G == 0) scale_inv[blk] = s_inv;
  uint32_t words[V / 4];
#pragma unroll
  for (int i = 0; i < V; i += 2) {
    uint32_t pair = quant2(v[i], v[i + 1], scale);
    if (i % 4 == 0)
      words[i / 4] = pair;
    else
      words[i / 4] |= pair << 16;
  }
  if (kAligned) {
    if (in) store_bytes<V>(q + row * K + k, words);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i)
      if (k + i < K) q[row * K + k + i] = uint8_t(words[i / 4] >> (8 * (i % 4)));
  }
}

// Dequantize rows of 128-element blocks; kBlockScales: the scale of row r is on the 128x128 grid of
// matrix r / N ([B, ceil(N/128), ceil(K/128)]), else rowwise [M, ceil(K/128)].
template <class T, bool kAligned, bool kBlockScales>
__global__ void dequantize_rows_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scale_inv, int64_t M,
                                       int64_t K, int64_t N, T* __restrict__ y) {
  constexpr int V = kVec<T>, G = kBlk / V;
  int64_t tid = blockIdx.x * int64_t(kThreads) + threadIdx.x, blk = tid / G;
  int64_t nbk = fp8_num_blocks(K);
  if (blk >= M * nbk) return;
  int64_t row, kb, mat = 0, n = 0;
  div_mod(blk, nbk, row, kb);
  int64_t k = kb * kBlk + (tid % G) * V;
  if (k >= K) return;
  if (kBlockScales) div_mod(row, N, mat, n);
  int64_t s_idx = kBlockScales ? (mat * fp8_num_blocks(N) + n / kBlk) * nbk + kb : blk;
  float s_inv = scale_inv[s_idx], v[V];
  if (kAligned) {
    uint32_t words[V / 4];
    if constexpr (V == 4)
      words[0] = *reinterpret_cast<const uint32_t*>(q + row * K + k);
    else
      *reinterpret_cast<uint2*>(words) = *reinterpret_cast<const uint2*>(q + row * K + k);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = dequant(words[i / 4] >> (8 * (i % 4)), s_inv);
    store_vec(y + row * K + k, v);
  } else {
    for (int i = 0; i < V && k + i < K; ++i) y[row * K + k + i] = from_float<T>(dequant(q[row * K + k + i], s_inv));
  }
}

// Colwise quantize of one 128-row block x 64 columns: stage in shared memory (f32), then a warp per
// column: amax over the block's rows, convert, and a 4-byte-per-lane store of q's row. Segments:
// SegmentChunk or CountSegments; a fill tile reads nothing (zeros: q 0, scale_inv 1).
template <class T, bool kAligned, class Segments>
__global__ void quantize_colwise_kernel(const T* __restrict__ x, int64_t M, int64_t K,
                                        __grid_constant__ const Segments segments, uint8_t* __restrict__ q,
                                        float* __restrict__ scale_inv) {
  constexpr int V = kVec<T>, VPR = kColTile / V;
  __shared__ float tile[kBlk][kColTile + 1];  // +1: a column read is conflict-free
  const TileRows tr = find_tile_rows(segments, int(blockIdx.x));
  const int64_t row0 = tr.first_row, k0 = int64_t(blockIdx.y) * kColTile;
  const int num_rows = tr.num_rows, read_rows = tr.fill ? 0 : num_rows;
  for (int idx = threadIdx.x; idx < kBlk * VPR; idx += kThreads) {
    int i = idx / VPR, c = (idx % VPR) * V;
    float v[V];
    if (kAligned && i < read_rows && k0 + c < K) load_vec(x + (row0 + i) * K + k0 + c, v);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (!kAligned)
        v[j] = i < read_rows && k0 + c + j < K ? to_float(x[(row0 + i) * K + k0 + c + j]) : 0.f;
      else if (!(i < read_rows && k0 + c < K))
        v[j] = 0.f;
      tile[i][c + j] = v[j];
    }
  }
  __syncthreads();
  int lane = threadIdx.x & 31;
  bool vec_store = ((reinterpret_cast<uintptr_t>(q) | uint64_t(M) | uint64_t(row0)) & 3) == 0;
  for (int c = threadIdx.x >> 5; c < kColTile && k0 + c < K; c += kWarps) {
    float v[4], amax = 0.f;
    for (int m = 0; m < 4; ++m) amax = fp8_amax_update(amax, v[m] = tile[lane + 32 * m][c]);
    amax = warp_amax(amax, 32);
    float s_inv = fp8_scale_inv(amax), scale = fp8_scale_from_inv(s_inv);
    if (lane == 0) scale_inv[tr.block * K + k0 + c] = s_inv;
    uint32_t word = quant2(v[0], v[1], scale) | quant2(v[2], v[3], scale) << 16;
    uint32_t packed = rows_strided_to_packed(word, lane);
    uint8_t* dst = q + (k0 + c) * M + row0;
    int i0 = 4 * lane;
    if (vec_store && i0 + 3 < num_rows)
      *reinterpret_cast<uint32_t*>(dst + i0) = packed;
    else
      for (int j = 0; j < 4 && i0 + j < num_rows; ++j) dst[i0 + j] = uint8_t(packed >> (8 * j));
  }
}

// The inverse: a warp per column reads q's row (4 bytes a lane), dequantizes into the tile, then the
// tile's rows are written to y with 16-byte stores.
template <class T, bool kAligned>
__global__ void dequantize_colwise_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scale_inv, int64_t M,
                                          int64_t K, __grid_constant__ const SegmentChunk chunk, T* __restrict__ y) {
  constexpr int V = kVec<T>, VPR = kColTile / V;
  __shared__ float tile[kBlk][kColTile + 1];
  const TileRows tr = find_tile_rows(chunk, int(blockIdx.x));
  const int64_t row0 = tr.first_row, k0 = int64_t(blockIdx.y) * kColTile;
  const int num_rows = tr.num_rows;
  int lane = threadIdx.x & 31, i0 = 4 * lane;
  bool vec_load = ((reinterpret_cast<uintptr_t>(q) | uint64_t(M) | uint64_t(row0)) & 3) == 0;
  for (int c = threadIdx.x >> 5; c < kColTile && k0 + c < K; c += kWarps) {
    const uint8_t* src = q + (k0 + c) * M + row0;
    uint32_t word = 0;
    if (vec_load && i0 + 3 < num_rows)
      word = *reinterpret_cast<const uint32_t*>(src + i0);
    else
      for (int j = 0; j < 4 && i0 + j < num_rows; ++j) word |= uint32_t(src[i0 + j]) << (8 * j);
    uint32_t strided = rows_packed_to_strided(word, lane);
    float s_inv = scale_inv[tr.block * K + k0 + c];
    for (int m = 0; m < 4; ++m) tile[lane + 32 * m][c] = dequant(strided >> (8 * m), s_inv);
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < num_rows * VPR; idx += kThreads) {
    int i = idx / VPR, c = (idx % VPR) * V;
    T* dst = y + (row0 + i) * K + k0 + c;
    if (kAligned) {
      if (k0 + c < K) store_vec(dst, &tile[i][c]);
    } else {
      for (int j = 0; j < V && k0 + c + j < K; ++j) dst[j] = from_float<T>(tile[i][c + j]);
    }
  }
}

// One CTA per 128x128 tile of matrix blockIdx.z: registers hold the tile, a block amax, q written from
// registers; for q_t the bytes go through shared memory and leave a warp per column (4 bytes a lane).
template <class T, bool kAligned>
__global__ void quantize_block_kernel(const T* __restrict__ w, int64_t N, int64_t K, uint8_t* __restrict__ q,
                                      float* __restrict__ scale_inv, uint8_t* __restrict__ q_t,
                                      float* __restrict__ scale_inv_t) {
  constexpr int V = kVec<T>, TPR = kBlk / V, RPP = kThreads / TPR, P = kBlk / RPP;
  __shared__ uint32_t tile[kBlk][kBlk / 4 + 1];  // bytes; +1 word: a column read is conflict-free
  __shared__ float warp_amaxes[kWarps];
  int64_t bk = blockIdx.x, bn = blockIdx.y, b = blockIdx.z, n0 = bn * kBlk, k0 = bk * kBlk;
  int64_t nbn = fp8_num_blocks(N), nbk = fp8_num_blocks(K);
  int c = (threadIdx.x % TPR) * V, lane = threadIdx.x & 31;
  const T* src = w + b * N * K;
  float v[P][V], amax = 0.f;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    int64_t n = n0 + threadIdx.x / TPR + p * RPP, k = k0 + c;
    if (kAligned && n < N && k < K) load_vec(src + n * K + k, v[p]);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (!kAligned)
        v[p][j] = n < N && k + j < K ? to_float(src[n * K + k + j]) : 0.f;
      else if (!(n < N && k < K))
        v[p][j] = 0.f;
      amax = fp8_amax_update(amax, v[p][j]);
    }
  }
  amax = warp_amax(amax, 32);
  if (lane == 0) warp_amaxes[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = 0.f;
  for (int i = 0; i < kWarps; ++i) amax = fp8_amax_update(amax, warp_amaxes[i]);
  float s_inv = fp8_scale_inv(amax), scale = fp8_scale_from_inv(s_inv);
  if (threadIdx.x == 0) {
    scale_inv[(b * nbn + bn) * nbk + bk] = s_inv;
    if (q_t) scale_inv_t[(b * nbk + bk) * nbn + bn] = s_inv;
  }
#pragma unroll
  for (int p = 0; p < P; ++p) {
    int r = threadIdx.x / TPR + p * RPP;
    int64_t n = n0 + r, k = k0 + c;
    uint32_t words[V / 4];
#pragma unroll
    for (int i = 0; i < V; i += 4)
      words[i / 4] = quant2(v[p][i], v[p][i + 1], scale) | quant2(v[p][i + 2], v[p][i + 3], scale) << 16;
    uint8_t* dst = q + b * N * K + n * K + k;
    if (kAligned) {
      if (n < N && k < K) store_bytes<V>(dst, words);
    } else if (n < N) {
#pragma unroll
      for (int j = 0; j < V; ++j)
        if (k + j < K) dst[j] = uint8_t(words[j / 4] >> (8 * (j % 4)));
    }
    if (q_t)
#pragma unroll
      for (int i = 0; i < V / 4; ++i) tile[r][c / 4 + i] = words[i];
  }
  if (!q_t) return;
  __syncthreads();
  int num_rows = int(min(int64_t(kBlk), N - n0)), i0 = 4 * lane;
  bool vec_store = ((reinterpret_cast<uintptr_t>(q_t) | uint64_t(N)) & 3) == 0;
  for (int cc = threadIdx.x >> 5; cc < kBlk && k0 + cc < K; cc += kWarps) {
    uint32_t word = 0;
    for (int m = 0; m < 4; ++m) word |= ((tile[lane + 32 * m][cc / 4] >> (8 * (cc % 4))) & 0xFFu) << (8 * m);
    uint32_t packed = rows_strided_to_packed(word, lane);
    uint8_t* dst = q_t + b * K * N + (k0 + cc) * N + n0;
    if (vec_store && i0 + 3 < num_rows)
      *reinterpret_cast<uint32_t*>(dst + i0) = packed;
    else
      for (int j = 0; j < 4 && i0 + j < num_rows; ++j) dst[i0 + j] = uint8_t(packed >> (8 * j));
  }
}

// ---- launchers --------------------------------------------------------------------------------

void check_sizes(const char* what, int64_t M, int64_t K) {
  FLOWMOE_CHECK(M >= 0 && K >= 0, ShapeError, what, ": bad shape [", M, ", ", K, "]");
}

// CTAs for one group of 128/V lanes per 128-element block of a [M,K] matrix.
template <class T>
unsigned rows_grid(const char* what, int64_t M, int64_t K) {
  int64_t lanes = M * fp8_num_blocks(K) * (kBlk / kVec<T>), ctas = (lanes + kThreads - 1) / kThreads;
  FLOWMOE_CHECK(ctas < (int64_t(1) << 31), ShapeError, what, ": [", M, ", ", K, "] is too large for one launch");
  return unsigned(ctas);
}

dim3 colwise_grid(const char* what, int64_t K) {
  FLOWMOE_CHECK((K + kColTile - 1) / kColTile < 65536, ShapeError, what, ": K = ", K, " is too large for one launch");
  return dim3(1, unsigned((K + kColTile - 1) / kColTile));
}

// Calls launch(chunk, num_blocks) for each run of up to kChunkSegments segments with blocks
// (fp8_segments.cuh); returns the segments' total.
template <class F>
int64_t for_each_colwise_chunk(const char* what, int64_t M, int64_t K, const int64_t* rows_per_segment,
                               int64_t num_segments, F&& launch) {
  int64_t total = colwise_total_rows(rows_per_segment, num_segments);
  FLOWMOE_CHECK(total <= M, ShapeError, what, ": rows_per_segment sum to ", total, " rows but the tensor has M = ", M);
  if (K > 0) for_each_chunk(rows_per_segment, num_segments, 1, what, launch);
  return total;
}

// The colwise quantize over `grid` (grid.x row blocks) with these segments.
template <class Segments>
void launch_quantize_colwise(const char* what, DType dtype, const void* x, int64_t M, int64_t K,
                             const Segments& segments, dim3 grid, uint8_t* q, float* scale_inv, cudaStream_t stream) {
  dispatch_cuda_float(dtype, what, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto* xt = static_cast<const T*>(x);
    if (K % kVec<T> == 0 && aligned_to(x, 16))
      quantize_colwise_kernel<T, true, Segments><<<grid, kThreads, 0, stream>>>(xt, M, K, segments, q, scale_inv);
    else
      quantize_colwise_kernel<T, false, Segments><<<grid, kThreads, 0, stream>>>(xt, M, K, segments, q, scale_inv);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void quantize_rowwise_cuda(DType dtype, const void* x, int64_t M, int64_t K, uint8_t* q, float* scale_inv,
                           cudaStream_t stream) {
  check_sizes("quantize_rowwise_cuda", M, K);
  if (M == 0 || K == 0) return;
  dispatch_cuda_float(dtype, "quantize_rowwise_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    unsigned grid = rows_grid<T>("quantize_rowwise_cuda", M, K);
    auto* xt = static_cast<const T*>(x);
    if (K % kVec<T> == 0 && aligned_to(x, 16) && aligned_to(q, 16))
      quantize_rowwise_kernel<T, true><<<grid, kThreads, 0, stream>>>(xt, M, K, q, scale_inv);
    else
      quantize_rowwise_kernel<T, false><<<grid, kThreads, 0, stream>>>(xt, M, K, q, scale_inv);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void dequantize_rowwise_cuda(DType out_dtype, const uint8_t* q, const float* scale_inv, int64_t M, int64_t K, void* y,
                             cudaStream_t stream) {
  check_sizes("dequantize_rowwise_cuda", M, K);
  if (M == 0 || K == 0) return;
  dispatch_cuda_float(out_dtype, "dequantize_rowwise_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    unsigned grid = rows_grid<T>("dequantize_rowwise_cuda", M, K);
    if (K % kVec<T> == 0 && aligned_to(y, 16) && aligned_to(q, 16))
      dequantize_rows_kernel<T, true, false><<<grid, kThreads, 0, stream>>>(q, scale_inv, M, K, 1, static_cast<T*>(y));
    else
      dequantize_rows_kernel<T, false, false><<<grid, kThreads, 0, stream>>>(q, scale_inv, M, K, 1, static_cast<T*>(y));
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void quantize_colwise_cuda(DType dtype, const void* x, int64_t M, int64_t K, const int64_t* rows_per_segment,
                           int64_t num_segments, uint8_t* q, float* scale_inv, cudaStream_t stream) {
  const char* what = "quantize_colwise_cuda";
  check_sizes(what, M, K);
  dim3 grid = colwise_grid(what, K);
  int64_t total =
      for_each_colwise_chunk(what, M, K, rows_per_segment, num_segments, [&](const SegmentChunk& c, unsigned nb) {
        grid.x = nb;
        launch_quantize_colwise(what, dtype, x, M, K, c, grid, q, scale_inv, stream);
      });
  if (total < M && K > 0)  // columns past the segments (a worst-case sized buffer) are zero
    FLOWMOE_CUDA_CHECK(cudaMemset2DAsync(q + total, size_t(M), 0, size_t(M - total), size_t(K), stream));
}

void quantize_colwise_device_cuda(DType dtype, const void* x, int64_t M, int64_t K, const int32_t* counts,
                                  int64_t num_experts, uint8_t* q, float* scale_inv, cudaStream_t stream) {
  const char* what = "quantize_colwise_device_cuda";
  const int64_t max_blocks = fp8_colwise_device_check(what, M, K, counts, num_experts);
  dim3 grid = colwise_grid(what, K);
  if (K == 0 || max_blocks == 0) return;
  grid.x = unsigned(max_blocks);
  launch_quantize_colwise(what, dtype, x, M, K, CountSegments{counts, int(num_experts), M}, grid, q, scale_inv, stream);
}

void dequantize_colwise_cuda(DType out_dtype, const uint8_t* q, const float* scale_inv, int64_t M, int64_t K,
                             const int64_t* rows_per_segment, int64_t num_segments, void* y, cudaStream_t stream) {
  const char* what = "dequantize_colwise_cuda";
  check_sizes(what, M, K);
  size_t elem = 0;
  dispatch_cuda_float(out_dtype, what, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    elem = sizeof(T);
    auto* yt = static_cast<T*>(y);
    bool vec = K % kVec<T> == 0 && aligned_to(y, 16);
    dim3 grid = colwise_grid(what, K);
    for_each_colwise_chunk(what, M, K, rows_per_segment, num_segments, [&](const SegmentChunk& c, unsigned nb) {
      grid.x = nb;
      if (vec)
        dequantize_colwise_kernel<T, true><<<grid, kThreads, 0, stream>>>(q, scale_inv, M, K, c, yt);
      else
        dequantize_colwise_kernel<T, false><<<grid, kThreads, 0, stream>>>(q, scale_inv, M, K, c, yt);
      FLOWMOE_CUDA_CHECK_LAUNCH();
    });
  });
  int64_t total = colwise_total_rows(rows_per_segment, num_segments);
  if (total < M && K > 0)  // rows past the segments are zero
    FLOWMOE_CUDA_CHECK(
        cudaMemsetAsync(static_cast<char*>(y) + size_t(total * K) * elem, 0, size_t((M - total) * K) * elem, stream));
}

void quantize_block_cuda(DType dtype, const void* w, int64_t B, int64_t N, int64_t K, uint8_t* q, float* scale_inv,
                         uint8_t* q_t, float* scale_inv_t, cudaStream_t stream) {
  const char* what = "quantize_block_cuda";
  FLOWMOE_CHECK(B >= 0 && N >= 0 && K >= 0, ShapeError, what, ": bad shape [", B, ", ", N, ", ", K, "]");
  FLOWMOE_CHECK(B < 65536 && fp8_num_blocks(N) < 65536, ShapeError, what, ": [", B, ", ", N, ", ", K,
                "] has too many matrices or row blocks for one launch");
  FLOWMOE_CHECK(!q_t || scale_inv_t, Error, what, ": q_t given without scale_inv_t");
  if (B == 0 || N == 0 || K == 0) return;
  dim3 grid(unsigned(fp8_num_blocks(K)), unsigned(fp8_num_blocks(N)), unsigned(B));
  dispatch_cuda_float(dtype, what, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto* wt = static_cast<const T*>(w);
    if (K % kVec<T> == 0 && aligned_to(w, 16) && aligned_to(q, 16))
      quantize_block_kernel<T, true><<<grid, kThreads, 0, stream>>>(wt, N, K, q, scale_inv, q_t, scale_inv_t);
    else
      quantize_block_kernel<T, false><<<grid, kThreads, 0, stream>>>(wt, N, K, q, scale_inv, q_t, scale_inv_t);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void dequantize_block_cuda(DType out_dtype, const uint8_t* q, const float* scale_inv, int64_t B, int64_t N, int64_t K,
                           void* y, cudaStream_t stream) {
  const char* what = "dequantize_block_cuda";
  FLOWMOE_CHECK(B >= 0 && N >= 0 && K >= 0, ShapeError, what, ": bad shape [", B, ", ", N, ", ", K, "]");
  if (B == 0 || N == 0 || K == 0) return;
  dispatch_cuda_float(out_dtype, what, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    unsigned grid = rows_grid<T>(what, B * N, K);
    auto* yt = static_cast<T*>(y);
    if (K % kVec<T> == 0 && aligned_to(y, 16) && aligned_to(q, 16))
      dequantize_rows_kernel<T, true, true><<<grid, kThreads, 0, stream>>>(q, scale_inv, B * N, K, N, yt);
    else
      dequantize_rows_kernel<T, false, true><<<grid, kThreads, 0, stream>>>(q, scale_inv, B * N, K, N, yt);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
