// Synced writes, reads at offsets, whole files, JSON strings and OS errors (see file_io.h).
#include "io/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "kernels/common/error.h"

namespace flowmoe {

std::string os_error(const std::string& action, const std::string& path, int err) {
  return "cannot " + action + " '" + path + "': " + std::strerror(err);
}

std::string os_error(const std::string& action, const std::string& path, const std::error_code& ec) {
  return "cannot " + action + " '" + path + "': " + ec.message();
}

bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {};
  struct stat sb {};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

const char* file_type_name(const struct stat& st) {
  if (S_ISREG(st.st_mode)) return "a regular file";
  if (S_ISDIR(st.st_mode)) return "a directory";
  if (S_ISCHR(st.st_mode)) return "a character device";
  if (S_ISBLK(st.st_mode)) return "a block device";
  if (S_ISFIFO(st.st_mode)) return "a FIFO";
  if (S_ISSOCK(st.st_mode)) return "a socket";
  return "not a file";
}

std::string json_escape(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20 || c == 0x7f) {
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

SyncedFile::SyncedFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  FLOWMOE_CHECK(fd_ >= 0, IoError, os_error("create", path, errno));
}

SyncedFile::~SyncedFile() {
  if (fd_ >= 0) ::close(fd_);
}

void SyncedFile::write(const void* data, size_t num_bytes) {
  FLOWMOE_CHECK(fd_ >= 0, IoError, "writing '", path_, "' after it was closed");
  const char* p = static_cast<const char*>(data);
  size_t done = 0;
  while (done < num_bytes) {
    ssize_t n = ::write(fd_, p + done, num_bytes - done);
    if (n < 0 && errno == EINTR) continue;
    FLOWMOE_CHECK(n > 0, IoError, "writing '", path_, "' failed: ", std::strerror(errno));
    done += size_t(n);
  }
}

void SyncedFile::close() {
  bool ok = ::fsync(fd_) == 0;
  int err = errno;
  ok = ::close(fd_) == 0 && ok;
  fd_ = -1;
  FLOWMOE_CHECK(ok, IoError, "fsync of '", path_, "' failed: ", std::strerror(err));
}

void write_file_synced(const std::string& path, const std::vector<const std::string*>& chunks) {
  SyncedFile f(path);
  for (const std::string* c : chunks) f.write(c->data(), c->size());
  f.close();
}

FileReader::FileReader(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  FLOWMOE_CHECK(fd_ >= 0, IoError, os_error("open", path, errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    FLOWMOE_THROW(IoError, os_error("read the size of", path, err));
  }
  size_ = uint64_t(st.st_size);
}

FileReader::~FileReader() {
  if (fd_ >= 0) ::close(fd_);
}

void FileReader::read_at(uint64_t offset, void* dst, size_t num_bytes) const {
  char* p = static_cast<char*>(dst);
  size_t done = 0;
  while (done < num_bytes) {
    ssize_t n = ::pread(fd_, p + done, num_bytes - done, off_t(offset + done));
    if (n < 0 && errno == EINTR) continue;
    FLOWMOE_CHECK(n > 0, IoError, "reading '", path_, "' failed at byte ", offset + done, ": ",
                  n == 0 ? "the file ends there" : std::strerror(errno));
    done += size_t(n);
  }
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;  // some filesystems do not allow it; the rename is still atomic
  ::fsync(fd);
  ::close(fd);
}

// "1048576 bytes (1 MiB)": a size limit as the messages give it.
static std::string limit_text(uint64_t bytes) {
  constexpr uint64_t kMiB = uint64_t(1) << 20;
  return std::to_string(bytes) + " bytes" + (bytes % kMiB == 0 ? " (" + std::to_string(bytes / kMiB) + " MiB)" : "");
}

std::string read_file(const std::string& path, uint64_t max_bytes, const std::string& what) {
  // O_NONBLOCK: a FIFO's open would otherwise wait for a writer before fstat could refuse it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  FLOWMOE_CHECK(fd >= 0, IoError, os_error("open " + what, path, errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  FLOWMOE_CHECK(::fstat(fd, &st) == 0, IoError, os_error("read the size of " + what, path, errno));
  FLOWMOE_CHECK(S_ISREG(st.st_mode), IoError, what, " '", path, "' is ", file_type_name(st), ", not a regular file");
  const auto check_size = [&](uint64_t n) {
    FLOWMOE_CHECK(n <= max_bytes, IoError, what, " '", path, "' is over the limit of ", limit_text(max_bytes),
                  " for a ", what, " (", n, " bytes", n == uint64_t(st.st_size) ? "" : " read and more", ")");
  };
  check_size(uint64_t(st.st_size));
  std::string text(size_t(st.st_size), '\0');
  size_t done = 0;
  while (true) {  // past the size fstat gave, in case the file grew since: to its end, or past the limit
    if (done == text.size()) text.resize(done + 65536);
    const ssize_t n = ::read(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    FLOWMOE_CHECK(n >= 0, IoError, os_error("read " + what, path, errno));
    if (n == 0) break;
    done += size_t(n);
    check_size(done);
  }
  text.resize(done);
  return text;
}

}  // namespace flowmoe
