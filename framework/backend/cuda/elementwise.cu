// Element-wise kernels: fill, convert, add, axpy, bias, gated activations.
#include <cmath>

#include "framework/backend/cuda/cuda_common.cuh"
#include "framework/backend/cuda/cuda_kernels.h"
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

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + __expf(-x)); }

template <typename T>
__global__ void glu_fwd_kernel(const T* h, T* a, int64_t rows, int64_t f, int kind, float alpha,
                               float limit) {
  const int64_t n = rows * f;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / f, c = i - r * f;
    float g = to_f32(h[r * 2 * f + c]), u = to_f32(h[r * 2 * f + f + c]);
    float out;
    if (kind == 0) {
      out = g * sigmoidf(g) * u;
    } else {
      g = fminf(g, limit);
      u = fminf(fmaxf(u, -limit), limit);
      out = g * sigmoidf(alpha * g) * (u + 1.f);
    }
    a[i] = from_f32<T>(out);
  }
}

template <typename T>
__global__ void glu_bwd_kernel(const T* h, const T* da, T* dh, int64_t rows, int64_t f, int kind,
                               float alpha, float limit) {
  const int64_t n = rows * f;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / f, c = i - r * f;
    const float g = to_f32(h[r * 2 * f + c]), u = to_f32(h[r * 2 * f + f + c]);
    const float d = to_f32(da[i]);
    float dg, du;
    if (kind == 0) {
      const float s = sigmoidf(g);
      dg = d * u * s * (1.f + g * (1.f - s));
      du = d * g * s;
    } else {
      const float gc = fminf(g, limit);
      const float uc = fminf(fmaxf(u, -limit), limit);
      const float s = sigmoidf(alpha * gc);
      dg = g <= limit ? d * (uc + 1.f) * (s + alpha * gc * s * (1.f - s)) : 0.f;
      du = (u >= -limit && u <= limit) ? d * gc * s : 0.f;
    }
    dh[r * 2 * f + c] = from_f32<T>(dg);
    dh[r * 2 * f + f + c] = from_f32<T>(du);
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
  const unsigned grid = grid_for(rows * f, kThreads, 4096);
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    glu_fwd_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const T*>(h), static_cast<T*>(a),
                                                  rows, f, kind, alpha, limit);
  });
  CUDA_CHECK_LAUNCH();
}

void launch_glu_bwd(const void* h, const void* da, void* dh, DType t, int64_t rows, int64_t f,
                    int kind, float alpha, float limit, cudaStream_t stream) {
  if (rows * f == 0) return;
  const unsigned grid = grid_for(rows * f, kThreads, 4096);
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    glu_bwd_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const T*>(h),
                                                  static_cast<const T*>(da), static_cast<T*>(dh),
                                                  rows, f, kind, alpha, limit);
  });
  CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace hp
