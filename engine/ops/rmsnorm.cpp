// rmsnorm(x, weight, eps) over the last dim as an autograd primitive; its backward (dx and d_weight
// in one pass, rstd recomputed rather than saved) is a primitive on the same device.
// Reference: kernels/cpu/rmsnorm.cpp. Tests: tests/test_rmsnorm.cpp.
#include "engine/ops/rmsnorm.h"

#include "engine/ops/ops.h"
#include "kernels/common/device_api.h"
#include "kernels/rmsnorm.h"

namespace flowmoe {

int64_t check_rmsnorm(const Tensor& x, const Tensor& weight, double eps, const char* what) {
  check_same_dtype(x, weight, what);
  FLOWMOE_CHECK(x.dim() >= 1, ShapeError, what, ": x must be [..., H], got ", x.describe());
  FLOWMOE_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), ShapeError, what, ": weight ", weight.describe(),
                " does not match x ", x.describe(), " (want [H] with H = x's last dim)");
  FLOWMOE_CHECK(eps >= 0, Error, what, ": eps must be >= 0, got ", eps);
  return x.size(-1);
}

namespace {

int64_t rows_of(const Tensor& x, int64_t hidden) { return hidden > 0 ? x.numel() / hidden : 0; }

// {d_x, d_weight} from {d_y, x, weight}.
class RmsnormBackward : public BackwardPrimitive {
 public:
  explicit RmsnormBackward(double eps) : eps_(eps) {}
  const char* name() const override { return "rmsnorm_backward"; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    int64_t hidden = check(in);
    Tensor d_y = in[0].contiguous(), x = in[1].contiguous(), w = in[2].contiguous();
    Tensor d_x = Tensor::empty(x.shape(), x.dtype(), x.device());
    Tensor d_w = Tensor::empty(w.shape(), w.dtype(), w.device());
    FLOWMOE_DISPATCH_CPU_FLOAT(
        x.dtype(), name(),
        rmsnorm_backward_cpu<scalar_t>(d_x.data<scalar_t>(), d_w.data<scalar_t>(), d_y.data<scalar_t>(),
                                       x.data<scalar_t>(), w.data<scalar_t>(), rows_of(x, hidden), hidden, eps_));
    return {d_x, d_w};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    int64_t hidden = check(in);
    check_dtype(in[1], {DType::f32, DType::bf16}, name());
    Tensor d_y = in[0].contiguous(), x = in[1].contiguous(), w = in[2].contiguous();
    Tensor d_x = Tensor::empty(x.shape(), x.dtype(), x.device());
    Tensor d_w = Tensor::empty(w.shape(), w.dtype(), w.device());
    int64_t rows = rows_of(x, hidden);
    int64_t ws_floats = rmsnorm_backward_workspace_floats(rows, hidden);
    Tensor workspace = Tensor::empty({ws_floats}, DType::f32, x.device());
    rmsnorm_backward_cuda(x.dtype(), d_x.raw_data(), d_w.raw_data(), d_y.raw_data(), x.raw_data(), w.raw_data(), rows,
                          hidden, eps_, static_cast<float*>(workspace.raw_data()), ws_floats,
                          current_stream(x.device().index));
    return {d_x, d_w};
  }

 private:
  double eps_;

  int64_t check(const std::vector<Tensor>& in) const {
    check_same_dtype(in[0], in[1], "rmsnorm_backward (d_y vs x)");
    check_same_shape(in[0], in[1], "rmsnorm_backward (d_y vs x)");
    return check_rmsnorm(in[1], in[2], eps_, name());
  }
};

class Rmsnorm : public Primitive {
 public:
  explicit Rmsnorm(double eps) : eps_(eps) {}
  const char* name() const override { return "rmsnorm"; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    int64_t hidden = check_rmsnorm(in[0], in[1], eps_, name());
    Tensor x = in[0].contiguous(), w = in[1].contiguous();
    Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
    FLOWMOE_DISPATCH_CPU_FLOAT(x.dtype(), name(),
                               rmsnorm_forward_cpu<scalar_t>(y.data<scalar_t>(), x.data<scalar_t>(), w.data<scalar_t>(),
                                                             rows_of(x, hidden), hidden, eps_));
    return {y};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    int64_t hidden = check_rmsnorm(in[0], in[1], eps_, name());
    check_dtype(in[0], {DType::f32, DType::bf16}, name());
    Tensor x = in[0].contiguous(), w = in[1].contiguous();
    Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
    rmsnorm_forward_cuda(x.dtype(), y.raw_data(), x.raw_data(), w.raw_data(), rows_of(x, hidden), hidden, eps_,
                         current_stream(x.device().index));
    return {y};
  }

  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    std::vector<Tensor> d = rmsnorm_backward(d_out[0], in[0], in[1], eps_);
    return {needs[0] ? d[0] : Tensor(), needs[1] ? d[1] : Tensor()};
  }

 private:
  double eps_;
};

}  // namespace

std::vector<Tensor> rmsnorm_backward(const Tensor& d_y, const Tensor& x, const Tensor& weight, double eps) {
  RmsnormBackward bwd(eps);
  return eval(bwd, {d_y, x, weight});
}

Variable rmsnorm(const Variable& x, const Variable& weight, double eps) {
  return apply(std::make_shared<Rmsnorm>(eps), {x, weight})[0];
}

}  // namespace flowmoe
