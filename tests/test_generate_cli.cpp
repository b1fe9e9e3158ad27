// `flowmoe generate` as a user runs it: a text model trained by the built command, continued greedily (stdout the
// prompt and its continuation, stderr the prefill's and the decoding's tokens/s), a seed that repeats its tokens,
// a prompt from a file or stdin, and bad input refused with one line and a non-zero exit: no checkpoint, no
// tokenizer (synthetic data), a prompt past the model's positions, a --top-p outside (0, 1].
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kernels/common/device_api.h"
#include "tests/train_test_util.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

struct Ran {
  int code = -1;  // the exit status; 124 when the timeout ended it
  std::string out, err;
};

// Runs the built command in `dir` with `args` under a 60 s timeout, stdin from `stdin_file` (default /dev/null).
Ran run_flowmoe(const fs::path& dir, const std::vector<std::string>& args, const std::string& stdin_file = "") {
  std::string cmd = "cd '" + dir.string() + "' && timeout 60 " + FLOWMOE_BINARY_DIR + "/flowmoe";
  for (const std::string& a : args) cmd += " '" + a + "'";
  cmd += " <'" + (stdin_file.empty() ? std::string("/dev/null") : stdin_file) + "' >out.txt 2>err.txt";
  const int status = std::system(cmd.c_str());
  Ran r;
  if (status != -1 && WIFEXITED(status)) r.code = WEXITSTATUS(status);
  r.out = read_bytes(dir / "out.txt");
  r.err = read_bytes(dir / "err.txt");
  return r;
}

size_t lines(const std::string& s) {
  size_t n = 0;
  for (char c : s) n += c == '\n';
  return n + (!s.empty() && s.back() != '\n');
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A byte-level model of a repeated sentence, 40 steps on the CPU (about a second); returns its checkpoint.
std::string train_text_model(const fs::path& dir, const std::string& source) {
  std::ofstream corpus(dir / "corpus.txt");
  for (int i = 0; i < 300; ++i) corpus << "the quick brown fox jumps over the lazy dog. ";
  corpus.close();
  std::ofstream(dir / "text.yaml")
      << "model: {vocab_size: 256, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,"
         " intermediate_size: 128, max_position_embeddings: 48}\n"
         "data: {"
      << (source == "text" ? "source: text, path: corpus.txt" : "source: synthetic")
      << ", seq_len: 48, val_fraction: 0.1}\n"
         "train: {device: cpu, steps: 40, batch_size: 8, eval_every: 0}\n"
         "optimizer: {lr: 0.01, min_lr: 0.001, warmup_steps: 4}\n"
         "logging: {progress: plain, out_dir: run_"
      << source << "}\n";
  const Ran r = run_flowmoe(dir, {"train", "--config", "text.yaml"});
  EXPECT_EQ(r.code, 0) << r.err;
  return (dir / ("run_" + source) / "checkpoints" / "step_00000040").string();
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
  refused({"generate", "--checkpoint", synthetic, "--prompt", "x"}, 2, "data.source synthetic has no tokenizer");
  fs::remove_all(d);
}
