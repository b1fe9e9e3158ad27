// The small MoE model configs that the MoE layer tests (tests/test_moe_layer.cpp,
// tests/test_moe_fp8.cpp) build their layers from.
#pragma once
#include <cstdint>

#include "layers/model_config.h"

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

}  // namespace flowmoe::test
