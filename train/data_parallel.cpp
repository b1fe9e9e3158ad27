// The reductions of data-parallel training (see data_parallel.h).
#include "train/data_parallel.h"

#include <cmath>

#include "engine/ops/ops.h"
#include "kernels/common/error.h"
#include "train/grad_reducer.h"

namespace flowmoe {

namespace {

// Reduces tensors[first, last) through one flat buffer (or in place, for a lone contiguous tensor).
void reduce_bucket(Communicator& comm, const std::vector<Tensor>& tensors, size_t first, size_t last, ReduceOp op,
                   double scale) {
  const Tensor& head = tensors[first];
  const bool scaled = op == ReduceOp::sum && scale != 1.0;
  if (last == first + 1 && head.is_contiguous() && !scaled) {
    comm.all_reduce(head, op);
    return;
  }
  int64_t numel = 0;
  for (size_t i = first; i < last; ++i) numel += tensors[i].numel();
  Tensor flat = Tensor::empty({numel}, head.dtype(), head.device());
  int64_t offset = 0;
  for (size_t i = first; i < last; ++i) {
    const Tensor& t = tensors[i];
    flat.slice(0, offset, offset + t.numel()).view(t.shape()).copy_(t);
    offset += t.numel();
  }
  comm.all_reduce(flat, op);
  if (scaled) flat = tensor_scale(flat, scale);
  offset = 0;
  for (size_t i = first; i < last; ++i) {
    Tensor t = tensors[i];
    t.copy_(flat.slice(0, offset, offset + t.numel()).view(t.shape()));
    offset += t.numel();
  }
}

}  // namespace

void all_reduce_flat(Communicator& comm, const std::vector<Tensor>& tensors, ReduceOp op, double scale,
                     size_t bucket_bytes) {
  if (tensors.empty()) return;
  const DType dtype = tensors[0].dtype();
  const Device device = tensors[0].device();
  for (const Tensor& t : tensors)
    FLOWMOE_CHECK(t.dtype() == dtype && t.device() == device, DTypeError, "all_reduce_flat: ", t.describe(),
                  " beside ", tensors[0].describe(), ": one bucket holds one dtype on one device");
  const size_t elem = dtype_size(dtype);
  size_t first = 0;
  while (first < tensors.size()) {
    size_t last = first + 1, bytes = size_t(tensors[first].numel()) * elem;
    while (last < tensors.size() && bytes + size_t(tensors[last].numel()) * elem <= bucket_bytes)
      bytes += size_t(tensors[last++].numel()) * elem;
    reduce_bucket(comm, tensors, first, last, op, scale);
    first = last;
  }
}

void all_reduce_gradients(Communicator& comm, const std::vector<Variable>& params, size_t bucket_bytes,
                          int64_t divisor) {
  if (params.empty()) return;
  const double scale = 1.0 / double(divisor > 0 ? divisor : comm.size());
  if (comm.size() == 1) {  // nothing to sum; an expert shard held by one rank still takes the world's mean
    if (scale == 1.0) return;
    for (const Variable& p : params) {
      if (!p.grad().defined()) continue;
      Tensor g = p.grad();
      g.copy_(tensor_scale(g, scale));
    }
    return;
  }
  std::vector<Tensor> grads;
  std::vector<float> present;
  grads.reserve(params.size() + 1);
  for (const Variable& p : params) {
    const bool has = p.grad().defined();
    present.push_back(has ? 1.0f : 0.0f);
    grads.push_back(has ? p.grad() : Tensor::zeros(p.shape(), DType::f32, p.device()));
  }
  // Which parameters have a gradient anywhere travels in the last bucket: after the sum it is > 0.
  Tensor any = Tensor::from_floats(present, {int64_t(present.size())}, DType::f32).to(params[0].device());
  grads.push_back(any);
  all_reduce_flat(comm, grads, ReduceOp::sum, scale, bucket_bytes);
  const std::vector<float> anywhere = any.to_floats();
  for (size_t i = 0; i < params.size(); ++i) {
    Variable p = params[i];
    if (!p.grad().defined() && anywhere[i] > 0) p.set_grad(grads[i]);
  }
}

void all_reduce_gradients(const ParallelState& ps, const std::vector<Variable>& params,
                          const std::vector<ParamShard>& shards, size_t bucket_bytes) {
  GradientReducer reducer(ps, params, shards, /*overlap=*/false, bucket_bytes);
  reducer.begin();
  reducer.finish();
}

double global_grad_norm(const ParallelState& ps, AdamW& opt, const std::vector<ParamShard>& shards) {
  if (ps.expert_parallel_size == 1) return opt.grad_norm();
  std::vector<bool> expert;
  for (const ParamShard& s : shards) expert.push_back(s.expert);
  const auto [dense, local_experts] = opt.grad_square_sums(expert);
  const double experts = all_reduce_values(*ps.expert_parallel, {local_experts}, ReduceOp::sum)[0];
  return std::sqrt(dense + experts);
}

std::vector<double> all_reduce_values(Communicator& comm, const std::vector<double>& values, ReduceOp op) {
  if (comm.size() == 1 || values.empty()) return values;
  // Through the host side (nccl's mpi bootstrap): a device copy would wait for the GPU's whole queue.
  Communicator& host = comm.host_communicator();
  Tensor t = Tensor::from_doubles(values, {int64_t(values.size())}, DType::f64, host.native_device());
  host.all_reduce(t, op);
  host.synchronize();
  return t.to_doubles();
}

}  // namespace flowmoe
