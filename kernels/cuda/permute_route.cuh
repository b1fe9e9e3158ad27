// permute_pad, step 1: the routing map (kernels/cuda/permute.cu includes this; layout in kernels/permute.h).
// The n = T*k flat entries of topk_idx are cut into chunks of kChunk = 2048, one 256-thread block each.
// Entry i of chunk c routed to local expert e goes to
//   row_map[i] = segment_starts[e] + (copies of e in chunks 0..c-1) + (rank of i among the copies of e in c)
//   segment_starts[e] = sum over e' < e of round_up(tokens_per_expert[e'], align)
// so every expert's copies keep ascending flat-index order (the CPU reference's order). route_map_kernel does it
// in one cooperative launch; three kernels are the fallback. Tests: tests/test_permute.cpp (both paths).
#pragma once
#include <cooperative_groups.h>

#include <cstdint>
#include <cstdio>

namespace flowmoe {
namespace {

constexpr int kCountThreads = 256, kCountWarps = kCountThreads / 32, kCountRounds = 8;
constexpr int kChunk = kCountThreads * kCountRounds;  // flat entries per chunk (per counting block)
constexpr int kScanThreads = 1024;
constexpr int kFinalizeThreads = 256;
constexpr int kMaxLocalExperts = 4096;  // the counting blocks keep [8][L] ints in shared memory

// Programmatic dependent launch (sm_90). A kernel launched with launch_dependent may start while the
// previous kernel in the stream still runs; it waits here before reading that kernel's outputs.
// Launched normally, this is a no-op.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel (launched with launch_dependent) start now rather than when this grid exits:
// its blocks become resident and read their inputs (the row move: its first slice of x) while this
// kernel runs. Correctness does not depend on it: the dependent still waits for this grid to finish.
__device__ __forceinline__ void start_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

__device__ __forceinline__ int warp_inclusive_scan(int v) {
  const int lane = threadIdx.x & 31;
  for (int o = 1; o < 32; o <<= 1) {
    int u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

// Inclusive scan over the block (blockDim.x a multiple of 32); scratch holds 32 ints.
__device__ __forceinline__ int block_inclusive_scan(int v, int* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  v = warp_inclusive_scan(v);
  if (lane == 31) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int w = lane < num_warps ? scratch[lane] : 0;
    w = warp_inclusive_scan(w);
    if (lane < num_warps) scratch[lane] = w;
  }
  __syncthreads();
  return warp > 0 ? v + scratch[warp - 1] : v;
}

// Step 1 for chunk `chunk`. Warp w owns entries [w*R*32, (w+1)*R*32) of the chunk and walks them in R
// rounds of 32, keeping a running count per expert in s_hist[w]; afterwards s_hist[w][e] is the
// exclusive offset of warp w's copies of e inside the chunk, and the chunk's count of e is written to
// counts[e * stride_e + chunk * stride_c]. expert[r] gets the local expert of this thread's entry of
// round r (-1: not routed here), rank[r] its rank among its warp's copies of that expert. An id outside
// [0, num_experts) prints the culprit and traps.
__device__ __forceinline__ void count_chunk(int chunk, const int32_t* __restrict__ topk_idx, int64_t n, int top_k,
                                            int num_experts, int expert_offset, int num_local, int32_t* s_hist,
                                            int32_t* __restrict__ counts, int64_t stride_e, int64_t stride_c,
                                            int (&expert)[kCountRounds], int (&rank)[kCountRounds]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t base = int64_t(chunk) * kChunk + int64_t(warp) * kCountRounds * 32;
  int id[kCountRounds];
#pragma unroll
  for (int r = 0; r < kCountRounds; ++r) {  // all loads first, so they are in flight together
    const int64_t i = base + r * 32 + lane;
    id[r] = i < n ? __ldg(topk_idx + i) : 0;
  }
  for (int i = threadIdx.x; i < kCountWarps * num_local; i += blockDim.x) s_hist[i] = 0;
  __syncthreads();
  int32_t* my_hist = s_hist + warp * num_local;
  const unsigned lanes_below = (1u << lane) - 1;
#pragma unroll
  for (int r = 0; r < kCountRounds; ++r) {
    const int64_t i = base + r * 32 + lane;
    int e = -1;
    if (i < n) {
      if (id[r] < 0 || id[r] >= num_experts) {
        printf("permute_pad: topk_idx[%lld, %d] = %d (token %lld) is not an expert id in [0, %d)\n",
               (long long)(i / top_k), int(i % top_k), id[r], (long long)(i / top_k), num_experts);
        __trap();
      }
      e = id[r] - expert_offset;
      if (e < 0 || e >= num_local) e = -1;  // an expert of another rank
    }
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int before = e >= 0 ? my_hist[e] : 0;  // copies of e in this warp's earlier rounds
    __syncwarp();
    if (e >= 0 && (peers & lanes_below) == 0) my_hist[e] = before + __popc(peers);  // first lane of the group
    __syncwarp();
    expert[r] = e;
    rank[r] = before + __popc(peers & lanes_below);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) {
    int run = 0;
    for (int w = 0; w < kCountWarps; ++w) {
      const int c = s_hist[w * num_local + e];
      s_hist[w * num_local + e] = run;
      run += c;
    }
    counts[int64_t(e) * stride_e + int64_t(chunk) * stride_c] = run;
  }
  __syncthreads();
}

// The flat entry of this thread's round 0 in `chunk` (round r adds r*32), as count_chunk walks them.
__device__ __forceinline__ int64_t chunk_entry_base(int chunk) {
  return int64_t(chunk) * kChunk + int64_t(threadIdx.x >> 5) * kCountRounds * 32 + (threadIdx.x & 31);
}

// Step 2, after the grid barrier, over the chunk-major counts [num_chunks, L] that other blocks wrote
// (hence __ldcg): s_total[e] += all chunks' counts of e, s_base[e] += those of the chunks before
// `chunk`. Shared atomics on ints: their order does not change the sums.
__device__ __forceinline__ void sum_chunk_counts(const int32_t* __restrict__ counts, int num_chunks, int num_local,
                                                 int chunk, int32_t* s_total, int32_t* s_base) {
  const int m = num_chunks * num_local;
  for (int i0 = threadIdx.x; i0 < m; i0 += 4 * int(blockDim.x)) {
    int v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {  // four loads in flight before the atomics
      const int i = i0 + u * int(blockDim.x);
      v[u] = i < m ? __ldcg(counts + i) : 0;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = i0 + u * int(blockDim.x);
      if (v[u] == 0) continue;
      const int c = i / num_local, e = i - c * num_local;
      atomicAdd(&s_total[e], v[u]);
      if (c < chunk) atomicAdd(&s_base[e], v[u]);
    }
  }
}

// Step 3: exclusive scan of the padded totals over the block; s_start[e] (when not null) += the segment
// start of e. With `write`, also the per-expert outputs and the check that the buffer holds the padded
// total (else it prints both and traps).
__device__ __forceinline__ void scan_padded_totals(const int32_t* s_total, int num_local, int align, int64_t num_rows,
                                                   bool write, int32_t* __restrict__ tokens_per_expert,
                                                   int32_t* __restrict__ padded_tokens_per_expert,
                                                   int32_t* __restrict__ segment_starts, int32_t* s_start,
                                                   int32_t* s_scratch) {
  const int per_thread = (num_local + blockDim.x - 1) / blockDim.x;
  const int e0 = min(int(threadIdx.x) * per_thread, num_local), e1 = min(e0 + per_thread, num_local);
  int sum = 0;
  for (int e = e0; e < e1; ++e) sum += (s_total[e] + align - 1) / align * align;
  const int inclusive = block_inclusive_scan(sum, s_scratch);
  int run = inclusive - sum;
  for (int e = e0; e < e1; ++e) {
    const int total = s_total[e], padded = (total + align - 1) / align * align;
    if (write) {
      tokens_per_expert[e] = total;
      padded_tokens_per_expert[e] = padded;
      segment_starts[e] = run;
    }
    if (s_start) s_start[e] += run;
    run += padded;
  }
  if (write && threadIdx.x == blockDim.x - 1) {
    segment_starts[num_local] = inclusive;
    if (inclusive > num_rows) {
      printf("permute_pad: the padded experts need %d rows but the buffer has %lld\n", inclusive, (long long)num_rows);
      __trap();
    }
  }
}

// ---- the normal path: one cooperative kernel ----------------------------------------------------

// Cooperative launch, one block per chunk, all resident at once:
//   1. count_chunk: the chunk's histogram of local experts and each entry's rank inside the chunk
//   2. grid barrier; every block sums the [chunks, L] counts itself (a few KiB from L2): the totals,
//      and the counts of the chunks before its own
//   3. scan_padded_totals: segment starts from the padded totals (block 0 writes the per-expert outputs)
//   4. the chunk's row_map entries
// Shared memory: [8, L] histogram, [L] totals, [L] bases.
__global__ void __launch_bounds__(kCountThreads)
    route_map_kernel(const int32_t* __restrict__ topk_idx /*[n]*/, int64_t n, int top_k, int num_experts,
                     int expert_offset, int num_local, int num_chunks, int align, int64_t num_rows,
                     int32_t* __restrict__ row_map /*[n]*/, int32_t* __restrict__ chunk_counts /*[num_chunks, L]*/,
                     int32_t* __restrict__ tokens_per_expert /*[L]*/,
                     int32_t* __restrict__ padded_tokens_per_expert /*[L]*/,
                     int32_t* __restrict__ segment_starts /*[L+1]*/) {
  extern __shared__ int32_t s_mem[];
  __shared__ int32_t s_scratch[32];
  int32_t* s_hist = s_mem;                             // [kCountWarps, L]
  int32_t* s_total = s_mem + kCountWarps * num_local;  // [L]
  int32_t* s_base = s_total + num_local;               // [L]
  start_dependents();
  int expert[kCountRounds], rank[kCountRounds];
  count_chunk(int(blockIdx.x), topk_idx, n, top_k, num_experts, expert_offset, num_local, s_hist, chunk_counts, 1,
              num_local, expert, rank);
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) s_total[e] = s_base[e] = 0;
  cooperative_groups::this_grid().sync();  // every chunk's counts are written (and visible)
  sum_chunk_counts(chunk_counts, num_chunks, num_local, int(blockIdx.x), s_total, s_base);
  __syncthreads();
  scan_padded_totals(s_total, num_local, align, num_rows, blockIdx.x == 0, tokens_per_expert, padded_tokens_per_expert,
                     segment_starts, s_base, s_scratch);
  __syncthreads();
  const int64_t base = chunk_entry_base(int(blockIdx.x));
  const int32_t* my_hist = s_hist + (threadIdx.x >> 5) * num_local;
#pragma unroll
  for (int r = 0; r < kCountRounds; ++r) {
    const int64_t i = base + r * 32;
    if (i < n) row_map[i] = expert[r] >= 0 ? s_base[expert[r]] + my_hist[expert[r]] + rank[r] : -1;
  }
}

// ---- the fallback: three kernels ----------------------------------------------------------------
// When the chunks cannot all be resident (very many chunks, or a large L): the same steps as three kernels,
// chained with programmatic dependent launch: route_count (1; row_map keeps the rank inside the chunk),
// route_scan (2 and 3 in one block; each chunk's offset inside its expert is written over its count),
// route_finalize (4: adds the offsets).

// One block per chunk. row_map gets each routed entry's rank inside its chunk, -1 elsewhere.
__global__ void __launch_bounds__(kCountThreads)
    route_count_kernel(const int32_t* __restrict__ topk_idx /*[n]*/, int64_t n, int top_k, int num_experts,
                       int expert_offset, int num_local, int num_chunks, int32_t* __restrict__ row_map /*[n]*/,
                       int32_t* __restrict__ chunk_counts /*[L, num_chunks]*/) {
  extern __shared__ int32_t s_hist[];  // [kCountWarps, L]
  start_dependents();
  int expert[kCountRounds], rank[kCountRounds];
  count_chunk(int(blockIdx.x), topk_idx, n, top_k, num_experts, expert_offset, num_local, s_hist, chunk_counts,
              num_chunks, 1, expert, rank);
  const int64_t base = chunk_entry_base(int(blockIdx.x));
  const int32_t* my_hist = s_hist + (threadIdx.x >> 5) * num_local;
#pragma unroll
  for (int r = 0; r < kCountRounds; ++r) {
    const int64_t i = base + r * 32;
    if (i < n) row_map[i] = expert[r] >= 0 ? my_hist[expert[r]] + rank[r] : -1;
  }
}

// One block. Warp per expert: lanes own contiguous runs of chunks, so a warp scan gives each chunk's
// offset inside its expert (written over its count) and the expert's total. Then step 3.
// With no entries (num_chunks 0) it alone writes the (zero) per-expert outputs.
__global__ void __launch_bounds__(kScanThreads)
    route_scan_kernel(int32_t* __restrict__ chunk_counts /*[L, num_chunks]*/, int num_chunks, int num_local, int align,
                      int64_t num_rows, int32_t* __restrict__ tokens_per_expert /*[L]*/,
                      int32_t* __restrict__ padded_tokens_per_expert /*[L]*/,
                      int32_t* __restrict__ segment_starts /*[L+1]*/) {
  extern __shared__ int32_t s_total[];  // [L]
  __shared__ int32_t s_scratch[32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, num_warps = blockDim.x >> 5;
  const int per_lane = (num_chunks + 31) / 32;
  start_dependents();
  wait_for_previous_kernel();  // chunk_counts come from route_count
  for (int e = warp; e < num_local; e += num_warps) {
    int32_t* counts = chunk_counts + int64_t(e) * num_chunks;
    const int c0 = min(lane * per_lane, num_chunks), c1 = min(c0 + per_lane, num_chunks);
    int sum = 0;
    for (int c = c0; c < c1; ++c) sum += counts[c];
    const int inclusive = warp_inclusive_scan(sum);
    int run = inclusive - sum;
    for (int c = c0; c < c1; ++c) {
      const int v = counts[c];
      counts[c] = run;
      run += v;
    }
    if (lane == 31) s_total[e] = inclusive;
  }
  __syncthreads();
  scan_padded_totals(s_total, num_local, align, num_rows, true, tokens_per_expert, padded_tokens_per_expert,
                     segment_starts, nullptr, s_scratch);
}

// The rank that route_count left in row_map becomes the destination row.
__global__ void __launch_bounds__(kFinalizeThreads)
    route_finalize_kernel(const int32_t* __restrict__ topk_idx /*[n]*/, int64_t n, int expert_offset, int num_local,
                          int num_chunks, const int32_t* __restrict__ chunk_offsets /*[L, num_chunks]*/,
                          const int32_t* __restrict__ segment_starts /*[L+1]*/, int32_t* __restrict__ row_map /*[n]*/) {
  start_dependents();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int id = i < n ? __ldg(topk_idx + i) : 0;  // an input: read while route_scan finishes
  wait_for_previous_kernel();
  if (i >= n) return;
  const int e = id - expert_offset;
  if (e >= 0 && e < num_local) row_map[i] += segment_starts[e] + chunk_offsets[int64_t(e) * num_chunks + i / kChunk];
}

}  // namespace
}  // namespace flowmoe
