// safetensors files, written and read by hand:
// 8-byte little-endian header length N, N bytes of JSON
// {"__metadata__": {str: str}, "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...}
// padded with spaces to a multiple of 8, then the raw little-endian tensor bytes, back to back.
// Writing streams one tensor at a time from its host copy; reading goes through SafetensorsIndex,
// which reads a tensor (or rows of it) at its offset, so neither side holds a whole file in memory.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "engine/tensor.h"
#include "io/file_io.h"

namespace flowmoe {

struct NamedTensor {
  std::string name;
  Tensor tensor;  // any device; written from a host copy
};

// dtype <-> safetensors dtype string ("F32", "BF16", "I64", ...). Unknown strings throw IoError.
const char* safetensors_dtype(DType t);
DType dtype_from_safetensors(const std::string& s);

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});
// A tensor of a file named before its values exist: the header needs every name, dtype and shape first.
struct TensorSpec {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
};
// The same, with tensor i made by make(i) only when its bytes are due (it must have specs[i]'s dtype and shape), so
// a conversion holds one tensor at a time, not the file.
void write_safetensors(const std::string& path, const std::vector<TensorSpec>& specs,
                       const std::function<Tensor(size_t)>& make,
                       const std::map<std::string, std::string>& metadata = {});
// Tensors on the CPU in file order. Throws IoError naming the file on any inconsistency; every
// length, offset and shape is checked against the file's size before memory is allocated.
std::vector<NamedTensor> read_safetensors(const std::string& path,
                                          std::map<std::string, std::string>* metadata = nullptr);

// One tensor of a safetensors header, checked against the file's size before any memory is
// allocated for it: [begin, end) is its byte range after the header.
struct SafetensorsEntry {
  DType dtype = DType::f32;
  Shape shape;
  uint64_t begin = 0, end = 0;
};

// A safetensors file's header, read and checked; its tensors are read on request, each straight
// from the file into host memory, so a reader holds one tensor at a time and an expert-parallel
// rank reads only its rows of a sharded tensor. Throws IoError naming the file, also when the
// tensors' byte ranges overlap (naming two of them) or leave bytes of the data section to none.
class SafetensorsIndex {
 public:
  SafetensorsIndex(const std::string& path, std::map<std::string, std::string>* metadata = nullptr);
  std::vector<std::string> names_in_file_order() const;
  const SafetensorsEntry& entry(const std::string& name) const;  // IoError when the file has none
  Tensor read(const std::string& name) const;                    // on the CPU
  // Rows [row_begin, row_begin + num_rows) along dim 0 of tensor `name`, on the CPU.
  Tensor read_rows(const std::string& name, int64_t row_begin, int64_t num_rows) const;
  const std::string& path() const { return path_; }

 private:
  void check_tiling(uint64_t body_size) const;  // IoError naming two overlapping tensors or a gap

  std::string path_;
  FileReader file_;
  uint64_t data_start_ = 0;
  std::map<std::string, SafetensorsEntry> entries_;
};

}  // namespace flowmoe
