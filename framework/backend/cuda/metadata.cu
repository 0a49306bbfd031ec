// The per-layer metadata baseline: cu_seqlens, max_seqlen and the attention tile map rebuilt
// from position ids on the device.
#include <cub/device/device_scan.cuh>

#include "framework/backend/cuda/cuda_common.cuh"
#include "framework/backend/cuda/cuda_kernels.h"

namespace hp {
namespace cuda {

namespace {

constexpr int kThreads = 256;

__global__ void seq_start_kernel(const int32_t* pos, int64_t n, int32_t* flags) {
  const int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (t >= n) return;
  flags[t] = (t == 0 || pos[t] == 0 || pos[t] != pos[t - 1] + 1) ? 1 : 0;
}

// seq_id: inclusive scan of the start flags (1-based sequence number of each token).
__global__ void cu_seqlens_kernel(const int32_t* flags, const int32_t* seq_id, int64_t n,
                                  int32_t* cu, int32_t* info) {
  const int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (t >= n) return;
  if (flags[t]) cu[seq_id[t] - 1] = static_cast<int32_t>(t);
  if (t == n - 1) {
    cu[seq_id[t]] = static_cast<int32_t>(n);
    info[0] = seq_id[t];
  }
}

__global__ void tile_count_kernel(const int32_t* cu, int64_t n, int32_t* info, int32_t* counts) {
  const int64_t s = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (s >= n) return;
  if (s < info[0]) {
    const int32_t len = cu[s + 1] - cu[s];
    counts[s] = (len + kAttnTile - 1) / kAttnTile;
    atomicMax(&info[1], len);
  } else {
    counts[s] = 0;
  }
}

__global__ void tile_fill_kernel(const int32_t* cu, const int32_t* counts, const int32_t* tile_end,
                                 int64_t n, AttnTile* tiles, int32_t* info) {
  const int64_t s = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  const int32_t n_seqs = info[0];
  if (s >= n || s >= n_seqs) return;
  const int32_t b = cu[s], e = cu[s + 1];
  const int32_t first = tile_end[s] - counts[s];
  for (int32_t j = 0; j < counts[s]; ++j) {
    AttnTile t;
    t.begin = b + j * kAttnTile;
    t.end = min(t.begin + kAttnTile, e);
    t.seq_begin = b;
    t.seq_end = e;
    tiles[first + j] = t;
  }
  if (s == n_seqs - 1) info[2] = tile_end[s];
}

}  // namespace

void launch_rebuild_metadata(const int32_t* positions, int64_t n, int32_t* cu_seqlens,
                             AttnTile* tiles, int32_t* info, Allocator& alloc,
                             cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(info, 0, 3 * sizeof(int32_t), stream));
  if (n == 0) {
    CUDA_CHECK(cudaMemsetAsync(cu_seqlens, 0, sizeof(int32_t), stream));
    return;
  }
  Tensor work = Tensor::empty(alloc, {4, n}, DType::kI32);
  int32_t* flags = work.data<int32_t>();
  int32_t* seq_id = flags + n;
  int32_t* counts = seq_id + n;
  int32_t* tile_end = counts + n;
  const int n_items = static_cast<int>(n);
  size_t temp_bytes = 0;
  CUDA_CHECK(cub::DeviceScan::InclusiveSum(nullptr, temp_bytes, flags, seq_id, n_items, stream));
  Tensor temp = Tensor::empty(alloc, {static_cast<int64_t>(temp_bytes / 4 + 1)}, DType::kI32);
  const unsigned grid = grid_for(n, kThreads, 1ll << 30);

  seq_start_kernel<<<grid, kThreads, 0, stream>>>(positions, n, flags);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cub::DeviceScan::InclusiveSum(temp.raw(), temp_bytes, flags, seq_id, n_items, stream));
  cu_seqlens_kernel<<<grid, kThreads, 0, stream>>>(flags, seq_id, n, cu_seqlens, info);
  CUDA_CHECK_LAUNCH();
  tile_count_kernel<<<grid, kThreads, 0, stream>>>(cu_seqlens, n, info, counts);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(
      cub::DeviceScan::InclusiveSum(temp.raw(), temp_bytes, counts, tile_end, n_items, stream));
  tile_fill_kernel<<<grid, kThreads, 0, stream>>>(cu_seqlens, counts, tile_end, n, tiles, info);
  CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace hp
