// One training run (TrainRun): its set-up (run_setup.h: the ranks, the device, the data, the model, the optimizer),
// what the loop changes every step (loop_state.h), the CUDA graph of the step (step_graph.h), and what the run
// writes: progress, metrics, checkpoints and the summary. Built in run.cpp in the order the members are declared;
// trainer.cpp drives the loop, train_step.h takes the steps, run_checkpoint.cpp saves and resumes.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config/config.h"
#include "dataset/run_tokenizer.h"
#include "io/dir_lock.h"
#include "train/evaluation.h"
#include "train/lap_timer.h"
#include "train/loop_state.h"
#include "train/metrics.h"
#include "train/model_flops.h"
#include "train/progress.h"
#include "train/run_setup.h"
#include "train/step_graph.h"
#include "train/train_options.h"

namespace flowmoe {

// Where a run's wall time goes: the summary's "time:" line. Set-up is split into parts by laps; evaluation (and
// samples) and checkpoints are timed each as a restart and a lap.
struct RunClock {
  // `started`: when the command began; the time until now is the part "start-up" (the ranks' start).
  explicit RunClock(std::optional<LapTimer::Clock::time_point> started)
      : whole(started.value_or(LapTimer::Clock::now())), setup_laps(whole) {
    if (started) lap("start-up");
  }
  // Ends the set-up part `name` now: its time is the time since the previous lap.
  void lap(const std::string& name) { setup.emplace_back(name, setup_laps.lap()); }

  LapTimer whole;                                     // never lapped: its running() is the run's time so far
  LapTimer setup_laps;                                // from the start, a lap a set-up part
  std::vector<std::pair<std::string, double>> setup;  // (part, seconds) in order
  LapTimer evaluation, checkpoints;
};
// A lap as a member: placed between TrainRun's members, it times the one built before it.
struct SetupLap {
  SetupLap(RunClock& clock, const char* name) { clock.lap(name); }
};

// Everything a run holds. Members are built in declaration order, which is the order set-up must keep:
// nothing is allocated for the model before the memory estimate says it fits. The constructor's body then
// builds the set-up's data, model and optimizer, and resumes.
struct TrainRun {
  TrainRun(const Config& cfg, const TrainOptions& opts);
  TrainRun(const TrainRun&) = delete;
  TrainRun& operator=(const TrainRun&) = delete;

  RunClock clock;  // first: set-up begins with the first member (or earlier, opts.started)
  const Config& cfg;
  const TrainOptions& opts;
  RunSetup setup;                // the ranks (each reads its slice of every batch) and the device, so far
  const ModelFlops flops;        // model FLOPs per token and this GPU's peak: the metrics' tflops and mfu
  std::string resume_note;       // the start-up line about the resume; declared first: resume_dir fills it
  const std::string resume_dir;  // the checkpoint to resume from; "" for a fresh start
  Progress progress;
  // Rank 0's locks on the run directory and the checkpoint directory (one lock where they are the same
  // folder): taken before anything is written or cleaned up there.
  std::vector<std::unique_ptr<DirLock>> dir_locks;
  TrainResult res;  // out_dir exists and holds config.yaml before the data is read
  SetupLap device_lap{clock, "device and memory check"};
  LoopState loop;
  StepGraph graph;                       // train.cuda_graph
  std::optional<MetricsWriter> metrics;  // opened once the step to resume at is known
  // train.sample_every's tokenizer, looked up at the first sample.
  std::optional<RunTokenizer> sample_tokenizer;

  const int64_t tokens_per_step;  // train.batch_size x data.seq_len x train.grad_accum_steps
  const int64_t end;              // the last step this call takes: train.steps, or opts.stop_after
  ValBatches val;                 // what an evaluation reads; no batches when the data holds out no validation
  double cast_divisor = 0;        // MoE layers x micro-batches: casts are reported per layer and micro-batch
};

// Closes the progress display, completes the result and prints the summary, its last line the run's
// time by part. Collective: every rank reaches the end of the run together.
TrainResult finish_run(TrainRun& run);

// Loads the weights (into the optimizer's f32 masters where it keeps them), the optimizer state, the buffers
// and the data position of the checkpoint at `dir` into `setup`, and returns its meta: the loop goes on from its
// step (run_checkpoint.cpp; TrainRun's constructor calls it).
CheckpointMeta resume_from_checkpoint(RunSetup& setup, const std::string& dir);

// Saves the run's weights, optimizer state and data position as the checkpoint of step `at`, and
// records it in run.res.last_checkpoint. Collective: the first expert-parallel group gathers the
// expert shards, rank 0 writes the full state while the others wait at a barrier, so the checkpoint
// is complete when any rank goes on (run_checkpoint.cpp).
void save_run_checkpoint(TrainRun& run, int64_t at);

}  // namespace flowmoe
