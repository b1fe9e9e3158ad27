// Token sources and the deterministic batch order (see data.h).
#include "dataset/data.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>

#include "engine/rng.h"
#include "io/file_io.h"
#include "kernels/common/error.h"

namespace flowmoe {

namespace fs = std::filesystem;

// ---- token files --------------------------------------------------------------------------------

// The size is checked against the header before anything is allocated: a damaged count must not
// turn into a multi-gigabyte allocation, and a file with extra or odd bytes is not silently cut.
std::vector<uint16_t> read_token_file(const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  FLOWMOE_CHECK(!ec && fs::exists(st), IoError, "cannot open token file '", path,
                "': ", ec ? ec.message() : "it does not exist");
  FLOWMOE_CHECK(fs::is_regular_file(st), IoError, "token file '", path, "' is not a regular file");
  const uintmax_t size = fs::file_size(path, ec);
  FLOWMOE_CHECK(!ec, IoError, os_error("read the size of token file", path, ec));
  std::ifstream in(path, std::ios::binary);
  FLOWMOE_CHECK(in.good(), IoError, os_error("open token file", path, errno));
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
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  FLOWMOE_CHECK(out.good(), IoError, os_error("write", tmp, errno));
  // From here the temp file is ours: a failed write or rename removes it, so no half-written
  // PATH.tmp stays beside the output (the output itself is untouched until the rename).
  std::string failure;
  out.write(reinterpret_cast<const char*>(header), sizeof header);
  out.write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(tokens.size() * sizeof(uint16_t)));
  out.close();
  std::error_code ec;
  if (!out.good()) {
    failure = "writing '" + tmp + "' failed (disk full?)";
  } else {
    fs::rename(tmp, path, ec);
    if (!ec) return;
    failure = "renaming '" + tmp + "' to '" + path + "' failed: " + ec.message();
  }
  fs::remove(tmp, ec);
  FLOWMOE_THROW(IoError, failure);
}

// ---- text ---------------------------------------------------------------------------------------

// Byte-level tokens: one token per byte of the file, whatever it holds.
static void append_file_bytes(const fs::path& p, std::vector<uint16_t>& out) {
  for (char c : read_file(p.string(), kNoSizeLimit, "text file"))
    out.push_back(uint16_t(static_cast<unsigned char>(c)));
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
                " validation tokens (data.val_fraction = ", val_fraction, ") are too few for one sequence of ", seq_len,
                " + 1 tokens");
  shuffle_epoch();
}

DataLoader DataLoader::from_config(const Config& cfg) {
  const DataConfig& d = cfg.data;
  std::vector<uint16_t> tokens;
  std::string name;
  if (d.source == DataSource::synthetic) {
    if (d.synthetic_kind == SyntheticKind::bigram)
      tokens = synthetic_bigram_corpus(cfg.model.vocab_size, d.synthetic_tokens, uint64_t(d.seed));
    else
      tokens = synthetic_corpus(cfg.model.vocab_size, d.synthetic_tokens, uint64_t(d.seed));
    name = std::string("synthetic corpus (") + enum_name(kSyntheticKindNames, d.synthetic_kind) + ")";
  } else if (d.source == DataSource::text) {
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
