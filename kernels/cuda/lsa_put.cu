// The kernels of the device-initiated row puts (kernels/lsa_put.h), NCCL >= 2.28's device API:
//   put:    lsa_put_kernel copies this rank's chunks of every tensor (rows, FP8 scales, probs: one put) into the
//           peers' windows between two LSA barriers; then lsa_copy_out_kernel copies the peers' chunks from the
//           own window into the recvs and sets each segment's pad rows.
// The window they write into and the device communicator are the nccl backend's (parallel/nccl/lsa_put.cpp).
// Tests: tests/mpi/test_exchange.cpp (nccl, a GPU per rank).
#include "kernels/lsa_put.h"

#include <cstring>

#include "kernels/common/cuda_check.h"

namespace flowmoe {

namespace {

constexpr int kThreads = 512;

// One chunk of `units` store units from `from` to `to`, spread over every thread of the grid as one
// sequence that runs on across chunks, so back-to-back chunks keep every thread busy: `next` is this
// thread's first unit of the chunk (its thread index at the first) and becomes its first of the next
// chunk, by additions alone (every thread walks every chunk, so a division per chunk would cost about
// as much as a small chunk's copy). Each thread keeps kUnroll loads in flight before its stores: a
// remote store is posted, so the copy's rate is the local loads in flight over their latency.
constexpr int kUnroll = 4;
__device__ __forceinline__ int64_t first_thread_unit() { return int64_t(blockIdx.x) * blockDim.x + threadIdx.x; }

template <class U>
__device__ __forceinline__ void copy_spread(U* __restrict__ to, const U* __restrict__ from, int64_t units,
                                            int64_t& next) {
  const int64_t threads = int64_t(gridDim.x) * blockDim.x;
  int64_t u = next;
  for (; u < units; u += kUnroll * threads) {
    U v[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j)
      if (u + j * threads < units) v[j] = from[u + j * threads];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j)
      if (u + j * threads < units) to[u + j * threads] = v[j];
  }
  if (u != next) {  // this thread's first unit past the chunk is inside its last batch of kUnroll
    u -= kUnroll * threads;
    while (u < units) u += threads;
  }
  next = u - units;
}

// `units` store units of the 16-byte pattern from `to`, spread as copy_spread's; `to_byte` is to's
// offset in a buffer whose start is element aligned, so the pattern (one element repeated) lines up.
template <class U>
__device__ __forceinline__ void fill_spread(U* __restrict__ to, int64_t to_byte, int64_t units, const uint4& pattern,
                                            int64_t& next) {
  const int64_t threads = int64_t(gridDim.x) * blockDim.x;
  const auto* bytes = reinterpret_cast<const unsigned char*>(&pattern);
  int64_t u = next;
  for (; u < units; u += threads) {
    U v;
    memcpy(&v, bytes + ((to_byte + u * int64_t(sizeof(U))) & 15), sizeof(U));
    to[u] = v;
  }
  next = u - units;
}

// A chunk's rows, or false for one outside either buffer (a routing the worst case did not allow): it is
// skipped, not written.
__device__ __forceinline__ bool chunk_rows(const int32_t* table, int i, int64_t src_rows, int64_t dst_rows,
                                           int64_t& src, int64_t& dst, int64_t& rows) {
  src = table[3 * i], dst = table[3 * i + 1], rows = table[3 * i + 2];
  return rows > 0 && src >= 0 && dst >= 0 && src + rows <= src_rows && dst + rows <= dst_rows;
}

// f(U{}) with the store unit of `unit` bytes.
template <class F>
__device__ __forceinline__ void with_unit(int unit, F&& f) {
  if (unit == 16)
    f(uint4{});
  else if (unit == 4)
    f(uint32_t{});
  else
    f(uint8_t{});
}

// out_table [n, C, 3] i32 (row in send, row in the peer's recv, rows), shared by every tensor; the
// window holds each tensor's recv_rows rows at its window_offset, on every rank. This rank is `me`.
// LSA barrier; each chunk of out_table copied, for every tensor, as one contiguous block (rows are consecutive
// on both sides) into the peer's window (its own chunks straight into recv) with 16/4/1-byte stores spread over
// every thread of the grid; LSA barrier (release/acquire).
// The peers in turn from me + 1 (its own chunks last): at any moment rank r writes to r + j, so every GPU
// receives from one peer and sends to one. In the same order on every rank, all of them would write into
// rank 0 first, then rank 1, ...: one GPU's inbound links carrying n − 1 senders while the others idle.
// Why the barriers suffice: every rank launches the same number of CTAs (at most kLsaPutCtas), and CTA b's barrier b
// covers CTA b of every rank, so after the kernel every peer's stores into this window have landed. The first barrier
// orders this rank's previous copy-out (an earlier launch on the stream) before any peer's store of this put.
__global__ void lsa_put_kernel(ncclDevComm comm, ncclWindow_t window, LsaPutTensors ts,
                               const int32_t* __restrict__ out_table, int me, int num_peers, int chunks_per_peer) {
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), comm, ncclTeamTagLsa{}, blockIdx.x};
  bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);  // every peer has read the last put out of its window
  int64_t next = first_thread_unit(), src = 0, dst = 0, rows = 0;
  for (int j = 1; j <= num_peers; ++j) {
    const int peer = (me + j) % num_peers;
    for (int c = 0, i = peer * chunks_per_peer; c < chunks_per_peer; ++c, ++i) {
      if (!chunk_rows(out_table, i, ts.send_rows, ts.recv_rows, src, dst, rows)) continue;
      for (int k = 0; k < ts.count; ++k) {
        const LsaPutTensor& t = ts.t[k];
        const int64_t at = dst * t.row_bytes;
        void* to = peer == me ? t.recv + at : ncclGetPeerPointer(window, size_t(t.window_offset + at), peer);
        with_unit(t.unit, [&](auto unit) {
          using U = decltype(unit);
          copy_spread(static_cast<U*>(to), reinterpret_cast<const U*>(t.send + src * t.row_bytes),
                      rows * (t.row_bytes / int64_t(sizeof(U))), next);
        });
      }
    }
  }
  bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);  // every rank's stores into every window have landed
}

// Each recv gets the rows the peers put into this rank's window: in_table [n, C, 3] i32 (row in recv =
// row in the window, row in the peer's send, rows), skipping this rank's own chunks (already in recv).
// Then the pad rows [seg[s] + covered[s], seg[s+1]) of each of num_segments segments (seg [S+1],
// covered [S] i32; none when seg is null) take each tensor's pattern. No other row is read or written: not the
// worst-case tail, whose fill would cost more than the rows themselves at 4 ranks (docs/PERF.md has the figures).
// An emptied exchange (overflow [1] nonzero: its tables move nothing) sets every row to the pattern instead.
__global__ void lsa_copy_out_kernel(LsaPutTensors ts, const char* __restrict__ window,
                                    const int32_t* __restrict__ in_table, int me, int chunks_per_peer, int num_chunks,
                                    const int32_t* __restrict__ seg, const int32_t* __restrict__ covered,
                                    int num_segments, const int32_t* __restrict__ overflow) {
  int64_t next = first_thread_unit(), row = 0, peer_row = 0, rows = 0;
  if (overflow && *overflow != 0) {
    for (int k = 0; k < ts.count; ++k) {
      const LsaPutTensor& t = ts.t[k];
      with_unit(t.unit, [&](auto unit) {
        using U = decltype(unit);
        fill_spread(reinterpret_cast<U*>(t.recv), 0, ts.recv_rows * (t.row_bytes / int64_t(sizeof(U))), t.pattern,
                    next);
      });
    }
    return;
  }
  const int own_first = me * chunks_per_peer, own_end = own_first + chunks_per_peer;
  for (int i = 0; i < num_chunks; ++i) {
    if ((i >= own_first && i < own_end) || !chunk_rows(in_table, i, ts.recv_rows, INT64_MAX, row, peer_row, rows))
      continue;
    for (int k = 0; k < ts.count; ++k) {
      const LsaPutTensor& t = ts.t[k];
      const int64_t at = row * t.row_bytes;
      with_unit(t.unit, [&](auto unit) {
        using U = decltype(unit);
        copy_spread(reinterpret_cast<U*>(t.recv + at), reinterpret_cast<const U*>(window + t.window_offset + at),
                    rows * (t.row_bytes / int64_t(sizeof(U))), next);
      });
    }
  }
  for (int s = 0; seg && s < num_segments; ++s) {
    const int64_t first = int64_t(seg[s]) + covered[s], end = min(int64_t(seg[s + 1]), ts.recv_rows);
    if (first < 0 || first >= end) continue;
    for (int k = 0; k < ts.count; ++k) {
      const LsaPutTensor& t = ts.t[k];
      with_unit(t.unit, [&](auto unit) {
        using U = decltype(unit);
        fill_spread(reinterpret_cast<U*>(t.recv + first * t.row_bytes), first * t.row_bytes,
                    (end - first) * (t.row_bytes / int64_t(sizeof(U))), t.pattern, next);
      });
    }
  }
}

}  // namespace

void lsa_put_launch(const ncclDevComm& comm, ncclWindow_t window, const LsaPutTensors& ts, const int32_t* out_table,
                    int me, int num_peers, int chunks_per_peer, int ctas, cudaStream_t stream) {
  lsa_put_kernel<<<ctas, kThreads, 0, stream>>>(comm, window, ts, out_table, me, num_peers, chunks_per_peer);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void lsa_copy_out_launch(const LsaPutTensors& ts, const char* window, const int32_t* in_table, int me,
                         int chunks_per_peer, int num_chunks, const int32_t* seg, const int32_t* covered,
                         int num_segments, const int32_t* overflow, int ctas, cudaStream_t stream) {
  lsa_copy_out_kernel<<<ctas, kThreads, 0, stream>>>(ts, window, in_table, me, chunks_per_peer, num_chunks, seg,
                                                     covered, num_segments, overflow);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
