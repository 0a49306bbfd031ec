// The CUDA backend's FP8 GEMMs against the CPU reference (framework/core/fp8.h and the CPU
// backend's emulated gemm_fp8): the quantization kernels bit for bit (codes and scales, every
// recipe, role and dtype, transposed copies included), and every FP8 product the model makes
// (forward x W, input gradient dY W^T, weight gradient X^T dY, and their expert groups) within a
// bound of the accumulation's rounding.
//
// Why the bound: the CPU sums each K block's products exactly and accumulates the scaled block
// sums in fp64, rounding once. cuBLASLt accumulates in fp32 and applies the scales per block;
// Hopper's FP8 tensor cores keep fewer bits than fp32 inside a block (about 14, DeepSeek-V3's
// measurement). So |gpu - cpu| <= 2^-9 * S + (c's rounding) * |cpu| + 2^-20 * (|beta c| + |bias|
// + |r|), with S = sum over K of |a_q| |b_q| (the dequantized operands), is far above the
// rounding (2^-13 S in-block, 2^-24 S per fp32 add) and far below what a misplaced scale or code
// gives (errors of the size of S). The inputs draw each 32 x 32 region at its own power of two
// (2^-6 .. 2^6), so any scale read from the wrong block shows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/backend/cuda/cuda_backend.h"
#include "framework/backend/cuda/fp8_layout.h"
#include "framework/core/dtype.h"
#include "framework/core/error.h"
#include "framework/core/fp8.h"
#include "framework/core/rng.h"
#include "tests/gpu/gpu_fixtures.h"

namespace hp {
namespace {

using fp8::Recipe;
using fp8::Role;

// Host f32 [rows, cols] of normals times 2^e, e drawn per 32 x 32 region in [-6, 6], rounded to
// bf16 (so both backends and both dtypes see the same numbers).
Tensor random_host(int64_t rows, int64_t cols, uint64_t seed) {
  Philox rng(seed, "fp8-gemm-test");
  Philox region(seed, "fp8-gemm-test-region");
  Tensor t = Tensor::host({rows, cols}, DType::kF32);
  float* p = t.data<float>();
  const int64_t region_cols = (cols + 31) / 32;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int e = static_cast<int>(region.below((r / 32) * region_cols + c / 32, 13)) - 6;
      const double v = std::ldexp(rng.normal(r * cols + c), e);
      p[r * cols + c] = static_cast<float>(bf16(static_cast<float>(v)));
    }
  return t;
}

class CudaFp8 : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0)
      GTEST_SKIP() << "no CUDA device: GPU tests run on the GPU machine";
    cpu_ = make_cpu_backend(DType::kF32);
    gpu_ = make_cuda_backend(0);
  }

  // The device's FP8 GEMM recipe, or skips (visibly) where the device has none.
  bool device_recipe(Recipe* r) {
    try {
      *r = cuda_fp8_recipe(*gpu_);
      return true;
    } catch (const Error& e) {
      std::printf("skipped: %s\n", e.what());
      return false;
    }
  }

  Tensor on_gpu(const Tensor& host, DType dt) {
    Tensor f = gpu_->upload(host);
    if (dt == DType::kF32) return f;
    Tensor t = gpu_->empty(host.shape(), dt);
    gpu_->convert(f, t);
    return t;
  }

  std::vector<double> values(const Tensor& gpu_tensor) {
    return gpu_test::device_values(*gpu_, gpu_tensor);
  }

  // Quantizes host x (stored [d0, d1]) on both sides and counts differing codes and scales.
  void check_quantize(const Tensor& host, bool trans, Recipe recipe, Role role, DType dt) {
    const int64_t d0 = host.dim(0), d1 = host.dim(1);
    const int64_t rows = trans ? d1 : d0, k = trans ? d0 : d1;
    const fp8::Quantized want =
        fp8::quantize(host.data<float>(), rows, k, trans ? 1 : d1, trans ? d1 : 1, recipe, role);
    const fp8::Quantized got = cuda_fp8_quantize(*gpu_, on_gpu(host, dt), trans, recipe, role);
    const std::string what = std::string(fp8::recipe_name(recipe)) +
                             (role == Role::kWeight ? " weight" : " data") +
                             (trans ? " transposed " : " ") + dtype_name(dt) + " " +
                             std::to_string(d0) + "x" + std::to_string(d1);
    ASSERT_EQ(got.rows, want.rows) << what;
    ASSERT_EQ(got.k, want.k) << what;
    ASSERT_EQ(got.block_rows, want.block_rows) << what;
    ASSERT_EQ(got.block_k, want.block_k) << what;
    ASSERT_EQ(got.codes.size(), want.codes.size()) << what;
    ASSERT_EQ(got.scales.size(), want.scales.size()) << what;
    int64_t codes = 0, scales = 0;
    for (size_t i = 0; i < want.codes.size(); ++i) codes += got.codes[i] != want.codes[i];
    for (size_t i = 0; i < want.scales.size(); ++i)
      scales += std::memcmp(&got.scales[i], &want.scales[i], 4) != 0;
    EXPECT_EQ(codes, 0) << what << ": codes differ of " << want.codes.size();
    EXPECT_EQ(scales, 0) << what << ": scales differ of " << want.scales.size();
    if (recipe == Recipe::kMx32) {
      EXPECT_EQ(got.scale_codes, want.scale_codes) << what;
    }
  }

  // S[i][j] = sum_k |a_q(i,k)| |b_q(k,j)|, the dequantized operands of the CPU reference.
  static std::vector<double> abs_sums(const Tensor& a, bool ta, const Tensor& b, bool tb,
                                      const Backend::Fp8Gemm& spec) {
    const int64_t m = ta ? a.dim(1) : a.dim(0), k = ta ? a.dim(0) : a.dim(1);
    const int64_t n = tb ? b.dim(0) : b.dim(1);
    const int64_t lda = a.dim(1), ldb = b.dim(1);
    const bool mx = spec.recipe == Recipe::kMx32;
    const fp8::Quantized qa = fp8::quantize(a.data<float>(), m, k, ta ? 1 : lda, ta ? lda : 1,
                                            spec.recipe, mx ? Role::kData : spec.a);
    const fp8::Quantized qb = fp8::quantize(b.data<float>(), n, k, tb ? ldb : 1, tb ? 1 : ldb,
                                            spec.recipe, mx ? Role::kData : spec.b);
    std::vector<double> av(static_cast<size_t>(m * k)), bv(static_cast<size_t>(n * k));
    for (int64_t i = 0; i < m; ++i)
      for (int64_t l = 0; l < k; ++l) av[i * k + l] = std::fabs(qa.dequantized(i, l));
    for (int64_t j = 0; j < n; ++j)
      for (int64_t l = 0; l < k; ++l) bv[j * k + l] = std::fabs(qb.dequantized(j, l));
    std::vector<double> s(static_cast<size_t>(m * n), 0.0);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (int64_t l = 0; l < k; ++l) acc += av[i * k + l] * bv[j * k + l];
        s[i * n + j] = acc;
      }
    return s;
  }

  // One product c = Q(op(a)) Q(op(b)) + beta c0 + bias + r on both backends (host inputs).
  // Returns the number of elements outside the bound.
  int64_t check_product(const std::string& what, const Tensor& a, bool ta, const Tensor& b, bool tb,
                        const Tensor& c0, double beta, const Tensor& bias, const Tensor& r,
                        const Backend::Fp8Gemm& spec, DType c_dt) {
    Tensor cc = cpu_->upload(c0);
    cpu_->gemm_fp8(cpu_->upload(a), ta, cpu_->upload(b), tb, cc, beta,
                   bias.defined() ? cpu_->upload(bias) : Tensor(),
                   r.defined() ? cpu_->upload(r) : Tensor(), spec);
    const std::vector<double> want = to_double_vector(cc);
    // c0 and r in c's dtype on the GPU (their bf16-rounded values are the CPU's).
    Tensor gc = on_gpu(c0, c_dt);
    gpu_->gemm_fp8(on_gpu(a, DType::kBF16), ta, on_gpu(b, DType::kBF16), tb, gc, beta,
                   bias.defined() ? on_gpu(bias, DType::kBF16) : Tensor(),
                   r.defined() ? on_gpu(r, c_dt) : Tensor(), spec);
    const std::vector<double> got = values(gc);
    const std::vector<double> s = abs_sums(a, ta, b, tb, spec);
    const int64_t n = c0.dim(1);
    const double out_ulp = c_dt == DType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -23);
    int64_t bad = 0;
    double worst = 0;
    for (size_t e = 0; e < want.size(); ++e) {
      double extra = beta * std::fabs(c0.data<float>()[e]);
      if (bias.defined()) extra += std::fabs(bias.data<float>()[static_cast<int64_t>(e) % n]);
      if (r.defined()) extra += std::fabs(r.data<float>()[e]);
      const double bound =
          std::ldexp(s[e], -9) + out_ulp * std::fabs(want[e]) + std::ldexp(extra, -20);
      const double err = std::fabs(got[e] - want[e]);
      if (!(err <= bound)) ++bad;
      if (bound > 0) worst = std::max(worst, err / bound);
    }
    EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << want.size()
                      << " elements outside the bound (worst error / bound " << worst << ")";
    return bad;
  }

  std::unique_ptr<Backend> cpu_, gpu_;
};

// The device layouts (no GPU needed): every scale of the padded operand has its own slot inside
// the buffer, and the MX slots follow the tile formula of cuBLAS's documentation: 128 x 4 tiles
// of 512 bytes, row-major over the tiles, offset (row % 32) * 16 + (row % 128) / 32 * 4 + block
// % 4 inside one.
TEST(Fp8Layout, ScaleSlotsAreDistinctAndInRange) {
  for (Recipe recipe : {Recipe::kBlock128, Recipe::kMx32})
    for (Role role : {Role::kData, Role::kWeight})
      for (int64_t rows : {1, 4, 37, 128, 200, 300})
        for (int64_t k : {16, 100, 128, 129, 700}) {
          const cuda::Fp8Layout l = cuda::fp8_layout(rows, k, recipe, role, 4);
          const bool mx = recipe == Recipe::kMx32;
          const int64_t row_step = l.weight ? 128 : 1;
          const int64_t blocks = (mx || l.weight) ? l.k_blocks4() : l.k_blocks();
          const int64_t slot_rows = mx ? l.row_tiles() * 128 : l.rows_pad;
          std::vector<int> seen(static_cast<size_t>(l.scale_count()), 0);
          for (int64_t r = 0; r < slot_rows; r += row_step)
            for (int64_t b = 0; b < blocks; ++b) {
              const int64_t at = l.scale_index(r, b);
              ASSERT_GE(at, 0);
              ASSERT_LT(at, l.scale_count()) << rows << "x" << k;
              ++seen[static_cast<size_t>(at)];
              if (mx) {
                const int64_t tile = (r / 128) * (l.k_blocks4() / 4) + b / 4;
                const int64_t inner = (r % 128 % 32) * 16 + (r % 128 / 32) * 4 + b % 4;
                EXPECT_EQ(at, tile * 512 + inner);
              }
            }
          for (size_t i = 0; i < seen.size(); ++i)
            ASSERT_EQ(seen[i], 1) << fp8::recipe_name(recipe) << " " << rows << "x" << k
                                  << ": slot " << i << " used " << seen[i] << " times";
          EXPECT_EQ(l.ldk % 16, 0);
          EXPECT_GE(l.ldk, k);
          EXPECT_EQ((l.ldk + l.block_k() - 1) / l.block_k(), l.k_blocks());
        }
}

TEST_F(CudaFp8, QuantizeMatchesReferenceBitwise) {
  // Rows of a multiple of 8 elements take the 16-byte kernels of block128 (fp8_quantize.cu),
  // the others the general one: both, with and without whole blocks and tiles.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {128, 256}, {200, 300}, {5, 17}, {257, 129}, {64, 40}, {130, 200}, {37, 264}, {300, 136},
      {45, 1032}, {520, 264}};
  uint64_t seed = 100;
  for (const auto& [d0, d1] : shapes) {
    const Tensor x = random_host(d0, d1, ++seed);
    for (Recipe recipe : {Recipe::kBlock128, Recipe::kMx32})
      for (Role role : {Role::kData, Role::kWeight})
        for (bool trans : {false, true})
          for (DType dt : {DType::kF32, DType::kBF16}) {
            if (recipe == Recipe::kMx32 && role == Role::kWeight) continue;
            check_quantize(x, trans, recipe, role, dt);
          }
  }
}

// A data operand of more rows than the data kernel's column-major grid holds (65535 groups of
// 32 rows) takes its row-major grid: the same bits either way.
TEST_F(CudaFp8, QuantizeDataOfManyRowsBitwise) {
  const Tensor x = random_host(65535 * 32 + 40, 16, 77);
  for (DType dt : {DType::kF32, DType::kBF16})
    check_quantize(x, false, Recipe::kBlock128, Role::kData, dt);
}

// Zeros, one large value in a block of small ones, values in E4M3's subnormal range after
// scaling, amaxes whose scale is subnormal or clamps (MX), and non-finite blocks.
TEST_F(CudaFp8, QuantizeEdgeValuesBitwise) {
  // 260 columns take the general kernel, 264 the 16-byte ones (fp8_quantize.cu).
  for (const int64_t cols : {260, 264}) {
    const int64_t rows = 130;
    Tensor x = random_host(rows, cols, 7);
    float* p = x.data<float>();
    for (int64_t c = 0; c < cols; ++c) p[0 * cols + c] = 0.f;                    // an all-zero row
    for (int64_t c = 0; c < 128; ++c) p[1 * cols + c] = 1e-3f;                   // tiny beside ...
    p[1 * cols + 5] = 3.0e4f;                                                    // ... one large
    for (int64_t c = 0; c < cols; ++c) p[2 * cols + c] = 1e-40f * (c % 7);       // subnormal floats
    for (int64_t c = 0; c < cols; ++c) p[3 * cols + c] = 1e-36f * (c - 100);     // amax near 2^-118
    for (int64_t c = 0; c < cols; ++c) p[4 * cols + c] = 448.f + 8.f * (c % 5);  // saturating
    p[5 * cols + 40] = std::numeric_limits<float>::quiet_NaN();
    p[6 * cols + 200] = std::numeric_limits<float>::infinity();
    p[7 * cols + 3] = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < cols; ++c) p[8 * cols + c] = -0.f;
    for (Recipe recipe : {Recipe::kBlock128, Recipe::kMx32})
      for (Role role : {Role::kData, Role::kWeight})
        for (bool trans : {false, true}) {
          if (recipe == Recipe::kMx32 && role == Role::kWeight) continue;
          // f32 only: the subnormal floats and 448 + 8j are not bf16 values.
          check_quantize(x, trans, recipe, role, DType::kF32);
        }
  }
  // bf16 sources (whose amax the 16-byte kernel takes on the raw halves): values that bf16
  // holds exactly, zeros, -0, a large power of two among small ones, NaN and both infinities.
  for (const int64_t cols : {260, 264}) {
    Tensor x = random_host(130, cols, 8);
    float* p = x.data<float>();
    for (int64_t c = 0; c < cols; ++c) p[0 * cols + c] = 0.f;
    for (int64_t c = 0; c < cols; ++c) p[1 * cols + c] = c % 2 ? -0.f : std::ldexp(1.0f, -10);
    p[1 * cols + 77] = -32768.f;
    p[2 * cols + 130] = std::numeric_limits<float>::quiet_NaN();
    p[3 * cols + 255] = std::numeric_limits<float>::infinity();
    p[4 * cols + 0] = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < cols; ++c) p[5 * cols + c] = -0.f;
    for (Recipe recipe : {Recipe::kBlock128, Recipe::kMx32})
      for (Role role : {Role::kData, Role::kWeight})
        for (bool trans : {false, true}) {
          if (recipe == Recipe::kMx32 && role == Role::kWeight) continue;
          check_quantize(x, trans, recipe, role, DType::kBF16);
        }
  }
}

// The layer's three products: forward y = x W (+ bias, + residual), input gradient
// dX = dY W^T, weight gradient dW += X^T dY; W stored [in, out].
TEST_F(CudaFp8, ProductsMatchCpuEmulation) {
  Recipe recipe;
  if (!device_recipe(&recipe)) GTEST_SKIP() << "no block-scaled FP8 GEMMs on this device";
  struct Shape3 {
    int64_t t, in, out;
  };
  // Aligned (straight into c), partial blocks and odd sizes (the scratch path), K not a multiple
  // of 16 (100 in, 37 tokens).
  const std::vector<Shape3> shapes = {{256, 384, 512}, {200, 320, 136}, {37, 100, 72}};
  uint64_t seed = 1000;
  for (const Shape3& s : shapes) {
    const std::string dims =
        std::to_string(s.t) + "x" + std::to_string(s.in) + "x" + std::to_string(s.out);
    const Tensor x = random_host(s.t, s.in, ++seed), w = random_host(s.in, s.out, ++seed);
    const Tensor dy = random_host(s.t, s.out, ++seed), bias = random_host(1, s.out, ++seed);
    const Tensor res = random_host(s.t, s.out, ++seed), g0 = random_host(s.in, s.out, ++seed);
    const Tensor zeros_y = Tensor::host({s.t, s.out}, DType::kF32);
    const Tensor zeros_dx = Tensor::host({s.t, s.in}, DType::kF32);
    const Tensor b1 = bias.reshape({s.out});
    Backend::Fp8Gemm fwd;
    fwd.recipe = recipe;
    Backend::Fp8Gemm wgrad = fwd;
    wgrad.b = Role::kData;
    for (DType c_dt : {DType::kBF16, DType::kF32}) {
      const std::string tag = dims + " " + dtype_name(c_dt);
      check_product("forward " + tag, x, false, w, false, zeros_y, 0.0, Tensor(), Tensor(), fwd,
                    c_dt);
      check_product("forward+bias " + tag, x, false, w, false, zeros_y, 0.0, b1, Tensor(), fwd,
                    c_dt);
      check_product("forward+bias+residual " + tag, x, false, w, false, zeros_y, 0.0, b1, res, fwd,
                    c_dt);
      check_product("input gradient " + tag, dy, false, w, true, zeros_dx, 0.0, Tensor(), Tensor(),
                    fwd, c_dt);
    }
    check_product("weight gradient (beta 1) " + dims, x, true, dy, false, g0, 1.0, Tensor(),
                  Tensor(), wgrad, DType::kF32);
    check_product("weight gradient (beta 0) " + dims, x, true, dy, false, g0, 0.0, Tensor(),
                  Tensor(), wgrad, DType::kF32);
  }
}

// A MoE layer's groups over row slices of one buffer (an empty expert, partial blocks): forward
// with biases, input gradient, weight gradients accumulated with beta 1.
//
// Chunks of one buffer: a chunk whose rows are not a multiple of 4 writes its padded rows into
// the next chunk's rows, which the next product overwrites (beta 0); only the last such chunk
// (203 rows) of the forward and input-gradient groups goes through the fp32 scratch.
TEST_F(CudaFp8, GroupsMatchCpuEmulation) {
  Recipe recipe;
  if (!device_recipe(&recipe)) GTEST_SKIP() << "no block-scaled FP8 GEMMs on this device";
  const std::vector<int64_t> rows = {0, 5, 130, 64, 203};
  const int64_t d = 256, f = 192;
  int64_t total = 0;
  for (int64_t r : rows) total += r;
  const Tensor x = random_host(total, d, 51), dy = random_host(total, f, 52);
  std::vector<Tensor> w, bias, g0;
  for (size_t i = 0; i < rows.size(); ++i) {
    w.push_back(random_host(d, f, 60 + i));
    bias.push_back(random_host(1, f, 70 + i).reshape({f}));
    g0.push_back(random_host(d, f, 80 + i));
  }
  Backend::Fp8Gemm fwd;
  fwd.recipe = recipe;
  Backend::Fp8Gemm wgrad = fwd;
  wgrad.b = Role::kData;
  // put(host, dtype) on a backend; returns y, dx and the weight gradients.
  int64_t scratch = 0;
  auto run = [&](Backend& be, auto&& put, DType out_dt) {
    Tensor bx = put(x, DType::kBF16), bdy = put(dy, DType::kBF16);
    Tensor y = be.empty({total, f}, out_dt), dx = be.empty({total, d}, out_dt);
    std::vector<Tensor> out = {y, dx};
    std::vector<Backend::GemmProblem> pf, pd, pw;
    int64_t r0 = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      const int64_t r1 = r0 + rows[i];
      Tensor wi = put(w[i], DType::kBF16), g = put(g0[i], DType::kF32);
      out.push_back(g);
      pf.push_back({bx.slice(r0, r1), wi, y.slice(r0, r1), put(bias[i], DType::kBF16)});
      pd.push_back({bdy.slice(r0, r1), wi, dx.slice(r0, r1), {}});
      pw.push_back({bx.slice(r0, r1), bdy.slice(r0, r1), g, {}});
      r0 = r1;
    }
    be.gemm_fp8_group(pf, false, false, 0.0, fwd);
    be.gemm_fp8_group(pd, false, true, 0.0, fwd);
    if (&be == gpu_.get()) scratch = cuda_fp8_scratch_products(be) - scratch;
    be.gemm_fp8_group(pw, true, false, 1.0, wgrad);
    return out;
  };
  const std::vector<Tensor> want = run(
      *cpu_, [&](const Tensor& h, DType) { return cpu_->upload(h); }, DType::kF32);
  // fp32 outputs, and bf16 ones (the model's), which bound the comparison by their rounding.
  for (const DType out_dt : {DType::kF32, DType::kBF16}) {
    const int out_bits = out_dt == DType::kBF16 ? -8 : -23;
    const std::string tag = std::string(" (") + dtype_name(out_dt) + " outputs)";
    scratch = cuda_fp8_scratch_products(*gpu_);
    const std::vector<Tensor> got = run(
        *gpu_, [&](const Tensor& h, DType dt) { return on_gpu(h, dt); }, out_dt);
    if (out_dt == DType::kBF16) {
      EXPECT_EQ(scratch, 2) << "products through the fp32 scratch in the forward and "
                               "input-gradient groups";
    }
    ASSERT_EQ(want.size(), got.size());
    // Each output against the CPU's with the product's bound (as check_product states it).
    auto compare = [&](const std::string& what, const Tensor& g, const Tensor& c,
                       const std::vector<double>& s, const std::vector<double>& extra) {
      const std::vector<double> gv = values(g), cv = to_double_vector(c);
      ASSERT_EQ(gv.size(), cv.size());
      int64_t bad = 0;
      for (size_t e = 0; e < cv.size(); ++e) {
        const double bound = std::ldexp(s[e], -9) + std::ldexp(std::fabs(cv[e]), out_bits) +
                             std::ldexp(extra.empty() ? 0.0 : extra[e], -20);
        bad += !(std::fabs(gv[e] - cv[e]) <= bound);
      }
      EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << cv.size() << " outside the bound";
    };
    // S for the slices: the forward and input-gradient rows expert by expert.
    std::vector<double> sy, sdx;
    int64_t r0 = 0;
    std::vector<double> ey;
    for (size_t i = 0; i < rows.size(); ++i) {
      const int64_t r1 = r0 + rows[i];
      if (rows[i] > 0) {
        const Tensor xs = x.slice(r0, r1), dys = dy.slice(r0, r1);
        const std::vector<double> a = abs_sums(xs, false, w[i], false, fwd);
        const std::vector<double> b = abs_sums(dys, false, w[i], true, fwd);
        sy.insert(sy.end(), a.begin(), a.end());
        sdx.insert(sdx.end(), b.begin(), b.end());
        for (int64_t rr = 0; rr < rows[i]; ++rr)
          for (int64_t j = 0; j < f; ++j) ey.push_back(std::fabs(bias[i].data<float>()[j]));
        const std::vector<double> sw = abs_sums(xs, true, dys, false, wgrad);
        std::vector<double> eg(static_cast<size_t>(d * f));
        for (size_t e = 0; e < eg.size(); ++e) eg[e] = std::fabs(g0[i].data<float>()[e]);
        compare("weight gradient of expert " + std::to_string(i) + tag, got[2 + i], want[2 + i], sw,
                eg);
      }
      r0 = r1;
    }
    compare("forward with biases" + tag, got[0], want[0], sy, ey);
    compare("input gradient" + tag, got[1], want[1], sdx, {});
  }
}

// A group quantizes its a operands together (a few launches for all its products) into the
// same codes and scales each product would make alone: its outputs equal the products' one at a
// time bit for bit. 40 products (two launches of the batch kernel), empty ones among them, rows
// multiples of 4 (so neither side goes through the fp32 scratch); forward with biases and input
// gradient. A forward group of K = 100 (not a multiple of 8) is not batched and gives the same
// bits too.
TEST_F(CudaFp8, GroupQuantizesItsDataTogetherBitwise) {
  Recipe recipe;
  if (!device_recipe(&recipe)) GTEST_SKIP() << "no block-scaled FP8 GEMMs on this device";
  if (recipe != Recipe::kBlock128) GTEST_SKIP() << "the batched quantization is block128's";
  Backend::Fp8Gemm fwd;
  fwd.recipe = recipe;
  for (const int64_t d : {int64_t{256}, int64_t{100}}) {
    SCOPED_TRACE("K=" + std::to_string(d));
    const int64_t f = 192;
    std::vector<int64_t> rows;
    Philox pick(d, "fp8-group-rows");
    for (int i = 0; i < 40; ++i)
      rows.push_back(i % 7 == 3 ? 0 : 4 * (1 + static_cast<int64_t>(pick.below(i, 40))));
    int64_t total = 0;
    for (int64_t r : rows) total += r;
    const Tensor x = on_gpu(random_host(total, d, 91 + d), DType::kBF16);
    const Tensor dy = on_gpu(random_host(total, f, 92 + d), DType::kBF16);
    std::vector<Tensor> w, bias;
    for (size_t i = 0; i < rows.size(); ++i) {
      w.push_back(on_gpu(random_host(d, f, 200 + i), DType::kBF16));
      bias.push_back(on_gpu(random_host(1, f, 300 + i).reshape({f}), DType::kBF16));
    }
    Tensor y = gpu_->empty({total, f}, DType::kBF16), dx = gpu_->empty({total, d}, DType::kBF16);
    Tensor y1 = gpu_->empty({total, f}, DType::kBF16), dx1 = gpu_->empty({total, d}, DType::kBF16);
    std::vector<Backend::GemmProblem> pf, pd;
    int64_t r0 = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      const int64_t r1 = r0 + rows[i];
      pf.push_back({x.slice(r0, r1), w[i], y.slice(r0, r1), bias[i]});
      pd.push_back({dy.slice(r0, r1), w[i], dx.slice(r0, r1), {}});
      Tensor yi = y1.slice(r0, r1), dxi = dx1.slice(r0, r1);
      gpu_->gemm_fp8(x.slice(r0, r1), false, w[i], false, yi, 0.0, bias[i], Tensor(), fwd);
      gpu_->gemm_fp8(dy.slice(r0, r1), false, w[i], true, dxi, 0.0, Tensor(), Tensor(), fwd);
      r0 = r1;
    }
    const int64_t batched = cuda_fp8_batched_groups(*gpu_);
    gpu_->gemm_fp8_group(pf, false, false, 0.0, fwd);
    gpu_->gemm_fp8_group(pd, false, true, 0.0, fwd);
    // The input-gradient group's K is 192 either way.
    EXPECT_EQ(cuda_fp8_batched_groups(*gpu_) - batched, d % 8 == 0 ? 2 : 1);
    EXPECT_TRUE(values(y) == values(y1)) << "forward group against single products";
    EXPECT_TRUE(values(dx) == values(dx1)) << "input-gradient group against single products";
  }
}

// A recipe other than the device's is refused before any work, naming both.
// Held weights (Backend::hold_fp8_weights): the forward x W and input gradient dY W^T of a held
// weight give the same bits as products that quantize W themselves; each takes the held form
// (the use count), and none is held after the release. Shapes whose tiles are whole and
// partial, rows that are not 16-byte runs (300 x 129: the general kernel), 20 weights held in
// one call (two launches of the pair kernel), bf16 and f32 weights.
TEST_F(CudaFp8, HeldWeightsGiveTheSameProductsBitwise) {
  Recipe recipe;
  if (!device_recipe(&recipe)) GTEST_SKIP() << "no block-scaled FP8 GEMMs on this device";
  Backend::Fp8Gemm spec;
  spec.recipe = recipe;
  struct Shape3 {
    int64_t t, in, out;
  };
  std::vector<Shape3> shapes = {{256, 384, 512}, {200, 320, 136}, {37, 100, 72}, {64, 300, 129}};
  for (int i = 0; i < 16; ++i) shapes.push_back({48 + 8 * i, 136 + 16 * i, 264 - 8 * i});
  uint64_t seed = 5000;
  for (DType wdt : {DType::kBF16, DType::kF32}) {
    const std::string tag = dtype_name(wdt);
    std::vector<Tensor> x, dy, w;
    for (const Shape3& s : shapes) {
      x.push_back(on_gpu(random_host(s.t, s.in, ++seed), wdt));
      dy.push_back(on_gpu(random_host(s.t, s.out, ++seed), wdt));
      w.push_back(on_gpu(random_host(s.in, s.out, ++seed), wdt));
    }
    auto products = [&](size_t i) {
      const Shape3& s = shapes[i];
      Tensor y = gpu_->empty({s.t, s.out}, DType::kBF16);
      Tensor dx = gpu_->empty({s.t, s.in}, DType::kBF16);
      gpu_->gemm_fp8(x[i], false, w[i], false, y, 0.0, Tensor(), Tensor(), spec);
      gpu_->gemm_fp8(dy[i], false, w[i], true, dx, 0.0, Tensor(), Tensor(), spec);
      return std::make_pair(values(y), values(dx));
    };
    std::vector<std::pair<std::vector<double>, std::vector<double>>> want;
    for (size_t i = 0; i < shapes.size(); ++i) want.push_back(products(i));
    const int64_t uses0 = cuda_fp8_held_uses(*gpu_);
    gpu_->hold_fp8_weights(w, spec);
    EXPECT_EQ(cuda_fp8_held_weights(*gpu_), static_cast<int64_t>(shapes.size())) << tag;
    for (size_t i = 0; i < shapes.size(); ++i) {
      const std::string what = tag + " " + std::to_string(shapes[i].t) + "x" +
                               std::to_string(shapes[i].in) + "x" + std::to_string(shapes[i].out);
      const auto got = products(i);
      EXPECT_EQ(got.first, want[i].first) << "forward " << what;
      EXPECT_EQ(got.second, want[i].second) << "input gradient " << what;
    }
    EXPECT_EQ(cuda_fp8_held_uses(*gpu_) - uses0, 2 * static_cast<int64_t>(shapes.size())) << tag;
    gpu_->release_fp8_weights();
    EXPECT_EQ(cuda_fp8_held_weights(*gpu_), 0) << tag;
    const int64_t uses1 = cuda_fp8_held_uses(*gpu_);
    EXPECT_EQ(products(0), want[0]) << tag;
    EXPECT_EQ(cuda_fp8_held_uses(*gpu_), uses1) << tag;
  }
}

// The GLUs that hand their output on (Backend::glu_fwd_fp8, glu_bwd_fp8): their output is bit
// for bit glu_fwd's / glu_bwd's, and the next product, which takes the handed-on codes (the use
// count), gives the bits of the product that quantizes that output itself; a product with
// another a drops them, so the one after quantizes again. Rows that are and are not a multiple
// of 4 (zero rows pad the codes), both activations, f 128 and 384 (the fused kernels) and 136
// (the plain GLU, nothing handed on).
TEST_F(CudaFp8, GluHandsItsQuantizedOutputToTheNextProductBitwise) {
  Recipe recipe;
  if (!device_recipe(&recipe)) GTEST_SKIP() << "no block-scaled FP8 GEMMs on this device";
  Backend::Fp8Gemm spec;
  spec.recipe = recipe;
  const bool fused_recipe = recipe == Recipe::kBlock128;
  uint64_t seed = 9000;
  for (const GluKind kind : {GluKind::kSwiGLU, GluKind::kGptOss})
    for (const int64_t rows : {256, 37})
      for (const int64_t f : {128, 384, 136}) {
        const std::string what = std::string(kind == GluKind::kSwiGLU ? "swiglu " : "gpt-oss ") +
                                 std::to_string(rows) + "x" + std::to_string(f);
        const bool fused = fused_recipe && f % 128 == 0;
        GluParams p;
        p.kind = kind;
        const Tensor h = on_gpu(random_host(rows, 2 * f, ++seed), DType::kBF16);
        const Tensor da = on_gpu(random_host(rows, f, ++seed), DType::kBF16);
        const Tensor wd = on_gpu(random_host(f, 96, ++seed), DType::kBF16);       // down [f, 96]
        const Tensor wu = on_gpu(random_host(64, 2 * f, ++seed), DType::kBF16);   // gate_up
        const Tensor other = on_gpu(random_host(rows, f, ++seed), DType::kBF16);  // another a
        // Plain: the GLU, then the products quantize their own a.
        Tensor a0 = gpu_->empty({rows, f}, DType::kBF16),
               dh0 = gpu_->empty({rows, 2 * f}, DType::kBF16);
        Tensor y0 = gpu_->empty({rows, 96}, DType::kBF16),
               dx0 = gpu_->empty({rows, 64}, DType::kBF16);
        gpu_->glu_fwd(h, p, a0);
        gpu_->gemm_fp8(a0, false, wd, false, y0, 0.0, Tensor(), Tensor(), spec);
        gpu_->glu_bwd(h, da, p, dh0);
        gpu_->gemm_fp8(dh0, false, wu, true, dx0, 0.0, Tensor(), Tensor(), spec);
        // Handed on: the next product takes the codes.
        Tensor a1 = gpu_->empty({rows, f}, DType::kBF16),
               dh1 = gpu_->empty({rows, 2 * f}, DType::kBF16);
        Tensor y1 = gpu_->empty({rows, 96}, DType::kBF16),
               dx1 = gpu_->empty({rows, 64}, DType::kBF16);
        const int64_t uses0 = cuda_fp8_handed_uses(*gpu_);
        gpu_->glu_fwd_fp8(h, p, a1, spec);
        gpu_->gemm_fp8(a1, false, wd, false, y1, 0.0, Tensor(), Tensor(), spec);
        gpu_->glu_bwd_fp8(h, da, p, dh1, spec);
        gpu_->gemm_fp8(dh1, false, wu, true, dx1, 0.0, Tensor(), Tensor(), spec);
        EXPECT_EQ(cuda_fp8_handed_uses(*gpu_) - uses0, fused ? 2 : 0) << what;
        EXPECT_EQ(values(a1), values(a0)) << "glu output " << what;
        EXPECT_EQ(values(dh1), values(dh0)) << "glu gradient " << what;
        EXPECT_EQ(values(y1), values(y0)) << "product after the glu " << what;
        EXPECT_EQ(values(dx1), values(dx0)) << "product after the glu gradient " << what;
        // Another product in between drops what was handed on.
        Tensor y2 = gpu_->empty({rows, 96}, DType::kBF16),
               z = gpu_->empty({rows, 96}, DType::kBF16);
        const int64_t uses1 = cuda_fp8_handed_uses(*gpu_);
        gpu_->glu_fwd_fp8(h, p, a1, spec);
        gpu_->gemm_fp8(other, false, wd, false, z, 0.0, Tensor(), Tensor(), spec);
        gpu_->gemm_fp8(a1, false, wd, false, y2, 0.0, Tensor(), Tensor(), spec);
        EXPECT_EQ(cuda_fp8_handed_uses(*gpu_), uses1) << what;
        EXPECT_EQ(values(y2), values(y0)) << "product after a dropped hand-on " << what;
      }
}

// Backend::cross_entropy_fp8 hands the gradient it writes on to the next FP8 product (the
// unembedding's input gradient, lm_head's form dlogits W^T and the tied embedding's dlogits E):
// the loss, the gradient and the product are bitwise cross_entropy's followed by the product
// quantizing dlogits itself. Rows with an ignored target (-1) and rows padded to 4 (37 rows) are
// covered; a vocabulary that is not a multiple of 128 (200) is not fused and hands nothing on.
TEST_F(CudaFp8, CrossEntropyHandsItsQuantizedGradientToTheNextProductBitwise) {
  Recipe recipe;
  if (!device_recipe(&recipe)) GTEST_SKIP() << "no block-scaled FP8 GEMMs on this device";
  Backend::Fp8Gemm spec;
  spec.recipe = recipe;
  uint64_t seed = 9500;
  for (const int64_t rows : {256, 37})
    for (const int64_t v : {384, 1152, 200}) {
      const std::string what = std::to_string(rows) + "x" + std::to_string(v);
      const bool fused = recipe == Recipe::kBlock128 && v % 128 == 0;
      const Tensor logits = on_gpu(random_host(rows, v, ++seed), DType::kBF16);
      std::vector<int32_t> t(static_cast<size_t>(rows));
      Philox rng(++seed, "fp8-ce-targets");
      for (int64_t r = 0; r < rows; ++r)
        t[static_cast<size_t>(r)] =
            r % 11 == 5 ? -1 : static_cast<int32_t>(rng.below(static_cast<uint64_t>(r), v));
      const Tensor targets = gpu_->upload(Tensor::host_from(t, DType::kI32));
      const Tensor w = on_gpu(random_host(96, v, ++seed), DType::kBF16);  // lm_head [d, v]
      const Tensor e = on_gpu(random_host(v, 96, ++seed), DType::kBF16);  // embedding [v, d]
      const double scale = 1.0 / static_cast<double>(rows);
      for (const bool tied : {false, true}) {
        const std::string form = what + (tied ? " tied" : " lm_head");
        const Tensor& head = tied ? e : w;
        auto run = [&](bool hand_on, Tensor& dl, Tensor& loss, Tensor& dx) {
          dl = gpu_->empty({rows, v}, DType::kBF16);
          gpu_->copy(logits, dl);
          loss = gpu_->zeros({1}, DType::kF32);
          dx = gpu_->empty({rows, 96}, DType::kBF16);
          if (hand_on)
            gpu_->cross_entropy_fp8(dl, targets, scale, loss, spec);
          else
            gpu_->cross_entropy(dl, targets, scale, loss);
          gpu_->gemm_fp8(dl, false, head, !tied, dx, 0.0, Tensor(), Tensor(), spec);
        };
        Tensor dl0, loss0, dx0, dl1, loss1, dx1;
        run(false, dl0, loss0, dx0);
        const int64_t uses0 = cuda_fp8_handed_uses(*gpu_);
        run(true, dl1, loss1, dx1);
        EXPECT_EQ(cuda_fp8_handed_uses(*gpu_) - uses0, fused ? 1 : 0) << form;
        EXPECT_EQ(values(loss1), values(loss0)) << "loss " << form;
        EXPECT_EQ(values(dl1), values(dl0)) << "gradient " << form;
        EXPECT_EQ(values(dx1), values(dx0)) << "input gradient " << form;
        // Another product in between drops what was handed on.
        Tensor dl2 = gpu_->empty({rows, v}, DType::kBF16), loss2 = gpu_->zeros({1}, DType::kF32);
        Tensor z = gpu_->empty({rows, 96}, DType::kBF16),
               dx2 = gpu_->empty({rows, 96}, DType::kBF16);
        gpu_->copy(logits, dl2);
        const int64_t uses1 = cuda_fp8_handed_uses(*gpu_);
        gpu_->cross_entropy_fp8(dl2, targets, scale, loss2, spec);
        gpu_->gemm_fp8(logits, false, head, !tied, z, 0.0, Tensor(), Tensor(), spec);
        gpu_->gemm_fp8(dl2, false, head, !tied, dx2, 0.0, Tensor(), Tensor(), spec);
        EXPECT_EQ(cuda_fp8_handed_uses(*gpu_), uses1) << form;
        EXPECT_EQ(values(dx2), values(dx0)) << "product after a dropped hand-on " << form;
      }
    }
}

TEST_F(CudaFp8, RefusesTheOtherRecipe) {
  Recipe recipe;
  if (!device_recipe(&recipe)) GTEST_SKIP() << "no block-scaled FP8 GEMMs on this device";
  Backend::Fp8Gemm spec;
  spec.recipe = recipe == Recipe::kBlock128 ? Recipe::kMx32 : Recipe::kBlock128;
  Tensor a = on_gpu(random_host(64, 128, 1), DType::kBF16);
  Tensor b = on_gpu(random_host(128, 64, 2), DType::kBF16);
  Tensor c = gpu_->empty({64, 64}, DType::kBF16);
  try {
    gpu_->gemm_fp8(a, false, b, false, c, 0.0, Tensor(), Tensor(), spec);
    ADD_FAILURE() << "the other recipe ran";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(fp8::recipe_name(spec.recipe)), std::string::npos) << msg;
    EXPECT_NE(msg.find(fp8::recipe_name(recipe)), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace hp
