// Files written in pieces and fsynced, files read at offsets, whole files and JSON strings: for
// checkpoints (train/checkpoint.cpp), plots (train/plot.cpp) and the tokenizer (train/bpe.cpp).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace flowmoe {

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
// Throws IoError naming the file.
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
// The whole file; throws IoError naming it when it cannot be opened.
std::string read_file(const std::string& path);

}  // namespace flowmoe
