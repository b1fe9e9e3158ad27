// The kernels of the nccl backend's device-initiated row puts (parallel/nccl/lsa_put.h, DESIGN.md §2, zero-sync
// dispatch), on NCCL's device API (NCCL >= 2.28): each rank's put kernel writes its rows straight into the peers'
// windows over NVLink or PCIe P2P between two LSA barriers, reading the row table on the device; the copy-out
// kernel then moves the peers' rows from this rank's window into the receive buffers. cuda/lsa_put.cu holds
// both; compiled only with CUDA and an NCCL that has the device API (no CPU reference: the host path of
// put_rows is the reference, tests/mpi/test_exchange.cpp).
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstdint>

namespace flowmoe {

constexpr int kLsaPutMaxTensors = 4;  // tensors moved by one put
constexpr int kLsaPutCtas = 64;       // the put's most CTAs = the LSA barriers asked of ncclDevCommCreate

// One tensor of a put: its rows' bytes on both sides, where its rows sit in the window, its store unit
// (16, 4 or 1 bytes: dividing row_bytes and both addresses) and its pad rows' 16-byte pattern.
struct LsaPutTensor {
  const char* send;  // [send_rows, row_bytes]
  char* recv;        // [recv_rows, row_bytes]
  int64_t window_offset;
  int64_t row_bytes;
  int unit;
  uint4 pattern;
};
struct LsaPutTensors {
  LsaPutTensor t[kLsaPutMaxTensors];
  int count;
  int64_t send_rows, recv_rows;
};

// out_table [num_peers, chunks_per_peer, 3] i32 on the device (row in send, row in the peer's recv, rows):
// every tensor's chunks into the peers' windows (this rank's own, `me`, straight into recv), between two
// LSA barriers. `ctas` (at most kLsaPutCtas) must be the same on every rank: CTA b's barrier b covers CTA b
// of every rank.
void lsa_put_launch(const ncclDevComm& comm, ncclWindow_t window, const LsaPutTensors& ts, const int32_t* out_table,
                    int me, int num_peers, int chunks_per_peer, int ctas, cudaStream_t stream);
// in_table [num_chunks, 3] i32 (row in recv = row in the window, row in the peer's send, rows): the peers'
// chunks from `window` (this rank's) into each recv, then each segment's pad rows (seg [S+1], covered [S],
// S = num_segments; none when seg is null) set to the tensor's pattern; with *overflow nonzero every row.
void lsa_copy_out_launch(const LsaPutTensors& ts, const char* window, const int32_t* in_table, int me,
                         int chunks_per_peer, int num_chunks, const int32_t* seg, const int32_t* covered,
                         int num_segments, const int32_t* overflow, int ctas, cudaStream_t stream);

}  // namespace flowmoe
