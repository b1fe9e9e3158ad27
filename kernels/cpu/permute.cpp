// CPU reference for the routing map, permute+pad and its backward (see kernels/permute.h).
// Plain per-token loops: the stable order is simply the order of the flat index t*k + j.
#include "kernels/permute.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>

#include "kernels/common/error.h"

namespace flowmoe {

int64_t permute_worst_case_rows(int64_t num_tokens, int top_k, int num_local_experts, int align_size) {
  const int64_t entries = num_tokens * top_k;
  return entries + std::min<int64_t>(num_local_experts, entries) * (align_size - 1);
}

void check_routing_dims(const RoutingDims& d) {
  const int a = d.align_size;
  FLOWMOE_CHECK(a == 16 || a == 32 || a == 64 || a == 128, Error,
                "permute_pad: align_size must be 16, 32, 64 or 128, got ", a);
  FLOWMOE_CHECK(d.num_tokens >= 0 && d.top_k >= 1, ShapeError, "permute_pad: need num_tokens >= 0 and top_k >= 1, got ",
                d.num_tokens, " tokens, top_k ", d.top_k);
  FLOWMOE_CHECK(d.num_experts >= 1 && d.num_local_experts >= 1 && d.expert_offset >= 0 &&
                    int64_t(d.expert_offset) + d.num_local_experts <= d.num_experts,
                Error, "permute_pad: local experts [", d.expert_offset, ", ",
                int64_t(d.expert_offset) + d.num_local_experts, ") do not lie in the ", d.num_experts, " experts");
  const int64_t worst = permute_worst_case_rows(d.num_tokens, d.top_k, d.num_local_experts, a);
  FLOWMOE_CHECK(worst <= INT32_MAX && d.num_rows >= 0 && d.num_rows <= INT32_MAX, ShapeError,
                "permute_pad: row indices are int32; ", d.num_tokens, " tokens x top_k ", d.top_k, " and ", d.num_rows,
                " buffer rows do not fit");
}

void permute_map_cpu(const RoutingDims& d, const int32_t* topk_idx, int32_t* row_map, int32_t* tokens_per_expert,
                     int32_t* padded_tokens_per_expert, int32_t* segment_starts) {
  check_routing_dims(d);
  const int num_local = d.num_local_experts, align = d.align_size;
  const int64_t n = d.num_tokens * d.top_k;
  std::fill(tokens_per_expert, tokens_per_expert + num_local, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int id = topk_idx[i];
    FLOWMOE_CHECK(id >= 0 && id < d.num_experts, Error, "permute_pad: topk_idx[", i / d.top_k, ", ", i % d.top_k,
                  "] = ", id, " (token ", i / d.top_k, ") is not an expert id in [0, ", d.num_experts, ")");
    const int e = id - d.expert_offset;
    if (e >= 0 && e < num_local) tokens_per_expert[e]++;
  }
  segment_starts[0] = 0;
  for (int e = 0; e < num_local; ++e) {
    padded_tokens_per_expert[e] = (tokens_per_expert[e] + align - 1) / align * align;
    segment_starts[e + 1] = segment_starts[e] + padded_tokens_per_expert[e];
  }
  FLOWMOE_CHECK(segment_starts[num_local] <= d.num_rows, ShapeError, "permute_pad: the padded experts need ",
                segment_starts[num_local], " rows but the buffer has ", d.num_rows);
  std::vector<int32_t> next(segment_starts, segment_starts + num_local);  // next free row per expert
  for (int64_t i = 0; i < n; ++i) {
    const int e = topk_idx[i] - d.expert_offset;
    row_map[i] = (e >= 0 && e < num_local) ? next[size_t(e)]++ : -1;
  }
}

void permute_rows_cpu(const RoutingDims& d, const int32_t* row_map, const void* src, size_t row_bytes,
                      const void* pad_row, void* dst) {
  auto* out = static_cast<unsigned char*>(dst);
  auto* in = static_cast<const unsigned char*>(src);
  if (row_bytes == 0) return;
  for (int64_t r = 0; r < d.num_rows; ++r) {  // the reference fills every row, then overwrites the routed ones
    if (pad_row)
      std::memcpy(out + r * row_bytes, pad_row, row_bytes);
    else
      std::memset(out + r * row_bytes, 0, row_bytes);
  }
  for (int64_t t = 0; t < d.num_tokens; ++t)
    for (int j = 0; j < d.top_k; ++j) {
      const int32_t r = row_map[t * d.top_k + j];
      if (r >= 0) std::memcpy(out + int64_t(r) * row_bytes, in + t * row_bytes, row_bytes);
    }
}

template <class P>
void permute_probs_cpu(const RoutingDims& d, const int32_t* row_map, const P* topk_prob, P* probs) {
  std::fill(probs, probs + d.num_rows, P(0));
  for (int64_t i = 0; i < d.num_tokens * d.top_k; ++i)
    if (row_map[i] >= 0) probs[row_map[i]] = topk_prob[i];
}

template <class T>
void permute_backward_cpu(const int32_t* row_map, int64_t num_tokens, int top_k, int64_t hidden, const T* d_rows,
                          const T* d_probs, T* d_x, T* d_topk_prob) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t* rows_of_t = row_map + t * top_k;
    if (d_x) {
      T* out = d_x + t * hidden;
      std::fill(out, out + hidden, T(0));
      for (int j = 0; j < top_k; ++j)  // j ascending, the order the GPU adds in
        if (rows_of_t[j] >= 0)
          for (int64_t h = 0; h < hidden; ++h) out[h] += d_rows[int64_t(rows_of_t[j]) * hidden + h];
    }
    if (d_topk_prob)
      for (int j = 0; j < top_k; ++j) d_topk_prob[t * top_k + j] = rows_of_t[j] >= 0 ? d_probs[rows_of_t[j]] : T(0);
  }
}

template void permute_probs_cpu<float>(const RoutingDims&, const int32_t*, const float*, float*);
template void permute_probs_cpu<double>(const RoutingDims&, const int32_t*, const double*, double*);
template void permute_backward_cpu<float>(const int32_t*, int64_t, int, int64_t, const float*, const float*, float*,
                                          float*);
template void permute_backward_cpu<double>(const int32_t*, int64_t, int, int64_t, const double*, const double*, double*,
                                           double*);

}  // namespace flowmoe
