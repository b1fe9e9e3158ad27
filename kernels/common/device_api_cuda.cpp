// CUDA runtime services for the host-side engine (see kernels/common/device_api.h).
#include "kernels/common/device_api.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

#include "kernels/common/cuda_check.h"

namespace flowmoe {

bool built_with_cuda() { return true; }

int cuda_device_count() {
  static int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // no driver or no device: clear the sticky error and report none
      return 0;
    }
    return n;
  }();
  return count;
}

bool cuda_available() { return cuda_device_count() > 0; }

static void check_index(int device) {
  FLOWMOE_CHECK(device >= 0 && device < cuda_device_count(), DeviceError, "cuda:", device, " does not exist (",
                cuda_device_count(), " CUDA devices visible)");
}

void cuda_set_device(int index) {
  check_index(index);
  FLOWMOE_CUDA_CHECK(cudaSetDevice(index));
}

int cuda_current_device() {
  int d = 0;
  FLOWMOE_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

std::string cuda_device_name(int device) {
  check_index(device);
  cudaDeviceProp prop{};
  FLOWMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

// One non-blocking compute stream per device, created on first use and kept for the process, and
// beside it the side stream. Everything the engine launches goes to the compute stream unless a side
// branch is open (engine/stream_lane.h, which also keeps freed memory from moving between the two).
namespace {

struct EngineStreams {
  cudaStream_t compute = nullptr, side = nullptr, comm = nullptr;
  cudaEvent_t marks[3] = {};  // per stream (EngineStream order), re-recorded for each wait
  cudaStream_t& operator[](EngineStream which) {
    return which == EngineStream::compute ? compute : which == EngineStream::side ? side : comm;
  }
};

EngineStreams& engine_streams(int device) {
  static std::mutex mu;
  static std::vector<EngineStreams> streams;
  std::lock_guard<std::mutex> lock(mu);
  check_index(device);
  if (streams.empty()) streams.assign(size_t(cuda_device_count()), EngineStreams{});
  EngineStreams& s = streams[size_t(device)];
  if (!s.compute) {
    int prev = cuda_current_device();
    FLOWMOE_CUDA_CHECK(cudaSetDevice(device));
    // The side stream's work fills the SMs the compute stream leaves idle (an exchange kernel waiting on
    // its peers) and does not hold the compute stream back: the block scheduler serves the compute
    // stream's blocks first.
    int least = 0, greatest = 0;
    FLOWMOE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    FLOWMOE_CUDA_CHECK(cudaStreamCreateWithPriority(&s.compute, cudaStreamNonBlocking, greatest));
    FLOWMOE_CUDA_CHECK(cudaStreamCreateWithPriority(&s.side, cudaStreamNonBlocking, least));
    // The comm stream's kernels are short and on the critical path (the next chunk's experts wait for them):
    // their blocks go first onto SMs the compute stream frees.
    FLOWMOE_CUDA_CHECK(cudaStreamCreateWithPriority(&s.comm, cudaStreamNonBlocking, greatest));
    for (cudaEvent_t& mark : s.marks) FLOWMOE_CUDA_CHECK(cudaEventCreateWithFlags(&mark, cudaEventDisableTiming));
    FLOWMOE_CUDA_CHECK(cudaSetDevice(prev));
  }
  return s;
}

thread_local bool t_on_side = false, t_on_comm = false;
std::atomic<int> g_comm_sms{0};

}  // namespace

cudaStream_t current_stream(int device) {
  const EngineStreams& s = engine_streams(device);
  return t_on_comm ? s.comm : t_on_side ? s.side : s.compute;
}

void cuda_use_side_stream(bool on) { t_on_side = on; }
bool cuda_using_side_stream() { return t_on_side; }

void cuda_use_comm_stream(bool on) { t_on_comm = on; }
bool cuda_using_comm_stream() { return t_on_comm; }

void cuda_stream_waits(int device, EngineStream waiter, EngineStream waited) {
  EngineStreams& s = engine_streams(device);
  cudaEvent_t mark = s.marks[static_cast<int>(waited)];
  FLOWMOE_CUDA_CHECK(cudaEventRecord(mark, s[waited]));
  FLOWMOE_CUDA_CHECK(cudaStreamWaitEvent(s[waiter], mark, 0));
}

cudaStream_t compute_stream(int device) { return engine_streams(device).compute; }

void cuda_set_comm_sms(int num_sms) { g_comm_sms.store(num_sms < 0 ? 0 : num_sms); }
int cuda_comm_sms() { return g_comm_sms.load(); }

void cuda_synchronize(int device) { FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(current_stream(device))); }

TimingEvent cuda_record_timing_event(int device) {
  cudaEvent_t e = nullptr;
  FLOWMOE_CUDA_CHECK(cudaEventCreate(&e));
  FLOWMOE_CUDA_CHECK(cudaEventRecord(e, current_stream(device)));
  return e;
}

float cuda_elapsed_ms(TimingEvent start, TimingEvent end) {
  float ms = 0;
  FLOWMOE_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(end)));
  FLOWMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(end)));
  return ms;
}

void cuda_destroy_timing_event(TimingEvent event) {
  if (event) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

void cuda_wait_event(TimingEvent event) { FLOWMOE_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event))); }

void* cuda_malloc_raw(size_t nbytes, int device) {
  check_index(device);
  int prev = cuda_current_device();
  FLOWMOE_CUDA_CHECK(cudaSetDevice(device));
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, nbytes);
  FLOWMOE_CUDA_CHECK(cudaSetDevice(prev));
  if (e != cudaSuccess) {
    cudaGetLastError();
    FLOWMOE_THROW(CudaError, "cudaMalloc of ", nbytes, " bytes on cuda:", device, " failed: ", cudaGetErrorString(e));
  }
  return p;
}

void cuda_free_raw(void* ptr, int device) {
  int prev = cuda_current_device();
  FLOWMOE_CUDA_CHECK(cudaSetDevice(device));
  FLOWMOE_CUDA_CHECK(cudaFree(ptr));
  FLOWMOE_CUDA_CHECK(cudaSetDevice(prev));
}

size_t cuda_free_memory(int device) {
  check_index(device);
  int prev = cuda_current_device();
  FLOWMOE_CUDA_CHECK(cudaSetDevice(device));
  size_t free_bytes = 0, total_bytes = 0;
  FLOWMOE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  FLOWMOE_CUDA_CHECK(cudaSetDevice(prev));
  return free_bytes;
}

// Copies are ordered on the engine stream of the device involved; copies that touch the host
// synchronise that stream so the host sees (or may reuse) the bytes on return.
void copy_bytes(void* dst, int dst_device, const void* src, int src_device, size_t nbytes) {
  if (nbytes == 0) return;
  if (dst_device < 0 && src_device < 0) {  // plain memcpy: must work on machines with no driver
    std::memcpy(dst, src, nbytes);
    return;
  }
  int dev = dst_device >= 0 ? dst_device : src_device;
  cudaStream_t s = current_stream(dev);
  if (dst_device >= 0 && src_device >= 0 && dst_device != src_device) {
    cuda_synchronize(src_device);  // the source may still be written on its own stream
    FLOWMOE_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_device, src, src_device, nbytes, s));
  } else {
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, s));
  }
  if (dst_device < 0 || src_device < 0) FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(s));
}

void cuda_memset(void* ptr, uint8_t byte, size_t nbytes, int device) {
  if (nbytes == 0) return;
  FLOWMOE_CUDA_CHECK(cudaMemsetAsync(ptr, byte, nbytes, current_stream(device)));
}

void* cuda_host_alloc(size_t nbytes) {
  void* p = nullptr;
  FLOWMOE_CUDA_CHECK(cudaMallocHost(&p, nbytes == 0 ? 1 : nbytes));
  return p;
}

void cuda_host_free(void* ptr) {
  if (ptr) cudaFreeHost(ptr);
}

void copy_bytes_to_device_async(void* dst, int dst_device, const void* src_pinned, size_t nbytes) {
  if (nbytes == 0) return;
  FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src_pinned, nbytes, cudaMemcpyHostToDevice, current_stream(dst_device)));
}

void copy_bytes_to_host_async(void* dst_pinned, const void* src, int src_device, size_t nbytes) {
  if (nbytes == 0) return;
  FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(dst_pinned, src, nbytes, cudaMemcpyDeviceToHost, current_stream(src_device)));
}

void cuda_begin_capture(int device) {
  FLOWMOE_CUDA_CHECK(cudaStreamBeginCapture(current_stream(device), cudaStreamCaptureModeRelaxed));
}

CudaGraph cuda_end_capture(int device) {
  cudaGraph_t graph = nullptr;
  FLOWMOE_CUDA_CHECK(cudaStreamEndCapture(current_stream(device), &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  FLOWMOE_CUDA_CHECK(e);
  return exec;
}

void cuda_abort_capture(int device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(current_stream(device), &status) != cudaSuccess) return;
  if (status == cudaStreamCaptureStatusNone) return;
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(current_stream(device), &graph);  // invalidated captures end with an error: ignored
  if (graph) cudaGraphDestroy(graph);
  cudaGetLastError();
}

bool cuda_is_capturing(int device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  FLOWMOE_CUDA_CHECK(cudaStreamIsCapturing(current_stream(device), &status));
  return status != cudaStreamCaptureStatusNone;
}

void cuda_graph_launch(CudaGraph graph, int device) {
  FLOWMOE_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), current_stream(device)));
}

void cuda_graph_destroy(CudaGraph graph) {
  if (graph) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph));
}

}  // namespace flowmoe
