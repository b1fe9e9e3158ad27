// CPU-only build: there is no device, and every device service says so clearly.
#include <cstring>

#include "kernels/common/device_api.h"

namespace flowmoe {

[[noreturn]] static void no_cuda(const char* what) { throw_no_cuda(what); }

bool built_with_cuda() { return false; }
int cuda_device_count() { return 0; }
bool cuda_available() { return false; }
void cuda_set_device(int) { no_cuda("cuda_set_device"); }
int cuda_current_device() { no_cuda("cuda_current_device"); }
std::string cuda_device_name(int) { no_cuda("cuda_device_name"); }
cudaStream_t current_stream(int) { no_cuda("current_stream"); }
// No side stream here, but the flag is kept: autograd tags the ops of a side branch on the CPU too.
static thread_local bool t_on_side = false;
void cuda_use_side_stream(bool on) { t_on_side = on; }
bool cuda_using_side_stream() { return t_on_side; }
static thread_local bool t_on_comm = false;
void cuda_use_comm_stream(bool on) { t_on_comm = on; }
bool cuda_using_comm_stream() { return t_on_comm; }
void cuda_stream_waits(int, EngineStream, EngineStream) { no_cuda("cuda_stream_waits"); }
cudaStream_t compute_stream(int) { no_cuda("compute_stream"); }
static int g_comm_sms = 0;
void cuda_set_comm_sms(int num_sms) { g_comm_sms = num_sms; }
int cuda_comm_sms() { return g_comm_sms; }
void cuda_synchronize(int) { no_cuda("cuda_synchronize"); }
TimingEvent cuda_record_timing_event(int) { no_cuda("cuda_record_timing_event"); }
float cuda_elapsed_ms(TimingEvent, TimingEvent) { no_cuda("cuda_elapsed_ms"); }
void cuda_destroy_timing_event(TimingEvent) {}
void cuda_wait_event(TimingEvent) { no_cuda("cuda_wait_event"); }
void* cuda_malloc_raw(size_t, int) { no_cuda("cuda_malloc"); }
void cuda_free_raw(void*, int) { no_cuda("cuda_free"); }
size_t cuda_free_memory(int) { no_cuda("cuda_free_memory"); }
void copy_bytes(void* dst, int dst_device, const void* src, int src_device, size_t nbytes) {
  if (dst_device >= 0 || src_device >= 0) no_cuda("copy to/from a CUDA device");
  if (nbytes) std::memcpy(dst, src, nbytes);
}
void cuda_memset(void*, uint8_t, size_t, int) { no_cuda("cuda_memset"); }
void cuda_begin_capture(int) { no_cuda("cuda_begin_capture"); }
CudaGraph cuda_end_capture(int) { no_cuda("cuda_end_capture"); }
void cuda_abort_capture(int) {}
bool cuda_is_capturing(int) { return false; }
void cuda_graph_launch(CudaGraph, int) { no_cuda("cuda_graph_launch"); }
void cuda_graph_destroy(CudaGraph) {}
void* cuda_host_alloc(size_t) { no_cuda("cuda_host_alloc"); }
void cuda_host_free(void*) {}
void copy_bytes_to_host_async(void*, const void*, int, size_t) { no_cuda("copy_bytes_to_host_async"); }
void copy_bytes_to_device_async(void*, int, const void*, size_t) { no_cuda("copy_bytes_to_device_async"); }

}  // namespace flowmoe
