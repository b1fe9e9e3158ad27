// The tensor-core pieces of the flash attention kernels (kernels/cuda/flash_attention.cu): bf16 tiles of
// HD = 64, 128 or 192 columns in shared memory, filled by cp.async, read by ldmatrix as the operands of
// mma.sync m16n8k16 (bf16 in, fp32 accumulate). Fragment layouts (PTX ISA; g = lane / 4, t = lane % 4):
//   A 16x16, row-major:  reg0 = A[g][2t, 2t+1]  reg1 = A[g+8][2t, 2t+1]  reg2 = A[g][2t+8, +9]  reg3 = A[g+8][2t+8, +9]
//   B 16x8 (k x n):      reg0 = B[2t, 2t+1][g]  reg1 = B[2t+8, 2t+9][g]
//   C 16x8, fp32:        c0, c1 = C[g][2t, 2t+1]  c2, c3 = C[g+8][2t, 2t+1]
// A register holds two bf16, the lower column (or k) in its low half. The C fragments of two adjacent
// n8 tiles are therefore exactly the A fragment of a 16x16 product operand (P·V, dS·K, Pᵀ·dO, dSᵀ·Q)
// once rounded to bf16: pack_a builds it without touching shared memory. The launchers' shared checks
// (make_flash_dims, check_flash_aligned) and the launchers' declarations close the file.
#pragma once
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "kernels/attention.h"
#include "kernels/common/cuda_check.h"
#include "kernels/cuda/launch.cuh"

namespace flowmoe::flash {

using Bf16 = __nv_bfloat16;

constexpr float kLog2e = 1.4426950408889634f;

// Row stride (elements) of a tile: HD + 8, i.e. 16 bytes of padding. Rows start 4 banks apart (272 or
// 144 bytes), so the 8 rows an ldmatrix phase reads (8 consecutive rows, same columns) and the 8 rows a
// C-fragment store writes cover the 32 banks once; rows stay 16-byte aligned for cp.async and ldmatrix.
template <int HD>
constexpr int kStride = HD + 8;

// head_dim is q's and k's head width, v_head_dim that of v, o, dO and dv (the same but for wide heads).
struct FlashDims {
  int batch, seq_len, num_heads, head_dim;
  float scale;  // 1 / sqrt(head_dim)
  int v_head_dim;
  __device__ __forceinline__ int64_t row_stride() const { return int64_t(num_heads) * head_dim; }
  // Element [b, 0, h, 0] of a [B, T, nh, hd] tensor: row t of the (b, h) slice is t * row_stride() further.
  __device__ __forceinline__ int64_t slice_offset(int b, int h) const {
    return (int64_t(b) * seq_len * num_heads + h) * head_dim;
  }
  // The same for the value-side tensors [B, T, nh, v_head_dim].
  __device__ __forceinline__ int64_t v_row_stride() const { return int64_t(num_heads) * v_head_dim; }
  __device__ __forceinline__ int64_t v_slice_offset(int b, int h) const {
    return (int64_t(b) * seq_len * num_heads + h) * v_head_dim;
  }
};

// The value side of a kernel instantiated for HD query/key and HDV value columns: with HD == HDV the launcher
// guarantees v_head_dim == head_dim, so those kernels keep the query side's strides and offsets.
template <int HD, int HDV>
struct ValueSide {
  int64_t stride, off;
  int head_dim;
  __device__ __forceinline__ ValueSide(const FlashDims& dims, int64_t qk_stride, int64_t qk_off, int b, int h)
      : stride(HD == HDV ? qk_stride : dims.v_row_stride()),
        off(HD == HDV ? qk_off : dims.v_slice_offset(b, h)),
        head_dim(HD == HDV ? dims.head_dim : dims.v_head_dim) {}
};

// ---- PTX wrappers ------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; with valid false nothing is read and the 16 bytes are zero-filled (src-size 0).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += A·B for one m16n8k16 tile.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c0 += A·B[:, 0..7] and c1 += A·B[:, 8..15]: one 16-column B fragment (b[0..1], b[2..3]) as two tiles.
__device__ __forceinline__ void mma_bf16_n16(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[4]) {
  mma_bf16(c0, a, b[0], b[1]);
  mma_bf16(c1, a, b[2], b[3]);
}

// 2^x, denormal results flushed to zero (probabilities that small vanish in any bf16 product anyway):
// exp2f would add a range check and two scalings around each MUFU.EX2. 2^-inf = +0.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two floats as bf16 (round to nearest even), lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return uint32_t(__bfloat16_as_ushort(v.x)) | (uint32_t(__bfloat16_as_ushort(v.y)) << 16);
}

// The A fragment of columns 16kk..16kk+15 of a 16-row fp32 tile held as C fragments c[j] (n8 tile j =
// columns 8j..8j+7): tiles 2kk and 2kk+1 give reg0/reg1 and reg2/reg3 (see the layouts above).
template <int N>
__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&c)[N][4], int kk) {
  a[0] = pack_bf16(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack_bf16(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack_bf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack_bf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// ---- shared-memory tiles -------------------------------------------------------------------------

// cp.async of rows t0..t0+ROWS-1 of one (batch, head) slice (row t at src + t * row_stride) into a
// [ROWS, HD] tile, by THREADS threads: thread i copies chunk i % (HD/8) of rows i / (HD/8) + pass·(rows per
// pass), so its addresses are one base plus uniform steps (few registers live across the main loops).
// Rows at or past seq_len and columns at or past head_dim (a multiple of 8, so a 16-byte chunk is all in
// or all out) are zero-filled: they add 0 to every product. HD = 192 (24 chunks a row, not a divisor of
// THREADS) takes chunk by chunk instead, each thread the chunks i, i + THREADS, ...
template <int ROWS, int HD, int THREADS>
__device__ __forceinline__ void load_tile(Bf16* tile /*[ROWS, kStride<HD>]*/, const Bf16* src, int64_t row_stride,
                                          int t0, int seq_len, int head_dim) {
  constexpr int kChunks = HD / 8;
  if constexpr (THREADS % kChunks != 0) {
    static_assert(ROWS * kChunks % THREADS == 0, "whole passes only");
#pragma unroll
    for (int pass = 0; pass < ROWS * kChunks / THREADS; ++pass) {
      const int i = pass * THREADS + int(threadIdx.x), r = i / kChunks, c = i % kChunks;
      const bool valid = c * 8 < head_dim && t0 + r < seq_len;
      cp_async16(smem_u32(tile + r * kStride<HD> + c * 8), valid ? src + int64_t(t0 + r) * row_stride + c * 8 : src,
                 valid);
    }
  } else {
    constexpr int kRowsPerPass = THREADS / kChunks;
    static_assert(ROWS % kRowsPerPass == 0, "whole passes only");
    const int r = int(threadIdx.x) / kChunks, c = int(threadIdx.x) % kChunks;
    const bool col_valid = c * 8 < head_dim;
    const Bf16* from = src + int64_t(t0 + r) * row_stride + c * 8;
    const uint32_t to = smem_u32(tile + r * kStride<HD> + c * 8);
#pragma unroll
    for (int pass = 0; pass < ROWS / kRowsPerPass; ++pass) {
      const bool valid = col_valid && t0 + r + pass * kRowsPerPass < seq_len;
      cp_async16(to + pass * kRowsPerPass * kStride<HD> * int(sizeof(Bf16)),
                 valid ? from + pass * kRowsPerPass * row_stride : src, valid);
    }
  }
}

// cp.async of src[t0 .. t0+N-1] (f32) into dst, zero past seq_len; 4-byte copies, as t0 + i is not
// 16-byte aligned in general.
template <int N, int THREADS>
__device__ __forceinline__ void load_row_values(float* dst /*[N]*/, const float* src, int t0, int seq_len) {
  for (int i = int(threadIdx.x); i < N; i += THREADS) {
    const bool valid = t0 + i < seq_len;
    cp_async4(smem_u32(dst + i), valid ? src + t0 + i : src, valid);
  }
}

// A fragment of rows m0..m0+15, columns k0..k0+15 of a row-major tile. Lane l points at row m0 + l % 16,
// column k0 + (l / 16) * 8, so the four 8x8 matrices are (rows 0-7, cols 0-7), (rows 8-15, cols 0-7),
// (rows 0-7, cols 8-15), (rows 8-15, cols 8-15): reg0..reg3 in that order.
template <int HD>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const Bf16* tile, int m0, int k0, int lane) {
  ldmatrix_x4(a, smem_u32(tile + (m0 + lane % 16) * kStride<HD> + k0 + (lane / 16) * 8));
}

// B fragments of two n8 tiles (n0..n0+7 in b[0], b[1]; n0+8..n0+15 in b[2], b[3]) for k0..k0+15, from a
// tile whose rows are n and columns k (K in Q·Kᵀ): ldmatrix gives lane (g, t) row g, columns 2t, 2t+1 of
// each 8x8 matrix, i.e. B[2t, 2t+1][g]. Lane l points at row n0 + l % 8 + (l / 16) * 8, column
// k0 + (l / 8) % 2 * 8: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
template <int HD>
__device__ __forceinline__ void load_b(uint32_t (&b)[4], const Bf16* tile, int n0, int k0, int lane) {
  ldmatrix_x4(b, smem_u32(tile + (n0 + lane % 8 + (lane / 16) * 8) * kStride<HD> + k0 + (lane / 8) % 2 * 8));
}

// The same two n8 tiles from a tile whose rows are k and columns n (V in P·V): .trans gives lane (g, t)
// elements [2t][g] and [2t+1][g] of each 8x8 matrix, i.e. B[2t, 2t+1][g]. Lane l points at row
// k0 + l % 8 + (l / 8) % 2 * 8, column n0 + (l / 16) * 8: matrices (k 0-7, n 0-7), (k 8-15, n 0-7),
// (k 0-7, n 8-15), (k 8-15, n 8-15).
template <int HD>
__device__ __forceinline__ void load_b_trans(uint32_t (&b)[4], const Bf16* tile, int k0, int n0, int lane) {
  ldmatrix_x4_trans(b, smem_u32(tile + (k0 + lane % 8 + (lane / 8) % 2 * 8) * kStride<HD> + n0 + (lane / 16) * 8));
}

// acc[j] += A·B[:, 8j..8j+7] for all HD/8 n8 tiles, B read from a [k, n] tile (V, dO, Q, K), rows
// k0..k0+15: the second product of every kernel (P·V, dS·K, Pᵀ·dO, dSᵀ·Q).
template <int HD>
__device__ __forceinline__ void mma_rows_trans(float (&acc)[HD / 8][4], const uint32_t (&a)[4], const Bf16* tile,
                                               int k0, int lane) {
#pragma unroll
  for (int dd = 0; dd < HD / 16; ++dd) {
    uint32_t b[4];
    load_b_trans<HD>(b, tile, k0, 16 * dd, lane);
    mma_bf16_n16(acc[2 * dd], acc[2 * dd + 1], a, b);
  }
}

// Two products of the warp's 16 rows at once: c1[j] = A1·B1[8j..8j+7]ᵀ over HD1 and c2[j] = A2·B2[..]ᵀ over
// HD2 for the N columns of two [n, k] tiles (rows of the A tiles from m0). The backward's first step: S and
// dP (query tile) or Sᵀ and dPᵀ (key tile) share their loop over k; with wide heads (HD1 = 192, HD2 = 128)
// the last k steps are the first product's alone.
template <int HD1, int HD2, int N>
__device__ __forceinline__ void mma_two_nt(float (&c1)[N / 8][4], float (&c2)[N / 8][4], const Bf16* a1, const Bf16* a2,
                                           int m0, const Bf16* b1, const Bf16* b2, int lane) {
  static_assert(HD1 >= HD2, "the first product is the wider");
#pragma unroll
  for (int kk = 0; kk < HD1 / 16; ++kk) {
    const bool second = 16 * kk < HD2;  // a constant once unrolled
    uint32_t x1[4], x2[4];
    load_a<HD1>(x1, a1, m0, 16 * kk, lane);
    if (second) load_a<HD2>(x2, a2, m0, 16 * kk, lane);
#pragma unroll
    for (int jj = 0; jj < N / 16; ++jj) {
      uint32_t y1[4], y2[4];
      load_b<HD1>(y1, b1, 16 * jj, 16 * kk, lane);
      if (second) load_b<HD2>(y2, b2, 16 * jj, 16 * kk, lane);
      mma_bf16_n16(c1[2 * jj], c1[2 * jj + 1], x1, y1);
      if (second) mma_bf16_n16(c2[2 * jj], c2[2 * jj + 1], x2, y2);
    }
  }
}

// Writes 16 rows of a warp's fp32 accumulator (acc[j]: rows g, g+8 of columns 8j + 2t, +1) as bf16 into
// rows m0..m0+15 of a tile of row stride STRIDE, row g scaled by scale_lo and row g+8 by scale_hi. The caller
// makes sure no other warp reads those rows (a narrower accumulator staged in a wider tile keeps that tile's
// stride, so that it stays within the warp's own rows).
template <int HD, int STRIDE = kStride<HD>>
__device__ __forceinline__ void stage_rows(Bf16* tile, int m0, const float (&acc)[HD / 8][4], float scale_lo,
                                           float scale_hi, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < HD / 8; ++j) {
    *reinterpret_cast<uint32_t*>(tile + (m0 + g) * STRIDE + 8 * j + 2 * t) =
        pack_bf16(acc[j][0] * scale_lo, acc[j][1] * scale_lo);
    *reinterpret_cast<uint32_t*>(tile + (m0 + g + 8) * STRIDE + 8 * j + 2 * t) =
        pack_bf16(acc[j][2] * scale_hi, acc[j][3] * scale_hi);
  }
}

// One warp copies tile rows m0..m0+ROWS-1 (row stride STRIDE) to rows t0 + m0.. of a (batch, head) slice (row
// t at dst + t * row_stride) with 16-byte stores, skipping rows at or past seq_len and columns at or past
// head_dim.
template <int ROWS, int HD, int STRIDE = kStride<HD>>
__device__ __forceinline__ void store_rows(Bf16* dst, int64_t row_stride, const Bf16* tile, int m0, int t0, int seq_len,
                                           int head_dim, int lane) {
  constexpr int kChunks = HD / 8;
  static_assert(ROWS * kChunks % 32 == 0, "whole warp passes only");
#pragma unroll
  for (int it = 0; it < ROWS * kChunks / 32; ++it) {
    const int i = it * 32 + lane, r = m0 + i / kChunks, c = i % kChunks, t = t0 + r;
    if (t < seq_len && c * 8 < head_dim)
      *reinterpret_cast<uint4*>(dst + int64_t(t) * row_stride + c * 8) =
          *reinterpret_cast<const uint4*>(tile + r * STRIDE + c * 8);
  }
}

// ---- launch helpers (host) ---------------------------------------------------------------------

// Checks dtype and sizes; false when there is nothing to compute.
inline bool make_flash_dims(FlashDims& dims, DType dtype, int64_t batch, int64_t seq_len, int64_t num_heads,
                            int64_t head_dim, int64_t v_head_dim, const char* what) {
  FLOWMOE_CHECK(dtype == DType::bf16, DTypeError, what, " supports bf16, got ", dtype_name(dtype));
  FLOWMOE_CHECK(batch >= 0 && seq_len >= 0 && num_heads >= 0 && head_dim >= 0 && v_head_dim >= 0, ShapeError, what,
                ": negative size [", batch, ", ", seq_len, ", ", num_heads, ", ", head_dim, "], v_head_dim ",
                v_head_dim);
  FLOWMOE_CHECK(head_dim % 8 == 0 && ((head_dim <= kAttentionMaxHeadDimCuda && v_head_dim == head_dim) ||
                                      attention_wide_head_cuda(head_dim, v_head_dim)),
                ShapeError, what, ": head_dim ", head_dim, " with v_head_dim ", v_head_dim,
                " is not a shape the kernels take (multiples of 8; v_head_dim = head_dim <= ", kAttentionMaxHeadDimCuda,
                ", or head_dim <= ", kAttentionMaxWideHeadDimCuda, " with v_head_dim <= ", kAttentionMaxHeadDimCuda,
                ")");
  if (batch * seq_len * num_heads * head_dim == 0) return false;
  const int64_t num_tiles = (seq_len + 63) / 64;  // the smallest tiles (64 rows) make the largest grid
  FLOWMOE_CHECK(batch * num_heads * num_tiles < (int64_t(1) << 31) && seq_len < (int64_t(1) << 30), ShapeError, what,
                ": too large [", batch, ", ", seq_len, ", ", num_heads, ", ", head_dim, "]");
  dims =
      FlashDims{int(batch),     int(seq_len), int(num_heads), int(head_dim), float(1.0 / std::sqrt(double(head_dim))),
                int(v_head_dim)};
  return true;
}

// cp.async and the 16-byte stores move whole 16-byte chunks of every row.
inline void check_flash_aligned(std::initializer_list<const void*> ptrs, const char* what) {
  for (const void* p : ptrs)
    FLOWMOE_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, Error, what, ": pointer ", p, " is not 16-byte aligned");
}

// Calls f(std::integral_constant<int, HD>, std::integral_constant<int, HDV>) with the tile widths of the
// checked dims: one width, head_dim rounded up to 64 or 128, or the wide heads' 192 and 128.
template <class F>
void dispatch_flash_head_dim(const FlashDims& dims, F&& f) {
  if (dims.head_dim > kAttentionMaxHeadDimCuda)
    f(std::integral_constant<int, 192>(), std::integral_constant<int, 128>());
  else if (dims.head_dim <= 64)
    f(std::integral_constant<int, 64>(), std::integral_constant<int, 64>());
  else
    f(std::integral_constant<int, 128>(), std::integral_constant<int, 128>());
}

}  // namespace flowmoe::flash

namespace flowmoe {
// The flash family's launchers (kernels/cuda/flash_attention.cu, flash_attention_backward.cu), with the
// arguments of attention_forward_cuda / attention_backward_cuda; kernels/cuda/attention.cu picks them.
void attention_forward_flash_cuda(DType dtype, void* out, float* lse, const void* q, const void* k, const void* v,
                                  int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim,
                                  int64_t v_head_dim, cudaStream_t stream);
void attention_backward_flash_cuda(DType dtype, void* d_q, void* d_k, void* d_v, float* delta, const void* d_out,
                                   const void* q, const void* k, const void* v, const void* out, const float* lse,
                                   int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim,
                                   int64_t v_head_dim, cudaStream_t stream);
}  // namespace flowmoe
