// Reading a run configuration (config_types.h): a YAML file or text and "section.key=value" overrides, each
// key checked by the schema (config_schema.h) and the whole by the cross-key checks (config_checks.h); and the
// resolved configuration and the key reference as text. Defined in config.cpp.
#pragma once
#include <string>
#include <vector>

#include "config/config_types.h"

namespace flowmoe {

// Reads and validates a YAML file, applies the overrides ("section.key=value") and validates the
// result. Throws ConfigError, also for a path that holds no config: a directory, a file that is not a
// regular file (/dev/null, /dev/zero, a FIFO), one over kMaxConfigFileBytes, or a file with no YAML
// content (empty, only comments or whitespace, a null document).
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// The same from YAML text; `name` stands for the file in messages. Empty text gives every default.
Config parse_config(const std::string& yaml_text, const std::string& name,
                    const std::vector<std::string>& overrides = {});
// The config a checkpoint's meta.json holds (its run's), for the commands that read the checkpoint (generate,
// export, eval of another folder): validated like parse_config's but for the data files, which need not exist
// where the checkpoint is read (the model is the checkpoint's; a tokenizer file is looked for by its own reader).
Config parse_checkpoint_config(const std::string& yaml_text, const std::string& name);
// One "section.key=value" override, type- and range-checked (call validate() afterwards).
void apply_override(Config& cfg, const std::string& assignment);
// The cross-key checks (divisibility, ranges that depend on other keys, unavailable features).
// runs_here false (parse_checkpoint_config): leaves out the checks of what the machine that runs the config must
// hold: data.path existing as a token file, and the cuDNN backend for model.attention_kernel: cudnn.
void validate(const Config& cfg, bool runs_here = true);
// Whether the CUDA attention kernels take the model's heads (attention_value_width_cuda): MLA's query/key head at
// most kAttentionMaxHeadDimCuda wide and its value head no wider (the GPU pads the value), or a query/key head up
// to kAttentionMaxWideHeadDimCuda (a multiple of 8; DeepSeek-V3's 128 + 64) with a value head of at most
// kAttentionMaxHeadDimCuda; plain MHA's always. A model that does not fit trains on the CPU only (model.* checks
// at train.device other than cpu).
bool attention_fits_cuda(const ModelConfig& m);

// The resolved configuration as YAML, every key included (written beside a run's outputs).
std::string to_yaml(const Config& cfg);
// A Markdown table of every key: type, range, default, meaning (docs/TRAINING.md).
std::string config_reference_markdown();

}  // namespace flowmoe
