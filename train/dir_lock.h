// One run per output folder: an advisory lock (flock) on <dir>/run.lock, held while a run writes there,
// so a second run into the same folder is refused instead of interleaving its metrics and checkpoints.
// The kernel drops the lock when the process ends however it ends, so a killed run never blocks the next.
// Tested in tests/test_checkpoint.cpp (DirLock).
#pragma once
#include <string>

namespace flowmoe {

constexpr const char* kDirLockFile = "run.lock";  // in every run folder (and a checkpoint folder outside it)

class DirLock {
 public:
  // Creates dir if needed and takes the lock, writing this process's pid into the file; throws IoError
  // naming the folder and the pid of the process that holds it. `what` names the folder in that message
  // ("the run directory", "the checkpoint directory").
  DirLock(const std::string& dir, const std::string& what);
  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace flowmoe
