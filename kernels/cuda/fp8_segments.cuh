// Segments of a colwise FP8 layout (kernels/fp8.h) as launch parameters: a kernel over the 128-row
// blocks of many segments gets their table by value, kChunkSegments per launch, and finds its tile's
// rows with a binary search. Shared by the FP8 transpose (kernels/cuda/fp8_transpose.cu) and the
// dequantize -> requantize baseline it is measured against (bench/baselines/fp8_transpose_baseline.cu).
#pragma once
#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/common/error.h"
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

struct TileRows {
  int64_t first_row, block;  // first row of the tile in [M], its row of scale_inv_t
  int num_rows;              // <= 128: the last block of a segment is partial
};

__device__ __forceinline__ TileRows find_tile_rows(const SegmentChunk& c, int blk) {
  int lo = 0, hi = c.num_segments - 1;  // the last segment with first_block <= blk (empty ones own nothing)
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (c.first_block[mid] <= blk) lo = mid; else hi = mid - 1;
  }
  const int r0 = (blk - c.first_block[lo]) * kTile;
  return {c.row_start[lo] + r0, c.block_offset + blk, min(kTile, c.num_rows[lo] - r0)};
}

// Launches kernel(chunk) once per kChunkSegments segments; returns the segments' total rows.
template <class Launch>
int64_t for_each_chunk(const int64_t* rows_per_segment, int64_t num_segments, int64_t num_col_tiles,
                       const char* what, Launch&& launch) {
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

}  // namespace flowmoe
