// Loss parity of precision recipes: the report math of `flowmoe parity` (examples/parity.cpp). Each
// run's loss is smoothed by an EMA, and every candidate's EMA is compared step by step with the
// reference run's; the verdict reads the largest relative deviation after the learning-rate warmup,
// where the early, fast-moving losses would otherwise dominate.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "studies/parity_band.h"
#include "train/metrics.h"

namespace flowmoe {

constexpr double kParityEmaAlpha = 0.9;  // ema = 0.9 * ema + 0.1 * loss

// The EMA of `losses`, started at the first finite loss (NaN before it). A non-finite loss leaves the
// EMA where it was, so one bad step does not poison every later comparison (the verdict fails it anyway).
std::vector<double> loss_ema(const std::vector<double>& losses, double alpha = kParityEmaAlpha);

// |candidate - reference| / |reference|; NaN when either is non-finite or the reference is 0.
double relative_error(double candidate, double reference);

// One training run as the report sees it.
struct ParityRun {
  std::string name;    // the recipe, or "control"
  std::string recipe;  // precision.recipe of the run
  bool control = false;
  std::vector<StepMetrics> rows;  // the metrics file's rows
  double final_val_loss = NAN;
  double tokens_per_s = 0;
  std::string config_hash;  // of the resolved config, hex
};

// A run's curve on the reference's steps, and (for a candidate) its EMA's relative error.
struct ParityCurve {
  std::vector<double> loss, ema, rel_err;  // one entry per report step; rel_err empty for the reference
};

struct ParityCandidate {
  std::string name;
  bool control = false;
  int64_t compared_steps = 0;  // steps after warmup where both EMAs are finite
  double max_rel_err = NAN, mean_rel_err = NAN;
  double final_loss = NAN, final_val_loss = NAN;
  std::vector<int64_t> nonfinite_steps;  // non-finite loss or skipped update
  bool pass = false;
  std::string reason;          // why it failed; empty on a pass
  double final_val_rel = NAN;  // final validation loss relative to the reference's (signed)
  // Against the noise band (parity_band.h), when the study has controls; not for a control itself.
  bool judged_against_noise = false;
  bool within_noise = false;
  double noise_ratio = NAN;  // mean EMA error after warmup / the largest control's
  std::string noise_reason;  // why it is outside the band; empty when within
};

struct ParityReport {
  std::string config;     // the config file
  std::string reference;  // the reference run's name
  double threshold = 0;   // the largest relative EMA error a candidate may have after warmup
  int64_t warmup_steps = 0;
  int world_size = 1, expert_parallel_size = 1;
  double ema_alpha = kParityEmaAlpha;       // the loss curves' EMA: ema = alpha * ema + (1 - alpha) * loss
  std::vector<int64_t> steps;               // every step some run logged, ascending
  std::vector<ParityRun> runs;              // reference first
  std::vector<ParityCurve> curves;          // per run
  std::vector<ParityCandidate> candidates;  // per run after the reference (the controls among them)
  NoiseBand band;                           // from the controls; undefined without them
  // Every candidate that is not a control passed the threshold.
  bool passed() const;
  // Every candidate that is not a control is within the noise band (true without controls).
  bool within_noise() const;
  // `flowmoe parity`'s exit status: 0 when every candidate passes what the study judges; without a
  // band (fewer than 2 controls) 1 when one fails the threshold; with one, 1 when a candidate is
  // outside it, and 4 when all are within it but one fails the threshold (the noise is above it).
  int exit_status() const;
};

// The report of `runs` (the reference first; runs with `control` set make the noise band, whose
// verdict takes `margin`), their losses smoothed by an EMA of `ema_alpha` in [0, 1) (0: the raw
// losses). Throws ConfigError for fewer than two runs or an alpha outside [0, 1).
ParityReport make_parity_report(std::vector<ParityRun> runs, double threshold, int64_t warmup_steps,
                                double margin = 0.25, double ema_alpha = kParityEmaAlpha);

// The first key in which two resolved configs (to_yaml texts) differ, as "train.steps: 200 in the
// earlier run, 300 now" ("(absent)" for a key one of them lacks); "" when they agree on every key but
// those of `ignored` ("section.key"). The keys are walked in `now`'s order, then those only `earlier`
// has. Comments do not count: the header names the config file, which may be spelled another way.
// Throws ConfigError when either text is not YAML.
std::string first_changed_key(const std::string& earlier, const std::string& now,
                              const std::vector<std::string>& ignored = {});

// The report as JSON (non-finite numbers as null).
std::string parity_json(const ParityReport& report);

// "fp8_flow vs bf16: max EMA rel err 0.31% after warmup (mean 0.12%), final loss 2.4627 vs 2.4623: PASS (threshold
// 0.25%)", then with controls "; within noise (mean error 0.82x the largest of 3 controls', margin 25%)"
// and the final validation loss relative to the reference's beside the controls' spread
std::string parity_summary_line(const ParityReport& report, const ParityCandidate& c);

// DIR/parity.png: the EMA curves on top, the candidates' relative errors with the threshold below.
// Returns false (drawing nothing) when neither gnuplot nor matplotlib is installed.
bool plot_parity(const ParityReport& report, const std::string& png_path);

}  // namespace flowmoe
