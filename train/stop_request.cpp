// A stop request: the signal flag and the stop file (see stop_request.h).
#include "train/stop_request.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "kernels/common/error.h"

namespace flowmoe {

namespace {

std::atomic<bool> g_stop_requested{false};
static_assert(std::atomic<bool>::is_always_lock_free, "request_stop is called from a signal handler");

}  // namespace

void request_stop() { g_stop_requested = true; }
void clear_stop_request() { g_stop_requested = false; }

std::string stop_file_path(const std::string& out_dir) {
  return (std::filesystem::path(out_dir) / kStopFileName).string();
}

bool stop_requested(const std::string& out_dir, bool check_file) {
  if (g_stop_requested) return true;
  if (!check_file) return false;
  // One stat a micro-batch: far below a micro-batch's time, and nothing to read or parse.
  struct stat st {};
  return ::stat(stop_file_path(out_dir).c_str(), &st) == 0;
}

bool remove_stop_file(const std::string& out_dir) {
  const std::string path = stop_file_path(out_dir);
  if (::unlink(path.c_str()) == 0) return true;
  const int err = errno;
  FLOWMOE_CHECK(err == ENOENT, IoError, "cannot remove the stop file '", path, "' after stopping: ", std::strerror(err),
                " (remove it before --resume, or the resumed run stops at once)");
  return false;
}

}  // namespace flowmoe
