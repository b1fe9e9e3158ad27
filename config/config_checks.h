// Cross-key checks of a Config that validate() (config.cpp) runs after every key passed its own
// type and range check: the reporting rules they share, and one check per concern.
#pragma once
#include <string>
#include <vector>

#include "config/config_types.h"

namespace flowmoe {

// Throws ConfigError at a key's origin: "configs/x.yaml:7: model.hidden_size: ...".
class KeyReport {
 public:
  explicit KeyReport(const Config& c) : c_(c) {}
  [[noreturn]] void err(const std::string& key, const std::string& msg) const;
  // "key (configs/x.yaml:7)": names another key and where its value came from.
  std::string from(const std::string& key) const;
  // Keys that do not fit together: reported at the one the user touched last (a --set before a file
  // line before a default; the first on a tie), naming where the others came from.
  [[noreturn]] void conflict(const std::vector<std::string>& keys, const std::string& msg) const;

 private:
  const Config& c_;
  int rank(const std::string& key) const;
};

// Attention heads that divide the width into even head sizes; sequences that fit the positions.
void check_model_shape(const Config& c, const KeyReport& r);
// The MoE keys agree with each other and with the router kernel's limits (DeepSeek-V3 group-limited top-k):
// the router's own validate_router_config, reported at the model.* keys.
void check_moe_routing(const Config& c, const KeyReport& r);
// model.attention_kernel: cudnn only in a build with the cuDNN backend. A check of this machine, not of the config
// alone: a checkpoint's config is read without it (validate's runs_here), so a CPU build exports and generates from
// a run that trained on cuDNN.
void check_attention_kernel(const Config& c, const KeyReport& r);
// A synthetic corpus big enough for one sequence per split, or a data.path that exists and suits the source.
void check_data_source(const Config& c, const KeyReport& r, bool data_files = true);
// checkpoint.init_from: empty or hf:DIR with a DIR.
void check_init_from(const Config& c, const KeyReport& r);
// The learning-rate schedule: min_lr below lr, warm-up within the run.
void check_lr_schedule(const Config& c, const KeyReport& r);
// An FP8 recipe needs layers to act on (MoE layers, but for fp8_full), 128-wide widths for its FP8 blocks, and
// (fp8_full) a data.seq_len its dense FP8 GEMMs take.
void check_precision_recipe(const Config& c, const KeyReport& r);
// The largest activations of one micro-batch must stay indexable with int64 byte counts.
void check_tensor_sizes(const Config& c, const KeyReport& r);
// Expert parallelism needs routed experts (the launch's part is checked at start-up).
void check_parallel(const Config& c, const KeyReport& r);

}  // namespace flowmoe
