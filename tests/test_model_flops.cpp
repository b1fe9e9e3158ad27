// Model FLOPs per token against counts written out by hand, the GPUs' peak table, and a CPU run's metrics:
// TFLOP/s per rank, no MFU (the CPU has no peak).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>

#include "tests/support/mla_config.h"
#include "tests/support/train_fixtures.h"
#include "train/metrics.h"
#include "train/model_flops.h"
#include "train/progress.h"
#include "train/trainer.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

size_t count_of(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// 3 layers: layer 0 dense, layers 1-2 MoE with 4 routed experts (top 2) and 2 shared ones.
ModelConfig small_moe() {
  ModelConfig c;
  c.vocab_size = 32;
  c.hidden_size = 16;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 2;
  c.intermediate_size = 24;
  c.first_k_dense_replace = 1;
  c.n_routed_experts = 4;
  c.num_experts_per_tok = 2;
  c.n_shared_experts = 2;
  c.moe_intermediate_size = 8;
  return c;
}

}  // namespace

TEST(ModelFlops, SmallMoeModelMatchesTheCountByHand) {
  const int64_t T = 10;  // seq_len
  // Forward, per token, H = 16, 2 FLOPs per multiply-add; each term's value after it.
  // 3 layers x q, k, v, o [16,16]: 6144
  const double attention_proj = 3 * (4 * 2 * 16 * 16);
  // 3 layers x q·kᵀ and p·v over T keys, halved for the causal mask: 960
  const double attention_core = 3 * (2 * 2 * T * 16) / 2;
  // layer 0: gate, up [24,16] and down [16,24]: 2304
  const double dense_mlp = 1 * (3 * 2 * 16 * 24);
  // layers 1-2: the router's gate [4,16]: 256
  const double router = 2 * (2 * 16 * 4);
  // layers 1-2: the top 2 of 4 experts, each fc1 [16,16] (gate and up, 8 rows each) and fc2 [16,8]: 3072
  const double routed = 2 * (2 * (3 * 2 * 16 * 8));
  // layers 1-2: 2 shared experts, one SwiGLU MLP of width 2 x 8: 3072
  const double shared = 2 * (3 * 2 * 16 * (2 * 8));
  // lm_head [32,16]; the embedding is a lookup: 1024
  const double head = 2 * 16 * 32;
  const double forward = attention_proj + attention_core + dense_mlp + router + routed + shared + head;
  ASSERT_EQ(forward, 16832.0);
  EXPECT_EQ(model_flops_per_token(small_moe(), T), 3 * forward);  // backward = 2 x forward
}

// MLA (layers/mla.h) in place of the q, k, v, o projections: its five projections, and the core's products at the
// query/key width (nope + rope) and the value width.
TEST(ModelFlops, MlaCountsItsProjectionsAndHeadWidths) {
  const int64_t T = 10;
  ModelConfig c =
      with_mla(small_moe(),
               {.q_lora_rank = 6, .kv_lora_rank = 4, .qk_nope_head_dim = 5, .qk_rope_head_dim = 2, .v_head_dim = 3});
  // Per layer: q_a [6,16], q_b [2*7,6], kv_a [4+2,16], kv_b [2*(5+3),4], o [16,2*3]
  const double proj = 6 * 16 + 14 * 6 + 6 * 16 + 16 * 4 + 16 * 6;
  // q·kᵀ over 7 dims and p·v over 3, per head, halved: T * 2 * (7 + 3)
  const double core = double(T) * 2 * (7 + 3);
  const double mha_proj = 4 * 16 * 16, mha_core = 2.0 * double(T) * 16;
  EXPECT_EQ(model_flops_per_token(c, T),
            model_flops_per_token(small_moe(), T) + 3 * 3 * (2 * (proj - mha_proj) + (core - mha_core)));
  c.q_lora_rank = 0;  // one q_proj [2*7, 16]
  const double direct = 14 * 16 + 6 * 16 + 16 * 4 + 16 * 6;
  EXPECT_EQ(model_flops_per_token(c, T),
            model_flops_per_token(small_moe(), T) + 3 * 3 * (2 * (direct - mha_proj) + (core - mha_core)));
}

// One MTP module of an MoE model: eh_proj [16,32], one MoE layer (its q, k, v, o, attention core, router, routed
// and shared experts) and the head again, all in the step's FLOPs.
TEST(ModelFlops, MtpModulesAddTheirProjectionABlockAndTheHead) {
  const int64_t T = 10;
  ModelConfig c = small_moe();
  c.num_nextn_predict_layers = 1;
  const double eh_proj = 2 * 16 * 32;                                // 1024
  const double block = 4 * 2 * 16 * 16 + 2 * T * 16 + 2 * 16 * 4 +   // q, k, v, o; core; router
                       2 * (3 * 2 * 16 * 8) + 3 * 2 * 16 * (2 * 8);  // routed and shared experts
  const double head = 2 * 16 * 32;                                   // 1024
  ASSERT_EQ(eh_proj + block + head, 7616.0);
  EXPECT_EQ(model_flops_per_token(c, T), model_flops_per_token(small_moe(), T) + 3 * (eh_proj + block + head));
  c.num_nextn_predict_layers = 2;
  EXPECT_EQ(model_flops_per_token(c, T), model_flops_per_token(small_moe(), T) + 6 * (eh_proj + block + head));
  // A model whose last layer is dense gets a dense module: its SwiGLU MLP instead.
  ModelConfig dense = small_moe();
  dense.first_k_dense_replace = 3;
  ModelConfig dense_mtp = dense;
  dense_mtp.num_nextn_predict_layers = 1;
  const double dense_block = 4 * 2 * 16 * 16 + 2 * T * 16 + 3 * 2 * 16 * 24;
  EXPECT_EQ(model_flops_per_token(dense_mtp, T), model_flops_per_token(dense, T) + 3 * (eh_proj + dense_block + head));
}

// Each expert more per token adds its three GEMMs in each MoE layer; more experts to choose from add only to
// the router; a tied head is still a GEMM; longer sequences add only to attention's q·kᵀ and p·v.
TEST(ModelFlops, TopKAddsTheRoutedExpertsShareOnly) {
  const ModelConfig c = small_moe();
  const double per_expert = 3 * (3 * 2 * 16 * 8);  // forward + backward of fc1 (2 x 8 rows) and fc2 of one expert
  const double base = model_flops_per_token(c, 10);
  ModelConfig k3 = c;
  k3.num_experts_per_tok = 3;
  EXPECT_EQ(model_flops_per_token(k3, 10) - base, 2 * per_expert);  // 2 MoE layers
  ModelConfig e8 = c;
  e8.n_routed_experts = 8;
  EXPECT_EQ(model_flops_per_token(e8, 10) - base, 2 * 3 * (2 * 16 * 4));  // the router's 4 more rows
  ModelConfig tied = c;
  tied.tie_word_embeddings = true;
  EXPECT_EQ(model_flops_per_token(tied, 10), base);
  EXPECT_EQ(model_flops_per_token(c, 20) - base, 3 * 3 * (2 * 2 * 10 * 16) / 2);  // 10 more keys, causal
}

// Without routed experts every layer is dense, first_k_dense_replace or not.
TEST(ModelFlops, DenseModel) {
  ModelConfig c = small_moe();
  c.n_routed_experts = 0;
  const double forward = 3 * (4 * 2 * 16 * 16) + 3 * (2 * 10 * 16) + 3 * (3 * 2 * 16 * 24) + 2 * 16 * 32;
  EXPECT_EQ(model_flops_per_token(c, 10), 3 * forward);
}

TEST(DevicePeak, EveryEntryByItsNameAndOthersUnknown) {
  EXPECT_EQ(bf16_dense_peak_tflops("NVIDIA H100 80GB HBM3"), 989.4);  // SXM
  EXPECT_EQ(bf16_dense_peak_tflops("NVIDIA H100 PCIe"), 756.0);
  EXPECT_EQ(bf16_dense_peak_tflops("NVIDIA H100 NVL"), 835.0);
  EXPECT_EQ(bf16_dense_peak_tflops("NVIDIA H200"), 989.4);
  EXPECT_EQ(bf16_dense_peak_tflops("NVIDIA GH200 480GB"), 989.4);
  EXPECT_EQ(bf16_dense_peak_tflops("NVIDIA GH200 144G HBM3e"), 989.4);
  for (const char* other : {"NVIDIA A100-SXM4-80GB", "NVIDIA H200 NVL", "NVIDIA H20", "NVIDIA H100", "NVIDIA H800",
                            "NVIDIA GeForce RTX 4090", "H200", ""})
    EXPECT_TRUE(std::isnan(bf16_dense_peak_tflops(other))) << other;
}

TEST(ModelFlops, RatesArePerRankAndMfuNeedsAPeak) {
  ModelFlops f;
  f.flops_per_token = 2e9;
  f.num_ranks = 4;
  f.peak_tflops = 800;
  StepMetrics m;
  m.tokens_per_s = 1e6;  // over the 4 ranks
  f.set_rates(m);
  EXPECT_DOUBLE_EQ(m.tflops, 500.0);  // 2e9 x 1e6 / 4 / 1e12
  EXPECT_DOUBLE_EQ(m.mfu, 0.625);
  f.peak_tflops = NAN;
  f.set_rates(m);
  EXPECT_DOUBLE_EQ(m.tflops, 500.0);
  EXPECT_TRUE(std::isnan(m.mfu));
}

// The start-up line on a GPU: the peak MFU is measured against, or that there is none.
TEST(ModelFlops, PeakNote) {
  ModelFlops f;
  f.device_name = "NVIDIA H100 PCIe";
  f.peak_tflops = bf16_dense_peak_tflops(f.device_name);
  EXPECT_EQ(f.peak_note(), "mfu: of NVIDIA H100 PCIe's bf16 dense peak, 756.0 TFLOP/s per GPU");
  f.device_name = "NVIDIA A100-SXM4-80GB";
  f.peak_tflops = bf16_dense_peak_tflops(f.device_name);
  EXPECT_EQ(f.peak_note(),
            "mfu: not reported: NVIDIA A100-SXM4-80GB has no bf16 dense peak in train/model_flops.h (TFLOP/s per GPU "
            "are)");
}

TEST(ModelFlops, OnTheCpuThereIsNoPeak) {
  const ModelFlops f = run_model_flops(small_moe(), 10, Device::cpu(), 2);
  EXPECT_EQ(f.flops_per_token, model_flops_per_token(small_moe(), 10));
  EXPECT_EQ(f.num_ranks, 2);
  EXPECT_TRUE(std::isnan(f.peak_tflops));
  EXPECT_EQ(f.peak_note(), "");
}

// A CPU run writes TFLOP/s in every row, from its tokens/s and the model's FLOPs per token, and no MFU: null in
// JSONL, an empty cell in CSV, nothing on the console.
TEST(ModelFlops, ACpuRunHasTflopsAndNoMfu) {
  const fs::path d = fresh_dir("model_flops_run");
  for (const MetricsFormat format : {MetricsFormat::jsonl, MetricsFormat::csv}) {
    const char* name = enum_name(kMetricsFormatNames, format);
    SCOPED_TRACE(name);
    Config c = tiny_config(d / name);
    c.logging.metrics_format = format;
    c.train.steps = 3;
    std::FILE* out = std::tmpfile();
    TrainOptions opts;
    opts.out = out;
    const TrainResult r = train(c, opts);
    const std::string printed = [&] {
      std::rewind(out);
      std::string s;
      char buf[4096];
      for (size_t n; (n = std::fread(buf, 1, sizeof buf, out)) > 0;) s.append(buf, n);
      std::fclose(out);
      return s;
    }();
    const double per_token = model_flops_per_token(c.model, c.data.seq_len);
    const std::vector<StepMetrics> rows = read_metrics(r.metrics_file);
    ASSERT_EQ(rows.size(), 3u);
    for (const StepMetrics& m : rows) {
      EXPECT_GT(m.tflops, 0);
      EXPECT_NEAR(m.tflops, per_token * m.tokens_per_s / 1e12, 1e-5 * m.tflops);  // 6 digits written
      EXPECT_TRUE(std::isnan(m.mfu));
    }
    const std::string text = read_bytes(r.metrics_file);
    if (format == MetricsFormat::jsonl)
      EXPECT_NE(text.find("\"mfu\": null, \"mtp_loss\": null}\n"), std::string::npos) << text;
    else  // the header, then 3 rows whose last cells, mfu and mtp_loss, are empty
      EXPECT_EQ(text.find(",tflops,mfu,mtp_loss\n"), text.find('\n') - 20) << text;
    EXPECT_EQ(count_of(text, ",,\n"), format == MetricsFormat::csv ? 3u : 0u) << text;
    EXPECT_EQ(text.find("nan"), std::string::npos) << text;
    EXPECT_NE(printed.find(" TFLOP/s | ETA"), std::string::npos) << printed;
    EXPECT_EQ(printed.find("MFU"), std::string::npos) << printed;
    EXPECT_NE(printed.find("), " + format_flops(per_token) + " per token (forward + backward) on cpu"),
              std::string::npos)
        << printed;
  }
  fs::remove_all(d);
}
