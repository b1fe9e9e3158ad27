// embedding(weight, ids) as an autograd primitive (ids are not differentiable); its scatter-add
// backward is a primitive on the same device. Reference: kernels/cpu/embedding.cpp.
// Tests: tests/test_embedding.cpp.
#include "kernels/embedding.h"
#include "engine/ops/ops.h"
#include "kernels/common/device_api.h"

namespace flowmoe {

namespace {

void check_ids(const Tensor& ids, const char* what) {
  FLOWMOE_CHECK(ids.dtype() == DType::i32, DTypeError, what, ": ids must be i32, got ", ids.describe());
}

// ids.shape + [hidden]
Shape rows_shape(const Tensor& ids, int64_t hidden) {
  Shape s = ids.shape();
  s.push_back(hidden);
  return s;
}

// d_weight [vocab, H] from {d_out [..., H], ids [...]}.
class EmbeddingBackward : public BackwardPrimitive {
 public:
  EmbeddingBackward(int64_t vocab, DType weight_dtype) : vocab_(vocab), weight_dtype_(weight_dtype) {}
  const char* name() const override { return "embedding_backward"; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    int64_t hidden = check(in);
    Tensor d_out = in[0].contiguous(), ids = in[1].contiguous();
    Tensor d_weight = Tensor::empty({vocab_, hidden}, d_out.dtype(), d_out.device());
    FLOWMOE_DISPATCH_CPU_FLOAT(d_out.dtype(), name(),
                               embedding_backward_cpu<scalar_t>(d_weight.data<scalar_t>(), d_out.data<scalar_t>(),
                                                                ids.data<int32_t>(), ids.numel(), vocab_, hidden));
    return {d_weight};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    int64_t hidden = check(in);
    check_dtype(in[0], {DType::f32, DType::bf16}, name());
    Tensor d_out = in[0].contiguous(), ids = in[1].contiguous();
    Tensor d_weight = Tensor::empty({vocab_, hidden}, d_out.dtype(), d_out.device());
    size_t ws_bytes = embedding_backward_workspace_bytes(ids.numel());
    Tensor workspace = Tensor::empty({int64_t(ws_bytes)}, DType::u8, d_out.device());
    embedding_backward_cuda(d_out.dtype(), d_weight.raw_data(), d_out.raw_data(), ids.data<int32_t>(), ids.numel(),
                            vocab_, hidden, workspace.raw_data(), ws_bytes, current_stream(d_out.device().index));
    return {d_weight};
  }

 private:
  int64_t vocab_;
  DType weight_dtype_;

  int64_t check(const std::vector<Tensor>& in) const {
    check_ids(in[1], "embedding_backward");
    FLOWMOE_CHECK(in[0].dtype() == weight_dtype_, DTypeError, "embedding_backward: d_out ", in[0].describe(),
                  " does not match the weight's dtype ", dtype_name(weight_dtype_));
    FLOWMOE_CHECK(in[0].dim() == in[1].dim() + 1, ShapeError, "embedding_backward: d_out ", in[0].describe(),
                  " does not match ids ", in[1].describe());
    int64_t hidden = in[0].size(-1);
    FLOWMOE_CHECK(in[0].shape() == rows_shape(in[1], hidden), ShapeError, "embedding_backward: d_out ",
                  in[0].describe(), " does not match ids ", in[1].describe());
    return hidden;
  }
};

class Embedding : public Primitive {
 public:
  const char* name() const override { return "embedding"; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    check(in);
    Tensor weight = in[0].contiguous(), ids = in[1].contiguous();
    int64_t vocab = weight.size(0), hidden = weight.size(1);
    Tensor out = Tensor::empty(rows_shape(ids, hidden), weight.dtype(), weight.device());
    FLOWMOE_DISPATCH_CPU_FLOAT(weight.dtype(), name(),
                               embedding_forward_cpu<scalar_t>(out.data<scalar_t>(), weight.data<scalar_t>(),
                                                               ids.data<int32_t>(), ids.numel(), vocab, hidden));
    return {out};
  }

  // Ids are not checked on the host (that would need a synchronisation): a bad id traps on the device.
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    check(in);
    check_dtype(in[0], {DType::f32, DType::bf16}, name());
    Tensor weight = in[0].contiguous(), ids = in[1].contiguous();
    int64_t vocab = weight.size(0), hidden = weight.size(1);
    Tensor out = Tensor::empty(rows_shape(ids, hidden), weight.dtype(), weight.device());
    embedding_forward_cuda(weight.dtype(), out.raw_data(), weight.raw_data(), ids.data<int32_t>(), ids.numel(), vocab,
                           hidden, current_stream(weight.device().index));
    return {out};
  }

  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    if (!needs[0]) return {Tensor(), Tensor()};
    EmbeddingBackward bwd(in[0].size(0), in[0].dtype());
    return {eval(bwd, {d_out[0], in[1]})[0], Tensor()};
  }

 private:
  static void check(const std::vector<Tensor>& in) {
    FLOWMOE_CHECK(in[0].defined() && in[1].defined(), Error, "embedding: weight and ids must be defined");
    FLOWMOE_CHECK(in[0].dim() == 2, ShapeError, "embedding: weight must be [V, H], got ", in[0].describe(), " (ids ",
                  in[1].describe(), ")");
    check_ids(in[1], "embedding");
  }
};

}  // namespace

Variable embedding(const Variable& weight, const Tensor& ids) {
  return apply(std::make_shared<Embedding>(), {weight, Variable(ids)})[0];
}

}  // namespace flowmoe
