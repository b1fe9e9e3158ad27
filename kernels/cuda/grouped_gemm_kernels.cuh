// What the one-launch grouped GEMMs' front end (kernels/cuda/grouped_gemm_device.cu: argument checks,
// trivial cases, dispatch) passes to the files that each instantiate one CUTLASS kernel
// (kernels/cuda/grouped_gemm_{bf16_fprop,bf16_dgrad,bf16_wgrad,fp8_fprop_bf16,fp8_fprop_f32,fp8_wgrad}.cu).
// Kept free of CUTLASS so the front end compiles in seconds; kernels/cuda/grouped_gemm_sm90.cuh holds the
// CUTLASS side. Public API: kernels/grouped_gemm_device.h.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace flowmoe::grouped_gemm {

// One checked call. n and k are the launcher's (w and dw are [E, n, k]); a and b are the GEMM's A and B:
//   bf16 fprop  a = x,  b = w        bf16 dgrad  a = dy, b = w        bf16 wgrad  a = dy,   b = x
//   fp8 fprop   a = x,  b = w (+ scales)                              fp8 wgrad   a = dy_t, b = x_t (+ scales)
struct Call {
  const void* a = nullptr;
  const float* a_scale = nullptr;
  const void* b = nullptr;
  const float* b_scale = nullptr;
  void* d = nullptr;
  const int32_t* counts = nullptr;  // [E] device
  int64_t num_experts = 0, m_total = 0, n = 0, k = 0;
  bool accumulate = false;
  bool zero_tail = true;  // fprop / dgrad: zero the rows past sum(counts), or leave them
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int device = 0, sm_count = 0;  // the persistent grid is one CTA per SM
  cudaStream_t stream = nullptr;
};

// Each kernel: run one call (the setup kernel, then the grouped GEMM, on call.stream), and the workspace
// bytes it needs for num_experts groups on sm_count SMs.
#define FLOWMOE_GROUPED_GEMM_ENTRY(name) \
  void name##_run(const Call& call);     \
  size_t name##_workspace_bytes(int64_t num_experts, int sm_count);
FLOWMOE_GROUPED_GEMM_ENTRY(bf16_fprop)
FLOWMOE_GROUPED_GEMM_ENTRY(bf16_dgrad)
FLOWMOE_GROUPED_GEMM_ENTRY(bf16_wgrad)
FLOWMOE_GROUPED_GEMM_ENTRY(fp8_fprop_bf16)
FLOWMOE_GROUPED_GEMM_ENTRY(fp8_fprop_f32)
FLOWMOE_GROUPED_GEMM_ENTRY(fp8_wgrad)
#undef FLOWMOE_GROUPED_GEMM_ENTRY

}  // namespace flowmoe::grouped_gemm
