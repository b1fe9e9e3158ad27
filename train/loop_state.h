// What a training run's loop changes every step (LoopState): the step reached, the steps queued and not yet read
// back, the step scalars on their way back (step_state.h), the training time, the casts of the last step. The
// set-up it runs on is run_setup.h's; train_step.cpp takes the steps, trainer.cpp drives the loop.
#pragma once
#include <cmath>
#include <cstdint>
#include <deque>

#include "dataset/data.h"
#include "engine/cast_stats.h"
#include "engine/device.h"
#include "engine/tensor.h"
#include "kernels/step_control.h"
#include "train/lap_timer.h"
#include "train/step_state.h"

namespace flowmoe {

// What the host knows of a step once it is queued; the rest comes with its StepReadout.
struct IssuedStep {
  DataPosition data_before;  // where the data was before the step's batches (a void step takes them again)
  int64_t host_syncs = 0;
  double moe_casts = NAN;
  bool has_exchanges = false;  // expert parallelism: the step closed a window of exchange timings
  bool has_aux = false;
};

struct LoopState {
  LoopState(Device device, const StepSchedule& schedule) : step_state(device, schedule) {}

  // Where the run stands. A resume sets step and skipped from its checkpoint (run.cpp); train_step.cpp moves
  // them as steps are queued, read back or run again; trainer.cpp notes the checkpoints it saves.
  int64_t step = 0;         // the last step taken or queued (the checkpoint's after a resume)
  int64_t skipped = 0;      // steps whose update was skipped, over the whole run
  int64_t steps_done = 0;   // steps taken by this call
  int64_t last_saved = -1;  // the step of the last checkpoint this call saved

  // The steps in flight: queued on the device and read back a step later (train_step.cpp), and what they took.
  StepState step_state;           // the optimizer step's scalars where the weights live, and their readout
  std::deque<IssuedStep> issued;  // queued steps whose metrics are not read yet, oldest first
  // Spent in steps, evaluation and checkpoints excluded: each read-back is a lap, and the loop restarts the timer
  // when it queues a step while none is pending (after an evaluation or a checkpoint).
  LapTimer time;
  CastCounts last_casts;  // of the last step taken

  // parallel.ep_capacity_factor: [1] i32 on the device, the most rows a zero-sync exchange needed past its
  // buffers since the last void step was run again (undefined: worst-case buffers), and the rows the buffers
  // have grown to since.
  Tensor exchange_overflow;
  int64_t exchange_min_rows = 0;
};

}  // namespace flowmoe
