// Softmax over the last dim as an autograd primitive; its vjp runs SoftmaxBackward on the saved
// output. References: kernels/cpu/softmax.cpp. Tests: tests/test_softmax.cpp.
#include "kernels/softmax.h"
#include "engine/ops/ops.h"
#include "kernels/common/device_api.h"

namespace flowmoe {

namespace {

// [..., cols] viewed as [rows, cols].
struct Rows {
  int64_t rows, cols;
};
Rows rows_of(const Tensor& x, const char* what) {
  FLOWMOE_CHECK(x.dim() >= 1, ShapeError, what, " needs at least one dim, got ", x.describe());
  int64_t cols = x.size(-1);
  return {cols > 0 ? x.numel() / cols : 0, cols};
}

class Softmax : public Primitive {
 public:
  const char* name() const override { return "softmax"; }
  bool saves_inputs() const override { return false; }
  bool saves_outputs() const override { return true; }  // dx needs only y

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    Tensor x = in[0].contiguous();
    Rows r = rows_of(x, name());
    Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
    FLOWMOE_DISPATCH_CPU_FLOAT(x.dtype(), name(),
                               softmax_forward_cpu<scalar_t>(y.data<scalar_t>(), x.data<scalar_t>(), r.rows, r.cols));
    return {y};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    Tensor x = in[0].contiguous();
    Rows r = rows_of(x, name());
    Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
    softmax_forward_cuda(x.dtype(), y.raw_data(), x.raw_data(), r.rows, r.cols, current_stream(x.device().index));
    return {y};
  }

  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>& out, const std::vector<Tensor>& d_out,
                          const std::vector<bool>&) override;
};

// inputs {d_y, y} -> {d_x}. Not differentiable itself.
class SoftmaxBackward : public BackwardPrimitive {
 public:
  const char* name() const override { return "softmax_backward"; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    check(in);
    Tensor d_y = in[0].contiguous(), y = in[1].contiguous();
    Rows r = rows_of(y, name());
    Tensor d_x = Tensor::empty(y.shape(), y.dtype(), y.device());
    FLOWMOE_DISPATCH_CPU_FLOAT(
        y.dtype(), name(),
        softmax_backward_cpu<scalar_t>(d_x.data<scalar_t>(), d_y.data<scalar_t>(), y.data<scalar_t>(), r.rows, r.cols));
    return {d_x};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    check(in);
    Tensor d_y = in[0].contiguous(), y = in[1].contiguous();
    Rows r = rows_of(y, name());
    Tensor d_x = Tensor::empty(y.shape(), y.dtype(), y.device());
    softmax_backward_cuda(y.dtype(), d_x.raw_data(), d_y.raw_data(), y.raw_data(), r.rows, r.cols,
                          current_stream(y.device().index));
    return {d_x};
  }

 private:
  void check(const std::vector<Tensor>& in) const {
    check_same_shape(in[0], in[1], name());
    check_same_dtype(in[0], in[1], name());
  }
};

std::vector<Tensor> Softmax::vjp(const std::vector<Tensor>&, const std::vector<Tensor>& out,
                                 const std::vector<Tensor>& d_out, const std::vector<bool>&) {
  SoftmaxBackward p;
  return {eval(p, {d_out[0], out[0]})[0]};
}

}  // namespace

Variable softmax(const Variable& x) { return apply(std::make_shared<Softmax>(), {x})[0]; }

}  // namespace flowmoe
