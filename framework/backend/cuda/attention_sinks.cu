// Sink rescaling around the sink-free cuDNN attention (cudnn_attention.h says why it is exact),
// and the ragged offsets cuDNN reads.
#include "framework/backend/cuda/column_sum.cuh"
#include "framework/backend/cuda/cuda_common.cuh"
#include "framework/backend/cuda/cudnn_attention.h"

namespace hp::cuda {
namespace {

__device__ float sink_value(const void* sinks, DType t, int h) {
  return t == DType::kF32 ? static_cast<const float*>(sinks)[h]
                          : __bfloat162float(static_cast<const __nv_bfloat16*>(sinks)[h]);
}

// One warp per (token, head): c = sigmoid(lse_ns - s); out *= c; lse = log(exp(s) + exp(lse_ns)).
__global__ void sink_forward_fixup_kernel(__nv_bfloat16* out, float* lse, const void* sinks,
                                          DType sinks_t, int64_t rows, int hq, int d) {
  const int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float s = sink_value(sinks, sinks_t, static_cast<int>(row % hq));
  const float l = lse[row];
  const float m = fmaxf(s, l);
  const float total = m + logf(expf(s - m) + expf(l - m));
  const float c = expf(l - total);
  __nv_bfloat16* o = out + row * d;
  for (int i = lane; i < d; i += 32) o[i] = __float2bfloat16(__bfloat162float(o[i]) * c);
  if (lane == 0) lse[row] = total;
}

// One warp per (token, head); term[row] = -(dout . out)(1 - c) for the sink gradient.
__global__ void sink_backward_prep_kernel(const __nv_bfloat16* out, const __nv_bfloat16* dout,
                                          const float* lse, const void* sinks, DType sinks_t,
                                          int64_t rows, int hq, int d, __nv_bfloat16* dout_scaled,
                                          float* lse_ns, float* term) {
  const int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float s = sink_value(sinks, sinks_t, static_cast<int>(row % hq));
  const float l = lse[row];
  // c = 1 - exp(s - lse): the share of the softmax mass on the keys; floored so that log(c)
  // stays finite where the sink takes (almost) all of it.
  const float c = fmaxf(1.f - expf(s - l), 1e-30f);
  const __nv_bfloat16* o = out + row * d;
  const __nv_bfloat16* g = dout + row * d;
  __nv_bfloat16* gs = dout_scaled + row * d;
  float dot = 0.f;
  for (int i = lane; i < d; i += 32) {
    const float gi = __bfloat162float(g[i]);
    dot += gi * __bfloat162float(o[i]);
    gs[i] = __float2bfloat16(gi * c);
  }
  for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
  if (lane == 0) {
    lse_ns[row] = l + logf(c);
    term[row] = -dot * (1.f - c);
  }
}

__global__ void cudnn_offsets_kernel(const int32_t* cu, int64_t n_seqs, int64_t b, int64_t qkv_row,
                                     int64_t o_row, int64_t lse_row, int32_t* out) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i > b) return;
  const int32_t start = cu[i < n_seqs ? i : n_seqs];
  if (i < b) {
    const int32_t end = cu[i < n_seqs ? i + 1 : n_seqs];
    out[i] = end - start;
  }
  int32_t* off = out + b;
  off[i] = static_cast<int32_t>(start * qkv_row);
  off[b + 1 + i] = static_cast<int32_t>(start * o_row);
  off[2 * (b + 1) + i] = static_cast<int32_t>(start * lse_row);
}

__global__ void lse_bhsd_kernel(const float* from, int64_t b, int64_t s, int hq, float* to,
                                bool to_bhsd) {
  const int64_t total = b * s * hq;
  for (int64_t x = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; x < total;
       x += (int64_t)gridDim.x * blockDim.x) {
    // x indexes the backend's layout: t = x / hq, h = x % hq, t = i s + j.
    const int64_t t = x / hq, h = x - t * hq, i = t / s, j = t - i * s;
    const int64_t y = (i * hq + h) * s + j;
    if (to_bhsd)
      to[y] = from[x];
    else
      to[x] = from[y];
  }
}

}  // namespace

void launch_lse_bhsd(const float* from, int64_t b, int64_t s, int hq, float* to, bool to_bhsd,
                     CUstream_st* stream) {
  const int64_t total = b * s * hq;
  if (total == 0) return;
  lse_bhsd_kernel<<<grid_for(total, 256, 8192), 256, 0, stream>>>(from, b, s, hq, to, to_bhsd);
  CUDA_CHECK_LAUNCH();
}

void launch_sink_forward_fixup(void* out, float* lse, const void* sinks, DType sinks_t, int64_t n,
                               int hq, int d, CUstream_st* stream) {
  const int64_t rows = n * hq;
  if (rows == 0) return;
  constexpr int kWarps = 8;
  sink_forward_fixup_kernel<<<grid_for(rows, kWarps), kWarps * 32, 0, stream>>>(
      static_cast<__nv_bfloat16*>(out), lse, sinks, sinks_t, rows, hq, d);
  CUDA_CHECK_LAUNCH();
}

void launch_sink_backward_prep(const void* out, const void* dout, const float* lse,
                               const void* sinks, DType sinks_t, int64_t n, int hq, int d,
                               void* dout_scaled, float* lse_ns, float* dsinks, Allocator& alloc,
                               CUstream_st* stream) {
  const int64_t rows = n * hq;
  if (rows == 0) return;
  Tensor term = Tensor::empty(alloc, {n, hq}, DType::kF32);
  constexpr int kWarps = 8;
  sink_backward_prep_kernel<<<grid_for(rows, kWarps), kWarps * 32, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(out), static_cast<const __nv_bfloat16*>(dout), lse, sinks,
      sinks_t, rows, hq, d, static_cast<__nv_bfloat16*>(dout_scaled), lse_ns, term.data<float>());
  CUDA_CHECK_LAUNCH();
  if (dsinks) launch_column_sum_add(term.data<float>(), n, hq, 1.f, dsinks, alloc, stream);
}

void launch_cudnn_offsets(const int32_t* cu_seqlens, int64_t n_seqs, int64_t b, int64_t qkv_row,
                          int64_t o_row, int64_t lse_row, int32_t* out, CUstream_st* stream) {
  cudnn_offsets_kernel<<<grid_for(b + 1, 256), 256, 0, stream>>>(cu_seqlens, n_seqs, b, qkv_row,
                                                                 o_row, lse_row, out);
  CUDA_CHECK_LAUNCH();
}

}  // namespace hp::cuda
