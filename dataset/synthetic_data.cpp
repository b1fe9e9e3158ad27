// The two built-in synthetic corpora (see data.h): the seeded "words" language and the bigram chain
// with the token statistics of BPE-tokenized text. Nothing to download, the same tokens everywhere.
#include "dataset/data.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/rng.h"
#include "kernels/common/error.h"

namespace flowmoe {

std::vector<uint16_t> synthetic_corpus(int64_t vocab_size, int64_t num_tokens, uint64_t seed) {
  FLOWMOE_CHECK(vocab_size >= 16 && vocab_size <= 65536, Error, "synthetic corpus: vocab_size ", vocab_size,
                " outside [16, 65536]");
  Rng rng(seed ^ 0x5EEDC0DE5EEDC0DEull);
  const int64_t num_words = std::max<int64_t>(8, vocab_size / 4);
  const int num_next = 4;
  const double next_prob[num_next] = {0.5, 0.25, 0.15, 0.10};
  std::vector<std::vector<uint16_t>> words(static_cast<size_t>(num_words));
  for (auto& w : words) {
    int64_t len = 3 + int64_t(rng.next_u64() % 6);  // 3..8 tokens
    for (int64_t i = 0; i < len; ++i) w.push_back(uint16_t(1 + rng.next_u64() % uint64_t(vocab_size - 1)));
  }
  std::vector<int64_t> next(static_cast<size_t>(num_words * num_next));
  for (auto& n : next) n = int64_t(rng.next_u64() % uint64_t(num_words));

  std::vector<uint16_t> out;
  out.reserve(size_t(num_tokens));
  int64_t word = 0;
  while (int64_t(out.size()) < num_tokens) {
    for (uint16_t t : words[size_t(word)]) out.push_back(t);
    out.push_back(0);  // separator
    double u = rng.next_uniform(), acc = 0;
    int j = 0;
    for (; j < num_next - 1; ++j) {
      acc += next_prob[j];
      if (u < acc) break;
    }
    word = next[size_t(word * num_next + j)];
  }
  out.resize(size_t(num_tokens));
  return out;
}

// Zipf-Mandelbrot popularity over tokens 1..V-1 in a random order, 16 successors per token drawn
// from it, successor slot j taken with weight 1/(j+1). Sampling inverts cumulative tables built by
// sequential double sums of correctly rounded divisions, so the output is the same on every platform.
std::vector<uint16_t> synthetic_bigram_corpus(int64_t vocab_size, int64_t num_tokens, uint64_t seed) {
  FLOWMOE_CHECK(vocab_size >= 16 && vocab_size <= 65536, Error, "synthetic bigram corpus: vocab_size ", vocab_size,
                " outside [16, 65536]");
  FLOWMOE_CHECK(num_tokens >= 0, Error, "synthetic bigram corpus: num_tokens ", num_tokens, " is negative");
  constexpr int64_t kSuccessors = 16, kMinDocLen = 1024;
  constexpr double kDocEndProb = 0.01;  // per token once a document has kMinDocLen tokens
  Rng rng(seed ^ 0xB16A3C0A9B5EED11ull);
  const int64_t num_words = vocab_size - 1;  // tokens 1..V-1; 0 separates documents

  std::vector<uint16_t> by_rank(static_cast<size_t>(num_words));  // by_rank[r - 1]: the token of rank r
  for (int64_t i = 0; i < num_words; ++i) by_rank[size_t(i)] = uint16_t(i + 1);
  for (int64_t i = num_words - 1; i > 0; --i)
    std::swap(by_rank[size_t(i)], by_rank[size_t(rng.next_u64() % uint64_t(i + 1))]);
  std::vector<double> pop_cum(static_cast<size_t>(num_words));
  double acc = 0;
  for (int64_t r = 1; r <= num_words; ++r) pop_cum[size_t(r - 1)] = acc += 1.0 / double(r + 10);
  auto popular = [&] {
    size_t i =
        size_t(std::upper_bound(pop_cum.begin(), pop_cum.end(), rng.next_uniform() * pop_cum.back()) - pop_cum.begin());
    return by_rank[std::min(i, size_t(num_words - 1))];
  };

  std::vector<uint16_t> successors(static_cast<size_t>(vocab_size * kSuccessors));  // [vocab, kSuccessors]
  for (auto& s : successors) s = popular();
  double slot_cum[kSuccessors];
  acc = 0;
  for (int64_t j = 0; j < kSuccessors; ++j) slot_cum[j] = acc += 1.0 / double(j + 1);

  std::vector<uint16_t> out;
  out.reserve(size_t(num_tokens));
  uint16_t tok = popular();
  int64_t doc_len = 0;
  while (int64_t(out.size()) < num_tokens) {
    out.push_back(tok);
    if (++doc_len >= kMinDocLen && rng.next_uniform() < kDocEndProb) {
      out.push_back(0);
      doc_len = 0;
      tok = popular();
      continue;
    }
    int64_t j =
        std::upper_bound(slot_cum, slot_cum + kSuccessors, rng.next_uniform() * slot_cum[kSuccessors - 1]) - slot_cum;
    tok = successors[size_t(int64_t(tok) * kSuccessors + std::min(j, kSuccessors - 1))];
  }
  out.resize(size_t(num_tokens));
  return out;
}

}  // namespace flowmoe
