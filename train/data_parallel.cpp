// The reductions of data-parallel training (see data_parallel.h).
#include "train/data_parallel.h"

#include <cmath>

#include "engine/ops/ops.h"
#include "kernels/common/error.h"
#include "train/grad_reducer.h"

namespace flowmoe {

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


}  // namespace flowmoe
