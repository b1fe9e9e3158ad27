// A loss-parity study's report as data: its runs, their curves, each candidate's verdict and the controls' noise
// band. Filled by make_parity_report (parity.h) and apply_noise_band (parity_band.h), read by the report's
// JSON, summary and plot.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "train/metrics.h"

namespace flowmoe {

constexpr double kParityEmaAlpha = 0.9;  // ema = 0.9 * ema + 0.1 * loss

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

// The noise band of a study's controls (parity_band.h).
struct NoiseBand {
  int num_controls = 0;
  double margin = 0.25;
  std::vector<double> upper;       // per report step: the largest control's EMA error (NaN: none)
  double control_mean_max = NAN;   // the largest of the controls' mean EMA errors after warmup
  double control_max_max = NAN;    // the largest of their maximum EMA errors after warmup
  double final_val_rel_min = NAN;  // the controls' final validation loss relative to the reference's:
  double final_val_rel_max = NAN;  //   its smallest and largest (signed: positive is worse)
  bool defined() const { return num_controls > 0; }
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

}  // namespace flowmoe
