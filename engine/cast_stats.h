// Cast accounting (DESIGN.md §1): every explicit quantize and dequantize of an
// activation or gradient calls note_cast() with the place it happens, so the trainer can report how
// many casts each MoE layer makes per step under each recipe. Fused kernels that happen to emit FP8
// (SwiGLU+quantize) and layout moves of FP8 data (permute, the scaling-aware transpose) are not casts.
// Weight quantization (once per optimizer step) is counted apart, as CastKind::weight_quantize.
#pragma once
#include <cstdint>
#include <map>
#include <string>

namespace flowmoe {

enum class CastKind : uint8_t { quantize, dequantize, weight_quantize };
const char* cast_kind_name(CastKind k);

void note_cast(CastKind kind, const std::string& site);  // site e.g. "fc1.dgrad: dy rowwise"

struct CastCounts {
  int64_t quantize = 0, dequantize = 0, weight_quantize = 0;
  std::map<std::string, int64_t> by_site;  // "<kind> <site>" -> count
  int64_t activation_casts() const { return quantize + dequantize; }
};
CastCounts cast_counts();  // since the last reset
void reset_cast_counts();

}  // namespace flowmoe
