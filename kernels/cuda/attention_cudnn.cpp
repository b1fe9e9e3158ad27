// cuDNN's fused SDPA as flowmoe's second bf16 attention backend (kernels/attention_cudnn.h): one forward graph
// (output and the natural-log Stats the backward reads) and one backward graph per shape and device, built the
// first time that shape is asked for and kept for the process, as cuDNN's plan building takes milliseconds and an
// execution microseconds. flowmoe's [B, T, nh, d] tensors are cuDNN's [B, nh, T, d] dims under strides
// {T·nh·d, d, nh·d, 1}, so nothing is transposed. Host code only: cudnn-frontend is a C++ header library over
// cuDNN's backend API.
#include <cudnn_frontend.h>

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "kernels/attention_cudnn.h"
#include "kernels/common/cuda_check.h"

namespace flowmoe {

namespace {

namespace fe = cudnn_frontend;

// The graphs' tensor ids, which the executions' variant packs name.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

// q/k/v/o-like [B, T, nh, d] as cuDNN's [B, nh, T, d].
fe::graph::Tensor_attributes bthd(const char* name, int64_t uid, const AttentionCudnnShape& s, int64_t d) {
  return fe::graph::Tensor_attributes()
      .set_name(name)
      .set_uid(uid)
      .set_dim({s.batch, s.num_heads, s.seq_len, d})
      .set_stride({s.seq_len * s.num_heads * d, d, s.num_heads * d, 1});
}
// lse [B, nh, T] f32 as cuDNN's Stats [B, nh, T, 1].
fe::graph::Tensor_attributes stats_attributes(const AttentionCudnnShape& s) {
  return fe::graph::Tensor_attributes()
      .set_name("stats")
      .set_uid(kStats)
      .set_dim({s.batch, s.num_heads, s.seq_len, 1})
      .set_stride({s.num_heads * s.seq_len, s.seq_len, 1, 1})
      .set_data_type(fe::DataType_t::FLOAT);
}

std::shared_ptr<fe::graph::Graph> new_graph() {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

float attention_scale(const AttentionCudnnShape& s) { return float(1.0 / std::sqrt(double(s.head_dim))); }

std::shared_ptr<fe::graph::Graph> forward_graph(const AttentionCudnnShape& s) {
  auto g = new_graph();
  auto q = g->tensor(bthd("q", kQ, s, s.head_dim));
  auto k = g->tensor(bthd("k", kK, s, s.head_dim));
  auto v = g->tensor(bthd("v", kV, s, s.v_head_dim));
  auto options = fe::graph::SDPA_attributes()
                     .set_name("flowmoe_attention_forward")
                     .set_generate_stats(true)
                     .set_attn_scale(attention_scale(s))
                     .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                     .set_diagonal_band_right_bound(0);
  auto [o, stats] = g->sdpa(q, k, v, options);
  const fe::graph::Tensor_attributes o_like = bthd("o", kO, s, s.v_head_dim);
  o->set_output(true).set_uid(kO).set_dim(o_like.get_dim()).set_stride(o_like.get_stride());
  const fe::graph::Tensor_attributes st = stats_attributes(s);
  stats->set_output(true)
      .set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim(st.get_dim())
      .set_stride(st.get_stride());
  return g;
}

std::shared_ptr<fe::graph::Graph> backward_graph(const AttentionCudnnShape& s) {
  auto g = new_graph();
  auto q = g->tensor(bthd("q", kQ, s, s.head_dim));
  auto k = g->tensor(bthd("k", kK, s, s.head_dim));
  auto v = g->tensor(bthd("v", kV, s, s.v_head_dim));
  auto o = g->tensor(bthd("o", kO, s, s.v_head_dim));
  auto d_o = g->tensor(bthd("d_o", kDO, s, s.v_head_dim));
  auto stats = g->tensor(stats_attributes(s));
  // Deterministic: flowmoe's recomputation and CUDA-graph replays promise the same gradients bit for bit.
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("flowmoe_attention_backward")
                     .set_attn_scale(attention_scale(s))
                     .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                     .set_diagonal_band_right_bound(0)
                     .set_deterministic_algorithm(true);
  auto [d_q, d_k, d_v] = g->sdpa_backward(q, k, v, o, d_o, stats, options);
  for (auto [t, uid, d] :
       {std::tuple{d_q, kDQ, s.head_dim}, std::tuple{d_k, kDK, s.head_dim}, std::tuple{d_v, kDV, s.v_head_dim}}) {
    const fe::graph::Tensor_attributes like = bthd("grad", uid, s, d);
    t->set_output(true).set_uid(uid).set_dim(like.get_dim()).set_stride(like.get_stride());
  }
  return g;
}

// "" when the graph is built and cuDNN supports it, else cuDNN's reason (the steps run in order, up to a failure).
std::string build(fe::graph::Graph& g, cudnnHandle_t handle) {
  std::string why;
  const auto failed = [&](fe::error_t e) {  // by value: error_t's get_message is not const
    if (e.is_good()) return false;
    why = e.get_message().empty() ? "cuDNN refused the graph" : e.get_message();
    return true;
  };
  if (failed(g.validate()) || failed(g.build_operation_graph(handle)) ||
      failed(g.create_execution_plans({fe::HeurMode_t::A})) || failed(g.check_support(handle)) ||
      failed(g.build_plans(handle)))
    return why;
  return "";
}

struct Plans {
  std::shared_ptr<fe::graph::Graph> forward, backward;
  int64_t forward_workspace = 0, backward_workspace = 0;
  std::string why_not;  // "" when both graphs are built and supported
};

struct Cache {
  std::mutex mutex;                      // the maps, and each handle from its set_stream to its execute
  std::map<int, cudnnHandle_t> handles;  // one per device, never destroyed (cuDNN tears down with the process)
  std::map<std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t>, Plans> plans;
};
Cache& cache() {
  static Cache* c = new Cache();  // leaked: the handles must outlive every static destructor that could run a graph
  return *c;
}

void check_cudnn(cudnnStatus_t status, const char* what) {
  FLOWMOE_CHECK(status == CUDNN_STATUS_SUCCESS, CudaError, what, " failed: ", cudnnGetErrorString(status));
}

int current_device() {
  int device = 0;
  FLOWMOE_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

// The current device's handle (the cache's mutex held).
cudnnHandle_t handle_locked(int device) {
  auto [it, fresh] = cache().handles.try_emplace(device, nullptr);
  if (fresh) {
    try {
      check_cudnn(cudnnCreate(&it->second), "cudnnCreate");
    } catch (...) {
      cache().handles.erase(it);
      throw;
    }
  }
  return it->second;
}

// The shape's plans on the current device (the cache's mutex held), built on first use.
const Plans& plans_locked(const AttentionCudnnShape& s) {
  const int device = current_device();
  const auto key = std::tuple{device, s.batch, s.seq_len, s.num_heads, s.head_dim, s.v_head_dim};
  auto found = cache().plans.find(key);
  if (found != cache().plans.end()) return found->second;
  Plans p;
  if (s.batch < 1 || s.seq_len < 1 || s.num_heads < 1 || s.head_dim < 1 || s.v_head_dim < 1) {
    p.why_not = "an empty shape";
  } else {
    // A cuDNN that cannot start here (no handle: a driver or GPU it does not support) refuses every shape, so
    // `auto` falls back to the flash kernels instead of failing the run.
    cudnnHandle_t handle = nullptr;
    try {
      handle = handle_locked(device);
    } catch (const CudaError& e) {
      p.why_not = e.what();
      return cache().plans.emplace(key, std::move(p)).first->second;
    }
    p.forward = forward_graph(s);
    p.backward = backward_graph(s);
    p.why_not = build(*p.forward, handle);
    if (p.why_not.empty()) p.why_not = build(*p.backward, handle);
    if (p.why_not.empty() && (p.forward->get_workspace_size(p.forward_workspace).is_bad() ||
                              p.backward->get_workspace_size(p.backward_workspace).is_bad()))
      p.why_not = "cuDNN gave no workspace size";
  }
  return cache().plans.emplace(key, std::move(p)).first->second;
}

std::string shape_text(const AttentionCudnnShape& s) {
  return detail::cat("[", s.batch, ", ", s.seq_len, ", ", s.num_heads, ", ", s.head_dim, "] with v head ",
                     s.v_head_dim);
}

const Plans& supported_plans_locked(const AttentionCudnnShape& s, const char* what) {
  const Plans& p = plans_locked(s);
  FLOWMOE_CHECK(p.why_not.empty(), Error, what, ": cuDNN does not run causal bf16 attention of q ", shape_text(s),
                " on this device: ", p.why_not);
  return p;
}

void execute_locked(const fe::graph::Graph& g, std::unordered_map<int64_t, void*>& pack, void* workspace,
                    cudaStream_t stream, const char* what) {
  cudnnHandle_t handle = handle_locked(current_device());
  check_cudnn(cudnnSetStream(handle, stream), "cudnnSetStream");
  fe::error_t e = g.execute(handle, pack, workspace);
  FLOWMOE_CHECK(e.is_good(), CudaError, what, ": cuDNN's execute failed: ", e.get_message());
}

}  // namespace

bool attention_cudnn_built() { return true; }

bool attention_cudnn_supports(const AttentionCudnnShape& shape, std::string* why) {
  std::lock_guard<std::mutex> lock(cache().mutex);
  const Plans& p = plans_locked(shape);
  if (why) *why = p.why_not;
  return p.why_not.empty();
}

int64_t attention_cudnn_workspace_bytes(const AttentionCudnnShape& shape, bool backward) {
  std::lock_guard<std::mutex> lock(cache().mutex);
  const Plans& p = supported_plans_locked(shape, "attention_cudnn_workspace_bytes");
  return backward ? p.backward_workspace : p.forward_workspace;
}

void attention_forward_cudnn(void* out, float* lse, const void* q, const void* k, const void* v,
                             const AttentionCudnnShape& shape, void* workspace, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(cache().mutex);
  const Plans& p = supported_plans_locked(shape, "attention_forward_cudnn");
  std::unordered_map<int64_t, void*> pack = {
      {kQ, const_cast<void*>(q)}, {kK, const_cast<void*>(k)}, {kV, const_cast<void*>(v)}, {kO, out}, {kStats, lse}};
  execute_locked(*p.forward, pack, workspace, stream, "attention_forward_cudnn");
}

void attention_backward_cudnn(void* d_q, void* d_k, void* d_v, const void* d_out, const void* q, const void* k,
                              const void* v, const void* out, const float* lse, const AttentionCudnnShape& shape,
                              void* workspace, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(cache().mutex);
  const Plans& p = supported_plans_locked(shape, "attention_backward_cudnn");
  std::unordered_map<int64_t, void*> pack = {{kQ, const_cast<void*>(q)},
                                             {kK, const_cast<void*>(k)},
                                             {kV, const_cast<void*>(v)},
                                             {kO, const_cast<void*>(out)},
                                             {kDO, const_cast<void*>(d_out)},
                                             {kStats, const_cast<float*>(lse)},
                                             {kDQ, d_q},
                                             {kDK, d_k},
                                             {kDV, d_v}};
  execute_locked(*p.backward, pack, workspace, stream, "attention_backward_cudnn");
}

}  // namespace flowmoe
