// permute_pad and its backward as autograd primitives (see engine/ops/permute.h).
// References: kernels/cpu/permute.cpp. Kernels: kernels/cuda/permute.cu. Tests: tests/test_permute.cpp.
#include "engine/ops/permute.h"

#include <memory>
#include <vector>

#include "kernels/common/device_api.h"

namespace flowmoe {

namespace {

// Inputs: row_map [T,k], d_rows [num_rows,H] (or undefined), d_probs [num_rows] (or undefined).
// Outputs: d_x [T,H] and d_topk_prob [T,k], each undefined when its cotangent is.
class PermutePadBackward : public BackwardPrimitive {
 public:
  PermutePadBackward(int64_t num_tokens, int top_k, int64_t hidden)
      : num_tokens_(num_tokens), topk_(top_k), hidden_(hidden) {}
  const char* name() const override { return "permute_pad_backward"; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    Tensor row_map = in[0].contiguous(), d_x, d_prob;
    if (in[1].defined()) {
      Tensor d_rows = in[1].contiguous();
      d_x = Tensor::empty({num_tokens_, hidden_}, d_rows.dtype());
      FLOWMOE_DISPATCH_CPU_FLOAT(
          d_rows.dtype(), name(),
          permute_backward_cpu<scalar_t>(row_map.data<int32_t>(), num_tokens_, topk_, hidden_, d_rows.data<scalar_t>(),
                                         nullptr, d_x.data<scalar_t>(), nullptr));
    }
    if (in[2].defined()) {
      Tensor d_probs = in[2].contiguous();
      d_prob = Tensor::empty({num_tokens_, topk_}, d_probs.dtype());
      FLOWMOE_DISPATCH_CPU_FLOAT(
          d_probs.dtype(), name(),
          permute_backward_cpu<scalar_t>(row_map.data<int32_t>(), num_tokens_, topk_, hidden_, nullptr,
                                         d_probs.data<scalar_t>(), nullptr, d_prob.data<scalar_t>()));
    }
    return {d_x, d_prob};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    const Device dev = in[0].device();
    Tensor row_map = in[0].contiguous(), d_rows, d_probs, d_x, d_prob;
    if (in[1].defined()) {
      d_rows = in[1].contiguous();
      d_x = Tensor::empty({num_tokens_, hidden_}, d_rows.dtype(), dev);
    }
    if (in[2].defined()) {
      d_probs = in[2].contiguous();
      d_prob = Tensor::empty({num_tokens_, topk_}, DType::f32, dev);
    }
    permute_backward_cuda(d_rows.defined() ? d_rows.dtype() : DType::f32, row_map.data<int32_t>(), num_tokens_, topk_,
                          hidden_, d_rows.defined() ? d_rows.raw_data() : nullptr,
                          d_probs.defined() ? d_probs.data<float>() : nullptr, d_x.defined() ? d_x.raw_data() : nullptr,
                          d_prob.defined() ? d_prob.data<float>() : nullptr, current_stream(dev.index));
    return {d_x, d_prob};
  }

 private:
  int64_t num_tokens_;
  int topk_;
  int64_t hidden_;
};

// Inputs: x [T,H], topk_idx [T,k] i32, topk_prob [T,k] (or undefined), side [T,S] f32 (or undefined).
// Outputs: rows, probs, row_map, tokens_per_expert, padded_tokens_per_expert, segment_starts, side_rows.
class PermutePad : public Primitive {
 public:
  PermutePad(const RoutingDims& d, double side_pad_value, bool fp8_scales)
      : d_(d), side_pad_value_(side_pad_value), fp8_scales_(fp8_scales) {}
  const char* name() const override { return "permute_pad"; }
  bool saves_inputs() const override { return false; }  // the vjp needs only row_map, kept below

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    check(in, false);
    Tensor x = in[0].contiguous(), idx = in[1].contiguous();
    std::vector<Tensor> out = allocate(in, Device::cpu());
    permute_map_cpu(d_, idx.data<int32_t>(), out[2].data<int32_t>(), out[3].data<int32_t>(), out[4].data<int32_t>(),
                    out[5].data<int32_t>());
    const int32_t* row_map = out[2].data<int32_t>();
    permute_rows_cpu(d_, row_map, x.raw_data(), row_bytes(x), nullptr, out[0].raw_data());
    if (in[2].defined()) {
      Tensor prob = in[2].contiguous();
      FLOWMOE_DISPATCH_CPU_FLOAT(
          prob.dtype(), name(),
          permute_probs_cpu<scalar_t>(d_, row_map, prob.data<scalar_t>(), out[1].data<scalar_t>()));
    }
    if (in[3].defined()) {
      Tensor side = in[3].contiguous();
      std::vector<float> pad_row(size_t(side.size(1)), float(side_pad_value_));
      permute_rows_cpu(d_, row_map, side.raw_data(), size_t(side.size(1)) * sizeof(float), pad_row.data(),
                       out[6].raw_data());
    }
    return finish(out);
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    check(in, true);
    const Device dev = in[0].device();
    Tensor x = in[0].contiguous(), idx = in[1].contiguous(), prob, side;
    std::vector<Tensor> out = allocate(in, dev);
    Tensor workspace = Tensor::empty({int64_t(permute_workspace_bytes(d_))}, DType::u8, dev);
    PermuteBuffers b;
    b.topk_idx = idx.data<int32_t>();
    b.x = x.raw_data();
    b.row_bytes = row_bytes(x);
    if (in[2].defined()) {
      prob = in[2].contiguous();
      b.topk_prob = prob.data<float>();
      b.probs = out[1].data<float>();
    }
    if (in[3].defined()) {
      side = in[3].contiguous();
      b.side = side.data<float>();
      b.side_cols = int(side.size(1));
      b.side_pad_value = float(side_pad_value_);
      b.side_rows = out[6].data<float>();
    }
    b.rows = out[0].raw_data();
    b.row_map = out[2].data<int32_t>();
    b.tokens_per_expert = out[3].data<int32_t>();
    b.padded_tokens_per_expert = out[4].data<int32_t>();
    b.segment_starts = out[5].data<int32_t>();
    b.workspace = workspace.raw_data();
    permute_pad_cuda(d_, b, current_stream(dev.index));
    return finish(out);
  }

  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    PermutePadBackward backward(d_.num_tokens, d_.top_k, hidden_);
    std::vector<Tensor> g = eval(backward, {row_map_, needs[0] ? d_out[0] : Tensor(), needs[2] ? d_out[1] : Tensor()});
    return {g[0], Tensor(), g[1], Tensor()};
  }

 private:
  RoutingDims d_;
  double side_pad_value_;
  bool fp8_scales_;  // the side payload is x's FP8 scales: attach them to the rows
  int64_t hidden_ = 0;
  Tensor row_map_;  // [T,k]: small, kept for the vjp instead of saving the (large) outputs

  size_t row_bytes(const Tensor& x) const { return size_t(x.size(1)) * dtype_size(x.dtype()); }

  std::vector<Tensor> finish(std::vector<Tensor>& out) {
    row_map_ = out[2];
    if (fp8_scales_) out[0] = out[0].with_scales(out[6], ScalingMode::rowwise_1x128);
    return out;
  }

  void check(const std::vector<Tensor>& in, bool cuda) const {
    const Tensor &x = in[0], &idx = in[1], &prob = in[2], &side = in[3];
    FLOWMOE_CHECK(x.dim() == 2, ShapeError, "permute_pad: x must be [tokens, hidden], got ", x.describe());
    FLOWMOE_CHECK(idx.dim() == 2 && idx.size(0) == x.size(0) && idx.size(0) == d_.num_tokens && idx.size(1) == d_.top_k,
                  ShapeError, "permute_pad: topk_idx ", idx.describe(), " does not match x ", x.describe());
    check_dtype(idx, {DType::i32}, "permute_pad topk_idx");
    if (prob.defined()) {
      check_same_shape(prob, idx, "permute_pad topk_prob vs topk_idx");
      if (cuda)
        check_dtype(prob, {DType::f32}, "permute_pad topk_prob on cuda");
      else
        check_dtype(prob, {DType::f32, DType::f64}, "permute_pad topk_prob on cpu");
    }
    if (side.defined()) {
      FLOWMOE_CHECK(side.dim() == 2 && side.size(0) == x.size(0), ShapeError, "permute_pad: side payload ",
                    side.describe(), " must be [", x.size(0), ", S]");
      check_dtype(side, {DType::f32}, "permute_pad side payload");
    }
  }

  // [rows, probs, row_map, tokens_per_expert, padded_tokens_per_expert, segment_starts, side_rows]
  std::vector<Tensor> allocate(const std::vector<Tensor>& in, Device dev) {
    const Tensor &x = in[0], &prob = in[2], &side = in[3];
    hidden_ = x.size(1);
    const int64_t num_local = d_.num_local_experts;
    return {Tensor::empty({d_.num_rows, hidden_}, x.dtype(), dev),
            prob.defined() ? Tensor::empty({d_.num_rows}, prob.dtype(), dev) : Tensor(),
            Tensor::empty({d_.num_tokens, d_.top_k}, DType::i32, dev),
            Tensor::empty({num_local}, DType::i32, dev),
            Tensor::empty({num_local}, DType::i32, dev),
            Tensor::empty({num_local + 1}, DType::i32, dev),
            side.defined() ? Tensor::empty({d_.num_rows, side.size(1)}, DType::f32, dev) : Tensor()};
  }
};

// Inputs: x [T,H'] (any dtype), row_map, tokens_per_expert, segment_starts, side [T,S] f32 (or
// undefined). Outputs: rows [num_rows, H'] (pad rows zero), side_rows [num_rows, S] (pad rows 1).
class PermuteRowsLike : public BackwardPrimitive {
 public:
  explicit PermuteRowsLike(const RoutingDims& d) : d_(d) {}
  const char* name() const override { return "permute_rows_like"; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    Tensor x = in[0].contiguous(), row_map = in[1].contiguous();
    const size_t row_bytes = size_t(x.size(1)) * dtype_size(x.dtype());
    Tensor rows = Tensor::empty({d_.num_rows, x.size(1)}, x.dtype()), side_rows;
    permute_rows_cpu(d_, row_map.data<int32_t>(), x.raw_data(), row_bytes, nullptr, rows.raw_data());
    if (in[4].defined()) {
      Tensor side = in[4].contiguous();
      side_rows = Tensor::empty({d_.num_rows, side.size(1)}, DType::f32);
      std::vector<float> pad_row(size_t(side.size(1)), 1.0f);
      permute_rows_cpu(d_, row_map.data<int32_t>(), side.raw_data(), size_t(side.size(1)) * sizeof(float),
                       pad_row.data(), side_rows.raw_data());
    }
    return {rows, side_rows};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    const Device dev = in[0].device();
    Tensor x = in[0].contiguous(), side;
    Tensor rows = Tensor::empty({d_.num_rows, x.size(1)}, x.dtype(), dev), side_rows;
    PermuteBuffers b;
    b.x = x.raw_data();
    b.row_bytes = size_t(x.size(1)) * dtype_size(x.dtype());
    b.rows = rows.raw_data();
    b.row_map = const_cast<int32_t*>(in[1].data<int32_t>());  // read only by the row move
    b.tokens_per_expert = const_cast<int32_t*>(in[2].data<int32_t>());
    b.segment_starts = const_cast<int32_t*>(in[3].data<int32_t>());
    if (in[4].defined()) {
      side = in[4].contiguous();
      side_rows = Tensor::empty({d_.num_rows, side.size(1)}, DType::f32, dev);
      b.side = side.data<float>();
      b.side_cols = int(side.size(1));
      b.side_pad_value = 1.0f;
      b.side_rows = side_rows.data<float>();
    }
    permute_rows_cuda(d_, b, current_stream(dev.index));
    return {rows, side_rows};
  }

 private:
  RoutingDims d_;
};

}  // namespace

PermuteResult permute_pad(const Variable& x, const Tensor& topk_idx, const Variable& topk_prob, int num_experts,
                          int align_size, int expert_offset, int num_local_experts, int64_t num_rows,
                          const Tensor& side, double side_pad_value) {
  FLOWMOE_CHECK(topk_idx.dim() == 2, ShapeError, "permute_pad: topk_idx must be [tokens, k], got ",
                topk_idx.describe());
  RoutingDims d;
  d.num_tokens = topk_idx.size(0);
  d.top_k = int(topk_idx.size(1));
  d.num_experts = num_experts;
  d.expert_offset = expert_offset;
  d.num_local_experts = num_local_experts < 0 ? num_experts - expert_offset : num_local_experts;
  d.align_size = align_size;
  check_routing_dims(d);  // align_size and expert range first: the worst case below relies on them
  d.num_rows =
      num_rows < 0 ? permute_worst_case_rows(d.num_tokens, d.top_k, d.num_local_experts, align_size) : num_rows;
  check_routing_dims(d);

  Tensor side_payload = side;
  const auto& scales = x.data().fp8_scales();
  if (scales) {
    FLOWMOE_CHECK(!side.defined(), Error, "permute_pad: an FP8 x carries its own scales; pass no side payload");
    FLOWMOE_CHECK(scales->mode == ScalingMode::rowwise_1x128, Error, "permute_pad: FP8 x must be rowwise 1x128, got ",
                  scaling_mode_name(scales->mode));
    side_payload = scales->scale_inv;
    side_pad_value = 1.0;  // the amax = 0 scale of a zero row (DESIGN.md §3)
  }
  std::vector<Variable> out =
      apply(std::make_shared<PermutePad>(d, side_pad_value, bool(scales)),
            {x, Variable(topk_idx), topk_prob, side_payload.defined() ? Variable(side_payload) : Variable()});
  PermuteResult r;
  r.rows = out[0];
  if (topk_prob.defined()) r.probs = out[1];
  r.row_map = out[2].data();
  r.tokens_per_expert = out[3].data();
  r.padded_tokens_per_expert = out[4].data();
  r.segment_starts = out[5].data();
  if (side.defined()) r.side_rows = out[6].data();
  r.align_size = align_size;
  r.dims = d;
  return r;
}

Tensor permute_rows_like(const Tensor& x, const PermuteResult& routing) {
  const RoutingDims& d = routing.dims;
  FLOWMOE_CHECK(x.dim() == 2 && x.size(0) == d.num_tokens, ShapeError, "permute_rows_like: x ", x.describe(),
                " must be [", d.num_tokens, ", H] (the routing's tokens)");
  const auto& scales = x.fp8_scales();
  FLOWMOE_CHECK(!scales || scales->mode == ScalingMode::rowwise_1x128, Error,
                "permute_rows_like: FP8 x must be rowwise 1x128, got ", scaling_mode_name(scales->mode));
  PermuteRowsLike op(d);
  std::vector<Tensor> in = {x, routing.row_map, routing.tokens_per_expert, routing.segment_starts,
                            scales ? scales->scale_inv : Tensor()};
  std::vector<Tensor> out = eval(op, in);
  return scales ? out[0].with_scales(out[1], ScalingMode::rowwise_1x128) : out[0];
}

}  // namespace flowmoe
