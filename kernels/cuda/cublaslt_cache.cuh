// The cuBLASLt plumbing that kernels/cuda/linear.cu (BF16/f32 GEMM) and fp8_grouped_linear.cu (FP8
// block-scaled GEMMs) share: operand alignment, plan-key hashing, row-count buckets (kernels/plan_keys.h), and the
// two-level cache of handles, workspaces, heuristic answers and plans. Each .cu defines its own PlanKey, Choice (what a
// heuristic query returns) and Plan (descriptors + choice) and instantiates LtCache with them, so the two GEMM families
// keep separate caches.
//   shared (per device, all host threads, under mutex()): the handle, one workspace per stream (GEMMs
//          on two streams may overlap), and the heuristic's answers, keyed by problem
//   thread (per device and host thread, no lock): the built plans and this thread's view of the
//          workspaces. A repeat GEMM is one hash lookup here plus cublasLtMatmul.
// Nothing is freed: releasing handles or workspaces at exit would race CUDA's own teardown.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kernels/common/cuda_check.h"
#include "kernels/common/device_api.h"
#include "kernels/plan_keys.h"  // alignment_of, hash_mix, quarter_octave_bucket: host logic, tested on the CPU

namespace flowmoe {

constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;  // cuBLAS's recommendation for Hopper

// A heuristic query's preference: kLtWorkspaceBytes of workspace and the four operands' alignments in bytes
// (A, B, C, D as cuBLASLt names them: a caller that swaps operands passes them swapped).
inline void init_lt_preference(cublasLtMatmulPreferenceOpaque_t& pref, uint32_t align_a, uint32_t align_b,
                               uint32_t align_c, uint32_t align_d) {
  FLOWMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceInit(&pref));
  uint64_t ws_bytes = kLtWorkspaceBytes;
  FLOWMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(&pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                            sizeof(ws_bytes)));
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}};
  for (const auto& [attr, value] : aligns)
    FLOWMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(&pref, attr, &value, sizeof(value)));
}

template <class Key, class KeyHash, class Choice, class Plan>
struct LtCache {
  struct Shared {
    cublasLtHandle_t handle = nullptr;
    std::unordered_map<cudaStream_t, void*> workspaces;
    // The heuristic's answer (nothing: no algorithm) for each problem queried as given.
    std::unordered_map<Key, std::optional<Choice>, KeyHash> choices;
  };
  struct Thread {
    int device = 0;
    cublasLtHandle_t handle = nullptr;
    std::unordered_map<Key, Plan, KeyHash> plans;
    std::vector<std::pair<cudaStream_t, void*>> workspaces;  // this thread's copy of the shared entries
  };

  static std::mutex& mutex() {  // guards every Shared
    static std::mutex mu;
    return mu;
  }

  static Shared& shared(int device) {  // call with mutex() held
    static std::vector<std::unique_ptr<Shared>> devices;
    if (devices.size() <= size_t(device)) devices.resize(size_t(device) + 1);
    auto& dev = devices[size_t(device)];
    if (!dev) {
      auto fresh = std::make_unique<Shared>();
      FLOWMOE_CUBLAS_CHECK(cublasLtCreate(&fresh->handle));
      dev = std::move(fresh);
    }
    return *dev;
  }

  static Thread& thread(int device) {
    thread_local std::vector<std::unique_ptr<Thread>> devices;
    if (size_t(device) < devices.size() && devices[size_t(device)]) return *devices[size_t(device)];
    auto td = std::make_unique<Thread>();
    td->device = device;
    {
      std::lock_guard<std::mutex> lock(mutex());
      td->handle = shared(device).handle;
    }
    if (devices.size() <= size_t(device)) devices.resize(size_t(device) + 1);
    devices[size_t(device)] = std::move(td);
    return *devices[size_t(device)];
  }

  // What choose() picked: the algorithm (null: the heuristic has none for this shape), whether it was
  // chosen for this exact shape, and whether a bucket's algorithm existed but `fits` refused it.
  struct Chosen {
    const Choice* choice = nullptr;
    bool exact = true;
    bool bucket_refused = false;
  };

  // The algorithm for `key`, from the cached heuristic answers (query(k) asks for a missing one): the
  // answer for its row-count bucket when fits(choice) accepts it for this exact shape, else the answer
  // for the exact shape (always, with exact_only, or once the exact shape has an answer of its own).
  // One heuristic query then serves a step's many fresh per-expert row counts. Call with mutex() held;
  // the returned pointer stays valid (map nodes never move).
  template <class Query, class Fits>
  static Chosen choose(Shared& shared, const Key& key, const Key& bucket, bool exact_only, Query&& query, Fits&& fits) {
    auto answer = [&](const Key& k) -> const std::optional<Choice>& {
      auto it = shared.choices.find(k);
      if (it == shared.choices.end()) it = shared.choices.emplace(k, query(k)).first;
      return it->second;
    };
    Chosen out;
    if (!exact_only && !(bucket == key) && !shared.choices.count(key)) {
      const std::optional<Choice>& borrowed = answer(bucket);
      if (borrowed && fits(*borrowed)) return {&*borrowed, false, false};
      out.bucket_refused = borrowed.has_value();
    }
    const std::optional<Choice>& own = answer(key);
    out.choice = own ? &*own : nullptr;
    return out;
  }

  static void* workspace(Thread& td, cudaStream_t stream) {
    for (const auto& [s, ws] : td.workspaces)
      if (s == stream) return ws;
    std::lock_guard<std::mutex> lock(mutex());
    void*& ws = shared(td.device).workspaces[stream];
    if (!ws) ws = cuda_malloc_raw(kLtWorkspaceBytes, td.device);
    td.workspaces.emplace_back(stream, ws);
    return ws;
  }
};

}  // namespace flowmoe
