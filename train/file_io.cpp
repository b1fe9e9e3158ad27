// Whole files and JSON strings (see file_io.h).
#include "train/file_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "kernels/common/error.h"

namespace flowmoe {

std::string json_escape(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += char(c);
        }
    }
  }
  return out + "\"";
}

// Writes bytes to path and fsyncs it, so a later rename publishes complete contents.
void write_file_synced(const std::string& path, const std::vector<const std::string*>& chunks) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  FLOWMOE_CHECK(fd >= 0, IoError, "cannot create '", path, "': ", std::strerror(errno));
  for (const std::string* c : chunks) {
    size_t done = 0;
    while (done < c->size()) {
      ssize_t n = ::write(fd, c->data() + done, c->size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        int err = errno;
        ::close(fd);
        FLOWMOE_THROW(IoError, "writing '", path, "' failed: ", std::strerror(err));
      }
      done += size_t(n);
    }
  }
  bool ok = ::fsync(fd) == 0;
  int err = errno;
  ::close(fd);
  FLOWMOE_CHECK(ok, IoError, "fsync of '", path, "' failed: ", std::strerror(err));
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;  // some filesystems do not allow it; the rename is still atomic
  ::fsync(fd);
  ::close(fd);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  FLOWMOE_CHECK(in.good(), IoError, "cannot open '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace flowmoe
