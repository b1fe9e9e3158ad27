// Rotary position embedding as an autograd primitive, of one tensor (rope) or of an attention's queries and keys in
// one node and, on the GPU, one launch each way (rope_qk); its vjp is the same primitive rotating the other way.
// Reference: kernels/cpu/rope.cpp. Tests: tests/test_rope.cpp.
#include <cmath>

#include "engine/ops/ops.h"
#include "kernels/common/device_api.h"
#include "kernels/rope.h"

namespace flowmoe {

namespace {

// {x} -> {rope(x)}, or {q, k} -> {rope(q), rope(k)}.
class Rope : public Primitive {
 public:
  Rope(double theta, int64_t pos_offset, bool inverse) : theta_(theta), pos_offset_(pos_offset), inverse_(inverse) {}
  const char* name() const override { return inverse_ ? "rope_backward" : "rope"; }
  bool saves_inputs() const override { return false; }  // a rotation's vjp needs only the angles

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    check(in);
    const Tensor x = in[0].contiguous();
    Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
    const Shape& s = x.shape();
    if (in.size() == 2) {
      const Tensor k = in[1].contiguous();
      Tensor k_out = Tensor::empty(k.shape(), k.dtype(), k.device());
      FLOWMOE_DISPATCH_CPU_FLOAT(x.dtype(), name(), {
        auto rotate = inverse_ ? rope_qk_backward_cpu<scalar_t> : rope_qk_forward_cpu<scalar_t>;
        rotate(out.data<scalar_t>(), k_out.data<scalar_t>(), x.data<scalar_t>(), k.data<scalar_t>(), s[0], s[1], s[2],
               k.size(2), s[3], theta_, pos_offset_);
      });
      return {out, k_out};
    }
    FLOWMOE_DISPATCH_CPU_FLOAT(x.dtype(), name(), {
      auto rotate = inverse_ ? rope_backward_cpu<scalar_t> : rope_forward_cpu<scalar_t>;
      rotate(out.data<scalar_t>(), x.data<scalar_t>(), s[0], s[1], s[2], s[3], theta_, pos_offset_);
    });
    return {out};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    check(in);
    const Tensor x = in[0].contiguous();
    Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
    const Shape& s = x.shape();
    cudaStream_t stream = current_stream(x.device().index);
    if (in.size() == 2) {
      const Tensor k = in[1].contiguous();
      Tensor k_out = Tensor::empty(k.shape(), k.dtype(), k.device());
      auto launch = inverse_ ? rope_qk_backward_cuda : rope_qk_forward_cuda;
      launch(x.dtype(), out.raw_data(), k_out.raw_data(), x.raw_data(), k.raw_data(), s[0], s[1], s[2], k.size(2), s[3],
             theta_, pos_offset_, stream);
      return {out, k_out};
    }
    auto launch = inverse_ ? rope_backward_cuda : rope_forward_cuda;
    launch(x.dtype(), out.raw_data(), x.raw_data(), s[0], s[1], s[2], s[3], theta_, pos_offset_, stream);
    return {out};
  }

  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>&) override {
    Rope back(theta_, pos_offset_, !inverse_);
    return eval(back, d_out);
  }

 private:
  double theta_;
  int64_t pos_offset_;
  bool inverse_;

  void check(const std::vector<Tensor>& in) const {
    for (const Tensor& x : in) {
      FLOWMOE_CHECK(x.dim() == 4, ShapeError, name(), ": expects x [B, T, nh, hd], got ", shape_str(x.shape()));
      FLOWMOE_CHECK(x.size(3) % 2 == 0, ShapeError, name(), ": head_dim must be even (pairs are rotated), got ",
                    x.size(3), " in x ", shape_str(x.shape()));
    }
    if (in.size() == 2) {
      const Tensor &q = in[0], &k = in[1];
      FLOWMOE_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3), ShapeError, name(),
                    ": keys ", shape_str(k.shape()), " and queries ", shape_str(q.shape()),
                    " differ in B, T or head_dim");
      FLOWMOE_CHECK(k.dtype() == q.dtype(), DTypeError, name(), ": keys ", dtype_name(k.dtype()), " and queries ",
                    dtype_name(q.dtype()));
    }
    FLOWMOE_CHECK(theta_ > 0 && std::isfinite(theta_), Error, name(), ": theta must be positive and finite, got ",
                  theta_);
  }
};

}  // namespace

Variable rope(const Variable& x, double theta, int64_t pos_offset) {
  return apply(std::make_shared<Rope>(theta, pos_offset, false), {x})[0];
}

std::pair<Variable, Variable> rope_qk(const Variable& q, const Variable& k, double theta, int64_t pos_offset) {
  const std::vector<Variable> out = apply(std::make_shared<Rope>(theta, pos_offset, false), {q, k});
  return {out[0], out[1]};
}

}  // namespace flowmoe
