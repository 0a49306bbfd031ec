// Deterministic reductions: bias gradients, column sums, sums of squares, scalar sums.
#include <algorithm>
#include <limits>
#include <vector>

#include "framework/backend/cuda/column_sum.cuh"
#include "framework/backend/cuda/cuda_kernels.h"

namespace hp {
namespace cuda {

__global__ void column_finish_kernel(const float* partial, int64_t n_chunks, int64_t cols,
                                     float scale, float* out, int64_t split, float* out_hi) {
  const float s = finish_column_block(partial, n_chunks, cols);
  const int64_t c = blockIdx.x * (int64_t)kColSumX + threadIdx.x;
  if (threadIdx.y != 0 || c >= cols) return;
  float& o = c < split ? out[c] : out_hi[c - split];
  o += scale * s;
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

namespace {

// Up to kSegmentsPerLaunch row segments of one matrix, each with its own output row.
constexpr int kSegmentsPerLaunch = 32;
struct Segments {
  int64_t begin[kSegmentsPerLaunch];
  int64_t rows[kSegmentsPerLaunch];
  int64_t rows_per_chunk[kSegmentsPerLaunch];
  int32_t n_chunks[kSegmentsPerLaunch];
  int32_t first_chunk[kSegmentsPerLaunch];  // of the segment, in the partial buffer
  float* out[kSegmentsPerLaunch];
};

// Block (x: columns, y: chunk, z: segment): the chunk's partial, as column_partial_kernel computes
// it for the segment's rows alone.
template <typename T>
__global__ void segment_partial_kernel(const T* dy, int64_t cols, Segments s, float* partial) {
  const int z = blockIdx.z;
  if (blockIdx.y >= static_cast<unsigned>(s.n_chunks[z])) return;
  const int64_t r0 = blockIdx.y * s.rows_per_chunk[z];
  const LoadValue<T> value{dy + s.begin[z] * cols, cols};
  column_partial_block(value, r0, min(s.rows[z], r0 + s.rows_per_chunk[z]), cols,
                       partial + (s.first_chunk[z] + blockIdx.y) * cols);
}

// out of segment z [c] += its partials, finished as column_finish_kernel finishes them.
__global__ void segment_finish_kernel(const float* partial, int64_t cols, Segments s) {
  const int z = blockIdx.y;
  const float total = finish_column_block(partial + s.first_chunk[z] * cols, s.n_chunks[z], cols);
  const int64_t c = blockIdx.x * (int64_t)kColSumX + threadIdx.x;
  if (threadIdx.y != 0 || c >= cols) return;
  s.out[z][c] += total;
}

}  // namespace

void launch_bias_grad_segments(const void* dy, DType t, int64_t cols,
                               const std::vector<RowSegmentRef>& segments, Allocator& alloc,
                               cudaStream_t stream) {
  if (cols == 0) return;
  const int64_t col_blocks = (cols + kColSumX - 1) / kColSumX;
  // A launch takes segments in order until it is full or one would add to an output it already
  // adds to: that one starts the next launch, so each output sums its segments in their order.
  size_t i = 0;
  while (i < segments.size()) {
    Segments s{};
    int n = 0;
    int32_t chunks = 0, max_chunks = 0;
    for (; i < segments.size() && n < kSegmentsPerLaunch; ++i) {
      const RowSegmentRef& g = segments[i];
      if (g.rows == 0) continue;
      if (std::find(s.out, s.out + n, g.out) != s.out + n) break;
      const ColumnChunks ch = column_chunks(g.rows, cols);
      s.begin[n] = g.begin;
      s.rows[n] = g.rows;
      s.rows_per_chunk[n] = ch.rows_per_chunk;
      s.n_chunks[n] = static_cast<int32_t>(ch.n_chunks);
      s.first_chunk[n] = chunks;
      s.out[n] = g.out;
      chunks += s.n_chunks[n];
      max_chunks = std::max(max_chunks, s.n_chunks[n]);
      ++n;
    }
    if (n == 0) continue;
    Tensor partial = Tensor::empty(alloc, {chunks, cols}, DType::kF32);
    dispatch_float(t, [&](auto tag) {
      using T = decltype(tag);
      dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(max_chunks),
                static_cast<unsigned>(n));
      segment_partial_kernel<T><<<grid, dim3(kColSumX, kColSumY), 0, stream>>>(
          static_cast<const T*>(dy), cols, s, partial.data<float>());
    });
    CUDA_CHECK_LAUNCH();
    segment_finish_kernel<<<dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(n)),
                            dim3(kColSumX, kFinishSplits), 0, stream>>>(partial.data<float>(), cols,
                                                                        s);
    CUDA_CHECK_LAUNCH();
  }
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

namespace {

// ---- sums of squares over many tensors (launch_sum_squares_many) ----
constexpr int kSqMax = 128;                  // tensors a launch (the table is ~2.7 KB)
constexpr int kSqChunk = 16 * 4 * kThreads;  // elements a block: 16 groups of 4 a thread
constexpr int32_t kSqMaxBlocks = 1 << 30;
constexpr int kSqFinishThreads = 1024;

// Tensor e owns blocks [first_block[e], first_block[e + 1]) of its launch, one chunk each.
struct SumSquaresTable {
  const void* x[kSqMax];
  int64_t n[kSqMax];
  int32_t first_block[kSqMax + 1];
  uint8_t bf16[kSqMax];
  uint8_t aligned[kSqMax];  // groups of 4 elements load as one access
  int32_t count;
};
static_assert(sizeof(SumSquaresTable) <= 4000, "the table must fit a kernel's 4 KB of parameters");

// This thread's sum of squares over elements [begin, end) of x: groups of 4 consecutive elements
// at begin + 4 * (threadIdx.x + k * kThreads), each squared and added in element order (a short
// last group padded with zeros, which add nothing). Loaded as one access where aligned, else one
// by one: the same values in the same order either way.
template <typename T>
__device__ __forceinline__ float sum_squares_chunk(const T* x, int64_t begin, int64_t end,
                                                   bool aligned) {
  float acc = 0.f;
  for (int64_t g = begin + 4 * static_cast<int64_t>(threadIdx.x); g < end; g += 4 * kThreads) {
    float f[4] = {0.f, 0.f, 0.f, 0.f};
    if (aligned && g + 4 <= end) {
      if constexpr (sizeof(T) == 4) {
        const float4 q = *reinterpret_cast<const float4*>(x + g);
        f[0] = q.x;
        f[1] = q.y;
        f[2] = q.z;
        f[3] = q.w;
      } else {
        const uint2 raw = *reinterpret_cast<const uint2*>(x + g);
        const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int j = 0; j < 4; ++j) f[j] = to_f32(h[j]);
      }
    } else {
      for (int j = 0; j < 4 && g + j < end; ++j) f[j] = to_f32(x[g + j]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) acc = __fmaf_rn(f[j], f[j], acc);
  }
  return acc;
}

__global__ void __launch_bounds__(kThreads)
    sum_squares_many_kernel(const SumSquaresTable t, float* partial) {
  __shared__ float scratch[33];
  const int32_t b = static_cast<int32_t>(blockIdx.x);
  const int e = entry_of_block(t.first_block, t.count, b);
  const int64_t begin = static_cast<int64_t>(b - t.first_block[e]) * kSqChunk;
  const int64_t end = min(t.n[e], begin + kSqChunk);
  // A null x (zeros, not read): every thread's sum of squares is +0, as its zeros would give.
  float acc = t.x[e] == nullptr ? 0.f
              : t.bf16[e]
                  ? sum_squares_chunk(static_cast<const bf16_t*>(t.x[e]), begin, end, t.aligned[e])
                  : sum_squares_chunk(static_cast<const float*>(t.x[e]), begin, end, t.aligned[e]);
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) partial[b] = acc;
}

}  // namespace

void launch_sum_squares_many(const std::vector<SumSquaresRef>& xs, float* acc, Allocator& alloc,
                             cudaStream_t stream) {
  int64_t total = 0;
  for (const SumSquaresRef& r : xs) {
    HP_CHECK(r.t == DType::kF32 || r.t == DType::kBF16, "launch_sum_squares_many: dtype ",
             dtype_name(r.t), " is not f32 or bf16");
    const int64_t chunks = (r.n + kSqChunk - 1) / kSqChunk;
    HP_CHECK(chunks <= kSqMaxBlocks, "launch_sum_squares_many: a tensor of ", r.n,
             " elements is too large");
    total += chunks;
  }
  if (total == 0) return;
  HP_CHECK(total <= std::numeric_limits<int>::max(), "launch_sum_squares_many: ", total,
           " partial sums are too many");
  Tensor partial = Tensor::empty(alloc, {total}, DType::kF32);
  float* out = partial.data<float>();
  size_t i = 0;
  while (i < xs.size()) {
    SumSquaresTable t{};
    int32_t blocks = 0;
    for (; i < xs.size() && t.count < kSqMax; ++i) {
      const SumSquaresRef& r = xs[i];
      if (r.n == 0) continue;
      const int64_t chunks = (r.n + kSqChunk - 1) / kSqChunk;
      if (blocks + chunks > kSqMaxBlocks) break;
      const int c = t.count++;
      const size_t elem = r.t == DType::kBF16 ? 2 : 4;
      t.x[c] = r.x;
      t.n[c] = r.n;
      t.first_block[c] = blocks;
      t.bf16[c] = r.t == DType::kBF16 ? 1 : 0;
      t.aligned[c] = reinterpret_cast<uintptr_t>(r.x) % (4 * elem) == 0 ? 1 : 0;
      blocks += static_cast<int32_t>(chunks);
    }
    if (t.count == 0) continue;
    t.first_block[t.count] = blocks;
    sum_squares_many_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(t, out);
    CUDA_CHECK_LAUNCH();
    out += blocks;
  }
  finish_sum_kernel<<<1, kSqFinishThreads, 0, stream>>>(partial.data<float>(),
                                                        static_cast<int>(total), 1.f, acc);
  CUDA_CHECK_LAUNCH();
}

void launch_reduce_sum_add(const float* x, int64_t n, float scale, float* acc, Allocator& alloc,
                           cudaStream_t stream) {
  sum_add<float, false>(x, n, scale, acc, alloc, stream);
}

}  // namespace cuda
}  // namespace hp
