// ParallelState: the communicator groups of expert and data parallelism, made from the world.
//
// With W ranks and expert_parallel_size E: an expert-parallel (EP) group is E consecutive ranks
// [g*E, (g+1)*E), which together hold every routed expert, n_routed_experts / E each; tokens move
// between them by all_to_all. The expert-data-parallel (EDP) group of a rank is the W / E ranks at the
// same position in their EP groups: they hold the same experts, and all-reduce those experts'
// gradients. Every rank reads its own data, so the data-parallel size is W, and the dense (non-expert)
// gradients are all-reduced over the world.
#pragma once
#include <cstdint>
#include <memory>

#include "parallel/communicator.h"

namespace flowmoe {

// ConfigError unless expert_parallel_size >= 1 divides both world_size and n_routed_experts (with at
// least one expert per rank when expert_parallel_size > 1).
void check_parallel_sizes(int64_t world_size, int64_t expert_parallel_size, int64_t n_routed_experts);

struct ParallelState {
  std::shared_ptr<Communicator> world;
  std::shared_ptr<Communicator> expert_parallel;       // E consecutive ranks: this rank's EP group
  std::shared_ptr<Communicator> expert_data_parallel;  // W / E ranks holding the same experts as this one
  int64_t expert_parallel_size = 1;                    // E
  int64_t expert_data_parallel_size = 1;               // W / E
  int64_t data_parallel_size = 1;                      // W: every rank reads its own data
  int64_t num_local_experts = 0;                       // n_routed_experts / E, held by this rank
  int64_t expert_offset = 0;                           // the first of them: expert_parallel->rank() * num_local_experts
};

// Splits `world` into the groups above (collective over world: every rank calls it with the same sizes).
ParallelState make_parallel_state(std::shared_ptr<Communicator> world, int64_t expert_parallel_size,
                                  int64_t n_routed_experts);

}  // namespace flowmoe
