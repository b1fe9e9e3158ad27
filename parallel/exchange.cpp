// The exchange plan and the row exchange as an autograd op (see parallel/exchange.h). The bytes move in
// Communicator::all_to_all (host plans) or put_rows (device plans); here are the offsets, the pad rows and the
// gradient's way back.
#include "parallel/exchange.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>

#include "engine/ops/ops.h"
#include "engine/stream_lane.h"
#include "kernels/common/device_api.h"
#include "kernels/ep_layout.h"

namespace flowmoe {

std::vector<int64_t> padded_segment_starts(const std::vector<int64_t>& counts, int align) {
  std::vector<int64_t> starts(counts.size() + 1, 0);
  for (size_t g = 0; g < counts.size(); ++g) starts[g + 1] = starts[g] + (counts[g] + align - 1) / align * align;
  return starts;
}

namespace {

// Pinned host blocks for the routes' asynchronous copies, reused rather than freed (cudaFreeHost may wait
// for the device). A block returns when its plan goes; the next plan takes it right after its counts' host
// read, when the stream, and so the block's earlier copy, has finished. That host read is what makes reuse
// safe here; StepState's upload staging (train/step_state.h), which no host read precedes, is instead
// reused a slot at a time, once the step that filled it has been read back. So the two stay apart.
std::shared_ptr<void> pinned_block(size_t bytes) {
  struct Pool {
    std::mutex mu;
    std::multimap<size_t, void*> free;
  };
  static Pool* pool = new Pool;  // leaked: plans freed after static destructors may return blocks
  std::lock_guard<std::mutex> lock(pool->mu);
  auto it = pool->free.lower_bound(bytes);
  void* block = nullptr;
  size_t size = bytes;
  if (it != pool->free.end()) {
    size = it->first, block = it->second;
    pool->free.erase(it);
  } else {
    block = cuda_host_alloc(bytes);
  }
  return std::shared_ptr<void>(block, [size](void* b) {
    std::lock_guard<std::mutex> lock(pool->mu);
    pool->free.emplace(size, b);
  });
}

// The staging permutes' routes (ExchangePlan::staging_to_padded, padded_to_staging) from the host plan's
// chunks: one i32 layout on `device` (copied asynchronously from pinned memory on a GPU, which the plan
// keeps until the copy has run), each route a view of it.
void add_staging_routes(ExchangePlan& p, const std::vector<int64_t>& staging_starts, Device device) {
  const int n = int(p.staging_block_rows.size()), L = p.num_local_experts;
  std::vector<int32_t> layout;
  const auto append = [&layout](const std::vector<int64_t>& v) {
    const int64_t at = int64_t(layout.size());
    for (int64_t x : v) layout.push_back(int32_t(x));
    return at;
  };
  std::vector<int64_t> to_padded(size_t(p.num_staging_rows), -1), to_staging(size_t(p.num_padded_rows), -1);
  for (size_t s = 0; s < p.padded_chunks.size(); ++s)
    for (int64_t i = 0; i < p.padded_chunks[s].rows; ++i) {
      to_padded[size_t(staging_starts[s] + i)] = p.padded_chunks[s].offset + i;
      to_staging[size_t(p.padded_chunks[s].offset + i)] = staging_starts[s] + i;
    }
  const int64_t at_to_padded = append(to_padded), at_to_staging = append(to_staging);
  const int64_t at_counts = append(p.tokens_per_expert), at_starts = append(p.segment_starts);
  const int64_t at_staging_counts = append(p.recv_counts), at_staging_starts = append(staging_starts);
  Tensor all = Tensor::empty({int64_t(layout.size())}, DType::i32, device);
  if (device.is_cpu()) {
    std::copy(layout.begin(), layout.end(), all.data<int32_t>());
  } else if (!layout.empty()) {
    p.pinned_layout = pinned_block(layout.size() * sizeof(int32_t));
    auto* pinned = static_cast<int32_t*>(p.pinned_layout.get());
    std::copy(layout.begin(), layout.end(), pinned);
    copy_bytes_to_device_async(all.raw_data(), device.index, pinned, layout.size() * sizeof(int32_t));
  }
  const auto part = [&all](int64_t at, int64_t len, Shape shape) { return all.slice(0, at, at + len).view(shape); };
  const auto route = [&](int64_t rows, int64_t out_rows, int segments, int align, int64_t at_map, int64_t at_c,
                         int64_t at_s) {
    PermuteResult r;
    r.row_map = part(at_map, rows, {rows, 1});
    r.tokens_per_expert = part(at_c, segments, {segments});
    r.segment_starts = part(at_s, segments + 1, {segments + 1});
    r.align_size = align;
    r.dims = RoutingDims{rows, 1, segments, 0, segments, align, out_rows};
    return r;
  };
  p.staging_to_padded =
      route(p.num_staging_rows, p.num_padded_rows, L, p.align_size, at_to_padded, at_counts, at_starts);
  p.padded_to_staging = route(p.num_padded_rows, p.num_staging_rows, n * L, p.sorted_align, at_to_staging,
                              at_staging_counts, at_staging_starts);
}

}  // namespace

ExchangePlan make_exchange_plan(std::shared_ptr<Communicator> comm, const std::vector<int64_t>& send_counts,
                                const std::vector<int64_t>& recv_counts, int sorted_align, int64_t num_sorted_rows,
                                int align_size, int row_multiple, Device device) {
  const int n = comm->size();
  FLOWMOE_CHECK(n >= 1 && send_counts.size() % size_t(n) == 0 && recv_counts.size() == send_counts.size(), ShapeError,
                "make_exchange_plan: ", send_counts.size(), " send counts and ", recv_counts.size(),
                " receive counts for ", n, " ranks");
  const std::vector<int64_t> sorted_starts = padded_segment_starts(send_counts, sorted_align);
  ExchangePlan p;
  p.comm = std::move(comm);
  const int L = int(send_counts.size()) / n;
  p.num_local_experts = L;
  p.align_size = align_size;
  p.send_counts = send_counts;
  p.recv_counts = recv_counts;
  p.num_sorted_rows = num_sorted_rows;
  p.tokens_per_expert.assign(size_t(L), 0);
  for (int q = 0; q < n; ++q)
    for (int e = 0; e < L; ++e) p.tokens_per_expert[size_t(e)] += recv_counts[size_t(q * L + e)];
  p.segment_starts = padded_segment_starts(p.tokens_per_expert, align_size);
  for (int e = 0; e < L; ++e)
    p.padded_tokens_per_expert.push_back(p.segment_starts[size_t(e) + 1] - p.segment_starts[size_t(e)]);
  p.num_padded_rows = (p.segment_starts.back() + row_multiple - 1) / row_multiple * row_multiple;
  // From peer q, expert e's copies follow those of peers 0..q-1 in e's segment.
  std::vector<int64_t> next(p.segment_starts.begin(), p.segment_starts.end() - 1);
  for (int q = 0; q < n; ++q)
    for (int e = 0; e < L; ++e) {
      const int64_t rows = recv_counts[size_t(q * L + e)];
      p.padded_chunks.push_back({q, next[size_t(e)], rows});
      next[size_t(e)] += rows;
    }
  // One block per peer: this rank's sorted segments for q's experts are adjacent (q owns a run of global
  // experts), and peer p's block here is p's segments for this rank's experts, in p's sorted layout.
  p.sorted_align = sorted_align;
  const std::vector<int64_t> staging_starts = padded_segment_starts(recv_counts, sorted_align);
  for (int q = 0; q < n; ++q) {
    p.sorted_block_rows.push_back(sorted_starts[size_t((q + 1) * L)] - sorted_starts[size_t(q * L)]);
    p.staging_block_rows.push_back(staging_starts[size_t((q + 1) * L)] - staging_starts[size_t(q * L)]);
  }
  p.num_staging_rows = staging_starts.back();
  add_staging_routes(p, staging_starts, device);
  return p;
}

int64_t zero_sync_padded_rows(int num_ranks, int64_t tokens_per_rank, int top_k, int num_local_experts, int align_size,
                              int row_multiple, double capacity_factor, int64_t min_rows) {
  FLOWMOE_CHECK(num_ranks >= 1 && tokens_per_rank >= 0 && top_k >= 1 && num_local_experts >= 1 && align_size >= 1 &&
                    row_multiple >= 1 && capacity_factor >= 0,
                ShapeError, "zero_sync_padded_rows: ", num_ranks, " ranks, ", tokens_per_rank, " tokens, top-", top_k,
                ", ", num_local_experts, " local experts, align ", align_size, ", row multiple ", row_multiple,
                ", capacity factor ", capacity_factor);
  const int64_t pad = int64_t(num_local_experts) * (align_size - 1);
  int64_t rows = int64_t(num_ranks) * tokens_per_rank * std::min(top_k, num_local_experts) + pad;
  if (capacity_factor > 0)
    rows = std::min(
        rows, std::max(min_rows, int64_t(std::ceil(capacity_factor * double(tokens_per_rank) * double(top_k))) + pad));
  return (rows + row_multiple - 1) / row_multiple * row_multiple;
}

ExchangePlan make_device_exchange_plan(std::shared_ptr<Communicator> comm, const Tensor& send_counts, int sorted_align,
                                       int64_t num_sorted_rows, int align_size, int64_t num_padded_rows,
                                       const Tensor& most_needed) {
  const int n = comm->size();
  FLOWMOE_CHECK(send_counts.dim() == 1 && send_counts.numel() % n == 0 && send_counts.dtype() == DType::i32, ShapeError,
                "make_device_exchange_plan: counts ", send_counts.describe(), " must be [n·L] i32 for ", n, " ranks");
  const int L = int(send_counts.numel() / n);
  const Device dev = send_counts.device();
  // [n, n·L]: row p holds rank p's counts; the all-gather is enqueued, not waited for (nccl).
  const Tensor all_counts = comm->all_gather(send_counts.contiguous().view({1, int64_t(n) * L}));
  FLOWMOE_CHECK(!most_needed.defined() ||
                    (most_needed.dtype() == DType::i32 && most_needed.numel() == 1 && most_needed.device() == dev),
                ShapeError, "make_device_exchange_plan: most_needed ", most_needed.describe(), " must be [1] i32 on ",
                dev.str());
  // The receive buffer's rows are the capacity: a need past them empties the exchange on every rank alike.
  const EpLayoutDims dims{n, L, comm->rank(), sorted_align, align_size, num_padded_rows};
  Tensor layout = Tensor::empty({ep_layout_size(n, L)}, DType::i32, dev);
  int32_t* most = most_needed.defined() ? most_needed.data<int32_t>() : nullptr;
  if (dev.is_cpu())
    ep_layout_cpu(dims, all_counts.data<int32_t>(), layout.data<int32_t>(), most);
  else
    ep_layout_cuda(dims, all_counts.data<int32_t>(), layout.data<int32_t>(), most, current_stream(dev.index));
  ExchangePlan p;
  p.comm = std::move(comm);
  p.num_local_experts = L;
  p.align_size = align_size;
  p.num_sorted_rows = num_sorted_rows;
  p.num_padded_rows = num_padded_rows;
  p.on_device = true;
  const auto part = [&](int64_t offset, int64_t length) { return layout.slice(0, offset, offset + length); };
  p.device_tokens_per_expert = part(0, L);
  p.device_padded_tokens_per_expert = part(ep_layout_padded_offset(n, L), L);
  p.device_segment_starts = part(ep_layout_starts_offset(n, L), L + 1);
  const int64_t table = 3 * int64_t(n) * L;
  p.to_experts_table = part(ep_layout_to_experts_offset(n, L), table).view({n, L, 3});
  p.to_tokens_table = part(ep_layout_to_tokens_offset(n, L), table).view({n, L, 3});
  p.device_overflow = part(ep_layout_overflow_offset(n, L), 1);
  return p;
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> exchange_counts_once(Communicator& comm,
                                                                           const Tensor& send_counts) {
  const int n = comm.size();
  FLOWMOE_CHECK(send_counts.dim() == 1 && send_counts.numel() % n == 0 && send_counts.dtype() == DType::i32, ShapeError,
                "exchange_counts_once: counts ", send_counts.describe(), " must be [n·L] i32 for ", n, " ranks");
  const int64_t L = send_counts.numel() / n;
  // Both directions in one tensor, so one copy to the host reads them: row 0 sent, row 1 received.
  Tensor both = Tensor::empty({2, n, L}, DType::i32, send_counts.device());
  both.slice(0, 0, 1).copy_(send_counts.view({1, n, L}));
  const std::vector<int64_t> ones(size_t(n), 1);
  comm.all_to_all(send_counts.view({n, L}), ones, both.slice(0, 1, 2).view({n, L}), ones);
  const std::vector<int64_t> all = both.to_ints();  // one counted host sync on a GPU
  const auto half = all.begin() + n * L;
  return {std::vector<int64_t>(all.begin(), half), std::vector<int64_t>(half, all.end())};
}

namespace {

// The shape of src's rows on the other side of the plan.
Shape moved_shape(const Tensor& src, const ExchangePlan& p, ExchangeDirection dir) {
  Shape shape = src.shape();
  shape[0] = dir == ExchangeDirection::to_experts ? p.num_padded_rows : p.num_sorted_rows;
  return shape;
}

// Every tensor's rows along a device plan in one put_rows. Toward the experts each segment's pad rows
// take their pad value (the GEMMs read them); nothing reads the worst-case tail, nor the sender's pad
// rows on the way back (unpermute reads the routed rows only).
void put_rows_on_device(const std::vector<Communicator::RowPut>& tensors, const ExchangePlan& p,
                        ExchangeDirection dir) {
  const bool to_experts = dir == ExchangeDirection::to_experts;
  Communicator::PadSegments pad;
  if (to_experts) pad.starts = p.device_segment_starts, pad.covered = p.device_tokens_per_expert;
  pad.overflow = p.device_overflow;  // an emptied exchange: every row of every recv takes its pad value
  p.comm->put_rows(tensors, to_experts ? p.to_experts_table : p.to_tokens_table,
                   to_experts ? p.to_tokens_table : p.to_experts_table, pad);
}

// One tensor's rows (an FP8 one with its scales) along a host plan, one all_to_all block per peer. Toward
// the experts this rank's sorted range for each peer leaves as it lies and lands in the staging buffer,
// whose permute writes the padded layout and its pad rows (zero; FP8 scales 1). Back, the reverse permute
// packs the padded rows into the staging layout, whose blocks land on the sorted side, gaps zero.
Tensor move_blocks(const Tensor& src, const ExchangePlan& p, ExchangeDirection dir) {
  Communicator& comm = *p.comm;
  int64_t sorted_total = 0;
  for (int64_t r : p.sorted_block_rows) sorted_total += r;
  if (dir == ExchangeDirection::to_experts) {
    const Tensor staging = comm.all_to_all(row_slice(src, 0, sorted_total), p.sorted_block_rows, p.staging_block_rows);
    return permute_rows_like(staging, p.staging_to_padded);
  }
  // The staging blocks of t (rows, or their scales) into the first rows of a [num_sorted_rows, ...] buffer.
  const auto land = [&](const Tensor& t) {
    Shape shape = t.shape();
    shape[0] = p.num_sorted_rows;
    Tensor out = Tensor::empty(shape, t.dtype(), t.device());
    comm.all_to_all(t, p.staging_block_rows, out.slice(0, 0, sorted_total), p.sorted_block_rows);
    return out;
  };
  const Tensor packed = permute_rows_like(src, p.padded_to_staging);
  const auto& scales = packed.fp8_scales();
  return scales ? land(packed).with_scales(land(scales->scale_inv), ScalingMode::rowwise_1x128) : land(packed);
}

// Rows (with their FP8 scales) and probs along the plan; on_lane: a device plan's puts go to the comm lane
// (engine/stream_lane.h), keeping what they read and write, the plan's tables included, until it is waited for.
std::vector<Tensor> move(const std::vector<Tensor>& in, const ExchangePlan& p, ExchangeDirection dir, bool on_lane) {
  const Tensor& rows = in[0];
  FLOWMOE_CHECK(
      rows.dim() == 2 && rows.size(0) == (dir == ExchangeDirection::to_experts ? p.num_sorted_rows : p.num_padded_rows),
      ShapeError, "exchange: rows ", rows.describe(), " do not have the plan's ",
      dir == ExchangeDirection::to_experts ? p.num_sorted_rows : p.num_padded_rows, " rows");
  const auto& scales = rows.fp8_scales();
  FLOWMOE_CHECK(!scales || scales->mode == ScalingMode::rowwise_1x128, DTypeError,
                "exchange: FP8 rows must carry rowwise 1x128 scales, got ", scaling_mode_name(scales->mode));
  if (!p.on_device) {  // the rows with their scales, and the probs as rows of one
    const Tensor& probs = in[1];
    Tensor moved_probs;
    if (probs.defined()) {
      moved_probs = move_blocks(probs.contiguous().view({probs.numel(), 1}), p, dir);
      moved_probs = moved_probs.view({moved_probs.size(0)});
    }
    return {move_blocks(rows, p, dir), moved_probs};
  }
  // What moves, with the value of its pad rows: the rows (zero), their scales (1.0), the probs (zero).
  std::vector<Communicator::RowPut> tensors = {{rows.contiguous(), Tensor(), 0.0}};
  if (scales) tensors.push_back({scales->scale_inv.contiguous(), Tensor(), 1.0});
  if (in[1].defined()) tensors.push_back({in[1].contiguous(), Tensor(), 0.0});
  for (auto& t : tensors) t.recv = Tensor::empty(moved_shape(t.send, p, dir), t.send.dtype(), t.send.device());
  const auto put = [&] { put_rows_on_device(tensors, p, dir); };
  if (on_lane) {  // one issue on the lane, keeping what the put reads and writes
    std::vector<Tensor> keep = {p.to_experts_table, p.to_tokens_table, p.device_segment_starts,
                                p.device_tokens_per_expert, p.device_overflow};
    for (const auto& t : tensors) keep.push_back(t.send), keep.push_back(t.recv);
    issue_on_comm_lane(rows.device(), std::move(keep), put);
  } else {
    put();
  }
  Tensor out = tensors[0].recv;
  if (scales) out = out.with_scales(tensors[1].recv, ScalingMode::rowwise_1x128);
  return {out, in[1].defined() ? tensors.back().recv : Tensor()};
}

// Inputs: [rows, probs (or undefined)]. Outputs: the same, moved. Linear, so its vjp is the move back.
class Exchange : public SharedBodyPrimitive<Primitive> {
 public:
  // On the comm lane when one is on (forward and backward) and the plan is a device one whose puts need no
  // host (the CPU's run at once); walked first in backward either way, so the order is the same everywhere.
  Exchange(std::shared_ptr<const ExchangePlan> plan, ExchangeDirection dir)
      : plan_(std::move(plan)),
        dir_(dir),
        backward_first_(comm_lane_on()),
        on_lane_(backward_first_ && plan_->on_device) {}
  const char* name() const override { return "exchange"; }
  bool saves_inputs() const override { return false; }
  bool backward_first() const override { return backward_first_; }

  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    const ExchangeDirection back =
        dir_ == ExchangeDirection::to_experts ? ExchangeDirection::to_tokens : ExchangeDirection::to_experts;
    // Collective: every rank must move its cotangents, so a missing one is an error, not a skip. The
    // rows always feed the experts (or unpermute), so their cotangent exists; probs get zeros if unused.
    FLOWMOE_CHECK(d_out[0].defined(), Error, "exchange backward: the moved rows received no gradient");
    Tensor d_probs =
        has_probs_ ? (d_out[1].defined() ? d_out[1] : Tensor::zeros(probs_shape_, probs_dtype_, device_)) : Tensor();
    std::vector<Tensor> g = move({d_out[0], d_probs}, *plan_, back, lane());
    return {needs[0] ? g[0] : Tensor(), has_probs_ && needs[1] ? g[1] : Tensor()};
  }

 protected:
  std::vector<Tensor> run(const std::vector<Tensor>& in, bool) override {
    has_probs_ = in[1].defined();
    device_ = in[0].device();
    std::vector<Tensor> out = move(in, *plan_, dir_, lane());
    if (has_probs_) probs_shape_ = out[1].shape(), probs_dtype_ = out[1].dtype();
    return out;
  }

 private:
  // A GPU's puts go to the lane where they need no host (device puts); the CPU's count their tickets.
  bool lane() const { return on_lane_ && (device_.is_cpu() || plan_->comm->device_puts()); }

  std::shared_ptr<const ExchangePlan> plan_;
  ExchangeDirection dir_;
  bool backward_first_, on_lane_;
  bool has_probs_ = false;
  Shape probs_shape_;
  DType probs_dtype_ = DType::f32;
  Device device_;
};

}  // namespace

std::vector<Variable> exchange(const Variable& rows, const Variable& probs, std::shared_ptr<const ExchangePlan> plan,
                               ExchangeDirection direction) {
  FLOWMOE_CHECK(plan != nullptr && plan->comm != nullptr, Error, "exchange: no plan");
  std::vector<Variable> out = apply(std::make_shared<Exchange>(std::move(plan), direction), {rows, probs});
  if (!probs.defined()) out[1] = Variable();
  return out;
}

}  // namespace flowmoe
