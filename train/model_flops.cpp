// Model FLOPs per token, the GPUs' peaks and MFU (see model_flops.h).
#include "train/model_flops.h"

#include <cctype>
#include <cstring>

#include "kernels/common/device_api.h"
#include "train/progress.h"

namespace flowmoe {

namespace {

// The weights of one block's attention a token multiplies: q, k, v and o [H, H]; MLA's projections (layers/mla.h).
double attention_weights(const ModelConfig& c) {
  const double H = double(c.hidden_size);
  if (c.attention != AttentionType::mla) return 4 * H * H;
  const double nh = double(c.num_attention_heads), qk = double(attention_qk_head_dim(c));
  const double ql = double(c.q_lora_rank), kv = double(c.kv_lora_rank);
  const double q = c.q_lora_rank > 0 ? ql * H + nh * qk * ql : nh * qk * H;
  return q + (kv + double(c.qk_rope_head_dim)) * H + nh * double(c.qk_nope_head_dim + c.v_head_dim) * kv +
         H * nh * double(c.v_head_dim);
}

}  // namespace

double model_flops_per_token(const ModelConfig& c, int64_t seq_len) {
  const double H = double(c.hidden_size), T = double(seq_len), L = double(c.num_hidden_layers);
  const double moe_layers = double(num_moe_layers(c)), dense_layers = L - moe_layers;
  const double F = double(c.moe_intermediate_size);
  const double swiglu = 3 * H;  // the weights of one unit of a SwiGLU MLP's width: gate, up and down
  // N_active, the weights a token multiplies: attention, dense MLPs, the head; the router, k routed and the shared
  // experts of each MoE layer.
  const double moe_mlp =
      H * double(c.n_routed_experts) + swiglu * F * double(c.num_experts_per_tok + c.n_shared_experts);
  const double attn = attention_weights(c);
  double active = L * attn + dense_layers * swiglu * double(c.intermediate_size) + H * double(c.vocab_size);
  active += moe_layers * moe_mlp;
  // forward: q·kᵀ and p·v over every head, 2·T·heads·(qk + v) halved (2·T·H under mha)
  const double core = T * double(c.num_attention_heads) * double(attention_qk_head_dim(c) + attention_v_head_dim(c));
  double causal_attention = L * core;
  // Each MTP module: eh_proj [H, 2H], one block of the last block's kind, and the shared head again.
  const double D = double(c.num_nextn_predict_layers);
  if (D > 0) {
    const bool moe = is_moe_layer(c, mtp_layer_index(c, 1));
    active +=
        D * (2 * H * H + attn + (moe ? moe_mlp : swiglu * double(c.intermediate_size)) + H * double(c.vocab_size));
    causal_attention += D * core;
  }
  return 3 * (2 * active + causal_attention);
}

double bf16_dense_peak_tflops(const std::string& name) {
  for (const DevicePeak& p : kDevicePeaks) {
    const size_t n = std::strlen(p.name);
    if (name.compare(0, n, p.name) != 0) continue;
    // The entry alone, or with the memory size after it; another word makes it another GPU ("NVIDIA H200 NVL").
    if (name.size() == n ||
        (name.size() > n + 1 && name[n] == ' ' && std::isdigit(static_cast<unsigned char>(name[n + 1]))))
      return p.bf16_dense_tflops;
  }
  return NAN;
}

void ModelFlops::set_rates(StepMetrics& m) const {
  m.tflops = tflops(m.tokens_per_s);
  m.mfu = mfu(m.tokens_per_s);
}

std::string ModelFlops::peak_note() const {
  if (device_name.empty()) return "";
  if (std::isnan(peak_tflops))
    return "mfu: not reported: " + device_name + " has no bf16 dense peak in train/model_flops.h (TFLOP/s per GPU are)";
  return "mfu: of " + device_name + "'s bf16 dense peak, " + format_fixed(peak_tflops, 1) + " TFLOP/s per GPU";
}

ModelFlops run_model_flops(const ModelConfig& model, int64_t seq_len, Device device, int num_ranks) {
  ModelFlops f;
  f.flops_per_token = model_flops_per_token(model, seq_len);
  f.num_ranks = num_ranks;
  if (device.is_cuda()) {
    f.device_name = cuda_device_name(device.index);
    f.peak_tflops = bf16_dense_peak_tflops(f.device_name);
  }
  return f;
}

}  // namespace flowmoe
