// The few CUDA runtime services the host-side engine needs, behind a header that compiles without
// CUDA. With FLOWMOE_WITH_CUDA they are implemented in kernels/common/device_api_cuda.cpp; without it,
// kernels/common/device_api_none.cpp answers "no device" and throws DeviceError on any use.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

// Same declaration as cuda_runtime_api.h, so launchers can be declared in host-only headers.
typedef struct CUstream_st* cudaStream_t;

namespace flowmoe {

bool built_with_cuda();
// What eval_gpu does in a CPU-only build (it is unreachable there: no tensor can live on a device).
[[noreturn]] void throw_no_cuda(const char* what);
int cuda_device_count();  // 0 when not built with CUDA or no device/driver is present
bool cuda_available();    // cuda_device_count() > 0

void cuda_set_device(int index);
int cuda_current_device();
// The name the driver gives the device ("NVIDIA H100 80GB HBM3"): what picks its peak FLOP/s (train/model_flops.h).
std::string cuda_device_name(int device);
cudaStream_t current_stream(int device);  // the engine's compute stream on that device (or its side stream)
// A second engine stream per device, for a branch of work that runs beside the compute stream (the shared
// experts beside the exchange: engine/stream_lane.h). While this thread has it on, current_stream returns
// the side stream (a build without CUDA keeps the flag alone).
void cuda_use_side_stream(bool on);
bool cuda_using_side_stream();
// A third engine stream per device, for data movement between GPUs that runs beside the compute stream (the
// expert exchange of token chunks or dual micro-batches: engine/stream_lane.h). It has the compute stream's
// priority. While this thread has it on, current_stream returns it; the compute stream waits for it through
// an event recorded on it (Event, engine/stream.h).
void cuda_use_comm_stream(bool on);
bool cuda_using_comm_stream();
// The engine's three streams on a device; `waiter` waits for the work `waited` has been given so far (an
// event recorded now). No host sync.
enum class EngineStream { compute, side, comm };
void cuda_stream_waits(int device, EngineStream waiter, EngineStream waited);
cudaStream_t compute_stream(int device);  // the engine's compute stream, whichever stream this thread now uses
// SMs the persistent grouped GEMMs leave free for communication kernels running beside them (0: they take
// every SM). Process-wide; set once, before the first step (the GEMMs' workspaces are sized for all SMs).
void cuda_set_comm_sms(int num_sms);
int cuda_comm_sms();
void cuda_synchronize(int device);  // waits for the engine's stream on that device
// Timing events on the engine's stream (the step profiler, engine/profiler.h): one recorded now on
// that device's stream; the milliseconds between two, waiting for the later one; freeing one.
using TimingEvent = void*;
TimingEvent cuda_record_timing_event(int device);
float cuda_elapsed_ms(TimingEvent start, TimingEvent end);
void cuda_destroy_timing_event(TimingEvent event);
// Waits on the host until the work before the event is done (a completion marker, not a timer).
void cuda_wait_event(TimingEvent event);

void* cuda_malloc_raw(size_t nbytes, int device);  // throws CudaError with the size on failure
void cuda_free_raw(void* ptr, int device);
// Bytes the driver reports free on the device (cudaMemGetInfo): what new allocations can still get.
size_t cuda_free_memory(int device);

// Byte copies. kind is inferred from the two pointers' devices; -1 means host.
void copy_bytes(void* dst, int dst_device, const void* src, int src_device, size_t nbytes);
void cuda_memset(void* ptr, uint8_t byte, size_t nbytes, int device);  // every byte = byte
// Page-locked host memory, which copies_to_host_async needs to stay asynchronous.
void* cuda_host_alloc(size_t nbytes);
void cuda_host_free(void* ptr);
// Queues a device -> pinned host copy on the device's engine stream and returns at once: read dst only
// after an event recorded later on that stream has completed (cuda_wait_event).
void copy_bytes_to_host_async(void* dst_pinned, const void* src, int src_device, size_t nbytes);
// The other way: a pinned host -> device copy queued on the device's engine stream; src must stay
// unchanged until the stream has passed it.
void copy_bytes_to_device_async(void* dst, int dst_device, const void* src_pinned, size_t nbytes);

// CUDA graphs of the engine stream: begin_capture records (relaxed mode: this thread may still
// allocate) instead of running; end_capture returns the instantiated graph, or throws CudaError with the
// reason when something in between could not be captured (a host synchronisation, say). abort_capture
// ends a capture that threw, leaving the stream usable.
using CudaGraph = void*;
void cuda_begin_capture(int device);
CudaGraph cuda_end_capture(int device);
void cuda_abort_capture(int device);
bool cuda_is_capturing(int device);  // the engine stream of that device is being captured
void cuda_graph_launch(CudaGraph graph, int device);
void cuda_graph_destroy(CudaGraph graph);

// Host synchronisations the engine makes (e.g. reading per-expert counts once per layer so cuBLASLt
// gets each expert's M). Every read of a GPU tensor into host memory calls note_host_sync()
// (Tensor::copy_, under to_floats, to_ints and to(cpu)); the trainer reports the count per step in
// the metrics and captures a step as a CUDA graph only where an eager step counted none.
void note_host_sync();
uint64_t num_host_syncs();

}  // namespace flowmoe
