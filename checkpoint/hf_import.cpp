// `flowmoe import --format hf` and checkpoint.init_from: hf:DIR (see hf_export.h): a glm4_moe folder's weights
// as a flowmoe checkpoint of step 0, or straight into a model's parameters.
#include <filesystem>
#include <optional>
#include <sstream>

#include "checkpoint/checkpoint.h"
#include "checkpoint/hf_export.h"
#include "checkpoint/hf_folder.h"
#include "config/config.h"
#include "config/output_check.h"
#include "dataset/hf_tokenizer.h"
#include "io/file_io.h"
#include "kernels/common/error.h"

namespace flowmoe {

namespace fs = std::filesystem;

namespace {

// A tokenizer.json is a few megabytes (a vocab of 150k tokens and its merges take about 10); a whole-file read
// needs a bound.
constexpr uint64_t kMaxTokenizerBytes = uint64_t(256) << 20;

// The folder's tokenizer.json, when it has one; ConfigError when its vocab does not fit the model's.
std::optional<HfTokenizerInfo> folder_tokenizer(const HfFolder& folder) {
  const std::string path = (fs::path(folder.dir()) / kHfTokenizerFile).string();
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  HfTokenizerInfo info = read_hf_tokenizer(read_file(path, kMaxTokenizerBytes, "tokenizer.json"), path);
  FLOWMOE_CHECK(info.vocab_size <= folder.model().vocab_size, ConfigError, "'", path, "': its vocab of ",
                info.vocab_size, " tokens does not fit vocab_size = ", folder.model().vocab_size, " of ", kHfConfigFile,
                " (a token id would index past the embedding)");
  return info;
}

// Section `name` of to_yaml's text: its line and the indented lines under it.
std::string yaml_section(const std::string& yaml, const std::string& name) {
  std::istringstream in(yaml);
  std::string line, out;
  bool inside = false;
  while (std::getline(in, line)) {
    if (!line.empty() && line[0] != ' ' && line[0] != '#') inside = line == name + ":";
    if (inside) out += line + "\n";
  }
  return out;
}

// Refuses (ConfigError) a folder whose model is not `model`: their config.json texts compared field by field
// (the one mapping decides what is the same model), naming the first field that differs as its model.* key.
void check_same_model(const ModelConfig& folder, const ModelConfig& model, const std::string& path) {
  std::istringstream a(hf_config_json(folder)), b(hf_config_json(model));
  std::string x, y;
  while (std::getline(a, x) && std::getline(b, y)) {
    if (x == y) continue;
    const auto field = [](const std::string& line) { return line.substr(0, line.find(':')); };
    const auto value = [](const std::string& line) {
      std::string v = line.substr(line.find(':') + 2);
      return v.back() == ',' ? v.substr(0, v.size() - 1) : v;
    };
    std::string key = field(x);
    key.erase(0, key.find_first_not_of(" \""));
    key.erase(key.find('"'));
    FLOWMOE_THROW(ConfigError, "checkpoint.init_from: '", path, "': ", key, " is ", value(x), ", the config's model.",
                  key, " gives ", value(y), " (the folder's model must be the config's)");
  }
}

}  // namespace

std::vector<std::string> import_hf(const std::string& dir, const HfImportOptions& options) {
  FLOWMOE_CHECK(!options.config_out.empty(), ConfigError, "import: --config-out FILE is required");
  HfFolder folder(dir);
  std::optional<HfTokenizerInfo> tokenizer = folder_tokenizer(folder);
  Config cfg;
  cfg.file = options.config_out;  // runs/<its name>, as a run of the written file
  cfg.model = folder.model();
  cfg.data.seq_len = std::min(cfg.data.seq_len, cfg.model.max_position_embeddings);
  cfg.checkpoint.resume = "true";
  if (!options.checkpoint_dir.empty()) cfg.checkpoint.dir = options.checkpoint_dir;
  if (!attention_fits_cuda(cfg.model))
    cfg.train.device = DeviceChoice::cpu;  // written so: the config then loads as it is
  validate(cfg);
  const std::string root = cfg.checkpoint_dir();
  const std::string bpe_file =
      tokenizer && tokenizer->flowmoe_form ? fs::path(options.config_out).replace_extension(".bpe").string() : "";

  // Every output checked, and every tensor read, before anything is written.
  const std::vector<InputFile> inputs = folder.inputs();
  check_output_file("import: --config-out '" + options.config_out + "'", options.config_out, inputs, "model.yaml");
  if (!bpe_file.empty()) check_output_file("import: the tokenizer file '" + bpe_file + "'", bpe_file, inputs);
  FLOWMOE_CHECK(latest_checkpoint(root).empty(), ConfigError, "import: the checkpoint folder '", root,
                "' already holds a checkpoint (", latest_checkpoint(root),
                "), which a resume would take before the import's; name another with --checkpoint-dir");
  const std::vector<HfTensorGroup> plan = hf_tensor_plan(cfg.model);
  std::vector<Variable> params, buffers;
  std::vector<Tensor> exp_avg, exp_avg_sq;
  for (const HfTensorGroup& g : plan) {
    if (g.name.empty()) {  // the empty tensors: read only to mark them used
      Tensor none;
      folder.fill(none, g);
      continue;
    }
    Tensor t = Tensor::zeros(g.shape, DType::f32, Device::cpu());
    folder.fill(t, g);
    (g.buffer ? buffers : params).push_back(Variable(t, false, g.name));
    if (g.buffer) continue;
    exp_avg.push_back(Tensor::zeros(g.shape, cfg.optimizer.moment_dtype, Device::cpu()));
    exp_avg_sq.push_back(Tensor::zeros(g.shape, cfg.optimizer.moment_dtype, Device::cpu()));
  }
  folder.check_all_used();

  CheckpointMeta meta;
  meta.data_seed = uint64_t(cfg.data.seed);
  meta.init_seed = uint64_t(cfg.train.seed);
  // Only the model: a resume compares the data keys its checkpoint's config names with the run's, and this
  // step 0 has read no data, so the run may take any.
  meta.config_yaml = yaml_section(to_yaml(cfg), "model");
  const std::string checkpoint = save_checkpoint(root, meta, params, exp_avg, exp_avg_sq, 1, buffers);
  if (!bpe_file.empty()) tokenizer->bpe.save(bpe_file);
  const std::string yaml = "# imported from the " + std::string(hf_model_type(cfg.model)) + " folder " + dir +
                           " by `flowmoe import --format hf`; `flowmoe train --config " + options.config_out +
                           "` starts from its weights (checkpoint.resume: true)\n" + to_yaml(cfg);
  write_file_synced(options.config_out, {&yaml});

  std::vector<std::string> lines = folder.notes();
  if (cfg.train.device == DeviceChoice::cpu)
    lines.push_back("train.device: cpu: the attention heads (qk_nope_head_dim + qk_rope_head_dim = " +
                    std::to_string(attention_qk_head_dim(cfg.model)) + ", v_head_dim " +
                    std::to_string(cfg.model.v_head_dim) + ") are wider than the CUDA attention kernels take");
  lines.push_back("imported " + dir + " (" + hf_architecture(cfg.model) + ", " +
                  std::to_string(params.size() + buffers.size()) + " tensors) as " + checkpoint + "; wrote " +
                  options.config_out);
  if (!bpe_file.empty())
    lines.push_back("tokenizer: wrote " + bpe_file + " (flowmoe prepare-data --tokenizer " + bpe_file + ")");
  else if (tokenizer)
    lines.push_back(std::string("tokenizer: ") + kHfTokenizerFile + " (vocab " + std::to_string(tokenizer->vocab_size) +
                    ") is not flowmoe's byte-level BPE (" + tokenizer->why_not +
                    "): tokenize the data with its own library");
  return lines;
}

std::vector<std::string> load_hf_weights(const std::string& dir, const ModelConfig& model,
                                         const std::vector<Variable>& params, const std::vector<ParamShard>& shards,
                                         const std::vector<Variable>& buffers) {
  HfFolder folder(dir);
  check_same_model(folder.model(), model, (fs::path(dir) / kHfConfigFile).string());
  folder_tokenizer(folder);
  std::vector<Variable> targets = params;
  targets.insert(targets.end(), buffers.begin(), buffers.end());
  size_t next = 0;
  for (const HfTensorGroup& g : hf_tensor_plan(model)) {
    if (g.name.empty()) {
      Tensor none;
      folder.fill(none, g);
      continue;
    }
    FLOWMOE_CHECK(next < targets.size() && targets[next].name() == g.name, Error, "load_hf_weights: the model's ",
                  next < targets.size() ? "tensor '" + targets[next].name() + "'" : std::string("end"),
                  " where the plan has '", g.name, "'");
    const bool param = next < params.size();
    const ParamShard* shard = param && !shards.empty() ? &shards[next] : nullptr;
    Tensor dst = targets[next++].data();
    Tensor host = Tensor::zeros(dst.shape(), DType::f32, Device::cpu());
    folder.fill(host, g, shard ? shard->offset : 0);
    dst.copy_(host.to(dst.device()).to(dst.dtype()));
  }
  folder.check_all_used();
  return folder.notes();
}

}  // namespace flowmoe
