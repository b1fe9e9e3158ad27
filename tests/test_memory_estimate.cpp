// The memory estimate: the parameter count from the config equals the built model's, the estimate
// stays within a stated factor of the measured CPU peak (dense, MoE and FP8 MoE runs, and an
// evaluation), and a model that cannot fit is refused by train() at once, before any allocation.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <limits>

#include "engine/allocator.h"
#include "kernels/common/error.h"
#include "parallel/grad_reducer.h"
#include "tests/support/train_fixtures.h"
#include "train/evaluation.h"
#include "train/memory_estimate.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

// The estimate is meant as an upper bound of the peak (its terms never all coexist) and close to
// it; the lower factor leaves room for what it does not model (the CUDA allocator hands out cached
// blocks up to 1/8 larger than asked). An evaluation keeps no graph and frees a block's tensors as
// soon as they are used, so counting all of one block's is looser there.
constexpr double kMinRatio = 0.9, kMaxRatio = 1.5, kMaxEvalRatio = 2.0;

Config run_config(const std::string& model_yaml, const fs::path& out_dir, const std::vector<std::string>& sets = {}) {
  Config c = parse_config("model: {" + model_yaml +
                              "}\n"
                              "data: {seq_len: 64, synthetic_tokens: 20000, val_fraction: 0.1}\n"
                              "train: {device: cpu, steps: 10, batch_size: 8, eval_every: 0, eval_batches: 1}\n"
                              "optimizer: {warmup_steps: 1}\n",
                          "memory_test.yaml", sets);
  c.logging.out_dir = out_dir.string();
  return c;
}

const char* kDense =
    "vocab_size: 256, hidden_size: 128, num_hidden_layers: 2, num_attention_heads: 4, intermediate_size: 384,"
    " max_position_embeddings: 64";
// Three blocks, the first dense; 8 experts of width 64, top-2, one shared expert.
const char* kMoe =
    "vocab_size: 128, hidden_size: 64, num_hidden_layers: 3, num_attention_heads: 4, intermediate_size: 128,"
    " max_position_embeddings: 64, n_routed_experts: 8, num_experts_per_tok: 2, moe_intermediate_size: 64,"
    " n_shared_experts: 1, first_k_dense_replace: 1";
// FP8 blocks are 128 wide; tied embeddings, no shared expert.
const char* kFp8Moe =
    "vocab_size: 128, hidden_size: 128, num_hidden_layers: 2, num_attention_heads: 4, intermediate_size: 128,"
    " max_position_embeddings: 64, n_routed_experts: 4, num_experts_per_tok: 2, moe_intermediate_size: 128,"
    " n_shared_experts: 0, tie_word_embeddings: true";

// Multi-head latent attention with a query bottleneck and heads of three widths.
const std::vector<std::string> kMla = {"model.attention=mla",       "model.q_lora_rank=48",     "model.kv_lora_rank=32",
                                       "model.qk_nope_head_dim=24", "model.qk_rope_head_dim=8", "model.v_head_dim=16"};

// The peak memory of two training steps of cfg on its device, from a clean peak.
double measured_training_peak(const Config& cfg, Device device) {
  TrainOptions o = quiet();
  o.stop_after = 2;
  reset_peak_memory(device);
  const size_t live_before = memory_stats(device).live_bytes;
  train(cfg, o);
  return double(memory_stats(device).peak_bytes - live_before);
}

void expect_estimate_near_peak(const Config& cfg, const char* what) {
  const Device device = resolve_device(cfg);
  const MemoryEstimate e = estimate_memory(cfg, device);
  const double peak = measured_training_peak(cfg, device);
  const double ratio = e.total_bytes() / peak;
  std::printf("%s: estimate %s, measured peak %s, ratio %.2f\n", what, e.summary().c_str(), format_bytes(peak).c_str(),
              ratio);
  EXPECT_GE(ratio, kMinRatio) << what << ": the estimate " << e.summary() << " is under the peak "
                              << format_bytes(peak);
  EXPECT_LE(ratio, kMaxRatio) << what << ": the estimate " << e.summary() << " is far over the peak "
                              << format_bytes(peak);
}

}  // namespace

TEST(MemoryEstimate, ParameterCountMatchesTheBuiltModel) {
  const fs::path d = fresh_dir("memory_count");
  const std::vector<std::pair<const char*, std::vector<std::string>>> variants = {
      {kDense, {}},
      {kDense, {"model.tie_word_embeddings=true"}},
      {kMoe, {}},  // shared experts, first block dense
      {kMoe, {"model.n_shared_experts=2", "model.first_k_dense_replace=0"}},
      {kMoe, {"model.n_shared_experts=0", "model.tie_word_embeddings=true"}},
      {kMoe, {"model.first_k_dense_replace=3"}},  // every block dense although experts are configured
      {kFp8Moe, {"precision.recipe=fp8_flow"}},
      {kDense, {"model.num_nextn_predict_layers=2"}},  // MTP modules: dense, then MoE, then dense after MoE layers
      {kMoe, {"model.num_nextn_predict_layers=1"}},
      {kMoe, {"model.num_nextn_predict_layers=2", "model.first_k_dense_replace=3"}},
      {kMoe, kMla},  // MLA (layers/mla.h): the q bottleneck, its norm, the latent's projections and norm
      {kMoe, {"model.attention=mla", "model.q_lora_rank=null", "model.num_nextn_predict_layers=1"}},
  };
  for (const auto& [yaml, sets] : variants) {
    const Config c = run_config(yaml, d, sets);
    Transformer model(c.model, Device::cpu(), DType::f32, 1, moe_options(c));
    std::string name = yaml;
    for (const std::string& s : sets) name += " " + s;
    EXPECT_EQ(count_parameters(c.model), model.num_parameters()) << name;
    EXPECT_EQ(estimate_memory(c, Device::cpu()).num_parameters, model.num_parameters()) << name;
  }
  fs::remove_all(d);
}

TEST(MemoryEstimate, AbsurdSizesCountWithoutOverflow) {
  // hidden 65536 x 1024 layers: 1.76e13 parameters, exact; the bytes reach hundreds of TiB.
  ModelConfig m;
  m.vocab_size = 256;
  m.hidden_size = 65536;
  m.num_attention_heads = 1;
  m.num_hidden_layers = 1024;
  m.intermediate_size = 384;
  const int64_t H = m.hidden_size, L = m.num_hidden_layers, V = m.vocab_size, I = m.intermediate_size;
  EXPECT_EQ(count_parameters(m), 2 * V * H + L * (4 * H * H + 3 * H * I + 2 * H) + H);
  // Wider than any validated config: the count saturates instead of wrapping around.
  m.hidden_size = int64_t(1) << 40;
  EXPECT_EQ(count_parameters(m), std::numeric_limits<int64_t>::max());
}

TEST(MemoryEstimate, DenseTrainingIsNearTheMeasuredPeak) {
  const fs::path d = fresh_dir("memory_dense");
  expect_estimate_near_peak(run_config(kDense, d / "run"), "dense");
  fs::remove_all(d);
}

// train.recompute attention: each block keeps 3 of its attention half's 8 [N, H] tensors, and its backward
// holds one block's again; the estimate stays near the measured peak, which falls (a wide, long-sequence
// model, so that attention's tensors dominate).
TEST(MemoryEstimate, AttentionRecomputeKeepsLessAndStaysNearThePeak) {
  const fs::path d = fresh_dir("memory_recompute");
  const std::vector<std::string> wide = {"model.hidden_size=256", "model.num_hidden_layers=4", "data.seq_len=64"};
  std::vector<std::string> recompute = wide;
  recompute.push_back("train.recompute=[attention]");
  const Config plain = run_config(kDense, d / "plain", wide), less = run_config(kDense, d / "less", recompute);
  const double tokens = 8 * 64, H = 256, L = 4;
  const double kept =
      estimate_memory(plain, Device::cpu()).activation_bytes - estimate_memory(less, Device::cpu()).activation_bytes;
  // 5 N H f32 per block, less what one block's recompute holds again beyond the logits' gradient (N V).
  EXPECT_NEAR(kept, 4 * (5 * L * tokens * H - std::max(0.0, 5 * tokens * H - tokens * 256)), 0.02 * kept);
  EXPECT_EQ(estimate_memory(less, Device::cpu(), MemoryUse::eval).activation_bytes,
            estimate_memory(plain, Device::cpu(), MemoryUse::eval).activation_bytes);
  expect_estimate_near_peak(less, "dense, attention recomputed");
  EXPECT_LT(measured_training_peak(less, Device::cpu()), measured_training_peak(plain, Device::cpu()));
  fs::remove_all(d);
}

TEST(MemoryEstimate, AccumulatedTrainingIsNearTheMeasuredPeak) {
  // Gradients outweigh the activations, and the second micro-batch adds to the held ones.
  const fs::path d = fresh_dir("memory_accum");
  expect_estimate_near_peak(
      run_config(kDense, d / "run",
                 {"model.vocab_size=8192", "train.batch_size=1", "data.seq_len=16", "train.grad_accum_steps=2"}),
      "dense, vocab 8192, 2 micro-batches");
  fs::remove_all(d);
}

// MTP modules (a block, a head, the projection's inputs each) stay within the estimate's band of the peak.
TEST(MemoryEstimate, MtpTrainingIsNearTheMeasuredPeak) {
  const fs::path d = fresh_dir("memory_mtp");
  expect_estimate_near_peak(run_config(kMoe, d / "run", {"model.num_nextn_predict_layers=2"}), "moe bf16, 2 MTP");
  fs::remove_all(d);
}

// MLA's kept tensors (q_a's output and norm, the latent and its norm, q, k, v and o at their widths) and the
// recomputed attention's, within the band of the measured peak.
TEST(MemoryEstimate, MlaTrainingIsNearTheMeasuredPeak) {
  const fs::path d = fresh_dir("memory_mla");
  std::vector<std::string> sets = kMla;
  sets.push_back("model.hidden_size=128");  // so that attention's tensors weigh
  expect_estimate_near_peak(run_config(kMoe, d / "run", sets), "moe bf16, mla");
  sets.push_back("train.recompute=[attention]");
  expect_estimate_near_peak(run_config(kMoe, d / "recompute", sets), "moe bf16, mla, attention recomputed");
  fs::remove_all(d);
}

// configs/gpu_mla.yaml fits one 80 GB GPU as configs/gpu_moe.yaml does, its MLA attention no heavier than MHA's
// there, and its parameter count is the built model's.
TEST(MemoryEstimate, GpuMlaConfigFitsOneGpu) {
  const std::string dir = std::string(FLOWMOE_SOURCE_DIR) + "/configs/";
  const Config mla = load_config(dir + "gpu_mla.yaml"), mha = load_config(dir + "gpu_moe.yaml");
  const MemoryEstimate e = estimate_memory(mla, Device::cuda()), base = estimate_memory(mha, Device::cuda());
  std::printf("gpu_mla: %s; gpu_moe: %s\n", e.summary().c_str(), base.summary().c_str());
  EXPECT_LT(e.total_bytes(), 70.0 * (1 << 30));
  EXPECT_LT(e.total_bytes(), 1.1 * base.total_bytes());
  ModelConfig small = mla.model;  // the count by the built model, at fewer layers and experts
  small.num_hidden_layers = 2;
  small.n_routed_experts = 4;
  small.n_group = 2;
  small.topk_group = 1;
  small.num_experts_per_tok = 2;
  small.vocab_size = 256;
  EXPECT_EQ(count_parameters(small), Transformer(small, Device::cpu(), DType::f32, 1).num_parameters());
}

TEST(MemoryEstimate, MoeTrainingIsNearTheMeasuredPeak) {
  const fs::path d = fresh_dir("memory_moe");
  expect_estimate_near_peak(run_config(kMoe, d / "run"), "moe bf16");
  fs::remove_all(d);
}

TEST(MemoryEstimate, Fp8MoeTrainingIsNearTheMeasuredPeak) {
  const fs::path d = fresh_dir("memory_fp8");
  expect_estimate_near_peak(run_config(kFp8Moe, d / "flow", {"precision.recipe=fp8_flow"}), "moe fp8_flow");
  expect_estimate_near_peak(run_config(kFp8Moe, d / "full", {"precision.recipe=fp8_full"}), "moe fp8_full");
  expect_estimate_near_peak(
      run_config(kFp8Moe, d / "rebuilt", {"precision.recipe=fp8_full", "precision.fp8_weight_transpose=rebuilt"}),
      "moe fp8_full, transposes rebuilt");
  expect_estimate_near_peak(
      run_config(kFp8Moe, d / "recompute", {"precision.recipe=fp8_blockwise", "train.recompute=moe_expert"}),
      "moe fp8_blockwise recompute");
  fs::remove_all(d);
}

TEST(MemoryEstimate, GpuTrainingIsNearTheMeasuredPeak) {
  FLOWMOE_REQUIRE_CUDA();
  // bf16 activations, the bf16 weight copies each op keeps, FP8 caches: the GPU's own terms.
  const fs::path d = fresh_dir("memory_gpu");
  const std::vector<std::string> cuda = {"train.device=cuda", "train.batch_size=32", "data.seq_len=64"};
  auto with = [&](std::vector<std::string> sets) {
    sets.insert(sets.end(), cuda.begin(), cuda.end());
    return sets;
  };
  expect_estimate_near_peak(run_config(kDense, d / "dense", with({})), "gpu dense");
  expect_estimate_near_peak(run_config(kMoe, d / "moe", with({"train.grad_accum_steps=2"})),
                            "gpu moe bf16, 2 micro-batches");
  expect_estimate_near_peak(run_config(kFp8Moe, d / "flow", with({"precision.recipe=fp8_flow"})), "gpu moe fp8_flow");
  expect_estimate_near_peak(run_config(kFp8Moe, d / "full", with({"precision.recipe=fp8_full"})), "gpu moe fp8_full");
  expect_estimate_near_peak(
      run_config(kFp8Moe, d / "rebuilt", with({"precision.recipe=fp8_full", "precision.fp8_weight_transpose=rebuilt"})),
      "gpu moe fp8_full, transposes rebuilt");
  fs::remove_all(d);
}

// precision.fp8_weight_transpose rebuilt keeps no FP8 transposes: an evaluation saves them all, training all but
// the one its dgrad rebuilds at a time, the largest: kFp8Moe's experts' fc1 [4 experts, 2 x 128, 128], 131072 bytes
// and 8 f32 block scales (32 bytes, allocated as 64).
TEST(MemoryEstimate, RebuiltTransposesKeepOnlyTheLargestWhileItsDgradRuns) {
  const fs::path d = fresh_dir("memory_rebuilt");
  const Config stored = run_config(kFp8Moe, d, {"precision.recipe=fp8_full"});
  const Config rebuilt =
      run_config(kFp8Moe, d, {"precision.recipe=fp8_full", "precision.fp8_weight_transpose=rebuilt"});
  auto saved = [&](MemoryUse use) {
    return estimate_memory(stored, Device::cpu(), use).weight_bytes -
           estimate_memory(rebuilt, Device::cpu(), use).weight_bytes;
  };
  EXPECT_GT(saved(MemoryUse::train), 0);
  EXPECT_EQ(saved(MemoryUse::eval) - saved(MemoryUse::train), 131072 + 64);
  fs::remove_all(d);
}

TEST(MemoryEstimate, EvaluationIsNearTheMeasuredPeak) {
  const fs::path d = fresh_dir("memory_eval");
  const Config c = run_config(kMoe, d);
  const MemoryEstimate e = estimate_memory(c, Device::cpu(), MemoryUse::eval);
  EXPECT_EQ(e.optimizer_bytes, 0);
  EXPECT_EQ(e.gradient_bytes, 0);
  EXPECT_LT(e.total_bytes(), estimate_memory(c, Device::cpu()).total_bytes());
  const DataLoader data = DataLoader::from_config(c);
  reset_peak_memory(Device::cpu());
  const size_t live_before = memory_stats(Device::cpu()).live_bytes;
  {
    Transformer model(c.model, Device::cpu(), DType::f32, 1, moe_options(c));
    evaluate(model, data, 2, c.train.batch_size);
  }
  const double peak = double(memory_stats(Device::cpu()).peak_bytes - live_before);
  std::printf("eval: estimate %s, measured peak %s, ratio %.2f\n", e.summary().c_str(), format_bytes(peak).c_str(),
              e.total_bytes() / peak);
  EXPECT_GE(e.total_bytes() / peak, kMinRatio);
  EXPECT_LE(e.total_bytes() / peak, kMaxEvalRatio);
  fs::remove_all(d);
}

TEST(MemoryEstimate, GpuAndFp8TermsFollowWhatTheyKeep) {
  const fs::path d = fresh_dir("memory_terms");
  // f32 masters everywhere; the GPU also keeps the bf16 weights (precision.param_dtype auto), or f32 weights
  // and the bf16 cast each op keeps for backward (f32): 6 bytes either way (the allocator's rounding of small
  // tensors adds under 1%).
  const Config dense = run_config(kDense, d);
  const double P = double(count_parameters(dense.model));
  EXPECT_NEAR(estimate_memory(dense, Device::cpu()).weight_bytes, 4 * P, 0.01 * 4 * P);
  EXPECT_NEAR(estimate_memory(dense, Device::cuda(0)).weight_bytes, 6 * P, 0.01 * 6 * P);
  const Config dense_f32 = run_config(kDense, d, {"precision.param_dtype=f32"});
  EXPECT_NEAR(estimate_memory(dense_f32, Device::cuda(0)).weight_bytes, 6 * P, 0.01 * 6 * P);
  // AdamW's two moments: 8 bytes per parameter in f32, 4 in bf16 (optimizer.moment_dtype), on either device;
  // nothing else changes.
  const Config dense_bf16_moments = run_config(kDense, d, {"optimizer.moment_dtype=bf16"});
  for (Device device : {Device::cpu(), Device::cuda(0)}) {
    const MemoryEstimate f32 = estimate_memory(dense, device), bf16 = estimate_memory(dense_bf16_moments, device);
    EXPECT_NEAR(f32.optimizer_bytes, 8 * P, 0.01 * 8 * P);
    EXPECT_NEAR(bf16.optimizer_bytes, 4 * P, 0.01 * 4 * P);
    EXPECT_EQ(bf16.weight_bytes + bf16.gradient_bytes + bf16.activation_bytes,
              f32.weight_bytes + f32.gradient_bytes + f32.activation_bytes);
  }
  // bf16 activations are half the size of the CPU's f32 ones.
  EXPECT_LT(estimate_memory(dense, Device::cuda(0)).activation_bytes,
            0.6 * estimate_memory(dense, Device::cpu()).activation_bytes);
  // FP8 recipes cache the quantized expert weights and their transpose: about 2 bytes per expert weight.
  const Config bf16 = run_config(kFp8Moe, d), fp8 = run_config(kFp8Moe, d, {"precision.recipe=fp8_flow"});
  const double expert_weights = 2.0 * 4 * 3 * 128 * 128;  // 2 layers x 4 experts x (fc1 + fc2)
  const double cache =
      estimate_memory(fp8, Device::cpu()).weight_bytes - estimate_memory(bf16, Device::cpu()).weight_bytes;
  EXPECT_GE(cache, 2 * expert_weights);
  EXPECT_LT(cache, 2.01 * expert_weights);
  // Recomputing fc1 and SwiGLU keeps less.
  const Config recompute = run_config(kFp8Moe, d, {"precision.recipe=fp8_flow", "train.recompute=moe_expert"});
  EXPECT_LT(estimate_memory(recompute, Device::cpu()).activation_bytes,
            estimate_memory(fp8, Device::cpu()).activation_bytes);
  // Expert parallelism 2: each rank holds half the routed experts' masters and moments (4 + 8 bytes
  // each; their gradients too, and a smaller largest tensor), and still reports the whole model's
  // parameter count.
  const Config ep2 = run_config(kFp8Moe, d, {"parallel.expert_parallel_size=2"});
  const MemoryEstimate whole = estimate_memory(bf16, Device::cpu()), half = estimate_memory(ep2, Device::cpu());
  const double held = whole.weight_bytes + whole.optimizer_bytes - (half.weight_bytes + half.optimizer_bytes);
  EXPECT_NEAR(held, 12 * expert_weights / 2, 0.01 * 12 * expert_weights);
  EXPECT_LT(half.gradient_bytes, whole.gradient_bytes);
  EXPECT_EQ(half.num_parameters, whole.num_parameters);
  // A sharded optimizer over 4 ranks of which pairs hold the same experts (EP 2 x DP 2): the dense
  // moments over 4, the experts' over 2, and so the f32 masters beside the model's weights (f32 on the CPU,
  // which stay whole). The gradients of a model smaller than the buckets in flight stay whole too.
  const MemoryEstimate sharded = estimate_memory(ep2, Device::cpu(), MemoryUse::train, {4, 2});
  const double expert_moments = 8 * expert_weights / 2, dense_moments = half.optimizer_bytes - expert_moments;
  EXPECT_NEAR(sharded.optimizer_bytes, dense_moments / 4 + expert_moments / 2, 0.01 * half.optimizer_bytes);
  EXPECT_NEAR(sharded.weight_bytes - half.weight_bytes, (dense_moments / 4 + expert_moments / 2) / 2,
              0.01 * half.weight_bytes);
  EXPECT_EQ(sharded.gradient_bytes, half.gradient_bytes);
  // On the GPU the model's weights are bf16 there (the router's and FP8 experts' stay f32) and no op keeps a
  // cast of them: less than an unsharded rank's weights, though masters are added.
  EXPECT_LT(estimate_memory(ep2, Device::cuda(), MemoryUse::train, {4, 2}).weight_bytes,
            estimate_memory(ep2, Device::cuda()).weight_bytes);
  // A large model's sharded gradients: its segments (1/4) and the buckets in flight and filling (25 MiB each:
  // no tensor is larger), unless micro-batches accumulate into whole gradients.
  const char* large =
      "vocab_size: 8192, hidden_size: 768, num_hidden_layers: 24, num_attention_heads: 12, intermediate_size: 3072,"
      " max_position_embeddings: 64";
  const Config big = run_config(large, d);
  const double whole_grads = estimate_memory(big, Device::cpu()).gradient_bytes;
  const double in_flight = double(GradientReducer::kBucketsInFlight + 1) * 25 * 1024 * 1024;
  EXPECT_NEAR(estimate_memory(big, Device::cpu(), MemoryUse::train, {4, 4}).gradient_bytes, whole_grads / 4 + in_flight,
              0.01 * whole_grads);
  const Config accumulating = run_config(large, d, {"train.grad_accum_steps=2"});
  EXPECT_EQ(estimate_memory(accumulating, Device::cpu(), MemoryUse::train, {4, 4}).gradient_bytes,
            estimate_memory(accumulating, Device::cpu()).gradient_bytes);
  fs::remove_all(d);
}

TEST(MemoryEstimate, RefusalNamesTheEstimateTheAvailableMemoryAndTheKeys) {
  const fs::path d = fresh_dir("memory_refusal");
  const Config c = run_config(kMoe, d);
  const MemoryEstimate e = estimate_memory(c, Device::cpu());
  EXPECT_NO_THROW(check_fits(e, e.total_bytes(), "cpu"));
  EXPECT_TRUE(
      throws_naming<ConfigError>([&] { check_fits(e, e.total_bytes() / 2, "cpu"); },
                                 {"the model needs about ", "weights ", "optimizer ", "activations ", "but cpu has ",
                                  "available; reduce model.hidden_size, model.num_hidden_layers"}));
  // 64 layers of hidden 8192 with 256 experts: the experts dominate, and the message says so.
  const Config big = run_config(kMoe, d,
                                {"model.hidden_size=8192", "model.num_hidden_layers=64", "model.n_routed_experts=256",
                                 "model.first_k_dense_replace=0"});
  const MemoryEstimate b = estimate_memory(big, Device::cpu());
  EXPECT_GT(b.total_bytes(), 16.0 * double(b.num_parameters));  // 4 weights + 8 moments + 4 gradients per parameter
  const std::string needed = "the model needs about " + format_bytes(b.total_bytes()) + " (";
  EXPECT_TRUE(throws_naming<ConfigError>([&] { check_fits(b, 21.3 * (1 << 30), "cpu"); },
                                         {needed.c_str(), "cpu has 21.3 GiB available", "model.n_routed_experts"}));
  fs::remove_all(d);
}

TEST(MemoryEstimate, TrainRefusesAnAbsurdModelAtOnceWithoutAllocating) {
  const fs::path d = fresh_dir("memory_absurd");
  Config c = load_config(std::string(FLOWMOE_SOURCE_DIR) + "/configs/tiny.yaml",
                         {"model.hidden_size=65536", "model.num_attention_heads=1", "model.num_hidden_layers=1024"});
  c.logging.out_dir = (d / "run").string();
  TrainOptions o;
  o.out = std::tmpfile();
  ASSERT_NE(o.out, nullptr);
  const size_t allocs_before = memory_stats(Device::cpu()).num_allocs;
  // "At once" is what the counts below show: nothing was allocated or written before the refusal (a
  // wall-clock bound would measure the machine's load, not the code).
  EXPECT_TRUE(throws_naming<ConfigError>(
      [&] { train(c, o); }, {"the model needs about ", "TiB (weights ", "available; reduce model.hidden_size"}));
  EXPECT_EQ(memory_stats(Device::cpu()).num_allocs, allocs_before) << "no tensor may be allocated before the refusal";
  EXPECT_FALSE(fs::exists(d / "run")) << "a refused run writes nothing";
  // The parameter count and the estimate were printed before the refusal.
  std::rewind(o.out);
  std::string printed(4096, '\0');
  printed.resize(std::fread(printed.data(), 1, printed.size(), o.out));
  std::fclose(o.out);
  EXPECT_NE(printed.find("flowmoe: " + format_count(double(count_parameters(c.model))) + " parameters (1024 layers"),
            std::string::npos)
      << printed;
  EXPECT_NE(printed.find("memory: about "), std::string::npos) << printed;
  fs::remove_all(d);
}

TEST(MemoryEstimate, FormatsBytesAndCounts) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(2.0 * (1 << 20)), "2.0 MiB");
  EXPECT_EQ(format_bytes(21.3 * (1 << 30)), "21.3 GiB");
  EXPECT_EQ(format_bytes(250.0 * (1 << 30)), "250 GiB");
  EXPECT_EQ(format_bytes(1.2 * 1024 * 1024 * 1024 * 1024), "1.2 TiB");
  EXPECT_EQ(format_count(490000), "0.49M");
  EXPECT_EQ(format_count(6.74e9), "6.74B");
  EXPECT_EQ(format_count(1.76e13), "17.6T");
}
