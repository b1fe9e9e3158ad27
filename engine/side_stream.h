// A side branch: work that does not wait for the main flow runs on a second stream beside it. The MoE
// layer puts its shared experts there, so they overlap dispatch, the routed experts and combine, forward
// and backward (parallel.shared_expert_overlap; DESIGN.md §4 draws the streams).
//   SideBranch scope(device): the ops issued while it lives go to the side stream, which first waits for
//     what the compute stream has been given so far (a fork). Autograd tags the nodes recorded in the
//     scope, and the backward walk runs them on the side stream too (engine/autograd.cpp), as soon as they
//     are ready (BackwardFirstGuard, also when the branch is not enabled: the same order either way).
//   join_side_branch(device): the compute stream waits for the side stream; call it before the first
//     compute-stream op that reads the branch's results.
// From the first fork to the join, freed memory is held back (engine/allocator.h): the caching allocator
// hands blocks out in host order, and a block one stream's op freed may still be in use by the other.
// On the CPU there is one stream and only the tagging happens, so the schedule is testable there.
// Tests: tests/test_side_stream.cpp (CPU and, where a GPU is present, bit-for-bit against one stream).
#pragma once
#include <memory>

#include "engine/device.h"

namespace flowmoe {

class BackwardFirstGuard;

class SideBranch {
 public:
  // enabled false: nothing changes (the ops stay on the compute stream, untagged).
  explicit SideBranch(Device device, bool enabled = true);
  ~SideBranch();
  SideBranch(const SideBranch&) = delete;
  SideBranch& operator=(const SideBranch&) = delete;

 private:
  bool enabled_, prev_;
  std::unique_ptr<BackwardFirstGuard> first_;
};

// Whether this thread's ops now go to a side branch.
bool in_side_branch();
// Switches this thread's ops to the side stream or back, with no ordering (the backward walk's tool;
// everything else uses SideBranch).
void use_side_branch(bool on);

// The side stream waits for the compute stream's work so far; memory is held from the first fork on.
void fork_side_branch(Device device);
// The compute stream waits for the side stream, and the held memory returns. Nothing if none is open.
void join_side_branch(Device device);
// Whether a branch forked on this device has not been joined yet.
bool side_branch_open(Device device);
// Where a branch is open: the stream now in use waits for the other one, without closing the branch
// (a gradient bucket that reads gradients of both, train/grad_reducer.cpp).
void wait_for_other_stream(Device device);

}  // namespace flowmoe
