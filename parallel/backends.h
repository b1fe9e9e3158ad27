// The communicator backends behind parallel/communicator.h, and the few MPI services the start-up
// code needs. A backend's file is compiled only when its library was found at build time
// (parallel/mpi/, parallel/nccl/); otherwise parallel/mpi_none.cpp or parallel/nccl_none.cpp defines
// the same functions to throw a CommError saying what to install, so no caller needs an #ifdef.
#pragma once
#include <memory>

#include "parallel/communicator.h"

namespace flowmoe {

// One process, world size 1: every collective is an identity or a copy. Always available.
std::shared_ptr<Communicator> make_none_communicator();

bool built_with_mpi();
// MPI_COMM_WORLD as a Communicator. Initializes MPI on first use (MPI_THREAD_FUNNELED: MPI is called
// from the main thread only) and finalizes it at exit when it was the one to initialize it.
std::shared_ptr<Communicator> make_mpi_world_communicator();
// This process's rank among the processes on its host (MPI_Comm_split_type, MPI_COMM_TYPE_SHARED).
int mpi_node_local_rank();
// With MPI initialized and more than one process: MPI_Abort(status) on the world, which ends every
// rank (for main's error path, so peers blocked in a collective do not wait forever). Otherwise
// returns false and does nothing.
bool mpi_abort_world(int status);

bool built_with_nccl();
// An NCCL communicator over the ranks of `bootstrap` (a CPU communicator: none or mpi), on cuda:device:
// rank 0 makes the unique id and bootstrap.broadcast hands it to the others (MPI_Bcast under mpi).
// Collective over bootstrap. split() splits the bootstrap the same way and makes a new NCCL communicator.
std::shared_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> bootstrap, int device);

}  // namespace flowmoe
