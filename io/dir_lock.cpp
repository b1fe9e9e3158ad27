// The output folder's lock (see dir_lock.h).
#include "io/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "io/file_io.h"
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

// Creates and removes a file in dir. An existing run.lock opens for writing even in a folder that no longer
// takes new files (chmod a-w), where every checkpoint would fail: this finds that at once.
static void check_writable(const std::string& dir, const std::string& what) {
  const std::string probe = (fs::path(dir) / ".run.lock.probe").string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int err = errno;
  FLOWMOE_CHECK(fd >= 0, IoError, what, " '", dir, "' is not writable: cannot create '", probe,
                "': ", std::strerror(err));
  ::close(fd);
  ::unlink(probe.c_str());
}

DirLock::DirLock(const std::string& dir, const std::string& what, const std::string& key)
    : path_((fs::path(dir) / kDirLockFile).string()) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  FLOWMOE_CHECK(!ec, IoError, "cannot create ", what, " '", dir, "': ", ec.message());
  check_writable(dir, what);
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  FLOWMOE_CHECK(fd_ >= 0, IoError, os_error("open", path_, errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string pid = err == EWOULDBLOCK ? holder_pid(fd_) : "";
    ::close(fd_);
    fd_ = -1;
    FLOWMOE_CHECK(err != EWOULDBLOCK, IoError, what, " '", dir, "' is in use by another flowmoe run (pid ", pid,
                  "); wait for it to end or give this run another ", key);
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
