// matmul and linear as autograd primitives, both on one row-major GEMM (kernels/linear.h).
//   matmul: c[M,N] = a[M,K]·b[K,N];            vjp: d_a = d_c·bᵀ, d_b = aᵀ·d_c
//   linear: y[...,N] = x[...,K]·w[N,K]ᵀ + bias; vjp: d_x = d_y·w, d_w = d_yᵀ·x, d_bias = Σ_rows d_y
// References: kernels/cpu/linear.cpp. CUDA: kernels/cuda/linear.cu. Tests: tests/test_linear.cpp.
#include <algorithm>

#include "engine/ops/ops.h"
#include "kernels/common/device_api.h"
#include "kernels/linear.h"

namespace flowmoe {

namespace {

// A 2-D operand as the GEMM takes it: packed row-major. A transposed view of packed data is passed
// as its packed transpose with the trans flag flipped, which saves a copy.
struct Operand {
  Tensor t;
  bool trans;
};
Operand as_operand(const Tensor& x, bool trans) {
  if (x.is_contiguous()) return {x, trans};
  Tensor xt = x.transpose(0, 1);
  if (xt.is_contiguous()) return {xt, !trans};
  return {x.contiguous(), trans};
}

struct GemmShape {
  int64_t m, n, k;
};
GemmShape gemm_shape(const Tensor& a, bool ta, const Tensor& b, bool tb) {
  return {ta ? a.size(1) : a.size(0), tb ? b.size(0) : b.size(1), ta ? a.size(0) : a.size(1)};
}

// c[m,n] = op(a)·op(b) (+ bias[n]); a, b 2-D with matching inner sizes, one dtype, one device.
Tensor gemm_cpu_tensor(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& bias) {
  auto [m, n, k] = gemm_shape(a, ta, b, tb);
  Operand oa = as_operand(a, ta), ob = as_operand(b, tb);
  Tensor c = Tensor::empty({m, n}, a.dtype(), a.device());
  Tensor bias_c = bias.defined() ? bias.contiguous() : bias;
  FLOWMOE_DISPATCH_CPU_FLOAT(a.dtype(), "matmul/linear", {
    gemm_cpu<scalar_t>(oa.trans, ob.trans, m, n, k, oa.t.data<scalar_t>(), ob.t.data<scalar_t>(), c.data<scalar_t>(),
                       false);
    if (bias_c.defined()) add_bias_cpu<scalar_t>(c.data<scalar_t>(), bias_c.data<scalar_t>(), m, n);
  });
  return c;
}

Tensor gemm_gpu_tensor(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& bias) {
  int device = a.device().index;
  if (cuda_current_device() != device) cuda_set_device(device);  // vjps run outside eval()
  auto [m, n, k] = gemm_shape(a, ta, b, tb);
  Operand oa = as_operand(a, ta), ob = as_operand(b, tb);
  Tensor c = Tensor::empty({m, n}, a.dtype(), a.device());
  Tensor bias_c = bias.defined() ? bias.contiguous() : bias;
  // Packed rows: the stored row length is the stride (cuBLASLt wants at least 1).
  int64_t lda = std::max<int64_t>(1, oa.trans ? m : k), ldb = std::max<int64_t>(1, ob.trans ? k : n);
  gemm_cuda(oa.trans, ob.trans, m, n, k, a.dtype(), oa.t.raw_data(), lda, ob.t.raw_data(), ldb, c.dtype(), c.raw_data(),
            std::max<int64_t>(1, n), bias_c.defined() ? bias_c.raw_data() : nullptr, false, current_stream(device));
  return c;
}

Tensor gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& bias = Tensor()) {
  check_same_device(a, b, "gemm");
  check_same_dtype(a, b, "gemm");
  return a.device().is_cpu() ? gemm_cpu_tensor(a, ta, b, tb, bias) : gemm_gpu_tensor(a, ta, b, tb, bias);
}

// d_bias[n] = Σ_m dy[m, n], in dy's dtype.
Tensor bias_grad(const Tensor& dy /*[m,n]*/) {
  Tensor d = dy.contiguous();
  int64_t m = d.size(0), n = d.size(1);
  Tensor out = Tensor::empty({n}, d.dtype(), d.device());
  if (d.device().is_cpu()) {
    FLOWMOE_DISPATCH_CPU_FLOAT(d.dtype(), "linear bias gradient",
                               bias_grad_cpu<scalar_t>(out.data<scalar_t>(), d.data<scalar_t>(), m, n));
    return out;
  }
  int device = d.device().index;
  if (cuda_current_device() != device) cuda_set_device(device);
  // Freed on return while the kernels may still run: safe, the allocator reuses in stream order.
  Tensor partial = Tensor::empty({bias_grad_num_chunks(m), n}, DType::f32, d.device());
  bias_grad_cuda(d.dtype(), out.raw_data(), d.raw_data(), m, n, partial.data<float>(), current_stream(device));
  return out;
}

void check_matmul(const Tensor& a, const Tensor& b) {
  check_same_device(a, b, "matmul");
  check_same_dtype(a, b, "matmul");
  FLOWMOE_CHECK(a.dim() == 2 && b.dim() == 2, ShapeError, "matmul: a ", shape_str(a.shape()), " and b ",
                shape_str(b.shape()), " must both be 2-D");
  FLOWMOE_CHECK(a.size(1) == b.size(0), ShapeError, "matmul: a ", shape_str(a.shape()), " and b ", shape_str(b.shape()),
                " do not chain (inner sizes ", a.size(1), " vs ", b.size(0), ")");
}

class MatMul : public Primitive {
 public:
  const char* name() const override { return "matmul"; }
  double flops(const std::vector<Tensor>& in) const override {
    return in.size() < 2 || in[0].dim() != 2 || in[1].dim() != 2
               ? 0
               : 2.0 * double(in[0].size(0)) * double(in[0].size(1)) * double(in[1].size(1));
  }
  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    check_matmul(in[0], in[1]);
    return {gemm_cpu_tensor(in[0], false, in[1], false, Tensor())};
  }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    check_matmul(in[0], in[1]);
    return {gemm_gpu_tensor(in[0], false, in[1], false, Tensor())};
  }
  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    return {needs[0] ? gemm(d_out[0], false, in[1], true) : Tensor(),
            needs[1] ? gemm(in[0], true, d_out[0], false) : Tensor()};
  }
};

void check_linear(const std::vector<Tensor>& in) {
  const Tensor &x = in[0], &w = in[1];
  check_same_device(x, w, "linear");
  check_same_dtype(x, w, "linear");
  FLOWMOE_CHECK(x.dim() >= 1 && w.dim() == 2, ShapeError, "linear: x ", shape_str(x.shape()), " and w ",
                shape_str(w.shape()), ": x needs at least 1 dim and w exactly 2");
  FLOWMOE_CHECK(x.size(-1) == w.size(1), ShapeError, "linear: x ", shape_str(x.shape()), " and w ",
                shape_str(w.shape()), " disagree on in-features (", x.size(-1), " vs ", w.size(1), ")");
  if (in.size() > 2) {
    const Tensor& bias = in[2];
    check_same_device(x, bias, "linear bias");
    check_same_dtype(x, bias, "linear bias");
    FLOWMOE_CHECK(bias.dim() == 1 && bias.size(0) == w.size(0), ShapeError, "linear: bias ", shape_str(bias.shape()),
                  " does not fit w ", shape_str(w.shape()), " (want [", w.size(0), "])");
  }
}

// Inputs {x, w} or {x, w, bias}.
class Linear : public SharedBodyPrimitive<Primitive> {
 public:
  const char* name() const override { return "linear"; }
  double flops(const std::vector<Tensor>& in) const override {
    return in.size() < 2 ? 0 : 2.0 * double(leading_rows(in[0])) * double(in[1].size(0)) * double(in[1].size(1));
  }
  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    const Tensor &x = in[0], &w = in[1];
    int64_t rows = leading_rows(x), n = w.size(0), k = w.size(1);
    Tensor dy = d_out[0].reshape({rows, n});
    std::vector<Tensor> grads(in.size());
    if (needs[0]) grads[0] = gemm(dy, false, w, false).reshape(x.shape());
    if (needs[1]) grads[1] = gemm(dy, true, x.reshape({rows, k}), false);
    if (in.size() > 2 && needs[2]) grads[2] = bias_grad(dy);
    return grads;
  }

 private:
  std::vector<Tensor> run(const std::vector<Tensor>& in, bool gpu) override {
    check_linear(in);
    const Tensor &x = in[0], &w = in[1];
    Tensor bias = in.size() > 2 ? in[2] : Tensor();
    Tensor x2 = x.reshape({leading_rows(x), w.size(1)});
    Tensor y = gpu ? gemm_gpu_tensor(x2, false, w, true, bias) : gemm_cpu_tensor(x2, false, w, true, bias);
    Shape out_shape = x.shape();
    out_shape.back() = w.size(0);
    return {y.view(out_shape)};
  }
};

}  // namespace

int64_t leading_rows(const Tensor& x) {
  int64_t rows = 1;
  for (int d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return rows;
}

Variable matmul(const Variable& a, const Variable& b) { return apply(std::make_shared<MatMul>(), {a, b})[0]; }

Variable linear(const Variable& x, const Variable& w, const Variable& bias) {
  if (bias.defined()) return apply(std::make_shared<Linear>(), {x, w, bias})[0];
  return apply(std::make_shared<Linear>(), {x, w})[0];
}

}  // namespace flowmoe
