// The config schema, shared by the files of the config reader: every key with its section, type,
// range, default and documentation (config_schema.cpp), and how one key's text is checked and
// stored (set_field). config.cpp walks the YAML and the overrides through it.
#pragma once
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <variant>
#include <vector>

#include "config/config_types.h"

namespace flowmoe::config_schema {

// dtype: one of `choices`, dtype names (kernels/common/dtype.h), parsed once into a DType. A choice parses its text
// once into the field's enum through the enum's name table (EnumRef), or stores its text where the field is a
// string.
// optional_integer: an integer in range, or null (YAML null, "null" or "" in an override), stored as 0.
enum class Kind {
  integer,
  optional_integer,
  number,
  boolean,
  string,
  choice,
  int_choice,
  bool_or_path,
  choice_list,
  dtype
};
// A choice field held as an enum: set stores the value of a name its table holds (false, the field untouched, for
// another); get is the value's name.
struct EnumRef {
  std::function<bool(const std::string&)> set;
  std::function<const char*()> get;
};
template <class E, size_t N>
EnumRef enum_ref(E* value, const EnumName<E> (&table)[N]) {
  return {[value, &table](const std::string& name) { return enum_from_name(table, name, value); },
          [value, &table] { return enum_name(table, *value); }};
}
using FieldRef = std::variant<int64_t*, double*, bool*, std::string*, DType*, EnumRef>;

struct Field {
  std::string section, key;
  Kind kind;
  double lo = -INFINITY, hi = INFINITY;   // allowed range (numbers and integers)
  bool lo_open = false, hi_open = false;  // exclusive bounds
  std::vector<std::string> choices;       // choice / int_choice / dtype
  std::string doc;
  std::function<FieldRef(Config&)> ref;
  std::string dotted() const { return section + "." + key; }
};

// Every key, in the order of the sections and of docs/TRAINING.md.
const std::vector<Field>& schema();
const std::vector<std::string>& sections();
const Field* find_field(const std::string& section, const std::string& key);  // nullptr when unknown

// " (did you mean 'x'?)" for the closest candidate within a small distance, else "".
std::string suggestion(const std::string& word, const std::vector<std::string>& candidates);
// "an integer in [1, 65536]", "one of bf16, fp8_blockwise, fp8_flow", ...
std::string describe_type(const Field& f);
// Throws ConfigError "<where>: <key>: <msg>" (no key part when key is empty).
[[noreturn]] void fail(const std::string& where, const std::string& key, const std::string& msg);

// Parses `text` into the field, checking type and range; `where` names the origin in messages.
void set_field(Config& cfg, const Field& f, const std::string& text, const std::string& where);
// The field's value as text (doubles in the shortest form that reads back exactly).
std::string field_value(const Config& cfg, const Field& f);

}  // namespace flowmoe::config_schema
