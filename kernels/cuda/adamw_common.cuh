// What the optimizer's multi-tensor kernels (adamw.cu, adamw_fp8.cu) share: the table of a launch's tensors, passed
// by value as the kernel's parameters (within 4 KiB), and the element helpers both use.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/adamw.h"
#include "kernels/stochastic_round.h"

namespace flowmoe {

// Up to kCapacity items (tensors or slices), item t owning the run of blocks [block_end[t-1], block_end[t]) of a
// 1-D grid.
template <class Item, int kCapacity = kTensorsPerLaunch>
struct LaunchTable {
  Item items[kCapacity];
  int block_end[kCapacity];
  int num_items;
};

// The item this block works on, its first block and its number of blocks.
template <class Item, int kCapacity>
__device__ __forceinline__ int find_item(const LaunchTable<Item, kCapacity>& table, int* first_block, int* num_blocks) {
  int t = 0;
  while (t + 1 < table.num_items && int(blockIdx.x) >= table.block_end[t]) ++t;
  *first_block = t ? table.block_end[t - 1] : 0;
  *num_blocks = table.block_end[t] - *first_block;
  return t;
}

// A moment (f32, or bf16 bits) as f32.
__device__ __forceinline__ float load_moment(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_moment(const uint16_t* p, int64_t i) { return bf16_bits_value(p[i]); }

// The weights' bf16 copy: x rounded to nearest even, as bits.
__device__ __forceinline__ uint16_t bf16_bits_rn(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }

}  // namespace flowmoe
