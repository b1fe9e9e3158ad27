// silu(x) = x * sigmoid(x) as an autograd primitive; its backward is a primitive too, so the
// gradient runs on the device of the values. Reference: kernels/cpu/silu.cpp. Tests: tests/test_silu.cpp.
#include "kernels/silu.h"
#include "engine/ops/ops.h"
#include "kernels/common/device_api.h"

namespace flowmoe {

namespace {

// dx = dy * silu'(x); inputs {dy, x}.
class SiluBackward : public BackwardPrimitive {
 public:
  const char* name() const override { return "silu_backward"; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    check(in);
    Tensor d_y = in[0].contiguous(), x = in[1].contiguous();
    Tensor d_x = Tensor::empty(x.shape(), x.dtype(), x.device());
    FLOWMOE_DISPATCH_CPU_FLOAT(
        x.dtype(), name(),
        silu_backward_cpu<scalar_t>(d_x.data<scalar_t>(), d_y.data<scalar_t>(), x.data<scalar_t>(), x.numel()));
    return {d_x};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    check(in);
    check_dtype(in[1], {DType::f32, DType::bf16}, name());
    Tensor d_y = in[0].contiguous(), x = in[1].contiguous();
    Tensor d_x = Tensor::empty(x.shape(), x.dtype(), x.device());
    silu_backward_cuda(x.dtype(), d_x.raw_data(), d_y.raw_data(), x.raw_data(), x.numel(),
                       current_stream(x.device().index));
    return {d_x};
  }

 private:
  static void check(const std::vector<Tensor>& in) {
    check_same_dtype(in[0], in[1], "silu_backward (dy vs x)");
    check_same_shape(in[0], in[1], "silu_backward (dy vs x)");
  }
};

class Silu : public Primitive {
 public:
  const char* name() const override { return "silu"; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    Tensor x = in[0].contiguous();
    Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
    FLOWMOE_DISPATCH_CPU_FLOAT(x.dtype(), name(),
                               silu_forward_cpu<scalar_t>(y.data<scalar_t>(), x.data<scalar_t>(), x.numel()));
    return {y};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    check_dtype(in[0], {DType::f32, DType::bf16}, name());
    Tensor x = in[0].contiguous();
    Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
    silu_forward_cuda(x.dtype(), y.raw_data(), x.raw_data(), x.numel(), current_stream(x.device().index));
    return {y};
  }

  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>&) override {
    SiluBackward bwd;
    return {eval(bwd, {d_out[0], in[0]})[0]};
  }
};

}  // namespace

Variable silu(const Variable& x) { return apply(std::make_shared<Silu>(), {x})[0]; }

}  // namespace flowmoe
