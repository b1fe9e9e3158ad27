// The collectives' watchdog (see watchdog.h).
#include "parallel/watchdog.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "kernels/common/error.h"

namespace flowmoe {

namespace {

using Clock = std::chrono::steady_clock;

// The process's one armed wait, written by the thread that calls the collectives and read by the watchdog.
struct ArmedWait {
  std::mutex mutex;
  bool running = false;        // a CollectiveWatchdog exists
  int paused = 0;              // UnwatchedWait depth
  const char* what = nullptr;  // null: not armed
  const char* backend = "";
  int num_ranks = 0;
  uint64_t generation = 0;  // one more at each arming: the watchdog tells two waits of one name apart
};

ArmedWait& armed() {
  static ArmedWait a;
  return a;
}

}  // namespace

CollectiveWatchdog::CollectiveWatchdog(double timeout_s, int rank) : timeout_s_(timeout_s), rank_(rank) {
  if (timeout_s_ <= 0) return;
  {
    std::lock_guard<std::mutex> lock(armed().mutex);
    FLOWMOE_CHECK(!armed().running, Error, "a collective watchdog already runs in this process");
    armed().running = true;
  }
  thread_ = std::thread([this] { watch(); });
}

CollectiveWatchdog::~CollectiveWatchdog() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  thread_.join();
  std::lock_guard<std::mutex> lock(armed().mutex);
  armed().running = false;
}

void CollectiveWatchdog::watch() {
  // A tenth of the timeout between looks: the job ends at most 10% late, and a long timeout costs nothing.
  const double poll_s = std::min(std::max(timeout_s_ / 10, 0.01), 1.0);
  const auto poll = std::chrono::duration<double>(poll_s);
  // The wait is counted in this thread's own looks, each at most two polls long: a process that was itself
  // paused (SIGSTOP, a suspended VM) does not count its pause against its peers when it goes on.
  double waited = 0;
  uint64_t seen = 0;
  Clock::time_point last = Clock::now();
  std::unique_lock<std::mutex> self(mutex_);
  while (!wake_.wait_for(self, poll, [this] { return stopping_; })) {
    const Clock::time_point now = Clock::now();
    const double step = std::min(std::chrono::duration<double>(now - last).count(), 2 * poll_s);
    last = now;
    std::lock_guard<std::mutex> lock(armed().mutex);
    const ArmedWait& a = armed();
    if (!a.what || a.paused > 0 || a.generation != seen) {
      waited = 0;
      seen = a.generation;
      continue;
    }
    waited += step;
    if (waited < timeout_s_) continue;
    // The main thread is stuck in the call; this thread ends the process. No destructor runs: they would
    // wait for the same peers (MPI_Finalize), and a checkpoint on disk is already complete or a step_N.tmp.
    std::fprintf(stderr,
                 "flowmoe: error: rank %d has waited %.0f s in %s over %d ranks (%s), more than parallel.timeout_s = "
                 "%g: another rank stopped answering (paused, hung or gone); ending the job\n",
                 rank_, waited, a.what, a.num_ranks, a.backend, timeout_s_);
    std::fflush(stderr);
    std::_Exit(kWatchdogExitStatus);
  }
}

WatchedWait::WatchedWait(const char* what, const char* backend, int num_ranks) {
  ArmedWait& a = armed();
  std::lock_guard<std::mutex> lock(a.mutex);
  if (!a.running || a.what) return;
  a.what = what;
  a.backend = backend;
  a.num_ranks = num_ranks;
  ++a.generation;
  armed_ = true;
}

WatchedWait::~WatchedWait() {
  if (!armed_) return;
  std::lock_guard<std::mutex> lock(armed().mutex);
  armed().what = nullptr;
}

UnwatchedWait::UnwatchedWait() {
  std::lock_guard<std::mutex> lock(armed().mutex);
  ++armed().paused;
}

UnwatchedWait::~UnwatchedWait() {
  std::lock_guard<std::mutex> lock(armed().mutex);
  --armed().paused;
}

}  // namespace flowmoe
