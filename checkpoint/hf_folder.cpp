// Reading a Hugging Face glm4_moe folder into flowmoe's tensors (see hf_folder.h).
#include "checkpoint/hf_folder.h"

#include <algorithm>
#include <filesystem>

#include "io/file_io.h"
#include "io/json.h"
#include "kernels/common/error.h"

namespace flowmoe {

namespace fs = std::filesystem;

namespace {

// A config.json or an index is a few kilobytes to a few megabytes (an index names every tensor).
constexpr uint64_t kMaxJsonBytes = uint64_t(64) << 20;

// The fused name transformers' glm4_moe module gives an expert group's tensor: experts.gate_up_proj for fc1
// [E, 2F, H] (gate rows, then up: flowmoe's layout), experts.down_proj for fc2 [E, H, F].
std::string fused_expert_name(const HfTensorGroup& g) {
  const std::string name = g.hf.front().part == HfPart::expert_down ? "down_proj" : "gate_up_proj";
  return g.name.substr(0, g.name.rfind(".experts.") + 9) + name;
}

bool is_expert_group(const HfTensorGroup& g) {
  return !g.hf.empty() && (g.hf.front().part == HfPart::expert_gate || g.hf.front().part == HfPart::expert_down);
}

}  // namespace

HfFolder::HfFolder(const std::string& dir) : dir_(dir) {
  std::error_code ec;
  FLOWMOE_CHECK(fs::is_directory(dir, ec), ConfigError, "'", dir, "' is not a folder (a Hugging Face model folder ",
                "holds config.json and model.safetensors)");
  const std::string config = (fs::path(dir) / kHfConfigFile).string();
  FLOWMOE_CHECK(fs::exists(config, ec), ConfigError, "'", dir, "' has no ", kHfConfigFile,
                " (not a Hugging Face model folder?)");
  const std::string text = read_file(config, kMaxJsonBytes, "config.json");
  model_ = model_config_from_hf(text, config, &notes_);
  num_mtp_layers_ = hf_num_mtp_layers(text, config);

  const fs::path index = fs::path(dir) / kHfIndexFile;
  if (!fs::exists(index, ec)) {
    const std::string single = (fs::path(dir) / kHfModelFile).string();
    FLOWMOE_CHECK(fs::exists(single, ec), IoError, "'", dir, "' has neither ", kHfModelFile, " nor ", kHfIndexFile);
    files_.push_back(std::make_unique<SafetensorsIndex>(single));
    for (const std::string& name : files_.back()->names_in_file_order()) where_[name] = files_.back().get();
    open_mtp_layers();
    return;
  }
  const YAML::Node j = parse_json(read_file(index.string(), kMaxJsonBytes, "safetensors index"), index.string());
  FLOWMOE_CHECK(j.IsMap() && j["weight_map"] && j["weight_map"].IsMap(), IoError, "'", index.string(),
                "' has no weight_map object");
  std::map<std::string, const SafetensorsIndex*> opened;
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    const std::string name = it->first.as<std::string>(), file = it->second.as<std::string>("");
    // A shard is a file of the folder itself: a path out of it is refused, not followed.
    FLOWMOE_CHECK(!file.empty() && file.find('/') == std::string::npos && file != "." && file != "..", IoError, "'",
                  index.string(), "': tensor '", name, "' maps to '", file, "', not a file of the folder");
    if (!opened.count(file)) {
      files_.push_back(std::make_unique<SafetensorsIndex>((fs::path(dir) / file).string()));
      opened[file] = files_.back().get();
    }
    where_[name] = opened[file];
    where_[name]->entry(name);  // IoError when the shard lacks it
  }
  open_mtp_layers();
}

// flowmoe's export writes the MTP layers to kHfMtpFile; other folders hold them among the model's tensors. The
// model gets MTP modules when every declared layer's eh_proj is there; otherwise they are left out, noted.
void HfFolder::open_mtp_layers() {
  std::error_code ec;
  const fs::path mtp_file = fs::path(dir_) / kHfMtpFile;
  if (fs::exists(mtp_file, ec) &&
      !where_.count("model.layers." + std::to_string(model_.num_hidden_layers) + ".eh_proj.weight")) {
    files_.push_back(std::make_unique<SafetensorsIndex>(mtp_file.string()));
    for (const std::string& name : files_.back()->names_in_file_order()) where_[name] = files_.back().get();
  }
  if (num_mtp_layers_ == 0) return;
  bool all = num_mtp_layers_ <= kMaxMtpDepth;
  for (int64_t k = 1; k <= num_mtp_layers_ && all; ++k)
    all = find("model.layers." + std::to_string(mtp_layer_index(model_, k)) + ".eh_proj.weight") != nullptr;
  // model_config_from_hf noted them as left out: so they are where the folder lacks some of their tensors.
  if (!all) return;
  model_.num_nextn_predict_layers = num_mtp_layers_;
  notes_.erase(std::remove_if(notes_.begin(), notes_.end(),
                              [](const std::string& n) {
                                return n.rfind("left out the ", 0) == 0 && n.find("MTP") != std::string::npos;
                              }),
               notes_.end());
  notes_.push_back("read the " + std::to_string(num_mtp_layers_) + " MTP layer" + (num_mtp_layers_ == 1 ? "" : "s") +
                   " (num_nextn_predict_layers) as the model's multi-token prediction modules");
}

std::vector<InputFile> HfFolder::inputs() const {
  std::vector<InputFile> in = {{"config.json", (fs::path(dir_) / kHfConfigFile).string()}};
  for (const auto& f : files_) in.push_back({"safetensors file", f->path()});
  return in;
}

const SafetensorsIndex* HfFolder::find(const std::string& name) const {
  const auto it = where_.find(name);
  return it == where_.end() ? nullptr : it->second;
}

Tensor HfFolder::read_experts(const std::string& name, const Shape& want, int64_t first, int64_t count) {
  const SafetensorsIndex* file = find(name);
  FLOWMOE_CHECK(file, IoError, "'", dir_, "': tensor '", name, "' is missing (the ", hf_model_type(model_),
                " model of its config.json has it)");
  const SafetensorsEntry& e = file->entry(name);
  FLOWMOE_CHECK(e.shape == want, IoError, "'", file->path(), "': tensor '", name, "' is ", shape_str(e.shape),
                ", the model of its config.json needs ", shape_str(want));
  FLOWMOE_CHECK(e.dtype == DType::f32 || e.dtype == DType::bf16 || e.dtype == DType::f64, IoError, "'", file->path(),
                "': tensor '", name, "' is ", dtype_name(e.dtype), ", not a float weight (F32, BF16 or F64)");
  used_.insert(name);
  const Tensor t = want.empty() ? file->read(name) : file->read_rows(name, first, count);
  return t.to(DType::f32);
}

Tensor HfFolder::read(const std::string& name, const Shape& want) {
  return read_experts(name, want, 0, want.empty() ? 1 : want[0]);
}

void HfFolder::fill(Tensor& dst, const HfTensorGroup& g, int64_t expert_offset) {
  if (is_expert_group(g) && find(fused_expert_name(g))) {
    dst.copy_(read_experts(fused_expert_name(g), g.shape, expert_offset, dst.size(0)));
    return;
  }
  for (const HfTensor& t : g.hf) {
    if (t.part == HfPart::empty) {  // no values: taken when there, not asked for
      if (find(t.name)) read(t.name, t.shape);
      continue;
    }
    const bool expert = t.part == HfPart::expert_gate || t.part == HfPart::expert_up || t.part == HfPart::expert_down;
    if (expert && (t.expert < expert_offset || t.expert >= expert_offset + dst.size(0))) {
      used_.insert(t.name);  // another rank's expert: read there
      continue;
    }
    hf_tensor_into(dst, read(t.name, t.shape), t, model_, expert_offset);
  }
}

void HfFolder::check_all_used() const {
  std::vector<std::string> left;
  for (const auto& [name, file] : where_) {
    const int64_t layer = hf_layer_of(name);
    const bool mtp = layer >= model_.num_hidden_layers && layer < model_.num_hidden_layers + num_mtp_layers_;
    if (!used_.count(name) && !mtp) left.push_back(name);
  }
  if (left.empty()) return;
  std::string names;
  for (size_t i = 0; i < left.size() && i < 4; ++i) names += (i ? ", '" : "'") + left[i] + "'";
  if (left.size() > 4) names += ", ... (" + std::to_string(left.size()) + " in all)";
  FLOWMOE_THROW(IoError, "'", dir_, "': ", left.size(), left.size() == 1 ? " tensor is" : " tensors are",
                " not in the ", hf_model_type(model_), " model of its config.json: ", names);
}

}  // namespace flowmoe
