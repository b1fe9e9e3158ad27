// Op tensor hooks: a study (flowmoe fp8-error) asks an op to hand over the tensors it uses at one named
// place, e.g. the operands of an expert GEMM's weight gradient, without the op knowing the study.
// Off by default; an op pays one check of a thread-local pointer per call. The hook runs on the
// thread that runs the op (the autograd backward runs on the caller's thread), synchronously.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/tensor.h"

namespace flowmoe {

// site: what the tensors are ("<weight name> wgrad"); tensors: the op's own, valid for the call only
// (copy what you keep); segments: the op's row counts per group (per expert), or empty.
using OpTensorHook = std::function<void(const std::string& site, const std::vector<Tensor>& tensors,
                                        const std::vector<int64_t>& segments)>;

// Installs `hook` on this thread for the guard's lifetime; the previous hook comes back after it.
class ScopedOpTensorHook {
 public:
  explicit ScopedOpTensorHook(OpTensorHook hook);
  ~ScopedOpTensorHook();
  ScopedOpTensorHook(const ScopedOpTensorHook&) = delete;
  ScopedOpTensorHook& operator=(const ScopedOpTensorHook&) = delete;

 private:
  OpTensorHook hook_;
  const OpTensorHook* previous_;
};

bool op_tensor_hook_installed();
// Hands the tensors to the installed hook, if any.
void hand_op_tensors(const std::string& site, const std::vector<Tensor>& tensors,
                     const std::vector<int64_t>& segments = {});

}  // namespace flowmoe
