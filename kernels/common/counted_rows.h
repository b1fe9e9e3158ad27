// The rows of a worst-case row buffer that hold data. A zero-sync exchange's receive buffer is sized for
// every token of every rank (about n times the rows a step fills); the expert GEMMs read only the rows their
// device counts cover, and the row kernels between them (SwiGLU, the fused SwiGLU+quantize) take the same
// counts so as not to compute the unused tail (kernels/swiglu.h, kernels/swiglu_quant.h).
#pragma once
#include <cstdint>

namespace flowmoe {

// counts [num] i32 on the kernel's device: the rows are their sum (at most the buffer's); null: every row.
// Rows past the sum are left unwritten.
struct CountedRows {
  const int32_t* counts = nullptr;
  int num = 0;
};

}  // namespace flowmoe
