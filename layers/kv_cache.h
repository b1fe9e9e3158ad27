// The K/V cache of one sequence being decoded (Transformer::forward_cached, train/generate.h). It is the
// expanded cache of plain multi-head attention: per layer, every position's keys (after RoPE) and values for
// every head, [num_heads, capacity, head_dim] in the compute dtype, each head's positions contiguous so that a
// decode step reads them as one [positions, head_dim] matrix without a copy. (MLA would cache one compressed
// latent per position instead; DESIGN.md §5 keeps plain MHA.)
#pragma once
#include <cstdint>
#include <vector>

#include "engine/tensor.h"
#include "layers/model_config.h"

namespace flowmoe {

struct KvCache {
  // Room for `capacity` positions (at most max_position_embeddings) in every layer.
  KvCache(const ModelConfig& cfg, int64_t capacity, DType dtype, Device device) : capacity(capacity) {
    FLOWMOE_CHECK(capacity >= 1 && capacity <= cfg.max_position_embeddings, ShapeError, "KvCache: capacity ", capacity,
                  " outside [1, max_position_embeddings = ", cfg.max_position_embeddings, "]");
    const Shape shape = {cfg.num_attention_heads, capacity, cfg.hidden_size / cfg.num_attention_heads};
    for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
      keys.push_back(Tensor::zeros(shape, dtype, device));
      values.push_back(Tensor::zeros(shape, dtype, device));
    }
  }
  std::vector<Tensor> keys, values;  // one per layer
  int64_t capacity = 0;
  int64_t length = 0;  // the positions held: the next token's position
};

}  // namespace flowmoe
