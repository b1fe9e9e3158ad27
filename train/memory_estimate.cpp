// The parameter count and memory estimate (see memory_estimate.h): a sum of terms in bytes, each documented above
// the function that computes it. N = train.batch_size x data.seq_len tokens of one micro-batch, a = the compute
// dtype's size (4: f32 on the CPU; 2: bf16 on the GPU), P parameters of which P_x are routed-expert weights (fc1,
// fc2), H hidden, I intermediate, V vocab, per MoE layer E experts of width F, top-k, S shared experts. Each tensor
// is counted as the allocator rounds it (whole MiB on the GPU above 1 MiB; allocation_bytes).
// The terms: weights (weight_bytes), optimizer and activations (estimate_memory), gradients (gradient_bytes).
// Summed, the terms bound the peak from above: backward frees each block's activations as it allocates that
// block's gradients, so the activations and the gradients never all coexist.
#include "train/memory_estimate.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

#include "engine/allocator.h"
#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"
#include "kernels/common/error.h"
#include "layers/moe.h"
#include "parallel/grad_reducer.h"
#include "train/train_options.h"

namespace flowmoe {

namespace {

// Bytes the allocator takes for one tensor of `bytes`: the CUDA caching allocator rounds to 512 B
// below 1 MiB and to whole MiB above (CachingAllocator::round_size), the host to 64 B.
double allocation_bytes(double bytes, bool gpu) {
  if (bytes <= 0) return 0;
  if (!gpu) return std::ceil(bytes / 64) * 64;
  if (bytes >= 0x1p60) return bytes;  // past size_t's comfort the rounding does not matter
  return double(CachingAllocator::round_size(size_t(std::ceil(bytes))));
}

// `count` tensors of `elements` elements of `element_bytes` each.
struct Tensors {
  double count, elements, element_bytes;
};

double allocated_bytes(const std::vector<Tensors>& tensors, bool gpu) {
  double total = 0;
  for (const Tensors& t : tensors) total += t.count * allocation_bytes(t.elements * t.element_bytes, gpu);
  return total;
}

// An FP8 tensor of `elements` (1 byte each) and its 1x128 f32 scales.
std::vector<Tensors> fp8_rowwise(double elements) { return {{1, elements, 1}, {1, elements / 128, 4}}; }

// mtp_proj: the MTP modules' eh_proj, a plain linear in every recipe.
// attention_compute: MLA's kv_a_proj_with_mqa, which stays in the compute dtype under fp8_full (layers/mla.h).
enum class Role {
  embedding,
  norm,
  attention,
  attention_compute,
  dense_mlp,
  router,
  routed_expert,
  shared_expert,
  mtp_proj
};

// `count` parameter tensors of `elements` each.
struct ParamGroup {
  Role role;
  double count, elements;
};

// The ranks a sharded optimizer splits a group's per-parameter state over.
double shard_ranks(const ParamGroup& g, const OptimizerShards& shards) {
  return double(std::max<int64_t>(1, g.role == Role::routed_expert ? shards.experts : shards.dense));
}

// Mirrors the parameters Transformer, TransformerBlock, Attention, Mlp and MoeLayer create. Counted in
// double: exact below 2^53, and no overflow for absurd sizes.
std::vector<ParamGroup> parameter_groups(const ModelConfig& c) {
  // L counts the MTP modules' blocks beside the model's (MtpModule: enorm, hnorm, eh_proj, a block, its norm).
  const double D = double(c.num_nextn_predict_layers);
  const double H = double(c.hidden_size), L = double(c.num_hidden_layers) + D, V = double(c.vocab_size);
  const double moe = double(num_moe_layers(c) + num_mtp_moe_layers(c)), dense = L - moe;
  const double E = double(c.n_routed_experts), F = double(c.moe_intermediate_size);
  std::vector<ParamGroup> g = {
      {Role::embedding, c.tie_word_embeddings ? 1.0 : 2.0, V * H},  // embed_tokens, lm_head
      {Role::norm, 2 * L + 1 + 3 * D, H},                           // two per block, the final norm; MTP's three
      {Role::dense_mlp, 3 * dense, double(c.intermediate_size) * H},
  };
  if (c.attention == AttentionType::mla) {  // layers/mla.h
    const double nh = double(c.num_attention_heads), ql = double(c.q_lora_rank), kv = double(c.kv_lora_rank);
    const double qk = double(c.qk_nope_head_dim + c.qk_rope_head_dim), rope = double(c.qk_rope_head_dim);
    if (c.q_lora_rank > 0) {
      g.push_back({Role::attention, L, ql * H});        // q_a_proj
      g.push_back({Role::norm, L, ql});                 // q_a_layernorm
      g.push_back({Role::attention, L, nh * qk * ql});  // q_b_proj
    } else {
      g.push_back({Role::attention, L, nh * qk * H});  // q_proj
    }
    g.push_back({Role::attention_compute, L, (kv + rope) * H});                              // kv_a_proj_with_mqa
    g.push_back({Role::norm, L, kv});                                                        // kv_a_layernorm
    g.push_back({Role::attention, L, nh * double(c.qk_nope_head_dim + c.v_head_dim) * kv});  // kv_b_proj
    g.push_back({Role::attention, L, H * nh * double(c.v_head_dim)});                        // o_proj
  } else {
    g.push_back({Role::attention, 4 * L, H * H});  // q, k, v, o
  }
  if (D > 0) g.push_back({Role::mtp_proj, D, 2 * H * H});
  if (moe > 0) {
    g.push_back({Role::router, moe, E * H});
    g.push_back({Role::routed_expert, moe, E * 2 * F * H});  // fc1 [E, 2F, H]
    g.push_back({Role::routed_expert, moe, E * H * F});      // fc2 [E, H, F]
    if (c.n_shared_experts > 0) g.push_back({Role::shared_expert, 3 * moe, double(c.n_shared_experts) * F * H});
  }
  return g;
}

double num_elements(const std::vector<ParamGroup>& groups, std::initializer_list<Role> roles) {
  double n = 0;
  for (const ParamGroup& g : groups)
    if (std::find(roles.begin(), roles.end(), g.role) != roles.end()) n += g.count * g.elements;
  return n;
}

double total_elements(const std::vector<ParamGroup>& groups) {
  double n = 0;
  for (const ParamGroup& g : groups) n += g.count * g.elements;
  return n;
}

double largest_tensor(const std::vector<ParamGroup>& groups) {
  double n = 0;
  for (const ParamGroup& g : groups)
    if (g.count > 0) n = std::max(n, g.elements);
  return n;
}

// `bytes_per_element` for every parameter, allocated tensor by tensor (the optimizer's moments too).
double per_parameter_bytes(const std::vector<ParamGroup>& groups, double bytes_per_element, bool gpu) {
  double total = 0;
  for (const ParamGroup& g : groups) total += allocated_bytes({{g.count, g.elements, bytes_per_element}}, gpu);
  return total;
}

int64_t saturate(double count) { return count < 9.2e18 ? int64_t(count) : std::numeric_limits<int64_t>::max(); }

// The f32 masters, the MoE buffers and the copies kept beside them: on the GPU in training the
// bf16 cast each op keeps until backward (routers read the f32 gate), and the FP8 expert caches.
// In bytes: 4 P f32 master weights on every device, + 8 E per MoE layer (expert_bias, counts).
// GPU: 2 (P - P_x - routers): each op keeps the bf16 copy of the weight it was cast for until backward (a tied
// embedding is cast twice); with the bf16 recipe also 2 P_x, grouped_linear's bf16 copy of the experts.
// FP8 recipes (CPU and GPU): 2 P_x + scales, the cached FP8 expert weights and their transpose; fp8_full keeps
// the same of its FP8 linears' weights (attention, dense MLPs, shared experts), which count into P_x here.
// precision.fp8_weight_transpose rebuilt keeps no transpose: training then holds one weight's at a time, the
// largest, while its dgrad runs.
// precision.param_dtype auto trains on the GPU with the model's weights in the compute dtype instead, a P (4 for
// what the forward reads in f32: routers, FP8 experts), and their f32 masters in the optimizer, 4 P; nothing is
// cast at use. A sharded optimizer (parallel/grad_reducer.h) keeps the masters of this rank's segments alone, of
// every parameter: 4 P / N.
double weight_bytes(const Config& cfg, const std::vector<ParamGroup>& groups, bool gpu, MemoryUse use,
                    const OptimizerShards& shards) {
  const MoeFlow flow = moe_flow(cfg.precision.recipe);
  const bool fp8 = flow.fp8_experts, fp8_linears = flow.fp8_linears;
  const bool sharded = use == MemoryUse::train && shards.any();
  const bool narrow = gpu && use == MemoryUse::train && cfg.precision.param_dtype != ParamDtype::f32;
  const bool keeps_casts = gpu && use == MemoryUse::train && !narrow;
  const int num_fp8_copies = cfg.precision.fp8_weight_transpose == Fp8WeightTranspose::stored ? 2 : 1;
  double bytes = 0, largest_fp8_weight = 0;
  for (const ParamGroup& g : groups) {
    const bool fp8_weight =
        (g.role == Role::routed_expert && fp8) ||
        (fp8_linears && (g.role == Role::attention || g.role == Role::dense_mlp || g.role == Role::shared_expert));
    const bool reads_f32 = g.role == Role::router || fp8_weight;
    const bool stored_narrow = narrow && !reads_f32;
    bytes += allocated_bytes({{g.count, g.elements, stored_narrow ? 2.0 : 4.0}}, gpu);
    if (sharded)
      bytes += allocated_bytes({{g.count, g.elements / shard_ranks(g, shards), 4}}, gpu);
    else if (stored_narrow)
      bytes += allocated_bytes({{g.count, g.elements, 4}}, gpu);
    if (fp8_weight) {
      for (int copy = 0; copy < num_fp8_copies; ++copy)  // the quantized weight (and its transpose), 128x128 scales
        bytes += allocated_bytes({{g.count, g.elements, 1}, {g.count, g.elements / (128 * 128), 4}}, gpu);
      largest_fp8_weight = std::max(largest_fp8_weight, g.elements);
    } else if (keeps_casts && g.role != Role::router) {
      const double casts = g.role == Role::embedding && cfg.model.tie_word_embeddings ? 2 : 1;
      bytes += allocated_bytes({{casts * g.count, g.elements, 2}}, gpu);
    }
  }
  if (num_fp8_copies == 1 && use == MemoryUse::train)
    bytes += allocated_bytes({{1, largest_fp8_weight, 1}, {1, largest_fp8_weight / (128 * 128), 4}}, gpu);
  const double E = double(cfg.model.n_routed_experts);
  const double moe_layers = double(num_moe_layers(cfg.model) + num_mtp_moe_layers(cfg.model));
  return bytes + allocated_bytes({{2 * moe_layers, E, 4}}, gpu);  // expert_bias, counts
}

// What the graph keeps of one block's attention half, 8 N H a: block input, its norm, q, k (after RoPE), v,
// attention output, residual, its norm. MLA (layers/mla.h) keeps the block input, its norm, the residual and its
// norm (4 N H a), q_a_proj's output and its norm (2 N q_lora_rank a), the latent and its norm (2 N kv_lora_rank a),
// q and k (2 N heads (nope + rope) a), v and the attention output (2 N heads v_head_dim a). Attention keeps no
// [T, T] scores: both backends recompute them from q and k in backward; the GPU keeps a [B, heads, T] f32
// logsumexp. train.recompute attention keeps the block input, the residual and its norm, 3 N H a; its backward
// holds one block's branch again at a time.
std::vector<Tensors> attention_tensors(const ModelConfig& c, double tokens, double a, bool gpu, bool recompute) {
  if (recompute) return {{3, tokens * double(c.hidden_size), a}};
  const double nh = double(c.num_attention_heads);
  std::vector<Tensors> t =
      c.attention == AttentionType::mla
          ? std::vector<Tensors>{{4, tokens * double(c.hidden_size), a},
                                 {2, tokens * double(c.q_lora_rank), a},
                                 {2, tokens * double(c.kv_lora_rank), a},
                                 {2, tokens * nh * double(c.qk_nope_head_dim + c.qk_rope_head_dim), a},
                                 {2, tokens * nh * double(c.v_head_dim), a}}
          : std::vector<Tensors>{{8, tokens * double(c.hidden_size), a}};
  if (gpu) t.push_back({1, tokens * double(c.num_attention_heads), 4});
  return t;
}

// A dense SwiGLU MLP of width I keeps 4 N I a: gate, up, silu(gate) and their product.
std::vector<Tensors> swiglu_mlp_tensors(double tokens, double width, double a) { return {{4, tokens * width, a}}; }

// What the graph keeps of one MoE layer: router, dispatch, routed and shared experts.
//   router: f32 logits N E, top-k ids, probs and row map 12 N k (GPU: the f32 copy of x the router reads, 4 N H).
//   M = the permuted buffer's worst case, N k + min(E, N k) (align - 1) rows.
//   What the recipe keeps follows its MoeFlow (layers/moe.h), as the layer reads it:
//   bf16: rows M H, fc1 out M 2F, SwiGLU out M F, fc2 out M H, all a.
//   fp8_experts (fp8_blockwise): FP8 rows M H (+ 1x128 f32 scales), fc1 out, FP8 SwiGLU out, fc2 out.
//   probs_in_experts (fp8_flow, fp8_full): FP8 rows and probs, fc1 out, FP8 SwiGLU out (fc2's output is not kept:
//   the probs' gradient comes from SwiGLU, not from combine).
//   train.recompute moe_expert drops fc1's output (where fc1 quantizes its own input, fp8_blockwise, the layer
//   then keeps the high-precision rows instead of the FP8 ones). Shared experts: 4 N S F a, as a dense MLP.
std::vector<Tensors> moe_tensors(const Config& cfg, double tokens, double a, bool gpu) {
  const ModelConfig& c = cfg.model;
  const double H = double(c.hidden_size), F = double(c.moe_intermediate_size), E = double(c.n_routed_experts);
  const double k = double(c.num_experts_per_tok);
  const MoeRecipe recipe = cfg.precision.recipe;
  const MoeFlow flow = moe_flow(recipe);
  const bool recompute = cfg.train.recomputes("moe_expert");
  // The permuted buffer, as the layer sizes it.
  const double rows = double(moe_permuted_rows(int64_t(tokens), int(k), int(E), int(cfg.precision.align_size), recipe));

  std::vector<Tensors> t = {{1, tokens * E, 4}, {3, tokens * k, 4}};  // logits; ids, probs, row map
  if (gpu) t.push_back({1, tokens * H, 4});                           // the router's f32 copy of x
  auto add = [&t](const std::vector<Tensors>& more) { t.insert(t.end(), more.begin(), more.end()); };
  if (!recompute) t.push_back({1, rows * 2 * F, a});  // fc1's output
  // The permuted rows: FP8 where the experts run in FP8, unless fc1 quantizes them itself and recompute re-runs it.
  if (flow.fp8_experts && (flow.quantize_once || !recompute))
    add(fp8_rowwise(rows * H));
  else
    t.push_back({1, rows * H, a});
  if (flow.probs_in_experts) t.push_back({1, rows, 4});  // the probs that travel with the rows
  // SwiGLU's output, fc2's input.
  if (flow.fp8_experts)
    add(fp8_rowwise(rows * F));
  else
    t.push_back({1, rows * F, a});
  if (!flow.probs_in_experts) t.push_back({1, rows * H, a});  // fc2's output, for the probs' gradient at combine
  if (c.n_shared_experts > 0) add(swiglu_mlp_tensors(tokens, F * double(c.n_shared_experts), a));
  return t;
}

// The config keys that drive the estimate: the largest parameter groups and, when activations
// weigh, the batch.
std::string driver_keys(const std::vector<ParamGroup>& groups, double activation_share) {
  std::vector<std::string> keys = {"model.hidden_size", "model.num_hidden_layers"};
  const double total = total_elements(groups);
  if (num_elements(groups, {Role::routed_expert}) >= 0.25 * total) {
    keys.push_back("model.n_routed_experts");
    keys.push_back("model.moe_intermediate_size");
  }
  if (num_elements(groups, {Role::dense_mlp}) >= 0.25 * total) keys.push_back("model.intermediate_size");
  if (num_elements(groups, {Role::embedding}) >= 0.25 * total) keys.push_back("model.vocab_size");
  if (activation_share >= 0.25) {
    keys.push_back("train.batch_size");
    keys.push_back("data.seq_len");
  }
  std::string out;
  for (size_t i = 0; i < keys.size(); ++i) out += (i == 0 ? "" : i + 1 == keys.size() ? " or " : ", ") + keys[i];
  return out;
}

// What one micro-batch's gradients take: 4 P, f32, one per parameter. A sharded optimizer without gradient
// accumulation releases them bucket by bucket (parallel/grad_reducer.h): 4 P / N of segments, plus the buckets in
// flight and the one filling, each 25 MiB or the largest tensor (never more than 4 P). When a gradient is added
// to one already held (train.grad_accum_steps > 1, a tied embedding's second use), the sum is a new tensor
// beside the held and the incoming one: + 8 x the largest parameter tensor. The GPU's weight gradients come as
// bf16 before their cast to f32: + 2 x the largest.
double gradient_bytes(const Config& cfg, const std::vector<ParamGroup>& groups, bool gpu,
                      const OptimizerShards& shards) {
  const bool accumulates = cfg.train.grad_accum_steps > 1 || cfg.model.tie_word_embeddings;
  const double largest = largest_tensor(groups);
  double bytes = per_parameter_bytes(groups, 4, gpu);
  // Accumulating micro-batches hold whole gradients until the last one's backward.
  if (shards.any() && cfg.train.grad_accum_steps == 1) {
    double kept = 0;
    for (const ParamGroup& g : groups) {
      const double ranks = shard_ranks(g, shards);
      kept += allocated_bytes({{g.count, g.elements / ranks, 4}}, gpu);
    }
    const double bucket = std::max(double(kGradientBucketBytes), 4 * largest);
    bytes = std::min(bytes, kept + double(GradientReducer::kBucketsInFlight + 1) * allocation_bytes(bucket, gpu));
  }
  if (accumulates) bytes += 2 * allocation_bytes(4 * largest, gpu);  // the incoming gradient and the sum
  if (gpu) bytes += allocation_bytes(2 * largest, gpu);              // a bf16 gradient before its cast
  return bytes;
}

// MemAvailable (kB) from /proc/meminfo; -1 when the file or the line is absent.
double meminfo_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    double kib = -1;
    fields >> kib;
    return kib >= 0 ? kib * 1024 : -1;
  }
  return -1;
}

// "(weights 2.0 MiB, optimizer 3.9 MiB, gradients 2.0 MiB, activations 23 MiB)"; an evaluation has
// no optimizer or gradient term.
std::string breakdown(const MemoryEstimate& e) {
  std::string s = "(weights " + format_bytes(e.weight_bytes);
  if (e.optimizer_bytes > 0) s += ", optimizer " + format_bytes(e.optimizer_bytes);
  if (e.gradient_bytes > 0) s += ", gradients " + format_bytes(e.gradient_bytes);
  return s + ", activations " + format_bytes(e.activation_bytes) + ")";
}

std::string one_decimal_or_whole(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, v < 99.95 ? "%.1f" : "%.0f", v);
  return buf;
}

}  // namespace

int64_t count_parameters(const ModelConfig& cfg) { return saturate(total_elements(parameter_groups(cfg))); }

std::string format_bytes(double bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return std::to_string(int64_t(std::max(0.0, bytes))) + " B";
  size_t u = 0;
  while (bytes >= 1024 && u + 1 < std::size(units)) {
    bytes /= 1024;
    ++u;
  }
  return one_decimal_or_whole(bytes) + " " + units[u];
}

std::string format_count(double count) {
  char buf[48];
  if (count < 1e9)
    std::snprintf(buf, sizeof buf, "%.2fM", count / 1e6);
  else if (count < 1e12)
    std::snprintf(buf, sizeof buf, "%.2fB", count / 1e9);
  else
    std::snprintf(buf, sizeof buf, "%.3gT", count / 1e12);
  return buf;
}

std::string MemoryEstimate::summary() const { return "about " + format_bytes(total_bytes()) + " " + breakdown(*this); }

// optimizer: 8 P, AdamW's exp_avg and exp_avg_sq, f32 beside every parameter (train/optimizer.cpp), or 4 P in
// bf16 (optimizer.moment_dtype); a sharded optimizer's rank keeps 1/N of each.
// activations: what the autograd graph of one micro-batch keeps for backward: per block the attention half
// (attention_tensors) and a dense MLP (swiglu_mlp_tensors) or an MoE layer (moe_tensors); the head, 2 N H a (the
// last block's output and its norm), logits N V a and, from the start of backward, their gradient N V a (or, when
// larger, a block's recomputed attention tensors: train.recompute attention); each MTP module adds its inputs'
// tensors, its block's and a head's.
// Evaluation keeps no graph: weights, and the larger of one block's and the head's tensors.
MemoryEstimate estimate_memory(const Config& cfg, Device device, MemoryUse use, const OptimizerShards& shards) {
  const ModelConfig& c = cfg.model;
  // What this rank holds: its share of the routed experts under expert parallelism.
  std::vector<ParamGroup> groups = parameter_groups(c);
  const double expert_share = 1.0 / double(std::max<int64_t>(1, cfg.parallel.expert_parallel_size));
  for (ParamGroup& g : groups)
    if (g.role == Role::routed_expert) g.elements *= expert_share;
  const bool gpu = device.is_cuda();
  const double a = double(dtype_size(compute_dtype_for(device)));
  const double tokens = double(cfg.train.batch_size) * double(cfg.data.seq_len);
  const double moe_layers = double(num_moe_layers(c)), dense_layers = double(c.num_hidden_layers) - moe_layers;

  MemoryEstimate e;
  e.num_parameters = count_parameters(c);  // the whole model's, whatever this rank holds
  e.weight_bytes = weight_bytes(cfg, groups, gpu, use, shards);

  const bool recompute_attention = use == MemoryUse::train && cfg.train.recomputes("attention");
  const double attention = allocated_bytes(attention_tensors(c, tokens, a, gpu, recompute_attention), gpu);
  // What one block's recomputed branch holds again while its backward runs (only one block's at a time).
  const double recomputed =
      recompute_attention ? allocated_bytes(attention_tensors(c, tokens, a, gpu, false), gpu) - attention : 0;
  const double dense = attention + allocated_bytes(swiglu_mlp_tensors(tokens, double(c.intermediate_size), a), gpu);
  const double moe = moe_layers > 0 ? attention + allocated_bytes(moe_tensors(cfg, tokens, a, gpu), gpu) : 0;
  const double logits = allocated_bytes({{1, tokens * double(c.vocab_size), a}}, gpu);
  // The last block's output and its norm, the logits, their logsumexp, the ids and the targets.
  const double head = logits + allocated_bytes({{2, tokens * double(c.hidden_size), a}, {3, tokens, 4}}, gpu);
  if (use == MemoryUse::train) {
    const double moment_bytes = 2.0 * double(dtype_size(cfg.optimizer.moment_dtype));
    for (const ParamGroup& g : groups) {
      const double ranks = shard_ranks(g, shards);
      e.optimizer_bytes += allocated_bytes({{g.count, g.elements / ranks, moment_bytes}}, gpu);
    }
    e.gradient_bytes = gradient_bytes(cfg, groups, gpu, shards);
    e.activation_bytes = dense_layers * dense + moe_layers * moe + head + std::max(logits, recomputed);
    // Each MTP module: the shifted embedding, both norms, their concatenation (2 H) and eh_proj's output, 6 N H a;
    // its block; its head's tensors as the model's.
    if (c.num_nextn_predict_layers > 0)
      e.activation_bytes +=
          double(c.num_nextn_predict_layers) * (allocated_bytes({{6, tokens * double(c.hidden_size), a}}, gpu) +
                                                (num_mtp_moe_layers(c) > 0 ? moe : dense) + head);
  } else {
    e.activation_bytes = std::max({dense_layers > 0 ? dense : 0.0, moe, head});
  }
  e.drivers = driver_keys(groups, e.activation_bytes / e.total_bytes());
  return e;
}

double available_memory_bytes(Device device) {
  if (device.is_cuda()) {
    // Blocks the caching allocator holds but does not use are free for this run too.
    const MemoryStats s = memory_stats(device);
    return double(cuda_free_memory(device.index)) + double(s.reserved_bytes - s.live_bytes);
  }
  const double meminfo = meminfo_available_bytes();
  if (meminfo >= 0) return meminfo;
  return double(sysconf(_SC_AVPHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
}

void check_fits(const MemoryEstimate& need, double available_bytes, const std::string& device_name) {
  if (need.total_bytes() <= available_bytes) return;
  throw ConfigError("the model needs about " + format_bytes(need.total_bytes()) + " " + breakdown(need) + " but " +
                    device_name + " has " + format_bytes(available_bytes) + " available; reduce " + need.drivers);
}

void check_fits(const MemoryEstimate& need, Device device) {
  check_fits(need, available_memory_bytes(device), device.str());
}

}  // namespace flowmoe
