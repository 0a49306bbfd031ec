// Token embedding (forward, deterministic backward) and the fused softmax cross-entropy.
#include <algorithm>
#include <cub/device/device_radix_sort.cuh>
#include <type_traits>

#include "framework/backend/cuda/cross_entropy.cuh"
#include "framework/backend/cuda/cuda_common.cuh"
#include "framework/backend/cuda/cuda_kernels.h"

namespace hp {
namespace cuda {

namespace {

constexpr int kThreads = 256;

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

// The backward visits the tokens sorted by id (a stable sort, so each id's run of tokens stays in
// token order) in tiles of kEmbedTile sorted positions, one block a tile. A run that lies in one
// tile is summed there and added to its table row. A run that crosses tiles is summed piecewise:
// its first piece (it starts in the tile, goes on past it) becomes the tile's tail piece, each
// later piece its tile's head piece, and embedding_bwd_merge_kernel adds them, in order, to the
// row. A long run (the padding's EOT, a frequent token) so spreads over many blocks, and the sums
// are the same in every run: nothing depends on scheduling.
constexpr int64_t kEmbedTile = 32;

// acc += W elements of `row` at unit c: one Vec16 of T when W is Vec16<T>::kN, else one element.
template <typename T, int W>
__device__ __forceinline__ void add_unit(const T* row, int64_t c, float (&acc)[W]) {
  if constexpr (W == 1) {
    acc[0] += to_f32(row[c]);
  } else {
    const Vec16<T> x{reinterpret_cast<const uint4*>(row)[c]};
#pragma unroll
    for (int q = 0; q < W; ++q) acc[q] += x.get(q);
  }
}

// Unit c of an f32 row: set to acc, or acc added to it.
template <int W>
__device__ __forceinline__ void put_unit(float* row, int64_t c, const float (&acc)[W], bool add) {
  if constexpr (W % 4 == 0) {
    float4* p = reinterpret_cast<float4*>(row + c * W);
#pragma unroll
    for (int q = 0; q < W / 4; ++q) {
      float4 o = make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
      if (add) {
        const float4 old = p[q];
        o.x += old.x;
        o.y += old.y;
        o.z += old.z;
        o.w += old.w;
      }
      p[q] = o;
    }
  } else {
#pragma unroll
    for (int q = 0; q < W; ++q) row[c * W + q] = add ? row[c * W + q] + acc[q] : acc[q];
  }
}

// pieces: [tiles, 2, d] f32, slot 0 the tile's head piece, slot 1 its tail piece; du = d / W.
template <typename T, int W>
__global__ void embedding_bwd_tile_kernel(const T* dout, const int32_t* sorted_ids,
                                          const int32_t* sorted_pos, int64_t n, int64_t du,
                                          int64_t v, float* dtable, float* pieces) {
  const int64_t d = du * W, tile = blockIdx.x;
  const int64_t end = min(n, (tile + 1) * kEmbedTile);
  for (int64_t a = tile * kEmbedTile; a < end;) {
    const int32_t id = sorted_ids[a];
    int64_t z = a + 1;
    while (z < end && sorted_ids[z] == id) ++z;
    if (id >= 0 && id < v) {
      const bool starts = a == 0 || sorted_ids[a - 1] != id;
      const bool ends = z == n || sorted_ids[z] != id;
      float* dst = starts && ends ? dtable + id * d : pieces + (2 * tile + (starts ? 1 : 0)) * d;
      for (int64_t c = threadIdx.x; c < du; c += blockDim.x) {
        float acc[W] = {};
#pragma unroll 4
        for (int64_t r = a; r < z; ++r)
          add_unit<T, W>(dout + static_cast<int64_t>(sorted_pos[r]) * d, c, acc);
        put_unit<W>(dst, c, acc, starts && ends);
      }
    }
    a = z;
  }
}

// Blocks (b, y), where a run starts in tile b and goes on past it: the tail piece of b, then the
// head pieces of the tiles after it up to the run's end, added to the run's row; blockIdx.y picks
// a slice of blockDim.x columns.
__global__ void embedding_bwd_merge_kernel(const int32_t* sorted_ids, int64_t n, int64_t d,
                                           int64_t v, const float* pieces, float* dtable) {
  const int64_t tile = blockIdx.x, first = tile * kEmbedTile;
  const int64_t c = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= d) return;
  const int64_t end = min(n, first + kEmbedTile);
  if (end >= n) return;
  const int32_t id = sorted_ids[end - 1];
  if (sorted_ids[end] != id || id < 0 || id >= v) return;  // the tile's last run ends in it
  if (first > 0 && sorted_ids[first] == id && sorted_ids[first - 1] == id) return;  // not its start
  int64_t last = tile + 1;  // the tile where the run ends
  while ((last + 1) * kEmbedTile < n && sorted_ids[(last + 1) * kEmbedTile] == id) ++last;
  float acc = pieces[(2 * tile + 1) * d + c];
#pragma unroll 8
  for (int64_t t = tile + 1; t <= last; ++t) acc += pieces[2 * t * d + c];
  dtable[id * d + c] += acc;
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
  const float lse = row_lse_bf16x8(lr8, v8, scratch);
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
  // All 32 bits of the key: an id outside [0, v) (skipped) then sorts apart from every valid id
  // instead of sharing the low bits of one and splitting its run.
  constexpr int kIdBits = 32;
  Tensor work = Tensor::empty(alloc, {3, n}, DType::kI32);
  int32_t* iota = work.data<int32_t>();
  int32_t* sorted_ids = iota + n;
  int32_t* sorted_pos = sorted_ids + n;
  iota_kernel<<<grid_for(n, kThreads, 1ll << 30), kThreads, 0, stream>>>(iota, n);
  CUDA_CHECK_LAUNCH();
  size_t temp_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, ids, sorted_ids, iota, sorted_pos,
                                             static_cast<int>(n), 0, kIdBits, stream));
  Tensor temp = Tensor::empty(alloc, {static_cast<int64_t>(temp_bytes / 4 + 1)}, DType::kI32);
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.raw(), temp_bytes, ids, sorted_ids, iota,
                                             sorted_pos, static_cast<int>(n), 0, kIdBits, stream));
  const int64_t tiles = (n + kEmbedTile - 1) / kEmbedTile;
  Tensor pieces = Tensor::empty(alloc, {tiles, 2, d}, DType::kF32);
  dispatch_float(t, [&](auto ts) {
    using T = decltype(ts);
    auto tile_pass = [&](auto unit) {
      constexpr int W = decltype(unit)::value;
      const int64_t du = d / W;
      const int threads = static_cast<int>(std::min<int64_t>(512, (du + 31) / 32 * 32));
      embedding_bwd_tile_kernel<T, W><<<static_cast<unsigned>(tiles), threads, 0, stream>>>(
          static_cast<const T*>(dout), sorted_ids, sorted_pos, n, du, v, dtable,
          pieces.data<float>());
    };
    if (vec16_rows(d, sizeof(T), {dout, dtable, pieces.raw()}))
      tile_pass(std::integral_constant<int, Vec16<T>::kN>{});
    else
      tile_pass(std::integral_constant<int, 1>{});
  });
  CUDA_CHECK_LAUNCH();
  if (tiles > 1) {
    constexpr int kMergeThreads = 256;
    const dim3 grid(static_cast<unsigned>(tiles - 1),
                    static_cast<unsigned>((d + kMergeThreads - 1) / kMergeThreads));
    embedding_bwd_merge_kernel<<<grid, kMergeThreads, 0, stream>>>(sorted_ids, n, d, v,
                                                                   pieces.data<float>(), dtable);
    CUDA_CHECK_LAUNCH();
  }
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
