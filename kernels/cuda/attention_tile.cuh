// The tile machinery of the attention kernels (kernels/cuda/attention.cu): 64-row tiles of q, k, v, dO
// held as fp32 in shared memory, two register-tiled products on them (A·Bᵀ over head_dim, and a
// probability tile times a [64, HD] tile), and half-warp row reductions for the softmax.
// A block has 16 x 16 threads; thread (ty, tx) owns tile rows 4ty..4ty+3, score columns tx + 16c.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/cuda_utils.cuh"

namespace flowmoe::attention_tile {

constexpr int kTile = 64;               // queries per query tile, keys per key tile
constexpr int kThreads = 256;           // 16 x 16 threads
constexpr int kProbStride = kTile + 4;  // row stride (floats) of a 64x64 probability tile in shared memory

// A [64, HD] tile in shared memory, and how a thread's HD/16 output columns are spread: groups of
// `vec` adjacent columns, so rows of V / dO / Q / K are read as float4 (float2 for HD = 32).
template <int HD>
struct TileShape {
  static constexpr int stride = HD + 4;  // rows 4 apart land in different banks; float4 stays aligned
  static constexpr int cols = HD / 16;
  static constexpr int vec = cols >= 4 ? 4 : 2;
  static __device__ __forceinline__ int col(int tx, int j) { return (j / vec) * 16 * vec + tx * vec + j % vec; }
};

// A kernel's dynamic shared memory: TILES [64, stride] tiles, then PROBS [64, kProbStride] probability
// tiles, then ROWS [64] row values. The kernel takes its arrays from it and the launcher its size.
template <int HD, int TILES, int PROBS, int ROWS>
struct SmemLayout {
  static constexpr size_t bytes =
      (TILES * kTile * TileShape<HD>::stride + PROBS * kTile * kProbStride + ROWS * kTile) * sizeof(float);
  static __device__ __forceinline__ float* tile(int i) { return base() + i * kTile * TileShape<HD>::stride; }
  static __device__ __forceinline__ float* prob(int i) { return tile(TILES) + i * kTile * kProbStride; }
  static __device__ __forceinline__ float* row(int i) { return prob(PROBS) + i * kTile; }

 private:
  static __device__ __forceinline__ float* base() {
    extern __shared__ float4 smem4[];
    return reinterpret_cast<float*>(smem4);
  }
};

struct AttnDims {
  int batch, seq_len, num_heads, head_dim;
  float scale;  // 1 / sqrt(head_dim)
};

__device__ __forceinline__ int64_t row_offset(const AttnDims& dims, int b, int t, int h) {
  return ((int64_t(b) * dims.seq_len + t) * dims.num_heads + h) * dims.head_dim;
}

// Sum / max over the 16 threads (one tx range) that share a tile row; they sit in one half-warp.
__device__ __forceinline__ float row_sum16(float x) { return lane_group_sum<16>(x); }
__device__ __forceinline__ float row_max16(float x) { return lane_group_max<16>(x); }

// dst[r][d] = src[b, t0 + r, h, d] as float; zero past seq_len and past head_dim.
template <int HD, class T>
__device__ __forceinline__ void load_tile(float* dst /*[64, stride]*/, const T* src /*[B, T, nh, hd]*/,
                                          const AttnDims& dims, int b, int h, int t0) {
  for (int idx = threadIdx.x; idx < kTile * HD; idx += kThreads) {
    const int r = idx / HD, d = idx % HD, t = t0 + r;
    float x = 0.f;
    if (t < dims.seq_len && d < dims.head_dim) x = to_float(src[row_offset(dims, b, t, h) + d]);
    dst[r * TileShape<HD>::stride + d] = x;
  }
}

// The next two tiles of a loop (k and v, say): once every thread is done with the previous ones, rows
// [t0, t0 + 64) of both, visible to the whole block on return.
template <int HD, class T>
__device__ __forceinline__ void load_next_tiles(float* a_dst, const T* a, float* b_dst, const T* b,
                                                const AttnDims& dims, int bi, int h, int t0) {
  __syncthreads();
  load_tile<HD>(a_dst, a, dims, bi, h, t0);
  load_tile<HD>(b_dst, b, dims, bi, h, t0);
  __syncthreads();
}

// The (batch, head) and 64-row tile a block of the grid owns, the (batch, head) pairs fastest. Causal
// attention gives query tile q the keys of tiles 0..q: the forward and dq take the last tile first, dk
// and dv (key tile k sees query tiles k..) the first, so the longest blocks start first.
struct TileBlock {
  int tile, bh, b, h;
};
__device__ __forceinline__ TileBlock tile_block(const AttnDims& dims, bool last_first) {
  const int num_bh = dims.batch * dims.num_heads, num_tiles = (dims.seq_len + kTile - 1) / kTile;
  const int k = int(blockIdx.x) / num_bh, bh = int(blockIdx.x) % num_bh;
  return {last_first ? num_tiles - 1 - k : k, bh, bh / dims.num_heads, bh % dims.num_heads};
}

// dst[b, t0 + 4ty + i, h, col(tx, j)] = acc[i][j] * row_scale[i] for the rows before seq_len and the columns
// before head_dim: a thread's outputs of a [64, HD] tile.
template <int HD, class T>
__device__ __forceinline__ void store_tile(T* dst /*[B, T, nh, hd]*/, const float (&acc)[4][TileShape<HD>::cols],
                                           const float (&row_scale)[4], const AttnDims& dims, int b, int h, int t0) {
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = t0 + 4 * ty + i;
    if (t >= dims.seq_len) continue;
    T* row = dst + row_offset(dims, b, t, h);
#pragma unroll
    for (int j = 0; j < TileShape<HD>::cols; ++j) {
      const int d = TileShape<HD>::col(tx, j);
      if (d < dims.head_dim) row[d] = from_float<T>(acc[i][j] * row_scale[i]);
    }
  }
}

// acc[i][c] = A[4ty + i] · B[tx + 16c]: dot products of rows of two [64, HD] tiles.
template <int HD>
__device__ __forceinline__ void tile_dot(const float* A, const float* B, float (&acc)[4][4]) {
  constexpr int S = TileShape<HD>::stride;
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[i][c] = 0.f;
#pragma unroll 4
  for (int d = 0; d < HD; d += 4) {
    float4 a[4], b[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = *reinterpret_cast<const float4*>(A + (4 * ty + i) * S + d);
#pragma unroll
    for (int c = 0; c < 4; ++c) b[c] = *reinterpret_cast<const float4*>(B + (tx + 16 * c) * S + d);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float x = acc[i][c];
        x = fmaf(a[i].x, b[c].x, x);
        x = fmaf(a[i].y, b[c].y, x);
        x = fmaf(a[i].z, b[c].z, x);
        acc[i][c] = fmaf(a[i].w, b[c].w, x);
      }
  }
}

// acc[i][j] += sum_c P[4ty + i][c] * V[c][col(tx, j)]: a [64, 64] probability tile times a [64, HD] tile.
template <int HD>
__device__ __forceinline__ void tile_accum(const float* P, const float* V, float (&acc)[4][TileShape<HD>::cols]) {
  using TS = TileShape<HD>;
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll 2
  for (int c = 0; c < kTile; c += 4) {
    float p[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 p4 = *reinterpret_cast<const float4*>(P + (4 * ty + i) * kProbStride + c);
      p[i][0] = p4.x, p[i][1] = p4.y, p[i][2] = p4.z, p[i][3] = p4.w;
    }
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
      const float* v_row = V + (c + cc) * TS::stride + tx * TS::vec;
      float vv[TS::cols];
#pragma unroll
      for (int g = 0; g < TS::cols / TS::vec; ++g) {
        if constexpr (TS::vec == 4) {
          const float4 x = *reinterpret_cast<const float4*>(v_row + g * 64);
          vv[4 * g] = x.x, vv[4 * g + 1] = x.y, vv[4 * g + 2] = x.z, vv[4 * g + 3] = x.w;
        } else {
          const float2 x = *reinterpret_cast<const float2*>(v_row + g * 32);
          vv[2 * g] = x.x, vv[2 * g + 1] = x.y;
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < TS::cols; ++j) acc[i][j] = fmaf(p[i][cc], vv[j], acc[i][j]);
    }
  }
}

}  // namespace flowmoe::attention_tile
