// The "mpi" backend (compiled when CMake finds MPI; parallel/mpi_none.cpp otherwise). CPU tensors go
// to MPI directly. CUDA tensors are staged through host memory: copied to the host on the engine
// stream, moved by MPI, copied back. That staging is a test transport, so several ranks can share
// one GPU in tests; it is not how a multi-GPU run should move GPU tensors (that is the nccl backend).
// Every MPI call's return code is checked (the communicators use MPI_ERRORS_RETURN) and a failure
// throws CommError with MPI's own message.
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "parallel/backends.h"

namespace flowmoe {

namespace {

void check_mpi(int rc, const char* call, const char* file, int line) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  throw CommError(
      detail::cat(call, " failed: ", len ? std::string(text, size_t(len)) : "MPI error " + std::to_string(rc)), file,
      line);
}
#define FLOWMOE_MPI_CHECK(call) check_mpi((call), #call, __FILE__, __LINE__)

// The tag of all_to_all_chunks' messages, the only point-to-point traffic on these communicators
// (collectives have a context of their own).
constexpr int kChunkTag = 1;

// MPI counts and displacements are ints.
int to_mpi_int(int64_t v, const char* what) {
  FLOWMOE_CHECK(v >= 0 && v <= INT_MAX, ShapeError, "mpi: ", what, " = ", v, " does not fit MPI's int counts");
  return int(v);
}

bool mpi_is_finalized() {
  int finalized = 0;
  return MPI_Finalized(&finalized) != MPI_SUCCESS || finalized;
}

void finalize_mpi_at_exit() {
  if (!mpi_is_finalized()) MPI_Finalize();
}

void ensure_mpi_initialized() {
  int initialized = 0;
  FLOWMOE_MPI_CHECK(MPI_Initialized(&initialized));
  FLOWMOE_CHECK(!mpi_is_finalized(), CommError, "mpi: MPI was already finalized in this process");
  if (!initialized) {
    int provided = 0;
    FLOWMOE_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided));
    std::atexit(finalize_mpi_at_exit);
  }
  FLOWMOE_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
}

// A contiguous MPI type of one row's bytes, freed on scope exit: counts and displacements are in rows.
class RowType {
 public:
  explicit RowType(size_t row_bytes) {
    FLOWMOE_MPI_CHECK(MPI_Type_contiguous(to_mpi_int(int64_t(row_bytes), "bytes per row"), MPI_BYTE, &type_));
    FLOWMOE_MPI_CHECK(MPI_Type_commit(&type_));
  }
  ~RowType() {
    if (!mpi_is_finalized()) MPI_Type_free(&type_);
  }
  RowType(const RowType&) = delete;
  RowType& operator=(const RowType&) = delete;
  MPI_Datatype get() const { return type_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
};

// The host bytes of a tensor: its own memory on the CPU; a staged host copy for a CUDA tensor (filled
// from the device when `load`, written back by store()).
class HostBytes {
 public:
  HostBytes(const Tensor& t, bool load, cudaStream_t side_stream) : t_(t) {
    if (t.device().is_cpu()) return;
    FLOWMOE_CHECK(side_stream == nullptr, DeviceError,
                  "mpi stages GPU tensors on the engine stream; set_stream applies"
                  " to the nccl backend only");
    staged_.resize(t.nbytes());
    if (load) copy_bytes(staged_.data(), -1, t.raw_data(), t.device().index, t.nbytes());
  }
  void* data() {
    static char empty_buffer;  // MPI gets a valid address even for zero bytes
    void* p = t_.device().is_cpu() ? t_.raw_data() : static_cast<void*>(staged_.data());
    return p ? p : &empty_buffer;
  }
  void store() {
    if (t_.device().is_cuda()) copy_bytes(t_.raw_data(), t_.device().index, staged_.data(), -1, t_.nbytes());
  }

 private:
  Tensor t_;
  std::vector<uint8_t> staged_;
};

// avg's scale after the sum, in the tensor's own precision (x * float(s) for f32).
void scale_in_place(void* data, DType dtype, int64_t n, double s) {
  if (dtype == DType::f32) {
    float* p = static_cast<float*>(data);
    const float f = float(s);
    for (int64_t i = 0; i < n; ++i) p[i] *= f;
  } else {
    double* p = static_cast<double*>(data);
    for (int64_t i = 0; i < n; ++i) p[i] *= s;
  }
}

MPI_Datatype mpi_type(DType d) {
  switch (d) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::i32:
      return MPI_INT32_T;
    case DType::i64:
      return MPI_INT64_T;
    default:
      FLOWMOE_THROW(DTypeError, "mpi all_reduce: no MPI type for ", dtype_name(d));
  }
}

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of comm unless it is MPI_COMM_WORLD.
  explicit MpiCommunicator(MPI_Comm comm) : comm_(comm) {
    FLOWMOE_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    FLOWMOE_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    FLOWMOE_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  }
  ~MpiCommunicator() override {
    if (comm_ != MPI_COMM_WORLD && !mpi_is_finalized()) MPI_Comm_free(&comm_);
  }
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend_name() const override { return "mpi"; }
  Device native_device() const override { return Device::cpu(); }

 protected:
  void do_all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows, const Tensor& recv,
                     const std::vector<int64_t>& recv_rows, size_t row_bytes) override {
    if (row_bytes == 0) return;  // rows of zero width: nothing moves (the row shape agrees on every rank)
    const size_t n = static_cast<size_t>(size_);
    std::vector<int> send_counts(n), send_displs(n);
    std::vector<int> recv_counts(n), recv_displs(n);
    int64_t send_at = 0, recv_at = 0;
    for (size_t p = 0; p < n; ++p) {
      send_counts[p] = to_mpi_int(send_rows[p], "rows sent to one peer");
      send_displs[p] = to_mpi_int(send_at, "row offset in send");
      recv_counts[p] = to_mpi_int(recv_rows[p], "rows received from one peer");
      recv_displs[p] = to_mpi_int(recv_at, "row offset in recv");
      send_at += send_rows[p];
      recv_at += recv_rows[p];
    }
    RowType row(row_bytes);
    HostBytes s(send, true, stream()), r(recv, false, stream());
    FLOWMOE_MPI_CHECK(MPI_Alltoallv(s.data(), send_counts.data(), send_displs.data(), row.get(), r.data(),
                                    recv_counts.data(), recv_displs.data(), row.get(), comm_));
    r.store();
  }

  // One message per non-empty chunk, self included. MPI matches messages of one (source, tag, comm)
  // in the order they were posted, which pairs each peer's chunks in list order.
  void do_all_to_all_chunks(const Tensor& send, const std::vector<RowChunk>& send_chunks, const Tensor& recv,
                            const std::vector<RowChunk>& recv_chunks, size_t row_bytes) override {
    if (row_bytes == 0) return;  // rows of zero width: nothing moves
    // Every count is checked before the first message is posted.
    for (const std::vector<RowChunk>* chunks : {&send_chunks, &recv_chunks})
      for (const RowChunk& c : *chunks) to_mpi_int(c.rows, "rows in one chunk");
    RowType row(row_bytes);
    // recv is loaded as well, so the rows no chunk covers are stored back unchanged.
    HostBytes s(send, true, stream()), r(recv, true, stream());
    std::vector<MPI_Request> requests;
    requests.reserve(send_chunks.size() + recv_chunks.size());
    auto post = [&](const std::vector<RowChunk>& chunks, HostBytes& bytes, bool sending) {
      for (const RowChunk& c : chunks) {
        if (c.rows == 0) continue;
        char* at = static_cast<char*>(bytes.data()) + size_t(c.offset) * row_bytes;
        requests.push_back(MPI_REQUEST_NULL);
        FLOWMOE_MPI_CHECK(sending ? MPI_Isend(at, int(c.rows), row.get(), c.peer, kChunkTag, comm_, &requests.back())
                                  : MPI_Irecv(at, int(c.rows), row.get(), c.peer, kChunkTag, comm_, &requests.back()));
      }
    };
    // Receives first: a peer's early message then lands in place instead of MPI's unexpected queue.
    post(recv_chunks, r, false);
    post(send_chunks, s, true);
    FLOWMOE_MPI_CHECK(MPI_Waitall(int(requests.size()), requests.data(), MPI_STATUSES_IGNORE));
    r.store();
  }

  void do_all_reduce(const Tensor& t, ReduceOp op) override {
    MPI_Datatype type = mpi_type(t.dtype());
    HostBytes h(t, true, stream());
    char* base = static_cast<char*>(h.data());
    constexpr int64_t kChunk = int64_t(1) << 28;  // elements per call, within MPI's int count
    for (int64_t at = 0; at < t.numel(); at += kChunk) {
      int count = int(std::min(kChunk, t.numel() - at));
      FLOWMOE_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, base + size_t(at) * dtype_size(t.dtype()), count, type,
                                      op == ReduceOp::max ? MPI_MAX : MPI_SUM, comm_));
    }
    if (op == ReduceOp::avg) scale_in_place(h.data(), t.dtype(), t.numel(), 1.0 / double(size_));
    h.store();
  }

  void do_all_gather(const Tensor& send, const Tensor& recv, size_t row_bytes) override {
    if (row_bytes == 0 || send.size(0) == 0) return;
    int rows = to_mpi_int(send.size(0), "rows gathered from each rank");
    RowType row(row_bytes);
    HostBytes s(send, true, stream()), r(recv, false, stream());
    FLOWMOE_MPI_CHECK(MPI_Allgather(s.data(), rows, row.get(), r.data(), rows, row.get(), comm_));
    r.store();
  }

  // MPI_Reduce_scatter_block into this rank's segment alone (MPI_IN_PLACE would put it at the front).
  void do_reduce_scatter_in_place(const Tensor& t, ReduceOp op) override {
    const int64_t n = t.numel() / size_;
    const int count = to_mpi_int(n, "elements in one segment");
    const size_t esize = dtype_size(t.dtype());
    HostBytes h(t, true, stream());
    std::vector<uint8_t> mine(size_t(n) * esize);  // n >= 1: the caller skips an empty t
    FLOWMOE_MPI_CHECK(MPI_Reduce_scatter_block(h.data(), mine.data(), count, mpi_type(t.dtype()), MPI_SUM, comm_));
    if (op == ReduceOp::avg) scale_in_place(mine.data(), t.dtype(), n, 1.0 / double(size_));
    std::memcpy(static_cast<char*>(h.data()) + size_t(rank_) * size_t(n) * esize, mine.data(), size_t(n) * esize);
    h.store();
  }

  void do_all_gather_in_place(const Tensor& t, size_t seg_bytes) override {
    const int bytes = to_mpi_int(int64_t(seg_bytes), "bytes in one segment");
    HostBytes h(t, true, stream());
    FLOWMOE_MPI_CHECK(MPI_Allgather(MPI_IN_PLACE, 0, MPI_BYTE, h.data(), bytes, MPI_BYTE, comm_));
    h.store();
  }

  void do_broadcast(const Tensor& t, int root) override {
    HostBytes h(t, rank_ == root, stream());
    char* base = static_cast<char*>(h.data());
    constexpr int64_t kChunk = int64_t(1) << 30;  // bytes per call
    const int64_t nbytes = int64_t(t.nbytes());
    for (int64_t at = 0; at < nbytes; at += kChunk)
      FLOWMOE_MPI_CHECK(MPI_Bcast(base + at, int(std::min(kChunk, nbytes - at)), MPI_BYTE, root, comm_));
    if (rank_ != root) h.store();
  }

  void do_barrier() override { FLOWMOE_MPI_CHECK(MPI_Barrier(comm_)); }

  std::shared_ptr<Communicator> do_split(int color, int key, int /*max_ctas: no kernels here*/) override {
    MPI_Comm sub = MPI_COMM_NULL;
    FLOWMOE_MPI_CHECK(MPI_Comm_split(comm_, color, key, &sub));
    try {
      return std::make_shared<MpiCommunicator>(sub);
    } catch (...) {
      MPI_Comm_free(&sub);
      throw;
    }
  }

 private:
  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace

bool built_with_mpi() { return true; }

std::shared_ptr<Communicator> make_mpi_world_communicator() {
  ensure_mpi_initialized();
  return std::make_shared<MpiCommunicator>(MPI_COMM_WORLD);
}

int mpi_node_local_rank() {
  ensure_mpi_initialized();
  MPI_Comm node = MPI_COMM_NULL;
  FLOWMOE_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int local_rank = 0;
  int rc = MPI_Comm_rank(node, &local_rank);
  MPI_Comm_free(&node);
  FLOWMOE_MPI_CHECK(rc);
  return local_rank;
}

bool mpi_abort_world(int status) {
  int initialized = 0, size = 1;
  if (MPI_Initialized(&initialized) != MPI_SUCCESS || !initialized || mpi_is_finalized()) return false;
  if (MPI_Comm_size(MPI_COMM_WORLD, &size) != MPI_SUCCESS || size <= 1) return false;
  MPI_Abort(MPI_COMM_WORLD, status);
  return true;  // not reached: MPI_Abort ends the process
}

}  // namespace flowmoe
