// FP8 numerics, exactly as the FP8 training recipes define them (docs/design.md, "FP8
// training"): the OCP FP8 E4M3 element format, the E8M0 power-of-two scale of the OCP MX
// formats, and block quantization of a matrix along its contraction dimension.
//
// E4M3 (OCP "E4M3FN"): sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; NaN is
// S.1111.111 (0x7F, 0xFF); largest finite value 448; smallest normal 2^-6, smallest subnormal
// 2^-9. Conversion from float rounds to nearest, ties to even (subnormals included), and
// saturates: a finite value beyond +-448, and +-inf, become +-448 (what the GPU's satfinite
// conversion does). NaN stays NaN. Every E4M3 value is exact as a float.
//
// Gradients use E4M3 too (the block recipes' choice: their per-block scales give the range that
// E5M2 would otherwise buy), so there is no E5M2 here.
//
// Block scales:
//  - kBlock128 (Hopper, cuBLASLt's VEC128_32F / BLK128x128_32F): an fp32 scale per block,
//    s = amax / 448, the factor that multiplies the E4M3 value to dequantize: x ~ s * q, where
//    q = e4m3(x * (1 / s)): 1 / s rounded to fp32 once per block, the product rounded to fp32
//    (one multiply an element, the same on the GPU; x / s where 1 / s overflows, a scale below
//    2^-128). A block whose amax is 0 (or so small that amax / 448 is 0) gets s = 1 and its
//    elements quantize to zeros. A block holding a non-finite value gets s = NaN, so every
//    element of it dequantizes to NaN (the step's non-finite check then sees it). Activations and gradients are quantized in 1x128 blocks along the
//    contraction dimension, weights in 128x128 tiles; edge blocks are partial.
//  - kMx32 (Blackwell MXFP8, VEC32_UE8M0): 1x32 blocks along the contraction dimension for every
//    operand, with an E8M0 scale 2^X, X = floor(log2(amax)) - 8 (8: the exponent of E4M3's
//    largest power of two), clamped to [-127, 127]; elements are x * 2^-X (exactly x / 2^X)
//    converted with
//    saturation (amax / 2^X lies in [256, 512), so the largest values of a block may saturate to
//    448, as the MX spec allows). An all-zero block gets X = 0; a non-finite block the NaN scale
//    0xFF.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace hp {
namespace fp8 {

constexpr float kE4M3Max = 448.0f;
constexpr uint8_t kE4M3NaN = 0x7F;
// E4M3's largest power of two is 2^8: the MX spec's emax_elem.
constexpr int kE4M3Emax = 8;
constexpr uint8_t kE8M0NaN = 0xFF;

// float -> E4M3 code: round to nearest even, saturating to +-448, NaN to NaN (sign kept).
uint8_t e4m3_from_float(float x);
// E4M3 code -> its exact value (NaN for 0x7F and 0xFF).
float e4m3_to_float(uint8_t code);

// The E8M0 scale code of an MX block whose largest magnitude is `amax` (>= 0): 127 + X, X as
// above; 127 (2^0) for amax == 0; 0xFF when amax is not finite.
uint8_t e8m0_scale_code(float amax);
// 2^(code - 127); NaN for 0xFF. Exact as a float for codes 1..254; code 0 (2^-127) is a float
// subnormal, also exact.
float e8m0_to_float(uint8_t code);

// The fp32 scale of a kBlock128 block whose largest magnitude is `amax` (NaN when not finite).
float block_scale(float amax);
// The code of x in a block of scale s (block_scale or an E8M0 value) whose reciprocal, 1 / s
// rounded to fp32, is r: e4m3(x * r), or e4m3(x / s) where r is infinite; NaN where s is.
uint8_t quantize_element(float x, float s, float r);

enum class Recipe {
  kBlock128,  // 1x128 (data) and 128x128 (weights) blocks, fp32 scales
  kMx32,      // 1x32 blocks for every operand, E8M0 scales
};
const char* recipe_name(Recipe r);

// How an operand of a product is blocked (kBlock128; under kMx32 every operand is kData).
enum class Role {
  kData,    // activations and gradients: 1 x B along the contraction dimension
  kWeight,  // 128 x 128 tiles
};

// The contraction-dimension block length of a recipe: 128 or 32.
int64_t block_k(Recipe r);

// A matrix of `rows` x `k` (k: the contraction dimension) quantized in blocks of
// block_rows x block_k: codes row-major [rows, k]; one scale per block, row-major
// [ceil(rows/block_rows), ceil(k/block_k)] (for kMx32 the decoded E8M0 scale; its code in
// scale_codes).
struct Quantized {
  int64_t rows = 0, k = 0;
  int64_t block_rows = 1, block_k = 128;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  std::vector<uint8_t> scale_codes;  // kMx32 only

  int64_t k_blocks() const { return (k + block_k - 1) / block_k; }
  float scale(int64_t r, int64_t c) const {
    return scales[static_cast<size_t>((r / block_rows) * k_blocks() + c / block_k)];
  }
  float code_value(int64_t r, int64_t c) const {
    return e4m3_to_float(codes[static_cast<size_t>(r * k + c)]);
  }
  // scale * E4M3 value, in double (exact: 4 x 24 significant bits).
  double dequantized(int64_t r, int64_t c) const {
    return static_cast<double>(scale(r, c)) * code_value(r, c);
  }
};

// Quantizes the logical matrix X[r][c] = x[r * row_stride + c * col_stride] (r < rows, c < k; c
// runs along the contraction dimension) with `role`'s blocks under `recipe`.
Quantized quantize(const float* x, int64_t rows, int64_t k, int64_t row_stride, int64_t col_stride,
                   Recipe recipe, Role role);

}  // namespace fp8
}  // namespace hp
