// Device-initiated row puts over load/store-reachable GPUs (parallel/nccl/lsa_put.h), NCCL >= 2.28.
//   window: ncclMemAlloc'd, registered NCCL_WIN_COLL_SYMMETRIC, the same bytes on every rank (ensure_window)
//   put:    the kernels of kernels/lsa_put.h copy this rank's chunks of every tensor (rows, FP8 scales, probs: one
//           put) into the peers' windows between two LSA barriers, then the peers' chunks from the own window
//           into the recvs, setting each segment's pad rows (LsaPutImpl::put launches both).
// Tests: tests/mpi/test_exchange.cpp (nccl, a GPU per rank).
#include <nccl.h>
#include <nccl_device.h>

#include <algorithm>
#include <cstring>

#include "kernels/common/cuda_check.h"
#include "kernels/common/device_api.h"
#include "kernels/lsa_put.h"
#include "parallel/nccl/lsa_put.h"
#include "parallel/nccl/nccl_check.h"

namespace flowmoe {

namespace {

static_assert(LsaPut::kMaxTensors == kLsaPutMaxTensors, "the put's tensors are the kernels'");

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
    LsaPutTensors ts{};
    ts.count = int(tensors.size());
    ts.send_rows = tensors.front().send.size(0);
    ts.recv_rows = tensors.front().recv.size(0);
    size_t bytes = 0;  // the window: each tensor's rows, 256-byte aligned, one after the other
    for (int k = 0; k < ts.count; ++k) {
      const Communicator::RowPut& r = tensors[size_t(k)];
      LsaPutTensor& t = ts.t[k];
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
    const int put_ctas = sms > 0 ? std::min(kLsaPutCtas, 4 * sms) : kLsaPutCtas;
    lsa_put_launch(dev_, window_, ts, out_table.data<int32_t>(), rank_, n, C, put_ctas, stream);
    const int copy_ctas = sms > 0 ? std::min(copy_ctas_, 4 * sms) : copy_ctas_;
    lsa_copy_out_launch(ts, static_cast<const char*>(buffer_), in_table.data<int32_t>(), rank_, C,
                        int(in_table.numel() / 3), has_pad ? pad.starts.data<int32_t>() : nullptr,
                        has_pad ? pad.covered.data<int32_t>() : nullptr, has_pad ? int(pad.covered.numel()) : 0,
                        pad.overflow.defined() ? pad.overflow.data<int32_t>() : nullptr, copy_ctas, stream);
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
  reqs.lsaBarrierCount = kLsaPutCtas;
  ncclDevComm dev{};
  FLOWMOE_NCCL_CHECK(ncclDevCommCreate(comm, &reqs, &dev), comm);
  int rank = 0;
  FLOWMOE_NCCL_CHECK(ncclCommUserRank(comm, &rank), comm);
  return std::make_unique<LsaPutImpl>(comm, dev, rank);
}

}  // namespace flowmoe
