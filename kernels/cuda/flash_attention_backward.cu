// Causal attention backward on bf16 with tensor cores, FlashAttention-2 style (math in kernels/attention.h),
// deterministic: two kernels, each CTA owning its output rows (no atomics). 4 warps x 16 rows, 64-row tiles.
//   dq:   one CTA per 64-query tile: delta_i = dO_i·o_i first (written for the next kernel), then over the key
//         tiles up to the diagonal P = exp(s - lse), dS = P∘(dO·Vᵀ - delta), dQ += dS·K/sqrt(hd).
//   dk/dv: one CTA per 64-key tile, over the query tiles from the diagonal on, transposed (rows are keys):
//         Pᵀ = exp(K·Qᵀ - lse), dSᵀ = Pᵀ∘(V·dOᵀ - delta), dV += Pᵀ·dO, dK += dSᵀ·Q/sqrt(hd).
// P and dS enter their products as bf16 straight from the accumulators (no shared-memory round trip).
// Wide heads (kernels/attention.h: q, k in HD = 192 columns, v, o, dO in HDV = 128) take each 64-row tile of the
// loop in steps of 32 (dq) or 16 (dk/dv) rows, so that S and dP of that many columns sit beside the wider dQ or
// dK and dV accumulators without spilling (dk/dv at 32 would spill 108 bytes); their tiles need 126 and 127 KB of
// shared memory, one CTA per SM.
// Forward and shapes: flash_attention.cu; tiles, fragments: flash_attention.cuh. CPU reference:
// kernels/cpu/attention.cpp; GPU reference: the fp32 kernels of attention.cu. Tests: tests/test_flash_attention.cpp.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/attention.h"
#include "kernels/common/cuda_check.h"
#include "kernels/cuda/flash_attention.cuh"

namespace flowmoe {

namespace {

using namespace flash;

constexpr int kBwdTile = 64;  // queries and keys per tile: 4 warps x 16 rows
constexpr int kBwdThreads = 128;

// Columns of S and dP per step of the loop over a tile: the whole tile, or part of it for wide heads.
template <int HD>
constexpr int kDqStep = HD > 128 ? 32 : 64;
template <int HD>
constexpr int kDkdvStep = HD > 128 ? 16 : 64;

template <int HD, int HDV>
constexpr size_t kDqSmem = size_t(3 * kBwdTile) * (kStride<HD> + kStride<HDV>)*sizeof(Bf16);  // Q, dO, 2 x (K, V)
template <int HD, int HDV>
constexpr size_t kDkdvSmem = kDqSmem<HD, HDV> + 4 * kBwdTile * sizeof(float);  // K, V, 2 x (Q, dO, lse, delta)

// ---- dq (and delta) -----------------------------------------------------------------------------

template <int HD, int HDV>
__global__ void __launch_bounds__(kBwdThreads, 2)
    flash_backward_dq_kernel(Bf16* __restrict__ d_q /*[B, T, nh, hd]*/, float* __restrict__ delta /*[B, nh, T]*/,
                             const Bf16* __restrict__ q /*[B, T, nh, hd]*/, const Bf16* __restrict__ k /*[same]*/,
                             const Bf16* __restrict__ v /*[B, T, nh, v_hd]*/, const Bf16* __restrict__ d_out /*[same]*/,
                             const Bf16* __restrict__ out /*[same]*/, const float* __restrict__ lse /*[B, nh, T]*/,
                             FlashDims dims) {
  constexpr int S = kStride<HD>, SV = kStride<HDV>, kStep = kDqStep<HD>;
  extern __shared__ __align__(16) unsigned char smem[];
  Bf16* q_s = reinterpret_cast<Bf16*>(smem);  // [64, S]
  Bf16* do_s = q_s + kBwdTile * S;            // [64, SV]
  Bf16* k_s = do_s + kBwdTile * SV;           // [2][64, S]; buffer 1 holds the o tile ([64, SV]) until delta is made
  Bf16* v_s = k_s + 2 * kBwdTile * S;         // [2][64, SV]
  const int num_bh = dims.batch * dims.num_heads, num_tiles = (dims.seq_len + kBwdTile - 1) / kBwdTile;
  const int q_tile = num_tiles - 1 - int(blockIdx.x) / num_bh;
  const int bh = int(blockIdx.x) % num_bh, b = bh / dims.num_heads, h = bh % dims.num_heads;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int q0 = q_tile * kBwdTile, row0 = 16 * warp;  // the warp's rows: q0 + row0 + {g, g+8}
  const int64_t stride = dims.row_stride(), off = dims.slice_offset(b, h);
  const ValueSide<HD, HDV> vs(dims, stride, off, b, h);
  const float scale_log2 = dims.scale * kLog2e;

  load_tile<kBwdTile, HD, kBwdThreads>(q_s, q + off, stride, q0, dims.seq_len, dims.head_dim);
  load_tile<kBwdTile, HDV, kBwdThreads>(do_s, d_out + vs.off, vs.stride, q0, dims.seq_len, vs.head_dim);
  load_tile<kBwdTile, HD, kBwdThreads>(k_s, k + off, stride, 0, dims.seq_len, dims.head_dim);
  load_tile<kBwdTile, HDV, kBwdThreads>(v_s, v + vs.off, vs.stride, 0, dims.seq_len, vs.head_dim);
  load_tile<kBwdTile, HDV, kBwdThreads>(k_s + kBwdTile * S, out + vs.off, vs.stride, q0, dims.seq_len, vs.head_dim);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  // delta = dO·o in fp32 from the bf16 tiles: lane l sums half (l % 2) of row row0 + l / 2.
  float row_delta[2], row_lse[2];
  {
    const int r = row0 + lane / 2, c0 = (lane % 2) * (HDV / 2);
    const Bf16* o_s = k_s + kBwdTile * S;
    float sum = 0.f;
#pragma unroll
    for (int c = c0; c < c0 + HDV / 2; c += 2) {
      const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(do_s + r * SV + c));
      const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(o_s + r * SV + c));
      sum = fmaf(x.x, y.x, fmaf(x.y, y.y, sum));
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if (lane % 2 == 0 && q0 + r < dims.seq_len) delta[int64_t(bh) * dims.seq_len + q0 + r] = sum;
    row_delta[0] = __shfl_sync(0xffffffffu, sum, 2 * g);       // row row0 + g
    row_delta[1] = __shfl_sync(0xffffffffu, sum, 2 * g + 16);  // row row0 + g + 8
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2) {
      const int row = q0 + row0 + g + 8 * r2;
      row_lse[r2] = row < dims.seq_len ? lse[int64_t(bh) * dims.seq_len + row] * kLog2e : 0.f;
    }
  }
  __syncthreads();  // the o tile is read: K/V buffer 1 takes the next tile

  float dq[HD / 8][4] = {};
  for (int n = 0; n <= q_tile; ++n) {  // key tiles up to the diagonal (all start before seq_len)
    const int k0 = n * kBwdTile, buf = n & 1;
    if (n < q_tile) {
      load_tile<kBwdTile, HD, kBwdThreads>(k_s + (buf ^ 1) * kBwdTile * S, k + off, stride, k0 + kBwdTile, dims.seq_len,
                                           dims.head_dim);
      load_tile<kBwdTile, HDV, kBwdThreads>(v_s + (buf ^ 1) * kBwdTile * SV, v + vs.off, vs.stride, k0 + kBwdTile,
                                            dims.seq_len, vs.head_dim);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const bool diagonal = n == q_tile;
#pragma unroll 1
    for (int c0 = 0; c0 < kBwdTile; c0 += kStep) {  // keys k0 + c0 ..; one step but for wide heads
      const Bf16* kb = k_s + (buf * kBwdTile + c0) * S;
      const Bf16* vb = v_s + (buf * kBwdTile + c0) * SV;
      float s[kStep / 8][4] = {}, dp[kStep / 8][4] = {};  // S = Q·Kᵀ, dP = dO·Vᵀ for the warp's 16 rows
      mma_two_nt<HD, HDV, kStep>(s, dp, q_s, do_s, row0, kb, vb, lane);
#pragma unroll
      for (int j = 0; j < kStep / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool hidden = diagonal && k0 + c0 + 8 * j + 2 * t + (e & 1) > q0 + row0 + g + 8 * (e >> 1);
          const float p = hidden ? 0.f : exp2_ftz(fmaf(s[j][e], scale_log2, -row_lse[e >> 1]));
          s[j][e] = p * (dp[j][e] - row_delta[e >> 1]);  // dS
        }
#pragma unroll
      for (int kk = 0; kk < kStep / 16; ++kk) {  // dQ += dS·K
        uint32_t a[4];
        pack_a(a, s, kk);
        mma_rows_trans<HD>(dq, a, kb, 16 * kk, lane);
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();
  stage_rows<HD>(q_s, row0, dq, dims.scale, dims.scale, lane);  // the warp's own Q rows
  __syncwarp();
  store_rows<16, HD>(d_q + off, stride, q_s, row0, q0, dims.seq_len, dims.head_dim, lane);
}

// ---- dk, dv -------------------------------------------------------------------------------------

template <int HD, int HDV>
__global__ void __launch_bounds__(kBwdThreads, 2)
    flash_backward_dkdv_kernel(Bf16* __restrict__ d_k /*[B, T, nh, hd]*/, Bf16* __restrict__ d_v /*[B, T, nh, v_hd]*/,
                               const Bf16* __restrict__ q /*[B, T, nh, hd]*/, const Bf16* __restrict__ k /*[same]*/,
                               const Bf16* __restrict__ v /*[B, T, nh, v_hd]*/,
                               const Bf16* __restrict__ d_out /*[same]*/, const float* __restrict__ lse /*[B, nh, T]*/,
                               const float* __restrict__ delta /*[B, nh, T]*/, FlashDims dims) {
  constexpr int S = kStride<HD>, SV = kStride<HDV>, kStep = kDkdvStep<HD>;
  extern __shared__ __align__(16) unsigned char smem[];
  Bf16* k_s = reinterpret_cast<Bf16*>(smem);                          // [64, S]
  Bf16* v_s = k_s + kBwdTile * S;                                     // [64, SV]
  Bf16* q_s = v_s + kBwdTile * SV;                                    // [2][64, S]
  Bf16* do_s = q_s + 2 * kBwdTile * S;                                // [2][64, SV]
  float* lse_s = reinterpret_cast<float*>(do_s + 2 * kBwdTile * SV);  // [2][64]
  float* delta_s = lse_s + 2 * kBwdTile;                              // [2][64]
  const int num_bh = dims.batch * dims.num_heads, num_tiles = (dims.seq_len + kBwdTile - 1) / kBwdTile;
  const int k_tile = int(blockIdx.x) / num_bh;  // low key tiles see the most queries and start first
  const int bh = int(blockIdx.x) % num_bh, b = bh / dims.num_heads, h = bh % dims.num_heads;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int k0 = k_tile * kBwdTile, row0 = 16 * warp;  // the warp's keys: k0 + row0 + {g, g+8}
  const int64_t stride = dims.row_stride(), off = dims.slice_offset(b, h);
  const ValueSide<HD, HDV> vs(dims, stride, off, b, h);
  const float* lse_bh = lse + int64_t(bh) * dims.seq_len;
  const float* delta_bh = delta + int64_t(bh) * dims.seq_len;
  const float scale_log2 = dims.scale * kLog2e;

  auto load_queries = [&](int q_tile, int buf) {
    const int q0 = q_tile * kBwdTile;
    load_tile<kBwdTile, HD, kBwdThreads>(q_s + buf * kBwdTile * S, q + off, stride, q0, dims.seq_len, dims.head_dim);
    load_tile<kBwdTile, HDV, kBwdThreads>(do_s + buf * kBwdTile * SV, d_out + vs.off, vs.stride, q0, dims.seq_len,
                                          vs.head_dim);
    load_row_values<kBwdTile, kBwdThreads>(lse_s + buf * kBwdTile, lse_bh, q0, dims.seq_len);
    load_row_values<kBwdTile, kBwdThreads>(delta_s + buf * kBwdTile, delta_bh, q0, dims.seq_len);
  };
  load_tile<kBwdTile, HD, kBwdThreads>(k_s, k + off, stride, k0, dims.seq_len, dims.head_dim);
  load_tile<kBwdTile, HDV, kBwdThreads>(v_s, v + vs.off, vs.stride, k0, dims.seq_len, vs.head_dim);
  load_queries(k_tile, 0);
  cp_async_commit();

  float dk[HD / 8][4] = {}, dv[HDV / 8][4] = {};
  for (int q_tile = k_tile; q_tile < num_tiles; ++q_tile) {  // query tiles from the diagonal on
    const int q0 = q_tile * kBwdTile, buf = (q_tile - k_tile) & 1;
    if (q_tile + 1 < num_tiles) load_queries(q_tile + 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
#pragma unroll 1
    for (int c0 = 0; c0 < kBwdTile; c0 += kStep) {  // queries q0 + c0 ..; one step but for wide heads
      // Row buf * kBwdTile + c0: so written, the one-step kernels compile as before the steps (the same PTX) and
      // the wide ones spill 16 bytes, not 28.
      const int r0 = kStep < kBwdTile ? buf * kBwdTile + c0 : buf * kBwdTile;
      const Bf16* qb = q_s + r0 * S;
      const Bf16* dob = do_s + r0 * SV;
      // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for the warp's 16 keys.
      float st[kStep / 8][4] = {}, dpt[kStep / 8][4] = {};
      mma_two_nt<HD, HDV, kStep>(st, dpt, k_s, v_s, row0, qb, dob, lane);
      // The diagonal tile hides queries before the key; the last tile hides queries past seq_len (their
      // lse and delta read as 0). Keys past seq_len are then hidden from every query.
      const bool masked = q_tile == k_tile || q0 + kBwdTile > dims.seq_len;
#pragma unroll
      for (int j = 0; j < kStep / 8; ++j) {
        const int col = c0 + 8 * j + 2 * t;  // columns col, col + 1 (queries q0 + col, + 1)
        const float2 lse2 = *reinterpret_cast<const float2*>(lse_s + buf * kBwdTile + col);
        const float2 delta2 = *reinterpret_cast<const float2*>(delta_s + buf * kBwdTile + col);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int query = q0 + col + (e & 1), key = k0 + row0 + g + 8 * (e >> 1);
          const bool hidden = masked && (query < key || query >= dims.seq_len);
          const float p = hidden ? 0.f : exp2_ftz(fmaf(st[j][e], scale_log2, -(e & 1 ? lse2.y : lse2.x) * kLog2e));
          st[j][e] = p;                                                 // Pᵀ
          dpt[j][e] = p * (dpt[j][e] - (e & 1 ? delta2.y : delta2.x));  // dSᵀ
        }
      }
#pragma unroll
      for (int kk = 0; kk < kStep / 16; ++kk) {  // dV += Pᵀ·dO, dK += dSᵀ·Q over queries c0 + 16kk..
        uint32_t a[4];
        pack_a(a, st, kk);
        mma_rows_trans<HDV>(dv, a, dob, 16 * kk, lane);
        pack_a(a, dpt, kk);
        mma_rows_trans<HD>(dk, a, qb, 16 * kk, lane);
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();
  stage_rows<HD>(k_s, row0, dk, dims.scale, dims.scale, lane);  // the warp's own K and V rows
  stage_rows<HDV>(v_s, row0, dv, 1.f, 1.f, lane);
  __syncwarp();
  store_rows<16, HD>(d_k + off, stride, k_s, row0, k0, dims.seq_len, dims.head_dim, lane);
  store_rows<16, HDV>(d_v + vs.off, vs.stride, v_s, row0, k0, dims.seq_len, vs.head_dim, lane);
}

}  // namespace

void attention_backward_flash_cuda(DType dtype, void* d_q, void* d_k, void* d_v, float* delta, const void* d_out,
                                   const void* q, const void* k, const void* v, const void* out, const float* lse,
                                   int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim,
                                   int64_t v_head_dim, cudaStream_t stream) {
  FlashDims dims{};
  if (!make_flash_dims(dims, dtype, batch, seq_len, num_heads, head_dim, v_head_dim, "attention_backward_flash_cuda"))
    return;
  check_flash_aligned({d_q, d_k, d_v, d_out, q, k, v, out}, "attention_backward_flash_cuda");
  const unsigned num_blocks = unsigned(batch * num_heads * ((seq_len + kBwdTile - 1) / kBwdTile));
  dispatch_flash_head_dim(dims, [&](auto hd_tag, auto hdv_tag) {
    constexpr int HD = decltype(hd_tag)::value, HDV = decltype(hdv_tag)::value;
    allow_smem(flash_backward_dq_kernel<HD, HDV>, kDqSmem<HD, HDV>);
    flash_backward_dq_kernel<HD, HDV><<<num_blocks, kBwdThreads, kDqSmem<HD, HDV>, stream>>>(
        static_cast<Bf16*>(d_q), delta, static_cast<const Bf16*>(q), static_cast<const Bf16*>(k),
        static_cast<const Bf16*>(v), static_cast<const Bf16*>(d_out), static_cast<const Bf16*>(out), lse, dims);
    FLOWMOE_CUDA_CHECK_LAUNCH();
    allow_smem(flash_backward_dkdv_kernel<HD, HDV>, kDkdvSmem<HD, HDV>);
    flash_backward_dkdv_kernel<HD, HDV><<<num_blocks, kBwdThreads, kDkdvSmem<HD, HDV>, stream>>>(
        static_cast<Bf16*>(d_k), static_cast<Bf16*>(d_v), static_cast<const Bf16*>(q), static_cast<const Bf16*>(k),
        static_cast<const Bf16*>(v), static_cast<const Bf16*>(d_out), lse, delta, dims);
    FLOWMOE_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace flowmoe
