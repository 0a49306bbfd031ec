// Fused AdamW: one pass updates master weights and moments and writes the working copy.
#include "framework/backend/cuda/cuda_common.cuh"
#include "framework/backend/cuda/cuda_kernels.h"

namespace hp {
namespace cuda {

namespace {

template <typename W>
__global__ void adamw_fwd_kernel(float* master, const float* grad, float* m, float* v, int64_t n,
                                 AdamWScalars s, W* working) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float g = grad[i] * s.grad_scale;
    const float mi = s.beta1 * m[i] + (1.f - s.beta1) * g;
    const float vi = s.beta2 * v[i] + (1.f - s.beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float mhat = mi / s.bias_correction1;
    const float vhat = vi / s.bias_correction2;
    float p = master[i];
    p -= s.lr * (mhat / (sqrtf(vhat) + s.eps) + s.weight_decay * p);
    master[i] = p;
    if (working) working[i] = from_f32<W>(p);
  }
}

}  // namespace

void launch_adamw(float* master, const float* grad, float* m, float* v, int64_t n,
                  const AdamWScalars& s, void* working, DType working_t, cudaStream_t stream) {
  if (n == 0) return;
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
