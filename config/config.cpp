// Strict YAML parsing with line numbers, --set overrides and cross-key validation, over the key
// table of config_schema.cpp; the resolved config and the key reference as text.
#include "config/config.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <set>
#include <sstream>

#include "config/config_checks.h"
#include "config/config_schema.h"
#include "io/file_io.h"
#include "kernels/common/error.h"

namespace flowmoe {

using namespace config_schema;

namespace {

namespace fs = std::filesystem;

std::string stem_of(const std::string& path) {
  std::string stem = fs::path(path).stem().string();
  return stem.empty() ? "run" : stem;
}

// Keys that were removed, with what replaces them: an old config gets the reason, not "unknown key".
const char* retired_key_note(const std::string& dotted) {
  if (dotted == "parallel.data_parallel_size")
    return "this key was removed: the data-parallel size is the number of launched processes "
           "(mpirun -np N, srun -n N); delete the line";
  return nullptr;
}

[[noreturn]] void fail_unknown_key(const std::string& where, const std::string& section, const std::string& key) {
  const std::string dotted = section + "." + key;
  if (const char* note = retired_key_note(dotted)) fail(where, dotted, note);
  std::vector<std::string> keys;
  for (const Field& g : schema())
    if (g.section == section) keys.push_back(g.key);
  fail(where, dotted, "unknown key in section '" + section + "'" + suggestion(key, keys));
}

// ---- YAML walking -------------------------------------------------------------------------------

std::string at(const std::string& name, const YAML::Node& n) { return name + ":" + std::to_string(n.Mark().line + 1); }

void read_yaml(Config& cfg, const YAML::Node& root, const std::string& name) {
  if (!root || root.IsNull()) return;  // an empty file: every key at its default
  if (!root.IsMap()) fail(at(name, root), "", "the top level must be a mapping of sections (model:, data:, ...)");
  std::set<std::string> seen_sections;
  for (auto it = root.begin(); it != root.end(); ++it) {
    YAML::Node k = it->first;
    if (!k.IsScalar()) fail(at(name, k), "", "section names must be plain words");
    std::string section = k.Scalar();
    if (std::find(sections().begin(), sections().end(), section) == sections().end())
      fail(at(name, k), "",
           "unknown section '" + section + "'" + suggestion(section, sections()) +
               "; sections are model, data, train, optimizer, precision, parallel, checkpoint, logging");
    if (!seen_sections.insert(section).second) fail(at(name, k), section, "section given twice");
    YAML::Node body = it->second;
    if (body.IsNull()) continue;
    if (!body.IsMap()) fail(at(name, body), section, "expected a mapping of keys");
    std::set<std::string> seen_keys;
    for (auto kv = body.begin(); kv != body.end(); ++kv) {
      YAML::Node kn = kv->first;
      if (!kn.IsScalar()) fail(at(name, kn), section, "keys must be plain words");
      std::string key = kn.Scalar();
      const Field* f = find_field(section, key);
      if (!f) fail_unknown_key(at(name, kn), section, key);
      if (!seen_keys.insert(key).second) fail(at(name, kn), f->dotted(), "key given twice");
      YAML::Node v = kv->second;
      if (v.IsNull() && f->kind != Kind::string && f->kind != Kind::optional_integer)
        fail(at(name, kn), f->dotted(), "missing value (expected " + describe_type(*f) + ")");
      if (f->kind == Kind::choice_list && v.IsSequence()) {
        std::string joined;
        for (const YAML::Node& item : v) {
          if (!item.IsScalar())
            fail(at(name, item), f->dotted(), "expected " + describe_type(*f) + ", got a nested value");
          joined += (joined.empty() ? "" : ",") + item.Scalar();
        }
        set_field(cfg, *f, joined, at(name, kn));
        continue;
      }
      if (!v.IsNull() && !v.IsScalar())
        fail(at(name, v), f->dotted(), "expected " + describe_type(*f) + ", got a " + (v.IsMap() ? "mapping" : "list"));
      set_field(cfg, *f, v.IsNull() ? "" : v.Scalar(), at(name, kn));
    }
  }
}

// The events of one YAML document: where it starts, and the first node that is not null.
class DocumentProbe : public YAML::EventHandler {
 public:
  YAML::Mark start, content;
  bool has_content = false;

  void OnDocumentStart(const YAML::Mark& m) override { start = m; }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark& m, YAML::anchor_t) override { saw(m); }
  void OnScalar(const YAML::Mark& m, const std::string&, YAML::anchor_t, const std::string&) override { saw(m); }
  void OnSequenceStart(const YAML::Mark& m, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {
    saw(m);
  }
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark& m, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {
    saw(m);
  }
  void OnMapEnd() override {}

 private:
  void saw(const YAML::Mark& m) {
    if (!has_content) content = m;
    has_content = true;
  }
};

// yaml-cpp's Load reads only the first document, and at a token no document can start with (a
// stray ',') it returns null without an error and without moving on. Walking the documents finds
// both: content after the first document, and input the parser cannot advance over.
void check_one_document(const std::string& text, const std::string& name) {
  std::istringstream in(text);
  YAML::Parser parser(in);
  int last_start = -1;
  for (size_t doc = 0;; ++doc) {
    DocumentProbe probe;
    if (!parser.HandleNextDocument(probe)) return;
    const YAML::Mark& m = probe.start;
    if (m.pos <= last_start || doc > text.size()) {  // every document takes at least one byte
      const unsigned char c = m.pos >= 0 && size_t(m.pos) < text.size() ? text[size_t(m.pos)] : 0;
      char shown[16];
      std::snprintf(shown, sizeof shown, c >= 0x20 && c < 0x7f ? "'%c'" : "byte 0x%02x", c);
      fail(name + ":" + std::to_string(m.line + 1) + ":" + std::to_string(m.column + 1), "",
           std::string("YAML syntax error: cannot parse ") + shown + " here");
    }
    if (doc > 0 && probe.has_content)
      fail(name + ":" + std::to_string(probe.content.line + 1), "",
           "a second YAML document (after '---'): a config is one document");
    last_start = m.pos;
  }
}

// The YAML of a config: one document, or none (a null node).
YAML::Node load_yaml(const std::string& text, const std::string& name) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
    check_one_document(text, name);
  } catch (const YAML::Exception& e) {
    fail(name + ":" + std::to_string(e.mark.line + 1) + ":" + std::to_string(e.mark.column + 1), "",
         "YAML syntax error: " + e.msg);
  }
  return root;
}

Config config_from_yaml(const YAML::Node& root, const std::string& name, const std::vector<std::string>& overrides,
                        bool runs_here = true) {
  Config cfg;
  cfg.file = name;
  read_yaml(cfg, root, name);
  for (const std::string& o : overrides) apply_override(cfg, o);
  validate(cfg, runs_here);
  return cfg;
}

}  // namespace

// ---- Config -------------------------------------------------------------------------------------

std::string Config::origin(const std::string& dotted_key) const {
  auto it = origins.find(dotted_key);
  return it == origins.end() ? "default" : it->second;
}

std::string Config::run_dir() const { return logging.out_dir.empty() ? "runs/" + stem_of(file) : logging.out_dir; }

std::string Config::checkpoint_dir() const {
  return checkpoint.dir.empty() ? (fs::path(run_dir()) / "checkpoints").string() : checkpoint.dir;
}

void apply_override(Config& cfg, const std::string& assignment) {
  const std::string where = "--set " + assignment;
  size_t eq = assignment.find('=');
  if (eq == std::string::npos) fail(where, "", "expected section.key=value");
  std::string dotted = assignment.substr(0, eq), value = assignment.substr(eq + 1);
  size_t dot = dotted.find('.');
  if (dot == std::string::npos)
    fail(where, "", "expected section.key=value (the key needs its section, e.g. train.steps=100)");
  std::string section = dotted.substr(0, dot), key = dotted.substr(dot + 1);
  if (std::find(sections().begin(), sections().end(), section) == sections().end())
    fail(where, "", "unknown section '" + section + "'" + suggestion(section, sections()));
  const Field* f = find_field(section, key);
  if (!f) fail_unknown_key(where, section, key);
  set_field(cfg, *f, value, where);
}

// Each section's own cross-key checks, in a fixed order: the first problem found is the one reported.
void validate(const Config& c, bool runs_here) {
  const KeyReport report(c);
  check_model_shape(c, report);
  if (runs_here) check_attention_kernel(c, report);
  check_moe_routing(c, report);
  check_data_source(c, report, runs_here);
  check_init_from(c, report);
  check_lr_schedule(c, report);
  check_precision_recipe(c, report);
  check_tensor_sizes(c, report);
  check_parallel(c, report);
}

Config parse_config(const std::string& yaml_text, const std::string& name, const std::vector<std::string>& overrides) {
  return config_from_yaml(load_yaml(yaml_text, name), name, overrides);
}

Config parse_checkpoint_config(const std::string& yaml_text, const std::string& name) {
  return config_from_yaml(load_yaml(yaml_text, name), name, {}, false);
}

// A file that holds no section is refused rather than read as "every key at its default": it is
// almost always the wrong path (a directory, a file not yet written).
Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw ConfigError("'" + path + "' is a directory, not a YAML config file");
  std::string text;
  try {
    text = read_file(path, kMaxConfigFileBytes, "config file");
  } catch (const IoError& e) {
    throw ConfigError(e.what());  // a wrong --config is the user's to fix: exit status 2, as for a bad key
  }
  YAML::Node root = load_yaml(text, path);
  if (root.IsNull())
    throw ConfigError("'" + path + "' is empty (no YAML content, only comments, whitespace or null): a config " +
                      "needs at least one section, e.g. model: or train:");
  return config_from_yaml(root, path, overrides);
}

std::string to_yaml(const Config& cfg) {
  Config c = cfg;
  c.logging.out_dir = c.run_dir();
  c.checkpoint.dir = c.checkpoint_dir();
  std::ostringstream os;
  os << "# flowmoe resolved config" << (c.file.empty() ? "" : " (from " + c.file + ")") << "\n";
  std::string section;
  for (const Field& f : schema()) {
    if (f.section != section) {
      section = f.section;
      os << section << ":\n";
    }
    std::string v = field_value(c, f);
    bool quote = f.kind == Kind::string || (f.kind == Kind::bool_or_path && v != "true" && v != "false");
    if (f.kind == Kind::choice_list) v = "[" + v + "]";
    os << "  " << f.key << ": " << (quote ? json_escape(v) : v) << "\n";
  }
  return os.str();
}

std::string config_reference_markdown() {
  Config defaults;
  std::ostringstream os;
  std::string section;
  for (const Field& f : schema()) {
    if (f.section != section) {
      section = f.section;
      os << "\n### " << section << "\n\n| key | type and range | default | meaning |\n| --- | --- | --- | --- |\n";
    }
    std::string v = field_value(defaults, f);
    if (f.kind == Kind::choice_list) v = "[" + v + "]";
    os << "| `" << f.key << "` | " << describe_type(f) << " | `" << (v.empty() ? "\"\"" : v) << "` | " << f.doc
       << " |\n";
  }
  return os.str();
}

}  // namespace flowmoe

namespace flowmoe {

bool TrainConfig::recomputes(const std::string& module) const {
  std::stringstream ss(recompute);
  for (std::string item; std::getline(ss, item, ',');)
    if (item == module) return true;
  return false;
}

}  // namespace flowmoe
