// FP8 quantization for the CUDA backend's FP8 GEMMs (fp8_gemm.h), bit for bit the math of the
// CPU reference (framework/core/fp8.cpp), and the epilogue kernel for what cuBLASLt's own
// epilogue does not take.
//
// Recipe block128 has two kernels that read their source once, 16 bytes per access:
//  - data operands (1x128 blocks) stored K-contiguous, the activations and output gradients of
//    the forward and input-gradient products: a warp covers 256 columns of four rows, a
//    half-warp one block of a row; the block's amax by shuffles, the codes written 8 bytes per
//    lane;
//  - weight operands (128x128 tiles) either way round: a thread block loads one source tile
//    into registers, reduces its amax, quantizes into shared memory and writes the tile out
//    K-contiguous, transposed where the source is.
//  - data operands (1x128 blocks) stored the other way, the weight gradients' operands blocked
//    along the tokens: a thread block loads a 128x128 tile, reduces each source column's amax
//    over the tile's 128 rows (one block of one row of X), quantizes into shared memory and
//    writes the tile out K-contiguous, transposed.
// Everything else (recipe mxfp8, sources whose rows are not a multiple of 16 bytes) takes the
// general kernel: one thread block per 128 x 128 tile of X [rows_pad, ldk] (fp8_layout.h), a
// tile holding one 128x128 weight block, 128 rows of one 1x128 data block each, or 128 rows of
// four 1x32 MX blocks. Its pass 1 reads the tile and takes the
// magnitude maxima per row and 32 columns; the scales follow from them; pass 2 reads the tile
// again (from L2), quantizes into shared memory and writes the codes K-contiguous in 4-byte
// words. A source stored K-contiguous is read along K; a source stored the other way is read
// along its rows, so every read is coalesced either way.
//
// Maxima are taken on the bits of |x|: for non-negative floats the integer order is the float
// order, and a NaN's bits exceed infinity's, so a NaN anywhere wins as the reference's amax does.
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "framework/backend/cuda/cross_entropy.cuh"
#include "framework/backend/cuda/cuda_check.h"
#include "framework/backend/cuda/cuda_common.cuh"
#include "framework/backend/cuda/cuda_kernels.h"
#include "framework/backend/cuda/fp8_gemm.h"
#include "framework/backend/cuda/glu_math.cuh"

namespace hp {
namespace cuda {
namespace {

constexpr int kTile = 128;
constexpr int kThreads = 256;
constexpr unsigned kInfBits = 0x7F800000u;

// The reference's block_scale(amax) from the bits of amax: amax / 448 rounded to nearest (an
// IEEE division, subnormals kept), 1 where that is 0, NaN where amax is not finite.
__device__ __forceinline__ float block_scale_bits(unsigned amax_bits) {
  if (amax_bits >= kInfBits) return __uint_as_float(0x7FC00000u);
  const float s = __fdiv_rn(__uint_as_float(amax_bits), fp8::kE4M3Max);
  return s > 0.f ? s : 1.f;
}

// The reference's e8m0_scale_code(amax): 127 + clamp(floor(log2 amax) - 8, -127, 127); 127 for
// 0; 0xFF when not finite. A subnormal amax (below 2^-126) clamps to -127 like any amax below
// 2^-118.
__device__ __forceinline__ unsigned char e8m0_code_bits(unsigned amax_bits) {
  if (amax_bits >= kInfBits) return fp8::kE8M0NaN;
  if (amax_bits == 0) return 127;
  const int e = static_cast<int>(amax_bits >> 23);  // biased exponent field, 0 for subnormals
  int x = e == 0 ? -127 : e - 127 - fp8::kE4M3Emax;
  x = x < -127 ? -127 : (x > 127 ? 127 : x);
  return static_cast<unsigned char>(x + 127);
}

// 2^(code - 127) as a float (code 0: the subnormal 2^-127); NaN for 0xFF.
__device__ __forceinline__ float e8m0_value(unsigned char code) {
  if (code == fp8::kE8M0NaN) return __uint_as_float(0x7FC00000u);
  if (code == 0) return __uint_as_float(0x00400000u);
  return __uint_as_float(static_cast<unsigned>(code) << 23);
}

// A block's scale s and its reciprocal r = 1 / s rounded to fp32 (the reference's).
struct Scale {
  float s, r;
};
__device__ __forceinline__ Scale make_scale(float s) { return {s, __frcp_rn(s)}; }

// The reference's quantize_element: e4m3(x * r), the product rounded to fp32 (x / s where r is
// infinite), then to E4M3 with round-to-nearest-even and saturation to +-448; a NaN scale gives
// the NaN code.
__device__ __forceinline__ unsigned char quantize_one(float x, Scale sc) {
  if (isnan(sc.s)) return fp8::kE4M3NaN;
  const float q = isinf(sc.r) ? __fdiv_rn(x, sc.s) : __fmul_rn(x, sc.r);
  return static_cast<unsigned char>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3));
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const T* __restrict__ x, int64_t row_stride, int64_t col_stride, Fp8Layout l,
                    unsigned char* __restrict__ codes, void* __restrict__ scales_out) {
  __shared__ unsigned amax[kTile][4];  // |x| bits, per row and 32 columns of the tile
  __shared__ float scale[kTile][4];    // the dequantization scale of each row's 32 columns
  __shared__ unsigned char tile[kTile][kTile + 4];
  const int tid = threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  for (int i = tid; i < kTile * 4; i += kThreads) amax[i / 4][i % 4] = 0;
  __syncthreads();
  // Along the rows where the source is row-contiguous (a transposed copy), else along K.
  const bool by_rows = col_stride != 1 && row_stride == 1;
  auto load = [&](int r, int c) -> float {
    const int64_t gr = r0 + r, gc = c0 + c;
    if (gr >= l.rows || gc >= l.k) return 0.f;
    return to_f32(x[gr * row_stride + gc * col_stride]);
  };
  if (by_rows) {
    // Thread t covers row t % 128 and columns t / 128 + 2i: its maxima stay in registers.
    const int r = tid % kTile;
    unsigned m[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < kTile * kTile / kThreads; ++i) {
      const int c = tid / kTile + 2 * i;  // in the 32-column group i / 16
      const unsigned bits = __float_as_uint(load(r, c)) & 0x7FFFFFFFu;
      m[i / 16] = max(m[i / 16], bits);
    }
    for (int j = 0; j < 4; ++j) atomicMax(&amax[r][j], m[j]);
  } else {
    // A warp covers 32 consecutive columns (one 32-column group) of one row.
    const int c = tid % kTile;
    for (int i = 0; i < kTile * kTile / kThreads; ++i) {
      const int r = tid / kTile + 2 * i;
      const unsigned bits = __float_as_uint(load(r, c)) & 0x7FFFFFFFu;
      const unsigned wm = __reduce_max_sync(0xFFFFFFFFu, bits);
      if (tid % 32 == 0) atomicMax(&amax[r][c / 32], wm);
    }
  }
  __syncthreads();
  // Scales: one thread per row (the weight tile: thread 0 for all).
  if (tid < kTile) {
    const int r = tid;
    const int64_t gr = r0 + r;
    if (l.mx()) {
      for (int j = 0; j < 4; ++j) {
        const int64_t b = c0 / 32 + j;
        const unsigned char code = e8m0_code_bits(amax[r][j]);
        scale[r][j] = e8m0_value(code);
        // The tiled layout's padding (rows past rows_pad, blocks past k) holds zeros.
        const bool inside = gr < l.rows_pad && b < l.k_blocks();
        static_cast<unsigned char*>(scales_out)[l.scale_index(gr, b)] = inside ? code : 0;
      }
    } else if (l.weight) {
      if (r == 0) {
        unsigned m = 0;
        for (int i = 0; i < kTile; ++i)
          for (int j = 0; j < 4; ++j) m = max(m, amax[i][j]);
        const float s = block_scale_bits(m);
        for (int i = 0; i < kTile; ++i)
          for (int j = 0; j < 4; ++j) scale[i][j] = s;
        const int64_t b = c0 / kTile;
        float* out = static_cast<float*>(scales_out);
        out[l.scale_index(r0, b)] = s;
        // The stride's padding columns, written once per row of tiles.
        if (b == l.k_blocks() - 1)
          for (int64_t p = l.k_blocks(); p < l.k_blocks4(); ++p) out[l.scale_index(r0, p)] = 0.f;
      }
    } else {
      const unsigned m = max(max(amax[r][0], amax[r][1]), max(amax[r][2], amax[r][3]));
      const float s = block_scale_bits(m);
      for (int j = 0; j < 4; ++j) scale[r][j] = s;
      if (gr < l.rows_pad) static_cast<float*>(scales_out)[l.scale_index(gr, c0 / kTile)] = s;
    }
  }
  __syncthreads();
  // Pass 2: the codes into shared memory (zeros outside X), read the way pass 1 read.
  for (int i = 0; i < kTile * kTile / kThreads; ++i) {
    int r, c;
    if (by_rows) {
      r = tid % kTile;
      c = tid / kTile + 2 * i;
    } else {
      r = tid / kTile + 2 * i;
      c = tid % kTile;
    }
    const bool inside = r0 + r < l.rows && c0 + c < l.k;
    tile[r][c] = inside ? quantize_one(load(r, c), make_scale(scale[r][c / 32])) : 0;
  }
  __syncthreads();
  // Out K-contiguous, a 4-byte word per thread and step (ldk is a multiple of 16).
  for (int i = tid; i < kTile * kTile / 4; i += kThreads) {
    const int r = i / (kTile / 4), w = i % (kTile / 4);
    const int64_t gr = r0 + r, gc = c0 + 4 * w;
    if (gr >= l.rows_pad || gc >= l.ldk) continue;
    const unsigned word = static_cast<unsigned>(tile[r][4 * w]) |
                          static_cast<unsigned>(tile[r][4 * w + 1]) << 8 |
                          static_cast<unsigned>(tile[r][4 * w + 2]) << 16 |
                          static_cast<unsigned>(tile[r][4 * w + 3]) << 24;
    *reinterpret_cast<unsigned*>(codes + gr * l.ldk + gc) = word;
  }
}

// 8 consecutive elements of T from a 16-byte aligned address, as f32.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[8]) {
  constexpr int kPer = Vec16<T>::kN;
#pragma unroll
  for (int h = 0; h < 8 / kPer; ++h) {
    Vec16<T> q;
    q.raw = reinterpret_cast<const uint4*>(p)[h];
#pragma unroll
    for (int i = 0; i < kPer; ++i) v[h * kPer + i] = q.get(i);
  }
}

__device__ __forceinline__ unsigned abs_bits(float x) { return __float_as_uint(x) & 0x7FFFFFFFu; }

// The largest |x| bits (as f32 bits) of the 8 elements of q. A bf16's f32 bits are its own
// shifted up by 16, so the maximum is taken on the packed halves of the raw words (sign
// cleared, unsigned order = magnitude order, a NaN above infinity) and shifted once.
template <typename T>
__device__ __forceinline__ unsigned amax8_bits(const Vec16<T> (&q)[8 / Vec16<T>::kN]) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    const uint4 w = q[0].raw;
    constexpr unsigned kAbs = 0x7FFF7FFFu;
    const unsigned m2 =
        __vmaxu2(__vmaxu2(w.x & kAbs, w.y & kAbs), __vmaxu2(w.z & kAbs, w.w & kAbs));
    return max(m2 >> 16, m2 & 0xFFFFu) << 16;
  } else {
    constexpr int kPer = Vec16<T>::kN;
    unsigned m = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) m = max(m, abs_bits(q[i / kPer].get(i % kPer)));
    return m;
  }
}

// Block128 data operand, source K-contiguous (X[r][c] = x[r * ld + c], ld and k multiples of 8,
// x 16-byte aligned). A thread block covers kDataRows rows and 256 columns (one grid dimension
// the groups of 256 columns, the other the groups of rows, so no index is divided; the column
// groups go along x where the row groups fit y, so that blocks launched together read
// neighbouring bytes of the same rows rather than one 512-byte run of each of many rows, whose
// addresses repeat at the row stride, often a power of two); a warp takes kUnits rows, lanes
// 0-15 one 128-column block of a row, lanes 16-31 the next, 8 columns a lane. The kernel is
// bound by how many bytes are in flight: every row's 16 bytes are loaded, raw, before any is
// used, and the raw words (not their f32 values) stay in registers, so that a thread holds
// kUnits loads at full occupancy. Rows in [rows, rows_pad) and columns in [k, ldk) are zeros
// (scale 1 where a whole block is).
constexpr int kUnits = 4;
constexpr int kDataRows = kThreads / 32 * kUnits;

// The codes of 8 elements under one scale: e4m3(x * r) in pairs where r is finite and the
// scale is a number (the common case, uniform over a half-warp), else quantize_one each.
template <typename T>
__device__ __forceinline__ uint2 quantize8(const Vec16<T> (&q)[8 / Vec16<T>::kN], Scale sc) {
  constexpr int kPer = Vec16<T>::kN;
  float v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = q[i / kPer].get(i % kPer);
  unsigned word[2] = {0, 0};
  if (!isnan(sc.s) && !isinf(sc.r)) {
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      const __nv_fp8x2_storage_t two = __nv_cvt_float2_to_fp8x2(
          make_float2(__fmul_rn(v[i], sc.r), __fmul_rn(v[i + 1], sc.r)), __NV_SATFINITE,
          __NV_E4M3);
      word[i / 4] |= static_cast<unsigned>(two) << (8 * (i % 4));
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      word[i / 4] |= static_cast<unsigned>(quantize_one(v[i], sc)) << (8 * (i % 4));
  }
  return make_uint2(word[0], word[1]);
}

// One thread block's part of a data operand: the 256 columns of `col_group` and the kDataRows rows
// of `row_group`.
template <typename T>
__device__ __forceinline__ void quantize_data_block(const T* __restrict__ x, int64_t ld,
                                                    const Fp8Layout& l,
                                                    unsigned char* __restrict__ codes,
                                                    float* __restrict__ scales, unsigned col_group,
                                                    unsigned row_group) {
  constexpr int kPer = Vec16<T>::kN;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t c = static_cast<int64_t>(col_group) * 256 + lane * 8;
  const int64_t r0 = static_cast<int64_t>(row_group) * kDataRows + warp;
  // k % 8 == 0: a lane's 8 columns are all in or all out.
  const bool col_in = c < l.k;
  Vec16<T> q[kUnits][8 / kPer];
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    const int64_t r = r0 + u * (kThreads / 32);
#pragma unroll
    for (int h = 0; h < 8 / kPer; ++h) {
      q[u][h].raw = make_uint4(0, 0, 0, 0);
      if (col_in && r < l.rows) q[u][h].raw = reinterpret_cast<const uint4*>(x + r * ld + c)[h];
    }
  }
  const int64_t b = c / kTile;
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    const int64_t r = r0 + u * (kThreads / 32);
    if (r >= l.rows_pad) break;  // the whole warp alike
    unsigned m = amax8_bits<T>(q[u]);
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    const Scale sc = make_scale(block_scale_bits(m));
    if (lane % 16 == 0 && b < l.k_blocks()) scales[l.scale_index(r, b)] = sc.s;
    if (c >= l.ldk) continue;
    const uint2 word = col_in ? quantize8<T>(q[u], sc) : make_uint2(0, 0);
    *reinterpret_cast<uint2*>(codes + r * l.ldk + c) = word;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_data_kernel(const T* __restrict__ x, int64_t ld, Fp8Layout l,
                         unsigned char* __restrict__ codes, float* __restrict__ scales,
                         bool columns_along_x) {
  quantize_data_block<T>(x, ld, l, codes, scales, columns_along_x ? blockIdx.x : blockIdx.y,
                         columns_along_x ? blockIdx.y : blockIdx.x);
}

// Up to kDataJobs data operands of one K in one launch (a group's products): blockIdx.x the
// column group, blockIdx.y the row group counted over the jobs in order.
constexpr int kDataJobs = 32;
struct DataJob {
  const void* x;
  int64_t ld, first_group;
  Fp8Layout l;
  unsigned char* codes;
  float* scales;
};
struct DataBatch {
  int n;
  DataJob job[kDataJobs];
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_data_batch_kernel(const __grid_constant__ DataBatch batch) {
  const int64_t g = blockIdx.y;
  int jn = 0;
  while (jn + 1 < batch.n && g >= batch.job[jn + 1].first_group) ++jn;
  const DataJob& j = batch.job[jn];
  quantize_data_block<T>(static_cast<const T*>(j.x), j.ld, j.l, j.codes, j.scales, blockIdx.x,
                         static_cast<unsigned>(g - j.first_group));
}

// A 128x128 tile's scale from each thread's amax (bits of |x|): the warps' maxima through
// warp_max (kThreads / 32 slots of shared memory), then the block's.
__device__ __forceinline__ Scale tile_scale(unsigned m, unsigned* warp_max) {
  m = __reduce_max_sync(0xFFFFFFFFu, m);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) m = max(m, warp_max[w]);
  return make_scale(block_scale_bits(m));
}

// A 128x128 tile of codes staged in shared memory (rows of kTile + 1 bytes, in the source's
// orientation: X's tile as stored, or its transpose where `trans`) written out K-contiguous into
// the codes of X's tile (r0, c0), a 4-byte word per thread and step, a warp one 128-byte row.
__device__ __forceinline__ void store_tile_codes(const unsigned char* tile, bool trans, int64_t r0,
                                                 int64_t c0, const Fp8Layout& l,
                                                 unsigned char* __restrict__ codes) {
  constexpr int kStride = kTile + 1;
  for (int w = threadIdx.x; w < kTile * kTile / 4; w += kThreads) {
    const int r = w / (kTile / 4), c = (w % (kTile / 4)) * 4;
    const int64_t gr = r0 + r, gc = c0 + c;
    if (gr >= l.rows_pad || gc >= l.ldk) continue;
    unsigned word = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const unsigned char code = trans ? tile[(c + e) * kStride + r] : tile[r * kStride + c + e];
      word |= static_cast<unsigned>(code) << (8 * e);
    }
    *reinterpret_cast<unsigned*>(codes + gr * l.ldk + gc) = word;
  }
}

// Block128 weight operand: one thread block per 128x128 tile of X, read from the source S
// (S[i][j] = x[i * ld + j], ld a multiple of 8, x 16-byte aligned) as X[r][c] = S[r][c], or
// S[c][r] where `trans`. Each thread loads 8 runs of 8 source elements of the tile; the tile's
// amax by warp then block; the codes go to shared memory in the source's orientation and out
// K-contiguous, a 4-byte word per thread and step.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_weight_kernel(const T* __restrict__ x, int64_t ld, bool trans, Fp8Layout l,
                           unsigned char* __restrict__ codes, float* __restrict__ scales) {
  constexpr int kRuns = kTile * kTile / 8 / kThreads;  // 8
  constexpr int kStride = kTile + 1;  // bytes per row of the shared tile: transposed reads spread
  __shared__ unsigned char tile[kTile * kStride];
  __shared__ unsigned warp_max[kThreads / 32];
  const int tid = threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  // The tile in source coordinates.
  const int64_t s_rows = trans ? l.k : l.rows, s_cols = trans ? l.rows : l.k;
  const int64_t i0 = trans ? c0 : r0, j0 = trans ? r0 : c0;
  float v[kRuns][8];
  unsigned m = 0;
#pragma unroll
  for (int q = 0; q < kRuns; ++q) {
    const int run = tid + q * kThreads;
    const int i = run / (kTile / 8), j = (run % (kTile / 8)) * 8;
    if (i0 + i < s_rows && j0 + j < s_cols) {
      load8(x + (i0 + i) * ld + j0 + j, v[q]);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) v[q][e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) m = max(m, abs_bits(v[q][e]));
  }
  const Scale sc = tile_scale(m, warp_max);
  if (tid == 0) {
    const int64_t b = c0 / kTile;
    scales[l.scale_index(r0, b)] = sc.s;
    // The stride's padding columns, written once per row of tiles.
    if (b == l.k_blocks() - 1)
      for (int64_t p = l.k_blocks(); p < l.k_blocks4(); ++p) scales[l.scale_index(r0, p)] = 0.f;
  }
#pragma unroll
  for (int q = 0; q < kRuns; ++q) {
    const int run = tid + q * kThreads;
    const int i = run / (kTile / 8), j = (run % (kTile / 8)) * 8;
    const bool in = i0 + i < s_rows && j0 + j < s_cols;
#pragma unroll
    for (int e = 0; e < 8; ++e) tile[i * kStride + j + e] = in ? quantize_one(v[q][e], sc) : 0;
  }
  __syncthreads();
  store_tile_codes(tile, trans, r0, c0, l, codes);
}

// Block128 data operand stored the other way: X[r][c] = S[c][r], S[i][j] = x[i * ld + j] (ld and
// X's rows multiples of 8, x 16-byte aligned), one thread block per 128x128 tile of X; the grid's
// x runs along X's rows (the source's columns), so that blocks launched together read
// neighbouring bytes of the same source rows. Thread tid loads 8 runs of 8 source elements, raw
// (16 bytes an access), source rows tid / 16 + 16 q of the tile and the same 8 columns
// (tid % 16) * 8 .. + 7 in every run, so that it holds one partial amax per column; a column's
// amax over the tile's 128 source rows (the 1x128 block of X's row) is the maximum of its 16
// threads' (the two half-warps by a shuffle, the 8 warps through shared memory). Scales as the
// data kernel's: rows in [rows, rows_pad) get 1 and zero codes, columns in [k, ldk) zeros. The
// codes go to shared memory in the source's orientation (in pairs where both scales are numbers
// with finite reciprocals, as quantize8) and out K-contiguous (store_tile_codes). The kernel is
// bound by the bytes in flight: the raw words, not their f32 values, stay in registers, so that
// bf16 sources fit 64 registers, four blocks an SM.
template <typename T>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 4 : 1)
    quantize_data_t_kernel(const T* __restrict__ x, int64_t ld, Fp8Layout l,
                           unsigned char* __restrict__ codes, float* __restrict__ scales) {
  constexpr int kPer = Vec16<T>::kN;
  constexpr int kRuns = kTile * kTile / 8 / kThreads;  // 8
  constexpr int kStride = kTile + 1;  // bytes per row of the shared tile: transposed reads spread
  constexpr int kWarps = kThreads / 32;
  __shared__ unsigned char tile[kTile * kStride];
  __shared__ unsigned col_max[kWarps][kTile];
  __shared__ float col_s[kTile], col_r[kTile];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile;  // X's rows: source columns
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTile;  // X's K: source rows
  const int j = (tid % 16) * 8;
  const bool col_in = r0 + j < l.rows;  // rows % 8 == 0: a run is all in or all out
  const T* src = x + c0 * ld + r0 + j;
  Vec16<T> q[kRuns][8 / kPer];
#pragma unroll
  for (int r = 0; r < kRuns; ++r) {
    const int i = tid / 16 + 16 * r;
    const bool in = col_in && c0 + i < l.k;
#pragma unroll
    for (int h = 0; h < 8 / kPer; ++h) {
      q[r][h].raw = make_uint4(0, 0, 0, 0);
      if (in) q[r][h].raw = reinterpret_cast<const uint4*>(src + i * ld)[h];
    }
  }
  if constexpr (std::is_same_v<T, bf16_t>) {
    // The maxima on the packed halves of the raw words (as amax8_bits): column 2h in the low
    // half of m2[h], 2h + 1 in the high one.
    constexpr unsigned kAbs = 0x7FFF7FFFu;
    unsigned m2[4] = {0, 0, 0, 0};
#pragma unroll
    for (int r = 0; r < kRuns; ++r) {
      const uint4 w = q[r][0].raw;
      m2[0] = __vmaxu2(m2[0], w.x & kAbs);
      m2[1] = __vmaxu2(m2[1], w.y & kAbs);
      m2[2] = __vmaxu2(m2[2], w.z & kAbs);
      m2[3] = __vmaxu2(m2[3], w.w & kAbs);
    }
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      m2[h] = __vmaxu2(m2[h], __shfl_xor_sync(0xFFFFFFFFu, m2[h], 16));
      if (lane < 16) {
        col_max[warp][j + 2 * h] = (m2[h] & 0xFFFFu) << 16;
        col_max[warp][j + 2 * h + 1] = (m2[h] >> 16) << 16;
      }
    }
  } else {
    unsigned m[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int r = 0; r < kRuns; ++r)
#pragma unroll
      for (int e = 0; e < 8; ++e) m[e] = max(m[e], abs_bits(q[r][e / kPer].get(e % kPer)));
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      m[e] = max(m[e], __shfl_xor_sync(0xFFFFFFFFu, m[e], 16));
      if (lane < 16) col_max[warp][j + e] = m[e];
    }
  }
  __syncthreads();
  if (tid < kTile) {
    unsigned mm = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mm = max(mm, col_max[w][tid]);
    const Scale sc = make_scale(block_scale_bits(mm));
    col_s[tid] = sc.s;
    col_r[tid] = sc.r;
    const int64_t r = r0 + tid, b = c0 / kTile;
    if (r < l.rows_pad && b < l.k_blocks()) scales[l.scale_index(r, b)] = sc.s;
  }
  __syncthreads();
  // Every scale of the thread's columns a number with a finite reciprocal: conversions in pairs
  // (outside X the loads left zeros, whose codes are zeros under such a scale).
  bool plain = true;
  float rcp[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    rcp[e] = col_r[j + e];
    plain = plain && !isnan(col_s[j + e]) && !isinf(rcp[e]);
  }
  if (plain) {
#pragma unroll
    for (int r = 0; r < kRuns; ++r) {
      unsigned char* row = tile + (tid / 16 + 16 * r) * kStride + j;
#pragma unroll
      for (int e = 0; e < 8; e += 2) {
        const __nv_fp8x2_storage_t two = __nv_cvt_float2_to_fp8x2(
            make_float2(__fmul_rn(q[r][e / kPer].get(e % kPer), rcp[e]),
                        __fmul_rn(q[r][(e + 1) / kPer].get((e + 1) % kPer), rcp[e + 1])),
            __NV_SATFINITE, __NV_E4M3);
        row[e] = static_cast<unsigned char>(two & 0xFF);
        row[e + 1] = static_cast<unsigned char>(two >> 8);
      }
    }
  } else {
    for (int r = 0; r < kRuns; ++r) {
      const int i = tid / 16 + 16 * r;
      const bool in = col_in && c0 + i < l.k;
      unsigned char* row = tile + i * kStride + j;
      for (int e = 0; e < 8; ++e)
        row[e] =
            in ? quantize_one(q[r][e / kPer].get(e % kPer), Scale{col_s[j + e], col_r[j + e]}) : 0;
    }
  }
  __syncthreads();
  store_tile_codes(tile, true, r0, c0, l, codes);
}

// Block128 weights in both forms at once (fp8_gemm.h, Fp8WeightPair): thread block b takes tile
// b of the launch's weights, one after another in the job table. Each thread loads 8 runs of 8
// elements of the tile of W, raw (16 bytes an access); the tile's amax (one scale for both
// forms) by warp, then block; the codes go to shared memory as words in W's orientation, 8 a
// run, two stores. Out as W: a word per thread and step, rows of the tile in order. Out as W^T:
// each thread takes 4x4 blocks of codes, reads 4 words of consecutive rows, transposes them in
// registers (__byte_perm) and writes 4 words to 4 consecutive rows of the W^T copy.
// The kernel is bound by the bytes in flight, so by how many blocks an SM holds: indices inside
// the tile are 32-bit and the tile's base pointers formed once, so that bf16 sources fit 64
// registers, four blocks an SM.
constexpr int kPairJobs = 16;
struct PairJob {
  const void* x;
  int64_t rows, cols, tiles_c, first_tile;
  Fp8Layout ls, lt;  // X = W, X = W^T
  unsigned char *codes_s, *codes_t;
  float *scales_s, *scales_t;
};
struct PairBatch {
  int n;
  PairJob job[kPairJobs];
};

template <typename T>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 4 : 1)
    quantize_weight_pair_kernel(const __grid_constant__ PairBatch batch) {
  constexpr int kPer = Vec16<T>::kN;
  constexpr int kRuns = kTile * kTile / 8 / kThreads;  // 8
  constexpr int kWords = kTile / 4 + 1;                // words per shared row (banks skewed)
  constexpr int kRunsPerRow = kTile / 8;               // 16
  constexpr int kRowStep = kThreads / kRunsPerRow;     // 16
  __shared__ unsigned tile[kTile * kWords];
  __shared__ unsigned warp_max[kThreads / 32];
  const int tid = threadIdx.x;
  const int64_t t = blockIdx.x;
  int jn = 0;
  while (jn + 1 < batch.n && t >= batch.job[jn + 1].first_tile) ++jn;
  const PairJob& job = batch.job[jn];  // read in place (__grid_constant__): no local copy
  const int64_t tt = t - job.first_tile;
  const int64_t i0 = tt / job.tiles_c * kTile, j0 = tt % job.tiles_c * kTile;
  // The tile's rows and columns inside W (fewer at its edges); cols % 8 == 0: runs whole.
  const int ri = static_cast<int>(std::min<int64_t>(kTile, job.rows - i0));
  const int rj = static_cast<int>(std::min<int64_t>(kTile, job.cols - j0));
  const T* x = static_cast<const T*>(job.x) + i0 * job.cols + j0;
  const size_t cols = static_cast<size_t>(job.cols);
  // Run r of thread tid: row tid / 16 + 16 r of the tile, columns (tid % 16) * 8 .. + 7.
  const int i_first = tid / kRunsPerRow, j = (tid % kRunsPerRow) * 8;
  Vec16<T> q[kRuns][8 / kPer];
#pragma unroll
  for (int r = 0; r < kRuns; ++r) {
    const int i = i_first + kRowStep * r;
    const bool in = i < ri && j < rj;
#pragma unroll
    for (int h = 0; h < 8 / kPer; ++h)
      q[r][h].raw =
          in ? reinterpret_cast<const uint4*>(x + i * cols + j)[h] : make_uint4(0, 0, 0, 0);
  }
  unsigned m = 0;
#pragma unroll
  for (int r = 0; r < kRuns; ++r) m = max(m, amax8_bits<T>(q[r]));
  const Scale sc = tile_scale(m, warp_max);
  if (tid == 0) {
    // X = W: tile (i0, j0), K block j0 / 128; X = W^T: tile (j0, i0), K block i0 / 128. The
    // stride's padding columns are written by the last K block of each row of tiles.
    const int64_t bs = j0 / kTile, bt = i0 / kTile;
    job.scales_s[job.ls.scale_index(i0, bs)] = sc.s;
    if (bs == job.ls.k_blocks() - 1)
      for (int64_t p = job.ls.k_blocks(); p < job.ls.k_blocks4(); ++p)
        job.scales_s[job.ls.scale_index(i0, p)] = 0.f;
    job.scales_t[job.lt.scale_index(j0, bt)] = sc.s;
    if (bt == job.lt.k_blocks() - 1)
      for (int64_t p = job.lt.k_blocks(); p < job.lt.k_blocks4(); ++p)
        job.scales_t[job.lt.scale_index(j0, p)] = 0.f;
  }
#pragma unroll
  for (int r = 0; r < kRuns; ++r) {
    const int i = i_first + kRowStep * r;
    const uint2 w = i < ri && j < rj ? quantize8<T>(q[r], sc) : make_uint2(0, 0);
    tile[i * kWords + j / 4] = w.x;
    tile[i * kWords + j / 4 + 1] = w.y;
  }
  __syncthreads();
  {
    // The rows and K columns of the W copy this tile writes (rows_pad and ldk bound them).
    const int rows = static_cast<int>(std::min<int64_t>(kTile, job.ls.rows_pad - i0));
    const int ks = static_cast<int>(std::min<int64_t>(kTile, job.ls.ldk - j0));
    const size_t ldk = static_cast<size_t>(job.ls.ldk);
    unsigned char* out = job.codes_s + i0 * job.ls.ldk + j0;
    for (int w = tid; w < kTile * kTile / 4; w += kThreads) {
      const int r = w / (kTile / 4), c = w % (kTile / 4);
      if (r < rows && 4 * c < ks)
        *reinterpret_cast<unsigned*>(out + r * ldk + 4 * c) = tile[r * kWords + c];
    }
  }
  const int rows = static_cast<int>(std::min<int64_t>(kTile, job.lt.rows_pad - j0));
  const int ks = static_cast<int>(std::min<int64_t>(kTile, job.lt.ldk - i0));
  const size_t ldk = static_cast<size_t>(job.lt.ldk);
  unsigned char* out = job.codes_t + j0 * job.lt.ldk + i0;
  for (int b = tid; b < (kTile / 4) * (kTile / 4); b += kThreads) {
    const int bi = b % (kTile / 4), bj = b / (kTile / 4);  // rows 4 bi.., columns 4 bj.. of W
    const unsigned w0 = tile[(4 * bi) * kWords + bj], w1 = tile[(4 * bi + 1) * kWords + bj];
    const unsigned w2 = tile[(4 * bi + 2) * kWords + bj], w3 = tile[(4 * bi + 3) * kWords + bj];
    const unsigned lo01 = __byte_perm(w0, w1, 0x5140), hi01 = __byte_perm(w0, w1, 0x7362);
    const unsigned lo23 = __byte_perm(w2, w3, 0x5140), hi23 = __byte_perm(w2, w3, 0x7362);
    // Row 4 bj + f of W^T: byte f of w0, w1, w2, w3.
    const unsigned o[4] = {__byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632),
                           __byte_perm(hi01, hi23, 0x5410), __byte_perm(hi01, hi23, 0x7632)};
    if (4 * bi >= ks) continue;
#pragma unroll
    for (int f = 0; f < 4; ++f)
      if (4 * bj + f < rows) *reinterpret_cast<unsigned*>(out + (4 * bj + f) * ldk + 4 * bi) = o[f];
  }
}

// The GLU kernels of elementwise.cu (bf16, 16 bytes an access) that also quantize what they write
// as a block128 data operand X [rows_pad, ldk] (rows padded to 4 with zero rows): f a multiple
// of 128, so the 16 lanes of a half-warp hold one 1x128 block of a row, whose amax they reduce
// by shuffles as quantize_data_kernel does, from the bf16 values written. Threads run over
// rows_pad rows; a warp leaves the loop as a whole (the shuffles need every lane) and half-warps
// past the end write nothing.
using Bf16Vec = Vec16<bf16_t>;

// A lane's 8 codes of a 1x128 block whose |x| bits' maximum is m, at `codes`; the block's scale
// at `scale` (written by the half-warp's first lane).
__device__ __forceinline__ void put_block_codes_at(const Bf16Vec (&v)[1], unsigned m, int lane,
                                                   unsigned char* codes, float* scale) {
  const Scale sc = make_scale(block_scale_bits(m));
  if (lane % 16 == 0) *scale = sc.s;
  *reinterpret_cast<uint2*>(codes) = quantize8<bf16_t>(v, sc);
}

__device__ __forceinline__ void put_block_codes(const Bf16Vec (&v)[1], unsigned m, int lane,
                                                const Fp8Layout& l, int64_t r, int64_t col,
                                                unsigned char* codes, float* scales) {
  put_block_codes_at(v, m, lane, codes + r * l.ldk + col, scales + l.scale_index(r, col / kTile));
}

__device__ __forceinline__ unsigned half_warp_max(unsigned m) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  return m;
}

__global__ void __launch_bounds__(kThreads)
    glu_fwd_fp8_kernel(const uint4* __restrict__ h, uint4* __restrict__ a, int64_t rows, int64_t fv,
                       GluArgs p, Fp8Layout l, unsigned char* __restrict__ codes,
                       float* __restrict__ scales) {
  const int lane = threadIdx.x % 32;
  const int64_t n = l.rows_pad * fv, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i - lane < n;
       i += stride) {
    const int64_t r = i / fv, c = i - r * fv;
    Bf16Vec out[1];
    out[0].raw = make_uint4(0, 0, 0, 0);
    if (i < n && r < rows) {
      const Bf16Vec g{h[r * 2 * fv + c]}, u{h[r * 2 * fv + fv + c]};
#pragma unroll
      for (int q = 0; q < Bf16Vec::kN; ++q) out[0].set(q, glu_value(g.get(q), u.get(q), p));
      a[i] = out[0].raw;
    }
    const unsigned m = half_warp_max(amax8_bits<bf16_t>(out));
    if (i >= n) continue;
    put_block_codes(out, m, lane, l, r, c * 8, codes, scales);
  }
}

__global__ void __launch_bounds__(kThreads)
    glu_bwd_fp8_kernel(const uint4* __restrict__ h, const uint4* __restrict__ da,
                       uint4* __restrict__ dh, int64_t rows, int64_t fv, GluArgs p, Fp8Layout l,
                       unsigned char* __restrict__ codes, float* __restrict__ scales) {
  const int lane = threadIdx.x % 32;
  const int64_t n = l.rows_pad * fv, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i - lane < n;
       i += stride) {
    const int64_t r = i / fv, c = i - r * fv;
    Bf16Vec dg[1], du[1];
    dg[0].raw = du[0].raw = make_uint4(0, 0, 0, 0);
    if (i < n && r < rows) {
      const Bf16Vec g{h[r * 2 * fv + c]}, u{h[r * 2 * fv + fv + c]}, d{da[i]};
#pragma unroll
      for (int q = 0; q < Bf16Vec::kN; ++q) {
        float x, y;
        glu_grad(g.get(q), u.get(q), d.get(q), p, x, y);
        dg[0].set(q, x);
        du[0].set(q, y);
      }
      dh[r * 2 * fv + c] = dg[0].raw;
      dh[r * 2 * fv + fv + c] = du[0].raw;
    }
    const unsigned mg = half_warp_max(amax8_bits<bf16_t>(dg));
    const unsigned mu = half_warp_max(amax8_bits<bf16_t>(du));
    if (i >= n) continue;
    put_block_codes(dg, mg, lane, l, r, c * 8, codes, scales);
    put_block_codes(du, mu, lane, l, r, fv * 8 + c * 8, codes, scales);
  }
}

// The bf16 cross-entropy of embedding_loss.cu (cross_entropy_bf16x8_kernel, whose loss and
// gradient bits it gives: the same 1,024 threads a row, the same order) that also quantizes the
// gradient it writes as a block128 data operand X [rows_pad, v] (v a multiple of 128; rows
// padded to 4): the 16 lanes of a half-warp hold one 1x128 block, whose amax they reduce by
// shuffles from the bf16 values written, as the GLU kernels do. One thread block a row; the
// blocks past the last row write the padding rows' zero codes and unit scales. A row's scales
// go to `row_scales` [rows_pad, k_blocks] row-major, where a row's blocks are neighbours, and
// transpose_scales_kernel moves them to the layout's [k_blocks, rows_pad]: written there
// directly, a row's scales lie rows_pad floats apart, one memory sector each.
__global__ void __launch_bounds__(kLossThreads)
    cross_entropy_fp8_kernel(bf16_t* __restrict__ logits, const int32_t* __restrict__ targets,
                             int64_t rows, int64_t v, float grad_scale,
                             float* __restrict__ row_loss, Fp8Layout l,
                             unsigned char* __restrict__ codes, float* __restrict__ row_scales) {
  __shared__ float scratch[33];
  const int64_t row = blockIdx.x, v8 = v / 8, kb = v / kTile;
  const int lane = threadIdx.x % 32;
  if (row >= rows) {
    for (int64_t i = threadIdx.x; i < v8; i += blockDim.x) {
      *reinterpret_cast<uint2*>(codes + row * l.ldk + i * 8) = make_uint2(0, 0);
      if (i % 16 == 0) row_scales[row * kb + i / 16] = 1.f;
    }
    return;
  }
  uint4* lr8 = reinterpret_cast<uint4*>(logits + row * v);
  const int32_t target = targets[row];
  const bool valid = target >= 0 && target < v;  // uniform over the block
  float lse = 0.f, target_logit = 0.f;
  if (valid) {
    target_logit = to_f32(logits[row * v + target]);
    lse = row_lse_bf16x8(lr8, v8, scratch);
  }
  // A warp leaves the loop as a whole (the shuffles need every lane); v8 is a multiple of 16, so
  // a half-warp is wholly in or out.
  for (int64_t i = threadIdx.x; i - lane < v8; i += blockDim.x) {
    Bf16Vec out[1];
    out[0].raw = make_uint4(0, 0, 0, 0);
    if (i < v8 && valid) {
      const Bf16Vec q{lr8[i]};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float p = __expf(q.get(j) - lse);
        out[0].set(j, grad_scale * (p - (i * 8 + j == target ? 1.f : 0.f)));
      }
    }
    if (i < v8) lr8[i] = out[0].raw;
    const unsigned m = half_warp_max(amax8_bits<bf16_t>(out));
    if (i >= v8) continue;
    put_block_codes_at(out, m, lane, codes + row * l.ldk + i * 8, row_scales + row * kb + i / 16);
  }
  if (threadIdx.x == 0) row_loss[row] = valid ? lse - target_logit : 0.f;
}

// out[b * rows + r] = in[r * cols + b] (r < rows, b < cols) through 32 x 32 tiles of shared
// memory, so that both sides are read and written in runs; blockDim (32, 8), tiles of rows along
// the grid's y in a stride loop.
__global__ void transpose_scales_kernel(const float* __restrict__ in, int64_t rows, int64_t cols,
                                        float* __restrict__ out) {
  __shared__ float tile[32][33];
  const int64_t b0 = static_cast<int64_t>(blockIdx.x) * 32;
  for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * 32; r0 < rows; r0 += 32ll * gridDim.y) {
    for (int j = threadIdx.y; j < 32; j += blockDim.y) {
      const int64_t r = r0 + j, b = b0 + threadIdx.x;
      if (r < rows && b < cols) tile[j][threadIdx.x] = in[r * cols + b];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < 32; j += blockDim.y) {
      const int64_t b = b0 + j, r = r0 + threadIdx.x;
      if (r < rows && b < cols) out[b * rows + r] = tile[threadIdx.x][j];
    }
    __syncthreads();
  }
}

// c[i, j] = d[i * ldd + j] + beta * c[i, j] + bias[j] + r[i, j] in double, rounded once to C.
// Rows along the grid's y, columns along x: no index division.
template <typename C, typename B>
__global__ void combine_kernel(const float* __restrict__ d, int64_t ldd, C* c, int64_t m, int64_t n,
                               double beta, const B* __restrict__ bias, const C* __restrict__ r) {
  for (int64_t i = blockIdx.y; i < m; i += gridDim.y)
    for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t e = i * n + j;
      double v = d ? static_cast<double>(d[i * ldd + j]) : 0.0;
      if (beta != 0) v += beta * static_cast<double>(to_f32(c[e]));
      if (bias) v += static_cast<double>(to_f32(bias[j]));
      if (r) v += static_cast<double>(to_f32(r[e]));
      if constexpr (std::is_same_v<C, float>) {
        c[e] = static_cast<float>(v);
      } else {
        c[e] = __double2bfloat16(v);
      }
    }
}

}  // namespace

void launch_fp8_quantize(const void* x, DType x_t, int64_t row_stride, int64_t col_stride,
                         const Fp8Layout& l, void* codes, void* scales, cudaStream_t stream) {
  if (l.rows_pad == 0 || l.ldk == 0) return;
  HP_CHECK(l.row_tiles() <= 65535, "fp8 quantize: ", l.rows_pad, " rows exceed the grid");
  // The source's rows: along K where col_stride is 1, else along X's rows (a transposed copy).
  const bool k_contiguous = col_stride == 1;
  const int64_t ld = k_contiguous ? row_stride : col_stride;
  const bool runs_of_8 = (k_contiguous || row_stride == 1) && ld % 8 == 0 &&
                         (k_contiguous ? l.k : l.rows) % 8 == 0 &&
                         reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(codes) % 8 == 0;
  const bool block128 = l.recipe == fp8::Recipe::kBlock128;
  dispatch_float(x_t, [&](auto tag) {
    using T = decltype(tag);
    const T* src = static_cast<const T*>(x);
    auto* out = static_cast<unsigned char*>(codes);
    const int64_t col_groups = (l.ldk + 255) / 256;
    const int64_t row_groups = (l.rows_pad + kDataRows - 1) / kDataRows;
    if (block128 && !l.weight && k_contiguous && runs_of_8 && col_groups <= 65535 &&
        row_groups <= 0x7FFFFFFF) {
      const bool columns_along_x = row_groups <= 65535;
      const dim3 grid =
          columns_along_x
              ? dim3(static_cast<unsigned>(col_groups), static_cast<unsigned>(row_groups))
              : dim3(static_cast<unsigned>(row_groups), static_cast<unsigned>(col_groups));
      quantize_data_kernel<T><<<grid, kThreads, 0, stream>>>(
          src, ld, l, out, static_cast<float*>(scales), columns_along_x);
    } else if (block128 && !l.weight && !k_contiguous && runs_of_8 &&
               (l.ldk + kTile - 1) / kTile <= 65535) {
      const dim3 grid(static_cast<unsigned>(l.row_tiles()),
                      static_cast<unsigned>((l.ldk + kTile - 1) / kTile));
      quantize_data_t_kernel<T>
          <<<grid, kThreads, 0, stream>>>(src, ld, l, out, static_cast<float*>(scales));
    } else if (block128 && l.weight && runs_of_8) {
      const dim3 grid(static_cast<unsigned>((l.ldk + kTile - 1) / kTile),
                      static_cast<unsigned>(l.row_tiles()));
      quantize_weight_kernel<T><<<grid, kThreads, 0, stream>>>(src, ld, !k_contiguous, l, out,
                                                               static_cast<float*>(scales));
    } else {
      const dim3 grid(static_cast<unsigned>((l.ldk + kTile - 1) / kTile),
                      static_cast<unsigned>(l.row_tiles()));
      quantize_kernel<T><<<grid, kThreads, 0, stream>>>(src, row_stride, col_stride, l, out,
                                                        scales);
    }
  });
  CUDA_CHECK_LAUNCH();
}

bool launch_fp8_quantize_data_batch(const std::vector<Fp8DataOperand>& ops, DType x_t,
                                    cudaStream_t stream) {
  if (ops.empty()) return true;
  const Fp8Layout& l0 = ops[0].l;
  for (const Fp8DataOperand& o : ops) {
    const Fp8Layout& l = o.l;
    if (l.recipe != fp8::Recipe::kBlock128 || l.weight || l.k != l0.k || l.ldk != l0.ldk ||
        o.ld % 8 != 0 || l.k % 8 != 0 || reinterpret_cast<uintptr_t>(o.x) % 16 != 0 ||
        reinterpret_cast<uintptr_t>(o.codes) % 8 != 0)
      return false;
  }
  const int64_t col_groups = (l0.ldk + 255) / 256;
  if (col_groups > 65535) return false;
  // The batches first, so that nothing is issued unless every one fits the grid.
  std::vector<DataBatch> batches;
  for (size_t at = 0; at < ops.size(); at += kDataJobs) {
    DataBatch batch{};
    int64_t groups = 0;
    for (size_t i = at; i < std::min(ops.size(), at + kDataJobs); ++i) {
      const Fp8DataOperand& o = ops[i];
      if (o.l.rows_pad == 0 || o.l.ldk == 0) continue;
      DataJob& j = batch.job[batch.n++];
      j.x = o.x;
      j.ld = o.ld;
      j.first_group = groups;
      j.l = o.l;
      j.codes = static_cast<unsigned char*>(o.codes);
      j.scales = static_cast<float*>(o.scales);
      groups += (o.l.rows_pad + kDataRows - 1) / kDataRows;
    }
    if (groups > 65535) return false;
    if (groups == 0) continue;
    batches.push_back(batch);
  }
  for (const DataBatch& batch : batches) {
    // The row groups of a batch: its last job's first one plus that job's own.
    const DataJob& last = batch.job[batch.n - 1];
    const int64_t groups = last.first_group + (last.l.rows_pad + kDataRows - 1) / kDataRows;
    const dim3 grid(static_cast<unsigned>(col_groups), static_cast<unsigned>(groups));
    dispatch_float(x_t, [&](auto tag) {
      using T = decltype(tag);
      quantize_data_batch_kernel<T><<<grid, kThreads, 0, stream>>>(batch);
    });
    CUDA_CHECK_LAUNCH();
  }
  return true;
}

void launch_fp8_quantize_weight_pairs(const std::vector<Fp8WeightPair>& pairs, DType x_t,
                                      cudaStream_t stream) {
  for (size_t at = 0; at < pairs.size(); at += kPairJobs) {
    PairBatch batch{};
    int64_t tiles = 0;
    for (size_t i = at; i < std::min(pairs.size(), at + kPairJobs); ++i) {
      const Fp8WeightPair& p = pairs[i];
      HP_CHECK(p.cols % 8 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
                   p.as_stored.recipe == fp8::Recipe::kBlock128 && p.as_stored.weight &&
                   p.transposed.weight,
               "fp8 weight pairs: ", p.rows, " x ", p.cols,
               " needs block128 weight layouts, columns a multiple of 8 and a 16-byte aligned "
               "source");
      if (p.rows == 0 || p.cols == 0) continue;
      PairJob& j = batch.job[batch.n++];
      j.x = p.x;
      j.rows = p.rows;
      j.cols = p.cols;
      j.tiles_c = (p.cols + kTile - 1) / kTile;
      j.first_tile = tiles;
      j.ls = p.as_stored;
      j.lt = p.transposed;
      j.codes_s = static_cast<unsigned char*>(p.codes_s);
      j.codes_t = static_cast<unsigned char*>(p.codes_t);
      j.scales_s = static_cast<float*>(p.scales_s);
      j.scales_t = static_cast<float*>(p.scales_t);
      tiles += (p.rows + kTile - 1) / kTile * j.tiles_c;
    }
    if (tiles == 0) continue;
    HP_CHECK(tiles <= 0x7FFFFFFF, "fp8 weight pairs: ", tiles, " tiles exceed the grid");
    dispatch_float(x_t, [&](auto tag) {
      using T = decltype(tag);
      quantize_weight_pair_kernel<T><<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(batch);
    });
    CUDA_CHECK_LAUNCH();
  }
}

static bool glu_fp8_fused(DType t, int64_t f, const Fp8Layout& l,
                          std::initializer_list<const void*> p) {
  return t == DType::kBF16 && f % kTile == 0 && l.recipe == fp8::Recipe::kBlock128 && !l.weight &&
         l.ldk == l.k && vec16_rows(f, 2, p);
}

bool launch_glu_fwd_fp8(const void* h, void* a, DType t, int64_t rows, int64_t f, int kind,
                        float alpha, float limit, const Fp8Layout& l, void* codes, void* scales,
                        cudaStream_t stream) {
  if (!glu_fp8_fused(t, f, l, {h, a, codes}) || l.k != f || l.rows != rows) return false;
  if (l.rows_pad == 0 || f == 0) return true;
  const int64_t fv = f / 8;
  glu_fwd_fp8_kernel<<<grid_for(l.rows_pad * fv, kThreads, 4096), kThreads, 0, stream>>>(
      static_cast<const uint4*>(h), static_cast<uint4*>(a), rows, fv, GluArgs{kind, alpha, limit},
      l, static_cast<unsigned char*>(codes), static_cast<float*>(scales));
  CUDA_CHECK_LAUNCH();
  return true;
}

bool launch_glu_bwd_fp8(const void* h, const void* da, void* dh, DType t, int64_t rows, int64_t f,
                        int kind, float alpha, float limit, const Fp8Layout& l, void* codes,
                        void* scales, cudaStream_t stream) {
  if (!glu_fp8_fused(t, f, l, {h, da, dh, codes}) || l.k != 2 * f || l.rows != rows) return false;
  if (l.rows_pad == 0 || f == 0) return true;
  const int64_t fv = f / 8;
  glu_bwd_fp8_kernel<<<grid_for(l.rows_pad * fv, kThreads, 4096), kThreads, 0, stream>>>(
      static_cast<const uint4*>(h), static_cast<const uint4*>(da), static_cast<uint4*>(dh), rows,
      fv, GluArgs{kind, alpha, limit}, l, static_cast<unsigned char*>(codes),
      static_cast<float*>(scales));
  CUDA_CHECK_LAUNCH();
  return true;
}

bool launch_cross_entropy_fp8(void* logits, DType t, const int32_t* targets, int64_t n, int64_t v,
                              float grad_scale, float* loss, const Fp8Layout& l, void* codes,
                              void* scales, Allocator& alloc, cudaStream_t stream) {
  if (t != DType::kBF16 || v % kTile != 0 || l.recipe != fp8::Recipe::kBlock128 || l.weight ||
      l.rows != n || l.k != v || l.ldk != v || !vec16_rows(v, 2, {logits, codes}))
    return false;
  if (l.rows_pad == 0) return true;
  HP_CHECK(l.rows_pad <= 0x7FFFFFFF, "cross_entropy_fp8: ", l.rows_pad, " rows exceed the grid");
  Tensor row_loss = Tensor::empty(alloc, {n}, DType::kF32);
  const int64_t kb = v / kTile;
  HP_CHECK(l.scale_count() == l.rows_pad * kb, "cross_entropy_fp8: scale layout");
  Tensor row_scales = Tensor::empty(alloc, {l.rows_pad, kb}, DType::kF32);
  cross_entropy_fp8_kernel<<<static_cast<unsigned>(l.rows_pad), kLossThreads, 0, stream>>>(
      static_cast<bf16_t*>(logits), targets, n, v, grad_scale, row_loss.data<float>(), l,
      static_cast<unsigned char*>(codes), row_scales.data<float>());
  CUDA_CHECK_LAUNCH();
  const dim3 grid(static_cast<unsigned>((kb + 31) / 32),
                  static_cast<unsigned>(std::min<int64_t>((l.rows_pad + 31) / 32, 65535)));
  transpose_scales_kernel<<<grid, dim3(32, 8), 0, stream>>>(row_scales.data<float>(), l.rows_pad,
                                                            kb, static_cast<float*>(scales));
  CUDA_CHECK_LAUNCH();
  if (n > 0) launch_reduce_sum_add(row_loss.data<float>(), n, 1.f, loss, alloc, stream);
  return true;
}

void launch_fp8_combine(const float* d, int64_t ldd, void* c, DType c_t, int64_t m, int64_t n,
                        double beta, const void* bias, DType bias_t, const void* r,
                        cudaStream_t stream) {
  if (m == 0 || n == 0) return;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 64)),
                  static_cast<unsigned>(std::min<int64_t>(m, 65535)));
  dispatch_float(c_t, [&](auto ctag) {
    using C = decltype(ctag);
    dispatch_float(bias ? bias_t : c_t, [&](auto btag) {
      using B = decltype(btag);
      combine_kernel<C, B><<<grid, kThreads, 0, stream>>>(d, ldd, static_cast<C*>(c), m, n, beta,
                                                          static_cast<const B*>(bias),
                                                          static_cast<const C*>(r));
    });
  });
  CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace hp
