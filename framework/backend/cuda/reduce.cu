// Deterministic reductions: bias gradients, column sums, sums of squares, scalar sums.
#include "framework/backend/cuda/column_sum.cuh"
#include "framework/backend/cuda/cuda_kernels.h"

namespace hp {
namespace cuda {

__global__ void column_finish_kernel(const float* partial, int64_t n_chunks, int64_t cols,
                                     float scale, float* out) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = 0.f;
  for (int64_t i = 0; i < n_chunks; ++i) s += partial[i * cols + c];
  out[c] += scale * s;
}

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;

template <typename T>
struct LoadValue {
  const T* p;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t c) const { return to_f32(p[r * cols + c]); }
};

// partial[block] = sum over a fixed grid-stride partition of f(x[i]).
template <typename T, bool kSquare>
__global__ void block_partial_kernel(const T* x, int64_t n, float* partial) {
  __shared__ float scratch[33];
  float acc = 0.f;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float v = to_f32(x[i]);
    acc += kSquare ? v * v : v;
  }
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void finish_sum_kernel(const float* partial, int n, float scale, float* acc) {
  __shared__ float scratch[33];
  float s = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += partial[i];
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) acc[0] += scale * s;
}

template <typename T, bool kSquare>
void sum_add(const T* x, int64_t n, float scale, float* acc, Allocator& alloc,
             cudaStream_t stream) {
  const unsigned blocks = grid_for(n, kThreads * 4, kMaxBlocks);
  Tensor partial = Tensor::empty(alloc, {static_cast<int64_t>(blocks)}, DType::kF32);
  block_partial_kernel<T, kSquare><<<blocks, kThreads, 0, stream>>>(x, n, partial.data<float>());
  CUDA_CHECK_LAUNCH();
  finish_sum_kernel<<<1, kThreads, 0, stream>>>(partial.data<float>(), (int)blocks, scale, acc);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_bias_grad(const void* dy, DType t, int64_t rows, int64_t cols, float* db,
                      Allocator& alloc, cudaStream_t stream) {
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    column_sum_add(LoadValue<T>{static_cast<const T*>(dy), cols}, rows, cols, 1.f, db, alloc,
                   stream);
  });
}

void launch_column_sum_add(const float* x, int64_t rows, int64_t cols, float scale, float* out,
                           Allocator& alloc, cudaStream_t stream) {
  column_sum_add(LoadValue<float>{x, cols}, rows, cols, scale, out, alloc, stream);
}

void launch_sum_squares(const void* x, DType t, int64_t n, float* acc, Allocator& alloc,
                        cudaStream_t stream) {
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    sum_add<T, true>(static_cast<const T*>(x), n, 1.f, acc, alloc, stream);
  });
}

void launch_reduce_sum_add(const float* x, int64_t n, float scale, float* acc, Allocator& alloc,
                           cudaStream_t stream) {
  sum_add<float, false>(x, n, scale, acc, alloc, stream);
}

}  // namespace cuda
}  // namespace hp
