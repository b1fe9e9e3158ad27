// export_hf and import_hf (checkpoint/hf_export.h): a checkpoint exported and imported back is the same bits and
// trains; a folder transformers may write (fused experts, shards with an index) reads the same; every refusal
// of either direction writes nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <set>

#include "checkpoint/hf_export.h"
#include "checkpoint/hf_folder.h"
#include "dataset/hf_tokenizer.h"
#include "io/file_io.h"
#include "tests/support/hf_models.h"
#include "tests/support/train_fixtures.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

// The names in folder `d`, sorted: what a refused command must leave as it was.
std::vector<std::string> listing(const fs::path& d) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(d)) out.push_back(fs::relative(e.path(), d).string());
  std::sort(out.begin(), out.end());
  return out;
}

// A checkpoint of m and its export: dir/ck/step_00000003 and dir/hf.
struct Exported {
  Config cfg;
  std::string checkpoint;
  fs::path hf;
};
Exported export_model(const ModelConfig& m, const fs::path& dir) {
  Exported e{hf_run_config(m, dir / "run"), "", dir / "hf"};
  e.checkpoint = hf_test_checkpoint(e.cfg, (dir / "ck").string());
  export_hf(e.checkpoint, e.hf.string());
  return e;
}

// Rewrites the folder's model.safetensors with edit applied to its tensors.
void edit_tensors(const fs::path& hf, const std::function<void(std::vector<NamedTensor>&)>& edit) {
  std::vector<NamedTensor> t = read_safetensors((hf / kHfModelFile).string());
  edit(t);
  write_safetensors((hf / kHfModelFile).string(), t, {{"format", "pt"}});
}

HfImportOptions import_options(const fs::path& dir) {
  return {(dir / "imported.yaml").string(), (dir / "imp").string()};
}

}  // namespace

TEST(HfRoundTrip, ExportThenImportIsBitIdenticalAndTrains) {
  for (const ModelConfig& m : {hf_moe_model(), hf_dense_model(), hf_moe_unshared_model()}) {
    const fs::path d = fresh_dir("hf_roundtrip");
    const Exported e = export_model(m, d);
    EXPECT_EQ(listing(e.hf), std::vector<std::string>({kHfConfigFile, kHfModelFile}));  // synthetic data: no tokenizer
    EXPECT_EQ(listing(d),
              std::vector<std::string>({"ck", "ck/step_00000003", "ck/step_00000003/meta.json",
                                        "ck/step_00000003/model.safetensors", "ck/step_00000003/optimizer.safetensors",
                                        "hf", "hf/config.json", "hf/model.safetensors"}));  // no temporary folder left
    import_hf(e.hf.string(), import_options(d));
    EXPECT_TRUE(same_model_weights(e.checkpoint, (d / "imp" / "step_00000000").string()));
    // The written config's run folder is runs/imported, as for any config: the test's goes to d.
    Config imported = load_config((d / "imported.yaml").string(), {"logging.out_dir=" + (d / "run2").string()});
    EXPECT_EQ(hf_config_json(imported.model), hf_config_json(m));
    EXPECT_EQ(imported.checkpoint.resume, "true");
    const TrainResult r = train(imported, quiet());
    EXPECT_EQ(r.first_step, 1);  // from the imported step 0
    ASSERT_EQ(r.losses.size(), size_t(imported.train.steps));
    for (double loss : r.losses) EXPECT_TRUE(std::isfinite(loss));
  }
}

// MTP modules go to mtp.safetensors under DeepSeek-V3's layer numbers (model.safetensors keeps exactly what
// transformers' glm4_moe loads), config.json declares them, and the import reads them back bit for bit. A folder
// that declares MTP layers but lacks their tensors imports without them, noted.
TEST(HfRoundTrip, MtpLayersRoundTripBitIdentical) {
  ModelConfig m = hf_moe_model();
  m.num_nextn_predict_layers = 2;
  const fs::path d = fresh_dir("hf_roundtrip_mtp");
  const Exported e = export_model(m, d);
  EXPECT_EQ(listing(e.hf), std::vector<std::string>({kHfConfigFile, kHfModelFile, kHfMtpFile}));
  const std::string L = std::to_string(m.num_hidden_layers);
  for (const NamedTensor& t : read_safetensors((e.hf / kHfModelFile).string()))
    EXPECT_LT(hf_layer_of(t.name), m.num_hidden_layers) << t.name;
  std::set<std::string> mtp_names;
  for (const NamedTensor& t : read_safetensors((e.hf / kHfMtpFile).string())) mtp_names.insert(t.name);
  for (const std::string& n : {"model.layers." + L + ".eh_proj.weight", "model.layers." + L + ".enorm.weight",
                               "model.layers." + L + ".hnorm.weight", "model.layers." + L + ".shared_head.norm.weight",
                               "model.layers." + L + ".mlp.gate.e_score_correction_bias",
                               "model.layers." + std::to_string(m.num_hidden_layers + 1) + ".self_attn.q_proj.weight"})
    EXPECT_TRUE(mtp_names.count(n)) << n;
  EXPECT_NE(read_file((e.hf / kHfConfigFile).string(), 1 << 20, "config").find("\"num_nextn_predict_layers\": 2,"),
            std::string::npos);
  import_hf(e.hf.string(), import_options(d));
  EXPECT_TRUE(same_model_weights(e.checkpoint, (d / "imp" / "step_00000000").string()));
  const Config imported = load_config((d / "imported.yaml").string());
  EXPECT_EQ(imported.model.num_nextn_predict_layers, 2);
  // Without its MTP file the folder is the model alone.
  fs::remove(e.hf / kHfMtpFile);
  const HfFolder plain(e.hf.string());
  EXPECT_EQ(plain.model().num_nextn_predict_layers, 0);
  ASSERT_FALSE(plain.notes().empty());
  EXPECT_NE(plain.notes().back().find("left out the 2 MTP layers"), std::string::npos) << plain.notes().back();
}

// An MLA model (deepseek_v3) with its MTP module, with and without the query bottleneck, and with DeepSeek-V3's
// head widths (imported with train.device: cpu): every tensor back bit for bit, the MTP layer's attention from
// mtp.safetensors.
TEST(HfRoundTrip, MlaRoundTripsBitIdentical) {
  ModelConfig wide = hf_mla_model();  // DeepSeek-V3's query/key heads with values as wide: more than the GPU takes
  wide.qk_nope_head_dim = 128;
  wide.qk_rope_head_dim = 64;
  wide.v_head_dim = 192;
  for (const ModelConfig& m : {hf_mla_model(12), hf_mla_model(0), wide}) {
    SCOPED_TRACE(hf_config_json(m));
    const fs::path d = fresh_dir("hf_roundtrip_mla");
    const Exported e = export_model(m, d);
    EXPECT_EQ(listing(e.hf), std::vector<std::string>({kHfConfigFile, kHfModelFile, kHfMtpFile}));
    std::set<std::string> mtp_names;
    for (const NamedTensor& t : read_safetensors((e.hf / kHfMtpFile).string())) mtp_names.insert(t.name);
    EXPECT_TRUE(mtp_names.count("model.layers.3.self_attn.kv_a_proj_with_mqa.weight"));
    import_hf(e.hf.string(), import_options(d));
    EXPECT_TRUE(same_model_weights(e.checkpoint, (d / "imp" / "step_00000000").string()));
    const Config imported = load_config((d / "imported.yaml").string());
    EXPECT_EQ(imported.model.attention, AttentionType::mla);
    EXPECT_EQ(hf_config_json(imported.model), hf_config_json(m));
    EXPECT_EQ(imported.train.device, attention_fits_cuda(m) ? DeviceChoice::automatic : DeviceChoice::cpu);
  }
}

// checkpoint.init_from: hf:DIR starts a run from the folder's weights: it trains as the imported checkpoint
// resumed does, loss for loss; a folder of another model is refused naming the field.
TEST(HfRoundTrip, InitFromTrainsAsTheImport) {
  const fs::path d = fresh_dir("hf_init_from");
  const Exported e = export_model(hf_moe_model(), d);
  import_hf(e.hf.string(), import_options(d));
  const TrainResult imported =
      train(load_config((d / "imported.yaml").string(), {"logging.out_dir=" + (d / "a").string()}), quiet());
  Config c = load_config((d / "imported.yaml").string(),
                         {"logging.out_dir=" + (d / "b").string(), "checkpoint.resume=false",
                          "checkpoint.dir=" + (d / "b_ck").string(), "checkpoint.init_from=hf:" + e.hf.string()});
  const TrainResult from = train(c, quiet());
  EXPECT_EQ(from.first_step, 1);
  EXPECT_EQ(from.losses, imported.losses);
  c.checkpoint.init_from.clear();
  fs::remove_all(d / "b_ck");
  EXPECT_NE(train(c, quiet()).losses, imported.losses);  // the seeded init: another start
  c.model.rope_theta = 10000.0;
  c.checkpoint.init_from = "hf:" + e.hf.string();
  fs::remove_all(d / "b_ck");
  EXPECT_TRUE(throws_naming<ConfigError>([&] { train(c, quiet()); },
                                         {"checkpoint.init_from", "rope_theta is 5000.0", "gives 10000.0"}));
}

// transformers' glm4_moe module holds the experts fused (experts.gate_up_proj [E, 2F, H], experts.down_proj
// [E, H, F]), and large models come as shards named by model.safetensors.index.json: both read as the same
// weights, also one expert shard's rows at a time.
TEST(HfRoundTrip, FusedExpertsAndShardsReadTheSame) {
  const fs::path d = fresh_dir("hf_fused");
  const Exported e = export_model(hf_moe_model(), d);
  const ModelConfig& m = e.cfg.model;
  const std::vector<NamedTensor> all = read_safetensors((e.hf / kHfModelFile).string());
  const std::vector<NamedTensor> ck = read_safetensors(e.checkpoint + "/" + kCheckpointModelFile);
  std::vector<NamedTensor> first, second;  // layer 1's experts fused, all else per expert; split over two files
  for (const NamedTensor& t : all)
    if (t.name.rfind("model.layers.1.mlp.experts.", 0) != 0)
      (first.size() < all.size() / 2 ? first : second).push_back(t);
  for (const NamedTensor& t : ck)
    if (t.name == "model.layers.1.mlp.experts.fc1.weight")
      second.push_back({"model.layers.1.mlp.experts.gate_up_proj", t.tensor});
    else if (t.name == "model.layers.1.mlp.experts.fc2.weight")
      second.push_back({"model.layers.1.mlp.experts.down_proj", t.tensor});
  const fs::path sharded = d / "sharded";
  fs::create_directories(sharded);
  fs::copy_file(e.hf / kHfConfigFile, sharded / kHfConfigFile);
  write_safetensors((sharded / "model-00001-of-00002.safetensors").string(), first, {{"format", "pt"}});
  write_safetensors((sharded / "model-00002-of-00002.safetensors").string(), second, {{"format", "pt"}});
  std::ofstream index(sharded / kHfIndexFile);
  index << "{\"metadata\": {}, \"weight_map\": {";
  for (size_t i = 0; i < first.size() + second.size(); ++i)
    index << (i ? ", " : "") << "\"" << (i < first.size() ? first[i] : second[i - first.size()]).name
          << "\": \"model-0000" << (i < first.size() ? 1 : 2) << "-of-00002.safetensors\"";
  index << "}}\n";
  index.close();
  import_hf(sharded.string(), import_options(d));
  EXPECT_TRUE(same_model_weights(e.checkpoint, (d / "imp" / "step_00000000").string()));

  // Experts [4, 6) of each expert tensor, from either form (an expert-parallel rank's shard).
  for (const fs::path& folder_dir : {e.hf, sharded}) {
    HfFolder folder(folder_dir.string());
    for (const HfTensorGroup& g : hf_tensor_plan(m)) {
      if (g.name.find(".experts.") == std::string::npos) continue;
      Shape rows = g.shape;
      rows[0] = 2;
      Tensor mine = Tensor::zeros(rows, DType::f32);
      folder.fill(mine, g, 4);
      const SafetensorsIndex file(e.checkpoint + "/" + kCheckpointModelFile);
      EXPECT_TRUE(bit_equal(mine, file.read_rows(g.name, 4, 2))) << folder_dir << " " << g.name;
    }
  }
}

TEST(HfRoundTrip, LoadWeightsIntoAModel) {
  const fs::path d = fresh_dir("hf_load");
  const Exported e = export_model(hf_moe_model(), d);
  Transformer model(e.cfg.model, Device::cpu(), DType::f32, 99);
  load_hf_weights(e.hf.string(), e.cfg.model, model.parameters(), model.parameter_shards(), model.buffers());
  Transformer reference(e.cfg.model, Device::cpu(), DType::f32, 1);
  load_checkpoint(e.checkpoint, reference.parameters(), nullptr, nullptr, reference.buffers());
  for (size_t i = 0; i < model.parameters().size(); ++i)
    EXPECT_TRUE(bit_equal(model.parameters()[i].data(), reference.parameters()[i].data()))
        << model.parameters()[i].name();
  for (size_t i = 0; i < model.buffers().size(); ++i)
    EXPECT_TRUE(bit_equal(model.buffers()[i].data(), reference.buffers()[i].data())) << model.buffers()[i].name();
  ModelConfig wider = e.cfg.model;
  wider.intermediate_size = 64;
  Transformer other(wider, Device::cpu(), DType::f32, 1);
  EXPECT_TRUE(throws_naming<ConfigError>(
      [&] { load_hf_weights(e.hf.string(), wider, other.parameters(), {}, other.buffers()); },
      {"intermediate_size is 48, the config's model.intermediate_size gives 64"}));
}

// Each refusal of a folder: one line naming the tensor, field or vocab; no config, checkpoint or tokenizer written.
TEST(HfRoundTrip, ImportRefusalsWriteNothing) {
  const fs::path d = fresh_dir("hf_refuse");
  const Exported e = export_model(hf_moe_model(), d);
  const std::vector<std::string> before = listing(d);
  const auto refused = [&](const std::function<void()>& damage, const std::vector<const char*>& named, bool config) {
    const fs::path broken = d / "broken";
    fs::remove_all(broken);
    fs::copy(e.hf, broken);
    damage();
    const auto run = [&] { import_hf(broken.string(), import_options(d)); };
    const bool ok = config ? bool(throws_naming<ConfigError>(run, {named[0]}))
                           : bool(throws_naming<IoError>(run, {named[0], named.size() > 1 ? named[1] : ""}));
    EXPECT_TRUE(ok) << named[0];
    fs::remove_all(broken);
    EXPECT_EQ(listing(d), before) << named[0];
  };
  const fs::path b = d / "broken";
  refused([&] { edit_tensors(b, [](auto& t) { t.erase(t.begin() + 3); }); },
          {"model.layers.0.self_attn.k_proj.weight", "is missing"}, false);
  refused(
      [&] {
        edit_tensors(b, [](auto& t) {
          for (NamedTensor& x : t)
            if (x.name == "model.layers.2.mlp.experts.5.up_proj.weight") x.tensor = Tensor::zeros({16, 31}, DType::f32);
        });
      },
      {"'model.layers.2.mlp.experts.5.up_proj.weight' is [16, 31]", "needs [16, 32]"}, false);
  refused(
      [&] { edit_tensors(b, [](auto& t) {
              t.push_back({"model.layers.0.self_attn.q_norm.weight", t[1].tensor});
            }); },
      {"not in the glm4_moe model of its config.json", "model.layers.0.self_attn.q_norm.weight"}, false);
  refused(
      [&] {
        std::ofstream(b / kHfConfigFile) << std::regex_replace(read_bytes(e.hf / kHfConfigFile),
                                                               std::regex("\"glm4_moe\""), "\"llama\"");
      },
      {"model_type: 'llama' is not glm4_moe"}, true);
  refused([&] { std::ofstream(b / kHfTokenizerFile) << hf_tokenizer_json(BpeTokenizer()); },
          {"its vocab of 256 tokens does not fit vocab_size = 96"}, true);
  refused([&] { fs::remove(b / kHfModelFile); }, {"has neither model.safetensors nor model.safetensors.index.json"},
          false);
}

TEST(HfRoundTrip, ExportRefusalsWriteNothing) {
  const fs::path d = fresh_dir("hf_export_refuse");
  const Config cfg = hf_run_config(hf_moe_model(), d / "run");
  const std::string ck = hf_test_checkpoint(cfg, (d / "ck").string());
  fs::create_directories(d / "full");
  std::ofstream(d / "full" / "x") << "x";
  const std::vector<std::string> before = listing(d);
  EXPECT_TRUE(throws_naming<ConfigError>([&] { export_hf(ck, (d / "full").string()); }, {"exists and is not empty"}));
  EXPECT_TRUE(throws_naming<ConfigError>([&] { export_hf(ck, ck + "/hf"); }, {"is in the checkpoint folder"}));
  EXPECT_TRUE(throws_naming<ConfigError>([&] { export_hf(ck, (d / "no" / "hf").string()); }, {"does not exist"}));
  EXPECT_EQ(listing(d), before);

  // A checkpoint whose config is not its tensors' model; a softmax router.
  Config other = cfg;
  other.model.num_hidden_layers = 2;
  const std::string meta_json = read_bytes(fs::path(ck) / kCheckpointMetaFile);
  const auto with_config = [&](const Config& c) {
    CheckpointMeta meta = read_checkpoint_meta(ck);
    meta.config_yaml = to_yaml(c);
    std::string j =
        meta_json.substr(0, meta_json.find("\"config\": ")) + "\"config\": " + json_escape(meta.config_yaml) + "\n}\n";
    std::ofstream(fs::path(ck) / kCheckpointMetaFile) << j;
  };
  with_config(other);
  EXPECT_TRUE(
      throws_naming<IoError>([&] { export_hf(ck, (d / "hf").string()); },
                             {"tensor 'model.layers.2.input_layernorm.weight' is not in the model of its config"}));
  other = cfg;
  other.model.scoring_func = RouterScoring::softmax;
  with_config(other);
  EXPECT_TRUE(throws_naming<ConfigError>([&] { export_hf(ck, (d / "hf").string()); }, {"model.scoring_func: softmax"}));
  std::ofstream(fs::path(ck) / kCheckpointMetaFile) << meta_json;
  EXPECT_EQ(listing(d), before);
}
