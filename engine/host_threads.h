// How many CPUs this process may run its host threads on: the size of its affinity mask
// (sched_getaffinity), or std::thread::hardware_concurrency() where the mask is unknown. An MPI
// launcher that binds each rank to one core (OpenMPI's default for 2 ranks) leaves a rank 1 CPU on a
// machine of many, so a thread pool sized by the machine would only take turns on it.
#pragma once

namespace flowmoe {

int usable_cpu_count();
int machine_cpu_count();  // std::thread::hardware_concurrency(), at least 1

}  // namespace flowmoe
