// Lanes: work beside the compute stream, on a second stream of its own, so that the two overlap. One
// scope type for both lanes, LaneScope(lane, device, on_stream); on_stream false keeps the same order (and the
// comm lane's tickets) on the compute stream, the reference the overlap is tested against.
//   Lane::side: work that does not wait for the main flow. The MoE layer puts its shared experts there, so they
//     overlap dispatch, the routed experts and combine, forward and backward (parallel.shared_expert_overlap;
//     DESIGN.md §4 draws the streams). The ops issued while the scope lives go to the side stream, which first
//     waits for what the compute stream has been given so far (a fork). Autograd tags the nodes recorded in the
//     scope, and the backward walk runs them on the side stream too (engine/backward_streams.h), as soon as they
//     are ready (BackwardFirstGuard, also with on_stream false: the same order either way; untagged then).
//     join_side_branch(device): the compute stream waits for the side stream; call it before the first
//     compute-stream op that reads the branch's results. From the first fork to the join, freed memory is held
//     back (engine/allocator.h): the caching allocator hands blocks out in host order, and a block one stream's
//     op freed may still be in use by the other.
//   Lane::comm: ops that only move data between GPUs (the expert exchange, parallel/exchange.cpp), so that an MoE
//     layer's token chunks or two micro-batches overlap one exchange with other compute (parallel.exchange_chunks,
//     parallel.dual_microbatch; DESIGN.md §9 draws it). The exchanges issued while the scope lives go to the
//     lane, and autograd walks their backward as soon as it is ready (Primitive::backward_first).
//     issue_on_comm_lane(device, keep, launches): the comm stream first waits for the compute stream's work so
//     far; the launches go to the comm stream; an event marks their end, and the tensors they read or write stay
//     referenced until the compute stream has waited for that event. comm_lane_wait(device, ticket): the compute
//     stream waits for that issue (and the earlier ones: one stream, in order) and their tensors are let go.
//     Nothing is allocated or freed on the comm stream, so the allocator needs no rule of its own for it.
// On the CPU there is one stream: the tagging, the order and the tickets happen, so the schedules are testable
// there. Tests: tests/test_side_stream.cpp, tests/test_comm_lane.cpp (CPU and, where a GPU is present, bit for
// bit against one stream).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/tensor.h"

namespace flowmoe {

class BackwardFirstGuard;

enum class Lane { side, comm };

class LaneScope {
 public:
  // on_stream false: the same order, with the work on the compute stream (the side lane's nodes untagged).
  LaneScope(Lane lane, Device device, bool on_stream = true);
  ~LaneScope();
  LaneScope(const LaneScope&) = delete;
  LaneScope& operator=(const LaneScope&) = delete;

 private:
  Lane lane_;
  bool on_stream_, prev_side_, prev_comm_on_, prev_comm_streams_;
  std::unique_ptr<BackwardFirstGuard> first_;
};

// The side lane.
// Whether this thread's ops now go to a side branch.
bool in_side_branch();
// Switches this thread's ops to the side stream or back, with no ordering (the backward walk's tool;
// everything else uses LaneScope).
void use_side_branch(bool on);
// The side stream waits for the compute stream's work so far; memory is held from the first fork on.
void fork_side_branch(Device device);
// The compute stream waits for the side stream, and the held memory returns. Nothing if none is open.
void join_side_branch(Device device);
// Whether a branch forked on this device has not been joined yet.
bool side_branch_open(Device device);
// Where a branch is open: the stream now in use waits for the other one, without closing the branch
// (a gradient bucket that reads gradients of both, parallel/grad_reducer.cpp).
void wait_for_other_stream(Device device);

// The comm lane.
// Whether exchanges issued now go to the comm lane, and whether its launches go to the comm stream.
bool comm_lane_on();
bool comm_lane_streams();
// Runs `launches` as one issue on the comm lane; keep: what they read or write. On the CPU, and where
// comm_lane_streams() is false, the launches stay where they are and the ticket is still counted. -> its ticket.
uint64_t issue_on_comm_lane(Device device, std::vector<Tensor> keep, const std::function<void()>& launches);
// The last ticket issued on this device (0: none yet); tickets grow by one per issue.
uint64_t comm_lane_last_ticket(Device device);
// The compute stream waits for every issue up to `ticket`; timed as "exchange" while profiling (the
// exchange's exposed part), in `scope` (default: the current profile scope). Nothing if they were waited
// for already.
void comm_lane_wait(Device device, uint64_t ticket, const std::string* scope = nullptr);
void comm_lane_join(Device device);  // comm_lane_wait for the last ticket

}  // namespace flowmoe
