// The NCCL backend of parallel/backends.h in a build without it (no CUDA, or CMake did not find
// nccl.h and libnccl): it throws a CommError saying how to get it, so callers need no #ifdef.
#include "parallel/backends.h"

namespace flowmoe {

bool built_with_nccl() { return false; }

std::shared_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator>, int) {
  FLOWMOE_THROW(CommError,
                "backend nccl: flowmoe was built without NCCL: install NCCL (nccl.h and libnccl, e.g."
                " Debian's libnccl-dev) and rebuild with CUDA (-DFLOWMOE_CUDA=ON)");
}

}  // namespace flowmoe
