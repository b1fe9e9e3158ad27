// A safetensors file read the long way, apart from checkpoint/safetensors.cpp, for tests that check what the loader
// made of a file (tests/test_fuzz_checkpoint.cpp): the length prefix, a tensor's header entry as the writer spells
// it, and its bytes.
#pragma once
#include <cstdint>
#include <cstring>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "engine/tensor.h"

namespace flowmoe::test {

// The 8-byte little-endian header length at the start of a file (of as many bytes as it has).
inline uint64_t header_length(const std::string& b) {
  uint64_t n = 0;
  for (int i = 0; i < 8 && size_t(i) < b.size(); ++i)
    n |= uint64_t(static_cast<unsigned char>(b[size_t(i)])) << (8 * i);
  return n;
}

// A tensor's entry in a safetensors file: its dtype, shape and byte range after the header, and where the
// data starts.
struct RawEntry {
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0, data_start = 0;
};

// The one match of `re` in `text` (its first group), or nullopt when there is none or more than one.
inline std::optional<std::string> one_match(const std::string& text, const std::regex& re) {
  std::optional<std::string> out;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it) {
    if (out) return std::nullopt;
    out = (*it)[1].str();
  }
  return out;
}

// A non-negative integer, or one quoted as a JSON string (which the loader takes as well).
inline std::optional<uint64_t> parse_u64(std::string s) {
  if (s.size() >= 2 && s.front() == '"' && s.back() == '"') s = s.substr(1, s.size() - 2);
  if (s.empty() || s.size() > 19 || s.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::stoull(s);
}

// Tensor `name`'s entry: the file's length prefix, then in the header the object after "<name>": (extra keys and
// quoted numbers allowed, as the loader allows them) with one "dtype" string, one "shape" list and one
// "data_offsets" pair.
inline std::optional<RawEntry> raw_entry(const std::string& file, const std::string& name) {
  const uint64_t n = header_length(file);
  if (file.size() < 8 || n > file.size() - 8) return std::nullopt;
  const std::string header = file.substr(8, n), key = "\"" + name + "\":{";
  const size_t at = header.find(key);
  if (at == std::string::npos || header.find(key, at + 1) != std::string::npos) return std::nullopt;
  size_t end = at + key.size();
  for (int depth = 1; end < header.size() && depth > 0; ++end)
    depth += header[end] == '{' ? 1 : header[end] == '}' ? -1 : 0;
  const std::string object = header.substr(at + key.size() - 1, end - (at + key.size() - 1));
  const auto dtype = one_match(object, std::regex(R"re("dtype":"([^"]*)")re"));
  const auto shape = one_match(object, std::regex(R"re("shape":\[([0-9",]*)\])re"));
  const auto offsets = one_match(object, std::regex(R"re("data_offsets":\[("?[0-9]+"?,"?[0-9]+"?)\])re"));
  if (!dtype || !shape || !offsets) return std::nullopt;
  RawEntry e;
  e.dtype = *dtype;
  std::stringstream dims(*shape);
  for (std::string d; std::getline(dims, d, ',');) {
    const auto v = parse_u64(d);
    if (!v) return std::nullopt;
    e.shape.push_back(int64_t(*v));
  }
  const size_t comma = offsets->find(',');
  const auto begin = parse_u64(offsets->substr(0, comma)), last = parse_u64(offsets->substr(comma + 1));
  if (!begin || !last) return std::nullopt;
  e.begin = *begin;
  e.end = *last;
  e.data_start = 8 + n;
  return e;
}

// Whether `t` is what tensor `name` of `file` holds: an F32 entry of t's shape whose byte range is t's bytes
// and lies in the file, and those bytes; "" when it is, else what differs.
inline std::string differs_from_file(const Tensor& t, const std::string& file, const std::string& name) {
  const std::optional<RawEntry> e = raw_entry(file, name);
  if (!e) return "tensor '" + name + "' loaded, but its entry is not in the file's header";
  if (e->dtype != "F32") return "tensor '" + name + "' loaded from dtype " + e->dtype;
  if (e->shape != t.shape()) return "tensor '" + name + "' loaded with another shape than its entry's";
  const uint64_t bytes = t.nbytes();
  if (e->end < e->begin || e->end - e->begin != bytes)
    return "tensor '" + name + "' loaded from data_offsets [" + std::to_string(e->begin) + ", " +
           std::to_string(e->end) + "), which are not its " + std::to_string(bytes) + " bytes";
  if (e->data_start + e->end > file.size()) return "tensor '" + name + "' loaded from past the file's end";
  const Tensor c = t.contiguous();
  if (bytes > 0 && std::memcmp(c.raw_data(), file.data() + e->data_start + e->begin, bytes) != 0)
    return "tensor '" + name + "' loaded other values than its bytes in the file";
  return "";
}

}  // namespace flowmoe::test
