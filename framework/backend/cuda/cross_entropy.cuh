// The softmax cross-entropy's first pass, shared by the loss kernel (embedding_loss.cu) and the
// loss kernel that also quantizes the gradient it writes (fp8_quantize.cu).
#pragma once

#include <cstdint>

#include "framework/backend/cuda/cuda_common.cuh"

namespace hp {
namespace cuda {

// Threads a row of the loss kernels: the plain and the quantizing kernel must agree for their
// sums to run in the same order (the same bits).
constexpr int kLossThreads = 1024;

// Adds x to a running (max m, sum s of exp(. - m)).
__device__ __forceinline__ void online_softmax_add(float x, float& m, float& s) {
  if (x > m) {
    s = s * __expf(m - x) + 1.f;
    m = x;
  } else {
    s += __expf(x - m);
  }
}

// log sum exp of a bf16 row of v8 * 8 logits (16-byte aligned), over the whole thread block (every
// thread gets it): each thread reads 16 bytes at a time, 8 logits, in a fixed order, so the
// result is deterministic.
__device__ __forceinline__ float row_lse_bf16x8(const uint4* lr8, int64_t v8, float* scratch) {
  float m = -INFINITY, s = 0.f;
  for (int64_t i = threadIdx.x; i < v8; i += blockDim.x) {
    const uint4 q = lr8[i];
    const bf16_t* e = reinterpret_cast<const bf16_t*>(&q);
#pragma unroll
    for (int j = 0; j < 8; ++j) online_softmax_add(to_f32(e[j]), m, s);
  }
  const float M = block_max(m, scratch);
  const float S = block_sum(m == -INFINITY ? 0.f : s * __expf(m - M), scratch);
  return M + __logf(S);
}

}  // namespace cuda
}  // namespace hp
