// Wall time measured in laps on the steady clock: the one timer of a run, for the summary's set-up parts,
// evaluation and checkpoints (run.h's RunClock) and the training time tokens/s is counted over (loop_state.h).
#pragma once
#include <chrono>

namespace flowmoe {

// Each lap() ends a lap: it adds the time since the previous lap, the last restart() or the construction to the
// total, and returns it. Time between a lap and the next restart() is left out of the total.
class LapTimer {
 public:
  using Clock = std::chrono::steady_clock;
  explicit LapTimer(Clock::time_point since = Clock::now()) : since_(since) {}
  void restart() { since_ = Clock::now(); }
  double lap() {
    const Clock::time_point now = Clock::now();
    const double dt = std::chrono::duration<double>(now - since_).count();
    since_ = now;
    seconds_ += dt;
    return dt;
  }
  // The time since the previous lap, restart or construction, which the next lap would add.
  double running() const { return std::chrono::duration<double>(Clock::now() - since_).count(); }
  double seconds() const { return seconds_; }  // the laps' total

 private:
  Clock::time_point since_;
  double seconds_ = 0;
};

}  // namespace flowmoe
