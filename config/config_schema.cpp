// The config schema (see config_schema.h): the key table, messages that name a key's type and the
// nearest known name, and the type- and range-checked parsing of one value.
#include "config/config_schema.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "engine/ops/router.h"
#include "kernels/common/error.h"
#include "kernels/router.h"
#include "layers/moe.h"
#include "parallel/dispatch.h"
#include "parallel/distributed.h"

namespace flowmoe::config_schema {

namespace {

// Builders of schema rows; what the messages and the scalar parsing use.

const double kInf = INFINITY;

#define FLOWMOE_CONFIG_REF(member) [](Config& c) -> FieldRef { return &c.member; }

Field integer(const char* s, const char* k, std::function<FieldRef(Config&)> r, double lo, double hi, const char* doc) {
  return Field{s, k, Kind::integer, lo, hi, false, false, {}, doc, std::move(r)};
}
Field optional_integer(const char* s, const char* k, std::function<FieldRef(Config&)> r, double lo, double hi,
                       const char* doc) {
  return Field{s, k, Kind::optional_integer, lo, hi, false, false, {}, doc, std::move(r)};
}
Field number(const char* s, const char* k, std::function<FieldRef(Config&)> r, double lo, bool lo_open, double hi,
             bool hi_open, const char* doc) {
  return Field{s, k, Kind::number, lo, hi, lo_open, hi_open, {}, doc, std::move(r)};
}
Field boolean(const char* s, const char* k, std::function<FieldRef(Config&)> r, const char* doc) {
  return Field{s, k, Kind::boolean, 0, 0, false, false, {}, doc, std::move(r)};
}
Field string(const char* s, const char* k, std::function<FieldRef(Config&)> r, const char* doc) {
  return Field{s, k, Kind::string, 0, 0, false, false, {}, doc, std::move(r)};
}
Field choice_list(const char* s, const char* k, std::function<FieldRef(Config&)> r, std::vector<std::string> choices,
                  const char* doc) {
  return Field{s, k, Kind::choice_list, 0, 0, false, false, std::move(choices), doc, std::move(r)};
}
Field choice(const char* s, const char* k, std::function<FieldRef(Config&)> r, std::vector<std::string> choices,
             const char* doc) {
  return Field{s, k, Kind::choice, 0, 0, false, false, std::move(choices), doc, std::move(r)};
}

Field dtype(const char* s, const char* k, std::function<FieldRef(Config&)> r, std::vector<DType> choices,
            const char* doc) {
  std::vector<std::string> names;
  for (DType t : choices) names.push_back(dtype_name(t));
  return Field{s, k, Kind::dtype, 0, 0, false, false, std::move(names), doc, std::move(r)};
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string fmt_bound(double v) {
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (v == std::floor(v) && std::fabs(v) < 1e16) return std::to_string(int64_t(v));
  std::ostringstream os;
  os << v;
  return os.str();
}

bool parse_int(const std::string& s, int64_t& out) {
  if (s.empty()) return false;
  const char* b = s.data();
  const char* e = s.data() + s.size();
  if (*b == '+') ++b;
  auto r = std::from_chars(b, e, out);
  return r.ec == std::errc() && r.ptr == e;
}

bool parse_double(const std::string& s, double& out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  out = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() && errno == 0 && std::isfinite(out);
}

bool parse_bool(const std::string& s, bool& out) {
  if (s == "true" || s == "True" || s == "TRUE") return out = true, true;
  if (s == "false" || s == "False" || s == "FALSE") return out = false, true;
  return false;
}

}  // namespace

// ---- the schema ---------------------------------------------------------------------------------

const std::vector<Field>& schema() {
  static const std::vector<Field> fields = [] {
    std::vector<Field> f;
    // model: Hugging Face DeepSeek-V3 names
    f.push_back(integer("model", "vocab_size", FLOWMOE_CONFIG_REF(model.vocab_size), 2, 65536,
                        "tokens in the vocabulary (token files hold uint16)"));
    f.push_back(integer("model", "hidden_size", FLOWMOE_CONFIG_REF(model.hidden_size), 1, 65536,
                        "width of the residual stream"));
    f.push_back(integer("model", "num_hidden_layers", FLOWMOE_CONFIG_REF(model.num_hidden_layers), 1, 1024,
                        "transformer blocks"));
    f.push_back(integer("model", "num_attention_heads", FLOWMOE_CONFIG_REF(model.num_attention_heads), 1, 1024,
                        "attention heads; must divide hidden_size, head size even (RoPE)"));
    f.push_back(integer("model", "intermediate_size", FLOWMOE_CONFIG_REF(model.intermediate_size), 1, 1 << 20,
                        "width of the dense SwiGLU MLP"));
    f.push_back(integer("model", "max_position_embeddings", FLOWMOE_CONFIG_REF(model.max_position_embeddings), 1,
                        1 << 20, "longest sequence; data.seq_len must not exceed it"));
    f.push_back(
        number("model", "rms_norm_eps", FLOWMOE_CONFIG_REF(model.rms_norm_eps), 0, true, 1, true, "RMSNorm epsilon"));
    f.push_back(number("model", "rope_theta", FLOWMOE_CONFIG_REF(model.rope_theta), 0, true, kInf, false, "RoPE base"));
    f.push_back(boolean("model", "tie_word_embeddings", FLOWMOE_CONFIG_REF(model.tie_word_embeddings),
                        "the LM head reuses the token embedding"));
    f.push_back(number("model", "initializer_range", FLOWMOE_CONFIG_REF(model.initializer_range), 0, true, 1, false,
                       "std of the normal weight init"));
    // The router's limits (kernels/router.h): its CUDA kernel routes a token in one warp, holding at most 8
    // expert scores per lane in registers, so the CPU reference and the config refuse the same beyond them.
    f.push_back(integer("model", "n_routed_experts", FLOWMOE_CONFIG_REF(model.n_routed_experts), 0, kRouterMaxExperts,
                        "routed experts per MoE layer; 0 = dense model; at most 256, DeepSeek-V3's count (the "
                        "router routes a token in one warp, 8 experts per lane)"));
    f.push_back(integer("model", "n_shared_experts", FLOWMOE_CONFIG_REF(model.n_shared_experts), 0, 64,
                        "shared experts per MoE layer"));
    f.push_back(integer("model", "num_experts_per_tok", FLOWMOE_CONFIG_REF(model.num_experts_per_tok), 1,
                        kRouterMaxTopk, "routed experts per token (top-k)"));
    f.push_back(integer("model", "moe_intermediate_size", FLOWMOE_CONFIG_REF(model.moe_intermediate_size), 1, 1 << 20,
                        "width of each expert's SwiGLU MLP"));
    f.push_back(integer("model", "first_k_dense_replace", FLOWMOE_CONFIG_REF(model.first_k_dense_replace), 0, 1024,
                        "the first k blocks keep a dense MLP"));
    f.push_back(integer("model", "n_group", FLOWMOE_CONFIG_REF(model.n_group), 1, kRouterMaxGroups,
                        "expert groups for group-limited routing"));
    f.push_back(integer("model", "topk_group", FLOWMOE_CONFIG_REF(model.topk_group), 1, kRouterMaxGroups,
                        "groups a token may route to"));
    f.push_back(choice("model", "scoring_func", FLOWMOE_CONFIG_REF(model.scoring_func), enum_names(kRouterScoringNames),
                       "router score function"));
    f.push_back(boolean("model", "norm_topk_prob", FLOWMOE_CONFIG_REF(model.norm_topk_prob),
                        "normalise the top-k probabilities"));
    f.push_back(number("model", "routed_scaling_factor", FLOWMOE_CONFIG_REF(model.routed_scaling_factor), 0, true, kInf,
                       false, "scale of the routed experts' output"));
    f.push_back(number("model", "aux_loss_alpha", FLOWMOE_CONFIG_REF(model.aux_loss_alpha), 0, false, kInf, false,
                       "weight of the sequence-wise balance loss"));
    f.push_back(number("model", "bias_update_rate", FLOWMOE_CONFIG_REF(model.bias_update_rate), 0, false, kInf, false,
                       "aux-loss-free balancing: expert_bias step"));
    f.push_back(
        choice("model", "bias_update_schedule", FLOWMOE_CONFIG_REF(model.bias_update_schedule), {"constant", "lr"},
               "constant: every step moves expert_bias by bias_update_rate (DeepSeek-V3); lr: by bias_update_rate * "
               "lr(step) / optimizer.lr, so the bias step follows the learning-rate schedule"));
    f.push_back(choice(
        "model", "bias_update_rule", FLOWMOE_CONFIG_REF(model.bias_update_rule), enum_names(kBiasUpdateRuleNames),
        "sign: each step moves expert_bias by the bias step toward the mean load (DeepSeek-V3); proportional: by the "
        "bias step * (mean - load) / mean, so near-balanced experts barely move and overloaded ones move more"));
    f.push_back(choice("model", "attention", FLOWMOE_CONFIG_REF(model.attention), enum_names(kAttentionTypeNames),
                       "mha: multi-head attention; mla: DeepSeek-V3's multi-head latent attention (the keys below)"));
    f.push_back(optional_integer("model", "q_lora_rank", FLOWMOE_CONFIG_REF(model.q_lora_rank), 1, 65536,
                                 "mla: the query bottleneck's width; null: one direct query projection"));
    f.push_back(integer("model", "kv_lora_rank", FLOWMOE_CONFIG_REF(model.kv_lora_rank), 1, 65536,
                        "mla: the width of the latent each token's keys and values come from"));
    f.push_back(integer("model", "qk_nope_head_dim", FLOWMOE_CONFIG_REF(model.qk_nope_head_dim), 1, 1024,
                        "mla: each head's query/key part without RoPE"));
    f.push_back(integer("model", "qk_rope_head_dim", FLOWMOE_CONFIG_REF(model.qk_rope_head_dim), 2, 1024,
                        "mla: each head's query/key part with RoPE (even; the key's part shared by the heads)"));
    f.push_back(
        integer("model", "v_head_dim", FLOWMOE_CONFIG_REF(model.v_head_dim), 1, 1024, "mla: each head's value width"));
    f.push_back(integer("model", "num_nextn_predict_layers", FLOWMOE_CONFIG_REF(model.num_nextn_predict_layers), 0,
                        kMaxMtpDepth,
                        "multi-token prediction depth D (DeepSeek-V3): modules after the model trained to predict "
                        "the tokens 2..D+1 ahead; 0: none"));
    // data
    f.push_back(choice("data", "source", FLOWMOE_CONFIG_REF(data.source), {"synthetic", "text", "tokens"},
                       "synthetic (built in, no download), text (bytes of files), tokens (llm.c .bin file)"));
    f.push_back(string("data", "path", FLOWMOE_CONFIG_REF(data.path),
                       "text: a file or a directory of files; tokens: a .bin token file (relative paths: from the "
                       "working directory)"));
    f.push_back(
        integer("data", "seq_len", FLOWMOE_CONFIG_REF(data.seq_len), 2, 1 << 20, "tokens per training sequence"));
    f.push_back(number("data", "val_fraction", FLOWMOE_CONFIG_REF(data.val_fraction), 0, false, 0.5, false,
                       "tail of the corpus held out for validation; 0 disables evaluation"));
    f.push_back(integer("data", "seed", FLOWMOE_CONFIG_REF(data.seed), 0, 9.0e15,
                        "seed of the synthetic corpus and of the batch order"));
    f.push_back(integer("data", "synthetic_tokens", FLOWMOE_CONFIG_REF(data.synthetic_tokens), 1024, 1 << 30,
                        "size of the synthetic corpus"));
    f.push_back(choice("data", "synthetic_kind", FLOWMOE_CONFIG_REF(data.synthetic_kind), {"words", "bigram"},
                       "which synthetic corpus: words (a low-entropy word chain, fast convergence checks) or bigram "
                       "(BPE-like token statistics: MoE load balance and precision parity)"));
    // train
    f.push_back(choice("train", "device", FLOWMOE_CONFIG_REF(train.device), {"auto", "cpu", "cuda"},
                       "auto: the GPU when one is present, else the CPU"));
    f.push_back(integer("train", "steps", FLOWMOE_CONFIG_REF(train.steps), 1, 1e12, "optimizer steps"));
    f.push_back(integer("train", "batch_size", FLOWMOE_CONFIG_REF(train.batch_size), 1, 1 << 20,
                        "sequences per micro-batch over all processes; each reads batch_size / processes"));
    f.push_back(integer("train", "grad_accum_steps", FLOWMOE_CONFIG_REF(train.grad_accum_steps), 1, 1 << 20,
                        "micro-batches per optimizer step"));
    f.push_back(integer("train", "eval_every", FLOWMOE_CONFIG_REF(train.eval_every), 0, 1e12,
                        "steps between validation passes; 0: only at the end"));
    f.push_back(integer("train", "sample_every", FLOWMOE_CONFIG_REF(train.sample_every), 0, 1e12,
                        "steps between greedy samples: rank 0 prints the first 8 tokens of the first validation "
                        "window and 32 greedy tokens after them (token ids without a tokenizer); 0: none"));
    f.push_back(integer("train", "eval_batches", FLOWMOE_CONFIG_REF(train.eval_batches), 1, 1 << 20,
                        "micro-batches per validation pass"));
    f.push_back(integer("train", "seed", FLOWMOE_CONFIG_REF(train.seed), 0, 9.0e15, "seed of the weight init"));
    f.push_back(choice("train", "nonfinite", FLOWMOE_CONFIG_REF(train.nonfinite), {"skip", "stop"},
                       "on a non-finite loss or gradient: skip the step, or stop with an error"));
    f.push_back(choice_list("train", "recompute", FLOWMOE_CONFIG_REF(train.recompute), {"moe_expert", "attention"},
                            "modules recomputed in backward: moe_expert keeps only the expert input (FP8 in fp8_flow) "
                            "and recomputes fc1 and SwiGLU; attention keeps only each block's input and recomputes "
                            "its norm, q/k/v, RoPE, attention and output projection. The same gradients bit for bit"));
    f.push_back(number("train", "mtp_loss_weight", FLOWMOE_CONFIG_REF(train.mtp_loss_weight), 0, false, kInf, false,
                       "lambda of the multi-token prediction loss: training minimizes loss + lambda * mtp_loss "
                       "(with model.num_nextn_predict_layers > 0)"));
    f.push_back(integer("train", "max_skipped_steps", FLOWMOE_CONFIG_REF(train.max_skipped_steps), 0, 1e12,
                        "with nonfinite: skip, stop after this many skipped steps"));
    f.push_back(choice("train", "cuda_graph", FLOWMOE_CONFIG_REF(train.cuda_graph), {"auto", "on", "off"},
                       "capture the training step once as a CUDA graph and replay it: auto where the step "
                       "makes no host synchronisation (a GPU per process, one process or collectives over "
                       "nccl, any recipe), on requires it"));
    // optimizer (AdamW, warmup then cosine)
    f.push_back(number("optimizer", "lr", FLOWMOE_CONFIG_REF(optimizer.lr), 0, true, 10, false, "peak learning rate"));
    f.push_back(number("optimizer", "min_lr", FLOWMOE_CONFIG_REF(optimizer.min_lr), 0, false, 10, false,
                       "learning rate at the end of the cosine decay"));
    f.push_back(integer("optimizer", "warmup_steps", FLOWMOE_CONFIG_REF(optimizer.warmup_steps), 0, 1e12,
                        "linear warmup steps"));
    f.push_back(number("optimizer", "weight_decay", FLOWMOE_CONFIG_REF(optimizer.weight_decay), 0, false, 10, false,
                       "decoupled weight decay on matrices"));
    f.push_back(number("optimizer", "beta1", FLOWMOE_CONFIG_REF(optimizer.beta1), 0, false, 1, true, "AdamW beta1"));
    f.push_back(number("optimizer", "beta2", FLOWMOE_CONFIG_REF(optimizer.beta2), 0, false, 1, true, "AdamW beta2"));
    f.push_back(number("optimizer", "eps", FLOWMOE_CONFIG_REF(optimizer.eps), 0, true, 1, false, "AdamW epsilon"));
    f.push_back(number("optimizer", "grad_clip", FLOWMOE_CONFIG_REF(optimizer.grad_clip), 0, false, kInf, false,
                       "max global gradient norm; 0 disables clipping"));
    f.push_back(number("optimizer", "router_lr_scale", FLOWMOE_CONFIG_REF(optimizer.router_lr_scale), 0, false, 10,
                       false,
                       "multiplies the learning rate of the MoE routers' gate weights (*.mlp.gate.weight); 1 trains "
                       "them like every other matrix"));
    f.push_back(dtype("optimizer", "moment_dtype", FLOWMOE_CONFIG_REF(optimizer.moment_dtype),
                      {DType::f32, DType::bf16},
                      "AdamW's exp_avg and exp_avg_sq (and the checkpoint's copy of them): bf16 halves their memory "
                      "(DeepSeek-V3's optimizer state), updated in f32 and rounded back stochastically; a "
                      "checkpoint of either resumes under either"));
    // precision
    f.push_back(
        choice("precision", "recipe", FLOWMOE_CONFIG_REF(precision.recipe), enum_names(kMoeRecipeNames),
               "GEMM precision: bf16 (fp32 on CPU); fp8_blockwise (the routed experts' GEMMs in FP8, each quantizing "
               "its own inputs); fp8_flow (quantize once before dispatch, FP8 through the experts); fp8_full "
               "(fp8_flow, and the attention projections, dense MLPs and shared experts in FP8 too; the embedding, "
               "routers, norms, attention core and LM head stay). fp8_blockwise and fp8_flow need MoE layers; the "
               "FP8 recipes need hidden_size and the FP8 GEMMs' widths (moe_intermediate_size; fp8_full also "
               "intermediate_size) multiples of 128, fp8_full also data.seq_len a multiple of 16. Master weights and "
               "gradients stay fp32"));
    Field align{"precision",
                "align_size",
                Kind::int_choice,
                0,
                0,
                false,
                false,
                {"16", "32", "64", "128"},
                "row alignment of each expert's segment",
                FLOWMOE_CONFIG_REF(precision.align_size)};
    f.push_back(align);
    f.push_back(choice("precision", "param_dtype", FLOWMOE_CONFIG_REF(precision.param_dtype), {"auto", "f32"},
                       "the dtype the model's weights are kept in: auto stores those the forward reads in bf16 (on "
                       "GPUs) in bf16, written once per step by AdamW from its f32 masters; f32 keeps f32 weights and "
                       "casts them at each use. The same losses either way"));
    f.push_back(choice("precision", "fp8_weights", FLOWMOE_CONFIG_REF(precision.fp8_weights),
                       enum_names(kFp8WeightWriterNames),
                       "who writes the FP8 copies of the FP8 GEMMs' weights: forward quantizes each once per "
                       "optimizer step, at its first use; optimizer has AdamW write them in its update (sharded, "
                       "the all-gather moves them in place of the weights). The same losses either way; no effect "
                       "under bf16 (docs/DESIGN.md §7)"));
    // parallel
    f.push_back(integer("parallel", "expert_parallel_size", FLOWMOE_CONFIG_REF(parallel.expert_parallel_size), 1, 4096,
                        "ranks per expert-parallel group, each holding n_routed_experts / this of the routed experts; "
                        "must divide the number of processes"));
    f.push_back(choice("parallel", "backend", FLOWMOE_CONFIG_REF(parallel.backend), enum_names(kCommBackendNames),
                       "collectives between ranks; auto: none for one process, nccl on GPUs, mpi on the CPU; nccl "
                       "asked for by name in one process runs the several-rank step on one GPU (the gradient "
                       "reducer and the sharded optimizer through NCCL)"));
    f.push_back(choice("parallel", "ep_dispatch", FLOWMOE_CONFIG_REF(parallel.ep_dispatch),
                       enum_names(kEpDispatchNames),
                       "the expert-parallel token exchange: sync reads the per-expert counts to the host once per "
                       "MoE layer; zero_sync keeps them on the device (worst-case receive buffers; nccl writes rows "
                       "into the peers' GPUs); auto: zero_sync for a group of 2 load/store-reachable GPUs, sync "
                       "otherwise (docs/PERF.md)"));
    f.push_back(choice("parallel", "shared_expert_overlap", FLOWMOE_CONFIG_REF(parallel.shared_expert_overlap),
                       {"auto", "on", "off"},
                       "run the shared experts on a second CUDA stream beside dispatch, the routed experts and "
                       "combine, forward and backward (the same results); auto: on where experts are sharded "
                       "over several ranks, whose exchange it hides"));
    f.push_back(integer("parallel", "exchange_chunks", FLOWMOE_CONFIG_REF(parallel.exchange_chunks), 1, 64,
                        "with the zero-sync exchange: each MoE layer splits its tokens into this many chunks and "
                        "issues them so that one chunk's exchange runs on a communication stream beside another "
                        "chunk's experts, forward and backward; 1: all tokens at once (no effect without it)"));
    f.push_back(integer("parallel", "exchange_sms", FLOWMOE_CONFIG_REF(parallel.exchange_sms), 0, 1024,
                        "with exchange_chunks > 1 or dual_microbatch on GPUs: SMs the expert GEMMs leave free for "
                        "the exchange kernels, which keep to them (the put and the copy-out take 4 blocks on each); "
                        "0: the GEMMs take all"));
    f.push_back(number("parallel", "ep_capacity_factor", FLOWMOE_CONFIG_REF(parallel.ep_capacity_factor), 0, false,
                       1024, false,
                       "with the zero-sync exchange: each receive buffer holds this many times an even load's rows "
                       "(plus pad rows) instead of the worst case; a step that needs more is run again with larger "
                       "buffers, nothing dropped; 0: the worst case"));
    f.push_back(boolean("parallel", "dual_microbatch", FLOWMOE_CONFIG_REF(parallel.dual_microbatch),
                        "a training step runs its batch as two halves interleaved layer by layer, so that one half's "
                        "expert exchange travels beside the other half's attention and experts (zero_sync); the "
                        "per-rank batch must be even"));
    f.push_back(boolean("parallel", "overlap_grad_reduce", FLOWMOE_CONFIG_REF(parallel.overlap_grad_reduce),
                        "reduce each 25 MiB gradient bucket as soon as the backward has finished it (on a stream "
                        "of its own with nccl), not after the backward; the same sums either way"));
    f.push_back(integer("parallel", "grad_reduce_sms", FLOWMOE_CONFIG_REF(parallel.grad_reduce_sms), 0, 1024,
                        "nccl, overlap_grad_reduce: the thread blocks (SMs) the gradient reduction's kernels may "
                        "take beside the backward; 0: as many as nccl chooses. `overlap_grad_reduce: false` "
                        "reduces under the same bound, so that both give the same sums bit for bit"));
    f.push_back(boolean("parallel", "shard_optimizer", FLOWMOE_CONFIG_REF(parallel.shard_optimizer),
                        "each data-parallel rank keeps AdamW's moments and f32 master weights for, the gradient of "
                        "and updates 1/N of the weights (gradients reduce-scattered and the rest released, weights "
                        "all-gathered: bf16 on the GPU, the FP8 GEMMs' weights in f32, or as their FP8 copies under "
                        "precision.fp8_weights: optimizer), so the optimizer "
                        "state costs 8/N bytes per parameter, the "
                        "masters 4/N and the gradients 4/N; false keeps a full copy on every rank"));
    f.push_back(number("parallel", "timeout_s", FLOWMOE_CONFIG_REF(parallel.timeout_s), 0, false, 604800, false,
                       "several processes: a rank that has waited this many seconds in one collective (or for a "
                       "step's collectives on the GPUs) ends the job with an error naming it and the collective, "
                       "so a rank that stopped answering does not hang the others forever; waiting for rank 0's "
                       "checkpoint write is not timed; 0: wait forever"));
    // checkpoint
    f.push_back(string("checkpoint", "dir", FLOWMOE_CONFIG_REF(checkpoint.dir),
                       "where checkpoints go; empty: <logging.out_dir>/checkpoints"));
    f.push_back(integer("checkpoint", "every", FLOWMOE_CONFIG_REF(checkpoint.every), 0, 1e12,
                        "steps between checkpoints; 0: only the final one"));
    f.push_back(boolean("checkpoint", "final", FLOWMOE_CONFIG_REF(checkpoint.final),
                        "a checkpoint at the last step; false leaves it out (a timing run), not a stop's"));
    f.push_back(integer("checkpoint", "keep_last", FLOWMOE_CONFIG_REF(checkpoint.keep_last), 1, 1e6,
                        "checkpoints kept; older ones are deleted"));
    Field resume{"checkpoint",
                 "resume",
                 Kind::bool_or_path,
                 0,
                 0,
                 false,
                 false,
                 {},
                 "false, true (the latest checkpoint in dir) or the path of a checkpoint directory",
                 FLOWMOE_CONFIG_REF(checkpoint.resume)};
    f.push_back(resume);
    f.push_back(boolean("checkpoint", "partial_load", FLOWMOE_CONFIG_REF(checkpoint.partial_load),
                        "loading (resume, eval, fp8-error) leaves out the checkpoint's tensors the model does not "
                        "have, for fine-tuning a smaller model; false refuses them, naming them"));
    f.push_back(boolean("checkpoint", "allow_nonfinite", FLOWMOE_CONFIG_REF(checkpoint.allow_nonfinite),
                        "loading accepts weights and moments holding NaN or Inf; false refuses them, naming the "
                        "tensor"));
    f.push_back(string("checkpoint", "init_from", FLOWMOE_CONFIG_REF(checkpoint.init_from),
                       "hf:DIR: a fresh run starts from the weights of a Hugging Face glm4_moe folder (flowmoe "
                       "export --format hf writes one), whose config.json must describe the model; a resume takes "
                       "its checkpoint's instead; empty: the seeded init"));
    // logging
    f.push_back(string("logging", "out_dir", FLOWMOE_CONFIG_REF(logging.out_dir),
                       "run outputs (resolved config, metrics); empty: runs/<config file name>"));
    f.push_back(choice("logging", "metrics_format", FLOWMOE_CONFIG_REF(logging.metrics_format), {"jsonl", "csv"},
                       "metrics file format"));
    f.push_back(integer("logging", "log_every", FLOWMOE_CONFIG_REF(logging.log_every), 1, 1e12,
                        "steps between plain progress lines"));
    f.push_back(choice("logging", "progress", FLOWMOE_CONFIG_REF(logging.progress), {"auto", "bar", "plain"},
                       "auto: a progress bar when one process writes to a terminal, plain lines otherwise and "
                       "under mpirun or srun (a rank cannot tell what the launcher's output is)"));
    return f;
  }();
  return fields;
}

const std::vector<std::string>& sections() {
  static const std::vector<std::string> s = {"model",     "data",     "train",      "optimizer",
                                             "precision", "parallel", "checkpoint", "logging"};
  return s;
}

const Field* find_field(const std::string& section, const std::string& key) {
  for (const Field& f : schema())
    if (f.section == section && f.key == key) return &f;
  return nullptr;
}

// ---- messages -----------------------------------------------------------------------------------

// " (did you mean 'x'?)" for the closest candidate within a small distance, else "".
std::string suggestion(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = 3;
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, c);
    if (d < best_d) best_d = d, best = c;
  }
  return best.empty() ? "" : " (did you mean '" + best + "'?)";
}

std::string describe_type(const Field& f) {
  switch (f.kind) {
    case Kind::integer:
      return "an integer in [" + fmt_bound(f.lo) + ", " + fmt_bound(f.hi) + "]";
    case Kind::optional_integer:
      return "null or an integer in [" + fmt_bound(f.lo) + ", " + fmt_bound(f.hi) + "]";
    case Kind::number:
      return std::string("a number in ") + (f.lo_open ? "(" : "[") + fmt_bound(f.lo) + ", " + fmt_bound(f.hi) +
             (f.hi_open || std::isinf(f.hi) ? ")" : "]");
    case Kind::boolean:
      return "true or false";
    case Kind::string:
      return "a string";
    case Kind::bool_or_path:
      return "true, false or a path";
    case Kind::choice_list: {
      std::string s = "a list of ";
      for (size_t i = 0; i < f.choices.size(); ++i) s += (i ? ", " : "") + f.choices[i];
      return s + " (possibly empty: [])";
    }
    case Kind::choice:
    case Kind::int_choice:
    case Kind::dtype: {
      std::string s = "one of ";
      for (size_t i = 0; i < f.choices.size(); ++i) s += (i ? ", " : "") + f.choices[i];
      return s;
    }
  }
  return "?";
}

[[noreturn]] void fail(const std::string& where, const std::string& key, const std::string& msg) {
  throw ConfigError(where + ": " + (key.empty() ? "" : key + ": ") + msg);
}

// ---- one value ----------------------------------------------------------------------------------

// Parses `text` into the field, checking type and range; `where` names the origin in messages.
void set_field(Config& cfg, const Field& f, const std::string& text, const std::string& where) {
  const std::string key = f.dotted();
  auto bad = [&](const std::string& got_what) {
    fail(where, key, "expected " + describe_type(f) + ", got " + got_what);
  };
  FieldRef ref = f.ref(cfg);
  // The string keys name paths (data.path, checkpoint.dir and .resume, logging.out_dir), and the OS
  // reads a path up to its first NUL byte: "runs/a\0b" would write into runs/a.
  const size_t nul = text.find('\0');
  if ((f.kind == Kind::string || f.kind == Kind::bool_or_path) && nul != std::string::npos) {
    std::string shown = where;  // a --set's origin holds the value: its NULs would cut the message short
    for (size_t at = shown.find('\0'); at != std::string::npos; at = shown.find('\0', at)) shown.replace(at, 1, "\\0");
    fail(shown, key, "a path cannot hold a NUL byte (one at byte " + std::to_string(nul) + ")");
  }
  switch (f.kind) {
    case Kind::integer: {
      int64_t v = 0;
      if (!parse_int(text, v)) bad("'" + text + "'");
      if (double(v) < f.lo || double(v) > f.hi) bad(text);
      *std::get<int64_t*>(ref) = v;
      break;
    }
    case Kind::optional_integer: {
      int64_t v = 0;
      if (text != "" && text != "null" && text != "~") {
        if (!parse_int(text, v)) bad("'" + text + "'");
        if (double(v) < f.lo || double(v) > f.hi) bad(text);
      }
      *std::get<int64_t*>(ref) = v;
      break;
    }
    case Kind::number: {
      double v = 0;
      if (!parse_double(text, v)) bad("'" + text + "'");
      bool below = f.lo_open ? v <= f.lo : v < f.lo;
      bool above = f.hi_open ? v >= f.hi : v > f.hi;
      if (below || above) bad(text);
      *std::get<double*>(ref) = v;
      break;
    }
    case Kind::boolean: {
      bool v = false;
      if (!parse_bool(text, v)) bad("'" + text + "'");
      *std::get<bool*>(ref) = v;
      break;
    }
    case Kind::string:
      *std::get<std::string*>(ref) = text;
      break;
    case Kind::choice:
      if (std::find(f.choices.begin(), f.choices.end(), text) == f.choices.end())
        bad("'" + text + "'" + suggestion(text, f.choices));
      if (auto* a = std::get_if<AttentionType*>(&ref)) {
        if (!enum_from_name(kAttentionTypeNames, text, *a)) bad("'" + text + "'");
      } else if (auto* w = std::get_if<Fp8WeightWriter*>(&ref)) {
        if (!enum_from_name(kFp8WeightWriterNames, text, *w)) bad("'" + text + "'");
      } else {
        *std::get<std::string*>(ref) = text;
      }
      break;
    case Kind::dtype:
      if (std::find(f.choices.begin(), f.choices.end(), text) == f.choices.end() ||
          !dtype_from_name(text, std::get<DType*>(ref)))
        bad("'" + text + "'" + suggestion(text, f.choices));
      break;
    case Kind::int_choice: {
      int64_t v = 0;
      if (!parse_int(text, v) || std::find(f.choices.begin(), f.choices.end(), std::to_string(v)) == f.choices.end())
        bad("'" + text + "'");
      *std::get<int64_t*>(ref) = v;
      break;
    }
    case Kind::choice_list: {
      // Stored comma-joined; accepts "[a, b]", "a,b", "a" and "[]" (the YAML list arrives joined).
      std::string body = text;
      if (!body.empty() && body.front() == '[') {
        if (body.back() != ']') bad("'" + text + "'");
        body = body.substr(1, body.size() - 2);
      }
      std::string joined;
      std::stringstream ss(body);
      for (std::string item; std::getline(ss, item, ',');) {
        item.erase(0, item.find_first_not_of(" \t"));
        item.erase(item.find_last_not_of(" \t") + 1);
        if (item.empty()) continue;
        if (std::find(f.choices.begin(), f.choices.end(), item) == f.choices.end())
          bad("'" + item + "'" + suggestion(item, f.choices));
        joined += (joined.empty() ? "" : ",") + item;
      }
      *std::get<std::string*>(ref) = joined;
      break;
    }
    case Kind::bool_or_path: {
      bool b = false;
      if (text.empty()) bad("an empty value");
      *std::get<std::string*>(ref) = parse_bool(text, b) ? (b ? "true" : "false") : text;
      break;
    }
  }
  cfg.origins[key] = where;
}

std::string field_value(const Config& cfg, const Field& f) {
  FieldRef ref = f.ref(const_cast<Config&>(cfg));
  if (auto* i = std::get_if<int64_t*>(&ref))
    return f.kind == Kind::optional_integer && **i == 0 ? "null" : std::to_string(**i);
  if (auto* a = std::get_if<AttentionType*>(&ref)) return attention_type_name(**a);
  if (auto* w = std::get_if<Fp8WeightWriter*>(&ref)) return fp8_weight_writer_name(**w);
  if (auto* b = std::get_if<bool*>(&ref)) return **b ? "true" : "false";
  if (auto* s = std::get_if<std::string*>(&ref)) return **s;
  if (auto* t = std::get_if<DType*>(&ref)) return dtype_name(**t);
  double d = *std::get<double*>(ref);
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d);  // shortest form that reads back exactly
  std::string s(buf, r.ptr);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

}  // namespace flowmoe::config_schema
