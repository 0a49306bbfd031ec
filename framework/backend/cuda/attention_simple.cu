// Simple attention kernels for head dims without a tensor-core instantiation: one warp per
// query row (forward, dQ) or key row (dK, dV), a scalar loop over the other side. Same math and
// the same determinism as the tiled kernels, much slower; head_dim <= 256.
#include "framework/backend/cuda/attention_common.cuh"

namespace hp {
namespace cuda {

namespace {

constexpr int kMaxPerLane = 8;  // head_dim <= 32 * 8
constexpr int kWarps = 4;

__device__ __forceinline__ float sink_value(const void* sinks, int f32, int h) {
  return f32 ? static_cast<const float*>(sinks)[h]
             : __bfloat162float(static_cast<const bf16_t*>(sinks)[h]);
}

// dot of a row held by the warp (x[j] = element lane + 32 j) with a bf16 row in memory.
__device__ __forceinline__ float warp_dot(const float (&x)[kMaxPerLane], const bf16_t* y, int d,
                                          int lane) {
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxPerLane; ++j) {
    const int i = lane + 32 * j;
    if (i < d) acc += x[j] * __bfloat162float(y[i]);
  }
  return warp_sum(acc);
}

__device__ __forceinline__ void load_row(float (&x)[kMaxPerLane], const bf16_t* p, int d,
                                         int lane) {
#pragma unroll
  for (int j = 0; j < kMaxPerLane; ++j) {
    const int i = lane + 32 * j;
    x[j] = i < d ? __bfloat162float(p[i]) : 0.f;
  }
}

__global__ void attention_simple_fwd_kernel(const bf16_t* __restrict__ qkv, const void* sinks,
                                            int sinks_f32, const AttnTile* __restrict__ tiles,
                                            int hq, int hkv, int d, int window, float scale,
                                            bf16_t* __restrict__ out, float* __restrict__ lse) {
  const AttnTile tile = tiles[blockIdx.x];
  const int h = blockIdx.y, g = h / (hq / hkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t ld = static_cast<int64_t>(hq + 2 * hkv) * d;
  for (int qi = tile.begin + warp; qi < tile.end; qi += kWarps) {
    float q[kMaxPerLane], o[kMaxPerLane] = {};
    load_row(q, qkv + qi * ld + static_cast<int64_t>(h) * d, d, lane);
    float m = -INFINITY, l = 0.f;
    const int lo = window > 0 ? max(tile.seq_begin, qi - window + 1) : tile.seq_begin;
    for (int kj = lo; kj <= qi; ++kj) {
      const float s =
          warp_dot(q, qkv + kj * ld + static_cast<int64_t>(hq + g) * d, d, lane) * scale;
      const float mn = fmaxf(m, s);
      const float corr = __expf(m - mn), p = __expf(s - mn);
      l = l * corr + p;
      const bf16_t* v = qkv + kj * ld + static_cast<int64_t>(hq + hkv + g) * d;
#pragma unroll
      for (int j = 0; j < kMaxPerLane; ++j) {
        const int i = lane + 32 * j;
        o[j] = o[j] * corr + (i < d ? p * __bfloat162float(v[i]) : 0.f);
      }
      m = mn;
    }
    float M = m, denom = l;
    if (sinks) {
      const float sv = sink_value(sinks, sinks_f32, h);
      M = fmaxf(m, sv);
      denom = l * __expf(m - M) + __expf(sv - M);
    }
    const float f = __expf(m - M) / denom;
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) {
      const int i = lane + 32 * j;
      if (i < d) out[(static_cast<int64_t>(qi) * hq + h) * d + i] = __float2bfloat16_rn(o[j] * f);
    }
    if (lane == 0) lse[static_cast<int64_t>(qi) * hq + h] = M + __logf(denom);
  }
}

__global__ void attention_simple_bwd_dq_kernel(
    const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ dout, const float* __restrict__ lse,
    const float* __restrict__ dvec, const AttnTile* __restrict__ tiles, int hq, int hkv, int d,
    int window, float scale, bf16_t* __restrict__ dqkv) {
  const AttnTile tile = tiles[blockIdx.x];
  const int h = blockIdx.y, g = h / (hq / hkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t ld = static_cast<int64_t>(hq + 2 * hkv) * d;
  for (int qi = tile.begin + warp; qi < tile.end; qi += kWarps) {
    float q[kMaxPerLane], dO[kMaxPerLane], dq[kMaxPerLane] = {};
    load_row(q, qkv + qi * ld + static_cast<int64_t>(h) * d, d, lane);
    load_row(dO, dout + (static_cast<int64_t>(qi) * hq + h) * d, d, lane);
    const float row_lse = lse[static_cast<int64_t>(qi) * hq + h];
    const float row_d = dvec[static_cast<int64_t>(qi) * hq + h];
    const int lo = window > 0 ? max(tile.seq_begin, qi - window + 1) : tile.seq_begin;
    for (int kj = lo; kj <= qi; ++kj) {
      const bf16_t* k = qkv + kj * ld + static_cast<int64_t>(hq + g) * d;
      const bf16_t* v = qkv + kj * ld + static_cast<int64_t>(hq + hkv + g) * d;
      const float p = __expf(warp_dot(q, k, d, lane) * scale - row_lse);
      const float ds = p * (warp_dot(dO, v, d, lane) - row_d);
#pragma unroll
      for (int j = 0; j < kMaxPerLane; ++j) {
        const int i = lane + 32 * j;
        if (i < d) dq[j] += ds * __bfloat162float(k[i]);
      }
    }
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) {
      const int i = lane + 32 * j;
      if (i < d)
        dqkv[qi * ld + static_cast<int64_t>(h) * d + i] = __float2bfloat16_rn(dq[j] * scale);
    }
  }
}

__global__ void attention_simple_bwd_dkdv_kernel(
    const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ dout, const float* __restrict__ lse,
    const float* __restrict__ dvec, const AttnTile* __restrict__ tiles, int hq, int hkv, int d,
    int window, float scale, bf16_t* __restrict__ dqkv) {
  const AttnTile tile = tiles[blockIdx.x];
  const int g = blockIdx.y, group_size = hq / hkv;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t ld = static_cast<int64_t>(hq + 2 * hkv) * d;
  for (int kj = tile.begin + warp; kj < tile.end; kj += kWarps) {
    float k[kMaxPerLane], v[kMaxPerLane], dk[kMaxPerLane] = {}, dv[kMaxPerLane] = {};
    load_row(k, qkv + kj * ld + static_cast<int64_t>(hq + g) * d, d, lane);
    load_row(v, qkv + kj * ld + static_cast<int64_t>(hq + hkv + g) * d, d, lane);
    const int hi_q = window > 0 ? min(tile.seq_end, kj + window) : tile.seq_end;
    for (int hi = 0; hi < group_size; ++hi) {
      const int h = g * group_size + hi;
      for (int qi = kj; qi < hi_q; ++qi) {
        const bf16_t* q = qkv + qi * ld + static_cast<int64_t>(h) * d;
        const bf16_t* dO = dout + (static_cast<int64_t>(qi) * hq + h) * d;
        const float p =
            __expf(warp_dot(k, q, d, lane) * scale - lse[static_cast<int64_t>(qi) * hq + h]);
        const float ds = p * (warp_dot(v, dO, d, lane) - dvec[static_cast<int64_t>(qi) * hq + h]);
#pragma unroll
        for (int j = 0; j < kMaxPerLane; ++j) {
          const int i = lane + 32 * j;
          if (i < d) {
            dv[j] += p * __bfloat162float(dO[i]);
            dk[j] += ds * __bfloat162float(q[i]);
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) {
      const int i = lane + 32 * j;
      if (i < d) {
        dqkv[kj * ld + static_cast<int64_t>(hq + g) * d + i] = __float2bfloat16_rn(dk[j] * scale);
        dqkv[kj * ld + static_cast<int64_t>(hq + hkv + g) * d + i] = __float2bfloat16_rn(dv[j]);
      }
    }
  }
}

}  // namespace

void launch_attention_simple_fwd(const AttnArgs& a, void* out, float* lse, cudaStream_t stream) {
  HP_CHECK(a.head_dim <= 32 * kMaxPerLane, "attention head_dim ", a.head_dim, " > 256");
  attention_simple_fwd_kernel<<<dim3(a.n_tiles, a.hq), kWarps * 32, 0, stream>>>(
      static_cast<const bf16_t*>(a.qkv), a.sinks, a.sinks_t == DType::kF32 ? 1 : 0, a.tiles, a.hq,
      a.hkv, a.head_dim, a.window, a.scale, static_cast<bf16_t*>(out), lse);
  CUDA_CHECK_LAUNCH();
}

void launch_attention_simple_bwd(const AttnArgs& a, const void* dout, const float* lse,
                                 const float* dvec, void* dqkv, cudaStream_t stream) {
  HP_CHECK(a.head_dim <= 32 * kMaxPerLane, "attention head_dim ", a.head_dim, " > 256");
  const bf16_t* qkv = static_cast<const bf16_t*>(a.qkv);
  const bf16_t* dO = static_cast<const bf16_t*>(dout);
  bf16_t* dst = static_cast<bf16_t*>(dqkv);
  attention_simple_bwd_dkdv_kernel<<<dim3(a.n_tiles, a.hkv), kWarps * 32, 0, stream>>>(
      qkv, dO, lse, dvec, a.tiles, a.hq, a.hkv, a.head_dim, a.window, a.scale, dst);
  CUDA_CHECK_LAUNCH();
  attention_simple_bwd_dq_kernel<<<dim3(a.n_tiles, a.hq), kWarps * 32, 0, stream>>>(
      qkv, dO, lse, dvec, a.tiles, a.hq, a.hkv, a.head_dim, a.window, a.scale, dst);
  CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace hp
