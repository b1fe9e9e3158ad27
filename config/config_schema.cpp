// The config schema (see config_schema.h): messages that name a key's type and the nearest known name, and
// the type- and range-checked parsing of one value (the key table itself: config_keys.cpp).
#include "config/config_schema.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "kernels/common/error.h"

namespace flowmoe::config_schema {

namespace {

// What the messages and the scalar parsing use.

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string fmt_bound(double v) {
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (v == std::floor(v) && std::fabs(v) < 1e16) return std::to_string(int64_t(v));
  std::ostringstream os;
  os << v;
  return os.str();
}

bool parse_int(const std::string& s, int64_t& out) {
  if (s.empty()) return false;
  const char* b = s.data();
  const char* e = s.data() + s.size();
  if (*b == '+') ++b;
  auto r = std::from_chars(b, e, out);
  return r.ec == std::errc() && r.ptr == e;
}

bool parse_double(const std::string& s, double& out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  out = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() && errno == 0 && std::isfinite(out);
}

bool parse_bool(const std::string& s, bool& out) {
  if (s == "true" || s == "True" || s == "TRUE") return out = true, true;
  if (s == "false" || s == "False" || s == "FALSE") return out = false, true;
  return false;
}

}  // namespace

// ---- messages -----------------------------------------------------------------------------------

// " (did you mean 'x'?)" for the closest candidate within a small distance, else "".
std::string suggestion(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = 3;
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, c);
    if (d < best_d) best_d = d, best = c;
  }
  return best.empty() ? "" : " (did you mean '" + best + "'?)";
}

std::string describe_type(const Field& f) {
  switch (f.kind) {
    case Kind::integer:
      return "an integer in [" + fmt_bound(f.lo) + ", " + fmt_bound(f.hi) + "]";
    case Kind::optional_integer:
      return "null or an integer in [" + fmt_bound(f.lo) + ", " + fmt_bound(f.hi) + "]";
    case Kind::number:
      return std::string("a number in ") + (f.lo_open ? "(" : "[") + fmt_bound(f.lo) + ", " + fmt_bound(f.hi) +
             (f.hi_open || std::isinf(f.hi) ? ")" : "]");
    case Kind::boolean:
      return "true or false";
    case Kind::string:
      return "a string";
    case Kind::bool_or_path:
      return "true, false or a path";
    case Kind::choice_list: {
      std::string s = "a list of ";
      for (size_t i = 0; i < f.choices.size(); ++i) s += (i ? ", " : "") + f.choices[i];
      return s + " (possibly empty: [])";
    }
    case Kind::choice:
    case Kind::int_choice:
    case Kind::dtype: {
      std::string s = "one of ";
      for (size_t i = 0; i < f.choices.size(); ++i) s += (i ? ", " : "") + f.choices[i];
      return s;
    }
  }
  return "?";
}

[[noreturn]] void fail(const std::string& where, const std::string& key, const std::string& msg) {
  throw ConfigError(where + ": " + (key.empty() ? "" : key + ": ") + msg);
}

// ---- one value ----------------------------------------------------------------------------------

// Parses `text` into the field, checking type and range; `where` names the origin in messages.
void set_field(Config& cfg, const Field& f, const std::string& text, const std::string& where) {
  const std::string key = f.dotted();
  auto bad = [&](const std::string& got_what) {
    fail(where, key, "expected " + describe_type(f) + ", got " + got_what);
  };
  FieldRef ref = f.ref(cfg);
  // The string keys name paths (data.path, checkpoint.dir and .resume, logging.out_dir), and the OS
  // reads a path up to its first NUL byte: "runs/a\0b" would write into runs/a.
  const size_t nul = text.find('\0');
  if ((f.kind == Kind::string || f.kind == Kind::bool_or_path) && nul != std::string::npos) {
    std::string shown = where;  // a --set's origin holds the value: its NULs would cut the message short
    for (size_t at = shown.find('\0'); at != std::string::npos; at = shown.find('\0', at)) shown.replace(at, 1, "\\0");
    fail(shown, key, "a path cannot hold a NUL byte (one at byte " + std::to_string(nul) + ")");
  }
  switch (f.kind) {
    case Kind::integer: {
      int64_t v = 0;
      if (!parse_int(text, v)) bad("'" + text + "'");
      if (double(v) < f.lo || double(v) > f.hi) bad(text);
      *std::get<int64_t*>(ref) = v;
      break;
    }
    case Kind::optional_integer: {
      int64_t v = 0;
      if (text != "" && text != "null" && text != "~") {
        if (!parse_int(text, v)) bad("'" + text + "'");
        if (double(v) < f.lo || double(v) > f.hi) bad(text);
      }
      *std::get<int64_t*>(ref) = v;
      break;
    }
    case Kind::number: {
      double v = 0;
      if (!parse_double(text, v)) bad("'" + text + "'");
      bool below = f.lo_open ? v <= f.lo : v < f.lo;
      bool above = f.hi_open ? v >= f.hi : v > f.hi;
      if (below || above) bad(text);
      *std::get<double*>(ref) = v;
      break;
    }
    case Kind::boolean: {
      bool v = false;
      if (!parse_bool(text, v)) bad("'" + text + "'");
      *std::get<bool*>(ref) = v;
      break;
    }
    case Kind::string:
      *std::get<std::string*>(ref) = text;
      break;
    case Kind::choice:
      if (std::find(f.choices.begin(), f.choices.end(), text) == f.choices.end())
        bad("'" + text + "'" + suggestion(text, f.choices));
      if (auto* e = std::get_if<EnumRef>(&ref)) {
        if (!e->set(text)) bad("'" + text + "'");
      } else {
        *std::get<std::string*>(ref) = text;
      }
      break;
    case Kind::dtype:
      if (std::find(f.choices.begin(), f.choices.end(), text) == f.choices.end() ||
          !dtype_from_name(text, std::get<DType*>(ref)))
        bad("'" + text + "'" + suggestion(text, f.choices));
      break;
    case Kind::int_choice: {
      int64_t v = 0;
      if (!parse_int(text, v) || std::find(f.choices.begin(), f.choices.end(), std::to_string(v)) == f.choices.end())
        bad("'" + text + "'");
      *std::get<int64_t*>(ref) = v;
      break;
    }
    case Kind::choice_list: {
      // Stored comma-joined; accepts "[a, b]", "a,b", "a" and "[]" (the YAML list arrives joined).
      std::string body = text;
      if (!body.empty() && body.front() == '[') {
        if (body.back() != ']') bad("'" + text + "'");
        body = body.substr(1, body.size() - 2);
      }
      std::string joined;
      std::stringstream ss(body);
      for (std::string item; std::getline(ss, item, ',');) {
        item.erase(0, item.find_first_not_of(" \t"));
        item.erase(item.find_last_not_of(" \t") + 1);
        if (item.empty()) continue;
        if (std::find(f.choices.begin(), f.choices.end(), item) == f.choices.end())
          bad("'" + item + "'" + suggestion(item, f.choices));
        joined += (joined.empty() ? "" : ",") + item;
      }
      *std::get<std::string*>(ref) = joined;
      break;
    }
    case Kind::bool_or_path: {
      bool b = false;
      if (text.empty()) bad("an empty value");
      *std::get<std::string*>(ref) = parse_bool(text, b) ? (b ? "true" : "false") : text;
      break;
    }
  }
  cfg.origins[key] = where;
}

std::string field_value(const Config& cfg, const Field& f) {
  FieldRef ref = f.ref(const_cast<Config&>(cfg));
  if (auto* i = std::get_if<int64_t*>(&ref))
    return f.kind == Kind::optional_integer && **i == 0 ? "null" : std::to_string(**i);
  if (auto* e = std::get_if<EnumRef>(&ref)) return e->get();
  if (auto* b = std::get_if<bool*>(&ref)) return **b ? "true" : "false";
  if (auto* s = std::get_if<std::string*>(&ref)) return **s;
  if (auto* t = std::get_if<DType*>(&ref)) return dtype_name(**t);
  double d = *std::get<double*>(ref);
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d);  // shortest form that reads back exactly
  std::string s(buf, r.ptr);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

}  // namespace flowmoe::config_schema
