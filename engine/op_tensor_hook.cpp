#include "engine/op_tensor_hook.h"

namespace flowmoe {

namespace {
thread_local const OpTensorHook* g_hook = nullptr;
}  // namespace

ScopedOpTensorHook::ScopedOpTensorHook(OpTensorHook hook) : hook_(std::move(hook)), previous_(g_hook) {
  g_hook = &hook_;
}
ScopedOpTensorHook::~ScopedOpTensorHook() { g_hook = previous_; }

bool op_tensor_hook_installed() { return g_hook != nullptr; }

void hand_op_tensors(const std::string& site, const std::vector<Tensor>& tensors,
                     const std::vector<int64_t>& segments) {
  if (g_hook) (*g_hook)(site, tensors, segments);
}

}  // namespace flowmoe
