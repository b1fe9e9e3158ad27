// The DeepSeek-style MoE block (DESIGN.md §2) in three recipes on the same code. forward reads top-down: router →
// quantize (fp8_flow) → dispatch (permute+pad; across ranks when the experts are sharded) → experts (fc1 → SwiGLU →
// fc2) → combine (back across ranks; unpermute+unpad) → + shared experts; moe.cpp lists the backward in order
// beside it.
//   bf16:          the rows stay bf16; the probs are applied at the unpermute (fp32 accumulation)
//   fp8_blockwise: each expert GEMM quantizes its own input and re-quantizes its wgrad operands (the classic recipe)
//   fp8_flow:      x quantized once, before dispatch; the experts run FP8 forward and backward (MoeFlow has the detail)
//   fp8_full:      fp8_flow, and the shared experts in FP8 too, reading the same quantized x
//   + shared experts: a dense SwiGLU MLP of width n_shared_experts·F on x (bf16 but in fp8_full).
#pragma once
#include <memory>
#include <string>

#include "engine/fp8_weight.h"
#include "engine/ops/fp8_grouped_linear.h"
#include "engine/ops/grouped_linear.h"
#include "engine/ops/quantize.h"
#include "engine/ops/router.h"
#include "kernels/common/name_table.h"
#include "layers/mlp.h"
#include "layers/model_config.h"
#include "parallel/dispatch.h"

namespace flowmoe {

enum class MoeRecipe { bf16, fp8_blockwise, fp8_flow, fp8_full };
// precision.recipe's names (kernels/common/name_table.h).
inline constexpr EnumName<MoeRecipe> kMoeRecipeNames[] = {{MoeRecipe::bf16, "bf16"},
                                                          {MoeRecipe::fp8_blockwise, "fp8_blockwise"},
                                                          {MoeRecipe::fp8_flow, "fp8_flow"},
                                                          {MoeRecipe::fp8_full, "fp8_full"}};
MoeRecipe moe_recipe_from_name(const std::string& name);  // precision.recipe; throws ConfigError
const char* moe_recipe_name(MoeRecipe r);

struct MoeOptions {
  MoeOptions() = default;
  explicit MoeOptions(int align) : align_size(align) {}  // bf16 at this alignment
  int align_size = 16;                                   // precision.align_size
  MoeRecipe recipe = MoeRecipe::bf16;                    // precision.recipe
  // fc1 → SwiGLU(+quantize) runs inside checkpoint(): forward keeps only the permuted expert input (FP8 with its
  // scales in fp8_flow) and the routing; fc2 keeps its own input.
  bool recompute_expert = false;  // train.recompute contains moe_expert
  // One rank on a GPU: the expert GEMMs (one launch each) and, in the FP8 recipes, the wgrad operands'
  // colwise layouts read the counts on the device (no host sync). false: read them to the host once
  // per layer (per-expert cuBLASLt calls).
  bool device_counts = true;
  // parallel.ep_dispatch: across ranks, the one-sync exchange or the zero-sync one (parallel/dispatch.h);
  // auto resolves in resolve_ep_dispatch, once, when the layer is built.
  EpDispatch ep_dispatch = EpDispatch::automatic;
  // parallel.shared_expert_overlap: the shared experts run on a side stream (engine/stream_lane.h) beside
  // router → dispatch → experts → combine, forward and backward, and join before their sum.
  bool shared_expert_overlap = false;
  // parallel.exchange_chunks: a training forward over the zero-sync exchange splits its tokens into this many
  // chunks, each dispatched and combined on its own, issued so that one chunk's exchange runs on the comm
  // stream (engine/stream_lane.h) beside another chunk's experts. 1: the layer's tokens at once.
  int exchange_chunks = 1;
  // false: the chunks' exchanges (and the dual micro-batches', layers/transformer.h) stay on the compute stream,
  // in the same order (the overlap's reference).
  bool exchange_comm_stream = true;
  // parallel.ep_capacity_factor: a zero-sync receive buffer holds this many times the copies of an even load
  // (and at least exchange_min_rows), not the worst case; 0: the worst case. A step that needs more is void
  // and raises exchange_overflow ([1] i32 on the layer's device, shared by the model's layers): the trainer
  // grows the buffers (exchange_min_rows) and runs it again (parallel/dispatch.h, kernels/step_control.h).
  double ep_capacity_factor = 0;
  int64_t exchange_min_rows = 0;
  Tensor exchange_overflow;
  // The expert-parallel group (parallel/process_group.h): its rank r holds experts
  // [r·E/n, (r+1)·E/n) and tokens travel to them through dispatch and combine. Null or one rank: every
  // expert is local.
  std::shared_ptr<Communicator> expert_parallel;
};

// What a recipe changes in the layer, read from the recipe in one place (moe_flow).
//   fp8_blockwise: as bf16, but each expert GEMM quantizes its own bf16 input (1x128) and re-quantizes its wgrad
//                  operands column-wise from high precision.
//   fp8_flow:      x quantized once, before dispatch; permute+pad moves FP8 data, scales and probs;
//                  FP8 fc1 → SwiGLU×prob+quantize (fused) → FP8 fc2 → unpermute+unpad (no probs);
//                  combine's backward quantizes dy once and the experts' backward stays FP8, with
//                  wgrad operands from the scaling-aware transpose. Two activation casts per layer.
//   fp8_full:      the routed experts as fp8_flow; beside them every other linear but the router and the LM head
//                  runs FP8 (fp8_linear: attention projections, dense MLPs, shared experts; DESIGN.md §7).
struct MoeFlow {
  bool fp8_experts = false;               // FP8 grouped GEMMs for fc1 and fc2 (fp8_blockwise, fp8_flow)
  bool quantize_once = false;             // fp8_flow: x quantized before dispatch, SwiGLU emits FP8, and
                                          // combine's backward quantizes dy once
  bool probs_in_experts = false;          // fp8_flow: probs move with the rows and SwiGLU applies them
  Fp8Wgrad wgrad = Fp8Wgrad::requantize;  // transpose (fp8_flow) or requantize (fp8_blockwise)
  bool fp8_linears = false;               // fp8_full: attention, dense MLPs and shared experts in FP8 as well
};
MoeFlow moe_flow(MoeRecipe r);

// What steps 0-2 of the forward leave for the routed experts: the tokens as [T, H] and their routing.
struct MoeTokens {
  Shape in_shape;   // x's, which the output takes
  Variable x2;      // x as [T, H]
  Variable xq;      // fp8_full: x quantized once, for the shared experts and dispatch alike; else undefined
  Variable tokens;  // what dispatch moves: x2, or x quantized (fp8_flow, fp8_full)
  Variable topk_prob, aux_loss;
  Tensor topk_idx;
};

class MoeLayer {
 public:
  // Parameters (HF names): <prefix>.gate.weight [E,H], <prefix>.experts.fc1.weight [E,2F,H] (gate rows first, then
  // up), <prefix>.experts.fc2.weight [E,H,F] (this rank's [L,...] rows when sharded),
  // <prefix>.shared_experts.{gate,up,down}_proj.
  MoeLayer(ParamFactory& f, const ModelConfig& cfg, const std::string& prefix, const MoeOptions& options,
           Device device);
  // Reads the per-expert counts to the host once per forward, in dispatch: cuBLASLt needs each expert's M, and
  // across ranks the transfers need their sizes. Not at all on one GPU (any recipe: the one-launch GEMMs and the
  // FP8 wgrad operands' colwise layouts read the counts on the device), nor across ranks on GPUs with ep_dispatch
  // zero_sync.
  // xq: under fp8_full, x already quantized (e4m3 [T, H] with rowwise scales, the block's fused norm emits it,
  // counting its cast at input_site()); undefined: the layer quantizes x itself where its recipe does. -> [..., H].
  Variable forward(const Variable& x /*[..., H]*/, DType compute, const Variable& xq = Variable()) const;
  static const char* input_site() { return "dispatch: x"; }  // where x's quantize before dispatch is counted

  // forward's stages, in order (moe.cpp), which the schedules (layers/moe_schedule.h) issue:
  //   take_tokens         x as [T, H], and fp8_full's quantize of x
  //   0. shared_forward   the shared experts (undefined without them)
  //   1. route, 2. quantize
  //   3. dispatch_tokens  buffers sized for tokens_per_rank tokens
  //   4. experts
  //   5. return_rows, then unpermute
  //   6. add_shared
  MoeTokens take_tokens(const Variable& x /*[..., H]*/, const Variable& xq) const;
  Variable shared_forward(const MoeTokens& t, DType compute) const;
  void route(MoeTokens& t) const;
  void quantize(MoeTokens& t) const;
  Dispatched dispatch_tokens(const MoeTokens& t, int64_t tokens_per_rank) const;
  Variable experts(const Dispatched& d) const;
  Variable return_rows(const Variable& out_rows, const Dispatched& d) const;
  Variable unpermute(const Variable& returned, const Dispatched& d, const MoeTokens& t) const;   // -> [T, H]
  Variable add_shared(const MoeTokens& t, Variable y /*[T, H]*/, const Variable& shared) const;  // -> [..., H]
  const MoeOptions& options() const { return options_; }

  // The balance loss of the last forward (undefined when aux_loss_alpha == 0).
  const Variable& aux_loss() const { return aux_loss_; }
  // expert_bias is a buffer, not a parameter (aux-loss-free balancing): each update moves it by ±bias_update_rate
  // toward the mean load, or by bias_update_rate times the relative load error (model.bias_update_rule:
  // proportional).
  // After an optimizer step: move expert_bias toward balance using the counts of every training
  // forward (grad enabled: evaluations do not count) since the last call, at bias_update_rate times the
  // rate scale the optimizer step's scalars give (on the layer's device, no host sync: 0 on a skipped
  // step, lr / peak lr under model.bias_update_schedule: lr). Returns the loads it used ([E] i32, the
  // layer's device) for the metrics to read later.
  Tensor update_bias(const StepScalars* control);
  // The per-expert counts update_bias() will use ([E] i32, shared storage): data parallelism sums
  // them over the ranks in place first, so every rank moves its bias by the global load.
  const Tensor& load_counts() const { return tokens_since_update_; }
  // Named <prefix>.gate.e_score_correction_bias (as HF); no gradient, saved in checkpoints.
  const Variable& expert_bias() const { return expert_bias_; }
  // The token chunks of a training forward (MoeOptions::exchange_chunks where the exchange is zero_sync, else 1).
  int num_chunks() const { return num_chunks_; }
  // Whether a training forward exchanges without host syncs (MoeOptions::ep_dispatch as resolved here).
  bool zero_sync() const { return zero_sync_; }
  // MoeOptions::ep_capacity_factor, exchange_min_rows and exchange_overflow, set by the trainer.
  void set_exchange_buffers(double capacity_factor, int64_t min_rows, const Tensor& overflow) {
    options_.ep_capacity_factor = capacity_factor;
    options_.exchange_min_rows = min_rows;
    options_.exchange_overflow = overflow;
  }
  // The shared experts' MLP (null when n_shared_experts is 0).
  const Mlp* shared_experts() const { return shared_.get(); }

 private:
  Variable experts(const Variable& rows, const Variable& probs, const ExpertCounts& dispatched) const;
  DispatchOptions dispatch_options(int64_t num_tokens) const;

  RouterConfig router_;
  int64_t num_experts_, intermediate_;
  int64_t num_local_experts_, expert_offset_;  // this rank's experts: [offset, offset + num_local)
  MoeOptions options_;
  MoeFlow flow_;
  bool zero_sync_ = false;            // options_.ep_dispatch resolved for this layer's group (training forwards)
  int num_chunks_ = 1;                // options_.exchange_chunks where the exchange is zero_sync, else 1
  Fp8WeightCache fc1_fp8_, fc2_fp8_;  // expert weights quantized once per optimizer step (engine/fp8_weight.h)
  double bias_update_rate_;
  BiasUpdateRule bias_update_rule_;
  Variable gate_, fc1_, fc2_;
  std::unique_ptr<Mlp> shared_;
  Variable expert_bias_;                // [E] f32, on the layer's device; requires no grad
  mutable Tensor tokens_since_update_;  // [E] i32: counts summed over forwards since update_bias()
  mutable Variable aux_loss_;
};

// The rows of the permuted buffer for num_tokens tokens: the worst case (permute_worst_case_rows),
// rounded up to a multiple of kFp8RowMultiple for the FP8 recipes (their GEMMs' leading dimension over the whole
// buffer, in wgrad).
int64_t moe_permuted_rows(int64_t num_tokens, int top_k, int num_experts, int align_size, MoeRecipe recipe);

// y unchanged; its backward quantizes dy once (rowwise 1x128, counted as one cast at "combine backward: dy"), so
// that fp8_flow's gradient rows and scales travel as FP8 from combine all the way to fc2's dgrad.
Variable combine_grad_to_fp8(const Variable& y /*[T, H], combine's output*/);

// RouterConfig from the model config's HF keys.
RouterConfig router_config(const ModelConfig& cfg);

}  // namespace flowmoe
