// dispatch and combine (see parallel/dispatch.h). At expert-parallel size 1 each forward hands its
// inputs back and each backward is the other op's forward; the only work is fp8_flow's once-only
// quantize of the output gradient in combine's backward.
#include "parallel/dispatch.h"

#include <memory>

#include "engine/ops/quantize.h"

namespace flowmoe {

namespace {

// Inputs: [tokens, topk_prob (or undefined)]. Outputs: the same tensors.
class Dispatch : public Primitive {
 public:
  const char* name() const override { return "dispatch"; }
  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override { return in; }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override { return in; }
  bool saves_inputs() const override { return false; }
  // d_tokens = combine(d_rows), d_prob = combine(d_prob): at size 1, the gradients as they come.
  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    return {needs[0] ? d_out[0] : Tensor(), needs[1] ? d_out[1] : Tensor()};
  }
};

// Inputs: [y]. Output: y.
class Combine : public Primitive {
 public:
  explicit Combine(CombineGrad grad) : grad_(grad) {}
  const char* name() const override { return "combine"; }
  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override { return in; }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override { return in; }
  bool saves_inputs() const override { return false; }
  // d_y = dispatch(dy): dy quantized first when the experts take an FP8 gradient.
  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    if (!needs[0]) return {Tensor()};
    if (grad_ == CombineGrad::fp8) return {quantize_rowwise_tensor(d_out[0], "combine backward: dy")};
    return {d_out[0]};
  }

 private:
  CombineGrad grad_;
};

}  // namespace

Dispatched dispatch(const Variable& tokens, const Tensor& topk_idx, const Variable& topk_prob, int num_experts) {
  FLOWMOE_CHECK(tokens.data().dim() == 2, ShapeError, "dispatch: tokens must be [T, H], got ",
                tokens.data().describe());
  FLOWMOE_CHECK(topk_idx.dim() == 2 && topk_idx.size(0) == tokens.size(0), ShapeError, "dispatch: topk_idx ",
                topk_idx.describe(), " must be [", tokens.size(0), ", k]");
  FLOWMOE_CHECK(num_experts >= 1, Error, "dispatch: num_experts must be at least 1, got ", num_experts);
  std::vector<Variable> out = apply(std::make_shared<Dispatch>(), {tokens, topk_prob});
  Dispatched d;
  d.tokens = out[0];
  d.topk_idx = topk_idx;
  if (topk_prob.defined()) d.topk_prob = out[1];
  return d;
}

Variable combine(const Variable& y, const Dispatched& from, CombineGrad grad) {
  FLOWMOE_CHECK(y.data().dim() == 2 && y.size(0) == from.tokens.size(0), ShapeError, "combine: y ",
                y.data().describe(), " must be [", from.tokens.size(0), ", H] (the dispatched tokens)");
  return apply(std::make_shared<Combine>(grad), {y})[0];
}

}  // namespace flowmoe
