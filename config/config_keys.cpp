// The config schema's key table (see config_schema.h): every key's section, type, range, default and
// documentation, in the order of docs/TRAINING.md; config_schema.cpp checks and stores one value against it.
#include "config/config_schema.h"

#include <cmath>
#include <utility>

#include "engine/ops/router.h"
#include "kernels/router.h"
#include "layers/moe.h"
#include "parallel/dispatch.h"
#include "parallel/distributed.h"

namespace flowmoe::config_schema {

namespace {

// Builders of schema rows.

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
// A choice held as an enum: its choices are the names in `table`, in order.
template <class E, size_t N>
Field choice(const char* s, const char* k, std::type_identity_t<E& (*)(Config&)> member, const EnumName<E> (&table)[N],
             const char* doc) {
  return choice(
      s, k, [member, &table](Config& c) -> FieldRef { return enum_ref(&member(c), table); }, enum_names(table), doc);
}
#define FLOWMOE_CONFIG_ENUM(member) \
  [](Config & c) -> auto& { return c.member; }

Field dtype(const char* s, const char* k, std::function<FieldRef(Config&)> r, std::vector<DType> choices,
            const char* doc) {
  std::vector<std::string> names;
  for (DType t : choices) names.push_back(dtype_name(t));
  return Field{s, k, Kind::dtype, 0, 0, false, false, std::move(names), doc, std::move(r)};
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
    f.push_back(choice("model", "scoring_func", FLOWMOE_CONFIG_ENUM(model.scoring_func), kRouterScoringNames,
                       "router score function"));
    f.push_back(boolean("model", "norm_topk_prob", FLOWMOE_CONFIG_REF(model.norm_topk_prob),
                        "normalise the top-k probabilities"));
    f.push_back(number("model", "routed_scaling_factor", FLOWMOE_CONFIG_REF(model.routed_scaling_factor), 0, true, kInf,
                       false, "scale of the routed experts' output"));
    f.push_back(number("model", "aux_loss_alpha", FLOWMOE_CONFIG_REF(model.aux_loss_alpha), 0, false, kInf, false,
                       "weight of the sequence-wise balance loss"));
    f.push_back(number("model", "bias_update_rate", FLOWMOE_CONFIG_REF(model.bias_update_rate), 0, false, kInf, false,
                       "aux-loss-free balancing: expert_bias step"));
    f.push_back(choice(
        "model", "bias_update_schedule", FLOWMOE_CONFIG_ENUM(model.bias_update_schedule), kBiasUpdateScheduleNames,
        "constant: every step moves expert_bias by bias_update_rate (DeepSeek-V3); lr: by bias_update_rate * "
        "lr(step) / optimizer.lr, so the bias step follows the learning-rate schedule"));
    f.push_back(choice(
        "model", "bias_update_rule", FLOWMOE_CONFIG_ENUM(model.bias_update_rule), kBiasUpdateRuleNames,
        "sign: each step moves expert_bias by the bias step toward the mean load (DeepSeek-V3); proportional: by the "
        "bias step * (mean - load) / mean, so near-balanced experts barely move and overloaded ones move more"));
    f.push_back(choice("model", "attention", FLOWMOE_CONFIG_ENUM(model.attention), kAttentionTypeNames,
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
    f.push_back(choice("model", "attention_kernel", FLOWMOE_CONFIG_ENUM(model.attention_kernel), kAttentionBackendNames,
                       "the attention core's GPU kernels (bf16): auto, cudnn where the build has it and cuDNN takes "
                       "the shape, else flash; cudnn, cuDNN's fused flash attention (a build with cuDNN: "
                       "scripts/install_cudnn.sh; 1.5-2.4x flash on an H100); flash, flowmoe's own kernels"));
    f.push_back(integer("model", "num_nextn_predict_layers", FLOWMOE_CONFIG_REF(model.num_nextn_predict_layers), 0,
                        kMaxMtpDepth,
                        "multi-token prediction depth D (DeepSeek-V3): modules after the model trained to predict "
                        "the tokens 2..D+1 ahead; 0: none"));
    // data
    f.push_back(choice("data", "source", FLOWMOE_CONFIG_ENUM(data.source), kDataSourceNames,
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
    f.push_back(choice("data", "synthetic_kind", FLOWMOE_CONFIG_ENUM(data.synthetic_kind), kSyntheticKindNames,
                       "which synthetic corpus: words (a low-entropy word chain, fast convergence checks) or bigram "
                       "(BPE-like token statistics: MoE load balance and precision parity)"));
    // train
    f.push_back(choice("train", "device", FLOWMOE_CONFIG_ENUM(train.device), kDeviceChoiceNames,
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
    f.push_back(choice("train", "nonfinite", FLOWMOE_CONFIG_ENUM(train.nonfinite), kNonfinitePolicyNames,
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
    f.push_back(choice("train", "cuda_graph", FLOWMOE_CONFIG_ENUM(train.cuda_graph), kAutoOnOffNames,
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
        choice("precision", "recipe", FLOWMOE_CONFIG_ENUM(precision.recipe), kMoeRecipeNames,
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
    f.push_back(choice("precision", "param_dtype", FLOWMOE_CONFIG_ENUM(precision.param_dtype), kParamDtypeNames,
                       "the dtype the model's weights are kept in: auto stores those the forward reads in bf16 (on "
                       "GPUs) in bf16, written once per step by AdamW from its f32 masters; f32 keeps f32 weights and "
                       "casts them at each use. The same losses either way"));
    f.push_back(choice("precision", "fp8_weights", FLOWMOE_CONFIG_ENUM(precision.fp8_weights), kFp8WeightWriterNames,
                       "who writes the FP8 copies of the FP8 GEMMs' weights: optimizer has AdamW write them in its "
                       "update (sharded, the all-gather moves them in place of the weights); forward quantizes each "
                       "once per optimizer step, at its first use. The same losses either way; no effect under bf16 "
                       "(docs/DESIGN.md §7)"));
    f.push_back(choice("precision", "fp8_weight_transpose", FLOWMOE_CONFIG_ENUM(precision.fp8_weight_transpose),
                       kFp8WeightTransposeNames,
                       "whether each FP8 weight's exact transpose, which the dgrad GEMMs read, is kept: stored keeps "
                       "it beside the FP8 weight; rebuilt has the backward rebuild it where dgrad needs it, 1 byte "
                       "per FP8 weight parameter less memory for about 2 more moved per step. The same losses either "
                       "way; no effect under bf16 (docs/DESIGN.md §7)"));
    // parallel
    f.push_back(integer("parallel", "expert_parallel_size", FLOWMOE_CONFIG_REF(parallel.expert_parallel_size), 1, 4096,
                        "ranks per expert-parallel group, each holding n_routed_experts / this of the routed experts; "
                        "must divide the number of processes"));
    f.push_back(choice("parallel", "backend", FLOWMOE_CONFIG_ENUM(parallel.backend), kCommBackendNames,
                       "collectives between ranks; auto: none for one process, nccl on GPUs, mpi on the CPU; nccl "
                       "asked for by name in one process runs the several-rank step on one GPU (the gradient "
                       "reducer and the sharded optimizer through NCCL)"));
    f.push_back(choice("parallel", "ep_dispatch", FLOWMOE_CONFIG_ENUM(parallel.ep_dispatch), kEpDispatchNames,
                       "the expert-parallel token exchange: sync reads the per-expert counts to the host once per "
                       "MoE layer; zero_sync keeps them on the device (worst-case receive buffers; nccl writes rows "
                       "into the peers' GPUs); auto: zero_sync for a group of 2 load/store-reachable GPUs, sync "
                       "otherwise (docs/PERF.md)"));
    f.push_back(choice("parallel", "shared_expert_overlap", FLOWMOE_CONFIG_ENUM(parallel.shared_expert_overlap),
                       kAutoOnOffNames,
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
    f.push_back(choice("logging", "metrics_format", FLOWMOE_CONFIG_ENUM(logging.metrics_format), kMetricsFormatNames,
                       "metrics file format"));
    f.push_back(integer("logging", "log_every", FLOWMOE_CONFIG_REF(logging.log_every), 1, 1e12,
                        "steps between plain progress lines"));
    f.push_back(choice("logging", "progress", FLOWMOE_CONFIG_ENUM(logging.progress), kProgressModeNames,
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

}  // namespace flowmoe::config_schema
