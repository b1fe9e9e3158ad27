// The progress display of a training run: a redrawn bar on a terminal, plain lines otherwise.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>

#include "train/metrics.h"

namespace flowmoe {

class Progress {
 public:
  // mode auto|bar|plain; auto draws a bar when `out` is a terminal (and TERM is not "dumb").
  // out == nullptr: silent.
  Progress(const std::string& mode, int64_t total_steps, int64_t log_every, std::FILE* out = stdout);
  void update(const StepMetrics& m, double eta_s);  // bar: redraw; plain: a line every log_every steps
  void message(const std::string& line);            // a permanent line (evaluation, checkpoints)
  void finish();
  bool is_bar() const { return bar_; }

 private:
  bool bar_;
  int64_t total_, log_every_;
  std::FILE* out_;
  bool drawn_ = false;
  bool printed_any_ = false;  // plain mode prints the first step of a run, then every log_every
};

std::string format_duration(double seconds);  // "1h02m", "3m07s", "12s"
std::string format_rate(double per_s);        // "12.3k"
std::string format_fixed(double v, int digits);  // "%.*f": format_fixed(2.46241, 4) == "2.4624"

}  // namespace flowmoe
