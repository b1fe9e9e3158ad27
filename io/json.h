// JSON text read with yaml-cpp (JSON is a subset of YAML 1.2's flow style), for the safetensors
// header and a checkpoint's meta.json. Included by .cpp files only: yaml-cpp stays out of the
// library's public headers.
#pragma once
#include <yaml-cpp/yaml.h>

#include <string>

#include "kernels/common/error.h"

namespace flowmoe {

inline YAML::Node parse_json(const std::string& text, const std::string& what) {
  try {
    return YAML::Load(text);
  } catch (const YAML::Exception& e) {
    FLOWMOE_THROW(IoError, what, ": malformed JSON (", e.msg, ")");
  }
}

}  // namespace flowmoe
