// Communicator: the collectives that expert and data parallelism need, on engine Tensors.
//
// One interface, three backends (made by parallel/backends.h): "none" (one process: every collective
// is an identity or a copy), "mpi" (CPU tensors directly; CUDA tensors staged through host memory, a
// test transport that lets several ranks share one GPU) and "nccl" (CUDA tensors, on the
// communicator's stream, bootstrapped through an MPI communicator). The public calls check their
// arguments here, once, so every backend refuses the same mistakes with the same typed error; the
// backends only move bytes. Collectives are collective: every rank of the group calls them in the
// same order, with sizes that agree across ranks.
#pragma once
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "engine/tensor.h"
#include "kernels/common/device_api.h"
#include "kernels/common/error.h"

namespace flowmoe {

// An MPI or NCCL call failed, a backend is missing from the build, or the ranks of a group disagree.
class CommError : public Error {
  using Error::Error;
};

// avg: the sum over the ranks times 1/size (floating types only; nccl's ncclAvg, which scales each
// input by 1/size before the sum: the same for a power-of-two size, barring subnormals).
enum class ReduceOp : uint8_t { sum, max, avg };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend_name() const = 0;  // "none", "mpi" or "nccl"
  // Where this backend's tensors live without staging: cpu (none, mpi) or the nccl communicator's cuda:N.
  virtual Device native_device() const = 0;

  // Rows to and from every peer. send [sum(send_rows), ...] holds the rows for peer p contiguously,
  // in peer order, send_rows[p] of them; recv [sum(recv_rows), ...] gets recv_rows[p] rows from each
  // peer p, in peer order. Rows have any shape and dtype (FP8 bytes, f32 scales) and arrive bit for
  // bit. recv_rows[p] on this rank must equal send_rows[this rank] on peer p (exchange_counts gives
  // them); recv is written in place and must not share storage with send.
  void all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows, const Tensor& recv,
                  const std::vector<int64_t>& recv_rows);
  // The same into a new tensor. An FP8 send with rowwise_1x128 scales attached moves its scale rows
  // along, and the result carries them; the in-place form above moves send's bytes only.
  Tensor all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows);
  // A run of rows exchanged with one peer: rows [offset, offset + rows) of the tensor.
  struct RowChunk {
    int peer = 0;
    int64_t offset = 0;
    int64_t rows = 0;
  };
  // Rows between chunks. For each peer q, the chunks of send_chunks with peer q (in list order) are
  // matched one to one, in order, with the chunks q lists in its recv_chunks for this rank; matched
  // chunks hold equal row counts (callers derive both sides from the same exchanged counts). A chunk of
  // 0 rows is allowed (both sides skip it). Chunks to and from this rank itself are local copies.
  // Rows of recv that no chunk covers keep their contents. Rows have any shape and dtype and arrive
  // bit for bit; recv must not share storage with send. Expert-parallel dispatch uses it to land rows
  // straight in an expert-major padded layout.
  void all_to_all_chunks(const Tensor& send, const std::vector<RowChunk>& send_chunks, const Tensor& recv,
                         const std::vector<RowChunk>& recv_chunks);
  // One tensor of a put_rows: send [S, ...] to recv [R, ...] (the same row shape, recv not sharing
  // send's storage), and the value recv's pad rows take (0: zero bytes, any dtype).
  struct RowPut {
    Tensor send;
    Tensor recv;
    double pad_value = 0;
  };
  // The rows of put_rows' recv tensors that take their pad value though no chunk covers them: in
  // segment s, the rows [starts[s] + covered[s], starts[s+1]), an expert's pad rows, which its GEMMs
  // read. Rows past starts[S] (a worst-case buffer's tail) and any others no chunk covers are left
  // unspecified.
  struct PadSegments {
    Tensor starts;   // [S+1] i32 beside the tables; undefined: no row takes a value
    Tensor covered;  // [S] i32: the rows the chunks fill at the start of each segment
    // [1] i32 beside the tables, or undefined: nonzero when the layout emptied the exchange (its need passed
    // the buffers, kernels/ep_layout.h). Every row of every recv then takes its pad value.
    Tensor overflow;
  };
  // Rows into the peers' buffers along tables that stay where they were computed (the device), for an
  // exchange whose sizes the host never reads (DESIGN.md §2, zero-sync dispatch). Collective.
  //   tensors: moved along the same tables (rows, their FP8 scales, their probs), every send with S
  //            rows and every recv with R
  //   out_table [n, C, 3] i32: for peer q and chunk c, (first row in send, first row in q's recv, rows)
  //   in_table  [n, C, 3] i32: for peer p and chunk c, (first row in recv, first row in p's send, rows):
  //             the chunks p's out_table lists for this rank, in the same order
  //   each recv: the chunks' rows, and pad's rows set to its pad_value; every other row is unspecified.
  // nccl on load/store-reachable GPUs writes the rows of every tensor into the peers' memory from one
  // kernel that reads out_table on the device (parallel/nccl/lsa_put.h): no host read, and each recv
  // must have the same shape on every rank (a worst-case size). Elsewhere (none, mpi, nccl without
  // NVLink/P2P reach) the tables are read to the host (each read of a device table a counted sync) and the rows
  // move by all_to_all_chunks. A chunk that runs past either buffer is an error (checked on the host
  // paths; skipped on the device). The host paths write the unspecified rows with NaN bytes (0xFF), so
  // that a reader of them fails loudly in tests; the device path leaves them as they were, which is
  // the write it saves.
  void put_rows(const std::vector<RowPut>& tensors, const Tensor& out_table, const Tensor& in_table,
                const PadSegments& pad);
  // Whether put_rows writes into the peers' memory from the device (nccl, every rank load/store
  // reachable), so that it reads nothing to the host. Collective the first time (nccl sets up its window
  // machinery then): every rank asks at the same point.
  bool device_puts() { return do_device_puts(); }
  // recv_rows from send_rows: how many rows each peer sends this rank (the counts travel on the host).
  std::vector<int64_t> exchange_counts(const std::vector<int64_t>& send_rows);

  // t = op over ranks of t, in place. f32, f64, i32, i64 (avg: f32, f64).
  void all_reduce(const Tensor& t, ReduceOp op);
  // send [n, ...] from every rank -> recv [size() * n, ...], rank r's rows at [r*n, (r+1)*n).
  void all_gather(const Tensor& send, const Tensor& recv);
  Tensor all_gather(const Tensor& send);
  // The halves of an all_reduce, for a sharded optimizer (ZeRO-1): t [size() * n] (1-D, contiguous) on
  // every rank, in place. reduce_scatter_in_place leaves op over ranks of segment r, t[r*n, (r+1)*n), in
  // rank r's segment r (f32 or f64; sum or avg) and the other segments unspecified;
  // all_gather_in_place gives every rank each rank's own segment (any dtype).
  void reduce_scatter_in_place(const Tensor& t, ReduceOp op);
  void all_gather_in_place(const Tensor& t);
  // t on every rank becomes root's t (in place).
  void broadcast(const Tensor& t, int root);
  // Every rank has reached this point (nccl: and its enqueued collectives are complete).
  void barrier();
  // Blocks the host until this rank's enqueued collectives are complete (only nccl enqueues).
  void synchronize();
  // A communicator for each color: the ranks that passed the same color, ordered by key (ties by
  // rank). Collective over this communicator; color >= 0. max_ctas > 0 bounds the thread blocks, so
  // the SMs, that nccl's kernels on the new communicator may take (ncclConfig_t.maxCTAs): its
  // collectives then leave the rest of the GPU to the compute that runs beside them. The other
  // backends run no kernels and ignore it.
  std::shared_ptr<Communicator> split(int color, int key, int max_ctas = 0);

  // Milliseconds this rank spent in all_to_all and all_to_all_chunks (expert parallelism's token
  // exchange, counts included) since the last call, and resets the sum: host time where the backend
  // returns when done (none, mpi), GPU time between events around each call on the stream for nccl,
  // which waits for those events.
  double take_exchange_ms();
  // The same per training step, for a step read back while the next one is already queued: close
  // puts the exchanges since the last close (or take) into a window, and take_exchange_window_ms
  // returns the oldest closed window's milliseconds (0 when none), waiting for its exchanges alone.
  void close_exchange_window();
  double take_exchange_window_ms();

  // The communicator of the same ranks, in the same order, that moves host values: nccl's bootstrap
  // (mpi), this one for the others. A few scalars the host has (a stop request, peak memory) travel
  // there, with no device copy and so no wait for the GPU's queue.
  virtual Communicator& host_communicator() { return *this; }

  // nccl: the stream collectives are enqueued on; nullptr (the default) means the engine's stream of
  // the communicator's device, so they follow the kernels that produced their inputs and the caching
  // allocator needs no cross-stream events. A side stream leaves that ordering to the caller.
  // none and mpi copy on the engine stream and return when done; mpi refuses GPU tensors with a side stream.
  void set_stream(cudaStream_t stream) { stream_ = stream; }
  cudaStream_t stream() const { return stream_; }

 protected:
  // Called with checked arguments: contiguous tensors on one device, counts of size() entries that
  // add up to the row counts, row_bytes the bytes of one row (the same in send and recv).
  virtual void do_all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows, const Tensor& recv,
                             const std::vector<int64_t>& recv_rows, size_t row_bytes) = 0;
  // Called with checked arguments: contiguous tensors on one device, chunks inside their tensors, recv
  // chunks disjoint, and this rank's chunks to itself matched (non-empty ones in order, equal rows).
  virtual void do_all_to_all_chunks(const Tensor& send, const std::vector<RowChunk>& send_chunks, const Tensor& recv,
                                    const std::vector<RowChunk>& recv_chunks, size_t row_bytes) = 0;
  // Called with checked arguments (tables [n, C, 3] i32; each send contiguous, each recv contiguous
  // with its send's row shape; pad's tensors [S+1] and [S] i32). The default reads the tables and pad's
  // starts to the host, writes each recv's rows (NaN bytes, then its pad_value over the segments) and
  // calls do_all_to_all_chunks for each tensor.
  virtual void do_put_rows(const std::vector<RowPut>& tensors, const Tensor& out_table, const Tensor& in_table,
                           const PadSegments& pad);
  virtual bool do_device_puts() { return false; }
  virtual void do_all_reduce(const Tensor& t, ReduceOp op) = 0;
  virtual void do_all_gather(const Tensor& send, const Tensor& recv, size_t row_bytes) = 0;
  // Called with t 1-D, contiguous, its numel a multiple of size(); seg_bytes the bytes of one segment.
  virtual void do_reduce_scatter_in_place(const Tensor& t, ReduceOp op) = 0;
  virtual void do_all_gather_in_place(const Tensor& t, size_t seg_bytes) = 0;
  virtual void do_broadcast(const Tensor& t, int root) = 0;
  virtual void do_barrier() = 0;
  virtual void do_synchronize() {}
  virtual std::shared_ptr<Communicator> do_split(int color, int key, int max_ctas) = 0;
  // Around each all-to-all: an asynchronous backend (nccl) records events here and sums their elapsed
  // GPU time in take_device_ms; the others keep the host time the base class measures (-1 below).
  virtual void exchange_started() {}
  virtual void exchange_finished() {}
  virtual double take_device_ms() { return -1; }  // every exchange, closed windows included
  virtual void close_device_window() {}
  virtual double take_device_window_ms() { return -1; }
  // Default: an all_to_all of one i64 per peer on native_device().
  virtual std::vector<int64_t> do_exchange_counts(const std::vector<int64_t>& send_rows);

 private:
  cudaStream_t stream_ = nullptr;
  double exchange_host_ms_ = 0;      // since the last close or take
  std::deque<double> host_windows_;  // closed, oldest first

  template <class F>
  void timed_exchange(F&& move);
};

}  // namespace flowmoe
