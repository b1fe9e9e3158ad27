// Segments of a colwise FP8 layout (kernels/fp8.h) for a kernel over their 128-row blocks, in two forms:
//   SegmentChunk   the table as launch parameters, kChunkSegments segments per launch (host counts);
//   CountSegments  the counts on the device ([E] i32, E <= 256): each CTA scans them in shared memory
//                  (kernels/cuda/count_scan.cuh); the grid covers fp8_colwise_max_blocks(M, E) blocks, and
//                  those past the real ones are fill tiles: the rows past the segments' total, 128 per
//                  block (none once the tail is covered), to be written as zero data with scale 1.
// find_tile_rows gives a CTA its tile's rows either way (a binary search over the block prefix sums).
// Shared by the FP8 transpose (kernels/cuda/fp8_transpose.cu), the colwise quantize (kernels/cuda/quantize.cu)
// and the dequantize -> requantize baseline (bench/baselines/fp8_transpose_baseline.cu).
#pragma once
#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/common/error.h"
#include "kernels/cuda/count_scan.cuh"
#include "kernels/fp8.h"

namespace flowmoe {

constexpr int kTile = 128;           // rows and columns of a tile: one scaling block each way
constexpr int kChunkSegments = 128;  // segments per launch, passed by value (~2 KB of parameters)

// One launch's segments: segment s has rows [row_start[s], row_start[s] + num_rows[s]) and owns this
// launch's 128-row blocks [first_block[s], first_block[s+1]); block_offset is the global index of block 0.
struct SegmentChunk {
  int64_t row_start[kChunkSegments];
  int32_t num_rows[kChunkSegments];
  int32_t first_block[kChunkSegments + 1];
  int32_t num_segments;
  int64_t block_offset;
};

// The segments as device counts: expert e has counts[e] rows; the sum must not pass m_total (traps).
struct CountSegments {
  const int32_t* counts;
  int num_experts;
  long long m_total;
};

struct TileRows {
  int64_t first_row, block;  // first row of the tile in [M], its row of scale_inv_t
  int num_rows;              // <= 128: the last block of a segment is partial (a fill tile: 0 once past M)
  bool fill;                 // a fill tile: rows past the segments, written as zeros with scale 1, never read
};

// The last segment s in [0, n) with first_block[s] <= blk: the one owning block blk (empty ones own nothing).
template <class T>
__device__ __forceinline__ int owning_segment(const T* first_block, int n, long long blk) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (first_block[mid] <= blk)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ TileRows find_tile_rows(const SegmentChunk& c, int blk) {
  const int s = owning_segment(c.first_block, c.num_segments, blk);
  const int r0 = (blk - c.first_block[s]) * kTile;
  return {c.row_start[s] + r0, c.block_offset + blk, min(kTile, c.num_rows[s] - r0), false};
}

// Every thread of the block (kCountScanThreads of them) must call it: it scans the counts.
__device__ __forceinline__ TileRows find_tile_rows(const CountSegments& c, int blk) {
  __shared__ long long off[kCountScanThreads + 1], first_block[kCountScanThreads + 1];
  scan_counts(c.counts, c.num_experts, 1, c.m_total, off, first_block, "fp8 colwise (device counts)");
  const long long num_blocks = first_block[c.num_experts];
  if (blk < num_blocks) {
    const int e = owning_segment(first_block, c.num_experts, blk);
    const long long r0 = (blk - first_block[e]) * kTile;
    return {off[e] + r0, blk, int(min(static_cast<long long>(kTile), off[e + 1] - off[e] - r0)), false};
  }
  const long long first = off[c.num_experts] + (blk - num_blocks) * kTile;
  return {first, blk, int(max(0LL, min(static_cast<long long>(kTile), c.m_total - first))), true};
}

// Launches kernel(chunk) once per kChunkSegments segments; returns the segments' total rows.
template <class Launch>
int64_t for_each_chunk(const int64_t* rows_per_segment, int64_t num_segments, int64_t num_col_tiles, const char* what,
                       Launch&& launch) {
  int64_t seg_start = 0, block = 0;
  for (int64_t s0 = 0; s0 < num_segments; s0 += kChunkSegments) {
    SegmentChunk c{};
    c.num_segments = int32_t(std::min<int64_t>(kChunkSegments, num_segments - s0));
    c.block_offset = block;
    int64_t num_blocks = 0;
    for (int i = 0; i < c.num_segments; ++i) {
      FLOWMOE_CHECK(rows_per_segment[s0 + i] < INT32_MAX, ShapeError, what, ": segment ", s0 + i, " has ",
                    rows_per_segment[s0 + i], " rows (at most 2^31 - 2)");
      c.row_start[i] = seg_start, c.num_rows[i] = int32_t(rows_per_segment[s0 + i]);
      c.first_block[i] = int32_t(num_blocks);
      num_blocks += fp8_num_blocks(rows_per_segment[s0 + i]);
      seg_start += rows_per_segment[s0 + i];
    }
    c.first_block[c.num_segments] = int32_t(num_blocks);
    FLOWMOE_CHECK(num_blocks * num_col_tiles < INT_MAX, ShapeError, what, ": ", num_blocks, " row blocks x ",
                  num_col_tiles, " column tiles exceed one grid");
    if (num_blocks > 0) launch(c, unsigned(num_blocks * num_col_tiles));
    block += num_blocks;
  }
  return seg_start;
}

// The arguments of a device-count launcher (ShapeError naming the value); returns the grid's row blocks,
// fp8_colwise_max_blocks(M, num_experts). The counts themselves are checked on the device.
inline int64_t fp8_colwise_device_check(const char* what, int64_t M, int64_t K, const int32_t* counts,
                                        int64_t num_experts) {
  FLOWMOE_CHECK(M >= 0 && K >= 0, ShapeError, what, ": bad shape [", M, ", ", K, "]");
  FLOWMOE_CHECK(num_experts >= 0 && num_experts <= kCountScanThreads, ShapeError, what, ": E=", num_experts,
                " experts (device counts take 0 to ", kCountScanThreads, ")");
  FLOWMOE_CHECK(num_experts == 0 || counts != nullptr, Error, what, ": ", num_experts, " experts but no counts");
  const int64_t max_blocks = fp8_colwise_max_blocks(M, num_experts);
  FLOWMOE_CHECK(max_blocks * fp8_num_blocks(K) < INT_MAX, ShapeError, what, ": [", M, ", ", K,
                "] is too large for one launch");
  return max_blocks;
}

}  // namespace flowmoe
