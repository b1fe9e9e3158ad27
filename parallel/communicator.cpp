// The backend-independent half of Communicator: argument checks (each names what was wrong, the same
// for every backend), the forms that allocate their output, and the default count exchange. The
// backends receive only checked arguments and move bytes.
#include "parallel/communicator.h"

#include <numeric>

namespace flowmoe {

const char* reduce_op_name(ReduceOp op) { return op == ReduceOp::sum ? "sum" : "max"; }

namespace {

int64_t sum_rows(const std::vector<int64_t>& rows) { return std::accumulate(rows.begin(), rows.end(), int64_t(0)); }

Shape row_shape(const Tensor& t) { return Shape(t.shape().begin() + 1, t.shape().end()); }

size_t row_bytes_of(const Tensor& t) { return size_t(shape_numel(row_shape(t))) * dtype_size(t.dtype()); }

void check_rows_tensor(const Tensor& t, const char* call, const char* what) {
  FLOWMOE_CHECK(t.defined(), ShapeError, call, ": ", what, " is an undefined tensor");
  FLOWMOE_CHECK(t.dim() >= 1, ShapeError, call, " moves rows: ", what, " needs at least one dim, got ", t.describe());
}

void check_counts(const std::vector<int64_t>& rows, int size, const char* call, const char* what) {
  FLOWMOE_CHECK(int64_t(rows.size()) == size, ShapeError, call, ": ", what, " has ", rows.size(),
                " entries for a communicator of ", size, " ranks");
  for (size_t p = 0; p < rows.size(); ++p)
    FLOWMOE_CHECK(rows[p] >= 0, ShapeError, call, ": ", what, "[", p, "] = ", rows[p], " is negative");
}

void check_output(const Tensor& out, const Tensor& in, const char* call, const char* what) {
  check_same_dtype(out, in, call);
  check_same_device(out, in, call);
  FLOWMOE_CHECK(out.is_contiguous(), ShapeError, call, ": ", what, " ", out.describe(), " must be contiguous");
  FLOWMOE_CHECK(!out.shares_storage_with(in), ShapeError, call, ": ", what, " must not share storage with its input");
}

}  // namespace

void Communicator::all_to_all(const Tensor& send_in, const std::vector<int64_t>& send_rows, const Tensor& recv,
                              const std::vector<int64_t>& recv_rows) {
  check_rows_tensor(send_in, "all_to_all", "send");
  check_rows_tensor(recv, "all_to_all", "recv");
  check_counts(send_rows, size(), "all_to_all", "send_rows");
  check_counts(recv_rows, size(), "all_to_all", "recv_rows");
  FLOWMOE_CHECK(send_in.size(0) == sum_rows(send_rows), ShapeError, "all_to_all: send ", send_in.describe(), " has ",
                send_in.size(0), " rows but send_rows add up to ", sum_rows(send_rows));
  FLOWMOE_CHECK(recv.size(0) == sum_rows(recv_rows), ShapeError, "all_to_all: recv ", recv.describe(), " has ",
                recv.size(0), " rows but recv_rows add up to ", sum_rows(recv_rows));
  FLOWMOE_CHECK(row_shape(send_in) == row_shape(recv), ShapeError, "all_to_all: send rows ",
                shape_str(row_shape(send_in)), " and recv rows ", shape_str(row_shape(recv)), " differ");
  check_output(recv, send_in, "all_to_all", "recv");
  Tensor send = send_in.contiguous();
  do_all_to_all(send, send_rows, recv, recv_rows, row_bytes_of(send));
}

Tensor Communicator::all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows,
                                const std::vector<int64_t>& recv_rows) {
  check_rows_tensor(send, "all_to_all", "send");
  check_counts(recv_rows, size(), "all_to_all", "recv_rows");
  const auto& scales = send.fp8_scales();
  if (scales) {  // checked before anything moves
    FLOWMOE_CHECK(scales->mode == ScalingMode::rowwise_1x128, DTypeError, "all_to_all moves FP8 scales with their",
                  " rows when they are rowwise_1x128, got ", scaling_mode_name(scales->mode), " on ", send.describe());
    FLOWMOE_CHECK(scales->scale_inv.dim() == 2 && scales->scale_inv.size(0) == send.size(0), ShapeError,
                  "all_to_all: rowwise scales ", scales->scale_inv.describe(), " do not have one row per row of ",
                  send.describe());
  }
  Shape shape = send.shape();
  shape[0] = sum_rows(recv_rows);
  Tensor recv = Tensor::empty(shape, send.dtype(), send.device());
  all_to_all(send, send_rows, recv, recv_rows);
  if (!scales) return recv;
  return recv.with_scales(all_to_all(scales->scale_inv, send_rows, recv_rows), ScalingMode::rowwise_1x128);
}

std::vector<int64_t> Communicator::exchange_counts(const std::vector<int64_t>& send_rows) {
  check_counts(send_rows, size(), "exchange_counts", "send_rows");
  return do_exchange_counts(send_rows);
}

std::vector<int64_t> Communicator::do_exchange_counts(const std::vector<int64_t>& send_rows) {
  Tensor send = Tensor::from_ints(send_rows, {int64_t(size())}, DType::i64, native_device());
  std::vector<int64_t> ones(size_t(size()), 1);
  Tensor recv = all_to_all(send, ones, ones);
  synchronize();
  return recv.to_ints();
}

void Communicator::all_reduce(const Tensor& t, ReduceOp op) {
  FLOWMOE_CHECK(t.defined(), ShapeError, "all_reduce of an undefined tensor");
  check_dtype(t, {DType::f32, DType::f64, DType::i32, DType::i64}, "all_reduce");
  FLOWMOE_CHECK(t.is_contiguous(), ShapeError, "all_reduce works in place: ", t.describe(), " must be contiguous");
  do_all_reduce(t, op);
}

void Communicator::all_gather(const Tensor& send_in, const Tensor& recv) {
  check_rows_tensor(send_in, "all_gather", "send");
  check_rows_tensor(recv, "all_gather", "recv");
  Shape want = send_in.shape();
  want[0] *= size();
  FLOWMOE_CHECK(recv.shape() == want, ShapeError, "all_gather: recv ", recv.describe(), " should be ", shape_str(want),
                " (", size(), " ranks x ", send_in.size(0), " rows)");
  check_output(recv, send_in, "all_gather", "recv");
  Tensor send = send_in.contiguous();
  do_all_gather(send, recv, row_bytes_of(send));
}

Tensor Communicator::all_gather(const Tensor& send) {
  check_rows_tensor(send, "all_gather", "send");
  Shape shape = send.shape();
  shape[0] *= size();
  Tensor recv = Tensor::empty(shape, send.dtype(), send.device());
  all_gather(send, recv);
  return recv;
}

void Communicator::broadcast(const Tensor& t, int root) {
  FLOWMOE_CHECK(t.defined(), ShapeError, "broadcast of an undefined tensor");
  FLOWMOE_CHECK(root >= 0 && root < size(), CommError, "broadcast: root ", root, " is not a rank of this ", size(),
                "-rank communicator");
  FLOWMOE_CHECK(t.is_contiguous(), ShapeError, "broadcast works in place: ", t.describe(), " must be contiguous");
  do_broadcast(t, root);
}

void Communicator::barrier() { do_barrier(); }

void Communicator::synchronize() { do_synchronize(); }

std::shared_ptr<Communicator> Communicator::split(int color, int key) {
  FLOWMOE_CHECK(color >= 0, CommError, "split: color must be >= 0, got ", color);
  return do_split(color, key);
}

}  // namespace flowmoe
