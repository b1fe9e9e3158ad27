// The output folder's lock (see dir_lock.h).
#include "train/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "kernels/common/error.h"

namespace flowmoe {

namespace fs = std::filesystem;

// The pid the holder wrote into the lock file, or "unknown" (it may not have written it yet).
static std::string holder_pid(int fd) {
  char buf[32] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  std::string pid(buf, n > 0 ? size_t(n) : 0);
  while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
  return pid.empty() ? "unknown" : pid;
}

DirLock::DirLock(const std::string& dir, const std::string& what) : path_((fs::path(dir) / kDirLockFile).string()) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  FLOWMOE_CHECK(!ec, IoError, "cannot create ", what, " '", dir, "': ", ec.message());
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  FLOWMOE_CHECK(fd_ >= 0, IoError, "cannot open '", path_, "': ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string pid = err == EWOULDBLOCK ? holder_pid(fd_) : "";
    ::close(fd_);
    fd_ = -1;
    FLOWMOE_CHECK(err != EWOULDBLOCK, IoError, what, " '", dir, "' is in use by another flowmoe run (pid ", pid,
                  "); wait for it to end or give this run another logging.out_dir");
    FLOWMOE_THROW(IoError, "cannot lock '", path_, "': ", std::strerror(err));
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  const bool wrote = ::ftruncate(fd_, 0) == 0 && ::pwrite(fd_, pid.data(), pid.size(), 0) == ssize_t(pid.size());
  (void)wrote;  // the pid serves the message above only: the lock holds without it
}

DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor drops the lock
}

}  // namespace flowmoe
