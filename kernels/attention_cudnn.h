// The second bf16 backend of causal attention: cuDNN's fused scaled-dot-product attention (flash attention forward
// and backward, with its Hopper kernels), through cudnn-frontend's graph API (kernels/cuda/attention_cudnn.cpp).
// Same contract as attention_*_cuda of kernels/attention.h: q, k [batch, seq_len, num_heads, head_dim], v and o
// [.., v_head_dim], bf16, causal, scale 1/sqrt(head_dim); the forward saves the natural-log logsumexp
// [batch, num_heads, seq_len] f32 that the backward reads (cuDNN's "Stats", the same quantity as the flash kernels'
// lse). The flash kernels stay the fallback and the reference the CPU twin checks. The backend exists only in a
// build with cuDNN (CMakeLists.txt; scripts/install_cudnn.sh); elsewhere kernels/attention_cudnn_none.cpp says so.
// Which backend runs is model.attention_kernel, resolved once per call in engine/ops/attention.cpp.
// Tests: tests/test_attention_cudnn.cpp. Benchmark: bench/bench_attention.cpp.
#pragma once
#include <cstdint>
#include <string>

#include "kernels/common/device_api.h"
#include "kernels/common/name_table.h"

namespace flowmoe {

// model.attention_kernel. automatic: cudnn where the build has it and cuDNN takes the call's dtype and shape on
// this device, else flash; flash: the kernels of kernels/attention.h (AttentionKernel::automatic); cudnn: this
// backend, an error where it cannot run.
enum class AttentionBackend : uint8_t { automatic, flash, cudnn };
inline constexpr EnumName<AttentionBackend> kAttentionBackendNames[] = {
    {AttentionBackend::automatic, "auto"}, {AttentionBackend::flash, "flash"}, {AttentionBackend::cudnn, "cudnn"}};

// Whether this build holds the cuDNN backend.
bool attention_cudnn_built();

// One call's shape; with causal masking and the scale 1/sqrt(head_dim) it is the key of the cached graphs.
struct AttentionCudnnShape {
  int64_t batch = 0, seq_len = 0, num_heads = 0, head_dim = 0, v_head_dim = 0;
};

// Whether cuDNN runs this shape in bf16 on the current device, forward and backward. The first call for a shape
// builds both graphs (cached for the process: one build per shape and device); false in a build without the
// backend. `why`, when given, receives the reason of a false.
bool attention_cudnn_supports(const AttentionCudnnShape& shape, std::string* why = nullptr);

// The device workspace the forward or backward graph of a supported shape needs, in bytes (0: none).
int64_t attention_cudnn_workspace_bytes(const AttentionCudnnShape& shape, bool backward);

// The forward: out [batch, seq_len, num_heads, v_head_dim], lse [batch, num_heads, seq_len] f32. workspace holds
// attention_cudnn_workspace_bytes(shape, false) bytes. A shape attention_cudnn_supports refuses is an Error.
void attention_forward_cudnn(void* out, float* lse, const void* q, const void* k, const void* v,
                             const AttentionCudnnShape& shape, void* workspace, cudaStream_t stream);
// The backward from the forward's out and lse; every gradient is written. Deterministic (cuDNN's deterministic
// algorithm), so recomputation and replays give the same bits.
void attention_backward_cudnn(void* d_q, void* d_k, void* d_v, const void* d_out, const void* q, const void* k,
                              const void* v, const void* out, const float* lse, const AttentionCudnnShape& shape,
                              void* workspace, cudaStream_t stream);

}  // namespace flowmoe
