#include "engine/tap.h"

namespace flowmoe {

namespace {
thread_local const TapFn* g_tap = nullptr;
}  // namespace

ScopedTap::ScopedTap(TapFn fn) : fn_(std::move(fn)), previous_(g_tap) { g_tap = &fn_; }
ScopedTap::~ScopedTap() { g_tap = previous_; }

bool tap_enabled() { return g_tap != nullptr; }

void tap(const std::string& site, const std::vector<Tensor>& tensors, const std::vector<int64_t>& segments) {
  if (g_tap) (*g_tap)(site, tensors, segments);
}

}  // namespace flowmoe
