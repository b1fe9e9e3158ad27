// The reductions of data-parallel training (see data_parallel.h).
#include "train/data_parallel.h"

#include <cmath>
#include <memory>

#include "train/grad_reducer.h"

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

double global_grad_norm(const ParallelState& ps, AdamW& opt, const std::vector<ParamShard>& shards) {
  if (ps.expert_parallel_size == 1 && !opt.sharded()) return opt.grad_norm();
  auto [dense, experts] = opt.grad_square_sums(expert_shard_flags(ps, shards));
  if (opt.sharded()) {  // each rank summed its segments of the buckets
    dense = all_reduce_values(*ps.world, {dense}, ReduceOp::sum)[0];
    if (ps.expert_parallel_size > 1) experts = all_reduce_values(*ps.expert_data_parallel, {experts}, ReduceOp::sum)[0];
  }
  if (ps.expert_parallel_size > 1) experts = all_reduce_values(*ps.expert_parallel, {experts}, ReduceOp::sum)[0];
  return std::sqrt(dense + experts);
}

void reduce_square_sums(const ParallelState& ps, const Tensor& sums, bool sharded) {
  const Tensor dense = sums.slice(0, 0, 1), experts = sums.slice(0, 1, 2);
  if (sharded) {
    ps.world->all_reduce(dense, ReduceOp::sum);
    if (ps.expert_parallel_size > 1) ps.expert_data_parallel->all_reduce(experts, ReduceOp::sum);
  }
  if (ps.expert_parallel_size > 1) ps.expert_parallel->all_reduce(experts, ReduceOp::sum);
}

std::vector<bool> expert_shard_flags(const ParallelState& ps, const std::vector<ParamShard>& shards) {
  std::vector<bool> flags;
  if (ps.expert_parallel_size > 1)
    for (const ParamShard& s : shards) flags.push_back(s.expert);
  return flags;
}

}  // namespace flowmoe
