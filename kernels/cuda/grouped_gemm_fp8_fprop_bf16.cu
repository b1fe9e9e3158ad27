// FP8 grouped fprop / dgrad in one launch, bf16 output: the kernel of kernels/cuda/grouped_gemm_fp8_fprop.cuh
// (tile, layouts and scales described there) instantiated for bf16. Public launcher:
// fp8_grouped_gemm_device_cuda (kernels/grouped_gemm_device.h); tests: tests/test_grouped_gemm_device.cpp.
#include "kernels/cuda/grouped_gemm_fp8_fprop.cuh"

namespace flowmoe::grouped_gemm {

void fp8_fprop_bf16_run(const Call& c) { fp8_fprop_run_as<cutlass::bfloat16_t>(c); }

size_t fp8_fprop_bf16_workspace_bytes(int64_t num_experts, int sm_count) {
  return workspace_bytes<Fp8FpropGemm<cutlass::bfloat16_t>>(num_experts, sm_count);
}

}  // namespace flowmoe::grouped_gemm
