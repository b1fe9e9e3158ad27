// A test model with multi-head latent attention (layers/mla.h): the one place the tests set MLA's widths.
#pragma once
#include <cstdint>

#include "layers/model_config.h"

namespace flowmoe {

// q_lora_rank 0 takes the direct q_proj.
struct MlaWidths {
  int64_t q_lora_rank = 0, kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
};

// c with model.attention: mla at these widths.
inline ModelConfig with_mla(ModelConfig c, const MlaWidths& w) {
  c.attention = AttentionType::mla;
  c.q_lora_rank = w.q_lora_rank;
  c.kv_lora_rank = w.kv_lora_rank;
  c.qk_nope_head_dim = w.qk_nope_head_dim;
  c.qk_rope_head_dim = w.qk_rope_head_dim;
  c.v_head_dim = w.v_head_dim;
  return c;
}

}  // namespace flowmoe
