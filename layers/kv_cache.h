// The K/V cache of one sequence being decoded (Transformer::forward_cached, train/generate.h). It is the
// expanded cache: per layer, every position's keys (after RoPE) and values for every head, keys
// [num_heads, capacity, qk_head_dim] and values [num_heads, capacity, v_head_dim] in the compute dtype, each head's
// positions contiguous so that a decode step reads them as one [positions, head_dim] matrix without a copy. MLA
// (layers/mla.h) caches the same expanded keys and values, not its compressed latent: simpler, and the same
// decode code for both attentions, at nh x (qk + v) numbers per position instead of kv_lora_rank + qk_rope.
#pragma once
#include <cstdint>
#include <vector>

#include "engine/autograd.h"
#include "engine/tensor.h"
#include "layers/model_config.h"

namespace flowmoe {

struct KvCache {
  // Room for `capacity` positions (at most max_position_embeddings) in every layer.
  KvCache(const ModelConfig& cfg, int64_t capacity, DType dtype, Device device) : capacity(capacity) {
    FLOWMOE_CHECK(capacity >= 1 && capacity <= cfg.max_position_embeddings, ShapeError, "KvCache: capacity ", capacity,
                  " outside [1, max_position_embeddings = ", cfg.max_position_embeddings, "]");
    const Shape key_shape = {cfg.num_attention_heads, capacity, attention_qk_head_dim(cfg)};
    const Shape value_shape = {cfg.num_attention_heads, capacity, attention_v_head_dim(cfg)};
    for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
      keys.push_back(Tensor::zeros(key_shape, dtype, device));
      values.push_back(Tensor::zeros(value_shape, dtype, device));
    }
  }
  std::vector<Tensor> keys, values;  // one per layer
  int64_t capacity = 0;
  int64_t length = 0;  // the positions held: the next token's position
};

// One cached attention step of a layer (layers/kv_cache.cpp): q, k [1, T, nh, qk], v [1, T, nh, v] at positions
// [pos, pos + T) go into the cache; the prompt (pos 0) runs the training forward's causal attention, a later
// call (one token) attends to the cached positions [0, pos] head by head through linear, softmax and matmul.
// -> [1, T, nh, v]. backend: the prompt's attention kernels (model.attention_kernel). `what` names the layer in the
// ShapeErrors.
Variable attend_with_cache(const Variable& q, const Variable& k, const Variable& v, const Tensor& keys,
                           const Tensor& values, int64_t pos, AttentionBackend backend, const char* what);

}  // namespace flowmoe
