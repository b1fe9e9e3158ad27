// The safetensors format, written and read by hand (see safetensors.h).
#include "checkpoint/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "io/file_io.h"
#include "io/json.h"

namespace flowmoe {

const char* safetensors_dtype(DType t) {
  switch (t) {
    case DType::f32:
      return "F32";
    case DType::f64:
      return "F64";
    case DType::bf16:
      return "BF16";
    case DType::e4m3:
      return "F8_E4M3";
    case DType::e5m2:
      return "F8_E5M2";
    case DType::i32:
      return "I32";
    case DType::i64:
      return "I64";
    case DType::u8:
      return "U8";
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
static std::string safetensors_header(const std::vector<TensorSpec>& tensors,
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
  for (const TensorSpec& t : tensors) {
    FLOWMOE_CHECK(t.name != "__metadata__" && !t.name.empty(), IoError, "safetensors: bad tensor name '", t.name, "'");
    h << (first ? "" : ",") << json_escape(t.name) << ":{\"dtype\":\"" << safetensors_dtype(t.dtype)
      << "\",\"shape\":[";
    for (size_t d = 0; d < t.shape.size(); ++d) h << (d ? "," : "") << t.shape[d];
    const size_t nbytes = size_t(shape_numel(t.shape)) * dtype_size(t.dtype);
    h << "],\"data_offsets\":[" << offset << "," << offset + nbytes << "]}";
    first = false;
    offset += nbytes;
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
  std::vector<TensorSpec> specs;
  for (const NamedTensor& nt : tensors) specs.push_back({nt.name, nt.tensor.dtype(), nt.tensor.shape()});
  write_safetensors(
      path, specs, [&](size_t i) { return tensors[i].tensor; }, metadata);
}

void write_safetensors(const std::string& path, const std::vector<TensorSpec>& specs,
                       const std::function<Tensor(size_t)>& make, const std::map<std::string, std::string>& metadata) {
  const std::string head = safetensors_header(specs, metadata);
  SyncedFile f(path);
  f.write(head.data(), head.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    if (shape_numel(specs[i].shape) == 0) continue;
    const Tensor host = make(i).to(Device::cpu()).contiguous();
    // The header already promised these bytes: another shape or dtype would shift every later tensor.
    FLOWMOE_CHECK(host.dtype() == specs[i].dtype && host.shape() == specs[i].shape, IoError, "safetensors '", path,
                  "': tensor '", specs[i].name, "' is ", host.describe(), ", its header entry says ",
                  dtype_name(specs[i].dtype), shape_str(specs[i].shape));
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

static SafetensorsEntry read_entry(const YAML::Node& e, const std::string& path, const std::string& name,
                                   uint64_t body_size) {
  const std::string what = "'" + path + "': tensor '" + name + "'";
  FLOWMOE_CHECK(e.IsMap() && e["dtype"] && e["shape"] && e["data_offsets"], IoError, what,
                " lacks dtype, shape or data_offsets");
  SafetensorsEntry l;
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

SafetensorsIndex::SafetensorsIndex(const std::string& path, std::map<std::string, std::string>* metadata)
    : path_(path), file_(path) {
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
  check_tiling(file_.size() - data_start_);
}

// The format's rule: the tensors' byte ranges tile the data section, in some order, with no overlap
// and no gap. An overlap would load one tensor from another's bytes (a norm weight from the
// embedding's) without any other check noticing; a gap means bytes no tensor accounts for.
void SafetensorsIndex::check_tiling(uint64_t body_size) const {
  std::vector<std::pair<const std::string*, const SafetensorsEntry*>> order;
  for (const auto& [name, l] : entries_) order.push_back({&name, &l});
  std::stable_sort(order.begin(), order.end(), [](const auto& x, const auto& y) {
    return std::pair(x.second->begin, x.second->end) < std::pair(y.second->begin, y.second->end);
  });
  uint64_t covered = 0;               // the bytes [0, covered) belong to the tensors so far
  const std::string* last = nullptr;  // the tensor that ends at `covered`
  const auto range = [](const SafetensorsEntry& l) { return detail::cat("[", l.begin, ", ", l.end, ")"); };
  const auto check_no_gap = [&](uint64_t next) {
    FLOWMOE_CHECK(next == covered, IoError, "'", path_, "': bytes [", covered, ", ", next,
                  ") of the data section belong to no tensor (the tensors must tile it with no gap)");
  };
  for (const auto& [name, l] : order) {
    FLOWMOE_CHECK(l->begin >= covered, IoError, "'", path_, "': tensors '", *last, "' ", range(entries_.at(*last)),
                  " and '", *name, "' ", range(*l), " overlap in the data section");
    check_no_gap(l->begin);
    if (l->end > l->begin) last = name;
    covered = l->end;
  }
  check_no_gap(body_size);
}

std::vector<std::string> SafetensorsIndex::names_in_file_order() const {
  std::vector<std::pair<uint64_t, std::string>> order;
  for (const auto& [name, l] : entries_) order.push_back({l.begin, name});
  std::stable_sort(order.begin(), order.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  std::vector<std::string> out;
  for (auto& o : order) out.push_back(std::move(o.second));
  return out;
}

const SafetensorsEntry& SafetensorsIndex::entry(const std::string& name) const {
  auto it = entries_.find(name);
  FLOWMOE_CHECK(it != entries_.end(), IoError, "'", path_, "' has no tensor '", name, "'");
  return it->second;
}

Tensor SafetensorsIndex::read_rows(const std::string& name, int64_t row_begin, int64_t num_rows) const {
  const SafetensorsEntry& l = entry(name);
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

Tensor SafetensorsIndex::read(const std::string& name) const {
  const Shape& shape = entry(name).shape;
  return read_rows(name, 0, shape.empty() ? 1 : shape[0]);
}

std::vector<NamedTensor> read_safetensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  const SafetensorsIndex index(path, metadata);
  std::vector<NamedTensor> out;
  for (const std::string& name : index.names_in_file_order()) out.push_back({name, index.read(name)});
  return out;
}

}  // namespace flowmoe
