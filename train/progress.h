// The progress display of a training run: a redrawn bar on a terminal, plain lines otherwise.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>

#include "config/config_types.h"
#include "train/metrics.h"

namespace flowmoe {

// Whether logging.progress: auto draws a bar: the output is a terminal, TERM is not "dumb", and no
// launcher (mpirun, srun) started the process. A launcher forwards each rank's output, and Open MPI
// does it through a pseudo-terminal even when mpirun's own output goes to a file, so a rank cannot
// tell whether the user sees a terminal: it prints plain lines, which a log keeps.
bool auto_progress_bar(bool out_is_terminal, const char* term, bool under_launcher);

class Progress {
 public:
  // mode auto|bar|plain; auto: auto_progress_bar for `out`, this process's TERM and launcher.
  // out == nullptr: silent.
  Progress(ProgressMode mode, int64_t total_steps, int64_t log_every, std::FILE* out = stdout);
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

std::string format_duration(double seconds);     // "1h02m", "3m07s", "12s"
std::string format_rate(double per_s);           // "12.3k"
std::string format_fixed(double v, int digits);  // "%.*f": format_fixed(2.46241, 4) == "2.4624"
std::string format_flops(double flops);          // "2.98 MFLOP", "15.6 GFLOP"
// The progress line's and the summary's model FLOP/s fields (StepMetrics::tflops and mfu): " | 412 TFLOP/s | MFU
// 41.6%", the TFLOP/s to 3 significant digits; without MFU where it is NaN, and "" where tflops is.
std::string model_flops_fields(double tflops, double mfu);

}  // namespace flowmoe
