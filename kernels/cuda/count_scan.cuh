// The per-expert row counts read on the device: one block of kCountScanThreads threads (one per expert)
// turns r = counts[0..E) into the prefix sums
//   off[e] = Σ_{i<e} r_i      blk[e] = Σ_{i<e} ceil(r_i / 128)      for e in [0, E]
// in shared memory, and traps (printing the culprit) on a count that is negative, not a multiple of
// row_multiple, or that makes the total pass m_total. Used by the one-launch grouped GEMMs' setup kernel
// (kernels/cuda/grouped_gemm_sm90.cuh) and by every CTA of the device-count colwise FP8 kernels
// (kernels/cuda/fp8_segments.cuh). Tests: tests/test_grouped_gemm_device.cpp, tests/test_fp8_colwise_device.cpp.
#pragma once
#include <cstdint>
#include <cstdio>

#include "kernels/grouped_gemm_device.h"

namespace flowmoe {

constexpr int kCountScanThreads = 256;
static_assert(kCountScanThreads == kGroupedGemmMaxExperts, "one scan thread per expert");

// blockDim.x must be kCountScanThreads and num_experts <= kCountScanThreads; off and blk hold
// kCountScanThreads + 1 entries. Every thread of the block must call it (it synchronises the block).
__device__ inline void scan_counts(const int32_t* counts, int num_experts, int row_multiple, long long m_total,
                                   long long* off, long long* blk, const char* what) {
  __shared__ long long warp_rows[kCountScanThreads / 32], warp_blocks[kCountScanThreads / 32];
  const int t = int(threadIdx.x), lane = t % 32, warp = t / 32;
  const long long r = t < num_experts ? counts[t] : 0;
  if (r < 0 || r % row_multiple != 0) {
    if (blockIdx.x == 0)
      printf("%s: expert %d has %lld rows (must be >= 0 and a multiple of %d)\n", what, t, r, row_multiple);
    __trap();
  }
  long long rows = r, blocks = (r + 127) / 128;
  for (int d = 1; d < 32; d *= 2) {  // inclusive scan within the warp
    const long long up_rows = __shfl_up_sync(0xffffffffu, rows, d), up_blocks = __shfl_up_sync(0xffffffffu, blocks, d);
    if (lane >= d) rows += up_rows, blocks += up_blocks;
  }
  if (lane == 31) warp_rows[warp] = rows, warp_blocks[warp] = blocks;
  __syncthreads();
  for (int w = 0; w < warp; ++w) rows += warp_rows[w], blocks += warp_blocks[w];
  off[t + 1] = rows, blk[t + 1] = blocks;
  if (t == 0) off[0] = 0, blk[0] = 0;
  __syncthreads();
  if (off[num_experts] > m_total) {
    if (blockIdx.x == 0 && t == 0)
      printf("%s: the %d experts' counts sum to %lld rows, beyond M_total = %lld\n", what, num_experts,
             off[num_experts], m_total);
    __trap();
  }
}

}  // namespace flowmoe
