// The MPI services of parallel/backends.h in a build without MPI (CMake did not find it): each throws
// a CommError saying how to get it, so callers compile the same code either way. A single-process run
// never reaches them (init_distributed picks the none backend for world size 1).
#include "parallel/backends.h"

namespace flowmoe {

[[noreturn]] static void no_mpi(const char* what) {
  FLOWMOE_THROW(CommError, what, ": flowmoe was built without MPI: install libopenmpi-dev and rebuild");
}

bool built_with_mpi() { return false; }
std::shared_ptr<Communicator> make_mpi_world_communicator() { no_mpi("backend mpi"); }
int mpi_node_local_rank() { no_mpi("the local rank from MPI"); }
bool mpi_abort_world(int) { return false; }

}  // namespace flowmoe
