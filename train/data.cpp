// Token sources and the deterministic batch order (see data.h).
#include "train/data.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>

#include "engine/rng.h"
#include "kernels/common/error.h"

namespace flowmoe {

namespace fs = std::filesystem;

// ---- token files --------------------------------------------------------------------------------

// The size is checked against the header before anything is allocated: a damaged count must not
// turn into a multi-gigabyte allocation, and a file with extra or odd bytes is not silently cut.
std::vector<uint16_t> read_token_file(const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  FLOWMOE_CHECK(!ec && fs::exists(st), IoError, "cannot open token file '", path, "': ",
                ec ? ec.message() : "it does not exist");
  FLOWMOE_CHECK(fs::is_regular_file(st), IoError, "token file '", path, "' is not a regular file");
  const uintmax_t size = fs::file_size(path, ec);
  FLOWMOE_CHECK(!ec, IoError, "cannot read the size of token file '", path, "': ", ec.message());
  std::ifstream in(path, std::ios::binary);
  FLOWMOE_CHECK(in.good(), IoError, "cannot open token file '", path, "'");
  constexpr uintmax_t header_bytes = kTokenFileHeaderInts * sizeof(int32_t);
  FLOWMOE_CHECK(size >= header_bytes, IoError, "token file '", path, "' is ", size, " bytes, shorter than its ",
                header_bytes, "-byte header");
  int32_t header[kTokenFileHeaderInts] = {};
  in.read(reinterpret_cast<char*>(header), sizeof header);
  FLOWMOE_CHECK(in.gcount() == std::streamsize(sizeof header), IoError, "token file '", path, "': reading its ",
                header_bytes, "-byte header failed");
  FLOWMOE_CHECK(header[0] == kTokenFileMagic, IoError, "token file '", path, "' has magic ", header[0], ", expected ",
                kTokenFileMagic, " (an llm.c-style .bin file; write one with `flowmoe prepare-data`)");
  FLOWMOE_CHECK(header[1] == kTokenFileVersion, IoError, "token file '", path, "' has version ", header[1],
                ", expected ", kTokenFileVersion, " (uint16 tokens)");
  const int64_t count = header[2];
  FLOWMOE_CHECK(count >= 0, IoError, "token file '", path, "' has a negative token count ", count);
  const uintmax_t body = size - header_bytes, expected = header_bytes + 2 * uintmax_t(count);
  FLOWMOE_CHECK(body % 2 == 0, IoError, "token file '", path, "' is ", size, " bytes: the ", body,
                " bytes after its header are an odd count, not whole uint16 tokens (its header's token count ", count,
                " means ", expected, " bytes)");
  FLOWMOE_CHECK(size == expected, IoError, "token file '", path, "' is ", size, " bytes, but its header's token count ",
                count, " means ", header_bytes, " + 2 x ", count, " = ", expected, " bytes (",
                size < expected ? "truncated" : "extra bytes after the tokens", ")");
  std::vector<uint16_t> tokens(static_cast<size_t>(count));
  in.read(reinterpret_cast<char*>(tokens.data()), std::streamsize(tokens.size() * sizeof(uint16_t)));
  FLOWMOE_CHECK(in.gcount() == std::streamsize(tokens.size() * sizeof(uint16_t)), IoError, "token file '", path,
                "': reading its ", count, " tokens failed after ", in.gcount(), " bytes (did it change meanwhile?)");
  return tokens;
}

void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens) {
  FLOWMOE_CHECK(tokens.size() <= size_t(INT32_MAX), IoError, "token file '", path, "': ", tokens.size(),
                " tokens exceed the format's int32 count");
  int32_t header[kTokenFileHeaderInts] = {};
  header[0] = kTokenFileMagic;
  header[1] = kTokenFileVersion;
  header[2] = int32_t(tokens.size());
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    FLOWMOE_CHECK(out.good(), IoError, "cannot write '", tmp, "'");
    out.write(reinterpret_cast<const char*>(header), sizeof header);
    out.write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(tokens.size() * sizeof(uint16_t)));
    out.flush();
    FLOWMOE_CHECK(out.good(), IoError, "writing '", tmp, "' failed (disk full?)");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  FLOWMOE_CHECK(!ec, IoError, "renaming '", tmp, "' to '", path, "' failed: ", ec.message());
}

// ---- text ---------------------------------------------------------------------------------------

// The bytes of a file, whatever it holds.
static void read_bytes(const fs::path& p, std::vector<char>& bytes) {
  std::ifstream in(p, std::ios::binary);
  FLOWMOE_CHECK(in.good(), IoError, "cannot open text file '", p.string(), "'");
  bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  FLOWMOE_CHECK(!in.bad(), IoError, "reading '", p.string(), "' failed");
}

// Byte-level tokens: one token per byte.
static void append_tokens(const std::vector<char>& bytes, std::vector<uint16_t>& out) {
  for (char c : bytes) out.push_back(uint16_t(static_cast<unsigned char>(c)));
}

static void append_file_bytes(const fs::path& p, std::vector<uint16_t>& out) {
  std::vector<char> bytes;
  read_bytes(p, bytes);
  append_tokens(bytes, out);
}

std::vector<uint16_t> read_text_tokens(const std::string& path) {
  std::vector<uint16_t> out;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(path))
      if (e.is_regular_file()) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    FLOWMOE_CHECK(!files.empty(), IoError, "text directory '", path, "' holds no files");
    for (const auto& f : files) append_file_bytes(f, out);
  } else {
    append_file_bytes(path, out);
  }
  return out;
}

// ---- prepare-data -------------------------------------------------------------------------------

namespace {

constexpr size_t kBinaryProbeBytes = 8192;

// The bytes of a text file into `bytes`; false, with the rest unread, when its first 8 KiB hold a
// NUL byte (no text encoding byte-level tokens are meant for has one).
bool read_if_text(const fs::path& p, std::vector<char>& bytes) {
  std::ifstream in(p, std::ios::binary);
  FLOWMOE_CHECK(in.good(), IoError, "prepare-data: cannot open '", p.string(), "'");
  bytes.assign(kBinaryProbeBytes, 0);
  in.read(bytes.data(), std::streamsize(bytes.size()));
  bytes.resize(size_t(in.gcount()));
  if (std::memchr(bytes.data(), 0, bytes.size())) return false;
  bytes.insert(bytes.end(), std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  FLOWMOE_CHECK(!in.bad(), IoError, "prepare-data: reading '", p.string(), "' failed");
  return true;
}

// The regular files below `dir` at any depth, sorted by their path relative to it (byte order).
std::vector<fs::path> files_below(const std::string& dir) {
  std::vector<std::pair<std::string, fs::path>> found;
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code type_ec;
    if (it->is_regular_file(type_ec))
      found.emplace_back(it->path().lexically_relative(dir).generic_string(), it->path());
  }
  FLOWMOE_CHECK(!ec, IoError, "prepare-data: cannot list directory '", dir, "': ", ec.message());
  std::sort(found.begin(), found.end());
  std::vector<fs::path> files;
  for (auto& f : found) files.push_back(std::move(f.second));
  return files;
}

std::string human_bytes(int64_t n) {
  if (n < 1000) return std::to_string(n) + " bytes";
  const char* units[] = {"kB", "MB", "GB", "TB"};
  double v = double(n) / 1000;
  int u = 0;
  for (; v >= 1000 && u < 3; ++u) v /= 1000;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
}

std::string count_of(size_t n, const char* what) {
  return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
}

}  // namespace

int64_t PreparedInputs::bytes() const {
  int64_t n = 0;
  for (const File& f : files) n += f.bytes;
  return n;
}

std::string PreparedInputs::summary() const {
  std::string s = "read " + count_of(files.size(), "file") + " (" + human_bytes(bytes()) + ")";
  if (skipped_binary.empty()) return s;
  const size_t shown = std::min<size_t>(skipped_binary.size(), 10);
  s += ", skipped " + count_of(skipped_binary.size(), "binary file") + ": ";
  for (size_t i = 0; i < shown; ++i) s += (i ? ", " : "") + skipped_binary[i];
  if (shown < skipped_binary.size()) s += " and " + std::to_string(skipped_binary.size() - shown) + " more";
  return s;
}

int64_t prepare_token_file(const std::vector<std::string>& inputs, const std::string& output, PreparedInputs* read) {
  FLOWMOE_CHECK(!inputs.empty(), IoError, "prepare-data: no input files");
  PreparedInputs info;
  std::vector<uint16_t> tokens;
  std::vector<char> bytes;
  auto append = [&](const fs::path& p) {
    append_tokens(bytes, tokens);
    info.files.push_back({p.string(), int64_t(bytes.size())});
  };
  std::error_code out_ec;
  const fs::path out_path = fs::weakly_canonical(output, out_ec);
  auto is_output = [&](const fs::path& p) {
    std::error_code ec;
    const fs::path q = fs::weakly_canonical(p, ec);
    return !out_ec && !ec && q == out_path;
  };
  for (const std::string& in : inputs) {
    std::error_code ec;
    if (!fs::is_directory(in, ec)) {
      read_bytes(in, bytes);  // a file named as an input is read whatever it holds
      append(in);
      continue;
    }
    const size_t files_before = info.files.size(), skipped_before = info.skipped_binary.size();
    for (const fs::path& p : files_below(in)) {
      if (is_output(p)) continue;
      if (read_if_text(p, bytes)) append(p);
      else info.skipped_binary.push_back(p.string());
    }
    FLOWMOE_CHECK(info.files.size() > files_before, IoError, "prepare-data: directory '", in, "' holds no text files (",
                  count_of(info.skipped_binary.size() - skipped_before, "binary file"), " skipped)");
  }
  write_token_file(output, tokens);
  if (read) *read = std::move(info);
  return int64_t(tokens.size());
}

// ---- the loader ---------------------------------------------------------------------------------

DataLoader::DataLoader(std::vector<uint16_t> tokens, int64_t vocab_size, int64_t seq_len, double val_fraction,
                       uint64_t seed, std::string name)
    : tokens_(std::move(tokens)), seq_len_(seq_len), seed_(seed) {
  FLOWMOE_CHECK(seq_len >= 1, Error, "seq_len must be positive, got ", seq_len);
  for (size_t i = 0; i < tokens_.size(); ++i)
    FLOWMOE_CHECK(tokens_[i] < vocab_size, IoError, name, ": token ", tokens_[i], " at position ", i,
                  " is outside model.vocab_size = ", vocab_size);
  const int64_t n = int64_t(tokens_.size());
  int64_t num_val_tokens = int64_t(double(n) * val_fraction);
  train_end_ = n - num_val_tokens;
  num_train_ = train_end_ > 0 ? (train_end_ - 1) / seq_len : 0;
  num_val_ = num_val_tokens > 0 ? (num_val_tokens - 1) / seq_len : 0;
  FLOWMOE_CHECK(num_train_ >= 1, IoError, name, ": ", train_end_, " training tokens are too few for one sequence of ",
                seq_len, " + 1 tokens");
  FLOWMOE_CHECK(val_fraction == 0 || num_val_ >= 1, IoError, name, ": ", num_val_tokens,
                " validation tokens (data.val_fraction = ", val_fraction, ") are too few for one sequence of ",
                seq_len, " + 1 tokens");
  shuffle_epoch();
}

DataLoader DataLoader::from_config(const Config& cfg) {
  const DataConfig& d = cfg.data;
  std::vector<uint16_t> tokens;
  std::string name;
  if (d.source == "synthetic") {
    if (d.synthetic_kind == "bigram")
      tokens = synthetic_bigram_corpus(cfg.model.vocab_size, d.synthetic_tokens, uint64_t(d.seed));
    else
      tokens = synthetic_corpus(cfg.model.vocab_size, d.synthetic_tokens, uint64_t(d.seed));
    name = "synthetic corpus (" + d.synthetic_kind + ")";
  } else if (d.source == "text") {
    tokens = read_text_tokens(d.path);
    name = "text '" + d.path + "'";
  } else {
    tokens = read_token_file(d.path);
    name = "token file '" + d.path + "'";
  }
  return DataLoader(std::move(tokens), cfg.model.vocab_size, d.seq_len, d.val_fraction, uint64_t(d.seed), name);
}

// Fisher-Yates over the training windows with a stream that depends only on (seed, epoch).
void DataLoader::shuffle_epoch() {
  order_.resize(size_t(num_train_));
  for (int64_t i = 0; i < num_train_; ++i) order_[size_t(i)] = i;
  Rng rng(seed_ * 0x9E3779B97F4A7C15ull + pos_.epoch + 1);
  for (int64_t i = num_train_ - 1; i > 0; --i) {
    int64_t j = int64_t(rng.next_u64() % uint64_t(i + 1));
    std::swap(order_[size_t(i)], order_[size_t(j)]);
  }
}

void DataLoader::set_position(const DataPosition& pos) {
  FLOWMOE_CHECK(pos.cursor <= uint64_t(num_train_), IoError, "data position cursor ", pos.cursor, " exceeds the ",
                num_train_, " training windows (was the checkpoint made with another corpus or seq_len?)");
  pos_ = pos;
  shuffle_epoch();
}

Batch DataLoader::make_batch(const std::vector<int64_t>& starts) const {
  const int64_t b = int64_t(starts.size()), t = seq_len_;
  Tensor inputs = Tensor::empty({b, t}, DType::i32), targets = Tensor::empty({b, t}, DType::i32);
  int32_t* in = inputs.data<int32_t>();
  int32_t* tg = targets.data<int32_t>();
  for (int64_t i = 0; i < b; ++i) {
    const uint16_t* src = tokens_.data() + starts[size_t(i)];
    for (int64_t j = 0; j < t; ++j) {
      in[i * t + j] = src[j];
      tg[i * t + j] = src[j + 1];
    }
  }
  return {inputs, targets};
}

// The sequences [begin, end) of a batch of batch_size that part `part` of `parts` reads.
static std::pair<int64_t, int64_t> batch_part(int64_t batch_size, int64_t part, int64_t parts) {
  FLOWMOE_CHECK(parts >= 1 && part >= 0 && part < parts, Error, "batch part ", part, " of ", parts);
  return {part * batch_size / parts, (part + 1) * batch_size / parts};
}

Batch DataLoader::next_train(int64_t batch_size, int64_t part, int64_t parts) {
  const auto [begin, end] = batch_part(batch_size, part, parts);
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < batch_size; ++i) {
    if (pos_.cursor == uint64_t(num_train_)) {
      pos_.epoch++, pos_.cursor = 0;
      shuffle_epoch();
    }
    const int64_t window = order_[size_t(pos_.cursor++)];
    if (i >= begin && i < end) starts.push_back(window * seq_len_);
  }
  return make_batch(starts);
}

Batch DataLoader::val_batch(int64_t batch_idx, int64_t batch_size, int64_t part, int64_t parts) const {
  FLOWMOE_CHECK(num_val_ > 0, Error, "no validation data (data.val_fraction is 0)");
  const auto [begin, end] = batch_part(batch_size, part, parts);
  std::vector<int64_t> starts;
  for (int64_t i = begin; i < end; ++i)
    starts.push_back(train_end_ + ((batch_idx * batch_size + i) % num_val_) * seq_len_);
  return make_batch(starts);
}

}  // namespace flowmoe
