// `flowmoe export --format hf` and `flowmoe import --format hf` as a user runs them: a BPE run exported with
// its tokenizer, imported back and trained from; each refusal one line with exit status 2 (what the user
// named) or 1 (a damaged folder), nothing written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "checkpoint/hf_format.h"
#include "dataset/hf_tokenizer.h"
#include "tests/support/cli_run.h"
#include "tests/support/train_fixtures.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

// Runs the built command in `dir` under a 120 s timeout.
Ran run_flowmoe(const fs::path& dir, const std::vector<std::string>& args) {
  return run_flowmoe_command(dir, args, 120);
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// One line "flowmoe: error: <...part...>\n".
::testing::AssertionResult one_error_line(const Ran& r, const std::string& part) {
  if (r.err.rfind("flowmoe: error: ", 0) != 0 || std::count(r.err.begin(), r.err.end(), '\n') != 1 || !has(r.err, part))
    return ::testing::AssertionFailure() << "stderr: " << r.err << "(wanted one error line with '" << part << "')";
  return ::testing::AssertionSuccess();
}

// A small MoE (dense first layer, a shared expert) on BPE tokens of vocab 300, its run in dir/run.
fs::path write_config(const fs::path& dir, const std::string& router = "sigmoid") {
  std::ofstream(dir / "corpus.txt") << [] {
    std::string text;
    for (int i = 0; i < 300; ++i)
      text += "the quick brown fox " + std::to_string(i % 17) + " jumps over the lazy dog.\n";
    return text;
  }();
  const fs::path file = dir / "moe.yaml";
  std::ofstream(file) << "model: {vocab_size: 320, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4,"
                         " intermediate_size: 48, max_position_embeddings: 32, n_routed_experts: 4,"
                         " first_k_dense_replace: 1, moe_intermediate_size: 16, scoring_func: "
                      << router
                      << "}\n"
                         "data: {source: tokens, path: data.bin, seq_len: 16, val_fraction: 0.0}\n"
                         "train: {device: cpu, steps: 2, batch_size: 2, eval_every: 0}\n"
                         "optimizer: {warmup_steps: 1}\n"
                         "logging: {progress: plain, out_dir: run}\n";
  return file;
}

}  // namespace

TEST(CliHf, HelpAndUsage) {
  const fs::path d = fresh_dir("cli_hf_help");
  Ran r = run_flowmoe(d, {"--help"});
  EXPECT_TRUE(has(r.out, "  export  ") && has(r.out, "  import  ")) << r.out;
  r = run_flowmoe(d, {"export", "--help"});
  EXPECT_EQ(r.code, 0);
  EXPECT_TRUE(has(r.out, "usage: flowmoe export --format hf CHECKPOINT OUT_DIR")) << r.out;
  r = run_flowmoe(d, {"import", "--help"});
  EXPECT_EQ(r.code, 0);
  EXPECT_TRUE(has(r.out, "usage: flowmoe import --format hf DIR --config-out FILE")) << r.out;
  r = run_flowmoe(d, {"export", "--format", "onnx", "a", "b"});
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(one_error_line(r, "export: --format 'onnx' is unknown (formats: hf)"));
  r = run_flowmoe(d, {"export", "a", "b"});
  EXPECT_TRUE(one_error_line(r, "export: --format FORMAT is required"));
  r = run_flowmoe(d, {"import", "--format", "hf", "x"});
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(one_error_line(r, "import: --config-out FILE is required"));
}

TEST(CliHf, ExportImportAndTrainFromIt) {
  const fs::path d = fresh_dir("cli_hf");
  write_config(d);
  ASSERT_EQ(run_flowmoe(d, {"prepare-data", "--bpe-vocab", "300", "--output", "data.bin", "corpus.txt"}).code, 0);
  ASSERT_EQ(run_flowmoe(d, {"train", "--config", "moe.yaml"}).code, 0);
  const std::string ck = "run/checkpoints/step_00000002";
  Ran r = run_flowmoe(d, {"export", "--format", "hf", ck, "hf"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(has(r.out, "export: tokenizer: BPE 'data.bpe' (vocab 300)")) << r.out;
  for (const char* f : {kHfConfigFile, kHfModelFile, kHfTokenizerFile, kHfTokenizerConfigFile})
    EXPECT_TRUE(fs::exists(d / "hf" / f)) << f;
  r = run_flowmoe(d, {"export", "--format", "hf", ck, "hf_bare", "--no-tokenizer"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(fs::exists(d / "hf_bare" / kHfTokenizerFile));

  r = run_flowmoe(d, {"import", "--format", "hf", "hf", "--config-out", "imported.yaml", "--checkpoint-dir", "imp"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(has(r.out, "import: tokenizer: wrote imported.bpe")) << r.out;
  EXPECT_TRUE(same_model_weights((d / ck).string(), (d / "imp" / "step_00000000").string()));
  EXPECT_EQ(read_bytes(d / "imported.bpe"), read_bytes(d / "data.bpe"));
  r = run_flowmoe(d, {"train", "--config", "imported.yaml", "--set", "data.source=tokens", "--set",
                      "data.path=data.bin", "--set", "logging.out_dir=run2", "--set", "optimizer.warmup_steps=1",
                      "--set", "train.steps=3", "--set", "logging.progress=plain"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(has(r.out, "resumed from imp/step_00000000 at step 0")) << r.out;
  EXPECT_TRUE(fs::exists(d / "imp" / "step_00000003"));
}

TEST(CliHf, RefusalsAreOneLine) {
  const fs::path d = fresh_dir("cli_hf_refuse");
  write_config(d, "softmax");
  ASSERT_EQ(run_flowmoe(d, {"prepare-data", "--bpe-vocab", "300", "--output", "data.bin", "corpus.txt"}).code, 0);
  ASSERT_EQ(run_flowmoe(d, {"train", "--config", "moe.yaml"}).code, 0);
  Ran r = run_flowmoe(d, {"export", "--format", "hf", "run/checkpoints/step_00000002", "hf"});
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(one_error_line(r, "model.scoring_func: softmax has no glm4_moe counterpart"));
  EXPECT_FALSE(fs::exists(d / "hf"));

  // A folder of the sigmoid model, then broken.
  write_config(d);
  ASSERT_EQ(run_flowmoe(d, {"train", "--config", "moe.yaml", "--set", "logging.out_dir=run_s"}).code, 0);
  ASSERT_EQ(run_flowmoe(d, {"export", "--format", "hf", "run_s/checkpoints/step_00000002", "hf"}).code, 0);
  r = run_flowmoe(d, {"export", "--format", "hf", "run_s/checkpoints/step_00000002", "hf"});
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(one_error_line(r, "export: OUT_DIR 'hf' exists and is not empty"));
  const std::string json = read_bytes(d / "hf" / kHfConfigFile);
  std::ofstream(d / "hf" / kHfConfigFile)
      << std::regex_replace(json, std::regex("\"num_key_value_heads\": 4"), "\"num_key_value_heads\": 2");
  r = run_flowmoe(d, {"import", "--format", "hf", "hf", "--config-out", "imported.yaml"});
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(one_error_line(r, "num_key_value_heads: 2 is not num_attention_heads = 4"));
  std::ofstream(d / "hf" / kHfConfigFile) << json;
  fs::remove(d / "hf" / kHfModelFile);
  r = run_flowmoe(d, {"import", "--format", "hf", "hf", "--config-out", "imported.yaml"});
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(one_error_line(r, "has neither model.safetensors"));
  EXPECT_FALSE(fs::exists(d / "imported.yaml"));
  EXPECT_FALSE(fs::exists(d / "runs"));
}
