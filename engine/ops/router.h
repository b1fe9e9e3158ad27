// The MoE router (DeepSeek-V3 "noaux_tc"), DESIGN.md §2: logits = x·Wrᵀ → sigmoid (or softmax) →
// group-limited top-k on score + expert_bias → topk_idx [T,k] i32, topk_prob [T,k] (normalized,
// × routed_scaling_factor), tokens_per_expert [E] i32. Plus the aux-loss-free bias update, the
// optional sequence-wise balance loss and per-layer load statistics.
// Kernels: kernels/router.h. Tests: tests/test_router.cpp.
#pragma once
#include <string>
#include <vector>

#include "engine/autograd.h"
#include "kernels/common/name_table.h"
#include "kernels/router.h"  // BiasUpdateRule, RouterScoring

namespace flowmoe {

struct RouterConfig {
  int num_experts = 0;                                  // n_routed_experts
  int top_k = 0;                                        // num_experts_per_tok
  int n_group = 1;                                      // n_group: experts form n_group contiguous groups
  int topk_group = 1;                                   // topk_group: groups kept per token
  RouterScoring scoring_func = RouterScoring::sigmoid;  // scoring_func (names: kRouterScoringNames)
  bool norm_topk_prob = true;                           // norm_topk_prob (applied only when top_k > 1, as HF)
  double routed_scaling_factor = 1.0;                   // routed_scaling_factor
  double aux_loss_alpha = 0.0;                          // aux_loss_alpha: 0 disables the balance loss
  int seq_len = 0;                                      // tokens per sequence for the balance loss; 0: see route()
};

// A RouterConfig that cannot route. keys() are the HF names of the keys involved, the one at fault
// first (several when their values conflict); detail() is the message without the key, so a config
// file can report it at its own key names. what() is "<key>: <detail>", or detail() for a conflict.
class RouterConfigError : public ConfigError {
 public:
  RouterConfigError(std::vector<std::string> keys, const std::string& detail, const std::string& key_prefix,
                    const char* file = nullptr, int line = 0);
  const std::vector<std::string>& keys() const { return keys_; }
  const std::string& detail() const { return detail_; }

 private:
  std::vector<std::string> keys_;
  std::string detail_;
};

// The one check of a router config: throws RouterConfigError when it cannot route: E % n_group,
// topk_group <= n_group, top_k <= E and top_k <= topk_group * E / n_group, the scales,
// and the kernel limits kRouterMaxExperts, kRouterMaxTopk and kRouterMaxGroups (kernels/router.h),
// which hold on CPU too so both backends accept the same configs. key_prefix goes before the keys a
// message names ("model." for the YAML config, whose checks call this).
void validate_router_config(const RouterConfig& cfg, const std::string& key_prefix = "");

struct RouterOutput {
  Tensor topk_idx;           // [T, k] i32, global expert ids, best first (ties: lower id)
  Variable topk_prob;        // [T, k] f32 (f64 when routing f64 on the CPU); differentiable
  Tensor tokens_per_expert;  // [E] i32, on the logits' device
  Variable aux_loss;         // shape {}, alpha * L_Bal; undefined when aux_loss_alpha == 0
};

// x [T, H] or [B, S, H]; weight [E, H]; expert_bias [E] f32 (undefined means zeros). The GEMM runs in
// the dtype of x and weight (pass f32 for fp32 router logits, as HF does) and its result is cast to f32.
// The balance loss treats the tokens as sequences of cfg.seq_len; with seq_len 0 it takes S from a
// 3-d x, else all T tokens form one sequence. Gradients reach x and weight through topk_prob (with the
// selection held fixed) and through aux_loss; expert_bias gets none.
RouterOutput route(const Variable& x, const Variable& weight, const Tensor& expert_bias, const RouterConfig& cfg);
// The same from precomputed logits [T, E] (f32, bf16 is cast to f32; f64 on the CPU for gradient checks).
RouterOutput route_logits(const Variable& logits, const Tensor& expert_bias, const RouterConfig& cfg);
// alpha * L_Bal for a given selection (differentiable w.r.t. logits only); cfg.seq_len 0 = one sequence.
Variable router_balance_loss(const Variable& logits /*[T,E]*/, const Tensor& topk_idx /*[T,k] i32*/,
                             const RouterConfig& cfg);

// Aux-loss-free balancing, in place on the bias's device with no host sync:
// expert_bias_e += rate * sign(mean_load - load_e) (equal load: unchanged), or with rule proportional
// rate * (mean_load - load_e) / mean_load. tokens_per_expert i32 [E]; no tokens: nothing moves.
void update_expert_bias(Tensor& expert_bias, const Tensor& tokens_per_expert, double rate,
                        BiasUpdateRule rule = BiasUpdateRule::sign);
// The same at rate × control->bias_rate_scale, read where the bias lives (control points to that
// device's memory; host memory for a CPU bias): the optimizer step's scalars (kernels/step_control.h),
// so a skipped step moves nothing and the host need not know yet.
void update_expert_bias(Tensor& expert_bias, const Tensor& tokens_per_expert, double rate, BiasUpdateRule rule,
                        const StepScalars* control);
// model.scoring_func's names.
inline constexpr EnumName<RouterScoring> kRouterScoringNames[] = {{RouterScoring::sigmoid, "sigmoid"},
                                                                  {RouterScoring::softmax, "softmax"}};
// model.bias_update_rule's names.
inline constexpr EnumName<BiasUpdateRule> kBiasUpdateRuleNames[] = {{BiasUpdateRule::sign, "sign"},
                                                                    {BiasUpdateRule::proportional, "proportional"}};
// total += counts (i32 [E], same device): sums the counts of several micro-batches before one update.
void add_tokens_per_expert(Tensor& total, const Tensor& counts);

struct LoadStats {
  int64_t total = 0;         // routed copies (T * k)
  int64_t max_load = 0;      // tokens on the busiest expert
  int64_t min_load = 0;      // tokens on the idlest expert
  double mean_load = 0;      // total / E
  double max_over_mean = 0;  // max_load / mean_load (1 = perfect balance; 0 when no tokens)
};
// Reads tokens_per_expert to the host: this synchronises with the device. Call it once per layer per
// logged step, where the metrics are written, never inside the forward.
LoadStats load_stats(const Tensor& tokens_per_expert);
// The same from counts already on the host.
LoadStats load_stats(const std::vector<int64_t>& tokens_per_expert);

}  // namespace flowmoe
