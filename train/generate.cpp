#include "train/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "engine/rng.h"
#include "kernels/common/error.h"

namespace flowmoe {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The logits of position t of logits [1, T, V], on the host.
std::vector<float> position_logits(const Variable& logits, int64_t t) {
  return logits.data().slice(1, t, t + 1).to_floats();
}

int32_t argmax(const std::vector<float>& logits) {
  return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());  // the first of equals
}

Tensor ids_tensor(const std::vector<int32_t>& tokens) {
  return Tensor::from_ints(std::vector<int64_t>(tokens.begin(), tokens.end()), {1, int64_t(tokens.size())});
}

std::string token_ids(const std::vector<int32_t>& tokens) {
  std::string s = "[";
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (i > 0) s += ' ';
    s += std::to_string(tokens[i]);
  }
  s += ']';
  return s;
}

}  // namespace

int32_t sample_token(const std::vector<float>& logits, const SamplingOptions& o, uint64_t index) {
  FLOWMOE_CHECK(!logits.empty(), ShapeError, "sample_token: no logits");
  FLOWMOE_CHECK(o.temperature >= 0 && std::isfinite(o.temperature) && o.top_k >= 0 && o.top_p > 0 && o.top_p <= 1,
                Error, "sample_token: temperature ", o.temperature, ", top_k ", o.top_k, ", top_p ", o.top_p,
                " out of range");
  if (o.temperature == 0 || o.top_k == 1) return argmax(logits);
  // The tokens from most to least likely; equal logits in id order, as argmax breaks ties.
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  const size_t k = o.top_k > 0 ? std::min(size_t(o.top_k), order.size()) : order.size();
  std::vector<double> p(k);
  const double top = logits[size_t(order[0])];
  double total = 0;
  for (size_t i = 0; i < k; ++i) total += p[i] = std::exp((double(logits[size_t(order[i])]) - top) / o.temperature);
  // The nucleus: the fewest leading tokens whose probability reaches top_p (at least one).
  size_t kept = 0;
  double mass = 0;
  while (kept < k && (kept == 0 || mass < o.top_p * total)) mass += p[kept++];
  Rng rng(o.seed);
  rng.set_state(o.seed, index);
  const double u = rng.next_uniform() * mass;
  double cum = 0;
  for (size_t i = 0; i < kept; ++i)
    if ((cum += p[i]) > u) return order[i];
  return order[kept - 1];  // u within rounding of the total
}

Generation generate(const Transformer& model, const std::vector<int32_t>& prompt, int64_t max_new_tokens,
                    const SamplingOptions& o, const std::function<void(int32_t)>& on_token) {
  const int64_t max_positions = model.config().max_position_embeddings, p = int64_t(prompt.size());
  FLOWMOE_CHECK(p >= 1 && max_new_tokens >= 1 && p + max_new_tokens <= max_positions, ShapeError, "generate: ", p,
                " prompt tokens and ", max_new_tokens, " new ones (each at least 1; together at most ",
                "max_position_embeddings = ", max_positions, ")");
  NoGradGuard no_grad;
  KvCache cache(model.config(), p + max_new_tokens, model.compute_dtype(), model.device());
  Generation g;
  const Clock::time_point start = Clock::now();
  std::vector<float> logits = position_logits(model.forward_cached(ids_tensor(prompt), cache), p - 1);
  g.prefill_seconds = seconds_since(start);
  const Clock::time_point decode_start = Clock::now();
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    if (i > 0) logits = position_logits(model.forward_cached(ids_tensor({g.tokens.back()}), cache), 0);
    g.tokens.push_back(sample_token(logits, o, uint64_t(i)));
    if (on_token) on_token(g.tokens.back());
  }
  g.decode_seconds = seconds_since(decode_start);
  return g;
}

std::vector<int32_t> greedy_window(const Transformer& model, const std::vector<int32_t>& prompt, int64_t num_new,
                                   int64_t window) {
  FLOWMOE_CHECK(!prompt.empty() && num_new >= 0 && int64_t(prompt.size()) + num_new <= window, ShapeError,
                "greedy_window: ", prompt.size(), " prompt tokens and ", num_new, " new ones in a window of ", window);
  NoGradGuard no_grad;
  std::vector<int32_t> tokens = prompt, padded(size_t(window), 0);
  for (int64_t i = 0; i < num_new; ++i) {
    std::copy(tokens.begin(), tokens.end(), padded.begin());
    const Variable logits = model.forward(ids_tensor(padded));
    tokens.push_back(argmax(position_logits(logits, int64_t(tokens.size()) - 1)));
  }
  return std::vector<int32_t>(tokens.begin() + int64_t(prompt.size()), tokens.end());
}

std::string training_sample(const Transformer& model, const DataLoader& data, const RunTokenizer& tokenizer) {
  const int64_t window = std::min(data.seq_len(), model.config().max_position_embeddings);
  std::vector<int32_t> prompt = {0};
  if (data.num_val_windows() > 0) {
    const std::vector<int64_t> first = data.val_batch(0, 1).inputs.to_ints();
    const int64_t n = std::max<int64_t>(1, std::min(kSamplePromptTokens, window / 2));
    prompt.assign(first.begin(), first.begin() + n);
  }
  const int64_t num_new = std::min(kSampleNewTokens, window - int64_t(prompt.size()));
  const std::vector<int32_t> sample = greedy_window(model, prompt, num_new, window);
  const auto shown = [&](const std::vector<int32_t>& tokens) {
    if (!tokenizer.found()) return token_ids(tokens);
    std::string s = "\"";
    s += escape_one_line(tokenizer.decode(tokens));
    s += '"';
    return s;
  };
  std::string line = shown(prompt);
  line += " -> ";
  line += shown(sample);
  return line;
}

}  // namespace flowmoe
