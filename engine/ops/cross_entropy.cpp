// Fused cross-entropy as an autograd primitive. Forward keeps the per-row logsumexp (and on the GPU
// the device-side 1/count) on the primitive, which its node owns; the vjp hands them to
// CrossEntropyBackward. References: kernels/cpu/cross_entropy.cpp. Tests: tests/test_cross_entropy.cpp.
#include "kernels/cross_entropy.h"
#include "engine/ops/ops.h"
#include "kernels/common/device_api.h"

namespace flowmoe {

namespace {

// logits [N, V], targets [N] i32 on the same device.
void check_inputs(const Tensor& logits, const Tensor& targets, const char* what) {
  FLOWMOE_CHECK(targets.defined(), Error, what, ": targets are undefined");
  FLOWMOE_CHECK(logits.dim() == 2, ShapeError, what, ": logits must be [N, V], got ", logits.describe());
  FLOWMOE_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0), ShapeError, what, ": targets must be [",
                logits.size(0), "] for logits ", shape_str(logits.shape()), ", got ", targets.describe());
  FLOWMOE_CHECK(logits.size(0) == 0 || logits.size(1) > 0, ShapeError, what, ": logits ", logits.describe(),
                " have no classes");
  check_dtype(targets, {DType::i32}, what);
  check_same_device(logits, targets, what);
}

// inputs {d_loss [], logits [N, V], targets [N], lse [N], inv_count [] (GPU only)} -> {d_logits}.
class CrossEntropyBackward : public BackwardPrimitive {
 public:
  explicit CrossEntropyBackward(int ignore_index) : ignore_index_(ignore_index) {}
  const char* name() const override { return "cross_entropy_backward"; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    Tensor logits = in[1].contiguous(), targets = in[2].contiguous(), lse = in[3];
    check_same_dtype(in[0], logits, name());  // on the CPU the loss has the logits' dtype
    Tensor d_logits = Tensor::empty(logits.shape(), logits.dtype(), logits.device());
    FLOWMOE_DISPATCH_CPU_FLOAT(
        logits.dtype(), name(),
        cross_entropy_backward_cpu<scalar_t>(d_logits.data<scalar_t>(), in[0].data<scalar_t>()[0],
                                             logits.data<scalar_t>(), lse.data<scalar_t>(), targets.data<int32_t>(),
                                             logits.size(0), logits.size(1), ignore_index_));
    return {d_logits};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    Tensor logits = in[1].contiguous(), targets = in[2].contiguous();
    check_dtype(in[0], {DType::f32}, name());  // on the GPU the loss is f32 whatever the logits are
    Tensor d_logits = Tensor::empty(logits.shape(), logits.dtype(), logits.device());
    cross_entropy_backward_cuda(logits.dtype(), d_logits.raw_data(), in[0].data<float>(), in[4].data<float>(),
                                logits.raw_data(), in[3].data<float>(), targets.data<int32_t>(), logits.size(0),
                                logits.size(1), ignore_index_, current_stream(logits.device().index));
    return {d_logits};
  }

 private:
  int ignore_index_;
};

// inputs {logits [N, V], targets [N] i32} -> {loss []}.
class CrossEntropy : public Primitive {
 public:
  explicit CrossEntropy(int ignore_index) : ignore_index_(ignore_index) {}
  const char* name() const override { return "cross_entropy"; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    check_inputs(in[0], in[1], name());
    Tensor logits = in[0].contiguous(), targets = in[1].contiguous();
    int64_t N = logits.size(0), V = logits.size(1);
    Tensor loss = Tensor::empty({}, logits.dtype(), logits.device());
    lse_ = Tensor::empty({N}, logits.dtype(), logits.device());
    FLOWMOE_DISPATCH_CPU_FLOAT(
        logits.dtype(), name(),
        cross_entropy_forward_cpu<scalar_t>(loss.data<scalar_t>(), lse_.data<scalar_t>(), logits.data<scalar_t>(),
                                            targets.data<int32_t>(), N, V, ignore_index_));
    return {loss};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    check_inputs(in[0], in[1], name());
    Tensor logits = in[0].contiguous(), targets = in[1].contiguous();
    int64_t N = logits.size(0), V = logits.size(1);
    Device dev = logits.device();
    Tensor loss = Tensor::empty({}, DType::f32, dev);
    Tensor row_loss = Tensor::empty({N}, DType::f32, dev);
    lse_ = Tensor::empty({N}, DType::f32, dev);
    inv_count_ = Tensor::empty({}, DType::f32, dev);
    cross_entropy_forward_cuda(logits.dtype(), loss.data<float>(), inv_count_.data<float>(), lse_.data<float>(),
                               row_loss.data<float>(), logits.raw_data(), targets.data<int32_t>(), N, V, ignore_index_,
                               current_stream(dev.index));
    return {loss};
  }

  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    if (!needs[0]) return {Tensor(), Tensor()};
    CrossEntropyBackward p(ignore_index_);
    return {eval(p, {d_out[0], in[0], in[1], lse_, inv_count_})[0], Tensor()};
  }

 private:
  int ignore_index_;
  Tensor lse_;        // [N] per-row logsumexp: logits' dtype on the CPU, f32 on the GPU
  Tensor inv_count_;  // [] f32 1/count on the GPU (undefined on the CPU, which recounts)
};

}  // namespace

Variable cross_entropy(const Variable& logits, const Tensor& targets, int ignore_index) {
  return apply(std::make_shared<CrossEntropy>(ignore_index), {logits, Variable(targets)})[0];
}

}  // namespace flowmoe
