// Where the CUDA backend's FP8 GEMM operands live on the device (docs/design.md, "FP8 on the
// GPU"): one layout type shared by the quantization kernels (fp8_quantize.cu), the cuBLASLt call
// (fp8_gemm.cpp) and the readback of the tests.
//
// An operand is the logical matrix X [rows, k] whose second index runs along the contraction
// dimension K (op(a) itself, and op(b) transposed). Hopper's FP8 tensor-core GEMMs take only the
// "TN" form (cuBLASLt: A transposed, B not), which in memory means both operands K-contiguous, so
// every operand is stored that way whatever the transposes of the product:
//  - codes: E4M3 bytes, row-major [rows_pad, ldk]; ldk = k rounded up to 16 (16-byte rows; to
//    the block length where a product needs it), rows_pad >= rows as the caller asks (the GEMM's
//    M and N). Padding holds zeros, which change no block's amax or sum.
//  - scales, by recipe and role (cuBLAS documentation, "128-element 1D and 128x128 2D Block
//    Scaling For FP8 Data Types" and "1D Block Scaling Factors Layout"):
//    * kBlock128, kData (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F): fp32, "outer-major": the scale
//      of row r and K block b at b * rows_pad + r ([k_blocks, rows_pad] row-major).
//    * kBlock128, kWeight (BLK128x128_32F): fp32, K-major with the column stride a multiple of
//      4: the 128x128 tile (r / 128, b) at (r / 128) * L4 + b, L4 = k_blocks rounded up to 4.
//    * kMx32 (VEC32_UE8M0): E8M0 bytes in the tiled layout: 128 x 4 tiles of 512 bytes, tiles
//      row-major over [ceil(rows_pad / 128), L4 / 4]; inside a tile the scale of row r, block b
//      at (r % 32) * 16 + ((r % 128) / 32) * 4 + b % 4. Every byte of the padded tiles is
//      written (zeros outside [rows_pad, k_blocks]).
#pragma once

#include <cstdint>

#include "framework/core/fp8.h"

#if defined(__CUDACC__)
#define HP_FP8_HD __host__ __device__
#else
#define HP_FP8_HD
#endif

namespace hp::cuda {

struct Fp8Layout {
  fp8::Recipe recipe = fp8::Recipe::kBlock128;
  bool weight = false;  // kBlock128 with the kWeight role: 128x128 tiles
  int64_t rows = 0, k = 0;
  int64_t rows_pad = 0, ldk = 0;

  HP_FP8_HD int64_t block_k() const { return recipe == fp8::Recipe::kMx32 ? 32 : 128; }
  HP_FP8_HD int64_t k_blocks() const { return (k + block_k() - 1) / block_k(); }
  HP_FP8_HD int64_t k_blocks4() const { return (k_blocks() + 3) / 4 * 4; }
  HP_FP8_HD int64_t row_tiles() const { return (rows_pad + 127) / 128; }
  HP_FP8_HD bool mx() const { return recipe == fp8::Recipe::kMx32; }
  // Scale elements (fp32 for kBlock128, bytes for kMx32).
  HP_FP8_HD int64_t scale_count() const {
    if (mx()) return row_tiles() * k_blocks4() * 128;
    if (weight) return row_tiles() * k_blocks4();
    return k_blocks() * rows_pad;
  }
  // The scale of row r (< rows_pad) and K block b (< k_blocks4 for kMx32 and weights, else
  // < k_blocks).
  HP_FP8_HD int64_t scale_index(int64_t r, int64_t b) const {
    if (mx())
      return ((b / 4) * 4 + (r / 128) * k_blocks4()) * 128 + (r % 32) * 16 + ((r % 128) / 32) * 4 +
             b % 4;
    if (weight) return (r / 128) * k_blocks4() + b;
    return b * rows_pad + r;
  }
  HP_FP8_HD int64_t code_bytes() const { return rows_pad * ldk; }
  bool operator==(const Fp8Layout& o) const {
    return recipe == o.recipe && weight == o.weight && rows == o.rows && k == o.k &&
           rows_pad == o.rows_pad && ldk == o.ldk;
  }
};

// The layout of X [rows, k] quantized under `recipe` with `role` (ignored under kMx32), rows
// padded up to a multiple of `row_multiple`, K to a multiple of `k_multiple` (16 or a multiple
// of it that divides the block length).
inline Fp8Layout fp8_layout(int64_t rows, int64_t k, fp8::Recipe recipe, fp8::Role role,
                            int64_t row_multiple, int64_t k_multiple = 16) {
  Fp8Layout l;
  l.recipe = recipe;
  l.weight = recipe == fp8::Recipe::kBlock128 && role == fp8::Role::kWeight;
  l.rows = rows;
  l.k = k;
  l.rows_pad = (rows + row_multiple - 1) / row_multiple * row_multiple;
  l.ldk = (k + k_multiple - 1) / k_multiple * k_multiple;
  return l;
}

}  // namespace hp::cuda
