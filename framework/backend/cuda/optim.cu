// Fused AdamW: one pass updates master weights and moments and writes the working copy.
#include <cstring>

#include "framework/backend/cuda/cuda_common.cuh"
#include "framework/backend/cuda/cuda_kernels.h"

namespace hp {
namespace cuda {

namespace {

// One element of the update: moments, bias correction, decoupled weight decay.
__device__ __forceinline__ void adamw_element(float grad, const AdamWScalars& s, float& m,
                                              float& v, float& p) {
  const float g = grad * s.grad_scale;
  m = s.beta1 * m + (1.f - s.beta1) * g;
  v = s.beta2 * v + (1.f - s.beta2) * g * g;
  const float mhat = m / s.bias_correction1;
  const float vhat = v / s.bias_correction2;
  p -= s.lr * (mhat / (sqrtf(vhat) + s.eps) + s.weight_decay * p);
}

template <typename W>
__global__ void adamw_fwd_kernel(float* master, const float* grad, float* m, float* v, int64_t n,
                                 AdamWScalars s, W* working) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    adamw_element(grad[i], s, m[i], v[i], master[i]);
    if (working) working[i] = from_f32<W>(master[i]);
  }
}

// Four elements per thread with 16-byte loads: AdamW moves 30 bytes a parameter (master, m, v
// read and written, grad read, bf16 working copy written) and is bound by device bandwidth.
// The same adamw_element as adamw_fwd_kernel, so results are bitwise the same.
template <typename W>
__global__ void adamw_x4_kernel(float4* master, const float4* grad, float4* m, float4* v,
                                int64_t n4, AdamWScalars s, W* working) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n4;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float4 g4 = grad[i];
    float4 m4 = m[i], v4 = v[i], p4 = master[i];
    const float* gp = reinterpret_cast<const float*>(&g4);
    float* mp = reinterpret_cast<float*>(&m4);
    float* vp = reinterpret_cast<float*>(&v4);
    float* pp = reinterpret_cast<float*>(&p4);
    W out[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      adamw_element(gp[j], s, mp[j], vp[j], pp[j]);
      out[j] = from_f32<W>(pp[j]);
    }
    m[i] = m4;
    v[i] = v4;
    master[i] = p4;
    if (working) {
      if constexpr (sizeof(W) == 2) {
        uint2 packed;
        std::memcpy(&packed, out, 8);
        reinterpret_cast<uint2*>(working)[i] = packed;
      } else {
        float4 w4;
        std::memcpy(&w4, out, 16);
        reinterpret_cast<float4*>(working)[i] = w4;
      }
    }
  }
}

// Check only: the same adamw_element on copies, nothing written but *flag = 1 where a new m, v
// or master (or the master in the working dtype W) would not be finite.
template <typename W>
__global__ void adamw_check_kernel(const float* master, const float* grad, const float* m,
                                   const float* v, int64_t n, AdamWScalars s, float* flag) {
  bool bad = false;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    float mi = m[i], vi = v[i], pi = master[i];
    adamw_element(grad[i], s, mi, vi, pi);
    const float wi = to_f32(from_f32<W>(pi));
    bad = bad || !(isfinite(mi) && isfinite(vi) && isfinite(pi) && isfinite(wi));
  }
  if (bad) *flag = 1.f;  // every writer writes the same value
}

}  // namespace

void launch_adamw_check(const float* master, const float* grad, const float* m, const float* v,
                        int64_t n, const AdamWScalars& s, DType working_t, float* flag,
                        cudaStream_t stream) {
  if (n == 0) return;
  const unsigned grid = grid_for(n, 256, 8192);
  dispatch_float(working_t, [&](auto ws) {
    using W = decltype(ws);
    adamw_check_kernel<W><<<grid, 256, 0, stream>>>(master, grad, m, v, n, s, flag);
  });
  CUDA_CHECK_LAUNCH();
}

void launch_adamw(float* master, const float* grad, float* m, float* v, int64_t n,
                  const AdamWScalars& s, void* working, DType working_t, cudaStream_t stream) {
  if (n == 0) return;
  auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  if (n % 4 == 0 && aligned(master) && aligned(grad) && aligned(m) && aligned(v) &&
      (working == nullptr || reinterpret_cast<uintptr_t>(working) % 8 == 0)) {
    const unsigned grid4 = grid_for(n / 4, 256, 16384);
    auto run = [&](auto* w) {
      adamw_x4_kernel<<<grid4, 256, 0, stream>>>(
          reinterpret_cast<float4*>(master), reinterpret_cast<const float4*>(grad),
          reinterpret_cast<float4*>(m), reinterpret_cast<float4*>(v), n / 4, s, w);
    };
    if (working == nullptr) {
      run(static_cast<float*>(nullptr));
    } else {
      dispatch_float(working_t, [&](auto ws) { run(static_cast<decltype(ws)*>(working)); });
    }
    CUDA_CHECK_LAUNCH();
    return;
  }
  const unsigned grid = grid_for(n, 256, 8192);
  if (working == nullptr) {
    adamw_fwd_kernel<float><<<grid, 256, 0, stream>>>(master, grad, m, v, n, s, nullptr);
  } else {
    dispatch_float(working_t, [&](auto ws) {
      using W = decltype(ws);
      adamw_fwd_kernel<<<grid, 256, 0, stream>>>(master, grad, m, v, n, s,
                                                 static_cast<W*>(working));
    });
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace hp
