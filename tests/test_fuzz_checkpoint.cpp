// The checkpoint loader against damaged files: a real checkpoint is written, then each case applies
// a few seeded random mutations (flipped bytes, truncation, extension, header lengths, dtypes,
// shapes and offsets in the safetensors header, meta.json values, deleted files) and loads it. Every
// case must end in success or a flowmoe::Error: no crash, no other exception (std::bad_alloc from
// an unchecked length included), no hang. A case that loads must have loaded what the damaged files say,
// read here without the loader: every tensor an f32 entry of its shape whose byte range is its size, and
// those bytes. Damage that makes a byte range disagree with its shape and dtype is refused (a test of its own).
//
// 2000 cases by default (a few seconds); FLOWMOE_FUZZ_CASES sets the count and FLOWMOE_TEST_SEED
// the seed. Case i draws from seed + i, so a failing case replays alone.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <typeinfo>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "kernels/common/error.h"
#include "tests/support/safetensors_raw.h"
#include "tests/support/train_fixtures.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

using Files = std::map<std::string, std::string>;  // file name -> contents
using Gen = std::mt19937_64;

const char* kModel = "model.safetensors";
const char* kOptim = "optimizer.safetensors";
const char* kMeta = "meta.json";

template <class T>
const T& pick(Gen& g, const std::vector<T>& v) {
  return v[g() % v.size()];
}

// The model of the cases: three weights and a buffer, like a Transformer's lists.
struct Model {
  std::vector<Variable> params = {Variable(Tensor::from_floats({1, 2, 3}, {3}), true, "a.weight"),
                                  Variable(Tensor::from_floats({4, 5, 6, 7}, {2, 2}), true, "b.weight"),
                                  Variable(Tensor::full({4, 3}, 0.25, DType::f32), true, "emb.weight")};
  std::vector<Variable> buffers = {Variable(Tensor::from_floats({0.5, -0.5}, {2}), false, "moe.bias")};
  std::vector<Tensor> exp_avg = {Tensor::full({3}, 0.1, DType::f32), Tensor::full({2, 2}, 0.2, DType::f32),
                                 Tensor::full({4, 3}, 0.3, DType::f32)};
  std::vector<Tensor> exp_avg_sq = {Tensor::full({3}, 1.0, DType::f32), Tensor::full({2, 2}, 2.0, DType::f32),
                                    Tensor::full({4, 3}, 3.0, DType::f32)};
};

// ---- mutations ----------------------------------------------------------------------------------

void flip_bytes(std::string& b, Gen& g) {
  if (b.empty()) return;
  for (int n = 1 + int(g() % 8); n > 0; --n) b[g() % b.size()] = char(g() & 0xff);
}

void truncate(std::string& b, Gen& g) { b.resize(b.empty() ? 0 : g() % b.size()); }

void extend(std::string& b, Gen& g) {
  for (int n = 1 + int(g() % 64); n > 0; --n) b += char(g() & 0xff);
}

void put_header_length(std::string& b, uint64_t n) {
  for (int i = 0; i < 8 && size_t(i) < b.size(); ++i) b[size_t(i)] = char((n >> (8 * i)) & 0xff);
}

void set_header_length(std::string& b, Gen& g) {
  const uint64_t n = header_length(b), size = b.size();
  put_header_length(b, pick<uint64_t>(g, {0, 1, 2, 7, n - 1, n + 1, n + 8, size - 8, size - 7, size, uint64_t(1) << 32,
                                          uint64_t(1) << 63, ~uint64_t(0), g()}));
}

// A random JSON value, mostly of the kinds a header or meta.json holds, some out of range.
std::string random_json_value(Gen& g) {
  return pick<std::string>(g, {"0",
                               "1",
                               "-1",
                               "3",
                               "7",
                               "12",
                               "16",
                               "48",
                               "1.5",
                               "1e400",
                               "-0",
                               "9223372036854775807",
                               "9223372036854775808",
                               "18446744073709551615",
                               "18446744073709551616",
                               "99999999999999999999999",
                               "\"x\"",
                               "\"\"",
                               "\"12\"",
                               "[]",
                               "{}",
                               "null",
                               "true",
                               "[1, 2]",
                               "{\"a\": 1}",
                               "[[[[1]]]]",
                               "\"F32\""});
}

std::string random_dims(Gen& g) {
  std::string out = "[";
  for (int n = int(g() % 5), i = 0; i < n; ++i)
    out += (i ? "," : "") + pick<std::string>(g, {"0", "1", "2", "3", "4", "7", "12", "-1", "2147483648",
                                                  "1099511627776", "4611686018427387904", "9223372036854775807",
                                                  "18446744073709551615", "1.5", "\"3\"", "[]"});
  return out + "]";
}

std::string random_offsets(Gen& g, uint64_t body) {
  const std::vector<uint64_t> near = {
      0, 4, 8, 12, 16, 36, 48, body - 4, body, body + 4, uint64_t(1) << 40, ~uint64_t(0), ~uint64_t(0) - 3};
  switch (g() % 4) {
    case 0:
      return "[" + std::to_string(pick(g, near)) + "," + std::to_string(pick(g, near)) + "]";
    case 1:
      return pick<std::string>(g, {"[]", "[0]", "[0,4,8]", "[-4,0]", "[0,-4]", "[\"0\",\"4\"]", "[1.0,5.0]"});
    case 2:
      return random_json_value(g);
    default: {
      const uint64_t b = g() % (body + 1);
      return "[" + std::to_string(b) + "," + std::to_string(b + g() % 64) + "]";
    }
  }
}

// Replaces the value after one occurrence of `key` in `text` (a quoted string or a bracketed list).
bool replace_value(std::string& text, const std::string& key, const std::string& value, Gen& g) {
  std::vector<size_t> at;
  for (size_t p = text.find(key); p != std::string::npos; p = text.find(key, p + 1)) at.push_back(p + key.size());
  if (at.empty()) return false;
  const size_t begin = pick(g, at);
  if (begin >= text.size()) return false;
  const char open = text[begin];
  const size_t end = open == '"' ? text.find('"', begin + 1) : open == '[' ? text.find(']', begin) : std::string::npos;
  if (end == std::string::npos) return false;
  text.replace(begin, end + 1 - begin, value);
  return true;
}

// Edits one dtype, shape or data_offsets of the JSON header; the length prefix follows the new
// header most of the time, so the damage reaches the entry checks.
void mutate_header(std::string& b, Gen& g) {
  const uint64_t n = header_length(b);
  if (b.size() < 8 || n > b.size() - 8) return;
  std::string header = b.substr(8, n), body = b.substr(8 + n);
  switch (g() % 6) {
    case 0:
      replace_value(header, "\"dtype\":",
                    pick<std::string>(g, {"\"F32\"", "\"F64\"", "\"BF16\"", "\"F16\"", "\"I64\"", "\"I32\"", "\"U8\"",
                                          "\"F8_E4M3\"", "\"\"", "\"X\"", "[]", "{}", "7", "null"}),
                    g);
      break;
    case 1:
      replace_value(header, "\"shape\":", random_dims(g), g);
      break;
    case 2:
      replace_value(header, "\"data_offsets\":", random_offsets(g, body.size()), g);
      break;
    case 3:
      replace_value(header, "\"format\":", random_json_value(g), g);
      break;
    case 4: {  // a key renamed or retyped, or an entry that is not an object
      const std::string key =
          pick<std::string>(g, {"\"dtype\":", "\"shape\":", "\"data_offsets\":", "\"__metadata__\":"});
      const size_t p = header.find(key);
      if (p != std::string::npos)
        header.replace(p, key.size(), pick<std::string>(g, {"\"dtypo\":", "1:", "\"x\":1,\"y\":"}));
      break;
    }
    default:  // stray entries or brackets
      if (header.size() > 2)
        header.insert(1 + g() % (header.size() - 2),
                      pick<std::string>(g, {"\"t\":{},", "\"u\":[],", "\"v\":7,", "{", "]"}));
  }
  std::string prefix(8, '\0');
  put_header_length(prefix, g() % 4 == 0 ? n : header.size());
  b = prefix + header + body;
}

// Replaces one value of meta.json, or drops one of its lines.
void mutate_meta(std::string& b, Gen& g) {
  if (g() % 4 == 0) {
    std::vector<size_t> starts = {0};
    for (size_t p = b.find('\n'); p != std::string::npos && p + 1 < b.size(); p = b.find('\n', p + 1))
      starts.push_back(p + 1);
    const size_t s = pick(g, starts), e = b.find('\n', s);
    b.erase(s, e == std::string::npos ? std::string::npos : e + 1 - s);
    return;
  }
  std::vector<size_t> colons;
  for (size_t p = b.find("\": "); p != std::string::npos; p = b.find("\": ", p + 1)) colons.push_back(p + 3);
  if (colons.empty()) return;
  const size_t begin = pick(g, colons);
  size_t end = begin;
  if (b[begin] == '{') {
    end = begin + 1;  // a nested object: replace the whole of it
    for (int depth = 1; end < b.size() && depth > 0; ++end) depth += b[end] == '{' ? 1 : b[end] == '}' ? -1 : 0;
  } else if (b[begin] == '"') {
    for (end = begin + 1; end < b.size() && b[end] != '"'; ++end) end += b[end] == '\\';
    end = std::min(end + 1, b.size());
  } else {
    while (end < b.size() && b[end] != ',' && b[end] != '\n' && b[end] != '}') ++end;
  }
  b.replace(begin, end - begin, random_json_value(g));
}

void mutate(Files& files, Gen& g) {
  std::vector<std::string> names;
  for (const auto& [name, bytes] : files) names.push_back(name);
  if (names.empty()) return;
  const std::string name = pick(g, names);
  std::string& b = files[name];
  const bool safetensors = name != kMeta;
  switch (g() % 8) {
    case 0:
      flip_bytes(b, g);
      break;
    case 1:
      truncate(b, g);
      break;
    case 2:
      extend(b, g);
      break;
    case 3:
      if (g() % 8 == 0)
        files.erase(name);
      else
        flip_bytes(b, g);
      break;
    default:
      if (!safetensors)
        mutate_meta(b, g);
      else if (g() % 5 == 0)
        set_header_length(b, g);
      else
        mutate_header(b, g);
  }
}

// After a load that succeeded: every tensor of m against the damaged files; "" when all agree.
std::string loaded_differs(const Files& files, const Model& m) {
  const auto file = [&](const char* f) { return files.count(f) ? files.at(f) : std::string(); };
  const std::string model = file(kModel), optim = file(kOptim);
  for (const Variable& v : m.params)
    if (std::string why = differs_from_file(v.data(), model, v.name()); !why.empty()) return why;
  for (const Variable& v : m.buffers)
    if (std::string why = differs_from_file(v.data(), model, v.name()); !why.empty()) return why;
  for (size_t i = 0; i < m.params.size(); ++i) {
    const std::string name = m.params[i].name();
    if (std::string why = differs_from_file(m.exp_avg[i], optim, name + ".exp_avg"); !why.empty()) return why;
    if (std::string why = differs_from_file(m.exp_avg_sq[i], optim, name + ".exp_avg_sq"); !why.empty()) return why;
  }
  return "";
}

void write_files(const fs::path& dir, const Files& files) {
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const auto& [name, bytes] : files) std::ofstream(dir / name, std::ios::binary) << bytes;
}

// Loads the checkpoint like a resume does, and the weights file with its metadata; "" when every
// call ended in success or a flowmoe::Error, else what escaped.
std::string load_case(const fs::path& dir, Model& m, bool* loaded) {
  try {
    load_checkpoint(dir.string(), m.params, &m.exp_avg, &m.exp_avg_sq, m.buffers);
    *loaded = true;
  } catch (const Error&) {
  } catch (const std::exception& e) {
    return std::string("load_checkpoint threw ") + typeid(e).name() + ": " + e.what();
  } catch (...) {
    return "load_checkpoint threw a non-std exception";
  }
  try {
    std::map<std::string, std::string> metadata;
    read_safetensors((dir / kModel).string(), &metadata);
  } catch (const Error&) {
  } catch (const std::exception& e) {
    return std::string("read_safetensors threw ") + typeid(e).name() + ": " + e.what();
  } catch (...) {
    return "read_safetensors threw a non-std exception";
  }
  return "";
}

// The files of model's checkpoint, saved under d/source.
Files source_checkpoint(const fs::path& d, const Model& model) {
  CheckpointMeta meta;
  meta.step = 12;
  meta.num_updates = 11;
  meta.skipped_steps = 1;
  meta.data = {1, 40};
  meta.data_seed = 1234;
  meta.init_seed = 42;
  meta.config_yaml = "model:\n  vocab_size: 64\n";
  const fs::path ckpt =
      save_checkpoint((d / "source").string(), meta, model.params, model.exp_avg, model.exp_avg_sq, 1, model.buffers);
  Files files;
  for (const char* f : {kModel, kOptim, kMeta}) files[f] = read_bytes(ckpt / f);
  return files;
}

}  // namespace

TEST(FuzzCheckpoint, DamagedFilesLoadOrThrowFlowmoeErrors) {
  const FuzzPlan plan = fuzz_plan(20240611, 2000);
  const uint64_t seed = plan.seed, cases = uint64_t(plan.num_cases);
  const fs::path d = fresh_dir("fuzz_checkpoint");
  Model model;
  const Files pristine = source_checkpoint(d, model);

  // The undamaged copy loads what it holds, so the cases start from a valid checkpoint.
  const fs::path dir = d / "case";
  write_files(dir, pristine);
  bool loaded = false;
  ASSERT_EQ(load_case(dir, model, &loaded), "");
  ASSERT_TRUE(loaded);
  ASSERT_EQ(loaded_differs(pristine, model), "");

  uint64_t ok = 0, refused = 0, failures = 0;
  for (uint64_t i = 0; i < cases && failures < 10; ++i) {
    Gen g(seed + i);
    Files files = pristine;
    for (int n = 1 + int(g() % 3); n > 0; --n) mutate(files, g);
    write_files(dir, files);
    const auto t0 = std::chrono::steady_clock::now();
    loaded = false;
    const std::string escaped = load_case(dir, model, &loaded);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string wrong = escaped.empty() && loaded ? loaded_differs(files, model) : "";
    if (!escaped.empty() || !wrong.empty() || seconds > 5) {
      ++failures;
      ADD_FAILURE() << "case " << i << " (FLOWMOE_TEST_SEED=" << seed + i << " FLOWMOE_FUZZ_CASES=1): "
                    << (!escaped.empty() ? escaped
                        : !wrong.empty() ? wrong
                                         : "took " + std::to_string(seconds) + " s");
      write_files(d / ("failed_case_" + std::to_string(i)), files);  // kept for a look
      continue;
    }
    ++(loaded ? ok : refused);
  }
  std::printf("[fuzz] %llu loaded, %llu refused with a flowmoe::Error\n", static_cast<unsigned long long>(ok),
              static_cast<unsigned long long>(refused));
  if (cases >= 100) {
    EXPECT_GT(ok, 0u) << "no damaged case loaded: the mutations never leave a checkpoint readable";
    EXPECT_GT(refused, cases / 2) << "most damage should be refused";
  }
  if (failures == 0) fs::remove_all(d);
}

// A tensor whose byte range is not its shape times its dtype's size is refused by the reader and the loader,
// whichever of the three disagrees: the range shorter or longer (still inside the file), another shape, a
// dtype of another size.
TEST(FuzzCheckpoint, ByteRangesOtherThanShapeTimesDtypeAreRefused) {
  const fs::path d = fresh_dir("fuzz_checkpoint_ranges");
  Model model;
  const Files pristine = source_checkpoint(d, model);
  const std::string& file = pristine.at(kModel);
  const std::optional<RawEntry> e = raw_entry(file, "emb.weight");  // [4, 3] f32: 48 bytes, not the last tensor
  ASSERT_TRUE(e.has_value());
  ASSERT_EQ(e->end - e->begin, 48u);
  ASSERT_LT(e->data_start + e->end + 4, file.size());
  const auto entry = [](const std::string& dtype, const std::string& shape, uint64_t begin, uint64_t end) {
    return "\"emb.weight\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" +
           std::to_string(begin) + "," + std::to_string(end) + "]}";
  };
  const std::string original = entry("F32", "[4,3]", e->begin, e->end);
  const uint64_t n = header_length(file);
  std::string header = file.substr(8, n);
  const size_t at = header.find(original);
  ASSERT_NE(at, std::string::npos) << header;
  const std::vector<std::pair<const char*, std::string>> damaged = {
      {"a shorter range", entry("F32", "[4,3]", e->begin, e->end - 4)},
      {"a longer range", entry("F32", "[4,3]", e->begin, e->end + 4)},
      {"another shape", entry("F32", "[4,2]", e->begin, e->end)},
      {"a scalar", entry("F32", "[]", e->begin, e->end)},
      {"a dtype of 2 bytes", entry("BF16", "[4,3]", e->begin, e->end)},
      {"a dtype of 8 bytes", entry("F64", "[4,3]", e->begin, e->end)},
  };
  const fs::path dir = d / "case";
  for (const auto& [what, replacement] : damaged) {
    SCOPED_TRACE(what);
    Files files = pristine;
    std::string h = header;
    h.replace(at, original.size(), replacement);
    std::string prefix(8, '\0');
    put_header_length(prefix, h.size());
    files[kModel] = prefix + h + file.substr(8 + n);
    write_files(dir, files);
    EXPECT_THROW(read_safetensors((dir / kModel).string()), IoError);
    EXPECT_THROW(load_checkpoint(dir.string(), model.params, &model.exp_avg, &model.exp_avg_sq, model.buffers),
                 IoError);
  }
  fs::remove_all(d);
}
