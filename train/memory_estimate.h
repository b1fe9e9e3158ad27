// What a model costs before it exists: its parameter count from the config alone, and an estimate of
// the memory a training step (or an evaluation) needs on the run's device. train() prints both before
// it builds the model and refuses, with a ConfigError naming the keys to reduce, a model that cannot
// fit; without this a model of petabytes would allocate until the system killed the process.
// The terms of the estimate are documented in memory_estimate.cpp; tests/test_memory_estimate.cpp
// compares it with the measured peak of CPU runs.
#pragma once
#include <cstdint>
#include <string>

#include "config/config.h"
#include "engine/device.h"

namespace flowmoe {

// The parameters Transformer(cfg) creates, exactly (Transformer::num_parameters()). Counted in double,
// which is exact below 2^53 (9e15) parameters; a count beyond int64 saturates at INT64_MAX.
int64_t count_parameters(const ModelConfig& cfg);

enum class MemoryUse {
  train,  // forward + backward + AdamW: master weights, moments, gradients, the autograd graph
  eval,   // forward without a graph (evaluate(), flowmoe eval): weights and one layer's working set
};

struct MemoryEstimate {
  int64_t num_parameters = 0;
  double weight_bytes = 0;      // f32 master weights, MoE buffers, compute-dtype copies, FP8 weight caches
  double optimizer_bytes = 0;   // AdamW exp_avg and exp_avg_sq (optimizer.moment_dtype)
  double gradient_bytes = 0;    // f32 parameter gradients
  double activation_bytes = 0;  // what one micro-batch keeps alive, logits and their gradient included
  std::string drivers;          // the config keys that drive the estimate, "model.hidden_size, ..."
  double total_bytes() const { return weight_bytes + optimizer_bytes + gradient_bytes + activation_bytes; }
  // "about 31 MiB (weights 2.0 MiB, optimizer 3.9 MiB, gradients 2.0 MiB, activations 23 MiB)"
  std::string summary() const;
};

// The ranks a sharded optimizer (parallel.shard_optimizer) splits AdamW's moments over: the world for
// dense parameters, the expert-data-parallel group for routed experts; 1: not sharded.
struct OptimizerShards {
  int64_t dense = 1, experts = 1;
  bool any() const { return dense > 1 || experts > 1; }
};

// The memory `use` of cfg's model needs on `device`, at train.batch_size x data.seq_len tokens.
// Allocates nothing.
MemoryEstimate estimate_memory(const Config& cfg, Device device, MemoryUse use = MemoryUse::train,
                               const OptimizerShards& shards = {});

// Memory a run can still take: free device memory (plus what the caching allocator holds unused) on
// a GPU; MemAvailable from /proc/meminfo (else free physical pages) on the CPU.
double available_memory_bytes(Device device);

// Throws ConfigError when the estimate exceeds what is available on the device, e.g. "the model needs
// about 1.2 TiB (...) but cpu has 21.3 GiB available; reduce model.hidden_size, ... or train.batch_size".
void check_fits(const MemoryEstimate& need, Device device);
void check_fits(const MemoryEstimate& need, double available_bytes, const std::string& device_name);

// "512 B", "2.0 MiB", "21.3 GiB", "1.2 TiB"; beyond EiB stays in EiB.
std::string format_bytes(double bytes);
// "0.49M", "6.74B", "17.6T": a parameter count for messages.
std::string format_count(double count);

}  // namespace flowmoe
