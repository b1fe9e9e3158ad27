// The collectives' watchdog (parallel.timeout_s): a thread per process that ends the job when a collective,
// or a host wait for one, has not returned within the timeout, as PyTorch's process-group watchdog does. A
// rank that stops answering (paused, stuck in a driver, its host gone) otherwise leaves every peer waiting
// in its next collective forever, and no launcher notices.
//
// The communicators arm it around each blocking call (Communicator's public calls, parallel/communicator.cpp;
// the trainer around the read-back of a step whose collectives run on the GPUs), naming the call. A call
// armed longer than the timeout prints one line,
//   [rank 0] flowmoe: error: all_reduce over 2 ranks (mpi) did not complete within parallel.timeout_s = 3 s: ...
// and ends the process with kWatchdogExitStatus; the launcher (mpirun, srun) then ends the other ranks.
// Ending a process there never tears a checkpoint: each is written into step_N.tmp and renamed into place
// once complete (checkpoint/checkpoint.h), and a resume ignores, and the next run removes, a step_N.tmp.
// Tests: tests/mpi/test_stop_train.cpp.
#pragma once
#include <condition_variable>
#include <mutex>
#include <thread>

namespace flowmoe {

// The exit status of a process the watchdog ends: an error, as for any other failed run.
constexpr int kWatchdogExitStatus = 1;

// Runs the watchdog thread for its lifetime (one at a time per process). timeout_s 0: off (no thread).
class CollectiveWatchdog {
 public:
  CollectiveWatchdog(double timeout_s, int rank);
  ~CollectiveWatchdog();
  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;

 private:
  void watch();

  double timeout_s_;
  int rank_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;
};

// Arms the watchdog for its lifetime with the call it waits in: `what` over `num_ranks` ranks of `backend`
// (static strings). Inside another armed wait it changes nothing: the outer wait's clock goes on. Costs a
// lock.
class WatchedWait {
 public:
  WatchedWait(const char* what, const char* backend, int num_ranks);
  ~WatchedWait();
  WatchedWait(const WatchedWait&) = delete;
  WatchedWait& operator=(const WatchedWait&) = delete;

 private:
  bool armed_ = false;  // this guard armed the watchdog (it was not armed before)
};

// No wait is timed while it lives: one whose length has no bound a step sets, such as waiting for rank 0
// to write a checkpoint. An armed wait around it counts from the end of it.
class UnwatchedWait {
 public:
  UnwatchedWait();
  ~UnwatchedWait();
  UnwatchedWait(const UnwatchedWait&) = delete;
  UnwatchedWait& operator=(const UnwatchedWait&) = delete;
};

}  // namespace flowmoe
