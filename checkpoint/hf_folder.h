// A Hugging Face glm4_moe folder read for flowmoe (`flowmoe import --format hf`, checkpoint.init_from: hf:DIR):
// its config.json mapped to a ModelConfig (checkpoint/hf_format.h) and its safetensors (model.safetensors, or the
// shards model.safetensors.index.json names) read tensor by tensor into flowmoe's tensors. Tensors may be
// F32, BF16 or F64 and become f32; the experts may be per expert (experts.N.gate_proj.weight, as transformers
// saves them) or fused (experts.gate_up_proj, as its glm4_moe module holds them).
#pragma once
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/hf_format.h"
#include "checkpoint/safetensors.h"
#include "config/output_check.h"

namespace flowmoe {

class HfFolder {
 public:
  // Reads config.json (ConfigError for what flowmoe does not map, naming the field) and opens the tensors'
  // files (IoError naming the file).
  explicit HfFolder(const std::string& dir);
  const std::string& dir() const { return dir_; }
  const ModelConfig& model() const { return model_; }
  const std::vector<std::string>& notes() const { return notes_; }  // what is left out, and why
  std::vector<InputFile> inputs() const;                            // the files read: a command writes none of them

  // Fills `dst` (CPU f32) with group g's values: the whole tensor, or for an expert shard the experts
  // [expert_offset, expert_offset + dst.size(0)). IoError names a missing tensor or one of another shape.
  void fill(Tensor& dst, const HfTensorGroup& g, int64_t expert_offset = 0);
  // Refuses (IoError) the folder's tensors no fill() took, but the MTP layers' (DeepSeek-V3's checkpoints hold
  // copies of the embedding and the head there, which flowmoe shares with the model), naming them.
  void check_all_used() const;

 private:
  Tensor read(const std::string& name, const Shape& want);  // f32, after the shape check; marks it used
  Tensor read_experts(const std::string& name, const Shape& want, int64_t first, int64_t count);
  const SafetensorsIndex* find(const std::string& name) const;
  void open_mtp_layers();

  std::string dir_;
  ModelConfig model_;
  int64_t num_mtp_layers_ = 0;
  std::vector<std::string> notes_;
  std::vector<std::unique_ptr<SafetensorsIndex>> files_;
  std::map<std::string, const SafetensorsIndex*> where_;  // tensor -> its file
  std::set<std::string> used_;
};

}  // namespace flowmoe
