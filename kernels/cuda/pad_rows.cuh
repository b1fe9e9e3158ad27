// Which rows of a permuted buffer are pad or tail rows (layout: kernels/permute.h), shared by the two
// kernels that write them without a memset: permute_rows (zero rows, probs 0, side_pad_value) and
// unpermute's backward (zero rows of d_rows).
// Pad item p < L*(align-1) is pad slot (e, q) = divmod(p, align-1): row seg[e] + tokens[e] + q, when
// that row is still inside e's segment (an expert has at most align-1 pad rows). Then item p strides
// over the tail rows [seg[L], num_rows) by the number of pad items.
#pragma once
#include <algorithm>
#include <cstdint>

namespace flowmoe {
namespace {

// Pad items to launch: one per possible pad slot, and at least enough to stride over a large tail.
inline int64_t pad_item_count(int num_local, int align, int64_t num_rows) {
  return std::max<int64_t>(int64_t(num_local) * (align - 1), std::min<int64_t>(num_rows, 1024));
}

// Calls fill_row(r) for each pad or tail row r of pad item p (of num_pad_items).
template <class F>
__device__ __forceinline__ void for_each_pad_row(int64_t p, int64_t num_pad_items, const int32_t* seg /*[L+1]*/,
                                                 const int32_t* tokens /*[L]*/, int num_local, int align,
                                                 int64_t num_rows, F&& fill_row) {
  const int slots = align - 1;
  if (p < int64_t(num_local) * slots) {
    const int e = int(p / slots), q = int(p % slots);
    const int64_t r = int64_t(seg[e]) + tokens[e] + q;
    if (r < seg[e + 1]) fill_row(r);
  }
  for (int64_t r = seg[num_local] + p; r < num_rows; r += num_pad_items) fill_row(r);
}

}  // namespace
}  // namespace flowmoe
