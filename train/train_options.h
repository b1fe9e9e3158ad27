// What train() is given and gives back (TrainOptions, TrainResult), and what a run's config implies for the model
// it builds: the device, the compute dtype and the MoE layers' options. Below the loop (trainer.h), the run's
// set-up (run.h) and the memory estimate (memory_estimate.h), which all read them.
#pragma once
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/config.h"
#include "engine/device.h"
#include "layers/moe.h"
#include "parallel/communicator.h"
#include "parallel/process_group.h"

namespace flowmoe {

// train.device resolved: auto picks cuda:0 when a GPU is usable. Throws ConfigError naming
// train.device when cuda is asked for and not available.
Device resolve_device(const Config& cfg);
// bf16 on the GPU (every recipe: FP8 is confined to the recipe's FP8 GEMMs), f32 on the CPU.
DType compute_dtype_for(Device device);
// The MoE layers' options a run's config asks for (precision.recipe, precision.align_size, train.recompute); the
// recipe also sets the other linears' precision (fp8_full, layers/transformer.h).
MoeOptions moe_options(const Config& cfg);
// The same on the ranks of `ps`: with expert-parallel size > 1, the layers hold this rank's experts.
MoeOptions moe_options(const Config& cfg, const ParallelState& ps);

struct TrainOptions {
  std::FILE* out = stdout;  // progress and messages (rank 0's only); nullptr: silent
  // The data-parallel ranks (parallel/distributed.h's world); null: this process alone. Every rank
  // calls train() with the same config; train.batch_size is the global batch, split over the ranks.
  std::shared_ptr<Communicator> world;
  std::optional<Device> device;  // this rank's device, as init_distributed chose it; unset: resolve_device(cfg)
  int64_t stop_after = -1;       // stop after this step as if interrupted (tests); -1: run to train.steps
  int64_t profile_step = 0;      // time this step op by op (train/step_profile.h); 0: none
  // When the command began (before the ranks started): the summary's time line counts from here,
  // so the ranks' start-up shows as its first part. Unset: from train()'s call.
  std::optional<std::chrono::steady_clock::time_point> started;
  // Called after a step's backward, before its gradient norm (tests inject faults here).
  std::function<void(int64_t step, const std::vector<Variable>& params)> after_backward;
  // Called with the step's measured LM loss before the non-finite check (tests plant a NaN here).
  std::function<void(int64_t step, double* loss)> after_loss;
};

struct TrainResult {
  int64_t first_step = 1;       // the step the run started at (after a resume: checkpoint + 1)
  int64_t last_step = 0;        // the last step taken
  std::vector<double> losses;   // training loss of each step taken, first_step..last_step
  double first_val_loss = NAN;  // validation loss at the first evaluation (NaN: none)
  double final_val_loss = NAN;  // at the end (NaN: no validation data)
  double tokens_per_s = 0;      // over the whole run
  int64_t skipped_steps = 0;
  bool interrupted = false;  // stopped by a stop request (stop_request.h) or stop_after before train.steps
  int world_size = 1;        // the data-parallel ranks that trained
  std::string out_dir, metrics_file, last_checkpoint;
};

}  // namespace flowmoe
