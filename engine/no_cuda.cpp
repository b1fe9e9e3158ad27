#include "engine/cuda_api.h"
#include "engine/error.h"

namespace flowmoe {

void throw_no_cuda(const char* what) {
  FLOWMOE_THROW(DeviceError, what, ": flowmoe was built without CUDA (configure with -DFLOWMOE_CUDA=ON)");
}

}  // namespace flowmoe
