// The bucketed, overlapped gradient reduction (see grad_reducer.h).
#include "parallel/grad_reducer.h"

#include <algorithm>
#include <string>
#include <utility>

#include "engine/ops/ops.h"
#include "engine/profiler.h"
#include "engine/stream_lane.h"
#include "kernels/common/device_api.h"
#include "kernels/common/error.h"
#include "kernels/fp8.h"

namespace flowmoe {

namespace {
GradientReducer::StreamHook g_stream_hook = nullptr;
}  // namespace

void GradientReducer::set_stream_hook(StreamHook hook) { g_stream_hook = hook; }

void GradientReducer::call_hook(HookPoint point, const Tensor& buffer) const {
  if (!g_stream_hook || !buffer.device().is_cuda()) return;
  const bool reduction_stream = point != HookPoint::bucket_copy && stream_;
  g_stream_hook(point, reduction_stream ? stream_->get() : current_stream(buffer.device().index), buffer);
}

GradientReducer::GradientReducer(const ParallelState& ps, std::vector<Variable> params,
                                 const std::vector<ParamShard>& shards, bool overlap, size_t bucket_bytes, int max_ctas,
                                 bool shard, DType weight_dtype)
    : ps_(ps), params_(std::move(params)), overlap_(overlap), shard_(shard) {
  FLOWMOE_CHECK(shards.size() == params_.size(), Error, "GradientReducer: ", params_.size(), " parameters but ",
                shards.size(), " shards");
  scale_ = 1.0 / double(ps.world->size());
  comms_[0] = group_communicator(0);
  comms_[1] = group_communicator(1);
  // Buckets in the order the backward finishes the gradients: the model lists its parameters in forward
  // order, so the last ones are final first. Each group fills its own buckets in that order; a bucket
  // closes when the next parameter would not fit, and the buckets are launched in the order their last
  // parameter becomes final. Sharded, a bucket's weights have one dtype: each group fills one bucket per dtype.
  const size_t max_numel = bucket_bytes / sizeof(float);
  std::vector<Bucket> closed;
  Bucket open[2][2];  // [group][f32 weights, weight_dtype weights]
  for (size_t k = 0; k < params_.size(); ++k) {
    const size_t i = params_.size() - 1 - k;
    const int g = shards[i].expert && ps.expert_parallel_size > 1 ? 1 : 0;
    index_of_[params_[i].impl()] = i;
    if (shard_ && gathers_fp8(params_[i], shards[i])) {  // a bucket of its own, in whole block rows
      Bucket own;
      own.group = g;
      own.params = {i};
      own.numel = params_[i].data().numel();
      own.fp8 = shards[i].fp8;
      closed.push_back(std::move(own));
      continue;
    }
    const bool narrow = shard_ && weight_dtype != DType::f32 && !shards[i].reads_f32;
    Bucket& b = open[g][narrow];
    const int64_t n = params_[i].data().numel();
    if (!b.params.empty() && size_t(b.numel + n) > max_numel) closed.push_back(std::exchange(b, {}));
    b.group = g;
    b.dtype = narrow ? weight_dtype : DType::f32;
    b.params.push_back(i);
    b.numel += n;
  }
  for (Bucket(&by_dtype)[2] : open)
    for (Bucket& b : by_dtype)
      if (!b.params.empty()) closed.push_back(std::move(b));
  // A bucket's last parameter is its smallest index: the larger the index, the earlier it is final.
  std::sort(closed.begin(), closed.end(),
            [](const Bucket& a, const Bucket& b) { return a.params.back() > b.params.back(); });
  buckets_ = std::move(closed);
  bucket_of_.assign(params_.size(), 0);
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (size_t i : buckets_[b].params) bucket_of_[i] = b;
  final_.assign(params_.size(), false);
  missing_.assign(params_.size(), false);
  if (shard_) shard_buckets();

  // nccl: the reductions get communicators of their own on a stream of their own, so that they run
  // beside the backward (a communicator serves one stream: the world's stays with the compute stream).
  // Their kernels take at most max_ctas thread blocks, and NCCL picks its algorithm by the blocks it may
  // take: the plain schedule, on the compute stream, reduces on communicators split with the same bound,
  // so that both schedules give the same sums bit for bit at any number of ranks.
  const bool nccl = ps.world->backend_name() == std::string("nccl");
  if (nccl && (overlap_ || max_ctas > 0)) {
    comms_[0] = ps.world->split(0, ps.world->rank(), max_ctas);
    comms_[1] = ps.expert_parallel_size > 1
                    ? ps.expert_data_parallel->split(0, ps.expert_data_parallel->rank(), max_ctas)
                    : comms_[0];
  }
  if (nccl && overlap_) {
    const int device = ps.world->native_device().index;
    stream_ = std::make_unique<Stream>(device, /*high_priority=*/true);  // as the compute stream's
    grads_ready_ = std::make_unique<Event>();
    reduced_ = std::make_unique<Event>();
    if (shard_)
      for (Bucket& b : buckets_) b.gathered = std::make_unique<Event>(), b.reduced = std::make_unique<Event>();
    for (const std::shared_ptr<Communicator>& comm : comms_) comm->set_stream(stream_->get());
  }
}

GradientReducer::~GradientReducer() = default;

std::pair<int64_t, int64_t> GradientReducer::segment(const Bucket& b) const {
  const Communicator& comm = *group_communicator(b.group);
  const int64_t n = b.padded / comm.size();
  return {comm.rank() * n, (comm.rank() + 1) * n};
}

// Each bucket's parameters move into one flat buffer in the bucket's layout (padded to whole segments) and
// dtype, so that the all-gather writes them in place; their f32 values in this rank's segment become its
// master; AdamW's ranges are their elements in that segment.
void GradientReducer::shard_buckets() {
  ranges_.assign(params_.size(), {0, 0});
  master_ranges_.assign(params_.size(), Tensor());
  for (size_t k = buckets_.size(); k-- > 0;) gather_order_.push_back(k);  // the forward's order, until set_stages
  for (Bucket& b : buckets_) {
    const Device device = params_[b.params.front()].device();
    const int64_t size = group_communicator(b.group)->size();
    // Segments of whole block rows (a row of 128 K elements) for an FP8 copy's bucket, whole elements otherwise.
    const int64_t unit = b.fp8 ? kFp8BlockSize * params_[b.params.front()].size(-1) * size : size;
    b.padded = (b.numel + unit - 1) / unit * unit;
    b.weights = Tensor::empty({b.padded}, b.dtype, device);
    b.master = Tensor::empty({b.padded / size}, DType::f32, device);
    set_values(b, packed_values(b, [&](size_t i) { return params_[i].data(); }));
    const auto [begin, end] = segment(b);
    int64_t offset = 0;
    for (size_t i : b.params) {
      Variable p = params_[i];
      const int64_t n = p.data().numel();
      ranges_[i] = {std::clamp(begin - offset, int64_t(0), n), std::clamp(end - offset, int64_t(0), n)};
      Tensor slot = b.weights.slice(0, offset, offset + n).view(p.shape());
      if (b.dtype == p.dtype())
        p.set_data(slot);
      else
        p.store_as(slot);  // the f32 data it had is freed with the last reference to it
      offset += n;
    }
    view_ranges(b, b.master, master_ranges_);
    if (b.fp8) shard_fp8_copy(b);
  }
}

template <class Value>
Tensor GradientReducer::packed_values(const Bucket& b, Value&& value) const {
  Tensor values = Tensor::zeros({b.padded}, DType::f32, params_[b.params.front()].device());
  int64_t offset = 0;
  for (size_t i : b.params) {
    const int64_t n = params_[i].data().numel();
    values.slice(0, offset, offset + n).view(params_[i].shape()).copy_(value(i));
    offset += n;
  }
  return values;
}

void GradientReducer::set_values(Bucket& b, const Tensor& values) {
  const auto [begin, end] = segment(b);
  b.master.copy_(values.slice(0, begin, end));
  b.weights.copy_(values.to(b.dtype));
}

const std::shared_ptr<Communicator>& GradientReducer::group_communicator(int group) const {
  return group == 1 && ps_.expert_parallel_size > 1 ? ps_.expert_data_parallel : ps_.world;
}

void GradientReducer::view_grads(const Bucket& b) {
  int64_t offset = 0;
  for (size_t i : b.params) {
    Variable p = params_[i];
    const int64_t n = p.data().numel();
    p.set_grad(b.flat.slice(0, offset, offset + n).view(p.shape()));
    offset += n;
  }
}

void GradientReducer::view_ranges(const Bucket& b, const Tensor& mine, std::vector<Tensor>& out) const {
  const int64_t begin = segment(b).first;
  int64_t offset = 0;
  for (size_t i : b.params) {
    const auto [first, last] = ranges_[i];
    if (last > first) out[i] = mine.slice(0, offset + first - begin, offset + last - begin);
    offset += params_[i].data().numel();
  }
}

void GradientReducer::begin() {
  // Every gather is awaited before the backward reads the weights (the forward's stage hooks have
  // waited already wherever the model calls them).
  wait_weights();
  final_.assign(params_.size(), false);
  missing_.assign(params_.size(), false);
  for (Bucket& b : buckets_) {
    b.pending = int(b.params.size());
    b.flat = Tensor();
  }
  in_flight_.clear();
  range_grads_.clear();
  next_ = 0;
  launched_in_backward_ = 0;
  reduced_in_place_ = 0;
  armed_ = true;
  // A backward that threw left the last guard armed: it goes first, so the new one is the hook in force.
  hook_.reset();
  if (overlap_) hook_ = std::make_unique<LeafGradHookGuard>([this](VariableImpl& leaf) { on_leaf(leaf); });
}

void GradientReducer::on_leaf(VariableImpl& leaf) {
  const auto it = index_of_.find(&leaf);
  if (it == index_of_.end()) return;  // a recompute's own inputs, say
  const size_t i = it->second;
  // A leaf is final once per backward; a second report means its bucket may already be reduced.
  FLOWMOE_CHECK(!final_[i], Error, "gradient reduction: '", leaf.name, "' received a gradient after it was final ",
                "(a parameter used both inside and outside a recomputed block?)");
  final_[i] = true;
  --buckets_[bucket_of_[i]].pending;
  while (next_ < buckets_.size() && buckets_[next_].pending == 0) {
    launch(buckets_[next_++]);
    ++launched_in_backward_;
  }
}

// The bucket's gradients into one flat buffer (zeros for a parameter without one here), or a lone gradient
// as it is, reduced in place; the parameters' own tensors are freed at once: their gradients become views
// of it, or, sharded, live on in the bucket's segment (retire).
void GradientReducer::launch(Bucket& b) {
  const Device device = params_[b.params.front()].device();
  // Inside the backward, some of these gradients may come from a side branch (the shared experts,
  // engine/stream_lane.h): the stream that copies them waits for the other one first.
  wait_for_other_stream(device);
  // At most kBucketsInFlight full buffers: the oldest one's reduction is waited for and its memory reused.
  while (shard_ && in_flight_.size() >= kBucketsInFlight) {
    retire(buckets_[in_flight_.front()]);
    in_flight_.erase(in_flight_.begin());
  }
  const int64_t flat_numel = shard_ ? b.padded : b.numel;
  const Tensor& only = params_[b.params.front()].grad();
  if (b.params.size() == 1 && only.defined() && only.dtype() == DType::f32 && only.numel() == flat_numel &&
      only.is_contiguous() && only.is_sole_owner()) {
    // One parameter's gradient that nothing else refers to (a large weight's own bucket: autograd keeps a
    // fresh wgrad as it is) is reduced where it lies: the same sums, without reading and writing every
    // byte of it once more (an expert weight's gradient is most of a step's gradient bytes).
    b.flat = only.view({flat_numel});
    ++reduced_in_place_;
  } else {
    b.flat = Tensor::empty({flat_numel}, DType::f32, device);
    call_hook(HookPoint::bucket_copy, b.flat);
    if (shard_ && b.padded > b.numel) b.flat.slice(0, b.numel, b.padded).zero_();
    int64_t offset = 0;
    for (size_t i : b.params) {
      const Variable& p = params_[i];
      const int64_t n = p.data().numel();
      Tensor slot = b.flat.slice(0, offset, offset + n);
      if (p.grad().defined()) {
        slot.view(p.shape()).copy_(p.grad());
      } else {
        slot.zero_();
        missing_[i] = true;
      }
      offset += n;
    }
  }
  if (shard_) {
    for (size_t i : b.params) params_[i].zero_grad();
  } else {
    view_grads(b);
  }
  Communicator& comm = *comms_[b.group];
  if (stream_) {  // the copies above are on the compute stream: the reduction stream waits for them
    grads_ready_->record(current_stream(device.index));
    grads_ready_->wait(stream_->get());
  }
  // Dense gradients: the mean over the world (data_parallel.h says why). Expert shards: the sum over
  // their W / E replicas, divided by W in finish().
  const ReduceOp op = b.group == 0 ? ReduceOp::avg : ReduceOp::sum;
  call_hook(HookPoint::reduction, b.flat);
  if (shard_)
    comm.reduce_scatter_in_place(b.flat, op);
  else
    comm.all_reduce(b.flat, op);
  if (stream_) reduced_->record(stream_->get());
  if (!shard_) return;
  if (stream_) b.reduced->record(stream_->get());
  in_flight_.push_back(size_t(&b - buckets_.data()));
}

void GradientReducer::retire(Bucket& b) {
  if (stream_) b.reduced->wait(current_stream(b.weights.device().index));
  const auto [begin, end] = segment(b);
  b.grad_segment = b.flat.slice(0, begin, end).clone();
  b.flat = Tensor();
}

void GradientReducer::release_grads() {
  for (Bucket& b : buckets_) b.grad_segment = Tensor();
  range_grads_.clear();
}

// Which parameters have a gradient on any rank of the group. The flags are host values: they travel
// through the group's host side (all_reduce_values), with no device copy, so a rank that lacks a
// gradient does nothing a captured step (train.cuda_graph) could not hold, and every rank of the
// group makes the same call whatever it lacks.
void GradientReducer::exchange_presence(int group) {
  std::vector<size_t> members;
  std::vector<double> present;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (buckets_[bucket_of_[i]].group != group) continue;
    members.push_back(i);
    present.push_back(missing_[i] ? 0.0 : 1.0);
  }
  if (members.empty()) return;
  const std::vector<double> anywhere = all_reduce_values(*group_communicator(group), present, ReduceOp::max);
  for (size_t k = 0; k < members.size(); ++k) {
    if (anywhere[k] != 0) continue;
    params_[members[k]].zero_grad();  // no rank had one: AdamW leaves it alone
    if (shard_) range_grads_[members[k]] = Tensor();
  }
}

void GradientReducer::finish() {
  FLOWMOE_CHECK(armed_, Error, "GradientReducer::finish without begin");
  hook_.reset();
  armed_ = false;
  while (next_ < buckets_.size()) launch(buckets_[next_++]);
  if (stream_) reduced_->wait(current_stream(params_[0].device().index));
  for (size_t k : in_flight_) retire(buckets_[k]);
  in_flight_.clear();
  if (shard_) range_grads_.assign(params_.size(), Tensor());
  for (Bucket& b : buckets_) {
    if (b.group == 1 && shard_) {  // only this rank's segment holds a sum to scale
      b.grad_segment = tensor_scale(b.grad_segment, scale_);
    } else if (b.group == 1) {  // scaled once summed; the views move onto the scaled buffer
      b.flat = tensor_scale(b.flat, scale_);
      view_grads(b);
    }
    b.flat = Tensor();  // the gradients, views of it, keep it
    if (shard_) view_ranges(b, b.grad_segment, range_grads_);
  }
  for (int g : {0, 1})
    if (g == 0 || ps_.expert_parallel_size > 1) exchange_presence(g);
}

// Every bucket's weights from the segments their ranks updated, in the order the forward reads them
// (the reverse of the backward's). With nccl they move on the reduction stream, after AdamW's kernels,
// and the compute stream waits for them before it reads a weight again.
void GradientReducer::gather_weights() {
  FLOWMOE_CHECK(shard_, Error, "GradientReducer::gather_weights: the optimizer is not sharded");
  if (stream_) {  // after AdamW's kernels on the compute stream
    grads_ready_->record(current_stream(params_[0].device().index));
    grads_ready_->wait(stream_->get());
  }
  for (size_t k : gather_order_) {
    Bucket& b = buckets_[k];
    call_hook(HookPoint::gather, b.fp8 ? b.fp8_q : b.weights);
    if (b.fp8)
      gather_fp8(b);
    else
      comms_[b.group]->all_gather_in_place(b.weights);
    if (!stream_) continue;
    b.gathered->record(stream_->get());
    b.awaited = false;
  }
  // A captured step (train.cuda_graph) joins the reducer's stream before it ends: the next replay's
  // forward cannot wait on events of this one.
  if (stream_ && cuda_is_capturing(params_[0].device().index)) wait_weights();
  for (const Variable& p : params_) p.bump_version();  // FP8 weight caches re-quantize, but for the gathered ones
  mark_fp8_current();
}

void GradientReducer::set_stages(const std::vector<int64_t>& stages) {
  FLOWMOE_CHECK(stages.size() == params_.size(), Error, "GradientReducer::set_stages: ", stages.size(), " stages for ",
                params_.size(), " parameters");
  for (Bucket& b : buckets_) {
    b.stage = INT64_MAX;
    for (size_t i : b.params) b.stage = std::min(b.stage, stages[i]);
  }
  // Stage order; among buckets of one stage, the later bucket holds the earlier parameters (the order
  // shard_buckets left them in).
  std::stable_sort(gather_order_.begin(), gather_order_.end(),
                   [&](size_t a, size_t b) { return buckets_[a].stage < buckets_[b].stage; });
}

void GradientReducer::wait_stage(int64_t stage) {
  const auto due = [&](const Bucket& b) { return !b.awaited && b.stage <= stage; };
  if (std::none_of(buckets_.begin(), buckets_.end(), due)) return;
  // What the compute stream stalls here is the gather the forward could not hide (the profile's
  // "weight gather" in the optimizer's scope).
  OpTimer timer("weight gather", OpPhase::step, "optimizer", params_[0].device(), 0, 0);
  for (Bucket& b : buckets_) {
    if (!due(b)) continue;
    b.gathered->wait(current_stream(params_[0].device().index));
    b.awaited = true;
  }
}

template <class Fill>
std::vector<Tensor> GradientReducer::gather_segments(Fill&& fill, DType dtype, bool keep) {
  FLOWMOE_CHECK(shard_, Error, "GradientReducer: gathering whole state of an optimizer that is not sharded");
  std::vector<Tensor> whole(params_.size());
  for (const Bucket& b : buckets_) {
    const auto [begin, end] = segment(b);
    Tensor flat = Tensor::zeros({b.padded}, dtype, params_[b.params.front()].device());
    Tensor mine = flat.slice(0, begin, end);
    fill(b, mine);
    group_communicator(b.group)->all_gather_in_place(flat);
    if (!keep) continue;
    const Tensor host = flat.to(Device::cpu());
    int64_t offset = 0;
    for (size_t i : b.params) {
      const int64_t n = params_[i].data().numel();
      whole[i] = host.slice(0, offset, offset + n).contiguous().view(params_[i].shape());
      offset += n;
    }
  }
  return whole;
}

std::vector<Tensor> GradientReducer::full_ranges(const std::vector<Tensor>& ranges, DType dtype, bool keep) {
  FLOWMOE_CHECK(ranges.size() == params_.size(), Error, "GradientReducer::full_ranges: ", ranges.size(),
                " tensors for ", params_.size(), " parameters");
  // This rank's segment of a bucket is its parameters' ranges side by side, then the padding.
  return gather_segments(
      [&](const Bucket& b, Tensor& segment) {
        int64_t at = 0;
        for (size_t i : b.params) {
          const int64_t n = ranges_[i].second - ranges_[i].first;
          if (n > 0) segment.slice(0, at, at + n).copy_(ranges[i]);
          at += n;
        }
        FLOWMOE_CHECK(at <= segment.numel(), Error, "full_ranges: a segment of ", segment.numel(), " elements holds ",
                      at);
      },
      dtype, keep);
}

std::vector<Tensor> GradientReducer::full_masters(bool keep) {
  return gather_segments([](const Bucket& b, Tensor& segment) { segment.copy_(b.master); }, DType::f32, keep);
}

void GradientReducer::load_masters(const std::vector<Tensor>& whole) {
  FLOWMOE_CHECK(shard_ && whole.size() == params_.size(), Error, "GradientReducer::load_masters: ", whole.size(),
                " tensors for ", params_.size(), " parameters", shard_ ? "" : " of an optimizer that is not sharded");
  for (Bucket& b : buckets_)
    set_values(b, packed_values(b, [&](size_t i) {
                 FLOWMOE_CHECK(whole[i].shape() == params_[i].shape() && whole[i].dtype() == DType::f32, ShapeError,
                               "GradientReducer::load_masters: '", params_[i].name(), "' is ", whole[i].describe(),
                               ", expected f32 ", shape_str(params_[i].shape()));
                 return whole[i];
               }));
  for (const Variable& p : params_) p.bump_version();  // FP8 weight caches re-quantize
}

}  // namespace flowmoe
