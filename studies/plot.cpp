// Loss-curve plots through gnuplot or matplotlib (see plot.h).
#include "studies/plot.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "config/output_check.h"
#include "io/file_io.h"
#include "kernels/common/error.h"
#include "train/metrics.h"

namespace flowmoe {

namespace fs = std::filesystem;

// A loss in the plot's data file: full precision, or NaN (a gap in the curve) where it is missing.
static std::string data_cell(double v) {
  if (!std::isfinite(v)) return "NaN";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

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

// After the plotting program ran: removes its work directory, and throws IoError with its last
// message when it failed or wrote no image.
static void finish_plot(const fs::path& work, const std::string& program, int rc, const std::string& png_path) {
  const std::string message = rc == 0 ? "" : last_error_line(work / "stderr.txt");
  fs::remove_all(work);
  FLOWMOE_CHECK(rc == 0, IoError, "plot: ", program, " failed (", describe_status(rc), ")",
                message.empty() ? "" : ": " + message, "; no '", png_path, "' was written");
  FLOWMOE_CHECK(fs::exists(png_path), IoError, "plot: ", program, " wrote no '", png_path, "'");
}

void plot_runs(const std::vector<std::string>& runs, const std::string& png_path, const std::string& title) {
  FLOWMOE_CHECK(!runs.empty(), IoError, "plot: no runs given");
  std::vector<std::string> files;
  std::vector<InputFile> inputs;
  for (const std::string& run : runs) {
    files.push_back(find_metrics_file(run));
    inputs.push_back({"metrics file", files.back()});
  }
  check_output_file("plot: --output '" + png_path + "'", png_path, inputs, "loss.png");
  const fs::path work = fs::temp_directory_path() / ("flowmoe-plot-" + std::to_string(::getpid()));
  fs::create_directories(work);
  std::vector<std::pair<std::string, std::string>> series;  // label, data file
  bool any_val = false;
  for (size_t i = 0; i < runs.size(); ++i) {
    const std::string& file = files[i];
    std::vector<StepMetrics> rows = read_metrics(file);
    FLOWMOE_CHECK(!rows.empty(), IoError, "plot: '", file, "' has no rows");
    fs::path data = work / ("run" + std::to_string(i) + ".dat");
    std::ofstream out(data);
    for (const auto& r : rows) {
      out << r.step << " " << data_cell(r.loss) << " " << data_cell(r.val_loss) << "\n";
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
      gp << (i ? ", " : "") << json_escape(series[i].second) << " using 1:2 with lines lw 2 lc " << i + 1 << " title "
         << json_escape(series[i].first + " train");
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
         << "if pts: ax.plot(*zip(*pts), 'o--', color=line.get_color(), label=" << json_escape(series[i].first + " val")
         << ")\n";
    }
    py << "ax.set_xlabel('step'); ax.set_ylabel('loss (nats)'); ax.set_title(" << json_escape(title) << ")\n"
       << "ax.grid(True); ax.legend()\nfig.savefig(" << json_escape(fs::absolute(png_path).string()) << ", dpi=100)\n";
    py.close();
    rc = std::system(("python3 " + shell_quote(script.string()) + " 2>" + shell_quote(errors.string())).c_str());
  } else {
    fs::remove_all(work);
    FLOWMOE_THROW(
        IoError, "plot needs gnuplot or Python's matplotlib; install one (scripts/quickstart.sh installs gnuplot-nox)");
  }
  finish_plot(work, program, rc, png_path);
}

bool plot_two_panels(const TwoPanelPlot& p, const std::string& png_path) {
  check_output_file("plot: '" + png_path + "'", png_path, {});
  const bool gnuplot = have_program("gnuplot");
  if (!gnuplot && std::system("python3 -c 'import matplotlib' >/dev/null 2>&1") != 0) return false;
  const fs::path work = fs::temp_directory_path() / ("flowmoe-plot2-" + std::to_string(::getpid()));
  fs::create_directories(work);
  const fs::path data = work / "series.dat";  // columns: x, the top series, the bottom series
  {
    std::ofstream out(data);
    for (size_t i = 0; i < p.x.size(); ++i) {
      out << data_cell(p.x[i]);
      for (const auto* panel : {&p.top, &p.bottom})
        for (const PlotSeries& s : *panel) out << " " << data_cell(i < s.y.size() ? s.y[i] : NAN);
      if (!p.bottom_band.empty()) out << " " << data_cell(i < p.bottom_band.size() ? p.bottom_band[i] : NAN);
      out << "\n";
    }
  }
  const fs::path errors = work / "stderr.txt";
  const std::string png = json_escape(fs::absolute(png_path).string());
  std::string command;
  if (gnuplot) {
    const fs::path script = work / "plot.gp";
    std::ofstream gp(script);
    gp << "set terminal pngcairo size 1000,900 enhanced font 'Sans,11'\nset output " << png << "\n"
       << "set datafile missing 'NaN'\nset grid\nset key top right noenhanced\n"
       << "set multiplot layout 2,1 title " << json_escape(p.title) << " noenhanced\n";
    size_t column = 2;
    const size_t band_column = 2 + p.top.size() + p.bottom.size();  // the last column, when there is a band
    for (const auto* panel : {&p.top, &p.bottom}) {
      const bool bottom = panel == &p.bottom;
      gp << "set xlabel 'step'\nset ylabel " << json_escape(bottom ? p.bottom_ylabel : p.top_ylabel)
         << " noenhanced\nplot ";
      if (bottom && !p.bottom_band.empty())
        gp << json_escape(data.string()) << " using 1:(0):" << band_column
           << " with filledcurves fs transparent solid 0.25 lc rgb 'gray50' title " << json_escape(p.bottom_band_label)
           << (panel->empty() ? "" : ", ");
      for (size_t i = 0; i < panel->size(); ++i, ++column)
        gp << (i ? ", " : "") << json_escape(data.string()) << " using 1:" << column << " with lines lw 2 lc "
           << i + 1 + (bottom ? 1 : 0) << " title " << json_escape((*panel)[i].label);
      if (bottom && std::isfinite(p.bottom_line))
        gp << (panel->empty() ? "" : ", ") << data_cell(p.bottom_line) << " with lines dt 2 lc rgb 'black' title "
           << json_escape(p.bottom_line_label);
      gp << "\n";
    }
    gp << "unset multiplot\n";
    command = "gnuplot " + shell_quote(script.string());
  } else {
    const fs::path script = work / "plot.py";
    std::ofstream py(script);
    py << "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
       << "cols = list(zip(*[[float(v) for v in l.split()] for l in open(" << json_escape(data.string()) << ")]))\n"
       << "fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 9), sharex=True)\n";
    size_t column = 1;
    if (!p.bottom_band.empty())
      py << "bottom.fill_between(cols[0], 0, cols[" << p.top.size() + p.bottom.size() + 1
         << "], color='0.5', alpha=0.25, label=" << json_escape(p.bottom_band_label) << ")\n";
    for (const auto* panel : {&p.top, &p.bottom}) {
      const bool bottom = panel == &p.bottom;
      const char* ax = bottom ? "bottom" : "top";
      for (size_t i = 0; i < panel->size(); ++i, ++column)
        py << ax << ".plot(cols[0], cols[" << column << "], lw=2, color='C" << i + (bottom ? 1 : 0)
           << "', label=" << json_escape((*panel)[i].label) << ")\n";
      if (bottom && std::isfinite(p.bottom_line))
        py << "bottom.axhline(" << data_cell(p.bottom_line)
           << ", ls='--', color='k', label=" << json_escape(p.bottom_line_label) << ")\n";
      py << ax << ".set_ylabel(" << json_escape(bottom ? p.bottom_ylabel : p.top_ylabel) << "); " << ax
         << ".grid(True); " << ax << ".legend()\n";
    }
    py << "bottom.set_xlabel('step'); fig.suptitle(" << json_escape(p.title) << ")\nfig.savefig(" << png
       << ", dpi=100)\n";
    command = "python3 " + shell_quote(script.string());
  }
  const int rc = std::system((command + " 2>" + shell_quote(errors.string())).c_str());
  finish_plot(work, gnuplot ? "gnuplot" : "matplotlib (python3)", rc, png_path);
  return true;
}

}  // namespace flowmoe
