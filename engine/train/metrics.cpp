// Metrics file, progress display and plots (see metrics.h).
#include "engine/train/metrics.h"

#include <sys/wait.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "engine/error.h"
#include "engine/train/checkpoint.h"

namespace flowmoe {

namespace fs = std::filesystem;

static const char* kCsvHeader = "step,loss,val_loss,lr,grad_norm,tokens_per_s,peak_mem_bytes,host_syncs,moe_casts,skipped,moe_max_over_mean,aux_loss";
// Columns added later go last: the rows an older run wrote are padded with empty cells on resume.

// Per-MoE-layer max/mean load: "1.02;1.10" in CSV, [1.02, 1.10] in JSON; empty for a dense model.
static std::string layer_list(const std::vector<double>& v, bool json) {
  std::string out = json ? "[" : "";
  for (size_t i = 0; i < v.size(); ++i) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.4g", v[i]);
    out += (i ? (json ? ", " : ";") : "") + std::string(std::isfinite(v[i]) ? buf : (json ? "null" : "nan"));
  }
  return json ? out + "]" : out;
}

static std::string num(double v, const char* fmt, bool json) {
  if (!std::isfinite(v)) return json ? "null" : (std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf"));
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

static std::string row_text(const StepMetrics& m, bool csv) {
  std::ostringstream os;
  if (csv) {
    os << m.step << "," << num(m.loss, "%.9g", false) << "," << (std::isnan(m.val_loss) ? "" : num(m.val_loss, "%.9g", false))
       << "," << num(m.lr, "%.6g", false) << "," << num(m.grad_norm, "%.6g", false) << ","
       << num(m.tokens_per_s, "%.1f", false) << "," << m.peak_mem_bytes << "," << m.host_syncs << ","
       << (std::isnan(m.moe_casts) ? "" : num(m.moe_casts, "%.6g", false)) << "," << (m.skipped ? 1 : 0) << "," << layer_list(m.moe_max_over_mean, false) << ","
       << (std::isnan(m.aux_loss) ? "" : num(m.aux_loss, "%.9g", false));
  } else {
    os << "{\"step\": " << m.step << ", \"loss\": " << num(m.loss, "%.9g", true)
       << ", \"val_loss\": " << num(m.val_loss, "%.9g", true) << ", \"lr\": " << num(m.lr, "%.6g", true)
       << ", \"grad_norm\": " << num(m.grad_norm, "%.6g", true) << ", \"tokens_per_s\": " << num(m.tokens_per_s, "%.1f", true)
       << ", \"peak_mem_bytes\": " << m.peak_mem_bytes << ", \"host_syncs\": " << m.host_syncs
       << ", \"moe_casts\": " << num(m.moe_casts, "%.6g", true) << ", \"skipped\": " << (m.skipped ? "true" : "false")
       << ", \"moe_max_over_mean\": " << layer_list(m.moe_max_over_mean, true)
       << ", \"aux_loss\": " << num(m.aux_loss, "%.9g", true) << "}";
  }
  return os.str();
}

// Step of one row (first CSV column or the JSON "step"), or -1 for a header or blank line.
static int64_t row_step(const std::string& line, bool csv) {
  if (line.empty()) return -1;
  if (csv) {
    if (line.rfind("step,", 0) == 0) return -1;
    return std::atoll(line.c_str());
  }
  size_t p = line.find("\"step\":");
  return p == std::string::npos ? -1 : std::atoll(line.c_str() + p + 7);
}

MetricsWriter::MetricsWriter(const std::string& path, const std::string& format, int64_t keep_up_to_step)
    : path_(path), csv_(format == "csv") {
  std::vector<std::string> kept;
  if (keep_up_to_step >= 0) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      int64_t s = row_step(line, csv_);
      if (s >= 0 && s <= keep_up_to_step) kept.push_back(line);
    }
  }
  file_ = std::fopen(path.c_str(), "w");
  FLOWMOE_CHECK(file_ != nullptr, IoError, "cannot write metrics file '", path, "'");
  if (csv_) std::fprintf(file_, "%s\n", kCsvHeader);
  const auto header_commas = std::count(kCsvHeader, kCsvHeader + std::strlen(kCsvHeader), ',');
  for (auto l : kept) {
    if (csv_)
      for (auto c = std::count(l.begin(), l.end(), ','); c < header_commas; ++c) l += ',';
    std::fprintf(file_, "%s\n", l.c_str());
  }
  std::fflush(file_);
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

void MetricsWriter::write(const StepMetrics& m) {
  std::fprintf(file_, "%s\n", row_text(m, csv_).c_str());
  std::fflush(file_);  // a crashed run keeps its rows
}

static double field_double(const std::string& s) {
  if (s.empty() || s == "null") return NAN;
  return std::strtod(s.c_str(), nullptr);
}

std::vector<StepMetrics> read_metrics(const std::string& path) {
  std::ifstream in(path);
  FLOWMOE_CHECK(in.good(), IoError, "cannot open metrics file '", path, "'");
  const bool csv = fs::path(path).extension() == ".csv";
  std::vector<StepMetrics> rows;
  std::vector<std::string> columns;
  std::string line;
  int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    StepMetrics m;
    if (csv) {
      std::vector<std::string> cells;
      std::stringstream ss(line);
      std::string cell;
      while (std::getline(ss, cell, ',')) cells.push_back(cell);
      if (line.back() == ',') cells.push_back("");
      if (columns.empty()) {
        columns = cells;
        continue;
      }
      FLOWMOE_CHECK(cells.size() == columns.size(), IoError, path, ":", line_no, ": ", cells.size(),
                    " cells, the header has ", columns.size());
      for (size_t i = 0; i < cells.size(); ++i) {
        const std::string& c = columns[i];
        if (c == "step") m.step = std::atoll(cells[i].c_str());
        else if (c == "loss") m.loss = field_double(cells[i]);
        else if (c == "val_loss") m.val_loss = field_double(cells[i]);
        else if (c == "lr") m.lr = field_double(cells[i]);
        else if (c == "grad_norm") m.grad_norm = field_double(cells[i]);
        else if (c == "tokens_per_s") m.tokens_per_s = field_double(cells[i]);
        else if (c == "peak_mem_bytes") m.peak_mem_bytes = std::atoll(cells[i].c_str());
        else if (c == "host_syncs") m.host_syncs = std::atoll(cells[i].c_str());
        else if (c == "moe_casts") m.moe_casts = cells[i].empty() ? NAN : field_double(cells[i]);
        else if (c == "skipped") m.skipped = cells[i] == "1";
        else if (c == "aux_loss") m.aux_loss = field_double(cells[i]);
        else if (c == "moe_max_over_mean") {
          std::stringstream layers(cells[i]);
          for (std::string v; std::getline(layers, v, ';');) m.moe_max_over_mean.push_back(field_double(v));
        }
      }
    } else {
      YAML::Node j;
      try {
        j = YAML::Load(line);
      } catch (const YAML::Exception& e) {
        FLOWMOE_THROW(IoError, path, ":", line_no, ": malformed JSON (", e.msg, ")");
      }
      FLOWMOE_CHECK(j.IsMap() && j["step"], IoError, path, ":", line_no, ": not a metrics row");
      auto get = [&](const char* k) { return j[k] ? field_double(j[k].Scalar()) : NAN; };
      m.step = j["step"].as<int64_t>();
      m.loss = get("loss");
      m.val_loss = get("val_loss");
      m.lr = get("lr");
      m.grad_norm = get("grad_norm");
      m.tokens_per_s = get("tokens_per_s");
      m.peak_mem_bytes = j["peak_mem_bytes"] ? j["peak_mem_bytes"].as<int64_t>() : 0;
      m.host_syncs = j["host_syncs"] ? j["host_syncs"].as<int64_t>() : 0;
      m.moe_casts = get("moe_casts");
      m.aux_loss = get("aux_loss");
      m.skipped = j["skipped"] && j["skipped"].Scalar() == "true";
      if (j["moe_max_over_mean"] && j["moe_max_over_mean"].IsSequence())
        for (const YAML::Node& v : j["moe_max_over_mean"]) m.moe_max_over_mean.push_back(field_double(v.Scalar()));
    }
    rows.push_back(m);
  }
  return rows;
}

std::string find_metrics_file(const std::string& run_or_file) {
  std::error_code ec;
  if (fs::is_directory(run_or_file, ec)) {
    for (const char* name : {"metrics.jsonl", "metrics.csv"}) {
      fs::path p = fs::path(run_or_file) / name;
      if (fs::exists(p)) return p.string();
    }
    FLOWMOE_THROW(IoError, "'", run_or_file, "' holds no metrics.jsonl or metrics.csv");
  }
  FLOWMOE_CHECK(fs::exists(run_or_file, ec), IoError, "'", run_or_file, "' does not exist");
  return run_or_file;
}

// ---- progress -----------------------------------------------------------------------------------

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

Progress::Progress(const std::string& mode, int64_t total_steps, int64_t log_every, std::FILE* out)
    : total_(total_steps), log_every_(log_every), out_(out) {
  if (mode == "bar")
    bar_ = true;
  else if (mode == "plain")
    bar_ = false;
  else {
    const char* term = std::getenv("TERM");
    bar_ = out && ::isatty(::fileno(out)) && !(term && std::string(term) == "dumb");
  }
}

void Progress::update(const StepMetrics& m, double eta_s) {
  if (!out_) return;
  char loss[32];
  std::snprintf(loss, sizeof loss, "%.4f", m.loss);
  char lr[32];
  std::snprintf(lr, sizeof lr, "%.2e", m.lr);
  const int digits = int(std::to_string(total_).size());
  if (bar_) {
    const int width = 24;
    double frac = total_ > 0 ? double(m.step) / double(total_) : 1.0;
    int filled = int(frac * width);
    std::string bar(size_t(filled), '#');
    bar += std::string(size_t(width - filled), '.');
    std::fprintf(out_, "\r\033[Kstep %*lld/%lld [%s] %3d%% | loss %s | lr %s | %s tok/s | ETA %s", digits,
                 static_cast<long long>(m.step), static_cast<long long>(total_), bar.c_str(), int(frac * 100 + 0.5),
                 loss, lr, format_rate(m.tokens_per_s).c_str(), format_duration(eta_s).c_str());
    drawn_ = true;
    std::fflush(out_);
    return;
  }
  const bool first = !printed_any_;
  printed_any_ = true;
  if (m.step % log_every_ != 0 && m.step != total_ && !first) return;
  char gn[32];
  std::snprintf(gn, sizeof gn, "%.3f", m.grad_norm);
  std::fprintf(out_, "step %*lld/%lld | loss %s | lr %s | grad norm %s | %s tok/s | ETA %s%s\n", digits,
               static_cast<long long>(m.step), static_cast<long long>(total_), loss, lr, gn,
               format_rate(m.tokens_per_s).c_str(), format_duration(eta_s).c_str(), m.skipped ? " | SKIPPED" : "");
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

// ---- plots --------------------------------------------------------------------------------------

static bool have_program(const std::string& name) {
  return std::system(("command -v " + name + " >/dev/null 2>&1").c_str()) == 0;
}

static std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// A label for a run: its directory name (or the file's parent directory name).
static std::string run_label(const std::string& run, const std::string& file) {
  fs::path p = fs::is_directory(run) ? fs::path(run) : fs::path(file).parent_path();
  std::string s = fs::absolute(p).lexically_normal().filename().string();
  if (s.empty()) s = fs::path(file).stem().string();
  std::string clean;
  for (char c : s) clean += (c == '"' || c == '\'' || c == '\\') ? '_' : c;
  return clean;
}

// A wait status from std::system in words: "exit status 1", "killed by signal 9".
static std::string describe_status(int status) {
  if (status == -1) return "could not be started";
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  return "wait status " + std::to_string(status);
}

// The last non-empty line a plotting program wrote to `file` (its error message: gnuplot and
// Python tracebacks both end with it), trimmed; "" when there is none.
static std::string last_error_line(const fs::path& file) {
  std::ifstream in(file);
  std::string line, last;
  while (std::getline(in, line)) {
    line.erase(0, line.find_first_not_of(" \t\r"));
    line.erase(line.find_last_not_of(" \t\r") + 1);
    if (!line.empty()) last = line;
  }
  return last.size() > 300 ? last.substr(0, 300) + "..." : last;
}

// The image must go into an existing directory, and not onto one: checked before any work.
static void check_plot_output(const std::string& png_path) {
  std::error_code ec;
  FLOWMOE_CHECK(!fs::is_directory(png_path, ec), IoError, "plot: the output '", png_path,
                "' is a directory; give a file name, e.g. --output ", (fs::path(png_path) / "loss.png").string());
  const fs::path parent = fs::path(png_path).parent_path();
  FLOWMOE_CHECK(parent.empty() || fs::is_directory(parent, ec), IoError, "plot: the output directory '",
                parent.string(), "' does not exist (create it first, or choose another --output)");
}

void plot_runs(const std::vector<std::string>& runs, const std::string& png_path, const std::string& title) {
  FLOWMOE_CHECK(!runs.empty(), IoError, "plot: no runs given");
  check_plot_output(png_path);
  const fs::path work = fs::temp_directory_path() / ("flowmoe-plot-" + std::to_string(::getpid()));
  fs::create_directories(work);
  std::vector<std::pair<std::string, std::string>> series;  // label, data file
  bool any_val = false;
  for (size_t i = 0; i < runs.size(); ++i) {
    std::string file = find_metrics_file(runs[i]);
    std::vector<StepMetrics> rows = read_metrics(file);
    FLOWMOE_CHECK(!rows.empty(), IoError, "plot: '", file, "' has no rows");
    fs::path data = work / ("run" + std::to_string(i) + ".dat");
    std::ofstream out(data);
    for (const auto& r : rows) {
      out << r.step << " " << (std::isfinite(r.loss) ? num(r.loss, "%.9g", false) : "NaN") << " "
          << (std::isfinite(r.val_loss) ? num(r.val_loss, "%.9g", false) : "NaN") << "\n";
      any_val = any_val || std::isfinite(r.val_loss);
    }
    series.push_back({run_label(runs[i], file), data.string()});
  }
  int rc = 0;
  std::string program;
  const fs::path errors = work / "stderr.txt";  // the program's messages, reported in one line on failure
  if (have_program("gnuplot")) {
    program = "gnuplot";
    fs::path script = work / "plot.gp";
    std::ofstream gp(script);
    gp << "set terminal pngcairo size 1000,600 enhanced font 'Sans,11'\n"
       << "set output " << json_escape(fs::absolute(png_path).string()) << "\n"
       << "set title " << json_escape(title) << " noenhanced\n"
       << "set xlabel 'step'\nset ylabel 'loss (nats)'\nset grid\nset key top right noenhanced\n"
       << "set datafile missing 'NaN'\nplot ";
    for (size_t i = 0; i < series.size(); ++i) {
      gp << (i ? ", " : "") << json_escape(series[i].second) << " using 1:2 with lines lw 2 lc " << i + 1
         << " title " << json_escape(series[i].first + " train");
      if (any_val)
        gp << ", " << json_escape(series[i].second) << " using 1:3 with linespoints pt 7 ps 1 dt 2 lw 2 lc " << i + 1
           << " title " << json_escape(series[i].first + " val");
    }
    gp << "\n";
    gp.close();
    rc = std::system(("gnuplot " + shell_quote(script.string()) + " 2>" + shell_quote(errors.string())).c_str());
  } else if (std::system("python3 -c 'import matplotlib' >/dev/null 2>&1") == 0) {
    program = "matplotlib (python3)";
    fs::path script = work / "plot.py";
    std::ofstream py(script);
    py << "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\nimport math\n"
       << "fig, ax = plt.subplots(figsize=(10, 6))\n";
    for (size_t i = 0; i < series.size(); ++i) {
      py << "rows = [l.split() for l in open(" << json_escape(series[i].second) << ")]\n"
         << "s = [int(r[0]) for r in rows]\nt = [float(r[1]) for r in rows]\nv = [float(r[2]) for r in rows]\n"
         << "line, = ax.plot(s, t, lw=2, label=" << json_escape(series[i].first + " train") << ")\n"
         << "pts = [(a, b) for a, b in zip(s, v) if not math.isnan(b)]\n"
         << "if pts: ax.plot(*zip(*pts), 'o--', color=line.get_color(), label="
         << json_escape(series[i].first + " val") << ")\n";
    }
    py << "ax.set_xlabel('step'); ax.set_ylabel('loss (nats)'); ax.set_title(" << json_escape(title) << ")\n"
       << "ax.grid(True); ax.legend()\nfig.savefig(" << json_escape(fs::absolute(png_path).string())
       << ", dpi=100)\n";
    py.close();
    rc = std::system(("python3 " + shell_quote(script.string()) + " 2>" + shell_quote(errors.string())).c_str());
  } else {
    fs::remove_all(work);
    FLOWMOE_THROW(IoError, "plot needs gnuplot or Python's matplotlib; install one (scripts/quickstart.sh installs gnuplot-nox)");
  }
  const std::string message = rc == 0 ? "" : last_error_line(errors);
  fs::remove_all(work);
  FLOWMOE_CHECK(rc == 0, IoError, "plot: ", program, " failed (", describe_status(rc), ")",
                message.empty() ? "" : ": " + message, "; no '", png_path, "' was written");
  FLOWMOE_CHECK(fs::exists(png_path), IoError, "plot: ", program, " wrote no '", png_path, "'");
}

}  // namespace flowmoe
