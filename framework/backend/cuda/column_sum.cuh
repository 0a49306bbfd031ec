// Deterministic column sums: out[c] += scale * sum_r value(r, c), in two passes (per-chunk
// partials in a fixed partition of the rows, then a fixed-order sum of the partials), so that
// results do not depend on scheduling.
#pragma once

#include "framework/backend/cuda/cuda_common.cuh"
#include "framework/core/tensor.h"

namespace hp {
namespace cuda {

constexpr int kColSumX = 32, kColSumY = 8;

// One block's partial: the sum over rows [r0, r1) of value(r, c) for its 32 columns, written to
// partial[c] by the first row of threads. Every column sum below adds in this order.
template <typename F>
__device__ void column_partial_block(const F& value, int64_t r0, int64_t r1, int64_t cols,
                                     float* partial) {
  __shared__ float red[kColSumY][kColSumX + 1];
  const int64_t c = blockIdx.x * (int64_t)kColSumX + threadIdx.x;
  float acc = 0.f;
  if (c < cols)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColSumY) acc += value(r, c);
  red[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kColSumY; ++i) s += red[i][threadIdx.x];
    partial[c] = s;
  }
}

template <typename F>
__global__ void column_partial_kernel(F value, int64_t rows, int64_t cols, int64_t rows_per_chunk,
                                      float* partial) {
  const int64_t r0 = blockIdx.y * rows_per_chunk;
  column_partial_block(value, r0, min(rows, r0 + rows_per_chunk), cols,
                       partial + blockIdx.y * cols);
}

// The row partition of a column sum over `rows` rows: n_chunks chunks of rows_per_chunk rows (the
// last may be shorter). A function of rows and cols only, so that a sum over a segment of a
// larger matrix partitions its rows as a sum over those rows alone does.
struct ColumnChunks {
  int64_t n_chunks, rows_per_chunk;
};
inline ColumnChunks column_chunks(int64_t rows, int64_t cols) {
  const int64_t col_blocks = (cols + kColSumX - 1) / kColSumX;
  int64_t n_chunks = 2048 / col_blocks;
  const int64_t max_chunks = (rows + 63) / 64;
  if (n_chunks > max_chunks) n_chunks = max_chunks;
  if (n_chunks < 1) n_chunks = 1;
  const int64_t rows_per_chunk = (rows + n_chunks - 1) / n_chunks;
  return {(rows + rows_per_chunk - 1) / rows_per_chunk, rows_per_chunk};
}

// The sum of column c's partials p[i * cols + c] for i = 0, 1, ..., n_chunks - 1, added in that
// order. The loads go out kUnroll at a time (they do not depend on each other), the adds stay in
// chunk order.
__device__ __forceinline__ float sum_partials_in_order(const float* p, int64_t n_chunks,
                                                       int64_t cols) {
  constexpr int kUnroll = 16;
  float s = 0.f;
  int64_t i = 0;
  for (; i + kUnroll <= n_chunks; i += kUnroll) {
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = p[(i + u) * cols];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) s = __fadd_rn(s, v[u]);
  }
  for (; i < n_chunks; ++i) s = __fadd_rn(s, p[i * cols]);
  return s;
}

// The finishing sum of a column's n_chunks partials, by a block of (kColSumX, kFinishSplits)
// threads over columns blockIdx.x * kColSumX + threadIdx.x: split y adds chunks [y * per,
// (y + 1) * per) in order (per = ceil(n_chunks / kFinishSplits)), then the splits add in order
// 0, 1, ..., kFinishSplits - 1. The total is returned to the threads of row y = 0 (0 elsewhere);
// every thread of the block must call it.
constexpr int kFinishSplits = 8;
__device__ __forceinline__ float finish_column_block(const float* partial, int64_t n_chunks,
                                                     int64_t cols) {
  __shared__ float red[kFinishSplits][kColSumX + 1];
  const int64_t c = blockIdx.x * (int64_t)kColSumX + threadIdx.x;
  const int64_t per = (n_chunks + kFinishSplits - 1) / kFinishSplits;
  const int64_t i0 = min(n_chunks, threadIdx.y * per), i1 = min(n_chunks, i0 + per);
  red[threadIdx.y][threadIdx.x] =
      c < cols ? sum_partials_in_order(partial + i0 * cols + c, i1 - i0, cols) : 0.f;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.y == 0)
#pragma unroll
    for (int k = 0; k < kFinishSplits; ++k) total = __fadd_rn(total, red[k][threadIdx.x]);
  return total;
}

// out[c] += scale * (column c's finished sum) for c < split, out_hi[c - split] for the columns
// from split on (two outputs filled by one sum; split = cols and out_hi = nullptr for one).
__global__ void column_finish_kernel(const float* partial, int64_t n_chunks, int64_t cols,
                                     float scale, float* out, int64_t split, float* out_hi);

inline void launch_column_finish(const float* partial, int64_t n_chunks, int64_t cols, float scale,
                                 float* out, int64_t split, float* out_hi, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((cols + kColSumX - 1) / kColSumX);
  column_finish_kernel<<<blocks, dim3(kColSumX, kFinishSplits), 0, stream>>>(
      partial, n_chunks, cols, scale, out, split, out_hi);
  CUDA_CHECK_LAUNCH();
}

// out_hi (optional): the columns from split on add to out_hi[c - split] instead.
template <typename F>
void column_sum_add(F value, int64_t rows, int64_t cols, float scale, float* out, Allocator& alloc,
                    cudaStream_t stream, int64_t split = -1, float* out_hi = nullptr) {
  if (out_hi == nullptr) split = cols;
  if (rows == 0 || cols == 0) return;
  const int64_t col_blocks = (cols + kColSumX - 1) / kColSumX;
  const ColumnChunks ch = column_chunks(rows, cols);
  Tensor partial = Tensor::empty(alloc, {ch.n_chunks, cols}, DType::kF32);
  dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(ch.n_chunks));
  column_partial_kernel<<<grid, dim3(kColSumX, kColSumY), 0, stream>>>(
      value, rows, cols, ch.rows_per_chunk, partial.data<float>());
  CUDA_CHECK_LAUNCH();
  launch_column_finish(partial.data<float>(), ch.n_chunks, cols, scale, out, split, out_hi, stream);
}

}  // namespace cuda
}  // namespace hp
