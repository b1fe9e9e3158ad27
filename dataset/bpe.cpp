// Byte-level BPE (see bpe.h). Training keeps, for every adjacent pair, its count over the word
// table and the words it occurs in, so a merge rewrites only the words that hold its pair and
// updates the counts of the pairs around each occurrence; a lazy max-heap finds the next pair.
#include "dataset/bpe.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdint>
#include <filesystem>

#include "io/file_io.h"
#include "kernels/common/error.h"

namespace flowmoe {

namespace {

// ---- words --------------------------------------------------------------------------------------

enum ByteClass : uint8_t { kLetter, kDigit, kSpace, kOther };

constexpr std::array<uint8_t, 256> make_byte_classes() {
  std::array<uint8_t, 256> cls{};
  for (int c = 0; c < 256; ++c) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80)
      cls[size_t(c)] = kLetter;
    else if (c >= '0' && c <= '9')
      cls[size_t(c)] = kDigit;
    else if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f')
      cls[size_t(c)] = kSpace;
    else
      cls[size_t(c)] = kOther;
  }
  return cls;
}
constexpr std::array<uint8_t, 256> kByteClass = make_byte_classes();

uint8_t byte_class(char c) { return kByteClass[static_cast<unsigned char>(c)]; }

// The end of the run of bytes of class `cls` that goes on at text[i].
size_t run_end(std::string_view text, size_t i, uint8_t cls) {
  while (i < text.size() && byte_class(text[i]) == cls) ++i;
  return i;
}

// The end of the word that starts at text[i] (i < text.size()).
size_t word_end(std::string_view text, size_t i) {
  const uint8_t cls = byte_class(text[i]);
  if (text[i] == ' ' && i + 1 < text.size() && byte_class(text[i + 1]) != kSpace)
    return run_end(text, i + 1, byte_class(text[i + 1]));
  size_t end = run_end(text, i + 1, cls);
  if (cls == kSpace && end < text.size() && end - i >= 2 && text[end - 1] == ' ') --end;  // " word" takes it
  return end;
}

template <class F>
void for_each_word(std::string_view text, F&& use) {
  for (size_t i = 0, end = 0; i < text.size(); i = end) {
    end = word_end(text, i);
    use(text.substr(i, end - i));
  }
}

uint32_t pair_key(uint32_t left, uint32_t right) { return left << 16 | right; }

// ---- training -----------------------------------------------------------------------------------

// The merge loop's state: the unique words as token sequences (rewritten in place as merges
// shorten them), and per pair its count and the words it was seen in (a superset: a word that lost
// the pair is found out when the pair is merged).
class MergeTable {
 public:
  explicit MergeTable(const BpeWordCounts& words) {
    for (const auto& [text, count] : words.counts()) {
      FLOWMOE_CHECK(text.size() < size_t(UINT32_MAX), Error, "bpe: a word of ", text.size(), " bytes is too long");
      const int32_t w = int32_t(word_count_.size());
      word_begin_.push_back(symbols_.size());
      word_len_.push_back(uint32_t(text.size()));
      word_count_.push_back(count);
      for (char c : text) symbols_.push_back(static_cast<unsigned char>(c));
      for (size_t i = 0; i + 1 < text.size(); ++i)
        add(static_cast<unsigned char>(text[i]), static_cast<unsigned char>(text[i + 1]), count, w);
    }
    for (int32_t id = 0; id < int32_t(pair_count_.size()); ++id)
      if (pair_count_[size_t(id)] >= 2) heap_.push_back({pair_count_[size_t(id)], pair_key_[size_t(id)], id});
    std::make_heap(heap_.begin(), heap_.end());
    raised_.clear();
  }

  std::vector<BpeTokenizer::Merge> run(int64_t num_merges) {
    std::vector<BpeTokenizer::Merge> merges;
    while (int64_t(merges.size()) < num_merges && !heap_.empty()) {
      std::pop_heap(heap_.begin(), heap_.end());
      const HeapEntry top = heap_.back();
      heap_.pop_back();
      const int64_t now = pair_count_[size_t(top.id)];
      if (top.count != now) {  // stale: a raised count has its own entry already, a lowered one gets one
        if (now >= 2 && now < top.count) push(top.id);
        continue;
      }
      const uint16_t left = uint16_t(top.key >> 16), right = uint16_t(top.key & 0xFFFF);
      merge(top.id, left, right, uint16_t(kBpeByteTokens + int64_t(merges.size())));
      merges.push_back({left, right});
    }
    return merges;
  }

 private:
  // Max-heap order: the higher count, then the smaller (left, right), comes first.
  struct HeapEntry {
    int64_t count;
    uint32_t key;
    int32_t id;
    bool operator<(const HeapEntry& o) const { return count != o.count ? count < o.count : key > o.key; }
  };

  std::vector<uint16_t> symbols_;
  std::vector<size_t> word_begin_;
  std::vector<uint32_t> word_len_;
  std::vector<int64_t> word_count_;
  std::unordered_map<uint32_t, int32_t> pair_ids_;
  std::vector<uint32_t> pair_key_;
  std::vector<int64_t> pair_count_;
  std::vector<std::vector<int32_t>> pair_words_;
  std::vector<int64_t> pair_raised_in_;  // the merge step that last raised the pair's count
  std::vector<int32_t> raised_;          // the pairs whose count rose in this step
  std::vector<HeapEntry> heap_;
  int64_t step_ = 0;

  void push(int32_t id) {
    heap_.push_back({pair_count_[size_t(id)], pair_key_[size_t(id)], id});
    std::push_heap(heap_.begin(), heap_.end());
  }

  void add(uint16_t left, uint16_t right, int64_t delta, int32_t word) {
    const uint32_t key = pair_key(left, right);
    auto [it, fresh] = pair_ids_.try_emplace(key, int32_t(pair_key_.size()));
    const size_t id = size_t(it->second);
    if (fresh) {
      pair_key_.push_back(key);
      pair_count_.push_back(0);
      pair_words_.emplace_back();
      pair_raised_in_.push_back(-1);
    }
    pair_count_[id] += delta;
    if (delta <= 0) return;
    std::vector<int32_t>& where = pair_words_[id];
    if (where.empty() || where.back() != word) where.push_back(word);
    if (pair_raised_in_[id] != step_) {
      pair_raised_in_[id] = step_;
      raised_.push_back(int32_t(id));
    }
  }

  // Replaces (left, right) by `token` in every word that holds it, left to right, and moves the
  // counts of the neighbouring pairs: (a, left) becomes (a, token), (right, b) becomes (token, b).
  void merge(int32_t id, uint16_t left, uint16_t right, uint16_t token) {
    std::vector<int32_t> words = std::move(pair_words_[size_t(id)]);
    pair_words_[size_t(id)] = {};
    std::sort(words.begin(), words.end());
    words.erase(std::unique(words.begin(), words.end()), words.end());
    ++step_;
    raised_.clear();
    for (int32_t w : words) {
      uint16_t* s = symbols_.data() + word_begin_[size_t(w)];
      const size_t len = word_len_[size_t(w)];
      const int64_t count = word_count_[size_t(w)];
      size_t out = 0;  // s[0, out) is rewritten; out <= i, so reads stay ahead of writes
      for (size_t i = 0; i < len;) {
        if (i + 1 < len && s[i] == left && s[i + 1] == right) {
          if (out > 0) {
            add(s[out - 1], left, -count, w);
            add(s[out - 1], token, count, w);
          }
          if (i + 2 < len) {
            add(right, s[i + 2], -count, w);
            add(token, s[i + 2], count, w);
          }
          s[out++] = token;
          i += 2;
        } else {
          s[out++] = s[i++];
        }
      }
      word_len_[size_t(w)] = uint32_t(out);
    }
    pair_count_[size_t(id)] = 0;  // no occurrence is left: every one was merged
    for (int32_t r : raised_)
      if (pair_count_[size_t(r)] >= 2) push(r);
  }
};

// ---- the tokenizer file -------------------------------------------------------------------------

constexpr std::string_view kFileMagic = "flowmoe-bpe";
constexpr int64_t kFileVersion = 1;
// A tokenizer of the largest vocab is a header line and 65280 merge lines of two token numbers, under
// 1 MiB; 4 MiB leaves room for blanks and line ends written by hand.
constexpr uint64_t kMaxFileBytes = uint64_t(4) << 20;

bool parse_int(std::string_view s, int64_t& value) {
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  return ec == std::errc() && end == s.data() + s.size();
}

// The fields of a line, split at runs of spaces and tabs.
std::vector<std::string_view> fields(std::string_view line) {
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
    const size_t start = i;
    while (i < line.size() && line[i] != ' ' && line[i] != '\t') ++i;
    if (i > start) out.push_back(line.substr(start, i - start));
  }
  return out;
}

// A line as quoted in a message: at most 60 bytes.
std::string quoted(std::string_view line) {
  return detail::cat("'", line.substr(0, 60), line.size() > 60 ? "...'" : "'");
}

// Words longer than this are encoded without caching: they are rare, and a cache entry each would
// hold their bytes twice.
constexpr size_t kMaxCachedWordBytes = 256;
constexpr size_t kMaxCachedWords = size_t(1) << 21;

}  // namespace

std::vector<std::string_view> bpe_words(std::string_view text) {
  std::vector<std::string_view> words;
  for_each_word(text, [&](std::string_view w) { words.push_back(w); });
  return words;
}

void BpeWordCounts::add_text(std::string_view text) {
  for_each_word(text, [&](std::string_view w) {
    ++num_words_;
    if (auto it = counts_.find(w); it != counts_.end())
      ++it->second;
    else
      counts_.emplace(std::string(w), 1);
  });
}

// ---- BpeTokenizer -------------------------------------------------------------------------------

BpeTokenizer::BpeTokenizer(std::vector<Merge> merges) {
  for (size_t i = 0; i < merges.size(); ++i) {
    const std::string problem = try_add_merge(merges[i]);
    FLOWMOE_CHECK(problem.empty(), Error, "bpe merge ", i, ": ", problem);
  }
}

std::string BpeTokenizer::try_add_merge(Merge m) {
  const int64_t token = vocab_size();
  if (token >= kBpeMaxVocab) return detail::cat("more than ", kBpeMaxVocab, " tokens (the uint16 limit)");
  if (m.left >= token || m.right >= token)
    return detail::cat("merge '", m.left, " ", m.right, "' names a token that does not exist before token ", token);
  const auto [it, fresh] = ranks_.try_emplace(pair_key(m.left, m.right), int32_t(merges_.size()));
  if (!fresh)
    return detail::cat("merge '", m.left, " ", m.right, "' repeats merge ", it->second, " (token ",
                       kBpeByteTokens + it->second, ")");
  if (pieces_.empty())
    for (int b = 0; b < kBpeByteTokens; ++b) pieces_.emplace_back(1, char(b));
  pieces_.push_back(pieces_[m.left] + pieces_[m.right]);
  merges_.push_back(m);
  return {};
}

BpeTokenizer BpeTokenizer::train(const BpeWordCounts& words, int64_t vocab_size) {
  FLOWMOE_CHECK(vocab_size > kBpeByteTokens && vocab_size <= kBpeMaxVocab, Error, "bpe vocab size must be from ",
                kBpeByteTokens + 1, " to ", kBpeMaxVocab, ", got ", vocab_size);
  MergeTable table(words);
  return BpeTokenizer(table.run(vocab_size - kBpeByteTokens));
}

void BpeTokenizer::save(const std::string& path) const {
  std::string text = detail::cat(kFileMagic, " ", kFileVersion, " vocab ", vocab_size(), "\n");
  for (const Merge& m : merges_) text += detail::cat(m.left, " ", m.right, "\n");
  const std::string tmp = path + ".tmp";
  std::error_code ec;
  try {
    write_file_synced(tmp, {&text});
  } catch (const IoError&) {
    // No half-written PATH.tmp is left beside the tokenizer; one that is not a file is not ours.
    if (std::filesystem::is_regular_file(tmp, ec)) std::filesystem::remove(tmp, ec);
    throw;
  }
  std::filesystem::rename(tmp, path, ec);
  if (!ec) return;
  const std::string why = ec.message();
  std::filesystem::remove(tmp, ec);
  FLOWMOE_THROW(IoError, "renaming '", tmp, "' to '", path, "' failed: ", why);
}

BpeTokenizer BpeTokenizer::load(const std::string& path) {
  const std::string text = read_file(path, kMaxFileBytes, "bpe tokenizer");
  std::vector<std::string_view> lines;
  for (size_t i = 0; i < text.size();) {
    const size_t nl = std::min(text.find('\n', i), text.size());
    lines.push_back(std::string_view(text).substr(i, nl - i));
    i = nl + 1;
  }
  FLOWMOE_CHECK(!lines.empty(), IoError, "bpe tokenizer ", path, ":1: the file is empty (expected '", kFileMagic, " ",
                kFileVersion, " vocab N')");
  const std::vector<std::string_view> head = fields(lines[0]);
  int64_t version = 0, vocab = 0;
  FLOWMOE_CHECK(head.size() == 4 && head[0] == kFileMagic && head[2] == "vocab", IoError, "bpe tokenizer ", path,
                ":1: expected '", kFileMagic, " ", kFileVersion, " vocab N', got ", quoted(lines[0]),
                " (not a tokenizer written by flowmoe prepare-data?)");
  FLOWMOE_CHECK(parse_int(head[1], version) && version == kFileVersion, IoError, "bpe tokenizer ", path, ":1: version ",
                quoted(head[1]), ", expected ", kFileVersion);
  FLOWMOE_CHECK(parse_int(head[3], vocab) && vocab >= kBpeByteTokens && vocab <= kBpeMaxVocab, IoError,
                "bpe tokenizer ", path, ":1: vocab ", quoted(head[3]), " is not a whole number from ", kBpeByteTokens,
                " to ", kBpeMaxVocab);
  const size_t num_merges = size_t(vocab - kBpeByteTokens);
  BpeTokenizer tok;
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t line = i + 1;
    FLOWMOE_CHECK(tok.merges_.size() < num_merges, IoError, "bpe tokenizer ", path, ":", line,
                  ": more merges than the ", num_merges, " its first line announces (vocab ", vocab, ")");
    const std::vector<std::string_view> ids = fields(lines[i]);
    int64_t left = -1, right = -1;
    FLOWMOE_CHECK(ids.size() == 2 && parse_int(ids[0], left) && parse_int(ids[1], right) && left >= 0 && right >= 0 &&
                      left < kBpeMaxVocab && right < kBpeMaxVocab,
                  IoError, "bpe tokenizer ", path, ":", line, ": expected a merge 'LEFT RIGHT' (two token ids), got ",
                  quoted(lines[i]));
    const std::string problem = tok.try_add_merge({uint16_t(left), uint16_t(right)});
    FLOWMOE_CHECK(problem.empty(), IoError, "bpe tokenizer ", path, ":", line, ": ", problem);
  }
  FLOWMOE_CHECK(tok.merges_.size() == num_merges, IoError, "bpe tokenizer ", path, ":", lines.size(), ": holds ",
                tok.merges_.size(), " of the ", num_merges, " merges its first line announces (vocab ", vocab,
                "; truncated?)");
  return tok;
}

void BpeTokenizer::encode(std::string_view text, std::vector<uint16_t>& out) {
  for_each_word(text, [&](std::string_view word) {
    if (word.size() == 1 || merges_.empty()) {
      for (char c : word) out.push_back(static_cast<unsigned char>(c));
      return;
    }
    if (word.size() > kMaxCachedWordBytes) return encode_word(word, out);
    auto it = cache_.find(word);
    if (it == cache_.end()) {
      if (cache_.size() >= kMaxCachedWords) {  // a bound on memory for corpora of endless distinct words
        cache_.clear();
        cache_tokens_.clear();
      }
      const size_t begin = cache_tokens_.size();
      encode_word(word, cache_tokens_);
      it = cache_.emplace(std::string(word), std::pair{uint32_t(begin), uint32_t(cache_tokens_.size() - begin)}).first;
    }
    const uint16_t* first = cache_tokens_.data() + it->second.first;
    out.insert(out.end(), first, first + it->second.second);
  });
}

std::vector<uint16_t> BpeTokenizer::encode(std::string_view text) {
  std::vector<uint16_t> out;
  encode(text, out);
  return out;
}

// Merges by rank: a min-heap of (rank, position) candidates over a linked list of the word's
// tokens. The lowest rank goes first, and among its occurrences the leftmost, which is the order
// training applied the merges in; a candidate whose tokens have changed since is passed over.
void BpeTokenizer::encode_word(std::string_view word, std::vector<uint16_t>& out) const {
  FLOWMOE_CHECK(word.size() < size_t(INT32_MAX), Error, "bpe: a word of ", word.size(), " bytes is too long to encode");
  const int32_t n = int32_t(word.size());
  std::vector<uint16_t> sym(word.size());
  std::vector<int32_t> prev(word.size()), next(word.size());  // next = -1: merged into its left neighbour
  for (int32_t i = 0; i < n; ++i) {
    sym[i] = static_cast<unsigned char>(word[i]);
    prev[i] = i - 1;
    next[i] = i + 1;
  }
  auto rank_of = [&](int32_t pos) {
    const auto it = ranks_.find(pair_key(sym[pos], sym[next[pos]]));
    return it == ranks_.end() ? -1 : it->second;
  };
  using Candidate = std::pair<int32_t, int32_t>;  // (rank, position of the left token)
  std::vector<Candidate> heap;
  auto offer = [&](int32_t pos) {
    if (const int32_t r = rank_of(pos); r >= 0) {
      heap.push_back({r, pos});
      std::push_heap(heap.begin(), heap.end(), std::greater<>());
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) offer(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>());
    const auto [rank, pos] = heap.back();
    heap.pop_back();
    const int32_t q = next[pos];
    if (q < 0 || q >= n || rank_of(pos) != rank) continue;
    sym[pos] = uint16_t(kBpeByteTokens + rank);
    next[pos] = next[q];
    if (next[q] < n) prev[next[q]] = pos;
    next[q] = -1;
    if (prev[pos] >= 0) offer(prev[pos]);
    if (next[pos] < n) offer(pos);
  }
  for (int32_t i = 0; i < n; i = next[i]) out.push_back(sym[i]);
}

std::string BpeTokenizer::decode(const std::vector<uint16_t>& tokens) const {
  std::string out;
  out.reserve(tokens.size() * 4);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const uint16_t t = tokens[i];
    FLOWMOE_CHECK(t < vocab_size(), Error, "bpe decode: token ", t, " at position ", i, " is outside the vocab of ",
                  vocab_size());
    if (t < kBpeByteTokens)
      out += char(t);
    else
      out += pieces_[t];
  }
  return out;
}

}  // namespace flowmoe
