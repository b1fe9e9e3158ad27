// CPU reference of the expert-parallel exchange layout (see kernels/ep_layout.h): the formulas as
// plain loops, one entry at a time, as the CUDA kernel computes them.
#include "kernels/ep_layout.h"

#include <algorithm>
#include <vector>

#include "kernels/common/error.h"

namespace flowmoe {

namespace {

int64_t round_up(int64_t v, int a) { return (v + a - 1) / a * a; }

}  // namespace

void check_ep_layout_dims(const EpLayoutDims& d) {
  FLOWMOE_CHECK(d.num_ranks >= 1 && d.num_local_experts >= 1 && d.rank >= 0 && d.rank < d.num_ranks, ShapeError,
                "ep_layout: rank ", d.rank, " of ", d.num_ranks, " ranks with ", d.num_local_experts,
                " local experts is not a layout");
  FLOWMOE_CHECK(d.sorted_align >= 1 && d.align_size >= 1, ShapeError, "ep_layout: aligns must be >= 1, got ",
                d.sorted_align, " and ", d.align_size);
  FLOWMOE_CHECK(d.capacity >= 0, ShapeError, "ep_layout: capacity ", d.capacity, " rows is negative");
}

void ep_layout_cpu(const EpLayoutDims& d, const int32_t* counts, int32_t* out, int32_t* most_needed) {
  check_ep_layout_dims(d);
  const int n = d.num_ranks, L = d.num_local_experts, me = d.rank, E = n * L;
  auto c = [&](int p, int g) { return int64_t(counts[int64_t(p) * E + g]); };
  std::vector<int64_t> total(size_t(E), 0), seg(size_t(E), 0);  // per global expert: copies, owner's segment start
  for (int g = 0; g < E; ++g)
    for (int p = 0; p < n; ++p) total[size_t(g)] += c(p, g);
  for (int g = 0; g < E; ++g)
    seg[size_t(g)] = g % L == 0 ? 0 : seg[size_t(g - 1)] + round_up(total[size_t(g - 1)], d.align_size);
  int64_t need = 0;  // the most padded rows any rank receives
  for (int q = 0; q < n; ++q) {
    const int last = q * L + L - 1;
    need = std::max(need, seg[size_t(last)] + round_up(total[size_t(last)], d.align_size));
  }
  if (d.capacity > 0 && need > d.capacity) {  // every rank lays out the same empty exchange
    std::fill(out, out + ep_layout_size(n, L), 0);
    out[ep_layout_overflow_offset(n, L)] = int32_t(need);
    if (most_needed) *most_needed = std::max(*most_needed, int32_t(need));
    return;
  }
  out[ep_layout_overflow_offset(n, L)] = 0;
  auto sorted_start = [&](int p, int g) {
    int64_t s = 0;
    for (int h = 0; h < g; ++h) s += round_up(c(p, h), d.sorted_align);
    return s;
  };
  for (int e = 0; e < L; ++e) {
    const int g = me * L + e;
    out[e] = int32_t(total[size_t(g)]);
    out[ep_layout_padded_offset(n, L) + e] = int32_t(round_up(total[size_t(g)], d.align_size));
    out[ep_layout_starts_offset(n, L) + e] = int32_t(seg[size_t(g)]);
  }
  out[ep_layout_starts_offset(n, L) + L] =
      int32_t(seg[size_t(me * L + L - 1)] + round_up(total[size_t(me * L + L - 1)], d.align_size));
  int32_t* to_experts = out + ep_layout_to_experts_offset(n, L);
  int32_t* to_tokens = out + ep_layout_to_tokens_offset(n, L);
  for (int q = 0; q < n; ++q)
    for (int e = 0; e < L; ++e) {
      const int g = q * L + e;  // q's expert e
      int64_t before = 0;
      for (int p = 0; p < me; ++p) before += c(p, g);
      int32_t* t = to_experts + 3 * int64_t(g);
      t[0] = int32_t(sorted_start(me, g)), t[1] = int32_t(seg[size_t(g)] + before), t[2] = int32_t(c(me, g));
    }
  for (int p = 0; p < n; ++p)
    for (int e = 0; e < L; ++e) {
      const int g = me * L + e;  // my expert e
      int64_t before = 0;
      for (int p2 = 0; p2 < p; ++p2) before += c(p2, g);
      int32_t* t = to_tokens + 3 * (int64_t(p) * L + e);
      t[0] = int32_t(seg[size_t(g)] + before), t[1] = int32_t(sorted_start(p, g)), t[2] = int32_t(c(p, g));
    }
}

}  // namespace flowmoe
