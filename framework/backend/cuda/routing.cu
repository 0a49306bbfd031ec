// Mixture-of-experts routing: top-k selection, load-balancing loss, histogram, scan, stable sort
// by expert, row permutation and the weighted combine (and their backward passes).
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "framework/backend/cuda/cuda_common.cuh"
#include "framework/backend/cuda/cuda_kernels.h"

namespace hp {
namespace cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxExpertsPerLane = 8;  // E <= 256

// One warp per row.
template <typename T, typename W>
__global__ void router_topk_fwd_kernel(const T* logits, int64_t n, int e, int k, int32_t* idx,
                                       W* w) {
  const int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= n) return;
  float v[kMaxExpertsPerLane];
  bool taken[kMaxExpertsPerLane];
#pragma unroll
  for (int j = 0; j < kMaxExpertsPerLane; ++j) {
    const int x = lane + 32 * j;
    v[j] = x < e ? to_f32(logits[row * e + x]) : -INFINITY;
    taken[j] = x >= e;
  }
  float top_first = 0.f, denom = 0.f;
  float picked_v = 0.f;  // lane s keeps the s-th picked logit
  int picked_i = 0;
  for (int s = 0; s < k; ++s) {
    float best = -INFINITY;
    int best_i = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < kMaxExpertsPerLane; ++j) {
      const int x = lane + 32 * j;
      if (!taken[j] && (v[j] > best || (v[j] == best && x < best_i))) {
        best = v[j];
        best_i = x;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
      if (ob > best || (ob == best && oi < best_i)) {
        best = ob;
        best_i = oi;
      }
    }
    if (best_i == 0x7fffffff) best_i = 0;  // fewer finite candidates than k (E < k is rejected)
#pragma unroll
    for (int j = 0; j < kMaxExpertsPerLane; ++j)
      if (lane + 32 * j == best_i) taken[j] = true;
    if (s == 0) top_first = best;
    denom += __expf(best - top_first);
    if (lane == s) {
      picked_v = best;
      picked_i = best_i;
    }
  }
  if (lane < k) {
    idx[row * k + lane] = picked_i;
    w[row * k + lane] = from_f32<W>(__expf(picked_v - top_first) / denom);
  }
}

template <typename W, typename T>
__global__ void router_topk_bwd_kernel(const int32_t* idx, const W* w, const W* dw, int64_t n,
                                       int e, int k, T* dlogits) {
  const int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= n) return;
  float dot = 0.f;
  for (int s = 0; s < k; ++s) dot += to_f32(w[row * k + s]) * to_f32(dw[row * k + s]);
  for (int x = lane; x < e; x += 32) {
    float g = 0.f;
    for (int s = 0; s < k; ++s) {
      if (idx[row * k + s] == x) g = to_f32(w[row * k + s]) * (to_f32(dw[row * k + s]) - dot);
    }
    dlogits[row * e + x] = from_f32<T>(g);
  }
}

// One warp per row: row_val[row] = sum_e f_e p_e; dlogits += c * p (f - row_val).
template <typename T>
__global__ void router_aux_loss_fwd_kernel(const T* logits, const int32_t* counts, int64_t n, int e,
                                           float inv_assign, float c, float* row_val, T* dlogits) {
  const int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= n) return;
  const T* lr = logits + row * e;
  float mx = -INFINITY;
  for (int x = lane; x < e; x += 32) mx = fmaxf(mx, to_f32(lr[x]));
  mx = warp_max(mx);
  float z = 0.f, fz = 0.f;
  for (int x = lane; x < e; x += 32) {
    const float p = __expf(to_f32(lr[x]) - mx);
    z += p;
    fz += p * counts[x] * inv_assign;
  }
  z = warp_sum(z);
  fz = warp_sum(fz);
  const float val = fz / z;
  for (int x = lane; x < e; x += 32) {
    const float p = __expf(to_f32(lr[x]) - mx) / z;
    const float f = counts[x] * inv_assign;
    T* d = dlogits + row * e + x;
    *d = from_f32<T>(to_f32(*d) + c * p * (f - val));
  }
  if (lane == 0) row_val[row] = val;
}

__global__ void histogram_fwd_kernel(const int32_t* ids, int64_t m, int n_bins, int32_t* counts) {
  extern __shared__ int32_t bins[];
  const bool use_smem = n_bins <= 8192;
  if (use_smem) {
    for (int i = threadIdx.x; i < n_bins; i += blockDim.x) bins[i] = 0;
    __syncthreads();
  }
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < m;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int32_t id = ids[i];
    if (id < 0 || id >= n_bins) continue;
    atomicAdd(use_smem ? &bins[id] : &counts[id], 1);
  }
  if (use_smem) {
    __syncthreads();
    for (int i = threadIdx.x; i < n_bins; i += blockDim.x)
      if (bins[i]) atomicAdd(&counts[i], bins[i]);
  }
}

__global__ void iota_kernel(int32_t* p, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) p[i] = static_cast<int32_t>(i);
}

__global__ void invert_permutation_kernel(const int32_t* perm, int64_t m, int32_t* inv,
                                          int64_t inv_size) {
  const int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (j < m) {
    const int32_t a = perm[j];
    if (a >= 0 && a < inv_size) inv[a] = static_cast<int32_t>(j);
  }
}

template <typename T>
__global__ void permute_rows_fwd_kernel(const T* x, int64_t d, const int32_t* s2a, int64_t m, int k,
                                        T* out) {
  const int64_t total = m * d;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t j = i / d, c = i - j * d;
    out[i] = x[static_cast<int64_t>(s2a[j] / k) * d + c];
  }
}

// dx[t] = sum_s dout[inv[t k + s]] (slot order: deterministic; written, not added to).
template <typename T>
__global__ void permute_rows_bwd_kernel(const T* dout, int64_t d, const int32_t* inv, int64_t n,
                                        int k, T* dx) {
  const int64_t total = n * d;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / d, c = i - t * d;
    float acc = 0.f;
    for (int s = 0; s < k; ++s) {
      const int32_t j = inv[t * k + s];
      if (j >= 0) acc += to_f32(dout[static_cast<int64_t>(j) * d + c]);
    }
    dx[i] = from_f32<T>(acc);
  }
}

template <typename T, typename W>
__global__ void unpermute_combine_fwd_kernel(const T* y, int64_t d, const int32_t* a2s, const W* w,
                                             int64_t n, int k, T* out) {
  const int64_t total = n * d;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / d, c = i - t * d;
    float acc = 0.f;
    for (int s = 0; s < k; ++s)
      acc += to_f32(w[t * k + s]) * to_f32(y[static_cast<int64_t>(a2s[t * k + s]) * d + c]);
    out[i] = from_f32<T>(acc);
  }
}

template <typename T, typename W>
__global__ void unpermute_combine_bwd_dy_kernel(const T* dout, int64_t d, const int32_t* a2s,
                                                const W* w, int64_t n, int k, T* dy) {
  const int64_t total = n * k * d;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t a = i / d, c = i - a * d;
    const int64_t t = a / k;
    dy[static_cast<int64_t>(a2s[a]) * d + c] = from_f32<T>(to_f32(w[a]) * to_f32(dout[t * d + c]));
  }
}

// One warp per assignment: dw[a] = dout[a / k] . y[a2s[a]].
template <typename T, typename W>
__global__ void unpermute_combine_bwd_dw_kernel(const T* dout, const T* y, int64_t d,
                                                const int32_t* a2s, int64_t n, int k, W* dw) {
  const int64_t a = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (a >= n * k) return;
  const T* dr = dout + (a / k) * d;
  const T* yr = y + static_cast<int64_t>(a2s[a]) * d;
  float acc = 0.f;
  for (int64_t c = lane; c < d; c += 32) acc += to_f32(dr[c]) * to_f32(yr[c]);
  acc = warp_sum(acc);
  if (lane == 0) dw[a] = from_f32<W>(acc);
}

// The same four kernels on rows of Vec16 (dv vectors a row), where rows are 16-byte aligned.
template <typename T>
__global__ void permute_rows_fwd_vec_kernel(const uint4* x, int64_t dv, const int32_t* s2a,
                                            int64_t m, int k, uint4* out) {
  const int64_t total = m * dv;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t j = i / dv, c = i - j * dv;
    out[i] = x[static_cast<int64_t>(s2a[j] / k) * dv + c];
  }
}

template <typename T>
__global__ void permute_rows_bwd_vec_kernel(const uint4* dout, int64_t dv, const int32_t* inv,
                                            int64_t n, int k, uint4* dx) {
  constexpr int kN = Vec16<T>::kN;
  const int64_t total = n * dv;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / dv, c = i - t * dv;
    float a[kN];
    for (int q = 0; q < kN; ++q) a[q] = 0.f;
    for (int s = 0; s < k; ++s) {
      const int32_t j = inv[t * k + s];
      if (j < 0) continue;
      const Vec16<T> v{dout[static_cast<int64_t>(j) * dv + c]};
      for (int q = 0; q < kN; ++q) a[q] += v.get(q);
    }
    Vec16<T> out;
    for (int q = 0; q < kN; ++q) out.set(q, a[q]);
    dx[i] = out.raw;
  }
}

template <typename T, typename W>
__global__ void unpermute_combine_fwd_vec_kernel(const uint4* y, int64_t dv, const int32_t* a2s,
                                                 const W* w, int64_t n, int k, uint4* out) {
  constexpr int kN = Vec16<T>::kN;
  const int64_t total = n * dv;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / dv, c = i - t * dv;
    float a[kN] = {};
    for (int s = 0; s < k; ++s) {
      const float ws = to_f32(w[t * k + s]);
      const Vec16<T> v{y[static_cast<int64_t>(a2s[t * k + s]) * dv + c]};
      for (int q = 0; q < kN; ++q) a[q] += ws * v.get(q);
    }
    Vec16<T> r;
    for (int q = 0; q < kN; ++q) r.set(q, a[q]);
    out[i] = r.raw;
  }
}

template <typename T, typename W>
__global__ void unpermute_combine_bwd_dy_vec_kernel(const uint4* dout, int64_t dv,
                                                    const int32_t* a2s, const W* w, int64_t n,
                                                    int k, uint4* dy) {
  constexpr int kN = Vec16<T>::kN;
  const int64_t total = n * k * dv;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t a = i / dv, c = i - a * dv;
    const float wa = to_f32(w[a]);
    const Vec16<T> v{dout[(a / k) * dv + c]};
    Vec16<T> r;
    for (int q = 0; q < kN; ++q) r.set(q, wa * v.get(q));
    dy[static_cast<int64_t>(a2s[a]) * dv + c] = r.raw;
  }
}

// One warp per assignment, a vector per lane and step: dw[a] = dout[a / k] . y[a2s[a]].
template <typename T, typename W>
__global__ void unpermute_combine_bwd_dw_vec_kernel(const uint4* dout, const uint4* y, int64_t dv,
                                                    const int32_t* a2s, int64_t n, int k, W* dw) {
  constexpr int kN = Vec16<T>::kN;
  const int64_t a = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (a >= n * k) return;
  const uint4* dr = dout + (a / k) * dv;
  const uint4* yr = y + static_cast<int64_t>(a2s[a]) * dv;
  float acc = 0.f;
  for (int64_t c = lane; c < dv; c += 32) {
    const Vec16<T> p{dr[c]}, q{yr[c]};
    for (int e = 0; e < kN; ++e) acc += p.get(e) * q.get(e);
  }
  acc = warp_sum(acc);
  if (lane == 0) dw[a] = from_f32<W>(acc);
}

unsigned warp_rows_grid(int64_t rows) {
  return static_cast<unsigned>((rows + kThreads / 32 - 1) / (kThreads / 32));
}

}  // namespace

void launch_router_topk(const void* logits, DType t, int64_t n, int e, int k, int32_t* idx, void* w,
                        DType w_t, cudaStream_t stream) {
  HP_CHECK(e <= 32 * kMaxExpertsPerLane && k <= 32 && k <= e, "router_topk: E=", e, ", k=", k,
           " (need k <= E <= 256, k <= 32)");
  if (n == 0) return;
  dispatch_float(t, [&](auto ts) {
    using T = decltype(ts);
    dispatch_float(w_t, [&](auto ws) {
      using W = decltype(ws);
      router_topk_fwd_kernel<<<warp_rows_grid(n), kThreads, 0, stream>>>(
          static_cast<const T*>(logits), n, e, k, idx, static_cast<W*>(w));
    });
  });
  CUDA_CHECK_LAUNCH();
}

void launch_router_topk_bwd(const int32_t* idx, const void* w, const void* dw, DType w_t, int64_t n,
                            int e, int k, void* dlogits, DType t, cudaStream_t stream) {
  if (n == 0) return;
  dispatch_float(t, [&](auto ts) {
    using T = decltype(ts);
    dispatch_float(w_t, [&](auto ws) {
      using W = decltype(ws);
      router_topk_bwd_kernel<<<warp_rows_grid(n), kThreads, 0, stream>>>(
          idx, static_cast<const W*>(w), static_cast<const W*>(dw), n, e, k,
          static_cast<T*>(dlogits));
    });
  });
  CUDA_CHECK_LAUNCH();
}

void launch_router_aux_loss(const void* logits, DType t, const int32_t* counts, int64_t n, int e,
                            int k, float coef, float* loss, void* dlogits, Allocator& alloc,
                            cudaStream_t stream) {
  if (n == 0) return;
  Tensor row_val = Tensor::empty(alloc, {n}, DType::kF32);
  const float inv_assign = 1.f / (static_cast<float>(n) * k);
  const float c = coef * e / static_cast<float>(n);
  dispatch_float(t, [&](auto ts) {
    using T = decltype(ts);
    router_aux_loss_fwd_kernel<<<warp_rows_grid(n), kThreads, 0, stream>>>(
        static_cast<const T*>(logits), counts, n, e, inv_assign, c, row_val.data<float>(),
        static_cast<T*>(dlogits));
  });
  CUDA_CHECK_LAUNCH();
  launch_reduce_sum_add(row_val.data<float>(), n, c, loss, alloc, stream);
}

void launch_histogram(const int32_t* ids, int64_t m, int n_bins, int32_t* counts,
                      cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(counts, 0, n_bins * sizeof(int32_t), stream));
  if (m == 0) return;
  const size_t smem = n_bins <= 8192 ? n_bins * sizeof(int32_t) : 0;
  histogram_fwd_kernel<<<grid_for(m, kThreads, 264), kThreads, smem, stream>>>(ids, m, n_bins,
                                                                               counts);
  CUDA_CHECK_LAUNCH();
}

void launch_exclusive_scan(const int32_t* counts, int64_t n, int32_t* offsets, Allocator& alloc,
                           cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(offsets, 0, sizeof(int32_t), stream));
  if (n == 0) return;
  size_t temp_bytes = 0;
  CUDA_CHECK(cub::DeviceScan::InclusiveSum(nullptr, temp_bytes, counts, offsets + 1,
                                           static_cast<int>(n), stream));
  Tensor temp = Tensor::empty(alloc, {static_cast<int64_t>(temp_bytes / 4 + 1)}, DType::kI32);
  CUDA_CHECK(cub::DeviceScan::InclusiveSum(temp.raw(), temp_bytes, counts, offsets + 1,
                                           static_cast<int>(n), stream));
}

void launch_sort_by_id(const int32_t* ids, int64_t m, int n_bins, int32_t* sorted_to_assign,
                       int32_t* assign_to_sorted, Allocator& alloc, cudaStream_t stream) {
  if (m == 0) return;
  int end_bit = 1;
  while (end_bit < 31 && (1ll << end_bit) < n_bins) ++end_bit;
  Tensor work = Tensor::empty(alloc, {2, m}, DType::kI32);
  int32_t* iota = work.data<int32_t>();
  int32_t* keys_out = iota + m;
  iota_kernel<<<grid_for(m, kThreads, 1ll << 30), kThreads, 0, stream>>>(iota, m);
  CUDA_CHECK_LAUNCH();
  size_t temp_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, ids, keys_out, iota,
                                             sorted_to_assign, static_cast<int>(m), 0, end_bit,
                                             stream));
  Tensor temp = Tensor::empty(alloc, {static_cast<int64_t>(temp_bytes / 4 + 1)}, DType::kI32);
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.raw(), temp_bytes, ids, keys_out, iota,
                                             sorted_to_assign, static_cast<int>(m), 0, end_bit,
                                             stream));
  invert_permutation_kernel<<<grid_for(m, kThreads, 1ll << 30), kThreads, 0, stream>>>(
      sorted_to_assign, m, assign_to_sorted, m);
  CUDA_CHECK_LAUNCH();
}

void launch_permute_rows(const void* x, DType t, int64_t d, const int32_t* sorted_to_assign,
                         int64_t m, int k, void* out, cudaStream_t stream) {
  if (m * d == 0) return;
  dispatch_float(t, [&](auto ts) {
    using T = decltype(ts);
    if (vec16_rows(d, sizeof(T), {x, out})) {
      const int64_t dv = d * static_cast<int64_t>(sizeof(T)) / 16;
      permute_rows_fwd_vec_kernel<T><<<grid_for(m * dv, kThreads, 8192), kThreads, 0, stream>>>(
          static_cast<const uint4*>(x), dv, sorted_to_assign, m, k, static_cast<uint4*>(out));
      return;
    }
    permute_rows_fwd_kernel<<<grid_for(m * d, kThreads, 8192), kThreads, 0, stream>>>(
        static_cast<const T*>(x), d, sorted_to_assign, m, k, static_cast<T*>(out));
  });
  CUDA_CHECK_LAUNCH();
}

void launch_permute_rows_bwd(const void* dout, DType t, int64_t d, const int32_t* sorted_to_assign,
                             int64_t m, int k, int64_t n, void* dx, Allocator& alloc,
                             cudaStream_t stream) {
  if (n * d == 0) return;
  Tensor inv = Tensor::empty(alloc, {n * k}, DType::kI32);
  launch_fill(inv.raw(), DType::kI32, n * k, -1, stream);
  if (m > 0) {
    invert_permutation_kernel<<<grid_for(m, kThreads, 1ll << 30), kThreads, 0, stream>>>(
        sorted_to_assign, m, inv.data<int32_t>(), n * k);
    CUDA_CHECK_LAUNCH();
  }
  dispatch_float(t, [&](auto ts) {
    using T = decltype(ts);
    if (vec16_rows(d, sizeof(T), {dout, dx})) {
      const int64_t dv = d * static_cast<int64_t>(sizeof(T)) / 16;
      permute_rows_bwd_vec_kernel<T><<<grid_for(n * dv, kThreads, 8192), kThreads, 0, stream>>>(
          static_cast<const uint4*>(dout), dv, inv.data<int32_t>(), n, k, static_cast<uint4*>(dx));
      return;
    }
    permute_rows_bwd_kernel<<<grid_for(n * d, kThreads, 8192), kThreads, 0, stream>>>(
        static_cast<const T*>(dout), d, inv.data<int32_t>(), n, k, static_cast<T*>(dx));
  });
  CUDA_CHECK_LAUNCH();
}

void launch_unpermute_combine(const void* y, DType t, int64_t d, const int32_t* assign_to_sorted,
                              int64_t m, const void* w, DType w_t, int64_t n, int k, void* out,
                              cudaStream_t stream) {
  if (n * d == 0) return;
  dispatch_float(t, [&](auto ts) {
    using T = decltype(ts);
    dispatch_float(w_t, [&](auto ws) {
      using W = decltype(ws);
      if (vec16_rows(d, sizeof(T), {y, out})) {
        const int64_t dv = d * static_cast<int64_t>(sizeof(T)) / 16;
        unpermute_combine_fwd_vec_kernel<T, W>
            <<<grid_for(n * dv, kThreads, 8192), kThreads, 0, stream>>>(
                static_cast<const uint4*>(y), dv, assign_to_sorted, static_cast<const W*>(w), n, k,
                static_cast<uint4*>(out));
        return;
      }
      unpermute_combine_fwd_kernel<<<grid_for(n * d, kThreads, 8192), kThreads, 0, stream>>>(
          static_cast<const T*>(y), d, assign_to_sorted, static_cast<const W*>(w), n, k,
          static_cast<T*>(out));
    });
  });
  CUDA_CHECK_LAUNCH();
}

void launch_unpermute_combine_bwd(const void* dout, const void* y, DType t, int64_t d,
                                  const int32_t* assign_to_sorted, int64_t m, const void* w,
                                  DType w_t, int64_t n, int k, void* dy, void* dw,
                                  cudaStream_t stream) {
  if (n * k == 0) return;
  dispatch_float(t, [&](auto ts) {
    using T = decltype(ts);
    dispatch_float(w_t, [&](auto ws) {
      using W = decltype(ws);
      if (d > 0 && vec16_rows(d, sizeof(T), {dout, y, dy})) {
        const int64_t dv = d * static_cast<int64_t>(sizeof(T)) / 16;
        unpermute_combine_bwd_dy_vec_kernel<T, W>
            <<<grid_for(n * k * dv, kThreads, 8192), kThreads, 0, stream>>>(
                static_cast<const uint4*>(dout), dv, assign_to_sorted, static_cast<const W*>(w), n,
                k, static_cast<uint4*>(dy));
        unpermute_combine_bwd_dw_vec_kernel<T, W><<<warp_rows_grid(n * k), kThreads, 0, stream>>>(
            static_cast<const uint4*>(dout), static_cast<const uint4*>(y), dv, assign_to_sorted, n,
            k, static_cast<W*>(dw));
        return;
      }
      if (d > 0) {
        unpermute_combine_bwd_dy_kernel<<<grid_for(n * k * d, kThreads, 8192), kThreads, 0,
                                          stream>>>(static_cast<const T*>(dout), d,
                                                    assign_to_sorted, static_cast<const W*>(w), n,
                                                    k, static_cast<T*>(dy));
      }
      unpermute_combine_bwd_dw_kernel<<<warp_rows_grid(n * k), kThreads, 0, stream>>>(
          static_cast<const T*>(dout), static_cast<const T*>(y), d, assign_to_sorted, n, k,
          static_cast<W*>(dw));
    });
  });
  CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace hp
