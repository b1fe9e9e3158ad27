// unpermute_unpad and its backward as autograd primitives (see engine/ops/unpermute.h).
// References: kernels/cpu/unpermute.cpp. Kernels: kernels/cuda/unpermute.cu. Tests: tests/test_unpermute.cpp.
#include "engine/ops/unpermute.h"

#include <memory>
#include <vector>

#include "kernels/common/device_api.h"
#include "kernels/unpermute.h"

namespace flowmoe {

namespace {

// Shared by forward and backward: inputs [rows, topk_prob (or undefined), row_map, tokens_per_expert,
// segment_starts, ...]. On the CPU, every row_map entry is checked against the rows it indexes.
void check_unpermute(const std::vector<Tensor>& in, bool cuda, const char* what) {
  const Tensor &rows = in[0], &prob = in[1], &row_map = in[2], &tokens = in[3], &seg = in[4];
  FLOWMOE_CHECK(rows.dim() == 2, ShapeError, what, ": rows must be [num_rows, hidden], got ", rows.describe());
  FLOWMOE_CHECK(row_map.dim() == 2, ShapeError, what, ": row_map must be [tokens, k], got ", row_map.describe());
  check_dtype(row_map, {DType::i32}, what);
  check_dtype(tokens, {DType::i32}, what);
  check_dtype(seg, {DType::i32}, what);
  FLOWMOE_CHECK(tokens.dim() == 1 && tokens.numel() >= 1 && seg.dim() == 1 && seg.numel() == tokens.numel() + 1,
                ShapeError, what, ": tokens_per_expert ", tokens.describe(), " and segment_starts ", seg.describe(),
                " must be [L] and [L+1]");
  if (cuda)
    check_dtype(rows, {DType::f32, DType::bf16}, what);
  else
    check_dtype(rows, {DType::f32, DType::f64}, what);
  if (prob.defined()) {
    check_same_shape(prob, row_map, what);
    if (cuda)
      check_dtype(prob, {DType::f32}, what);
    else
      check_same_dtype(prob, rows, what);
  }
  if (!cuda) {
    Tensor rm = row_map.contiguous();
    const int32_t* p = rm.data<int32_t>();
    for (int64_t i = 0; i < rm.numel(); ++i)
      FLOWMOE_CHECK(p[i] >= -1 && p[i] < rows.size(0), ShapeError, what, ": row_map[", i / rm.size(1), ", ",
                    i % rm.size(1), "] = ", p[i], " is not a row of ", rows.describe());
  }
}

// Inputs: [rows, topk_prob, row_map, tokens_per_expert, segment_starts, dy]. Outputs: [d_rows, d_topk_prob],
// each undefined when not wanted.
class UnpermuteBackward : public BackwardPrimitive {
 public:
  UnpermuteBackward(int align_size, bool want_rows, bool want_prob)
      : align_(align_size), want_rows_(want_rows), want_prob_(want_prob) {}
  const char* name() const override { return "unpermute_unpad_backward"; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    check_unpermute(in, false, name());
    Tensor rows = in[0].contiguous(), row_map = in[2].contiguous(), dy = in[5].contiguous(), prob, d_rows, d_prob;
    check_same_dtype(dy, rows, name());
    if (in[1].defined()) prob = in[1].contiguous();
    if (want_rows_) d_rows = Tensor::empty(rows.shape(), rows.dtype());
    if (want_prob_) d_prob = Tensor::empty(row_map.shape(), rows.dtype());
    FLOWMOE_DISPATCH_CPU_FLOAT(
        rows.dtype(), name(),
        unpermute_backward_cpu<scalar_t>(
            row_map.data<int32_t>(), row_map.size(0), int(row_map.size(1)), rows.size(1), rows.size(0),
            rows.data<scalar_t>(), prob.defined() ? prob.data<scalar_t>() : nullptr, dy.data<scalar_t>(),
            want_rows_ ? d_rows.data<scalar_t>() : nullptr, want_prob_ ? d_prob.data<scalar_t>() : nullptr));
    return {d_rows, d_prob};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    check_unpermute(in, true, name());
    const Device dev = in[0].device();
    Tensor rows = in[0].contiguous(), row_map = in[2].contiguous(), tokens = in[3].contiguous(),
           seg = in[4].contiguous(), dy = in[5].contiguous(), prob, d_rows, d_prob;
    check_same_dtype(dy, rows, name());
    if (in[1].defined()) prob = in[1].contiguous();
    if (want_rows_) d_rows = Tensor::empty(rows.shape(), rows.dtype(), dev);
    if (want_prob_) d_prob = Tensor::empty(row_map.shape(), DType::f32, dev);
    UnpermuteBackwardArgs a;
    a.row_map = row_map.data<int32_t>();
    a.tokens_per_expert = tokens.data<int32_t>();
    a.segment_starts = seg.data<int32_t>();
    a.rows = rows.raw_data();
    a.topk_prob = prob.defined() ? prob.data<float>() : nullptr;
    a.dy = dy.raw_data();
    a.d_rows = want_rows_ ? d_rows.raw_data() : nullptr;
    a.d_topk_prob = want_prob_ ? d_prob.data<float>() : nullptr;
    a.num_tokens = row_map.size(0), a.hidden = rows.size(1), a.num_rows = rows.size(0);
    a.top_k = int(row_map.size(1)), a.num_local_experts = int(tokens.numel()), a.align_size = align_;
    unpermute_backward_cuda(rows.dtype(), a, current_stream(dev.index));
    return {d_rows, d_prob};
  }

 private:
  int align_;
  bool want_rows_, want_prob_;
};

// Inputs: [rows, topk_prob (or undefined), row_map, tokens_per_expert, segment_starts]. Output: y [T,H].
// Built from a permute_pad routing, its vjp also takes an FP8 dy (fp8_flow: combine's backward
// quantized it once): the rows and scales of dy then move with that routing, dequantizing nothing.
class UnpermuteUnpad : public Primitive {
 public:
  UnpermuteUnpad(int align_size, bool has_prob) : align_(align_size), has_prob_(has_prob) {}
  UnpermuteUnpad(const PermuteResult& routing, bool has_prob) : UnpermuteUnpad(routing.align_size, has_prob) {
    routing_ = routing;
    routing_.rows = routing_.probs = Variable();  // keep the routing, not the permuted activations
    routing_.side_rows = Tensor();
  }
  const char* name() const override { return "unpermute_unpad"; }
  // Without probs, d_rows needs only the routing (and dy): the expert outputs are not kept.
  bool saves_inputs() const override { return has_prob_ || !routing_.row_map.defined(); }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    check_unpermute(in, false, name());
    Tensor rows = in[0].contiguous(), row_map = in[2].contiguous(), prob;
    if (in[1].defined()) prob = in[1].contiguous();
    Tensor y = Tensor::empty({row_map.size(0), rows.size(1)}, rows.dtype());
    FLOWMOE_DISPATCH_CPU_FLOAT(
        rows.dtype(), name(),
        unpermute_cpu<scalar_t>(row_map.data<int32_t>(), row_map.size(0), int(row_map.size(1)), rows.size(1),
                                rows.data<scalar_t>(), prob.defined() ? prob.data<scalar_t>() : nullptr,
                                y.data<scalar_t>()));
    return {y};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    check_unpermute(in, true, name());
    const Device dev = in[0].device();
    Tensor rows = in[0].contiguous(), row_map = in[2].contiguous(), prob;
    if (in[1].defined()) prob = in[1].contiguous();
    Tensor y = Tensor::empty({row_map.size(0), rows.size(1)}, rows.dtype(), dev);
    unpermute_cuda(rows.dtype(), row_map.data<int32_t>(), row_map.size(0), int(row_map.size(1)), rows.size(1),
                   rows.raw_data(), prob.defined() ? prob.data<float>() : nullptr, y.raw_data(),
                   current_stream(dev.index));
    return {y};
  }

  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    if (!saves_inputs()) {  // no probs: d_rows[row_map[t,j]] = dy[t]; an FP8 dy moves with its scales
      return {needs[0] ? permute_rows_like(d_out[0], routing_) : Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    }
    FLOWMOE_CHECK(!is_fp8(d_out[0].dtype()), Error, name(),
                  ": an FP8 output gradient needs the permute_pad routing and no probs");
    UnpermuteBackward backward(align_, needs[0], needs[1]);
    std::vector<Tensor> g = eval(backward, {in[0], in[1], in[2], in[3], in[4], d_out[0]});
    return {g[0], g[1], Tensor(), Tensor(), Tensor()};
  }

 private:
  int align_;
  bool has_prob_;
  PermuteResult routing_;  // row_map undefined when built from plain routing tensors
};

}  // namespace

Variable unpermute_unpad(const Variable& rows, const Tensor& row_map, const Tensor& tokens_per_expert,
                         const Tensor& segment_starts, int align_size, const Variable& topk_prob) {
  FLOWMOE_CHECK(align_size == 16 || align_size == 32 || align_size == 64 || align_size == 128, Error,
                "unpermute_unpad: align_size must be 16, 32, 64 or 128, got ", align_size);
  return apply(std::make_shared<UnpermuteUnpad>(align_size, topk_prob.defined()),
               {rows, topk_prob, Variable(row_map), Variable(tokens_per_expert), Variable(segment_starts)})[0];
}

Variable unpermute_unpad(const Variable& rows, const PermuteResult& routing, const Variable& topk_prob) {
  const PermuteResult& r = routing;
  return apply(std::make_shared<UnpermuteUnpad>(r, topk_prob.defined()),
               {rows, topk_prob, Variable(r.row_map), Variable(r.tokens_per_expert), Variable(r.segment_starts)})[0];
}

}  // namespace flowmoe
