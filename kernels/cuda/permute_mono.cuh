// permute_mono: the whole permute_pad in one cooperative launch (kernels/cuda/permute.cu includes this;
// layout in kernels/permute.h). A grid of at most SMs x occupancy blocks, all resident:
//   phase 0: each thread group reads the first pass of its first token (x is an input)
//   phase 1: block b counts chunks b, b+G, ... as route_count does (row_map gets ranks inside the
//            chunk; the counts are chunk-major)
//   grid barrier
//   phase 2: blocks b < chunks sum the counts and scan the padded totals themselves (block 0 writes the
//            per-expert outputs), then finalise the row_map entries of their chunks
//   grid barrier
//   phase 3: the persistent row move and the pad rows (persistent_rows in permute_rows.cuh)
// It saves the launches and kernel boundaries of the split paths (host launch latency and the
// programmatic-launch hand-over) for two grid barriers.
#pragma once
#include <cooperative_groups.h>

#include <cstdint>

#include "kernels/cuda/permute_route.cuh"
#include "kernels/cuda/permute_rows.cuh"

namespace flowmoe {
namespace {

struct MonoArgs {
  int64_t n;                           // T*k flat entries
  int num_experts;
  int32_t* counts;                     // [num_chunks, L] workspace
  int32_t* tokens_per_expert;          // [L]
  int32_t* padded_tokens_per_expert;   // [L]
  int32_t* segment_starts;             // [L+1]
};

// Shared memory: [8, L] histogram (phase 2 reuses its first L ints for the segment starts), [L] totals,
// [L] per-chunk bases.
template <int VB, bool kStream>
__global__ void __launch_bounds__(kRowThreads) permute_mono_kernel(const RowArgs a, const MonoArgs m) {
  extern __shared__ int32_t s_mem[];
  __shared__ int32_t s_scratch[32];
  const int num_local = a.num_local;
  int32_t* s_hist = s_mem;
  int32_t* s_total = s_mem + kCountWarps * num_local;
  int32_t* s_base = s_total + num_local;
  int32_t* s_seg = s_hist;
  auto grid = cooperative_groups::this_grid();

  typename VecOf<VB>::type cur[kPersistUnroll];
  persistent_prefetch<VB, kStream>(a, cur);

  for (int c = blockIdx.x; c < a.num_chunks; c += gridDim.x) {
    int expert[kCountRounds], rank[kCountRounds];
    count_chunk(c, a.topk_idx, m.n, a.topk, m.num_experts, a.expert_offset, num_local, s_hist, m.counts, 1, num_local,
                expert, rank);
    const int64_t base = chunk_entry_base(c);
    const int32_t* my_hist = s_hist + (threadIdx.x >> 5) * num_local;
#pragma unroll
    for (int r = 0; r < kCountRounds; ++r) {
      const int64_t i = base + r * 32;
      if (i < m.n) a.row_map[i] = expert[r] >= 0 ? my_hist[expert[r]] + rank[r] : -1;
    }
    __syncthreads();  // the next count_chunk clears s_hist
  }
  grid.sync();  // every chunk's counts and ranks are written

  if (blockIdx.x < a.num_chunks) {  // block-uniform: the barriers inside are safe
    for (int e = threadIdx.x; e < num_local; e += blockDim.x) s_total[e] = s_seg[e] = 0;
    __syncthreads();
    sum_chunk_counts(m.counts, a.num_chunks, num_local, 0, s_total, s_base);  // chunk 0: s_base untouched
    __syncthreads();
    scan_padded_totals(s_total, num_local, a.align, a.num_rows, blockIdx.x == 0, m.tokens_per_expert,
                       m.padded_tokens_per_expert, m.segment_starts, s_seg, s_scratch);
    __syncthreads();
    for (int c = blockIdx.x; c < a.num_chunks; c += gridDim.x) {
      for (int e = threadIdx.x; e < num_local; e += blockDim.x) s_base[e] = s_seg[e];
      __syncthreads();
      sum_chunk_counts(m.counts, a.num_chunks, num_local, c, nullptr, s_base);
      __syncthreads();
      // The same thread wrote these ranks in phase 1 (same chunk, same entries): no barrier needed.
      const int64_t base = chunk_entry_base(c);
#pragma unroll
      for (int r = 0; r < kCountRounds; ++r) {
        const int64_t i = base + r * 32;
        if (i < m.n) {
          const int e = __ldg(a.topk_idx + i) - a.expert_offset;
          if (e >= 0 && e < num_local) a.row_map[i] += s_base[e];
        }
      }
      __syncthreads();  // s_base is rewritten for the next chunk
    }
  }
  grid.sync();  // the final row_map and the per-expert outputs are written

  persistent_rows<VB, kStream, true>(a, cur);
}

}  // namespace
}  // namespace flowmoe
