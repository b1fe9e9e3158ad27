// The CPUs a process may use (see engine/host_threads.h).
#include "engine/host_threads.h"

#include <algorithm>
#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif

namespace flowmoe {

int machine_cpu_count() { return std::max(1, int(std::thread::hardware_concurrency())); }

int usable_cpu_count() {
#if defined(__linux__)
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof(mask), &mask) == 0) return std::max(1, CPU_COUNT(&mask));
#endif
  return machine_cpu_count();
}

}  // namespace flowmoe
