// The "none" backend: one process, world size 1. Every collective is an identity (all_reduce,
// broadcast, barrier) or a copy (all_to_all, all_to_all_chunks, all_gather), on CPU or CUDA tensors
// alike, so code written for N ranks runs unchanged on one without MPI or NCCL.
#include "parallel/backends.h"

namespace flowmoe {

namespace {

class NoneCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const char* backend_name() const override { return "none"; }
  Device native_device() const override { return Device::cpu(); }

 protected:
  void do_all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows, const Tensor& recv,
                     const std::vector<int64_t>& recv_rows, size_t) override {
    FLOWMOE_CHECK(send_rows[0] == recv_rows[0], ShapeError, "all_to_all on one rank: it receives what it sends, but",
                  " send_rows = ", send_rows[0], " and recv_rows = ", recv_rows[0]);
    Tensor out = recv;  // a handle on the same storage
    out.copy_(send);
  }
  // Every chunk is to and from rank 0; the checks matched the non-empty ones in order.
  void do_all_to_all_chunks(const Tensor& send, const std::vector<RowChunk>& send_chunks, const Tensor& recv,
                            const std::vector<RowChunk>& recv_chunks, size_t) override {
    size_t r = 0;
    for (const RowChunk& s : send_chunks) {
      if (s.rows == 0) continue;
      while (recv_chunks[r].rows == 0) ++r;
      const RowChunk& d = recv_chunks[r++];
      recv.slice(0, d.offset, d.offset + d.rows).copy_(send.slice(0, s.offset, s.offset + s.rows));
    }
  }
  void do_all_reduce(const Tensor&, ReduceOp) override {}
  void do_all_gather(const Tensor& send, const Tensor& recv, size_t) override {
    Tensor out = recv;
    out.copy_(send);
  }
  void do_reduce_scatter_in_place(const Tensor&, ReduceOp) override {}
  void do_all_gather_in_place(const Tensor&, size_t) override {}
  void do_broadcast(const Tensor&, int) override {}
  void do_barrier() override {}
  std::shared_ptr<Communicator> do_split(int, int, int) override { return std::make_shared<NoneCommunicator>(); }
};

}  // namespace

std::shared_ptr<Communicator> make_none_communicator() { return std::make_shared<NoneCommunicator>(); }

}  // namespace flowmoe
