#include "dataset/run_tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "dataset/data.h"
#include "kernels/common/error.h"

namespace flowmoe {

namespace fs = std::filesystem;

RunTokenizer RunTokenizer::for_config(const Config& cfg, const std::string& explicit_bpe) {
  RunTokenizer t;
  const auto load_bpe = [&t](const std::string& path) {
    t.kind_ = Kind::bpe;
    t.bpe_ = BpeTokenizer::load(path);
    t.bpe_path_ = path;
  };
  if (!explicit_bpe.empty()) {
    load_bpe(explicit_bpe);
    return t;
  }
  const DataConfig& d = cfg.data;
  if (d.source == DataSource::text) {
    t.kind_ = Kind::bytes;
  } else if (d.source == DataSource::tokens) {
    const std::string bpe = bpe_tokenizer_path(d.path);
    std::error_code ec;
    if (fs::exists(bpe, ec)) {
      load_bpe(bpe);
    } else {
      const std::vector<uint16_t> tokens = read_token_file(d.path);
      if (std::all_of(tokens.begin(), tokens.end(), [](uint16_t x) { return x < kBpeByteTokens; }))
        t.kind_ = Kind::bytes;
      else
        t.missing_ = "the token file '" + d.path + "' has no BPE tokenizer beside it ('" + bpe +
                     "') and holds tokens of 256 and more, so they are not bytes";
    }
  } else {
    t.missing_ = std::string("data.source ") + enum_name(kDataSourceNames, d.source) +
                 " has no tokenizer: its tokens are ids of a generated corpus, not text";
  }
  return t;
}

std::string RunTokenizer::describe() const {
  if (kind_ == Kind::bpe) return "BPE '" + bpe_path_ + "' (vocab " + std::to_string(bpe_.vocab_size()) + ")";
  return kind_ == Kind::bytes ? "byte-level" : "none";
}

std::vector<int32_t> RunTokenizer::encode(std::string_view text) {
  FLOWMOE_CHECK(found(), ConfigError, "no tokenizer: ", missing_);
  if (kind_ == Kind::bytes) {
    std::vector<int32_t> out;
    for (unsigned char c : text) out.push_back(c);
    return out;
  }
  const std::vector<uint16_t> tokens = bpe_.encode(text);
  return std::vector<int32_t>(tokens.begin(), tokens.end());
}

std::string RunTokenizer::decode(const std::vector<int32_t>& tokens) const {
  FLOWMOE_CHECK(found(), ConfigError, "no tokenizer: ", missing_);
  static const std::string kReplacement = "\xEF\xBF\xBD";
  std::string out;
  std::vector<uint16_t> run;  // known tokens since the last unknown one: BPE decodes them together
  const auto flush = [&] {
    if (kind_ == Kind::bpe)
      out += bpe_.decode(run);
    else
      for (uint16_t x : run) out += char(x);
    run.clear();
  };
  for (int32_t x : tokens) {
    if (x >= 0 && x < vocab_size()) {
      run.push_back(uint16_t(x));
      continue;
    }
    flush();
    out += kReplacement;
  }
  flush();
  return out;
}

std::string escape_one_line(std::string_view text) {
  std::string out;
  for (unsigned char c : text) {
    if (c == '\n')
      out += "\\n";
    else if (c == '\t')
      out += "\\t";
    else if (c == '\r')
      out += "\\r";
    else if (c == '\\')
      out += "\\\\";
    else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else
      out += char(c);
  }
  return out;
}

}  // namespace flowmoe
