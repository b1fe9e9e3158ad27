// AdamW update and deterministic sum reductions on the GPU, over many tensors per launch (math in
// kernels/adamw.h).
//   adamw:  a table of up to kTensorsPerLaunch tensors in the kernel's parameters; tensor t owns a run of
//           blocks that grid-stride over its n elements (f32 params and grads, f32 or bf16 moments, fp32 math),
//           writing its copy (f32, bf16 or none) beside: 8 elements per thread in 16-byte accesses (f32: two
//           per buffer) where every buffer of the tensor is 16-byte aligned, then one element per thread for
//           the rest. Elementwise, so the bits depend on neither the table nor the path.
//   sums:   pass 1 - each of a slice's G(n) <= kReduceMaxBlocks blocks reduces a grid-stride slice of it to
//           its partials; pass 2 - one block per slice adds its G partials. G depends on n only and no
//           atomics are used, so a slice gives the same bits alone or among others, run after run.
// CPU reference: kernels/cpu/adamw.cpp. Tests: tests/test_adamw.cpp, tests/test_adamw_multi.cpp,
// tests/test_bf16_moments.cpp.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/adamw.h"
#include "kernels/common/cuda_check.h"
#include "kernels/cuda/adamw_common.cuh"
#include "kernels/cuda/cuda_utils.cuh"

namespace flowmoe {

namespace {

constexpr int kThreads = 256;

static_assert(sizeof(LaunchTable<AdamWTensor>) <= 4096, "a launch's table must fit the kernel parameters");

// ---- kernels ----------------------------------------------------------------------------------

// Elements a thread updates at once on the 16-byte path.
constexpr int kVec = 8;

// kVec consecutive values at p (16-byte aligned) as f32, and back.
__device__ __forceinline__ void load_vec(const float* p, float (&x)[kVec]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}
__device__ __forceinline__ void load_vec(const uint16_t* p, float (&x)[kVec]) {
  const uint4 a = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x[2 * k] = bits_to_float(w[k] << 16);
    x[2 * k + 1] = bits_to_float(w[k] & 0xFFFF0000u);
  }
}
__device__ __forceinline__ void store_vec(float* p, const float (&x)[kVec]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(x[0], x[1], x[2], x[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(x[4], x[5], x[6], x[7]);
}
__device__ __forceinline__ void store_vec(uint16_t* p, const uint16_t (&b)[kVec]) {
  *reinterpret_cast<uint4*>(p) = make_uint4(b[0] | uint32_t(b[1]) << 16, b[2] | uint32_t(b[3]) << 16,
                                            b[4] | uint32_t(b[5]) << 16, b[6] | uint32_t(b[7]) << 16);
}

// Tensor t's elements this thread owns (thread `tid` of `stride`), with moments of type M (float, or uint16_t:
// bf16 bits).
template <class M>
__device__ __forceinline__ void update_tensor(const AdamWTensor& t, const AdamWStep& s, int64_t tid, int64_t stride) {
  float* __restrict__ param = t.param;
  const float* __restrict__ grad = t.grad;
  M* __restrict__ exp_avg = static_cast<M*>(t.exp_avg);
  M* __restrict__ exp_avg_sq = static_cast<M*>(t.exp_avg_sq);
  constexpr bool kNarrow = sizeof(M) == 2;
  const uint64_t stream = kNarrow ? rounding_stream(t.rounding.key, s.update) : 0;
  const int64_t n = t.n, first = t.rounding.first_index;
  const bool copy_f32 = t.copy.data && t.copy.dtype == DType::f32;
  const bool copy_bf16 = t.copy.data && t.copy.dtype == DType::bf16;
  const bool vec = aligned_to(param, 16) && aligned_to(grad, 16) && aligned_to(exp_avg, 16) &&
                   aligned_to(exp_avg_sq, 16) && (!t.copy.data || aligned_to(t.copy.data, 16));
  const int64_t n_vec = vec ? n / kVec * kVec : 0;
  for (int64_t i = tid * kVec; i < n_vec; i += stride * kVec) {
    float p[kVec], g[kVec], m[kVec], v[kVec];
    load_vec(param + i, p);
    load_vec(grad + i, g);
    load_vec(exp_avg + i, m);
    load_vec(exp_avg_sq + i, v);
#pragma unroll
    for (int k = 0; k < kVec; ++k) adamw_element(p[k], m[k], v[k], g[k], s);
    store_vec(param + i, p);
    if constexpr (kNarrow) {
      uint16_t mb[kVec], vb[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) round_moments_bf16(m[k], v[k], stream, first + i + k, &mb[k], &vb[k]);
      store_vec(exp_avg + i, mb);
      store_vec(exp_avg_sq + i, vb);
    } else {
      store_vec(exp_avg + i, m);
      store_vec(exp_avg_sq + i, v);
    }
    if (copy_f32) store_vec(static_cast<float*>(t.copy.data) + i, p);
    if (copy_bf16) {
      uint16_t c[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) c[k] = bf16_bits_rn(p[k]);
      store_vec(static_cast<uint16_t*>(t.copy.data) + i, c);
    }
  }
  for (int64_t i = n_vec + tid; i < n; i += stride) {
    float p = param[i], m = load_moment(exp_avg, i), v = load_moment(exp_avg_sq, i);
    adamw_element(p, m, v, grad[i], s);
    param[i] = p;
    if constexpr (kNarrow) {
      round_moments_bf16(m, v, stream, first + i, &exp_avg[i], &exp_avg_sq[i]);
    } else {
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
    }
    if (copy_f32) static_cast<float*>(t.copy.data)[i] = p;
    if (copy_bf16) static_cast<uint16_t*>(t.copy.data)[i] = bf16_bits_rn(p);
  }
}

}  // namespace

// control: null for steps given by value, else the step's scalars on the device (kernels/step_control.h).
__global__ void adamw_multi_kernel(const __grid_constant__ LaunchTable<AdamWTensor> table,
                                   const StepScalars* __restrict__ control) {
  if (control && !control->apply) return;  // a skipped step: parameters and moments stay as they are
  int first_block = 0, num_blocks = 0;
  const AdamWTensor& t = table.items[find_item(table, &first_block, &num_blocks)];
  const AdamWStep s = control ? scheduled_adamw_step(t.step, *control, t.lr_multiplier) : t.step;
  const int64_t tid = (blockIdx.x - first_block) * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(num_blocks) * blockDim.x;
  if (t.moment_dtype == DType::bf16)
    update_tensor<uint16_t>(t, s, tid, stride);
  else
    update_tensor<float>(t, s, tid, stride);
}

// Pass 1: slice t's block b writes partials[t * kReduceMaxBlocks + b].
template <bool kSquare>
__global__ void sum_partials_kernel(const __grid_constant__ LaunchTable<SumSlice> table, float* __restrict__ partials) {
  __shared__ float scratch[32];
  int first_block = 0, num_blocks = 0;
  const int t = find_item(table, &first_block, &num_blocks);
  const SumSlice& slice = table.items[t];
  const float* __restrict__ x = slice.x;
  const int64_t stride = int64_t(num_blocks) * blockDim.x;
  float acc = 0.f;
  for (int64_t i = (blockIdx.x - first_block) * int64_t(blockDim.x) + threadIdx.x; i < slice.n; i += stride) {
    float v = x[i];
    acc += kSquare ? v * v : v;
  }
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) partials[t * kReduceMaxBlocks + (blockIdx.x - first_block)] = acc;
}

// Pass 2: block t (kReduceMaxBlocks threads) adds slice t's partials; thread j holds partial j (or 0).
__global__ void sum_final_kernel(const __grid_constant__ LaunchTable<SumSlice> table,
                                 const float* __restrict__ partials) {
  __shared__ float scratch[32];
  const int t = blockIdx.x;
  const int num_partials = table.block_end[t] - (t ? table.block_end[t - 1] : 0);
  float v = int(threadIdx.x) < num_partials ? partials[t * kReduceMaxBlocks + threadIdx.x] : 0.f;
  v = block_sum(v, scratch);
  if (threadIdx.x == 0) *table.items[t].out = v;
}

// ---- launchers --------------------------------------------------------------------------------

// A reduction slice's pass-1 blocks: about 4 elements per thread, at most kReduceMaxBlocks (0 for none).
static int sum_blocks(int64_t n) {
  const int64_t want = (n + kThreads * 4 - 1) / (kThreads * 4);
  return int(std::min<int64_t>(want, kReduceMaxBlocks));
}

// An update's blocks per tensor: kVec elements per thread, grid-stride beyond 65536 blocks (cuda_utils.cuh).
static int update_blocks(int64_t n) { return int(grid_size((n + kVec - 1) / kVec, kThreads)); }

void adamw_multi_cuda(const AdamWTensor* tensors, int64_t num_tensors, const StepScalars* control,
                      cudaStream_t stream) {
  FLOWMOE_CHECK(num_tensors >= 0 && (tensors || num_tensors == 0), Error, "adamw_multi_cuda: ", num_tensors,
                " tensors");
  for (int64_t i = 0; i < num_tensors; ++i) {  // all checked before any is updated
    const AdamWTensor& t = tensors[i];
    FLOWMOE_CHECK(t.n >= 0, Error, "adamw_multi_cuda: tensor ", i, " has negative size ", t.n);
    FLOWMOE_CHECK(t.n == 0 || (t.param && t.grad && t.exp_avg && t.exp_avg_sq), Error, "adamw_multi_cuda: tensor ", i,
                  " has a null buffer for ", t.n, " elements");
    FLOWMOE_CHECK(!t.copy.data || t.copy.dtype == DType::f32 || t.copy.dtype == DType::bf16, DTypeError,
                  "adamw_multi_cuda: tensor ", i, " has a weight copy in ", dtype_name(t.copy.dtype), " (f32 or bf16)");
    FLOWMOE_CHECK(t.moment_dtype == DType::f32 || t.moment_dtype == DType::bf16, DTypeError,
                  "adamw_multi_cuda: tensor ", i, " has moments in ", dtype_name(t.moment_dtype), " (f32 or bf16)");
  }
  LaunchTable<AdamWTensor> table{};
  int num_blocks = 0;
  auto launch = [&] {
    if (table.num_items == 0) return;
    adamw_multi_kernel<<<num_blocks, kThreads, 0, stream>>>(table, control);
    FLOWMOE_CUDA_CHECK_LAUNCH();
    table.num_items = 0;
    num_blocks = 0;
  };
  for (int64_t i = 0; i < num_tensors; ++i) {
    if (tensors[i].n == 0) continue;  // nothing to update: no blocks
    num_blocks += update_blocks(tensors[i].n);
    table.items[table.num_items] = tensors[i];
    table.block_end[table.num_items++] = num_blocks;
    if (table.num_items == kTensorsPerLaunch) launch();
  }
  launch();
}

void adamw_cuda(float* param, const float* grad, void* exp_avg, void* exp_avg_sq, int64_t n, const AdamWStep& s,
                cudaStream_t stream, WeightCopy copy, DType moment_dtype, MomentRounding rounding) {
  const AdamWTensor t{param, grad, exp_avg, exp_avg_sq, n, s, moment_dtype, 1.0, copy, rounding};
  adamw_multi_cuda(&t, 1, nullptr, stream);
}

void adamw_scheduled_cuda(float* param, const float* grad, void* exp_avg, void* exp_avg_sq, int64_t n,
                          const AdamWStep& base, const StepScalars* control, double lr_multiplier, cudaStream_t stream,
                          WeightCopy copy, DType moment_dtype, MomentRounding rounding) {
  FLOWMOE_CHECK(control, Error, "adamw_scheduled_cuda: null step scalars");
  const AdamWTensor t{param, grad, exp_avg, exp_avg_sq, n, base, moment_dtype, lr_multiplier, copy, rounding};
  adamw_multi_cuda(&t, 1, control, stream);
}

// Slices of size 0 still get their pass-2 block, which writes 0.
template <bool kSquare>
static void sum_multi_cuda(const SumSlice* slices, int64_t num_slices, float* partials, cudaStream_t stream,
                           const char* what) {
  FLOWMOE_CHECK(num_slices >= 0 && (slices || num_slices == 0), Error, what, ": ", num_slices, " slices");
  FLOWMOE_CHECK(partials || num_slices == 0, Error, what, ": null scratch");
  for (int64_t i = 0; i < num_slices; ++i)  // all checked before any is summed
    FLOWMOE_CHECK(slices[i].n >= 0 && slices[i].out && (slices[i].x || slices[i].n == 0), Error, what, ": slice ", i,
                  " of ", slices[i].n, " elements has a null buffer or a negative size");
  for (int64_t begin = 0; begin < num_slices; begin += kTensorsPerLaunch) {
    LaunchTable<SumSlice> table{};
    int num_blocks = 0;
    table.num_items = int(std::min<int64_t>(num_slices - begin, kTensorsPerLaunch));
    for (int t = 0; t < table.num_items; ++t) {
      num_blocks += sum_blocks(slices[begin + t].n);
      table.items[t] = slices[begin + t];
      table.block_end[t] = num_blocks;
    }
    if (num_blocks > 0) {
      sum_partials_kernel<kSquare><<<num_blocks, kThreads, 0, stream>>>(table, partials);
      FLOWMOE_CUDA_CHECK_LAUNCH();
    }
    sum_final_kernel<<<table.num_items, kReduceMaxBlocks, 0, stream>>>(table, partials);
    FLOWMOE_CUDA_CHECK_LAUNCH();
  }
}

void sum_squares_multi_cuda(const SumSlice* slices, int64_t num_slices, float* partials, cudaStream_t stream) {
  sum_multi_cuda<true>(slices, num_slices, partials, stream, "sum_squares_multi_cuda");
}

void sum_values_multi_cuda(const SumSlice* slices, int64_t num_slices, float* partials, cudaStream_t stream) {
  sum_multi_cuda<false>(slices, num_slices, partials, stream, "sum_values_multi_cuda");
}

void sum_squares_cuda(const float* x, int64_t n, float* out, float* partials, cudaStream_t stream) {
  const SumSlice s{x, n, out};
  sum_squares_multi_cuda(&s, 1, partials, stream);
}

void sum_values_cuda(const float* x, int64_t n, float* out, float* partials, cudaStream_t stream) {
  const SumSlice s{x, n, out};
  sum_values_multi_cuda(&s, 1, partials, stream);
}

}  // namespace flowmoe
