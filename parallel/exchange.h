// The token exchange of expert parallelism: rows between each rank's expert-sorted send buffer and the
// expert-major padded buffer of the experts' owners (DESIGN.md §2). With n ranks of L experts each, rank s
// permutes its routed copies by global expert g (permute_pad over all E = n·L experts: the "sorted" buffer,
// segment g at sorted_starts[g]). Rank r receives, for its local expert e, the copies of every peer p in peer
// order, then pad rows up to align_size:
//   padded row = segment_starts[e] + sum_{p' < p} counts[p'][e] + i       (i-th copy from peer p)
// The plan is made once per forward, on the host or on the device, and reused by every backward exchange.
// A device plan puts each (peer, expert) segment straight into its place (Communicator::put_rows); a host plan
// moves one block per peer (Communicator::all_to_all) into a staging buffer, which a permute regroups.
// Tests: tests/mpi/test_exchange.cpp (round trips under mpiexec, both kinds), tests/test_ep_layout.cpp (the
// device layout against make_exchange_plan), tests/test_dispatch.cpp (world size 1, with a gradient check).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops/permute.h"
#include "parallel/communicator.h"

namespace flowmoe {

struct ExchangePlan {
  std::shared_ptr<Communicator> comm;  // the expert-parallel group
  int num_local_experts = 0;           // L
  int align_size = 16;
  std::vector<int64_t> send_counts;               // [n·L] this rank's copies per global expert
  std::vector<int64_t> recv_counts;               // [n·L] counts[p][e]: copies peer p sends to local expert e
  std::vector<int64_t> tokens_per_expert;         // [L] received copies per local expert
  std::vector<int64_t> padded_tokens_per_expert;  // [L] rounded up to align_size
  std::vector<int64_t> segment_starts;            // [L+1] in the padded buffer
  int64_t num_sorted_rows = 0;                    // rows of the send buffer (the sender's permute_pad output)
  int64_t num_padded_rows = 0;  // rows of the receive buffer: the padded total rounded up to row_multiple
  // Per peer, in local-expert order, the (peer, expert) segments where the copies arrive / leave on the padded
  // side. The staging routes follow them; with the senders' sorted segments (padded_segment_starts of their
  // counts) they are the host statement of the device plan's tables (tests/test_ep_layout.cpp holds one
  // against the other).
  std::vector<Communicator::RowChunk> padded_chunks;
  // A host plan moves one block per peer (Communicator::all_to_all). Peer q's block is q's sorted segments
  // for this rank's experts, sorted_align apart as q permuted them: the staging buffer holds the n blocks
  // in peer order, and a permute (permute_rows_like) moves its rows to the padded layout or back.
  std::vector<int64_t> sorted_block_rows;   // [n] this rank's sorted rows for peer q's experts, gaps included
  std::vector<int64_t> staging_block_rows;  // [n] the rows of peer p's block here
  int64_t num_staging_rows = 0;
  PermuteResult staging_to_padded;      // row_map [staging rows, 1]: each staging row's padded row (-1: a gap)
  PermuteResult padded_to_staging;      // row_map [padded rows, 1]: each padded row's staging row (-1: pad)
  int sorted_align = 16;                // the sender's permute's, which the staging blocks keep
  std::shared_ptr<void> pinned_layout;  // on a GPU: the host side of the routes' copy, held with the plan

  // A device plan: the vectors above are empty and these views of one i32 layout tensor
  // (kernels/ep_layout.h) on the rows' device hold the same values.
  bool on_device = false;
  Tensor device_tokens_per_expert;         // [L] i32
  Tensor device_padded_tokens_per_expert;  // [L] i32
  Tensor device_segment_starts;            // [L+1] i32
  Tensor to_experts_table;  // [n, L, 3] i32: per peer q, q's expert e: (sorted row here, padded row on q, rows)
  Tensor to_tokens_table;   // [n, L, 3] i32: per peer p, my expert e: (padded row here, sorted row on p, rows)
  // [1] i32: 0, or the rows the exchange needed past num_padded_rows on some rank. Then the layout above is an
  // empty exchange on every rank (all counts 0) and every moved row takes its pad value (zero): the step is
  // run again with larger buffers (parallel.ep_capacity_factor, train/step_state.h).
  Tensor device_overflow;
};

// [counts.size()+1]: the exclusive scan of the counts, each rounded up to a multiple of align (the
// segment starts permute_pad computes on the device, here from host counts).
std::vector<int64_t> padded_segment_starts(const std::vector<int64_t>& counts, int align);

// The host plan, from this rank's per-expert counts and those its peers send it (exchange_counts_once: read to
// the host once). The rows move one block per peer into a buffer of exactly the padded total (rounded up to
// row_multiple). sorted_align: the align_size of the sender's permute, whose segments the copies leave from.
// The staging permutes' maps go to `device` in one asynchronous copy (no second host sync).
ExchangePlan make_exchange_plan(std::shared_ptr<Communicator> comm, const std::vector<int64_t>& send_counts,
                                const std::vector<int64_t>& recv_counts, int sorted_align, int64_t num_sorted_rows,
                                int align_size, int row_multiple, Device device = Device::cpu());

// The rows of a zero-sync receive buffer. The worst case: every rank sends every copy it routes to this
// rank's L experts (tokens_per_rank·min(top_k, L) from each of n ranks; top-k experts are distinct), plus
// align_size−1 pad rows per expert, rounded up to row_multiple. With capacity_factor > 0, that many times the
// copies of an even load (tokens_per_rank·top_k) plus the pad rows, at least min_rows and at most the worst
// case. The same on every rank when tokens_per_rank is.
int64_t zero_sync_padded_rows(int num_ranks, int64_t tokens_per_rank, int top_k, int num_local_experts, int align_size,
                              int row_multiple, double capacity_factor = 0, int64_t min_rows = 0);

// The device plan (zero-sync): send_counts [n·L] i32 (the sender's permute counts by global expert, on the rows'
// device) are all-gathered on the stream and the layout (kernels/ep_layout.h, the same offsets) computed there
// (ep_layout_cuda; ep_layout_cpu on the CPU). Nothing reads the host. The rows move by put_rows into a buffer
// of num_padded_rows (zero_sync_padded_rows, equal on every rank) whose rows past the padded total are pad rows
// too. A need past num_padded_rows empties the exchange (device_overflow) and raises most_needed ([1] i32 on the
// rows' device, or undefined) to it.
ExchangePlan make_device_exchange_plan(std::shared_ptr<Communicator> comm, const Tensor& send_counts, int sorted_align,
                                       int64_t num_sorted_rows, int align_size, int64_t num_padded_rows,
                                       const Tensor& most_needed = Tensor());

// send_counts: tokens_per_expert [n·L] i32 of the sender's permute (any device). Sends each peer its L
// counts and reads both directions to the host in one read: THE host synchronisation of a dispatch
// (counted by note_host_sync on a GPU). Returns {send_counts, recv_counts}, each [n·L].
std::pair<std::vector<int64_t>, std::vector<int64_t>> exchange_counts_once(Communicator& comm,
                                                                           const Tensor& send_counts);

enum class ExchangeDirection { to_experts, to_tokens };

// Moves rows [num_sorted_rows, ...] to the owners' padded layout (to_experts) or back (to_tokens), with
// probs [rows] alongside when defined. The padded side's pad rows are zero (probs 0); an FP8 tensor
// with rowwise 1x128 scales moves its scales too (pad rows scale_inv 1). The sorted side's pad rows
// are zero, and its tail past the sorted segments is left unwritten by a host plan (unpermute and
// permute's backward never read them). A device plan moves the rows with Communicator::put_rows, a host
// plan with one all_to_all block per peer. Differentiable: the gradient goes back the other way, with the
// same plan.
std::vector<Variable> exchange(const Variable& rows, const Variable& probs, std::shared_ptr<const ExchangePlan> plan,
                               ExchangeDirection direction);

}  // namespace flowmoe
