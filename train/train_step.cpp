// One optimizer step of the training loop (see train_step.h).
#include "train/train_step.h"

#include <chrono>
#include <cmath>

#include "engine/allocator.h"
#include "engine/profiler.h"
#include "kernels/common/device_api.h"
#include "kernels/common/error.h"
#include "train/data_parallel.h"

namespace flowmoe {

namespace {

// The step's losses, averaged over its micro-batches.
struct StepLosses {
  double lm = 0;         // the language-model loss
  double aux = NAN;      // the MoE balance loss; NaN when the model has none
  bool has_aux = false;  // kept apart from aux: a balance loss that went non-finite is still one
};

// Forward and backward over this rank's slices of the step's micro-batches; the gradients accumulate
// in the parameters. Each micro-batch's loss is the mean over its tokens, weighted 1/grad_accum_steps.
StepLosses run_micro_batches(TrainRun& run) {
  const int64_t num_micro_batches = run.cfg.train.grad_accum_steps;
  StepLosses out;
  double loss_sum = 0, aux_sum = 0;
  for (int64_t a = 0; a < num_micro_batches; ++a) {
    Batch b = run.data.next_train(run.cfg.train.batch_size, run.rank, run.world_size);
    const Transformer::Losses parts = run.model.losses(b.inputs, b.targets);
    const Variable loss = parts.total();
    loss_sum += double(parts.lm.data().to_floats()[0]);
    if (parts.aux.defined()) {
      out.has_aux = true;
      aux_sum += double(parts.aux.data().to_floats()[0]);
    }
    (num_micro_batches > 1 ? scale(loss, 1.0 / double(num_micro_batches)) : loss).backward();
  }
  // The LM loss and the balance loss are logged apart; training minimizes their sum.
  out.lm = loss_sum / double(num_micro_batches);
  out.aux = out.has_aux ? aux_sum / double(num_micro_batches) : NAN;
  return out;
}

// The gradient sync point: the ranks' gradients become the global batch's (data_parallel.h); at world
// size 1 they are already complete.
void sync_gradients(TrainRun& run) {
  if (run.world_size > 1) all_reduce_gradients(run.parallel, run.model.parameters(), run.model.parameter_shards());
}

// The step's losses as the means over the ranks (each slice holds as many tokens) and whether any
// rank saw a non-finite objective or gradient norm: all ranks then skip (or stop) together.
bool agree_on_losses(TrainRun& run, StepMetrics& m, bool has_aux) {
  const double objective = m.loss + (has_aux ? m.aux_loss : 0.0);
  const bool finite = std::isfinite(objective) && std::isfinite(m.grad_norm);
  if (run.world_size == 1) return finite;
  const std::vector<double> sums =
      all_reduce_values(*run.world, {m.loss, has_aux ? m.aux_loss : 0.0, finite ? 0.0 : 1.0}, ReduceOp::sum);
  m.loss = sums[0] / double(run.world_size);
  if (has_aux) m.aux_loss = sums[1] / double(run.world_size);
  return sums[2] == 0;
}

// "step 7: non-finite loss (nan, balance loss 0.01)" or "step 7: non-finite gradients (grad norm inf)".
std::string describe_non_finite(const StepMetrics& m, bool has_aux, double objective) {
  const std::string what =
      std::isfinite(objective)
          ? "gradients (grad norm " + std::to_string(m.grad_norm) + ")"
          : "loss (" + std::to_string(m.loss) + (has_aux ? ", balance loss " + std::to_string(m.aux_loss) : "") + ")";
  return "step " + std::to_string(m.step) + ": non-finite " + what;
}

// train.nonfinite: stop ends the run with a checkpoint; skip goes on until too many steps were skipped.
void apply_non_finite_policy(TrainRun& run, const std::string& what) {
  const TrainConfig& tc = run.cfg.train;
  if (tc.nonfinite == "stop") {
    // The update was not applied: the checkpoint holds the weights of the last good step, and a
    // --resume continues after the batch that failed.
    save_run_checkpoint(run, run.step);
    FLOWMOE_THROW(Error, what, "; stopping because train.nonfinite is 'stop' (", run.cfg.origin("train.nonfinite"),
                  "); the weights before this step are in ", run.res.last_checkpoint,
                  ". Lower optimizer.lr, raise optimizer.warmup_steps, or set train.nonfinite: skip");
  }
  if (run.skipped > tc.max_skipped_steps)
    FLOWMOE_THROW(Error, what, "; ", run.skipped, " steps skipped so far, more than train.max_skipped_steps = ",
                  tc.max_skipped_steps, ": the run is diverging. Lower optimizer.lr or raise warmup_steps");
  run.progress.message(what + ": update skipped (" + std::to_string(run.skipped) + " of at most " +
                       std::to_string(tc.max_skipped_steps) + ")");
}

// The clipped AdamW update, applied only when the loss and the gradients are finite on every rank.
void update_weights(TrainRun& run, StepMetrics& m, bool has_aux, bool all_finite) {
  const double objective = m.loss + (has_aux ? m.aux_loss : 0.0);
  if (all_finite) {
    run.opt.step(m.lr, clip_scale(m.grad_norm, run.cfg.optimizer.grad_clip));
    return;
  }
  m.skipped = true;
  ++run.skipped;
  apply_non_finite_policy(run, describe_non_finite(m, has_aux, objective));
}

// Aux-loss-free balancing: every MoE layer moves its expert bias toward the mean load, by
// bias_update_rate, or (schedule lr) by bias_update_rate * lr / optimizer.lr.
void update_expert_bias(TrainRun& run, StepMetrics& m) {
  const Config& cfg = run.cfg;
  const double bias_scale = cfg.model.bias_update_schedule != "lr" ? 1.0
                            : cfg.optimizer.lr > 0                 ? m.lr / cfg.optimizer.lr
                                                                   : 0.0;
  // Every rank moves its bias by the loads of the global batch.
  if (run.world_size > 1) all_reduce_flat(*run.world, run.model.moe_load_counts(), ReduceOp::sum);
  // A skipped step moves nothing, the expert bias included (rate 0); its loads are still logged.
  for (const LoadStats& ls : run.model.update_moe_bias(m.skipped ? 0.0 : bias_scale))
    m.moe_max_over_mean.push_back(ls.max_over_mean);
}

}  // namespace

StepMetrics train_step(TrainRun& run) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  const uint64_t syncs_before = num_host_syncs();
  reset_cast_counts();
  Communicator* exchanges = run.parallel.expert_parallel_size > 1 ? run.parallel.expert_parallel.get() : nullptr;
  if (exchanges) exchanges->take_exchange_ms();  // an evaluation's exchanges are not this step's
  StepMetrics m;
  m.step = ++run.step;
  m.lr = learning_rate(run.cfg.optimizer, m.step, run.cfg.train.steps);
  run.opt.zero_grad();
  const StepLosses losses = run_micro_batches(run);
  m.loss = losses.lm;
  m.aux_loss = losses.aux;
  m.host_syncs = int64_t(num_host_syncs() - syncs_before);  // the model's own; our loss reads are not counted
  if (run.cast_divisor > 0) {
    run.last_casts = cast_counts();
    m.moe_casts = double(run.last_casts.activation_casts()) / run.cast_divisor;
  }
  {
    OpTimer timer("gradient sync", OpPhase::step, "optimizer", run.device, 0, 0);
    sync_gradients(run);
  }
  if (run.opts.after_backward) run.opts.after_backward(m.step, run.model.parameters());
  if (run.opts.after_loss) run.opts.after_loss(m.step, &m.loss);
  {
    OpTimer timer("gradient norm", OpPhase::step, "optimizer", run.device, 0, 0);
    m.grad_norm = global_grad_norm(run.parallel, run.opt, run.model.parameter_shards());  // of the synced gradients
  }
  const bool all_finite = agree_on_losses(run, m, losses.has_aux);
  {
    OpTimer timer("adamw", OpPhase::step, "optimizer", run.device, 0, 0);
    update_weights(run, m, losses.has_aux, all_finite);
    run.opt.zero_grad();
  }
  {
    OpTimer timer("expert bias", OpPhase::step, "optimizer", run.device, 0, 0);
    update_expert_bias(run, m);
  }

  const double dt = std::chrono::duration<double>(clock::now() - t0).count();
  run.train_seconds += dt;
  ++run.steps_done;
  m.tokens_per_s = double(run.tokens_per_step) / dt;
  m.peak_mem_bytes = int64_t(memory_stats(run.device).peak_bytes);
  if (exchanges) m.exchange_ms = exchanges->take_exchange_ms();
  run.res.losses.push_back(m.loss);
  return m;
}

}  // namespace flowmoe
