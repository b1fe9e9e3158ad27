// Groups and start-up (parallel/process_group.h, parallel/distributed.h): split, the expert-parallel
// and expert-data-parallel groups for every expert_parallel_size the world allows, size validation,
// the config agreement check (an error on every rank, never a hang), launcher detection from a
// given environment, and the backend choice.
#include <map>

#include "parallel/process_group.h"
#include "tests/mpi/comm_test_util.h"
#include "tests/support/checks.h"

namespace flowmoe::test {
namespace {

// The world ranks of the members of `group`, in group-rank order.
std::vector<int64_t> members(Communicator& group) {
  Tensor mine = Tensor::from_ints({int64_t(test_world().rank())}, {1}, DType::i64, group.native_device());
  return group.all_gather(mine).to_ints();
}

TEST(Groups, SplitOrdersByKeyAndGroupsByColor) {
  Communicator& world = test_world();
  const int me = world.rank(), n = world.size();
  std::shared_ptr<Communicator> reversed = world.split(0, -me);
  EXPECT_EQ(reversed->size(), n);
  EXPECT_EQ(reversed->rank(), n - 1 - me);
  std::vector<int64_t> want;
  for (int r = n - 1; r >= 0; --r) want.push_back(r);
  EXPECT_EQ(members(*reversed), want);

  std::shared_ptr<Communicator> parity = world.split(me % 2, me);
  want.clear();
  for (int r = me % 2; r < n; r += 2) want.push_back(r);
  EXPECT_EQ(members(*parity), want);
  EXPECT_STREQ(parity->backend_name(), world.backend_name());
}

TEST(Groups, ExpertParallelAndExpertDataParallelGroupsForEveryDivisor) {
  Communicator& world = test_world();
  const int me = world.rank(), n = world.size();
  const int64_t n_routed = 12;  // divisible by 1, 2 and 4 (the world sizes CI runs)
  for (int e = 1; e <= n; ++e) {
    if (n % e || n_routed % e) continue;
    SCOPED_TRACE("expert_parallel_size " + std::to_string(e));
    ParallelState st = make_parallel_state(test_runtime().world, e, n_routed);
    EXPECT_EQ(st.expert_parallel_size, e);
    EXPECT_EQ(st.data_parallel_size, n);
    EXPECT_EQ(st.expert_data_parallel_size, n / e);
    EXPECT_EQ(st.num_local_experts, n_routed / e);
    EXPECT_EQ(st.expert_parallel->rank(), me % e);
    EXPECT_EQ(st.expert_offset, (me % e) * (n_routed / e));
    std::vector<int64_t> ep, edp;
    for (int r = me / e * e; r < me / e * e + e; ++r) ep.push_back(r);  // consecutive ranks
    for (int r = me % e; r < n; r += e) edp.push_back(r);               // same position in each EP group
    EXPECT_EQ(members(*st.expert_parallel), ep);
    EXPECT_EQ(members(*st.expert_data_parallel), edp);
    // Experts are partitioned inside an EP group: its offsets cover [0, n_routed) once.
    Tensor offset = Tensor::from_ints({st.expert_offset}, {1}, DType::i64, st.expert_parallel->native_device());
    std::vector<int64_t> offsets = st.expert_parallel->all_gather(offset).to_ints();
    for (int i = 0; i < e; ++i) EXPECT_EQ(offsets[size_t(i)], i * (n_routed / e));
  }
}

TEST(Groups, SizesThatDoNotDivideAreConfigErrors) {
  EXPECT_NO_THROW(check_parallel_sizes(8, 4, 64));
  EXPECT_NO_THROW(check_parallel_sizes(1, 1, 0));
  EXPECT_TRUE(throws_naming<ConfigError>([] { check_parallel_sizes(4, 3, 12); },
                                         {"parallel.expert_parallel_size 3", "4 ranks"}));
  EXPECT_TRUE(throws_naming<ConfigError>([] { check_parallel_sizes(4, 2, 3); }, {"model.n_routed_experts 3"}));
  EXPECT_TRUE(throws_naming<ConfigError>([] { check_parallel_sizes(4, 0, 8); }, {">= 1"}));
  EXPECT_TRUE(throws_naming<ConfigError>([] { check_parallel_sizes(2, 2, 0); }, {"at least one routed expert"}));
  // On the world: every rank refuses before splitting anything, so no rank waits for the others.
  const int n = test_world().size();
  EXPECT_TRUE(
      throws_naming<ConfigError>([&] { make_parallel_state(test_runtime().world, n + 1, 12); }, {"does not divide"}));
  test_world().barrier();
}

TEST(Groups, SameConfigPassesAndDifferentConfigsFailOnEveryRank) {
  Communicator& world = test_world();
  const int me = world.rank(), n = world.size();
  EXPECT_EQ(config_hash(""), 14695981039346656037ull);
  EXPECT_EQ(config_hash("a"), 0xaf63dc4c8601ec8cull);  // FNV-1a 64 reference value
  EXPECT_NO_THROW(check_same_config(world, "model:\n  hidden_size: 128\n"));
  // Rank 0 has another config: every rank throws the same error (a rank that went on would hang).
  std::string text = me == 0 ? "model:\n  hidden_size: 256\n" : "model:\n  hidden_size: 128\n";
  if (n == 1) {
    EXPECT_NO_THROW(check_same_config(world, text));
  } else {
    EXPECT_TRUE(throws_naming<ConfigError>([&] { check_same_config(world, text); },
                                           {"different configs", "rank 0 hash", "same config file"}));
    EXPECT_TRUE(
        throws_naming<ConfigError>([&] { check_same_config(world, "rank " + std::to_string(me)); }, {"rank 1 hash"}));
  }
  world.barrier();
}

TEST(Launch, DetectsTheLauncherFromItsEnvironment) {
  auto from = [](std::map<std::string, std::string> vars) {
    return detect_launch([vars](const char* name) -> const char* {
      auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    });
  };
  LaunchInfo plain = from({});
  EXPECT_EQ(plain.world_size, 1);
  EXPECT_EQ(plain.launcher, "");
  LaunchInfo ompi = from({{"OMPI_COMM_WORLD_SIZE", "4"},
                          {"OMPI_COMM_WORLD_RANK", "2"},
                          {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                          {"SLURM_NTASKS", "8"}});
  EXPECT_EQ(ompi.world_size, 4);
  EXPECT_EQ(ompi.rank, 2);
  EXPECT_EQ(ompi.launcher, "OMPI_COMM_WORLD_SIZE");
  LaunchInfo pmi = from({{"PMI_SIZE", "2"}, {"PMI_RANK", "1"}, {"MPI_LOCALRANKID", "1"}});
  EXPECT_EQ(pmi.world_size, 2);
  EXPECT_EQ(pmi.local_rank, 1);
  LaunchInfo slurm =
      from({{"SLURM_NTASKS", "16"}, {"SLURM_STEP_NUM_TASKS", "8"}, {"SLURM_PROCID", "5"}, {"SLURM_LOCALID", "1"}});
  EXPECT_EQ(slurm.world_size, 8);
  EXPECT_EQ(slurm.rank, 5);
  EXPECT_EQ(slurm.launcher, "SLURM_STEP_NUM_TASKS");
  LaunchInfo sbatch = from({{"SLURM_NTASKS", "3"}, {"SLURM_PROCID", "2"}});
  EXPECT_EQ(sbatch.world_size, 3);
  EXPECT_EQ(sbatch.rank, 2);
  EXPECT_EQ(sbatch.local_rank, 0);
  EXPECT_TRUE(throws_naming<ConfigError>([&] { from({{"PMI_SIZE", "two"}}); }, {"PMI_SIZE='two'"}));
  EXPECT_TRUE(throws_naming<ConfigError>([&] { from({{"PMI_SIZE", "0"}}); }, {"PMI_SIZE"}));
  EXPECT_TRUE(throws_naming<ConfigError>([&] { from({{"PMI_SIZE", "2"}, {"PMI_RANK", "2"}}); }, {"not below"}));
}

TEST(Launch, BackendChoice) {
  EXPECT_EQ(parse_comm_backend("auto"), CommBackend::automatic);
  EXPECT_EQ(parse_comm_backend("nccl"), CommBackend::nccl);
  EXPECT_STREQ(comm_backend_name(parse_comm_backend("mpi")), "mpi");
  EXPECT_TRUE(throws_naming<ConfigError>([] { parse_comm_backend("gloo"); }, {"gloo", "auto, nccl, mpi, none"}));
  EXPECT_EQ(resolve_backend(CommBackend::automatic, 1, true, true), CommBackend::none);
  EXPECT_EQ(resolve_backend(CommBackend::automatic, 4, true, true), CommBackend::nccl);
  EXPECT_EQ(resolve_backend(CommBackend::automatic, 4, true, false), CommBackend::mpi);
  EXPECT_EQ(resolve_backend(CommBackend::automatic, 4, false, true), CommBackend::mpi);
  EXPECT_EQ(resolve_backend(CommBackend::mpi, 1, false, false), CommBackend::mpi);
  EXPECT_TRUE(throws_naming<ConfigError>([] { resolve_backend(CommBackend::none, 2, false, false); }, {"one process"}));
  EXPECT_TRUE(throws_naming<ConfigError>([] { resolve_backend(CommBackend::nccl, 2, false, true); }, {"on the CPU"}));
}

TEST(Launch, ThisProcessStartedWithTheExpectedBackend) {
  const DistributedRuntime& rt = test_runtime();
  EXPECT_EQ(rt.launch.world_size, rt.world->size());
  EXPECT_EQ(rt.launch.rank, rt.world->rank());
  EXPECT_TRUE(rt.device.is_cpu());
  EXPECT_STREQ(rt.world->backend_name(), rt.world->size() == 1 ? "none" : "mpi");
  EXPECT_EQ(rt.backend, rt.world->size() == 1 ? CommBackend::none : CommBackend::mpi);
}

}  // namespace
}  // namespace flowmoe::test
