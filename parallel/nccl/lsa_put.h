// Device-initiated row puts for the nccl backend's Communicator::put_rows (DESIGN.md §2, zero-sync
// dispatch): each rank's kernel writes its rows straight into the peers' receive windows over NVLink
// or PCIe P2P, reading the row table on the device, so no count or offset ever reaches the host.
// Built on NCCL's device API (NCCL >= 2.28: ncclMemAlloc + ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC),
// ncclDevCommCreate with one LSA barrier per CTA); lsa_put.cpp implements it over the kernels of
// kernels/lsa_put.h, lsa_none.cpp stands in when the build's NCCL lacks the device headers. No
// multimem/NVLink SHARP is requested.
// Tests: tests/mpi/test_exchange.cpp (EveryCheckThroughNcclOnAGpuPerRank, zero-sync cases).
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include <memory>
#include <string>

#include "parallel/communicator.h"

namespace flowmoe {

class LsaPut {
 public:
  // Collective over comm (every rank calls it, with comm's device current). Null, with *why_not saying why, when
  // some rank is not load/store reachable (the LSA team is smaller than the communicator: several
  // hosts, NCCL_P2P_DISABLE=1) or the build has no device API.
  static std::unique_ptr<LsaPut> create(ncclComm_t comm, int num_ranks, std::string* why_not);
  virtual ~LsaPut() = default;

  // Collective; each recv has the same shape on every rank. One kernel on every rank writes its
  // out_table chunks (out_table [n, C, 3] i32 on the device: row in send, row in the peer's recv, rows)
  // of every tensor into the peers' windows (one window, grown collectively to the recvs' bytes when
  // smaller), and its own chunks into the recvs, between two LSA barriers; then a second kernel copies
  // the in_table chunks (the same rows as the peers list them for this rank) from this rank's window
  // into the recvs and sets pad's rows (Communicator::PadSegments, on the device). Rows that neither
  // covers are not written. All on `stream`; at most kMaxTensors tensors.
  static constexpr int kMaxTensors = 4;  // = kLsaPutMaxTensors (kernels/lsa_put.h; lsa_put.cpp checks)
  virtual void put(const std::vector<Communicator::RowPut>& tensors, const Tensor& out_table, const Tensor& in_table,
                   const Communicator::PadSegments& pad, cudaStream_t stream) = 0;
};

}  // namespace flowmoe
