// Side branches (see engine/side_stream.h): the thread's stream choice, the per-device open flag, and
// the allocator's held releases between a fork and its join.
#include "engine/side_stream.h"

#include <mutex>
#include <set>

#include "engine/allocator.h"
#include "engine/autograd.h"
#include "kernels/common/device_api.h"

namespace flowmoe {

namespace {

// The devices (the CPU as index -1) with a branch forked and not yet joined.
std::mutex g_mu;
std::set<int>& open_branches() {
  static auto* open = new std::set<int>;  // leaked: tensors freed after static destructors may ask
  return *open;
}

int key(Device device) { return device.is_cuda() ? device.index : -1; }

}  // namespace

// The thread's flag is the device API's, which current_stream and the allocator read.
bool in_side_branch() { return cuda_using_side_stream(); }
void use_side_branch(bool on) { cuda_use_side_stream(on); }

bool side_branch_open(Device device) {
  std::lock_guard<std::mutex> lock(g_mu);
  return open_branches().count(key(device)) > 0;
}

void fork_side_branch(Device device) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (open_branches().insert(key(device)).second) hold_memory_releases(device);
  }
  if (device.is_cuda()) cuda_stream_waits(device.index, EngineStream::side, EngineStream::compute);
}

void join_side_branch(Device device) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (open_branches().erase(key(device)) == 0) return;
  }
  if (device.is_cuda()) cuda_stream_waits(device.index, EngineStream::compute, EngineStream::side);
  // Every later compute-stream op is ordered after both streams' work so far; a later fork makes the
  // side stream wait for those ops too. So the held blocks are free for either stream.
  release_held_memory(device);
}

void wait_for_other_stream(Device device) {
  if (!side_branch_open(device) || !device.is_cuda()) return;
  if (in_side_branch())
    cuda_stream_waits(device.index, EngineStream::side, EngineStream::compute);
  else
    cuda_stream_waits(device.index, EngineStream::compute, EngineStream::side);
}

SideBranch::SideBranch(Device device, bool enabled)
    : enabled_(enabled), prev_(in_side_branch()), first_(std::make_unique<BackwardFirstGuard>()) {
  if (!enabled_) return;
  fork_side_branch(device);
  use_side_branch(true);
}

SideBranch::~SideBranch() {
  if (enabled_) use_side_branch(prev_);
}

}  // namespace flowmoe
