// `flowmoe export --format hf` (see hf_export.h): a checkpoint's weights under transformers' glm4_moe names, its
// config.json and, where the run had one, its tokenizer.
#include "checkpoint/hf_export.h"

#include <unistd.h>

#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>

#include "checkpoint/checkpoint.h"
#include "checkpoint/hf_format.h"
#include "checkpoint/safetensors.h"
#include "config/config.h"
#include "config/output_check.h"
#include "dataset/hf_tokenizer.h"
#include "dataset/run_tokenizer.h"
#include "io/file_io.h"
#include "kernels/common/error.h"

namespace flowmoe {

namespace fs = std::filesystem;

namespace {

// The tokenizer to export: --tokenizer's file, else the run's (dataset/run_tokenizer.h); none with --no-tokenizer or
// where the run has none. *note says which.
std::optional<BpeTokenizer> export_tokenizer(const Config& cfg, const HfExportOptions& options, std::string* note) {
  if (options.no_tokenizer) {
    *note = "no tokenizer (--no-tokenizer)";
    return std::nullopt;
  }
  RunTokenizer run;
  try {
    run = RunTokenizer::for_config(cfg, options.tokenizer);
  } catch (const IoError& e) {  // the run's data is not on this machine, say
    if (!options.tokenizer.empty()) throw;
    FLOWMOE_THROW(ConfigError, "export: the run's tokenizer cannot be read (", e.what(),
                  "): give --tokenizer FILE or --no-tokenizer");
  }
  if (!run.found()) {
    *note = "no tokenizer: " + run.missing() + " (give --tokenizer FILE)";
    return std::nullopt;
  }
  *note = "tokenizer: " + run.describe();
  return run.bpe();
}

// Refuses (IoError) a checkpoint whose model.safetensors does not hold exactly the plan's tensors.
void check_checkpoint_tensors(const SafetensorsIndex& file, const std::vector<HfTensorGroup>& plan) {
  std::set<std::string> want;
  for (const HfTensorGroup& g : plan) {
    if (g.name.empty()) continue;
    want.insert(g.name);
    const SafetensorsEntry& e = file.entry(g.name);  // IoError naming a missing one
    FLOWMOE_CHECK(e.shape == g.shape, IoError, "'", file.path(), "': tensor '", g.name, "' is ", shape_str(e.shape),
                  ", its config's model needs ", shape_str(g.shape));
  }
  for (const std::string& name : file.names_in_file_order())
    FLOWMOE_CHECK(want.count(name), IoError, "'", file.path(), "': tensor '", name,
                  "' is not in the model of its config (a checkpoint of another model?)");
}

// Fills a new folder beside `out_dir` with fill(folder) and renames it to out_dir (an empty folder there is
// replaced), so a failed or interrupted export leaves no half folder under the name asked for.
void publish_folder(const std::string& out_dir, const std::function<void(const fs::path&)>& fill) {
  fs::path target(out_dir);
  while (target.has_parent_path() && target.filename().empty()) target = target.parent_path();
  std::string name = ".";  // hidden, and named by the process: two exports of one name do not meet
  name += target.filename().string();
  name += ".tmp";
  name += std::to_string(getpid());
  const fs::path tmp = target.parent_path() / name;
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directory(tmp, ec);
  FLOWMOE_CHECK(!ec, IoError, os_error("create", tmp.string(), ec));
  try {
    fill(tmp);
    fsync_dir(tmp.string());
    fs::rename(tmp, target, ec);
    FLOWMOE_CHECK(!ec, IoError, "renaming '", tmp.string(), "' to '", target.string(), "' failed: ", ec.message());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  fsync_dir(target.parent_path().empty() ? "." : target.parent_path().string());
}

}  // namespace

std::vector<std::string> export_hf(const std::string& checkpoint, const std::string& out_dir,
                                   const HfExportOptions& options) {
  check_output_folder("export: OUT_DIR '" + out_dir + "'", out_dir);
  const CheckpointMeta meta = read_checkpoint_meta(checkpoint);
  const std::string meta_file = (fs::path(checkpoint) / kCheckpointMetaFile).string();
  const Config cfg = parse_checkpoint_config(meta.config_yaml, meta_file);
  const ModelConfig& m = cfg.model;
  const std::string config_json = hf_config_json(m);  // refuses a model glm4_moe cannot hold
  std::string tokenizer_note;
  const std::optional<BpeTokenizer> tokenizer = export_tokenizer(cfg, options, &tokenizer_note);
  FLOWMOE_CHECK(!tokenizer || tokenizer->vocab_size() <= m.vocab_size, ConfigError, "export: the tokenizer's vocab ",
                tokenizer ? tokenizer->vocab_size() : 0, " does not fit model.vocab_size = ", m.vocab_size, " (",
                tokenizer_note, ")");
  const std::string tokenizer_json = tokenizer ? hf_tokenizer_json(*tokenizer) : "";

  const std::vector<HfTensorGroup> plan = hf_tensor_plan(m);
  const SafetensorsIndex file((fs::path(checkpoint) / kCheckpointModelFile).string());
  check_checkpoint_tensors(file, plan);
  // Two files: the model's tensors, and the MTP layers' (kHfMtpFile) where the model has them.
  struct HfFile {
    std::vector<TensorSpec> specs;
    std::vector<std::pair<const HfTensorGroup*, const HfTensor*>> source;  // spec i's group and HF tensor
  };
  HfFile files[2];
  for (const HfTensorGroup& g : plan)
    for (const HfTensor& t : g.hf) {
      HfFile& f = files[hf_layer_of(t.name) >= m.num_hidden_layers ? 1 : 0];
      f.specs.push_back({t.name, DType::f32, t.shape});
      f.source.push_back({&g, &t});
    }
  // A group's tensor is read once, for its HF tensors in a row (the experts' gate, up and down).
  const HfTensorGroup* held_group = nullptr;
  Tensor held;
  const auto write = [&](const fs::path& path, const HfFile& f) {
    const auto make = [&](size_t i) {
      const auto [g, t] = f.source[i];
      if (g->name.empty()) return hf_tensor_from(Tensor(), *t, m);
      if (g != held_group) {
        held = file.read(g->name).to(DType::f32);
        held_group = g;
      }
      return hf_tensor_from(held, *t, m);
    };
    write_safetensors(path.string(), f.specs, make, {{"format", "pt"}});
  };
  publish_folder(out_dir, [&](const fs::path& dir) {
    write_file_synced((dir / kHfConfigFile).string(), {&config_json});
    write(dir / kHfModelFile, files[0]);
    if (!files[1].specs.empty()) write(dir / kHfMtpFile, files[1]);
    if (tokenizer) {
      const std::string tokenizer_config = hf_tokenizer_config_json(m.max_position_embeddings);
      write_file_synced((dir / kHfTokenizerFile).string(), {&tokenizer_json});
      write_file_synced((dir / kHfTokenizerConfigFile).string(), {&tokenizer_config});
    }
  });
  const std::string mtp_note =
      files[1].specs.empty() ? ""
                             : std::string(", ") + kHfMtpFile + " (the " + std::to_string(m.num_nextn_predict_layers) +
                                   " MTP layers, " + std::to_string(files[1].specs.size()) + " tensors)";
  return {"exported " + checkpoint + " (step " + std::to_string(meta.step) + ") as " + hf_architecture(m) + " to " +
              out_dir + ": " + kHfConfigFile + ", " + kHfModelFile + " (" + std::to_string(files[0].specs.size()) +
              " tensors, f32)" + mtp_note +
              (tokenizer ? std::string(", ") + kHfTokenizerFile + ", " + kHfTokenizerConfigFile : ""),
          tokenizer_note};
}

}  // namespace flowmoe
