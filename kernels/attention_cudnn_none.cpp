// The cuDNN attention backend in a build without cuDNN (CMakeLists.txt compiles this file instead of
// kernels/cuda/attention_cudnn.cpp): it is absent, so model.attention_kernel=cudnn is refused when the config is
// read and `auto` resolves to the flash kernels; the launchers are never reached.
#include "kernels/attention_cudnn.h"

namespace {
[[noreturn]] void throw_absent(const char* what) {
  FLOWMOE_THROW(flowmoe::Error, what,
                ": this build has no cuDNN attention backend (scripts/install_cudnn.sh, then a CUDA build)");
}
}  // namespace

bool flowmoe::attention_cudnn_built() { return false; }

bool flowmoe::attention_cudnn_supports(const flowmoe::AttentionCudnnShape&, std::string* why) {
  if (why) *why = "this build has no cuDNN attention backend";
  return false;
}

int64_t flowmoe::attention_cudnn_workspace_bytes(const flowmoe::AttentionCudnnShape&, bool) {
  throw_absent("attention_cudnn_workspace_bytes");
}

void flowmoe::attention_forward_cudnn(void*, float*, const void*, const void*, const void*,
                                      const flowmoe::AttentionCudnnShape&, void*, cudaStream_t) {
  throw_absent("attention_forward_cudnn");
}

void flowmoe::attention_backward_cudnn(void*, void*, void*, const void*, const void*, const void*, const void*,
                                       const void*, const float*, const flowmoe::AttentionCudnnShape&, void*,
                                       cudaStream_t) {
  throw_absent("attention_backward_cudnn");
}
