// RAII wrappers for CUDA streams and events (engine/cuda/stream.cpp; without CUDA, engine/stream_none.cpp
// throws from every constructor).
// The engine itself runs on one stream per device (current_stream); these are for overlap work
// (communication streams) and for timing in bench/.
#pragma once
#include "kernels/common/device_api.h"

typedef struct CUevent_st* cudaEvent_t;

namespace flowmoe {

class Stream {
 public:
  // A new non-blocking stream on that device; high_priority: as the engine's compute stream's (the
  // highest), whose blocks the GPU schedules before those of other streams.
  explicit Stream(int device, bool high_priority = false);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  Stream(Stream&& o) noexcept;
  Stream& operator=(Stream&& o) noexcept;
  cudaStream_t get() const { return stream_; }
  int device() const { return device_; }
  void synchronize() const;

 private:
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
};

class Event {
 public:
  explicit Event(bool enable_timing = false);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  Event(Event&& o) noexcept;
  Event& operator=(Event&& o) noexcept;
  void record(cudaStream_t stream);
  void wait(cudaStream_t stream) const;  // make `stream` wait for this event (no host sync)
  void synchronize() const;
  float elapsed_ms(const Event& end) const;  // this -> end, both recorded and complete
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace flowmoe
