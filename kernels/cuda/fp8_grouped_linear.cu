// FP8 GroupedLinear on the GPU: one cuBLASLt block-scaled GEMM per expert (e4m3, fp32 compute), in
// expert order. cuBLASLt is column-major and takes FP8 only in the "TN" form (both operands K-contiguous):
//   fprop  D[n, r_e] = W_e[n, k] · X_eᵀ      A = w[e] (T, lda k, BLK128x128 [n/128][k/128]),
//                                          B = x_e  (N, ldb k, VEC128 [k/128][r_e], rows contiguous)
//          D column-major [n, r_e], ld n = y_e row-major.  x's rowwise scales [m_total][k/128] are re-laid
//          out per expert by scale_relayout_kernel into the caller's workspace first (DESIGN.md §4).
//   wgrad  D[k, n] = X_eᵀ[k, r_e] · dY_e[r_e, n]   A = x_t + off_e (T, lda m_total), B = dy_t + off_e
//          (N, ldb m_total), both VEC128 with their segment's packed [blocks_e, k|n] scale slice;
//          D column-major [k, n], ld k = dw[e] row-major [n, k], beta 1 when accumulating.
// Plans (descriptors + algorithm) are cached per exact problem (kernels/cuda/cublaslt_cache.cuh, shared
// with linear.cu); algorithms are chosen per bucket of the row count (cuBLASLt's n in fprop, k in wgrad).
// CPU reference: kernels/cpu/fp8_grouped_linear.cpp. Tests: tests/test_fp8_grouped_linear.cpp.
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <optional>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cublaslt_cache.cuh"
#include "kernels/cuda/stream_fan.cuh"
#include "kernels/fp8.h"
#include "kernels/fp8_grouped_linear.h"
#include "kernels/grouped_linear.h"

namespace flowmoe {

namespace {

// ---- kernels ----------------------------------------------------------------------------------

// Absolute row offsets of a chunk of experts, passed by value (2 KiB of kernel parameters): no
// host-to-device copy and no sync; more experts take several launches.
constexpr int kMaxExpertsPerLaunch = 256;
struct ExpertRows {
  int64_t off[kMaxExpertsPerLaunch + 1];
};

// Expert blockIdx.z of the chunk: ws[off*kb + b*rows + r] = xs[(off + r)*kb + b], a 32x32 tiled
// transpose of its [rows][kb] scale block (rows a multiple of kFp8RowMultiple, kb = k/kFp8BlockSize).
__global__ void scale_relayout_kernel(float* __restrict__ ws, const float* __restrict__ xs, ExpertRows chunk,
                                      int64_t kb) {
  __shared__ float tile[32][33];
  const int64_t r0 = chunk.off[blockIdx.z], rows = chunk.off[blockIdx.z + 1] - r0;
  const int64_t b0 = int64_t(blockIdx.y) * 32;
  for (int64_t t0 = int64_t(blockIdx.x) * 32; t0 < rows; t0 += int64_t(gridDim.x) * 32) {
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
      int64_t r = t0 + i, b = b0 + threadIdx.x;
      if (r < rows && b < kb) tile[i][threadIdx.x] = xs[(r0 + r) * kb + b];
    }
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
      int64_t b = b0 + i, r = t0 + threadIdx.x;
      if (r < rows && b < kb) ws[r0 * kb + b * rows + r] = tile[threadIdx.x][i];
    }
    __syncthreads();
  }
}

// w_pad[e][i][j] = w[e][i][j] for j < kb, 1 in the padding: the 128x128 scale grid with its K-block
// stride padded to kb4 = round_up(kb, 4), the stride cuBLASLt reads (see the header).
__global__ void weight_scale_pad_kernel(float* __restrict__ w_pad, const float* __restrict__ w, int64_t num_rows,
                                        int64_t kb, int64_t kb4) {
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < num_rows * kb4;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = idx / kb4, j = idx % kb4;
    w_pad[idx] = j < kb ? w[row * kb + j] : 1.f;
  }
}

// ---- cuBLASLt plans ---------------------------------------------------------------------------

// cuBLASLt's view: D[m, n] (column-major, ldd) = op(A)[m, k] · op(B)[k, n], A stored [k, m] (lda), B [k, n].
struct PlanKey {
  int64_t m, n, k, lda, ldb, ldd;
  bool wgrad, accumulate;  // wgrad: A VEC128 (else BLK128x128); B is always VEC128
  DType d_dtype;
  uint32_t align_a, align_b, align_d;
  bool operator==(const PlanKey&) const = default;
};
struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    size_t h = 0;
    for (int64_t v : {k.m, k.n, k.k, k.lda, k.ldb, k.ldd}) hash_mix(h, uint64_t(v));
    hash_mix(h, uint64_t(k.wgrad) | uint64_t(k.accumulate) << 1 | uint64_t(k.d_dtype) << 8 | uint64_t(k.align_a) << 16 |
                    uint64_t(k.align_b) << 32 | uint64_t(k.align_d) << 48);
    return h;
  }
};

// Quarter-octave buckets that stay multiples of kFp8RowMultiple (FP8 leading dimensions): 16, 32, 48, 64, 80, 96,
// 112, 128, 160, 192, 224, 256, 320, ..., 1024, 1280, ... A new row count reuses its bucket's algorithm.
int64_t bucket_of(int64_t v) { return quarter_octave_bucket(v, kFp8RowMultiple); }
PlanKey bucket_key(PlanKey key) {
  if (!key.wgrad) {
    key.n = bucket_of(key.n);
  } else {  // the inner dim is the row count; lda = ldb = m_total moves every step too (and stays >= k)
    key.k = bucket_of(key.k);
    key.lda = key.ldb = bucket_of(key.lda);
  }
  return key;
}

struct Layouts {
  cublasLtMatrixLayoutOpaque_t a, b, d;  // C = D
};
void init_layouts(Layouts& l, const PlanKey& key) {
  FLOWMOE_CUBLAS_CHECK(cublasLtMatrixLayoutInit(&l.a, CUDA_R_8F_E4M3, uint64_t(key.k), uint64_t(key.m), key.lda));
  FLOWMOE_CUBLAS_CHECK(cublasLtMatrixLayoutInit(&l.b, CUDA_R_8F_E4M3, uint64_t(key.k), uint64_t(key.n), key.ldb));
  FLOWMOE_CUBLAS_CHECK(cublasLtMatrixLayoutInit(&l.d, key.d_dtype == DType::f32 ? CUDA_R_32F : CUDA_R_16BF,
                                                uint64_t(key.m), uint64_t(key.n), key.ldd));
}
void set_scales(cublasLtMatmulDescOpaque_t& op, const float* a_scale, const float* b_scale) {
  FLOWMOE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(&op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale)));
  FLOWMOE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(&op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale)));
}
// The heuristic refuses block-scaled problems (status 7) while the scale pointers are null: set them here.
void init_op(cublasLtMatmulDescOpaque_t& op, const PlanKey& key, const float* a_scale, const float* b_scale) {
  FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescInit(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_a = CUBLAS_OP_T, op_b = CUBLAS_OP_N;
  const int32_t mode_a =
      key.wgrad ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const int32_t mode_b = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)));
  FLOWMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)));
  set_scales(op, a_scale, b_scale);
}

std::optional<cublasLtMatmulAlgo_t> query_heuristic(cublasLtHandle_t handle, const PlanKey& key, const float* a_scale,
                                                    const float* b_scale) {
  Layouts l;
  init_layouts(l, key);
  cublasLtMatmulDescOpaque_t op;
  init_op(op, key, a_scale, b_scale);
  cublasLtMatmulPreferenceOpaque_t pref;
  init_lt_preference(pref, key.align_a, key.align_b, key.align_d, key.align_d);
  cublasLtMatmulHeuristicResult_t result{};
  int num_results = 0;
  cublasStatus_t s =
      cublasLtMatmulAlgoGetHeuristic(handle, &op, &l.a, &l.b, &l.d, &l.d, &pref, 1, &result, &num_results);
  if (s == CUBLAS_STATUS_NOT_SUPPORTED || (s == CUBLAS_STATUS_SUCCESS && num_results == 0)) return std::nullopt;
  FLOWMOE_CUBLAS_CHECK(s);
  return result.algo;
}

struct Plan {
  Layouts layouts;
  cublasLtMatmulDescOpaque_t op;  // its scale pointers are set on every call
  cublasLtMatmulAlgo_t algo;
  bool exact;  // chosen for this exact shape (false: borrowed from its bucket)
};

// Handles, workspaces, heuristic answers and plans: kernels/cuda/cublaslt_cache.cuh.
using Cache = LtCache<PlanKey, PlanKeyHash, cublasLtMatmulAlgo_t, Plan>;

bool algo_fits(cublasLtHandle_t handle, Plan& p, const cublasLtMatmulAlgo_t& algo) {
  cublasLtMatmulHeuristicResult_t result{};
  cublasStatus_t s =
      cublasLtMatmulAlgoCheck(handle, &p.op, &p.layouts.a, &p.layouts.b, &p.layouts.d, &p.layouts.d, &algo, &result);
  return s == CUBLAS_STATUS_SUCCESS && result.workspaceSize <= kLtWorkspaceBytes;
}

[[noreturn]] void throw_no_algorithm(const PlanKey& key) {
  if (key.wgrad && key.k % kFp8BlockSize != 0)  // the open question of DESIGN.md §4: partial 1x128 blocks
    FLOWMOE_THROW(CudaError, "fp8_grouped_wgrad_cuda: cuBLASLt has no VEC128 x VEC128 algorithm for an expert of ",
                  key.k, " rows (N=", key.n, " K=", key.m, ", M_total ", key.lda, "): the reduction dim is not a ",
                  "multiple of ", kFp8BlockSize, ", so its last 1x", kFp8BlockSize,
                  " block is partial; pad the segments to ", kFp8BlockSize, " rows");
  FLOWMOE_THROW(CudaError, key.wgrad ? "fp8_grouped_wgrad_cuda" : "fp8_grouped_gemm_cuda",
                ": cuBLASLt has no block-scaled FP8 algorithm for m=", key.m, " n=", key.n, " k=", key.k, " (lda ",
                key.lda, ", ldb ", key.ldb, ", ldd ", key.ldd, ", out ", dtype_name(key.d_dtype), ", alignments ",
                key.align_a, "/", key.align_b, "/", key.align_d, ")");
}

// Fills p for `key`: its bucket's algorithm when AlgoCheck accepts it, else one chosen for this shape.
void build_plan(Cache::Thread& td, Plan& p, const PlanKey& key, const float* a_scale, const float* b_scale,
                bool exact_only) {
  init_layouts(p.layouts, key);
  init_op(p.op, key, a_scale, b_scale);
  std::lock_guard<std::mutex> lock(Cache::mutex());  // heuristic queries are rare: holding the lock keeps this simple
  const Cache::Chosen c = Cache::choose(
      Cache::shared(td.device), key, bucket_key(key), exact_only,
      [&](const PlanKey& k) { return query_heuristic(td.handle, k, a_scale, b_scale); },
      [&](const cublasLtMatmulAlgo_t& algo) { return algo_fits(td.handle, p, algo); });
  if (!c.choice) throw_no_algorithm(key);
  p.algo = *c.choice;
  p.exact = c.exact;
}

// One GEMM: plan lookup (built on a miss), scale pointers, cublasLtMatmul; C = D.
void run_gemm(const PlanKey& key, const void* a, const float* a_scale, const void* b, const float* b_scale, void* d,
              cudaStream_t stream) {
  Cache::Thread& td = Cache::thread(cuda_current_device());
  auto [it, inserted] = td.plans.try_emplace(key);
  Plan& plan = it->second;
  if (inserted) {
    try {
      build_plan(td, plan, key, a_scale, b_scale, false);
    } catch (...) {
      td.plans.erase(it);  // no half-built plan survives a throw
      throw;
    }
  }
  void* workspace = Cache::workspace(td, stream);
  const float alpha = 1.f, beta = key.accumulate ? 1.f : 0.f;
  auto matmul = [&] {
    set_scales(plan.op, a_scale, b_scale);
    return cublasLtMatmul(td.handle, &plan.op, &alpha, a, &plan.layouts.a, b, &plan.layouts.b, &beta, d,
                          &plan.layouts.d, d, &plan.layouts.d, &plan.algo, workspace, kLtWorkspaceBytes, stream);
  };
  cublasStatus_t s = matmul();
  if (s != CUBLAS_STATUS_SUCCESS && !plan.exact) {  // AlgoCheck is not a guarantee: choose for this shape
    build_plan(td, plan, key, a_scale, b_scale, true);
    s = matmul();
  }
  FLOWMOE_CHECK(s == CUBLAS_STATUS_SUCCESS, CudaError, key.wgrad ? "fp8_grouped_wgrad_cuda" : "fp8_grouped_gemm_cuda",
                ": cublasLtMatmul failed: ", cublasLtGetStatusString(s), " (", int(s), ") for m=", key.m, " n=", key.n,
                " k=", key.k, " out ", dtype_name(key.d_dtype));
}

// Shared argument checks; returns sum(padded_tokens_per_expert).
int64_t check_args(const int64_t* padded_tokens_per_expert, int64_t num_experts, int64_t m_total, int64_t n, int64_t k,
                   const char* what) {
  FLOWMOE_CHECK(num_experts >= 0 && m_total >= 0 && n >= 0 && k >= 0, ShapeError, what,
                ": negative size E=", num_experts, " M_total=", m_total, " N=", n, " K=", k);
  FLOWMOE_CHECK(n % kFp8BlockSize == 0 && k % kFp8BlockSize == 0, ShapeError, what, ": N=", n, " and K=", k,
                " must be multiples of ", kFp8BlockSize, " (", kFp8BlockSize, "x", kFp8BlockSize, " weight blocks)");
  FLOWMOE_CHECK(m_total % kFp8RowMultiple == 0, ShapeError, what, ": M_total=", m_total, " must be a multiple of ",
                kFp8RowMultiple, " (cuBLASLt FP8 leading dimension)");
  const int64_t total = check_grouped_rows(padded_tokens_per_expert, num_experts, m_total, what);
  for (int64_t e = 0; e < num_experts; ++e)
    FLOWMOE_CHECK(padded_tokens_per_expert[e] % kFp8RowMultiple == 0, ShapeError, what, ": expert ", e, " has ",
                  padded_tokens_per_expert[e], " rows, not a multiple of ", kFp8RowMultiple,
                  " (permute_pad with align_size >= ", kFp8RowMultiple, ")");
  return total;
}

}  // namespace

// ---- launchers --------------------------------------------------------------------------------

void fp8_grouped_gemm_cuda(DType out_dtype, const uint8_t* x, const float* x_scale_inv, const uint8_t* w,
                           const float* w_scale_inv, void* y, const int64_t* padded_tokens_per_expert,
                           int64_t num_experts, int64_t m_total, int64_t n, int64_t k, void* workspace,
                           cudaStream_t stream) {
  const char* what = "fp8_grouped_gemm_cuda";
  FLOWMOE_CHECK(out_dtype == DType::bf16 || out_dtype == DType::f32, DTypeError, what,
                ": the output must be bf16 or f32, got ", dtype_name(out_dtype));
  const int64_t total = check_args(padded_tokens_per_expert, num_experts, m_total, n, k, what);
  const size_t es = dtype_size(out_dtype);
  if (total < m_total && n > 0)  // tail rows past the last segment
    FLOWMOE_CUDA_CHECK(
        cudaMemsetAsync(static_cast<char*>(y) + size_t(total * n) * es, 0, size_t((m_total - total) * n) * es, stream));
  if (total == 0 || n == 0) return;
  if (k == 0) {  // an empty sum
    FLOWMOE_CUDA_CHECK(cudaMemsetAsync(y, 0, size_t(total * n) * es, stream));
    return;
  }
  FLOWMOE_CHECK(x && x_scale_inv && w && w_scale_inv && y && workspace, Error, what,
                ": null pointer for M_total=", m_total, " N=", n, " K=", k);
  const int64_t kb = k / kFp8BlockSize, nb = n / kFp8BlockSize;
  float* ws = static_cast<float*>(workspace);
  for (int64_t e0 = 0, off0 = 0; e0 < num_experts; e0 += kMaxExpertsPerLaunch) {  // scales -> [kb][r_e] per expert
    const int64_t count = std::min<int64_t>(kMaxExpertsPerLaunch, num_experts - e0);
    ExpertRows chunk{};
    int64_t max_rows = 0;
    chunk.off[0] = off0;
    for (int64_t i = 0; i < count; ++i) {
      chunk.off[i + 1] = chunk.off[i] + padded_tokens_per_expert[e0 + i];
      max_rows = std::max(max_rows, padded_tokens_per_expert[e0 + i]);
    }
    off0 = chunk.off[count];
    if (max_rows == 0) continue;
    dim3 grid(unsigned(std::min<int64_t>((max_rows + 31) / 32, 1024)), unsigned((kb + 31) / 32), unsigned(count));
    scale_relayout_kernel<<<grid, dim3(32, 8), 0, stream>>>(ws, x_scale_inv, chunk, kb);
    FLOWMOE_CUDA_CHECK_LAUNCH();
  }
  const int64_t kb4 = (kb + 3) / 4 * 4;
  float* w_scales = ws + (m_total * kb + 63) / 64 * 64;
  {
    const int64_t num = num_experts * nb * kb4;
    weight_scale_pad_kernel<<<unsigned(std::min<int64_t>((num + 255) / 256, 4096)), 256, 0, stream>>>(
        w_scales, w_scale_inv, num_experts * nb, kb, kb4);
    FLOWMOE_CUDA_CHECK_LAUNCH();
  }
  StreamFan fan(stream, experts_with_rows(padded_tokens_per_expert, num_experts));
  int64_t off = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows = padded_tokens_per_expert[e];
    if (rows > 0) {
      const uint8_t* a = w + e * n * k;
      const uint8_t* b = x + off * k;
      void* d = static_cast<char*>(y) + size_t(off * n) * es;
      const PlanKey key{n,
                        rows,
                        k,
                        k,
                        k,
                        n,
                        false,
                        false,
                        out_dtype,  // D [n, rows] = y_eᵀ
                        alignment_of(a),
                        alignment_of(b),
                        alignment_of(d)};
      run_gemm(key, a, w_scales + e * nb * kb4, b, ws + off * kb, d, fan.next());
    }
    off += rows;
  }
  fan.join();
}

void fp8_grouped_wgrad_cuda(const uint8_t* dy_t, const float* dy_t_scale_inv, const uint8_t* x_t,
                            const float* x_t_scale_inv, float* dw, const int64_t* padded_tokens_per_expert,
                            int64_t num_experts, int64_t m_total, int64_t n, int64_t k, bool accumulate,
                            cudaStream_t stream) {
  const char* what = "fp8_grouped_wgrad_cuda";
  check_args(padded_tokens_per_expert, num_experts, m_total, n, k, what);
  const size_t expert_bytes = size_t(n * k) * sizeof(float);
  if (expert_bytes == 0) return;
  FLOWMOE_CHECK(dw != nullptr, Error, what, ": null dw");
  for (int64_t e = 0; e < num_experts; ++e)  // an empty sum, on `main` before the fan forks
    if (padded_tokens_per_expert[e] == 0 && !accumulate)
      FLOWMOE_CUDA_CHECK(cudaMemsetAsync(dw + e * n * k, 0, expert_bytes, stream));
  StreamFan fan(stream, experts_with_rows(padded_tokens_per_expert, num_experts));
  int64_t off = 0, blk = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows = padded_tokens_per_expert[e];
    float* d = dw + e * n * k;
    if (rows == 0) continue;
    FLOWMOE_CHECK(dy_t && dy_t_scale_inv && x_t && x_t_scale_inv, Error, what, ": null operand for expert ", e);
    const uint8_t* a = x_t + off;
    const uint8_t* b = dy_t + off;
    const PlanKey key{k,
                      n,
                      rows,
                      m_total,
                      m_total,
                      k,
                      true,
                      accumulate,
                      DType::f32,  // D [k, n] = dw[e]ᵀ
                      alignment_of(a),
                      alignment_of(b),
                      alignment_of(d)};
    run_gemm(key, a, x_t_scale_inv + blk * k, b, dy_t_scale_inv + blk * n, d, fan.next());
    off += rows;
    blk += fp8_num_blocks(rows);
  }
  fan.join();
}

}  // namespace flowmoe
