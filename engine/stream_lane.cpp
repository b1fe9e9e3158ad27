// The lanes (see engine/stream_lane.h). The side lane: the thread's stream choice, the per-device open flag, and
// the allocator's held releases between a fork and its join. The comm lane: the thread's flags and, per device,
// the issues not yet waited for, each with its event and the tensors it keeps.
#include "engine/stream_lane.h"

#include <deque>
#include <map>
#include <mutex>
#include <set>

#include "engine/allocator.h"
#include "engine/autograd.h"
#include "engine/profiler.h"
#include "engine/stream.h"
#include "kernels/common/device_api.h"

namespace flowmoe {

namespace {

int key(Device device) { return device.is_cuda() ? device.index : -1; }  // the CPU as -1

// The devices with a side branch forked and not yet joined.
std::mutex g_side_mu;
std::set<int>& open_branches() {
  static auto* open = new std::set<int>;  // leaked: tensors freed after static destructors may ask
  return *open;
}

thread_local bool t_comm_on = false, t_comm_streams = true;

struct Issue {
  uint64_t ticket = 0;
  Event event;  // recorded on the comm stream after the issue's launches
  std::vector<Tensor> keep;
};

struct CommQueue {
  uint64_t last = 0, waited = 0;
  std::deque<Issue> pending;  // tickets (waited, last], in order
  std::vector<Event> events;  // free for the next issues
};

Event take_event(CommQueue& queue) {
  if (queue.events.empty()) return Event();
  Event e = std::move(queue.events.back());
  queue.events.pop_back();
  return e;
}

std::mutex g_comm_mu;
std::map<int, CommQueue>& comm_queues() {
  static auto* q = new std::map<int, CommQueue>;  // leaked: tensors freed after static destructors may ask
  return *q;
}

// The end of an issue on the comm stream: its event recorded, this thread back on the stream it used before.
void end_issue(Device device, uint64_t ticket, bool prev) {
  {
    std::lock_guard<std::mutex> lock(g_comm_mu);
    for (Issue& issue : comm_queues()[key(device)].pending)
      if (issue.ticket == ticket) {
        try {
          issue.event.record(current_stream(device.index));  // still the comm stream
        } catch (...) {                                      // a launch failed before: its error is the report
        }
      }
  }
  cuda_use_comm_stream(prev);
}

}  // namespace

LaneScope::LaneScope(Lane lane, Device device, bool on_stream)
    : lane_(lane),
      on_stream_(on_stream),
      prev_side_(in_side_branch()),
      prev_comm_on_(t_comm_on),
      prev_comm_streams_(t_comm_streams) {
  if (lane == Lane::comm) {
    t_comm_on = true;
    t_comm_streams = on_stream;
    return;
  }
  first_ = std::make_unique<BackwardFirstGuard>();
  if (!on_stream_) return;
  fork_side_branch(device);
  use_side_branch(true);
}

LaneScope::~LaneScope() {
  if (lane_ == Lane::comm) {
    t_comm_on = prev_comm_on_;
    t_comm_streams = prev_comm_streams_;
  } else if (on_stream_) {
    use_side_branch(prev_side_);
  }
}

// The thread's flag is the device API's, which current_stream and the allocator read.
bool in_side_branch() { return cuda_using_side_stream(); }
void use_side_branch(bool on) { cuda_use_side_stream(on); }

bool side_branch_open(Device device) {
  std::lock_guard<std::mutex> lock(g_side_mu);
  return open_branches().count(key(device)) > 0;
}

void fork_side_branch(Device device) {
  {
    std::lock_guard<std::mutex> lock(g_side_mu);
    if (open_branches().insert(key(device)).second) hold_memory_releases(device);
  }
  if (device.is_cuda()) cuda_stream_waits(device.index, EngineStream::side, EngineStream::compute);
}

void join_side_branch(Device device) {
  {
    std::lock_guard<std::mutex> lock(g_side_mu);
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

bool comm_lane_on() { return t_comm_on; }
bool comm_lane_streams() { return t_comm_streams; }

uint64_t issue_on_comm_lane(Device device, std::vector<Tensor> keep, const std::function<void()>& launches) {
  const bool streams = device.is_cuda() && t_comm_streams;
  const bool prev = cuda_using_comm_stream();
  if (!streams) comm_lane_join(device);  // what an earlier issue on the comm stream moves comes first
  uint64_t ticket = 0;
  {
    std::lock_guard<std::mutex> lock(g_comm_mu);
    CommQueue& queue = comm_queues()[key(device)];
    ticket = ++queue.last;
    if (!streams) {
      queue.waited = ticket;
    } else {
      queue.pending.push_back(Issue{ticket, take_event(queue), std::move(keep)});
      cuda_stream_waits(device.index, EngineStream::comm, EngineStream::compute);
      cuda_use_comm_stream(true);
    }
  }
  if (!streams) {  // one stream, which has what came before; the launches run on it now
    launches();
    return ticket;
  }
  try {
    launches();
  } catch (...) {
    end_issue(device, ticket, prev);
    throw;
  }
  end_issue(device, ticket, prev);
  return ticket;
}

uint64_t comm_lane_last_ticket(Device device) {
  std::lock_guard<std::mutex> lock(g_comm_mu);
  return comm_queues()[key(device)].last;
}

void comm_lane_wait(Device device, uint64_t ticket, const std::string* scope) {
  std::vector<Tensor> released;  // freed after the lock: a tensor's storage goes back to the allocator
  {
    std::lock_guard<std::mutex> lock(g_comm_mu);
    CommQueue& queue = comm_queues()[key(device)];
    if (ticket <= queue.waited) return;
    FLOWMOE_CHECK(ticket <= queue.last, Error, "comm lane: ticket ", ticket, " was never issued (last ", queue.last,
                  ")");
    Issue* wanted = nullptr;
    for (Issue& issue : queue.pending)
      if (issue.ticket == ticket) wanted = &issue;
    if (wanted) {
      OpTimer timer("exchange", forward_phase(), scope ? *scope : profile_scope(), device, 0, 0);
      wanted->event.wait(compute_stream(device.index));
    }
    while (!queue.pending.empty() && queue.pending.front().ticket <= ticket) {
      Issue& issue = queue.pending.front();
      for (Tensor& t : issue.keep) released.push_back(std::move(t));
      queue.events.push_back(std::move(issue.event));
      queue.pending.pop_front();
    }
    queue.waited = ticket;
  }
}

void comm_lane_join(Device device) { comm_lane_wait(device, comm_lane_last_ticket(device)); }

}  // namespace flowmoe
