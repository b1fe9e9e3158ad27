// The op profiler (see profiler.h): a thread-local record of timed calls, summed at the end.
#include "engine/profiler.h"

#include <chrono>
#include <map>
#include <tuple>

#include "kernels/common/device_api.h"
#include "kernels/common/error.h"

namespace flowmoe {

namespace {

using Clock = std::chrono::steady_clock;

struct Call {
  std::string scope;
  const char* op;
  OpPhase phase;
  Device device;
  double flops, bytes;
  Clock::time_point host_start;
  double host_ms = 0;
  TimingEvent start = nullptr, end = nullptr;  // CUDA calls only
};

struct State {
  bool on = false;
  int depth = 0;  // timers alive: only the outermost records
  OpPhase eval_phase = OpPhase::forward;
  std::vector<std::string> scopes;  // full names, innermost last
  std::vector<Call> calls;
};
thread_local State g;

const std::string kNoScope;

void free_events(std::vector<Call>& calls) {
  for (Call& c : calls) cuda_destroy_timing_event(c.start), cuda_destroy_timing_event(c.end);
}

}  // namespace

const char* op_phase_name(OpPhase phase) {
  switch (phase) {
    case OpPhase::forward:
      return "fwd";
    case OpPhase::backward:
      return "bwd";
    case OpPhase::recompute:
      return "recompute";
    case OpPhase::step:
      return "step";
  }
  return "?";
}

void profile_begin() {
  FLOWMOE_CHECK(!g.on, Error, "profile_begin: the profiler is already on");
  g.on = true;
  g.depth = 0;
  g.calls.clear();
}

bool profiling() { return g.on; }

std::vector<OpTiming> profile_end() {
  FLOWMOE_CHECK(g.on, Error, "profile_end: the profiler is not on");
  g.on = false;
  std::vector<Call> calls = std::move(g.calls);
  g.calls.clear();
  std::vector<OpTiming> out;
  std::map<std::tuple<std::string, std::string, OpPhase>, size_t> index;
  try {
    for (const Call& c : calls) {
      auto [it, fresh] = index.try_emplace({c.scope, c.op, c.phase}, out.size());
      if (fresh) out.push_back({c.scope, c.op, c.phase});
      OpTiming& t = out[it->second];
      ++t.calls;
      t.host_ms += c.host_ms;
      t.device_ms += c.start ? double(cuda_elapsed_ms(c.start, c.end)) : c.host_ms;
      t.flops += c.flops;
      t.bytes += c.bytes;
    }
  } catch (...) {
    free_events(calls);
    throw;
  }
  free_events(calls);
  return out;
}

ProfileScope::ProfileScope(const std::string& name, bool nested) : active_(g.on) {
  if (active_) g.scopes.push_back(!nested || g.scopes.empty() ? name : g.scopes.back() + "." + name);
}
ProfileScope::~ProfileScope() {
  if (active_ && !g.scopes.empty()) g.scopes.pop_back();
}
const std::string& profile_scope() { return g.scopes.empty() ? kNoScope : g.scopes.back(); }

OpTimer::OpTimer(const char* op, OpPhase phase, const std::string& scope, Device device, double flops, double bytes) {
  if (!g.on) return;
  if (g.depth > 0) {  // inside a timed op: counted there
    ++g.depth;
    return;
  }
  Call c{scope, op, phase, device, flops, bytes, Clock::now()};
  if (device.is_cuda()) c.start = cuda_record_timing_event(device.index);  // may throw: nothing changed yet
  ++g.depth;
  index_ = int64_t(g.calls.size());
  g.calls.push_back(std::move(c));
}

void OpTimer::add_bytes(double bytes) {
  if (g.on && index_ >= 0 && index_ < int64_t(g.calls.size())) g.calls[size_t(index_)].bytes += bytes;
}

OpTimer::~OpTimer() {
  if (!g.on) return;
  --g.depth;
  if (index_ < 0 || index_ >= int64_t(g.calls.size())) return;
  Call& c = g.calls[size_t(index_)];
  if (c.device.is_cuda()) {
    try {
      c.end = cuda_record_timing_event(c.device.index);
    } catch (...) {  // a destructor must not throw; the call then counts its host time only
      cuda_destroy_timing_event(c.start);
      c.start = nullptr;
    }
  }
  c.host_ms = std::chrono::duration<double, std::milli>(Clock::now() - c.host_start).count();
}

EvalPhaseGuard::EvalPhaseGuard(OpPhase phase) : prev_(g.eval_phase) { g.eval_phase = phase; }
EvalPhaseGuard::~EvalPhaseGuard() { g.eval_phase = prev_; }
OpPhase forward_phase() { return g.eval_phase; }

double tensor_bytes(const std::vector<Tensor>& tensors) {
  double n = 0;
  for (const Tensor& t : tensors)
    if (t.defined()) {
      n += double(t.nbytes());
      if (const auto& s = t.fp8_scales()) n += double(s->scale_inv.nbytes());
    }
  return n;
}

}  // namespace flowmoe
