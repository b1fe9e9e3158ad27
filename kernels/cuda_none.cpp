// The CUDA launchers of kernels/*.h in a CPU-only build (CMakeLists.txt compiles this file instead of
// kernels/cuda/ when the CUDA backend is off), with the few host helpers that size their device
// workspaces or tune them. Each throws DeviceError through throw_no_cuda, naming itself.
// Why they exist: the ops call their launchers in eval_gpu without preprocessor guards, so both builds
// compile the same op code. In a CPU-only build eval_gpu is unreachable (no tensor can live on a device:
// kernels/common/device_api_none.cpp refuses every device allocation), so none of these ever runs; they only let
// that code link. Each definition is qualified (flowmoe::name), so a signature that no longer matches
// its declaration in kernels/*.h is a compile error here rather than a silent overload.
#include "kernels/adamw.h"
#include "kernels/adamw_fp8.h"
#include "kernels/add_rmsnorm.h"
#include "kernels/attention.h"
#include "kernels/common/device_api.h"
#include "kernels/copy.h"
#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/ep_layout.h"
#include "kernels/fp8_grouped_linear.h"
#include "kernels/fp8_transpose.h"
#include "kernels/grouped_gemm_device.h"
#include "kernels/grouped_linear.h"
#include "kernels/linear.h"
#include "kernels/permute.h"
#include "kernels/quantize.h"
#include "kernels/reduce.h"
#include "kernels/rmsnorm.h"
#include "kernels/rmsnorm_quant.h"
#include "kernels/rope.h"
#include "kernels/router.h"
#include "kernels/silu.h"
#include "kernels/softmax.h"
#include "kernels/swiglu.h"
#include "kernels/swiglu_quant.h"
#include "kernels/unpermute.h"

// Defines flowmoe::name(params) -> ret as a throwing stand-in (params: the declared parameter types).
#define FLOWMOE_NO_CUDA(ret, name, params) \
  auto flowmoe::name params->ret { flowmoe::throw_no_cuda(#name); }

// kernels/adamw.h
FLOWMOE_NO_CUDA(void, adamw_cuda,
                (float*, const float*, void*, void*, int64_t, const AdamWStep&, cudaStream_t, WeightCopy, DType,
                 MomentRounding))
FLOWMOE_NO_CUDA(void, adamw_scheduled_cuda,
                (float*, const float*, void*, void*, int64_t, const AdamWStep&, const StepScalars*, double,
                 cudaStream_t, WeightCopy, DType, MomentRounding))
FLOWMOE_NO_CUDA(void, adamw_multi_cuda, (const AdamWTensor*, int64_t, const StepScalars*, cudaStream_t))
FLOWMOE_NO_CUDA(void, advance_step_cuda,
                (StepScalars*, const StepSchedule&, const float*, const float*, const float*, const int32_t*,
                 cudaStream_t, const float*))
FLOWMOE_NO_CUDA(void, sum_squares_cuda, (const float*, int64_t, float*, float*, cudaStream_t))
FLOWMOE_NO_CUDA(void, sum_values_cuda, (const float*, int64_t, float*, float*, cudaStream_t))
FLOWMOE_NO_CUDA(void, sum_squares_multi_cuda, (const SumSlice*, int64_t, float*, cudaStream_t))
FLOWMOE_NO_CUDA(void, sum_values_multi_cuda, (const SumSlice*, int64_t, float*, cudaStream_t))

// kernels/adamw_fp8.h
FLOWMOE_NO_CUDA(void, adamw_fp8_cuda, (const AdamWFp8Tensor*, int64_t, const StepScalars*, cudaStream_t))
FLOWMOE_NO_CUDA(void, fp8_block_transpose_cuda, (const Fp8BlockCopy&, cudaStream_t))

// kernels/add_rmsnorm.h
FLOWMOE_NO_CUDA(void, add_rmsnorm_forward_cuda,
                (DType, void*, void*, uint8_t*, float*, const void*, const void*, const void*, int64_t, int64_t, double,
                 cudaStream_t))

// kernels/attention.h
FLOWMOE_NO_CUDA(void, attention_forward_cuda,
                (DType, void*, float*, const void*, const void*, const void*, int64_t, int64_t, int64_t, int64_t,
                 int64_t, cudaStream_t, AttentionKernel))
FLOWMOE_NO_CUDA(void, attention_backward_cuda,
                (DType, void*, void*, void*, float*, const void*, const void*, const void*, const void*, const void*,
                 const float*, int64_t, int64_t, int64_t, int64_t, int64_t, cudaStream_t, AttentionKernel))

// kernels/copy.h
FLOWMOE_NO_CUDA(void, strided_copy_cuda, (void*, const void*, size_t, const StridedLayout&, cudaStream_t))
FLOWMOE_NO_CUDA(void, cast_cuda, (void*, DType, const void*, DType, int64_t, cudaStream_t))
FLOWMOE_NO_CUDA(void, fill_cuda, (void*, DType, double, int64_t, cudaStream_t))

// kernels/cross_entropy.h
FLOWMOE_NO_CUDA(void, cross_entropy_forward_cuda,
                (DType, float*, float*, float*, float*, const void*, const int32_t*, int64_t, int64_t, int,
                 cudaStream_t))
FLOWMOE_NO_CUDA(void, cross_entropy_backward_cuda,
                (DType, void*, const float*, const float*, const void*, const float*, const int32_t*, int64_t, int64_t,
                 int, cudaStream_t))

// kernels/elementwise.h
FLOWMOE_NO_CUDA(void, binary_cuda, (BinaryOp, DType, void*, const void*, const void*, int64_t, cudaStream_t))
FLOWMOE_NO_CUDA(void, scale_cuda, (DType, void*, const void*, double, int64_t, cudaStream_t))

// kernels/embedding.h
FLOWMOE_NO_CUDA(void, embedding_forward_cuda,
                (DType, void*, const void*, const int32_t*, int64_t, int64_t, int64_t, cudaStream_t))
FLOWMOE_NO_CUDA(size_t, embedding_backward_workspace_bytes, (int64_t))
FLOWMOE_NO_CUDA(void, embedding_backward_cuda,
                (DType, void*, const void*, const int32_t*, int64_t, int64_t, int64_t, void*, size_t, cudaStream_t))

// kernels/fp8_grouped_linear.h
FLOWMOE_NO_CUDA(void, fp8_grouped_gemm_cuda,
                (DType, const uint8_t*, const float*, const uint8_t*, const float*, void*, const int64_t*, int64_t,
                 int64_t, int64_t, int64_t, void*, cudaStream_t))
FLOWMOE_NO_CUDA(void, fp8_grouped_wgrad_cuda,
                (const uint8_t*, const float*, const uint8_t*, const float*, float*, const int64_t*, int64_t, int64_t,
                 int64_t, int64_t, bool, cudaStream_t))

// kernels/fp8_transpose.h
FLOWMOE_NO_CUDA(void, fp8_transpose_cuda,
                (const uint8_t*, const float*, int64_t, int64_t, const int64_t*, int64_t, uint8_t*, float*,
                 cudaStream_t))
FLOWMOE_NO_CUDA(void, fp8_transpose_device_cuda,
                (const uint8_t*, const float*, int64_t, int64_t, const int32_t*, int64_t, uint8_t*, float*,
                 cudaStream_t))

// kernels/grouped_gemm_device.h
FLOWMOE_NO_CUDA(size_t, grouped_gemm_device_workspace_bytes, (int64_t))
FLOWMOE_NO_CUDA(void, grouped_gemm_fprop_device_cuda,
                (DType, const void*, const void*, void*, const int32_t*, int64_t, int64_t, int64_t, int64_t, void*,
                 size_t, cudaStream_t, bool))
FLOWMOE_NO_CUDA(void, grouped_gemm_dgrad_device_cuda,
                (DType, const void*, const void*, void*, const int32_t*, int64_t, int64_t, int64_t, int64_t, void*,
                 size_t, cudaStream_t, bool))
FLOWMOE_NO_CUDA(void, grouped_gemm_wgrad_device_cuda,
                (DType, const void*, const void*, float*, const int32_t*, int64_t, int64_t, int64_t, int64_t, bool,
                 void*, size_t, cudaStream_t))
FLOWMOE_NO_CUDA(void, fp8_grouped_gemm_device_cuda,
                (DType, const uint8_t*, const float*, const uint8_t*, const float*, void*, const int32_t*, int64_t,
                 int64_t, int64_t, int64_t, void*, size_t, cudaStream_t, bool))
FLOWMOE_NO_CUDA(void, fp8_grouped_wgrad_device_cuda,
                (const uint8_t*, const float*, const uint8_t*, const float*, float*, const int32_t*, int64_t, int64_t,
                 int64_t, int64_t, bool, void*, size_t, cudaStream_t))

// kernels/grouped_linear.h
FLOWMOE_NO_CUDA(void, set_grouped_linear_streams, (int))
FLOWMOE_NO_CUDA(int, grouped_linear_streams, ())
FLOWMOE_NO_CUDA(void, grouped_linear_forward_cuda,
                (DType, const void*, const void*, void*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                 cudaStream_t))
FLOWMOE_NO_CUDA(void, grouped_linear_dgrad_cuda,
                (DType, const void*, const void*, void*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                 cudaStream_t))
FLOWMOE_NO_CUDA(void, grouped_linear_wgrad_cuda,
                (DType, const void*, const void*, float*, const int64_t*, int64_t, int64_t, int64_t, int64_t, bool,
                 cudaStream_t))

// kernels/linear.h
FLOWMOE_NO_CUDA(void, gemm_cuda,
                (bool, bool, int64_t, int64_t, int64_t, DType, const void*, int64_t, const void*, int64_t, DType, void*,
                 int64_t, const void*, bool, cudaStream_t))
FLOWMOE_NO_CUDA(GemmPlanStats, gemm_cuda_plan_stats, ())
FLOWMOE_NO_CUDA(void, bias_grad_cuda, (DType, void*, const void*, int64_t, int64_t, float*, cudaStream_t))

// kernels/ep_layout.h
FLOWMOE_NO_CUDA(void, ep_layout_cuda, (const EpLayoutDims&, const int32_t*, int32_t*, int32_t*, cudaStream_t))

// kernels/permute.h
FLOWMOE_NO_CUDA(size_t, permute_workspace_bytes, (const RoutingDims&))
FLOWMOE_NO_CUDA(void, permute_pad_cuda, (const RoutingDims&, const PermuteBuffers&, cudaStream_t, PermuteRowKernel))
FLOWMOE_NO_CUDA(void, permute_map_cuda, (const RoutingDims&, const PermuteBuffers&, cudaStream_t))
FLOWMOE_NO_CUDA(void, permute_rows_cuda, (const RoutingDims&, const PermuteBuffers&, cudaStream_t, PermuteRowKernel))
FLOWMOE_NO_CUDA(void, permute_backward_cuda,
                (DType, const int32_t*, int64_t, int, int64_t, const void*, const float*, void*, float*, cudaStream_t))

// kernels/quantize.h
FLOWMOE_NO_CUDA(void, quantize_rowwise_cuda, (DType, const void*, int64_t, int64_t, uint8_t*, float*, cudaStream_t))
FLOWMOE_NO_CUDA(void, dequantize_rowwise_cuda,
                (DType, const uint8_t*, const float*, int64_t, int64_t, void*, cudaStream_t))
FLOWMOE_NO_CUDA(void, quantize_colwise_cuda,
                (DType, const void*, int64_t, int64_t, const int64_t*, int64_t, uint8_t*, float*, cudaStream_t))
FLOWMOE_NO_CUDA(void, quantize_colwise_device_cuda,
                (DType, const void*, int64_t, int64_t, const int32_t*, int64_t, uint8_t*, float*, cudaStream_t))
FLOWMOE_NO_CUDA(void, dequantize_colwise_cuda,
                (DType, const uint8_t*, const float*, int64_t, int64_t, const int64_t*, int64_t, void*, cudaStream_t))
FLOWMOE_NO_CUDA(void, quantize_block_cuda,
                (DType, const void*, int64_t, int64_t, int64_t, uint8_t*, float*, uint8_t*, float*, cudaStream_t))
FLOWMOE_NO_CUDA(void, dequantize_block_cuda,
                (DType, const uint8_t*, const float*, int64_t, int64_t, int64_t, void*, cudaStream_t))

// kernels/reduce.h
FLOWMOE_NO_CUDA(void, reduce_cuda, (ReduceOp, DType, float*, float*, const void*, int64_t, cudaStream_t))
FLOWMOE_NO_CUDA(void, reduce_backward_cuda, (ReduceOp, DType, void*, const float*, int64_t, cudaStream_t))

// kernels/rmsnorm.h
FLOWMOE_NO_CUDA(void, rmsnorm_forward_cuda,
                (DType, void*, const void*, const void*, int64_t, int64_t, double, cudaStream_t))
FLOWMOE_NO_CUDA(int64_t, rmsnorm_backward_workspace_floats, (int64_t, int64_t))
FLOWMOE_NO_CUDA(void, rmsnorm_backward_cuda,
                (DType, void*, void*, const void*, const void*, const void*, int64_t, int64_t, double, float*, int64_t,
                 cudaStream_t))

// kernels/rmsnorm_quant.h
FLOWMOE_NO_CUDA(void, rmsnorm_quant_forward_cuda,
                (DType, void*, uint8_t*, float*, const void*, const void*, int64_t, int64_t, double, cudaStream_t))

// kernels/rope.h
FLOWMOE_NO_CUDA(void, rope_forward_cuda,
                (DType, void*, const void*, int64_t, int64_t, int64_t, int64_t, double, int64_t, cudaStream_t))
FLOWMOE_NO_CUDA(void, rope_backward_cuda,
                (DType, void*, const void*, int64_t, int64_t, int64_t, int64_t, double, int64_t, cudaStream_t))
FLOWMOE_NO_CUDA(void, rope_qk_forward_cuda,
                (DType, void*, void*, const void*, const void*, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                 int64_t, cudaStream_t))
FLOWMOE_NO_CUDA(void, rope_qk_backward_cuda,
                (DType, void*, void*, const void*, const void*, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                 int64_t, cudaStream_t))

// kernels/router.h
FLOWMOE_NO_CUDA(void, router_topk_cuda,
                (const RouterParams&, const float*, const float*, int64_t, int32_t*, float*, int32_t*, cudaStream_t))
FLOWMOE_NO_CUDA(void, router_topk_backward_cuda,
                (const RouterParams&, const float*, const int32_t*, const float*, int64_t, float*, cudaStream_t))
FLOWMOE_NO_CUDA(void, router_balance_loss_cuda,
                (const RouterParams&, const float*, const int32_t*, int64_t, int64_t, double, int32_t*, float*, float*,
                 cudaStream_t))
FLOWMOE_NO_CUDA(void, router_balance_loss_backward_cuda,
                (const RouterParams&, const float*, const int32_t*, int64_t, int64_t, double, const float*, int32_t*,
                 float*, cudaStream_t))
FLOWMOE_NO_CUDA(void, expert_bias_update_cuda, (float*, const int32_t*, int, double, BiasUpdateRule, cudaStream_t))
FLOWMOE_NO_CUDA(void, expert_bias_update_scheduled_cuda,
                (float*, const int32_t*, int, double, BiasUpdateRule, const StepScalars*, cudaStream_t))
FLOWMOE_NO_CUDA(void, add_tokens_per_expert_cuda, (int32_t*, const int32_t*, int, cudaStream_t))

// kernels/silu.h
FLOWMOE_NO_CUDA(void, silu_forward_cuda, (DType, void*, const void*, int64_t, cudaStream_t))
FLOWMOE_NO_CUDA(void, silu_backward_cuda, (DType, void*, const void*, const void*, int64_t, cudaStream_t))

// kernels/softmax.h
FLOWMOE_NO_CUDA(void, softmax_forward_cuda, (DType, void*, const void*, int64_t, int64_t, cudaStream_t))
FLOWMOE_NO_CUDA(void, softmax_backward_cuda, (DType, void*, const void*, const void*, int64_t, int64_t, cudaStream_t))

// kernels/swiglu.h
FLOWMOE_NO_CUDA(void, swiglu_forward_cuda, (DType, void*, const void*, int64_t, int64_t, cudaStream_t, CountedRows))
FLOWMOE_NO_CUDA(void, swiglu_backward_cuda,
                (DType, void*, const void*, const void*, int64_t, int64_t, cudaStream_t, CountedRows))

// kernels/swiglu_quant.h
FLOWMOE_NO_CUDA(void, swiglu_quant_forward_cuda,
                (DType, const void*, const float*, int64_t, int64_t, uint8_t*, float*, cudaStream_t, CountedRows))
FLOWMOE_NO_CUDA(void, swiglu_quant_backward_cuda,
                (DType, const void*, const void*, const float*, int64_t, int64_t, uint8_t*, float*, void*, float*,
                 cudaStream_t, CountedRows))

// kernels/unpermute.h
FLOWMOE_NO_CUDA(void, unpermute_cuda,
                (DType, const int32_t*, int64_t, int, int64_t, const void*, const float*, void*, cudaStream_t))
FLOWMOE_NO_CUDA(void, unpermute_backward_cuda, (DType, const UnpermuteBackwardArgs&, cudaStream_t))

#undef FLOWMOE_NO_CUDA
