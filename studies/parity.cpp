// The loss-parity report (see parity.h).
#include "studies/parity.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include "io/file_io.h"
#include "kernels/common/error.h"
#include "studies/parity_band.h"
#include "studies/plot.h"

namespace flowmoe {

std::vector<double> loss_ema(const std::vector<double>& losses, double alpha) {
  std::vector<double> out(losses.size(), NAN);
  double ema = NAN;
  for (size_t i = 0; i < losses.size(); ++i) {
    if (std::isfinite(losses[i])) ema = std::isnan(ema) ? losses[i] : alpha * ema + (1 - alpha) * losses[i];
    out[i] = ema;
  }
  return out;
}

double relative_error(double candidate, double reference) {
  if (!std::isfinite(candidate) || !std::isfinite(reference) || reference == 0) return NAN;
  return std::fabs(candidate - reference) / std::fabs(reference);
}

bool ParityReport::passed() const {
  return std::all_of(candidates.begin(), candidates.end(),
                     [](const ParityCandidate& c) { return c.control || c.pass; });
}

bool ParityReport::within_noise() const {
  return std::all_of(candidates.begin(), candidates.end(),
                     [](const ParityCandidate& c) { return c.control || !c.judged_against_noise || c.within_noise; });
}

int ParityReport::exit_status() const {
  if (!band.defined()) return passed() ? 0 : 1;
  if (!within_noise()) return 1;
  return passed() ? 0 : 4;
}

namespace {

ParityCandidate judge(const ParityReport& r, size_t run_index) {
  const ParityRun& run = r.runs[run_index];
  const ParityCurve& curve = r.curves[run_index];
  ParityCandidate c;
  c.name = run.name;
  c.control = run.control;
  c.final_loss = run.rows.empty() ? NAN : run.rows.back().loss;
  c.final_val_loss = run.final_val_loss;
  for (const StepMetrics& m : run.rows)
    if (m.skipped || !std::isfinite(m.loss)) c.nonfinite_steps.push_back(m.step);
  double sum = 0;
  for (size_t i = 0; i < r.steps.size(); ++i) {
    if (r.steps[i] <= r.warmup_steps || !std::isfinite(curve.rel_err[i])) continue;
    c.max_rel_err = c.compared_steps == 0 ? curve.rel_err[i] : std::max(c.max_rel_err, curve.rel_err[i]);
    sum += curve.rel_err[i];
    ++c.compared_steps;
  }
  if (c.compared_steps > 0) c.mean_rel_err = sum / double(c.compared_steps);
  const size_t missing = std::count_if(curve.loss.begin(), curve.loss.end(), [](double v) { return std::isnan(v); });
  if (!c.nonfinite_steps.empty())
    c.reason = std::to_string(c.nonfinite_steps.size()) + " non-finite or skipped step(s), the first at step " +
               std::to_string(c.nonfinite_steps.front());
  else if (std::any_of(r.runs[0].rows.begin(), r.runs[0].rows.end(),
                       [](const StepMetrics& m) { return m.skipped || !std::isfinite(m.loss); }))
    c.reason = "the reference run has non-finite or skipped steps";  // nothing sound to compare with
  else if (c.compared_steps == 0)
    c.reason = "no step after warmup (step " + std::to_string(r.warmup_steps) + ") to compare";
  else if (missing > 0)
    c.reason = std::to_string(missing) + " step(s) the reference logged are missing";
  else if (!(c.max_rel_err <= r.threshold))
    c.reason = "max EMA relative error above the threshold";
  c.pass = c.reason.empty();
  return c;
}

std::string num(double v, const char* fmt = "%.9g") {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

std::string percent(double v) {
  if (!std::isfinite(v)) return "n/a";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3g%%", 100 * v);
  return buf;
}

std::string signed_percent(double v) {
  if (!std::isfinite(v)) return "n/a";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%+.3g%%", 100 * v);
  return buf;
}

std::string band_json(const NoiseBand& b) {
  if (!b.defined()) return "null";
  return "{\"controls\": " + std::to_string(b.num_controls) + ", \"margin\": " + num(b.margin) +
         ", \"control_mean_max\": " + num(b.control_mean_max) + ", \"control_max_max\": " + num(b.control_max_max) +
         ", \"final_val_rel_min\": " + num(b.final_val_rel_min) +
         ", \"final_val_rel_max\": " + num(b.final_val_rel_max) + "}";
}

// {"bf16": 2.5, "fp8_flow": 2.6} over the runs (or the candidates) with values at one step.
std::string named_values(const ParityReport& r, size_t first_run, size_t step,
                         std::vector<double> ParityCurve::*field) {
  std::string out = "{";
  for (size_t k = first_run; k < r.runs.size(); ++k)
    out += (k > first_run ? ", " : "") + json_escape(r.runs[k].name) + ": " + num((r.curves[k].*field)[step]);
  return out + "}";
}

double reference_final_loss(const ParityReport& r) {
  return r.runs.front().rows.empty() ? NAN : r.runs.front().rows.back().loss;
}

// The leaves of a config's YAML, "section.key" -> value, in document order; a list is one leaf.
using ConfigLeaves = std::vector<std::pair<std::string, YAML::Node>>;

void flatten(const YAML::Node& node, const std::string& prefix, ConfigLeaves& out) {
  if (!node.IsMap()) {
    out.emplace_back(prefix, node);
    return;
  }
  for (const auto& kv : node)
    flatten(kv.second, prefix.empty() ? kv.first.Scalar() : prefix + "." + kv.first.Scalar(), out);
}

ConfigLeaves config_leaves(const std::string& yaml_text, const char* which) {
  ConfigLeaves out;
  try {
    flatten(YAML::Load(yaml_text), "", out);
  } catch (const YAML::Exception& e) {
    FLOWMOE_THROW(ConfigError, "the ", which, " config is not YAML: ", e.what());
  }
  return out;
}

// A value as the message shows it: the scalar ("" quoted), a list in flow style, or "(absent)".
std::string shown(const YAML::Node* n) {
  if (!n) return "(absent)";
  if (n->IsScalar()) return n->Scalar().empty() ? "\"\"" : n->Scalar();
  YAML::Emitter e;
  e << YAML::Flow << *n;
  return e.c_str();
}

bool same_value(const YAML::Node* a, const YAML::Node* b) {
  if (!a || !b) return a == b;
  if (a->IsScalar() && b->IsScalar()) return a->Scalar() == b->Scalar();
  return shown(a) == shown(b);
}

}  // namespace

std::string first_changed_key(const std::string& earlier, const std::string& now,
                              const std::vector<std::string>& ignored) {
  const ConfigLeaves was = config_leaves(earlier, "earlier run's"), is = config_leaves(now, "current");
  auto find = [](const ConfigLeaves& leaves, const std::string& key) -> const YAML::Node* {
    for (const auto& [k, v] : leaves)
      if (k == key) return &v;
    return nullptr;
  };
  std::vector<std::string> keys;
  for (const auto& kv : is) keys.push_back(kv.first);
  for (const auto& kv : was)
    if (!find(is, kv.first)) keys.push_back(kv.first);
  const std::set<std::string> skip(ignored.begin(), ignored.end());
  for (const std::string& key : keys) {
    if (skip.count(key)) continue;
    const YAML::Node *a = find(was, key), *b = find(is, key);
    if (!same_value(a, b)) return key + ": " + shown(a) + " in the earlier run, " + shown(b) + " now";
  }
  return "";
}

ParityReport make_parity_report(std::vector<ParityRun> runs, double threshold, int64_t warmup_steps, double margin,
                                double ema_alpha) {
  FLOWMOE_CHECK(runs.size() >= 2, ConfigError, "parity: a reference and at least one candidate are needed, got ",
                runs.size(), " run(s)");
  FLOWMOE_CHECK(ema_alpha >= 0 && ema_alpha < 1, ConfigError, "parity: the EMA's alpha must be in [0, 1), got ",
                ema_alpha);
  ParityReport r;
  r.ema_alpha = ema_alpha;
  r.reference = runs.front().name;
  r.threshold = threshold;
  r.warmup_steps = warmup_steps;
  for (const StepMetrics& m : runs.front().rows) r.steps.push_back(m.step);
  std::sort(r.steps.begin(), r.steps.end());
  r.steps.erase(std::unique(r.steps.begin(), r.steps.end()), r.steps.end());
  r.runs = std::move(runs);
  for (const ParityRun& run : r.runs) {
    // The run's losses on the reference's steps (NaN where it logged none), the last row of a step winning.
    std::map<int64_t, double> by_step;
    for (const StepMetrics& m : run.rows) by_step[m.step] = m.loss;
    ParityCurve c;
    for (int64_t s : r.steps) c.loss.push_back(by_step.count(s) ? by_step[s] : NAN);
    c.ema = loss_ema(c.loss, r.ema_alpha);
    r.curves.push_back(std::move(c));
  }
  for (size_t k = 1; k < r.runs.size(); ++k) {
    for (size_t i = 0; i < r.steps.size(); ++i)
      r.curves[k].rel_err.push_back(relative_error(r.curves[k].ema[i], r.curves[0].ema[i]));
    r.candidates.push_back(judge(r, k));
    r.candidates.back().final_val_rel = signed_relative(r.runs[k].final_val_loss, r.runs[0].final_val_loss);
  }
  apply_noise_band(r, margin);
  return r;
}

std::string parity_json(const ParityReport& r) {
  std::ostringstream o;
  o << "{\n  \"config\": " << json_escape(r.config) << ",\n  \"reference\": " << json_escape(r.reference)
    << ",\n  \"threshold\": " << num(r.threshold) << ",\n  \"warmup_steps\": " << r.warmup_steps
    << ",\n  \"ema_alpha\": " << num(r.ema_alpha) << ",\n  \"world_size\": " << r.world_size
    << ",\n  \"expert_parallel_size\": " << r.expert_parallel_size
    << ",\n  \"pass\": " << (r.passed() ? "true" : "false")
    << ",\n  \"within_noise\": " << (r.within_noise() ? "true" : "false") << ",\n  \"exit_status\": " << r.exit_status()
    << ",\n  \"noise_band\": " << band_json(r.band) << ",\n  \"runs\": [";
  for (size_t k = 0; k < r.runs.size(); ++k) {
    const ParityRun& run = r.runs[k];
    double peak = 0;
    for (const StepMetrics& m : run.rows) peak = std::max(peak, double(m.peak_mem_bytes));
    const StepMetrics last = run.rows.empty() ? StepMetrics{} : run.rows.back();
    o << (k ? "," : "") << "\n    {\"name\": " << json_escape(run.name) << ", \"recipe\": " << json_escape(run.recipe)
      << ", \"role\": "
      << json_escape(k == 0        ? "reference"
                     : run.control ? "control"
                                   : "candidate")
      << ", \"config_hash\": " << json_escape(run.config_hash) << ", \"steps\": " << run.rows.size()
      << ", \"final_loss\": " << num(last.loss) << ", \"final_val_loss\": " << num(run.final_val_loss)
      << ", \"tokens_per_s\": " << num(run.tokens_per_s, "%.6g") << ", \"peak_mem_bytes\": " << int64_t(peak)
      << ", \"moe_casts\": " << num(last.moe_casts, "%.6g") << ", \"host_syncs\": " << last.host_syncs << "}";
  }
  o << "\n  ],\n  \"candidates\": [";
  for (size_t k = 0; k < r.candidates.size(); ++k) {
    const ParityCandidate& c = r.candidates[k];
    std::string steps;
    for (int64_t s : c.nonfinite_steps) steps += (steps.empty() ? "" : ", ") + std::to_string(s);
    o << (k ? "," : "") << "\n    {\"name\": " << json_escape(c.name)
      << ", \"control\": " << (c.control ? "true" : "false") << ", \"compared_steps\": " << c.compared_steps
      << ", \"max_rel_err\": " << num(c.max_rel_err) << ", \"mean_rel_err\": " << num(c.mean_rel_err)
      << ", \"final_loss\": " << num(c.final_loss) << ", \"reference_final_loss\": " << num(reference_final_loss(r))
      << ", \"final_val_loss\": " << num(c.final_val_loss) << ", \"nonfinite_steps\": [" << steps << "]"
      << ", \"final_val_rel\": " << num(c.final_val_rel) << ", \"verdict\": " << json_escape(c.pass ? "pass" : "fail")
      << ", \"reason\": " << json_escape(c.reason) << ", \"noise_verdict\": "
      << (c.judged_against_noise ? json_escape(c.within_noise ? "within noise" : "outside noise") : "null")
      << ", \"noise_ratio\": " << num(c.noise_ratio) << ", \"noise_reason\": " << json_escape(c.noise_reason) << "}";
  }
  o << "\n  ],\n  \"steps\": [";
  for (size_t i = 0; i < r.steps.size(); ++i) {
    o << (i ? "," : "") << "\n    {\"step\": " << r.steps[i]
      << ", \"loss\": " << named_values(r, 0, i, &ParityCurve::loss)
      << ", \"ema\": " << named_values(r, 0, i, &ParityCurve::ema)
      << ", \"rel_err\": " << named_values(r, 1, i, &ParityCurve::rel_err)
      << ", \"band_upper\": " << num(r.band.defined() ? r.band.upper[i] : NAN) << "}";
  }
  o << "\n  ]\n}\n";
  return o.str();
}

std::string parity_summary_line(const ParityReport& r, const ParityCandidate& c) {
  const double ref_final = reference_final_loss(r);
  std::string line = c.name + " vs " + r.reference + ": max EMA rel err " + percent(c.max_rel_err) +
                     " after warmup (mean " + percent(c.mean_rel_err) + "), final loss " + num(c.final_loss, "%.4f") +
                     " vs " + num(ref_final, "%.4f") + ": ";
  if (c.control)
    line += "noise floor (control, not judged)";
  else
    line += std::string(c.pass ? "PASS" : "FAIL") + " (threshold " + percent(r.threshold) + ")";
  if (!c.pass && !c.reason.empty() && !c.control) line += ": " + c.reason;
  if (c.judged_against_noise) {
    char ratio[32];
    std::snprintf(ratio, sizeof ratio, "%.2fx", c.noise_ratio);
    line += std::string("; ") + (c.within_noise ? "within noise" : "OUTSIDE noise") + " (mean error " +
            (std::isfinite(c.noise_ratio) ? ratio : std::string("n/a")) + " the largest of " +
            std::to_string(r.band.num_controls) + " controls', margin " + percent(r.band.margin) + ")";
    if (!c.within_noise) line += ": " + c.noise_reason;
  }
  if (r.band.defined() || std::isfinite(c.final_val_rel)) {
    line += "; final val loss " + signed_percent(c.final_val_rel) + " vs " + r.reference;
    if (r.band.defined() && !c.control)
      line += " (controls " + signed_percent(r.band.final_val_rel_min) + " to " +
              signed_percent(r.band.final_val_rel_max) + ")";
  }
  return line;
}

bool plot_parity(const ParityReport& r, const std::string& png_path) {
  TwoPanelPlot p;
  p.title = "loss parity: " + r.config;
  p.top_ylabel = "loss EMA (nats)";
  p.bottom_ylabel = "relative EMA error vs " + r.reference;
  for (int64_t s : r.steps) p.x.push_back(double(s));
  for (size_t k = 0; k < r.runs.size(); ++k) {
    p.top.push_back({r.runs[k].name, r.curves[k].ema});
    if (k > 0) p.bottom.push_back({r.runs[k].name, r.curves[k].rel_err});
  }
  p.bottom_line = r.threshold;
  p.bottom_line_label = "threshold";
  if (r.band.defined()) {
    p.bottom_band = r.band.upper;
    p.bottom_band_label = "noise band (" + std::to_string(r.band.num_controls) + " controls)";
  }
  return plot_two_panels(p, png_path);
}

}  // namespace flowmoe
