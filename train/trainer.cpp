// The training loop around train_step(): evaluation and checkpoints when due, the ranks' agreement
// after each step, a stop request (see trainer.h), the collectives' watchdog; the run's set-up,
// checkpoints and summary are run.cpp's.
#include "train/trainer.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "parallel/watchdog.h"
#include "train/evaluation.h"
#include "train/generate.h"
#include "train/progress.h"
#include "train/run.h"
#include "train/step_profile.h"
#include "train/train_step.h"

namespace flowmoe {

namespace fs = std::filesystem;

// ---- evaluation, checkpoints, progress -----------------------------------------------------------

// Every `every` steps (0: never) and at the last step of the run.
static bool due(int64_t step, int64_t every, int64_t last_step) {
  return (every > 0 && step % every == 0) || step == last_step;
}

static void evaluate_if_due(TrainRun& run, StepMetrics& m) {
  if (run.val.num_batches == 0 || !due(m.step, run.cfg.train.eval_every, run.cfg.train.steps)) return;
  run.clock.evaluation.restart();
  m.val_loss =
      evaluate(run.setup.model(), run.setup.data(), run.val.num_batches, run.val.batch_size, run.setup.world.get());
  run.clock.evaluation.lap();
  if (std::isnan(run.res.first_val_loss)) run.res.first_val_loss = m.val_loss;
  run.res.final_val_loss = m.val_loss;
  run.progress.message("step " + std::to_string(m.step) + ": val loss " + format_fixed(m.val_loss, 4) +
                       " (train loss " + format_fixed(m.loss, 4) + ")");
}

// train.sample_every: a greedy sample of the weights after this step (train/generate.h), taken on every rank (an
// expert-parallel forward is collective) and printed by rank 0, timed as evaluation. Without gradients it counts
// no expert loads and it draws no random numbers, so training goes on as it would without it.
static void sample_if_due(TrainRun& run, int64_t step) {
  if (!due(step, run.cfg.train.sample_every, -1)) return;
  run.clock.evaluation.restart();
  if (!run.sample_tokenizer) run.sample_tokenizer = RunTokenizer::for_config(run.cfg);
  const std::string line = training_sample(run.setup.model(), run.setup.data(), *run.sample_tokenizer);
  run.clock.evaluation.lap();
  run.progress.message("step " + std::to_string(step) + ": sample " + line);
}

// Every checkpoint.every steps, and at train.steps unless checkpoint.final is false.
static bool checkpoint_due(const TrainRun& run, int64_t step) {
  const CheckpointConfig& c = run.cfg.checkpoint;
  return due(step, c.every, c.final ? run.cfg.train.steps : -1);
}

// `step` is the step just read back; a step due for a checkpoint is never run ahead of (may_run_ahead),
// so it is also the last one queued and the weights are its own. Returns whether it saved one.
static bool save_if_due(TrainRun& run, int64_t step) {
  if (!checkpoint_due(run, step)) return false;
  FLOWMOE_CHECK(step == run.loop.step, Error, "checkpoint of step ", step, " while step ", run.loop.step, " is queued");
  save_run_checkpoint(run, run.loop.step);
  run.loop.last_saved = run.loop.step;
  run.progress.message("step " + std::to_string(run.loop.step) + ": checkpoint " + run.res.last_checkpoint);
  return true;
}

// A stop request ends the run after the last finished step, with a checkpoint to continue from. Before this
// call's first step there is nothing new to save: the checkpoint it resumed from stands (none at step 0).
// Rank 0 then removes the stop file, so that the resume does not stop at once.
static void stop_with_checkpoint(TrainRun& run) {
  if (run.loop.steps_done > 0 && run.loop.last_saved != run.loop.step) save_run_checkpoint(run, run.loop.step);
  if (run.loop.steps_done == 0) run.res.last_checkpoint = run.resume_dir;
  const bool by_file = run.setup.is_root && remove_stop_file(run.res.out_dir);
  const std::string why = by_file ? " (asked by " + stop_file_path(run.res.out_dir) + ", now removed)" : "";
  if (run.res.last_checkpoint.empty())
    run.progress.message("stopped before the first step" + why + ": nothing trained, no checkpoint");
  else
    run.progress.message("interrupted at step " + std::to_string(run.loop.step) + why + ": checkpoint " +
                         run.res.last_checkpoint + " (continue with --resume)");
  run.res.interrupted = true;
}

// The step's metrics row, and the progress display with the run's mean rate so far.
static void report_step(TrainRun& run, const StepMetrics& m) {
  if (run.metrics) run.metrics->write(m);  // rank 0's alone
  StepMetrics shown = m;
  shown.tokens_per_s =
      double(run.tokens_per_step * run.loop.steps_done) / run.loop.time.seconds();  // smoothed for display
  run.flops.set_rates(shown);
  run.progress.update(
      shown, run.loop.time.seconds() / double(run.loop.steps_done) * double(run.cfg.train.steps - run.loop.step));
}

// ---- the loop -------------------------------------------------------------------------------------

// Whether this rank was asked to stop: a signal, or on rank 0 the stop file.
static bool asked_to_stop(const TrainRun& run) { return stop_requested(run.res.out_dir, run.setup.is_root); }

// Whether any rank was asked to stop (a launcher delivers a signal to the ranks at slightly different
// times, and rank 0 alone reads the stop file): all of them stop at the same point.
static bool agree_on_stop(TrainRun& run) {
  const bool stop = asked_to_stop(run);
  if (run.setup.world_size == 1) return stop;
  return all_reduce_values(*run.setup.world, {stop ? 1.0 : 0.0}, ReduceOp::max)[0] > 0;
}

// The peak memory and exchange time of the step as the most any rank used, and agree_on_stop's answer,
// in the step's one collective: all ranks stop after the same step.
static bool agree_after_step(TrainRun& run, StepMetrics& m) {
  const bool stop = asked_to_stop(run);
  if (run.setup.world_size == 1) return stop;
  const bool exchanged = !std::isnan(m.exchange_ms);  // the same on every rank: an expert-parallel run
  const std::vector<double> most = all_reduce_values(
      *run.setup.world, {double(m.peak_mem_bytes), stop ? 1.0 : 0.0, exchanged ? m.exchange_ms : 0.0}, ReduceOp::max);
  m.peak_mem_bytes = int64_t(most[0]);
  if (exchanged) m.exchange_ms = most[2];
  return most[1] > 0;
}

// After a step's metrics are read: its evaluation, metrics row and checkpoint. Returns whether the run
// must stop (a stop request on any rank). The ranks agree after the evaluation, and once more after a
// checkpoint, so that a request that comes during either stops the run at this step, not one step later.
static bool finish_step(TrainRun& run, StepMetrics m) {
  evaluate_if_due(run, m);
  sample_if_due(run, m.step);
  bool stop = agree_after_step(run, m);
  report_step(run, m);
  if (save_if_due(run, m.step) && !stop) stop = agree_on_stop(run);
  run.loop.time.restart();  // evaluation and checkpoints are not training time
  return stop;
}

// The step's read-back: on the GPUs it waits for the step's collectives too, so a peer that stopped answering
// shows here (the collectives' watchdog, parallel/watchdog.h).
static std::optional<StepMetrics> read_back_step(TrainRun& run) {
  const WatchedWait watch("the read-back of a step (its collectives)", run.setup.world->backend_name(),
                          run.setup.world_size);
  return complete_step(run);
}

// Whether the step just queued may stay unread while the next one is queued: only when its scalars are
// on the device, nothing reads the weights after it (evaluation, a sample, checkpoint, the run's end), the next
// step is not the profiled one, and a non-finite step need not stop the run exactly there.
static bool may_run_ahead(const TrainRun& run) {
  const TrainConfig& tc = run.cfg.train;
  return step_scalars_on_device(run) && run.loop.step < run.end && run.loop.step + 1 != run.opts.profile_step &&
         tc.nonfinite != NonfinitePolicy::stop && !due(run.loop.step, tc.eval_every, tc.steps) &&
         !due(run.loop.step, tc.sample_every, -1) && !checkpoint_due(run, run.loop.step);
}

TrainResult train(const Config& cfg, const TrainOptions& opts) {
  // A stop requested before this point (a signal during start-up) holds: it is cleared on return.
  struct ClearStopOnReturn {
    ~ClearStopOnReturn() { clear_stop_request(); }
  } clear_stop;
  const bool several = opts.world && opts.world->size() > 1;
  const CollectiveWatchdog watchdog(several ? cfg.parallel.timeout_s : 0, several ? opts.world->rank() : 0);
  TrainRun run(cfg, opts);
  bool stop = agree_on_stop(run);  // a request during set-up (or a stop file left behind): no step at all
  while (run.loop.step < run.end && !stop) {
    if (run.loop.step + 1 == run.opts.profile_step) {
      if (std::optional<StepMetrics> m = profiled_train_step(run)) stop = finish_step(run, *m);
      continue;
    }
    // One process: a stop request before one of the step's micro-batches drops the step (train_step.h).
    if (!issue_step(run)) {
      stop = true;
      break;
    }
    // On one GPU the host queues step N + 1 before it reads step N's loss: the GPU never waits for it.
    const int64_t keep = may_run_ahead(run) ? 1 : 0;
    // A void step (none is left pending then) goes round again: the loop takes it anew.
    while (run.loop.step_state.num_pending() > keep && !stop)
      if (std::optional<StepMetrics> m = read_back_step(run)) stop = finish_step(run, *m);
  }
  while (run.loop.step_state.num_pending() > 0)  // a step queued before a stop
    if (std::optional<StepMetrics> m = read_back_step(run)) finish_step(run, *m);
  if (stop && run.loop.step < run.end)
    stop_with_checkpoint(run);
  else if (stop && run.setup.is_root)
    remove_stop_file(run.res.out_dir);  // it came with the run's last step: moot, and the next run must not stop
  return finish_run(run);
}

}  // namespace flowmoe
