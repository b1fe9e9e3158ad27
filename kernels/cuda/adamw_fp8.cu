// AdamW with the FP8 block copy written in the same kernel (kernels/adamw_fp8.h): one CTA per 128x128 block of a
// weight [B, N, K], many weights per launch (a table of up to kFp8TensorsPerLaunch in the kernel's parameters, as
// kernels/cuda/adamw.cu batches its tensors; one launch per moment and copy dtype, template parameters).
//   update:    warp w takes block rows w, w + 8, ...; lane l the 4 columns 4l..4l+3, so a warp reads a whole 128-wide
//              row in one 16-byte access per buffer (a scalar access per element where K is not a multiple of 4 or
//              a buffer is not aligned for it). The loads of kBatchRows rows go out before any store. The values
//              as the forward reads them go to a 64 KiB f32 tile in shared memory, not registers, so a thread
//              holds only its batch: 3 CTAs of 256 threads fit an SM (80 registers each, no spills).
//   quantize:  the CTA reduces the amax (NaN-propagating); each thread quantizes its values from the tile and
//              writes them to q, 4 bytes at a time, and to a byte tile (over the f32 one), which
//              store_block_transpose writes to q_t, 4 consecutive bytes of one q_t row per thread (a warp: 128).
// The element update is kernels/adamw.h's adamw_element and the quantize is quantize_block_kernel's (x * scale, a
// power of two, converted by cvt.rn.satfinite.e4m3), so the CPU reference kernels/cpu/adamw_fp8.cpp agrees bit
// for bit, whichever path an element takes. Tests: tests/test_adamw_fp8.cpp.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <climits>
#include <vector>

#include "kernels/adamw_fp8.h"
#include "kernels/common/cuda_check.h"
#include "kernels/cuda/adamw_common.cuh"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/fp8.h"

namespace flowmoe {

namespace {

constexpr int kBlk = kFp8BlockSize;  // 128
constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kVec = 4;                      // columns per lane: 32 lanes x 4 = a block row
constexpr int kRowsPerWarp = kBlk / kWarps;  // 16: warp w takes rows w, w + 8, ...
constexpr int kBatchRows = 2;                // rows whose loads are in flight together, per thread
constexpr int kBytePitch = kBlk + 4;         // the byte tile's row: 4-byte aligned, and column reads spread
constexpr size_t kTileBytes = sizeof(float) * kBlk * kBlk;  // the f32 tile; the byte tile lies over its start
static_assert(kBlk * kBytePitch <= int(kTileBytes) && kRowsPerWarp % kBatchRows == 0, "tile layout");

// Weights a launch takes (their table travels as the kernel's parameters, within 4 KiB).
constexpr int kFp8TensorsPerLaunch = 16;
using Fp8LaunchTable = LaunchTable<AdamWFp8Tensor, kFp8TensorsPerLaunch>;
static_assert(sizeof(Fp8LaunchTable) <= 4096, "a launch's table must fit the kernel parameters");

// The weights' copy an update writes (a kernel's template parameter: the branch is the launch's, not an element's).
enum class CopyKind { none, f32, bf16 };

// Four consecutive values at p (aligned to 4 elements) as f32, and back: the stores spelled as one access each
// (__stwb, the default write-back store), which nvcc otherwise splits here into 4-byte ones.
__device__ __forceinline__ void load4(const float* p, float (&x)[kVec]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
}
__device__ __forceinline__ void load4(const uint16_t* p, float (&x)[kVec]) {
  const uint2 a = *reinterpret_cast<const uint2*>(p);
  x[0] = bits_to_float(a.x << 16), x[1] = bits_to_float(a.x & 0xFFFF0000u);
  x[2] = bits_to_float(a.y << 16), x[3] = bits_to_float(a.y & 0xFFFF0000u);
}
__device__ __forceinline__ void store4(float* p, const float (&x)[kVec]) {
  __stwb(reinterpret_cast<float4*>(p), make_float4(x[0], x[1], x[2], x[3]));
}
__device__ __forceinline__ void store4(uint16_t* p, const uint16_t (&b)[kVec]) {
  __stwb(reinterpret_cast<uint2*>(p), make_uint2(b[0] | uint32_t(b[1]) << 16, b[2] | uint32_t(b[3]) << 16));
}

// One lane's 4 elements of a block row: loaded, then updated and stored.
struct Chunk {
  float w[kVec], m[kVec], v[kVec], g[kVec];
};

// One thread's part of the block a CTA updates: chunk p (row warp + kWarps p of the block, 4 columns) starts at
// element at + p * row_step of t's buffers, at + p * row_step + first of the whole tensor (bf16 moments' rounding
// index). Counted in the block, not the weight, so the bounds checks are 32-bit.
template <class M>
struct ThreadChunks {
  float* __restrict__ param;
  const float* __restrict__ grad;
  M* __restrict__ exp_avg;
  M* __restrict__ exp_avg_sq;
  void* __restrict__ copy;
  int64_t at, row_step, first;
  uint64_t stream;  // bf16 moments' rounding stream
  int block_rows;   // rows of the block inside the weight
  int num_cols;     // this lane's columns inside the weight: 0 to kVec
};

// kVector: the chunk's 4 elements in one access per buffer (K a multiple of 4, buffers aligned); else one at a
// time. Nothing where the chunk is outside the weight.
template <bool kVector, class M>
__device__ __forceinline__ void load_chunk(const ThreadChunks<M>& a, int row, int p, Chunk& c) {
  if (row >= a.block_rows || a.num_cols == 0) return;
  const int64_t at = a.at + p * a.row_step;
  if constexpr (kVector) {
    load4(a.param + at, c.w);
    load4(a.exp_avg + at, c.m);
    load4(a.exp_avg_sq + at, c.v);
    load4(a.grad + at, c.g);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      if (j < a.num_cols) {
        c.w[j] = a.param[at + j];
        c.m[j] = load_moment(a.exp_avg, at + j);
        c.v[j] = load_moment(a.exp_avg_sq, at + j);
        c.g[j] = a.grad[at + j];
      }
  }
}

// The chunk's update stored, and its values as the forward reads them (0 outside the weight) in x.
template <bool kVector, CopyKind C, class M>
__device__ __forceinline__ void update_chunk(const ThreadChunks<M>& a, const AdamWStep& s, int row, int p, Chunk& c,
                                             float (&x)[kVec]) {
  constexpr bool kNarrow = sizeof(M) == 2;
#pragma unroll
  for (int j = 0; j < kVec; ++j) x[j] = 0.f;
  if (row >= a.block_rows || a.num_cols == 0) return;
  const int64_t at = a.at + p * a.row_step;
  const int num = kVector ? kVec : a.num_cols;
  uint16_t mb[kVec] = {}, vb[kVec] = {}, cb[kVec] = {};
#pragma unroll
  for (int j = 0; j < kVec; ++j)
    if (j < num) {
      adamw_element(c.w[j], c.m[j], c.v[j], c.g[j], s);
      if constexpr (kNarrow) round_moments_bf16(c.m[j], c.v[j], a.stream, a.first + at + j, &mb[j], &vb[j]);
      x[j] = c.w[j];
      if constexpr (C == CopyKind::bf16) {
        cb[j] = bf16_bits_rn(c.w[j]);
        x[j] = bf16_bits_value(cb[j]);  // the forward reads the bf16 copy
      }
    }
  if constexpr (kVector) {
    store4(a.param + at, c.w);
    if constexpr (kNarrow) {
      store4(a.exp_avg + at, mb);
      store4(a.exp_avg_sq + at, vb);
    } else {
      store4(a.exp_avg + at, c.m);
      store4(a.exp_avg_sq + at, c.v);
    }
    if constexpr (C == CopyKind::f32) store4(static_cast<float*>(a.copy) + at, c.w);
    if constexpr (C == CopyKind::bf16) store4(static_cast<uint16_t*>(a.copy) + at, cb);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      if (j < num) {
        a.param[at + j] = c.w[j];
        if constexpr (kNarrow) {
          a.exp_avg[at + j] = mb[j];
          a.exp_avg_sq[at + j] = vb[j];
        } else {
          a.exp_avg[at + j] = c.m[j];
          a.exp_avg_sq[at + j] = c.v[j];
        }
        if constexpr (C == CopyKind::f32) static_cast<float*>(a.copy)[at + j] = c.w[j];
        if constexpr (C == CopyKind::bf16) static_cast<uint16_t*>(a.copy)[at + j] = cb[j];
      }
  }
}

// This thread's rows of the block updated (kBatchRows at a time, their loads first), their values stored to the
// f32 tile, and their amax.
template <bool kVector, CopyKind C, class M>
__device__ __forceinline__ float update_rows(const ThreadChunks<M>& a, const AdamWStep& s, float (*vals)[kBlk],
                                             int warp, int col) {
  float amax = 0.f;
#pragma unroll 1
  for (int p0 = 0; p0 < kRowsPerWarp; p0 += kBatchRows) {
    Chunk c[kBatchRows];
#pragma unroll
    for (int pp = 0; pp < kBatchRows; ++pp) load_chunk<kVector>(a, warp + kWarps * (p0 + pp), p0 + pp, c[pp]);
#pragma unroll
    for (int pp = 0; pp < kBatchRows; ++pp) {
      const int row = warp + kWarps * (p0 + pp);
      float x[kVec];
      update_chunk<kVector, C>(a, s, row, p0 + pp, c[pp], x);
#pragma unroll
      for (int j = 0; j < kVec; ++j) amax = fp8_amax_update(amax, x[j]);
      *reinterpret_cast<float4*>(&vals[row][col]) = make_float4(x[0], x[1], x[2], x[3]);
    }
  }
  return amax;
}

// The block's bytes (tile: [n][k], pitch kBytePitch) to q_t [B, K, N]: q_t row k0 + kk holds the block's column kk;
// a thread writes 4 consecutive bytes of one such row (in one 4-byte store where N is a multiple of 4 and q_t
// aligned), a warp 128.
__device__ __forceinline__ void store_block_transpose(const uint8_t* tile, const Fp8BlockCopy& c, int64_t base,
                                                      int64_t n0, int64_t k0) {
  const bool wide = c.N % 4 == 0 && aligned_to(c.q_t, 4);
  for (int e = int(threadIdx.x); e < kBlk * kBlk / 4; e += int(blockDim.x)) {
    const int kk = e / (kBlk / 4), nn = 4 * (e % (kBlk / 4));
    if (k0 + kk >= c.K || n0 + nn >= c.N) continue;
    const uint8_t* col = tile + nn * kBytePitch + kk;
    uint8_t* out = c.q_t + base + (k0 + kk) * c.N + n0 + nn;
    if (wide) {
      *reinterpret_cast<uint32_t*>(out) = uint32_t(col[0]) | uint32_t(col[kBytePitch]) << 8 |
                                          uint32_t(col[2 * kBytePitch]) << 16 | uint32_t(col[3 * kBytePitch]) << 24;
    } else {
      for (int j = 0; j < 4 && n0 + nn + j < c.N; ++j) out[j] = col[j * kBytePitch];
    }
  }
}

// M: the moments' type (float, or uint16_t: bf16 bits); C: the copy every weight of the launch writes. Block b of
// weight t's run of blocks is block row first / (128 K) + b / nbk (r = matrix * nbn + bn; a range's first block row:
// kernels/adamw_fp8.h, its buffers in t starting at element first = t.rounding.first_index), column block b % nbk.
template <class M, CopyKind C>
__global__ void __launch_bounds__(kThreads, 3)
    adamw_fp8_kernel(const __grid_constant__ Fp8LaunchTable table, const StepScalars* __restrict__ control) {
  if (control && !control->apply) return;  // a skipped step: nothing moves, the copy stays the weights'
  extern __shared__ float4 smem[];
  __shared__ float warp_amaxes[kWarps];
  float(*vals)[kBlk] = reinterpret_cast<float(*)[kBlk]>(smem);  // [row][column]
  uint8_t* bytes = reinterpret_cast<uint8_t*>(smem);            // [row][column], pitch kBytePitch
  int first_block = 0, num_blocks = 0;
  const AdamWFp8Tensor& w = table.items[find_item(table, &first_block, &num_blocks)];
  const AdamWTensor& t = w.t;
  const Fp8BlockCopy& c = w.fp8;
  const AdamWStep s = control ? scheduled_adamw_step(t.step, *control, t.lr_multiplier) : t.step;
  const int64_t N = c.N, K = c.K, nbn = fp8_num_blocks(N), nbk = fp8_num_blocks(K), first = t.rounding.first_index;
  const int64_t block = int(blockIdx.x) - first_block, r = first / (kBlk * K) + block / nbk, bk = block % nbk;
  const int64_t bn = r % nbn, b = r / nbn, n0 = bn * kBlk, k0 = bk * kBlk, base = b * N * K;
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31, col = kVec * lane;
  M* exp_avg = static_cast<M*>(t.exp_avg);
  M* exp_avg_sq = static_cast<M*>(t.exp_avg_sq);
  const ThreadChunks<M> at{t.param,
                           t.grad,
                           exp_avg,
                           exp_avg_sq,
                           t.copy.data,
                           base + (n0 + warp) * K + k0 + col - first,
                           kWarps * K,
                           first,
                           sizeof(M) == 2 ? rounding_stream(t.rounding.key, s.update) : 0,
                           int(min(N - n0, int64_t(kBlk))),
                           int(max(int64_t(0), min(K - k0 - col, int64_t(kVec))))};
  // Element (n, k) of the weight is at base + n K + k - first in t's buffers: with K and first multiples of 4,
  // every chunk starts 4-element aligned where the buffers do.
  const bool vector = K % kVec == 0 && first % kVec == 0 && aligned_to(t.param, 16) && aligned_to(t.grad, 16) &&
                      aligned_to(exp_avg, kVec * sizeof(M)) && aligned_to(exp_avg_sq, kVec * sizeof(M)) &&
                      (C == CopyKind::none || aligned_to(t.copy.data, kVec * (C == CopyKind::f32 ? 4 : 2)));
  float amax = vector ? update_rows<true, C>(at, s, vals, warp, col) : update_rows<false, C>(at, s, vals, warp, col);

  for (int o = 16; o > 0; o >>= 1) amax = fp8_amax_update(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (lane == 0) warp_amaxes[warp] = amax;
  __syncthreads();
  amax = 0.f;
  for (int i = 0; i < kWarps; ++i) amax = fp8_amax_update(amax, warp_amaxes[i]);
  const float s_inv = fp8_scale_inv(amax), scale = fp8_scale_from_inv(s_inv);
  if (threadIdx.x == 0) {
    c.scale_inv[(b * nbn + bn) * nbk + bk] = s_inv;
    if (c.scale_inv_t) c.scale_inv_t[(b * nbk + bk) * nbn + bn] = s_inv;
  }
  // Each thread quantizes the values it stored; q takes them 4 bytes at a time where K is a multiple of 4.
  const bool wide_q = K % kVec == 0 && aligned_to(c.q, 4);
  uint32_t quads[kRowsPerWarp];
#pragma unroll
  for (int p = 0; p < kRowsPerWarp; ++p) {
    const int row = warp + kWarps * p;
    const float4 x4 = *reinterpret_cast<const float4*>(&vals[row][col]);
    const float x[kVec] = {x4.x, x4.y, x4.z, x4.w};
    quads[p] = 0;
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      quads[p] |= uint32_t(uint8_t(__nv_cvt_float_to_fp8(__fmul_rn(x[j], scale), __NV_SATFINITE, __NV_E4M3)))
                  << (8 * j);
    const int64_t n = n0 + row, k = k0 + col;
    if (n >= N || k >= K) continue;
    uint8_t* out = c.q + base + n * K + k;
    if (wide_q) {
      *reinterpret_cast<uint32_t*>(out) = quads[p];
    } else {
      for (int j = 0; j < kVec && k + j < K; ++j) out[j] = uint8_t(quads[p] >> (8 * j));
    }
  }
  if (!c.q_t) return;  // a range: the transpose is rebuilt once the copy is whole (fp8_block_transpose_cuda)
  __syncthreads();     // every value read: the byte tile lies over them
#pragma unroll
  for (int p = 0; p < kRowsPerWarp; ++p)
    *reinterpret_cast<uint32_t*>(&bytes[(warp + kWarps * p) * kBytePitch + col]) = quads[p];
  __syncthreads();
  store_block_transpose(bytes, c, base, n0, k0);
}

// One CTA per 128x128 block (grid: nbk, nbn, B): the block's bytes read into a tile (4 at a time where K is a
// multiple of 4), then written as adamw_fp8_kernel writes its transpose; thread 0 moves the block's scale.
__global__ void fp8_block_transpose_kernel(const __grid_constant__ Fp8BlockCopy c) {
  __shared__ __align__(4) uint8_t tile[kBlk * kBytePitch];
  const int64_t N = c.N, K = c.K, nbn = fp8_num_blocks(N), nbk = fp8_num_blocks(K);
  const int64_t bk = blockIdx.x, bn = blockIdx.y, b = blockIdx.z, n0 = bn * kBlk, k0 = bk * kBlk, base = b * N * K;
  if (threadIdx.x == 0) c.scale_inv_t[(b * nbk + bk) * nbn + bn] = c.scale_inv[(b * nbn + bn) * nbk + bk];
  const bool wide = K % 4 == 0 && aligned_to(c.q, 4);
  for (int e = int(threadIdx.x); e < kBlk * kBlk / 4; e += kThreads) {
    const int nn = e / (kBlk / 4), kk = 4 * (e % (kBlk / 4));
    if (n0 + nn >= N || k0 + kk >= K) continue;
    const uint8_t* in = c.q + base + (n0 + nn) * K + k0 + kk;
    uint8_t* row = tile + nn * kBytePitch + kk;
    if (wide) {
      *reinterpret_cast<uint32_t*>(row) = *reinterpret_cast<const uint32_t*>(in);
    } else {
      for (int j = 0; j < 4 && k0 + kk + j < K; ++j) row[j] = in[j];
    }
  }
  __syncthreads();
  store_block_transpose(tile, c, base, n0, k0);
}

// The CTAs of one weight's update: a 128x128 block each, over the range's block rows (a whole tensor: all).
int64_t update_blocks(const AdamWFp8Tensor& w) {
  if (w.t.n == 0) return 0;
  const bool whole = w.t.n == w.fp8.B * w.fp8.N * w.fp8.K;
  const int64_t rows = whole ? w.fp8.B * fp8_num_blocks(w.fp8.N) : w.t.n / (kBlk * w.fp8.K);
  return rows * fp8_num_blocks(w.fp8.K);
}

// The weights of `tensors` whose moments are M and whose copy is C, kFp8TensorsPerLaunch per launch.
template <class M, CopyKind C>
void launch_group(const AdamWFp8Tensor* tensors, const std::vector<int64_t>& group, const StepScalars* control,
                  cudaStream_t stream) {
  if (group.empty()) return;
  allow_smem(adamw_fp8_kernel<M, C>, kTileBytes, true);  // 3 CTAs per SM: the largest shared-memory split
  Fp8LaunchTable table{};
  int64_t num_blocks = 0;
  const auto launch = [&] {
    if (table.num_items == 0) return;
    adamw_fp8_kernel<M, C><<<unsigned(num_blocks), kThreads, kTileBytes, stream>>>(table, control);
    FLOWMOE_CUDA_CHECK_LAUNCH();
    table.num_items = 0;
    num_blocks = 0;
  };
  for (int64_t i : group) {
    if (num_blocks + update_blocks(tensors[i]) > INT_MAX) launch();
    num_blocks += update_blocks(tensors[i]);
    table.items[table.num_items] = tensors[i];
    table.block_end[table.num_items++] = int(num_blocks);
    if (table.num_items == kFp8TensorsPerLaunch) launch();
  }
  launch();
}

CopyKind copy_kind(const WeightCopy& copy) {
  if (!copy.data) return CopyKind::none;
  return copy.dtype == DType::bf16 ? CopyKind::bf16 : CopyKind::f32;
}

template <class M>
void launch_groups(const AdamWFp8Tensor* tensors, int64_t num_tensors, DType moment_dtype, const StepScalars* control,
                   cudaStream_t stream) {
  std::vector<int64_t> groups[3];  // by CopyKind
  for (int64_t i = 0; i < num_tensors; ++i)
    if (tensors[i].t.moment_dtype == moment_dtype && tensors[i].t.n > 0)
      groups[int(copy_kind(tensors[i].t.copy))].push_back(i);
  launch_group<M, CopyKind::none>(tensors, groups[int(CopyKind::none)], control, stream);
  launch_group<M, CopyKind::f32>(tensors, groups[int(CopyKind::f32)], control, stream);
  launch_group<M, CopyKind::bf16>(tensors, groups[int(CopyKind::bf16)], control, stream);
}

}  // namespace

void fp8_block_transpose_cuda(const Fp8BlockCopy& c, cudaStream_t stream) {
  FLOWMOE_CHECK(c.B < 65536 && fp8_num_blocks(c.N) < 65536, ShapeError, "fp8_block_transpose_cuda: [", c.B, ", ", c.N,
                ", ", c.K, "] has too many matrices or row blocks for one launch");
  if (c.B * c.N * c.K == 0) return;
  const dim3 grid(unsigned(fp8_num_blocks(c.K)), unsigned(fp8_num_blocks(c.N)), unsigned(c.B));
  fp8_block_transpose_kernel<<<grid, kThreads, 0, stream>>>(c);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void adamw_fp8_cuda(const AdamWFp8Tensor* tensors, int64_t num_tensors, const StepScalars* control,
                    cudaStream_t stream) {
  const char* what = "adamw_fp8_cuda";
  check_adamw_fp8(tensors, num_tensors, what);
  for (int64_t i = 0; i < num_tensors; ++i) {
    const Fp8BlockCopy& c = tensors[i].fp8;
    FLOWMOE_CHECK(update_blocks(tensors[i]) <= INT_MAX, ShapeError, what, ": tensor ", i, " [", c.B, ", ", c.N, ", ",
                  c.K, "] has too many blocks for one launch");
  }
  launch_groups<float>(tensors, num_tensors, DType::f32, control, stream);
  launch_groups<uint16_t>(tensors, num_tensors, DType::bf16, control, stream);
}

}  // namespace flowmoe
