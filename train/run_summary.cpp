// The end of a training run: the result completed, and the summary lines (done, casts, files, time).
#include <algorithm>
#include <cmath>
#include <string>

#include "engine/allocator.h"
#include "engine/cast_stats.h"
#include "train/data_parallel.h"
#include "train/progress.h"
#include "train/train_step.h"

namespace flowmoe {

// Where each explicit cast of the last step happened (DESIGN.md §1: the published flow has 2).
static void print_cast_summary(TrainRun& run) {
  const CastCounts& casts = run.last_casts;
  std::string line = "casts per MoE layer per micro-batch (" + run.cfg.precision.recipe + "): " +
                     format_fixed(double(casts.activation_casts()) / run.cast_divisor, 1);
  for (const auto& [site, n] : casts.by_site)
    if (site.rfind("weight_quantize", 0) != 0)
      line += " | " + site + " x" + format_fixed(double(n) / run.cast_divisor, 1);
  run.progress.message(line);
}

// "time: 41.3 s in all: set-up 12.1 s (start-up 3.2, model 8.4, ...), training 3.0 s, evaluation 0.4 s,
// checkpoints 25.7 s, other 0.2 s", set-up parts of 0.05 s or more named. Set-up, evaluation and
// checkpoints are what tokens/s leaves out; "other" is the loop's own time and the summary's collectives.
static void print_times(TrainRun& run) {
  const RunClock& c = run.clock;
  const double total = c.seconds_since_start();
  double setup = 0;
  std::string parts;
  for (const auto& [name, seconds] : c.setup) {
    setup += seconds;
    if (seconds >= 0.05) parts += (parts.empty() ? "" : ", ") + name + " " + format_fixed(seconds, 1);
  }
  const double other = total - setup - run.train_seconds - c.evaluation_seconds - c.checkpoint_seconds;
  run.progress.message("time: " + format_fixed(total, 1) + " s in all: set-up " + format_fixed(setup, 1) + " s" +
                       (parts.empty() ? "" : " (" + parts + ")") + ", training " + format_fixed(run.train_seconds, 1) +
                       " s, evaluation " + format_fixed(c.evaluation_seconds, 1) + " s, checkpoints " +
                       format_fixed(c.checkpoint_seconds, 1) + " s, other " + format_fixed(std::max(other, 0.0), 1) +
                       " s");
}

static void print_summary(TrainRun& run, double peak_mem_bytes) {
  const TrainResult& res = run.res;
  std::string line = "done: step " + std::to_string(run.step) + "/" + std::to_string(run.cfg.train.steps) + " in " +
                     format_duration(run.train_seconds) + " | loss " + format_fixed(res.losses.front(), 4) + " -> " +
                     format_fixed(res.losses.back(), 4);
  if (!std::isnan(res.final_val_loss)) line += " | val loss " + format_fixed(res.final_val_loss, 4);
  line += " | " + format_rate(res.tokens_per_s) + " tok/s | peak mem " + format_fixed(peak_mem_bytes / (1 << 20), 1) +
          " MiB";
  if (run.world_size > 1) line += " (max over ranks) | " + std::to_string(run.world_size) + " ranks";
  run.progress.message(line);
  if (run.cast_divisor > 0) print_cast_summary(run);
  run.progress.message("metrics: " + res.metrics_file +
                       (res.last_checkpoint.empty() ? "" : " | checkpoint: " + res.last_checkpoint));
}

TrainResult finish_run(TrainRun& run) {
  run.progress.finish();
  TrainResult& res = run.res;
  res.last_step = run.step;
  res.skipped_steps = run.skipped;
  res.interrupted = res.interrupted || run.step < run.cfg.train.steps;
  res.tokens_per_s = run.train_seconds > 0 ? double(run.tokens_per_step * run.steps_done) / run.train_seconds : 0;
  const double peak = all_reduce_values(*run.world, {double(memory_stats(run.device).peak_bytes)}, ReduceOp::max)[0];
  if (run.steps_done > 0)
    print_summary(run, peak);
  else
    run.progress.message("nothing to do: the run is already at step " + std::to_string(run.step) + " of " +
                         std::to_string(run.cfg.train.steps));
  print_times(run);
  return std::move(res);
}

}  // namespace flowmoe
