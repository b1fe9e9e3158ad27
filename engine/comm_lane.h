// The comm lane: ops that only move data between GPUs (the expert exchange, parallel/exchange.cpp) run on a
// third stream beside the compute stream, so that an MoE layer split into token chunks overlaps one chunk's
// exchange with another chunk's experts (parallel.exchange_chunks, layers/moe_schedule.cpp; DESIGN.md §9 draws it).
//   CommLaneScope scope(on): the exchanges issued while it lives go to the lane, and autograd walks their
//     backward as soon as it is ready (Primitive::backward_first), so the comm stream gets it early. The walk
//     order is the same on the CPU, where the lane runs everything at once.
//   CommIssue issue(device, tensors): around an op's launches. The comm stream first waits for the compute
//     stream's work so far; the launches go to the comm stream; at the end an event marks them, and the
//     tensors they read or write stay referenced until the compute stream has waited for that event.
//   comm_lane_wait(device, ticket): the compute stream waits for that issue (and the earlier ones: one stream,
//     in order) and their tensors are let go. The backward walk calls it before a node reads a gradient the
//     lane wrote; the layer calls it before its experts read a chunk's rows.
// Memory: an issue's outputs are allocated before it, on the compute stream, whose earlier users the comm
// stream waits for; nothing is allocated or freed on the comm stream; what it reads stays referenced until
// the wait. So the caching allocator needs no rule of its own for it (engine/allocator.h).
// Tests: tests/test_comm_lane.cpp (the CPU schedule; on a GPU, bit for bit against one stream).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/tensor.h"

namespace flowmoe {

class CommLaneScope {
 public:
  // streams false: the same order and tickets, but the launches stay on the compute stream (the reference
  // the overlap is tested against).
  explicit CommLaneScope(bool on, bool streams = true);
  ~CommLaneScope();
  CommLaneScope(const CommLaneScope&) = delete;
  CommLaneScope& operator=(const CommLaneScope&) = delete;

 private:
  bool prev_on_, prev_streams_;
};
// Whether exchanges issued now go to the comm lane, and whether its launches go to the comm stream.
bool comm_lane_on();
bool comm_lane_streams();

class CommIssue {
 public:
  // keep: what the launches read or write. On the CPU, and where comm_lane_streams() is false, the launches
  // stay where they are and the ticket is still counted.
  CommIssue(Device device, std::vector<Tensor> keep);
  ~CommIssue();  // records the event (does not throw: an error there is reported by the next CUDA call)
  CommIssue(const CommIssue&) = delete;
  CommIssue& operator=(const CommIssue&) = delete;
  uint64_t ticket() const { return ticket_; }

 private:
  Device device_;
  bool streams_;  // the launches go to the comm stream
  uint64_t ticket_ = 0;
  bool prev_;
};

// The last ticket issued on this device (0: none yet); tickets grow by one per issue.
uint64_t comm_lane_last_ticket(Device device);
// The compute stream waits for every issue up to `ticket`; timed as "exchange" while profiling (the
// exchange's exposed part), in `scope` (default: the current profile scope). Nothing if they were waited
// for already.
void comm_lane_wait(Device device, uint64_t ticket, const std::string* scope = nullptr);
void comm_lane_join(Device device);  // comm_lane_wait for the last ticket

}  // namespace flowmoe
