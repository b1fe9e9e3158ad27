// Fused cross-entropy over logits [N, V] with targets [N] (i32; rows whose target == ignore_index
// are skipped): loss = mean over counted rows of lse(row) - row[target], lse = log(sum(exp(row))),
// 0 when no row counts. Forward saves the per-row lse; backward dlogits = (softmax - onehot) *
// d_loss / count, 0 on ignored rows. CPU reference: kernels/cpu/cross_entropy.cpp (f32, f64);
// CUDA: kernels/cuda/cross_entropy.cu (f32 and bf16 logits, fp32 math and f32 loss).
// Node: engine/ops/cross_entropy.cpp. Tests: tests/test_cross_entropy.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

// A target outside [0, V) that is not ignore_index throws Error naming the row and the value.
template <class T>
void cross_entropy_forward_cpu(T* loss /*[]*/, T* lse /*[N]*/, const T* logits /*[N, V]*/,
                               const int32_t* targets /*[N]*/, int64_t N, int64_t V, int ignore_index);
template <class T>
void cross_entropy_backward_cpu(T* d_logits /*[N, V]*/, T d_loss, const T* logits /*[N, V]*/, const T* lse /*[N]*/,
                                const int32_t* targets /*[N]*/, int64_t N, int64_t V, int ignore_index);

// dtype (of logits and d_logits) f32 or bf16; loss, lse, row_loss and inv_count are f32. The row
// count never leaves the device: forward writes inv_count = 1 / count (0 when count is 0) for the
// backward. Deterministic: per-row losses are summed by one block in a fixed order. A target
// outside [0, V) that is not ignore_index traps (printf + __trap()).
void cross_entropy_forward_cuda(DType dtype, float* loss /*[]*/, float* inv_count /*[]*/, float* lse /*[N]*/,
                                float* row_loss /*[N] scratch*/, const void* logits /*[N, V]*/,
                                const int32_t* targets /*[N]*/, int64_t N, int64_t V, int ignore_index,
                                cudaStream_t stream);
void cross_entropy_backward_cuda(DType dtype, void* d_logits /*[N, V]*/, const float* d_loss /*[]*/,
                                 const float* inv_count /*[]*/, const void* logits /*[N, V]*/, const float* lse /*[N]*/,
                                 const int32_t* targets /*[N]*/, int64_t N, int64_t V, int ignore_index,
                                 cudaStream_t stream);

}  // namespace flowmoe
