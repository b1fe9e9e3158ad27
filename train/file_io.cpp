// Synced writes, reads at offsets, whole files and JSON strings (see file_io.h).
#include "train/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
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
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  FLOWMOE_CHECK(fd_ >= 0, IoError, "cannot create '", path, "': ", std::strerror(errno));
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
  fd_ = ::open(path.c_str(), O_RDONLY);
  FLOWMOE_CHECK(fd_ >= 0, IoError, "cannot open '", path, "'");
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    FLOWMOE_THROW(IoError, "cannot read the size of '", path, "': ", std::strerror(err));
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

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  FLOWMOE_CHECK(in.good(), IoError, "cannot open '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace flowmoe
