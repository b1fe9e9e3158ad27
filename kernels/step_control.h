// The optimizer step's scalars, computed where the gradients live so that the host never waits for them:
//   loss = Σ_a lm_a / A,  aux = Σ_a aux_a / A (A micro-batches),  norm = sqrt(sq_sums[0] + sq_sums[1])
//   mtp = Σ_a mtp_a / A, the multi-token prediction loss, reported only (a non-finite one shows in the norm)
//   finite = isfinite(loss + aux) && isfinite(norm);  apply = finite && !halted (halted: sticky, set by a
//   non-finite step when the run stops on one);  t += apply;  lr = schedule(step);  grad_scale = clip(norm)
//   bias_correction_i = 1 - beta_i^t;  bias_rate_scale = apply ? (lr / peak lr, or 1) : 0
//   A step whose expert exchange ran out of buffer rows (exchange_overflow, kernels/ep_layout.h) is void: it
//   changes nothing (not even step) but the sticky exchange_overflow, which voids every later step too until
//   the host, which runs the step again with larger buffers, clears it.
// AdamW (kernels/adamw.h) and the expert-bias update (kernels/router.h) read the result on the device;
// the trainer copies it to the host a step later. The math is one __host__ __device__ function below (the
// CPU path and the reference), so the CUDA path agrees bit for bit. CUDA: kernels/cuda/step_control.cu.
// Tests: tests/test_step_control.cpp.
#pragma once
#include <cmath>
#include <cstdint>

#include "kernels/common/device_api.h"

#if defined(__CUDACC__)
#define FLOWMOE_HOST_DEVICE __host__ __device__
#else
#define FLOWMOE_HOST_DEVICE
#endif

namespace flowmoe {

// The learning rates and bias corrections one step on the device may read, computed by the host: the
// device's cos and pow may differ from the host's in the last bit, and the window keeps the two paths
// bit-identical in a few bytes, whatever the number of steps. The host refills it before each step it
// queues (train/step_state.h), for every step and update count the device may have reached by then: the
// steps still queued before it may each have been applied, skipped (no update) or void (no step).
constexpr int kScheduleWindow = 4;
struct ScheduleWindow {
  int64_t first_step = 0;    // lr[k] is step first_step + k's
  int64_t first_update = 0;  // bias_correction*[k] are those after first_update + k updates
  double lr[kScheduleWindow] = {};
  float bias_correction1[kScheduleWindow] = {}, bias_correction2[kScheduleWindow] = {};
};

// The run's constants, passed by value.
struct StepSchedule {
  double lr = 0, min_lr = 0;  // peak and final learning rate
  int64_t warmup_steps = 0, total_steps = 0;
  double beta1 = 0.9, beta2 = 0.999;
  double grad_clip = 0;         // max global norm; 0: no clipping
  int32_t bias_follows_lr = 0;  // the expert-bias rate scales with lr / (peak) lr; 0: constant
  int32_t num_micro_batches = 1;
  int32_t has_aux = 0;            // the model has a balance loss (aux inputs are read)
  int32_t has_mtp = 0;            // the model has MTP modules (mtp inputs are read)
  int32_t stop_on_nonfinite = 0;  // a non-finite step halts every later update
  // The host's values for the step being advanced, in the memory of whoever advances it (the device);
  // null: computed here (scheduled_lr, bias_correction), as the host fills the window.
  const ScheduleWindow* window = nullptr;
};

// One step's scalars. step, num_updates and halted carry over from the previous step.
struct StepScalars {
  int64_t step = 0;         // 1-based, the step these scalars are for
  int64_t num_updates = 0;  // applied updates so far, this step's included
  double lr = 0, loss = NAN, aux_loss = NAN, grad_norm = NAN;
  double mtp_loss = NAN;  // NaN without MTP modules
  double grad_scale = 1, bias_rate_scale = 0;
  float bias_correction1 = 1, bias_correction2 = 1;
  int32_t apply = 0, halted = 0;
  int64_t exchange_overflow = 0;  // rows an exchange needed past its buffers (a void step, and sticky); 0: none
};

// isfinite for host and device alike: x - x is 0 for a finite x and NaN for inf or NaN.
FLOWMOE_HOST_DEVICE inline bool is_finite_value(double x) { return x - x == 0; }

// Warmup from lr/warmup to lr over warmup_steps, then cosine decay to min_lr at total_steps.
FLOWMOE_HOST_DEVICE inline double scheduled_lr(const StepSchedule& p, int64_t step) {
  if (p.warmup_steps > 0 && step <= p.warmup_steps) return p.lr * double(step) / double(p.warmup_steps);
  const int64_t decay_steps = p.total_steps - p.warmup_steps;
  if (decay_steps <= 0) return p.lr;
  const double progress = fmin(1.0, double(step - p.warmup_steps) / double(decay_steps));
  return p.min_lr + 0.5 * (p.lr - p.min_lr) * (1.0 + cos(M_PI * progress));
}

// Adam's bias correction after t updates, 1 - beta^t, as the kernels read it (f32).
FLOWMOE_HOST_DEVICE inline float bias_correction(double beta, int64_t t) { return float(1.0 - pow(beta, double(t))); }

// The window of a step queued after `last`, the last scalars the host read back (host only): from the step
// after it and its update count on, the pending steps before the new one being 0 or more of the window's.
inline ScheduleWindow schedule_window(const StepSchedule& p, const StepScalars& last) {
  ScheduleWindow w;
  w.first_step = last.step + 1;
  w.first_update = last.num_updates;
  for (int k = 0; k < kScheduleWindow; ++k) {
    w.lr[k] = scheduled_lr(p, w.first_step + k);
    w.bias_correction1[k] = bias_correction(p.beta1, w.first_update + k);
    w.bias_correction2[k] = bias_correction(p.beta2, w.first_update + k);
  }
  return w;
}

// Entry k of a window's row; NaN outside it, which a host that filled the window for other steps would
// make a loud failure (NaN weights), not a wrong schedule.
template <typename T>
FLOWMOE_HOST_DEVICE inline T window_entry(const T (&row)[kScheduleWindow], int64_t k) {
  return k >= 0 && k < kScheduleWindow ? row[k] : T(NAN);
}

// The factor that brings a gradient of global norm `norm` down to max_norm (1 within it or at max_norm 0).
FLOWMOE_HOST_DEVICE inline double clip_factor(double norm, double max_norm) {
  if (max_norm <= 0 || !(norm > max_norm)) return 1.0;
  return max_norm / norm;
}

// Advances s to the next step, given that step's loss, balance loss (NaN: none), norm, whether every
// rank found them finite (one process: their own finiteness) and the most rows any rank's exchange needed
// past its buffers (0: none; then, or while an earlier one is sticky, the step is void); mtp: the MTP loss
// (NaN: none).
FLOWMOE_HOST_DEVICE inline void advance_step(StepScalars& s, const StepSchedule& p, double loss, double aux,
                                             double norm, bool all_finite, int32_t exchange_overflow = 0,
                                             double mtp = NAN) {
  if (exchange_overflow > 0 || s.exchange_overflow > 0) {
    if (exchange_overflow > s.exchange_overflow) s.exchange_overflow = exchange_overflow;
    s.apply = 0;
    s.bias_rate_scale = 0;
    return;
  }
  s.step += 1;
  s.loss = loss;
  s.aux_loss = aux;
  s.mtp_loss = mtp;
  s.grad_norm = norm;
  const ScheduleWindow* w = p.window;
  s.lr = w ? window_entry(w->lr, s.step - w->first_step) : scheduled_lr(p, s.step);
  if (!all_finite && p.stop_on_nonfinite) s.halted = 1;
  s.apply = all_finite && !s.halted;
  s.num_updates += s.apply;
  s.grad_scale = clip_factor(norm, p.grad_clip);
  const int64_t t = s.num_updates;
  s.bias_correction1 = w ? window_entry(w->bias_correction1, t - w->first_update) : bias_correction(p.beta1, t);
  s.bias_correction2 = w ? window_entry(w->bias_correction2, t - w->first_update) : bias_correction(p.beta2, t);
  s.bias_rate_scale = !s.apply ? 0.0 : !p.bias_follows_lr ? 1.0 : p.lr > 0 ? s.lr / p.lr : 0.0;
}

// From the step's own values: lm/aux/mtp one float per micro-batch (aux unread without p.has_aux, mtp without
// p.has_mtp), sq_sums the two squared-norm classes of AdamW::grad_square_sums, exchange_overflow [1] (or null:
// none).
FLOWMOE_HOST_DEVICE inline void advance_step_from_sums(StepScalars& s, const StepSchedule& p, const float* lm /*[A]*/,
                                                       const float* aux /*[A]*/, const float* sq_sums /*[2]*/,
                                                       const int32_t* exchange_overflow = nullptr,
                                                       const float* mtp /*[A]*/ = nullptr) {
  double lm_sum = 0, aux_sum = 0, mtp_sum = 0;
  for (int a = 0; a < p.num_micro_batches; ++a) {
    lm_sum += double(lm[a]);
    if (p.has_aux) aux_sum += double(aux[a]);
    if (p.has_mtp) mtp_sum += double(mtp[a]);
  }
  const double loss = lm_sum / double(p.num_micro_batches);
  const double aux_loss = p.has_aux ? aux_sum / double(p.num_micro_batches) : NAN;
  const double norm = sqrt(double(sq_sums[0]) + double(sq_sums[1]));
  const double objective = loss + (p.has_aux ? aux_loss : 0.0);
  advance_step(s, p, loss, aux_loss, norm, is_finite_value(objective) && is_finite_value(norm),
               exchange_overflow ? *exchange_overflow : 0, p.has_mtp ? mtp_sum / double(p.num_micro_batches) : NAN);
}

// The same on the device, in one thread: s, lm, aux and sq_sums are device pointers.
void advance_step_cuda(StepScalars* s /*[1] device*/, const StepSchedule& p, const float* lm /*[A] device*/,
                       const float* aux /*[A] device, or null without p.has_aux*/, const float* sq_sums /*[2] device*/,
                       const int32_t* exchange_overflow /*[1] device, or null*/, cudaStream_t stream,
                       const float* mtp /*[A] device, or null without p.has_mtp*/ = nullptr);

}  // namespace flowmoe
