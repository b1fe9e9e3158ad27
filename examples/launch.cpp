// Start-up and error ending of a run on several processes (see launch.h).
#include "examples/launch.h"

#include "parallel/backends.h"
#include "train/train_options.h"

namespace flowmoe {

namespace {
bool g_ranks_started = false;
}

DistributedRuntime start_ranks(const Config& cfg, const std::string& command) {
  DistributedOptions options;
  options.backend = cfg.parallel.backend;
  options.use_cuda = resolve_device(cfg).is_cuda();
  options.config_text = "command: " + command + "\n" + to_yaml(cfg);
  g_ranks_started = true;
  return init_distributed(options);
}

void leave_together(const std::string& what) {
  if (g_ranks_started || launch_world_size() <= 1 || !built_with_mpi()) return;
  g_ranks_started = true;
  check_same_config(*make_mpi_world_communicator(), "command: " + what + " (ends without a run)\n");
}

int launch_rank() {
  try {
    return detect_launch().rank;
  } catch (const std::exception&) {
    return 0;  // a malformed launcher variable is reported where the run starts
  }
}

bool is_root_rank() { return launch_rank() == 0; }

int launch_world_size() {
  try {
    return detect_launch().world_size;
  } catch (const std::exception&) {
    return 1;
  }
}

void end_other_ranks_after(const std::exception& e, int status) {
  if (dynamic_cast<const AllRanksConfigError*>(&e)) return;
  if (launch_world_size() <= 1 || !built_with_mpi()) return;
  try {
    // A rank that failed before MPI started (a config its peers did not share) starts it now: the
    // peers are waiting in MPI's start-up or in a collective, and MPI_Abort reaches them only then.
    make_mpi_world_communicator();
  } catch (const std::exception&) {
    return;
  }
  mpi_abort_world(status);
}

}  // namespace flowmoe
