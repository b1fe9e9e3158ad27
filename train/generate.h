// Sampling text from a model: `flowmoe generate` and train.sample_every.
//   generate:        the prompt in one cached forward (prefill), then one token per step over the K/V cache
//                    (Transformer::forward_cached, layers/kv_cache.h), each chosen by sample_token.
//   greedy_window:   what a training run prints every train.sample_every steps, as llm.c does: each token
//                    from a full forward of one fixed window (the model's ordinary forward, in any recipe
//                    and layout), no cache.
// Sampling is on the host from the last position's logits, with a counter-based draw (engine/rng.h): the
// token chosen at step i depends on (seed, i) and the logits alone, so a seed gives the same tokens on the
// CPU and the GPU wherever their logits agree.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dataset/data.h"
#include "dataset/run_tokenizer.h"
#include "layers/transformer.h"

namespace flowmoe {

struct SamplingOptions {
  double temperature = 1.0;  // 0: greedy (the most likely token; ties to the smaller id)
  int64_t top_k = 0;         // keep the k most likely tokens; 0: all
  double top_p = 1.0;        // nucleus: keep the fewest most likely tokens whose probability reaches top_p, (0, 1]
  uint64_t seed = 0;
};

// The token drawn from `logits` (one position's, [V]) as draw number `index` of o.seed: softmax(logits /
// temperature) cut to top_k, then to top_p, renormalized, and inverted at the draw's uniform number. Greedy when
// temperature is 0, top_k is 1 or top_p keeps one token.
int32_t sample_token(const std::vector<float>& logits, const SamplingOptions& o, uint64_t index);

struct Generation {
  std::vector<int32_t> tokens;  // the new tokens, in order
  double prefill_seconds = 0;   // the prompt's forward up to its logits on the host
  double decode_seconds = 0;    // every later step
};

// Up to max_new_tokens tokens after `prompt` (at least one token; the two together at most the model's
// max_position_embeddings: ShapeError otherwise). on_token, when given, sees each token as it is chosen.
// Runs under its own NoGradGuard on a model built with the bf16 recipe (Transformer::forward_cached).
Generation generate(const Transformer& model, const std::vector<int32_t>& prompt, int64_t max_new_tokens,
                    const SamplingOptions& o, const std::function<void(int32_t)>& on_token = {});

// num_new greedy tokens after `prompt`, each from model.forward of one sequence of `window` positions holding the
// tokens so far and then zeros: causal attention keeps later positions out of earlier ones, and one shape serves
// every step (an FP8 recipe's GEMMs take data.seq_len rows). prompt.size() + num_new <= window.
std::vector<int32_t> greedy_window(const Transformer& model, const std::vector<int32_t>& prompt, int64_t num_new,
                                   int64_t window);

// train.sample_every: the prompt is the first kSamplePromptTokens tokens of the first validation window (token 0
// when the data holds none out), followed by kSampleNewTokens greedy tokens (fewer where data.seq_len is short).
constexpr int64_t kSamplePromptTokens = 8;
constexpr int64_t kSampleNewTokens = 32;
// The sample as one line: "<prompt>" -> "<continuation>" decoded and escaped, or the token ids in brackets when
// the run has no tokenizer (synthetic data). Every rank of an expert-parallel run must call it (its forwards are
// collective); the line is the same on each.
std::string training_sample(const Transformer& model, const DataLoader& data, const RunTokenizer& tokenizer);

}  // namespace flowmoe
