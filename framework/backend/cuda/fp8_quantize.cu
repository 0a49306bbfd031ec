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
// Everything else (recipe mxfp8, data operands stored the other way, sources whose rows are not
// a multiple of 16 bytes) takes the general kernel: one thread block per 128 x 128 tile of X
// [rows_pad, ldk] (fp8_layout.h), a tile holding one 128x128 weight block, 128 rows of one 1x128
// data block each, or 128 rows of four 1x32 MX blocks. Its pass 1 reads the tile and takes the
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

#include "framework/backend/cuda/cuda_check.h"
#include "framework/backend/cuda/cuda_common.cuh"
#include "framework/backend/cuda/fp8_gemm.h"

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

// Block128 data operand, source K-contiguous (X[r][c] = x[r * ld + c], ld and k multiples of 8,
// x 16-byte aligned). A thread block covers kDataRows rows and 256 columns (grid x: groups of
// rows, grid y: groups of 256 columns, so no index is divided); a warp takes kUnits rows, lanes
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

template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_data_kernel(const T* __restrict__ x, int64_t ld, Fp8Layout l,
                         unsigned char* __restrict__ codes, float* __restrict__ scales) {
  constexpr int kPer = Vec16<T>::kN;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * 256 + lane * 8;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kDataRows + warp;
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
    unsigned m = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) m = max(m, abs_bits(q[u][i / kPer].get(i % kPer)));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    const Scale sc = make_scale(block_scale_bits(m));
    if (lane % 16 == 0 && b < l.k_blocks()) scales[l.scale_index(r, b)] = sc.s;
    if (c >= l.ldk) continue;
    const uint2 word = col_in ? quantize8<T>(q[u], sc) : make_uint2(0, 0);
    *reinterpret_cast<uint2*>(codes + r * l.ldk + c) = word;
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
  m = __reduce_max_sync(0xFFFFFFFFu, m);
  if (tid % 32 == 0) warp_max[tid / 32] = m;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) m = max(m, warp_max[w]);
  const Scale sc = make_scale(block_scale_bits(m));
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
  for (int w = tid; w < kTile * kTile / 4; w += kThreads) {
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
    if (block128 && !l.weight && k_contiguous && runs_of_8 && (l.ldk + 255) / 256 <= 65535 &&
        (l.rows_pad + kDataRows - 1) / kDataRows <= 0x7FFFFFFF) {
      const dim3 grid(static_cast<unsigned>((l.rows_pad + kDataRows - 1) / kDataRows),
                      static_cast<unsigned>((l.ldk + 255) / 256));
      quantize_data_kernel<T><<<grid, kThreads, 0, stream>>>(src, ld, l, out,
                                                             static_cast<float*>(scales));
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
