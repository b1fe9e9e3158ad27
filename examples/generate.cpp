// `flowmoe generate`: the prompt through the run's tokenizer, a checkpoint's weights into a model of its own
// config (meta.json), the tokens sampled over the K/V cache and printed as they come.
#include "examples/generate.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "dataset/run_tokenizer.h"
#include "examples/args.h"
#include "io/file_io.h"
#include "train/generate.h"
#include "train/run_setup.h"
#include "train/trainer.h"

namespace flowmoe {

namespace {

const char* kGenerateHelp =
    R"(usage: flowmoe generate --checkpoint DIR [--prompt TEXT | --prompt-file FILE] [--max-new-tokens N]
                        [--temperature T] [--top-k K] [--top-p P] [--seed S] [--device cpu|cuda]
                        [--tokenizer BPE]

Continues a prompt with a trained model: the checkpoint's meta.json gives the model and data config of
its run, whose tokenizer encodes the prompt and decodes the new tokens. The prompt is run in one
forward (prefill), then each new token in one step over a cache of every layer's keys and values.
Prints the prompt and its continuation on stdout as the tokens come, then on stderr a line with the
prefill's and the decoding's tokens/s.

The tokenizer: data.source text is one token per byte; data.source tokens uses the BPE file
prepare-data --bpe-vocab saved beside the token file (data/books.bin -> data/books.bpe), or one token
per byte where there is none and every token is below 256. Synthetic data is no text: its prompt is token ids
separated by spaces (e.g. --prompt "0 17 42"), and the ids are printed.

options:
  --checkpoint DIR      a checkpoint directory (e.g. runs/tiny/checkpoints/step_00000300)
  --prompt TEXT         the prompt (without --prompt or --prompt-file: stdin, read to its end)
  --prompt-file FILE    the prompt, read from FILE
  --max-new-tokens N    new tokens to generate (default 64); prompt and new tokens together take at most
                        model.max_position_embeddings positions: a longer prompt is refused, and N is
                        cut to the positions left (said on stderr)
  --temperature T       softmax temperature, 0 for greedy decoding (default 1.0)
  --top-k K             sample among the K most likely tokens; 0: all (default 0)
  --top-p P             nucleus sampling: among the fewest most likely tokens whose probability
                        reaches P, in (0, 1] (default 1.0)
  --seed S              the sampling seed: a seed gives the same tokens on every run (default 0)
  --device DEV          cpu or cuda (default: the GPU when one is present, else the CPU)
  --tokenizer BPE       a BPE tokenizer file to use instead of the run's (prepare-data --tokenizer runs)
  -h, --help            this text

The model runs in bf16 on the GPU and f32 on the CPU whatever precision.recipe trained it.
)";

constexpr int64_t kDefaultMaxNewTokens = 64;

struct GenerateArgs {
  std::string checkpoint, prompt, prompt_file, tokenizer;
  DeviceChoice device = DeviceChoice::automatic;
  bool has_prompt = false;
  int64_t max_new_tokens = kDefaultMaxNewTokens;
  SamplingOptions sampling;
};

GenerateArgs parse_generate_args(int argc, char** argv) {
  Args args(argc, argv, 2, kGenerateHelp);
  GenerateArgs g;
  while (!args.done()) {
    const std::string a = args.next();
    if (a == "--checkpoint") {
      g.checkpoint = args.value(a);
    } else if (a == "--prompt") {
      g.prompt = args.value(a);
      g.has_prompt = true;
    } else if (a == "--prompt-file") {
      g.prompt_file = args.value(a);
    } else if (a == "--max-new-tokens") {
      g.max_new_tokens = positive_integer("generate", a, args.value(a));
    } else if (a == "--temperature") {
      g.sampling.temperature = non_negative_number("generate", a, args.value(a));
    } else if (a == "--top-k") {
      g.sampling.top_k = int64_t(non_negative_number("generate", a, args.value(a), true));
    } else if (a == "--top-p") {
      const std::string v = args.value(a);
      char* end = nullptr;
      const double p = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || !(p > 0 && p <= 1))
        throw UsageError("generate: --top-p needs a number in (0, 1], got '" + v + "'");
      g.sampling.top_p = p;
    } else if (a == "--seed") {
      const std::string v = args.value(a);
      char* end = nullptr;
      errno = 0;
      g.sampling.seed = std::strtoull(v.c_str(), &end, 10);
      if (v.empty() || v[0] == '-' || *end != '\0' || errno == ERANGE)
        throw UsageError("generate: --seed needs a whole number from 0 to 2^64 - 1, got '" + v + "'");
    } else if (a == "--device") {
      const std::string d = args.value(a);
      if (!enum_from_name(kDeviceChoiceNames, d, &g.device) || g.device == DeviceChoice::automatic)
        throw UsageError("generate: --device needs cpu or cuda, got '" + d + "'");
    } else if (a == "--tokenizer") {
      g.tokenizer = args.value(a);
    } else {
      throw UsageError("generate: unknown argument '" + a + "' (see flowmoe generate --help)");
    }
  }
  if (g.checkpoint.empty()) throw UsageError("generate: --checkpoint DIR is required");
  if (g.has_prompt && !g.prompt_file.empty()) throw UsageError("generate: give --prompt or --prompt-file, not both");
  return g;
}

std::string read_prompt(const GenerateArgs& g) {
  if (g.has_prompt) return g.prompt;
  if (!g.prompt_file.empty()) return read_file(g.prompt_file, kNoSizeLimit, "prompt file");
  return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}

// "12 tokens in 3.4 ms (3.5k tok/s)"; a rate of nothing is not shown.
std::string timing(int64_t tokens, double seconds) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%lld tokens in %.1f ms", static_cast<long long>(tokens), seconds * 1e3);
  std::string s = buf;
  if (tokens > 0 && seconds > 0) {
    std::snprintf(buf, sizeof buf, " (%.1f tok/s)", double(tokens) / seconds);
    s += buf;
  }
  return s;
}

// A synthetic-data prompt: token ids below vocab_size separated by white space.
std::vector<int32_t> parse_token_ids(const std::string& text, int64_t vocab_size) {
  std::vector<int32_t> ids;
  size_t at = text.find_first_not_of(" \t\n");
  while (at != std::string::npos) {
    const size_t end = std::min(text.find_first_of(" \t\n", at), text.size());
    const std::string word = text.substr(at, end - at);
    char* stop = nullptr;
    errno = 0;
    const long long id = std::strtoll(word.c_str(), &stop, 10);
    if (*stop != '\0' || errno == ERANGE || id < 0 || id >= vocab_size)
      throw UsageError("generate: data.source synthetic has no text, so the prompt is token ids from 0 to " +
                       std::to_string(vocab_size - 1) + " separated by spaces; got '" + word + "'");
    ids.push_back(int32_t(id));
    at = text.find_first_not_of(" \t\n", end);
  }
  return ids;
}

// " 0 17 42": each id after a space, so that the prompt's and each new token's pieces print as one line.
std::string spaced_ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) {
    s.push_back(' ');
    s.append(std::to_string(id));
  }
  return s;
}

}  // namespace

int cmd_generate(int argc, char** argv) {
  const GenerateArgs g = parse_generate_args(argc, argv);
  const CheckpointMeta meta = read_checkpoint_meta(g.checkpoint);
  Config cfg = parse_checkpoint_config(meta.config_yaml, g.checkpoint + "/meta.json");
  cfg.train.device = g.device;
  cfg.origins["train.device"] =
      std::string("--device ") + enum_name(kDeviceChoiceNames, g.device);  // what a refusal of the device names
  // One process holds every expert: the MoE options below are a single process's, whatever trained the weights.
  cfg.parallel.expert_parallel_size = 1;
  RunSetup setup(cfg);
  const Device device = setup.device;
  RunTokenizer tokenizer = RunTokenizer::for_config(cfg, g.tokenizer);
  // Synthetic tokens are ids of a generated corpus: they go in and come out as numbers.
  const bool ids = !tokenizer.found() && cfg.data.source == DataSource::synthetic;
  if (!tokenizer.found() && !ids)
    throw ConfigError("generate: no tokenizer for this checkpoint: " + tokenizer.missing() +
                      " (give --tokenizer FILE)");
  const std::vector<int32_t> prompt =
      ids ? parse_token_ids(read_prompt(g), cfg.model.vocab_size) : tokenizer.encode(read_prompt(g));
  const int64_t max_positions = cfg.model.max_position_embeddings, p = int64_t(prompt.size());
  if (p == 0) throw UsageError("generate: the prompt is empty (give --prompt TEXT, --prompt-file FILE or stdin)");
  if (p >= max_positions)
    throw UsageError("generate: the prompt is " + std::to_string(p) + " tokens; the model takes " +
                     std::to_string(max_positions) + " positions (model.max_position_embeddings), so at most " +
                     std::to_string(max_positions - 1) + " prompt tokens leave room for one new token");
  int64_t num_new = g.max_new_tokens;
  if (p + num_new > max_positions) {
    num_new = max_positions - p;
    std::fprintf(stderr, "generate: --max-new-tokens %lld cut to %lld (%lld prompt tokens of %lld positions)\n",
                 static_cast<long long>(g.max_new_tokens), static_cast<long long>(num_new), static_cast<long long>(p),
                 static_cast<long long>(max_positions));
  }
  const DType compute = setup.compute;
  // The bf16 recipe whatever trained the weights (Transformer::forward_cached); the weights are converted once to
  // the compute dtype, but those read in f32 (the routers' gates), so no step casts them again.
  Transformer& model = setup.build_model(meta.init_seed, MoeOptions(int(cfg.precision.align_size)));
  setup.load_weights(g.checkpoint);
  for (size_t i = 0; i < model.parameters().size(); ++i) {
    Variable w = model.parameters()[i];  // shares the model's weight
    if (!model.parameter_shards()[i].reads_f32 && w.dtype() != compute) w.store_as(w.data().to(compute));
  }
  std::fprintf(stderr, "generate: checkpoint %s (step %lld) on %s, tokenizer %s, %lld prompt tokens\n",
               g.checkpoint.c_str(), static_cast<long long>(meta.step), device.str().c_str(),
               ids ? "none (token ids)" : tokenizer.describe().c_str(), static_cast<long long>(p));
  std::fputs((ids ? spaced_ids(prompt).substr(1) : tokenizer.decode(prompt)).c_str(), stdout);
  std::fflush(stdout);
  // A byte-level BPE token decodes to its own bytes, so printing each as it comes gives the whole text.
  const Generation out = generate(model, prompt, num_new, g.sampling, [&](int32_t token) {
    const std::string piece = ids ? spaced_ids({token}) : tokenizer.decode({token});
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  });
  std::fputs("\n", stdout);
  std::fflush(stdout);
  std::fprintf(stderr, "prefill: %s | decode: %s\n", timing(p, out.prefill_seconds).c_str(),
               timing(int64_t(out.tokens.size()) - 1, out.decode_seconds).c_str());
  return 0;
}

}  // namespace flowmoe
