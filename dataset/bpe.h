// Byte-level BPE tokenization for `flowmoe prepare-data`: training, encoding, decoding, and the
// tokenizer's text file. Tokens 0..255 are the bytes and merge i makes token 256 + i, so any byte
// string encodes and decodes back exactly. Text is first split into words as GPT-2 does (an optional
// space and a run of letters, digits or punctuation, or a run of whitespace); merges never cross a
// word, which keeps training to a table of unique words and lets encoding cache each word's tokens.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace flowmoe {

constexpr int64_t kBpeByteTokens = 256;
constexpr int64_t kBpeMaxVocab = 65536;  // token files hold uint16 tokens

// The words of `text`, in order; concatenated they are `text`. A byte >= 0x80 counts as a letter, so
// UTF-8 characters stay inside their word. A run of whitespace followed by a word gives its last
// space to that word (" world"), as GPT-2 does.
std::vector<std::string_view> bpe_words(std::string_view text);

// Hash of a string that also takes string_views, so counting and cache lookups allocate nothing.
struct BpeStringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

// The unique words of a corpus and how often each occurs, gathered text by text: a word never
// spans two texts (prepare-data adds each file on its own).
class BpeWordCounts {
 public:
  void add_text(std::string_view text);
  int64_t num_unique() const { return int64_t(counts_.size()); }
  int64_t num_words() const { return num_words_; }
  const auto& counts() const { return counts_; }

 private:
  std::unordered_map<std::string, int64_t, BpeStringHash, std::equal_to<>> counts_;
  int64_t num_words_ = 0;
};

class BpeTokenizer {
 public:
  struct Merge {
    uint16_t left = 0, right = 0;
    bool operator==(const Merge&) const = default;
  };

  BpeTokenizer() = default;  // no merges: one token per byte
  // Throws Error when a merge names a token that does not exist before it, or repeats a pair.
  explicit BpeTokenizer(std::vector<Merge> merges);

  // The standard BPE loop over the word table: merge the most frequent adjacent pair everywhere,
  // ties going to the smallest (left, right) ids, until vocab_size tokens or no pair occurs twice
  // (then vocab_size() is smaller). vocab_size must be in (256, 65536].
  static BpeTokenizer train(const BpeWordCounts& words, int64_t vocab_size);

  // The text file: a line "flowmoe-bpe 1 vocab N", then N - 256 lines "LEFT RIGHT" (token ids).
  // save writes PATH.tmp and renames it; load throws IoError naming the file and line at fault.
  void save(const std::string& path) const;
  static BpeTokenizer load(const std::string& path);

  int64_t vocab_size() const { return kBpeByteTokens + int64_t(merges_.size()); }
  const std::vector<Merge>& merges() const { return merges_; }

  // Appends the tokens of `text` to `out`: each word's merges are applied by rank, and the result
  // is cached, so a corpus costs about one hash lookup per word.
  void encode(std::string_view text, std::vector<uint16_t>& out);
  std::vector<uint16_t> encode(std::string_view text);
  // The bytes of `tokens`; throws Error on a token >= vocab_size().
  std::string decode(const std::vector<uint16_t>& tokens) const;

 private:
  std::vector<Merge> merges_;
  std::unordered_map<uint32_t, int32_t> ranks_;  // (left << 16 | right) -> merge index
  std::vector<std::string> pieces_;              // the bytes of each token
  // Encoded words: a word's tokens are cache_tokens_[begin, begin + count).
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, BpeStringHash, std::equal_to<>> cache_;
  std::vector<uint16_t> cache_tokens_;

  // Appends merge m as token vocab_size(); the reason it cannot be, or "".
  std::string try_add_merge(Merge m);
  void encode_word(std::string_view word, std::vector<uint16_t>& out) const;
};

}  // namespace flowmoe
