// The training loop: micro-batches with gradient accumulation, global-norm clipping, AdamW on the
// fp32 master weights, the non-finite policy, periodic validation, checkpoints and resume.
// On the CPU every op is deterministic, so a resumed run repeats the uninterrupted loss sequence
// bit for bit (tests/test_checkpoint.cpp).
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
#include "layers/transformer.h"
#include "parallel/communicator.h"
#include "parallel/process_group.h"
#include "train/stop_request.h"  // request_stop: a signal or the stop file stops a run
#include "train/train_options.h"

namespace flowmoe {

// Runs the configured training. Writes <out_dir>/config.yaml (the resolved config) and the metrics
// file; checkpoints go to cfg.checkpoint_dir(). A stop request (stop_request.h) ends it early with a
// checkpoint of the last finished step: one process drops a step in progress at its next micro-batch
// (none under a CUDA graph, which replays the step whole); several ranks agree on it once per step, after
// the step's evaluation and after its checkpoint, and stop together. With several ranks,
// parallel.timeout_s runs the collectives' watchdog (parallel/watchdog.h) for the call.
TrainResult train(const Config& cfg, const TrainOptions& opts = {});

}  // namespace flowmoe
