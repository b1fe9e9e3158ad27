// safetensors reader/writer and atomic checkpoint directories (see checkpoint.h).
#include "train/checkpoint.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "train/file_io.h"

namespace flowmoe {

namespace fs = std::filesystem;

// ---- JSON ---------------------------------------------------------------------------------------

// JSON is read with yaml-cpp (JSON is a subset of YAML 1.2's flow style).
static YAML::Node parse_json(const std::string& text, const std::string& what) {
  try {
    return YAML::Load(text);
  } catch (const YAML::Exception& e) {
    FLOWMOE_THROW(IoError, what, ": malformed JSON (", e.msg, ")");
  }
}

// ---- safetensors --------------------------------------------------------------------------------

const char* safetensors_dtype(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::e4m3: return "F8_E4M3";
    case DType::e5m2: return "F8_E5M2";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::u8: return "U8";
  }
  FLOWMOE_THROW(IoError, "no safetensors dtype for ", dtype_name(t));
}

// The dtype named by a safetensors dtype string; false when it is not one we read.
static bool known_dtype(const std::string& s, DType* out) {
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::e4m3, DType::e5m2, DType::i32, DType::i64, DType::u8})
    if (s == safetensors_dtype(t)) return *out = t, true;
  return false;
}

static const char* kSupportedDtypes = "F32, F64, BF16, F8_E4M3, F8_E5M2, I32, I64, U8";

DType dtype_from_safetensors(const std::string& s) {
  DType t = DType::f32;
  FLOWMOE_CHECK(known_dtype(s, &t), IoError, "safetensors dtype '", s, "' is not supported (", kSupportedDtypes, ")");
  return t;
}

// The 8-byte length and the JSON header of a safetensors file: names, dtypes, shapes and offsets,
// which the tensors' shapes alone give. The tensors' bytes follow it in the same order.
static std::string safetensors_header(const std::vector<NamedTensor>& tensors,
                                      const std::map<std::string, std::string>& metadata) {
  std::ostringstream h;
  h << "{";
  bool first = true;
  if (!metadata.empty()) {
    h << "\"__metadata__\":{";
    for (auto it = metadata.begin(); it != metadata.end(); ++it)
      h << (it == metadata.begin() ? "" : ",") << json_escape(it->first) << ":" << json_escape(it->second);
    h << "}";
    first = false;
  }
  size_t offset = 0;
  for (const NamedTensor& nt : tensors) {
    FLOWMOE_CHECK(nt.name != "__metadata__" && !nt.name.empty(), IoError, "safetensors: bad tensor name '", nt.name,
                  "'");
    h << (first ? "" : ",") << json_escape(nt.name) << ":{\"dtype\":\"" << safetensors_dtype(nt.tensor.dtype())
      << "\",\"shape\":[";
    for (int d = 0; d < nt.tensor.dim(); ++d) h << (d ? "," : "") << nt.tensor.size(d);
    h << "],\"data_offsets\":[" << offset << "," << offset + nt.tensor.nbytes() << "]}";
    first = false;
    offset += nt.tensor.nbytes();
  }
  h << "}";
  std::string header = h.str();
  header.append((8 - header.size() % 8) % 8, ' ');  // pad so the data starts 8-byte aligned
  uint64_t n = header.size();
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; ++i) prefix[size_t(i)] = char((n >> (8 * i)) & 0xff);
  return prefix + header;
}

// Each tensor goes to the file as it comes to the host: the host holds one tensor at a time, not
// the whole file.
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const std::string head = safetensors_header(tensors, metadata);
  SyncedFile f(path);
  f.write(head.data(), head.size());
  for (const NamedTensor& nt : tensors) {
    if (nt.tensor.numel() == 0) continue;
    const Tensor host = nt.tensor.to(Device::cpu()).contiguous();
    f.write(host.raw_data(), host.nbytes());
  }
  f.close();
}

// A non-negative integer of a safetensors header (a dimension or an offset).
static bool header_uint(const YAML::Node& n, uint64_t* out) {
  if (!n.IsScalar() || n.Scalar().empty() || n.Scalar().size() > 19) return false;
  uint64_t v = 0;
  for (char c : n.Scalar()) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + uint64_t(c - '0');
  }
  *out = v;
  return true;
}

// One tensor of a safetensors header, checked against the file before any memory is allocated for it.
struct EntryLayout {
  DType dtype = DType::f32;
  Shape shape;
  uint64_t begin = 0, end = 0;
};

static EntryLayout read_entry(const YAML::Node& e, const std::string& path, const std::string& name,
                              uint64_t body_size) {
  const std::string what = "'" + path + "': tensor '" + name + "'";
  FLOWMOE_CHECK(e.IsMap() && e["dtype"] && e["shape"] && e["data_offsets"], IoError, what,
                " lacks dtype, shape or data_offsets");
  EntryLayout l;
  const YAML::Node dtype = e["dtype"], shape = e["shape"], offsets = e["data_offsets"];
  FLOWMOE_CHECK(dtype.IsScalar() && known_dtype(dtype.Scalar(), &l.dtype), IoError, what, " has dtype '",
                dtype.IsScalar() ? dtype.Scalar() : "?", "' (supported: ", kSupportedDtypes, ")");
  FLOWMOE_CHECK(shape.IsSequence(), IoError, what, ": shape is not a list");
  // Bytes of the tensor, and of the tensor with its zero dimensions taken as 1: the second bounds
  // the strides, so an empty tensor cannot claim dimensions no allocation could hold.
  uint64_t bytes = dtype_size(l.dtype), extent = bytes;
  for (const YAML::Node& d : shape) {
    uint64_t v = 0;
    FLOWMOE_CHECK(header_uint(d, &v), IoError, what, ": shape holds something other than a non-negative integer");
    FLOWMOE_CHECK(!__builtin_mul_overflow(extent, std::max<uint64_t>(v, 1), &extent) && extent <= (uint64_t(1) << 62),
                  IoError, what, " has an impossibly large shape");
    bytes *= v;  // <= extent, so it cannot overflow
    l.shape.push_back(int64_t(v));
  }
  FLOWMOE_CHECK(offsets.IsSequence() && offsets.size() == 2 && header_uint(offsets[0], &l.begin) &&
                    header_uint(offsets[1], &l.end),
                IoError, what, ": data_offsets is not a pair of non-negative integers");
  FLOWMOE_CHECK(l.begin <= l.end && l.end <= body_size && l.end - l.begin == bytes, IoError, what, " has offsets [",
                l.begin, ", ", l.end, ") for ", bytes, " bytes in a ", body_size, "-byte body");
  return l;
}

// A safetensors file's header, read and checked against the file's size; its tensors are read on
// request, each straight from the file into host memory, so a reader holds one tensor at a time and
// an expert-parallel rank reads only its rows of a sharded tensor.
class SafetensorsIndex {
 public:
  SafetensorsIndex(const std::string& path, std::map<std::string, std::string>* metadata) : path_(path), file_(path) {
    FLOWMOE_CHECK(file_.size() >= 8, IoError, "'", path, "' is too short for a safetensors file");
    unsigned char length[8];
    file_.read_at(0, length, 8);
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= uint64_t(length[i]) << (8 * i);
    FLOWMOE_CHECK(n <= file_.size() - 8, IoError, "'", path, "': header length ", n, " exceeds the file");
    std::string header_text(n, '\0');
    file_.read_at(8, header_text.data(), n);
    const YAML::Node header = parse_json(header_text, path);
    FLOWMOE_CHECK(header.IsMap(), IoError, "'", path, "': the header is not a JSON object");
    data_start_ = 8 + n;
    try {
      for (auto it = header.begin(); it != header.end(); ++it) {
        FLOWMOE_CHECK(it->first.IsScalar(), IoError, "'", path, "': the header has a key that is not a string");
        const std::string name = it->first.Scalar();
        if (name == "__metadata__") {
          FLOWMOE_CHECK(it->second.IsMap(), IoError, "'", path, "': __metadata__ is not a JSON object");
          if (metadata)
            for (auto m = it->second.begin(); m != it->second.end(); ++m)
              (*metadata)[m->first.as<std::string>()] = m->second.as<std::string>();
          continue;
        }
        entries_[name] = read_entry(it->second, path, name, file_.size() - data_start_);
      }
    } catch (const YAML::Exception& e) {  // a value of the wrong JSON type
      FLOWMOE_THROW(IoError, "'", path, "': malformed header (", e.msg, ")");
    }
  }

  // The names in the order of their bytes in the file.
  std::vector<std::string> names_in_file_order() const {
    std::vector<std::pair<uint64_t, std::string>> order;
    for (const auto& [name, l] : entries_) order.push_back({l.begin, name});
    std::stable_sort(order.begin(), order.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    std::vector<std::string> out;
    for (auto& o : order) out.push_back(std::move(o.second));
    return out;
  }

  const EntryLayout& entry(const std::string& name) const {
    auto it = entries_.find(name);
    FLOWMOE_CHECK(it != entries_.end(), IoError, "'", path_, "' has no tensor '", name, "'");
    return it->second;
  }

  // Rows [row_begin, row_begin + num_rows) along dim 0 of tensor `name` (all of it: 0, its rows), on the CPU.
  Tensor read_rows(const std::string& name, int64_t row_begin, int64_t num_rows) const {
    const EntryLayout& l = entry(name);
    Shape shape = l.shape;
    uint64_t row_bytes = l.end - l.begin;
    if (!shape.empty()) {
      row_bytes = shape[0] > 0 ? row_bytes / uint64_t(shape[0]) : 0;
      shape[0] = num_rows;
    }
    Tensor t = Tensor::empty(shape, l.dtype);
    if (t.nbytes() > 0) file_.read_at(data_start_ + l.begin + uint64_t(row_begin) * row_bytes, t.raw_data(), t.nbytes());
    return t;
  }
  Tensor read(const std::string& name) const {
    const Shape& shape = entry(name).shape;
    return read_rows(name, 0, shape.empty() ? 1 : shape[0]);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  FileReader file_;
  uint64_t data_start_ = 0;
  std::map<std::string, EntryLayout> entries_;
};

std::vector<NamedTensor> read_safetensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  const SafetensorsIndex index(path, metadata);
  std::vector<NamedTensor> out;
  for (const std::string& name : index.names_in_file_order()) out.push_back({name, index.read(name)});
  return out;
}

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
    if (s >= 0 && e.is_directory(ec) && fs::exists(e.path() / "meta.json", ec)) out.push_back({s, e.path()});
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
    FLOWMOE_CHECK(!ec, IoError, "cannot remove the unfinished checkpoint directory '",
                  (fs::path(root) / name).string(), "': ", ec.message());
  }
  return removed;
}

std::string save_checkpoint(const std::string& root, const CheckpointMeta& meta, const std::vector<Variable>& params,
                            const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq,
                            int64_t keep_last, const std::vector<Variable>& buffers) {
  FLOWMOE_CHECK(exp_avg.size() == params.size() && exp_avg_sq.size() == params.size(), Error,
                "save_checkpoint: ", params.size(), " parameters but ", exp_avg.size(), " / ", exp_avg_sq.size(),
                " moments");
  std::error_code ec;
  fs::create_directories(root, ec);
  FLOWMOE_CHECK(!ec, IoError, "cannot create checkpoint directory '", root, "': ", ec.message());
  const fs::path final_dir = fs::path(root) / step_dir_name(meta.step);
  const fs::path tmp_dir = fs::path(root) / (step_dir_name(meta.step) + ".tmp");
  fs::remove_all(tmp_dir, ec);  // left over from a crash
  fs::create_directory(tmp_dir, ec);
  FLOWMOE_CHECK(!ec, IoError, "cannot create '", tmp_dir.string(), "': ", ec.message());

  std::vector<NamedTensor> model, optim;
  for (size_t i = 0; i < params.size(); ++i) {
    model.push_back({params[i].name(), params[i].data()});
    optim.push_back({params[i].name() + ".exp_avg", exp_avg[i]});
    optim.push_back({params[i].name() + ".exp_avg_sq", exp_avg_sq[i]});
  }
  for (const Variable& b : buffers) model.push_back({b.name(), b.data()});
  write_safetensors((tmp_dir / "model.safetensors").string(), model, {{"format", "pt"}});
  write_safetensors((tmp_dir / "optimizer.safetensors").string(), optim, {{"format", "pt"}});

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
  write_file_synced((tmp_dir / "meta.json").string(), {&json});
  fsync_dir(tmp_dir.string());

  if (fs::exists(final_dir)) fs::remove_all(final_dir, ec);  // the same step saved again (after a resume)
  fs::rename(tmp_dir, final_dir, ec);
  FLOWMOE_CHECK(!ec, IoError, "renaming '", tmp_dir.string(), "' to '", final_dir.string(), "' failed: ", ec.message());
  fsync_dir(root);

  auto all = list_checkpoints(root);
  for (size_t i = 0; i + size_t(keep_last) < all.size(); ++i) fs::remove_all(all[i].second, ec);
  return final_dir.string();
}

std::string latest_checkpoint(const std::string& root) {
  auto all = list_checkpoints(root);
  return all.empty() ? "" : all.back().second.string();
}

// Reads tensor `name` of `file` into `dst`, after checking it is the one expected: rows [offset,
// offset + rows) of it for a shard of a larger tensor, which are all that is read.
static void fill_from(Tensor& dst, const SafetensorsIndex& file, const std::string& name,
                      const ParamShard* shard = nullptr) {
  const EntryLayout& src = file.entry(name);
  const bool sharded = shard && dst.dim() > 0 && shard->full_rows != dst.size(0);
  Shape want = dst.shape();
  if (sharded) want[0] = shard->full_rows;
  FLOWMOE_CHECK(src.shape == want && src.dtype == dst.dtype(), IoError, "'", file.path(), "': tensor '", name, "' is ",
                dtype_name(src.dtype), shape_str(src.shape), " on cpu, the model expects ", dtype_name(dst.dtype()),
                shape_str(want), " (was the checkpoint made with another model config?)");
  dst.copy_(sharded ? file.read_rows(name, shard->offset, dst.size(0)) : file.read(name));
}

CheckpointMeta load_checkpoint(const std::string& dir, const std::vector<Variable>& params,
                               std::vector<Tensor>* exp_avg, std::vector<Tensor>* exp_avg_sq,
                               const std::vector<Variable>& buffers, const std::vector<ParamShard>& shards) {
  FLOWMOE_CHECK(shards.empty() || shards.size() == params.size(), Error, "load_checkpoint: ", params.size(),
                " parameters but ", shards.size(), " shards");
  const auto shard = [&](size_t i) { return shards.empty() ? nullptr : &shards[i]; };
  const fs::path d(dir);
  std::error_code ec;
  FLOWMOE_CHECK(fs::exists(d / "meta.json", ec), IoError, "'", dir, "' is not a checkpoint (no meta.json)");
  const SafetensorsIndex model((d / "model.safetensors").string(), nullptr);
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor dst = params[i].data();
    fill_from(dst, model, params[i].name(), shard(i));
    params[i].bump_version();  // loaded in place
  }
  for (const Variable& b : buffers) {
    Tensor dst = b.data();
    fill_from(dst, model, b.name());
    b.bump_version();
  }
  if (exp_avg || exp_avg_sq) {
    const SafetensorsIndex optim((d / "optimizer.safetensors").string(), nullptr);
    for (size_t i = 0; i < params.size(); ++i) {
      if (exp_avg) fill_from((*exp_avg)[i], optim, params[i].name() + ".exp_avg", shard(i));
      if (exp_avg_sq) fill_from((*exp_avg_sq)[i], optim, params[i].name() + ".exp_avg_sq", shard(i));
    }
  }
  std::string meta_file = (d / "meta.json").string();
  const YAML::Node j = parse_json(read_file(meta_file), meta_file);
  FLOWMOE_CHECK(j.IsMap() && j["format"] && j["format"].IsScalar() && j["format"].Scalar() == "flowmoe-checkpoint-1",
                IoError, "'", meta_file, "' is not a flowmoe checkpoint description (no \"format\": ",
                "\"flowmoe-checkpoint-1\")");
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
  FLOWMOE_CHECK(meta.step >= 0 && meta.num_updates >= 0 && meta.skipped_steps >= 0 &&
                    meta.num_updates <= meta.step && meta.skipped_steps <= meta.step - meta.num_updates,
                IoError, "'", meta_file, "': inconsistent counts (step ", meta.step, ", num_updates ", meta.num_updates,
                ", skipped_steps ", meta.skipped_steps, ")");
  return meta;
}

}  // namespace flowmoe
