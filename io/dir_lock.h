// One run per output folder: an advisory lock (flock) on <dir>/run.lock, held while a run writes there,
// so a second run into the same folder is refused instead of interleaving its metrics and checkpoints.
// The kernel drops the lock when the process ends however it ends, so a killed run never blocks the next.
// Taking it also proves the folder writable, so a read-only folder is refused at start, not at the first
// file written there. Tested in tests/test_checkpoint_load.cpp (RunDirLock).
#pragma once
#include <string>

namespace flowmoe {

constexpr const char* kDirLockFile = "run.lock";  // in every run folder (and a checkpoint folder outside it)

class DirLock {
 public:
  // Creates dir if needed, takes the lock, writing this process's pid into the file, and creates and
  // removes a file there; throws IoError naming the folder and the pid of the process that holds it, or
  // the OS's reason it cannot be written. `what` names the folder in those messages ("the run directory",
  // "the checkpoint directory"), `key` the config key that gives a run another one ("logging.out_dir").
  DirLock(const std::string& dir, const std::string& what, const std::string& key = "logging.out_dir");
  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace flowmoe
