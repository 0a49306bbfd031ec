// The gated activations of the feed-forward layers on the device (Backend::glu_fwd, glu_bwd):
// the one definition the GLU kernels (elementwise.cu) and the GLU kernels that also quantize
// their output for an FP8 product (fp8_quantize.cu) compute with, so both give the same bits.
#pragma once

namespace hp::cuda {

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + __expf(-x)); }

struct GluArgs {
  int kind;  // 0 SwiGLU, 1 GPT-OSS
  float alpha, limit;
};

__device__ __forceinline__ float glu_value(float g, float u, GluArgs p) {
  if (p.kind == 0) return g * sigmoidf(g) * u;
  g = fminf(g, p.limit);
  u = fminf(fmaxf(u, -p.limit), p.limit);
  return g * sigmoidf(p.alpha * g) * (u + 1.f);
}

// d(loss)/dg and d(loss)/du from d = d(loss)/d(glu_value(g, u)).
__device__ __forceinline__ void glu_grad(float g, float u, float d, GluArgs p, float& dg,
                                         float& du) {
  if (p.kind == 0) {
    const float s = sigmoidf(g);
    dg = d * u * s * (1.f + g * (1.f - s));
    du = d * g * s;
    return;
  }
  const float gc = fminf(g, p.limit);
  const float uc = fminf(fmaxf(u, -p.limit), p.limit);
  const float s = sigmoidf(p.alpha * gc);
  dg = g <= p.limit ? d * (uc + 1.f) * (s + p.alpha * gc * s * (1.f - s)) : 0.f;
  du = (u >= -p.limit && u <= p.limit) ? d * gc * s : 0.f;
}

}  // namespace hp::cuda
