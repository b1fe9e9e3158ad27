// Causal attention forward on bf16 with tensor cores, FlashAttention-2 style (math in kernels/attention.h).
// One CTA (4 warps x 32 query rows, so every K/V fragment feeds two m16 tiles) per (batch, head, 128-query
// tile) walks the 64-key tiles up to the diagonal, double-buffered by cp.async, 32 keys per online-softmax
// step: S = Q·Kᵀ, m and l in registers with exp2 of scores pre-scaled by log2(e)/sqrt(hd), O += P·V with P
// rounded to bf16. Writes o and lse = m/sqrt(hd) + log(l), the natural-log normaliser the backward reads.
// q, k, v, o [B, T, nh, hd] bf16, hd % 8 == 0, hd <= 128, zero-padded to HD = 64 or 128 in shared memory; or
// wide heads (kernels/attention.h): q, k of hd <= 192 in HD = 192 columns, v, o of v_hd <= 128 in HDV = 128, and
// 32-key K/V tiles, which keep two CTAs' shared memory within an SM's (92 KB each; 64-key tiles would take 134).
// Only keys past a warp's first row are masked; key tiles past the diagonal are never loaded.
// Backward: flash_attention_backward.cu; tiles, fragments: flash_attention.cuh. CPU reference:
// kernels/cpu/attention.cpp; GPU reference: the fp32 kernels of attention.cu. Tests: tests/test_flash_attention.cpp.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "kernels/attention.h"
#include "kernels/common/cuda_check.h"
#include "kernels/cuda/flash_attention.cuh"

namespace flowmoe {

namespace {

using namespace flash;

constexpr int kFwdRows = 128;     // queries per CTA: 4 warps x 2 m16 tiles
constexpr int kFwdSubKeys = 32;   // keys per online-softmax step
constexpr int kFwdThreads = 128;  // 4 warps

// Keys per K/V tile (one cp.async group, one barrier pair): 64, or 32 for wide heads (the file's comment).
template <int HD>
constexpr int kFwdTileKeys = HD > 128 ? 32 : 64;

// Q, 2 x (K, V)
template <int HD, int HDV>
constexpr size_t kFwdSmem = sizeof(Bf16) * (size_t(kFwdRows + 2 * kFwdTileKeys<HD>) * kStride<HD> +
                                            size_t(2 * kFwdTileKeys<HD>) * kStride<HDV>);

// acc[i][2n], acc[i][2n + 1] += a[i]·B_n for the warp's two m16 row groups i and each 16-column block n of
// B (N8 / 2 of them), the fragment B_n from load_b_frag(b, n): loaded once, it feeds both row groups.
template <int N8, class LoadB>
__device__ __forceinline__ void mma_both_row_groups(float (&acc)[2][N8][4], const uint32_t (&a)[2][4],
                                                    LoadB&& load_b_frag) {
#pragma unroll
  for (int n = 0; n < N8 / 2; ++n) {
    uint32_t b[4];
    load_b_frag(b, n);
#pragma unroll
    for (int i = 0; i < 2; ++i) mma_bf16_n16(acc[i][2 * n], acc[i][2 * n + 1], a[i], b);
  }
}

template <int HD, int HDV>
__global__ void __launch_bounds__(kFwdThreads, 2)
    flash_forward_kernel(Bf16* __restrict__ out /*[B, T, nh, v_hd]*/, float* __restrict__ lse /*[B, nh, T]*/,
                         const Bf16* __restrict__ q /*[B, T, nh, hd]*/, const Bf16* __restrict__ k /*[same]*/,
                         const Bf16* __restrict__ v /*[B, T, nh, v_hd]*/, FlashDims dims) {
  constexpr int S = kStride<HD>, SV = kStride<HDV>, kFwdKeys = kFwdTileKeys<HD>;
  extern __shared__ __align__(16) unsigned char smem[];
  Bf16* q_s = reinterpret_cast<Bf16*>(smem);  // [128, S]
  Bf16* k_s = q_s + kFwdRows * S;             // [2][kFwdKeys, S]
  Bf16* v_s = k_s + 2 * kFwdKeys * S;         // [2][kFwdKeys, SV]
  const int num_bh = dims.batch * dims.num_heads, num_q_tiles = (dims.seq_len + kFwdRows - 1) / kFwdRows;
  const int q_tile = num_q_tiles - 1 - int(blockIdx.x) / num_bh;  // tiles with the most keys start first
  const int bh = int(blockIdx.x) % num_bh, b = bh / dims.num_heads, h = bh % dims.num_heads;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int q0 = q_tile * kFwdRows, row0 = 32 * warp;  // the warp's rows: q0 + row0 + 16i + {g, g+8}, i = 0, 1
  const int64_t stride = dims.row_stride(), off = dims.slice_offset(b, h);
  const ValueSide<HD, HDV> vs(dims, stride, off, b, h);
  // Key tiles up to the diagonal, and none wholly past the end of the sequence.
  const int num_k_tiles = min((q0 + kFwdRows + kFwdKeys - 1) / kFwdKeys, (dims.seq_len + kFwdKeys - 1) / kFwdKeys);
  const float scale_log2 = dims.scale * kLog2e;

  load_tile<kFwdRows, HD, kFwdThreads>(q_s, q + off, stride, q0, dims.seq_len, dims.head_dim);
  load_tile<kFwdKeys, HD, kFwdThreads>(k_s, k + off, stride, 0, dims.seq_len, dims.head_dim);
  load_tile<kFwdKeys, HDV, kFwdThreads>(v_s, v + vs.off, vs.stride, 0, dims.seq_len, vs.head_dim);
  cp_async_commit();

  float o[2][HDV / 8][4] = {};
  float m[2][2], l[2][2];  // per row: running max of the raw scores; this thread's part of the running sum
#pragma unroll
  for (int i = 0; i < 2; ++i) m[i][0] = m[i][1] = -INFINITY, l[i][0] = l[i][1] = 0.f;

  for (int n = 0; n < num_k_tiles; ++n) {
    const int buf = n & 1;
    if (n + 1 < num_k_tiles) {  // prefetch the next K/V tile into the other buffer while this one is used
      load_tile<kFwdKeys, HD, kFwdThreads>(k_s + (buf ^ 1) * kFwdKeys * S, k + off, stride, (n + 1) * kFwdKeys,
                                           dims.seq_len, dims.head_dim);
      load_tile<kFwdKeys, HDV, kFwdThreads>(v_s + (buf ^ 1) * kFwdKeys * SV, v + vs.off, vs.stride, (n + 1) * kFwdKeys,
                                            dims.seq_len, vs.head_dim);
    }
    cp_async_commit();  // possibly empty: the wait below always leaves exactly the newest group in flight
    cp_async_wait<1>();
    __syncthreads();
    // The tile is consumed 32 keys at a time, each a full online-softmax step: scores of 32 keys keep the
    // registers (O alone is 128 per thread at HD = 128) clear of spills. Not unrolled, for the same reason.
#pragma unroll 1
    for (int sub = 0; sub < kFwdKeys / kFwdSubKeys; ++sub) {
      const int key0 = n * kFwdKeys + sub * kFwdSubKeys;
      // Keys after all the warp's rows (warps 0, 1 on a CTA's last tile) or past the sequence: nothing to add.
      if (key0 > q0 + row0 + 31 || key0 >= dims.seq_len) break;
      const Bf16* kb = k_s + (buf * kFwdKeys + sub * kFwdSubKeys) * S;
      const Bf16* vb = v_s + (buf * kFwdKeys + sub * kFwdSubKeys) * SV;
      float s[2][kFwdSubKeys / 8][4] = {};
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        uint32_t a[2][4];
        load_a<HD>(a[0], q_s, row0, 16 * kk, lane);
        load_a<HD>(a[1], q_s, row0 + 16, 16 * kk, lane);
        mma_both_row_groups(s, a, [&](uint32_t(&bk)[4], int jj) { load_b<HD>(bk, kb, 16 * jj, 16 * kk, lane); });
      }
      // Only keys reaching past the warp's first row need the causal mask. It also hides keys past
      // seq_len from every row before seq_len; rows past it are never written.
      if (key0 + kFwdSubKeys - 1 > q0 + row0) {
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int j = 0; j < kFwdSubKeys / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (key0 + 8 * j + 2 * t + (e & 1) > q0 + row0 + 16 * i + g + 8 * (e >> 1)) s[i][j][e] = -INFINITY;
      }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // row g (c0, c1) and row g + 8 (c2, c3); a row spans the 4 lanes of a quad
          float mx = -INFINITY;
#pragma unroll
          for (int j = 0; j < kFwdSubKeys / 8; ++j) mx = fmaxf(mx, fmaxf(s[i][j][2 * r], s[i][j][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m[i][r], mx);
          // Key 0 is visible to every row, so m_new is finite from the first step on; the guard keeps a
          // row without a visible key at p = 0 instead of NaN.
          const float m_scaled = m_new == -INFINITY ? 0.f : m_new * scale_log2;
          const float alpha = exp2_ftz(m[i][r] * scale_log2 - m_scaled);  // 0 on the first step (m = -inf)
          m[i][r] = m_new;
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < kFwdSubKeys / 8; ++j) {
            s[i][j][2 * r] = exp2_ftz(fmaf(s[i][j][2 * r], scale_log2, -m_scaled));
            s[i][j][2 * r + 1] = exp2_ftz(fmaf(s[i][j][2 * r + 1], scale_log2, -m_scaled));
            sum += s[i][j][2 * r] + s[i][j][2 * r + 1];
          }
          l[i][r] = l[i][r] * alpha + sum;  // the quad's partial sums are added once, after the last step
#pragma unroll
          for (int d = 0; d < HDV / 8; ++d) o[i][d][2 * r] *= alpha, o[i][d][2 * r + 1] *= alpha;
        }
        // O += P·V: the probabilities go from the S accumulators straight into A fragments.
#pragma unroll
      for (int kk = 0; kk < kFwdSubKeys / 16; ++kk) {
        uint32_t p[2][4];
        pack_a(p[0], s[0], kk);
        pack_a(p[1], s[1], kk);
        mma_both_row_groups(o, p, [&](uint32_t(&bv)[4], int dd) { load_b_trans<HDV>(bv, vb, 16 * kk, 16 * dd, lane); });
      }
    }
    __syncthreads();  // this buffer is refilled by the next iteration's prefetch
  }
  cp_async_wait<0>();

  // o = acc / l; lse = m·scale + log(l). The warp's Q rows (read by no other warp) stage the bf16 rows.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float inv_l[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = l[i][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      inv_l[r] = 1.f / sum;
      const int row = q0 + row0 + 16 * i + g + 8 * r;
      if (t == 0 && row < dims.seq_len) lse[int64_t(bh) * dims.seq_len + row] = m[i][r] * dims.scale + logf(sum);
    }
    stage_rows<HDV, S>(q_s, row0 + 16 * i, o[i], inv_l[0], inv_l[1], lane);
  }
  __syncwarp();
  store_rows<32, HDV, S>(out + vs.off, vs.stride, q_s, row0, q0, dims.seq_len, vs.head_dim, lane);
}

}  // namespace

void attention_forward_flash_cuda(DType dtype, void* out, float* lse, const void* q, const void* k, const void* v,
                                  int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim,
                                  int64_t v_head_dim, cudaStream_t stream) {
  FlashDims dims{};
  if (!make_flash_dims(dims, dtype, batch, seq_len, num_heads, head_dim, v_head_dim, "attention_forward_flash_cuda"))
    return;
  check_flash_aligned({out, q, k, v}, "attention_forward_flash_cuda");
  const unsigned num_blocks = unsigned(batch * num_heads * ((seq_len + kFwdRows - 1) / kFwdRows));
  dispatch_flash_head_dim(dims, [&](auto hd_tag, auto hdv_tag) {
    constexpr int HD = decltype(hd_tag)::value, HDV = decltype(hdv_tag)::value;
    allow_smem(flash_forward_kernel<HD, HDV>, kFwdSmem<HD, HDV>);
    flash_forward_kernel<HD, HDV><<<num_blocks, kFwdThreads, kFwdSmem<HD, HDV>, stream>>>(
        static_cast<Bf16*>(out), lse, static_cast<const Bf16*>(q), static_cast<const Bf16*>(k),
        static_cast<const Bf16*>(v), dims);
    FLOWMOE_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace flowmoe
