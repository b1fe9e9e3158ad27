// The optimizer step's scalars on the device (math: kernels/step_control.h, advance_step_from_sums): one
// thread reads the micro-batch losses and the squared-norm sums and advances the StepScalars in place,
// so AdamW and the expert-bias update that follow on the stream read them without a host round trip.
// Reference: the same inline function on the host. Tests: tests/test_step_control.cpp.
#include "kernels/common/cuda_check.h"
#include "kernels/common/error.h"
#include "kernels/step_control.h"

namespace flowmoe {

// ---- kernels ----------------------------------------------------------------------------------

__global__ void advance_step_kernel(StepScalars* s, StepSchedule p, const float* lm, const float* aux,
                                    const float* sq_sums, const int32_t* exchange_overflow, const float* mtp) {
  if (threadIdx.x == 0 && blockIdx.x == 0) advance_step_from_sums(*s, p, lm, aux, sq_sums, exchange_overflow, mtp);
}

// ---- launchers --------------------------------------------------------------------------------

void advance_step_cuda(StepScalars* s, const StepSchedule& p, const float* lm, const float* aux, const float* sq_sums,
                       const int32_t* exchange_overflow, cudaStream_t stream, const float* mtp) {
  FLOWMOE_CHECK(s && lm && sq_sums && (aux || !p.has_aux) && (mtp || !p.has_mtp), Error,
                "advance_step_cuda: null scalars, losses or norm sums");
  FLOWMOE_CHECK(p.num_micro_batches >= 1, Error, "advance_step_cuda: num_micro_batches ", p.num_micro_batches,
                " must be >= 1");
  advance_step_kernel<<<1, 32, 0, stream>>>(s, p, lm, aux, sq_sums, exchange_overflow, mtp);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
