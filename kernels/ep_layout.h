// The expert-parallel exchange layout, computed where the counts are (no host read): from every
// rank's per-expert send counts, all-gathered, one rank's expert segments and row tables.
//   counts [n, n·L] i32: counts[p][g] = copies rank p sends global expert g (owner g / L, local g % L).
//   sorted_start_p[g] = Σ_{g'<g} round_up(counts[p][g'], sorted_align)   (rank p's permute_pad buffer)
//   total_q[e] = Σ_p counts[p][q·L+e];  seg_start_q[e] = Σ_{e'<e} round_up(total_q[e'], align)
// Rank `me`'s output is one i32 buffer of ep_layout_size(n, L) entries, its fields listed above ep_layout_size:
// the segments, and the host plan's (make_exchange_plan) chunks as two row tables (to_experts, to_tokens).
// Capacity: with receive buffers of `capacity` rows, need = max_q Σ_e round_up(total_q[e], align) must fit on
// every rank. Every rank computes the same need (the counts are the same everywhere), so when it does not fit
// all of them lay out an empty exchange together: every count and row 0, overflow = need.
// CPU reference: kernels/cpu/ep_layout.cpp; CUDA: kernels/cuda/ep_layout.cu; tests: tests/test_ep_layout.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"

namespace flowmoe {

struct EpLayoutDims {
  int num_ranks = 1;          // n
  int num_local_experts = 1;  // L
  int rank = 0;               // me
  int sorted_align = 16;      // the senders' permute_pad align_size
  int align_size = 16;        // the owners' expert segments
  int64_t capacity = 0;       // rows of every rank's receive buffer; 0: any need fits
};

// Rank `me`'s outputs, one i32 buffer of ep_layout_size(n, L) entries, in this order:
//   tokens_per_expert [L] = total_me; padded_tokens_per_expert [L]; segment_starts [L+1] = seg_start_me
//   to_experts [n, L, 3]: per peer q, q's expert e: (sorted_start_me[q·L+e],
//                         seg_start_q[e] + Σ_{p'<me} counts[p'][q·L+e], counts[me][q·L+e])
//   to_tokens  [n, L, 3]: per peer p, my expert e:  (seg_start_me[e] + Σ_{p'<p} counts[p'][me·L+e],
//                         sorted_start_p[me·L+e], counts[p][me·L+e])
//   overflow   [1]: 0, or need when it exceeds the capacity (the fields above then hold an empty exchange)
// Each table row is (row here, row on the peer, rows): the host plan's (make_exchange_plan) chunks.
// Offsets of the fields in the output buffer (constexpr: the kernel uses them too).
constexpr int64_t ep_layout_size(int n, int L) { return 3 * int64_t(L) + 2 + 6 * int64_t(n) * L; }
constexpr int64_t ep_layout_padded_offset(int, int L) { return L; }
constexpr int64_t ep_layout_starts_offset(int, int L) { return 2 * int64_t(L); }
constexpr int64_t ep_layout_to_experts_offset(int, int L) { return 3 * int64_t(L) + 1; }
constexpr int64_t ep_layout_to_tokens_offset(int n, int L) { return 3 * int64_t(L) + 1 + 3 * int64_t(n) * L; }
constexpr int64_t ep_layout_overflow_offset(int n, int L) { return 3 * int64_t(L) + 1 + 6 * int64_t(n) * L; }

// Throws ShapeError unless n, L >= 1, 0 <= rank < n, both aligns are >= 1 and the capacity >= 0.
void check_ep_layout_dims(const EpLayoutDims& d);

// most_needed [1] i32 (may be null): raised to the overflow's need when there is one, as a running maximum
// over the layouts of a step (the trainer reads it to grow the buffers and run the step again).
void ep_layout_cpu(const EpLayoutDims& d, const int32_t* counts /*[n, n·L]*/, int32_t* out /*[ep_layout_size]*/,
                   int32_t* most_needed = nullptr);
void ep_layout_cuda(const EpLayoutDims& d, const int32_t* counts /*[n, n·L]*/, int32_t* out /*[ep_layout_size]*/,
                    int32_t* most_needed /*[1] or null*/, cudaStream_t stream);

}  // namespace flowmoe
