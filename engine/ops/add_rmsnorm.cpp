// add_rmsnorm (engine/ops/add_rmsnorm.h) as an autograd primitive. It keeps the weight and its output h, nothing
// else (what the unfused rmsnorm kept: y and q are kept by their readers if they need them): RMSNorm's backward
// (rstd recomputed from h) on d_y + the straight-through d_q, plus h's own gradient, is x's and a's. The cast is
// counted in the public function, once per call, as quantize_rowwise counts its own.
#include "engine/ops/add_rmsnorm.h"

#include <memory>

#include "engine/cast_stats.h"
#include "engine/ops/ops.h"
#include "engine/ops/quantize.h"
#include "engine/ops/rmsnorm.h"
#include "kernels/add_rmsnorm.h"
#include "kernels/common/device_api.h"
#include "kernels/fp8.h"

namespace flowmoe {

namespace {

// {x [..., H], a [..., H], weight [H]} -> {h, then y (when kept), then q (when quantized)}.
class AddRmsnorm : public SharedBodyPrimitive<Primitive> {
 public:
  AddRmsnorm(double eps, const std::string& site, bool keep_y)
      : eps_(eps), quantize_(!site.empty()), keep_y_(keep_y || site.empty()), what_("add_rmsnorm at '" + site + "'") {}
  const char* name() const override { return "add_rmsnorm"; }
  bool saves_outputs() const override { return true; }
  bool keeps_input(size_t i) const override { return i == 2; }   // the weight
  bool keeps_output(size_t i) const override { return i == 0; }  // h

  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>& out,
                          const std::vector<Tensor>& d_out, const std::vector<bool>& needs) override {
    const Tensor& h = out[0];
    Tensor d_n;
    if (keep_y_) d_n = d_out[1].to(h.dtype());
    if (quantize_) {
      const Tensor d_q = straight_through_grad(d_out.back(), h.dtype()).reshape(h.shape());
      d_n = d_n.defined() ? tensor_add(d_n, d_q) : d_q;
    }
    std::vector<Tensor> d = rmsnorm_backward(d_n, h, in[2], eps_);
    const Tensor d_h = tensor_add(d_out[0].to(h.dtype()), d[0]);
    return {needs[0] ? d_h : Tensor(), needs[1] ? d_h : Tensor(), needs[2] ? d[1] : Tensor()};
  }

 private:
  double eps_;
  bool quantize_, keep_y_;
  std::string what_;

  std::vector<Tensor> run(const std::vector<Tensor>& in, bool cuda) override {
    const int64_t hidden = check_rmsnorm(in[0], in[2], eps_, what_.c_str());
    check_same_dtype(in[0], in[1], what_.c_str());
    check_same_shape(in[0], in[1], what_.c_str());
    if (cuda)
      check_dtype(in[0], {DType::f32, DType::bf16}, what_.c_str());
    else
      check_dtype(in[0], {DType::f32, DType::f64}, what_.c_str());
    const Tensor x = in[0].contiguous(), a = in[1].contiguous(), w = in[2].contiguous();
    const Device dev = x.device();
    const int64_t rows = leading_rows(x);
    Tensor h = Tensor::empty(x.shape(), x.dtype(), dev);
    Tensor y = keep_y_ ? Tensor::empty(x.shape(), x.dtype(), dev) : Tensor();
    Tensor q = quantize_ ? Tensor::empty({rows, hidden}, DType::e4m3, dev) : Tensor();
    Tensor s = quantize_ ? Tensor::empty({rows, fp8_num_blocks(hidden)}, DType::f32, dev) : Tensor();
    void* y_ptr = keep_y_ ? y.raw_data() : nullptr;
    auto* q_ptr = quantize_ ? static_cast<uint8_t*>(q.raw_data()) : nullptr;
    float* s_ptr = quantize_ ? s.data<float>() : nullptr;
    if (cuda) {
      add_rmsnorm_forward_cuda(x.dtype(), h.raw_data(), y_ptr, q_ptr, s_ptr, x.raw_data(), a.raw_data(), w.raw_data(),
                               rows, hidden, eps_, current_stream(dev.index));
    } else {
      FLOWMOE_DISPATCH_CPU_FLOAT(x.dtype(), name(),
                                 add_rmsnorm_forward_cpu<scalar_t>(h.data<scalar_t>(), static_cast<scalar_t*>(y_ptr),
                                                                   q_ptr, s_ptr, x.data<scalar_t>(), a.data<scalar_t>(),
                                                                   w.data<scalar_t>(), rows, hidden, eps_));
    }
    std::vector<Tensor> outs = {h};
    if (keep_y_) outs.push_back(y);
    if (quantize_) outs.push_back(q.with_scales(s, ScalingMode::rowwise_1x128));
    return outs;
  }
};

}  // namespace

AddNormed add_rmsnorm(const Variable& x, const Variable& a, const Variable& weight, double eps, const std::string& site,
                      bool keep_y) {
  const auto op = std::make_shared<AddRmsnorm>(eps, site, keep_y);
  const std::vector<Variable> out = apply(op, {x, a, weight});
  AddNormed r;
  r.h = out[0];
  size_t i = 1;
  if (keep_y || site.empty()) r.n.y = out[i++];
  if (!site.empty()) {
    r.n.q = out[i];
    note_cast(CastKind::quantize, site);
  }
  return r;
}

}  // namespace flowmoe
