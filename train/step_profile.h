// `flowmoe train --profile N`: step N of the run under the op profiler (engine/profiler.h), then
// its table: the step's wall time; the ops' device time by part of the model (attention, MoE, dense
// MLP, embedding, head, optimizer), by layer, and by op with calls, host time, TFLOP/s and GB/s.
// Printed by rank 0 and written to <logging.out_dir>/profile.txt. docs/TRAINING.md shows one.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/profiler.h"
#include "train/metrics.h"

namespace flowmoe {

struct TrainRun;

struct StepProfile {
  int64_t step = 0;
  std::string device;  // "cuda:0", "cpu"
  double wall_ms = 0;  // the whole step, host clock, the device drained at both ends
  std::vector<OpTiming> ops;
};

// The part of the model a profiler scope belongs to: "layers.3.moe" -> "moe"; others as they are,
// "" -> "(outside the model)".
std::string profile_part(const std::string& scope);

std::string profile_table(const StepProfile& profile, size_t max_ops = 30);

// train_step under the profiler: the table goes to the run's progress output and profile.txt.
std::optional<StepMetrics> profiled_train_step(TrainRun& run);

}  // namespace flowmoe
