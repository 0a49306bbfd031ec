// FP8 numerics (framework/core/fp8.h) against plain references written another way: every E4M3
// code decoded from its bit fields by a formula of its own, the encoder against a brute-force
// nearest search over all 256 codes (ties to the even code), saturation, zeros, subnormals and
// NaN; block scales (one large value, partial blocks, all-zero blocks, non-finite blocks); the MX
// E8M0 scale; and the CPU backend's emulated FP8 GEMM (Backend::gemm_fp8) against an fp64
// product of the dequantized operands, with its error against the unquantized product bounded.
//
// No finite-difference checks here: a quantized product is piecewise constant in its inputs
// (rounding to E4M3), so it has no useful derivative. What training needs is that the backward
// products are the products of the quantized operands the recipe states (dX = Q(dY) Q(W)^T with
// W in 128x128 tiles, dW = Q(X)^T Q(dY) with both blocked along the tokens), which
// Fp8Gemm.ProductsQuantizeTheStatedOperands checks for each transpose combination.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/core/fp8.h"
#include "framework/core/rng.h"

namespace hp {
namespace {

constexpr uint64_t kSeed = 20261202;

// E4M3 decoded from first principles: value = (-1)^s * 2^(E - 7) * (1 + M/8), subnormal
// 2^-6 * M/8, NaN at S.1111.111; computed in double with pow.
double e4m3_reference(int code) {
  const int s = (code >> 7) & 1, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::pow(2.0, -6) * (m / 8.0) : std::pow(2.0, e - 7) * (1 + m / 8.0);
  return s ? -mag : mag;
}

// The code nearest to x by brute force over all finite codes of x's sign; ties to the code whose
// last bit is 0; beyond 448 the largest finite code (saturation).
int nearest_code_brute(float x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xFF : 0x7F;
  const int sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(x));
  if (a > 448) return sign | 0x7E;
  int best = -1;
  double best_d = 0;
  for (int c = 0; c <= 0x7E; ++c) {
    const double d = std::fabs(e4m3_reference(c) - a);
    if (best < 0 || d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return sign | best;
}

float random_float(Philox& rng, uint64_t i) {
  // Magnitudes over 2^-14 .. 2^10: subnormals, normals and overflow, both signs.
  const double e = -14 + 24 * rng.uniform(2 * i);
  const double sgn = rng.uniform(2 * i + 1) < 0.5 ? -1 : 1;
  return static_cast<float>(sgn * std::pow(2.0, e));
}

TEST(Fp8, EveryE4M3CodeDecodesToItsValue) {
  for (int c = 0; c < 256; ++c) {
    const double want = e4m3_reference(c);
    const float got = fp8::e4m3_to_float(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), want) << "code " << c;
    // Every finite value encodes back to its own code (+0 and -0 keep their sign bit).
    EXPECT_EQ(fp8::e4m3_from_float(got), c) << "code " << c;
  }
  EXPECT_EQ(fp8::e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(fp8::e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8::e4m3_to_float(0x08), std::ldexp(1.0f, -6));
}

TEST(Fp8, EncoderPicksTheNearestCodeTiesToEven) {
  Philox rng(kSeed, "fp8 encoder");
  int ties = 0;
  for (uint64_t i = 0; i < 20000; ++i) {
    const float x = random_float(rng, i);
    ASSERT_EQ(fp8::e4m3_from_float(x), nearest_code_brute(x)) << "x = " << x;
  }
  // Every midpoint between two neighbouring codes: a tie, which goes to the even code.
  for (int c = 0; c < 0x7E; ++c) {
    const double mid = (e4m3_reference(c) + e4m3_reference(c + 1)) / 2;
    const float x = static_cast<float>(mid);
    ASSERT_EQ(static_cast<double>(x), mid);  // midpoints are exact in float
    const int want = (c & 1) == 0 ? c : c + 1;
    EXPECT_EQ(fp8::e4m3_from_float(x), want) << "midpoint of codes " << c << ", " << c + 1;
    EXPECT_EQ(fp8::e4m3_from_float(-x), 0x80 | want);
    EXPECT_EQ(nearest_code_brute(x), want);
    ++ties;
    // Just above and below the midpoint: the nearer code.
    EXPECT_EQ(fp8::e4m3_from_float(std::nextafter(x, 1e9f)), c + 1);
    EXPECT_EQ(fp8::e4m3_from_float(std::nextafter(x, -1e9f)), c);
  }
  EXPECT_EQ(ties, 126);
}

TEST(Fp8, SaturationZerosSubnormalsAndNaN) {
  EXPECT_EQ(fp8::e4m3_from_float(448.0f), 0x7E);
  EXPECT_EQ(fp8::e4m3_from_float(463.99f), 0x7E);
  EXPECT_EQ(fp8::e4m3_from_float(464.0f), 0x7E);  // the tie with 480 (not a value): saturates
  EXPECT_EQ(fp8::e4m3_from_float(1e6f), 0x7E);
  EXPECT_EQ(fp8::e4m3_from_float(-1e30f), 0xFE);
  EXPECT_EQ(fp8::e4m3_from_float(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(fp8::e4m3_from_float(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(fp8::e4m3_from_float(0.0f), 0x00);
  EXPECT_EQ(fp8::e4m3_from_float(-0.0f), 0x80);
  // Subnormals: multiples of 2^-9; half of the smallest rounds to even (zero), a bit more up.
  EXPECT_EQ(fp8::e4m3_from_float(std::ldexp(3.0f, -9)), 0x03);
  EXPECT_EQ(fp8::e4m3_from_float(std::ldexp(1.0f, -10)), 0x00);
  EXPECT_EQ(fp8::e4m3_from_float(std::ldexp(1.01f, -10)), 0x01);
  EXPECT_EQ(fp8::e4m3_from_float(std::ldexp(3.0f, -10)), 0x02);  // 1.5 units: tie to 2
  EXPECT_EQ(fp8::e4m3_from_float(1e-30f), 0x00);
  EXPECT_EQ(fp8::e4m3_from_float(std::numeric_limits<float>::denorm_min()), 0x00);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(fp8::e4m3_from_float(nan), 0x7F);
  EXPECT_EQ(fp8::e4m3_from_float(-nan), 0xFF);
  EXPECT_TRUE(std::isnan(fp8::e4m3_to_float(0xFF)));
}

TEST(Fp8, BlockScaleOfOneLargeValue) {
  // One row of 128 along K: one value of 1000, the rest small. s = 1000/448; 1000 maps to 448;
  // values below s * 2^-10 (half the smallest subnormal) flush to zero.
  std::vector<float> x(128, 0.0f);
  x[5] = 1000.0f;
  x[6] = 1e-4f;    // 1e-4 / s = 4.5e-5 < 2^-10: flushes
  x[7] = 0.01f;    // 0.01 / s = 0.00448: a subnormal, 2 units of 2^-9 (0.0039 .. 0.0059)
  x[8] = -3.0f;    // -1.344: rounds to -1.375 (code 0xBB)
  const fp8::Quantized q =
      fp8::quantize(x.data(), 1, 128, 128, 1, fp8::Recipe::kBlock128, fp8::Role::kData);
  ASSERT_EQ(q.scales.size(), 1u);
  EXPECT_EQ(q.scales[0], 1000.0f / 448.0f);
  EXPECT_EQ(q.codes[5], 0x7E);
  EXPECT_EQ(q.codes[6], 0x00);
  EXPECT_EQ(q.codes[7], 0x02);
  EXPECT_EQ(q.codes[8], 0xBB);
  EXPECT_EQ(q.codes[0], 0x00);
  EXPECT_NEAR(q.dequantized(0, 5), 1000.0, 1e-3);
}

// Elements are multiplied by the block's fp32 reciprocal scale; where that reciprocal overflows
// (a scale below 2^-128: subnormal amaxes) they are divided, so zeros stay zeros, not NaN.
TEST(Fp8, ReciprocalScaleAndItsOverflow) {
  std::vector<float> x(256, 0.0f);
  for (int c = 0; c < 128; c += 3) x[static_cast<size_t>(c)] = 0.37f * static_cast<float>(c - 60);
  for (int c = 128; c < 256; c += 5) x[static_cast<size_t>(c)] = 1e-40f * static_cast<float>(c % 7);
  const fp8::Quantized q =
      fp8::quantize(x.data(), 1, 256, 256, 1, fp8::Recipe::kBlock128, fp8::Role::kData);
  ASSERT_EQ(q.scales.size(), 2u);
  const float s0 = q.scales[0], s1 = q.scales[1];
  EXPECT_TRUE(std::isfinite(1.0f / s0));
  EXPECT_TRUE(std::isinf(1.0f / s1)) << "the second block's scale " << s1 << " is not tiny";
  for (int c = 0; c < 256; ++c) {
    const float v = x[static_cast<size_t>(c)];
    const uint8_t want = c < 128 ? fp8::e4m3_from_float(v * (1.0f / s0))
                                 : fp8::e4m3_from_float(v / s1);
    EXPECT_EQ(q.codes[static_cast<size_t>(c)], want) << "element " << c;
    EXPECT_EQ(q.codes[static_cast<size_t>(c)], fp8::quantize_element(v, c < 128 ? s0 : s1,
                                                                      1.0f / (c < 128 ? s0 : s1)));
  }
  EXPECT_EQ(q.codes[129], 0x00);  // a zero of the tiny block
  EXPECT_NE(q.codes[128], 0x00);  // 2e-40 / s1 is about 150
}

TEST(Fp8, PartialBlocksTilesAndZeroBlocks) {
  // 130 x 200 along K = 200: data blocks 1x128 give 2 K blocks per row (the second of 72);
  // weight tiles 128x128 give 2 x 2 tiles, the edge ones partial.
  const int64_t rows = 130, k = 200;
  Philox rng(kSeed, "fp8 blocks");
  std::vector<float> x(static_cast<size_t>(rows * k));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(rng.normal(i));
  for (int64_t c = 128; c < k; ++c) x[static_cast<size_t>(3 * k + c)] = 0.0f;  // a zero block
  const fp8::Quantized d =
      fp8::quantize(x.data(), rows, k, k, 1, fp8::Recipe::kBlock128, fp8::Role::kData);
  ASSERT_EQ(d.scales.size(), static_cast<size_t>(rows * 2));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < 2; ++b) {
      float amax = 0;
      for (int64_t c = b * 128; c < std::min<int64_t>(k, b * 128 + 128); ++c)
        amax = std::max(amax, std::fabs(x[static_cast<size_t>(r * k + c)]));
      const float want = amax == 0 ? 1.0f : amax / 448.0f;
      ASSERT_EQ(d.scales[static_cast<size_t>(r * 2 + b)], want) << r << "," << b;
    }
  EXPECT_EQ(d.scale(3, 150), 1.0f);  // the all-zero block: scale 1, codes zero, no NaN
  for (int64_t c = 128; c < k; ++c) EXPECT_EQ(d.codes[static_cast<size_t>(3 * k + c)], 0);
  const fp8::Quantized w =
      fp8::quantize(x.data(), rows, k, k, 1, fp8::Recipe::kBlock128, fp8::Role::kWeight);
  ASSERT_EQ(w.scales.size(), 4u);
  for (int64_t br = 0; br < 2; ++br)
    for (int64_t bc = 0; bc < 2; ++bc) {
      float amax = 0;
      for (int64_t r = br * 128; r < std::min<int64_t>(rows, br * 128 + 128); ++r)
        for (int64_t c = bc * 128; c < std::min<int64_t>(k, bc * 128 + 128); ++c)
          amax = std::max(amax, std::fabs(x[static_cast<size_t>(r * k + c)]));
      EXPECT_EQ(w.scales[static_cast<size_t>(br * 2 + bc)], amax / 448.0f);
    }
  // Every element: the code of x times the block's fp32 reciprocal scale, and within half a step
  // of E4M3 (2^-4 relative) of x.
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < k; ++c) {
      const float v = x[static_cast<size_t>(r * k + c)];
      const float inv = 1.0f / w.scale(r, c);
      ASSERT_EQ(w.codes[static_cast<size_t>(r * k + c)], fp8::e4m3_from_float(v * inv));
      const double err = std::fabs(w.dequantized(r, c) - v);
      ASSERT_LE(err, std::fabs(v) / 16 + w.scale(r, c) * std::ldexp(1.0, -10));
    }
  // A transposed view (col_stride = row length) quantizes the columns: blocks of 128 along the
  // first index of x.
  const fp8::Quantized t =
      fp8::quantize(x.data(), k, rows, 1, k, fp8::Recipe::kBlock128, fp8::Role::kData);
  EXPECT_EQ(t.rows, k);
  EXPECT_EQ(t.k, rows);
  float amax = 0;
  for (int64_t r = 0; r < 128; ++r) amax = std::max(amax, std::fabs(x[static_cast<size_t>(r * k)]));
  EXPECT_EQ(t.scale(0, 0), amax / 448.0f);
}

TEST(Fp8, NonFiniteBlocksDequantizeToNaN) {
  std::vector<float> x(256, 1.0f);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  x[200] = std::numeric_limits<float>::infinity();
  const fp8::Quantized q =
      fp8::quantize(x.data(), 1, 256, 256, 1, fp8::Recipe::kBlock128, fp8::Role::kData);
  EXPECT_TRUE(std::isnan(q.scales[0]));
  EXPECT_TRUE(std::isnan(q.scales[1]));
  EXPECT_TRUE(std::isnan(q.dequantized(0, 0)));
  EXPECT_EQ(q.codes[3], 0x7F);
  const float tiny = std::numeric_limits<float>::denorm_min();  // amax / 448 == 0: scale 1
  EXPECT_EQ(fp8::block_scale(tiny), 1.0f);
  EXPECT_EQ(fp8::block_scale(0.0f), 1.0f);
}

TEST(Fp8, MxScaleExponentAndElements) {
  // X = floor(log2(amax)) - 8, code = X + 127.
  EXPECT_EQ(fp8::e8m0_scale_code(1.0f), 127 - 8);
  EXPECT_EQ(fp8::e8m0_scale_code(448.0f), 127 + 0);  // log2(448) = 8.8
  EXPECT_EQ(fp8::e8m0_scale_code(511.0f), 127 + 0);
  EXPECT_EQ(fp8::e8m0_scale_code(512.0f), 127 + 1);
  EXPECT_EQ(fp8::e8m0_scale_code(0.75f), 127 - 9);
  EXPECT_EQ(fp8::e8m0_scale_code(0.0f), 127);
  EXPECT_EQ(fp8::e8m0_scale_code(std::numeric_limits<float>::infinity()), 0xFF);
  EXPECT_EQ(fp8::e8m0_scale_code(std::ldexp(1.0f, -140)), 0);      // clamped to 2^-127
  EXPECT_EQ(fp8::e8m0_scale_code(std::numeric_limits<float>::max()), 127 + 127 - 8);
  EXPECT_EQ(fp8::e8m0_to_float(127), 1.0f);
  EXPECT_EQ(fp8::e8m0_to_float(130), 8.0f);
  EXPECT_EQ(fp8::e8m0_to_float(0), std::ldexp(1.0f, -127));
  EXPECT_TRUE(std::isnan(fp8::e8m0_to_float(0xFF)));
  // 70 values along K: 1x32 blocks (3, the last of 6). Block 0's amax 500 -> X = 0, so 500
  // saturates to 448 and 3.3 rounds to 3.25; block 1's amax 0.1 -> X = -12, elements x * 4096.
  std::vector<float> x(70, 0.0f);
  x[0] = 500.0f;
  x[1] = 3.3f;
  x[40] = 0.1f;
  x[41] = -0.03f;
  x[64] = 2.0f;
  const fp8::Quantized q =
      fp8::quantize(x.data(), 1, 70, 70, 1, fp8::Recipe::kMx32, fp8::Role::kWeight);
  ASSERT_EQ(q.scales.size(), 3u);
  EXPECT_EQ(q.block_rows, 1);  // MX blocks every operand 1x32, weights too
  EXPECT_EQ(q.scale_codes[0], 127);
  EXPECT_EQ(q.codes[0], 0x7E);
  EXPECT_EQ(fp8::e4m3_to_float(q.codes[1]), 3.25f);
  EXPECT_EQ(q.scale_codes[1], 127 - 12);
  EXPECT_EQ(q.scales[1], std::ldexp(1.0f, -12));
  EXPECT_EQ(q.codes[40], fp8::e4m3_from_float(0.1f * 4096));
  EXPECT_EQ(q.codes[41], fp8::e4m3_from_float(-0.03f * 4096));
  EXPECT_EQ(q.scale_codes[2], 127 - 7);  // amax 2 -> X = 1 - 8
  EXPECT_EQ(fp8::e4m3_to_float(q.codes[64]), 256.0f);
}

// ---- the emulated GEMM ----------------------------------------------------------------------

Tensor random_tensor(Backend& be, Shape shape, const std::string& purpose, double scale) {
  Tensor t = be.empty(std::move(shape), DType::kF32);
  Philox rng(kSeed, purpose);
  for (int64_t i = 0; i < t.numel(); ++i)
    t.data<float>()[i] = static_cast<float>(scale * rng.normal(static_cast<uint64_t>(i)));
  return t;
}

// sum_k deq(op(a))[i][k] deq(op(b))[k][j] in fp64 (and the unquantized product), independently
// of the backend: each operand quantized from its logical view with the stated role.
void reference_products(const Tensor& a, bool ta, const Tensor& b, bool tb,
                        const Backend::Fp8Gemm& spec, std::vector<double>& deq,
                        std::vector<double>& exact, int64_t& m, int64_t& n) {
  m = ta ? a.dim(1) : a.dim(0);
  const int64_t k = ta ? a.dim(0) : a.dim(1);
  n = tb ? b.dim(0) : b.dim(1);
  const int64_t lda = a.dim(1), ldb = b.dim(1);
  const fp8::Quantized qa = fp8::quantize(a.data<float>(), m, k, ta ? 1 : lda, ta ? lda : 1,
                                          spec.recipe, spec.a);
  const fp8::Quantized qb = fp8::quantize(b.data<float>(), n, k, tb ? ldb : 1, tb ? 1 : ldb,
                                          spec.recipe, spec.b);
  deq.assign(static_cast<size_t>(m * n), 0.0);
  exact.assign(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0, e = 0;
      for (int64_t kk = 0; kk < k; ++kk) {
        s += qa.dequantized(i, kk) * qb.dequantized(j, kk);
        const double av = a.data<float>()[ta ? kk * lda + i : i * lda + kk];
        const double bv = b.data<float>()[tb ? j * ldb + kk : kk * ldb + j];
        e += av * bv;
      }
      deq[static_cast<size_t>(i * n + j)] = s;
      exact[static_cast<size_t>(i * n + j)] = e;
    }
}

TEST(Fp8Gemm, MatchesTheProductOfDequantizedOperands) {
  auto be = make_cpu_backend(DType::kF32);
  // K = 300: two full 128 blocks and a partial one; M, N cross a 128 tile edge.
  const int64_t m = 140, k = 300, n = 133;
  for (const fp8::Recipe recipe : {fp8::Recipe::kBlock128, fp8::Recipe::kMx32}) {
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      Tensor a = random_tensor(*be, ta ? Shape{k, m} : Shape{m, k}, "gemm a", 1.0);
      Tensor b = random_tensor(*be, tb ? Shape{n, k} : Shape{k, n}, "gemm b", 0.05);
      Tensor c = be->empty({m, n}, DType::kF32);
      Backend::Fp8Gemm spec;
      spec.recipe = recipe;
      be->gemm_fp8(a, ta, b, tb, c, 0.0, Tensor(), Tensor(), spec);
      std::vector<double> deq, exact;
      int64_t mm = 0, nn = 0;
      Backend::Fp8Gemm ref_spec = spec;
      if (recipe == fp8::Recipe::kMx32) ref_spec.b = fp8::Role::kData;
      reference_products(a, ta, b, tb, ref_spec, deq, exact, mm, nn);
      double err2 = 0, ref2 = 0;
      for (int64_t i = 0; i < m * n; ++i) {
        const double got = c.data<float>()[i];
        // The emulation rounds the fp64 sum once to float.
        ASSERT_NEAR(got, deq[static_cast<size_t>(i)],
                    std::fabs(deq[static_cast<size_t>(i)]) * 1e-7 + 1e-12)
            << fp8::recipe_name(recipe) << " ta=" << ta << " tb=" << tb << " at " << i;
        err2 += (got - exact[static_cast<size_t>(i)]) * (got - exact[static_cast<size_t>(i)]);
        ref2 += exact[static_cast<size_t>(i)] * exact[static_cast<size_t>(i)];
      }
      // Each E4M3 element carries a relative rounding error of at most 2^-4 (about 2^-4 / sqrt(3)
      // rms for a uniform spread); two operands and random signs give a product error of about
      // 2^-4 * sqrt(2/3) ~ 5% rms relative. Bounded at 8%, and it must be nonzero (quantized).
      const double rel = std::sqrt(err2 / ref2);
      EXPECT_LT(rel, 0.08) << fp8::recipe_name(recipe);
      EXPECT_GT(rel, 0.005) << fp8::recipe_name(recipe);
    }
  }
}

TEST(Fp8Gemm, ProductsQuantizeTheStatedOperands) {
  // The three products of a projection with weight W [d_in, d_out], X [tokens, d_in],
  // dY [tokens, d_out], as the model issues them.
  auto be = make_cpu_backend(DType::kF32);
  const int64_t tokens = 260, din = 150, dout = 136;
  Tensor x = random_tensor(*be, {tokens, din}, "x", 1.0);
  Tensor w = random_tensor(*be, {din, dout}, "w", 0.02);
  Tensor dy = random_tensor(*be, {tokens, dout}, "dy", 1e-3);
  struct Case {
    const char* name;
    const Tensor *a, *b;
    bool ta, tb;
    fp8::Role ra, rb;
  };
  const Case cases[] = {
      {"forward y = x W", &x, &w, false, false, fp8::Role::kData, fp8::Role::kWeight},
      {"input gradient dX = dY W^T", &dy, &w, false, true, fp8::Role::kData, fp8::Role::kWeight},
      {"weight gradient dW = X^T dY", &x, &dy, true, false, fp8::Role::kData, fp8::Role::kData},
  };
  for (const Case& cs : cases) {
    const int64_t m = cs.ta ? cs.a->dim(1) : cs.a->dim(0);
    const int64_t n = cs.tb ? cs.b->dim(0) : cs.b->dim(1);
    Tensor c = be->empty({m, n}, DType::kF32);
    Backend::Fp8Gemm spec;
    spec.a = cs.ra;
    spec.b = cs.rb;
    be->gemm_fp8(*cs.a, cs.ta, *cs.b, cs.tb, c, 0.0, Tensor(), Tensor(), spec);
    std::vector<double> deq, exact, other, unused;
    int64_t mm = 0, nn = 0;
    reference_products(*cs.a, cs.ta, *cs.b, cs.tb, spec, deq, exact, mm, nn);
    // The same product with the other blocking of b (tiles <-> vectors) differs: the test can
    // tell which operand quantization the op used.
    Backend::Fp8Gemm swapped = spec;
    swapped.b = spec.b == fp8::Role::kData ? fp8::Role::kWeight : fp8::Role::kData;
    reference_products(*cs.a, cs.ta, *cs.b, cs.tb, swapped, other, unused, mm, nn);
    int differs = 0;
    for (int64_t i = 0; i < m * n; ++i) {
      const double got = c.data<float>()[i];
      ASSERT_NEAR(got, deq[static_cast<size_t>(i)],
                  std::fabs(deq[static_cast<size_t>(i)]) * 1e-7 + 1e-15)
          << cs.name << " at " << i;
      differs += std::fabs(other[static_cast<size_t>(i)] - deq[static_cast<size_t>(i)]) >
                 std::fabs(deq[static_cast<size_t>(i)]) * 1e-6;
    }
    EXPECT_GT(differs, m * n / 10) << cs.name;
  }
}

TEST(Fp8Gemm, BetaBiasAndResidual) {
  auto be = make_cpu_backend(DType::kF32);
  const int64_t m = 37, k = 140, n = 29;
  Tensor a = random_tensor(*be, {m, k}, "bb a", 1.0);
  Tensor b = random_tensor(*be, {k, n}, "bb b", 0.1);
  Tensor bias = random_tensor(*be, {n}, "bb bias", 1.0);
  Tensor r = random_tensor(*be, {m, n}, "bb r", 1.0);
  Tensor c0 = random_tensor(*be, {m, n}, "bb c", 1.0);
  Backend::Fp8Gemm spec;
  Tensor plain = be->empty({m, n}, DType::kF32);
  be->gemm_fp8(a, false, b, false, plain, 0.0, Tensor(), Tensor(), spec);
  Tensor with = be->empty({m, n}, DType::kF32);
  be->gemm_fp8(a, false, b, false, with, 0.0, bias, r, spec);
  Tensor acc = be->empty({m, n}, DType::kF32);
  be->copy(c0, acc);
  be->gemm_fp8(a, false, b, false, acc, 1.0, Tensor(), Tensor(), spec);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const int64_t ij = i * n + j;
      const double p = plain.data<float>()[ij];
      EXPECT_NEAR(with.data<float>()[ij], p + bias.data<float>()[j] + r.data<float>()[ij], 1e-5);
      EXPECT_NEAR(acc.data<float>()[ij], p + c0.data<float>()[ij], 1e-5);
    }
  // Contract: a bias with beta != 0 is refused before any work.
  EXPECT_THROW(be->gemm_fp8(a, false, b, false, acc, 1.0, bias, Tensor(), spec), Error);
  // The group op computes what single products compute, bitwise.
  Tensor g1 = be->empty({m, n}, DType::kF32), g2 = be->empty({m, n}, DType::kF32);
  be->gemm_fp8_group({{a, b, g1, bias}, {a, b, g2, Tensor()}}, false, false, 0.0, spec);
  Tensor s1 = be->empty({m, n}, DType::kF32);
  be->gemm_fp8(a, false, b, false, s1, 0.0, bias, Tensor(), spec);
  EXPECT_EQ(std::memcmp(g1.raw(), s1.raw(), static_cast<size_t>(s1.nbytes())), 0);
  EXPECT_EQ(std::memcmp(g2.raw(), plain.raw(), static_cast<size_t>(s1.nbytes())), 0);
}

TEST(Fp8Gemm, ContractsAreCheckedBeforeAnyWork) {
  auto be = make_cpu_backend(DType::kF32);
  Tensor a = random_tensor(*be, {8, 16}, "contract a", 1.0);
  Tensor b = random_tensor(*be, {16, 4}, "contract b", 1.0);
  Tensor wrong = be->empty({8, 5}, DType::kF32);
  try {
    be->gemm_fp8(a, false, b, false, wrong, 0.0, Tensor(), Tensor(), {});
    FAIL() << "a c of the wrong shape was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gemm_fp8"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[8, 4]"), std::string::npos) << e.what();
  }
  Tensor c = be->empty({8, 4}, DType::kF32);
  EXPECT_THROW(be->gemm_fp8(a, false, b, false, c, 0.0, Tensor(), c, {}), Error);  // r aliases c
  Tensor big = be->empty({16, 4}, DType::kF32);  // two problems writing overlapping rows
  EXPECT_THROW(be->gemm_fp8_group({{a, b, big.slice(0, 8), {}}, {a, b, big.slice(4, 12), {}}},
                                  false, false, 0.0, {}),
               Error);
}

// The fp64 reference backend rounds its operands to float, quantizes them the same way and keeps
// the fp64 sum: rounded to float, it is the fp32 backend's result bit for bit.
TEST(Fp8Gemm, TheFp64BackendComputesTheSameProduct) {
  auto f32 = make_cpu_backend(DType::kF32);
  auto f64 = make_cpu_backend(DType::kF64);
  const int64_t m = 50, k = 260, n = 40;
  Tensor a = random_tensor(*f32, {k, m}, "f64 a", 1.0);
  Tensor b = random_tensor(*f32, {k, n}, "f64 b", 1.0);
  Tensor a64 = f64->empty({k, m}, DType::kF64), b64 = f64->empty({k, n}, DType::kF64);
  for (int64_t i = 0; i < a.numel(); ++i) a64.data<double>()[i] = a.data<float>()[i];
  for (int64_t i = 0; i < b.numel(); ++i) b64.data<double>()[i] = b.data<float>()[i];
  Backend::Fp8Gemm spec;
  spec.b = fp8::Role::kData;  // the weight-gradient product: both along the tokens
  Tensor c = f32->empty({m, n}, DType::kF32);
  Tensor c64 = f64->empty({m, n}, DType::kF64);
  f32->gemm_fp8(a, true, b, false, c, 0.0, Tensor(), Tensor(), spec);
  f64->gemm_fp8(a64, true, b64, false, c64, 0.0, Tensor(), Tensor(), spec);
  for (int64_t i = 0; i < m * n; ++i)
    ASSERT_EQ(static_cast<float>(c64.data<double>()[i]), c.data<float>()[i]) << i;
}

}  // namespace
}  // namespace hp
