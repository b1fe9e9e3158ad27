// Row chunks of a [N, ...] tensor and back: the MoE layer's token chunks (parallel.exchange_chunks,
// layers/moe.cpp).
//   split_rows(x, bounds): chunk i is x[bounds[i], bounds[i+1]) as a view; FP8 rows keep the rows of their
//     rowwise 1x128 scales. vjp: the chunks' cotangents copied into one [N, ...] gradient (zero rows where a
//     chunk got none).
//   concat_rows(xs): one [Σ n_i, ...] tensor; vjp: row views of the cotangent.
//   concat_last(xs): [..., Σ C_i], each input's columns in turn (the MTP modules' [norm(h); norm(emb)],
//     layers/mtp.h; MLA's query and key parts, layers/mla.h): the inputs stacked as rows of their transposes,
//     then one strided copy interleaves them; vjp: the cotangent's column slices, copied.
//   split_last(x, widths): the column slices, copied; vjp: the cotangents joined back.
// Data movement through Tensor::slice and copy_, which run on the tensors' device: the CPU reference and the
// GPU path are the same code. Tests: tests/test_rows.cpp (values, FP8 scales, empty chunks, a
// finite-difference check; on a GPU, against the CPU).
#include <algorithm>

#include "engine/ops/ops.h"

namespace flowmoe {

namespace {

void check_bounds(const std::vector<int64_t>& bounds, int64_t rows) {
  FLOWMOE_CHECK(bounds.size() >= 2 && bounds.front() == 0 && bounds.back() == rows, ShapeError,
                "split_rows: bounds must run from 0 to the ", rows, " rows");
  for (size_t i = 1; i < bounds.size(); ++i)
    FLOWMOE_CHECK(bounds[i - 1] <= bounds[i], ShapeError, "split_rows: bounds must not decrease (", bounds[i - 1],
                  " then ", bounds[i], ")");
}

// parts[i] into rows [bounds[i], bounds[i+1]) of a new tensor; undefined parts leave zero rows.
Tensor join_rows(const std::vector<Tensor>& parts, const std::vector<int64_t>& bounds, const Shape& shape, DType dtype,
                 Device device) {
  bool all = true;
  for (const Tensor& p : parts) all = all && p.defined();
  Tensor out = all ? Tensor::empty(shape, dtype, device) : Tensor::zeros(shape, dtype, device);
  for (size_t i = 0; i < parts.size(); ++i)
    if (parts[i].defined() && bounds[i + 1] > bounds[i]) out.slice(0, bounds[i], bounds[i + 1]).copy_(parts[i]);
  return out;
}

class SplitRows : public Primitive {
 public:
  explicit SplitRows(std::vector<int64_t> bounds) : bounds_(std::move(bounds)) {}
  const char* name() const override { return "split_rows"; }
  bool saves_inputs() const override { return false; }
  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    FLOWMOE_CHECK(in[0].dim() >= 1, ShapeError, "split_rows: x ", in[0].describe(), " has no rows");
    check_bounds(bounds_, in[0].size(0));
    shape_ = in[0].shape();
    device_ = in[0].device();
    std::vector<Tensor> out;
    for (size_t i = 0; i + 1 < bounds_.size(); ++i) out.push_back(row_slice(in[0], bounds_[i], bounds_[i + 1]));
    return out;
  }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override { return eval_cpu(in); }
  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>&) override {
    DType dtype = DType::bf16;  // what the walk fills an FP8 output's missing cotangent with
    for (const Tensor& d : d_out)
      if (d.defined()) dtype = d.dtype();
    return {join_rows(d_out, bounds_, shape_, dtype, device_)};
  }

 private:
  std::vector<int64_t> bounds_;
  Shape shape_;
  Device device_;
};

class ConcatRows : public Primitive {
 public:
  const char* name() const override { return "concat_rows"; }
  bool saves_inputs() const override { return false; }
  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    FLOWMOE_CHECK(!in.empty() && in[0].dim() >= 1, ShapeError, "concat_rows: no tensors with rows");
    bounds_ = {0};
    Shape shape = in[0].shape();
    for (const Tensor& t : in) {
      Shape tail = t.shape();
      tail[0] = shape[0];
      FLOWMOE_CHECK(t.dim() == in[0].dim() && tail == shape && t.dtype() == in[0].dtype() && !t.fp8_scales(),
                    ShapeError, "concat_rows: ", t.describe(), " does not stack under ", in[0].describe(),
                    " (same trailing shape and dtype, no FP8 scales)");
      bounds_.push_back(bounds_.back() + t.size(0));
    }
    shape[0] = bounds_.back();
    return {join_rows(in, bounds_, shape, in[0].dtype(), in[0].device())};
  }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override { return eval_cpu(in); }
  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    std::vector<Tensor> d_in;
    for (size_t i = 0; i + 1 < bounds_.size(); ++i)
      d_in.push_back(needs[i] ? d_out[0].slice(0, bounds_[i], bounds_[i + 1]) : Tensor());
    return d_in;
  }

 private:
  std::vector<int64_t> bounds_;
};

// Each input [.., C_i] transposed into rows [C_i, N] of one [Σ C_i, N] tensor, whose transpose copied contiguous
// is [N, Σ C_i]: the inputs' columns side by side. The MTP projection joins two of one width, MLA (layers/mla.h)
// parts of different widths.
class ConcatLast : public Primitive {
 public:
  const char* name() const override { return "concat_last"; }
  bool saves_inputs() const override { return false; }
  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    FLOWMOE_CHECK(!in.empty() && in[0].dim() >= 1, ShapeError, "concat_last: no tensors with columns");
    shapes_.clear();
    int64_t width = 0;
    for (const Tensor& t : in) {
      Shape lead = t.shape(), lead0 = in[0].shape();
      lead.pop_back();
      lead0.pop_back();
      FLOWMOE_CHECK(t.dim() == in[0].dim() && lead == lead0 && t.dtype() == in[0].dtype() && !t.fp8_scales(),
                    ShapeError, "concat_last: ", t.describe(), " does not join ", in[0].describe(),
                    " (same leading shape and dtype, no FP8 scales)");
      shapes_.push_back(t.shape());
      width += t.shape().back();
    }
    const int64_t n = in[0].numel() / std::max<int64_t>(in[0].shape().back(), 1);
    Tensor cols = Tensor::empty({width, n}, in[0].dtype(), in[0].device());
    int64_t at = 0;
    for (const Tensor& t : in) {
      const int64_t c = t.shape().back();
      if (c > 0 && n > 0) cols.slice(0, at, at + c).copy_(t.contiguous().reshape({n, c}).transpose(0, 1));
      at += c;
    }
    Shape out = in[0].shape();
    out.back() = width;
    return {cols.transpose(0, 1).contiguous().reshape(out)};
  }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override { return eval_cpu(in); }
  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    const Tensor d = d_out[0].contiguous();
    const int last = d.dim() - 1;
    std::vector<Tensor> d_in;
    int64_t at = 0;
    for (size_t i = 0; i < shapes_.size(); ++i) {
      const int64_t c = shapes_[i].back();
      d_in.push_back(needs[i] ? d.slice(last, at, at + c).contiguous().reshape(shapes_[i]) : Tensor());
      at += c;
    }
    return d_in;
  }

 private:
  std::vector<Shape> shapes_;
};

// Column slices [.., widths[i]] of x [.., Σ widths], each copied contiguous; vjp: the cotangents joined back
// (zero columns where a part got none).
class SplitLast : public Primitive {
 public:
  explicit SplitLast(std::vector<int64_t> widths) : widths_(std::move(widths)) {}
  const char* name() const override { return "split_last"; }
  bool saves_inputs() const override { return false; }
  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    const Tensor& x = in[0];
    int64_t total = 0;
    for (int64_t w : widths_) total += w;
    FLOWMOE_CHECK(x.dim() >= 1 && x.shape().back() == total && !x.fp8_scales(), ShapeError,
                  "split_last: ", x.describe(), " does not split into widths adding up to ", total, " (no FP8 scales)");
    shape_ = x.shape();
    device_ = x.device();
    std::vector<Tensor> out;
    int64_t at = 0;
    for (int64_t w : widths_) {
      out.push_back(x.slice(x.dim() - 1, at, at + w).contiguous());
      at += w;
    }
    return out;
  }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override { return eval_cpu(in); }
  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>&) override {
    DType dtype = DType::f32;
    for (const Tensor& d : d_out)
      if (d.defined()) dtype = d.dtype();
    const int64_t n = shape_.back() > 0 ? shape_numel(shape_) / shape_.back() : 0;
    Tensor cols = Tensor::zeros({shape_.back(), n}, dtype, device_);
    int64_t at = 0;
    for (size_t i = 0; i < widths_.size(); ++i) {
      if (d_out[i].defined() && widths_[i] > 0 && n > 0)
        cols.slice(0, at, at + widths_[i]).copy_(d_out[i].contiguous().reshape({n, widths_[i]}).transpose(0, 1));
      at += widths_[i];
    }
    return {cols.transpose(0, 1).contiguous().reshape(shape_)};
  }

 private:
  std::vector<int64_t> widths_;
  Shape shape_;
  Device device_;
};

}  // namespace

Variable concat_last(const Variable& a, const Variable& b) {
  FLOWMOE_CHECK(a.data().shape() == b.data().shape(), ShapeError, "concat_last: ", a.data().describe(), " and ",
                b.data().describe(), " must share shape and dtype (no FP8 scales)");
  return concat_last(std::vector<Variable>{a, b});
}

Variable concat_last(const std::vector<Variable>& xs) { return flowmoe::apply(std::make_shared<ConcatLast>(), xs)[0]; }

std::vector<Variable> split_last(const Variable& x, const std::vector<int64_t>& widths) {
  return flowmoe::apply(std::make_shared<SplitLast>(widths), {x});
}

std::vector<Variable> split_rows(const Variable& x, const std::vector<int64_t>& bounds) {
  return flowmoe::apply(std::make_shared<SplitRows>(bounds), {x});
}

Variable concat_rows(const std::vector<Variable>& xs) { return flowmoe::apply(std::make_shared<ConcatRows>(), xs)[0]; }

Tensor row_slice(const Tensor& x, int64_t begin, int64_t end) {
  Tensor v = x.slice(0, begin, end);
  const auto& scales = x.fp8_scales();
  if (!scales) return v;
  FLOWMOE_CHECK(scales->mode == ScalingMode::rowwise_1x128, DTypeError,
                "row_slice: FP8 rows must carry rowwise 1x128 scales, got ", scaling_mode_name(scales->mode));
  return v.with_scales(scales->scale_inv.slice(0, begin, end), ScalingMode::rowwise_1x128);
}

std::vector<int64_t> even_row_bounds(int64_t rows, int num_chunks) {
  FLOWMOE_CHECK(rows >= 0 && num_chunks >= 1, ShapeError, "even_row_bounds: ", rows, " rows in ", num_chunks,
                " chunks");
  const int64_t per = (rows + num_chunks - 1) / num_chunks;
  std::vector<int64_t> bounds = {0};
  for (int i = 0; i < num_chunks; ++i) bounds.push_back(std::min(rows, bounds.back() + per));
  return bounds;
}

}  // namespace flowmoe
