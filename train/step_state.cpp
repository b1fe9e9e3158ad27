// The optimizer step's scalars on the device and their readout a step later (see step_state.h).
#include "train/step_state.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/ops/ops.h"
#include "kernels/common/error.h"

namespace flowmoe {

namespace {
constexpr size_t kNumSlots = 2;  // the step being queued and the one before it
}

StepState::StepState(Device device, const StepSchedule& schedule)
    : device_(device), schedule_(schedule), device_schedule_(schedule), slots_(kNumSlots) {
  FLOWMOE_CHECK(schedule.num_micro_batches >= 1, Error, "StepState: ", schedule.num_micro_batches, " micro-batches");
  if (!device_.is_cuda()) return;
  device_window_ = Tensor::zeros({int64_t(sizeof(ScheduleWindow))}, DType::u8, device_);
  device_schedule_.window = static_cast<const ScheduleWindow*>(device_window_.raw_data());
  device_scalars_ = Tensor::zeros({int64_t(sizeof(StepScalars))}, DType::u8, device_);
  loss_slots_ = Tensor::zeros({3 * int64_t(schedule.num_micro_batches)}, DType::f32, device_);
  for (Slot& s : slots_) s.scalars = static_cast<StepScalars*>(cuda_host_alloc(sizeof(StepScalars)));
}

StepState::~StepState() {
  for (Slot& s : slots_) {
    cuda_destroy_timing_event(s.done);
    if (device_.is_cuda()) {
      cuda_host_free(s.scalars);
      cuda_host_free(s.loads);
      for (auto& [buf, bytes] : s.staging) cuda_host_free(buf);
    } else {
      delete s.scalars;
      delete[] s.loads;
    }
  }
}

void StepState::reset(int64_t last_step, int64_t num_updates) {
  FLOWMOE_CHECK(pending_.empty(), Error, "StepState::reset with ", pending_.size(), " steps still pending");
  host_ = StepScalars{};
  host_.step = last_step;
  host_.num_updates = num_updates;
  if (device_.is_cuda()) copy_bytes(device_scalars_.raw_data(), device_.index, &host_, -1, sizeof(StepScalars));
}

// The step being queued is step host_.step + 1 + k and leaves num_updates at host_.num_updates + k' for k
// up to the steps still pending and k' up to one more (each pending step and this one may or may not count;
// host_ holds the last scalars read back).
static_assert(kNumSlots + 1 <= size_t(kScheduleWindow), "the schedule window must cover every pending step");

void StepState::prepare_device_step() {
  FLOWMOE_CHECK(device_.is_cuda(), Error, "StepState::prepare_device_step on ", device_.str());
  const ScheduleWindow w = schedule_window(schedule_, host_);
  stage_to_device(&w, sizeof w, device_window_.raw_data());
  window_prepared_ = true;
}

const StepScalars* StepState::scalars() const {
  return device_.is_cuda() ? static_cast<const StepScalars*>(device_scalars_.raw_data()) : &host_;
}

void StepState::record_losses(int64_t micro_batch, const Tensor& lm, const Tensor& aux, const Tensor& mtp) {
  FLOWMOE_CHECK(device_.is_cuda() && micro_batch >= 0 && micro_batch < schedule_.num_micro_batches, Error,
                "StepState::record_losses: micro-batch ", micro_batch, " of ", schedule_.num_micro_batches, " on ",
                device_.str());
  const auto put = [&](const Tensor& t, int64_t slot) {
    FLOWMOE_CHECK(t.numel() == 1 && t.dtype() == DType::f32 && t.device() == device_, DTypeError,
                  "StepState: a loss must be an f32 scalar on ", device_.str(), ", got ", t.describe());
    Tensor c = t.contiguous();
    copy_bytes(loss_slots_.data<float>() + slot, device_.index, c.raw_data(), device_.index, sizeof(float));
  };
  put(lm, micro_batch);
  schedule_.has_aux = aux.defined();  // the same for every micro-batch of a model
  if (aux.defined()) put(aux, schedule_.num_micro_batches + micro_batch);
  schedule_.has_mtp = mtp.defined();
  if (mtp.defined()) put(mtp, 2 * schedule_.num_micro_batches + micro_batch);
}

void StepState::reduce_losses(Communicator& world) {
  if (world.size() == 1) return;
  world.all_reduce(loss_slots_, ReduceOp::sum);
  loss_slots_.copy_(tensor_scale(loss_slots_, 1.0 / double(world.size())));
}

void StepState::advance_on_device(const float* sq_sums, const int32_t* exchange_overflow) {
  FLOWMOE_CHECK(device_.is_cuda() && window_prepared_, Error, "StepState::advance_on_device on ", device_.str(),
                window_prepared_ ? "" : " before prepare_device_step");
  const float* lm = loss_slots_.data<float>();
  device_schedule_.has_aux = schedule_.has_aux;
  device_schedule_.has_mtp = schedule_.has_mtp;
  advance_step_cuda(static_cast<StepScalars*>(device_scalars_.raw_data()), device_schedule_, lm,
                    schedule_.has_aux ? lm + schedule_.num_micro_batches : nullptr, sq_sums, exchange_overflow,
                    current_stream(device_.index), schedule_.has_mtp ? lm + 2 * schedule_.num_micro_batches : nullptr);
}

void StepState::advance_on_host(double loss, double aux, double norm, bool all_finite, int64_t exchange_overflow,
                                double mtp) {
  FLOWMOE_CHECK(pending_.empty() || !device_.is_cuda(), Error,
                "StepState: the host path needs the previous step's scalars read back first");
  advance_step(host_, schedule_, loss, aux, norm, all_finite, int32_t(exchange_overflow), mtp);
  if (device_.is_cuda()) copy_bytes(device_scalars_.raw_data(), device_.index, &host_, -1, sizeof(StepScalars));
}

void StepState::clear_exchange_overflow() {
  FLOWMOE_CHECK(pending_.empty(), Error, "StepState::clear_exchange_overflow with ", pending_.size(),
                " steps still pending");
  host_.exchange_overflow = 0;  // host_ holds the last read-back (void) scalars: those of the last applied step
  if (device_.is_cuda()) copy_bytes(device_scalars_.raw_data(), device_.index, &host_, -1, sizeof(StepScalars));
}

Tensor StepState::upload(const Tensor& host) {
  Tensor out = Tensor::empty(host.shape(), host.dtype(), device_);
  upload_into(host, out);
  return out;
}

void StepState::upload_into(const Tensor& host, Tensor& out) {
  FLOWMOE_CHECK(device_.is_cuda() && host.device().is_cpu() && out.device() == device_ && out.shape() == host.shape() &&
                    out.dtype() == host.dtype() && out.is_contiguous(),
                Error, "StepState::upload: ", host.describe(), " into ", out.describe());
  Tensor src = host.contiguous();
  stage_to_device(src.raw_data(), size_t(src.numel()) * dtype_size(src.dtype()), out.raw_data());
}

void StepState::stage_to_device(const void* src, size_t bytes, void* dst) {
  FLOWMOE_CHECK(pending_.size() < slots_.size(), Error, "StepState: ", pending_.size(), " steps already pending");
  // This slot's previous step was read back (complete()) before this one was issued: its copies are done.
  Slot& s = slots_[next_slot_];
  if (s.num_uploads == s.staging.size()) s.staging.emplace_back(nullptr, 0);
  auto& [buf, capacity] = s.staging[s.num_uploads++];
  if (capacity < bytes) {
    cuda_host_free(buf);
    buf = cuda_host_alloc(bytes);
    capacity = bytes;
  }
  std::memcpy(buf, src, bytes);
  copy_bytes_to_device_async(dst, device_.index, buf, bytes);
}

void StepState::snapshot(const std::vector<Tensor>& loads) {
  FLOWMOE_CHECK(pending_.size() < slots_.size(), Error, "StepState: ", pending_.size(), " steps already pending");
  Slot& s = slots_[next_slot_];
  s.num_uploads = 0;  // the next step that takes this slot starts its uploads again
  window_prepared_ = false;
  next_slot_ = (next_slot_ + 1) % slots_.size();
  size_t total = 0;
  s.layer_sizes.clear();
  for (const Tensor& l : loads) {
    FLOWMOE_CHECK(l.dtype() == DType::i32 && l.dim() == 1 && l.device() == device_, DTypeError,
                  "StepState: loads must be [E] i32 on ", device_.str(), ", got ", l.describe());
    s.layer_sizes.push_back(l.numel());
    total += size_t(l.numel());
  }
  if (!device_.is_cuda()) {
    // The CPU has finished the step: read everything now.
    if (!s.scalars) s.scalars = new StepScalars;
    *s.scalars = host_;
    if (s.loads_capacity < total) {
      delete[] s.loads;
      s.loads = new int32_t[total];
      s.loads_capacity = total;
    }
  } else {
    if (s.loads_capacity < total) {
      cuda_host_free(s.loads);
      s.loads = static_cast<int32_t*>(cuda_host_alloc(total * sizeof(int32_t)));
      s.loads_capacity = total;
    }
    copy_bytes_to_host_async(s.scalars, device_scalars_.raw_data(), device_.index, sizeof(StepScalars));
  }
  size_t at = 0;
  for (const Tensor& l : loads) {
    Tensor c = l.contiguous();
    if (device_.is_cuda())
      copy_bytes_to_host_async(s.loads + at, c.raw_data(), device_.index, size_t(c.numel()) * sizeof(int32_t));
    else
      std::memcpy(s.loads + at, c.raw_data(), size_t(c.numel()) * sizeof(int32_t));
    at += size_t(c.numel());
  }
  if (device_.is_cuda()) {
    cuda_destroy_timing_event(s.done);
    s.done = cuda_record_timing_event(device_.index);
  }
  pending_.push_back(size_t(&s - slots_.data()));
}

StepReadout StepState::complete() {
  FLOWMOE_CHECK(!pending_.empty(), Error, "StepState::complete: no step pending");
  Slot& s = slots_[pending_.front()];
  pending_.pop_front();
  if (s.done) cuda_wait_event(s.done);
  StepReadout r;
  r.scalars = *s.scalars;
  if (device_.is_cuda()) host_ = r.scalars;  // the host path continues from the device's scalars
  size_t at = 0;
  for (int64_t n : s.layer_sizes) {
    r.loads.emplace_back(s.loads + at, s.loads + at + n);
    at += size_t(n);
  }
  return r;
}

}  // namespace flowmoe
