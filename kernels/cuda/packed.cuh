// Vector loads and stores for the row-moving kernels (permute, unpermute): VecOf<VB> is the
// integer type of VB bytes; Packed<T, VB> holds VB bytes of T, loaded and stored as one vector
// (llm.c's Packed128), with get/set converting through fp32.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

#include "kernels/cuda/cuda_utils.cuh"

namespace flowmoe {

template <int VB>
struct VecOf;
template <>
struct VecOf<16> {
  using type = uint4;
};
template <>
struct VecOf<8> {
  using type = uint2;
};
template <>
struct VecOf<4> {
  using type = unsigned int;
};
template <>
struct VecOf<2> {
  using type = unsigned short;
};
template <>
struct VecOf<1> {
  using type = unsigned char;
};

// VB bytes of T, loaded and stored as one vector (llm.c's Packed128); get/set convert through fp32.
template <class T, int VB>
struct Packed {
  static constexpr int n = VB / int(sizeof(T));
  T v[n];
  __device__ static Packed load(const T* p) {
    auto raw = __ldg(reinterpret_cast<const typename VecOf<VB>::type*>(p));
    Packed out;
    memcpy(&out, &raw, VB);
    return out;
  }
  __device__ void store(T* p) const {
    typename VecOf<VB>::type raw;
    memcpy(&raw, this, VB);
    *reinterpret_cast<typename VecOf<VB>::type*>(p) = raw;
  }
  __device__ float get(int e) const { return to_float(v[e]); }
  __device__ void set(int e, float x) { v[e] = from_float<T>(x); }
};

// Eight bf16 kept as four 32-bit words (not eight 16-bit registers): widening is a shift, exact.
template <>
struct Packed<__nv_bfloat16, 16> {
  static constexpr int n = 8;
  uint4 raw;
  __device__ static Packed load(const __nv_bfloat16* p) { return {__ldg(reinterpret_cast<const uint4*>(p))}; }
  __device__ void store(__nv_bfloat16* p) const { *reinterpret_cast<uint4*>(p) = raw; }
  __device__ unsigned& word(int i) { return i == 0 ? raw.x : i == 1 ? raw.y : i == 2 ? raw.z : raw.w; }
  __device__ unsigned word(int i) const { return i == 0 ? raw.x : i == 1 ? raw.y : i == 2 ? raw.z : raw.w; }
  __device__ float get(int e) const {
    const unsigned w = word(e >> 1);
    return __uint_as_float((e & 1) ? (w & 0xffff0000u) : (w << 16));
  }
  __device__ void set(int e, float x) {
    const unsigned b = __bfloat16_as_ushort(__float2bfloat16_rn(x));
    unsigned& w = word(e >> 1);
    w = (e & 1) ? ((w & 0x0000ffffu) | (b << 16)) : ((w & 0xffff0000u) | b);
  }
};

}  // namespace flowmoe
