// The check of a file a command is about to write (see output_check.h).
#include "config/output_check.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "io/dir_lock.h"
#include "io/file_io.h"
#include "io/run_files.h"
#include "kernels/common/error.h"

namespace flowmoe {

namespace fs = std::filesystem;

namespace {

// What marks a folder as a run's: its lock or its metrics (a config.yaml alone may be anyone's).
std::vector<std::string> run_folder_markers() {
  std::vector<std::string> files = {kDirLockFile};
  for (const char* metrics : kMetricsFiles) files.push_back(metrics);
  return files;
}

bool holds(const fs::path& folder, const std::string& file) {
  std::error_code ec;
  return fs::exists(folder / file, ec);
}

}  // namespace

std::vector<InputFile> config_inputs(const Config& cfg) {
  std::vector<InputFile> inputs;
  if (!cfg.file.empty()) inputs.push_back({"config file", cfg.file});
  if (cfg.data.source == DataSource::synthetic || cfg.data.path.empty()) return inputs;
  std::error_code ec;
  if (!fs::is_directory(cfg.data.path, ec)) {
    inputs.push_back({"data file", cfg.data.path});
    return inputs;
  }
  for (fs::directory_iterator it(cfg.data.path, ec), end; !ec && it != end; it.increment(ec))
    inputs.push_back({"data file", it->path().string()});
  return inputs;
}

std::string output_file_problem(const std::string& named, const std::string& path, const std::vector<InputFile>& inputs,
                                const std::string& example_name) {
  const fs::path folder = fs::path(path).parent_path();
  const std::string folder_name = folder.empty() ? "." : folder.string();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err != ENOENT) return named + " cannot be written: " + std::strerror(err);
    std::error_code ec;
    if (!fs::is_directory(folder_name, ec))
      return named + ": its folder '" + folder_name + "' does not exist (create it first, or name another file)";
  } else if (S_ISDIR(st.st_mode)) {
    return named + " is a directory; name a file to write" +
           (example_name.empty() ? "" : ", e.g. '" + (fs::path(path) / example_name).string() + "'");
  } else if (!S_ISREG(st.st_mode)) {
    return named + " is " + file_type_name(st) + ", not a regular file; name a regular file to write";
  } else {
    for (const InputFile& in : inputs)
      if (same_file(path, in.path))
        return named + " is the " + in.what + " '" + in.path + "'" + (in.path == path ? "" : " (the same file)") +
               ": writing it would overwrite what is read; name another file to write";
  }
  // Every file of a checkpoint folder is the checkpoint's (keep_last deletes the folder whole); a run
  // folder takes other files (a plot beside the metrics) but not one of the run's own.
  if (holds(folder_name, kCheckpointModelFile))
    return named + " is in the checkpoint folder '" + folder_name + "' (it holds " + kCheckpointModelFile +
           "), whose files are the checkpoint's; write it elsewhere";
  const std::vector<std::string> markers = run_folder_markers();
  const std::string name = fs::path(path).filename().string();
  const bool own = name == kRunConfigFile || std::find(markers.begin(), markers.end(), name) != markers.end();
  if (own && std::any_of(markers.begin(), markers.end(), [&](const std::string& f) { return holds(folder_name, f); }))
    return named + " is the run folder '" + folder_name + "''s own " + name + "; write it elsewhere";
  return "";
}

void check_output_file(const std::string& named, const std::string& path, const std::vector<InputFile>& inputs,
                       const std::string& example_name) {
  const std::string problem = output_file_problem(named, path, inputs, example_name);
  FLOWMOE_CHECK(problem.empty(), ConfigError, problem);
}

std::string output_folder_problem(const std::string& named, const std::string& path) {
  if (path.empty()) return named + ": the path is empty";
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode))
      return named + " exists and is " + file_type_name(st) + ", not a folder; name a new folder";
    std::error_code ec;
    const bool empty = fs::is_empty(path, ec);
    if (ec) return named + " cannot be read: " + ec.message();
    if (!empty) return named + " exists and is not empty; name a new folder (nothing is written over)";
  } else if (const int err = errno; err != ENOENT) {
    return named + " cannot be written: " + std::strerror(err);
  }
  // The parent of "runs/x/" is "runs/x" to std::filesystem: the path without its trailing separators.
  fs::path p(path);
  while (p.has_parent_path() && p.filename().empty()) p = p.parent_path();
  const std::string parent = p.parent_path().empty() ? "." : p.parent_path().string();
  std::error_code ec;
  if (!fs::is_directory(parent, ec))
    return named + ": its parent folder '" + parent + "' does not exist (create it first, or name another folder)";
  if (holds(parent, kCheckpointModelFile))
    return named + " is in the checkpoint folder '" + parent + "' (it holds " + kCheckpointModelFile +
           "), whose files are the checkpoint's; write it elsewhere";
  return "";
}

void check_output_folder(const std::string& named, const std::string& path) {
  const std::string problem = output_folder_problem(named, path);
  FLOWMOE_CHECK(problem.empty(), ConfigError, problem);
}

}  // namespace flowmoe
