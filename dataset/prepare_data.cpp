// flowmoe prepare-data (see data.h): text files to one token file, byte-level or BPE (dataset/bpe.h).
// The inputs are walked once to train a tokenizer and again to encode them, so a corpus is never
// held in memory whole: only its tokens are.
#include <fnmatch.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string_view>
#include <utility>

#include "config/output_check.h"
#include "dataset/bpe.h"
#include "dataset/data.h"
#include "io/file_io.h"
#include "kernels/common/error.h"

namespace flowmoe {

namespace fs = std::filesystem;

namespace {

constexpr size_t kBinaryProbeBytes = 8192;

// The bytes of a text file into `bytes`; false, with the rest unread, when its first 8 KiB hold a
// NUL byte (no text encoding byte-level tokens are meant for has one).
bool read_if_text(const fs::path& p, std::string& bytes) {
  std::ifstream in(p, std::ios::binary);
  FLOWMOE_CHECK(in.good(), IoError, "prepare-data: ", os_error("open", p.string(), errno));
  bytes.assign(kBinaryProbeBytes, 0);
  in.read(bytes.data(), std::streamsize(bytes.size()));
  bytes.resize(size_t(in.gcount()));
  if (std::memchr(bytes.data(), 0, bytes.size())) return false;
  bytes.insert(bytes.end(), std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  FLOWMOE_CHECK(!in.bad(), IoError, "prepare-data: reading '", p.string(), "' failed");
  return true;
}

// The regular files below `dir` at any depth with their paths relative to it, sorted by those (byte
// order).
std::vector<std::pair<std::string, fs::path>> files_below(const std::string& dir) {
  std::vector<std::pair<std::string, fs::path>> found;
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code type_ec;
    if (it->is_regular_file(type_ec))
      found.emplace_back(it->path().lexically_relative(dir).generic_string(), it->path());
  }
  FLOWMOE_CHECK(!ec, IoError, "prepare-data: ", os_error("list directory", dir, ec));
  std::sort(found.begin(), found.end());
  return found;
}

// Whether a pattern matches the relative path or one of its folders ("translations" and
// "translations/*" both match "translations/it_IT/a.txt").
bool is_excluded(const std::string& rel, const std::vector<std::string>& patterns) {
  for (const std::string& pattern : patterns)
    for (size_t end = rel.size(); end != std::string::npos && end > 0; end = rel.rfind('/', end - 1))
      if (fnmatch(pattern.c_str(), rel.substr(0, end).c_str(), 0) == 0) return true;
  return false;
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

std::string count_of(size_t n, const char* what) { return std::to_string(n) + " " + what + (n == 1 ? "" : "s"); }

// "2 binary files: a.bin, b.png", the first 10 paths named.
std::string listed(const std::vector<std::string>& paths, const char* what) {
  const size_t shown = std::min<size_t>(paths.size(), 10);
  std::string s = count_of(paths.size(), what) + ": ";
  for (size_t i = 0; i < shown; ++i) s += (i ? ", " : "") + paths[i];
  if (shown < paths.size()) s += " and " + std::to_string(paths.size() - shown) + " more";
  return s;
}

// Reads the inputs in order and hands each file to be encoded to use(bytes); `info` records what
// was read and left out. The files in `skip` (what prepare-data writes) are left out silently.
template <class F>
void read_inputs(const std::vector<std::string>& inputs, const std::vector<std::string>& skip,
                 const std::vector<std::string>& exclude, PreparedInputs& info, F&& use) {
  std::vector<fs::path> skip_paths;
  for (const std::string& p : skip) {
    std::error_code ec;
    fs::path q = fs::weakly_canonical(p, ec);
    if (!ec) skip_paths.push_back(std::move(q));
  }
  auto is_skipped = [&](const fs::path& p) {
    std::error_code ec;
    const fs::path q = fs::weakly_canonical(p, ec);
    return !ec && std::find(skip_paths.begin(), skip_paths.end(), q) != skip_paths.end();
  };
  std::string bytes;
  auto take = [&](const fs::path& p) {
    use(std::string_view(bytes));
    info.files.push_back({p.string(), int64_t(bytes.size())});
  };
  for (const std::string& in : inputs) {
    std::error_code ec;
    if (!fs::is_directory(in, ec)) {
      bytes = read_file(in, kNoSizeLimit, "input");  // a file named as an input is read whatever it holds
      take(in);
      continue;
    }
    const size_t files_before = info.files.size(), skipped_before = info.skipped_binary.size(),
                 excluded_before = info.excluded.size();
    for (const auto& [rel, p] : files_below(in)) {
      if (is_skipped(p)) continue;
      if (is_excluded(rel, exclude))
        info.excluded.push_back(p.string());
      else if (read_if_text(p, bytes))
        take(p);
      else
        info.skipped_binary.push_back(p.string());
    }
    const size_t num_excluded = info.excluded.size() - excluded_before;
    FLOWMOE_CHECK(info.files.size() > files_before, IoError, "prepare-data: directory '", in, "' holds no text files (",
                  count_of(info.skipped_binary.size() - skipped_before, "binary file"), " skipped",
                  num_excluded ? ", " + std::to_string(num_excluded) + " excluded" : "", ")");
  }
}

bool same_path(const fs::path& a, const fs::path& b) {
  std::error_code ea, eb;
  const fs::path ca = fs::weakly_canonical(a, ea), cb = fs::weakly_canonical(b, eb);
  return !ea && !eb && ca == cb;
}

// Why writing `target` (named: how the message begins) would feed back what an input directory reads:
// it is another path to one of the directory's files (a hard link), which --exclude does not leave out.
// The target's own path inside an input directory is fine: read_inputs skips it.
std::string read_by_input_directory(const std::string& named, const std::string& target,
                                    const std::vector<std::string>& inputs, const PrepareOptions& opts) {
  std::error_code ec;
  if (!fs::exists(target, ec)) return "";  // not there yet: nothing to overwrite
  for (const std::string& in : inputs) {
    if (!fs::is_directory(in, ec)) continue;
    for (const auto& [rel, p] : files_below(in))
      if (same_file(p.string(), target) && !same_path(p, target) && !is_excluded(rel, opts.exclude))
        return named + " is also '" + p.string() + "' in the input directory '" + in +
               "' (the same file by another path), which would be read; name another file to write or --exclude it";
  }
  return "";
}

}  // namespace

std::string prepare_output_problem(const std::vector<std::string>& inputs, const std::string& output,
                                   const PrepareOptions& opts) {
  std::vector<InputFile> read;  // the inputs named as files, and the --tokenizer file
  std::error_code ec;
  for (const std::string& in : inputs)
    if (!fs::is_directory(in, ec)) read.push_back({"input", in});
  if (!opts.tokenizer.empty()) read.push_back({"--tokenizer file", opts.tokenizer});
  // What prepare-data writes, each first to PATH.tmp and then renamed: the token file, and the tokenizer
  // --bpe-vocab trains. Refused before any input is read: the work would otherwise be lost at the end.
  std::vector<std::pair<std::string, std::string>> writes = {{"prepare-data: --output '" + output + "'", output}};
  if (opts.bpe_vocab > 0) {
    const std::string tokenizer = bpe_tokenizer_path(output);
    writes.push_back(
        {"prepare-data: the tokenizer file '" + tokenizer + "' (--bpe-vocab writes it beside --output)", tokenizer});
  }
  for (size_t i = 0, n = writes.size(); i < n; ++i) {
    const std::string tmp = writes[i].second + ".tmp";
    writes.push_back({"prepare-data: '" + tmp + "' (written first, then renamed to '" + writes[i].second + "')", tmp});
  }
  for (const auto& [named, path] : writes) {
    std::string problem = output_file_problem(named, path, read, path == output ? "tokens.bin" : "");
    if (problem.empty()) problem = read_by_input_directory(named, path, inputs, opts);
    if (!problem.empty()) return problem;
  }
  return "";
}

int64_t PreparedInputs::bytes() const {
  int64_t n = 0;
  for (const File& f : files) n += f.bytes;
  return n;
}

std::string PreparedInputs::summary() const {
  std::string s = "read " + count_of(files.size(), "file") + " (" + human_bytes(bytes()) + ")";
  if (!skipped_binary.empty()) s += ", skipped " + listed(skipped_binary, "binary file");
  if (!excluded.empty()) s += (skipped_binary.empty() ? ", excluded " : "; excluded ") + listed(excluded, "file");
  return s;
}

std::string bpe_tokenizer_path(const std::string& token_file) {
  return fs::path(token_file).replace_extension(".bpe").string();
}

int64_t prepare_token_file(const std::vector<std::string>& inputs, const std::string& output, PreparedInputs* read,
                           const PrepareOptions& opts) {
  FLOWMOE_CHECK(!inputs.empty(), IoError, "prepare-data: no input files");
  FLOWMOE_CHECK(opts.bpe_vocab == 0 || opts.tokenizer.empty(), ConfigError,
                "prepare-data: give --bpe-vocab N (train a tokenizer) or --tokenizer FILE (use one), not both");
  FLOWMOE_CHECK(opts.bpe_vocab == 0 || (opts.bpe_vocab > kBpeByteTokens && opts.bpe_vocab <= kBpeMaxVocab), ConfigError,
                "prepare-data: --bpe-vocab must be from ", kBpeByteTokens + 1, " to ", kBpeMaxVocab,
                " (the 256 bytes and at least one merge; token files hold uint16 tokens), got ", opts.bpe_vocab);
  const std::string problem = prepare_output_problem(inputs, output, opts);
  FLOWMOE_CHECK(problem.empty(), ConfigError, problem);
  PreparedInputs info;
  BpeTokenizer tokenizer;
  const bool bpe = opts.bpe_vocab > 0 || !opts.tokenizer.empty();
  if (opts.bpe_vocab > 0) {
    info.tokenizer = bpe_tokenizer_path(output);
    FLOWMOE_CHECK(info.tokenizer != output, ConfigError, "prepare-data: --output '", output,
                  "' ends in .bpe, the extension of the tokenizer written beside it; name the token file .bin");
    BpeWordCounts words;
    PreparedInputs first_pass;
    read_inputs(inputs, {output, info.tokenizer}, opts.exclude, first_pass,
                [&](std::string_view text) { words.add_text(text); });
    tokenizer = BpeTokenizer::train(words, opts.bpe_vocab);
    tokenizer.save(info.tokenizer);
    info.num_words = words.num_words();
    info.num_unique_words = words.num_unique();
  } else if (bpe) {
    info.tokenizer = opts.tokenizer;
    std::error_code ec;
    FLOWMOE_CHECK(fs::is_regular_file(opts.tokenizer, ec), IoError, "prepare-data: --tokenizer '", opts.tokenizer, "' ",
                  fs::exists(opts.tokenizer, ec) ? "is not a regular file" : "does not exist");
    tokenizer = BpeTokenizer::load(opts.tokenizer);
  }
  std::vector<uint16_t> tokens;
  read_inputs(inputs, {output, info.tokenizer}, opts.exclude, info, [&](std::string_view text) {
    if (bpe)
      tokenizer.encode(text, tokens);
    else
      for (char c : text) tokens.push_back(static_cast<unsigned char>(c));  // byte-level: one token a byte
  });
  info.vocab_size = tokenizer.vocab_size();
  write_token_file(output, tokens);
  if (read) *read = std::move(info);
  return int64_t(tokens.size());
}

}  // namespace flowmoe
