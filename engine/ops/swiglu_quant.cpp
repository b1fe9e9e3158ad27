// swiglu_quant (engine/ops/swiglu_quant.h) as an autograd primitive; its backward is a primitive on the
// same device. It saves its inputs h and prob. Kernels: kernels/cpu/swiglu_quant.cpp,
// kernels/cuda/swiglu_quant.cu. Tests: tests/test_swiglu_quant.cpp.
#include "engine/ops/swiglu_quant.h"

#include <memory>

#include "engine/ops/ops.h"
#include "kernels/common/device_api.h"
#include "kernels/fp8.h"
#include "kernels/swiglu_quant.h"

namespace flowmoe {

namespace {

// Checks h [M,2F] (f32/bf16) and prob [M] f32 (or undefined); returns F.
int64_t check_h_prob(const Tensor& h, const Tensor& prob, const char* what) {
  FLOWMOE_CHECK(h.dim() == 2 && h.size(1) % 2 == 0, ShapeError, what, ": h must be [M, 2F] = [gate | up], got ",
                h.describe());
  check_dtype(h, {DType::f32, DType::bf16}, what);
  if (prob.defined()) {
    FLOWMOE_CHECK(prob.dim() == 1 && prob.size(0) == h.size(0), ShapeError, what, ": prob ", prob.describe(),
                  " must be [", h.size(0), "] for h ", h.describe());
    check_dtype(prob, {DType::f32}, what);
  }
  return h.size(1) / 2;
}

const float* prob_ptr(const Tensor& prob) { return prob.defined() ? prob.data<float>() : nullptr; }

// {d_a [M,F], h [M,2F], prob [M] or undefined} -> {d_h (FP8 + scales, or h's dtype) or undefined,
// d_prob [M] f32 or undefined}.
class SwigluQuantBackward : public SharedBodyPrimitive<BackwardPrimitive> {
 public:
  SwigluQuantBackward(bool quantize_grad, bool want_h, bool want_prob, Tensor row_counts)
      : quantize_grad_(quantize_grad), want_h_(want_h), want_prob_(want_prob), row_counts_(std::move(row_counts)) {}
  const char* name() const override { return "swiglu_quant_backward"; }

 private:
  bool quantize_grad_, want_h_, want_prob_;
  Tensor row_counts_;

  std::vector<Tensor> run(const std::vector<Tensor>& in, bool cuda) override {
    const int64_t F = check_h_prob(in[1], in[2], name());
    const int64_t M = in[1].size(0);
    FLOWMOE_CHECK(in[0].shape() == (Shape{M, F}), ShapeError, name(), ": d_a ", in[0].describe(), " does not match h ",
                  in[1].describe());
    check_dtype(in[0], {DType::f32, DType::bf16}, "swiglu_quant_backward d_a");
    // The zero-filled gradient of an FP8 output arrives as bf16: one compute dtype for both, f32
    // when they differ (bf16 -> f32 is exact).
    const DType dtype = in[0].dtype() == in[1].dtype() ? in[1].dtype() : DType::f32;
    const Device dev = in[1].device();
    Tensor d_a = in[0].to(dtype).contiguous(), h = in[1].to(dtype).contiguous(), prob;
    if (in[2].defined()) prob = in[2].contiguous();
    Tensor q, scale_inv, d_h, d_prob;
    if (want_h_ && quantize_grad_) {
      q = Tensor::empty({M, 2 * F}, DType::e4m3, dev);
      scale_inv = Tensor::empty({M, fp8_num_blocks(2 * F)}, DType::f32, dev);
    } else if (want_h_) {
      d_h = Tensor::empty({M, 2 * F}, dtype, dev);
    }
    if (want_prob_) d_prob = Tensor::empty({M}, DType::f32, dev);
    auto* q_ptr = q.defined() ? static_cast<uint8_t*>(q.raw_data()) : nullptr;
    float* s_ptr = scale_inv.defined() ? scale_inv.data<float>() : nullptr;
    void* d_h_ptr = d_h.defined() ? d_h.raw_data() : nullptr;
    float* d_prob_ptr = d_prob.defined() ? d_prob.data<float>() : nullptr;
    CountedRows counted;
    const int64_t rows = counted_host_rows(in[1], row_counts_, name(), &counted);
    if (cuda) {
      swiglu_quant_backward_cuda(dtype, d_a.raw_data(), h.raw_data(), prob_ptr(prob), M, F, q_ptr, s_ptr, d_h_ptr,
                                 d_prob_ptr, current_stream(dev.index), counted);
    } else {
      swiglu_quant_backward_cpu(dtype, d_a.raw_data(), h.raw_data(), prob_ptr(prob), rows, F, q_ptr, s_ptr, d_h_ptr,
                                d_prob_ptr);
    }
    if (q.defined())
      d_h = q.with_scales(scale_inv, ScalingMode::rowwise_1x128);
    else if (d_h.defined())
      d_h = d_h.to(in[1].dtype());
    return {d_h, d_prob};
  }
};

class SwigluQuant : public SharedBodyPrimitive<Primitive> {
 public:
  SwigluQuant(bool quantize_grad, Tensor row_counts)
      : quantize_grad_(quantize_grad), row_counts_(std::move(row_counts)) {}
  const char* name() const override { return "swiglu_quant"; }

  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    SwigluQuantBackward bwd(quantize_grad_, needs[0], needs[1] && in[1].defined(), row_counts_);
    return eval(bwd, {d_out[0], in[0], in[1]});
  }

 private:
  bool quantize_grad_;
  Tensor row_counts_;

  std::vector<Tensor> run(const std::vector<Tensor>& in, bool cuda) override {
    const int64_t F = check_h_prob(in[0], in[1], name());
    const int64_t M = in[0].size(0);
    const Device dev = in[0].device();
    CountedRows counted;
    const int64_t rows = counted_host_rows(in[0], row_counts_, name(), &counted);
    Tensor h = in[0].contiguous(), prob = in[1].defined() ? in[1].contiguous() : Tensor();
    Tensor q = Tensor::empty({M, F}, DType::e4m3, dev);
    Tensor scale_inv = Tensor::empty({M, fp8_num_blocks(F)}, DType::f32, dev);
    auto* q_ptr = static_cast<uint8_t*>(q.raw_data());
    if (cuda) {
      swiglu_quant_forward_cuda(h.dtype(), h.raw_data(), prob_ptr(prob), M, F, q_ptr, scale_inv.data<float>(),
                                current_stream(dev.index), counted);
    } else {
      swiglu_quant_forward_cpu(h.dtype(), h.raw_data(), prob_ptr(prob), rows, F, q_ptr, scale_inv.data<float>());
    }
    return {q.with_scales(scale_inv, ScalingMode::rowwise_1x128)};
  }
};

}  // namespace

Variable swiglu_quant(const Variable& h, const Variable& prob, bool quantize_grad, const Tensor& row_counts) {
  return apply(std::make_shared<SwigluQuant>(quantize_grad, row_counts), {h, prob})[0];
}

}  // namespace flowmoe
