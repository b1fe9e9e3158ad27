// Stream and Event in a build without CUDA: no tensor can live on a device there, so nothing that
// needs one is reached; a constructor that is reached says what is missing (engine/stream.h).
#include "engine/stream.h"

#include <utility>

namespace flowmoe {

Stream::Stream(int device, bool) : device_(device) { throw_no_cuda("Stream"); }
Stream::~Stream() = default;
Stream::Stream(Stream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)), device_(o.device_) {}
Stream& Stream::operator=(Stream&& o) noexcept {
  stream_ = std::exchange(o.stream_, nullptr);
  device_ = o.device_;
  return *this;
}
void Stream::synchronize() const { throw_no_cuda("Stream::synchronize"); }

Event::Event(bool) { throw_no_cuda("Event"); }
Event::~Event() = default;
Event::Event(Event&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
Event& Event::operator=(Event&& o) noexcept {
  event_ = std::exchange(o.event_, nullptr);
  return *this;
}
void Event::record(cudaStream_t) { throw_no_cuda("Event::record"); }
void Event::wait(cudaStream_t) const { throw_no_cuda("Event::wait"); }
void Event::synchronize() const { throw_no_cuda("Event::synchronize"); }
float Event::elapsed_ms(const Event&) const { throw_no_cuda("Event::elapsed_ms"); }

}  // namespace flowmoe
