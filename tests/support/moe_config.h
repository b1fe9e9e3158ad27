// The small MoE model configs that the MoE layer tests (tests/test_moe_layer.cpp,
// tests/test_moe_fp8.cpp and others) build their layers from, and one forward + backward of such a layer.
#pragma once
#include <cstdint>
#include <vector>

#include "kernels/common/device_api.h"
#include "layers/model_config.h"
#include "layers/moe.h"

namespace flowmoe::test {

// Two layers of hidden H; E routed experts of width F, top-k, in n_group groups (topk_group kept);
// `shared` shared experts; weights drawn with standard deviation init_std.
inline ModelConfig moe_test_config(int64_t E, int64_t k, int64_t H, int64_t F, int64_t shared, double init_std,
                                   int64_t n_group = 1, int64_t topk_group = 1) {
  ModelConfig c;
  c.hidden_size = H;
  c.num_hidden_layers = 2;
  c.n_routed_experts = E;
  c.num_experts_per_tok = k;
  c.moe_intermediate_size = F;
  c.n_group = n_group;
  c.topk_group = topk_group;
  c.n_shared_experts = shared;
  c.initializer_range = init_std;
  return c;
}

// A layer's output, input gradient and parameter gradients (in ParamFactory order), on the CPU, y and dx
// in f32 (exact for bf16 values), and the host synchronisations of its forward and backward (the reads of
// the results excluded).
struct LayerRun {
  Tensor y, dx;
  std::vector<Tensor> grads;
  uint64_t host_syncs = 0;
};

// One forward + backward of a fresh layer (the same seed gives the same weights) on `device`; `expert_bias`
// [E], when given, replaces the layer's routing bias first (a hot expert).
inline LayerRun run_layer(const ModelConfig& c, const MoeOptions& o, const Tensor& x, const Tensor& dy, Device device,
                          DType compute, uint64_t seed = 11, const Tensor& expert_bias = Tensor()) {
  ParamFactory f(seed, device);
  MoeLayer layer(f, c, "mlp", o, device);
  if (expert_bias.defined()) {
    Tensor bias = layer.expert_bias().data();  // shares the buffer's storage
    bias.copy_(expert_bias);
  }
  Variable xv(x.to(device).to(compute), true);
  const Tensor dy_in = dy.to(device).to(compute);
  const uint64_t syncs = num_host_syncs();
  Variable y = layer.forward(xv, compute);
  y.backward(dy_in);
  const uint64_t host_syncs = num_host_syncs() - syncs;
  LayerRun r{y.data().to(Device::cpu()).to(DType::f32), xv.grad().to(Device::cpu()).to(DType::f32), {}, host_syncs};
  for (const Variable& p : f.params()) r.grads.push_back(p.grad().to(Device::cpu()));
  return r;
}

}  // namespace flowmoe::test
