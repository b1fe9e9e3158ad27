// `flowmoe export --format hf` and `flowmoe import --format hf`: a checkpoint as a Hugging Face glm4_moe folder
// that transformers' AutoModelForCausalLM loads, and such a folder as a flowmoe config and checkpoint
// (the mapping: checkpoint/hf_format.h; the folder's reading: checkpoint/hf_folder.h; the tokenizer:
// dataset/hf_tokenizer.h).
#pragma once
#include <string>
#include <vector>

#include "engine/autograd.h"
#include "layers/model_config.h"
#include "parallel/param_shard.h"

namespace flowmoe {

struct HfExportOptions {
  // The BPE tokenizer file (`prepare-data --bpe-vocab`'s .bpe) to write as tokenizer.json; "": the run's own
  // (dataset/run_tokenizer.h: the .bpe beside data.path for data.source tokens, bytes for text), none for synthetic.
  std::string tokenizer;
  bool no_tokenizer = false;  // write no tokenizer
};
// Writes out_dir: config.json, model.safetensors (f32, as the checkpoint holds its weights) and, where there is
// a tokenizer, tokenizer.json and tokenizer_config.json. It is filled in a temporary folder beside it and
// renamed into place once complete: out_dir must not exist or be an empty folder (ConfigError before anything
// is read). Refuses (ConfigError naming the model.* key) a model with no exact glm4_moe counterpart, and
// (IoError) a checkpoint whose tensors are not its config's model. Returns lines that say what it wrote.
std::vector<std::string> export_hf(const std::string& checkpoint, const std::string& out_dir,
                                   const HfExportOptions& options = {});

struct HfImportOptions {
  std::string config_out;  // the flowmoe config (YAML) to write
  // Where the checkpoint goes: a checkpoint folder, which gets step_00000000; "": the config's own
  // (runs/<config name>/checkpoints), so that the run resumes from it.
  std::string checkpoint_dir;
};
// Reads a glm4_moe folder (checkpoint/hf_folder.h's refusals; a tokenizer.json whose vocab does not fit the model's
// is refused) and writes a flowmoe checkpoint of step 0 (the weights in f32, zero AdamW moments, data position
// 0) and the config: the model as config.json gives it, every other key at its default but
// checkpoint.resume: true (and checkpoint.dir, when given), so `flowmoe train --config FILE` starts from the
// imported weights. A tokenizer.json of flowmoe's form is also written as FILE's .bpe (prepare-data
// --tokenizer reads it). Returns lines that say what it wrote.
std::vector<std::string> import_hf(const std::string& dir, const HfImportOptions& options);

// checkpoint.init_from: hf:DIR. Fills the model's parameters (CPU or device, whole or expert shards: shards as
// Transformer::parameter_shards, or empty) and buffers from the folder, after checking that its config.json
// describes `model` (ConfigError naming the first model.* key that differs). Returns its notes.
std::vector<std::string> load_hf_weights(const std::string& dir, const ModelConfig& model,
                                         const std::vector<Variable>& params, const std::vector<ParamShard>& shards,
                                         const std::vector<Variable>& buffers);

}  // namespace flowmoe
