// LsaPut in a build whose NCCL has no device API (headers older than 2.28): put_rows takes the host
// path (parallel/nccl/lsa_put.h says what it would do).
#include "parallel/nccl/lsa_put.h"

namespace flowmoe {

std::unique_ptr<LsaPut> LsaPut::create(ncclComm_t, int, std::string* why_not) {
  if (why_not) *why_not = "this build's NCCL has no device API (nccl_device.h, NCCL >= 2.28)";
  return nullptr;
}

}  // namespace flowmoe
