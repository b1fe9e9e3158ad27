// The optimizer step's scalars where the weights live (kernels/step_control.h), and their way back to the
// host a step later. On one GPU the loss, the gradient norm, the clip factor, the skip decision, the
// learning rate and the expert-bias rate never visit the host during a step: AdamW and the bias update
// read them on the device, and the host reads them (with the MoE loads) from pinned memory once a later
// step is queued. On the CPU, under several ranks or with test hooks, the host computes them instead.
#pragma once
#include <cstdint>
#include <deque>
#include <vector>

#include "engine/device.h"
#include "engine/tensor.h"
#include "kernels/common/device_api.h"
#include "kernels/step_control.h"
#include "parallel/communicator.h"

namespace flowmoe {

// A step's scalars and its MoE layers' loads, as the host reads them.
struct StepReadout {
  StepScalars scalars;
  std::vector<std::vector<int64_t>> loads;  // per MoE layer, [E]
};

class StepState {
 public:
  StepState(Device device, const StepSchedule& schedule);
  ~StepState();
  StepState(const StepState&) = delete;
  StepState& operator=(const StepState&) = delete;

  // The next step is `last_step + 1`, after `num_updates` applied updates (a start, or a resume).
  void reset(int64_t last_step, int64_t num_updates);
  // The device path, before each step is queued and outside a graph capture: the learning rates and bias
  // corrections it may read (kernels/step_control.h, ScheduleWindow), copied from pinned memory of the
  // step's own on the stream, so the host neither waits nor holds a table of every step.
  void prepare_device_step();
  // Where the parameters' device reads the scalars: device memory on a GPU, host memory on the CPU.
  const StepScalars* scalars() const;

  // The device path. Micro-batch a's losses (f32 scalars on the device; aux undefined without a
  // balance loss, mtp without MTP modules) go to the step's slots; advance_on_device then computes the
  // scalars from them and the gradients' squared-norm sums ([2] on the device).
  void record_losses(int64_t micro_batch, const Tensor& lm, const Tensor& aux, const Tensor& mtp = Tensor());
  // Several ranks: the recorded losses become their means over `world`'s ranks (each rank's slice
  // holds as many tokens), by a sum on the device; a NaN on any rank reaches every rank.
  void reduce_losses(Communicator& world);
  // exchange_overflow: the most rows a zero-sync exchange of the step needed past its buffers, agreed by every
  // rank ([1] i32 on the device, or null: none); nonzero voids the step (kernels/step_control.h).
  void advance_on_device(const float* sq_sums /*[2] device*/, const int32_t* exchange_overflow = nullptr);
  // The host path: from values the host has (several ranks agreed on them, or the CPU computed them);
  // aux is NaN without a balance loss, mtp without MTP modules.
  void advance_on_host(double loss, double aux, double norm, bool all_finite, int64_t exchange_overflow = 0,
                       double mtp = NAN);
  // After a void step has been read back and nothing is pending: the next step goes on from the last applied
  // one (a host write to the device's scalars; the trainer runs the void steps again).
  void clear_exchange_overflow();

  // The device path's inputs: a device copy of `host` (a CPU tensor), queued from pinned memory that
  // belongs to the step being issued, so the host does not wait for the device to take it.
  Tensor upload(const Tensor& host);
  // The same into an existing device tensor of host's shape and dtype (a captured step's static inputs).
  void upload_into(const Tensor& host, Tensor& device_tensor);

  // Queues the copy of the scalars and the loads to the host, after the step's last kernel.
  void snapshot(const std::vector<Tensor>& loads);
  int64_t num_pending() const { return int64_t(pending_.size()); }
  // Waits for the oldest snapshot and returns it.
  StepReadout complete();

 private:
  struct Slot {
    StepScalars* scalars = nullptr;  // pinned host memory on a GPU
    int32_t* loads = nullptr;        // pinned, [num_layers, E]
    size_t loads_capacity = 0;       // int32s
    std::vector<int64_t> layer_sizes;
    TimingEvent done = nullptr;
    std::vector<std::pair<void*, size_t>> staging;  // pinned input buffers and their bytes, by upload
    size_t num_uploads = 0;                         // used by the step being issued
  };
  Device device_;
  StepSchedule schedule_;         // the host computes each step's values
  StepSchedule device_schedule_;  // the device reads them from device_window_
  Tensor device_window_;          // u8 [sizeof(ScheduleWindow)] on a GPU
  bool window_prepared_ = false;  // for the step being queued
  StepScalars host_;              // the CPU's scalars, or the last ones the host path computed
  Tensor device_scalars_;         // u8 [sizeof(StepScalars)] on a GPU
  Tensor loss_slots_;             // f32 [3 * micro-batches] on a GPU: lm, aux, then mtp
  std::vector<Slot> slots_;
  std::deque<size_t> pending_;  // slot indices, oldest first
  size_t next_slot_ = 0;
  // Queues a copy of `bytes` from src to dst (device memory) through pinned staging of the step being queued.
  void stage_to_device(const void* src, size_t bytes, void* dst);
};

}  // namespace flowmoe
