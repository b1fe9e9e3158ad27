// Starting a distributed run: which launcher started this process (mpirun, a PMI launcher such as
// MPICH's hydra, Slurm's srun), which communicator backend to use, the world communicator and this
// rank's device; and the check that every rank was given the same config. A plain single-process run
// needs no MPI at run time: MPI is initialized only when a launcher started more than one process or
// backend mpi is asked for by name.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "kernels/common/name_table.h"
#include "parallel/communicator.h"

namespace flowmoe {

// A configuration error that every rank raises at the same point, from values the ranks agree on
// (check_same_config, a batch that does not split over the ranks): no rank is left waiting in a
// collective, so each may print it and exit on its own instead of aborting the others.
class AllRanksConfigError : public ConfigError {
  using ConfigError::ConfigError;
};

// auto: none for world size 1; nccl for a CUDA run when the build has NCCL; mpi otherwise.
enum class CommBackend : uint8_t { automatic, none, mpi, nccl };
// parallel.backend's names, in the order its choices are listed.
inline constexpr EnumName<CommBackend> kCommBackendNames[] = {{CommBackend::automatic, "auto"},
                                                              {CommBackend::nccl, "nccl"},
                                                              {CommBackend::mpi, "mpi"},
                                                              {CommBackend::none, "none"}};
CommBackend parse_comm_backend(const std::string& name);  // "auto", "nccl", "mpi", "none"; ConfigError otherwise
const char* comm_backend_name(CommBackend backend);

// What the launcher says about this process, from its environment variables.
struct LaunchInfo {
  int world_size = 1;
  int rank = 0;
  int local_rank = 0;    // among the processes on this host (0 when the launcher does not say)
  std::string launcher;  // the variable the size came from, e.g. "OMPI_COMM_WORLD_SIZE"; "" for a plain run
};
// Looks one environment variable up (nullptr when unset); std::getenv in a real run.
using EnvLookup = std::function<const char*(const char* name)>;
// Checked in order: OMPI_COMM_WORLD_SIZE (Open MPI), PMI_SIZE (MPICH hydra, Intel MPI),
// SLURM_STEP_NUM_TASKS then SLURM_NTASKS (srun). A value that is not a positive integer is a ConfigError.
LaunchInfo detect_launch(const EnvLookup& env);
LaunchInfo detect_launch();  // from this process's environment

// The backend to use: requested, with auto resolved; ConfigError for a choice that cannot work
// (none with several processes, nccl for a CPU run).
CommBackend resolve_backend(CommBackend requested, int world_size, bool use_cuda, bool have_nccl);

struct DistributedOptions {
  CommBackend backend = CommBackend::automatic;
  bool use_cuda = false;  // the run's tensors live on CUDA devices
  // What every rank must agree on (the command and the resolved config): with several processes,
  // check_same_config over it is the first collective after MPI starts.
  std::string config_text;
};

struct DistributedRuntime {
  std::shared_ptr<Communicator> world;
  CommBackend backend = CommBackend::none;  // resolved
  LaunchInfo launch;
  // This rank's device: cpu, or for a CUDA run cuda:<local rank> (nccl: one GPU per rank; mpi
  // staging may share GPUs, cuda:<local rank mod GPUs>). Made current with cuda_set_device.
  Device device;
};
DistributedRuntime init_distributed(const DistributedOptions& options = {});

// 64-bit FNV-1a of the text.
uint64_t config_hash(const std::string& text);
// Every rank all-gathers the hash of its config text; if they differ, every rank throws the same
// AllRanksConfigError naming which ranks had which hash and the first key whose value differs (so no
// rank goes on alone and hangs its peers).
void check_same_config(Communicator& comm, const std::string& config_text);
// The first key line where two config texts (to_yaml's: two-space nesting, "key: value") differ, for a
// message: "train.steps is 200 on rank 0 and 300 on rank 1".
std::string first_config_difference(const std::string& a, int rank_a, const std::string& b, int rank_b);

}  // namespace flowmoe
