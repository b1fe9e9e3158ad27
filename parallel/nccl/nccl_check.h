// FLOWMOE_NCCL_CHECK: a failed NCCL call throws CommError naming the call, NCCL's error string and its
// last error message. Shared by the nccl backend's files (comm_nccl.cpp, lsa_put.cpp).
#pragma once
#include <nccl.h>

#include <string>

#include "parallel/communicator.h"

namespace flowmoe {

inline void check_nccl(ncclResult_t rc, ncclComm_t comm, const char* call, const char* file, int line) {
  if (rc == ncclSuccess) return;
  const char* last = ncclGetLastError(comm);
  throw CommError(detail::cat(call, " failed: ", ncclGetErrorString(rc), " (", int(rc), ")",
                              last && *last ? std::string(": ") + last : std::string()),
                  file, line);
}

}  // namespace flowmoe

#define FLOWMOE_NCCL_CHECK(call, comm) ::flowmoe::check_nccl((call), (comm), #call, __FILE__, __LINE__)
