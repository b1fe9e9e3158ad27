// Cross-key checks of a Config that validate() (config.cpp) runs after every key passed its own
// type and range check: the reporting rules they share, and the checks of the precision recipe and
// of tensor sizes.
#pragma once
#include <string>
#include <vector>

#include "engine/train/config.h"

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

// An FP8 recipe needs MoE layers to act on, and 128-wide widths for its FP8 blocks.
void check_precision_recipe(const Config& c, const KeyReport& r);
// The largest activations of one micro-batch must stay indexable with int64 byte counts.
void check_tensor_sizes(const Config& c, const KeyReport& r);

}  // namespace flowmoe
