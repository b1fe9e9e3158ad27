// The streams of the backward walk (engine/autograd.cpp's backward() alone uses it): where each node runs
// and what waits for what.
//   Side lane (engine/stream_lane.h): nodes recorded in one run on the side stream (forked when the walk
//     first meets one), the others on the compute stream. The compute stream joins the branch before it
//     reads a slot or leaf gradient the side stream wrote, and the side stream waits for the compute stream
//     before it adds into one the compute stream wrote. What a side node reads (its incoming gradients, its
//     saved tensors) stays referenced until the join, so that no block the side stream may still read is
//     freed and handed to the compute stream (engine/allocator.h). A walk that starts inside a side node
//     (a checkpoint's recompute there) stays on it.
//   Comm lane (engine/stream_lane.h): a node whose vjp issued onto it leaves gradients to be waited for; the
//     compute stream waits for that issue (and no later one) before a node reads them or a sum adds them.
// Tests: tests/test_side_stream.cpp, tests/test_comm_lane.cpp (CPU schedules), tests/mpi/test_exchange_chunks.cpp.
#pragma once
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "engine/autograd.h"

namespace flowmoe {

class BackwardStreams {
 public:
  BackwardStreams();
  ~BackwardStreams();  // joins what the walk left open (does not throw: an error being reported comes first)
  BackwardStreams(const BackwardStreams&) = delete;
  BackwardStreams& operator=(const BackwardStreams&) = delete;

  // Before n's vjp, given its incoming gradients: the stream it runs on, and the waits for what it reads.
  void before_run(const Node& n, const std::vector<Tensor>& d_out);
  // After n's vjp: whether it issued onto the comm lane, whose gradients are then waited for where read.
  void after_run(const Node& n);
  // Releases n's saved tensors now, or at the join for a side node.
  void release(const std::shared_ptr<Node>& n);
  // Before a gradient goes into `target` (a node's slot, or a leaf's .grad), which already holds one if
  // `defined`.
  void before_accumulate(const void* target, bool defined, bool leaf);

 private:
  void before_accumulate_lane(const void* target, bool defined, bool leaf);
  void join();

  bool nested_, on_side_ = false, forked_ = false;
  Device device_;
  std::unordered_set<const void*> fed_;  // slots and leaves holding a gradient the side stream wrote
  std::vector<std::shared_ptr<Node>> released_at_join_;
  std::vector<Tensor> kept_;  // the side nodes' incoming gradients
  bool lane_used_ = false;
  Device lane_device_;
  uint64_t issued_before_ = 0, ticket_ = 0;             // the running node's comm-lane issue, 0: none
  const std::string* scope_ = nullptr;                  // the running node's, for the profiler's timing of a wait
  std::unordered_map<const void*, uint64_t> lane_fed_;  // slots holding a gradient the comm lane writes
};

}  // namespace flowmoe
