// An enum's names in one table: what parses a name, prints a value and lists the choices in a message (the
// config's choice keys among them: config/config_schema.cpp takes their choices from the same table).
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include "kernels/common/error.h"

namespace flowmoe {

template <class E>
struct EnumName {
  E value;
  const char* name;
};

template <class E, size_t N>
const char* enum_name(const EnumName<E> (&table)[N], E value) {
  for (const EnumName<E>& e : table)
    if (e.value == value) return e.name;
  return "?";
}

// False (out untouched) for a name the table does not hold.
template <class E, size_t N>
bool enum_from_name(const EnumName<E> (&table)[N], const std::string& name, E* out) {
  for (const EnumName<E>& e : table)
    if (name == e.name) {
      *out = e.value;
      return true;
    }
  return false;
}

// The names in the table's order.
template <class E, size_t N>
std::vector<std::string> enum_names(const EnumName<E> (&table)[N]) {
  std::vector<std::string> names;
  for (const EnumName<E>& e : table) names.push_back(e.name);
  return names;
}

// The value of `name`; ConfigError "<key>: '<name>' is not one of a, b, c" for a name the table does not hold.
template <class E, size_t N>
E parse_enum(const EnumName<E> (&table)[N], const std::string& name, const std::string& key) {
  E value{};
  if (enum_from_name(table, name, &value)) return value;
  std::string choices;
  for (const EnumName<E>& e : table) choices += (choices.empty() ? "" : ", ") + std::string(e.name);
  FLOWMOE_THROW(ConfigError, key, ": '", name, "' is not one of ", choices);
}

}  // namespace flowmoe
