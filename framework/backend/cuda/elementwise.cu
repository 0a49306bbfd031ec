// Element-wise kernels: fill, convert, add, axpy, bias, gated activations.
#include <cmath>

#include "framework/backend/cuda/cuda_common.cuh"
#include "framework/backend/cuda/cuda_kernels.h"
#include "framework/backend/cuda/glu_math.cuh"
#include "framework/core/rng.h"

namespace hp {
namespace cuda {

namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void fill_kernel(T* p, int64_t n, T v) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    p[i] = v;
}

template <typename T>
__global__ void fill_normal_kernel(T* p, int64_t n, uint64_t key, int64_t offset, double std) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    p[i] =
        static_cast<T>(rng_detail::mul(std, philox_normal(key, static_cast<uint64_t>(offset + i))));
}

template <typename S, typename D>
__global__ void convert_kernel(const S* src, D* dst, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = from_f32<D>(to_f32(src[i]));
}

// 8 bf16 per 16-byte access: residual adds move n * 6 bytes, so they are bandwidth-bound.
__global__ void add_bf16x8_kernel(const uint4* a, const uint4* b, uint4* out, int64_t n8) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n8;
       i += (int64_t)gridDim.x * blockDim.x) {
    const uint4 x = a[i], y = b[i];
    uint4 r;
    const auto* xa = reinterpret_cast<const __nv_bfloat162*>(&x);
    const auto* ya = reinterpret_cast<const __nv_bfloat162*>(&y);
    auto* ra = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 fx = __bfloat1622float2(xa[j]), fy = __bfloat1622float2(ya[j]);
      ra[j] = __floats2bfloat162_rn(fx.x + fy.x, fx.y + fy.y);
    }
    out[i] = r;
  }
}

template <typename T>
__global__ void add_kernel(const T* a, const T* b, T* out, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
}

template <typename X, typename Y>
__global__ void axpy_kernel(float alpha, const X* x, Y* y, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    y[i] = from_f32<Y>(fmaf(alpha, to_f32(x[i]), to_f32(y[i])));
}

template <typename Y, typename B>
__global__ void add_bias_kernel(Y* y, const B* bias, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    y[i] = from_f32<Y>(to_f32(y[i]) + to_f32(bias[i % cols]));
}

template <typename T>
__global__ void glu_fwd_kernel(const T* h, T* a, int64_t rows, int64_t f, GluArgs p) {
  const int64_t n = rows * f;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / f, c = i - r * f;
    a[i] = from_f32<T>(glu_value(to_f32(h[r * 2 * f + c]), to_f32(h[r * 2 * f + f + c]), p));
  }
}

template <typename T>
__global__ void glu_bwd_kernel(const T* h, const T* da, T* dh, int64_t rows, int64_t f, GluArgs p) {
  const int64_t n = rows * f;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / f, c = i - r * f;
    float dg, du;
    glu_grad(to_f32(h[r * 2 * f + c]), to_f32(h[r * 2 * f + f + c]), to_f32(da[i]), p, dg, du);
    dh[r * 2 * f + c] = from_f32<T>(dg);
    dh[r * 2 * f + f + c] = from_f32<T>(du);
  }
}

// The same on Vec16 columns (fv vectors of the f columns a row): 16-byte accesses.
template <typename T>
__global__ void glu_fwd_vec_kernel(const uint4* h, uint4* a, int64_t rows, int64_t fv, GluArgs p) {
  const int64_t n = rows * fv;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / fv, c = i - r * fv;
    const Vec16<T> g{h[r * 2 * fv + c]}, u{h[r * 2 * fv + fv + c]};
    Vec16<T> out;
    for (int q = 0; q < Vec16<T>::kN; ++q) out.set(q, glu_value(g.get(q), u.get(q), p));
    a[i] = out.raw;
  }
}

template <typename T>
__global__ void glu_bwd_vec_kernel(const uint4* h, const uint4* da, uint4* dh, int64_t rows,
                                   int64_t fv, GluArgs p) {
  const int64_t n = rows * fv;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / fv, c = i - r * fv;
    const Vec16<T> g{h[r * 2 * fv + c]}, u{h[r * 2 * fv + fv + c]}, d{da[i]};
    Vec16<T> dg, du;
    for (int q = 0; q < Vec16<T>::kN; ++q) {
      float x, y;
      glu_grad(g.get(q), u.get(q), d.get(q), p, x, y);
      dg.set(q, x);
      du.set(q, y);
    }
    dh[r * 2 * fv + c] = dg.raw;
    dh[r * 2 * fv + fv + c] = du.raw;
  }
}

}  // namespace

void launch_fill(void* p, DType t, int64_t n, double value, cudaStream_t stream) {
  if (n == 0) return;
  if (value == 0.0 && !std::signbit(value)) {
    // +0 is all zero bytes in every dtype; the copy engines' memset runs at full bandwidth
    // (gradient zeroing writes every gradient of the model once a step).
    CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<size_t>(n) * dtype_size(t), stream));
    return;
  }
  const unsigned grid = grid_for(n, kThreads, 4096);
  switch (t) {
    case DType::kF32:
      fill_kernel<<<grid, kThreads, 0, stream>>>(static_cast<float*>(p), n, (float)value);
      break;
    case DType::kBF16:
      fill_kernel<<<grid, kThreads, 0, stream>>>(static_cast<bf16_t*>(p), n,
                                                 __float2bfloat16_rn((float)value));
      break;
    case DType::kI32:
      fill_kernel<<<grid, kThreads, 0, stream>>>(static_cast<int32_t*>(p), n, (int32_t)value);
      break;
    case DType::kI64:
      fill_kernel<<<grid, kThreads, 0, stream>>>(static_cast<int64_t*>(p), n, (int64_t)value);
      break;
    case DType::kF64:
      fill_kernel<<<grid, kThreads, 0, stream>>>(static_cast<double*>(p), n, value);
      break;
  }
  CUDA_CHECK_LAUNCH();
}

void launch_fill_normal(void* p, DType t, int64_t n, uint64_t key, int64_t offset, double std,
                        cudaStream_t stream) {
  if (n == 0) return;
  const unsigned grid = grid_for(n, kThreads, 8192);
  if (t == DType::kF64)
    fill_normal_kernel<<<grid, kThreads, 0, stream>>>(static_cast<double*>(p), n, key, offset, std);
  else
    fill_normal_kernel<<<grid, kThreads, 0, stream>>>(static_cast<float*>(p), n, key, offset, std);
  CUDA_CHECK_LAUNCH();
}

void launch_convert(const void* src, DType src_t, void* dst, DType dst_t, int64_t n,
                    cudaStream_t stream) {
  if (n == 0) return;
  if (src_t == dst_t) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, n * dtype_size(src_t), cudaMemcpyDeviceToDevice, stream));
    return;
  }
  const unsigned grid = grid_for(n, kThreads, 4096);
  dispatch_float(src_t, [&](auto s) {
    using S = decltype(s);
    dispatch_float(dst_t, [&](auto d) {
      using D = decltype(d);
      convert_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const S*>(src),
                                                    static_cast<D*>(dst), n);
    });
  });
  CUDA_CHECK_LAUNCH();
}

void launch_add(const void* a, const void* b, void* out, DType t, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  if (t == DType::kBF16 && n % 8 == 0 && aligned(a) && aligned(b) && aligned(out)) {
    add_bf16x8_kernel<<<grid_for(n / 8, kThreads, 8192), kThreads, 0, stream>>>(
        static_cast<const uint4*>(a), static_cast<const uint4*>(b), static_cast<uint4*>(out),
        n / 8);
    CUDA_CHECK_LAUNCH();
    return;
  }
  const unsigned grid = grid_for(n, kThreads, 4096);
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    add_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const T*>(a), static_cast<const T*>(b),
                                              static_cast<T*>(out), n);
  });
  CUDA_CHECK_LAUNCH();
}

void launch_axpy(double alpha, const void* x, DType x_t, void* y, DType y_t, int64_t n,
                 cudaStream_t stream) {
  if (n == 0) return;
  const unsigned grid = grid_for(n, kThreads, 4096);
  dispatch_float(x_t, [&](auto xs) {
    using X = decltype(xs);
    dispatch_float(y_t, [&](auto ys) {
      using Y = decltype(ys);
      axpy_kernel<<<grid, kThreads, 0, stream>>>((float)alpha, static_cast<const X*>(x),
                                                 static_cast<Y*>(y), n);
    });
  });
  CUDA_CHECK_LAUNCH();
}

namespace {
struct PointerList {
  const void* p[kMaxStoredPointers];
};
__global__ void store_pointers_kernel(PointerList list, int n, void** out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = const_cast<void*>(list.p[i]);
}
}  // namespace

void launch_store_pointers(const void* const* host_ptrs, int n, void** out, cudaStream_t stream) {
  HP_CHECK(n >= 0 && n <= kMaxStoredPointers, "launch_store_pointers: ", n, " pointers (at most ",
           kMaxStoredPointers, ")");
  if (n == 0) return;
  PointerList list{};
  for (int i = 0; i < n; ++i) list.p[i] = host_ptrs[i];
  store_pointers_kernel<<<1, kMaxStoredPointers, 0, stream>>>(list, n, out);
  CUDA_CHECK_LAUNCH();
}

void launch_add_bias(void* y, DType y_t, const void* bias, DType bias_t, int64_t rows, int64_t cols,
                     cudaStream_t stream) {
  if (rows * cols == 0) return;
  const unsigned grid = grid_for(rows * cols, kThreads, 4096);
  dispatch_float(y_t, [&](auto ys) {
    using Y = decltype(ys);
    dispatch_float(bias_t, [&](auto bs) {
      using B = decltype(bs);
      add_bias_kernel<<<grid, kThreads, 0, stream>>>(static_cast<Y*>(y),
                                                     static_cast<const B*>(bias), rows, cols);
    });
  });
  CUDA_CHECK_LAUNCH();
}

void launch_glu_fwd(const void* h, void* a, DType t, int64_t rows, int64_t f, int kind, float alpha,
                    float limit, cudaStream_t stream) {
  if (rows * f == 0) return;
  const GluArgs p{kind, alpha, limit};
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    if (vec16_rows(f, sizeof(T), {h, a})) {
      const int64_t fv = f * static_cast<int64_t>(sizeof(T)) / 16;
      glu_fwd_vec_kernel<T><<<grid_for(rows * fv, kThreads, 4096), kThreads, 0, stream>>>(
          static_cast<const uint4*>(h), static_cast<uint4*>(a), rows, fv, p);
      return;
    }
    glu_fwd_kernel<<<grid_for(rows * f, kThreads, 4096), kThreads, 0, stream>>>(
        static_cast<const T*>(h), static_cast<T*>(a), rows, f, p);
  });
  CUDA_CHECK_LAUNCH();
}

void launch_glu_bwd(const void* h, const void* da, void* dh, DType t, int64_t rows, int64_t f,
                    int kind, float alpha, float limit, cudaStream_t stream) {
  if (rows * f == 0) return;
  const GluArgs p{kind, alpha, limit};
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    if (vec16_rows(f, sizeof(T), {h, da, dh})) {
      const int64_t fv = f * static_cast<int64_t>(sizeof(T)) / 16;
      glu_bwd_vec_kernel<T><<<grid_for(rows * fv, kThreads, 4096), kThreads, 0, stream>>>(
          static_cast<const uint4*>(h), static_cast<const uint4*>(da), static_cast<uint4*>(dh),
          rows, fv, p);
      return;
    }
    glu_bwd_kernel<<<grid_for(rows * f, kThreads, 4096), kThreads, 0, stream>>>(
        static_cast<const T*>(h), static_cast<const T*>(da), static_cast<T*>(dh), rows, f, p);
  });
  CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace hp
