// The op profiler behind `flowmoe train --profile N`: while it is on, every op the autograd engine
// runs is timed, its forward in eval(), its backward in the graph's walk, and a forward that runs
// inside a backward (checkpoint's recompute) apart. Each time goes to the scope the model was in
// when the op was recorded (ProfileScope: "layers.3.moe"), so a backward is charged to its layer.
// CPU ops are timed by the host clock. CUDA ops are timed by a pair of events on the engine stream,
// read once when the profile ends, so profiling adds no host sync per op; the host time of each call
// is kept beside it. Only the outermost op of a nest is timed: a vjp that runs ops of its own counts
// once.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/tensor.h"

namespace flowmoe {

// step: the training step's own work around the model (gradient sync and norm, the optimizer).
enum class OpPhase : uint8_t { forward, backward, recompute, step };
const char* op_phase_name(OpPhase phase);  // "fwd", "bwd", "recompute", "step"

// One (scope, op, phase) of a profile, summed over its calls.
struct OpTiming {
  std::string scope;  // "layers.3.moe"; "" outside any scope
  std::string op;     // the primitive's name
  OpPhase phase = OpPhase::forward;
  int64_t calls = 0;
  double device_ms = 0;  // the ops' time on their device (CUDA events; the host clock on the CPU)
  double host_ms = 0;    // the host's time inside the calls (launching, or computing on the CPU)
  double flops = 0;      // what Primitive::flops counts (0 where an op does not say)
  double bytes = 0;      // the bytes of the op's input and output tensors
};

// Starts recording on this thread (throws Error when already on).
void profile_begin();
// Stops recording, waits for the last op's events, and returns the sums in the order each
// (scope, op, phase) first ran.
std::vector<OpTiming> profile_end();
bool profiling();

// The scope ops are charged to while it lives; scopes nest with '.' ("layers.3" then "moe"), or
// with nested false the name replaces the current scope (a recompute back in its forward's scope).
class ProfileScope {
 public:
  explicit ProfileScope(const std::string& name, bool nested = true);
  ~ProfileScope();
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  bool active_;
};
const std::string& profile_scope();  // the current one, "" outside

// Times one op call while profiling (the autograd engine makes these): from construction to
// destruction, on the device of `device`. Nested timers inside an active one record nothing.
class OpTimer {
 public:
  OpTimer(const char* op, OpPhase phase, const std::string& scope, Device device, double flops, double bytes);
  ~OpTimer();
  void add_bytes(double bytes);  // the outputs', once they exist
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  int64_t index_ = -1;  // the call's slot in this thread's record; -1: not timed
};

// The phase eval() charges its ops to while the guard lives: backward during the graph's walk,
// recompute while a checkpoint re-runs its forward.
class EvalPhaseGuard {
 public:
  explicit EvalPhaseGuard(OpPhase phase);
  ~EvalPhaseGuard();
  EvalPhaseGuard(const EvalPhaseGuard&) = delete;
  EvalPhaseGuard& operator=(const EvalPhaseGuard&) = delete;

 private:
  OpPhase prev_;
};
OpPhase forward_phase();  // the phase eval() charges now (forward outside any guard)

double tensor_bytes(const std::vector<Tensor>& tensors);  // the defined ones' storage bytes, scales included

}  // namespace flowmoe
