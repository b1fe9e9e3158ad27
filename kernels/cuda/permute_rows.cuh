// permute_pad, step 2: the row move (kernels/cuda/permute.cu includes this; layout in kernels/permute.h).
//
// Launched after the routing map (permute_route.cuh) with programmatic dependent launch, it reads
// row_map, tokens_per_expert and segment_starts only after wait_for_previous_kernel.
//   token blocks: one thread group (32 to 256 threads, by row length) per token reads the token's k
//                 destinations into shared memory, then moves the row in passes of group*kUnroll
//                 vectors: each pass is loaded once and stored to every destination row. The first pass
//                 is loaded before the wait (x is an input, not an output of step 1).
//   pad blocks:   one warp per pad item writes zero rows (and probs 0, side_pad_value) into the pad slots
//                 and the tail past segment_starts[L].
// Vectors are VB = 16, 8, 4, 2 or 1 bytes: the widest that divides the row and both base addresses.
// The sm_90 alternative (bulk copies through shared memory) is permute_rows_tma.cuh.
#pragma once
#include <cstdint>

#include "kernels/cuda/packed.cuh"
#include "kernels/cuda/pad_rows.cuh"
#include "kernels/cuda/permute_route.cuh"
#include "kernels/unpermute.h"

namespace flowmoe {
namespace {

constexpr int kRowThreads = 256;             // threads per block of the row kernels: 256 / group thread groups
constexpr int kUnroll = 4;                   // vectors per thread in flight per pass
constexpr int kRowMinBlocks = 5;             // the row kernel's register budget: 5 blocks per SM (<= 48 registers)
constexpr int kMaxTopk = kUnpermuteMaxTopk;  // the backward runs unpermute_cuda (kernels/unpermute.h)

struct RowArgs {
  const void* x;           // [T, nvec] vectors
  const float* topk_prob;  // [T,k] or null
  const float* side;       // [T, side_cols] or null
  const int32_t* row_map;  // [T,k] destination rows (written by step 1)
  const int32_t* tokens;   // [L] tokens_per_expert (step 1)
  const int32_t* seg;      // [L+1] segment_starts (step 1)
  void* rows;              // [num_rows, nvec] vectors
  float* probs;            // [num_rows] or null
  float* side_rows;        // [num_rows, side_cols] or null
  int64_t num_tokens, nvec, num_rows;
  int64_t token_blocks;   // blocks [0, token_blocks) move tokens, the rest write pad rows
  int64_t num_pad_items;  // pad warps
  int top_k, num_local, align, group, side_cols;
  float side_pad_value;
};

// One warp writes the pad and tail rows of pad item p (kernels/cuda/pad_rows.cuh).
template <int VB>
__device__ __forceinline__ void fill_pad_item(const RowArgs& a, int64_t p) {
  using Vec = typename VecOf<VB>::type;
  const int lane = threadIdx.x & 31;
  auto fill_row = [&](int64_t r) {
    Vec* out = static_cast<Vec*>(a.rows) + r * a.nvec;
    for (int64_t v = lane; v < a.nvec; v += 32) out[v] = Vec{};
    if (a.probs && lane == 0) a.probs[r] = 0.f;
    if (a.side_rows)
      for (int c = lane; c < a.side_cols; c += 32) a.side_rows[r * a.side_cols + c] = a.side_pad_value;
  };
  for_each_pad_row(p, a.num_pad_items, a.seg, a.tokens, a.num_local, a.align, a.num_rows, fill_row);
}

// Blocks [0, token_blocks) hold 256 / group tokens each; the blocks after them hold 8 pad warps each
// (a warp per pad row keeps those blocks few and busy).
template <int VB>
__global__ void __launch_bounds__(kRowThreads, kRowMinBlocks) permute_rows_kernel(const RowArgs a) {
  using Vec = typename VecOf<VB>::type;
  extern __shared__ int32_t s_dest[];  // [groups per block, k]
  if (blockIdx.x >= a.token_blocks) {
    wait_for_previous_kernel();
    const int64_t p = (int64_t(blockIdx.x) - a.token_blocks) * (kRowThreads / 32) + (threadIdx.x >> 5);
    if (p < a.num_pad_items) fill_pad_item<VB>(a, p);
    return;
  }
  const int g = threadIdx.x / a.group, lane = threadIdx.x % a.group;
  const int64_t t = int64_t(blockIdx.x) * (kRowThreads / a.group) + g;
  const bool is_token = t < a.num_tokens;
  const Vec* src = static_cast<const Vec*>(a.x) + (is_token ? t : 0) * a.nvec;
  Vec buf[kUnroll];
  auto load_pass = [&](int64_t v0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * a.group + lane;
      if (v < a.nvec) buf[u] = __ldg(src + v);
    }
  };
  // x is an input, not an output of step 1: its first pass is read while the routing map finishes.
  if (is_token) load_pass(0);
  wait_for_previous_kernel();
  int32_t* dest = s_dest + g * a.top_k;
  if (is_token)
    for (int j = lane; j < a.top_k; j += a.group) {
      const int32_t r = a.row_map[t * a.top_k + j];
      dest[j] = r;
      if (a.probs && r >= 0) a.probs[r] = a.topk_prob[t * a.top_k + j];
    }
  __syncthreads();
  if (!is_token) return;
  bool routed = false;
  for (int j = 0; j < a.top_k; ++j) routed |= dest[j] >= 0;
  if (!routed) return;
  for (int64_t v0 = 0;;) {
    for (int j = 0; j < a.top_k; ++j) {
      if (dest[j] < 0) continue;
      Vec* out = static_cast<Vec*>(a.rows) + int64_t(dest[j]) * a.nvec;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * a.group + lane;
        if (v < a.nvec) out[v] = buf[u];
      }
    }
    v0 += int64_t(a.group) * kUnroll;
    if (v0 >= a.nvec) break;
    load_pass(v0);
  }
  if (a.side)
    for (int j = 0; j < a.top_k; ++j)
      if (dest[j] >= 0)
        for (int c = lane; c < a.side_cols; c += a.group)
          a.side_rows[int64_t(dest[j]) * a.side_cols + c] = a.side[t * a.side_cols + c];
}

}  // namespace
}  // namespace flowmoe
