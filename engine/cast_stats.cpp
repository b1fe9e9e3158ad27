#include "engine/cast_stats.h"

#include <mutex>

namespace flowmoe {

namespace {
std::mutex g_mutex;
CastCounts g_counts;
}  // namespace

const char* cast_kind_name(CastKind k) {
  switch (k) {
    case CastKind::quantize:
      return "quantize";
    case CastKind::dequantize:
      return "dequantize";
    case CastKind::weight_quantize:
      return "weight_quantize";
  }
  return "?";
}

void note_cast(CastKind kind, const std::string& site) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (kind == CastKind::quantize) ++g_counts.quantize;
  if (kind == CastKind::dequantize) ++g_counts.dequantize;
  if (kind == CastKind::weight_quantize) ++g_counts.weight_quantize;
  ++g_counts.by_site[std::string(cast_kind_name(kind)) + " " + site];
}

CastCounts cast_counts() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_counts;
}

void reset_cast_counts() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_counts = CastCounts{};
}

}  // namespace flowmoe
