// The step profiler's table (see step_profile.h).
#include "train/step_profile.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <tuple>

#include "io/file_io.h"
#include "kernels/common/device_api.h"
#include "kernels/common/error.h"
#include "train/train_step.h"

namespace flowmoe {

std::string profile_part(const std::string& scope) {
  if (scope.empty()) return "(outside the model)";
  if (scope.rfind("layers.", 0) == 0) {
    const size_t dot = scope.find('.', 7);  // past "layers.<i>"
    return dot == std::string::npos ? "layer" : scope.substr(dot + 1);
  }
  return scope;
}

namespace {

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string rate(double v) { return fmt(v >= 100 ? "%.0f" : "%.3g", v); }  // 3 digits, no exponent

// One row of a sum by key: milliseconds per phase.
struct PhaseSums {
  double ms[4] = {0, 0, 0, 0};  // by OpPhase
  double total() const { return ms[0] + ms[1] + ms[2] + ms[3]; }
};

void phase_table(std::string& t, const char* title, const std::vector<std::pair<std::string, PhaseSums>>& rows,
                 double all_ms) {
  char line[256];
  std::snprintf(line, sizeof line, "%-28s %10s %10s %10s %10s %7s\n", title, "fwd ms", "bwd ms", "recomp ms", "step ms",
                "share");
  t += line;
  for (const auto& [key, s] : rows) {
    std::snprintf(line, sizeof line, "  %-26s %10.3f %10.3f %10.3f %10.3f %6.1f%%\n", key.c_str(), s.ms[0], s.ms[1],
                  s.ms[2], s.ms[3], all_ms > 0 ? 100 * s.total() / all_ms : 0.0);
    t += line;
  }
}

}  // namespace

std::string profile_table(const StepProfile& p, size_t max_ops) {
  double device_ms = 0, host_ms = 0;
  for (const OpTiming& o : p.ops) device_ms += o.device_ms, host_ms += o.host_ms;
  std::string t = "profile of step " + std::to_string(p.step) + " on " + p.device + ": " + fmt("%.3f", p.wall_ms) +
                  " ms wall; the ops take " + fmt("%.3f", device_ms) + " ms on the device (" +
                  fmt("%.2f", p.wall_ms > 0 ? device_ms / p.wall_ms : 0) + " of the step) and " + fmt("%.3f", host_ms) +
                  " ms of host time; " + fmt("%.3f", std::max(0.0, p.wall_ms - device_ms)) +
                  " ms of the step pass outside every op\n";
  // By part and by scope, in the order they first ran.
  std::vector<std::pair<std::string, PhaseSums>> parts, scopes;
  std::map<std::string, size_t> part_at, scope_at;
  auto add = [](auto& rows, auto& at, const std::string& key, const OpTiming& o) {
    auto [it, fresh] = at.try_emplace(key, rows.size());
    if (fresh) rows.push_back({key, PhaseSums{}});
    rows[it->second].second.ms[int(o.phase)] += o.device_ms;
  };
  for (const OpTiming& o : p.ops) {
    add(parts, part_at, profile_part(o.scope), o);
    add(scopes, scope_at, o.scope.empty() ? "(outside the model)" : o.scope, o);
  }
  phase_table(t, "by part", parts, device_ms);
  phase_table(t, "by scope", scopes, device_ms);
  // By op: (part, op, phase) summed over the layers, largest first.
  struct OpRow {
    std::string part, op;
    OpPhase phase;
    OpTiming sum;
  };
  std::vector<OpRow> ops;
  std::map<std::tuple<std::string, std::string, int>, size_t> op_at;
  for (const OpTiming& o : p.ops) {
    const std::string part = profile_part(o.scope);
    auto [it, fresh] = op_at.try_emplace({part, o.op, int(o.phase)}, ops.size());
    if (fresh) ops.push_back({part, o.op, o.phase, OpTiming{}});
    OpTiming& s = ops[it->second].sum;
    s.calls += o.calls, s.device_ms += o.device_ms, s.host_ms += o.host_ms, s.flops += o.flops, s.bytes += o.bytes;
  }
  std::stable_sort(ops.begin(), ops.end(),
                   [](const OpRow& a, const OpRow& b) { return a.sum.device_ms > b.sum.device_ms; });
  char line[256];
  std::snprintf(line, sizeof line, "%-22s %-26s %-9s %6s %10s %7s %9s %9s %8s\n", "by op: part", "op", "phase", "calls",
                "device ms", "share", "host ms", "TFLOP/s", "GB/s");
  t += line;
  for (size_t i = 0; i < ops.size() && i < max_ops; ++i) {
    const OpRow& r = ops[i];
    const double s = r.sum.device_ms / 1e3;
    std::snprintf(line, sizeof line, "  %-20s %-26s %-9s %6lld %10.3f %6.1f%% %9.3f %9s %8s\n", r.part.c_str(),
                  r.op.c_str(), op_phase_name(r.phase), static_cast<long long>(r.sum.calls), r.sum.device_ms,
                  device_ms > 0 ? 100 * r.sum.device_ms / device_ms : 0.0, r.sum.host_ms,
                  r.sum.flops > 0 && s > 0 ? rate(r.sum.flops / s / 1e12).c_str() : "-",
                  r.sum.bytes > 0 && s > 0 ? rate(r.sum.bytes / s / 1e9).c_str() : "-");
    t += line;
  }
  if (ops.size() > max_ops) t += "  (" + std::to_string(ops.size() - max_ops) + " smaller ops left out)\n";
  return t;
}

std::optional<StepMetrics> profiled_train_step(TrainRun& run) {
  using clock = std::chrono::steady_clock;
  const auto drain = [&] {
    if (run.setup.device.is_cuda()) cuda_synchronize(run.setup.device.index);
  };
  drain();
  StepProfile p;
  p.step = run.loop.step + 1;
  p.device = run.setup.device.str();
  const auto t0 = clock::now();
  profile_begin();
  std::optional<StepMetrics> m;
  try {
    m = train_step(run, /*profiled=*/true);
    drain();
  } catch (...) {
    profile_end();
    throw;
  }
  p.wall_ms = std::chrono::duration<double, std::milli>(clock::now() - t0).count();
  p.ops = profile_end();
  if (run.setup.is_root) {
    const std::string table = profile_table(p);
    for (size_t at = 0; at < table.size();) {  // one progress line per table line
      const size_t nl = table.find('\n', at);
      run.progress.message(table.substr(at, nl - at));
      at = nl == std::string::npos ? table.size() : nl + 1;
    }
    const std::string path = run.res.out_dir + "/profile.txt";
    std::ofstream out(path);
    out << table;
    FLOWMOE_CHECK(out.good(), IoError, "--profile: ", os_error("write", path, errno));
  }
  return m;
}

}  // namespace flowmoe
