// Embedding lookup: out[i, :] = weight[ids[i], :] for ids in [0, vocab).
// Backward: d_weight[v, :] = sum over positions i with ids[i] == v of d_out[i, :] (ascending i).
// CPU reference: kernels/cpu/embedding.cpp (f32 and f64; a bad id throws Error naming it and its
// position). CUDA: kernels/cuda/embedding.cu (f32 and bf16; a bad id prints and traps on the device).
// Node: engine/ops/embedding.cpp. Tests: tests/test_embedding.cpp.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

template <class T>
void embedding_forward_cpu(T* out /*[num_ids, hidden]*/, const T* weight /*[vocab, hidden]*/,
                           const int32_t* ids /*[num_ids]*/, int64_t num_ids, int64_t vocab, int64_t hidden);
// Sums in T in ascending position order (the order the GPU uses, so f32 results match it bit for bit).
template <class T>
void embedding_backward_cpu(T* d_weight /*[vocab, hidden]*/, const T* d_out /*[num_ids, hidden]*/,
                            const int32_t* ids /*[num_ids]*/, int64_t num_ids, int64_t vocab, int64_t hidden);

// dtype f32 or bf16 (bf16 as raw bits).
void embedding_forward_cuda(DType dtype, void* out /*[num_ids, hidden]*/, const void* weight /*[vocab, hidden]*/,
                            const int32_t* ids /*[num_ids]*/, int64_t num_ids, int64_t vocab, int64_t hidden,
                            cudaStream_t stream);
// Bytes of device workspace embedding_backward_cuda needs (sorted ids and positions, CUB scratch).
size_t embedding_backward_workspace_bytes(int64_t num_ids);
// Deterministic: ids are stably sorted, then each distinct id sums its rows in fp32 in ascending
// position order and writes its d_weight row once (rounded once for bf16); absent ids get zeros.
void embedding_backward_cuda(DType dtype, void* d_weight /*[vocab, hidden]*/, const void* d_out /*[num_ids, hidden]*/,
                             const int32_t* ids /*[num_ids]*/, int64_t num_ids, int64_t vocab, int64_t hidden,
                             void* workspace /*[embedding_backward_workspace_bytes]*/, size_t workspace_bytes,
                             cudaStream_t stream);

}  // namespace flowmoe
