#include "framework/core/fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "framework/core/error.h"

namespace hp {
namespace fp8 {

uint8_t e4m3_from_float(float x) {
  uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return static_cast<uint8_t>(sign | kE4M3NaN);
  if (mag >= 0x43E00000u) return static_cast<uint8_t>(sign | 0x7E);  // >= 448 (inf included)
  if (mag < 0x3C800000u) {
    // Below 2^-6, E4M3's subnormals: multiples of 2^-9, so the code is the count of 2^-9 units,
    // rounded to nearest even (a * 512 is exact; 8 units is 2^-6, the smallest normal, code 8).
    float a = 0;
    std::memcpy(&a, &mag, sizeof a);
    return static_cast<uint8_t>(sign | static_cast<int>(std::nearbyint(a * 512.0f)));
  }
  // A normal value: float's exponent (bias 127) and top 3 mantissa bits become E4M3's (bias 7)
  // after rounding the 20 dropped bits to nearest even; a carry out of the mantissa moves into
  // the exponent field, which is the right next value. Below 448 the result is at most 0x7E.
  const uint32_t rounded = mag + 0x7FFFFu + ((mag >> 20) & 1u);
  return static_cast<uint8_t>(sign | ((rounded >> 20) - (120u << 3)));
}

namespace {
// Every code's value, from its fields: 2^(E-7) * (1 + M/8), subnormal 2^-6 * M/8, NaN at
// S.1111.111.
struct E4M3Table {
  float v[256];
  E4M3Table() {
    for (int code = 0; code < 256; ++code) {
      const int exp_field = (code >> 3) & 0xF, mant = code & 0x7;
      float a = 0;
      if (exp_field == 0xF && mant == 0x7) {
        a = std::numeric_limits<float>::quiet_NaN();
      } else if (exp_field == 0) {
        a = std::ldexp(static_cast<float>(mant), -9);
      } else {
        a = std::ldexp(static_cast<float>(8 + mant), exp_field - 7 - 3);
      }
      v[code] = (code & 0x80) ? -a : a;
    }
  }
};
}  // namespace

float e4m3_to_float(uint8_t code) {
  static const E4M3Table table;
  return table.v[code];
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

uint8_t quantize_element(float x, float s, float r) {
  if (std::isnan(s)) return kE4M3NaN;
  return e4m3_from_float(std::isinf(r) ? x / s : x * r);
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
      const float inv = 1.0f / s;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c)
          q.codes[static_cast<size_t>(r * k + c)] = quantize_element(at(r, c), s, inv);
    }
  }
  return q;
}

}  // namespace fp8
}  // namespace hp
