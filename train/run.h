// One training run's state (TrainRun), built in run.cpp with its set-up in the order the members are
// declared, and what the run does outside its steps: its checkpoints and its summary. trainer.cpp
// drives the loop; train_step.h takes the steps.
#pragma once
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config/config.h"
#include "dataset/data.h"
#include "dataset/run_tokenizer.h"
#include "engine/cast_stats.h"
#include "engine/cuda_graph.h"
#include "engine/device.h"
#include "io/dir_lock.h"
#include "layers/transformer.h"
#include "parallel/communicator.h"
#include "parallel/process_group.h"
#include "train/evaluation.h"
#include "train/grad_reducer.h"
#include "train/metrics.h"
#include "train/model_flops.h"
#include "train/optimizer.h"
#include "train/progress.h"
#include "train/step_state.h"
#include "train/train_options.h"

namespace flowmoe {

// What the host knows of a step once it is queued; the rest comes with its StepReadout.
struct IssuedStep {
  DataPosition data_before;  // where the data was before the step's batches (a void step takes them again)
  int64_t host_syncs = 0;
  double moe_casts = NAN;
  bool has_exchanges = false;  // expert parallelism: the step closed a window of exchange timings
  bool has_aux = false;
};

// Where a run's wall time goes: the summary's "time:" line. Set-up is split into parts by laps.
struct RunClock {
  using Clock = std::chrono::steady_clock;
  // `started`: when the command began; the time until now is the part "start-up" (the ranks' start).
  explicit RunClock(std::optional<Clock::time_point> started) : start(started.value_or(Clock::now())), last(start) {
    if (started) lap("start-up");
  }
  // Ends the set-up part `name` now: its time is the time since the previous lap.
  void lap(const std::string& name) {
    const Clock::time_point now = Clock::now();
    setup.emplace_back(name, std::chrono::duration<double>(now - last).count());
    last = now;
  }
  static double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
  double seconds_since_start() const { return seconds_since(start); }

  Clock::time_point start, last;
  std::vector<std::pair<std::string, double>> setup;  // (part, seconds) in order
  double evaluation_seconds = 0, checkpoint_seconds = 0;
};
// A lap as a member: placed between TrainRun's members, it times the one built before it.
struct SetupLap {
  SetupLap(RunClock& clock, const char* name) { clock.lap(name); }
};

// Everything a run holds. Members are built in declaration order, which is the order set-up must
// keep: nothing is allocated for the model before the memory estimate says it fits.
struct TrainRun {
  TrainRun(const Config& cfg, const TrainOptions& opts);
  TrainRun(const TrainRun&) = delete;
  TrainRun& operator=(const TrainRun&) = delete;

  RunClock clock;  // first: set-up begins with the first member (or earlier, opts.started)
  const Config& cfg;
  const TrainOptions& opts;
  const std::shared_ptr<Communicator> world;  // opts.world, or a world of this process alone
  const int rank, world_size;                 // this rank's slice of each batch; the data-parallel size
  const ParallelState parallel;               // the expert-parallel and expert-data-parallel groups
  const bool is_root;                         // rank 0: prints, writes the metrics and the checkpoints
  const Device device;
  const DType compute;
  const ModelFlops flops;        // model FLOPs per token and this GPU's peak: the metrics' tflops and mfu
  std::string resume_note;       // the start-up line about the resume; declared first: resume_dir fills it
  const std::string resume_dir;  // the checkpoint to resume from; "" for a fresh start
  Progress progress;
  // Rank 0's locks on the run directory and the checkpoint directory (one lock where they are the same
  // folder): taken before anything is written or cleaned up there.
  std::vector<std::unique_ptr<DirLock>> dir_locks;
  TrainResult res;  // out_dir exists and holds config.yaml before the data is read
  SetupLap device_lap{clock, "device and memory check"};
  DataLoader data;
  SetupLap data_lap{clock, "data"};
  Transformer model;
  SetupLap model_lap{clock, "model"};
  // checkpoint.init_from's start-up line ("" without one): the weights are loaded here, before the reducer and
  // the optimizer take their copies of them.
  const std::string init_note;
  // Several ranks: the gradient buckets and their schedule; before the optimizer, whose moments a
  // sharded reducer sizes to this rank's segments.
  std::unique_ptr<GradientReducer> reducer;
  AdamW opt;
  SetupLap optimizer_lap{clock, "optimizer"};
  std::optional<MetricsWriter> metrics;  // opened once the step to resume at is known
  StepState state;                       // the optimizer step's scalars where the weights live, and their readout
  // parallel.ep_capacity_factor: [1] i32 on the device, the most rows a zero-sync exchange needed past its
  // buffers since the last void step was run again (undefined: worst-case buffers), and the rows the buffers
  // have grown to since.
  Tensor exchange_overflow;
  int64_t exchange_min_rows = 0;
  // train.sample_every's tokenizer, looked up at the first sample.
  std::optional<RunTokenizer> sample_tokenizer;

  int64_t tokens_per_step = 0;
  ValBatches val;           // what an evaluation reads; no batches when the data holds out no validation
  int64_t end = 0;          // the last step this call takes: train.steps, or opts.stop_after
  double cast_divisor = 0;  // MoE layers x micro-batches: casts are reported per layer and micro-batch
  CastCounts last_casts;    // of the last step taken

  int64_t step = 0;               // the last step taken or queued (the checkpoint's after a resume)
  int64_t skipped = 0;            // steps whose update was skipped, over the whole run
  int64_t steps_done = 0;         // steps taken by this call
  int64_t last_saved = -1;        // the step of the last checkpoint this call saved
  double train_seconds = 0;       // spent in steps, evaluation and checkpoints excluded
  std::deque<IssuedStep> issued;  // queued steps whose metrics are not read yet, oldest first
  // train.cuda_graph: the captured step, its static inputs, and what its capture's host code knew.
  std::unique_ptr<CudaGraphCapture> graph;
  std::vector<Batch> graph_inputs;
  IssuedStep graph_issued;
  CastCounts graph_casts;
  bool graph_failed = false;                         // a capture failed under auto: eager from then on
  int64_t eager_steps = 0;                           // steps this call ran without the graph
  int64_t last_eager_host_syncs = -1;                // the host synchronisations the last of them made
  std::chrono::steady_clock::time_point step_clock;  // when the oldest queued step's time began
};

// Closes the progress display, completes the result and prints the summary, its last line the run's
// time by part. Collective: every rank reaches the end of the run together.
TrainResult finish_run(TrainRun& run);

// Loads the weights (into the optimizer's f32 masters where it keeps them), the optimizer state, the buffers
// and the data position of run.resume_dir (run_checkpoint.cpp; TrainRun's constructor calls it).
void resume_from_checkpoint(TrainRun& run);

// Saves the run's weights, optimizer state and data position as the checkpoint of step `at`, and
// records it in run.res.last_checkpoint. Collective: the first expert-parallel group gathers the
// expert shards, rank 0 writes the full state while the others wait at a barrier, so the checkpoint
// is complete when any rank goes on (run_checkpoint.cpp).
void save_run_checkpoint(TrainRun& run, int64_t at);

}  // namespace flowmoe
