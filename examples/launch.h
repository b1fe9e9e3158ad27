// How `flowmoe train` and `flowmoe eval` start on one process or on several (mpirun -np N, srun -n N):
// the world communicator, this rank's device, the agreement on the config, who prints, and how an
// error on one rank ends the others instead of leaving them waiting in a collective.
#pragma once
#include <exception>
#include <string>

#include "config/config.h"
#include "parallel/distributed.h"

namespace flowmoe {

// Called once per process with the loaded config: init_distributed with parallel.backend, the device
// train.device resolves to (cuda:<local rank> for a CUDA run), and check_same_config over the command
// ("train", "eval", "parity") and the resolved config text as its first collective, so ranks given
// different commands or configs all fail instead of hanging. A plain run gets the none backend and initializes
// no MPI.
DistributedRuntime start_ranks(const Config& cfg, const std::string& command);

// Under a launcher of several processes, a command that ends without start_ranks (--print-config,
// --help, a command that runs alone such as prepare-data) still meets its peers before it exits: a peer
// that is starting a run would otherwise wait in MPI's start-up forever. Starts MPI and checks that
// every rank ends this way (`what`, e.g. "train --print-config"); a rank that started a run instead
// gets the same AllRanksConfigError, so all leave together. Does nothing for a plain run.
void leave_together(const std::string& what);

// This process's rank as the launcher set it (0 for a plain run, or when the environment is unreadable):
// known before MPI starts, for messages.
int launch_rank();
bool is_root_rank();
int launch_world_size();  // 1 for a plain run, or when the environment is unreadable

// Main's error path, after the message is printed: in a run of several processes, ends every rank
// (MPI_Abort with `status`), starting MPI first if this rank failed before it did. An
// AllRanksConfigError returns instead: every rank raised it, so each exits on its own.
void end_other_ranks_after(const std::exception& e, int status);

}  // namespace flowmoe
