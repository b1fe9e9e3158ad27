// Device-initiated row puts over load/store-reachable GPUs (parallel/nccl/lsa_put.h), NCCL >= 2.28.
//   window: ncclMemAlloc'd, registered NCCL_WIN_COLL_SYMMETRIC, the same bytes on every rank (ensure_window)
//   put:    lsa_put_kernel copies this rank's chunks of every tensor (rows, FP8 scales, probs: one put) into the
//           peers' windows between two LSA barriers; then lsa_copy_out_kernel copies the peers' chunks from the
//           own window into the recvs and sets each segment's pad rows (LsaPutImpl::put launches both).
// Tests: tests/mpi/test_exchange.cpp (nccl, a GPU per rank).
#include <nccl.h>
#include <nccl_device.h>

#include <algorithm>
#include <cstring>

#include "kernels/common/cuda_check.h"
#include "kernels/common/device_api.h"
#include "parallel/nccl/lsa_put.h"
#include "parallel/nccl/nccl_check.h"

namespace flowmoe {

namespace {

constexpr int kCtas = 64;  // = the LSA barriers asked of ncclDevCommCreate
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

// One tensor of a put: its rows' bytes on both sides, where its rows sit in the window, its store unit
// (16, 4 or 1 bytes: dividing row_bytes and both addresses) and its pad rows' 16-byte pattern.
struct PutTensor {
  const char* send;  // [send_rows, row_bytes]
  char* recv;        // [recv_rows, row_bytes]
  int64_t window_offset;
  int64_t row_bytes;
  int unit;
  uint4 pattern;
};
struct PutTensors {
  PutTensor t[LsaPut::kMaxTensors];
  int count;
  int64_t send_rows, recv_rows;
};

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
// Why the barriers suffice: every rank launches the same number of CTAs (at most kCtas), and CTA b's barrier b covers
// CTA b of every rank, so after the kernel every peer's stores into this window have landed. The first barrier orders
// this rank's previous copy-out (an earlier launch on the stream) before any peer's store of this put.
__global__ void lsa_put_kernel(ncclDevComm comm, ncclWindow_t window, PutTensors ts,
                               const int32_t* __restrict__ out_table, int me, int num_peers, int chunks_per_peer) {
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), comm, ncclTeamTagLsa{}, blockIdx.x};
  bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);  // every peer has read the last put out of its window
  int64_t next = first_thread_unit(), src = 0, dst = 0, rows = 0;
  for (int j = 1; j <= num_peers; ++j) {
    const int peer = (me + j) % num_peers;
    for (int c = 0, i = peer * chunks_per_peer; c < chunks_per_peer; ++c, ++i) {
      if (!chunk_rows(out_table, i, ts.send_rows, ts.recv_rows, src, dst, rows)) continue;
      for (int k = 0; k < ts.count; ++k) {
        const PutTensor& t = ts.t[k];
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
__global__ void lsa_copy_out_kernel(PutTensors ts, const char* __restrict__ window,
                                    const int32_t* __restrict__ in_table, int me, int chunks_per_peer, int num_chunks,
                                    const int32_t* __restrict__ seg, const int32_t* __restrict__ covered,
                                    int num_segments, const int32_t* __restrict__ overflow) {
  int64_t next = first_thread_unit(), row = 0, peer_row = 0, rows = 0;
  if (overflow && *overflow != 0) {
    for (int k = 0; k < ts.count; ++k) {
      const PutTensor& t = ts.t[k];
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
      const PutTensor& t = ts.t[k];
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
      const PutTensor& t = ts.t[k];
      with_unit(t.unit, [&](auto unit) {
        using U = decltype(unit);
        fill_spread(reinterpret_cast<U*>(t.recv + first * t.row_bytes), first * t.row_bytes,
                    (end - first) * (t.row_bytes / int64_t(sizeof(U))), t.pattern, next);
      });
    }
  }
}

// The 16 bytes of `value` in dtype repeated (0: zero bytes): the pad rows' fill, one element period.
uint4 fill_pattern(double value, DType dtype) {
  uint4 pattern{0, 0, 0, 0};
  if (value == 0) return pattern;
  const Tensor one = Tensor::full({int64_t(16 / dtype_size(dtype))}, value, dtype, Device::cpu());
  std::memcpy(&pattern, one.raw_data(), sizeof(pattern));
  return pattern;
}

// The widest store unit that divides the row bytes and both addresses.
int store_unit(int64_t row_bytes, const void* send, const void* recv) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(send) | reinterpret_cast<uintptr_t>(recv);
  for (int unit : {16, 4})
    if (row_bytes % unit == 0 && addr % uintptr_t(unit) == 0) return unit;
  return 1;
}

class LsaPutImpl final : public LsaPut {
 public:
  LsaPutImpl(ncclComm_t comm, const ncclDevComm& dev, int rank) : comm_(comm), dev_(dev), rank_(rank) {
    int device = 0;
    FLOWMOE_CUDA_CHECK(cudaGetDevice(&device));
    FLOWMOE_CUDA_CHECK(cudaDeviceGetAttribute(&copy_ctas_, cudaDevAttrMultiProcessorCount, device));
  }
  ~LsaPutImpl() override {    // no throwing calls: a failure to tear down is ignored
    cudaDeviceSynchronize();  // on the communicator's device (its destructor makes it current)
    release_window();
    ncclDevCommDestroy(comm_, &dev_);
  }

  void put(const std::vector<Communicator::RowPut>& tensors, const Tensor& out_table, const Tensor& in_table,
           const Communicator::PadSegments& pad, cudaStream_t stream) override {
    FLOWMOE_CHECK(!tensors.empty() && tensors.size() <= size_t(kMaxTensors), ShapeError, "put_rows: ", tensors.size(),
                  " tensors; the device put moves 1 to ", kMaxTensors);
    PutTensors ts{};
    ts.count = int(tensors.size());
    ts.send_rows = tensors.front().send.size(0);
    ts.recv_rows = tensors.front().recv.size(0);
    size_t bytes = 0;  // the window: each tensor's rows, 256-byte aligned, one after the other
    for (int k = 0; k < ts.count; ++k) {
      const Communicator::RowPut& r = tensors[size_t(k)];
      PutTensor& t = ts.t[k];
      t.send = static_cast<const char*>(r.send.raw_data());
      t.recv = static_cast<char*>(r.recv.raw_data());
      t.row_bytes = ts.recv_rows == 0 ? 0 : int64_t(r.recv.nbytes() / size_t(ts.recv_rows));
      t.window_offset = int64_t(bytes);
      t.unit = store_unit(t.row_bytes, t.send, t.recv);
      t.pattern = fill_pattern(r.pad_value, r.recv.dtype());
      bytes += (r.recv.nbytes() + 255) / 256 * 256;
    }
    if (bytes == 0) return;  // the same on every rank: the shapes agree
    ensure_window(bytes, stream);
    const int n = int(out_table.size(0)), C = int(out_table.size(1));
    const bool has_pad = pad.starts.defined();
    // Beside the GEMMs (cuda_set_comm_sms) both kernels keep to the SMs they leave: 4 CTAs of 512 threads
    // each. The put's grid is the same on every rank (the setting is the run's), as its barriers need.
    const int sms = cuda_comm_sms();
    const int put_ctas = sms > 0 ? std::min(kCtas, 4 * sms) : kCtas;
    lsa_put_kernel<<<put_ctas, kThreads, 0, stream>>>(dev_, window_, ts, out_table.data<int32_t>(), rank_, n, C);
    FLOWMOE_CUDA_CHECK_LAUNCH();
    const int copy_ctas = sms > 0 ? std::min(copy_ctas_, 4 * sms) : copy_ctas_;
    lsa_copy_out_kernel<<<copy_ctas, kThreads, 0, stream>>>(
        ts, static_cast<const char*>(buffer_), in_table.data<int32_t>(), rank_, C, int(in_table.numel() / 3),
        has_pad ? pad.starts.data<int32_t>() : nullptr, has_pad ? pad.covered.data<int32_t>() : nullptr,
        has_pad ? int(pad.covered.numel()) : 0, pad.overflow.defined() ? pad.overflow.data<int32_t>() : nullptr);
    FLOWMOE_CUDA_CHECK_LAUNCH();
  }

 private:
  ncclComm_t comm_;
  ncclDevComm dev_;
  int rank_;  // in comm (= in its LSA team: every rank is reachable)
  void* buffer_ = nullptr;
  size_t bytes_ = 0;
  ncclWindow_t window_ = nullptr;
  int copy_ctas_ = 0;  // the local copy-out: one CTA per SM

  // The window: ncclMemAlloc'd, registered NCCL_WIN_COLL_SYMMETRIC, the same bytes on every rank (the receive
  // buffers are worst-case sized, so their shapes agree), each tensor of a put at its own offset; grown
  // collectively, never shrunk.
  // Every rank asks for the same bytes at the same call (the exchanges' shapes are static), so the
  // collective registration lines up. Grows to a power of two so a dispatch's rows, scales and probs
  // and a combine's wider rows settle on one window after the first step.
  void ensure_window(size_t bytes, cudaStream_t stream) {
    if (bytes <= bytes_) return;
    size_t want = size_t(1) << 20;
    while (want < bytes) want *= 2;
    FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream));  // the old window's last put is done (only on growth)
    release_window();
    FLOWMOE_NCCL_CHECK(ncclMemAlloc(&buffer_, want), comm_);
    FLOWMOE_NCCL_CHECK(ncclCommWindowRegister(comm_, buffer_, want, &window_, NCCL_WIN_COLL_SYMMETRIC), comm_);
    bytes_ = want;
  }
  void release_window() {
    if (window_) ncclCommWindowDeregister(comm_, window_);
    if (buffer_) ncclMemFree(buffer_);
    window_ = nullptr, buffer_ = nullptr, bytes_ = 0;
  }
};

}  // namespace

std::unique_ptr<LsaPut> LsaPut::create(ncclComm_t comm, int num_ranks, std::string* why_not) {
  // One rank has no peer to write into, and NCCL 2.28.3 gives a one-rank communicator on a host of
  // several GPUs no symmetric memory (ncclDevCommCreate refuses it): its chunks are local copies.
  if (num_ranks == 1) {
    if (why_not) *why_not = "one rank: every chunk is a local copy";
    return nullptr;
  }
  const ncclTeam_t lsa = ncclTeamLsa(comm);
  if (lsa.nRanks < num_ranks) {
    if (why_not)
      *why_not = detail::cat("only ", lsa.nRanks, " of ", num_ranks,
                             " ranks are load/store reachable (NVLink or PCIe P2P on one host)");
    return nullptr;
  }
  ncclDevCommRequirements reqs{};  // no multimem: NVLink SHARP stays off
  reqs.lsaBarrierCount = kCtas;
  ncclDevComm dev{};
  FLOWMOE_NCCL_CHECK(ncclDevCommCreate(comm, &reqs, &dev), comm);
  int rank = 0;
  FLOWMOE_NCCL_CHECK(ncclCommUserRank(comm, &rank), comm);
  return std::make_unique<LsaPutImpl>(comm, dev, rank);
}

}  // namespace flowmoe
