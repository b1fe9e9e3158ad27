// Parts of kernels/common/device_api.h that are the same with and without CUDA.
#include <atomic>

#include "kernels/common/device_api.h"
#include "kernels/common/error.h"

namespace flowmoe {

void throw_no_cuda(const char* what) {
  FLOWMOE_THROW(DeviceError, what, ": flowmoe was built without CUDA (configure with -DFLOWMOE_CUDA=ON)");
}

static std::atomic<uint64_t> g_host_syncs{0};
void note_host_sync() { g_host_syncs.fetch_add(1, std::memory_order_relaxed); }
uint64_t num_host_syncs() { return g_host_syncs.load(std::memory_order_relaxed); }

}  // namespace flowmoe
