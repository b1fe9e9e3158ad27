// AdamW for the weights the FP8 GEMMs read in 128x128 blocks (kernels/quantize.h, block 128x128): the update of
// kernels/adamw.h and, in the same pass over each block, the block's FP8 copy the forward reads next
// (DeepSeek-V3 and Megatron-Core's FP8 parameters): e4m3 data, its scale_inv and the exact transpose the dgrad
// and wgrad GEMMs read. A block's amax needs all of its updated elements, so the update is tile-shaped: one CTA
// (CPU: one loop) per 128x128 block updates the block's elements, reduces their amax and writes data, scale and
// transpose. The copy is bit for bit quantize_block_cpu of the updated weights as the forward reads them (the
// WeightCopy's values where the update writes one, else the f32 weights), and the update's bits are
// adamw_multi_cpu's. CPU reference: kernels/cpu/adamw_fp8.cpp; CUDA: kernels/cuda/adamw_fp8.cu; optimizer:
// train/optimizer.cpp; tests: tests/test_adamw_fp8.cpp.
#pragma once
#include <cstdint>

#include "kernels/adamw.h"

namespace flowmoe {

// The FP8 copy of a weight [B, N, K] (B = 1 for a dense [N, K]) in quantize_block_cpu's layouts.
struct Fp8BlockCopy {
  uint8_t* q = nullptr;          // [B, N, K]
  float* scale_inv = nullptr;    // [B, ceil(N/128), ceil(K/128)]
  uint8_t* q_t = nullptr;        // [B, K, N]
  float* scale_inv_t = nullptr;  // [B, ceil(K/128), ceil(N/128)]
  int64_t B = 0, N = 0, K = 0;
};

// One weight's update and its FP8 copy: a whole tensor (t.n == B * N * K, t.rounding.first_index 0), or a range of
// whole 128-row block rows (the sharded optimizer's segment: N a multiple of 128, t.rounding.first_index and t.n
// multiples of 128 * K; t's buffers hold the range alone, fp8's the whole copy). A range writes its blocks of q and
// scale_inv. q_t and scale_inv_t may be both null (a range's transpose needs every block row: the sharded optimizer
// has fp8_block_transpose_* write it once the copy is whole).
struct AdamWFp8Tensor {
  AdamWTensor t;
  Fp8BlockCopy fp8;
};

// As adamw_multi_cpu (control: host memory or null), and each tensor's FP8 copy written from its update.
void adamw_fp8_cpu(const AdamWFp8Tensor* tensors /*[num_tensors]*/, int64_t num_tensors,
                   const StepScalars* control = nullptr);
// The same on the GPU (tensors: a host table of device buffers; control: device memory or null): one CTA per
// 128x128 block, up to 16 tensors of one moment and copy dtype per launch; a skipped step (control->apply false)
// writes nothing. No host synchronisation.
void adamw_fp8_cuda(const AdamWFp8Tensor* tensors /*[num_tensors]*/, int64_t num_tensors,
                    const StepScalars* control /*[1] device, or null*/, cudaStream_t stream);

// The checks both launchers make before anything is updated (Error / ShapeError / DTypeError naming the tensor).
void check_adamw_fp8(const AdamWFp8Tensor* tensors, int64_t num_tensors, const char* what);

// q_t and scale_inv_t of c from its q and scale_inv: each 128x128 block's bytes transposed, and the scale grid
// transposed, which is bit for bit what adamw_fp8 and quantize_block write (each block's transpose keeps its
// scale). The sharded optimizer's ranks gather q and scale_inv and rebuild the transpose each.
void fp8_block_transpose_cpu(const Fp8BlockCopy& c);
void fp8_block_transpose_cuda(const Fp8BlockCopy& c, cudaStream_t stream);

}  // namespace flowmoe
