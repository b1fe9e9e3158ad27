// The reductions of data-parallel training (see data_parallel.h).
#include "parallel/data_parallel.h"

#include <cmath>
#include <memory>

#include "parallel/grad_reducer.h"

namespace flowmoe {

void all_reduce_gradients(Communicator& comm, const std::vector<Variable>& params, size_t bucket_bytes) {
  // comm as the world of a run without expert parallelism; the caller keeps it alive.
  ParallelState ps;
  ps.world = std::shared_ptr<Communicator>(std::shared_ptr<Communicator>(), &comm);
  ps.expert_data_parallel = ps.world;
  ps.data_parallel_size = ps.expert_data_parallel_size = comm.size();
  all_reduce_gradients(ps, params, std::vector<ParamShard>(params.size()), bucket_bytes);
}

void all_reduce_gradients(const ParallelState& ps, const std::vector<Variable>& params,
                          const std::vector<ParamShard>& shards, size_t bucket_bytes) {
  GradientReducer reducer(ps, params, shards, /*overlap=*/false, bucket_bytes);
  reducer.begin();
  reducer.finish();
}

namespace {

// The order both the host and the device path sum the two classes of squared norms in (slot 0: dense,
// 1: expert shards): a sharded optimizer's segments over each parameter's data-parallel group first,
// then the expert shards over the expert-parallel group. reduce(comm, slot) sums one slot over comm.
template <class Reduce>
void sum_square_classes(const ParallelState& ps, bool sharded, Reduce&& reduce) {
  const bool experts = ps.expert_parallel_size > 1;
  if (sharded) {
    reduce(*ps.world, 0);
    if (experts) reduce(*ps.expert_data_parallel, 1);
  }
  if (experts) reduce(*ps.expert_parallel, 1);
}

}  // namespace

double global_norm(const ParallelState& ps, std::pair<double, double> square_sums, bool sharded) {
  double sums[2] = {square_sums.first, square_sums.second};
  sum_square_classes(ps, sharded, [&](Communicator& comm, int slot) {
    sums[slot] = all_reduce_values(comm, {sums[slot]}, ReduceOp::sum)[0];
  });
  return std::sqrt(sums[0] + sums[1]);
}

void reduce_square_sums(const ParallelState& ps, const Tensor& sums, bool sharded) {
  sum_square_classes(ps, sharded, [&](Communicator& comm, int slot) {
    comm.all_reduce(sums.slice(0, slot, slot + 1), ReduceOp::sum);
  });
}

std::vector<bool> expert_shard_flags(const ParallelState& ps, const std::vector<ParamShard>& shards) {
  std::vector<bool> flags;
  if (ps.expert_parallel_size > 1)
    for (const ParamShard& s : shards) flags.push_back(s.expert);
  return flags;
}

}  // namespace flowmoe
