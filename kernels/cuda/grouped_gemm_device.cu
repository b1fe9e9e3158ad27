// The one-launch grouped GEMMs' launchers (kernels/grouped_gemm_device.h): argument checks (typed errors
// naming the values, before any device work), the cases that need no GEMM (no experts, no rows, an empty
// reduction: a memset), the workspace check, and the dispatch to the kernel files
// kernels/cuda/grouped_gemm_{bf16_fprop,bf16_dgrad,bf16_wgrad,fp8_fprop_bf16,fp8_fprop_f32,fp8_wgrad}.cu.
// No CUTLASS here (kernels/cuda/grouped_gemm_kernels.cuh is the interface), so this file builds fast.
// Nothing reads the counts on the host. CPU references: kernels/cpu/grouped_linear.cpp,
// kernels/cpu/fp8_grouped_linear.cpp; tests: tests/test_grouped_gemm_device.cpp.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>

#include "kernels/common/cuda_check.h"
#include "kernels/common/device_api.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/grouped_gemm_kernels.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/fp8.h"
#include "kernels/grouped_gemm_device.h"

namespace flowmoe {

namespace {

using grouped_gemm::Call;

// Checks shared by every launcher: sizes, the expert limit of the device scan, and int32 problem shapes.
void check_sizes(int64_t num_experts, int64_t m_total, int64_t n, int64_t k, const char* what) {
  FLOWMOE_CHECK(num_experts >= 0 && m_total >= 0 && n >= 0 && k >= 0, ShapeError, what,
                ": negative size E=", num_experts, " M_total=", m_total, " N=", n, " K=", k);
  FLOWMOE_CHECK(num_experts <= kGroupedGemmMaxExperts, ShapeError, what, ": E=", num_experts,
                " experts, more than the ", kGroupedGemmMaxExperts, " one scan block handles");
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
  FLOWMOE_CHECK(m_total <= kMaxDim && n <= kMaxDim && k <= kMaxDim, ShapeError, what, ": M_total=", m_total, " N=", n,
                " K=", k, " beyond int32 (CUTLASS's problem shapes)");
}

void check_multiple(int64_t n, int64_t k, int64_t multiple, const char* why, const char* what) {
  FLOWMOE_CHECK(n % multiple == 0 && k % multiple == 0, ShapeError, what, ": N=", n, " and K=", k,
                " must be multiples of ", multiple, " (", why, ")");
}

// The pointers a GEMM reads or writes: present and 16-byte aligned (TMA's base alignment).
void check_pointers(std::initializer_list<const void*> ptrs, const char* what) {
  int i = 0;
  for (const void* p : ptrs) {
    FLOWMOE_CHECK(p != nullptr, Error, what, ": device pointer argument ", i, " is null");
    FLOWMOE_CHECK(aligned_to(p, 16), Error, what, ": device pointer argument ", i, " (", p, ") is not 16-byte aligned");
    ++i;
  }
}

// Fills in the device, SM count, counts, workspace and stream, checking the workspace against the kernel's
// need (workspace_fn: its *_workspace_bytes).
Call make_call(const int32_t* counts, int64_t num_experts, int64_t m_total, int64_t n, int64_t k, void* workspace,
               size_t workspace_bytes, cudaStream_t stream, size_t (*workspace_fn)(int64_t, int), const char* what) {
  Call c;
  FLOWMOE_CUDA_CHECK(cudaGetDevice(&c.device));
  // The persistent grid, one CTA per SM, leaves the SMs reserved for communication kernels that run beside the
  // GEMMs (an exchange on the comm stream: cuda_set_comm_sms); CUTLASS's workspace shrinks with it.
  c.sm_count = std::max(1, sm_count() - cuda_comm_sms());
  const size_t need = workspace_fn(num_experts, c.sm_count);
  FLOWMOE_CHECK(workspace != nullptr && workspace_bytes >= need, Error, what, ": workspace of ", workspace_bytes,
                " bytes", workspace ? "" : " (null)", ", needs ", need, " for E=", num_experts,
                " (grouped_gemm_device_workspace_bytes)");
  FLOWMOE_CHECK(counts != nullptr, Error, what, ": padded_tokens_per_expert is null");
  c.counts = counts;
  c.num_experts = num_experts, c.m_total = m_total, c.n = n, c.k = k;
  c.workspace = workspace, c.workspace_bytes = workspace_bytes;
  c.stream = stream;
  return c;
}

void memset_async(void* p, size_t bytes, cudaStream_t stream) {
  if (bytes > 0) FLOWMOE_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream));
}

// fprop / dgrad: y [m_total, out_cols] = per expert rows · B; when there are no experts or the reduction
// is empty every row is zero (an empty sum, or a tail row), so one memset is the whole result. Returns
// whether the GEMM is still needed.
bool rows_gemm_needed(void* y, int64_t num_experts, int64_t m_total, int64_t out_cols, int64_t inner, size_t elem,
                      cudaStream_t stream, const char* what) {
  if (m_total == 0 || out_cols == 0) return false;
  FLOWMOE_CHECK(y != nullptr, Error, what, ": null output for M_total=", m_total);
  if (num_experts > 0 && inner > 0) return true;
  memset_async(y, size_t(m_total) * size_t(out_cols) * elem, stream);
  return false;
}

void bf16_rows_gemm(DType dtype, const void* a, const void* w, void* out, const int32_t* counts, int64_t num_experts,
                    int64_t m_total, int64_t n, int64_t k, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                    bool zero_tail, bool dgrad, const char* what) {
  FLOWMOE_CHECK(dtype == DType::bf16, DTypeError, what, " takes bf16 operands, got ", dtype_name(dtype),
                " (f32 stays on the per-expert cuBLASLt launchers)");
  check_sizes(num_experts, m_total, n, k, what);
  check_multiple(n, k, 8, "rows of 16 bytes for TMA", what);
  const int64_t out_cols = dgrad ? k : n, inner = dgrad ? n : k;
  if (!rows_gemm_needed(out, num_experts, m_total, out_cols, inner, 2, stream, what)) return;
  check_pointers({a, w, out}, what);
  Call c = make_call(counts, num_experts, m_total, n, k, workspace, workspace_bytes, stream,
                     dgrad ? grouped_gemm::bf16_dgrad_workspace_bytes : grouped_gemm::bf16_fprop_workspace_bytes, what);
  c.a = a, c.b = w, c.d = out, c.zero_tail = zero_tail;
  if (dgrad)
    grouped_gemm::bf16_dgrad_run(c);
  else
    grouped_gemm::bf16_fprop_run(c);
}

// wgrad: dw [E, n, k] fp32. Without experts or with an empty dw nothing is written; with m_total 0 every
// expert has no rows (the counts sum to at most m_total), so dw is zeroed or kept.
bool wgrad_gemm_needed(float* dw, int64_t num_experts, int64_t m_total, int64_t n, int64_t k, bool accumulate,
                       cudaStream_t stream, const char* what) {
  if (num_experts == 0 || n == 0 || k == 0) return false;
  FLOWMOE_CHECK(dw != nullptr, Error, what, ": null dw for E=", num_experts, " N=", n, " K=", k);
  if (m_total > 0) return true;
  if (!accumulate) memset_async(dw, size_t(num_experts) * size_t(n) * size_t(k) * sizeof(float), stream);
  return false;
}

}  // namespace

size_t grouped_gemm_device_workspace_bytes(int64_t num_experts) {
  FLOWMOE_CHECK(num_experts >= 0 && num_experts <= kGroupedGemmMaxExperts, ShapeError,
                "grouped_gemm_device_workspace_bytes: E=", num_experts, " is outside [0, ", kGroupedGemmMaxExperts,
                "]");
  const int num_sms = sm_count();
  size_t bytes = 0;
  for (auto fn : {grouped_gemm::bf16_fprop_workspace_bytes, grouped_gemm::bf16_dgrad_workspace_bytes,
                  grouped_gemm::bf16_wgrad_workspace_bytes, grouped_gemm::fp8_fprop_bf16_workspace_bytes,
                  grouped_gemm::fp8_fprop_f32_workspace_bytes, grouped_gemm::fp8_wgrad_workspace_bytes})
    bytes = std::max(bytes, fn(num_experts, num_sms));
  return bytes;
}

// ---- launchers --------------------------------------------------------------------------------

// fprop and dgrad take the same arguments and share one body (bf16_rows_gemm); each names itself in its errors.
#define FLOWMOE_BF16_ROWS_LAUNCHER(name, dgrad)                                                                        \
  void name(DType dtype, const void* a, const void* w, void* out, const int32_t* padded_tokens_per_expert,             \
            int64_t num_experts, int64_t m_total, int64_t n, int64_t k, void* workspace, size_t workspace_bytes,       \
            cudaStream_t stream, bool zero_tail) {                                                                     \
    bf16_rows_gemm(dtype, a, w, out, padded_tokens_per_expert, num_experts, m_total, n, k, workspace, workspace_bytes, \
                   stream, zero_tail, dgrad, #name);                                                                   \
  }
FLOWMOE_BF16_ROWS_LAUNCHER(grouped_gemm_fprop_device_cuda, /*dgrad=*/false)
FLOWMOE_BF16_ROWS_LAUNCHER(grouped_gemm_dgrad_device_cuda, /*dgrad=*/true)
#undef FLOWMOE_BF16_ROWS_LAUNCHER

void grouped_gemm_wgrad_device_cuda(DType dtype, const void* x, const void* dy, float* dw,
                                    const int32_t* padded_tokens_per_expert, int64_t num_experts, int64_t m_total,
                                    int64_t n, int64_t k, bool accumulate, void* workspace, size_t workspace_bytes,
                                    cudaStream_t stream) {
  const char* what = "grouped_gemm_wgrad_device_cuda";
  FLOWMOE_CHECK(dtype == DType::bf16, DTypeError, what, " takes bf16 operands, got ", dtype_name(dtype),
                " (f32 stays on the per-expert cuBLASLt launchers)");
  check_sizes(num_experts, m_total, n, k, what);
  check_multiple(n, k, 8, "rows of 16 bytes for TMA", what);
  if (!wgrad_gemm_needed(dw, num_experts, m_total, n, k, accumulate, stream, what)) return;
  check_pointers({dy, x, dw}, what);
  Call c = make_call(padded_tokens_per_expert, num_experts, m_total, n, k, workspace, workspace_bytes, stream,
                     grouped_gemm::bf16_wgrad_workspace_bytes, what);
  c.a = dy, c.b = x, c.d = dw, c.accumulate = accumulate;
  grouped_gemm::bf16_wgrad_run(c);
}

void fp8_grouped_gemm_device_cuda(DType out_dtype, const uint8_t* x, const float* x_scale_inv, const uint8_t* w,
                                  const float* w_scale_inv, void* y, const int32_t* padded_tokens_per_expert,
                                  int64_t num_experts, int64_t m_total, int64_t n, int64_t k, void* workspace,
                                  size_t workspace_bytes, cudaStream_t stream, bool zero_tail) {
  const char* what = "fp8_grouped_gemm_device_cuda";
  FLOWMOE_CHECK(out_dtype == DType::bf16 || out_dtype == DType::f32, DTypeError, what,
                ": the output must be bf16 or f32, got ", dtype_name(out_dtype));
  check_sizes(num_experts, m_total, n, k, what);
  check_multiple(n, k, kFp8BlockSize, "128x128 weight blocks", what);
  if (!rows_gemm_needed(y, num_experts, m_total, n, k, dtype_size(out_dtype), stream, what)) return;
  check_pointers({x, w, y}, what);
  FLOWMOE_CHECK(x_scale_inv && w_scale_inv, Error, what, ": null scale_inv for M_total=", m_total, " N=", n, " K=", k);
  const bool bf16_out = out_dtype == DType::bf16;
  Call c = make_call(
      padded_tokens_per_expert, num_experts, m_total, n, k, workspace, workspace_bytes, stream,
      bf16_out ? grouped_gemm::fp8_fprop_bf16_workspace_bytes : grouped_gemm::fp8_fprop_f32_workspace_bytes, what);
  c.a = x, c.a_scale = x_scale_inv, c.b = w, c.b_scale = w_scale_inv, c.d = y, c.zero_tail = zero_tail;
  if (bf16_out)
    grouped_gemm::fp8_fprop_bf16_run(c);
  else
    grouped_gemm::fp8_fprop_f32_run(c);
}

void fp8_grouped_wgrad_device_cuda(const uint8_t* dy_t, const float* dy_t_scale_inv, const uint8_t* x_t,
                                   const float* x_t_scale_inv, float* dw, const int32_t* padded_tokens_per_expert,
                                   int64_t num_experts, int64_t m_total, int64_t n, int64_t k, bool accumulate,
                                   void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const char* what = "fp8_grouped_wgrad_device_cuda";
  check_sizes(num_experts, m_total, n, k, what);
  check_multiple(n, k, kFp8BlockSize, "128x128 weight blocks", what);
  FLOWMOE_CHECK(m_total % kFp8RowMultiple == 0, ShapeError, what, ": M_total=", m_total, " must be a multiple of ",
                kFp8RowMultiple, " (the leading dimension of dy_t and x_t, 16-byte rows for TMA)");
  if (!wgrad_gemm_needed(dw, num_experts, m_total, n, k, accumulate, stream, what)) return;
  check_pointers({dy_t, x_t, dw}, what);  // the scales may be null (num_blocks 0: every count is 0)
  Call c = make_call(padded_tokens_per_expert, num_experts, m_total, n, k, workspace, workspace_bytes, stream,
                     grouped_gemm::fp8_wgrad_workspace_bytes, what);
  c.a = dy_t, c.a_scale = dy_t_scale_inv, c.b = x_t, c.b_scale = x_t_scale_inv, c.d = dw, c.accumulate = accumulate;
  grouped_gemm::fp8_wgrad_run(c);
}

}  // namespace flowmoe
