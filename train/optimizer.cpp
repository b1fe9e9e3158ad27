// AdamW over a parameter list, LR schedule and clipping (see optimizer.h).
#include "train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/adamw.h"
#include "parallel/data_parallel.h"

namespace flowmoe {

StepSchedule step_schedule(const OptimizerConfig& o, int64_t total_steps) {
  StepSchedule p;
  p.lr = o.lr;
  p.min_lr = o.min_lr;
  p.warmup_steps = o.warmup_steps;
  p.total_steps = total_steps;
  p.beta1 = o.beta1;
  p.beta2 = o.beta2;
  p.grad_clip = o.grad_clip;
  return p;
}

double learning_rate(const OptimizerConfig& o, int64_t step, int64_t total_steps) {
  return scheduled_lr(step_schedule(o, total_steps), step);
}

double clip_scale(double norm, double max_norm) { return clip_factor(norm, max_norm); }

// The MoE router's gate (layers/moe.cpp names it <layer>.mlp.gate.weight); the dense MLP's
// projections are gate_proj/up_proj/down_proj and do not match.
static bool is_router_weight(const std::string& name) { return name.ends_with(".mlp.gate.weight"); }

AdamW::AdamW(std::vector<Variable> params, const OptimizerConfig& cfg,
             const std::vector<std::pair<int64_t, int64_t>>& ranges, std::vector<Tensor> masters)
    : params_(std::move(params)), masters_(std::move(masters)), sharded_(!ranges.empty()), cfg_(cfg) {
  FLOWMOE_CHECK(!params_.empty(), Error, "AdamW: no parameters");
  FLOWMOE_CHECK(ranges.empty() || ranges.size() == params_.size(), Error, "AdamW: ", ranges.size(), " ranges for ",
                params_.size(), " parameters");
  FLOWMOE_CHECK(masters_.empty() || masters_.size() == params_.size(), Error, "AdamW: ", masters_.size(),
                " master weights for ", params_.size(), " parameters");
  FLOWMOE_CHECK(cfg_.moment_dtype == DType::f32 || cfg_.moment_dtype == DType::bf16, DTypeError, "AdamW: moments in ",
                dtype_name(cfg_.moment_dtype), " (f32 or bf16)");
  Device dev = params_[0].device();
  for (const Variable& p : params_) {
    FLOWMOE_CHECK(p.is_leaf() && p.requires_grad(), Error, "AdamW: parameter '", p.name(),
                  "' must be a leaf that requires grad");
    FLOWMOE_CHECK(p.device() == dev, DeviceError, "AdamW: parameter '", p.name(), "' is on ", p.device().str(),
                  ", the first on ", dev.str());
    FLOWMOE_CHECK(p.data().is_contiguous(), Error, "AdamW: parameter '", p.name(), "' is not contiguous");
    const size_t i = ranges_.size();
    const int64_t numel = p.data().numel();
    ranges_.push_back(sharded_ ? ranges[i] : std::pair<int64_t, int64_t>{0, numel});
    const auto [begin, end] = ranges_.back();
    FLOWMOE_CHECK(0 <= begin && begin <= end && end <= numel, Error, "AdamW: range [", begin, ", ", end, ") of '",
                  p.name(), "', which has ", numel, " elements");
    // A bf16 parameter is a copy: AdamW writes it from its master, or leaves it to another rank (empty range).
    const bool has_master = !masters_.empty() && masters_[i].defined();
    FLOWMOE_CHECK(p.dtype() == DType::f32 || (p.dtype() == DType::bf16 && (has_master || begin == end)), DTypeError,
                  "AdamW: parameter '", p.name(), "' is ", p.data().describe(),
                  has_master ? "; copies of f32 masters are f32 or bf16" : "; master weights must be f32");
    if (has_master) {
      const Tensor& w = masters_[i];
      FLOWMOE_CHECK(
          w.dtype() == DType::f32 && w.shape() == Shape{end - begin} && w.device() == dev && w.is_contiguous(), Error,
          "AdamW: the master of '", p.name(), "' is ", w.describe(), ", expected f32 [", end - begin, "] on ",
          dev.str());
    }
    // Whole moments take the parameter's shape; a range's are flat.
    const Shape moment_shape = sharded_ ? Shape{end - begin} : p.shape();
    exp_avg_.push_back(Tensor::zeros(moment_shape, cfg_.moment_dtype, dev));
    exp_avg_sq_.push_back(Tensor::zeros(moment_shape, cfg_.moment_dtype, dev));
    decay_.push_back(p.data().dim() >= 2);
    router_.push_back(is_router_weight(p.name()));
  }
  if (dev.is_cuda()) {
    norm_slots_ = Tensor::zeros({2 * int64_t(params_.size())}, DType::f32, dev);
    norm_total_ = Tensor::zeros({2}, DType::f32, dev);
    partials_ = Tensor::zeros({int64_t(kTensorsPerLaunch) * kReduceMaxBlocks}, DType::f32, dev);
  }
}

Tensor AdamW::range_grad(size_t i) const {
  const Variable& p = params_[i];
  const Tensor g = sharded_ ? (i < range_grads_.size() ? range_grads_[i] : Tensor()) : p.grad();
  if (!g.defined()) return g;  // unused this step: left as is (as torch does)
  const auto [begin, end] = ranges_[i];
  const Shape shape = sharded_ ? Shape{end - begin} : p.shape();
  FLOWMOE_CHECK(g.dtype() == DType::f32, DTypeError, "AdamW: gradient of '", p.name(), "' is ", g.describe(),
                ", expected f32");
  FLOWMOE_CHECK(g.shape() == shape && g.device() == p.device(), Error, "AdamW: gradient of '", p.name(), "' is ",
                g.describe(), ", expected ", shape_str(shape), " on ", p.device().str());
  return g.contiguous();
}

void AdamW::set_range_grads(std::vector<Tensor> grads) {
  FLOWMOE_CHECK(sharded_ && grads.size() == params_.size(), Error, "AdamW::set_range_grads: ", grads.size(),
                " gradients for ", params_.size(), " parameters", sharded_ ? "" : " of an optimizer without ranges");
  range_grads_ = std::move(grads);
}

double AdamW::grad_norm() {
  const auto [sum, none] = grad_square_sums({});
  return std::sqrt(sum + none);  // none is 0: the norm of every gradient
}

std::pair<double, double> AdamW::grad_square_sums(const std::vector<bool>& flagged) {
  FLOWMOE_CHECK(flagged.empty() || flagged.size() == params_.size(), Error, "AdamW: ", flagged.size(), " flags for ",
                params_.size(), " parameters");
  const auto second = [&](size_t i) { return !flagged.empty() && flagged[i]; };
  Device dev = params_[0].device();
  if (dev.is_cpu()) {
    double total[2] = {0, 0};
    for (size_t i = 0; i < params_.size(); ++i)
      if (const Tensor g = range_grad(i); g.defined()) total[second(i)] += sum_squares_cpu(g.data<float>(), g.numel());
    return {total[0], total[1]};
  }
  grad_square_sums_device(flagged);
  const std::vector<float> host = norm_total_.to_floats();  // the one host synchronisation
  return {double(host[0]), double(host[1])};
}

Tensor AdamW::grad_square_sums_device(const std::vector<bool>& flagged) {
  FLOWMOE_CHECK(flagged.empty() || flagged.size() == params_.size(), Error, "AdamW: ", flagged.size(), " flags for ",
                params_.size(), " parameters");
  FLOWMOE_CHECK(norm_total_.defined(), DeviceError, "AdamW: grad_square_sums_device needs CUDA parameters");
  const auto second = [&](size_t i) { return !flagged.empty() && flagged[i]; };
  cudaStream_t stream = current_stream(params_[0].device().index);
  const int64_t n = int64_t(params_.size());
  norm_slots_.zero_();
  float* slots = norm_slots_.data<float>();
  float* totals = norm_total_.data<float>();
  // Each gradient's sum of squares into its class's slot, then each class's slots added up: one kernel pair
  // per kTensorsPerLaunch gradients, the same bits as one reduction per gradient.
  std::vector<Tensor> grads;  // alive until the launches are queued (a strided gradient's contiguous copy)
  std::vector<SumSlice> slices;
  for (size_t i = 0; i < params_.size(); ++i)
    if (const Tensor g = range_grad(i); g.defined()) {
      grads.push_back(g);
      slices.push_back({g.data<float>(), g.numel(), slots + (second(i) ? n : 0) + int64_t(i)});
    }
  sum_squares_multi_cuda(slices.data(), int64_t(slices.size()), partials_.data<float>(), stream);
  const SumSlice classes[2] = {{slots, n, totals}, {slots + n, n, totals + 1}};
  sum_values_multi_cuda(classes, 2, partials_.data<float>(), stream);
  return norm_total_;
}

AdamW::Update AdamW::update_tensors() const {
  Update u;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Variable& p = params_[i];
    const auto [begin, end] = ranges_[i];
    if (begin == end) continue;  // another rank's to update
    const Tensor g = range_grad(i);
    if (!g.defined()) continue;
    AdamWTensor t;
    t.step.beta1 = float(cfg_.beta1);
    t.step.beta2 = float(cfg_.beta2);
    t.step.eps = float(cfg_.eps);
    t.step.weight_decay = decay_[i] ? float(cfg_.weight_decay) : 0.0f;
    t.lr_multiplier = router_[i] ? cfg_.router_lr_scale : 1.0;
    const bool has_master = !masters_.empty() && masters_[i].defined();
    t.param = has_master ? masters_[i].data<float>() : p.data().data<float>() + begin;
    t.grad = g.data<float>();
    t.exp_avg = exp_avg_[i].raw_data();
    t.exp_avg_sq = exp_avg_sq_[i].raw_data();
    t.n = end - begin;
    t.moment_dtype = cfg_.moment_dtype;
    t.rounding = {rounding_key(rounding_seed_, i), begin};
    if (has_master)
      t.copy = {static_cast<char*>(p.data().raw_data()) + begin * int64_t(dtype_size(p.dtype())), p.dtype()};
    u.grads.push_back(g);
    u.params.push_back(i);
    // Sharded, a copy here is one the reducer gathers: its buffers exist from the start, the update writes the
    // range's block rows of its data and scales whatever its version, and the gather marks it current.
    const Fp8WeightCopy* fp8 = fp8_.empty() ? nullptr : fp8_[i].get();
    if (fp8 && (sharded_ || fp8->current_for(p))) {
      Fp8BlockCopy c = block_copy(fp8->wq);
      if (sharded_) c.q_t = nullptr, c.scale_inv_t = nullptr;  // rebuilt from the gathered copy
      u.fp8_tensors.push_back({t, c});
      if (!sharded_) u.fp8_params.push_back(i);
    } else {
      u.tensors.push_back(t);
    }
  }
  return u;
}

void AdamW::set_fp8_copies(std::vector<std::shared_ptr<Fp8WeightCopy>> copies) {
  FLOWMOE_CHECK(copies.empty() || copies.size() == params_.size(), Error, "AdamW::set_fp8_copies: ", copies.size(),
                " FP8 copies for ", params_.size(), " parameters");
  fp8_ = std::move(copies);
  for (const auto& c : fp8_)
    if (c) c->held = true;  // the update writes their buffers
  fp8_written_.clear();
}

void AdamW::mark_fp8_copies_current() const {
  for (size_t i : fp8_written_) fp8_[i]->mark_current(params_[i]);
}

void AdamW::apply(const Update& u, const StepScalars* control) {
  const Device dev = params_[0].device();
  if (dev.is_cpu()) {
    adamw_multi_cpu(u.tensors.data(), int64_t(u.tensors.size()), control);
    adamw_fp8_cpu(u.fp8_tensors.data(), int64_t(u.fp8_tensors.size()), control);
  } else {
    adamw_multi_cuda(u.tensors.data(), int64_t(u.tensors.size()), control, current_stream(dev.index));
    adamw_fp8_cuda(u.fp8_tensors.data(), int64_t(u.fp8_tensors.size()), control, current_stream(dev.index));
  }
  for (size_t i : u.params) params_[i].bump_version();  // updated in place: other FP8 copies must re-quantize
  fp8_written_ = u.fp8_params;
  mark_fp8_copies_current();  // written by the update from the new values
}

void AdamW::step(double lr, double grad_scale) {
  ++num_updates_;
  const float bias_correction1 = float(1.0 - std::pow(cfg_.beta1, double(num_updates_)));
  const float bias_correction2 = float(1.0 - std::pow(cfg_.beta2, double(num_updates_)));
  Update u = update_tensors();
  const auto set_step = [&](AdamWTensor& t) {
    t.step.lr = float(lr * t.lr_multiplier);
    t.step.grad_scale = float(grad_scale);
    t.step.bias_correction1 = bias_correction1;
    t.step.bias_correction2 = bias_correction2;
    t.step.update = uint32_t(num_updates_);
  };
  for (AdamWTensor& t : u.tensors) set_step(t);
  for (AdamWFp8Tensor& t : u.fp8_tensors) set_step(t.t);
  apply(u, nullptr);
}

void AdamW::step(const StepScalars* control) {
  FLOWMOE_CHECK(control, Error, "AdamW: null step scalars");
  // CPU parameters: control is host memory, so the host makes the decision the CUDA kernel makes.
  if (params_[0].device().is_cpu() && !control->apply) return;
  apply(update_tensors(), control);
}

int64_t AdamW::num_router_params() const { return std::count(router_.begin(), router_.end(), true); }

void AdamW::load_moment_ranges(const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq) {
  FLOWMOE_CHECK(exp_avg.size() == params_.size() && exp_avg_sq.size() == params_.size(), Error,
                "AdamW::load_moment_ranges: ", exp_avg.size(), " / ", exp_avg_sq.size(), " moments for ",
                params_.size(), " parameters");
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto [begin, end] = ranges_[i];
    exp_avg_[i].copy_(exp_avg[i].contiguous().reshape({-1}).slice(0, begin, end));
    exp_avg_sq_[i].copy_(exp_avg_sq[i].contiguous().reshape({-1}).slice(0, begin, end));
  }
}

void AdamW::zero_grad() {
  for (Variable& p : params_) p.zero_grad();
  range_grads_.clear();
}

double global_grad_norm(const ParallelState& ps, AdamW& opt, const std::vector<ParamShard>& shards) {
  if (ps.expert_parallel_size == 1 && !opt.sharded()) return opt.grad_norm();
  return global_norm(ps, opt.grad_square_sums(expert_shard_flags(ps, shards)), opt.sharded());
}

}  // namespace flowmoe
