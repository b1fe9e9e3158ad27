// One optimizer step over a training run (run.h): issued and read back in two halves, so that on the
// GPU the next step can be queued before the last one is read (train_step.cpp).
#pragma once
#include <cstdint>
#include <optional>

#include "train/metrics.h"
#include "train/run.h"

namespace flowmoe {

// One optimizer step: the micro-batches with gradient accumulation, the gradient sync point, the
// gradient norm, the non-finite policy, the clipped AdamW update and the expert-bias update.
// Returns the step's metrics (its validation loss left for the caller to fill), or nothing for a void step
// (its exchange needed more rows than parallel.ep_capacity_factor gave it): then the buffers have grown and
// run.loop.step and the data are back before it, so that the loop takes the step again.
std::optional<StepMetrics> train_step(TrainRun& run, bool profiled = false);
// train_step in two halves. issue_step queues step run.loop.step + 1 (on one GPU without reading anything
// back: the scalars stay on the device, step_state.h); complete_step waits for the oldest queued step,
// returns its metrics and applies the non-finite policy. Between them the host may queue the next step.
// A void step voids every step queued after it too: complete_step then reads them all back and sets the
// run back to the void one (nothing pending is left).
// `profiled`: the step the step profiler times, always eager (train.cuda_graph, step_graph.h, is not used for it).
// In one process an eager step that is not profiled checks for a stop request (stop_request.h) before each
// micro-batch: on one, it drops the step (its partial gradients are never applied; run.loop.step and the data go
// back to before it) and returns false, so that a stop waits for a micro-batch, not for a step of any
// number of them. Several ranks never drop a step: they agree on a stop once per step (trainer.cpp), as a
// rank leaving the accumulation alone would leave the others waiting in the step's collectives.
bool issue_step(TrainRun& run, bool profiled = false);
std::optional<StepMetrics> complete_step(TrainRun& run);
// Whether the run's steps compute their scalars on the device (one GPU, one rank, no loss hook), so
// that a step may be queued before the previous one is read.
bool step_scalars_on_device(const TrainRun& run);

}  // namespace flowmoe
