// Config schema, strict YAML parsing with line numbers, --set overrides and cross-key validation.
#include "train/config.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <variant>

#include "kernels/common/error.h"
#include "train/config_checks.h"

namespace flowmoe {

namespace {

namespace fs = std::filesystem;

// ---- the schema ---------------------------------------------------------------------------------

enum class Kind { integer, number, boolean, string, choice, int_choice, bool_or_path, choice_list };
using FieldRef = std::variant<int64_t*, double*, bool*, std::string*>;

struct Field {
  std::string section, key;
  Kind kind;
  double lo = -INFINITY, hi = INFINITY;  // allowed range (numbers and integers)
  bool lo_open = false, hi_open = false;  // exclusive bounds
  std::vector<std::string> choices;       // choice / int_choice
  std::string doc;
  std::function<FieldRef(Config&)> ref;
  std::string dotted() const { return section + "." + key; }
};

const double kInf = INFINITY;

#define FM_REF(member) [](Config& c) -> FieldRef { return &c.member; }

Field integer(const char* s, const char* k, std::function<FieldRef(Config&)> r, double lo, double hi, const char* doc) {
  return Field{s, k, Kind::integer, lo, hi, false, false, {}, doc, std::move(r)};
}
Field number(const char* s, const char* k, std::function<FieldRef(Config&)> r, double lo, bool lo_open, double hi,
             bool hi_open, const char* doc) {
  return Field{s, k, Kind::number, lo, hi, lo_open, hi_open, {}, doc, std::move(r)};
}
Field boolean(const char* s, const char* k, std::function<FieldRef(Config&)> r, const char* doc) {
  return Field{s, k, Kind::boolean, 0, 0, false, false, {}, doc, std::move(r)};
}
Field string(const char* s, const char* k, std::function<FieldRef(Config&)> r, const char* doc) {
  return Field{s, k, Kind::string, 0, 0, false, false, {}, doc, std::move(r)};
}
Field choice_list(const char* s, const char* k, std::function<FieldRef(Config&)> r, std::vector<std::string> choices,
                  const char* doc) {
  return Field{s, k, Kind::choice_list, 0, 0, false, false, std::move(choices), doc, std::move(r)};
}
Field choice(const char* s, const char* k, std::function<FieldRef(Config&)> r, std::vector<std::string> choices,
             const char* doc) {
  return Field{s, k, Kind::choice, 0, 0, false, false, std::move(choices), doc, std::move(r)};
}

const std::vector<Field>& schema() {
  static const std::vector<Field> fields = [] {
    std::vector<Field> f;
    // model: Hugging Face DeepSeek-V3 names
    f.push_back(integer("model", "vocab_size", FM_REF(model.vocab_size), 2, 65536, "tokens in the vocabulary (token files hold uint16)"));
    f.push_back(integer("model", "hidden_size", FM_REF(model.hidden_size), 1, 65536, "width of the residual stream"));
    f.push_back(integer("model", "num_hidden_layers", FM_REF(model.num_hidden_layers), 1, 1024, "transformer blocks"));
    f.push_back(integer("model", "num_attention_heads", FM_REF(model.num_attention_heads), 1, 1024, "attention heads; must divide hidden_size, head size even (RoPE)"));
    f.push_back(integer("model", "intermediate_size", FM_REF(model.intermediate_size), 1, 1 << 20, "width of the dense SwiGLU MLP"));
    f.push_back(integer("model", "max_position_embeddings", FM_REF(model.max_position_embeddings), 1, 1 << 20, "longest sequence; data.seq_len must not exceed it"));
    f.push_back(number("model", "rms_norm_eps", FM_REF(model.rms_norm_eps), 0, true, 1, true, "RMSNorm epsilon"));
    f.push_back(number("model", "rope_theta", FM_REF(model.rope_theta), 0, true, kInf, false, "RoPE base"));
    f.push_back(boolean("model", "tie_word_embeddings", FM_REF(model.tie_word_embeddings), "the LM head reuses the token embedding"));
    f.push_back(number("model", "initializer_range", FM_REF(model.initializer_range), 0, true, 1, false, "std of the normal weight init"));
    f.push_back(integer("model", "n_routed_experts", FM_REF(model.n_routed_experts), 0, 4096, "routed experts per MoE layer; 0 = dense model"));
    f.push_back(integer("model", "n_shared_experts", FM_REF(model.n_shared_experts), 0, 64, "shared experts per MoE layer"));
    f.push_back(integer("model", "num_experts_per_tok", FM_REF(model.num_experts_per_tok), 1, 256, "routed experts per token (top-k)"));
    f.push_back(integer("model", "moe_intermediate_size", FM_REF(model.moe_intermediate_size), 1, 1 << 20, "width of each expert's SwiGLU MLP"));
    f.push_back(integer("model", "first_k_dense_replace", FM_REF(model.first_k_dense_replace), 0, 1024, "the first k blocks keep a dense MLP"));
    f.push_back(integer("model", "n_group", FM_REF(model.n_group), 1, 4096, "expert groups for group-limited routing"));
    f.push_back(integer("model", "topk_group", FM_REF(model.topk_group), 1, 4096, "groups a token may route to"));
    f.push_back(choice("model", "scoring_func", FM_REF(model.scoring_func), {"sigmoid", "softmax"}, "router score function"));
    f.push_back(boolean("model", "norm_topk_prob", FM_REF(model.norm_topk_prob), "normalise the top-k probabilities"));
    f.push_back(number("model", "routed_scaling_factor", FM_REF(model.routed_scaling_factor), 0, true, kInf, false, "scale of the routed experts' output"));
    f.push_back(number("model", "aux_loss_alpha", FM_REF(model.aux_loss_alpha), 0, false, kInf, false, "weight of the sequence-wise balance loss"));
    f.push_back(number("model", "bias_update_rate", FM_REF(model.bias_update_rate), 0, false, kInf, false, "aux-loss-free balancing: expert_bias step"));
    f.push_back(choice("model", "bias_update_schedule", FM_REF(model.bias_update_schedule), {"constant", "lr"}, "constant: every step moves expert_bias by bias_update_rate (DeepSeek-V3); lr: by bias_update_rate * lr(step) / optimizer.lr, so the bias step follows the learning-rate schedule"));
    f.push_back(choice("model", "bias_update_rule", FM_REF(model.bias_update_rule), {"sign", "proportional"}, "sign: each step moves expert_bias by the bias step toward the mean load (DeepSeek-V3); proportional: by the bias step * (mean - load) / mean, so near-balanced experts barely move and overloaded ones move more"));
    // data
    f.push_back(choice("data", "source", FM_REF(data.source), {"synthetic", "text", "tokens"}, "synthetic (built in, no download), text (bytes of files), tokens (llm.c .bin file)"));
    f.push_back(string("data", "path", FM_REF(data.path), "text: a file or a directory of files; tokens: a .bin token file (relative paths: from the working directory)"));
    f.push_back(integer("data", "seq_len", FM_REF(data.seq_len), 2, 1 << 20, "tokens per training sequence"));
    f.push_back(number("data", "val_fraction", FM_REF(data.val_fraction), 0, false, 0.5, false, "tail of the corpus held out for validation; 0 disables evaluation"));
    f.push_back(integer("data", "seed", FM_REF(data.seed), 0, 9.0e15, "seed of the synthetic corpus and of the batch order"));
    f.push_back(integer("data", "synthetic_tokens", FM_REF(data.synthetic_tokens), 1024, 1 << 30, "size of the synthetic corpus"));
    f.push_back(choice("data", "synthetic_kind", FM_REF(data.synthetic_kind), {"words", "bigram"}, "which synthetic corpus: words (a low-entropy word chain, fast convergence checks) or bigram (BPE-like token statistics: MoE load balance and precision parity)"));
    // train
    f.push_back(choice("train", "device", FM_REF(train.device), {"auto", "cpu", "cuda"}, "auto: the GPU when one is present, else the CPU"));
    f.push_back(integer("train", "steps", FM_REF(train.steps), 1, 1e12, "optimizer steps"));
    f.push_back(integer("train", "batch_size", FM_REF(train.batch_size), 1, 1 << 20, "sequences per micro-batch"));
    f.push_back(integer("train", "grad_accum_steps", FM_REF(train.grad_accum_steps), 1, 1 << 20, "micro-batches per optimizer step"));
    f.push_back(integer("train", "eval_every", FM_REF(train.eval_every), 0, 1e12, "steps between validation passes; 0: only at the end"));
    f.push_back(integer("train", "eval_batches", FM_REF(train.eval_batches), 1, 1 << 20, "micro-batches per validation pass"));
    f.push_back(integer("train", "seed", FM_REF(train.seed), 0, 9.0e15, "seed of the weight init"));
    f.push_back(choice("train", "nonfinite", FM_REF(train.nonfinite), {"skip", "stop"}, "on a non-finite loss or gradient: skip the step, or stop with an error"));
    f.push_back(choice_list("train", "recompute", FM_REF(train.recompute), {"moe_expert"}, "modules recomputed in backward: moe_expert keeps only the expert input (FP8 in fp8_flow) and recomputes fc1 and SwiGLU"));
    f.push_back(integer("train", "max_skipped_steps", FM_REF(train.max_skipped_steps), 0, 1e12, "with nonfinite: skip, stop after this many skipped steps"));
    // optimizer (AdamW, warmup then cosine)
    f.push_back(number("optimizer", "lr", FM_REF(optimizer.lr), 0, true, 10, false, "peak learning rate"));
    f.push_back(number("optimizer", "min_lr", FM_REF(optimizer.min_lr), 0, false, 10, false, "learning rate at the end of the cosine decay"));
    f.push_back(integer("optimizer", "warmup_steps", FM_REF(optimizer.warmup_steps), 0, 1e12, "linear warmup steps"));
    f.push_back(number("optimizer", "weight_decay", FM_REF(optimizer.weight_decay), 0, false, 10, false, "decoupled weight decay on matrices"));
    f.push_back(number("optimizer", "beta1", FM_REF(optimizer.beta1), 0, false, 1, true, "AdamW beta1"));
    f.push_back(number("optimizer", "beta2", FM_REF(optimizer.beta2), 0, false, 1, true, "AdamW beta2"));
    f.push_back(number("optimizer", "eps", FM_REF(optimizer.eps), 0, true, 1, false, "AdamW epsilon"));
    f.push_back(number("optimizer", "grad_clip", FM_REF(optimizer.grad_clip), 0, false, kInf, false, "max global gradient norm; 0 disables clipping"));
    f.push_back(number("optimizer", "router_lr_scale", FM_REF(optimizer.router_lr_scale), 0, false, 10, false, "multiplies the learning rate of the MoE routers' gate weights (*.mlp.gate.weight); 1 trains them like every other matrix"));
    // precision
    f.push_back(choice("precision", "recipe", FM_REF(precision.recipe), {"bf16", "fp8_blockwise", "fp8_flow"}, "routed-expert GEMM precision: bf16 (fp32 on CPU); fp8_blockwise (FP8 GEMMs, each quantizing its own inputs); fp8_flow (quantize once before dispatch, FP8 through the experts). FP8 needs MoE layers and hidden_size, moe_intermediate_size multiples of 128. Master weights and gradients stay fp32"));
    Field align{"precision", "align_size", Kind::int_choice, 0, 0, false, false, {"16", "32", "64", "128"},
                "row alignment of each expert's segment", FM_REF(precision.align_size)};
    f.push_back(align);
    // parallel
    f.push_back(integer("parallel", "expert_parallel_size", FM_REF(parallel.expert_parallel_size), 1, 4096, "ranks per expert-parallel group (1 only for now)"));
    f.push_back(integer("parallel", "data_parallel_size", FM_REF(parallel.data_parallel_size), 1, 4096, "data-parallel replicas (1 only for now)"));
    // checkpoint
    f.push_back(string("checkpoint", "dir", FM_REF(checkpoint.dir), "where checkpoints go; empty: <logging.out_dir>/checkpoints"));
    f.push_back(integer("checkpoint", "every", FM_REF(checkpoint.every), 0, 1e12, "steps between checkpoints; 0: only the final one"));
    f.push_back(integer("checkpoint", "keep_last", FM_REF(checkpoint.keep_last), 1, 1e6, "checkpoints kept; older ones are deleted"));
    Field resume{"checkpoint", "resume", Kind::bool_or_path, 0, 0, false, false, {},
                 "false, true (the latest checkpoint in dir) or the path of a checkpoint directory", FM_REF(checkpoint.resume)};
    f.push_back(resume);
    // logging
    f.push_back(string("logging", "out_dir", FM_REF(logging.out_dir), "run outputs (resolved config, metrics); empty: runs/<config file name>"));
    f.push_back(choice("logging", "metrics_format", FM_REF(logging.metrics_format), {"jsonl", "csv"}, "metrics file format"));
    f.push_back(integer("logging", "log_every", FM_REF(logging.log_every), 1, 1e12, "steps between plain progress lines"));
    f.push_back(choice("logging", "progress", FM_REF(logging.progress), {"auto", "bar", "plain"}, "auto: a progress bar on a terminal, plain lines otherwise"));
    return f;
  }();
  return fields;
}

const std::vector<std::string>& sections() {
  static const std::vector<std::string> s = {"model",     "data",     "train",      "optimizer",
                                             "precision", "parallel", "checkpoint", "logging"};
  return s;
}

const Field* find_field(const std::string& section, const std::string& key) {
  for (const Field& f : schema())
    if (f.section == section && f.key == key) return &f;
  return nullptr;
}

// ---- messages -----------------------------------------------------------------------------------

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// " (did you mean 'x'?)" for the closest candidate within a small distance, else "".
std::string suggestion(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = 3;
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, c);
    if (d < best_d) best_d = d, best = c;
  }
  return best.empty() ? "" : " (did you mean '" + best + "'?)";
}

std::string fmt_bound(double v) {
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (v == std::floor(v) && std::fabs(v) < 1e16) return std::to_string(int64_t(v));
  std::ostringstream os;
  os << v;
  return os.str();
}

std::string describe_type(const Field& f) {
  switch (f.kind) {
    case Kind::integer:
      return "an integer in [" + fmt_bound(f.lo) + ", " + fmt_bound(f.hi) + "]";
    case Kind::number:
      return std::string("a number in ") + (f.lo_open ? "(" : "[") + fmt_bound(f.lo) + ", " + fmt_bound(f.hi) +
             (f.hi_open || std::isinf(f.hi) ? ")" : "]");
    case Kind::boolean: return "true or false";
    case Kind::string: return "a string";
    case Kind::bool_or_path: return "true, false or a path";
    case Kind::choice_list: {
      std::string s = "a list of ";
      for (size_t i = 0; i < f.choices.size(); ++i) s += (i ? ", " : "") + f.choices[i];
      return s + " (possibly empty: [])";
    }
    case Kind::choice:
    case Kind::int_choice: {
      std::string s = "one of ";
      for (size_t i = 0; i < f.choices.size(); ++i) s += (i ? ", " : "") + f.choices[i];
      return s;
    }
  }
  return "?";
}

[[noreturn]] void fail(const std::string& where, const std::string& key, const std::string& msg) {
  throw ConfigError(where + ": " + (key.empty() ? "" : key + ": ") + msg);
}

// ---- scalar parsing -----------------------------------------------------------------------------

bool parse_int(const std::string& s, int64_t& out) {
  if (s.empty()) return false;
  const char* b = s.data();
  const char* e = s.data() + s.size();
  if (*b == '+') ++b;
  auto r = std::from_chars(b, e, out);
  return r.ec == std::errc() && r.ptr == e;
}

bool parse_double(const std::string& s, double& out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  out = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() && errno == 0 && std::isfinite(out);
}

bool parse_bool(const std::string& s, bool& out) {
  if (s == "true" || s == "True" || s == "TRUE") return out = true, true;
  if (s == "false" || s == "False" || s == "FALSE") return out = false, true;
  return false;
}

// Parses `text` into the field, checking type and range; `where` names the origin in messages.
void set_field(Config& cfg, const Field& f, const std::string& text, const std::string& where) {
  const std::string key = f.dotted();
  auto bad = [&](const std::string& got_what) {
    fail(where, key, "expected " + describe_type(f) + ", got " + got_what);
  };
  FieldRef ref = f.ref(cfg);
  switch (f.kind) {
    case Kind::integer: {
      int64_t v = 0;
      if (!parse_int(text, v)) bad("'" + text + "'");
      if (double(v) < f.lo || double(v) > f.hi) bad(text);
      *std::get<int64_t*>(ref) = v;
      break;
    }
    case Kind::number: {
      double v = 0;
      if (!parse_double(text, v)) bad("'" + text + "'");
      bool below = f.lo_open ? v <= f.lo : v < f.lo;
      bool above = f.hi_open ? v >= f.hi : v > f.hi;
      if (below || above) bad(text);
      *std::get<double*>(ref) = v;
      break;
    }
    case Kind::boolean: {
      bool v = false;
      if (!parse_bool(text, v)) bad("'" + text + "'");
      *std::get<bool*>(ref) = v;
      break;
    }
    case Kind::string:
      *std::get<std::string*>(ref) = text;
      break;
    case Kind::choice:
      if (std::find(f.choices.begin(), f.choices.end(), text) == f.choices.end())
        bad("'" + text + "'" + suggestion(text, f.choices));
      *std::get<std::string*>(ref) = text;
      break;
    case Kind::int_choice: {
      int64_t v = 0;
      if (!parse_int(text, v) || std::find(f.choices.begin(), f.choices.end(), std::to_string(v)) == f.choices.end())
        bad("'" + text + "'");
      *std::get<int64_t*>(ref) = v;
      break;
    }
    case Kind::choice_list: {
      // Stored comma-joined; accepts "[a, b]", "a,b", "a" and "[]" (the YAML list arrives joined).
      std::string body = text;
      if (!body.empty() && body.front() == '[') {
        if (body.back() != ']') bad("'" + text + "'");
        body = body.substr(1, body.size() - 2);
      }
      std::string joined;
      std::stringstream ss(body);
      for (std::string item; std::getline(ss, item, ',');) {
        item.erase(0, item.find_first_not_of(" \t"));
        item.erase(item.find_last_not_of(" \t") + 1);
        if (item.empty()) continue;
        if (std::find(f.choices.begin(), f.choices.end(), item) == f.choices.end())
          bad("'" + item + "'" + suggestion(item, f.choices));
        joined += (joined.empty() ? "" : ",") + item;
      }
      *std::get<std::string*>(ref) = joined;
      break;
    }
    case Kind::bool_or_path: {
      bool b = false;
      if (text.empty()) bad("an empty value");
      *std::get<std::string*>(ref) = parse_bool(text, b) ? (b ? "true" : "false") : text;
      break;
    }
  }
  cfg.origins[key] = where;
}

std::string field_value(const Config& cfg, const Field& f) {
  FieldRef ref = f.ref(const_cast<Config&>(cfg));
  if (auto* i = std::get_if<int64_t*>(&ref)) return std::to_string(**i);
  if (auto* b = std::get_if<bool*>(&ref)) return **b ? "true" : "false";
  if (auto* s = std::get_if<std::string*>(&ref)) return **s;
  double d = *std::get<double*>(ref);
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d);  // shortest form that reads back exactly
  std::string s(buf, r.ptr);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

// A double-quoted YAML scalar that reads back as `s`. Control characters are escaped: a raw line
// break inside quotes would read back as a space.
std::string yaml_quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += char(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += char(c);
    }
  }
  return out + "\"";
}

std::string stem_of(const std::string& path) {
  std::string stem = fs::path(path).stem().string();
  return stem.empty() ? "run" : stem;
}

// ---- YAML walking -------------------------------------------------------------------------------

std::string at(const std::string& name, const YAML::Node& n) {
  return name + ":" + std::to_string(n.Mark().line + 1);
}

void read_yaml(Config& cfg, const YAML::Node& root, const std::string& name) {
  if (!root || root.IsNull()) return;  // an empty file: every key at its default
  if (!root.IsMap()) fail(at(name, root), "", "the top level must be a mapping of sections (model:, data:, ...)");
  std::set<std::string> seen_sections;
  for (auto it = root.begin(); it != root.end(); ++it) {
    YAML::Node k = it->first;
    if (!k.IsScalar()) fail(at(name, k), "", "section names must be plain words");
    std::string section = k.Scalar();
    if (std::find(sections().begin(), sections().end(), section) == sections().end())
      fail(at(name, k), "", "unknown section '" + section + "'" + suggestion(section, sections()) +
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
      if (!f) {
        std::vector<std::string> keys;
        for (const Field& g : schema())
          if (g.section == section) keys.push_back(g.key);
        fail(at(name, kn), section + "." + key, "unknown key in section '" + section + "'" + suggestion(key, keys));
      }
      if (!seen_keys.insert(key).second) fail(at(name, kn), f->dotted(), "key given twice");
      YAML::Node v = kv->second;
      if (v.IsNull() && f->kind != Kind::string) fail(at(name, kn), f->dotted(), "missing value (expected " + describe_type(*f) + ")");
      if (f->kind == Kind::choice_list && v.IsSequence()) {
        std::string joined;
        for (const YAML::Node& item : v) {
          if (!item.IsScalar()) fail(at(name, item), f->dotted(), "expected " + describe_type(*f) + ", got a nested value");
          joined += (joined.empty() ? "" : ",") + item.Scalar();
        }
        set_field(cfg, *f, joined, at(name, kn));
        continue;
      }
      if (!v.IsNull() && !v.IsScalar()) fail(at(name, v), f->dotted(), "expected " + describe_type(*f) + ", got a " +
                                                                         (v.IsMap() ? "mapping" : "list"));
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

Config config_from_yaml(const YAML::Node& root, const std::string& name, const std::vector<std::string>& overrides) {
  Config cfg;
  cfg.file = name;
  read_yaml(cfg, root, name);
  for (const std::string& o : overrides) apply_override(cfg, o);
  validate(cfg);
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
  if (dot == std::string::npos) fail(where, "", "expected section.key=value (the key needs its section, e.g. train.steps=100)");
  std::string section = dotted.substr(0, dot), key = dotted.substr(dot + 1);
  if (std::find(sections().begin(), sections().end(), section) == sections().end())
    fail(where, "", "unknown section '" + section + "'" + suggestion(section, sections()));
  const Field* f = find_field(section, key);
  if (!f) {
    std::vector<std::string> keys;
    for (const Field& g : schema())
      if (g.section == section) keys.push_back(g.key);
    fail(where, dotted, "unknown key in section '" + section + "'" + suggestion(key, keys));
  }
  set_field(cfg, *f, value, where);
}

// Each section's own cross-key checks, in a fixed order: the first problem found is the one reported.
void validate(const Config& c) {
  const KeyReport report(c);
  check_model_shape(c, report);
  check_moe_routing(c, report);
  check_data_source(c, report);
  check_lr_schedule(c, report);
  check_precision_recipe(c, report);
  check_tensor_sizes(c, report);
  check_parallel(c, report);
}

Config parse_config(const std::string& yaml_text, const std::string& name, const std::vector<std::string>& overrides) {
  return config_from_yaml(load_yaml(yaml_text, name), name, overrides);
}

// A file that holds no section is refused rather than read as "every key at its default": it is
// almost always the wrong path (a directory, /dev/null, a file not yet written).
Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw ConfigError("'" + path + "' is a directory, not a YAML config file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(path + ": cannot open the config file");
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw ConfigError(path + ": cannot read the config file");
  YAML::Node root = load_yaml(ss.str(), path);
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
    os << "  " << f.key << ": " << (quote ? yaml_quote(v) : v) << "\n";
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
    os << "| `" << f.key << "` | " << describe_type(f) << " | `" << (v.empty() ? "\"\"" : v) << "` | " << f.doc << " |\n";
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
