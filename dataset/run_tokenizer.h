// The tokenizer of a run's data, which turns prompts into tokens and samples back into text (`flowmoe
// generate`, train.sample_every). It follows from the resolved config alone:
//   data.source text:     one token per byte (read_text_tokens);
//   data.source tokens:   the BPE tokenizer prepare-data --bpe-vocab saved beside the token file
//                         (bpe_tokenizer_path: data/books.bin -> data/books.bpe); without one, one token per byte
//                         when every token of the file is below 256 (prepare-data without --bpe-vocab);
//   data.source synthetic: none (its tokens are ids of a generated corpus, not text).
// A tokenizer file given explicitly (generate --tokenizer) replaces the lookup.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "config/config.h"
#include "dataset/bpe.h"

namespace flowmoe {

class RunTokenizer {
 public:
  // The run's tokenizer as above, or one that found none (found() false; missing() says what it looked for).
  // `explicit_bpe` (non-empty): that BPE file instead. Throws IoError for a tokenizer file that cannot be read.
  static RunTokenizer for_config(const Config& cfg, const std::string& explicit_bpe = "");

  bool found() const { return kind_ != Kind::none; }
  const std::string& missing() const { return missing_; }  // "" when found
  std::string describe() const;                            // "byte-level" or "BPE 'data/books.bpe' (vocab 512)"
  int64_t vocab_size() const { return kind_ == Kind::bpe ? bpe_.vocab_size() : kBpeByteTokens; }
  // As a BPE tokenizer: byte-level is the one without merges (found() must hold).
  const BpeTokenizer& bpe() const { return bpe_; }

  std::vector<int32_t> encode(std::string_view text);
  // The text of `tokens`; a token outside the tokenizer's vocab (a model's vocab may be larger) becomes U+FFFD.
  std::string decode(const std::vector<int32_t>& tokens) const;

 private:
  enum class Kind { none, bytes, bpe };
  Kind kind_ = Kind::none;
  BpeTokenizer bpe_;
  std::string bpe_path_, missing_;
};

// `text` on one line for a log: \n, \t, \r, backslash and other control bytes escaped as C does.
std::string escape_one_line(std::string_view text);

}  // namespace flowmoe
