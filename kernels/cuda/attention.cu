// Causal attention on the GPU, flash-attention style, fp32 math on CUDA cores, f32 or bf16 data (the
// *_simt_cuda launchers), and attention_forward_cuda / attention_backward_cuda, which send bf16 to the
// tensor-core kernels (kernels/cuda/flash_attention.cu) where they apply and everything else here.
//   forward:  one block per (batch, head, 64-query tile) walks the 64-key tiles up to the diagonal with an
//             online softmax and writes o and lse_i = log sum_{j<=i} exp(s_ij), s = q·kᵀ/sqrt(hd).
//   backward: delta_i = dO_i·o_i; then P = exp(s - lse) is recomputed twice: by one block per key tile
//             (dk, dv, looping over query tiles from the diagonal on) and by one block per query tile (dq).
//             Every block owns its output rows, so there are no atomics and results are deterministic.
// q, k, v, o [B, T, nh, hd] with hd <= 128, zero-padded to 32, 64 or 128 columns in shared memory. The wide heads
// (kernels/attention.h: q and k wider than v) are the flash kernels' alone.
// Tiles and the products on them: kernels/cuda/attention_tile.cuh.
// CPU reference: kernels/cpu/attention.cpp. Tests: tests/test_attention.cpp, tests/test_flash_attention.cpp.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "kernels/attention.h"
#include "kernels/common/cuda_check.h"
#include "kernels/cuda/attention_tile.cuh"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/flash_attention.cuh"
#include "kernels/cuda/launch.cuh"

namespace flowmoe {

namespace {

using namespace attention_tile;

// ---- kernels ----------------------------------------------------------------------------------

// The shared memory of each kernel (SmemLayout: [64, stride] tiles, probability tiles, row values).
template <int HD>
using ForwardSmem = SmemLayout<HD, 3, 1, 0>;  // q, k, v; P
template <int HD>
using DkdvSmem = SmemLayout<HD, 4, 2, 2>;  // k, v, q, dO; Pᵀ, dSᵀ; lse, delta
template <int HD>
using DqSmem = SmemLayout<HD, 4, 1, 0>;  // q, dO, k, v; dS

template <class T, int HD>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(T* __restrict__ out /*[B, T, nh, hd]*/, float* __restrict__ lse /*[B, nh, T]*/,
                             const T* __restrict__ q /*[B, T, nh, hd]*/, const T* __restrict__ k /*[B, T, nh, hd]*/,
                             const T* __restrict__ v /*[B, T, nh, hd]*/, AttnDims dims) {
  using TS = TileShape<HD>;
  using Smem = ForwardSmem<HD>;
  float *q_s = Smem::tile(0), *k_s = Smem::tile(1), *v_s = Smem::tile(2), *p_s = Smem::prob(0);
  const TileBlock blk = tile_block(dims, /*last_first=*/true);
  const int q_tile = blk.tile, b = blk.b, h = blk.h;
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16, q0 = q_tile * kTile;

  load_tile<HD>(q_s, q, dims, b, h, q0);
  float m[4], l[4], acc[4][TS::cols];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m[i] = -INFINITY, l[i] = 0.f;
#pragma unroll
    for (int j = 0; j < TS::cols; ++j) acc[i][j] = 0.f;
  }
  for (int k_tile = 0; k_tile <= q_tile; ++k_tile) {
    const int k0 = k_tile * kTile;
    load_next_tiles<HD>(k_s, k, v_s, v, dims, b, h, k0);  // after the last tile's p_s is read, too
    float s[4][4];
    tile_dot<HD>(q_s, k_s, s);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int q_idx = q0 + 4 * ty + i;
      float tile_max = -INFINITY;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int k_idx = k0 + tx + 16 * c;
        s[i][c] = (k_idx <= q_idx && k_idx < dims.seq_len) ? s[i][c] * dims.scale : -INFINITY;
        tile_max = fmaxf(tile_max, s[i][c]);
      }
      // Key 0 is in every row's first tile, so m_new is finite and alpha = exp(-inf) = 0 there.
      const float m_new = fmaxf(m[i], row_max16(tile_max));
      const float alpha = expf(m[i] - m_new);
      float tile_sum = 0.f;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float p = expf(s[i][c] - m_new);
        tile_sum += p;
        p_s[(4 * ty + i) * kProbStride + tx + 16 * c] = p;
      }
      l[i] = l[i] * alpha + row_sum16(tile_sum);
      m[i] = m_new;
#pragma unroll
      for (int j = 0; j < TS::cols; ++j) acc[i][j] *= alpha;
    }
    __syncthreads();
    tile_accum<HD>(p_s, v_s, acc);
  }
  float inv_l[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    inv_l[i] = 1.f / l[i];
    const int q_idx = q0 + 4 * ty + i;
    if (tx == 0 && q_idx < dims.seq_len) lse[int64_t(blk.bh) * dims.seq_len + q_idx] = m[i] + logf(l[i]);
  }
  store_tile<HD>(out, acc, inv_l, dims, b, h, q0);
}

// delta[b, h, t] = dO[b, t, h, :]·o[b, t, h, :]; one warp per (b, t, h).
template <class T>
__global__ void attention_delta_kernel(float* __restrict__ delta /*[B, nh, T]*/,
                                       const T* __restrict__ d_out /*[B, T, nh, hd]*/,
                                       const T* __restrict__ out /*[B, T, nh, hd]*/, AttnDims dims) {
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;  // (b * T + t) * nh + h
  const int lane = threadIdx.x % 32;
  if (row >= int64_t(dims.batch) * dims.seq_len * dims.num_heads) return;  // the whole warp leaves together
  float sum = 0.f;
  for (int d = lane; d < dims.head_dim; d += 32)
    sum += to_float(d_out[row * dims.head_dim + d]) * to_float(out[row * dims.head_dim + d]);
  sum = warp_sum(sum);
  if (lane == 0) {
    const int64_t h = row % dims.num_heads, bt = row / dims.num_heads;
    const int64_t t = bt % dims.seq_len, b = bt / dims.seq_len;
    delta[(b * dims.num_heads + h) * dims.seq_len + t] = sum;
  }
}

// What both backward kernels read.
template <class T>
struct BackwardInputs {
  const T* __restrict__ q;          // [B, T, nh, hd]
  const T* __restrict__ k;          // [B, T, nh, hd]
  const T* __restrict__ v;          // [B, T, nh, hd]
  const T* __restrict__ d_out;      // [B, T, nh, hd]
  const float* __restrict__ lse;    // [B, nh, T]
  const float* __restrict__ delta;  // [B, nh, T]
};

// The products both backward kernels recompute P and dS from, on the thread's 4x4 block (rows 4ty + i
// of a, columns tx + 16c of b): s = a·bᵀ and dp = da·dbᵀ; then f(i, c, s[i][c], dp[i][c]) for each element.
template <int HD, class F>
__device__ __forceinline__ void for_each_score(const float* a, const float* b, const float* da, const float* db,
                                               F&& f) {
  float s[4][4], dp[4][4];
  tile_dot<HD>(a, b, s);
  tile_dot<HD>(da, db, dp);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) f(i, c, s[i][c], dp[i][c]);
}

// dk, dv for one 64-key tile: loop over query tiles from the diagonal on, with everything transposed
// (rows of the tiles are keys): Pᵀ = exp(K Qᵀ scale - lse), dSᵀ = Pᵀ (V dOᵀ - delta),
// dV += Pᵀ dO, dK += dSᵀ Q scale.
template <class T, int HD>
__global__ void __launch_bounds__(kThreads)
    attention_backward_dkdv_kernel(T* __restrict__ d_k /*[B, T, nh, hd]*/, T* __restrict__ d_v /*[B, T, nh, hd]*/,
                                   BackwardInputs<T> in, AttnDims dims) {
  using TS = TileShape<HD>;
  using Smem = DkdvSmem<HD>;
  float *k_s = Smem::tile(0), *v_s = Smem::tile(1), *q_s = Smem::tile(2), *do_s = Smem::tile(3);
  float *pt_s = Smem::prob(0), *dst_s = Smem::prob(1);   // [64 keys, kProbStride]: Pᵀ, dSᵀ
  float *lse_s = Smem::row(0), *delta_s = Smem::row(1);  // the query tile's rows
  const int num_tiles = (dims.seq_len + kTile - 1) / kTile;
  const TileBlock blk = tile_block(dims, /*last_first=*/false);
  const int k_tile = blk.tile, bh = blk.bh, b = blk.b, h = blk.h;
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16, k0 = k_tile * kTile;

  load_tile<HD>(k_s, in.k, dims, b, h, k0);
  load_tile<HD>(v_s, in.v, dims, b, h, k0);
  float dk[4][TS::cols], dv[4][TS::cols];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < TS::cols; ++j) dk[i][j] = 0.f, dv[i][j] = 0.f;
  for (int q_tile = k_tile; q_tile < num_tiles; ++q_tile) {
    const int q0 = q_tile * kTile;
    __syncthreads();  // the previous tile's q_s, do_s, pt_s, dst_s are no longer read
    load_tile<HD>(q_s, in.q, dims, b, h, q0);
    load_tile<HD>(do_s, in.d_out, dims, b, h, q0);
    for (int r = threadIdx.x; r < kTile; r += kThreads) {
      const bool valid = q0 + r < dims.seq_len;
      lse_s[r] = valid ? in.lse[int64_t(bh) * dims.seq_len + q0 + r] : 0.f;
      delta_s[r] = valid ? in.delta[int64_t(bh) * dims.seq_len + q0 + r] : 0.f;
    }
    __syncthreads();
    // s = k_{k0+4ty+i} · q_{q0+tx+16c}, dp = v_{k0+4ty+i} · dO_{q0+tx+16c}
    for_each_score<HD>(k_s, q_s, v_s, do_s, [&](int i, int c, float s, float dp) {
      const int k_idx = k0 + 4 * ty + i, r = tx + 16 * c, q_idx = q0 + r;
      const float p = (k_idx <= q_idx && q_idx < dims.seq_len) ? expf(s * dims.scale - lse_s[r]) : 0.f;
      pt_s[(4 * ty + i) * kProbStride + r] = p;
      dst_s[(4 * ty + i) * kProbStride + r] = p * (dp - delta_s[r]);
    });
    __syncthreads();
    tile_accum<HD>(pt_s, do_s, dv);
    tile_accum<HD>(dst_s, q_s, dk);
  }
  const float scale[4] = {dims.scale, dims.scale, dims.scale, dims.scale}, one[4] = {1.f, 1.f, 1.f, 1.f};
  store_tile<HD>(d_k, dk, scale, dims, b, h, k0);
  store_tile<HD>(d_v, dv, one, dims, b, h, k0);
}

// dq for one 64-query tile: loop over key tiles up to the diagonal; dS = P (dO Vᵀ - delta), dQ += dS K scale.
template <class T, int HD>
__global__ void __launch_bounds__(kThreads)
    attention_backward_dq_kernel(T* __restrict__ d_q /*[B, T, nh, hd]*/, BackwardInputs<T> in, AttnDims dims) {
  using TS = TileShape<HD>;
  using Smem = DqSmem<HD>;
  float *q_s = Smem::tile(0), *do_s = Smem::tile(1), *k_s = Smem::tile(2), *v_s = Smem::tile(3);
  float* ds_s = Smem::prob(0);  // [64 queries, kProbStride] dS
  const TileBlock blk = tile_block(dims, /*last_first=*/true);
  const int q_tile = blk.tile, bh = blk.bh, b = blk.b, h = blk.h;
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16, q0 = q_tile * kTile;

  load_tile<HD>(q_s, in.q, dims, b, h, q0);
  load_tile<HD>(do_s, in.d_out, dims, b, h, q0);
  float row_lse[4], row_delta[4], dq[4][TS::cols];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int q_idx = q0 + 4 * ty + i;
    const bool valid = q_idx < dims.seq_len;
    row_lse[i] = valid ? in.lse[int64_t(bh) * dims.seq_len + q_idx] : 0.f;
    row_delta[i] = valid ? in.delta[int64_t(bh) * dims.seq_len + q_idx] : 0.f;
#pragma unroll
    for (int j = 0; j < TS::cols; ++j) dq[i][j] = 0.f;
  }
  for (int k_tile = 0; k_tile <= q_tile; ++k_tile) {
    const int k0 = k_tile * kTile;
    load_next_tiles<HD>(k_s, in.k, v_s, in.v, dims, b, h, k0);  // after the last tile's ds_s is read, too
    // s = q_{q0+4ty+i} · k_{k0+tx+16c}, dp = dO_{q0+4ty+i} · v_{k0+tx+16c}
    for_each_score<HD>(q_s, k_s, do_s, v_s, [&](int i, int c, float s, float dp) {
      const int q_idx = q0 + 4 * ty + i, k_idx = k0 + tx + 16 * c;
      const float p = (k_idx <= q_idx && k_idx < dims.seq_len) ? expf(s * dims.scale - row_lse[i]) : 0.f;
      ds_s[(4 * ty + i) * kProbStride + tx + 16 * c] = p * (dp - row_delta[i]);
    });
    __syncthreads();
    tile_accum<HD>(ds_s, k_s, dq);
  }
  const float scale[4] = {dims.scale, dims.scale, dims.scale, dims.scale};
  store_tile<HD>(d_q, dq, scale, dims, b, h, q0);
}

// ---- launchers --------------------------------------------------------------------------------

// Checks sizes; false when there is nothing to compute.
bool make_dims(AttnDims& dims, int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim, int64_t v_head_dim,
               const char* what) {
  FLOWMOE_CHECK(batch >= 0 && seq_len >= 0 && num_heads >= 0 && head_dim >= 0, ShapeError, what, ": negative size [",
                batch, ", ", seq_len, ", ", num_heads, ", ", head_dim, "]");
  FLOWMOE_CHECK(head_dim <= kAttentionMaxHeadDimCuda && v_head_dim == head_dim, ShapeError, what, ": head_dim ",
                head_dim, " with v_head_dim ", v_head_dim,
                " is not a shape the kernels take (v_head_dim = head_dim <= ", kAttentionMaxHeadDimCuda, ")");
  if (batch * seq_len * num_heads * head_dim == 0) return false;
  const int64_t num_tiles = (seq_len + kTile - 1) / kTile;
  FLOWMOE_CHECK(batch * num_heads * num_tiles < (int64_t(1) << 31) && seq_len < (int64_t(1) << 30), ShapeError, what,
                ": too large [", batch, ", ", seq_len, ", ", num_heads, ", ", head_dim, "]");
  dims = AttnDims{int(batch), int(seq_len), int(num_heads), int(head_dim), float(1.0 / std::sqrt(double(head_dim)))};
  return true;
}

unsigned num_tile_blocks(const AttnDims& dims) {
  return unsigned(dims.batch * dims.num_heads * ((dims.seq_len + kTile - 1) / kTile));
}

// Calls f(std::integral_constant<int, HD>) with head_dim rounded up to 32, 64 or 128.
template <class F>
void dispatch_head_dim(int head_dim, F&& f) {
  if (head_dim <= 32)
    f(std::integral_constant<int, 32>());
  else if (head_dim <= 64)
    f(std::integral_constant<int, 64>());
  else
    f(std::integral_constant<int, 128>());
}

// Checks the sizes (nothing to do when one is 0), then runs launch.template operator()<T, HD>(dims) for
// dtype's element type T and head_dim rounded up to HD.
template <class F>
void dispatch_simt(DType dtype, int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim, int64_t v_head_dim,
                   const char* what, F&& launch) {
  AttnDims dims{};
  if (!make_dims(dims, batch, seq_len, num_heads, head_dim, v_head_dim, what)) return;
  dispatch_cuda_float(dtype, what, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    dispatch_head_dim(dims.head_dim,
                      [&](auto hd_tag) { launch.template operator()<T, decltype(hd_tag)::value>(dims); });
  });
}

void attention_forward_simt_cuda(DType dtype, void* out, float* lse, const void* q, const void* k, const void* v,
                                 int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim,
                                 int64_t v_head_dim, cudaStream_t stream) {
  auto launch = [&]<class T, int HD>(const AttnDims& dims) {
    allow_smem(attention_forward_kernel<T, HD>, ForwardSmem<HD>::bytes);
    attention_forward_kernel<T, HD><<<num_tile_blocks(dims), kThreads, ForwardSmem<HD>::bytes, stream>>>(
        static_cast<T*>(out), lse, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), dims);
    FLOWMOE_CUDA_CHECK_LAUNCH();
  };
  dispatch_simt(dtype, batch, seq_len, num_heads, head_dim, v_head_dim, "attention_forward_simt_cuda", launch);
}

void attention_backward_simt_cuda(DType dtype, void* d_q, void* d_k, void* d_v, float* delta, const void* d_out,
                                  const void* q, const void* k, const void* v, const void* out, const float* lse,
                                  int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim,
                                  int64_t v_head_dim, cudaStream_t stream) {
  auto launch = [&]<class T, int HD>(const AttnDims& dims) {
    auto input = [](const void* p) { return static_cast<const T*>(p); };
    const int64_t num_rows = batch * seq_len * num_heads;
    const int delta_threads = 256;
    attention_delta_kernel<<<unsigned((num_rows * 32 + delta_threads - 1) / delta_threads), delta_threads, 0, stream>>>(
        delta, input(d_out), input(out), dims);
    FLOWMOE_CUDA_CHECK_LAUNCH();
    const BackwardInputs<T> in{input(q), input(k), input(v), input(d_out), lse, delta};
    allow_smem(attention_backward_dkdv_kernel<T, HD>, DkdvSmem<HD>::bytes);
    attention_backward_dkdv_kernel<T, HD><<<num_tile_blocks(dims), kThreads, DkdvSmem<HD>::bytes, stream>>>(
        static_cast<T*>(d_k), static_cast<T*>(d_v), in, dims);
    FLOWMOE_CUDA_CHECK_LAUNCH();
    allow_smem(attention_backward_dq_kernel<T, HD>, DqSmem<HD>::bytes);
    attention_backward_dq_kernel<T, HD>
        <<<num_tile_blocks(dims), kThreads, DqSmem<HD>::bytes, stream>>>(static_cast<T*>(d_q), in, dims);
    FLOWMOE_CUDA_CHECK_LAUNCH();
  };
  dispatch_simt(dtype, batch, seq_len, num_heads, head_dim, v_head_dim, "attention_backward_simt_cuda", launch);
}

// The tensor-core kernels take bf16 rows of whole 16-byte chunks: head_dim % 8 == 0, aligned pointers. Wide heads
// are theirs alone, which then name what they lack.
bool use_flash(AttentionKernel kernel, DType dtype, int64_t head_dim, int64_t v_head_dim,
               std::initializer_list<const void*> ptrs) {
  if (kernel != AttentionKernel::automatic) return kernel == AttentionKernel::flash;
  if (head_dim > kAttentionMaxHeadDimCuda || v_head_dim != head_dim) return true;
  if (dtype != DType::bf16 || head_dim % 8 != 0) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

}  // namespace

void attention_forward_cuda(DType dtype, void* out, float* lse, const void* q, const void* k, const void* v,
                            int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim, int64_t v_head_dim,
                            cudaStream_t stream, AttentionKernel kernel) {
  if (use_flash(kernel, dtype, head_dim, v_head_dim, {out, q, k, v}))
    attention_forward_flash_cuda(dtype, out, lse, q, k, v, batch, seq_len, num_heads, head_dim, v_head_dim, stream);
  else
    attention_forward_simt_cuda(dtype, out, lse, q, k, v, batch, seq_len, num_heads, head_dim, v_head_dim, stream);
}

void attention_backward_cuda(DType dtype, void* d_q, void* d_k, void* d_v, float* delta, const void* d_out,
                             const void* q, const void* k, const void* v, const void* out, const float* lse,
                             int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim, int64_t v_head_dim,
                             cudaStream_t stream, AttentionKernel kernel) {
  if (use_flash(kernel, dtype, head_dim, v_head_dim, {d_q, d_k, d_v, d_out, q, k, v, out}))
    attention_backward_flash_cuda(dtype, d_q, d_k, d_v, delta, d_out, q, k, v, out, lse, batch, seq_len, num_heads,
                                  head_dim, v_head_dim, stream);
  else
    attention_backward_simt_cuda(dtype, d_q, d_k, d_v, delta, d_out, q, k, v, out, lse, batch, seq_len, num_heads,
                                 head_dim, v_head_dim, stream);
}

}  // namespace flowmoe
