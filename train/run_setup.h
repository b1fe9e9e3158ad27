// What a command builds once from its config and keeps while it runs (RunSetup): the ranks and their groups,
// the device, then, in the order the command needs them, the data, the model with its weights, and for training
// the optimizer with its gradient reducer. train (run.h), eval, generate, fp8-error and parity (through train)
// build it alike; what changes every step is the loop's (loop_state.h).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "dataset/data.h"
#include "engine/device.h"
#include "layers/transformer.h"
#include "parallel/communicator.h"
#include "parallel/grad_reducer.h"
#include "parallel/process_group.h"
#include "train/memory_estimate.h"
#include "train/optimizer.h"

namespace flowmoe {

class RunSetup {
 public:
  // The ranks of `world` (null: this process alone) and their expert-parallel groups (collective: every rank
  // builds them, parallel/expert_parallel.h), on `device` (unset: train.device resolved). Allocates nothing.
  RunSetup(const Config& cfg, std::shared_ptr<Communicator> world = nullptr,
           std::optional<Device> device = std::nullopt);
  RunSetup(const RunSetup&) = delete;
  RunSetup& operator=(const RunSetup&) = delete;

  // Refuses a model whose estimated memory for `use` (at the config's whole batch) exceeds what the device has
  // available (ConfigError, memory_estimate.h); a check before anything is allocated.
  void check_fits(MemoryUse use) const;
  // The config's data (DataLoader::from_config), read once.
  DataLoader& read_data();
  // The config's model on this set-up's device: with `seed` and `moe`, or train.seed and the MoE options of these
  // ranks (moe_options). Built once, after the memory check.
  Transformer& build_model(uint64_t seed, const MoeOptions& moe);
  Transformer& build_model();
  // Fills the model's weights and buffers from the checkpoint at `dir` (checkpoint.partial_load and
  // checkpoint.allow_nonfinite as the config says) and returns its meta.
  CheckpointMeta load_weights(const std::string& dir);
  // Training: the gradient reducer of several ranks (or of one rank on nccl) and AdamW over the model's weights,
  // with its f32 masters where the weights are stored narrower (precision.param_dtype) and the FP8 weight copies it
  // writes (precision.fp8_weights). Refuses optimizer.router_lr_scale without a router.
  void build_optimizer();

  DataLoader& data() { return *data_; }
  const DataLoader& data() const { return *data_; }
  Transformer& model() { return *model_; }
  const Transformer& model() const { return *model_; }
  AdamW& optimizer() { return *opt_; }
  const AdamW& optimizer() const { return *opt_; }
  // Null where one rank reduces nothing.
  GradientReducer* reducer() const { return reducer_.get(); }

  const Config& cfg;
  const std::shared_ptr<Communicator> world;  // the given world, or a world of this process alone
  const int rank, world_size;
  const ParallelState parallel;  // the expert-parallel and expert-data-parallel groups
  const bool is_root;            // rank 0: prints and writes what one process writes
  const Device device;
  const DType compute;

 private:
  std::optional<DataLoader> data_;
  std::optional<Transformer> model_;
  // Before the optimizer, whose moments a sharded reducer sizes to this rank's segments.
  std::unique_ptr<GradientReducer> reducer_;
  std::optional<AdamW> opt_;
};

}  // namespace flowmoe
