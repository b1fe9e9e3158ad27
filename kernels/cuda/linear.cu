// Row-major GEMM through cuBLASLt, and linear's bias kernels.
//   C[m,n] = op(A)·op(B) (+ C) (+ bias[n]); f32 or bf16 operands, fp32 compute (CUBLAS_COMPUTE_32F,
//   never TF32, so f32 results agree with the CPU to ~1e-6). cuBLASLt is column-major: row-major C
//   is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ, so it is called with A and B swapped and m, n exchanged.
//   d_bias[n] = Σ_rows dy[:, n], fp32 sums in a fixed order.
// Host cost: a repeat GEMM is a lock-free plan lookup plus cublasLtMatmul; algorithms are chosen per
//   bucket of m and k (row counts), so new per-expert counts reuse them (see "cuBLASLt plans").
// CPU reference: kernels/cpu/linear.cpp. Tests: tests/test_linear.cpp. Benchmark: bench/bench_linear.cpp.
#include <cuda_bf16.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cublaslt_cache.cuh"
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

// ---- cuBLASLt plans ---------------------------------------------------------------------------
// A repeat call must cost little more than cublasLtMatmul itself (grouped GEMMs issue ~100 small
// ones per layer), and a new per-expert row count must not cost a heuristic query (they change
// every training step). Hence two caches:
//   plans   (per device and host thread, no lock): exact problem -> descriptors initialised in place
//           + algorithm; a hit is one hash lookup, a bias-pointer update and the matmul.
//   choices (per device, shared, under a lock; only on a plan miss): heuristic results, keyed by the
//           problem with m and k rounded up to a bucket. A new exact shape takes its bucket's
//           algorithm once cublasLtMatmulAlgoCheck accepts it for that shape, else (rare) its own
//           exact query. Either way the algorithm is a function of the shape alone, not of call order.

namespace {

cudaDataType_t cuda_type(DType t) { return t == DType::f32 ? CUDA_R_32F : CUDA_R_16BF; }

// The plan key and the bucket whose heuristic answer it borrows: kernels/plan_keys.h.
using PlanKey = LinearPlanKey;
using PlanKeyHash = LinearPlanKeyHash;

struct Choice {
  cublasLtMatmulAlgo_t algo;
  bool fused_bias;  // false when bias is added by add_bias_kernel (or there is none)
};

// Descriptors live in cuBLASLt's semi-opaque structs, initialised in place: no heap, nothing to destroy.
struct Layouts {
  cublasLtMatrixLayoutOpaque_t a, b, d;  // cuBLASLt's A (our b), B (our a), C = D
};

// Column-major view of the problem: D[n, m] = op(our b)[n, k] · op(our a)[k, m]. A row-major [r, c]
// buffer with row stride ld is the column-major [c, r] matrix with leading dimension ld.
void init_layouts(Layouts& l, const PlanKey& key) {
  const uint64_t m = uint64_t(key.m), n = uint64_t(key.n), k = uint64_t(key.k);
  FLOWMOE_CUBLAS_CHECK(
      cublasLtMatrixLayoutInit(&l.a, cuda_type(key.ab_dtype), key.trans_b ? k : n, key.trans_b ? n : k, key.ldb));
  FLOWMOE_CUBLAS_CHECK(
      cublasLtMatrixLayoutInit(&l.b, cuda_type(key.ab_dtype), key.trans_a ? m : k, key.trans_a ? k : m, key.lda));
  FLOWMOE_CUBLAS_CHECK(cublasLtMatrixLayoutInit(&l.d, cuda_type(key.c_dtype), n, m, key.ldc));
}

void init_op(cublasLtMatmulDescOpaque_t& op, const PlanKey& key, const void* bias, bool fuse_bias) {
  FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescInit(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t op_a = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t op_b = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  if (fuse_bias) {  // the bias has D's dtype, which is cuBLASLt's default bias type
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    FLOWMOE_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(&op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
}

std::atomic<uint64_t> g_heuristic_queries{0}, g_plans_built{0}, g_bucket_rejects{0};

// The heuristic's first choice for `key` (with the bias fused into the epilogue when possible), or
// nothing when it has no algorithm for this configuration.
std::optional<Choice> query_heuristic(cublasLtHandle_t handle, const PlanKey& key, const void* bias) {
  g_heuristic_queries.fetch_add(1, std::memory_order_relaxed);
  Layouts l;
  init_layouts(l, key);
  cublasLtMatmulPreferenceOpaque_t pref;
  init_lt_preference(pref, key.align_b, key.align_a, key.align_c, key.align_c);  // swapped operands
  for (bool fuse : {true, false}) {
    if (fuse && !key.has_bias) continue;
    cublasLtMatmulDescOpaque_t op;
    init_op(op, key, bias, fuse);
    cublasLtMatmulHeuristicResult_t result{};
    int num_results = 0;
    cublasStatus_t s =
        cublasLtMatmulAlgoGetHeuristic(handle, &op, &l.a, &l.b, &l.d, &l.d, &pref, 1, &result, &num_results);
    if (s == CUBLAS_STATUS_NOT_SUPPORTED || (s == CUBLAS_STATUS_SUCCESS && num_results == 0)) continue;
    FLOWMOE_CUBLAS_CHECK(s);
    return Choice{result.algo, fuse};
  }
  return std::nullopt;
}

struct Plan {
  Layouts layouts;
  cublasLtMatmulDescOpaque_t op;  // its bias pointer is set on every call that fuses the bias
  Choice choice;
  bool exact;  // choice was made for this exact shape (false: borrowed from its bucket)
};

// Handles, workspaces, heuristic answers and plans: kernels/cuda/cublaslt_cache.cuh.
using Cache = LtCache<PlanKey, PlanKeyHash, Choice, Plan>;

// Whether `choice` (made for another shape of the bucket) runs the exact problem described by p's
// layouts; initialises p.op for it either way.
bool check_choice(cublasLtHandle_t handle, Plan& p, const PlanKey& key, const void* bias, const Choice& choice) {
  init_op(p.op, key, bias, choice.fused_bias);
  cublasLtMatmulHeuristicResult_t result{};
  cublasStatus_t s = cublasLtMatmulAlgoCheck(handle, &p.op, &p.layouts.a, &p.layouts.b, &p.layouts.d, &p.layouts.d,
                                             &choice.algo, &result);
  return s == CUBLAS_STATUS_SUCCESS && result.workspaceSize <= kLtWorkspaceBytes;
}

// Fills p (descriptors, algorithm) for the exact problem `key`: the bucket's choice when AlgoCheck
// accepts it, else one made for this shape (always, with exact_only: the bucket's was refused).
void build_plan(Cache::Thread& td, Plan& p, const PlanKey& key, const void* bias, bool exact_only) {
  init_layouts(p.layouts, key);
  std::lock_guard<std::mutex> lock(Cache::mutex());  // heuristic queries are rare: holding the lock keeps this simple
  const Cache::Chosen c = Cache::choose(
      Cache::shared(td.device), key, linear_bucket_key(key), exact_only,
      [&](const PlanKey& k) { return query_heuristic(td.handle, k, bias); },
      [&](const Choice& choice) { return check_choice(td.handle, p, key, bias, choice); });
  if (c.bucket_refused) g_bucket_rejects.fetch_add(1, std::memory_order_relaxed);
  FLOWMOE_CHECK(c.choice, CudaError, "gemm_cuda: cuBLASLt has no algorithm for m=", key.m, " n=", key.n, " k=", key.k,
                " trans_a=", key.trans_a, " trans_b=", key.trans_b, " ", dtype_name(key.ab_dtype), " -> ",
                dtype_name(key.c_dtype), " (lda ", key.lda, ", ldb ", key.ldb, ", ldc ", key.ldc, ")");
  p.choice = *c.choice;
  p.exact = c.exact;
  init_op(p.op, key, bias, p.choice.fused_bias);  // for the choice made (check_choice may have set a refused one)
}

cublasStatus_t run_plan(Cache::Thread& td, Plan& p, const void* a, const void* b, void* c, const void* bias,
                        bool accumulate, void* workspace, cudaStream_t stream) {
  if (p.choice.fused_bias)  // the cached descriptor still holds the previous call's bias
    FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  return cublasLtMatmul(td.handle, &p.op, &alpha, b, &p.layouts.a, a, &p.layouts.b, &beta, c, &p.layouts.d, c,
                        &p.layouts.d, &p.choice.algo, workspace, kLtWorkspaceBytes, stream);
}

void launch_add_bias(DType dtype, void* c, const void* bias, int64_t m, int64_t n, int64_t ldc, cudaStream_t stream) {
  const int threads = 256;
  dispatch_cuda_float(dtype, "gemm_cuda bias", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    add_bias_kernel<<<grid_size(m * n, threads), threads, 0, stream>>>(static_cast<T*>(c), static_cast<const T*>(bias),
                                                                       m, n, ldc);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
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
  FLOWMOE_CHECK(
      lda >= std::max<int64_t>(1, a_cols) && ldb >= std::max<int64_t>(1, b_cols) && ldc >= std::max<int64_t>(1, n),
      ShapeError, "gemm_cuda: row strides lda=", lda, " ldb=", ldb, " ldc=", ldc, " are shorter than the rows (",
      a_cols, ", ", b_cols, ", ", n, ")");
  if (m == 0 || n == 0) return;
  FLOWMOE_CHECK(c != nullptr && (k == 0 || (a != nullptr && b != nullptr)), Error, "gemm_cuda: null operand for m=", m,
                " n=", n, " k=", k);

  if (k == 0) {  // an empty sum: cuBLASLt layouts cannot have zero columns, so write it directly
    size_t es = dtype_size(c_dtype);
    if (!accumulate) FLOWMOE_CUDA_CHECK(cudaMemset2DAsync(c, size_t(ldc) * es, 0, size_t(n) * es, size_t(m), stream));
    if (bias) launch_add_bias(c_dtype, c, bias, m, n, ldc, stream);
    return;
  }

  Cache::Thread& td = Cache::thread(cuda_current_device());
  const PlanKey key{m,
                    n,
                    k,
                    lda,
                    ldb,
                    ldc,
                    trans_a,
                    trans_b,
                    accumulate,
                    bias != nullptr,
                    ab_dtype,
                    c_dtype,
                    alignment_of(a),
                    alignment_of(b),
                    alignment_of(c),
                    alignment_of(bias)};
  auto [it, inserted] = td.plans.try_emplace(key);
  Plan& plan = it->second;
  if (inserted) {
    g_plans_built.fetch_add(1, std::memory_order_relaxed);
    try {
      build_plan(td, plan, key, bias, false);
    } catch (...) {
      td.plans.erase(it);  // no half-built plan survives a throw
      throw;
    }
  }
  void* workspace = Cache::workspace(td, stream);
  cublasStatus_t s = run_plan(td, plan, a, b, c, bias, accumulate, workspace, stream);
  if (s != CUBLAS_STATUS_SUCCESS && !plan.exact) {  // AlgoCheck is not a guarantee: choose for this shape
    g_bucket_rejects.fetch_add(1, std::memory_order_relaxed);
    build_plan(td, plan, key, bias, true);
    s = run_plan(td, plan, a, b, c, bias, accumulate, workspace, stream);
  }
  FLOWMOE_CHECK(s == CUBLAS_STATUS_SUCCESS, CudaError, "gemm_cuda: cublasLtMatmul failed: ", cublasLtGetStatusString(s),
                " (", int(s), ") for m=", m, " n=", n, " k=", k, " trans_a=", trans_a, " trans_b=", trans_b, " ",
                dtype_name(ab_dtype), " -> ", dtype_name(c_dtype));
  if (bias && !plan.choice.fused_bias) launch_add_bias(c_dtype, c, bias, m, n, ldc, stream);
}

GemmPlanStats gemm_cuda_plan_stats() {
  return {g_heuristic_queries.load(std::memory_order_relaxed), g_plans_built.load(std::memory_order_relaxed),
          g_bucket_rejects.load(std::memory_order_relaxed)};
}

void bias_grad_cuda(DType dtype, void* d_bias, const void* dy, int64_t m, int64_t n, float* partial,
                    cudaStream_t stream) {
  FLOWMOE_CHECK(m >= 0 && n >= 0, ShapeError, "bias_grad_cuda: negative size m=", m, " n=", n);
  if (n == 0) return;
  FLOWMOE_CHECK(d_bias != nullptr, Error, "bias_grad_cuda: null d_bias");
  if (m == 0) {  // no rows: the gradient is zero (0 has all-zero bits in f32 and bf16)
    FLOWMOE_CUDA_CHECK(cudaMemsetAsync(d_bias, 0, size_t(n) * dtype_size(dtype), stream));
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
    FLOWMOE_CUDA_CHECK_LAUNCH();
    bias_grad_finish_kernel<<<grid_size(n, threads), threads, 0, stream>>>(static_cast<T*>(d_bias), partial, num_chunks,
                                                                           n);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
