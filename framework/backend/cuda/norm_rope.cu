// RMSNorm (forward, backward) and rotary position embedding.
#include <type_traits>
#include <utility>

#include "framework/backend/cuda/column_sum.cuh"
#include "framework/backend/cuda/cuda_kernels.h"

namespace hp {
namespace cuda {

namespace {

constexpr int kWarpsPerBlock = 8;

// One warp per row.
template <typename T, typename W>
__global__ void rmsnorm_fwd_kernel(const T* x, const W* w, float eps, T* y, float* rstd,
                                   int64_t rows, int64_t d) {
  const int64_t row = blockIdx.x * (int64_t)kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const T* xr = x + row * d;
  float ss = 0.f;
  for (int64_t i = lane; i < d; i += 32) {
    const float v = to_f32(xr[i]);
    ss += v * v;
  }
  ss = warp_sum(ss);
  const float r = rsqrtf(ss / (float)d + eps);
  T* yr = y + row * d;
  for (int64_t i = lane; i < d; i += 32) yr[i] = from_f32<T>(to_f32(xr[i]) * r * to_f32(w[i]));
  if (lane == 0) rstd[row] = r;
}

template <typename T, typename W>
__global__ void rmsnorm_bwd_kernel(const T* x, const W* w, const float* rstd, const T* dy, T* dx,
                                   int64_t rows, int64_t d, bool add_dx) {
  const int64_t row = blockIdx.x * (int64_t)kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const T* xr = x + row * d;
  const T* dyr = dy + row * d;
  float dot = 0.f;
  for (int64_t i = lane; i < d; i += 32) dot += to_f32(dyr[i]) * to_f32(w[i]) * to_f32(xr[i]);
  dot = warp_sum(dot);
  const float r = rstd[row];
  const float c = r * r * r * dot / (float)d;
  T* dxr = dx + row * d;
  for (int64_t i = lane; i < d; i += 32) {
    const float g = r * to_f32(dyr[i]) * to_f32(w[i]) - c * to_f32(xr[i]);
    dxr[i] = from_f32<T>(add_dx ? to_f32(dxr[i]) + g : g);
  }
}

template <typename T>
struct NormWeightGrad {
  const T* x;
  const T* dy;
  const float* rstd;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t c) const {
    return to_f32(dy[r * cols + c]) * to_f32(x[r * cols + c]) * rstd[r];
  }
};

// The rotation of one pair, x1 at i and x2 at i + D/2 of a head, by c = cos and s = sin (s
// negated for the inverse). Every rope kernel rotates through it, its roundings fixed by the
// intrinsics (no contraction left to the compiler), so fused and unfused rotations give the same
// bits.
__device__ __forceinline__ void rope_rotate(float x1, float x2, float c, float s, float& y1,
                                            float& y2) {
  y1 = __fmaf_rn(x1, c, -__fmul_rn(x2, s));
  y2 = __fmaf_rn(x2, c, __fmul_rn(x1, s));
}

// Token t's position, clamped into the table's [0, max_pos).
__device__ __forceinline__ int64_t rope_position(const int32_t* positions, int64_t t,
                                                 int64_t max_pos) {
  const int64_t pos = positions[t];
  return pos < 0 ? 0 : (pos >= max_pos ? max_pos - 1 : pos);
}

template <typename T>
__global__ void rope_fwd_kernel(T* x, int64_t n_tokens, int n_heads, int n_rot_heads, int head_dim,
                                const int32_t* positions, const float* cos_t, const float* sin_t,
                                int64_t max_pos, bool inverse) {
  const int half = head_dim / 2;
  const int64_t n = n_tokens * n_rot_heads * half;
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < n;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int i = static_cast<int>(idx % half);
    const int64_t th = idx / half;
    const int h = static_cast<int>(th % n_rot_heads);
    const int64_t t = th / n_rot_heads;
    const int64_t pos = rope_position(positions, t, max_pos);
    const float c = cos_t[pos * half + i];
    const float s = inverse ? -sin_t[pos * half + i] : sin_t[pos * half + i];
    T* p = x + (t * n_heads + h) * (int64_t)head_dim;
    float y1, y2;
    rope_rotate(to_f32(p[i]), to_f32(p[i + half]), c, s, y1, y2);
    p[i] = from_f32<T>(y1);
    p[i + half] = from_f32<T>(y2);
  }
}

// The table entries [at, at + kN) of cos and sin (at a multiple of 4, the tables 16-byte
// aligned), as rope_vec_kernel loads them.
template <int kN>
__device__ __forceinline__ void load_rope_table(const float* cos_t, const float* sin_t, int64_t at,
                                                float (&c)[kN], float (&sn)[kN]) {
#pragma unroll
  for (int q = 0; q < kN; q += 4) {
    const float4 c4 = *reinterpret_cast<const float4*>(cos_t + at + q);
    const float4 s4 = *reinterpret_cast<const float4*>(sin_t + at + q);
    c[q] = c4.x, c[q + 1] = c4.y, c[q + 2] = c4.z, c[q + 3] = c4.w;
    sn[q] = s4.x, sn[q + 1] = s4.y, sn[q + 2] = s4.z, sn[q + 3] = s4.w;
  }
}

// One lane's kN elements of a Vec16 head rotated: `own` holds elements [i0, i0 + kN) of the
// first half (first) or of the second half (!first), `other` the same elements of the other
// half; c and sn the position's table entries [i0, i0 + kN). Returns own's rotated elements, as
// rope_vec_kernel rotates them forward.
template <typename T>
__device__ __forceinline__ Vec16<T> rope_lane(const Vec16<T>& own, const Vec16<T>& other,
                                              bool first, const float (&c)[Vec16<T>::kN],
                                              const float (&sn)[Vec16<T>::kN]) {
  Vec16<T> r;
#pragma unroll
  for (int q = 0; q < Vec16<T>::kN; ++q) {
    const float a = own.get(q), b = other.get(q);
    float y1, y2;
    rope_rotate(first ? a : b, first ? b : a, c[q], sn[q], y1, y2);
    r.set(q, first ? y1 : y2);
  }
  return r;
}

// The 16 bytes of lane (lane ^ m) of the warp; every lane takes part.
__device__ __forceinline__ uint4 shfl_xor_16(uint4 v, int m) {
  v.x = __shfl_xor_sync(0xffffffffu, v.x, m);
  v.y = __shfl_xor_sync(0xffffffffu, v.y, m);
  v.z = __shfl_xor_sync(0xffffffffu, v.z, m);
  v.w = __shfl_xor_sync(0xffffffffu, v.w, m);
  return v;
}

// The forward and backward on Vec16 rows (dv vectors of kN elements a row): one warp per row.
template <typename T, typename W>
__global__ void rmsnorm_fwd_vec_kernel(const uint4* x, const W* w, float eps, uint4* y, float* rstd,
                                       int64_t rows, int64_t dv) {
  constexpr int kN = Vec16<T>::kN;
  const int64_t row = blockIdx.x * (int64_t)kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const uint4* xr = x + row * dv;
  float ss = 0.f;
  for (int64_t c = lane; c < dv; c += 32) {
    const Vec16<T> v{xr[c]};
    for (int q = 0; q < kN; ++q) ss += v.get(q) * v.get(q);
  }
  ss = warp_sum(ss);
  const float r = rsqrtf(ss / (float)(dv * kN) + eps);
  for (int64_t c = lane; c < dv; c += 32) {
    const Vec16<T> v{xr[c]};
    Vec16<T> o;
    for (int q = 0; q < kN; ++q) o.set(q, v.get(q) * r * to_f32(w[c * kN + q]));
    y[row * dv + c] = o.raw;
  }
  if (lane == 0) rstd[row] = r;
}

template <typename T, typename W>
__global__ void rmsnorm_bwd_vec_kernel(const uint4* x, const W* w, const float* rstd,
                                       const uint4* dy, uint4* dx, int64_t rows, int64_t dv,
                                       bool add_dx) {
  constexpr int kN = Vec16<T>::kN;
  const int64_t row = blockIdx.x * (int64_t)kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const uint4* xr = x + row * dv;
  const uint4* dyr = dy + row * dv;
  float dot = 0.f;
  for (int64_t c = lane; c < dv; c += 32) {
    const Vec16<T> a{dyr[c]}, b{xr[c]};
    for (int q = 0; q < kN; ++q) dot += a.get(q) * to_f32(w[c * kN + q]) * b.get(q);
  }
  dot = warp_sum(dot);
  const float r = rstd[row];
  const float k = r * r * r * dot / (float)(dv * kN);
  for (int64_t c = lane; c < dv; c += 32) {
    const Vec16<T> a{dyr[c]}, b{xr[c]};
    Vec16<T> o, prev{};
    if (add_dx) prev.raw = dx[row * dv + c];
    for (int q = 0; q < kN; ++q) {
      const float g = r * a.get(q) * to_f32(w[c * kN + q]) - k * b.get(q);
      o.set(q, add_dx ? prev.get(q) + g : g);
    }
    dx[row * dv + c] = o.raw;
  }
}

// rmsnorm_bwd_vec_kernel with the weight gradient folded in, for rows of V Vec16 vectors a lane
// (d = 32 V kN): dx as that kernel computes it (the same expressions in the same order, so the
// same bits), and the column sums of dy * x * rstd, which it would otherwise take a second pass
// over x and dy to form. Warp w of the grid takes rows w, w + W, w + 2W, ... (W warps in all,
// rmsnorm_dw_blocks(rows, V) blocks of them: a function of the shape only), each lane summing
// its own columns in row order; the block's warps then add in warp order into partial[block][d],
// which column_finish_kernel finishes (column_sum.cuh). The same bits in every run. Registers
// are capped so that three blocks share an SM up to V = 4 (no spills at these caps).
template <typename T, typename W, int V>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, V <= 4 ? 3 : (V == 5 ? 2 : 1))
    rmsnorm_bwd_dw_vec_kernel(const uint4* x, const W* w, const float* rstd, const uint4* dy,
                              uint4* dx, int64_t rows, bool add_dx, float* partial) {
  constexpr int kN = Vec16<T>::kN, kDv = 32 * V, kD = kDv * kN;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int64_t stride = (int64_t)gridDim.x * kWarpsPerBlock;
  float acc[V][kN] = {};
  // w is read where used (it stays in L1): held in registers it would push V = 8 into spills.
  const auto wf = [&](int v, int q) { return to_f32(w[(lane + 32 * v) * kN + q]); };
  for (int64_t row = blockIdx.x * (int64_t)kWarpsPerBlock + warp; row < rows; row += stride) {
    const uint4* dyr = dy + row * kDv + lane;
    const uint4* xr = x + row * kDv + lane;
    uint4* dxr = dx + row * kDv + lane;
    // Every load of the row goes out first, dx's too where the gradient adds to it. The second
    // pass reads dy and x again (from L1), so that they need no registers across the sum.
    Vec16<T> prev[V];
    float dot = 0.f;
    {
      Vec16<T> a[V], b[V];
#pragma unroll
      for (int v = 0; v < V; ++v) {
        a[v].raw = dyr[32 * v];
        b[v].raw = xr[32 * v];
        prev[v].raw = add_dx ? dxr[32 * v] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int v = 0; v < V; ++v)
#pragma unroll
        for (int q = 0; q < kN; ++q) dot += a[v].get(q) * wf(v, q) * b[v].get(q);
    }
    dot = warp_sum(dot);
    const float r = rstd[row];
    const float k = r * r * r * dot / (float)kD;
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const Vec16<T> a{dyr[32 * v]}, b{xr[32 * v]};
      Vec16<T> o;
#pragma unroll
      for (int q = 0; q < kN; ++q) {
        const float g = r * a.get(q) * wf(v, q) - k * b.get(q);
        o.set(q, add_dx ? prev[v].get(q) + g : g);
        acc[v][q] += a.get(q) * b.get(q) * r;
      }
      dxr[32 * v] = o.raw;
    }
  }
  // The block's warps, in warp order, into one row of d sums.
  __shared__ float red[kD];
  for (int i = 0; i < kWarpsPerBlock; ++i) {
    if (warp == i) {
#pragma unroll
      for (int v = 0; v < V; ++v)
#pragma unroll
        for (int q = 0; q < kN; ++q) {
          float& s = red[(lane + 32 * v) * kN + q];
          s = i == 0 ? acc[v][q] : s + acc[v][q];
        }
    }
    __syncthreads();
  }
  for (int c = threadIdx.x; c < kD; c += blockDim.x) partial[blockIdx.x * (int64_t)kD + c] = red[c];
}

// Blocks of the folded backward over `rows` rows of V vectors a lane: a function of the row count
// and width only (6 rows a warp where V <= 4 lets three blocks share an SM, about one wave of an
// H100 or H200 at 16,384 rows; 8 rows a warp for the wider rows; at most 512 blocks).
inline int64_t rmsnorm_dw_blocks(int64_t rows, int64_t v) {
  const int64_t per_block = (v <= 4 ? 6 : 8) * kWarpsPerBlock;
  const int64_t b = (rows + per_block - 1) / per_block;
  return b < 1 ? 1 : (b > 512 ? 512 : b);
}

// f(std::integral_constant<int, V>{}) for the V in 1 .. sizeof...(Vs) that equals v (none where
// v is outside).
template <int... Vs, typename F>
void with_int_upto(int v, std::integer_sequence<int, Vs...>, F&& f) {
  ((v == Vs + 1 ? f(std::integral_constant<int, Vs + 1>{}) : void()), ...);
}

// rmsnorm_bwd_dw_vec_kernel and its finishing sum into dw; false (nothing launched) where the
// rows are not V Vec16 vectors a lane for a V from 1 to 8.
template <typename T, typename W>
bool rmsnorm_bwd_dw_vec(const void* x, const void* w, const float* rstd, const void* dy, void* dx,
                        float* dw, int64_t rows, int64_t d, bool add_dx, Allocator& alloc,
                        cudaStream_t stream) {
  constexpr int kN = Vec16<T>::kN;
  if (d % (32 * kN) != 0 || !vec16_rows(d, sizeof(T), {x, dy, dx})) return false;
  const int64_t v = d / (32 * kN);
  if (v < 1 || v > 8) return false;
  const int64_t blocks = rmsnorm_dw_blocks(rows, v);
  Tensor partial = Tensor::empty(alloc, {blocks, d}, DType::kF32);
  const auto launch = [&](auto vc) {
    constexpr int V = decltype(vc)::value;
    rmsnorm_bwd_dw_vec_kernel<T, W, V>
        <<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(
            static_cast<const uint4*>(x), static_cast<const W*>(w), rstd,
            static_cast<const uint4*>(dy), static_cast<uint4*>(dx), rows, add_dx,
            partial.data<float>());
  };
  with_int_upto(static_cast<int>(v), std::make_integer_sequence<int, 8>{}, launch);
  CUDA_CHECK_LAUNCH();
  launch_column_finish(partial.data<float>(), blocks, d, 1.f, dw, d, nullptr, stream);
  return true;
}

// rope_fwd_kernel with kN consecutive rotation pairs a thread: 16-byte accesses to x, float4 to
// the tables.
template <typename T>
__global__ void rope_vec_kernel(T* x, int64_t n_tokens, int n_heads, int n_rot_heads, int head_dim,
                                const int32_t* positions, const float* cos_t, const float* sin_t,
                                int64_t max_pos, bool inverse) {
  constexpr int kN = Vec16<T>::kN;
  const int half = head_dim / 2, hv = half / kN;
  const int64_t n = n_tokens * n_rot_heads * hv;
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < n;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int i0 = static_cast<int>(idx % hv) * kN;
    const int64_t th = idx / hv;
    const int h = static_cast<int>(th % n_rot_heads);
    const int64_t t = th / n_rot_heads;
    const int64_t pos = rope_position(positions, t, max_pos);
    float c[kN], sn[kN];
    load_rope_table<kN>(cos_t, sin_t, pos * half + i0, c, sn);
    T* p = x + (t * n_heads + h) * (int64_t)head_dim + i0;
    uint4* p1 = reinterpret_cast<uint4*>(p);
    uint4* p2 = reinterpret_cast<uint4*>(p + half);
    const Vec16<T> a{*p1}, b{*p2};
    Vec16<T> ra, rb;
    for (int q = 0; q < kN; ++q) {
      float y1, y2;
      rope_rotate(a.get(q), b.get(q), c[q], inverse ? -sn[q] : sn[q], y1, y2);
      ra.set(q, y1);
      rb.set(q, y2);
    }
    *p1 = ra.raw;
    *p2 = rb.raw;
  }
}

}  // namespace

void launch_rmsnorm_fwd(const void* x, DType t, const void* w, DType w_t, float eps, void* y,
                        float* rstd, int64_t rows, int64_t d, cudaStream_t stream) {
  if (rows == 0) return;
  const unsigned grid = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  dispatch_float(t, [&](auto ts) {
    using T = decltype(ts);
    dispatch_float(w_t, [&](auto ws) {
      using W = decltype(ws);
      if (vec16_rows(d, sizeof(T), {x, y})) {
        rmsnorm_fwd_vec_kernel<T, W><<<grid, kWarpsPerBlock * 32, 0, stream>>>(
            static_cast<const uint4*>(x), static_cast<const W*>(w), eps, static_cast<uint4*>(y),
            rstd, rows, d * static_cast<int64_t>(sizeof(T)) / 16);
        return;
      }
      rmsnorm_fwd_kernel<<<grid, kWarpsPerBlock * 32, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const W*>(w), eps, static_cast<T*>(y), rstd, rows,
          d);
    });
  });
  CUDA_CHECK_LAUNCH();
}

void launch_rmsnorm_bwd(const void* x, DType t, const void* w, DType w_t, const float* rstd,
                        const void* dy, void* dx, float* dw, int64_t rows, int64_t d, bool add_dx,
                        Allocator& alloc, cudaStream_t stream, bool fold_dw) {
  if (rows == 0) return;
  const unsigned grid = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  dispatch_float(t, [&](auto ts) {
    using T = decltype(ts);
    dispatch_float(w_t, [&](auto ws) {
      using W = decltype(ws);
      if (fold_dw &&
          rmsnorm_bwd_dw_vec<T, W>(x, w, rstd, dy, dx, dw, rows, d, add_dx, alloc, stream))
        return;
      // dw first: dx may alias dy.
      column_sum_add(
          NormWeightGrad<T>{static_cast<const T*>(x), static_cast<const T*>(dy), rstd, d}, rows, d,
          1.f, dw, alloc, stream);
      if (vec16_rows(d, sizeof(T), {x, dy, dx})) {
        rmsnorm_bwd_vec_kernel<T, W><<<grid, kWarpsPerBlock * 32, 0, stream>>>(
            static_cast<const uint4*>(x), static_cast<const W*>(w), rstd,
            static_cast<const uint4*>(dy), static_cast<uint4*>(dx), rows,
            d * static_cast<int64_t>(sizeof(T)) / 16, add_dx);
        return;
      }
      rmsnorm_bwd_kernel<<<grid, kWarpsPerBlock * 32, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const W*>(w), rstd, static_cast<const T*>(dy),
          static_cast<T*>(dx), rows, d, add_dx);
    });
    CUDA_CHECK_LAUNCH();
  });
}

void launch_rope(void* x, DType t, int64_t n_tokens, int n_heads, int n_rot_heads, int head_dim,
                 const int32_t* positions, const float* cos_table, const float* sin_table,
                 int64_t max_pos, bool inverse, cudaStream_t stream) {
  const int64_t n = n_tokens * n_rot_heads * (head_dim / 2);
  if (n == 0) return;
  dispatch_float(t, [&](auto ts) {
    using T = decltype(ts);
    constexpr int kN = static_cast<int>(16 / sizeof(T));
    if ((head_dim / 2) % kN == 0 && head_dim % 2 == 0 &&
        vec16_rows(head_dim, sizeof(T), {x, cos_table, sin_table})) {
      rope_vec_kernel<<<grid_for(n / kN, 256, 4096), 256, 0, stream>>>(
          static_cast<T*>(x), n_tokens, n_heads, n_rot_heads, head_dim, positions, cos_table,
          sin_table, max_pos, inverse);
      return;
    }
    rope_fwd_kernel<<<grid_for(n, 256, 4096), 256, 0, stream>>>(
        static_cast<T*>(x), n_tokens, n_heads, n_rot_heads, head_dim, positions, cos_table,
        sin_table, max_pos, inverse);
  });
  CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace hp

namespace hp {
namespace cuda {

namespace {

// One warp per (token, head) row.
template <typename T, typename W>
__global__ void qk_norm_fwd_kernel(const T* x, const W* qw, const W* kw, int64_t n, int h,
                                   int hq_norm, int h_norm, int d, float eps, T* out, float* rstd) {
  const int64_t row = blockIdx.x * (int64_t)kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= n * h) return;
  const int head = static_cast<int>(row % h);
  const int64_t t = row / h;
  const T* xr = x + row * d;
  T* yr = out + row * d;
  if (head >= h_norm) {
    for (int i = lane; i < d; i += 32) yr[i] = xr[i];
    return;
  }
  const W* w = head < hq_norm ? qw : kw;
  float ss = 0.f;
  for (int i = lane; i < d; i += 32) {
    const float v = to_f32(xr[i]);
    ss += v * v;
  }
  ss = warp_sum(ss);
  const float r = rsqrtf(ss / (float)d + eps);
  for (int i = lane; i < d; i += 32) yr[i] = from_f32<T>(to_f32(xr[i]) * r * to_f32(w[i]));
  if (lane == 0) rstd[t * h_norm + head] = r;
}

template <typename T, typename W>
__global__ void qk_norm_bwd_kernel(const T* x, const W* qw, const W* kw, int64_t n, int h,
                                   int hq_norm, int h_norm, int d, const float* rstd, const T* dy,
                                   T* dx) {
  const int64_t row = blockIdx.x * (int64_t)kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= n * h) return;
  const int head = static_cast<int>(row % h);
  const int64_t t = row / h;
  const T* dyr = dy + row * d;
  T* dxr = dx + row * d;
  if (head >= h_norm) {
    for (int i = lane; i < d; i += 32) dxr[i] = dyr[i];
    return;
  }
  const W* w = head < hq_norm ? qw : kw;
  const T* xr = x + row * d;
  float dot = 0.f;
  for (int i = lane; i < d; i += 32) dot += to_f32(dyr[i]) * to_f32(w[i]) * to_f32(xr[i]);
  dot = warp_sum(dot);
  const float r = rstd[t * h_norm + head];
  const float c = r * r * r * dot / (float)d;
  __syncwarp();  // dx may alias dy: every lane has read its dy before any lane writes
  for (int i = lane; i < d; i += 32)
    dxr[i] = from_f32<T>(r * to_f32(dyr[i]) * to_f32(w[i]) - c * to_f32(xr[i]));
}

// What the fused forward rotates by (rope_vec_kernel's arguments); unused where kRope is false.
struct RopeArgs {
  const int32_t* positions = nullptr;
  const float* cos_t = nullptr;
  const float* sin_t = nullptr;
  int64_t max_pos = 0;
};

// The same on Vec16 rows of L vectors (L = d / Vec16<T>::kN, a power of two <= 32): one warp a
// token, L lanes a head, 32 / L heads at a time and kAhead such groups loaded before any is used,
// so a head of 128 bf16 is 16 lanes of one 16-byte access each instead of 32 lanes of four 2-byte
// ones. Every lane of the warp takes part in the shuffles: heads past the token's last and v
// heads (copied, not normalized) compute a sum they then ignore.
// kRope (L >= 2): then rope of the normalized q and k heads, as launch_rope would rotate out: a
// lane of the first half of a head pairs with lane sub + L/2, which holds the elements D/2
// further on (a shuffle), and rotates the normalized values as rounded to T.
template <typename T, typename W, int L, bool kRope>
__global__ void qk_norm_fwd_vec_kernel(const uint4* x, const W* qw, const W* kw, int64_t n, int h,
                                       int hq_norm, int h_norm, float eps, RopeArgs rope,
                                       uint4* out, float* rstd) {
  constexpr int kN = Vec16<T>::kN, kSlots = 32 / L, kAhead = 4;
  static_assert(!kRope || L >= 2, "rope pairs lanes of one head");
  const int lane = threadIdx.x & 31, sub = lane % L, slot = lane / L;
  const int64_t t = blockIdx.x * (int64_t)kWarpsPerBlock + threadIdx.x / 32;
  if (t >= n) return;  // the whole warp: one token
  // The rotation's table entries of the token, loaded once for all of its heads.
  float c[kN], sn[kN];
  if constexpr (kRope) {
    const int64_t at =
        rope_position(rope.positions, t, rope.max_pos) * (L * kN / 2) + (sub % (L / 2)) * kN;
    load_rope_table<kN>(rope.cos_t, rope.sin_t, at, c, sn);
  }
  // Heads h0 + u kSlots + slot for u < kAhead: their loads are in flight together. The loop
  // bound is the same for every lane, so all of them reach the shuffles.
  for (int h0 = 0; h0 < h; h0 += kAhead * kSlots) {
    Vec16<T> v[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int head = h0 + u * kSlots + slot;
      v[u] = head < h ? Vec16<T>{x[(t * h + head) * L + sub]} : Vec16<T>{make_uint4(0, 0, 0, 0)};
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int head = h0 + u * kSlots + slot;
      const bool valid = head < h, norm = head < h_norm;
      float ss = 0.f;
#pragma unroll
      for (int q = 0; q < kN; ++q) ss = __fmaf_rn(v[u].get(q), v[u].get(q), ss);
#pragma unroll
      for (int o = L / 2; o > 0; o >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, o));
      Vec16<T> y = v[u];  // v heads: copied
      float r = 0.f;
      if (norm) {
        r = rsqrtf(__fadd_rn(__fdiv_rn(ss, (float)(L * kN)), eps));
        const W* w = (head < hq_norm ? qw : kw) + sub * kN;
#pragma unroll
        for (int q = 0; q < kN; ++q) y.set(q, __fmul_rn(__fmul_rn(v[u].get(q), r), to_f32(w[q])));
      }
      if constexpr (kRope) {
        const Vec16<T> other{shfl_xor_16(y.raw, L / 2)};
        if (norm) y = rope_lane(y, other, sub < L / 2, c, sn);
      }
      if (!valid) continue;
      out[(t * h + head) * L + sub] = y.raw;
      if (norm && sub == 0) rstd[t * h_norm + head] = r;
    }
  }
}

// The backward on Vec16 rows, with the weight gradients folded in: a grid of
// qk_norm_bwd_blocks(rows) blocks walks the groups of 32 / L rows (warp w of the grid takes
// groups w, w + W, w + 2W, ... for W warps in all, two at a time so that both groups' loads are
// in flight together), each lane summing dy * x * rstd of its kN columns for the q heads and for
// the k heads in that order; each block then adds its warps' and row slots' sums in a fixed order
// into partial[block][2d] (q columns, then k). The row partition depends on the row count only,
// so the sums are the same in every run. (Rope's inverse is not folded in: with the rotation,
// the sums no longer fit in registers, and the kernel that kept them in shared memory took 5.7
// ms a Qwen3-0.6B step on an H200 against 5.1 ms for rope's inverse and this kernel.)
template <typename T, typename W, int L>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, 4)
    qk_norm_bwd_vec_kernel(const uint4* x, const W* qw, const W* kw, int64_t n, int h, int hq_norm,
                           int h_norm, const float* rstd, const uint4* dy, uint4* dx,
                           float* partial) {
  constexpr int kN = Vec16<T>::kN, kSlots = 32 / L, kD = L * kN, kAhead = 2;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int sub = lane % L, slot = lane / L;
  const int64_t groups = (n * h + kSlots - 1) / kSlots;
  const int64_t stride = (int64_t)gridDim.x * kWarpsPerBlock;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  // (Every array here is indexed by unrolled constants only, so all of them stay in registers.)
  float acc_q[kN] = {}, acc_k[kN] = {};
  // The loop bound is the same for every lane of a warp, so all of them reach the shuffles.
  for (int64_t g0 = blockIdx.x * (int64_t)kWarpsPerBlock + warp; g0 < groups;
       g0 += kAhead * stride) {
    int64_t row[kAhead];
    bool valid[kAhead], norm[kAhead];
    int head[kAhead];
    Vec16<T> g[kAhead], v[kAhead];
    float r[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int64_t gi = g0 + u * stride;
      row[u] = gi * kSlots + slot;
      valid[u] = gi < groups && row[u] < n * h;
      head[u] = static_cast<int>(row[u] % h);
      norm[u] = valid[u] && head[u] < h_norm;
      g[u] = valid[u] ? Vec16<T>{dy[row[u] * L + sub]} : Vec16<T>{zero};
      v[u] = norm[u] ? Vec16<T>{x[row[u] * L + sub]} : Vec16<T>{zero};
      r[u] = norm[u] ? rstd[(row[u] / h) * h_norm + head[u]] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const W* w = (head[u] < hq_norm ? qw : kw) + sub * kN;
      float wf[kN];
#pragma unroll
      for (int q = 0; q < kN; ++q) wf[q] = norm[u] ? to_f32(w[q]) : 0.f;
      float dot = 0.f;
#pragma unroll
      for (int q = 0; q < kN; ++q) dot += g[u].get(q) * wf[q] * v[u].get(q);
#pragma unroll
      for (int o = L / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (!valid[u]) continue;
      if (!norm[u]) {
        dx[row[u] * L + sub] = g[u].raw;
        continue;
      }
      const float c = r[u] * r[u] * r[u] * dot / (float)kD;
      const bool q_side = head[u] < hq_norm;
      Vec16<T> o;
#pragma unroll
      for (int q = 0; q < kN; ++q) {
        const float wg = g[u].get(q) * v[u].get(q) * r[u];
        acc_q[q] += q_side ? wg : 0.f;
        acc_k[q] += q_side ? 0.f : wg;
        o.set(q, r[u] * g[u].get(q) * wf[q] - c * v[u].get(q));
      }
      dx[row[u] * L + sub] = o.raw;
    }
  }
  // [warp][slot][q columns, k columns] of this block.
  __shared__ float red[kWarpsPerBlock * kSlots][2 * kD];
  float* mine = red[warp * kSlots + slot];
#pragma unroll
  for (int q = 0; q < kN; ++q) {
    mine[sub * kN + q] = acc_q[q];
    mine[kD + sub * kN + q] = acc_k[q];
  }
  __syncthreads();
  for (int c = threadIdx.x; c < 2 * kD; c += blockDim.x) {
    float s = 0.f;
    for (int k = 0; k < kWarpsPerBlock * kSlots; ++k) s += red[k][c];
    partial[blockIdx.x * (int64_t)(2 * kD) + c] = s;
  }
}

// Blocks of the folded backward over `rows` rows of L lanes: a function of the row count only
// (about 64 row groups a warp; at most 512 blocks, which at 4 blocks an SM is one wave on an
// H100 or H200, and whose partial sums the finishing pass adds: 2048 made that pass 0.2 ms).
inline int64_t qk_norm_bwd_blocks(int64_t rows, int lanes) {
  const int64_t groups = (rows + 32 / lanes - 1) / (32 / lanes);
  const int64_t b = (groups + 64 * kWarpsPerBlock - 1) / (64 * kWarpsPerBlock);
  return b < 1 ? 1 : (b > 512 ? 512 : b);
}

// Calls f(std::integral_constant<int, L>) for L = d / Vec16<T>::kN when rows of d elements of T
// at these pointers are Vec16 rows and L is a power of two <= 32; false (f not called) else.
template <typename T, typename F>
bool with_vec16_lanes(int d, std::initializer_list<const void*> ptrs, F&& f) {
  constexpr int kN = Vec16<T>::kN;
  if (d % kN != 0 || !vec16_rows(d, sizeof(T), ptrs)) return false;
  switch (d / kN) {
    case 1:
      f(std::integral_constant<int, 1>{});
      return true;
    case 2:
      f(std::integral_constant<int, 2>{});
      return true;
    case 4:
      f(std::integral_constant<int, 4>{});
      return true;
    case 8:
      f(std::integral_constant<int, 8>{});
      return true;
    case 16:
      f(std::integral_constant<int, 16>{});
      return true;
    case 32:
      f(std::integral_constant<int, 32>{});
      return true;
    default:
      return false;
  }
}

// Column c < d: q-head weight gradient; c >= d: k-head weight gradient; rows are tokens.
template <typename T>
struct QkNormWeightGrad {
  const T* x;
  const T* dy;
  const float* rstd;
  int h, hq_norm, h_norm, d;
  __device__ float operator()(int64_t t, int64_t c) const {
    const bool k_side = c >= d;
    const int j = static_cast<int>(k_side ? c - d : c);
    const int h0 = k_side ? hq_norm : 0, h1 = k_side ? h_norm : hq_norm;
    float acc = 0.f;
    for (int head = h0; head < h1; ++head) {
      const int64_t i = (t * h + head) * d + j;
      acc += to_f32(dy[i]) * to_f32(x[i]) * rstd[t * h_norm + head];
    }
    return acc;
  }
};

// Whether rows of d elements of T at these pointers take the fused forward: Vec16 rows of L
// lanes, L a power of two from 2 to 32 (the rotation pairs the lanes of one head).
template <typename T>
bool rope_vec16_lanes(int d, std::initializer_list<const void*> ptrs) {
  constexpr int kN = Vec16<T>::kN;
  const int l = d / kN;
  return d % kN == 0 && l >= 2 && l <= 32 && (l & (l - 1)) == 0 && vec16_rows(d, sizeof(T), ptrs);
}

// qk_norm_fwd_vec_kernel<T, W, L, kRope> over x[n, h, d]; false (nothing launched) where the
// rows are not Vec16 rows of a lane count it takes.
template <typename T, typename W, bool kRope>
bool qk_norm_fwd_vec(const void* x, const void* qw, const void* kw, int64_t n, int h, int hq_norm,
                     int h_norm, int d, float eps, const RopeArgs& rope, void* out, float* rstd,
                     cudaStream_t stream) {
  if (kRope && !rope_vec16_lanes<T>(d, {x, out, rope.cos_t, rope.sin_t})) return false;
  return with_vec16_lanes<T>(d, {x, out}, [&](auto lanes) {
    constexpr int L = decltype(lanes)::value;
    if constexpr (!kRope || L >= 2) {
      qk_norm_fwd_vec_kernel<T, W, L, kRope>
          <<<static_cast<unsigned>((n + kWarpsPerBlock - 1) / kWarpsPerBlock), kWarpsPerBlock * 32,
             0, stream>>>(static_cast<const uint4*>(x), static_cast<const W*>(qw),
                          static_cast<const W*>(kw), n, h, hq_norm, h_norm, eps, rope,
                          static_cast<uint4*>(out), rstd);
      CUDA_CHECK_LAUNCH();
    }
  });
}

// qk_norm_bwd_vec_kernel<T, W, L> over x[n, h, d] and its column sums added to dqw[d] (q
// columns) and dkw[d] (k columns); false (nothing launched) where the rows are not Vec16 rows of
// a lane count it takes.
template <typename T, typename W>
bool qk_norm_bwd_vec(const void* x, const void* qw, const void* kw, int64_t n, int h, int hq_norm,
                     int h_norm, int d, const float* rstd, const void* dout, void* din, float* dqw,
                     float* dkw, Allocator& alloc, cudaStream_t stream) {
  const int64_t rows = n * h;
  return with_vec16_lanes<T>(d, {x, dout, din}, [&](auto lanes) {
    constexpr int L = decltype(lanes)::value;
    const int64_t blocks = qk_norm_bwd_blocks(rows, L);
    Tensor partial = Tensor::empty(alloc, {blocks, 2 * static_cast<int64_t>(d)}, DType::kF32);
    qk_norm_bwd_vec_kernel<T, W, L><<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(
        static_cast<const uint4*>(x), static_cast<const W*>(qw), static_cast<const W*>(kw), n, h,
        hq_norm, h_norm, rstd, static_cast<const uint4*>(dout), static_cast<uint4*>(din),
        partial.data<float>());
    CUDA_CHECK_LAUNCH();
    launch_column_finish(partial.data<float>(), blocks, 2 * d, 1.f, dqw, d, dkw, stream);
  });
}

}  // namespace

void launch_qk_norm_fwd(const void* x, DType t, const void* qw, const void* kw, DType w_t,
                        int64_t n, int h, int hq_norm, int hkv_norm, int d, float eps, void* out,
                        float* rstd, cudaStream_t stream) {
  const int64_t rows = n * h;
  if (rows == 0) return;
  const unsigned grid = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  dispatch_float(t, [&](auto ts) {
    using T = decltype(ts);
    dispatch_float(w_t, [&](auto ws) {
      using W = decltype(ws);
      if (qk_norm_fwd_vec<T, W, false>(x, qw, kw, n, h, hq_norm, hq_norm + hkv_norm, d, eps,
                                       RopeArgs{}, out, rstd, stream))
        return;
      qk_norm_fwd_kernel<<<grid, kWarpsPerBlock * 32, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const W*>(qw), static_cast<const W*>(kw), n, h,
          hq_norm, hq_norm + hkv_norm, d, eps, static_cast<T*>(out), rstd);
      CUDA_CHECK_LAUNCH();
    });
  });
}

void launch_qk_norm_bwd(const void* x, DType t, const void* qw, const void* kw, DType w_t,
                        int64_t n, int h, int hq_norm, int hkv_norm, int d, const float* rstd,
                        const void* dout, void* din, float* dqw, float* dkw, Allocator& alloc,
                        cudaStream_t stream) {
  const int64_t rows = n * h;
  if (rows == 0) return;
  const int h_norm = hq_norm + hkv_norm;
  dispatch_float(t, [&](auto ts) {
    using T = decltype(ts);
    // The weight gradients' column sums run over 2d columns (q, then k); the first d add to
    // dqw, the rest to dkw.
    dispatch_float(w_t, [&](auto ws) {
      using W = decltype(ws);
      if (qk_norm_bwd_vec<T, W>(x, qw, kw, n, h, hq_norm, h_norm, d, rstd, dout, din, dqw, dkw,
                                alloc, stream))
        return;
      // Weight gradients first: din may alias dout.
      column_sum_add(QkNormWeightGrad<T>{static_cast<const T*>(x), static_cast<const T*>(dout),
                                         rstd, h, hq_norm, h_norm, d},
                     n, 2 * d, 1.f, dqw, alloc, stream, d, dkw);
      const unsigned grid = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
      qk_norm_bwd_kernel<<<grid, kWarpsPerBlock * 32, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const W*>(qw), static_cast<const W*>(kw), n, h,
          hq_norm, h_norm, d, rstd, static_cast<const T*>(dout), static_cast<T*>(din));
      CUDA_CHECK_LAUNCH();
    });
  });
}

bool launch_qk_norm_rope_fwd(const void* x, DType t, const void* qw, const void* kw, DType w_t,
                             int64_t n, int h, int hq_norm, int hkv_norm, int d, float eps,
                             const int32_t* positions, const float* cos_table,
                             const float* sin_table, int64_t max_pos, void* out, float* rstd,
                             cudaStream_t stream) {
  if (n * h == 0) return true;
  const RopeArgs rope{positions, cos_table, sin_table, max_pos};
  bool done = false;
  dispatch_float(t, [&](auto ts) {
    using T = decltype(ts);
    dispatch_float(w_t, [&](auto ws) {
      using W = decltype(ws);
      done = qk_norm_fwd_vec<T, W, true>(x, qw, kw, n, h, hq_norm, hq_norm + hkv_norm, d, eps, rope,
                                         out, rstd, stream);
    });
  });
  return done;
}

}  // namespace cuda
}  // namespace hp
