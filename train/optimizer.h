// AdamW on fp32 master weights, with its moments in fp32 or bf16 beside them (optimizer.moment_dtype), the
// warmup-then-cosine learning-rate schedule and global-norm gradient clipping. The math is kernels/adamw.h; this
// class gathers the parameters into one multi-tensor update and picks the CPU or CUDA launcher by device;
// global_grad_norm hands its squared sums to the ranks' reduction (parallel/data_parallel.h).
#pragma once
#include <memory>
#include <utility>
#include <vector>

#include "config/config.h"
#include "engine/autograd.h"
#include "engine/fp8_weight.h"
#include "kernels/adamw.h"
#include "kernels/adamw_fp8.h"
#include "kernels/step_control.h"
#include "parallel/param_shard.h"
#include "parallel/process_group.h"

namespace flowmoe {

// Learning rate for optimizer step `step` (1-based) of `total_steps`: linear warmup from lr/warmup
// to lr over warmup_steps, then cosine decay to min_lr at total_steps.
double learning_rate(const OptimizerConfig& o, int64_t step, int64_t total_steps);
// The schedule, clipping and betas of kernels/step_control.h from the optimizer config (the trainer adds
// the micro-batch count, the balance loss and the expert-bias schedule).
StepSchedule step_schedule(const OptimizerConfig& o, int64_t total_steps);
// The factor that brings a gradient of global norm `norm` down to `max_norm` (1 when within it or
// when max_norm is 0).
double clip_scale(double norm, double max_norm);

class AdamW {
 public:
  // Parameters must be f32 leaves (bf16 ones too with masters, below). Weight decay applies to matrices
  // (dim >= 2) only. A parameter named *.mlp.gate.weight (an MoE router) steps with lr * cfg.router_lr_scale.
  //
  // ranges, when given (parallel/grad_reducer.h, parallel.shard_optimizer): this rank updates the elements
  // [ranges[i].first, ranges[i].second) of parameter i's flat data alone and keeps moments for them alone
  // (1-D tensors of that many elements, zeroed); an empty range leaves the parameter to other ranks. Their
  // gradients are not the parameters' but set_range_grads()'s. The squared norms then cover the ranges, so
  // they are this rank's share of a sum over its group. Without ranges every parameter is whole.
  //
  // masters (precision.param_dtype, parallel/grad_reducer.h): per parameter the f32 master weights of its range
  // (1-D, the range's length: the whole parameter without ranges), or undefined where the parameter is its own
  // master (f32) or its range is empty. A parameter with a master is the model's copy (f32, or bf16 where the
  // forward computes in it): AdamW updates the master and writes the parameter's elements of the range from it,
  // in the parameter's dtype (kernels/adamw.h, WeightCopy).
  //
  // The moments are of cfg.moment_dtype; bf16 ones are rounded stochastically from a hash of the rounding seed
  // (set_rounding_seed), the update count, the parameter's index here and the element's index in the parameter,
  // so ranges round as whole parameters do.
  AdamW(std::vector<Variable> params, const OptimizerConfig& cfg,
        const std::vector<std::pair<int64_t, int64_t>>& ranges = {}, std::vector<Tensor> masters = {});

  // Global L2 norm of all gradients (a missing gradient counts as zero); NaN or inf when any
  // gradient is not finite. Deterministic; one host synchronisation.
  double grad_norm();
  // The squared norms of two classes of gradients: {unflagged, flagged} by one flag per parameter
  // (empty: none flagged), each summed in parameter order; the same host synchronisation. Expert
  // parallelism adds the flagged class over the expert-parallel group before the square root.
  std::pair<double, double> grad_square_sums(const std::vector<bool>& flagged);
  // The same two sums left on the device (CUDA parameters only): a [2] f32 tensor whose values are
  // valid once the engine stream reaches them (expert parallelism all-reduces its flagged entry over
  // the expert-parallel group there); no host synchronisation. It is overwritten by the next call.
  Tensor grad_square_sums_device(const std::vector<bool>& flagged);
  // One update of every parameter that has a gradient, with g = grad_scale * grad.
  void step(double lr, double grad_scale);
  // One update with the step's scalars (kernels/step_control.h) as the parameters' device sees them
  // (device memory for CUDA parameters, host memory for CPU ones): nothing moves unless control->apply.
  // The host's num_updates() is not advanced: the caller sets it once it has read the scalars.
  void step(const StepScalars* control);
  // Clears the parameters' gradients and the ranges'.
  void zero_grad();

  bool sharded() const { return sharded_; }                        // built with ranges
  const std::vector<Tensor>& masters() const { return masters_; }  // as built (empty: none)
  // Sharded: per parameter, the gradient of its range (1-D f32 of the range's length on the parameters'
  // device; undefined: none this step, the range is left alone), until zero_grad().
  void set_range_grads(std::vector<Tensor> grads);
  // The moments of the ranges from full ones (a checkpoint's, of the parameters' shapes, on any device).
  // The moments' dtype must be theirs (a checkpoint converts on load: checkpoint/checkpoint.h).
  void load_moment_ranges(const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq);
  // Per parameter, the FP8 copy the forward reads in its place (engine/fp8_weight.h, ParamShard::fp8; null: none, an
  // empty list: none at all). A parameter this rank updates whole whose copy is current for it then steps in
  // adamw_fp8 (kernels/adamw_fp8.h): the update writes the copy too and marks it current for the new version, so
  // the next forward quantizes nothing. A copy that is not current (no forward yet since the weight moved) is left
  // to the forward, which quantizes it once. Sharded, the copies are the reducer's gathered ones
  // (GradientReducer::gathered_fp8_copies): the update writes the data and scales of its range's block rows, and
  // the gather moves them and marks the copies current.
  void set_fp8_copies(std::vector<std::shared_ptr<Fp8WeightCopy>> copies);
  // Marks current again the copies the last update wrote, whose weights' versions have moved since without a
  // change of values: a replayed CUDA graph runs that update again on the device (train.cuda_graph).
  void mark_fp8_copies_current() const;
  // bf16 moments' rounding seed (the run's train.seed; 0 until set).
  void set_rounding_seed(uint64_t seed) { rounding_seed_ = seed; }
  DType moment_dtype() const { return cfg_.moment_dtype; }

  int64_t num_updates() const { return num_updates_; }  // the t of the bias corrections
  int64_t num_router_params() const;                    // parameters stepped with router_lr_scale
  void set_num_updates(int64_t t) { num_updates_ = t; }
  const std::vector<Variable>& params() const { return params_; }
  std::vector<Tensor>& exp_avg() { return exp_avg_; }  // the params' shapes and devices (sharded: the ranges)
  std::vector<Tensor>& exp_avg_sq() { return exp_avg_sq_; }
  const std::vector<Tensor>& exp_avg() const { return exp_avg_; }
  const std::vector<Tensor>& exp_avg_sq() const { return exp_avg_sq_; }

 private:
  std::vector<Variable> params_;
  std::vector<Tensor> exp_avg_, exp_avg_sq_;
  std::vector<bool> decay_;
  std::vector<bool> router_;  // per parameter: an MoE router's gate, stepped with lr * router_lr_scale
  std::vector<std::pair<int64_t, int64_t>> ranges_;  // per parameter: the flat elements this rank updates
  std::vector<Tensor> range_grads_;                  // sharded: their gradients (set_range_grads)
  std::vector<Tensor> masters_;                      // optional: the ranges' f32 master weights
  bool sharded_ = false;
  OptimizerConfig cfg_;
  int64_t num_updates_ = 0;
  uint64_t rounding_seed_ = 0;
  std::vector<std::shared_ptr<Fp8WeightCopy>> fp8_;  // per parameter, or empty (set_fp8_copies)
  std::vector<size_t> fp8_written_;                  // the parameters whose copies the last update wrote
  Tensor norm_slots_, norm_total_, partials_;        // CUDA scratch for the reduction: two classes of slots, two totals
  // One step's update: a multi-tensor table (kernels/adamw.h) of every parameter that has a gradient and elements
  // here, each with its step's base (betas, eps, weight decay) and lr multiplier; the gradients it points into,
  // kept alive until the update is queued; the parameters' indices, whose versions the update bumps.
  // Those whose FP8 copies the update writes go in fp8_tensors (fp8_params: their indices) instead.
  struct Update {
    std::vector<AdamWTensor> tensors;
    std::vector<AdamWFp8Tensor> fp8_tensors;
    std::vector<size_t> fp8_params;
    std::vector<Tensor> grads;
    std::vector<size_t> params;
  };
  Update update_tensors() const;
  // Runs u on the parameters' device (control: the step's scalars, host or device memory as adamw_multi_cpu or
  // adamw_multi_cuda reads them, or null for steps given in u), then bumps the updated parameters' versions.
  void apply(const Update& u, const StepScalars* control);
  // Parameter i's gradient over its range, contiguous (the whole parameter's unsharded), or undefined when it has
  // none this step.
  Tensor range_grad(size_t i) const;
};

// The global norm of the synced gradients, the same on every rank: opt.grad_norm() at expert-parallel size 1
// without sharding (bit for bit); otherwise opt's squared sums split by expert shard (expert_shard_flags) and
// summed over the groups (parallel/data_parallel.h, global_norm).
double global_grad_norm(const ParallelState& ps, AdamW& opt, const std::vector<ParamShard>& shards);

}  // namespace flowmoe
