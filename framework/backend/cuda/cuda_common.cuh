// Device-side helpers shared by the backend's kernels: element conversion, warp/block reductions,
// grid sizing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "framework/backend/cuda/cuda_check.h"
#include "framework/core/dtype.h"

namespace hp {
namespace cuda {

using bf16_t = __nv_bfloat16;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16_t x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ bf16_t from_f32<bf16_t>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds at least 33 floats. Fixed order, so deterministic.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < n_warps ? scratch[lane] : 0.f;
    w = warp_sum(w);
    if (lane == 0) scratch[32] = w;
  }
  __syncthreads();
  return scratch[32];
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < n_warps ? scratch[lane] : -INFINITY;
    w = warp_max(w);
    if (lane == 0) scratch[32] = w;
  }
  __syncthreads();
  return scratch[32];
}

inline unsigned grid_for(int64_t n, int threads, int64_t max_blocks = 65535ll * 16) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  if (b > max_blocks) b = max_blocks;
  return static_cast<unsigned>(b);
}

}  // namespace cuda
}  // namespace hp

namespace hp {
namespace cuda {

// Multi-tensor launches: entry e of a table owns blocks [first_block[e], first_block[e + 1]);
// the entry (of count >= 1) that owns block b, by binary search.
__device__ __forceinline__ int entry_of_block(const int32_t* first_block, int count, int32_t b) {
  int lo = 0, hi = count - 1;  // the last entry whose first block is <= b
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (first_block[mid] <= b)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// 16 bytes of T (8 bf16 or 4 f32), loaded and stored as one access; lanes read and written as
// f32, so a kernel on Vec16 does per element exactly what its scalar form does.
template <typename T>
struct Vec16 {
  static constexpr int kN = static_cast<int>(16 / sizeof(T));
  uint4 raw;
  __device__ __forceinline__ float get(int i) const {
    return to_f32(reinterpret_cast<const T*>(&raw)[i]);
  }
  __device__ __forceinline__ void set(int i, float x) {
    reinterpret_cast<T*>(&raw)[i] = from_f32<T>(x);
  }
};

// Whether rows of d elements of `elem_bytes` each, at these base pointers, can be moved as Vec16.
inline bool vec16_rows(int64_t d, size_t elem_bytes, std::initializer_list<const void*> ptrs) {
  if ((d * static_cast<int64_t>(elem_bytes)) % 16 != 0) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// Calls f(T{}) with T = float or bf16_t for the floating dtypes the CUDA backend stores.
template <typename F>
void dispatch_float(DType t, F&& f) {
  switch (t) {
    case DType::kF32:
      f(float{});
      break;
    case DType::kBF16:
      f(bf16_t{});
      break;
    default:
      HP_FAIL(ErrorKind::kInternal, "CUDA backend: dtype ", dtype_name(t),
              " is not supported here (f32 or bf16)");
  }
}

}  // namespace cuda
}  // namespace hp
