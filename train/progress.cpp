// The progress display (see progress.h).
#include "train/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <iterator>

#include "parallel/distributed.h"

namespace flowmoe {

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  long t = long(s + 0.5);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", t / 3600, (t / 60) % 60);
  else if (t >= 60)
    std::snprintf(buf, sizeof buf, "%ldm%02lds", t / 60, t % 60);
  else
    std::snprintf(buf, sizeof buf, "%lds", t);
  return buf;
}

std::string format_fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string format_rate(double v) {
  char buf[32];
  if (v >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
  else if (v >= 1e3)
    std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.0f", v);
  return buf;
}

// 3 significant digits, without an exponent: 412, 41.2, 4.12, 0.0412.
static std::string three_digits(double v) {
  const int decimals = v > 0 ? std::clamp(2 - int(std::floor(std::log10(v))), 0, 9) : 0;
  return format_fixed(v, decimals);
}

std::string format_flops(double flops) {
  static const char* prefixes[] = {"", "k", "M", "G", "T", "P", "E"};
  size_t p = 0;
  while (flops >= 1000 && p + 1 < std::size(prefixes)) {
    flops /= 1000;
    ++p;
  }
  return three_digits(flops) + " " + prefixes[p] + "FLOP";
}

std::string model_flops_fields(double tflops, double mfu) {
  if (std::isnan(tflops)) return "";
  return " | " + three_digits(tflops) + " TFLOP/s" +
         (std::isnan(mfu) ? "" : " | MFU " + format_fixed(100 * mfu, 1) + "%");
}

bool auto_progress_bar(bool out_is_terminal, const char* term, bool under_launcher) {
  return out_is_terminal && !(term && std::string(term) == "dumb") && !under_launcher;
}

// A launcher set this process's environment (detect_launch names the variable); a malformed one
// counts too: the run reports it where it starts.
static bool started_by_launcher() {
  try {
    return !detect_launch().launcher.empty();
  } catch (const std::exception&) {
    return true;
  }
}

Progress::Progress(ProgressMode mode, int64_t total_steps, int64_t log_every, std::FILE* out)
    : total_(total_steps), log_every_(log_every), out_(out) {
  if (mode == ProgressMode::bar)
    bar_ = true;
  else if (mode == ProgressMode::plain)
    bar_ = false;
  else
    bar_ = out && auto_progress_bar(::isatty(::fileno(out)), std::getenv("TERM"), started_by_launcher());
}

void Progress::update(const StepMetrics& m, double eta_s) {
  if (!out_) return;
  // With MTP modules the MTP loss follows the LM loss: "loss 2.3456 | mtp 2.9876".
  char loss[64];
  if (std::isnan(m.mtp_loss))
    std::snprintf(loss, sizeof loss, "%.4f", m.loss);
  else
    std::snprintf(loss, sizeof loss, "%.4f | mtp %.4f", m.loss, m.mtp_loss);
  char lr[32];
  std::snprintf(lr, sizeof lr, "%.2e", m.lr);
  const int digits = int(std::to_string(total_).size());
  if (bar_) {
    const int width = 24;
    double frac = total_ > 0 ? double(m.step) / double(total_) : 1.0;
    int filled = int(frac * width);
    std::string bar(size_t(filled), '#');
    bar += std::string(size_t(width - filled), '.');
    std::fprintf(out_, "\r\033[Kstep %*lld/%lld [%s] %3d%% | loss %s | lr %s | %s tok/s%s | ETA %s", digits,
                 static_cast<long long>(m.step), static_cast<long long>(total_), bar.c_str(), int(frac * 100 + 0.5),
                 loss, lr, format_rate(m.tokens_per_s).c_str(), model_flops_fields(m.tflops, m.mfu).c_str(),
                 format_duration(eta_s).c_str());
    drawn_ = true;
    std::fflush(out_);
    return;
  }
  const bool first = !printed_any_;
  printed_any_ = true;
  if (m.step % log_every_ != 0 && m.step != total_ && !first) return;
  char gn[32];
  std::snprintf(gn, sizeof gn, "%.3f", m.grad_norm);
  std::fprintf(out_, "step %*lld/%lld | loss %s | lr %s | grad norm %s | %s tok/s%s | ETA %s%s\n", digits,
               static_cast<long long>(m.step), static_cast<long long>(total_), loss, lr, gn,
               format_rate(m.tokens_per_s).c_str(), model_flops_fields(m.tflops, m.mfu).c_str(),
               format_duration(eta_s).c_str(), m.skipped ? " | SKIPPED" : "");
  std::fflush(out_);
}

void Progress::message(const std::string& line) {
  if (!out_) return;
  if (bar_ && drawn_) std::fprintf(out_, "\r\033[K");
  std::fprintf(out_, "%s\n", line.c_str());
  drawn_ = false;
  std::fflush(out_);
}

void Progress::finish() {
  if (!out_) return;
  if (bar_ && drawn_) std::fprintf(out_, "\n");
  drawn_ = false;
  std::fflush(out_);
}

}  // namespace flowmoe
