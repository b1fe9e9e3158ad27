// Row-move kernels of permute_pad (kernels/cuda/permute.cu includes this; layout in kernels/permute.h).
//   permute_rows:            one thread group per token loads its row once (VB-byte vectors, U per thread
//                            per pass) and stores it to its k destinations; the blocks after the token
//                            blocks write the pad rows and the tail. kFinalMap: row_map already holds the
//                            destination rows (route_map / route_finalize); otherwise it holds the rank
//                            inside the chunk and this kernel finalises it (the original three-launch path).
//   permute_rows_persistent: a grid of SMs x occupancy blocks; each group walks its tokens and loads the
//                            next token's vectors (and rows) before storing the current ones, then its
//                            warps fill pad rows. Needs the final row_map; no shared memory, no barriers.
//                            Its body is also the last phase of permute_mono (kernels/cuda/permute_mono.cuh).
// kStream (16-byte vectors only): x is read with ld.global.nc.L1::no_allocate.L2::256B and the rows are
// written with st.global.cs (evict-first): the outputs are ~8x the inputs and are not read back here.
#pragma once
#include <cstdint>

#include "kernels/cuda/permute_route.cuh"

namespace flowmoe {
namespace {

constexpr int kRowThreads = 256;  // blocks of the row kernels hold 256 / group thread groups
constexpr int kMaxTopk = 1024;    // permute_rows keeps [groups][k] ints in shared memory
constexpr int kDestRegs = 8;      // the persistent kernel keeps the first 8 destinations in registers

template <int VB>
struct VecOf;
template <>
struct VecOf<16> { using type = uint4; };
template <>
struct VecOf<8> { using type = uint2; };
template <>
struct VecOf<4> { using type = unsigned int; };
template <>
struct VecOf<2> { using type = unsigned short; };
template <>
struct VecOf<1> { using type = unsigned char; };

template <int VB, bool kStream>
__device__ __forceinline__ typename VecOf<VB>::type load_vec(const typename VecOf<VB>::type* p) {
  if constexpr (kStream && VB == 16) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
  } else {
    return __ldg(p);
  }
}

template <int VB, bool kStream>
__device__ __forceinline__ void store_vec(typename VecOf<VB>::type* p, const typename VecOf<VB>::type& v) {
  if constexpr (kStream && VB == 16)
    __stcs(p, v);
  else
    *p = v;
}

struct RowArgs {
  const int32_t* topk_idx;       // [T,k]
  const void* x;                 // [T, nvec] vectors
  const float* topk_prob;        // [T,k] or null
  const float* side;             // [T, side_cols] or null
  const int32_t* chunk_offsets;  // [L, num_chunks] (not read with a final row_map)
  const int32_t* tokens;         // [L]
  const int32_t* seg;            // [L+1]
  void* rows;                    // [num_rows, nvec] vectors
  float* probs;                  // [num_rows] or null
  float* side_rows;              // [num_rows, side_cols] or null
  int32_t* row_map;              // [T,k]: the destination row (final map), or the rank inside the chunk
  int64_t num_tokens, nvec, num_rows, token_blocks, num_pad_items;
  int topk, expert_offset, num_local, align, num_chunks, group, side_cols;
  float side_pad_value;
};

// Pad item p < L*(align-1) is pad slot (e, q) = divmod(p, align-1), written when that row exists; then
// item p strides over the tail rows [seg[L], num_rows). One warp per item.
template <int VB, bool kStream, bool kCoherent = false>
__device__ __forceinline__ void fill_pad_item(const RowArgs& a, int64_t p) {
  using Vec = typename VecOf<VB>::type;
  const int lane = threadIdx.x & 31;
  Vec* rows = static_cast<Vec*>(a.rows);
  auto fill_row = [&](int64_t r) {
    const Vec zero{};
    Vec* out = rows + r * a.nvec;
    for (int64_t v = lane; v < a.nvec; v += 32) store_vec<VB, kStream>(out + v, zero);
    if (a.probs && lane == 0) a.probs[r] = 0.f;
    if (a.side_rows)
      for (int c = lane; c < a.side_cols; c += 32) a.side_rows[r * a.side_cols + c] = a.side_pad_value;
  };
  auto load = [](const int32_t* q) {  // kCoherent: written earlier in this kernel (permute_mono)
    if constexpr (kCoherent)
      return __ldcg(q);
    else
      return *q;
  };
  const int slots = a.align - 1;  // an expert has at most align-1 pad rows
  if (p < int64_t(a.num_local) * slots) {
    const int e = int(p / slots), q = int(p % slots);
    const int64_t r = int64_t(load(a.seg + e)) + load(a.tokens + e) + q;
    if (r < load(a.seg + e + 1)) fill_row(r);
  }
  for (int64_t r = load(a.seg + a.num_local) + p; r < a.num_rows; r += a.num_pad_items) fill_row(r);
}

// Blocks resident per SM that the variants ask the register allocator for: 5 is what the base kernel
// gets unasked (48 registers), so a variant is not slower only for holding fewer blocks.
template <int U, bool kStream, bool kFinalMap>
constexpr int kRowMinBlocks = (kStream || kFinalMap || U != 4) ? (U == 4 ? 5 : 4) : 0;

// Blocks [0, token_blocks) hold 256 / group tokens each. The blocks after them hold 8 pad warps each
// (a warp per pad row keeps those blocks few and busy).
template <int VB, int U, bool kStream, bool kFinalMap>
__global__ void __launch_bounds__(kRowThreads, (kRowMinBlocks<U, kStream, kFinalMap>))
    permute_rows_kernel(const RowArgs a) {
  using Vec = typename VecOf<VB>::type;
  extern __shared__ int32_t s_dest[];  // [groups per block, k]
  Vec* rows = static_cast<Vec*>(a.rows);
  if (blockIdx.x >= a.token_blocks) {
    wait_for_previous_kernel();
    const int64_t p = (int64_t(blockIdx.x) - a.token_blocks) * (kRowThreads / 32) + (threadIdx.x >> 5);
    if (p < a.num_pad_items) fill_pad_item<VB, kStream>(a, p);
    return;
  }
  const int g = threadIdx.x / a.group, lane = threadIdx.x % a.group;
  const int64_t item = int64_t(blockIdx.x) * (blockDim.x / a.group) + g;
  const bool is_token = item < a.num_tokens;
  const int64_t step = int64_t(a.group) * U;
  const Vec* src = static_cast<const Vec*>(a.x) + (is_token ? item : 0) * a.nvec;
  Vec buf[U];
  auto load_pass = [&](int64_t v0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + u * a.group + lane;
      if (v < a.nvec) buf[u] = load_vec<VB, kStream>(src + v);
    }
  };
  // x was written before route_count ran, so its first pass is read while the routing map finishes.
  if (is_token) load_pass(0);
  wait_for_previous_kernel();
  int32_t* dest = s_dest + g * a.topk;
  if (is_token) {
    for (int j = lane; j < a.topk; j += a.group) {
      const int64_t i = item * a.topk + j;
      int32_t r;
      if constexpr (kFinalMap) {
        r = a.row_map[i];
      } else {
        const int e = a.topk_idx[i] - a.expert_offset;
        r = -1;
        if (e >= 0 && e < a.num_local)
          r = a.seg[e] + a.chunk_offsets[int64_t(e) * a.num_chunks + i / kChunk] + a.row_map[i];
        a.row_map[i] = r;
      }
      dest[j] = r;
      if (a.probs && r >= 0) a.probs[r] = a.topk_prob[i];
    }
  }
  __syncthreads();
  if (!is_token) return;
  bool routed = false;
  for (int j = 0; j < a.topk; ++j) routed |= dest[j] >= 0;
  if (!routed) return;
  for (int64_t v0 = 0;;) {
    for (int j = 0; j < a.topk; ++j) {
      const int32_t r = dest[j];
      if (r < 0) continue;
      Vec* out = rows + int64_t(r) * a.nvec;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t v = v0 + u * a.group + lane;
        if (v < a.nvec) store_vec<VB, kStream>(out + v, buf[u]);
      }
    }
    v0 += step;
    if (v0 >= a.nvec) break;
    load_pass(v0);
  }
  if (a.side)
    for (int j = 0; j < a.topk; ++j)
      if (dest[j] >= 0)
        for (int c = lane; c < a.side_cols; c += a.group)
          a.side_rows[int64_t(dest[j]) * a.side_cols + c] = a.side[item * a.side_cols + c];
}

// ---- persistent row move (permute_rows_persistent, and the last phase of permute_mono) ------------
// Group g of block b takes tokens b*groups + g, then + gridDim.x*groups, ...; each token in passes of
// group*4 vectors. While the stores of one (token, pass) are issued, the loads of the next are in
// flight. kCoherent: row_map, seg and tokens were written earlier in this same kernel (permute_mono),
// so they are read through L2 (__ldcg), never the read-only path.
constexpr int kPersistUnroll = 4;

template <bool kCoherent>
__device__ __forceinline__ int32_t load_map(const int32_t* p) {
  if constexpr (kCoherent)
    return __ldcg(p);
  else
    return __ldg(p);
}

template <int VB, bool kStream>
__device__ __forceinline__ void load_token_pass(const RowArgs& a, int64_t t, int64_t v0,
                                                typename VecOf<VB>::type (&buf)[kPersistUnroll]) {
  const auto* x = static_cast<const typename VecOf<VB>::type*>(a.x) + t * a.nvec;
  const int lane = threadIdx.x % a.group;
#pragma unroll
  for (int u = 0; u < kPersistUnroll; ++u) {
    const int64_t v = v0 + u * a.group + lane;
    if (v < a.nvec) buf[u] = load_vec<VB, kStream>(x + v);
  }
}

// The first pass of the group's first token: x is an input, so this may run before any wait.
template <int VB, bool kStream>
__device__ __forceinline__ void persistent_prefetch(const RowArgs& a, typename VecOf<VB>::type (&cur)[kPersistUnroll]) {
  const int64_t t = int64_t(blockIdx.x) * (kRowThreads / a.group) + threadIdx.x / a.group;
  if (t < a.num_tokens) load_token_pass<VB, kStream>(a, t, 0, cur);
}

// The rest, once row_map holds the destination rows: every token of the group, then the pad rows.
template <int VB, bool kStream, bool kCoherent>
__device__ __forceinline__ void persistent_rows(const RowArgs& a, typename VecOf<VB>::type (&cur)[kPersistUnroll]) {
  using Vec = typename VecOf<VB>::type;
  constexpr int U = kPersistUnroll;
  Vec* rows = static_cast<Vec*>(a.rows);
  const int groups = kRowThreads / a.group, g = threadIdx.x / a.group, lane = threadIdx.x % a.group;
  const int64_t token_stride = int64_t(gridDim.x) * groups, step = int64_t(a.group) * U;
  auto load_dest = [&](int32_t (&r)[kDestRegs], int64_t t) {
#pragma unroll
    for (int j = 0; j < kDestRegs; ++j) r[j] = j < a.topk ? load_map<kCoherent>(a.row_map + t * a.topk + j) : -1;
  };
  auto store_row = [&](const Vec (&buf)[U], int32_t r, int64_t v0) {
    if (r < 0) return;
    Vec* out = rows + int64_t(r) * a.nvec;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + u * a.group + lane;
      if (v < a.nvec) store_vec<VB, kStream>(out + v, buf[u]);
    }
  };
  int64_t t = int64_t(blockIdx.x) * groups + g, v0 = 0;
  int32_t dest[kDestRegs];
  if (t < a.num_tokens) load_dest(dest, t);
  while (t < a.num_tokens) {
    int64_t next_t = t, next_v0 = v0 + step;
    if (next_v0 >= a.nvec) next_t += token_stride, next_v0 = 0;
    Vec next[U];
    int32_t next_dest[kDestRegs];
    if (next_t < a.num_tokens) {
      load_token_pass<VB, kStream>(a, next_t, next_v0, next);
      if (next_t != t) {
        load_dest(next_dest, next_t);
      } else {
#pragma unroll
        for (int j = 0; j < kDestRegs; ++j) next_dest[j] = dest[j];
      }
    }
    const int32_t* map = a.row_map + t * a.topk;
#pragma unroll
    for (int j = 0; j < kDestRegs; ++j) store_row(cur, dest[j], v0);
    for (int j = kDestRegs; j < a.topk; ++j) store_row(cur, load_map<kCoherent>(map + j), v0);
    if (v0 == 0) {  // once per token: its probs and side payload
      for (int j = lane; j < a.topk; j += a.group) {
        const int32_t r = load_map<kCoherent>(map + j);
        if (a.probs && r >= 0) a.probs[r] = a.topk_prob[t * a.topk + j];
      }
      if (a.side)
        for (int j = 0; j < a.topk; ++j) {
          const int32_t r = load_map<kCoherent>(map + j);
          if (r >= 0)
            for (int c = lane; c < a.side_cols; c += a.group)
              a.side_rows[int64_t(r) * a.side_cols + c] = a.side[t * a.side_cols + c];
        }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) cur[u] = next[u];
#pragma unroll
    for (int j = 0; j < kDestRegs; ++j) dest[j] = next_dest[j];
    t = next_t, v0 = next_v0;
  }
  const int64_t num_warps = int64_t(gridDim.x) * (kRowThreads / 32);
  for (int64_t p = int64_t(blockIdx.x) * (kRowThreads / 32) + (threadIdx.x >> 5); p < a.num_pad_items; p += num_warps)
    fill_pad_item<VB, kStream, kCoherent>(a, p);
}

// A grid of at most SMs x occupancy blocks (fewer when there is less work). Needs the final row_map.
template <int VB, bool kStream>
__global__ void __launch_bounds__(kRowThreads) permute_rows_persistent_kernel(const RowArgs a) {
  typename VecOf<VB>::type cur[kPersistUnroll];
  persistent_prefetch<VB, kStream>(a, cur);  // read while the routing map finishes
  wait_for_previous_kernel();
  persistent_rows<VB, kStream, false>(a, cur);
}

}  // namespace
}  // namespace flowmoe
