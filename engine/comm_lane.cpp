// The comm lane (see engine/comm_lane.h): per device, the issues not yet waited for, each with its event
// and the tensors it keeps, and the thread's flag.
#include "engine/comm_lane.h"

#include <deque>
#include <map>
#include <mutex>

#include "engine/profiler.h"
#include "engine/stream.h"
#include "kernels/common/device_api.h"

namespace flowmoe {

namespace {

thread_local bool t_lane_on = false, t_lane_streams = true;

struct Issue {
  uint64_t ticket = 0;
  Event event;  // recorded on the comm stream after the issue's launches
  std::vector<Tensor> keep;
};

struct Lane {
  uint64_t last = 0, waited = 0;
  std::deque<Issue> pending;  // tickets (waited, last], in order
  std::vector<Event> events;  // free for the next issues
};

Event take_event(Lane& lane) {
  if (lane.events.empty()) return Event();
  Event e = std::move(lane.events.back());
  lane.events.pop_back();
  return e;
}

std::mutex g_mu;
std::map<int, Lane>& lanes() {
  static auto* l = new std::map<int, Lane>;  // leaked: tensors freed after static destructors may ask
  return *l;
}
int key(Device device) { return device.is_cuda() ? device.index : -1; }

}  // namespace

CommLaneScope::CommLaneScope(bool on, bool streams) : prev_on_(t_lane_on), prev_streams_(t_lane_streams) {
  t_lane_on = on;
  t_lane_streams = streams;
}
CommLaneScope::~CommLaneScope() {
  t_lane_on = prev_on_;
  t_lane_streams = prev_streams_;
}
bool comm_lane_on() { return t_lane_on; }
bool comm_lane_streams() { return t_lane_streams; }

CommIssue::CommIssue(Device device, std::vector<Tensor> keep)
    : device_(device), streams_(device.is_cuda() && t_lane_streams), prev_(cuda_using_comm_stream()) {
  if (!streams_) comm_lane_join(device);  // what an earlier issue on the comm stream moves comes first
  std::lock_guard<std::mutex> lock(g_mu);
  Lane& lane = lanes()[key(device)];
  ticket_ = ++lane.last;
  if (!streams_) {  // one stream, which has what came before; the op runs on it now
    lane.waited = ticket_;
    return;
  }
  lane.pending.push_back(Issue{ticket_, take_event(lane), std::move(keep)});
  cuda_stream_waits(device.index, EngineStream::comm, EngineStream::compute);
  cuda_use_comm_stream(true);
}

CommIssue::~CommIssue() {
  if (!streams_) return;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (Issue& issue : lanes()[key(device_)].pending)
      if (issue.ticket == ticket_) {
        try {
          issue.event.record(current_stream(device_.index));  // still the comm stream
        } catch (...) {                                       // a launch failed before: its error is the report
        }
      }
  }
  cuda_use_comm_stream(prev_);
}

uint64_t comm_lane_last_ticket(Device device) {
  std::lock_guard<std::mutex> lock(g_mu);
  return lanes()[key(device)].last;
}

void comm_lane_wait(Device device, uint64_t ticket, const std::string* scope) {
  std::vector<Tensor> released;  // freed after the lock: a tensor's storage goes back to the allocator
  {
    std::lock_guard<std::mutex> lock(g_mu);
    Lane& lane = lanes()[key(device)];
    if (ticket <= lane.waited) return;
    FLOWMOE_CHECK(ticket <= lane.last, Error, "comm lane: ticket ", ticket, " was never issued (last ", lane.last, ")");
    Issue* wanted = nullptr;
    for (Issue& issue : lane.pending)
      if (issue.ticket == ticket) wanted = &issue;
    if (wanted) {
      OpTimer timer("exchange", forward_phase(), scope ? *scope : profile_scope(), device, 0, 0);
      wanted->event.wait(compute_stream(device.index));
    }
    while (!lane.pending.empty() && lane.pending.front().ticket <= ticket) {
      Issue& issue = lane.pending.front();
      for (Tensor& t : issue.keep) released.push_back(std::move(t));
      lane.events.push_back(std::move(issue.event));
      lane.pending.pop_front();
    }
    lane.waited = ticket;
  }
}

void comm_lane_join(Device device) { comm_lane_wait(device, comm_lane_last_ticket(device)); }

}  // namespace flowmoe
