// The "nccl" backend (compiled with CUDA when CMake finds nccl.h and libnccl; parallel/nccl_none.cpp
// otherwise). CUDA tensors on the communicator's device, collectives enqueued on its stream (the
// engine's stream by default) and asynchronous to the host. The communicator is bootstrapped through
// a CPU communicator (mpi, or none at world size 1): rank 0 calls ncclGetUniqueId and broadcasts it,
// every rank calls ncclCommInitRank. The all-to-all with per-peer counts, and the one between row
// chunks, are each one NCCL group of ncclSend/ncclRecv calls. put_rows (zero-sync dispatch) writes rows
// into the peers' memory from a kernel (parallel/nccl/lsa_put.h) when every rank is load/store
// reachable, and otherwise takes the base class's host path, saying so once. Every NCCL and CUDA
// return code is checked; failures throw CommError (NCCL) or CudaError (CUDA runtime).
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <cstring>
#include <deque>

#include "kernels/common/cuda_check.h"
#include "parallel/backends.h"
#include "parallel/nccl/lsa_put.h"
#include "parallel/nccl/nccl_check.h"

namespace flowmoe {

namespace {

// Makes `device` current for the scope (NCCL calls act on the current device), then restores.
class DeviceScope {
 public:
  explicit DeviceScope(int device) : prev_(cuda_current_device()) {
    if (prev_ != device) cuda_set_device(device);
  }
  ~DeviceScope() { cudaSetDevice(prev_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_;
};

ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    default:
      FLOWMOE_THROW(DTypeError, "nccl all_reduce: no NCCL type for ", dtype_name(d));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::avg:
      return ncclAvg;
  }
  return ncclSum;
}

// Rank 0's unique id, handed to every rank of `bootstrap`. The first byte says whether rank 0 made
// one, so a failure there is an error on every rank instead of peers waiting in ncclCommInitRank.
ncclUniqueId share_unique_id(Communicator& bootstrap) {
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  Tensor msg = Tensor::zeros({int64_t(sizeof(id)) + 1}, DType::u8);
  std::string failure;
  if (bootstrap.rank() == 0) {
    ncclResult_t rc = ncclGetUniqueId(&id);
    if (rc == ncclSuccess) {
      msg.data<uint8_t>()[0] = 1;
      std::memcpy(msg.data<uint8_t>() + 1, &id, sizeof(id));
    } else {
      failure = ncclGetErrorString(rc);
    }
  }
  bootstrap.broadcast(msg, 0);
  FLOWMOE_CHECK(msg.data<uint8_t>()[0] == 1, CommError, "nccl: rank 0 could not make the NCCL unique id",
                failure.empty() ? std::string() : ": " + failure);
  std::memcpy(&id, msg.data<uint8_t>() + 1, sizeof(id));
  return id;
}

class NcclCommunicator final : public Communicator {
 public:
  // max_ctas > 0: nccl's kernels on this communicator take at most that many thread blocks.
  NcclCommunicator(std::shared_ptr<Communicator> bootstrap, int device, int max_ctas = 0)
      : bootstrap_(std::move(bootstrap)), device_(device) {
    FLOWMOE_CHECK(bootstrap_ != nullptr, CommError, "nccl: no bootstrap communicator");
    FLOWMOE_CHECK(bootstrap_->native_device().is_cpu(), CommError, "nccl bootstraps through a CPU communicator (mpi",
                  " or none), got ", bootstrap_->backend_name());
    FLOWMOE_CHECK(device >= 0 && device < cuda_device_count(), DeviceError, "nccl: cuda:", device, " does not exist (",
                  cuda_device_count(), " CUDA devices visible)");
    DeviceScope scope(device_);
    ncclUniqueId id = share_unique_id(*bootstrap_);
    if (max_ctas == 0) {
      // No bound: NCCL's own defaults, through the plain initialization.
      FLOWMOE_NCCL_CHECK(ncclCommInitRank(&comm_, bootstrap_->size(), id, bootstrap_->rank()), nullptr);
    } else {
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.maxCTAs = max_ctas;
      FLOWMOE_NCCL_CHECK(ncclCommInitRankConfig(&comm_, bootstrap_->size(), id, bootstrap_->rank(), &config), nullptr);
    }
  }
  ~NcclCommunicator() override {  // no throwing calls here: a failure to tear down is ignored
    for (auto& [start, end] : exchange_events_) cudaEventDestroy(start), cudaEventDestroy(end);
    for (auto& window : closed_windows_)
      for (auto& [start, end] : window) cudaEventDestroy(start), cudaEventDestroy(end);
    if (!comm_) return;
    int prev = -1;
    if (cudaGetDevice(&prev) == cudaSuccess) cudaSetDevice(device_);
    lsa_.reset();  // its window and device communicator belong to comm_
    ncclCommDestroy(comm_);
    if (prev >= 0) cudaSetDevice(prev);
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return bootstrap_->rank(); }
  int size() const override { return bootstrap_->size(); }
  const char* backend_name() const override { return "nccl"; }
  Communicator& host_communicator() override { return *bootstrap_; }
  Device native_device() const override { return Device::cuda(device_); }

 protected:
  // Rank-major blocks are one chunk per peer, in peer order.
  void do_all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows, const Tensor& recv,
                     const std::vector<int64_t>& recv_rows, size_t row_bytes) override {
    std::vector<RowChunk> send_chunks, recv_chunks;
    int64_t send_at = 0, recv_at = 0;
    for (int p = 0; p < size(); ++p) {
      send_chunks.push_back({p, send_at, send_rows[size_t(p)]});
      recv_chunks.push_back({p, recv_at, recv_rows[size_t(p)]});
      send_at += send_rows[size_t(p)];
      recv_at += recv_rows[size_t(p)];
    }
    send_recv_chunks(send, send_chunks, recv, recv_chunks, row_bytes, "all_to_all");
  }

  void do_all_to_all_chunks(const Tensor& send, const std::vector<RowChunk>& send_chunks, const Tensor& recv,
                            const std::vector<RowChunk>& recv_chunks, size_t row_bytes) override {
    send_recv_chunks(send, send_chunks, recv, recv_chunks, row_bytes, "all_to_all_chunks");
  }

  void do_put_rows(const std::vector<RowPut>& tensors, const Tensor& out_table, const Tensor& in_table,
                   const PadSegments& pad) override {
    for (const RowPut& t : tensors) check_on_device(t.send, "put_rows");
    if (!do_device_puts() || out_table.device().is_cpu()) {
      Communicator::do_put_rows(tensors, out_table, in_table, pad);
      return;
    }
    DeviceScope scope(device_);
    lsa_->put(tensors, out_table, in_table, pad, enqueue_stream());
  }

  bool do_device_puts() override {
    if (!lsa_tried_) {  // collective, and every rank asks at the same point
      lsa_tried_ = true;
      std::string why_not;
      DeviceScope scope(device_);
      lsa_ = LsaPut::create(comm_, size(), &why_not);
      if (!lsa_ && rank() == 0)
        std::fprintf(stderr, "flowmoe: nccl put_rows (zero-sync dispatch) reads its row tables to the host: %s\n",
                     why_not.c_str());
    }
    return lsa_ != nullptr;
  }

  void do_all_reduce(const Tensor& t, ReduceOp op) override {
    check_on_device(t, "all_reduce");
    if (t.numel() == 0) return;
    DeviceScope scope(device_);
    FLOWMOE_NCCL_CHECK(ncclAllReduce(t.raw_data(), t.raw_data(), size_t(t.numel()), nccl_type(t.dtype()), nccl_op(op),
                                     comm_, enqueue_stream()),
                       comm_);
  }

  void do_all_gather(const Tensor& send, const Tensor& recv, size_t row_bytes) override {
    check_on_device(send, "all_gather");
    if (send.nbytes() == 0) return;
    DeviceScope scope(device_);
    FLOWMOE_NCCL_CHECK(
        ncclAllGather(send.raw_data(), recv.raw_data(), send.nbytes(), ncclUint8, comm_, enqueue_stream()), comm_);
  }

  // In place as NCCL defines it: this rank's segment of the buffer is the receive buffer.
  void do_reduce_scatter_in_place(const Tensor& t, ReduceOp op) override {
    check_on_device(t, "reduce_scatter_in_place");
    DeviceScope scope(device_);
    const size_t n = size_t(t.numel() / size());
    char* base = static_cast<char*>(t.raw_data());
    FLOWMOE_NCCL_CHECK(ncclReduceScatter(base, base + size_t(rank()) * n * dtype_size(t.dtype()), n,
                                         nccl_type(t.dtype()), nccl_op(op), comm_, enqueue_stream()),
                       comm_);
  }

  void do_all_gather_in_place(const Tensor& t, size_t seg_bytes) override {
    check_on_device(t, "all_gather_in_place");
    DeviceScope scope(device_);
    char* base = static_cast<char*>(t.raw_data());
    FLOWMOE_NCCL_CHECK(
        ncclAllGather(base + size_t(rank()) * seg_bytes, base, seg_bytes, ncclUint8, comm_, enqueue_stream()), comm_);
  }

  void do_broadcast(const Tensor& t, int root) override {
    check_on_device(t, "broadcast");
    if (t.nbytes() == 0) return;
    DeviceScope scope(device_);
    FLOWMOE_NCCL_CHECK(ncclBroadcast(t.raw_data(), t.raw_data(), t.nbytes(), ncclUint8, root, comm_, enqueue_stream()),
                       comm_);
  }

  void do_barrier() override {
    do_synchronize();
    bootstrap_->barrier();
  }

  void do_synchronize() override {
    DeviceScope scope(device_);
    FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(enqueue_stream()));
  }

  std::shared_ptr<Communicator> do_split(int color, int key, int max_ctas) override {
    return std::make_shared<NcclCommunicator>(bootstrap_->split(color, key), device_, max_ctas);
  }

  // The exchanges run asynchronously: events on the stream around each one time it on the GPU. Not in
  // a captured step (train.cuda_graph), whose replays run no host code to read them.
  void exchange_started() override {
    DeviceScope scope(device_);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    FLOWMOE_CUDA_CHECK(cudaStreamIsCapturing(enqueue_stream(), &capture));
    timing_ = capture == cudaStreamCaptureStatusNone;
    if (!timing_) return;
    if (exchange_events_.size() >= 1024) folded_ms_ += release_events(exchange_events_);  // nobody asked: bound them
    cudaEvent_t start = nullptr, end = nullptr;
    FLOWMOE_CUDA_CHECK(cudaEventCreate(&start));
    FLOWMOE_CUDA_CHECK(cudaEventCreate(&end));
    exchange_events_.push_back({start, end});
    FLOWMOE_CUDA_CHECK(cudaEventRecord(start, enqueue_stream()));
  }
  void exchange_finished() override {
    if (!timing_) return;
    DeviceScope scope(device_);
    FLOWMOE_CUDA_CHECK(cudaEventRecord(exchange_events_.back().second, enqueue_stream()));
  }
  double take_device_ms() override {
    DeviceScope scope(device_);
    double total = folded_ms_ + release_events(exchange_events_);
    for (auto& window : closed_windows_) total += release_events(window);
    closed_windows_.clear();
    folded_ms_ = 0;
    return total;
  }
  void close_device_window() override {
    closed_windows_.push_back(std::move(exchange_events_));
    exchange_events_.clear();
  }
  double take_device_window_ms() override {
    if (closed_windows_.empty()) return 0;
    DeviceScope scope(device_);
    const double total = release_events(closed_windows_.front());
    closed_windows_.pop_front();
    return total;
  }
  // Waits for the recorded exchanges and returns their summed GPU time.
  static double release_events(std::vector<std::pair<cudaEvent_t, cudaEvent_t>>& events) {
    double total = 0;
    for (auto& [start, end] : events) {
      float ms = 0;
      FLOWMOE_CUDA_CHECK(cudaEventSynchronize(end));
      FLOWMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, start, end));
      total += ms;
      cudaEventDestroy(start);
      cudaEventDestroy(end);
    }
    events.clear();
    return total;
  }

  // The counts are host values: they travel through the bootstrap communicator, not the GPU.
  std::vector<int64_t> do_exchange_counts(const std::vector<int64_t>& send_rows) override {
    return bootstrap_->exchange_counts(send_rows);
  }

 private:
  std::shared_ptr<Communicator> bootstrap_;
  int device_;
  ncclComm_t comm_ = nullptr;
  std::unique_ptr<LsaPut> lsa_;  // put_rows' device path; null until the first put_rows, or unreachable
  bool lsa_tried_ = false;
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> exchange_events_;             // since the last take or close
  std::deque<std::vector<std::pair<cudaEvent_t, cudaEvent_t>>> closed_windows_;  // oldest first
  double folded_ms_ = 0;
  bool timing_ = false;  // the exchange in progress is timed (not captured)

  // One group of ncclSend/ncclRecv, one per non-empty chunk, self included: NCCL runs the calls of a
  // group that target the same peer in order, which pairs each peer's chunks in list order.
  void send_recv_chunks(const Tensor& send, const std::vector<RowChunk>& send_chunks, const Tensor& recv,
                        const std::vector<RowChunk>& recv_chunks, size_t row_bytes, const char* call) {
    check_on_device(send, call);
    if (row_bytes == 0) return;
    DeviceScope scope(device_);
    const char* send_base = static_cast<const char*>(send.raw_data());
    char* recv_base = static_cast<char*>(recv.raw_data());
    FLOWMOE_NCCL_CHECK(ncclGroupStart(), comm_);
    ncclResult_t rc = ncclSuccess;
    for (const RowChunk& c : send_chunks)
      if (c.rows > 0 && rc == ncclSuccess)
        rc = ncclSend(send_base + size_t(c.offset) * row_bytes, size_t(c.rows) * row_bytes, ncclUint8, c.peer, comm_,
                      enqueue_stream());
    for (const RowChunk& c : recv_chunks)
      if (c.rows > 0 && rc == ncclSuccess)
        rc = ncclRecv(recv_base + size_t(c.offset) * row_bytes, size_t(c.rows) * row_bytes, ncclUint8, c.peer, comm_,
                      enqueue_stream());
    ncclResult_t end = ncclGroupEnd();  // always closes the group, even after a failed call inside it
    FLOWMOE_NCCL_CHECK(rc, comm_);
    FLOWMOE_NCCL_CHECK(end, comm_);
  }

  cudaStream_t enqueue_stream() const { return stream() ? stream() : current_stream(device_); }
  void check_on_device(const Tensor& t, const char* call) const {
    FLOWMOE_CHECK(t.device() == Device::cuda(device_), DeviceError, "nccl ", call,
                  ": the communicator is on cuda:", device_, " but got ", t.describe(),
                  " (nccl moves GPU tensors of its device; backend mpi moves CPU ones)");
  }
};

}  // namespace

bool built_with_nccl() { return true; }

std::shared_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> bootstrap, int device) {
  return std::make_shared<NcclCommunicator>(std::move(bootstrap), device);
}

}  // namespace flowmoe
