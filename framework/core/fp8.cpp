#include "framework/core/fp8.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "framework/core/error.h"

namespace hp {
namespace fp8 {

uint8_t e4m3_from_float(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return static_cast<uint8_t>(sign | kE4M3NaN);
  const float a = std::fabs(x);
  if (a >= kE4M3Max) return static_cast<uint8_t>(sign | 0x7E);  // saturate (inf included)
  if (a == 0) return sign;
  // The spacing of E4M3 values around a: 2^(e - 3) in the binade [2^e, 2^(e+1)) of a normal
  // value, 2^-9 below 2^-6 (subnormals). a / spacing is exact (a power-of-two division in
  // range), and nearbyint rounds it to nearest, ties to even, in the default rounding mode.
  int e = 0;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1): the binade's exponent is e - 1
  const int step_exp = std::max(e - 1, -6) - 3;
  const float units = std::nearbyint(std::ldexp(a, -step_exp));  // multiples of the spacing
  // Value = units * 2^step_exp. In the subnormal range the code is the unit count itself (8
  // units = 2^-6 is code 0x08, the smallest normal). In a normal binade the mantissa field is
  // units - 8; 16 units (rounded up to the next binade) carries into the exponent field, which
  // the same sum gives.
  const int u = static_cast<int>(units);
  int code = 0;
  if (step_exp == -9) {
    code = u;
  } else {
    const int biased = (step_exp + 3) + 7;  // the binade's biased exponent
    code = biased * 8 + (u - 8);
  }
  if (code > 0x7E) code = 0x7E;  // a value in [448, 464) rounds to 448 anyway; never NaN
  return static_cast<uint8_t>(sign | code);
}

float e4m3_to_float(uint8_t code) {
  const bool neg = (code & 0x80) != 0;
  const int exp_field = (code >> 3) & 0xF;
  const int mant = code & 0x7;
  float v = 0;
  if (exp_field == 0xF && mant == 0x7) {
    v = std::numeric_limits<float>::quiet_NaN();
  } else if (exp_field == 0) {
    v = std::ldexp(static_cast<float>(mant), -9);
  } else {
    v = std::ldexp(static_cast<float>(8 + mant), exp_field - 7 - 3);
  }
  return neg ? -v : v;
}

uint8_t e8m0_scale_code(float amax) {
  if (!std::isfinite(amax)) return kE8M0NaN;
  if (amax <= 0) return 127;
  int e = 0;
  std::frexp(amax, &e);  // floor(log2(amax)) = e - 1 (subnormals included)
  const int x = std::clamp(e - 1 - kE4M3Emax, -127, 127);
  return static_cast<uint8_t>(x + 127);
}

float e8m0_to_float(uint8_t code) {
  if (code == kE8M0NaN) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(code) - 127);
}

float block_scale(float amax) {
  if (!std::isfinite(amax)) return std::numeric_limits<float>::quiet_NaN();
  const float s = amax / kE4M3Max;
  return s > 0 ? s : 1.0f;
}

const char* recipe_name(Recipe r) { return r == Recipe::kMx32 ? "mxfp8" : "block128"; }

int64_t block_k(Recipe r) { return r == Recipe::kMx32 ? 32 : 128; }

Quantized quantize(const float* x, int64_t rows, int64_t k, int64_t row_stride, int64_t col_stride,
                   Recipe recipe, Role role) {
  HP_CHECK(rows >= 0 && k >= 0, "fp8::quantize: bad shape ", rows, " x ", k);
  Quantized q;
  q.rows = rows;
  q.k = k;
  q.block_k = block_k(recipe);
  q.block_rows = (recipe == Recipe::kBlock128 && role == Role::kWeight) ? 128 : 1;
  const int64_t rb = (rows + q.block_rows - 1) / q.block_rows, kb = q.k_blocks();
  q.codes.assign(static_cast<size_t>(rows * k), 0);
  q.scales.assign(static_cast<size_t>(rb * kb), 1.0f);
  if (recipe == Recipe::kMx32) q.scale_codes.assign(q.scales.size(), 127);
  auto at = [&](int64_t r, int64_t c) { return x[r * row_stride + c * col_stride]; };
  for (int64_t br = 0; br < rb; ++br) {
    const int64_t r0 = br * q.block_rows, r1 = std::min(rows, r0 + q.block_rows);
    for (int64_t bc = 0; bc < kb; ++bc) {
      const int64_t c0 = bc * q.block_k, c1 = std::min(k, c0 + q.block_k);
      // amax; a NaN anywhere makes it NaN (std::max would drop it).
      float amax = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          const float v = std::fabs(at(r, c));
          amax = std::isnan(v) || std::isnan(amax) ? std::numeric_limits<float>::quiet_NaN()
                                                   : std::max(amax, v);
        }
      float s = 0;
      const size_t si = static_cast<size_t>(br * kb + bc);
      if (recipe == Recipe::kMx32) {
        q.scale_codes[si] = e8m0_scale_code(amax);
        s = e8m0_to_float(q.scale_codes[si]);
      } else {
        s = block_scale(amax);
      }
      q.scales[si] = s;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c)
          q.codes[static_cast<size_t>(r * k + c)] =
              std::isnan(s) ? kE4M3NaN : e4m3_from_float(at(r, c) / s);
    }
  }
  return q;
}

}  // namespace fp8
}  // namespace hp
