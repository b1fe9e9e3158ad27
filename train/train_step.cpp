// One optimizer step of the training loop (see train_step.h).
#include "train/train_step.h"

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "engine/allocator.h"
#include "engine/ops/router.h"
#include "engine/profiler.h"
#include "kernels/common/device_api.h"
#include "kernels/common/error.h"
#include "parallel/data_parallel.h"
#include "train/stop_request.h"

namespace flowmoe {

namespace {

// The step's losses, averaged over its micro-batches; NaN until read (the device path reads them later).
struct StepLosses {
  double lm = NAN;       // the language-model loss
  double aux = NAN;      // the MoE balance loss; NaN when the model has none
  bool has_aux = false;  // kept apart from aux: a balance loss that went non-finite is still one
  double mtp = NAN;      // the MTP loss (Transformer::Losses::mtp, unweighted); NaN without MTP modules
  bool dropped = false;  // a stop request came before one of the micro-batches (issue_step)
  // The host path's per-micro-batch losses, read once the step's own host syncs are counted (read_losses).
  std::vector<Tensor> lm_parts, aux_parts, mtp_parts;
};

// This rank's slice of the step's next micro-batch, on the host.
Batch next_batch(TrainRun& run) {
  return run.setup.data().next_train(run.cfg.train.batch_size, run.setup.rank, run.setup.world_size);
}

// The step's micro-batch a. An eager step takes each from the data as it reaches it, so a step of many
// micro-batches holds one at a time and a stop request between two of them is honoured at once; a graph's
// step reads the inputs it was captured with.
using MicroBatches = std::function<Batch(int64_t a)>;

MicroBatches prepared(const std::vector<Batch>& batches) {
  return [&batches](int64_t a) { return batches[size_t(a)]; };
}

// Forward and backward over the step's micro-batches; the gradients accumulate in the parameters. Each
// micro-batch's loss is the mean over its tokens, weighted 1/grad_accum_steps. On the device path the
// losses stay on the device (StepState::record_losses); otherwise they are kept for read_losses. `may_stop`:
// a stop request before a micro-batch ends the loop there, the step dropped.
StepLosses run_micro_batches(TrainRun& run, const MicroBatches& batches, bool on_device, bool may_stop) {
  const int64_t num_micro_batches = run.cfg.train.grad_accum_steps;
  StepLosses out;
  for (int64_t a = 0; a < num_micro_batches; ++a) {
    if (may_stop && stop_requested(run.res.out_dir, /*check_file=*/true)) {
      out.dropped = true;
      return out;
    }
    const Batch batch = batches(a);
    const Transformer::Losses parts = run.setup.model().losses(batch.inputs, batch.targets);
    const Variable loss = parts.total();
    out.has_aux = parts.aux.defined();
    const Tensor mtp = parts.mtp.defined() ? parts.mtp.data() : Tensor();
    if (on_device) {
      run.loop.step_state.record_losses(a, parts.lm.data(), out.has_aux ? parts.aux.data() : Tensor(), mtp);
    } else {
      out.lm_parts.push_back(parts.lm.data());
      if (out.has_aux) out.aux_parts.push_back(parts.aux.data());
      if (mtp.defined()) out.mtp_parts.push_back(mtp);
    }
    // The last micro-batch's backward finishes the gradients: the reducer starts on them as they are.
    if (run.setup.reducer() && a + 1 == num_micro_batches) run.setup.reducer()->begin();
    (num_micro_batches > 1 ? scale(loss, 1.0 / double(num_micro_batches)) : loss).backward();
  }
  return out;
}

// The host path's losses as the means over the micro-batches. The LM loss and the balance loss are
// logged apart; training minimizes their sum.
void read_losses(StepLosses& l) {
  const auto mean = [](const std::vector<Tensor>& parts) {
    double sum = 0;
    for (const Tensor& t : parts) sum += double(t.to_floats()[0]);
    return sum / double(parts.size());
  };
  if (l.lm_parts.empty()) return;  // the device path's
  l.lm = mean(l.lm_parts);
  l.aux = l.has_aux ? mean(l.aux_parts) : NAN;
  l.mtp = l.mtp_parts.empty() ? NAN : mean(l.mtp_parts);
}

// The gradient sync point: the ranks' gradients become the global batch's (grad_reducer.h: what the
// backward did not already reduce is reduced now, and the optimizer waits for it); at world size 1 they
// are already complete.
void sync_gradients(TrainRun& run) {
  GradientReducer* reducer = run.setup.reducer();
  AdamW& opt = run.setup.optimizer();
  if (!reducer) return;
  reducer->finish();
  // Sharded: the parameters keep no gradient; AdamW reads this rank's segments of them.
  if (opt.sharded()) opt.set_range_grads(reducer->range_grads());
}

// The host path's losses as the means over the ranks (each slice holds as many tokens) and whether any
// rank saw a non-finite objective or gradient norm: all ranks then skip (or stop) together.
bool agree_on_losses(TrainRun& run, StepLosses& l, double grad_norm) {
  const double objective = l.lm + (l.has_aux ? l.aux : 0.0);
  const bool finite = std::isfinite(objective) && std::isfinite(grad_norm);
  if (run.setup.world_size == 1) return finite;
  const bool has_mtp = !std::isnan(l.mtp);
  const std::vector<double> sums = all_reduce_values(
      *run.setup.world, {l.lm, l.has_aux ? l.aux : 0.0, finite ? 0.0 : 1.0, has_mtp ? l.mtp : 0.0}, ReduceOp::sum);
  l.lm = sums[0] / double(run.setup.world_size);
  if (l.has_aux) l.aux = sums[1] / double(run.setup.world_size);
  if (has_mtp) l.mtp = sums[3] / double(run.setup.world_size);
  return sums[2] == 0;
}

// "step 7: non-finite loss (nan, balance loss 0.01)" or "step 7: non-finite gradients (grad norm inf)".
std::string describe_non_finite(const StepMetrics& m, bool has_aux) {
  const double objective = m.loss + (has_aux ? m.aux_loss : 0.0);
  const std::string what =
      std::isfinite(objective)
          ? "gradients (grad norm " + std::to_string(m.grad_norm) + ")"
          : "loss (" + std::to_string(m.loss) + (has_aux ? ", balance loss " + std::to_string(m.aux_loss) : "") + ")";
  return "step " + std::to_string(m.step) + ": non-finite " + what;
}

// train.nonfinite: stop ends the run with a checkpoint; skip goes on until too many steps were skipped.
void apply_non_finite_policy(TrainRun& run, const std::string& what) {
  const TrainConfig& tc = run.cfg.train;
  if (tc.nonfinite == NonfinitePolicy::stop) {
    // The update was not applied: the checkpoint holds the weights of the last good step, and a
    // --resume continues after the batch that failed.
    save_run_checkpoint(run, run.loop.step);
    FLOWMOE_THROW(Error, what, "; stopping because train.nonfinite is 'stop' (", run.cfg.origin("train.nonfinite"),
                  "); the weights before this step are in ", run.res.last_checkpoint,
                  ". Lower optimizer.lr, raise optimizer.warmup_steps, or set train.nonfinite: skip");
  }
  if (run.loop.skipped > tc.max_skipped_steps)
    FLOWMOE_THROW(Error, what, "; ", run.loop.skipped,
                  " steps skipped so far, more than train.max_skipped_steps = ", tc.max_skipped_steps,
                  ": the run is diverging. Lower optimizer.lr or raise warmup_steps");
  run.progress.message(what + ": update skipped (" + std::to_string(run.loop.skipped) + " of at most " +
                       std::to_string(tc.max_skipped_steps) + ")");
}

// The step's scalars (kernels/step_control.h): on the device from the device's own losses and norm, or
// on the host from the read and agreed values (the CPU; ranks that stage through the host; a test hook
// on the loss). With several ranks on the device, the losses become the means over the ranks and the
// expert shards' squared norms the sum over the expert-parallel group, by collectives on the device:
// every rank then holds the same scalars, so all of them apply, skip or stop the step alike.
void advance_scalars(TrainRun& run, StepLosses& losses, bool on_device) {
  AdamW& opt = run.setup.optimizer();
  const Transformer& model = run.setup.model();
  StepState& state = run.loop.step_state;
  // An exchange that ran out of rows voids the step on every rank (kernels/step_control.h): the expert-parallel
  // groups each agree already, the data-parallel copies of them through the maximum.
  const Tensor& overflow = run.loop.exchange_overflow;
  if (overflow.defined() && run.setup.world_size > 1) run.setup.world->all_reduce(overflow, ReduceOp::max);
  if (on_device) {
    OpTimer timer("gradient norm", OpPhase::step, "optimizer", run.setup.device, 0, 0);
    if (run.setup.world_size > 1) state.reduce_losses(*run.setup.world);
    const std::vector<bool> experts = expert_shard_flags(run.setup.parallel, model.parameter_shards());
    Tensor sums = opt.grad_square_sums_device(experts);  // {dense, expert shards}
    reduce_square_sums(run.setup.parallel, sums, opt.sharded());
    state.advance_on_device(sums.data<float>(), overflow.defined() ? overflow.data<int32_t>() : nullptr);
    return;
  }
  double norm = NAN;
  {
    OpTimer timer("gradient norm", OpPhase::step, "optimizer", run.setup.device, 0, 0);
    norm = global_grad_norm(run.setup.parallel, opt, model.parameter_shards());  // of the synced gradients
  }
  if (run.opts.after_loss) run.opts.after_loss(run.loop.step, &losses.lm);
  const bool all_finite = agree_on_losses(run, losses, norm);
  state.advance_on_host(losses.lm, losses.aux, norm, all_finite, overflow.defined() ? overflow.to_ints()[0] : 0,
                        losses.mtp);
}

// The step on the device, from the batches (on the device for the device path) to the expert-bias
// update: what a CUDA graph captures. Returns the MoE layers' loads for the readout. `dropped` (eager steps
// of one process): set when a stop request dropped the step before one of its micro-batches; the
// gradients are zeroed and nothing else is done.
std::vector<Tensor> step_body(TrainRun& run, const MicroBatches& batches, bool on_device, IssuedStep& issued,
                              bool* dropped = nullptr) {
  AdamW& opt = run.setup.optimizer();
  Transformer& model = run.setup.model();
  GradientReducer* reducer = run.setup.reducer();
  const uint64_t syncs_before = num_host_syncs();
  reset_cast_counts();
  opt.zero_grad();
  StepLosses losses = run_micro_batches(run, batches, on_device, dropped != nullptr);
  if (losses.dropped) {
    opt.zero_grad();
    *dropped = true;
    return {};
  }
  issued.has_aux = losses.has_aux;
  if (run.cast_divisor > 0) {
    run.loop.last_casts = cast_counts();
    issued.moe_casts = double(run.loop.last_casts.activation_casts()) / run.cast_divisor;
  }
  {
    OpTimer timer("gradient sync", OpPhase::step, "optimizer", run.setup.device, 0, 0);
    sync_gradients(run);
  }
  // The model's and the gradient reduction's own, which StepGraph::use reads; the loss reads below are not counted.
  issued.host_syncs = int64_t(num_host_syncs() - syncs_before);
  read_losses(losses);
  if (run.opts.after_backward) run.opts.after_backward(run.loop.step, model.parameters());
  advance_scalars(run, losses, on_device);
  {
    OpTimer timer("adamw", OpPhase::step, "optimizer", run.setup.device, 0, 0);
    opt.step(run.loop.step_state.scalars());  // a skipped step changes nothing (step_control.h: apply)
    opt.zero_grad();
    if (opt.sharded()) reducer->release_grads();  // the sharded gradients, read by AdamW
  }
  // Each rank updated its segments: every rank gets all of them, while the next forward begins.
  if (opt.sharded()) reducer->gather_weights();
  OpTimer timer("expert bias", OpPhase::step, "optimizer", run.setup.device, 0, 0);
  // Every rank moves its bias by the loads of the global batch.
  if (run.setup.world_size > 1) all_reduce_flat(*run.setup.world, model.moe_load_counts(), ReduceOp::sum);
  return model.update_moe_bias(run.loop.step_state.scalars());  // a skipped step moves nothing; loads still logged
}

}  // namespace

bool step_scalars_on_device(const TrainRun& run) {
  // Several ranks need device collectives (nccl) for it; the mpi backend stages through the host.
  const bool device_collectives = run.setup.world_size == 1 || run.setup.world->native_device().is_cuda();
  return run.setup.device.is_cuda() && device_collectives && !run.opts.after_loss;
}

bool issue_step(TrainRun& run, bool profiled) {
  if (run.loop.step_state.num_pending() == 0) run.loop.time.restart();
  Communicator* exchanges =
      run.setup.parallel.expert_parallel_size > 1 ? run.setup.parallel.expert_parallel.get() : nullptr;
  // An evaluation's exchanges are not this step's (one runs only while no step is pending).
  if (exchanges && run.loop.step_state.num_pending() == 0) exchanges->take_exchange_ms();
  const bool on_device = step_scalars_on_device(run);
  ++run.loop.step;
  const DataPosition data_before = run.setup.data().position();
  IssuedStep issued;
  std::vector<Tensor> loads;
  if (on_device) run.loop.step_state.prepare_device_step();  // before a graph replays or captures the step
  const bool graphed = run.graph.use(run, profiled);
  if (graphed) {
    std::vector<Batch> batches;
    for (int64_t a = 0; a < run.cfg.train.grad_accum_steps; ++a) batches.push_back(next_batch(run));
    loads = run.graph.step(run, batches, issued, [&run](const std::vector<Batch>& inputs, IssuedStep& is) {
      return step_body(run, prepared(inputs), true, is);
    });
  } else {
    const MicroBatches take = [&](int64_t) {
      Batch b = next_batch(run);
      // A plain copy to the device would wait for the previous step to finish.
      return on_device ? Batch{run.loop.step_state.upload(b.inputs), run.loop.step_state.upload(b.targets)} : b;
    };
    bool dropped = false;
    loads = step_body(run, take, on_device, issued, run.setup.world_size == 1 && !profiled ? &dropped : nullptr);
    if (dropped) {
      --run.loop.step;
      run.setup.data().set_position(data_before);
      return false;
    }
    run.graph.count_eager_step(issued.host_syncs);
  }
  // A graph step's `issued` is its capture's: the data position is this step's own.
  issued.data_before = data_before;
  // The step's exchanges are timed unless it is a graph's (its replays record no timing events).
  issued.has_exchanges = exchanges != nullptr && !graphed;
  if (issued.has_exchanges) exchanges->close_exchange_window();  // read with the step's scalars (complete_step)
  run.loop.step_state.snapshot(loads);
  run.loop.issued.push_back(issued);
  return true;
}

namespace {

// A void step, read back with the scalars of the last step that was applied (last_step): its exchange needed
// `need` rows on some rank, more than the buffers hold. Every step queued after it is void too (the overflow
// is sticky on the device); they are read back and dropped. The buffers grow to the need and an eighth, the
// graph (sized for the old buffers) is dropped, and run.loop.step and the data go back to before the void step, which
// the loop then takes again, as if it had never run: it changed nothing.
void rerun_after_overflow(TrainRun& run, int64_t last_step, int64_t need, const DataPosition& data_before) {
  while (run.loop.step_state.num_pending() > 0) {
    run.loop.step_state.complete();
    if (run.loop.issued.front().has_exchanges) run.setup.parallel.expert_parallel->take_exchange_window_ms();
    run.loop.issued.pop_front();
  }
  run.loop.exchange_min_rows = std::max(run.loop.exchange_min_rows, need + need / 8);
  run.setup.model().set_exchange_buffers(run.cfg.parallel.ep_capacity_factor, run.loop.exchange_min_rows,
                                         run.loop.exchange_overflow);
  run.loop.exchange_overflow.zero_();
  run.loop.step_state.clear_exchange_overflow();
  run.graph.drop();  // it holds the old buffers' shapes
  const int64_t queued_after = run.loop.step - last_step - 1;
  const std::string also = queued_after == 1  ? ", as does the step queued after it"
                           : queued_after > 1 ? ", as do the " + std::to_string(queued_after) + " steps queued after it"
                                              : std::string();
  run.progress.message("step " + std::to_string(last_step + 1) + ": an expert exchange needed " + std::to_string(need) +
                       " receive rows, more than its buffers hold (parallel.ep_capacity_factor " +
                       format_fixed(run.cfg.parallel.ep_capacity_factor, 2) + "); they grow to " +
                       std::to_string(run.loop.exchange_min_rows) + " rows and the step runs again" + also);
  run.loop.step = last_step;
  run.setup.data().set_position(data_before);
  run.loop.time.lap();  // the void steps' time is training time too
}

}  // namespace

std::optional<StepMetrics> complete_step(TrainRun& run) {
  const StepReadout r = run.loop.step_state.complete();
  const IssuedStep issued = run.loop.issued.front();
  run.loop.issued.pop_front();
  if (r.scalars.exchange_overflow > 0) {
    if (issued.has_exchanges) run.setup.parallel.expert_parallel->take_exchange_window_ms();
    rerun_after_overflow(run, r.scalars.step, r.scalars.exchange_overflow, issued.data_before);
    return std::nullopt;
  }
  StepMetrics m;
  m.step = r.scalars.step;
  m.lr = r.scalars.lr;
  m.loss = r.scalars.loss;
  m.aux_loss = r.scalars.aux_loss;
  m.mtp_loss = r.scalars.mtp_loss;
  m.grad_norm = r.scalars.grad_norm;
  m.host_syncs = issued.host_syncs;
  m.moe_casts = issued.moe_casts;
  // The step has finished: its exchanges' window is read without waiting on a step queued after it.
  if (issued.has_exchanges) m.exchange_ms = run.setup.parallel.expert_parallel->take_exchange_window_ms();
  for (const std::vector<int64_t>& l : r.loads) m.moe_max_over_mean.push_back(load_stats(l).max_over_mean);
  run.setup.optimizer().set_num_updates(r.scalars.num_updates);

  const double dt = run.loop.time.lap();
  ++run.loop.steps_done;
  m.tokens_per_s = double(run.tokens_per_step) / dt;
  run.flops.set_rates(m);
  m.peak_mem_bytes = int64_t(memory_stats(run.setup.device).peak_bytes);
  run.res.losses.push_back(m.loss);
  if (!r.scalars.apply) {
    m.skipped = true;
    ++run.loop.skipped;
    apply_non_finite_policy(run, describe_non_finite(m, issued.has_aux));
  }
  return m;
}

std::optional<StepMetrics> train_step(TrainRun& run, bool profiled) {
  if (!issue_step(run, profiled)) return std::nullopt;  // dropped by a stop request (never when profiled)
  return complete_step(run);
}

}  // namespace flowmoe
