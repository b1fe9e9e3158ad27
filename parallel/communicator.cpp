// The backend-independent half of Communicator: argument checks (each names what was wrong, the same
// for every backend), the forms that allocate their output, and the default count exchange. The
// backends receive only checked arguments and move bytes.
#include "parallel/communicator.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <string>

#include "parallel/watchdog.h"

namespace flowmoe {

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

void check_chunks(const std::vector<Communicator::RowChunk>& chunks, const Tensor& t, int size, const char* what) {
  for (size_t i = 0; i < chunks.size(); ++i) {
    const Communicator::RowChunk& c = chunks[i];
    FLOWMOE_CHECK(c.peer >= 0 && c.peer < size, CommError, "all_to_all_chunks: ", what, "[", i, "].peer = ", c.peer,
                  " is not a rank of this ", size, "-rank communicator");
    FLOWMOE_CHECK(c.offset >= 0 && c.rows >= 0, ShapeError, "all_to_all_chunks: ", what, "[", i, "] has offset ",
                  c.offset, " and rows ", c.rows, ": neither may be negative");
    FLOWMOE_CHECK(c.offset <= t.size(0) && c.rows <= t.size(0) - c.offset, ShapeError, "all_to_all_chunks: ", what, "[",
                  i, "] = rows [", c.offset, ", ", c.offset + c.rows, ") runs past the end of ", t.describe());
  }
}

// Each row of recv is written by at most one chunk: two writers would make the result depend on timing.
void check_disjoint(const std::vector<Communicator::RowChunk>& chunks) {
  std::vector<size_t> order;
  for (size_t i = 0; i < chunks.size(); ++i)
    if (chunks[i].rows > 0) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return chunks[a].offset < chunks[b].offset; });
  for (size_t k = 1; k < order.size(); ++k) {
    const Communicator::RowChunk &a = chunks[order[k - 1]], &b = chunks[order[k]];
    FLOWMOE_CHECK(a.offset + a.rows <= b.offset, ShapeError, "all_to_all_chunks: recv_chunks[", order[k - 1],
                  "] = rows [", a.offset, ", ", a.offset + a.rows, ") and recv_chunks[", order[k], "] = rows [",
                  b.offset, ", ", b.offset + b.rows, ") overlap");
  }
}

// The non-empty row counts of the chunks with this peer, in list order: what the two sides must agree on.
std::vector<int64_t> rows_with(const std::vector<Communicator::RowChunk>& chunks, int peer) {
  std::vector<int64_t> rows;
  for (const Communicator::RowChunk& c : chunks)
    if (c.peer == peer && c.rows > 0) rows.push_back(c.rows);
  return rows;
}

std::string join(const std::vector<int64_t>& v) {
  std::string out;
  for (int64_t x : v) out += (out.empty() ? "" : ", ") + std::to_string(x);
  return out.empty() ? "none" : out;
}

// The chunk lists of one exchange: inside their tensors, recv chunks disjoint, the chunks to this rank
// itself matched (the one pairing a rank can check alone; a mismatch would stall or truncate).
void check_chunk_lists(const Tensor& send, const std::vector<Communicator::RowChunk>& send_chunks, const Tensor& recv,
                       const std::vector<Communicator::RowChunk>& recv_chunks, int rank, int size) {
  check_chunks(send_chunks, send, size, "send_chunks");
  check_chunks(recv_chunks, recv, size, "recv_chunks");
  check_disjoint(recv_chunks);
  std::vector<int64_t> to_self = rows_with(send_chunks, rank), from_self = rows_with(recv_chunks, rank);
  FLOWMOE_CHECK(to_self == from_self, ShapeError, "all_to_all_chunks: rank ", rank, " sends itself chunks of ",
                join(to_self), " rows but receives from itself chunks of ", join(from_self), " rows");
}

// Arms the collectives' watchdog for the call (parallel/watchdog.h): the one place every backend's blocking
// calls, and nccl's host waits, pass through.
WatchedWait watched(const Communicator& c, const char* call) { return WatchedWait(call, c.backend_name(), c.size()); }

}  // namespace

template <class F>
void Communicator::timed_exchange(F&& move) {
  const auto start = std::chrono::steady_clock::now();
  exchange_started();
  move();
  exchange_finished();
  exchange_host_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

double Communicator::take_exchange_ms() {
  const WatchedWait watch = watched(*this, "the exchanges' timing events");
  const double device_ms = take_device_ms();
  double host_ms = exchange_host_ms_;
  for (double w : host_windows_) host_ms += w;
  exchange_host_ms_ = 0;
  host_windows_.clear();
  return device_ms >= 0 ? device_ms : host_ms;
}

void Communicator::close_exchange_window() {
  host_windows_.push_back(exchange_host_ms_);
  exchange_host_ms_ = 0;
  close_device_window();
}

double Communicator::take_exchange_window_ms() {
  const WatchedWait watch = watched(*this, "the exchanges' timing events");
  const double device_ms = take_device_window_ms();
  double host_ms = 0;
  if (!host_windows_.empty()) {
    host_ms = host_windows_.front();
    host_windows_.pop_front();
  }
  return device_ms >= 0 ? device_ms : host_ms;
}

void Communicator::all_to_all_chunks(const Tensor& send_in, const std::vector<RowChunk>& send_chunks,
                                     const Tensor& recv, const std::vector<RowChunk>& recv_chunks) {
  check_rows_tensor(send_in, "all_to_all_chunks", "send");
  check_rows_tensor(recv, "all_to_all_chunks", "recv");
  FLOWMOE_CHECK(row_shape(send_in) == row_shape(recv), ShapeError, "all_to_all_chunks: send rows ",
                shape_str(row_shape(send_in)), " and recv rows ", shape_str(row_shape(recv)), " differ");
  check_output(recv, send_in, "all_to_all_chunks", "recv");
  check_chunk_lists(send_in, send_chunks, recv, recv_chunks, rank(), size());
  Tensor send = send_in.contiguous();
  const WatchedWait watch = watched(*this, "all_to_all_chunks");
  timed_exchange([&] { do_all_to_all_chunks(send, send_chunks, recv, recv_chunks, row_bytes_of(send)); });
}

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
  const WatchedWait watch = watched(*this, "all_to_all");
  timed_exchange([&] { do_all_to_all(send, send_rows, recv, recv_rows, row_bytes_of(send)); });
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

namespace {

void check_put_table(const Tensor& t, const Tensor& rows, int size, const char* what) {
  FLOWMOE_CHECK(t.defined() && t.dtype() == DType::i32 && t.dim() == 3 && t.size(0) == size && t.size(2) == 3 &&
                    t.is_contiguous(),
                ShapeError, "put_rows: ", what, " ", t.defined() ? t.describe() : std::string("(undefined)"),
                " must be a contiguous [", size, ", C, 3] i32 table");
  FLOWMOE_CHECK(t.device() == rows.device() || t.device().is_cpu(), DeviceError, "put_rows: ", what, " ", t.describe(),
                " must be on the CPU or beside ", rows.describe());
}

// Each table entry (row, peer's row, rows) as a chunk of this rank's buffer with the entry's peer.
std::vector<Communicator::RowChunk> table_chunks(const std::vector<int64_t>& v, int64_t C) {
  std::vector<Communicator::RowChunk> chunks;
  for (size_t i = 0; i < v.size() / 3; ++i) chunks.push_back({int(int64_t(i) / C), v[3 * i], v[3 * i + 2]});
  return chunks;
}

}  // namespace

void Communicator::put_rows(const std::vector<RowPut>& tensors_in, const Tensor& out_table, const Tensor& in_table,
                            const PadSegments& pad) {
  FLOWMOE_CHECK(!tensors_in.empty(), ShapeError, "put_rows: no tensors to move");
  std::vector<RowPut> tensors = tensors_in;
  for (RowPut& t : tensors) {
    check_rows_tensor(t.send, "put_rows", "send");
    check_rows_tensor(t.recv, "put_rows", "recv");
    FLOWMOE_CHECK(row_shape(t.send) == row_shape(t.recv), ShapeError, "put_rows: send rows ",
                  shape_str(row_shape(t.send)), " and recv rows ", shape_str(row_shape(t.recv)), " differ");
    check_output(t.recv, t.send, "put_rows", "recv");
    const RowPut& first = tensors.front();
    FLOWMOE_CHECK(t.send.size(0) == first.send.size(0) && t.recv.size(0) == first.recv.size(0), ShapeError,
                  "put_rows: ", t.send.describe(), " → ", t.recv.describe(), " and ", first.send.describe(), " → ",
                  first.recv.describe(), " move along one table but have different rows");
    t.send = t.send.contiguous();
  }
  const Tensor& send0 = tensors.front().send;
  check_put_table(out_table, send0, size(), "out_table");
  check_put_table(in_table, send0, size(), "in_table");
  FLOWMOE_CHECK(out_table.size(1) == in_table.size(1), ShapeError, "put_rows: out_table ", out_table.describe(),
                " and in_table ", in_table.describe(), " list different chunks per peer");
  if (pad.starts.defined()) {
    const Tensor& s = pad.starts;
    const Tensor& c = pad.covered;
    FLOWMOE_CHECK(s.dim() == 1 && s.numel() >= 1 && s.dtype() == DType::i32 && s.is_contiguous() && c.defined() &&
                      c.dim() == 1 && c.numel() == s.numel() - 1 && c.dtype() == DType::i32 && c.is_contiguous() &&
                      s.device() == in_table.device() && c.device() == in_table.device(),
                  ShapeError, "put_rows: pad starts ", s.describe(), " and covered ",
                  c.defined() ? c.describe() : std::string("(undefined)"),
                  " must be contiguous [S+1] and [S] i32 beside in_table ", in_table.describe());
  }
  const Tensor& o = pad.overflow;
  FLOWMOE_CHECK(!o.defined() || (o.numel() == 1 && o.dtype() == DType::i32 && o.device() == in_table.device()),
                ShapeError, "put_rows: overflow ", o.describe(), " must be [1] i32 beside in_table ",
                in_table.describe());
  const WatchedWait watch = watched(*this, "put_rows");
  timed_exchange([&] { do_put_rows(tensors, out_table, in_table, pad); });
}

void Communicator::do_put_rows(const std::vector<RowPut>& tensors, const Tensor& out_table, const Tensor& in_table,
                               const PadSegments& pad) {
  const int64_t C = out_table.size(1);
  const std::vector<RowChunk> send_chunks = table_chunks(out_table.to_ints(), C);
  const std::vector<RowChunk> recv_chunks = table_chunks(in_table.to_ints(), C);
  const RowPut& first = tensors.front();
  check_chunk_lists(first.send, send_chunks, first.recv, recv_chunks, rank(), size());
  int64_t segments_begin = 0, segments_end = 0;  // the value goes over every segment, pad rows and covered alike
  if (pad.starts.defined()) {
    const std::vector<int64_t> starts = pad.starts.to_ints();
    segments_begin = starts.front(), segments_end = starts.back();
    FLOWMOE_CHECK(segments_begin >= 0 && segments_begin <= segments_end && segments_end <= first.recv.size(0),
                  ShapeError, "put_rows: pad segments [", segments_begin, ", ", segments_end, ") run past recv ",
                  first.recv.describe());
  }
  // An emptied exchange (the tables move nothing): every row takes the pad value.
  if (pad.overflow.defined() && pad.overflow.to_ints().front() != 0)
    segments_begin = 0, segments_end = first.recv.size(0);
  for (const RowPut& t : tensors) {
    Tensor out = t.recv;    // a handle on the same storage
    out.fill_bytes_(0xFF);  // the unspecified rows: NaN in every float dtype
    Tensor segments = out.slice(0, segments_begin, segments_end);
    if (t.pad_value == 0)
      segments.zero_();  // any dtype, FP8 bytes included
    else
      segments.fill_(t.pad_value);
    do_all_to_all_chunks(t.send, send_chunks, t.recv, recv_chunks, row_bytes_of(t.send));  // the chunks overwrite
  }
}

std::vector<int64_t> Communicator::exchange_counts(const std::vector<int64_t>& send_rows) {
  check_counts(send_rows, size(), "exchange_counts", "send_rows");
  const WatchedWait watch = watched(*this, "exchange_counts");
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
  FLOWMOE_CHECK(op != ReduceOp::avg || t.dtype() == DType::f32 || t.dtype() == DType::f64, DTypeError,
                "all_reduce avg of ", t.describe(), ": a mean needs a floating type");
  FLOWMOE_CHECK(t.is_contiguous(), ShapeError, "all_reduce works in place: ", t.describe(), " must be contiguous");
  const WatchedWait watch = watched(*this, "all_reduce");
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
  const WatchedWait watch = watched(*this, "all_gather");
  do_all_gather(send, recv, row_bytes_of(send));
}

// The sharded forms' shared checks: a flat tensor of whole segments.
static void check_segments(const Tensor& t, int size, const char* call) {
  FLOWMOE_CHECK(t.defined(), ShapeError, call, " of an undefined tensor");
  FLOWMOE_CHECK(t.dim() == 1 && t.is_contiguous(), ShapeError, call, " works in place on a flat tensor: ", t.describe(),
                " must be 1-D and contiguous");
  FLOWMOE_CHECK(t.numel() % size == 0, ShapeError, call, ": ", t.describe(), " is not ", size,
                " segments of equal size (pad it to a multiple of the ranks)");
}

void Communicator::reduce_scatter_in_place(const Tensor& t, ReduceOp op) {
  check_segments(t, size(), "reduce_scatter_in_place");
  check_dtype(t, {DType::f32, DType::f64}, "reduce_scatter_in_place");
  FLOWMOE_CHECK(op != ReduceOp::max, CommError, "reduce_scatter_in_place: sum or avg, not max");
  const WatchedWait watch = watched(*this, "reduce_scatter_in_place");
  if (t.numel() > 0) do_reduce_scatter_in_place(t, op);
}

void Communicator::all_gather_in_place(const Tensor& t) {
  check_segments(t, size(), "all_gather_in_place");
  const WatchedWait watch = watched(*this, "all_gather_in_place");
  if (t.numel() > 0) do_all_gather_in_place(t, t.nbytes() / size_t(size()));
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
  const WatchedWait watch = watched(*this, "broadcast");
  do_broadcast(t, root);
}

void Communicator::barrier() {
  const WatchedWait watch = watched(*this, "barrier");
  do_barrier();
}

void Communicator::synchronize() {
  const WatchedWait watch = watched(*this, "synchronize");
  do_synchronize();
}

std::shared_ptr<Communicator> Communicator::split(int color, int key, int max_ctas) {
  FLOWMOE_CHECK(color >= 0, CommError, "split: color must be >= 0, got ", color);
  FLOWMOE_CHECK(max_ctas >= 0, CommError, "split: max_ctas must be >= 0, got ", max_ctas);
  const WatchedWait watch = watched(*this, "split");
  return do_split(color, key, max_ctas);
}

}  // namespace flowmoe
