// Dispatch and combine: the seams where an MoE layer's routed token copies leave for the experts' ranks, in the
// experts' expert-major padded layout, and come back (DESIGN.md §2).
//   dispatch: tokens [T,H] (FP8 with 1x128 scales in fp8_flow), topk_idx [T,k], probs [T,k] (optional)
//             -> rows [R,H], probs [R]: this rank's L experts' copies, expert-major, padded to align_size
//   combine:  the experts' output rows [R,H] -> y [T,H] = Σ_j prob[t,j]·row(t,j) on the token's rank
// One rank (no expert-parallel group): dispatch is permute+pad and combine is unpermute+unpad. Several ranks: the
// rows also cross ranks (parallel/exchange.h), sync or zero_sync (EpDispatch). Each op's backward is the other's
// forward. Tests: tests/test_dispatch.cpp (one process), tests/mpi/test_exchange.cpp (under mpiexec).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops/grouped_linear.h"
#include "engine/ops/permute.h"
#include "kernels/common/name_table.h"
#include "parallel/exchange.h"

namespace flowmoe {

// One options type for every case: one rank (expert_parallel null), and several, sync or zero_sync.
struct DispatchOptions {
  int num_experts = 0;    // E, over all ranks
  int align_size = 16;    // each expert's segment is a multiple of it (16, 32, 64 or 128)
  int64_t num_rows = -1;  // one rank: the buffer's rows (-1: the worst case, permute_worst_case_rows)
  int row_multiple = 1;   // several ranks: the received buffer's rows round up to it (FP8 GEMMs: 16)
  // What the expert GEMMs are (FP8 ones take device counts on any backend, bf16 ones on a GPU:
  // grouped_linear_takes_device_counts), and whether they may read the counts on the device after a
  // one-rank permute (no host sync) rather than on the host (read once). Dispatched::counts follows.
  bool fp8_experts = false;
  bool device_counts = false;
  // Several ranks: no host read (see EpDispatch; the mode is resolved once, where the layer is built).
  // The receive buffer's rows follow tokens_per_rank, the tokens every rank dispatches (the same on
  // every rank; -1: this rank's T).
  bool zero_sync = false;
  int64_t tokens_per_rank = -1;
  // zero_sync: receive buffers of capacity_factor times an even load, at least min_receive_rows
  // (zero_sync_padded_rows; 0: the worst case). A need past them empties the exchange on every rank and raises
  // most_needed ([1] i32 on the device, or undefined) to it: the step is void (kernels/step_control.h).
  double capacity_factor = 0;
  int64_t min_receive_rows = 0;
  Tensor most_needed;
  // The expert-parallel group: rank r holds experts [r·L, (r+1)·L), L = E / size. Null: every expert
  // is here and nothing moves between ranks. (A group of one rank still exchanges, with itself.)
  std::shared_ptr<Communicator> expert_parallel;
};

struct Dispatched {
  Variable rows;   // [R, H] this rank's experts' copies in the tokens' dtype (FP8 keeps its scales attached)
  Variable probs;  // [R] the probs moved with the rows (0 on pad rows); undefined when none were given
  // The expert GEMMs' M, [L] padded to align_size, where they read them: on the rows' device where the
  // counts are there and the GEMMs can read them (one rank with device_counts; zero_sync on a GPU,
  // always), else on the host (one rank: read once; a sync exchange: its plan's, already read).
  ExpertCounts counts;
  // [L] i32, the real copies: on the rows' device with one rank and with zero_sync; on the host after a
  // sync exchange, where the plan holds them (an upload would wait for the stream, a second host sync).
  Tensor tokens_per_expert;
  PermuteResult routing;                     // the permute+pad on the tokens' rank (combine undoes it)
  std::shared_ptr<const ExchangePlan> plan;  // several ranks: the segments; null on one rank
};

// How an MoE layer exchanges across ranks (parallel.ep_dispatch): sync, zero_sync, or auto, which picks
// zero_sync only where it is implemented and ahead of sync (resolve_ep_dispatch; docs/PERF.md has the figures).
//   sync (DispatchOptions' default): the counts are read to the host once and the buffer has exactly the padded rows;
//   zero_sync: the counts are all-gathered and laid out on the device, the buffer has the worst-case
//     rows (zero_sync_padded_rows; the tail is pad rows) and the GEMMs take the counts on the device;
//     nccl writes the rows into the owners' memory from a kernel (NVLink/P2P; else it falls back to a
//     host read of the tables, and says so once).
enum class EpDispatch { automatic, sync, zero_sync };
inline constexpr EnumName<EpDispatch> kEpDispatchNames[] = {
    {EpDispatch::automatic, "auto"}, {EpDispatch::sync, "sync"}, {EpDispatch::zero_sync, "zero_sync"}};
EpDispatch ep_dispatch_from_name(const std::string& name);  // auto, sync, zero_sync; throws ConfigError
const char* ep_dispatch_name(EpDispatch mode);
// Whether a layer with this mode exchanges without host syncs over `group` (null or one rank: false).
bool resolve_ep_dispatch(EpDispatch mode, Communicator* group);
// A capacity factor (DispatchOptions::capacity_factor) bounds the zero-sync exchange's receive buffers; the sync
// exchange sizes its own, so the two are refused together: at parsing for ep_dispatch: sync, at start-up for an auto
// that resolves to sync. "" where they fit (no factor, or not sync); else the message after
// "parallel.ep_capacity_factor: ", `why_sync` saying what made the exchange sync.
std::string capacity_factor_error(double capacity_factor, bool sync, const std::string& why_sync);

// tokens [T,H] any dtype; topk_idx [T,k] i32 in [0, E); probs [T,k] or undefined.
// Several ranks: permutes by global expert, exchanges the counts and moves the rows to the owners' padded
// buffers (parallel/exchange.h: one block per peer, or with zero_sync each segment straight into place).
// Host syncs: one per dispatch, to size the GEMMs (and, across ranks, the transfers); none on one rank with
// device_counts, nor with zero_sync on nccl between NVLink-reachable GPUs; none in backward.
Dispatched dispatch(const Variable& tokens, const Tensor& topk_idx, const Variable& probs,
                    const DispatchOptions& options);

// rows [R,H] (the experts' outputs, in dispatch's layout) -> y [T,H]. topk_prob [T,k]: the merge
// weights, or undefined when the experts applied them (fp8_flow). Several ranks: moves the rows back and
// unpermutes them where the tokens live. Its backward takes the gradient as it comes (fp8_flow's layer quantizes
// it once before, layers/moe.h: combine_grad_to_fp8).
Variable combine(const Variable& rows, const Dispatched& from, const Variable& topk_prob);
// combine's two steps, for a layer that returns every chunk's rows before it unpermutes any (layers/moe_schedule.cpp):
// the rows back to the tokens' rank in the sender's sorted layout (as they are on one rank), then
// unpermute+unpad there.
Variable combine_return(const Variable& rows, const Dispatched& from);
Variable combine_unpermute(const Variable& sorted, const Dispatched& from, const Variable& topk_prob);

}  // namespace flowmoe
