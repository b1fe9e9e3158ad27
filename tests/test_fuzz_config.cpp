// Seeded random mutations of the shipped configs (configs/*.yaml) through parse_config, load_config
// and --set overrides: deleted, duplicated, moved and renamed keys; values at and past their limits,
// of the wrong type, or absurd; broken YAML; random bytes. Every input must end in a Config or a
// ConfigError, never a crash, a hang or another exception, and every accepted config must read back
// from its resolved YAML unchanged. FLOWMOE_FUZZ_CASES sets the number of cases (default 3000, a few
// seconds) and FLOWMOE_TEST_SEED the seed (default fixed, so every run checks the same cases).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <typeinfo>
#include <vector>

#include "config/config.h"
#include "kernels/common/error.h"
#include "tests/support/checks.h"

using namespace flowmoe;
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kDefaultSeed = 20240520;
constexpr int64_t kDefaultCases = 3000;
constexpr double kSlowCaseSeconds = 2.0;

// ---- what a crash reports ------------------------------------------------------------------------

// The input being parsed, printed by the signal handler when the parser crashes (a stack overflow
// included: the handler runs on its own stack).
char g_current[8192];

void on_crash(int sig) {
  const char head[] = "\n[fuzz] crashed while parsing this input:\n";
  ssize_t ignored = write(2, head, sizeof head - 1);
  ignored = write(2, g_current, strnlen(g_current, sizeof g_current));
  (void)ignored;
  signal(sig, SIG_DFL);
  raise(sig);
}

void install_crash_report() {
  static std::vector<char> stack(1 << 16);
  stack_t ss{};
  ss.ss_sp = stack.data();
  ss.ss_size = stack.size();
  sigaltstack(&ss, nullptr);
  struct sigaction sa {};
  sa.sa_handler = on_crash;
  sa.sa_flags = SA_ONSTACK;
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) sigaction(sig, &sa, nullptr);
}

// ---- inputs ------------------------------------------------------------------------------------------

struct Case {
  std::string yaml;
  std::vector<std::string> sets;
  std::vector<std::string> mutations;  // what was done to the shipped config, for the report
  bool through_file = false;           // load_config from a file instead of parse_config

  std::string describe() const {
    std::ostringstream os;
    os << "mutations:";
    for (const auto& m : mutations) os << " " << m;
    os << (through_file ? " (load_config)" : " (parse_config)") << "\nsets:";
    for (const auto& s : sets) os << " [" << escaped(s) << "]";
    os << "\nyaml: \"" << escaped(yaml.substr(0, 3000)) << (yaml.size() > 3000 ? "...\"" : "\"") << "\n";
    return os.str();
  }
  static std::string escaped(const std::string& s) {
    std::string out;
    for (unsigned char c : s) {
      if (c == '\n')
        out += "\\n";
      else if (c == '\\' || c == '"')
        out += std::string("\\") + char(c);
      else if (c < 0x20 || c >= 0x7f) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\x%02x", c);
        out += buf;
      } else {
        out += char(c);
      }
    }
    return out;
  }
};

// A key of the schema with the values at and just past its limits, read from the reference table.
struct KeyInfo {
  std::string section, key;
  std::vector<std::string> edge_values;
  bool text = false;  // a string or a path
};

std::vector<std::string> edge_values_of(const std::string& type) {
  std::vector<std::string> v;
  auto bounds = [&](size_t open) {
    size_t comma = type.find(", ", open), close = type.find_first_of(")]", comma);
    return std::make_pair(type.substr(open + 1, comma - open - 1), type.substr(comma + 2, close - comma - 2));
  };
  if (type.rfind("an integer in [", 0) == 0) {
    auto [lo, hi] = bounds(type.find('['));
    const long long l = std::stoll(lo), h = std::stoll(hi);
    v = {lo, hi, std::to_string(l - 1), std::to_string(h + 1), std::to_string(h / 2), std::to_string(h) + ".0"};
  } else if (type.rfind("a number in ", 0) == 0) {
    auto [lo, hi] = bounds(type.find_first_of("(["));
    v = {lo, hi, "-" + hi, lo + "1", hi + "1", "-1e-300", hi == "inf" ? "1e308" : hi + "e0"};
  } else if (type.rfind("one of ", 0) == 0) {
    std::stringstream ss(type.substr(7));
    for (std::string c; std::getline(ss, c, ',');) {
      c.erase(0, c.find_first_not_of(' '));
      v.push_back(c);
      v.push_back(c + "x");
      v.push_back("[" + c + "]");
    }
  } else if (type == "a string" || type == "true, false or a path") {  // text that must survive the resolved YAML
    v = {"",
         "runs/x",
         "\"a\\nb\"",
         "|\n    two\n    lines\n",
         "\"\\t\\x01\\r\"",
         "'q\"uote'",
         "\"back\\\\slash\"",
         "\"\\x7f\"",
         "é",
         "\xff",
         "' lead and trail '",
         "\"#x\"",
         "\"true\"",
         "\"~\""};
  } else if (type.rfind("a list of ", 0) == 0) {
    v = {"[]", "[moe_expert]", "[moe_expert, moe_expert]", "moe_expert", "[moe_expert", "[[moe_expert]]", "[,]"};
  }
  return v;
}

const std::vector<KeyInfo>& schema_keys() {
  static const std::vector<KeyInfo> keys = [] {
    std::vector<KeyInfo> out;
    std::istringstream ref(config_reference_markdown());
    std::string section;
    for (std::string line; std::getline(ref, line);) {
      if (line.rfind("### ", 0) == 0) section = line.substr(4);
      if (line.rfind("| `", 0) != 0) continue;
      const size_t key_end = line.find('`', 3), type_start = line.find("| ", key_end) + 2;
      const std::string type = line.substr(type_start, line.find(" |", type_start) - type_start);
      out.push_back({section, line.substr(3, key_end - 3), edge_values_of(type),
                     type == "a string" || type == "true, false or a path"});
    }
    return out;
  }();
  return keys;
}

const std::vector<std::string>& odd_values() {
  static const std::vector<std::string> v = {"0",
                                             "-1",
                                             "1",
                                             "2",
                                             "3",
                                             "-0",
                                             "+5",
                                             "128",
                                             "1024",
                                             "65536",
                                             "1048576",
                                             "9223372036854775807",
                                             "9223372036854775808",
                                             "-9223372036854775808",
                                             "-9223372036854775809",
                                             "18446744073709551616",
                                             "99999999999999999999999999",
                                             "1e308",
                                             "-1e308",
                                             "1e309",
                                             "4.9e-324",
                                             "1e-400",
                                             "nan",
                                             ".nan",
                                             "NaN",
                                             "inf",
                                             ".inf",
                                             "-.inf",
                                             "-inf",
                                             "Infinity",
                                             "0x10",
                                             "0x1p3",
                                             "1_000",
                                             "0o17",
                                             "017",
                                             "1e3",
                                             "2.5",
                                             "1.",
                                             ".5",
                                             "abc",
                                             "''",
                                             "\"\"",
                                             "\"128\"",
                                             "'1e-3'",
                                             "[]",
                                             "{}",
                                             "[1, 2]",
                                             "{a: 1}",
                                             "true",
                                             "false",
                                             "True",
                                             "yes",
                                             "no",
                                             "~",
                                             "null",
                                             "-",
                                             "!!int 3",
                                             "!!str 4",
                                             "!!float .inf",
                                             "&a 5",
                                             "*a",
                                             "|\n    x\n",
                                             ">\n  y\n",
                                             "\"\\x00\"",
                                             "\"a\\nb\"",
                                             "\"\\t\"",
                                             "'runs/x y'",
                                             "\"\\u00e9\"",
                                             "\"\\\"\"",
                                             "'it''s'",
                                             "\"a:b # c\"",
                                             "a # b",
                                             "é",
                                             "\xff\xfe",
                                             "\xc3",
                                             "runs/\"q\"",
                                             "\"\\\\\"",
                                             "\"\\r\\n\"",
                                             " ",
                                             "\"\\x7f\"",
                                             "\"\\U0001F600\""};
  return v;
}

const std::vector<std::string>& yaml_noise() {
  static const std::vector<std::string> v = {"[",
                                             "]",
                                             "{",
                                             "}",
                                             ": ",
                                             ":",
                                             "- ",
                                             "\t",
                                             "'",
                                             "\"",
                                             "&x ",
                                             "*x",
                                             "!!map ",
                                             "!!seq ",
                                             "? ",
                                             "|",
                                             ">",
                                             "#",
                                             "%YAML 1.2\n",
                                             "@",
                                             "`",
                                             ",",
                                             "\n",
                                             "\r",
                                             "\r\n",
                                             "---\n",
                                             "...\n",
                                             "\xEF\xBB\xBF",
                                             std::string(1, '\0'),
                                             "\\",
                                             "<<: ",
                                             "!<tag:x> ",
                                             "%TAG ! tag:x\n",
                                             "{a: [b, {c: d}]}"};
  return v;
}

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  size_t pick(size_t n) { return n ? size_t(rng_() % n) : 0; }
  template <class T>
  const T& pick_of(const std::vector<T>& v) {
    return v[pick(v.size())];
  }
  bool chance(double p) { return double(rng_() % 1000000) < p * 1e6; }

  // Any key, with the few text keys (whose values must survive the resolved YAML) drawn more often.
  const KeyInfo& pick_key() {
    static const std::vector<KeyInfo> text_keys = [] {
      std::vector<KeyInfo> t;
      for (const KeyInfo& k : schema_keys())
        if (k.text) t.push_back(k);
      return t;
    }();
    return chance(0.15) ? pick_of(text_keys) : pick_of(schema_keys());
  }

  std::string value_for(const KeyInfo& k) {
    if (!k.edge_values.empty() && chance(0.5)) return pick_of(k.edge_values);
    if (chance(0.03)) return std::string(1 + pick(20000), "x9[{"[pick(4)]);
    return pick_of(odd_values());
  }

  std::string set_for(const KeyInfo& k) {
    static const std::vector<std::string> malformed = {"",
                                                       "=",
                                                       "model",
                                                       "model.",
                                                       ".hidden_size=1",
                                                       "model.hidden_size",
                                                       "model.hidden_size==3",
                                                       "MODEL.hidden_size=3",
                                                       "model.hidden_size=1=2",
                                                       "a.b.c=1",
                                                       "model.hidden_size =64",
                                                       "model .hidden_size=64",
                                                       "=model.hidden_size"};
    if (chance(0.1)) return pick_of(malformed);
    return k.section + "." + k.key + "=" + value_for(k);
  }

  // One mutation of `text`, named in `what`.
  std::string mutate(std::string text, std::string& what) {
    std::vector<std::string> lines = split(text);
    const size_t i = pick(lines.size());
    switch (pick(11)) {
      case 0:
        what = "delete line " + std::to_string(i + 1);
        if (!lines.empty()) lines.erase(lines.begin() + long(i));
        break;
      case 1:
        what = "duplicate line " + std::to_string(i + 1);
        if (!lines.empty()) lines.insert(lines.begin() + long(i), lines[i]);
        break;
      case 2: {  // move a line elsewhere (a key into another section)
        const size_t j = pick(lines.size());
        what = "move line " + std::to_string(i + 1) + " to " + std::to_string(j + 1);
        if (!lines.empty()) {
          std::string l = lines[i];
          lines.erase(lines.begin() + long(i));
          lines.insert(lines.begin() + long(std::min(j, lines.size())), l);
        }
        break;
      }
      case 3:
      case 4: {  // a key's value: at or past its limits, another type, absurd
        const KeyInfo& k = pick_key();
        const std::string v = value_for(k);
        what = "value " + k.key + "=" + Case::escaped(v);
        if (!replace_value(lines, k.key, v)) lines.push_back(k.section + ":\n  " + k.key + ": " + v + "\n");
        break;
      }
      case 5: {  // a key renamed: to another key, a near miss or garbage
        const KeyInfo& k = pick_of(schema_keys());
        static const std::vector<std::string> names = {"hiden_size", "Steps", "model", "",    "-",
                                                       "[a]",        "{}",    "?",     "x y", "\"steps\"",
                                                       "'lr'",       "1",     "null",  "~",   "<<"};
        const std::string to = chance(0.5) ? pick_of(schema_keys()).key : pick_of(names);
        what = "rename " + k.key + " -> " + Case::escaped(to);
        for (std::string& l : lines) {
          size_t at = l.find(k.key + ":");
          if (at != std::string::npos) {
            l.replace(at, k.key.size(), to);
            break;
          }
        }
        break;
      }
      case 6: {  // indentation: more, less, or a tab
        what = "indent line " + std::to_string(i + 1);
        if (lines.empty()) break;
        std::string& l = lines[i];
        const size_t lead = l.find_first_not_of(" \t");
        if (chance(0.33))
          l.insert(0, std::string(1 + pick(3), ' '));
        else if (chance(0.5))
          l.erase(0, lead == std::string::npos ? 0 : lead);
        else
          l.insert(0, "\t");
        break;
      }
      case 7: {  // YAML syntax noise at a random byte
        const std::string& n = pick_of(yaml_noise());
        const size_t at = pick(text.size() + 1);
        what = "insert " + Case::escaped(n) + " at " + std::to_string(at);
        return text.insert(at, n);
      }
      case 8: {  // random bytes, overwritten or inserted
        const size_t count = 1 + pick(8);
        what = "random bytes x" + std::to_string(count);
        for (size_t k = 0; k < count; ++k) {
          const char b = char(rng_() & 0xff);
          const size_t at = pick(text.size() + 1);
          if (at < text.size() && chance(0.5))
            text[at] = b;
          else
            text.insert(at, 1, b);
        }
        return text;
      }
      case 9: {  // cut short
        const size_t at = pick(text.size() + 1);
        what = "truncate at " + std::to_string(at);
        return text.substr(0, at);
      }
      default: {  // deep nesting or a whole section as a flow value
        const size_t depth = 1 + pick(chance(0.1) ? 5000 : 50);
        what = "nest depth " + std::to_string(depth);
        std::string open(depth, chance(0.5) ? '[' : '{');
        lines.insert(lines.begin() + long(i), "model: " + open + (chance(0.5) ? "" : std::string(depth, ']')) + "\n");
        break;
      }
    }
    return join(lines);
  }

  // A random document of bytes, or of YAML noise.
  std::string garbage() {
    std::string s;
    const size_t n = pick(400);
    const bool noise = chance(0.5);
    for (size_t k = 0; k < n; ++k) s += noise ? pick_of(yaml_noise()) : std::string(1, char(rng_() & 0xff));
    return s;
  }

 private:
  std::mt19937_64 rng_;

  static std::vector<std::string> split(const std::string& text) {
    std::vector<std::string> lines;
    size_t start = 0;
    while (start < text.size()) {
      size_t end = text.find('\n', start);
      end = end == std::string::npos ? text.size() : end + 1;
      lines.push_back(text.substr(start, end - start));
      start = end;
    }
    return lines;
  }
  static std::string join(const std::vector<std::string>& lines) {
    std::string s;
    for (const auto& l : lines) s += l;
    return s;
  }
  static bool replace_value(std::vector<std::string>& lines, const std::string& key, const std::string& value) {
    for (std::string& l : lines) {
      const size_t at = l.find(key + ":");
      if (at == std::string::npos || l.find_first_not_of(' ') != at) continue;
      l = l.substr(0, at + key.size() + 1) + " " + value + "\n";
      return true;
    }
    return false;
  }
};

std::vector<std::string> shipped_configs() {
  std::vector<fs::path> paths;
  for (const auto& e : fs::directory_iterator(fs::path(FLOWMOE_SOURCE_DIR) / "configs"))
    if (e.path().extension() == ".yaml") paths.push_back(e.path());
  std::sort(paths.begin(), paths.end());
  std::vector<std::string> texts;
  for (const auto& p : paths) {
    std::ifstream in(p, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    texts.push_back(ss.str());
  }
  return texts;
}

Case make_case(Mutator& m, const std::vector<std::string>& bases) {
  Case c;
  if (m.chance(0.04)) {
    c.yaml = m.garbage();
    c.mutations.push_back("garbage document");
  } else {
    c.yaml = m.pick_of(bases);
    const size_t count = m.chance(0.15) ? 0 : 1 + m.pick(4);
    for (size_t k = 0; k < count; ++k) {
      std::string what;
      c.yaml = m.mutate(c.yaml, what);
      c.mutations.push_back(what);
    }
  }
  if (c.mutations.empty() || m.chance(0.3))
    for (size_t k = 1 + m.pick(3); k > 0; --k) c.sets.push_back(m.set_for(m.pick_key()));
  c.through_file = m.chance(0.25);
  return c;
}

// The resolved YAML of an accepted config must load and resolve to the same text.
std::string round_trip_problem(const Config& c) {
  const std::string yaml = to_yaml(c);
  auto body = [](const std::string& y) { return y.substr(y.find('\n')); };  // past the comment line
  try {
    Config again = parse_config(yaml, "resolved.yaml");
    std::istringstream want(body(yaml)), got(body(to_yaml(again)));
    for (std::string w, g;;) {  // the first line that differs
      const bool more_w = bool(std::getline(want, w)), more_g = bool(std::getline(got, g));
      if (!more_w && !more_g) break;
      if (!more_w || !more_g || w != g)
        return "the resolved YAML reads back differently: \"" + Case::escaped(more_w ? w : "") + "\" reads back as \"" +
               Case::escaped(more_g ? g : "") + "\"";
    }
  } catch (const std::exception& e) {
    return std::string("the resolved YAML does not load: ") + e.what() + "\n" + yaml;
  }
  return "";
}

}  // namespace

TEST(FuzzConfig, MutatedConfigsParseOrFailWithConfigError) {
  const test::FuzzPlan plan = test::fuzz_plan(kDefaultSeed, kDefaultCases);
  const uint64_t seed = plan.seed;
  const int64_t cases = plan.num_cases;
  const std::vector<std::string> bases = shipped_configs();
  ASSERT_GE(bases.size(), 4u);
  ASSERT_GT(schema_keys().size(), 50u);
  const fs::path dir = fs::temp_directory_path() / ("flowmoe_fuzz_config_" + std::to_string(seed));
  fs::create_directories(dir);
  install_crash_report();

  Mutator m(seed);
  int64_t accepted = 0, failures = 0;
  for (int64_t i = 0; i < cases && failures < 10; ++i) {
    const Case c = make_case(m, bases);
    const std::string report = "case " + std::to_string(i) + " (seed " + std::to_string(seed) + ")\n" + c.describe();
    std::snprintf(g_current, sizeof g_current, "%s", report.c_str());
    // A new file each time: rewriting one in place makes some filesystems flush it on every close.
    const std::string file = (dir / ("case_" + std::to_string(i) + ".yaml")).string();
    if (c.through_file) std::ofstream(file, std::ios::binary) << c.yaml;
    const auto start = std::chrono::steady_clock::now();
    std::string problem;
    try {
      Config cfg = c.through_file ? load_config(file, c.sets) : parse_config(c.yaml, "fuzz.yaml", c.sets);
      ++accepted;
      problem = round_trip_problem(cfg);
    } catch (const ConfigError& e) {  // the expected outcome of a bad input; it must say where
      const std::string msg = e.what(), name = c.through_file ? file : "fuzz.yaml";
      if (msg.rfind(name, 0) != 0 && msg.rfind("'" + name + "'", 0) != 0 && msg.rfind("--set ", 0) != 0)
        problem = "the ConfigError names neither the file nor a --set: " + msg;
    } catch (const std::exception& e) {
      problem = std::string("threw a ") + typeid(e).name() + ", not a ConfigError: " + e.what();
    } catch (...) {
      problem = "threw something that is not a std::exception";
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (problem.empty() && seconds > kSlowCaseSeconds) problem = "took " + std::to_string(seconds) + " s";
    if (!problem.empty()) {
      ++failures;
      ADD_FAILURE() << report << problem;
    }
    if (c.through_file) fs::remove(file);
  }
  std::printf("[fuzz] %lld of %lld inputs were valid configs\n", (long long)accepted, (long long)cases);
  EXPECT_GT(accepted, cases / 50) << "too few valid inputs: the mutations no longer reach validation";
  fs::remove_all(dir);
}
