// Config parsing: strict errors name the file, the line and the key; --set overrides are checked
// the same way; the shipped configs load; the resolved YAML reads back to the same config.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "engine/error.h"
#include "engine/train/config.h"

using namespace flowmoe;

namespace {

// The message of the ConfigError that f throws (a test failure when it throws none).
std::string config_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a ConfigError";
  return "";
}

std::string parse_error(const std::string& yaml, const std::vector<std::string>& sets = {}) {
  return config_error([&] { parse_config(yaml, "bad.yaml", sets); });
}

#define EXPECT_HAS(haystack, needle) EXPECT_NE((haystack).find(needle), std::string::npos) << (haystack)

}  // namespace

TEST(Config, EmptyFileGivesValidDefaults) {
  Config c = parse_config("", "empty.yaml");
  EXPECT_EQ(c.model.n_routed_experts, 0);
  EXPECT_EQ(c.data.source, "synthetic");
  EXPECT_EQ(c.run_dir(), "runs/empty");
  EXPECT_EQ(c.checkpoint_dir(), "runs/empty/checkpoints");
}

TEST(Config, ShippedConfigsLoad) {
  Config tiny = load_config(std::string(FLOWMOE_SOURCE_DIR) + "/configs/tiny.yaml");
  EXPECT_EQ(tiny.model.vocab_size, 256);
  EXPECT_EQ(tiny.train.device, "auto");
  Config gpu = load_config(std::string(FLOWMOE_SOURCE_DIR) + "/configs/gpu_small.yaml");
  EXPECT_GT(gpu.model.hidden_size, tiny.model.hidden_size);
  EXPECT_EQ(gpu.origin("model.hidden_size").rfind(std::string(FLOWMOE_SOURCE_DIR) + "/configs/gpu_small.yaml:", 0), 0u);
}

TEST(Config, ReadsEveryKind) {
  Config c = parse_config(
      "model:\n  hidden_size: 64\n  rms_norm_eps: 1e-5\n  tie_word_embeddings: true\n"
      "optimizer:\n  lr: 0.01\n  min_lr: 0\n"
      "checkpoint:\n  resume: /tmp/x\n"
      "precision:\n  align_size: 64\n",
      "ok.yaml");
  EXPECT_EQ(c.model.hidden_size, 64);
  EXPECT_DOUBLE_EQ(c.model.rms_norm_eps, 1e-5);
  EXPECT_TRUE(c.model.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 0.01);
  EXPECT_DOUBLE_EQ(c.optimizer.min_lr, 0.0);
  EXPECT_EQ(c.checkpoint.resume, "/tmp/x");
  EXPECT_EQ(c.precision.align_size, 64);
  EXPECT_EQ(c.origin("model.hidden_size"), "ok.yaml:2");
  EXPECT_EQ(c.origin("optimizer.lr"), "ok.yaml:6");
  EXPECT_EQ(c.origin("train.steps"), "default");
}

TEST(Config, UnknownKeyNamesFileLineAndKey) {
  std::string m = parse_error("model:\n  hidden_size: 64\n  hiden_size: 32\n");
  EXPECT_HAS(m, "bad.yaml:3");
  EXPECT_HAS(m, "model.hiden_size");
  EXPECT_HAS(m, "did you mean 'hidden_size'");
}

TEST(Config, UnknownSection) {
  std::string m = parse_error("model:\n  hidden_size: 64\ntrainer:\n  steps: 3\n");
  EXPECT_HAS(m, "bad.yaml:3");
  EXPECT_HAS(m, "unknown section 'trainer'");
  EXPECT_HAS(m, "did you mean 'train'");
}

TEST(Config, WrongTypes) {
  std::string m = parse_error("train:\n  steps: ten\n");
  EXPECT_HAS(m, "bad.yaml:2");
  EXPECT_HAS(m, "train.steps");
  EXPECT_HAS(m, "expected an integer");
  m = parse_error("train:\n  batch_size: 2.5\n");
  EXPECT_HAS(m, "train.batch_size");
  m = parse_error("model:\n  tie_word_embeddings: maybe\n");
  EXPECT_HAS(m, "model.tie_word_embeddings");
  EXPECT_HAS(m, "true or false");
  m = parse_error("optimizer:\n  lr: fast\n");
  EXPECT_HAS(m, "optimizer.lr");
  EXPECT_HAS(m, "expected a number");
  m = parse_error("train:\n  device: gpu\n");
  EXPECT_HAS(m, "train.device");
  EXPECT_HAS(m, "one of auto, cpu, cuda");
  m = parse_error("model:\n  hidden_size: [1, 2]\n");
  EXPECT_HAS(m, "got a list");
  m = parse_error("model:\n  hidden_size:\n");
  EXPECT_HAS(m, "missing value");
  m = parse_error("precision:\n  align_size: 48\n");
  EXPECT_HAS(m, "precision.align_size");
  EXPECT_HAS(m, "one of 16, 32, 64, 128");
}

TEST(Config, OutOfRange) {
  std::string m = parse_error("\n\noptimizer:\n  beta2: 1.0\n");
  EXPECT_HAS(m, "bad.yaml:4");
  EXPECT_HAS(m, "optimizer.beta2");
  EXPECT_HAS(m, "[0, 1)");
  m = parse_error("train:\n  steps: 0\n");
  EXPECT_HAS(m, "train.steps");
  m = parse_error("model:\n  rms_norm_eps: 0\n");
  EXPECT_HAS(m, "model.rms_norm_eps");
  m = parse_error("model:\n  vocab_size: 70000\n");
  EXPECT_HAS(m, "model.vocab_size");
}

TEST(Config, InconsistentCombinations) {
  std::string m = parse_error("model:\n  hidden_size: 100\n  num_attention_heads: 3\n");
  EXPECT_HAS(m, "bad.yaml:2");
  EXPECT_HAS(m, "model.hidden_size");
  EXPECT_HAS(m, "not divisible by model.num_attention_heads = 3");
  EXPECT_HAS(m, "(model.num_attention_heads: bad.yaml:3)");
  m = parse_error("model:\n  hidden_size: 12\n  num_attention_heads: 4\n");
  EXPECT_HAS(m, "must be even");
  m = parse_error("model:\n  max_position_embeddings: 64\ndata:\n  seq_len: 128\n");
  EXPECT_HAS(m, "bad.yaml:4");
  EXPECT_HAS(m, "data.seq_len");
  m = parse_error("optimizer:\n  lr: 0.001\n  min_lr: 0.01\n");
  EXPECT_HAS(m, "optimizer.min_lr");
  m = parse_error("train:\n  steps: 10\noptimizer:\n  warmup_steps: 20\n");
  EXPECT_HAS(m, "bad.yaml:4: optimizer.warmup_steps");
  m = parse_error("train:\n  steps: 10\n");  // the default warmup (20) no longer fits: train.steps is named
  EXPECT_HAS(m, "bad.yaml:2: train.steps: optimizer.warmup_steps = 20 exceeds train.steps = 10");
  m = parse_error("data:\n  path: corpus.txt\n");
  EXPECT_HAS(m, "data.path");
  EXPECT_HAS(m, "synthetic");
  m = parse_error("data:\n  source: tokens\n");
  EXPECT_HAS(m, "needs data.path");
  m = parse_error("data:\n  source: tokens\n  path: /nonexistent/x.bin\n");
  EXPECT_HAS(m, "bad.yaml:3");
  EXPECT_HAS(m, "does not exist");
}

TEST(Config, UnavailableFeaturesAreRejected) {
  // MoE routing keys are checked for consistency, naming the key and its line.
  std::string m = parse_error("model:\n  n_routed_experts: 8\n  n_group: 3\n");
  EXPECT_HAS(m, "bad.yaml:3");
  EXPECT_HAS(m, "model.n_group");
  m = parse_error("model:\n  n_routed_experts: 8\n  n_group: 4\n  topk_group: 1\n  num_experts_per_tok: 3\n");
  EXPECT_HAS(m, "model.num_experts_per_tok");
  EXPECT_HAS(m, "kept groups");
  m = parse_error("model:\n  n_routed_experts: 300\n");
  EXPECT_HAS(m, "limit of 256");
  m = parse_error("parallel:\n  expert_parallel_size: 2\n");
  EXPECT_HAS(m, "parallel.expert_parallel_size");
  EXPECT_HAS(m, "not available yet");
  // FP8 recipes need 128-wide blocks: a hidden size or expert width FP8 cannot serve is named.
  m = parse_error("model:\n  n_routed_experts: 8\n  hidden_size: 192\n  num_attention_heads: 4\nprecision:\n  recipe: fp8_flow\n");
  EXPECT_HAS(m, "model.hidden_size");
  EXPECT_HAS(m, "not a multiple of 128");
  EXPECT_HAS(m, "fp8_flow");
  m = parse_error("model:\n  n_routed_experts: 8\n  hidden_size: 256\n  moe_intermediate_size: 200\nprecision:\n  recipe: fp8_blockwise\n");
  EXPECT_HAS(m, "model.moe_intermediate_size");
  m = parse_error("parallel:\n  data_parallel_size: 2\n");
  EXPECT_HAS(m, "parallel.data_parallel_size");
  m = parse_error("parallel:\n  expert_parallel_size: 4\n");
  EXPECT_HAS(m, "parallel.expert_parallel_size");
}

TEST(Config, RecomputeIsAListOfModules) {
  Config c = parse_config("train:\n  recompute: [moe_expert]\n", "ok.yaml");
  EXPECT_TRUE(c.train.recomputes("moe_expert"));
  EXPECT_NE(to_yaml(c).find("recompute: [moe_expert]"), std::string::npos);
  c = parse_config("train:\n  recompute: []\n", "ok.yaml");
  EXPECT_FALSE(c.train.recomputes("moe_expert"));
  c = parse_config("", "ok.yaml", {"train.recompute=[moe_expert]"});
  EXPECT_TRUE(c.train.recomputes("moe_expert"));
  std::string m = parse_error("train:\n  recompute: [moe_experts]\n");
  EXPECT_HAS(m, "train.recompute");
  EXPECT_HAS(m, "moe_expert");
  EXPECT_HAS(m, "bad.yaml:2");
}

TEST(Config, DuplicatesAndSyntaxErrors) {
  std::string m = parse_error("train:\n  steps: 3\n  steps: 4\n");
  EXPECT_HAS(m, "bad.yaml:3");
  EXPECT_HAS(m, "given twice");
  m = parse_error("train:\n  steps: [3\n");
  EXPECT_HAS(m, "bad.yaml:");
  EXPECT_HAS(m, "YAML syntax error");
  m = parse_error("- 1\n- 2\n");
  EXPECT_HAS(m, "top level must be a mapping");
}

TEST(Config, SyntheticKindChoosesTheCorpus) {
  EXPECT_EQ(parse_config("", "ok.yaml").data.synthetic_kind, "words");
  Config c = parse_config("data:\n  synthetic_kind: bigram\n", "ok.yaml");
  EXPECT_EQ(c.data.synthetic_kind, "bigram");
  EXPECT_EQ(c.origin("data.synthetic_kind"), "ok.yaml:2");
  EXPECT_NE(to_yaml(c).find("synthetic_kind: bigram"), std::string::npos);
  c = parse_config("", "ok.yaml", {"data.synthetic_kind=bigram"});
  EXPECT_EQ(c.data.synthetic_kind, "bigram");
  std::string m = parse_error("data:\n  seq_len: 64\n  synthetic_kind: zipf\n");
  EXPECT_HAS(m, "bad.yaml:3");
  EXPECT_HAS(m, "data.synthetic_kind");
  EXPECT_HAS(m, "one of words, bigram");
  m = parse_error("", {"data.synthetic_kind=bigrams"});
  EXPECT_HAS(m, "--set data.synthetic_kind=bigrams: data.synthetic_kind");
  EXPECT_HAS(m, "did you mean 'bigram'");
}

TEST(Config, RouterLrScaleDefaultsToOneAndRejectsNegatives) {
  EXPECT_EQ(parse_config("", "ok.yaml").optimizer.router_lr_scale, 1.0);
  Config c = parse_config("optimizer:\n  router_lr_scale: 0.1\n", "ok.yaml");
  EXPECT_EQ(c.optimizer.router_lr_scale, 0.1);
  EXPECT_NE(to_yaml(c).find("router_lr_scale: 0.1"), std::string::npos);
  std::string m = parse_error("optimizer:\n  router_lr_scale: -1\n");
  EXPECT_HAS(m, "bad.yaml:2");
  EXPECT_HAS(m, "optimizer.router_lr_scale");
}

TEST(Config, BiasUpdateScheduleIsConstantOrLr) {
  EXPECT_EQ(parse_config("", "ok.yaml").model.bias_update_schedule, "constant");
  Config c = parse_config("model:\n  bias_update_schedule: lr\n", "ok.yaml");
  EXPECT_EQ(c.model.bias_update_schedule, "lr");
  EXPECT_NE(to_yaml(c).find("bias_update_schedule: lr"), std::string::npos);
  std::string m = parse_error("model:\n  bias_update_rate: 0.01\n  bias_update_schedule: cosine\n");
  EXPECT_HAS(m, "bad.yaml:3");
  EXPECT_HAS(m, "model.bias_update_schedule");
  EXPECT_HAS(m, "one of constant, lr");
}

TEST(Config, BiasUpdateRuleIsSignOrProportional) {
  EXPECT_EQ(parse_config("", "ok.yaml").model.bias_update_rule, "sign");
  EXPECT_EQ(parse_config("model:\n  bias_update_rule: proportional\n", "ok.yaml").model.bias_update_rule,
            "proportional");
  EXPECT_HAS(parse_error("model:\n  bias_update_rule: linear\n"), "model.bias_update_rule");
}

TEST(Config, SetOverridesAreValidatedTheSameWay) {
  Config c = parse_config("train:\n  steps: 50\n", "base.yaml", {"train.steps=7", "optimizer.lr=1e-4",
                                                                  "optimizer.min_lr=0", "optimizer.warmup_steps=2"});
  EXPECT_EQ(c.train.steps, 7);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-4);
  EXPECT_EQ(c.origin("train.steps"), "--set train.steps=7");

  std::string m = parse_error("", {"train.steps=abc"});
  EXPECT_HAS(m, "--set train.steps=abc");
  EXPECT_HAS(m, "expected an integer");
  m = parse_error("", {"train.stepz=3"});
  EXPECT_HAS(m, "train.stepz");
  EXPECT_HAS(m, "did you mean 'steps'");
  m = parse_error("", {"steps=3"});
  EXPECT_HAS(m, "section.key=value");
  m = parse_error("", {"train.steps"});
  EXPECT_HAS(m, "section.key=value");
  m = parse_error("", {"model.hidden_size=130"});
  EXPECT_HAS(m, "--set model.hidden_size=130");
  EXPECT_HAS(m, "not divisible");
  m = parse_error("", {"model.hidden_size=100"});  // 4 heads of 25: odd head size, blamed on the key that was set
  EXPECT_HAS(m, "--set model.hidden_size=100: model.hidden_size");
  EXPECT_HAS(m, "must be even");
  m = parse_error("", {"model.n_routed_experts=8", "model.n_group=3"});
  EXPECT_HAS(m, "--set model.n_group=3");
}

TEST(Config, ResolvedYamlReadsBack) {
  Config a = parse_config("model:\n  rope_theta: 500000\n  rms_norm_eps: 1.0e-5\noptimizer:\n  lr: 0.0007\n", "x.yaml",
                          {"checkpoint.resume=true", "logging.metrics_format=csv"});
  std::string yaml = to_yaml(a);
  Config b = parse_config(yaml, "resolved.yaml");
  auto body = [](const std::string& y) { return y.substr(y.find('\n')); };  // past the comment line
  EXPECT_EQ(body(to_yaml(b)), body(yaml));
  EXPECT_DOUBLE_EQ(b.optimizer.lr, 0.0007);
  EXPECT_EQ(b.checkpoint.resume, "true");
  EXPECT_EQ(b.run_dir(), "runs/x");
}

TEST(Config, LoadNamesTheFile) {
  auto dir = std::filesystem::temp_directory_path() / "flowmoe_test_config";
  std::filesystem::create_directories(dir);
  std::string path = (dir / "broken.yaml").string();
  std::ofstream(path) << "model:\n  vocab_size: 256\n\ntrain:\n  eval_every: -1\n";
  std::string m = config_error([&] { load_config(path); });
  EXPECT_HAS(m, path + ":5");
  EXPECT_HAS(m, "train.eval_every");
  m = config_error([&] { load_config((dir / "missing.yaml").string()); });
  EXPECT_HAS(m, "cannot open");
  std::filesystem::remove_all(dir);
}

TEST(Config, TrainingGuideDocumentsEveryKey) {
  std::ifstream in(std::string(FLOWMOE_SOURCE_DIR) + "/docs/TRAINING.md");
  ASSERT_TRUE(in.good()) << "docs/TRAINING.md is missing";
  std::stringstream ss;
  ss << in.rdbuf();
  std::string doc = ss.str(), line;
  std::istringstream ref(config_reference_markdown());
  int rows = 0;
  while (std::getline(ref, line))
    if (line.rfind("| `", 0) == 0) {
      ++rows;
      EXPECT_NE(doc.find(line), std::string::npos) << "docs/TRAINING.md lacks (or has an old version of):\n" << line;
    }
  EXPECT_GT(rows, 50);
}
