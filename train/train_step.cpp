// One optimizer step of the training loop (see train_step.h).
#include "train/train_step.h"

#include <chrono>
#include <cmath>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "engine/allocator.h"
#include "engine/cuda_graph.h"
#include "engine/ops/router.h"
#include "engine/profiler.h"
#include "kernels/common/device_api.h"
#include "kernels/common/error.h"
#include "train/data_parallel.h"
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
Batch next_batch(TrainRun& run) { return run.data.next_train(run.cfg.train.batch_size, run.rank, run.world_size); }

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
    const Transformer::Losses parts = run.model.losses(batch.inputs, batch.targets);
    const Variable loss = parts.total();
    out.has_aux = parts.aux.defined();
    const Tensor mtp = parts.mtp.defined() ? parts.mtp.data() : Tensor();
    if (on_device) {
      run.state.record_losses(a, parts.lm.data(), out.has_aux ? parts.aux.data() : Tensor(), mtp);
    } else {
      out.lm_parts.push_back(parts.lm.data());
      if (out.has_aux) out.aux_parts.push_back(parts.aux.data());
      if (mtp.defined()) out.mtp_parts.push_back(mtp);
    }
    // The last micro-batch's backward finishes the gradients: the reducer starts on them as they are.
    if (run.reducer && a + 1 == num_micro_batches) run.reducer->begin();
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
  if (!run.reducer) return;
  run.reducer->finish();
  // Sharded: the parameters keep no gradient; AdamW reads this rank's segments of them.
  if (run.opt.sharded()) run.opt.set_range_grads(run.reducer->range_grads());
}

// The host path's losses as the means over the ranks (each slice holds as many tokens) and whether any
// rank saw a non-finite objective or gradient norm: all ranks then skip (or stop) together.
bool agree_on_losses(TrainRun& run, StepLosses& l, double grad_norm) {
  const double objective = l.lm + (l.has_aux ? l.aux : 0.0);
  const bool finite = std::isfinite(objective) && std::isfinite(grad_norm);
  if (run.world_size == 1) return finite;
  const bool has_mtp = !std::isnan(l.mtp);
  const std::vector<double> sums = all_reduce_values(
      *run.world, {l.lm, l.has_aux ? l.aux : 0.0, finite ? 0.0 : 1.0, has_mtp ? l.mtp : 0.0}, ReduceOp::sum);
  l.lm = sums[0] / double(run.world_size);
  if (l.has_aux) l.aux = sums[1] / double(run.world_size);
  if (has_mtp) l.mtp = sums[3] / double(run.world_size);
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
  if (tc.nonfinite == "stop") {
    // The update was not applied: the checkpoint holds the weights of the last good step, and a
    // --resume continues after the batch that failed.
    save_run_checkpoint(run, run.step);
    FLOWMOE_THROW(Error, what, "; stopping because train.nonfinite is 'stop' (", run.cfg.origin("train.nonfinite"),
                  "); the weights before this step are in ", run.res.last_checkpoint,
                  ". Lower optimizer.lr, raise optimizer.warmup_steps, or set train.nonfinite: skip");
  }
  if (run.skipped > tc.max_skipped_steps)
    FLOWMOE_THROW(Error, what, "; ", run.skipped,
                  " steps skipped so far, more than train.max_skipped_steps = ", tc.max_skipped_steps,
                  ": the run is diverging. Lower optimizer.lr or raise warmup_steps");
  run.progress.message(what + ": update skipped (" + std::to_string(run.skipped) + " of at most " +
                       std::to_string(tc.max_skipped_steps) + ")");
}

// The step's scalars (kernels/step_control.h): on the device from the device's own losses and norm, or
// on the host from the read and agreed values (the CPU; ranks that stage through the host; a test hook
// on the loss). With several ranks on the device, the losses become the means over the ranks and the
// expert shards' squared norms the sum over the expert-parallel group, by collectives on the device:
// every rank then holds the same scalars, so all of them apply, skip or stop the step alike.
void advance_scalars(TrainRun& run, StepLosses& losses, bool on_device) {
  // An exchange that ran out of rows voids the step on every rank (kernels/step_control.h): the expert-parallel
  // groups each agree already, the data-parallel copies of them through the maximum.
  const Tensor& overflow = run.exchange_overflow;
  if (overflow.defined() && run.world_size > 1) run.world->all_reduce(overflow, ReduceOp::max);
  if (on_device) {
    OpTimer timer("gradient norm", OpPhase::step, "optimizer", run.device, 0, 0);
    if (run.world_size > 1) run.state.reduce_losses(*run.world);
    const std::vector<bool> experts = expert_shard_flags(run.parallel, run.model.parameter_shards());
    Tensor sums = run.opt.grad_square_sums_device(experts);  // {dense, expert shards}
    reduce_square_sums(run.parallel, sums, run.opt.sharded());
    run.state.advance_on_device(sums.data<float>(), overflow.defined() ? overflow.data<int32_t>() : nullptr);
    return;
  }
  double norm = NAN;
  {
    OpTimer timer("gradient norm", OpPhase::step, "optimizer", run.device, 0, 0);
    norm = global_grad_norm(run.parallel, run.opt, run.model.parameter_shards());  // of the synced gradients
  }
  if (run.opts.after_loss) run.opts.after_loss(run.step, &losses.lm);
  const bool all_finite = agree_on_losses(run, losses, norm);
  run.state.advance_on_host(losses.lm, losses.aux, norm, all_finite, overflow.defined() ? overflow.to_ints()[0] : 0,
                            losses.mtp);
}

// The step on the device, from the batches (on the device for the device path) to the expert-bias
// update: what a CUDA graph captures. Returns the MoE layers' loads for the readout. `dropped` (eager steps
// of one process): set when a stop request dropped the step before one of its micro-batches; the
// gradients are zeroed and nothing else is done.
std::vector<Tensor> step_body(TrainRun& run, const MicroBatches& batches, bool on_device, IssuedStep& issued,
                              bool* dropped = nullptr) {
  const uint64_t syncs_before = num_host_syncs();
  reset_cast_counts();
  run.opt.zero_grad();
  StepLosses losses = run_micro_batches(run, batches, on_device, dropped != nullptr);
  if (losses.dropped) {
    run.opt.zero_grad();
    *dropped = true;
    return {};
  }
  issued.has_aux = losses.has_aux;
  if (run.cast_divisor > 0) {
    run.last_casts = cast_counts();
    issued.moe_casts = double(run.last_casts.activation_casts()) / run.cast_divisor;
  }
  {
    OpTimer timer("gradient sync", OpPhase::step, "optimizer", run.device, 0, 0);
    sync_gradients(run);
  }
  // The model's and the gradient reduction's own, which use_graph reads; the loss reads below are not counted.
  issued.host_syncs = int64_t(num_host_syncs() - syncs_before);
  read_losses(losses);
  if (run.opts.after_backward) run.opts.after_backward(run.step, run.model.parameters());
  advance_scalars(run, losses, on_device);
  {
    OpTimer timer("adamw", OpPhase::step, "optimizer", run.device, 0, 0);
    run.opt.step(run.state.scalars());  // a skipped step changes nothing (step_control.h: apply)
    run.opt.zero_grad();
    if (run.opt.sharded()) run.reducer->release_grads();  // the sharded gradients, read by AdamW
  }
  // Each rank updated its segments: every rank gets all of them, while the next forward begins.
  if (run.opt.sharded()) run.reducer->gather_weights();
  OpTimer timer("expert bias", OpPhase::step, "optimizer", run.device, 0, 0);
  // Every rank moves its bias by the loads of the global batch.
  if (run.world_size > 1) all_reduce_flat(*run.world, run.model.moe_load_counts(), ReduceOp::sum);
  return run.model.update_moe_bias(run.state.scalars());  // a skipped step moves nothing; loads still logged
}

// train.cuda_graph: whether this step replays (or first captures) the graph. auto takes it once an eager
// step of this run made no host synchronisation on any rank; on insists, and says why when it cannot.
// Every rank decides alike: what it reads is the same on every rank, or agreed over the world.
bool use_graph(TrainRun& run, bool profiled) {
  const std::string& mode = run.cfg.train.cuda_graph;
  if (mode == "off" || run.graph_failed || profiled) return false;
  if (run.graph && run.graph->captured()) return true;
  // Several ranks: nccl's collectives, the reducer's stream and the zero-sync exchange's device puts are
  // captured with the step. A sync exchange reads counts to the host, which no replay could repeat.
  const bool possible = step_scalars_on_device(run) && !run.opts.after_backward;
  FLOWMOE_CHECK(possible || mode != "on", ConfigError, "train.cuda_graph: on (", run.cfg.origin("train.cuda_graph"),
                ") needs a GPU, one process or collectives on the device (nccl), and no test hooks");
  // The first step of a run is eager: it creates the cuBLASLt plans and tells whether the step syncs.
  if (!possible || run.eager_steps == 0) return false;
  const bool no_syncs = on_every_rank(*run.world, run.last_eager_host_syncs == 0);
  FLOWMOE_CHECK(no_syncs || mode != "on", ConfigError, "train.cuda_graph: on (", run.cfg.origin("train.cuda_graph"),
                "), but the eager step made host synchronisations (", run.last_eager_host_syncs,
                " on this rank), which a graph cannot replay (expert parallelism needs "
                "parallel.ep_dispatch: zero_sync on GPUs that reach each other's memory)");
  return no_syncs;
}

// The graph step: the batches go into the captured step's static inputs, then one launch runs it all.
std::vector<Tensor> graph_step(TrainRun& run, const std::vector<Batch>& batches, IssuedStep& issued) {
  // A weight gather an eager step left in flight (the last before the capture, or the profiled one):
  // neither the capture nor a replay may wait on an event from outside the graph, whose own gathers
  // are joined inside it.
  if (run.reducer) run.reducer->wait_weights();
  if (!run.graph) {
    run.graph = std::make_unique<CudaGraphCapture>(run.device);
    run.graph_inputs.clear();
    for (const Batch& b : batches)
      run.graph_inputs.push_back({Tensor::empty(b.inputs.shape(), b.inputs.dtype(), run.device),
                                  Tensor::empty(b.targets.shape(), b.targets.dtype(), run.device)});
  }
  for (size_t a = 0; a < batches.size(); ++a) {
    run.state.upload_into(batches[a].inputs, run.graph_inputs[a].inputs);
    run.state.upload_into(batches[a].targets, run.graph_inputs[a].targets);
  }
  if (!run.graph->captured()) {
    std::exception_ptr failure;
    std::string why = "another rank could not capture it";
    try {
      run.graph->capture([&] { return step_body(run, prepared(run.graph_inputs), true, run.graph_issued); });
    } catch (const Error& e) {
      failure = std::current_exception();
      why = e.what();
    }
    const GraphDecision decision = agree_on_capture(*run.world, failure == nullptr, run.cfg.train.cuda_graph == "on");
    if (decision != GraphDecision::replay) {
      // Nothing of a capture ran, here or elsewhere; FP8 weight caches made during it are dropped (their
      // versions move), and so is a graph this rank did capture.
      for (const Variable& p : run.model.parameters()) p.bump_version();
      // The gathered copies hold the weights still (nothing ran); their f32 weights are stale outside this
      // rank's segments, so the forward must not quantize them again.
      if (run.reducer && run.reducer->sharded()) run.reducer->mark_fp8_current();
      run.graph.reset();
      if (decision == GraphDecision::abort && failure) std::rethrow_exception(failure);
      FLOWMOE_CHECK(decision != GraphDecision::abort, Error, "train.cuda_graph: on (",
                    run.cfg.origin("train.cuda_graph"), "), but the step could not be captured: ", why);
      run.graph_failed = true;
      run.progress.message("train.cuda_graph: the step could not be captured, so it runs eagerly (" + why + ")");
      return step_body(run, prepared(run.graph_inputs), true, issued);
    }
    run.graph_casts = run.last_casts;
    run.progress.message("train.cuda_graph: step " + std::to_string(run.step) +
                         " captured; it and later steps replay it");
  }
  run.graph->replay();
  // What the captured host code did once, each replay does on the device; the versions move as an
  // eager AdamW step moves them, and the FP8 copies the update wrote are current for the new versions.
  for (const Variable& p : run.model.parameters()) p.bump_version();
  run.opt.mark_fp8_copies_current();
  if (run.reducer && run.reducer->sharded()) run.reducer->mark_fp8_current();
  issued = run.graph_issued;
  run.last_casts = run.graph_casts;
  return run.graph->outputs();
}

}  // namespace

GraphDecision agree_on_capture(Communicator& world, bool captured_here, bool insist) {
  if (on_every_rank(world, captured_here)) return GraphDecision::replay;
  return insist ? GraphDecision::abort : GraphDecision::eager;
}

bool step_scalars_on_device(const TrainRun& run) {
  // Several ranks need device collectives (nccl) for it; the mpi backend stages through the host.
  const bool device_collectives = run.world_size == 1 || run.world->native_device().is_cuda();
  return run.device.is_cuda() && device_collectives && !run.opts.after_loss;
}

bool issue_step(TrainRun& run, bool profiled) {
  using clock = std::chrono::steady_clock;
  if (run.state.num_pending() == 0) run.step_clock = clock::now();
  Communicator* exchanges = run.parallel.expert_parallel_size > 1 ? run.parallel.expert_parallel.get() : nullptr;
  // An evaluation's exchanges are not this step's (one runs only while no step is pending).
  if (exchanges && run.state.num_pending() == 0) exchanges->take_exchange_ms();
  const bool on_device = step_scalars_on_device(run);
  ++run.step;
  const DataPosition data_before = run.data.position();
  IssuedStep issued;
  std::vector<Tensor> loads;
  if (on_device) run.state.prepare_device_step();  // before a graph replays or captures the step
  const bool graphed = use_graph(run, profiled);
  if (graphed) {
    std::vector<Batch> batches;
    for (int64_t a = 0; a < run.cfg.train.grad_accum_steps; ++a) batches.push_back(next_batch(run));
    loads = graph_step(run, batches, issued);
  } else {
    const MicroBatches take = [&](int64_t) {
      Batch b = next_batch(run);
      // A plain copy to the device would wait for the previous step to finish.
      return on_device ? Batch{run.state.upload(b.inputs), run.state.upload(b.targets)} : b;
    };
    bool dropped = false;
    loads = step_body(run, take, on_device, issued, run.world_size == 1 && !profiled ? &dropped : nullptr);
    if (dropped) {
      --run.step;
      run.data.set_position(data_before);
      return false;
    }
    ++run.eager_steps;
    run.last_eager_host_syncs = issued.host_syncs;
  }
  // A graph step's `issued` is its capture's: the data position is this step's own.
  issued.data_before = data_before;
  // The step's exchanges are timed unless it is a graph's (its replays record no timing events).
  issued.has_exchanges = exchanges != nullptr && !graphed;
  if (issued.has_exchanges) exchanges->close_exchange_window();  // read with the step's scalars (complete_step)
  run.state.snapshot(loads);
  run.issued.push_back(issued);
  return true;
}

namespace {

// A void step, read back with the scalars of the last step that was applied (last_step): its exchange needed
// `need` rows on some rank, more than the buffers hold. Every step queued after it is void too (the overflow
// is sticky on the device); they are read back and dropped. The buffers grow to the need and an eighth, the
// graph (sized for the old buffers) is dropped, and run.step and the data go back to before the void step, which
// the loop then takes again, as if it had never run: it changed nothing.
void rerun_after_overflow(TrainRun& run, int64_t last_step, int64_t need, const DataPosition& data_before) {
  while (run.state.num_pending() > 0) {
    run.state.complete();
    if (run.issued.front().has_exchanges) run.parallel.expert_parallel->take_exchange_window_ms();
    run.issued.pop_front();
  }
  run.exchange_min_rows = std::max(run.exchange_min_rows, need + need / 8);
  run.model.set_exchange_buffers(run.cfg.parallel.ep_capacity_factor, run.exchange_min_rows, run.exchange_overflow);
  run.exchange_overflow.zero_();
  run.state.clear_exchange_overflow();
  // The graph holds the old buffers' shapes. The next step runs eagerly (an exchange window grows there,
  // which a capture could not do) and the one after it is captured anew.
  run.graph.reset();
  run.eager_steps = 0;
  const int64_t queued_after = run.step - last_step - 1;
  const std::string also = queued_after == 1  ? ", as does the step queued after it"
                           : queued_after > 1 ? ", as do the " + std::to_string(queued_after) + " steps queued after it"
                                              : std::string();
  run.progress.message("step " + std::to_string(last_step + 1) + ": an expert exchange needed " + std::to_string(need) +
                       " receive rows, more than its buffers hold (parallel.ep_capacity_factor " +
                       format_fixed(run.cfg.parallel.ep_capacity_factor, 2) + "); they grow to " +
                       std::to_string(run.exchange_min_rows) + " rows and the step runs again" + also);
  run.step = last_step;
  run.data.set_position(data_before);
  const auto now = std::chrono::steady_clock::now();  // the void steps' time is training time too
  run.train_seconds += std::chrono::duration<double>(now - run.step_clock).count();
  run.step_clock = now;
}

}  // namespace

std::optional<StepMetrics> complete_step(TrainRun& run) {
  using clock = std::chrono::steady_clock;
  const StepReadout r = run.state.complete();
  const IssuedStep issued = run.issued.front();
  run.issued.pop_front();
  if (r.scalars.exchange_overflow > 0) {
    if (issued.has_exchanges) run.parallel.expert_parallel->take_exchange_window_ms();
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
  if (issued.has_exchanges) m.exchange_ms = run.parallel.expert_parallel->take_exchange_window_ms();
  for (const std::vector<int64_t>& l : r.loads) m.moe_max_over_mean.push_back(load_stats(l).max_over_mean);
  run.opt.set_num_updates(r.scalars.num_updates);

  const auto now = clock::now();
  const double dt = std::chrono::duration<double>(now - run.step_clock).count();
  run.step_clock = now;
  run.train_seconds += dt;
  ++run.steps_done;
  m.tokens_per_s = double(run.tokens_per_step) / dt;
  run.flops.set_rates(m);
  m.peak_mem_bytes = int64_t(memory_stats(run.device).peak_bytes);
  run.res.losses.push_back(m.loss);
  if (!r.scalars.apply) {
    m.skipped = true;
    ++run.skipped;
    apply_non_finite_policy(run, describe_non_finite(m, issued.has_aux));
  }
  return m;
}

std::optional<StepMetrics> train_step(TrainRun& run, bool profiled) {
  if (!issue_step(run, profiled)) return std::nullopt;  // dropped by a stop request (never when profiled)
  return complete_step(run);
}

}  // namespace flowmoe
