// The metrics file: its writer and reader (see metrics.h).
#include "train/metrics.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "io/file_io.h"
#include "kernels/common/error.h"

namespace flowmoe {

namespace fs = std::filesystem;

static const char* kCsvHeader =
    "step,loss,val_loss,lr,grad_norm,tokens_per_s,peak_mem_bytes,host_syncs,moe_casts,skipped,moe_max_over_mean,aux_"
    "loss,exchange_ms,tflops,mfu,mtp_loss";
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
    os << m.step << "," << num(m.loss, "%.9g", false) << ","
       << (std::isnan(m.val_loss) ? "" : num(m.val_loss, "%.9g", false)) << "," << num(m.lr, "%.6g", false) << ","
       << num(m.grad_norm, "%.6g", false) << "," << num(m.tokens_per_s, "%.1f", false) << "," << m.peak_mem_bytes << ","
       << m.host_syncs << "," << (std::isnan(m.moe_casts) ? "" : num(m.moe_casts, "%.6g", false)) << ","
       << (m.skipped ? 1 : 0) << "," << layer_list(m.moe_max_over_mean, false) << ","
       << (std::isnan(m.aux_loss) ? "" : num(m.aux_loss, "%.9g", false)) << ","
       << (std::isnan(m.exchange_ms) ? "" : num(m.exchange_ms, "%.4f", false)) << ","
       << (std::isnan(m.tflops) ? "" : num(m.tflops, "%.6g", false)) << ","
       << (std::isnan(m.mfu) ? "" : num(m.mfu, "%.6g", false)) << ","
       << (std::isnan(m.mtp_loss) ? "" : num(m.mtp_loss, "%.9g", false));
  } else {
    os << "{\"step\": " << m.step << ", \"loss\": " << num(m.loss, "%.9g", true)
       << ", \"val_loss\": " << num(m.val_loss, "%.9g", true) << ", \"lr\": " << num(m.lr, "%.6g", true)
       << ", \"grad_norm\": " << num(m.grad_norm, "%.6g", true)
       << ", \"tokens_per_s\": " << num(m.tokens_per_s, "%.1f", true) << ", \"peak_mem_bytes\": " << m.peak_mem_bytes
       << ", \"host_syncs\": " << m.host_syncs << ", \"moe_casts\": " << num(m.moe_casts, "%.6g", true)
       << ", \"skipped\": " << (m.skipped ? "true" : "false")
       << ", \"moe_max_over_mean\": " << layer_list(m.moe_max_over_mean, true)
       << ", \"aux_loss\": " << num(m.aux_loss, "%.9g", true)
       << ", \"exchange_ms\": " << num(m.exchange_ms, "%.4f", true) << ", \"tflops\": " << num(m.tflops, "%.6g", true)
       << ", \"mfu\": " << num(m.mfu, "%.6g", true) << ", \"mtp_loss\": " << num(m.mtp_loss, "%.9g", true) << "}";
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

// The cells of a CSV line; a trailing comma ends an empty last cell.
static std::vector<std::string> csv_cells(const std::string& line) {
  std::vector<std::string> cells;
  std::stringstream ss(line);
  std::string cell;
  while (std::getline(ss, cell, ',')) cells.push_back(cell);
  if (!line.empty() && line.back() == ',') cells.push_back("");
  return cells;
}

// A JSONL line as a metrics row (JSON is YAML); *why says why when it is not one.
static YAML::Node json_row(const std::string& line, std::string* why) {
  try {
    YAML::Node j = YAML::Load(line);
    if (j.IsMap() && j["step"]) {
      (void)j["step"].as<int64_t>();
      return j;
    }
    *why = "not a metrics row";
  } catch (const YAML::Exception& e) {
    *why = "malformed JSON (" + e.msg + ")";
  }
  return YAML::Node();
}

// Whether a line of a metrics file whose CSV header has `num_columns` cells is a row (or that header).
static bool is_row(const std::string& line, bool csv, size_t num_columns) {
  if (!csv) {
    std::string why;
    json_row(line, &why);
    return why.empty();
  }
  if (line.rfind("step,", 0) == 0) return true;
  char* end = nullptr;
  std::strtoll(line.c_str(), &end, 10);
  return end != line.c_str() && *end == ',' && csv_cells(line).size() == num_columns;
}

// The lines of an earlier run's metrics file, less a last line it left torn: one with no line end (the
// run stopped while writing it, or the disk filled) or that is not a row. *note then says so.
static std::vector<std::string> whole_lines(const std::string& path, bool csv, std::string* note) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  const std::string all = text.str();
  std::vector<std::string> lines;
  for (size_t at = 0; at < all.size();) {
    const size_t nl = std::min(all.find('\n', at), all.size());
    lines.push_back(all.substr(at, nl - at));
    at = nl + 1;
  }
  if (lines.empty()) return lines;
  const bool ended = all.back() == '\n';
  const size_t num_columns = csv ? csv_cells(lines.front()).size() : 0;
  if (ended && (lines.back().empty() || is_row(lines.back(), csv, num_columns))) return lines;
  *note = "metrics: dropped line " + std::to_string(lines.size()) + " of " + path + ", which the earlier run left " +
          (ended ? "unreadable (not a metrics row)" : "unfinished (no line end)");
  lines.pop_back();
  return lines;
}

MetricsWriter::MetricsWriter(const std::string& path, MetricsFormat format, int64_t keep_up_to_step)
    : path_(path), csv_(format == MetricsFormat::csv) {
  std::vector<std::string> kept;
  if (keep_up_to_step >= 0) {
    for (const std::string& line : whole_lines(path, csv_, &note_)) {
      int64_t s = row_step(line, csv_);
      if (s >= 0 && s <= keep_up_to_step) kept.push_back(line);
    }
  }
  // A resumed run's kept rows go to a temporary file renamed over the earlier one, so a write that fails
  // (a full disk) leaves the earlier rows as they were; a fresh run's file starts empty.
  const bool resumed = keep_up_to_step >= 0;
  const std::string first = resumed ? path + ".tmp" : path;
  file_ = std::fopen(first.c_str(), "w");
  FLOWMOE_CHECK(file_ != nullptr, IoError, os_error("write metrics file", first, errno));
  try {
    if (csv_) put(kCsvHeader);
    const auto header_commas = std::count(kCsvHeader, kCsvHeader + std::strlen(kCsvHeader), ',');
    for (auto l : kept) {
      if (csv_)
        for (auto c = std::count(l.begin(), l.end(), ','); c < header_commas; ++c) l += ',';
      put(l);
    }
    flush();
    if (!resumed) return;
    const bool closed = std::fclose(file_) == 0;
    file_ = nullptr;
    FLOWMOE_CHECK(closed, IoError, os_error("write metrics file", first, errno));
    FLOWMOE_CHECK(std::rename(first.c_str(), path.c_str()) == 0, IoError, "cannot rename '", first, "' to '", path,
                  "': ", std::strerror(errno));
  } catch (...) {  // no destructor runs for a constructor that throws
    if (file_) std::fclose(file_);
    file_ = nullptr;
    if (resumed) std::remove(first.c_str());
    throw;
  }
  file_ = std::fopen(path.c_str(), "a");
  FLOWMOE_CHECK(file_ != nullptr, IoError, os_error("write metrics file", path, errno));
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

// A buffered write may fail only at the flush that sends it: both are checked, with the OS's reason.
void MetricsWriter::put(const std::string& line) {
  errno = 0;
  const bool ok = std::fputs(line.c_str(), file_) >= 0 && std::fputc('\n', file_) != EOF;
  FLOWMOE_CHECK(ok, IoError, os_error("write metrics file", path_, errno ? errno : EIO));
}

void MetricsWriter::flush() {
  errno = 0;
  FLOWMOE_CHECK(std::fflush(file_) == 0, IoError, os_error("write metrics file", path_, errno ? errno : EIO));
}

void MetricsWriter::write(const StepMetrics& m) {
  put(row_text(m, csv_));
  flush();  // a crashed run keeps its rows
}

static double field_double(const std::string& s) {
  if (s.empty() || s == "null") return NAN;
  return std::strtod(s.c_str(), nullptr);
}

std::vector<StepMetrics> read_metrics(const std::string& path) {
  std::ifstream in(path);
  FLOWMOE_CHECK(in.good(), IoError, os_error("open metrics file", path, errno));
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
      const std::vector<std::string> cells = csv_cells(line);
      if (columns.empty()) {
        columns = cells;
        continue;
      }
      FLOWMOE_CHECK(cells.size() == columns.size(), IoError, path, ":", line_no, ": ", cells.size(),
                    " cells, the header has ", columns.size());
      for (size_t i = 0; i < cells.size(); ++i) {
        const std::string& c = columns[i];
        if (c == "step")
          m.step = std::atoll(cells[i].c_str());
        else if (c == "loss")
          m.loss = field_double(cells[i]);
        else if (c == "val_loss")
          m.val_loss = field_double(cells[i]);
        else if (c == "lr")
          m.lr = field_double(cells[i]);
        else if (c == "grad_norm")
          m.grad_norm = field_double(cells[i]);
        else if (c == "tokens_per_s")
          m.tokens_per_s = field_double(cells[i]);
        else if (c == "peak_mem_bytes")
          m.peak_mem_bytes = std::atoll(cells[i].c_str());
        else if (c == "host_syncs")
          m.host_syncs = std::atoll(cells[i].c_str());
        else if (c == "moe_casts")
          m.moe_casts = cells[i].empty() ? NAN : field_double(cells[i]);
        else if (c == "skipped")
          m.skipped = cells[i] == "1";
        else if (c == "aux_loss")
          m.aux_loss = field_double(cells[i]);
        else if (c == "exchange_ms")
          m.exchange_ms = cells[i].empty() ? NAN : field_double(cells[i]);
        else if (c == "tflops")
          m.tflops = field_double(cells[i]);
        else if (c == "mfu")
          m.mfu = field_double(cells[i]);
        else if (c == "mtp_loss")
          m.mtp_loss = cells[i].empty() ? NAN : field_double(cells[i]);
        else if (c == "moe_max_over_mean") {
          std::stringstream layers(cells[i]);
          for (std::string v; std::getline(layers, v, ';');) m.moe_max_over_mean.push_back(field_double(v));
        }
      }
    } else {
      std::string why;
      const YAML::Node j = json_row(line, &why);
      FLOWMOE_CHECK(why.empty(), IoError, path, ":", line_no, ": ", why);
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
      m.exchange_ms = get("exchange_ms");
      m.tflops = get("tflops");
      m.mfu = get("mfu");
      m.mtp_loss = get("mtp_loss");
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
    for (const char* name : kMetricsFiles) {
      fs::path p = fs::path(run_or_file) / name;
      if (fs::exists(p)) return p.string();
    }
    FLOWMOE_THROW(IoError, "'", run_or_file, "' holds no metrics.jsonl or metrics.csv");
  }
  FLOWMOE_CHECK(fs::exists(run_or_file, ec), IoError, "'", run_or_file, "' does not exist");
  return run_or_file;
}

}  // namespace flowmoe
