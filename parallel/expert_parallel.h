// Expert parallelism in a run (train, eval): the groups parallel.expert_parallel_size asks for, checked
// against the launch before any collective; the line that describes the ranks; and the full expert
// tensors a checkpoint holds, gathered from the expert-parallel group (docs/TRAINING.md, "Several
// processes": checkpoints do not depend on the expert-parallel size).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "parallel/param_shard.h"
#include "parallel/process_group.h"

namespace flowmoe {

// The groups of a run's parallel.expert_parallel_size over `world`, for a model of n_routed_experts;
// collective: every rank calls it. A size that does not divide the number of ranks or model.n_routed_experts
// is an AllRanksConfigError naming the key and `origin` (where the config set it: Config::origin), raised on
// every rank alike before any group is split. At size 1 no group is split: the expert-parallel group is this
// rank alone and the expert-data-parallel group is the world itself, so a data-parallel run makes no extra
// communicator.
ParallelState run_parallel_state(std::shared_ptr<Communicator> world, int64_t expert_parallel_size,
                                 int64_t n_routed_experts, const std::string& origin);

// Rank 0's start-up line about the ranks of a run on several, batch_size sequences a batch (train.batch_size):
// "data-parallel: 4 ranks (backend mpi), each reads 2 of every batch of 8 sequences", or with expert parallelism
// "expert-parallel 2 x data-parallel 2: 4 ranks (backend mpi), each reads 2 of every batch of 8 sequences and
// holds 4 of the 8 routed experts: rank r the experts [4p, 4p + 4) with p = r mod 2".
std::string describe_ranks(const ParallelState& ps, int64_t batch_size);

// Whether `shards` (Transformer::parameter_shards()) holds rows of a larger tensor: the model is
// expert-parallel, and its MoE forwards are collective over the expert-parallel group.
bool holds_expert_shards(const std::vector<Variable>& params, const std::vector<ParamShard>& shards);

// A run's trained state as one process holds it: expert shards gathered into their full [E, ...]
// tensors, the other parameters as they are.
struct FullState {
  std::vector<Variable> params;  // the same names; a gathered one is a new leaf on the CPU
  std::vector<Tensor> exp_avg, exp_avg_sq;
};
// Gathers every sharded parameter and its AdamW moments over `expert_parallel` (collective over it:
// its ranks call it with the same parameter list). The group's rank order is the expert order, as its
// ranks are consecutive (parallel/process_group.h). A rank with keep false drops what it gathered and
// gets an empty FullState; gathered tensors are kept on the host, one at a time leaving the device.
FullState gather_full_state(Communicator& expert_parallel, const std::vector<Variable>& params,
                            const std::vector<ParamShard>& shards, const std::vector<Tensor>& exp_avg,
                            const std::vector<Tensor>& exp_avg_sq, bool keep);

}  // namespace flowmoe
