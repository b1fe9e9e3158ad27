// Expert parallelism in a run: its groups, their description and the checkpoint gather (see expert_parallel.h).
#include "parallel/expert_parallel.h"

#include "kernels/common/error.h"
#include "parallel/backends.h"
#include "parallel/distributed.h"

namespace flowmoe {

ParallelState run_parallel_state(std::shared_ptr<Communicator> world, int64_t expert_parallel_size,
                                 int64_t n_routed_experts, const std::string& origin) {
  const int64_t e = expert_parallel_size, experts = n_routed_experts;
  try {
    check_parallel_sizes(world->size(), e, experts);
  } catch (const ConfigError& err) {
    // Every rank has the same config and world size, so every rank throws here, before any collective.
    std::string why = err.what();
    const std::string key = "parallel.expert_parallel_size";
    if (why.rfind(key + " ", 0) == 0) why = why.substr(key.size() + 1);  // the key is named once, in front
    if (world->size() == 1)
      why += " (expert parallelism shares the experts out over processes: start a multiple of " + std::to_string(e) +
             " of them with mpirun -np or srun -n)";
    throw AllRanksConfigError(origin + ": " + key + ": " + why);
  }
  if (e > 1) return make_parallel_state(std::move(world), e, experts);
  ParallelState ps;
  ps.expert_parallel = make_none_communicator();
  ps.expert_data_parallel = world;
  ps.expert_data_parallel_size = ps.data_parallel_size = world->size();
  ps.num_local_experts = experts;
  ps.world = std::move(world);
  return ps;
}

std::string describe_ranks(const ParallelState& ps, int64_t batch_size) {
  const int64_t n = ps.world->size(), b = batch_size;
  const std::string ranks = std::to_string(n) + " ranks (backend " + ps.world->backend_name() + "), each reads " +
                            std::to_string(b / n) + " of every batch of " + std::to_string(b) + " sequences";
  if (ps.expert_parallel_size == 1) return "data-parallel: " + ranks;
  const std::string e = std::to_string(ps.expert_parallel_size), k = std::to_string(ps.num_local_experts);
  return "expert-parallel " + e + " x data-parallel " + std::to_string(ps.expert_data_parallel_size) + ": " + ranks +
         " and holds " + k + " of the " + std::to_string(ps.num_local_experts * ps.expert_parallel_size) +
         " routed experts: rank r the experts [" + k + "p, " + k + "p + " + k + ") with p = r mod " + e;
}

bool holds_expert_shards(const std::vector<Variable>& params, const std::vector<ParamShard>& shards) {
  for (size_t i = 0; i < shards.size() && i < params.size(); ++i)
    if (shards[i].sharded(params[i])) return true;
  return false;
}

namespace {

// The full tensor of one shard: the group's rows in rank order, on the host where kept.
Tensor gather_rows(Communicator& group, const Tensor& local, const ParamShard& shard, const std::string& name,
                   bool keep) {
  FLOWMOE_CHECK(local.size(0) * group.size() == shard.full_rows && shard.offset == group.rank() * local.size(0), Error,
                "'", name, "': rows [", shard.offset, ", ", shard.offset + local.size(0), ") of ", shard.full_rows,
                " are not this rank's share of an expert-parallel group of ", group.size());
  // A sharded optimizer's gathered moments come from the host.
  Tensor full = group.all_gather(local.to(group.native_device()).contiguous());
  return keep ? full.to(Device::cpu()) : Tensor();
}

}  // namespace

FullState gather_full_state(Communicator& expert_parallel, const std::vector<Variable>& params,
                            const std::vector<ParamShard>& shards, const std::vector<Tensor>& exp_avg,
                            const std::vector<Tensor>& exp_avg_sq, bool keep) {
  FLOWMOE_CHECK(shards.size() == params.size() && exp_avg.size() == params.size() && exp_avg_sq.size() == params.size(),
                Error, "gather_full_state: ", params.size(), " parameters, ", shards.size(), " shards, ",
                exp_avg.size(), " / ", exp_avg_sq.size(), " moments");
  FullState full;
  for (size_t i = 0; i < params.size(); ++i) {
    const Variable& p = params[i];
    if (!shards[i].sharded(p)) {
      if (!keep) continue;
      full.params.push_back(p);
      full.exp_avg.push_back(exp_avg[i]);
      full.exp_avg_sq.push_back(exp_avg_sq[i]);
      continue;
    }
    // Every rank of the group gathers the same tensors in the same order, kept or not.
    Tensor w = gather_rows(expert_parallel, p.data(), shards[i], p.name(), keep);
    Tensor m = gather_rows(expert_parallel, exp_avg[i], shards[i], p.name() + ".exp_avg", keep);
    Tensor v = gather_rows(expert_parallel, exp_avg_sq[i], shards[i], p.name() + ".exp_avg_sq", keep);
    if (!keep) continue;
    full.params.emplace_back(w, false, p.name());
    full.exp_avg.push_back(m);
    full.exp_avg_sq.push_back(v);
  }
  return full;
}

}  // namespace flowmoe
