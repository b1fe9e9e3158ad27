// Config parsing: strict errors name the file, the line and the key; --set overrides are checked
// the same way; the shipped configs load; the resolved YAML reads back to the same config.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "config/config.h"
#include "kernels/common/error.h"

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
  EXPECT_EQ(c.data.source, DataSource::synthetic);
  EXPECT_EQ(c.run_dir(), "runs/empty");
  EXPECT_EQ(c.checkpoint_dir(), "runs/empty/checkpoints");
}

TEST(Config, ShippedConfigsLoad) {
  Config tiny = load_config(std::string(FLOWMOE_SOURCE_DIR) + "/configs/tiny.yaml");
  EXPECT_EQ(tiny.model.vocab_size, 256);
  EXPECT_EQ(tiny.train.device, DeviceChoice::automatic);
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
  m = parse_error("train:\n  steps: 10\noptimizer:\n  warmup_steps: 11\n");  // the boundary: 10 of 10 fits
  EXPECT_HAS(m, "optimizer.warmup_steps = 11 exceeds train.steps = 10");
  EXPECT_NO_THROW(parse_config("train:\n  steps: 10\noptimizer:\n  warmup_steps: 10\n", "ok.yaml"));
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
  EXPECT_HAS(m, "model.n_routed_experts: expected an integer in [0, 256], got 300");  // the router's limit
  // FP8 recipes need 128-wide blocks: a hidden size or expert width FP8 cannot serve is named.
  m = parse_error(
      "model:\n  n_routed_experts: 8\n  hidden_size: 192\n  num_attention_heads: 4\nprecision:\n  recipe: fp8_flow\n");
  EXPECT_HAS(m, "model.hidden_size");
  EXPECT_HAS(m, "not a multiple of 128");
  EXPECT_HAS(m, "fp8_flow");
  m = parse_error(
      "model:\n  n_routed_experts: 8\n  hidden_size: 256\n  moe_intermediate_size: 200\nprecision:\n  recipe: "
      "fp8_blockwise\n");
  EXPECT_HAS(m, "model.moe_intermediate_size");
}

TEST(Config, ExpertParallelismNeedsRoutedExperts) {
  // A dense model has no experts to share out; whether the size fits the launch is checked at start-up.
  std::string m = parse_error("parallel:\n  expert_parallel_size: 2\n");
  EXPECT_HAS(m, "bad.yaml:2: parallel.expert_parallel_size: 2 needs routed experts");
  EXPECT_HAS(m, "model.n_routed_experts (default) is 0: a dense model");
  m = parse_error("model:\n  n_routed_experts: 8\n", {"parallel.expert_parallel_size=4", "model.n_routed_experts=0"});
  EXPECT_HAS(m, "--set parallel.expert_parallel_size=4: parallel.expert_parallel_size: 4 needs routed experts");
  const Config c = parse_config("model:\n  n_routed_experts: 8\nparallel:\n  expert_parallel_size: 4\n", "ep.yaml");
  EXPECT_EQ(c.parallel.expert_parallel_size, 4);
  // 3 does not divide 8 experts, nor most launches: refused at start-up, with the launch's world size.
  EXPECT_EQ(parse_config("model:\n  n_routed_experts: 8\n", "ep.yaml", {"parallel.expert_parallel_size=3"})
                .parallel.expert_parallel_size,
            3);
}

TEST(Config, TheDataParallelSizeIsTheNumberOfProcesses) {
  // The removed key says what replaced it, in the file and as an override.
  for (const char* v : {"1", "2"}) {
    std::string m = parse_error(std::string("parallel:\n  data_parallel_size: ") + v + "\n");
    EXPECT_HAS(m, "bad.yaml:2");
    EXPECT_HAS(m, "parallel.data_parallel_size");
    EXPECT_HAS(m, "the data-parallel size is the number of launched processes");
  }
  const std::string set = parse_error("", {"parallel.data_parallel_size=2"});
  EXPECT_HAS(set, "--set parallel.data_parallel_size=2");
  EXPECT_HAS(set, "number of launched processes");
  for (const char* b : {"auto", "nccl", "mpi", "none"})
    EXPECT_STREQ(
        comm_backend_name(parse_config(std::string("parallel:\n  backend: ") + b + "\n", "ok.yaml").parallel.backend),
        b);
  std::string m = parse_error("parallel:\n  backend: gloo\n");
  EXPECT_HAS(m, "parallel.backend");
  EXPECT_HAS(m, "auto, nccl, mpi, none");
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

// The choice keys are held as enums: each takes every one of its names, in the order the messages list them, and
// the resolved config writes the same name back; another name is refused in one line naming the key and the names.
TEST(Config, ChoiceKeysTakeEachNameAndWriteItBack) {
  const std::string file = std::string(FLOWMOE_SOURCE_DIR) + "/configs/tiny.yaml";  // a file data.path may name
  const std::vector<std::pair<std::string, std::vector<std::string>>> keys = {
      {"model.scoring_func", {"sigmoid", "softmax"}},
      {"model.bias_update_schedule", {"constant", "lr"}},
      {"data.source", {"synthetic", "text", "tokens"}},
      {"data.synthetic_kind", {"words", "bigram"}},
      {"train.device", {"auto", "cpu", "cuda"}},
      {"train.nonfinite", {"skip", "stop"}},
      {"train.cuda_graph", {"auto", "on", "off"}},
      {"precision.param_dtype", {"auto", "f32"}},
      {"parallel.backend", {"auto", "nccl", "mpi", "none"}},
      {"parallel.ep_dispatch", {"auto", "sync", "zero_sync"}},
      {"parallel.shared_expert_overlap", {"auto", "on", "off"}},
      {"logging.metrics_format", {"jsonl", "csv"}},
      {"logging.progress", {"auto", "bar", "plain"}}};
  for (const auto& [key, names] : keys) {
    SCOPED_TRACE(key);
    const std::string name = key.substr(key.find('.') + 1);
    std::string listed;
    for (const std::string& v : names) {
      std::vector<std::string> sets = {key + "=" + v};
      if (key == "data.source" && v != "synthetic") sets.push_back("data.path=" + file);
      EXPECT_HAS(to_yaml(parse_config("", "ok.yaml", sets)), "\n  " + name + ": " + v + "\n");
      listed += (listed.empty() ? "" : ", ") + v;
    }
    const std::string m = parse_error("", {key + "=" + names.back() + "x"});
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    EXPECT_HAS(m, "--set " + key + "=" + names.back() + "x: " + key + ": expected one of " + listed + ", got '" +
                      names.back() + "x'");
  }
}

TEST(Config, SyntheticKindChoosesTheCorpus) {
  EXPECT_EQ(parse_config("", "ok.yaml").data.synthetic_kind, SyntheticKind::words);
  Config c = parse_config("data:\n  synthetic_kind: bigram\n", "ok.yaml");
  EXPECT_EQ(c.data.synthetic_kind, SyntheticKind::bigram);
  EXPECT_EQ(c.origin("data.synthetic_kind"), "ok.yaml:2");
  EXPECT_NE(to_yaml(c).find("synthetic_kind: bigram"), std::string::npos);
  c = parse_config("", "ok.yaml", {"data.synthetic_kind=bigram"});
  EXPECT_EQ(c.data.synthetic_kind, SyntheticKind::bigram);
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
  EXPECT_EQ(parse_config("", "ok.yaml").model.bias_update_schedule, BiasUpdateSchedule::constant);
  Config c = parse_config("model:\n  bias_update_schedule: lr\n", "ok.yaml");
  EXPECT_EQ(c.model.bias_update_schedule, BiasUpdateSchedule::lr);
  EXPECT_NE(to_yaml(c).find("bias_update_schedule: lr"), std::string::npos);
  std::string m = parse_error("model:\n  bias_update_rate: 0.01\n  bias_update_schedule: cosine\n");
  EXPECT_HAS(m, "bad.yaml:3");
  EXPECT_HAS(m, "model.bias_update_schedule");
  EXPECT_HAS(m, "one of constant, lr");
}

// Multi-token prediction: off by default, λ 0.3 (DeepSeek-V3's early value); D must leave its deepest module a
// target in the window, λ must not be negative.
TEST(Config, MultiTokenPredictionKeys) {
  const Config d = parse_config("", "ok.yaml");
  EXPECT_EQ(d.model.num_nextn_predict_layers, 0);
  EXPECT_EQ(d.train.mtp_loss_weight, 0.3);
  const Config c = parse_config("model:\n  num_nextn_predict_layers: 2\ntrain:\n  mtp_loss_weight: 0.1\n", "ok.yaml");
  EXPECT_EQ(c.model.num_nextn_predict_layers, 2);
  EXPECT_EQ(c.train.mtp_loss_weight, 0.1);
  EXPECT_HAS(to_yaml(c), "num_nextn_predict_layers: 2");
  EXPECT_EQ(parse_config(to_yaml(c), "resolved.yaml").model.num_nextn_predict_layers, 2);
  EXPECT_HAS(parse_error("model:\n  num_nextn_predict_layers: -1\n"), "model.num_nextn_predict_layers");
  EXPECT_HAS(parse_error("model:\n  num_nextn_predict_layers: 17\n"), "model.num_nextn_predict_layers");
  EXPECT_HAS(parse_error("train:\n  mtp_loss_weight: -0.1\n"), "train.mtp_loss_weight");
  const std::string m = parse_error("model:\n  num_nextn_predict_layers: 4\ndata:\n  seq_len: 4\n");
  EXPECT_HAS(m, "model.num_nextn_predict_layers = 4");
  EXPECT_HAS(m, "data.seq_len = 4");
  EXPECT_NO_THROW(parse_config("model:\n  num_nextn_predict_layers: 3\ndata:\n  seq_len: 4\n", "ok.yaml"));
}

TEST(Config, BiasUpdateRuleIsSignOrProportional) {
  EXPECT_EQ(parse_config("", "ok.yaml").model.bias_update_rule, BiasUpdateRule::sign);
  EXPECT_EQ(parse_config("model:\n  bias_update_rule: proportional\n", "ok.yaml").model.bias_update_rule,
            BiasUpdateRule::proportional);
  EXPECT_HAS(parse_error("model:\n  bias_update_rule: linear\n"),
             "bad.yaml:2: model.bias_update_rule: expected one of sign, proportional, got 'linear'");
}

// optimizer.moment_dtype: parsed once into a DType, f32 by default; anything but f32 or bf16 is refused in one
// line naming the file and line (or the --set), the key and the allowed values; the resolved YAML reads back.
TEST(Config, MomentDtypeIsF32OrBf16) {
  EXPECT_EQ(parse_config("", "ok.yaml").optimizer.moment_dtype, DType::f32);
  Config c = parse_config("optimizer:\n  moment_dtype: bf16\n", "ok.yaml");
  EXPECT_EQ(c.optimizer.moment_dtype, DType::bf16);
  EXPECT_HAS(to_yaml(c), "  moment_dtype: bf16\n");
  EXPECT_EQ(parse_config(to_yaml(c), "resolved.yaml").optimizer.moment_dtype, DType::bf16);
  EXPECT_EQ(parse_config("", "ok.yaml", {"optimizer.moment_dtype=bf16"}).optimizer.moment_dtype, DType::bf16);
  for (const char* bad : {"f16", "e4m3", "f64", "BF16", "\"\""}) {
    const std::string m = parse_error(std::string("optimizer:\n  moment_dtype: ") + bad + "\n");
    EXPECT_HAS(m, "bad.yaml:2: optimizer.moment_dtype: expected one of f32, bf16, got '");
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  EXPECT_HAS(parse_error("optimizer:\n  moment_dtype: bf61\n"), "(did you mean 'bf16'?)");
  EXPECT_HAS(parse_error("", {"optimizer.moment_dtype=fp16"}),
             "--set optimizer.moment_dtype=fp16: optimizer.moment_dtype: expected one of f32, bf16");
}

// precision.fp8_weights parses once into Fp8WeightWriter; optimizer by default, and taken under bf16 too (no FP8
// weights there, so it changes nothing).
TEST(Config, Fp8WeightsIsForwardOrOptimizer) {
  EXPECT_EQ(parse_config("", "ok.yaml").precision.fp8_weights, Fp8WeightWriter::optimizer);
  Config c = parse_config("precision:\n  fp8_weights: forward\n", "ok.yaml");  // under bf16
  EXPECT_EQ(c.precision.fp8_weights, Fp8WeightWriter::forward);
  EXPECT_HAS(to_yaml(c), "  fp8_weights: forward\n");
  EXPECT_EQ(parse_config(to_yaml(c), "resolved.yaml").precision.fp8_weights, Fp8WeightWriter::forward);
  EXPECT_EQ(parse_config("", "ok.yaml", {"precision.fp8_weights=optimizer"}).precision.fp8_weights,
            Fp8WeightWriter::optimizer);
  EXPECT_EQ(parse_config("", "ok.yaml", {"precision.fp8_weights=forward"}).precision.fp8_weights,
            Fp8WeightWriter::forward);
  for (const char* bad : {"adamw", "Forward", "true", "\"\""}) {
    const std::string m = parse_error(std::string("precision:\n  fp8_weights: ") + bad + "\n");
    EXPECT_HAS(m, "bad.yaml:2: precision.fp8_weights: expected one of forward, optimizer, got '");
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  EXPECT_HAS(parse_error("precision:\n  fp8_weights: optimiser\n"), "(did you mean 'optimizer'?)");
  EXPECT_HAS(parse_error("", {"precision.fp8_weights=both"}),
             "--set precision.fp8_weights=both: precision.fp8_weights: expected one of forward, optimizer");
}

// precision.fp8_weight_transpose parses once into Fp8WeightTranspose; stored by default.
TEST(Config, Fp8WeightTransposeIsStoredOrRebuilt) {
  EXPECT_EQ(parse_config("", "ok.yaml").precision.fp8_weight_transpose, Fp8WeightTranspose::stored);
  Config c = parse_config("precision:\n  recipe: fp8_full\n  fp8_weight_transpose: rebuilt\n", "ok.yaml");
  EXPECT_EQ(c.precision.fp8_weight_transpose, Fp8WeightTranspose::rebuilt);
  EXPECT_HAS(to_yaml(c), "  fp8_weight_transpose: rebuilt\n");
  EXPECT_EQ(parse_config(to_yaml(c), "resolved.yaml").precision.fp8_weight_transpose, Fp8WeightTranspose::rebuilt);
  EXPECT_EQ(parse_config("", "ok.yaml", {"precision.fp8_weight_transpose=stored"}).precision.fp8_weight_transpose,
            Fp8WeightTranspose::stored);
  const std::string m = parse_error("precision:\n  fp8_weight_transpose: rebuild\n");
  EXPECT_HAS(m, "bad.yaml:2: precision.fp8_weight_transpose: expected one of stored, rebuilt, got 'rebuild'");
  EXPECT_HAS(m, "(did you mean 'rebuilt'?)");
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
}

TEST(Config, SetOverridesAreValidatedTheSameWay) {
  Config c = parse_config("train:\n  steps: 50\n", "base.yaml",
                          {"train.steps=7", "optimizer.lr=1e-4", "optimizer.min_lr=0", "optimizer.warmup_steps=2"});
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

// Strings may hold line breaks, tabs, quotes and other control characters (a YAML block scalar or
// escapes); the resolved YAML must keep them.
TEST(Config, ResolvedYamlKeepsControlCharactersInStrings) {
  Config a =
      parse_config("logging:\n  out_dir: |\n    runs/a\n    b\ncheckpoint:\n  dir: \"c\\td\\x01\\\"q\\\\e\\r\"\n",
                   "x.yaml", {"checkpoint.resume=r\x7f"});
  EXPECT_EQ(a.logging.out_dir, "runs/a\nb\n");
  EXPECT_EQ(a.checkpoint.dir, "c\td\x01\"q\\e\r");
  Config b = parse_config(to_yaml(a), "resolved.yaml");
  EXPECT_EQ(b.logging.out_dir, a.logging.out_dir);
  EXPECT_EQ(b.checkpoint.dir, a.checkpoint.dir);
  EXPECT_EQ(b.checkpoint.resume, "r\x7f");
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

// A path that holds no config is an error, not a run of every default: a directory, an empty file,
// one of only comments or whitespace, a null document, or /dev/null (not a regular file).
TEST(Config, LoadRefusesDirectoriesAndEmptyFiles) {
  auto dir = std::filesystem::temp_directory_path() / "flowmoe_test_config_empty";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "configs");
  const std::string d = (dir / "configs").string();
  EXPECT_HAS(config_error([&] { load_config(d); }), "'" + d + "' is a directory");
  const std::vector<std::pair<std::string, std::string>> empties = {
      {"empty.yaml", ""},   {"blank.yaml", "\n   \n\t\n"}, {"comments.yaml", "# only a comment\n  # and another\n"},
      {"null.yaml", "~\n"}, {"null_word.yaml", "null\n"},  {"separator.yaml", "---\n# nothing\n"}};
  for (const auto& [name, text] : empties) {
    const std::string path = (dir / name).string();
    std::ofstream(path) << text;
    std::string m = config_error([&] { load_config(path); });
    EXPECT_HAS(m, "'" + path + "' is empty");
    m = config_error([&] { load_config(path, {"train.steps=30"}); });  // overrides do not make it a config
    EXPECT_HAS(m, "'" + path + "' is empty");
  }
  if (std::filesystem::exists("/dev/null")) {
    EXPECT_HAS(config_error([] { load_config("/dev/null"); }),
               "config file '/dev/null' is a character device, not a regular file");
  }
  // A top level that is not a mapping names the file and its line.
  const std::string scalar = (dir / "scalar.yaml").string(), list = (dir / "list.yaml").string();
  std::ofstream(scalar) << "# a comment first\nmodel hidden_size 64\n";
  std::ofstream(list) << "- model\n- train\n";
  std::string m = config_error([&] { load_config(scalar); });
  EXPECT_HAS(m, scalar + ":2");
  EXPECT_HAS(m, "top level must be a mapping");
  EXPECT_HAS(config_error([&] { load_config(list); }), list + ":1");
  // In code, parse_config("") stays the way to get every default.
  EXPECT_EQ(parse_config("", "defaults").train.steps, Config().train.steps);
  std::filesystem::remove_all(dir);
}

TEST(Config, SecondYamlDocumentIsRefused) {
  std::string m = parse_error("model:\n  hidden_size: 64\n---\ntrain:\n  steps: 30\n");
  EXPECT_HAS(m, "bad.yaml:4");
  EXPECT_HAS(m, "a second YAML document");
  Config c = parse_config("model:\n  hidden_size: 64\n...\n", "ok.yaml");  // an end marker alone is fine
  EXPECT_EQ(c.model.hidden_size, 64);
}

// yaml-cpp stops without an error at a token no document starts with, as if the file were empty;
// such a file must not train every default.
TEST(Config, TextTheYamlParserCannotStartIsASyntaxError) {
  std::string m = parse_error("# a comment\n, model:\n  hidden_size: 64\n");
  EXPECT_HAS(m, "bad.yaml:2:1: YAML syntax error: cannot parse ',' here");
  m = parse_error("model:\n  hidden_size: 64\n---\n,\n");
  EXPECT_HAS(m, "bad.yaml:4:1: YAML syntax error");
}

// FP8 changes only the routed experts' GEMMs: a model without MoE layers would run bf16 under an FP8
// name, so the recipe is refused at its line, naming what it applies to and where the other key was set.
TEST(Config, Fp8RecipesNeedMoeLayers) {
  std::string m = parse_error("model:\n  hidden_size: 128\nprecision:\n  recipe: fp8_flow\n");
  EXPECT_HAS(m, "bad.yaml:4: precision.recipe: fp8_flow applies only to the routed experts' GEMMs of MoE layers");
  EXPECT_HAS(m, "model.n_routed_experts = 0");
  EXPECT_HAS(m, "(model.n_routed_experts: default)");
  const std::string moe =
      "model:\n  hidden_size: 128\n  num_hidden_layers: 2\n  n_routed_experts: 8\n  moe_intermediate_size: 128\n"
      "  first_k_dense_replace: 2\nprecision:\n  recipe: fp8_blockwise\n";
  m = parse_error(moe);
  EXPECT_HAS(m, "bad.yaml:8: precision.recipe: fp8_blockwise applies only to the routed experts' GEMMs");
  EXPECT_HAS(m, "model.first_k_dense_replace = 2 keeps all model.num_hidden_layers = 2 blocks dense");
  EXPECT_HAS(m, "model.first_k_dense_replace: bad.yaml:6");
  // A --set is blamed over the file line it conflicts with.
  m = parse_error(moe, {"model.first_k_dense_replace=1", "model.n_routed_experts=0"});
  EXPECT_HAS(m, "--set model.n_routed_experts=0: model.n_routed_experts: fp8_blockwise applies only");
  EXPECT_HAS(m, "(precision.recipe: bad.yaml:8)");
  // The missing MoE layers come first, before any width check.
  m = parse_error("model:\n  hidden_size: 192\n  num_attention_heads: 4\nprecision:\n  recipe: fp8_flow\n");
  EXPECT_HAS(m, "precision.recipe");
  EXPECT_HAS(m, "n_routed_experts = 0");
  m = parse_error(moe, {"model.first_k_dense_replace=1", "model.moe_intermediate_size=192"});
  EXPECT_HAS(m, "--set model.moe_intermediate_size=192: model.moe_intermediate_size: 192 is not a multiple of 128");
  EXPECT_HAS(m, "precision.recipe (bad.yaml:8) = fp8_blockwise");
  for (const char* recipe : {"fp8_blockwise", "fp8_flow", "fp8_full"}) {
    Config c =
        parse_config(moe, "ok.yaml", {"model.first_k_dense_replace=1", std::string("precision.recipe=") + recipe});
    EXPECT_STREQ(moe_recipe_name(c.precision.recipe), recipe);
  }
  EXPECT_EQ(parse_config(moe, "ok.yaml", {"precision.recipe=bf16"}).model.first_k_dense_replace, 2);
}

// fp8_full runs the dense linears in FP8 too: a dense model takes it, and a width or a sequence length its FP8
// GEMMs cannot take is refused at its key, naming the value and the recipe's line; a width no FP8 GEMM of the
// model reads is not checked.
TEST(Config, Fp8FullChecksEveryFp8Linear) {
  const std::string dense =
      "model:\n  hidden_size: 128\n  intermediate_size: 384\ndata:\n  seq_len: 64\nprecision:\n  recipe: fp8_full\n";
  EXPECT_EQ(parse_config(dense, "ok.yaml").precision.recipe, MoeRecipe::fp8_full);
  std::string m = parse_error(dense, {"model.intermediate_size=200"});
  EXPECT_HAS(m, "--set model.intermediate_size=200: model.intermediate_size: 200 is not a multiple of 128");
  EXPECT_HAS(m, "precision.recipe (bad.yaml:7) = fp8_full needs: it runs the dense MLPs' GEMMs");
  m = parse_error(dense, {"data.seq_len=100"});
  EXPECT_HAS(m,
             "--set data.seq_len=100: data.seq_len: 100 is not a multiple of 16, which precision.recipe (bad.yaml:7)");
  m = parse_error("model:\n  hidden_size: 192\n  num_attention_heads: 4\nprecision:\n  recipe: fp8_full\n");
  EXPECT_HAS(m, "bad.yaml:2: model.hidden_size: 192 is not a multiple of 128");
  EXPECT_HAS(m, "every linear but the routers and the LM head");
  // All blocks MoE: intermediate_size serves no block; the experts' width does.
  const std::string moe =
      "model:\n  hidden_size: 128\n  intermediate_size: 200\n  n_routed_experts: 8\n  moe_intermediate_size: 128\n"
      "data:\n  seq_len: 32\nprecision:\n  recipe: fp8_full\n";
  EXPECT_EQ(parse_config(moe, "ok.yaml").model.intermediate_size, 200);
  m = parse_error(moe, {"model.moe_intermediate_size=192"});
  EXPECT_HAS(m, "model.moe_intermediate_size: 192 is not a multiple of 128");
  m = parse_error(moe, {"model.first_k_dense_replace=1"});
  EXPECT_HAS(m, "model.intermediate_size: 200 is not a multiple of 128");
  // The other FP8 recipes run no dense FP8 GEMM: neither key binds them.
  for (const char* recipe : {"fp8_blockwise", "fp8_flow"})
    EXPECT_EQ(parse_config(moe, "ok.yaml", {std::string("precision.recipe=") + recipe, "data.seq_len=40"}).data.seq_len,
              40);
}

// Products of sizes at the top of their ranges are checked without overflowing int64.
TEST(Config, ActivationsPastInt64AreRefused) {
  const std::string big =
      "model:\n  hidden_size: 128\n  max_position_embeddings: 1048576\n  n_routed_experts: 16\n"
      "  num_experts_per_tok: 16\n  moe_intermediate_size: 1048576\n  n_shared_experts: 0\n"
      "data:\n  seq_len: 1048576\n  synthetic_tokens: 1073741824\ntrain:\n  batch_size: 1048576\n";
  std::string m = parse_error(big);
  EXPECT_HAS(m,
             "routed-expert activations would hold train.batch_size 1048576 x data.seq_len 1048576 x "
             "model.num_experts_per_tok 16 x 2 x model.moe_intermediate_size 1048576 elements, more than 2^60");
  m = parse_error(big,
                  {"model.num_experts_per_tok=1", "model.moe_intermediate_size=524288", "model.n_shared_experts=64"});
  EXPECT_HAS(m, "--set model.n_shared_experts=64: model.n_shared_experts: one micro-batch's shared-expert activations");
  // Just inside the limit: 2^20 x 2^20 x 1 x 2 x 2^19 = 2^60 elements.
  Config c = parse_config(big, "ok.yaml", {"model.num_experts_per_tok=1", "model.moe_intermediate_size=524288"});
  EXPECT_EQ(c.model.moe_intermediate_size, 524288);
}

// A conflict with a key left at its default is reported where the user set the other key: the
// message names the file and line, never just "default".
TEST(Config, ConflictsWithDefaultsNameTheKeyThatWasSet) {
  std::string m = parse_error("model:\n  n_routed_experts: 1\n");
  EXPECT_HAS(m, "bad.yaml:2: model.n_routed_experts: model.num_experts_per_tok = 2 exceeds model.n_routed_experts = 1");
  m = parse_error("model:\n  n_routed_experts: 8\n  n_group: 8\n");  // top-2 of one kept group of 1 expert
  EXPECT_HAS(m, "bad.yaml:3: model.n_group:");
  EXPECT_HAS(m, "kept groups");
  m = parse_error("model:\n  max_position_embeddings: 1048576\ndata:\n  seq_len: 1000000\n");
  EXPECT_HAS(m, "bad.yaml:4: data.seq_len: data.synthetic_tokens = 1048576 tokens are too few");
  m = parse_error("data:\n  val_fraction: 0.0001\n");
  EXPECT_HAS(m, "bad.yaml:2: data.val_fraction:");
}

// Bounded receive buffers belong to the zero-sync exchange: with the sync one they are refused, naming both keys.
TEST(Config, CapacityFactorNeedsTheZeroSyncExchange) {
  const std::string m = parse_error("parallel:\n  ep_dispatch: sync\n  ep_capacity_factor: 1.5\n");
  EXPECT_HAS(m, "parallel.ep_capacity_factor");
  EXPECT_HAS(m, "parallel.ep_dispatch");
  EXPECT_HAS(m, "zero-sync exchange's receive buffers");
  EXPECT_NO_THROW(parse_config("parallel:\n  ep_dispatch: zero_sync\n  ep_capacity_factor: 1.5\n", "ok.yaml"));
}

// parallel.timeout_s: the collectives' watchdog (parallel/watchdog.h), on by default, 0 turns it off.
TEST(Config, CollectiveTimeoutIsSecondsFromZero) {
  EXPECT_EQ(parse_config("", "ok.yaml").parallel.timeout_s, 600.0);
  Config c = parse_config("parallel:\n  timeout_s: 0\n", "ok.yaml");
  EXPECT_EQ(c.parallel.timeout_s, 0.0);
  EXPECT_NE(to_yaml(c).find("timeout_s: 0"), std::string::npos);
  EXPECT_EQ(parse_config("", "ok.yaml", {"parallel.timeout_s=2.5"}).parallel.timeout_s, 2.5);
  const std::string m = parse_error("parallel:\n  timeout_s: -1\n");
  EXPECT_HAS(m, "bad.yaml:2");
  EXPECT_HAS(m, "parallel.timeout_s");
  EXPECT_HAS(m, "[0, 604800]");
  EXPECT_HAS(parse_error("parallel:\n  timeout_s: forever\n"), "parallel.timeout_s");
}

TEST(Config, SampleEveryIsStepsFromZero) {
  EXPECT_EQ(parse_config("", "ok.yaml").train.sample_every, 0) << "off by default";
  Config c = parse_config("train:\n  sample_every: 50\n", "ok.yaml");
  EXPECT_EQ(c.train.sample_every, 50);
  EXPECT_NE(to_yaml(c).find("sample_every: 50"), std::string::npos);
  EXPECT_EQ(parse_config("", "ok.yaml", {"train.sample_every=7"}).train.sample_every, 7);
  const std::string m = parse_error("train:\n  sample_every: -1\n");
  EXPECT_HAS(m, "bad.yaml:2");
  EXPECT_HAS(m, "train.sample_every");
  EXPECT_HAS(parse_error("train:\n  sample_every: 2.5\n"), "train.sample_every");
  EXPECT_HAS(parse_error("", {"train.sample_every=often"}), "train.sample_every");
}

// checkpoint.init_from: empty, or hf: and a folder (tests/test_hf_roundtrip.cpp trains from one).
TEST(Config, InitFromIsAHuggingFaceFolder) {
  EXPECT_EQ(parse_config("", "ok.yaml").checkpoint.init_from, "");
  EXPECT_EQ(parse_config("checkpoint:\n  init_from: hf:models/x\n", "ok.yaml").checkpoint.init_from, "hf:models/x");
  for (const char* bad : {"models/x", "hf:", "gguf:x"}) {
    const std::string m = parse_error(std::string("checkpoint:\n  init_from: '") + bad + "'\n");
    EXPECT_HAS(m, "bad.yaml:2");
    EXPECT_HAS(m, "checkpoint.init_from: '" + std::string(bad) + "' is not hf:DIR");
  }
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

// model.attention_kernel is parsed once into its enum (auto by default); cudnn in a build without the cuDNN backend
// is a ConfigError naming the key and its line, and auto and flash read in every build. A checkpoint's config asking
// for cudnn reads anywhere (export and generate run from it on a build without cuDNN).
TEST(Config, AttentionKernelKey) {
  EXPECT_EQ(parse_config("", "ok.yaml").model.attention_kernel, AttentionBackend::automatic);
  Config c = parse_config("model:\n  attention_kernel: flash\n", "ok.yaml");
  EXPECT_EQ(c.model.attention_kernel, AttentionBackend::flash);
  EXPECT_HAS(to_yaml(c), "attention_kernel: flash");
  EXPECT_EQ(parse_config(to_yaml(c), "again.yaml").model.attention_kernel, AttentionBackend::flash);
  EXPECT_EQ(parse_config("", "ok.yaml", {"model.attention_kernel=auto"}).model.attention_kernel,
            AttentionBackend::automatic);
  EXPECT_HAS(parse_error("model:\n  attention_kernel: cudn\n"),
             "bad.yaml:2: model.attention_kernel: expected one of auto, flash, cudnn, got 'cudn' (did you mean "
             "'cudnn'?)");
  if (attention_cudnn_built()) {
    EXPECT_EQ(parse_config("model:\n  attention_kernel: cudnn\n", "ok.yaml").model.attention_kernel,
              AttentionBackend::cudnn);
  } else {
    const std::string m = parse_error("model:\n  attention_kernel: cudnn\n");
    EXPECT_HAS(m, "bad.yaml:2: model.attention_kernel: cudnn, but this build has no cuDNN attention backend");
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    EXPECT_HAS(parse_error("", {"model.attention_kernel=cudnn"}),
               "--set model.attention_kernel=cudnn: model.attention_kernel: cudnn, but this build has no cuDNN");
  }
  EXPECT_EQ(parse_checkpoint_config("model:\n  attention_kernel: cudnn\n", "meta.json").model.attention_kernel,
            AttentionBackend::cudnn);
}

// model.attention is parsed once into its enum; MLA's keys take DeepSeek-V3's names, q_lora_rank null.
TEST(Config, MlaKeys) {
  Config c = parse_config(
      "model:\n  attention: mla\n  q_lora_rank: null\n  kv_lora_rank: 24\n  qk_nope_head_dim: 8\n"
      "  qk_rope_head_dim: 4\n  v_head_dim: 6\n",
      "ok.yaml");
  EXPECT_EQ(c.model.attention, AttentionType::mla);
  EXPECT_EQ(c.model.q_lora_rank, 0);
  EXPECT_EQ(c.model.kv_lora_rank, 24);
  EXPECT_EQ(attention_qk_head_dim(c.model), 12);
  EXPECT_EQ(attention_v_head_dim(c.model), 6);
  EXPECT_HAS(to_yaml(c), "q_lora_rank: null");
  EXPECT_HAS(to_yaml(c), "attention: mla");
  EXPECT_EQ(parse_config(to_yaml(c), "again.yaml").model.q_lora_rank, 0);  // the resolved config reads back
  c = parse_config("", "ok.yaml", {"model.attention=mla", "model.q_lora_rank=32"});
  EXPECT_EQ(c.model.q_lora_rank, 32);
  EXPECT_EQ(parse_config("", "ok.yaml").model.attention, AttentionType::mha);
  EXPECT_EQ(attention_qk_head_dim(parse_config("", "ok.yaml").model), 128 / 4);

  std::string m = parse_error("model:\n  attention: mlaa\n");
  EXPECT_HAS(m, "bad.yaml:2: model.attention: expected one of mha, mla, got 'mlaa' (did you mean 'mla'?)");
  m = parse_error("model:\n  q_lora_rank: -3\n");
  EXPECT_HAS(m, "model.q_lora_rank: expected null or an integer in [1, 65536], got -3");
  m = parse_error("model:\n  attention: mla\n  qk_rope_head_dim: 5\n");
  EXPECT_HAS(m, "bad.yaml:3: model.qk_rope_head_dim: 5 must be even");
  // Under mla the heads need not divide hidden_size.
  EXPECT_NO_THROW(parse_config("model:\n  attention: mla\n  num_attention_heads: 3\n", "ok.yaml"));
  // The CUDA kernels' head widths: one up to 128, or query/key heads up to 192 (multiples of 8; DeepSeek-V3's
  // 128 + 64) with value heads up to 128; train.device: cpu takes any.
  const std::string mla_cuda = "model:\n  attention: mla\ntrain:\n  device: cuda\n";
  EXPECT_NO_THROW(parse_config(mla_cuda, "ok.yaml",
                               {"model.qk_nope_head_dim=128", "model.qk_rope_head_dim=64", "model.v_head_dim=128"}));
  EXPECT_NO_THROW(parse_config(mla_cuda, "ok.yaml",
                               {"model.qk_nope_head_dim=120", "model.qk_rope_head_dim=16", "model.v_head_dim=100"}));
  m = parse_error(mla_cuda, {"model.qk_nope_head_dim=136", "model.qk_rope_head_dim=64"});
  EXPECT_HAS(m, "model.qk_nope_head_dim + model.qk_rope_head_dim = 200 exceeds the CUDA attention kernels' 192");
  m = parse_error(mla_cuda, {"model.qk_nope_head_dim=122", "model.qk_rope_head_dim=16"});
  EXPECT_HAS(m, "model.qk_nope_head_dim + model.qk_rope_head_dim = 138 is past 128 and not a multiple of 8");
  m = parse_error(mla_cuda, {"model.qk_nope_head_dim=128", "model.qk_rope_head_dim=64", "model.v_head_dim=192"});
  EXPECT_HAS(m,
             "model.v_head_dim = 192 exceeds 128, the widest value head the CUDA attention kernels take beside a "
             "query/key head past 128 (here 192;");
  EXPECT_NO_THROW(
      parse_config("model:\n  attention: mla\n  qk_nope_head_dim: 136\n  qk_rope_head_dim: 64\n"
                   "  v_head_dim: 192\ntrain:\n  device: cpu\n",
                   "ok.yaml"));
  m = parse_error("model:\n  attention: mla\n  v_head_dim: 64\ntrain:\n  device: cuda\n");
  EXPECT_HAS(m, "model.v_head_dim = 64 exceeds the query/key head 48");
  // fp8_full: the MLA GEMMs' widths, by their keys.
  const std::string fp8 =
      "model:\n  hidden_size: 256\n  attention: mla\n  num_attention_heads: 4\n  q_lora_rank: 128\n"
      "  kv_lora_rank: 128\n  qk_nope_head_dim: 32\n  qk_rope_head_dim: 32\n  v_head_dim: 32\n"
      "  intermediate_size: 256\nprecision:\n  recipe: fp8_full\n";
  EXPECT_NO_THROW(parse_config(fp8, "ok.yaml"));
  m = parse_error(fp8, {"model.kv_lora_rank=96"});
  EXPECT_HAS(m, "model.kv_lora_rank: 96 is not a multiple of 128");
  m = parse_error(fp8, {"model.v_head_dim=16"});
  EXPECT_HAS(m, "model.num_attention_heads x (qk_nope_head_dim + v_head_dim) = 192 is not a multiple of 128");
}
