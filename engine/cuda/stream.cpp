#include "engine/stream.h"

#include <utility>

#include "kernels/common/cuda_check.h"

namespace flowmoe {

Stream::Stream(int device, bool high_priority) : device_(device) {
  int prev = cuda_current_device();
  cuda_set_device(device);
  int least = 0, greatest = 0;
  FLOWMOE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  FLOWMOE_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, high_priority ? greatest : least));
  cuda_set_device(prev);
}
Stream::~Stream() {
  if (stream_) cudaStreamDestroy(stream_);  // no throw from a destructor
}
Stream::Stream(Stream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)), device_(o.device_) {}
Stream& Stream::operator=(Stream&& o) noexcept {
  if (this != &o) {
    if (stream_) cudaStreamDestroy(stream_);
    stream_ = std::exchange(o.stream_, nullptr);
    device_ = o.device_;
  }
  return *this;
}
void Stream::synchronize() const { FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

Event::Event(bool enable_timing) {
  FLOWMOE_CUDA_CHECK(cudaEventCreateWithFlags(&event_, enable_timing ? cudaEventDefault : cudaEventDisableTiming));
}
Event::~Event() {
  if (event_) cudaEventDestroy(event_);
}
Event::Event(Event&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    if (event_) cudaEventDestroy(event_);
    event_ = std::exchange(o.event_, nullptr);
  }
  return *this;
}
void Event::record(cudaStream_t stream) { FLOWMOE_CUDA_CHECK(cudaEventRecord(event_, stream)); }
void Event::wait(cudaStream_t stream) const { FLOWMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0)); }
void Event::synchronize() const { FLOWMOE_CUDA_CHECK(cudaEventSynchronize(event_)); }
float Event::elapsed_ms(const Event& end) const {
  float ms = 0;
  FLOWMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, event_, end.event_));
  return ms;
}

}  // namespace flowmoe
