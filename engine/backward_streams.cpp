// The backward walk's streams (see engine/backward_streams.h).
#include "engine/backward_streams.h"

#include <algorithm>

#include "engine/stream_lane.h"

namespace flowmoe {

BackwardStreams::BackwardStreams() : nested_(in_side_branch()) {}

BackwardStreams::~BackwardStreams() {
  try {
    if (lane_used_) comm_lane_join(lane_device_);
  } catch (...) {  // unwinding from an error already thrown: that one is the report
  }
  if (nested_) return;
  use_side_branch(false);
  try {
    if (forked_) join();
  } catch (...) {
  }
}

void BackwardStreams::before_run(const Node& n, const std::vector<Tensor>& d_out) {
  auto lane = lane_fed_.find(&n);
  if (lane != lane_fed_.end()) {
    comm_lane_wait(lane_device_, lane->second, &n.scope);
    lane_fed_.erase(lane);
  }
  issued_before_ = comm_lane_last_ticket(n.device);
  if (nested_) return;
  if (n.on_side != on_side_) {
    if (n.on_side) fork_side_branch(n.device), device_ = n.device, forked_ = true;
    use_side_branch(on_side_ = n.on_side);
  }
  if (on_side_) kept_.insert(kept_.end(), d_out.begin(), d_out.end());
  if (!on_side_ && fed_.count(&n)) join();
}

void BackwardStreams::after_run(const Node& n) {
  const uint64_t last = comm_lane_last_ticket(n.device);
  ticket_ = last != issued_before_ ? last : 0;
  if (ticket_) lane_used_ = true, lane_device_ = n.device;
  scope_ = &n.scope;
}

void BackwardStreams::release(const std::shared_ptr<Node>& n) {
  if (on_side_ && !nested_)
    released_at_join_.push_back(n);
  else
    n->release();
}

void BackwardStreams::before_accumulate(const void* target, bool defined, bool leaf) {
  before_accumulate_lane(target, defined, leaf);
  if (nested_) return;
  if (on_side_) {
    if (defined) wait_for_other_stream(device_);
    fed_.insert(target);
  } else if (fed_.count(target)) {
    join();
  }
}

// A sum reads both addends, and a leaf's gradient is read by hooks at once: both wait for the lane first.
void BackwardStreams::before_accumulate_lane(const void* target, bool defined, bool leaf) {
  auto it = lane_fed_.find(target);
  const uint64_t held = it != lane_fed_.end() ? it->second : 0;
  const uint64_t need = defined || leaf ? std::max(ticket_, held) : 0;
  if (need) comm_lane_wait(lane_device_, need, scope_);
  if (need && held) lane_fed_.erase(it);
  if (ticket_ && !need) lane_fed_[target] = ticket_;
}

void BackwardStreams::join() {
  join_side_branch(device_);
  fed_.clear();
  for (const auto& n : released_at_join_) n->release();
  released_at_join_.clear();
  kept_.clear();
}

}  // namespace flowmoe
