// The expert-parallel and expert-data-parallel groups (see parallel/process_group.h): two splits of
// the world, by EP group (rank / E) and by position inside it (rank % E).
#include "parallel/process_group.h"

namespace flowmoe {

void check_parallel_sizes(int64_t world_size, int64_t expert_parallel_size, int64_t n_routed_experts) {
  const int64_t e = expert_parallel_size;
  FLOWMOE_CHECK(e >= 1, ConfigError, "parallel.expert_parallel_size must be >= 1, got ", e);
  FLOWMOE_CHECK(world_size % e == 0, ConfigError, "parallel.expert_parallel_size ", e, " does not divide the ",
                world_size, " ranks of the run");
  FLOWMOE_CHECK(n_routed_experts % e == 0, ConfigError, "parallel.expert_parallel_size ", e,
                " does not divide model.n_routed_experts ", n_routed_experts, " (every rank holds as many experts)");
  FLOWMOE_CHECK(e == 1 || n_routed_experts >= e, ConfigError, "parallel.expert_parallel_size ", e,
                " needs at least one routed expert per rank, but model.n_routed_experts is ", n_routed_experts);
}

ParallelState make_parallel_state(std::shared_ptr<Communicator> world, int64_t expert_parallel_size,
                                  int64_t n_routed_experts) {
  FLOWMOE_CHECK(world != nullptr, CommError, "make_parallel_state: no world communicator");
  check_parallel_sizes(world->size(), expert_parallel_size, n_routed_experts);
  const int e = int(expert_parallel_size), rank = world->rank();
  ParallelState st;
  st.expert_parallel_size = e;
  st.expert_data_parallel_size = world->size() / e;
  st.data_parallel_size = world->size();
  st.num_local_experts = n_routed_experts / e;
  // Both splits are collective over the world, so every rank makes them in this order.
  st.expert_parallel = world->split(rank / e, rank);
  st.expert_data_parallel = world->split(rank % e, rank);
  st.expert_offset = st.expert_parallel->rank() * st.num_local_experts;
  st.world = std::move(world);
  return st;
}

}  // namespace flowmoe
