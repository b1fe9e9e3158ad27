// MoE permute + pad on the GPU, and its backward. Layout and API: kernels/permute.h.
// topk_idx [T,k] holds global expert ids; flat entry i = t*k + j is routed to local expert e = id - expert_offset
// when 0 <= e < L. Expert e owns the buffer rows [segment_starts[e], segment_starts[e+1]): its tokens_per_expert[e]
// copies in ascending i, then pad rows up to padded_tokens_per_expert[e] = round_up(tokens_per_expert[e], align).
// Two steps on one stream, the routing map (launch_map) and the row move (launch_rows); every output row (listed
// above permute_pad_cuda) is written exactly once: no memset, no host synchronisation. The result is bit-identical
// to the CPU reference (it only moves bytes). CPU reference: kernels/cpu/permute.cpp. Tests: tests/test_permute.cpp
// (GPU vs CPU, bit for bit). bench/bench_permute.cpp measures it against the device's D2D copy bandwidth, as a
// whole and as its two steps (docs/PERF.md has the figures).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/permute_route.cuh"
#include "kernels/cuda/permute_rows.cuh"
#include "kernels/cuda/permute_rows_tma.cuh"
#include "kernels/permute.h"
#include "kernels/unpermute.h"

namespace flowmoe {

namespace {

// ---- launch helpers -----------------------------------------------------------------------------

// Threads per token: enough that one pass of kUnroll vectors per thread covers the row when it can.
int group_for(int64_t nvec) {
  if (nvec <= 32 * kUnroll) return 32;
  if (nvec <= 64 * kUnroll) return 64;
  if (nvec <= 128 * kUnroll) return 128;
  return 256;
}

// Widest vector (16, 8, 4, 2 or 1 bytes) that divides the row and both base addresses.
int vector_bytes(size_t row_bytes, const void* a, const void* b) {
  for (int vb = 16; vb > 1; vb /= 2)
    if (row_bytes % size_t(vb) == 0 && aligned_to(a, vb) && aligned_to(b, vb)) return vb;
  return 1;
}

void check_permute_args(const RoutingDims& d, const PermuteBuffers& b) {
  check_routing_dims(d);
  FLOWMOE_CHECK(d.num_local_experts <= kMaxLocalExperts, Error, "permute_pad_cuda: at most ", kMaxLocalExperts,
                " local experts, got ", d.num_local_experts);
  FLOWMOE_CHECK(d.top_k <= kMaxTopk, Error, "permute_pad_cuda: top_k at most ", kMaxTopk, ", got ", d.top_k);
  // No tokens need no x: a buffer of pad rows alone (a rank with nothing to send) is still written.
  FLOWMOE_CHECK(b.row_bytes == 0 || ((b.x || d.num_tokens == 0) && (b.rows || d.num_rows == 0)), Error,
                "permute_pad_cuda: null x or rows");
  FLOWMOE_CHECK(!b.side || b.side_rows, Error, "permute_pad_cuda: a side payload needs side_rows");
}

// route_map needs every chunk's block resident at once. One block per SM always fits (its shared
// memory is at most (8+2)*4096 ints); beyond that, ask. Its [chunks, L] sums index with int.
bool route_map_fits(int num_chunks, int num_local, size_t smem) {
  if (int64_t(num_chunks) * num_local >= INT32_MAX) return false;
  if (num_chunks <= sm_count()) return true;
  int per_sm = 0;
  FLOWMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, route_map_kernel, kCountThreads, smem));
  return int64_t(per_sm) * sm_count() >= num_chunks;
}

// ---- the two steps ------------------------------------------------------------------------------

// Step 1, the routing map (kernels/cuda/permute_route.cuh): one cooperative kernel, route_map, computes the
// counts, segment starts and the final row_map; when its blocks cannot all be resident it falls back to
// route_count + route_scan + route_finalize. Each routing kernel triggers its dependent at once
// (start_dependents), so the row kernel becomes resident and loads its first slice of x early.
// The workspace holds the per-chunk counts: [chunks, L] for route_map, [L, chunks] for the fallback.
void launch_map(const RoutingDims& d, const PermuteBuffers& b, cudaStream_t stream) {
  const int num_local = d.num_local_experts;
  const int64_t n = d.num_tokens * d.top_k;
  const int num_chunks = int((n + kChunk - 1) / kChunk);
  auto* chunk_counts = static_cast<int32_t*>(b.workspace);
  auto scan = [&] {  // with no entries, route_scan alone writes the zero counts
    launch_dependent(route_scan_kernel, 1, kScanThreads, size_t(num_local) * sizeof(int32_t), stream, chunk_counts,
                     num_chunks, num_local, d.align_size, d.num_rows, b.tokens_per_expert, b.padded_tokens_per_expert,
                     b.segment_starts);
  };
  if (n == 0) {
    scan();
    return;
  }
  const size_t map_smem = size_t(kCountWarps + 2) * num_local * sizeof(int32_t);
  allow_smem(route_map_kernel, map_smem);
  if (route_map_fits(num_chunks, num_local, map_smem)) {
    launch_ex(route_map_kernel, unsigned(num_chunks), kCountThreads, map_smem, stream, false, true, b.topk_idx, n,
              d.top_k, d.num_experts, d.expert_offset, num_local, num_chunks, d.align_size, d.num_rows, b.row_map,
              chunk_counts, b.tokens_per_expert, b.padded_tokens_per_expert, b.segment_starts);
    return;
  }
  const size_t count_smem = size_t(kCountWarps) * num_local * sizeof(int32_t);
  allow_smem(route_count_kernel, count_smem);
  route_count_kernel<<<num_chunks, kCountThreads, count_smem, stream>>>(
      b.topk_idx, n, d.top_k, d.num_experts, d.expert_offset, num_local, num_chunks, b.row_map, chunk_counts);
  FLOWMOE_CUDA_CHECK_LAUNCH();
  scan();
  launch_dependent(route_finalize_kernel, unsigned((n + kFinalizeThreads - 1) / kFinalizeThreads), kFinalizeThreads, 0,
                   stream, b.topk_idx, n, d.expert_offset, num_local, num_chunks,
                   static_cast<const int32_t*>(chunk_counts), static_cast<const int32_t*>(b.segment_starts), b.row_map);
}

template <int VB>
void launch_rows_vb(const RowArgs& a, cudaStream_t stream) {
  const int64_t pad_blocks = (a.num_pad_items + kRowThreads / 32 - 1) / (kRowThreads / 32);
  const size_t smem = size_t(kRowThreads / a.group) * a.top_k * sizeof(int32_t);
  launch_dependent(permute_rows_kernel<VB>, unsigned(a.token_blocks + pad_blocks), kRowThreads, smem, stream, a);
}

// Grid: the token blocks, or enough blocks for the pad warps when there are few tokens; every block's
// pad warps stride over the pad items.
void launch_rows_tma(const RowArgs& a, int64_t row_bytes, cudaStream_t stream) {
  TmaRowArgs ta{};
  ta.a = a;
  tma_geometry(ta, row_bytes);
  const int64_t token_blocks = (a.num_tokens + ta.tokens_per_block - 1) / ta.tokens_per_block;
  const int64_t pad_blocks = (std::min<int64_t>(a.num_pad_items, 4096) + kTmaPadWarps - 1) / kTmaPadWarps;
  const int64_t blocks = std::max<int64_t>({token_blocks, pad_blocks, 1});
  ta.num_pad_warps = blocks * kTmaPadWarps;
  const size_t smem = tma_smem_bytes(ta);
  allow_smem(permute_rows_tma_kernel, smem, true);
  launch_dependent(permute_rows_tma_kernel, unsigned(blocks), kTmaThreads, smem, stream, ta);
}

// The TMA kernel when selected (automatic: from kPermuteTmaMinRowBytes up, kernels/permute.h) and possible:
// 16-byte rows and base addresses, and an sm_90 build.
bool use_tma_rows(const PermuteBuffers& b, PermuteRowKernel row_kernel) {
  if (row_kernel == PermuteRowKernel::classic ||
      (row_kernel == PermuteRowKernel::automatic && b.row_bytes < kPermuteTmaMinRowBytes))
    return false;
  return b.x && b.row_bytes > 0 && b.row_bytes % 16 == 0 && aligned_to(b.x, 16) && aligned_to(b.rows, 16) &&
         tma_rows_supported();
}

// Step 2: the row move, after step 1 in the same stream, launched with programmatic dependent launch (PDL).
// One of two kernels (PermuteRowKernel, kernels/permute.h):
//   classic (kernels/cuda/permute_rows.cuh): permute_rows_kernel, one thread group per token, loads the token's
//     row once (16-byte vectors where the row and pointers allow) and stores it to its k destination rows; the
//     blocks after the token blocks write the pad rows and the tail.
//   tma (kernels/cuda/permute_rows_tma.cuh, sm_90, 16-byte aligned rows only): bulk copies through shared
//     memory, the block's rows loaded before the wait for the routing map.
void launch_rows(const RoutingDims& d, const PermuteBuffers& b, cudaStream_t stream, PermuteRowKernel row_kernel) {
  if (d.num_tokens == 0 && d.num_rows == 0) return;
  const bool tma = use_tma_rows(b, row_kernel);
  const int vb = tma ? 16 : vector_bytes(b.row_bytes, b.x, b.rows);
  RowArgs a{};
  a.x = b.x, a.topk_prob = b.topk_prob, a.side = b.side;
  a.row_map = b.row_map, a.tokens = b.tokens_per_expert, a.seg = b.segment_starts;
  a.rows = b.rows, a.probs = b.topk_prob ? b.probs : nullptr, a.side_rows = b.side ? b.side_rows : nullptr;
  a.num_tokens = d.num_tokens, a.nvec = int64_t(b.row_bytes) / vb, a.num_rows = d.num_rows;
  a.group = group_for(a.nvec);
  a.token_blocks = (d.num_tokens + kRowThreads / a.group - 1) / (kRowThreads / a.group);
  a.num_pad_items = pad_item_count(d.num_local_experts, d.align_size, d.num_rows);
  a.top_k = d.top_k, a.num_local = d.num_local_experts, a.align = d.align_size;
  a.side_cols = b.side ? b.side_cols : 0, a.side_pad_value = b.side_pad_value;
  if (tma) return launch_rows_tma(a, int64_t(b.row_bytes), stream);
  switch (vb) {
    case 16:
      return launch_rows_vb<16>(a, stream);
    case 8:
      return launch_rows_vb<8>(a, stream);
    case 4:
      return launch_rows_vb<4>(a, stream);
    case 2:
      return launch_rows_vb<2>(a, stream);
    default:
      return launch_rows_vb<1>(a, stream);
  }
}

// d_topk_prob[i] = d_probs[row_map[i]] for the flat entries i of [T,k]; 0 where not routed here.
__global__ void gather_probs_kernel(const int32_t* __restrict__ row_map /*[T*k]*/, int64_t n,
                                    const float* __restrict__ d_probs /*[num_rows]*/,
                                    float* __restrict__ d_topk_prob /*[T*k]*/) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int32_t r = row_map[i];
  d_topk_prob[i] = r >= 0 ? d_probs[r] : 0.f;
}

}  // namespace

// ---- public launchers ---------------------------------------------------------------------------

size_t permute_workspace_bytes(const RoutingDims& d) {
  const int64_t chunks = (d.num_tokens * d.top_k + kChunk - 1) / kChunk;
  return size_t(chunks) * size_t(d.num_local_experts) * sizeof(int32_t);
}

// Outputs:
//   row_map [T,k]           destination row of entry i, -1 when not routed here
//   rows    [num_rows, H]   rows[row_map[t,j]] = x[t]; pad rows and the tail past segment_starts[L] are 0
//   probs   [num_rows]      probs[row_map[t,j]] = topk_prob[t,j]; 0 elsewhere
//   side_rows [num_rows, C] side[t] moved like rows; side_pad_value elsewhere (FP8 scale_inv)
void permute_pad_cuda(const RoutingDims& d, const PermuteBuffers& b, cudaStream_t stream, PermuteRowKernel row_kernel) {
  check_permute_args(d, b);
  launch_map(d, b, stream);
  launch_rows(d, b, stream, row_kernel);
}

void permute_map_cuda(const RoutingDims& d, const PermuteBuffers& b, cudaStream_t stream) {
  check_permute_args(d, b);
  launch_map(d, b, stream);
}

void permute_rows_cuda(const RoutingDims& d, const PermuteBuffers& b, cudaStream_t stream,
                       PermuteRowKernel row_kernel) {
  check_permute_args(d, b);
  launch_rows(d, b, stream, row_kernel);
}

// d_x[t] = sum_j d_rows[row_map[t,j]] is the unpermute with weights 1 (unpermute_cuda, kernels/cuda/unpermute.cu:
// fmaf(1, x, acc) rounds as acc + x, so fp32, j ascending, one rounding, as the CPU reference); d_topk_prob is a
// gather of d_probs (gather_probs_kernel).
void permute_backward_cuda(DType dtype, const int32_t* row_map, int64_t num_tokens, int top_k, int64_t hidden,
                           const void* d_rows, const float* d_probs, void* d_x, float* d_topk_prob,
                           cudaStream_t stream) {
  FLOWMOE_CHECK(top_k >= 1 && top_k <= kMaxTopk, Error, "permute_backward_cuda: top_k must be in [1, ", kMaxTopk,
                "], got ", top_k);
  if (num_tokens == 0) return;  // no token gets a gradient (an empty d_x may be null beside a worst-case d_rows)
  FLOWMOE_CHECK(bool(d_x) == bool(d_rows) && bool(d_topk_prob) == bool(d_probs), Error,
                "permute_backward_cuda: d_x and d_rows (and d_topk_prob and d_probs) go together");
  if (d_x) unpermute_cuda(dtype, row_map, num_tokens, top_k, hidden, d_rows, nullptr, d_x, stream);
  if (d_topk_prob) {
    const int64_t n = num_tokens * top_k;
    gather_probs_kernel<<<unsigned((n + kRowThreads - 1) / kRowThreads), kRowThreads, 0, stream>>>(row_map, n, d_probs,
                                                                                                   d_topk_prob);
    FLOWMOE_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace flowmoe
