// Token embedding (forward, deterministic backward) and the fused softmax cross-entropy.
#include <cub/device/device_radix_sort.cuh>
#include <type_traits>

#include "framework/backend/cuda/cuda_common.cuh"
#include "framework/backend/cuda/cuda_kernels.h"

namespace hp {
namespace cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kLossThreads = 1024;

template <typename S, typename T>
__global__ void embedding_fwd_kernel(const S* table, int64_t v, const int32_t* ids, int64_t n,
                                     int64_t d, T* out) {
  const int64_t total = n * d;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / d, c = i - t * d;
    const int32_t id = ids[t];
    out[i] = from_f32<T>(id >= 0 && id < v ? to_f32(table[id * d + c]) : 0.f);
  }
}

__global__ void iota_kernel(int32_t* p, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) p[i] = static_cast<int32_t>(i);
}

// Block j handles the run of equal ids starting at sorted position j (others exit): the rows of
// the run are summed in token order, so the result does not depend on scheduling.
template <typename T>
__global__ void embedding_bwd_kernel(const T* dout, const int32_t* sorted_ids,
                                     const int32_t* sorted_pos, int64_t n, int64_t d, int64_t v,
                                     float* dtable) {
  const int64_t j = blockIdx.x;
  const int32_t id = sorted_ids[j];
  if ((j > 0 && sorted_ids[j - 1] == id) || id < 0 || id >= v) return;
  int64_t end = j + 1;
  while (end < n && sorted_ids[end] == id) ++end;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    float acc = 0.f;
    for (int64_t r = j; r < end; ++r)
      acc += to_f32(dout[static_cast<int64_t>(sorted_pos[r]) * d + c]);
    dtable[id * d + c] += acc;
  }
}

// embedding_fwd_kernel on Vec16 rows where table and out share a dtype (a plain row copy).
__global__ void embedding_fwd_vec_kernel(const uint4* table, int64_t v, const int32_t* ids,
                                         int64_t n, int64_t dv, uint4* out) {
  const int64_t total = n * dv;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / dv, c = i - t * dv;
    const int32_t id = ids[t];
    out[i] = id >= 0 && id < v ? table[id * dv + c] : make_uint4(0, 0, 0, 0);
  }
}

// embedding_bwd_kernel with a Vec16 of dout per thread and step (the same sums, in token order).
template <typename T>
__global__ void embedding_bwd_vec_kernel(const uint4* dout, const int32_t* sorted_ids,
                                         const int32_t* sorted_pos, int64_t n, int64_t dv,
                                         int64_t v, float* dtable) {
  constexpr int kN = Vec16<T>::kN;
  const int64_t j = blockIdx.x;
  const int32_t id = sorted_ids[j];
  if ((j > 0 && sorted_ids[j - 1] == id) || id < 0 || id >= v) return;
  int64_t end = j + 1;
  while (end < n && sorted_ids[end] == id) ++end;
  for (int64_t c = threadIdx.x; c < dv; c += blockDim.x) {
    float acc[kN] = {};
    for (int64_t r = j; r < end; ++r) {
      const Vec16<T> x{dout[static_cast<int64_t>(sorted_pos[r]) * dv + c]};
      for (int q = 0; q < kN; ++q) acc[q] += x.get(q);
    }
    float4* dst = reinterpret_cast<float4*>(dtable + (id * dv + c) * kN);
    for (int q = 0; q < kN / 4; ++q) {
      float4 o = dst[q];
      o.x += acc[4 * q];
      o.y += acc[4 * q + 1];
      o.z += acc[4 * q + 2];
      o.w += acc[4 * q + 3];
      dst[q] = o;
    }
  }
}

// Adds x to a running (max m, sum s of exp(. - m)).
__device__ __forceinline__ void online_softmax_add(float x, float& m, float& s) {
  if (x > m) {
    s = s * __expf(m - x) + 1.f;
    m = x;
  } else {
    s += __expf(x - m);
  }
}

// One block per row: an online max/sum pass, then the gradient pass.
template <typename T>
__global__ void cross_entropy_fwd_kernel(T* logits, const int32_t* targets, int64_t v,
                                         float grad_scale, float* row_loss) {
  __shared__ float scratch[33];
  const int64_t row = blockIdx.x;
  T* lr = logits + row * v;
  const int32_t target = targets[row];
  const bool valid = target >= 0 && target < v;
  if (!valid) {
    for (int64_t i = threadIdx.x; i < v; i += blockDim.x) lr[i] = from_f32<T>(0.f);
    if (threadIdx.x == 0) row_loss[row] = 0.f;
    return;
  }
  const float target_logit = to_f32(lr[target]);
  float m = -INFINITY, s = 0.f;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
    online_softmax_add(to_f32(lr[i]), m, s);
  }
  const float M = block_max(m, scratch);
  const float S = block_sum(m == -INFINITY ? 0.f : s * __expf(m - M), scratch);
  const float lse = M + __logf(S);
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
    const float p = __expf(to_f32(lr[i]) - lse);
    lr[i] = from_f32<T>(grad_scale * (p - (i == target ? 1.f : 0.f)));
  }
  if (threadIdx.x == 0) row_loss[row] = lse - target_logit;
}

// The bf16 row kernel with 16-byte accesses (8 logits each): the loss reads the vocabulary-wide
// logits twice and writes their gradient once, so it is bound by bandwidth. Deterministic like
// cross_entropy_fwd_kernel (each thread visits its elements in another order, so the rounding of
// the sums differs from it). Needs v % 8 == 0 and 16-byte aligned rows.
__global__ void cross_entropy_bf16x8_kernel(bf16_t* logits, const int32_t* targets, int64_t v,
                                            float grad_scale, float* row_loss) {
  __shared__ float scratch[33];
  const int64_t row = blockIdx.x;
  bf16_t* lr = logits + row * v;
  uint4* lr8 = reinterpret_cast<uint4*>(lr);
  const int64_t v8 = v / 8;
  const int32_t target = targets[row];
  const bool valid = target >= 0 && target < v;
  if (!valid) {
    for (int64_t i = threadIdx.x; i < v8; i += blockDim.x) lr8[i] = make_uint4(0, 0, 0, 0);
    if (threadIdx.x == 0) row_loss[row] = 0.f;
    return;
  }
  const float target_logit = to_f32(lr[target]);
  float m = -INFINITY, s = 0.f;
  for (int64_t i = threadIdx.x; i < v8; i += blockDim.x) {
    const uint4 q = lr8[i];
    const bf16_t* e = reinterpret_cast<const bf16_t*>(&q);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      online_softmax_add(to_f32(e[j]), m, s);
    }
  }
  const float M = block_max(m, scratch);
  const float S = block_sum(m == -INFINITY ? 0.f : s * __expf(m - M), scratch);
  const float lse = M + __logf(S);
  for (int64_t i = threadIdx.x; i < v8; i += blockDim.x) {
    uint4 q = lr8[i];
    bf16_t* e = reinterpret_cast<bf16_t*>(&q);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float p = __expf(to_f32(e[j]) - lse);
      e[j] = from_f32<bf16_t>(grad_scale * (p - (i * 8 + j == target ? 1.f : 0.f)));
    }
    lr8[i] = q;
  }
  if (threadIdx.x == 0) row_loss[row] = lse - target_logit;
}

}  // namespace

void launch_embedding_fwd(const void* table, DType table_t, int64_t v, const int32_t* ids,
                          int64_t n, int64_t d, void* out, DType out_t, cudaStream_t stream) {
  if (n * d == 0) return;
  dispatch_float(table_t, [&](auto ss) {
    using S = decltype(ss);
    dispatch_float(out_t, [&](auto ts) {
      using T = decltype(ts);
      if (std::is_same<S, T>::value && vec16_rows(d, sizeof(T), {table, out})) {
        const int64_t dv = d * static_cast<int64_t>(sizeof(T)) / 16;
        embedding_fwd_vec_kernel<<<grid_for(n * dv, kThreads, 8192), kThreads, 0, stream>>>(
            static_cast<const uint4*>(table), v, ids, n, dv, static_cast<uint4*>(out));
        return;
      }
      embedding_fwd_kernel<<<grid_for(n * d, kThreads, 8192), kThreads, 0, stream>>>(
          static_cast<const S*>(table), v, ids, n, d, static_cast<T*>(out));
    });
  });
  CUDA_CHECK_LAUNCH();
}

void launch_embedding_bwd(const void* dout, DType t, const int32_t* ids, int64_t n, int64_t d,
                          int64_t v, float* dtable, Allocator& alloc, cudaStream_t stream) {
  if (n == 0 || d == 0) return;
  int end_bit = 1;
  while (end_bit < 31 && (1ll << end_bit) < v) ++end_bit;
  Tensor work = Tensor::empty(alloc, {3, n}, DType::kI32);
  int32_t* iota = work.data<int32_t>();
  int32_t* sorted_ids = iota + n;
  int32_t* sorted_pos = sorted_ids + n;
  iota_kernel<<<grid_for(n, kThreads, 1ll << 30), kThreads, 0, stream>>>(iota, n);
  CUDA_CHECK_LAUNCH();
  size_t temp_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, ids, sorted_ids, iota, sorted_pos,
                                             static_cast<int>(n), 0, end_bit, stream));
  Tensor temp = Tensor::empty(alloc, {static_cast<int64_t>(temp_bytes / 4 + 1)}, DType::kI32);
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.raw(), temp_bytes, ids, sorted_ids, iota,
                                             sorted_pos, static_cast<int>(n), 0, end_bit, stream));
  dispatch_float(t, [&](auto ts) {
    using T = decltype(ts);
    if (vec16_rows(d, sizeof(T), {dout, dtable})) {
      const int64_t dv = d * static_cast<int64_t>(sizeof(T)) / 16;
      embedding_bwd_vec_kernel<T><<<static_cast<unsigned>(n), kThreads, 0, stream>>>(
          static_cast<const uint4*>(dout), sorted_ids, sorted_pos, n, dv, v, dtable);
      return;
    }
    embedding_bwd_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(
        static_cast<const T*>(dout), sorted_ids, sorted_pos, n, d, v, dtable);
  });
  CUDA_CHECK_LAUNCH();
}

void launch_cross_entropy(void* logits, DType t, const int32_t* targets, int64_t n, int64_t v,
                          float grad_scale, float* loss, Allocator& alloc, cudaStream_t stream) {
  if (n == 0) return;
  Tensor row_loss = Tensor::empty(alloc, {n}, DType::kF32);
  if (t == DType::kBF16 && v % 8 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0) {
    cross_entropy_bf16x8_kernel<<<static_cast<unsigned>(n), kLossThreads, 0, stream>>>(
        static_cast<bf16_t*>(logits), targets, v, grad_scale, row_loss.data<float>());
    CUDA_CHECK_LAUNCH();
    launch_reduce_sum_add(row_loss.data<float>(), n, 1.f, loss, alloc, stream);
    return;
  }
  dispatch_float(t, [&](auto ts) {
    using T = decltype(ts);
    cross_entropy_fwd_kernel<<<static_cast<unsigned>(n), kLossThreads, 0, stream>>>(
        static_cast<T*>(logits), targets, v, grad_scale, row_loss.data<float>());
  });
  CUDA_CHECK_LAUNCH();
  launch_reduce_sum_add(row_loss.data<float>(), n, 1.f, loss, alloc, stream);
}

}  // namespace cuda
}  // namespace hp
