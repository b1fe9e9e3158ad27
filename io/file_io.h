// Files written in pieces and fsynced, files read at offsets, whole files and JSON strings: for
// checkpoints (checkpoint/checkpoint.cpp), plots (studies/plot.cpp) and the tokenizer (dataset/bpe.cpp); and
// the one form of a message where the OS refused a file.
#pragma once
#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <system_error>
#include <vector>

namespace flowmoe {

// "cannot <action> '<path>': <the OS's reason>" (err an errno value, or a filesystem error).
std::string os_error(const std::string& action, const std::string& path, int err);
std::string os_error(const std::string& action, const std::string& path, const std::error_code& ec);

// Whether both paths name one existing file, by device and inode: "./x", a symlink and a hard link
// are the file itself.
bool same_file(const std::string& a, const std::string& b);

// What a stat names: "a directory", "a character device", "a FIFO", ... ("a regular file").
const char* file_type_name(const struct stat& st);

// s as a JSON string literal, with the quotes (also a valid gnuplot and Python string, and a YAML
// double-quoted scalar that reads back as s: control characters and DEL are escaped).
std::string json_escape(const std::string& s);

// A file written in pieces and fsynced by close(), so a later rename publishes complete contents:
// a checkpoint's tensors go to the file one by one, never staged whole in memory. Throws IoError
// naming the file. Destroyed before close() (an exception), it closes the file unsynced.
class SyncedFile {
 public:
  explicit SyncedFile(const std::string& path);  // creates or truncates
  ~SyncedFile();
  SyncedFile(const SyncedFile&) = delete;
  SyncedFile& operator=(const SyncedFile&) = delete;
  void write(const void* data, size_t num_bytes);
  void close();

 private:
  std::string path_;
  int fd_ = -1;
};

// Writes the chunks to path, back to back, through a SyncedFile.
void write_file_synced(const std::string& path, const std::vector<const std::string*>& chunks);

// A file read at offsets, so a reader takes the parts it needs straight into their destination.
// Throws IoError naming the file, with the OS's reason where it refused.
class FileReader {
 public:
  explicit FileReader(const std::string& path);
  ~FileReader();
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;
  uint64_t size() const { return size_; }
  void read_at(uint64_t offset, void* dst, size_t num_bytes) const;  // all of them, or IoError

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};
// fsyncs a directory (after a rename into it); quietly does nothing where the filesystem refuses.
void fsync_dir(const std::string& dir);
constexpr uint64_t kNoSizeLimit = std::numeric_limits<uint64_t>::max();

// The whole file; throws IoError naming it (what: its kind in messages, e.g. "config file") when it
// cannot be opened or read (with the OS's reason), when it is not a regular file (a read of /dev/zero
// would never end, a FIFO's waits for a writer) or when it holds more than max_bytes.
std::string read_file(const std::string& path, uint64_t max_bytes = kNoSizeLimit, const std::string& what = "file");

}  // namespace flowmoe
