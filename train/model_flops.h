// Model FLOPs and model FLOPs utilisation (MFU), as PaLM (Appendix B) defined them and Megatron-LM, torchtitan
// and llm.c count them: the matrix products the model's definition needs for one token, forward and backward.
// What a run does beyond them (recomputation, the expert buffers' padding, FP8 casts, norms and other
// elementwise ops) is not counted, so MFU compares runs, recipes and engines by the useful work they get through.
//
// Forward, per token, 2 FLOPs per multiply-add; H hidden_size, T data.seq_len, V vocab_size, E n_routed_experts,
// k num_experts_per_tok, F moe_intermediate_size:
//   every layer: attention's q, k, v, o projections   4 · 2·H·H
//                attention's q·kᵀ and p·v             2 · 2·T·H for full attention (H = heads · head size),
//                                                     half of it under the causal mask: 2·T·H
//   a dense layer: SwiGLU MLP (gate, up, down)        3 · 2·H·intermediate_size
//   an MoE layer:  router                             2·H·E (the token is scored against every expert)
//                  routed experts, fc1 (gate and up)  k · 3 · 2·H·F (the k experts the token goes to, not E)
//                  and fc2
//                  shared experts                     3 · 2·H·(n_shared_experts · F)
//   the output head                                   2·H·V (the embedding is a lookup: 0)
//   each MTP module (model.num_nextn_predict_layers)  2·H·2H (eh_proj), one layer as above of the last layer's
//                                                     kind, and the output head again: the modules run in every
//                                                     training step, so their FLOPs count in the step's (and MFU)
// Backward is twice the forward (the inputs' and the weights' gradients), so a training step is 3x forward:
//   6·N_active + 6·L·H·T,
// N_active the weights a token multiplies and L the layers: PaLM's 6·N + 12·L·H·T with the attention term
// halved for the causal mask (T/2 keys per query on average; exactly (T+1)/2). The router counts at its
// size although it runs in f32.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>

#include "engine/device.h"
#include "layers/model_config.h"
#include "train/metrics.h"

namespace flowmoe {

// Model FLOPs of one token in one training step (forward + backward) for sequences of seq_len tokens.
double model_flops_per_token(const ModelConfig& model, int64_t seq_len);

// The bf16 dense (no sparsity) peak of a GPU, by the name CUDA gives it (cuda_device_name). A name matches an
// entry when it is the entry, or the entry followed by its memory size ("NVIDIA GH200 480GB"). MFU is
// measured against this peak in every precision recipe: the FP8 recipes' expert GEMMs do not raise it.
struct DevicePeak {
  const char* name;
  double bf16_dense_tflops;
};
inline constexpr DevicePeak kDevicePeaks[] = {
    {"NVIDIA H100 80GB HBM3", 989.4},  // H100 SXM5
    {"NVIDIA H100 PCIe", 756.0},      {"NVIDIA H100 NVL", 835.0}, {"NVIDIA H200", 989.4}, {"NVIDIA GH200", 989.4},
};
// The table's peak for a device name in TFLOP/s; NaN for a name not in it.
double bf16_dense_peak_tflops(const std::string& device_name);

// What turns a run's tokens/s, counted over all its ranks, into model TFLOP/s per GPU and MFU.
struct ModelFlops {
  double flops_per_token = 0;  // model_flops_per_token
  int num_ranks = 1;           // the processes the tokens are split over, one device each
  double peak_tflops = NAN;    // of one device; NaN: none known (the CPU, or a GPU not in kDevicePeaks)
  std::string device_name;     // the GPU's name; "" on the CPU

  double tflops(double tokens_per_s) const { return flops_per_token * tokens_per_s / double(num_ranks) / 1e12; }
  double mfu(double tokens_per_s) const { return tflops(tokens_per_s) / peak_tflops; }  // NaN without a peak
  // m.tflops and m.mfu from m.tokens_per_s.
  void set_rates(StepMetrics& m) const;
  // The start-up line about the peak on a GPU ("" on the CPU): the peak MFU is measured against, or that
  // the GPU has none in the table and MFU is left out.
  std::string peak_note() const;
};
// A run's: the model of `cfg`'s shape and data.seq_len, over `num_ranks` ranks, on `device` (rank 0's, whose
// metrics are written).
ModelFlops run_model_flops(const ModelConfig& model, int64_t seq_len, Device device, int num_ranks);

}  // namespace flowmoe
