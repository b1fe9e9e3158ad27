// Atomic checkpoint directories and their loading (see checkpoint.h).
#include "checkpoint/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <sstream>

#include "io/file_io.h"
#include "io/json.h"

namespace flowmoe {

namespace fs = std::filesystem;

// ---- checkpoints --------------------------------------------------------------------------------

static std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

std::string checkpoint_path(const std::string& root, int64_t step) {
  return (fs::path(root) / step_dir_name(step)).string();
}

// Step number of a finished checkpoint directory name ("step_00000100"), or -1.
static int64_t parse_step_dir(const std::string& name) {
  if (name.rfind("step_", 0) != 0 || name.size() == 5 || name.size() > 5 + 18) return -1;  // 18 digits fit int64
  for (size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return -1;
  return std::stoll(name.substr(5));
}

// The entries of a directory; none when it cannot be read.
static std::vector<fs::directory_entry> list_dir(const std::string& root) {
  std::vector<fs::directory_entry> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) out.push_back(*it);
  return out;
}

static std::vector<std::pair<int64_t, fs::path>> list_checkpoints(const std::string& root) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  for (const auto& e : list_dir(root)) {
    int64_t s = parse_step_dir(e.path().filename().string());
    if (s >= 0 && e.is_directory(ec) && fs::exists(e.path() / kCheckpointMetaFile, ec)) out.push_back({s, e.path()});
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> remove_stale_checkpoint_tmp(const std::string& root) {
  std::vector<std::string> removed;
  std::error_code ec;
  for (const auto& e : list_dir(root)) {
    const std::string name = e.path().filename().string();
    if (name.ends_with(".tmp") && parse_step_dir(name.substr(0, name.size() - 4)) >= 0 && e.is_directory(ec))
      removed.push_back(name);
  }
  std::sort(removed.begin(), removed.end());
  for (const std::string& name : removed) {
    fs::remove_all(fs::path(root) / name, ec);
    FLOWMOE_CHECK(!ec, IoError, "cannot remove the unfinished checkpoint directory '", (fs::path(root) / name).string(),
                  "': ", ec.message());
  }
  return removed;
}

// The files of a checkpoint, fsynced, into dir.
static void write_checkpoint_files(const fs::path& dir, const CheckpointMeta& meta, const std::vector<Variable>& params,
                                   const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq,
                                   const std::vector<Variable>& buffers) {
  std::vector<NamedTensor> model, optim;
  for (size_t i = 0; i < params.size(); ++i) {
    model.push_back({params[i].name(), params[i].data()});
    optim.push_back({params[i].name() + ".exp_avg", exp_avg[i]});
    optim.push_back({params[i].name() + ".exp_avg_sq", exp_avg_sq[i]});
  }
  for (const Variable& b : buffers) model.push_back({b.name(), b.data()});
  write_safetensors((dir / kCheckpointModelFile).string(), model, {{"format", "pt"}});
  write_safetensors((dir / "optimizer.safetensors").string(), optim, {{"format", "pt"}});

  std::ostringstream js;
  js << "{\n  \"format\": \"flowmoe-checkpoint-1\",\n"
     << "  \"step\": " << meta.step << ",\n"
     << "  \"num_updates\": " << meta.num_updates << ",\n"
     << "  \"skipped_steps\": " << meta.skipped_steps << ",\n"
     << "  \"data_position\": {\"epoch\": " << meta.data.epoch << ", \"cursor\": " << meta.data.cursor
     << ", \"seed\": " << meta.data_seed << "},\n"
     << "  \"rng\": {\"init_seed\": " << meta.init_seed
     << ", \"note\": \"after init only the batch order is random: a function of data_position\"},\n"
     << "  \"config\": " << json_escape(meta.config_yaml) << "\n}\n";
  std::string json = js.str();
  write_file_synced((dir / kCheckpointMetaFile).string(), {&json});
  fsync_dir(dir.string());
}

std::string save_checkpoint(const std::string& root, const CheckpointMeta& meta, const std::vector<Variable>& params,
                            const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq,
                            int64_t keep_last, const std::vector<Variable>& buffers) {
  FLOWMOE_CHECK(exp_avg.size() == params.size() && exp_avg_sq.size() == params.size(), Error,
                "save_checkpoint: ", params.size(), " parameters but ", exp_avg.size(), " / ", exp_avg_sq.size(),
                " moments");
  std::error_code ec;
  fs::create_directories(root, ec);
  FLOWMOE_CHECK(!ec, IoError, os_error("create checkpoint directory", root, ec));
  const fs::path final_dir = fs::path(root) / step_dir_name(meta.step);
  const fs::path tmp_dir = fs::path(root) / (step_dir_name(meta.step) + ".tmp");
  fs::remove_all(tmp_dir, ec);  // left over from a crash
  fs::create_directory(tmp_dir, ec);
  FLOWMOE_CHECK(!ec, IoError, os_error("create", tmp_dir.string(), ec));

  // From here the temporary directory is this save's: one that fails (a full disk) removes it at once, so
  // it holds no disk space until the next run's start.
  try {
    write_checkpoint_files(tmp_dir, meta, params, exp_avg, exp_avg_sq, buffers);
    if (fs::exists(final_dir)) fs::remove_all(final_dir, ec);  // the same step saved again (after a resume)
    fs::rename(tmp_dir, final_dir, ec);
    FLOWMOE_CHECK(!ec, IoError, "renaming '", tmp_dir.string(), "' to '", final_dir.string(),
                  "' failed: ", ec.message());
  } catch (...) {
    fs::remove_all(tmp_dir, ec);
    throw;
  }
  fsync_dir(root);

  auto all = list_checkpoints(root);
  for (size_t i = 0; i + size_t(keep_last) < all.size(); ++i) fs::remove_all(all[i].second, ec);
  return final_dir.string();
}

std::string latest_checkpoint(const std::string& root) {
  auto all = list_checkpoints(root);
  return all.empty() ? "" : all.back().second.string();
}

// The index of the first NaN or Inf of a host f32, f64 or bf16 tensor, or -1 (other dtypes: -1).
static int64_t first_nonfinite(const Tensor& host) {
  const int64_t n = host.numel();
  const Tensor c = host.contiguous();  // kept alive while its data is read
  if (c.dtype() == DType::bf16) {
    const bf16* p = c.data<bf16>();
    for (int64_t i = 0; i < n; ++i)
      if ((p[i].bits & 0x7F80) == 0x7F80) return i;  // all exponent bits set: inf or NaN
  } else if (c.dtype() == DType::f32) {
    const float* p = c.data<float>();
    for (int64_t i = 0; i < n; ++i)
      if (!std::isfinite(p[i])) return i;
  } else if (c.dtype() == DType::f64) {
    const double* p = c.data<double>();
    for (int64_t i = 0; i < n; ++i)
      if (!std::isfinite(p[i])) return i;
  }
  return -1;
}

// One safetensors file of a checkpoint, read tensor by tensor, remembering which tensors were taken.
struct CheckpointFile {
  SafetensorsIndex index;
  const CheckpointLoadOptions& options;
  std::set<std::string> used;

  CheckpointFile(const std::string& path, const CheckpointLoadOptions& opts) : index(path, nullptr), options(opts) {}

  // Reads tensor `name` into `dst`, after checking it is the one expected: rows [offset, offset + rows)
  // of it for a shard of a larger tensor, which are all that is read. A NaN or Inf is refused: resuming
  // from it would train on garbage without a word, since the step only checks the loss and gradients.
  // moment: an AdamW moment, which may be f32 or bf16 in the file and in dst alike (optimizer.moment_dtype may
  // change between a save and its resume): converted, f32 to bf16 rounded to nearest even, bf16 to f32 exactly.
  void fill(Tensor& dst, const std::string& name, const ParamShard* shard = nullptr, bool moment = false) {
    const SafetensorsEntry& src = index.entry(name);
    const bool sharded = shard && dst.dim() > 0 && shard->full_rows != dst.size(0);
    Shape want = dst.shape();
    if (sharded) want[0] = shard->full_rows;
    const auto moment_dtype = [](DType t) { return t == DType::f32 || t == DType::bf16; };
    const bool convertible = moment && moment_dtype(src.dtype) && moment_dtype(dst.dtype());
    FLOWMOE_CHECK(src.shape == want && (src.dtype == dst.dtype() || convertible), IoError, "'", index.path(),
                  "': tensor '", name, "' is ", dtype_name(src.dtype), shape_str(src.shape),
                  " on cpu, the model expects ", dtype_name(dst.dtype()), shape_str(want),
                  " (was the checkpoint made with another model config?)");
    const Tensor host = sharded ? index.read_rows(name, shard->offset, dst.size(0)) : index.read(name);
    if (!options.allow_nonfinite) {
      const int64_t bad = first_nonfinite(host);
      // The index in the whole tensor: a shard's rows start at row shard->offset of it.
      const int64_t row_elems = sharded && dst.size(0) > 0 ? host.numel() / dst.size(0) : 0;
      FLOWMOE_CHECK(bad < 0, IoError, "'", index.path(), "': tensor '", name, "' holds ",
                    bad < 0 ? 0.0 : host.contiguous().to_doubles()[size_t(bad)], " at element ",
                    bad + (sharded ? shard->offset * row_elems : 0),
                    " (set checkpoint.allow_nonfinite: true to load a checkpoint with NaN or Inf anyway)");
    }
    dst.copy_(host.to(dst.dtype()));
    used.insert(name);
  }

  // The file's tensors no fill() took, sorted.
  std::vector<std::string> unused() const {
    std::vector<std::string> out;
    for (const std::string& name : index.names_in_file_order())
      if (!used.count(name)) out.push_back(name);
    std::sort(out.begin(), out.end());
    return out;
  }

  // Refuses tensors left over unless a partial load was asked for; returns them.
  std::vector<std::string> check_all_used() const {
    std::vector<std::string> left = unused();
    if (left.empty() || options.allow_unused) return left;
    std::string names;
    for (size_t i = 0; i < left.size() && i < 4; ++i) names += (i ? ", '" : "'") + left[i] + "'";
    if (left.size() > 4) names += ", ... (" + std::to_string(left.size()) + " in all)";
    FLOWMOE_THROW(IoError, "'", index.path(), "': ", left.size(), left.size() == 1 ? " tensor is" : " tensors are",
                  " not in the model: ", names, " (was the checkpoint made with another model config? ",
                  "checkpoint.partial_load: true loads the model's tensors and leaves these out)");
  }
};

std::string partial_load_note(const CheckpointMeta& meta) {
  const std::vector<std::string>& left = meta.unused_tensors;
  if (left.empty()) return "";
  std::string note = "; left out " + std::to_string(left.size()) + " tensor" + (left.size() == 1 ? "" : "s") +
                     " of the checkpoint that the model does not have (checkpoint.partial_load): " + left[0];
  return left.size() == 1 ? note : note + ", ...";
}

CheckpointMeta read_checkpoint_meta(const std::string& dir) {
  const fs::path d(dir);
  std::error_code ec;
  FLOWMOE_CHECK(fs::exists(d / kCheckpointMetaFile, ec), IoError, "'", dir, "' is not a checkpoint (no meta.json)");
  std::string meta_file = (d / kCheckpointMetaFile).string();
  // meta.json holds a few counts and the resolved config, JSON-escaped (at most 6 bytes per byte).
  constexpr uint64_t kMaxMetaBytes = 8 * kMaxConfigFileBytes;
  const YAML::Node j = parse_json(read_file(meta_file, kMaxMetaBytes, "checkpoint description"), meta_file);
  FLOWMOE_CHECK(j.IsMap() && j["format"] && j["format"].IsScalar() && j["format"].Scalar() == "flowmoe-checkpoint-1",
                IoError, "'", meta_file,
                "' is not a flowmoe checkpoint description (no \"format\": ", "\"flowmoe-checkpoint-1\")");
  CheckpointMeta meta;
  try {
    meta.step = j["step"].as<int64_t>();
    meta.num_updates = j["num_updates"].as<int64_t>();
    meta.skipped_steps = j["skipped_steps"].as<int64_t>();
    meta.data.epoch = j["data_position"]["epoch"].as<uint64_t>();
    meta.data.cursor = j["data_position"]["cursor"].as<uint64_t>();
    meta.data_seed = j["data_position"]["seed"].as<uint64_t>();
    meta.init_seed = j["rng"]["init_seed"].as<uint64_t>();
    meta.config_yaml = j["config"].as<std::string>();
  } catch (const YAML::Exception& e) {
    FLOWMOE_THROW(IoError, "'", meta_file, "': missing or malformed field (", e.msg, ")");
  }
  FLOWMOE_CHECK(meta.step >= 0 && meta.num_updates >= 0 && meta.skipped_steps >= 0 && meta.num_updates <= meta.step &&
                    meta.skipped_steps <= meta.step - meta.num_updates,
                IoError, "'", meta_file, "': inconsistent counts (step ", meta.step, ", num_updates ", meta.num_updates,
                ", skipped_steps ", meta.skipped_steps, ")");
  return meta;
}

CheckpointMeta load_checkpoint(const std::string& dir, const std::vector<Variable>& params,
                               std::vector<Tensor>* exp_avg, std::vector<Tensor>* exp_avg_sq,
                               const std::vector<Variable>& buffers, const std::vector<ParamShard>& shards,
                               const CheckpointLoadOptions& options) {
  FLOWMOE_CHECK(shards.empty() || shards.size() == params.size(), Error, "load_checkpoint: ", params.size(),
                " parameters but ", shards.size(), " shards");
  const auto shard = [&](size_t i) { return shards.empty() ? nullptr : &shards[i]; };
  const fs::path d(dir);
  std::error_code ec;
  FLOWMOE_CHECK(fs::exists(d / kCheckpointMetaFile, ec), IoError, "'", dir, "' is not a checkpoint (no meta.json)");
  CheckpointFile model((d / kCheckpointModelFile).string(), options);
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor dst = params[i].data();
    model.fill(dst, params[i].name(), shard(i));
    params[i].bump_version();  // loaded in place
  }
  for (const Variable& b : buffers) {
    Tensor dst = b.data();
    model.fill(dst, b.name());
    b.bump_version();
  }
  std::vector<std::string> unused = model.check_all_used();
  if (exp_avg || exp_avg_sq) {
    CheckpointFile optim((d / "optimizer.safetensors").string(), options);
    for (size_t i = 0; i < params.size(); ++i) {
      if (exp_avg) optim.fill((*exp_avg)[i], params[i].name() + ".exp_avg", shard(i), true);
      if (exp_avg_sq) optim.fill((*exp_avg_sq)[i], params[i].name() + ".exp_avg_sq", shard(i), true);
    }
    // Only moments of the model's own parameters count as used; a file read for one of the two
    // moment kinds leaves the other kind out of the check.
    for (const std::string& name : optim.unused()) {
      const bool other_kind =
          (!exp_avg && name.ends_with(".exp_avg")) || (!exp_avg_sq && name.ends_with(".exp_avg_sq"));
      if (other_kind) optim.used.insert(name);
    }
    for (std::string& name : optim.check_all_used()) unused.push_back(std::move(name));
  }
  CheckpointMeta meta = read_checkpoint_meta(dir);
  meta.unused_tensors = std::move(unused);
  return meta;
}

}  // namespace flowmoe
