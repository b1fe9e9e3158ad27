// FP8 grouped fprop / dgrad in one launch, f32 output: the kernel of kernels/cuda/grouped_gemm_fp8_fprop.cuh
// (tile, layouts and scales described there) instantiated for f32. Public launcher:
// fp8_grouped_gemm_device_cuda (kernels/grouped_gemm_device.h); tests: tests/test_grouped_gemm_device.cpp.
#include "kernels/cuda/grouped_gemm_fp8_fprop.cuh"

namespace flowmoe::grouped_gemm {

void fp8_fprop_f32_run(const Call& c) { fp8_fprop_run_as<float>(c); }

size_t fp8_fprop_f32_workspace_bytes(int64_t num_experts, int sm_count) {
  return workspace_bytes<Fp8FpropGemm<float>>(num_experts, sm_count);
}

}  // namespace flowmoe::grouped_gemm
