// Row-major GEMM through cuBLASLt, and linear's bias kernels.
//   C[m,n] = op(A)·op(B) (+ C) (+ bias[n]); f32 or bf16 operands, fp32 compute (CUBLAS_COMPUTE_32F,
//   never TF32, so f32 results agree with the CPU to ~1e-6). cuBLASLt is column-major: row-major C
//   is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ, so it is called with A and B swapped and m, n exchanged.
//   d_bias[n] = Σ_rows dy[:, n], fp32 sums in a fixed order.
// CPU reference: kernels/cpu/linear.cpp. Tests: tests/test_linear.cpp. Benchmark: bench/bench_linear.cpp.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "engine/cuda/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/linear.h"

namespace flowmoe {

// ---- kernels ----------------------------------------------------------------------------------

// c[i, j] += bias[j]: for k = 0, and where no cuBLASLt algorithm fuses the bias (then a bf16 c is
// rounded twice, once by the GEMM and once here).
template <class T>
__global__ void add_bias_kernel(T* __restrict__ c, const T* __restrict__ bias, int64_t m, int64_t n, int64_t ldc) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < m * n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t row = i / n, col = i - row * n;
    T* p = c + row * ldc + col;
    *p = from_float<T>(to_float(*p) + to_float(bias[col]));
  }
}

constexpr int kBiasCols = 32;       // columns per block: one warp reads them coalesced
constexpr int kBiasRowThreads = 8;  // rows read at once per block

// Block (x, y) sums rows [y·kBiasGradRows, (y+1)·kBiasGradRows) of 32 columns into partial[y, :].
template <class T>
__global__ void bias_grad_partial_kernel(float* __restrict__ partial, const T* __restrict__ dy, int64_t m, int64_t n) {
  __shared__ float sums[kBiasRowThreads][kBiasCols + 1];
  int64_t col = int64_t(blockIdx.x) * kBiasCols + threadIdx.x;
  int64_t row0 = int64_t(blockIdx.y) * kBiasGradRows;
  int64_t row_end = row0 + kBiasGradRows < m ? row0 + kBiasGradRows : m;
  float s = 0.f;
  if (col < n)
    for (int64_t r = row0 + threadIdx.y; r < row_end; r += kBiasRowThreads) s += to_float(dy[r * n + col]);
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    float t = 0.f;
    for (int y = 0; y < kBiasRowThreads; ++y) t += sums[y][threadIdx.x];
    partial[int64_t(blockIdx.y) * n + col] = t;
  }
}

template <class T>
__global__ void bias_grad_finish_kernel(T* __restrict__ d_bias, const float* __restrict__ partial, int64_t num_chunks,
                                        int64_t n) {
  for (int64_t col = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; col < n; col += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (int64_t c = 0; c < num_chunks; ++c) s += partial[c * n + col];
    d_bias[col] = from_float<T>(s);
  }
}

// ---- cuBLASLt state ---------------------------------------------------------------------------

namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // cuBLAS's recommendation for Hopper

cudaDataType_t cuda_type(DType t) { return t == DType::f32 ? CUDA_R_32F : CUDA_R_16BF; }

// Largest power of two (at most 256) dividing the address: cuBLASLt picks algorithms by alignment.
uint32_t alignment_of(const void* p) {
  auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a >>= 1;
  return a;
}

// Everything the algorithm choice depends on (the bias pointer's alignment included: the heuristic reads it).
struct PlanKey {
  int64_t m, n, k, lda, ldb, ldc;
  bool trans_a, trans_b, accumulate, has_bias;
  DType ab_dtype, c_dtype;
  uint32_t align_a, align_b, align_c, align_bias;
  bool operator==(const PlanKey&) const = default;
};
struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    size_t h = 0;
    auto mix = [&h](uint64_t v) { h ^= std::hash<uint64_t>{}(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    for (int64_t v : {k.m, k.n, k.k, k.lda, k.ldb, k.ldc}) mix(uint64_t(v));
    mix(uint64_t(k.trans_a) | uint64_t(k.trans_b) << 1 | uint64_t(k.accumulate) << 2 | uint64_t(k.has_bias) << 3 |
        uint64_t(k.ab_dtype) << 8 | uint64_t(k.c_dtype) << 16);
    mix(uint64_t(k.align_a) | uint64_t(k.align_b) << 16 | uint64_t(k.align_c) << 32 | uint64_t(k.align_bias) << 48);
    return h;
  }
};

struct Plan {
  cublasLtMatmulAlgo_t algo;
  bool fused_bias;  // false when bias is added by add_bias_kernel (or there is none)
};

// Per device: one handle, one plan cache, one workspace per stream (GEMMs on two streams may overlap).
// Never freed: releasing them at exit would race CUDA's own teardown.
struct DeviceContext {
  cublasLtHandle_t handle = nullptr;
  std::unordered_map<cudaStream_t, void*> workspaces;
  std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;
};

std::mutex g_mutex;  // guards g_contexts and everything in them
std::vector<std::unique_ptr<DeviceContext>> g_contexts;

DeviceContext& device_context(int device) {
  if (g_contexts.size() <= size_t(device)) g_contexts.resize(size_t(device) + 1);
  if (!g_contexts[size_t(device)]) {
    auto ctx = std::make_unique<DeviceContext>();
    MOE_CUBLAS_CHECK(cublasLtCreate(&ctx->handle));
    g_contexts[size_t(device)] = std::move(ctx);
  }
  return *g_contexts[size_t(device)];
}

void* stream_workspace(DeviceContext& ctx, cudaStream_t stream, int device) {
  void*& ws = ctx.workspaces[stream];
  if (!ws) ws = cuda_malloc_raw(kWorkspaceBytes, device);
  return ws;
}

// The descriptors of one call, destroyed on scope exit (also when a check throws).
struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;  // cuBLASLt's A (our b), B (our a), C = D
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descriptors() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// Column-major view of the problem: D[n, m] = op(our b)[n, k] · op(our a)[k, m]. A row-major [r, c]
// buffer with row stride ld is the column-major [c, r] matrix with leading dimension ld.
void make_descriptors(Descriptors& ds, const PlanKey& key, const void* bias, bool fuse_bias) {
  MOE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&ds.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t op_a = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t op_b = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  if (fuse_bias) {  // the bias has D's dtype, which is cuBLASLt's default bias type
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  const uint64_t m = uint64_t(key.m), n = uint64_t(key.n), k = uint64_t(key.k);
  MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ds.a, cuda_type(key.ab_dtype), key.trans_b ? k : n,
                                              key.trans_b ? n : k, key.ldb));
  MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ds.b, cuda_type(key.ab_dtype), key.trans_a ? m : k,
                                              key.trans_a ? k : m, key.lda));
  MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ds.d, cuda_type(key.c_dtype), n, m, key.ldc));

  MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&ds.pref));
  uint64_t ws_bytes = kWorkspaceBytes;
  MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(ds.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                        sizeof(ws_bytes)));
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_b},  // swapped operands
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c}};
  for (const auto& [attr, value] : aligns)
    MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(ds.pref, attr, &value, sizeof(value)));
}

// The heuristic's first choice, or nothing when it has no algorithm for this configuration.
std::optional<cublasLtMatmulAlgo_t> query_algo(cublasLtHandle_t handle, const PlanKey& key, const void* bias,
                                               bool fuse_bias) {
  Descriptors ds;
  make_descriptors(ds, key, bias, fuse_bias);
  cublasLtMatmulHeuristicResult_t result{};
  int num_results = 0;
  cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(handle, ds.op, ds.a, ds.b, ds.d, ds.d, ds.pref, 1, &result,
                                                    &num_results);
  if (s == CUBLAS_STATUS_NOT_SUPPORTED || (s == CUBLAS_STATUS_SUCCESS && num_results == 0)) return std::nullopt;
  MOE_CUBLAS_CHECK(s);
  return result.algo;
}

void launch_add_bias(DType dtype, void* c, const void* bias, int64_t m, int64_t n, int64_t ldc, cudaStream_t stream) {
  const int threads = 256;
  dispatch_cuda_float(dtype, "gemm_cuda bias", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    add_bias_kernel<<<grid_size(m * n, threads), threads, 0, stream>>>(static_cast<T*>(c), static_cast<const T*>(bias),
                                                                       m, n, ldc);
  });
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

// ---- launchers --------------------------------------------------------------------------------

void gemm_cuda(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, DType ab_dtype, const void* a, int64_t lda,
               const void* b, int64_t ldb, DType c_dtype, void* c, int64_t ldc, const void* bias, bool accumulate,
               cudaStream_t stream) {
  FLOWMOE_CHECK(m >= 0 && n >= 0 && k >= 0, ShapeError, "gemm_cuda: negative size m=", m, " n=", n, " k=", k);
  FLOWMOE_CHECK(ab_dtype == DType::f32 || ab_dtype == DType::bf16, DTypeError,
                "gemm_cuda: operands must be f32 or bf16, got ", dtype_name(ab_dtype));
  FLOWMOE_CHECK(c_dtype == DType::f32 || (c_dtype == DType::bf16 && ab_dtype == DType::bf16), DTypeError,
                "gemm_cuda: ", dtype_name(ab_dtype), " operands cannot write a ", dtype_name(c_dtype), " result");
  int64_t a_cols = trans_a ? m : k, b_cols = trans_b ? k : n;
  FLOWMOE_CHECK(lda >= std::max<int64_t>(1, a_cols) && ldb >= std::max<int64_t>(1, b_cols) &&
                    ldc >= std::max<int64_t>(1, n),
                ShapeError, "gemm_cuda: row strides lda=", lda, " ldb=", ldb, " ldc=", ldc,
                " are shorter than the rows (", a_cols, ", ", b_cols, ", ", n, ")");
  if (m == 0 || n == 0) return;
  FLOWMOE_CHECK(c != nullptr && (k == 0 || (a != nullptr && b != nullptr)), Error,
                "gemm_cuda: null operand for m=", m, " n=", n, " k=", k);

  if (k == 0) {  // an empty sum: cuBLASLt layouts cannot have zero columns, so write it directly
    size_t es = dtype_size(c_dtype);
    if (!accumulate) MOE_CUDA_CHECK(cudaMemset2DAsync(c, size_t(ldc) * es, 0, size_t(n) * es, size_t(m), stream));
    if (bias) launch_add_bias(c_dtype, c, bias, m, n, ldc, stream);
    return;
  }

  int device = cuda_current_device();
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceContext& ctx = device_context(device);
  PlanKey key{m, n, k, lda, ldb, ldc, trans_a, trans_b, accumulate, bias != nullptr, ab_dtype, c_dtype,
              alignment_of(a), alignment_of(b), alignment_of(c), alignment_of(bias)};
  auto it = ctx.plans.find(key);
  if (it == ctx.plans.end()) {
    std::optional<cublasLtMatmulAlgo_t> algo;
    if (bias) algo = query_algo(ctx.handle, key, bias, true);
    bool fused = algo.has_value();
    if (!algo) algo = query_algo(ctx.handle, key, bias, false);
    FLOWMOE_CHECK(algo.has_value(), CudaError, "gemm_cuda: cuBLASLt has no algorithm for m=", m, " n=", n, " k=", k,
                  " trans_a=", trans_a, " trans_b=", trans_b, " ", dtype_name(ab_dtype), " -> ",
                  dtype_name(c_dtype), " (lda ", lda, ", ldb ", ldb, ", ldc ", ldc, ")");
    it = ctx.plans.emplace(key, Plan{*algo, fused}).first;
  }
  const Plan& plan = it->second;
  void* workspace = stream_workspace(ctx, stream, device);

  Descriptors ds;
  make_descriptors(ds, key, bias, plan.fused_bias);
  float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  MOE_CUBLAS_CHECK(cublasLtMatmul(ctx.handle, ds.op, &alpha, b, ds.a, a, ds.b, &beta, c, ds.d, c, ds.d, &plan.algo,
                                  workspace, kWorkspaceBytes, stream));
  if (bias && !plan.fused_bias) launch_add_bias(c_dtype, c, bias, m, n, ldc, stream);
}

void bias_grad_cuda(DType dtype, void* d_bias, const void* dy, int64_t m, int64_t n, float* partial,
                    cudaStream_t stream) {
  FLOWMOE_CHECK(m >= 0 && n >= 0, ShapeError, "bias_grad_cuda: negative size m=", m, " n=", n);
  if (n == 0) return;
  FLOWMOE_CHECK(d_bias != nullptr, Error, "bias_grad_cuda: null d_bias");
  if (m == 0) {  // no rows: the gradient is zero (0 has all-zero bits in f32 and bf16)
    MOE_CUDA_CHECK(cudaMemsetAsync(d_bias, 0, size_t(n) * dtype_size(dtype), stream));
    return;
  }
  FLOWMOE_CHECK(dy != nullptr && partial != nullptr, Error, "bias_grad_cuda: null dy or partial");
  int64_t num_chunks = bias_grad_num_chunks(m);
  FLOWMOE_CHECK(num_chunks <= 65535, ShapeError, "bias_grad_cuda: ", m, " rows exceed the grid's limit of ",
                65535 * kBiasGradRows);
  dim3 grid(unsigned((n + kBiasCols - 1) / kBiasCols), unsigned(num_chunks)), block(kBiasCols, kBiasRowThreads);
  const int threads = 256;
  dispatch_cuda_float(dtype, "bias_grad_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    bias_grad_partial_kernel<<<grid, block, 0, stream>>>(partial, static_cast<const T*>(dy), m, n);
    MOE_CUDA_CHECK_LAUNCH();
    bias_grad_finish_kernel<<<grid_size(n, threads), threads, 0, stream>>>(static_cast<T*>(d_bias), partial,
                                                                            num_chunks, n);
  });
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
