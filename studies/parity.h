// Loss parity of precision recipes: the report math of `flowmoe parity` (examples/parity.cpp). Each
// run's loss is smoothed by an EMA, and every candidate's EMA is compared step by step with the
// reference run's; the verdict reads the largest relative deviation after the learning-rate warmup,
// where the early, fast-moving losses would otherwise dominate.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "studies/parity_report.h"

namespace flowmoe {

// The EMA of `losses`, started at the first finite loss (NaN before it). A non-finite loss leaves the
// EMA where it was, so one bad step does not poison every later comparison (the verdict fails it anyway).
std::vector<double> loss_ema(const std::vector<double>& losses, double alpha = kParityEmaAlpha);

// |candidate - reference| / |reference|; NaN when either is non-finite or the reference is 0.
double relative_error(double candidate, double reference);

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
