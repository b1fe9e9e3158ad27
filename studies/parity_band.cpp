// The noise band of a parity study and each candidate's verdict against it (see parity_band.h).
#include "studies/parity_band.h"

#include <algorithm>
#include <cstdio>
#include <string>

#include "studies/parity_report.h"

namespace flowmoe {

double signed_relative(double value, double reference) {
  if (!std::isfinite(value) || !std::isfinite(reference) || reference == 0) return NAN;
  return (value - reference) / std::fabs(reference);
}

namespace {

// The larger of two values where a NaN counts as absent.
double max_of(double a, double b) { return std::isnan(a) ? b : std::isnan(b) ? a : std::max(a, b); }
double min_of(double a, double b) { return std::isnan(a) ? b : std::isnan(b) ? a : std::min(a, b); }

std::string ratio_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

}  // namespace

void apply_noise_band(ParityReport& r, double margin) {
  NoiseBand& band = r.band;
  band = NoiseBand{};
  band.margin = margin;
  band.upper.assign(r.steps.size(), NAN);
  // A band needs a spread: one control is reported as the noise floor, but judges nothing.
  const auto controls = std::count_if(r.runs.begin(), r.runs.end(), [](const ParityRun& run) { return run.control; });
  if (controls < 2) {
    band.upper.clear();
    return;
  }
  band.num_controls = int(controls);
  // candidates[k - 1] is runs[k]'s verdict: the reference has none.
  for (size_t k = 1; k < r.runs.size(); ++k) {
    if (!r.runs[k].control) continue;
    const ParityCandidate& c = r.candidates[k - 1];
    for (size_t i = 0; i < r.steps.size(); ++i)
      if (r.steps[i] > r.warmup_steps) band.upper[i] = max_of(band.upper[i], r.curves[k].rel_err[i]);
    band.control_mean_max = max_of(band.control_mean_max, c.mean_rel_err);
    band.control_max_max = max_of(band.control_max_max, c.max_rel_err);
    band.final_val_rel_min = min_of(band.final_val_rel_min, c.final_val_rel);
    band.final_val_rel_max = max_of(band.final_val_rel_max, c.final_val_rel);
  }
  if (!band.defined()) return;
  for (ParityCandidate& c : r.candidates) {
    if (c.control) continue;
    c.judged_against_noise = true;
    if (std::isfinite(c.mean_rel_err) && std::isfinite(band.control_mean_max) && band.control_mean_max > 0)
      c.noise_ratio = c.mean_rel_err / band.control_mean_max;
    else if (c.mean_rel_err == 0)
      c.noise_ratio = 0;  // identical to the reference: within any band, an empty one too
    if (!c.nonfinite_steps.empty())
      c.noise_reason = "non-finite or skipped steps";  // no control of a sound recipe has those
    else if (std::isnan(c.noise_ratio))
      c.noise_reason = "no error to compare with the controls'";
    else if (c.noise_ratio > 1 + margin)
      c.noise_reason = "mean EMA error " + ratio_text(c.noise_ratio) + "x the largest of the " +
                       std::to_string(band.num_controls) + " controls', above 1 + margin (" + ratio_text(1 + margin) +
                       ")";
    c.within_noise = c.noise_reason.empty();
  }
}

}  // namespace flowmoe
