// The differentiable ops of flowmoe, on Variables. Each is a Primitive (eval_cpu / eval_gpu / vjp)
// in engine/ops/<op>.cpp, with its CPU reference in kernels/cpu/<op>.cpp, its CUDA kernel in
// kernels/cuda/<op>.cu (launchers declared in kernels/<op>.h) and its tests in tests/test_<op>.cpp.
//
// Dtypes: the CPU backend computes in f32 or f64 (f64 is for gradient checks); the CUDA backend in
// f32 or bf16 (bf16 in and out, fp32 inside). All floating inputs of one op share one dtype and one
// device; a mismatch throws DTypeError / DeviceError naming both sides.
#pragma once
#include <utility>

#include "engine/autograd.h"
#include "kernels/attention_cudnn.h"
#include "kernels/common/counted_rows.h"

namespace flowmoe {

// ---- tensor-level helpers (no graph; used by the engine and optimizers) -----------------------
Tensor tensor_add(const Tensor& a, const Tensor& b);  // a + b, same shape
Tensor tensor_scale(const Tensor& a, double s);       // s * a
Tensor tensor_mul(const Tensor& a, const Tensor& b);  // a * b, same shape

// ---- elementwise: engine/ops/elementwise.cpp ---------------------------------------------------
Variable add(const Variable& a, const Variable& b);  // same shape
Variable mul(const Variable& a, const Variable& b);  // same shape
Variable scale(const Variable& a, double s);         // s * a
Variable cast(const Variable& a, DType to);          // f32 <-> bf16 (and f64 on cpu); grad casts back

// ---- matmul / linear: engine/ops/linear.cpp (cuBLASLt on GPU, Eigen on CPU) --------------------
Variable matmul(const Variable& a /*[M,K]*/, const Variable& b /*[K,N]*/);  // -> [M,N]
// y = x · wᵀ (+ bias). x [..., K], w [N, K], bias [N] or undefined -> y [..., N].
Variable linear(const Variable& x, const Variable& w, const Variable& bias = Variable());
// Rows of x [..., K] seen as a matrix [rows, K]: the product of the leading dims (1 for a 1-D x, also when K == 0).
int64_t leading_rows(const Tensor& x);

// ---- embedding: engine/ops/embedding.cpp -------------------------------------------------------
// out[..., :] = weight[ids[...], :]; ids i32 in [0, V) (out of range throws on cpu, traps on gpu).
Variable embedding(const Variable& weight /*[V,H]*/, const Tensor& ids /*[...] i32*/);  // -> [..., H]

// ---- normalisation and activations -------------------------------------------------------------
// y = x / sqrt(mean(x^2 over last dim) + eps) * weight. engine/ops/rmsnorm.cpp
Variable rmsnorm(const Variable& x /*[..., H]*/, const Variable& weight /*[H]*/, double eps);
Variable silu(const Variable& x);  // x * sigmoid(x). engine/ops/silu.cpp
// out = silu(gate) * up, gate = x[..., :F], up = x[..., F:]. engine/ops/swiglu.cpp
// row_counts: the expert GEMMs' device counts [E] i32 over a 2-D gate_up [M, 2F]: only the rows they cover
// (their sum) are computed, forward and backward, and the rest are left unwritten (kernels/common/counted_rows.h).
Variable swiglu(const Variable& gate_up /*[..., 2F]*/, const Tensor& row_counts = Tensor());  // -> [..., F]
// The rows a row kernel computes of x [..., C] (kernels/common/counted_rows.h): all of them, or with row_counts
// ([E] i32 on x's device, over a 2-D x) their sum, read on the host for a CPU tensor (host memory, no sync) and
// left to the kernel on a GPU (`counted` then points at them; the return is every row). Bad counts throw
// ShapeError or DeviceError naming `what`.
int64_t counted_host_rows(const Tensor& x, const Tensor& row_counts, const char* what, CountedRows* counted);

// ---- softmax and loss --------------------------------------------------------------------------
Variable softmax(const Variable& x);  // over the last dim. engine/ops/softmax.cpp
// Mean over rows whose target != ignore_index of -log softmax(logits)[target]; f32 scalar (shape {}).
// All rows ignored gives 0 (and zero gradients). engine/ops/cross_entropy.cpp
Variable cross_entropy(const Variable& logits /*[N,V]*/, const Tensor& targets /*[N] i32*/, int ignore_index = -100);

// ---- attention: engine/ops/rope.cpp, engine/ops/attention.cpp ---------------------------------
// Rotary embedding on pairs (x[2i], x[2i+1]) of each head, angle = (pos_offset + t) * theta^(-2i/hd).
Variable rope(const Variable& x /*[B,T,nh,hd]*/, double theta, int64_t pos_offset = 0);
// rope of an attention's queries and of its keys in one node (one kernel each way on the GPU), each the same bit for
// bit as rope alone; q and k share B, T, head_dim and dtype, their head counts may differ.
std::pair<Variable, Variable> rope_qk(const Variable& q /*[B,T,nh,hd]*/, const Variable& k /*[B,T,nk,hd]*/,
                                      double theta, int64_t pos_offset = 0);
// softmax(q·kᵀ / sqrt(hd) with a causal mask) · v, per batch and head. v's head width v_hd may differ from hd
// (MLA); on a GPU it must not exceed hd. backend (model.attention_kernel) picks the GPU kernels: the flash kernels
// of kernels/attention.h or cuDNN's (kernels/attention_cudnn.h); the CPU ignores it.
Variable causal_attention(const Variable& q /*[B,T,nh,hd]*/, const Variable& k /*[B,T,nh,hd]*/,
                          const Variable& v /*[B,T,nh,v_hd]*/,
                          AttentionBackend backend = AttentionBackend::flash);  // -> [B,T,nh,v_hd]

// ---- reductions: engine/ops/reduce.cpp ---------------------------------------------------------
Variable sum(const Variable& x);   // over all elements -> shape {} (f32 for bf16 input)
Variable mean(const Variable& x);  // over all elements -> shape {}; mean of nothing is 0

// ---- views (no copy when contiguous; gradient reshapes back) ---------------------------------
Variable reshape(const Variable& x, const Shape& shape);

// ---- row chunks: engine/ops/rows.cpp (views one way, one copy the other) ----------------------
// x [N, ...] -> x[bounds[i], bounds[i+1]) for each i (bounds from 0 to N, not decreasing); FP8 rows keep the
// rows of their rowwise scales. concat_rows stacks [n_i, ...] tensors of one dtype into [Σ n_i, ...].
std::vector<Variable> split_rows(const Variable& x, const std::vector<int64_t>& bounds);
Variable concat_rows(const std::vector<Variable>& xs);
// [a, b] along the last dim: a and b of one shape [..., C] and dtype -> [..., 2C].
Variable concat_last(const Variable& a, const Variable& b);
// xs [..., C_i] of one leading shape and dtype -> [..., Σ C_i], each one's columns in turn.
Variable concat_last(const std::vector<Variable>& xs);
// x [..., Σ widths] -> the parts [..., widths[i]] in turn (copies).
std::vector<Variable> split_last(const Variable& x, const std::vector<int64_t>& widths);
// num_chunks + 1 bounds over rows: chunks of ceil(rows / num_chunks), the last ones shorter or empty.
std::vector<int64_t> even_row_bounds(int64_t rows, int num_chunks);
// Rows [begin, end) of x as a view; FP8 rows keep the same rows of their rowwise 1x128 scales (Tensor::slice
// drops scales; another scaling is refused with DTypeError).
Tensor row_slice(const Tensor& x, int64_t begin, int64_t end);

}  // namespace flowmoe
