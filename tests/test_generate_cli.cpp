// `flowmoe generate` as a user runs it: a text model trained by the built command, continued greedily (stdout the
// prompt and its continuation, stderr the prefill's and the decoding's tokens/s), a seed that repeats its tokens,
// a prompt from a file or stdin, token ids in and out for synthetic data, and bad input refused with one line and a
// non-zero exit: no checkpoint, no tokenizer, a synthetic-data prompt that is not token ids, a prompt past the model's
// positions, a --top-p outside (0, 1].
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "kernels/common/device_api.h"
#include "tests/support/cli_run.h"
#include "tests/support/train_fixtures.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

// Runs the built command in `dir` with `args` under a 60 s timeout, stdin from `stdin_file` (default /dev/null).
Ran run_flowmoe(const fs::path& dir, const std::vector<std::string>& args, const std::string& stdin_file = "") {
  return run_flowmoe_command(dir, args, 60, stdin_file);
}

size_t lines(const std::string& s) {
  size_t n = 0;
  for (char c : s) n += c == '\n';
  return n + (!s.empty() && s.back() != '\n');
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A model of a repeated sentence, 60 steps on the CPU (about a second); returns its checkpoint. source: text (one
// token per byte), synthetic, or tokens (BPE tokens of the sentence in corpus.bin, its tokenizer corpus.bpe).
std::string train_text_model(const fs::path& dir, const std::string& source) {
  std::ofstream corpus(dir / "corpus.txt");
  for (int i = 0; i < 300; ++i) corpus << "the quick brown fox jumps over the lazy dog. ";
  corpus.close();
  std::string data = "source: synthetic";
  if (source == "text") data = "source: text, path: corpus.txt";
  if (source == "tokens") {
    const Ran prepared =
        run_flowmoe(dir, {"prepare-data", "--output", "corpus.bin", "--bpe-vocab", "300", "corpus.txt"});
    EXPECT_EQ(prepared.code, 0) << prepared.err;
    data = "source: tokens, path: corpus.bin";
  }
  std::ofstream(dir / "text.yaml") << "model: {vocab_size: " << (source == "tokens" ? 320 : 256)
                                   << ", hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,"
                                      " intermediate_size: 128, max_position_embeddings: 48}\n"
                                      "data: {"
                                   << data
                                   << ", seq_len: 48, val_fraction: 0.1}\n"
                                      "train: {device: cpu, steps: 60, batch_size: 8, eval_every: 0}\n"
                                      "optimizer: {lr: 0.01, min_lr: 0.001, warmup_steps: 4}\n"
                                      "logging: {progress: plain, out_dir: run_"
                                   << source << "}\n";
  const Ran r = run_flowmoe(dir, {"train", "--config", "text.yaml"});
  EXPECT_EQ(r.code, 0) << r.err;
  return (dir / ("run_" + source) / "checkpoints" / "step_00000060").string();
}

}  // namespace

TEST(GenerateCli, ContinuesAPromptAndTimesBothPhases) {
  const fs::path d = fresh_dir("generate_cli");
  const std::string ckpt = train_text_model(d, "text");
  // `flowmoe generate --checkpoint CKPT ARGS... --device DEVICE`
  const auto generate = [&](std::vector<std::string> args, const std::string& device = "cpu") {
    args.insert(args.begin(), {"generate", "--checkpoint", ckpt});
    args.insert(args.end(), {"--device", device});
    return args;
  };
  const std::vector<std::string> greedy = {"--prompt", "the quick", "--temperature", "0", "--max-new-tokens", "20"};
  const Ran r = run_flowmoe(d, generate(greedy));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(lines(r.out), 1u) << r.out;
  EXPECT_EQ(r.out.rfind("the quick", 0), 0u) << r.out;
  EXPECT_EQ(r.out.size(), std::string("the quick").size() + 20 + 1) << "20 byte tokens and a newline: " << r.out;
  EXPECT_TRUE(has(r.out, "brown fox")) << "a model of one sentence continues it: " << r.out;
  EXPECT_TRUE(has(r.err, "prefill: 9 tokens in ")) << r.err;
  EXPECT_TRUE(has(r.err, "| decode: 19 tokens in ")) << r.err;
  EXPECT_TRUE(has(r.err, "tok/s")) << r.err;

  // A seed repeats its tokens; the prompt from a file and from stdin is the same prompt.
  const std::vector<std::string> sampled = generate({"--prompt", "over", "--top-k", "5", "--seed", "3"});
  const Ran a = run_flowmoe(d, sampled), b = run_flowmoe(d, sampled);
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_EQ(a.out, b.out);
  std::ofstream(d / "prompt.txt") << "the quick";
  const Ran from_file =
      run_flowmoe(d, generate({"--prompt-file", "prompt.txt", "--temperature", "0", "--max-new-tokens", "20"}));
  EXPECT_EQ(from_file.out, r.out) << from_file.err;
  const Ran from_stdin =
      run_flowmoe(d, generate({"--temperature", "0", "--max-new-tokens", "20"}), (d / "prompt.txt").string());
  EXPECT_EQ(from_stdin.out, r.out) << from_stdin.err;

  // More new tokens than positions left: cut, and said.
  const Ran cut = run_flowmoe(d, generate({"--prompt", "the", "--max-new-tokens", "100"}));
  ASSERT_EQ(cut.code, 0) << cut.err;
  EXPECT_TRUE(has(cut.err, "--max-new-tokens 100 cut to 45")) << cut.err;
  EXPECT_EQ(cut.out.size(), 48u + 1);

  // On a GPU (bf16, the weights converted once at load): the same command, 20 tokens after the prompt.
  if (cuda_available()) {
    const Ran g = run_flowmoe(d, generate(greedy, "cuda"));
    ASSERT_EQ(g.code, 0) << g.err;
    EXPECT_EQ(g.out.rfind("the quick", 0), 0u) << g.out;
    EXPECT_EQ(g.out.size(), r.out.size()) << g.out;
    EXPECT_TRUE(has(g.err, "on cuda:0")) << g.err;
  }
  fs::remove_all(d);
}

TEST(GenerateCli, BadInputIsOneLineAndANonZeroExit) {
  const fs::path d = fresh_dir("generate_cli_bad");
  const std::string ckpt = train_text_model(d, "text");
  const auto refused = [&](const std::vector<std::string>& args, int code, const std::string& part) {
    const Ran r = run_flowmoe(d, args);
    EXPECT_EQ(r.code, code) << r.err;
    EXPECT_EQ(lines(r.err), 1u) << r.err;
    EXPECT_EQ(r.err.rfind("flowmoe: error: ", 0), 0u) << r.err;
    EXPECT_TRUE(has(r.err, part)) << r.err;
    EXPECT_EQ(r.out, "");
  };
  refused({"generate", "--checkpoint", (d / "nowhere").string(), "--prompt", "x"}, 1, "is not a checkpoint");
  refused({"generate", "--checkpoint", ckpt, "--prompt", std::string(48, 'a')}, 2,
          "the prompt is 48 tokens; the model takes 48 positions");
  refused({"generate", "--checkpoint", ckpt, "--prompt", "x", "--top-p", "0"}, 2, "--top-p needs a number in (0, 1]");
  refused({"generate", "--checkpoint", ckpt, "--prompt", "x", "--top-p", "1.5"}, 2, "--top-p");
  refused({"generate", "--checkpoint", ckpt, "--prompt", ""}, 2, "the prompt is empty");
  refused({"generate", "--checkpoint", ckpt, "--prompt", "x", "--prompt-file", "p.txt"}, 2, "not both");
  refused({"generate", "--prompt", "x"}, 2, "--checkpoint DIR is required");
  refused({"generate", "--checkpoint", ckpt, "--prompt", "x", "--device", "tpu"}, 2, "--device");
  refused({"generate", "--checkpoint", ckpt, "--prompt", "x", "--seed", "-1"}, 2, "--seed");
  refused({"generate", "--checkpoint", ckpt, "--prompt", "x", "--top-k", "1.5"}, 2, "--top-k");
  if (!cuda_available())
    refused({"generate", "--checkpoint", ckpt, "--prompt", "x", "--device", "cuda"}, 2,
            "--device cuda: train.device: cuda was requested");
  const std::string synthetic = train_text_model(d, "synthetic");
  refused({"generate", "--checkpoint", synthetic, "--prompt", "x"}, 2,
          "data.source synthetic has no text, so the prompt is token ids from 0 to 255 separated by spaces; got 'x'");
  refused({"generate", "--checkpoint", synthetic, "--prompt", "0 256"}, 2, "got '256'");
  // Synthetic data: the prompt's ids and the new ones, on one line.
  const Ran ids =
      run_flowmoe(d, {"generate", "--checkpoint", synthetic, "--prompt", " 0  7\n", "--max-new-tokens", "5"});
  ASSERT_EQ(ids.code, 0) << ids.err;
  EXPECT_TRUE(std::regex_match(ids.out, std::regex("0 7( [0-9]+){5}\n"))) << ids.out;
  EXPECT_TRUE(has(ids.err, "tokenizer none (token ids), 2 prompt tokens")) << ids.err;
  fs::remove_all(d);
}

// data.source tokens: the BPE tokenizer prepare-data saved beside the token file encodes the prompt and decodes
// the tokens; moved away, it is missing (named in the one-line refusal) until --tokenizer names it.
TEST(GenerateCli, ATokenFileTakesTheBpeTokenizerBesideIt) {
  const fs::path d = fresh_dir("generate_cli_bpe");
  const std::string ckpt = train_text_model(d, "tokens");
  const std::vector<std::string> args = {"generate", "--checkpoint",  ckpt, "--prompt", "the quick", "--device",
                                         "cpu",      "--temperature", "0"};
  const Ran r = run_flowmoe(d, args);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(has(r.err, "tokenizer BPE 'corpus.bpe' (vocab ")) << r.err;
  EXPECT_EQ(r.out.rfind("the quick", 0), 0u) << r.out;
  EXPECT_TRUE(has(r.out, "lazy dog")) << "a model of one sentence continues it: " << r.out;
  fs::rename(d / "corpus.bpe", d / "moved.bpe");
  const Ran missing = run_flowmoe(d, args);
  EXPECT_EQ(missing.code, 2);
  EXPECT_EQ(lines(missing.err), 1u) << missing.err;
  EXPECT_TRUE(has(missing.err, "no BPE tokenizer beside it ('corpus.bpe')")) << missing.err;
  std::vector<std::string> named = args;
  named.insert(named.end(), {"--tokenizer", "moved.bpe"});
  const Ran given = run_flowmoe(d, named);
  ASSERT_EQ(given.code, 0) << given.err;
  EXPECT_EQ(given.out, r.out);
  fs::remove_all(d);
}
