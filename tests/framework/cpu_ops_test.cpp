// Every op of the CPU reference backend: forward values against direct formulas, gradients
// against central differences on the f64 backend (random inputs, odd sizes), integer routing ops
// against their stated semantics, sync counting, argument checks, f32-vs-f64 agreement and
// bitwise determinism of attention.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/core/rng.h"
#include "framework/model/rope_table.h"
#include "tests/framework/grad_check.h"

namespace hp {
namespace {

using grad_check::check;
using grad_check::passes;
using grad_check::weighted_sum;

constexpr uint64_t kSeed = 20240917;
constexpr double kPi = 3.14159265358979323846;

// ---- helpers ----------------------------------------------------------------------------------

void set_values(Tensor& t, const std::vector<double>& v) {
  HP_CHECK(static_cast<int64_t>(v.size()) == t.numel(), "set_values size");
  for (int64_t i = 0; i < t.numel(); ++i) {
    switch (t.dtype()) {
      case DType::kF32:
        t.data<float>()[i] = static_cast<float>(v[i]);
        break;
      case DType::kF64:
        t.data<double>()[i] = v[i];
        break;
      default:
        HP_CHECK(false, "set_values on ", t.desc());
    }
  }
}

std::vector<double> normals(int64_t n, const std::string& purpose, double scale = 1.0) {
  Philox rng(kSeed, purpose);
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = scale * rng.normal(static_cast<uint64_t>(i));
  return v;
}

std::vector<double> uniforms(int64_t n, const std::string& purpose, double lo, double hi) {
  Philox rng(kSeed, purpose);
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = lo + (hi - lo) * rng.uniform(static_cast<uint64_t>(i));
  return v;
}

// A master-dtype tensor of N(0, scale^2) values.
Tensor randn(Backend& be, const Shape& shape, const std::string& purpose, double scale = 1.0) {
  Tensor t = be.zeros(shape, be.master_dtype());
  set_values(t, normals(t.numel(), purpose, scale));
  return t;
}

Tensor from_values(Backend& be, const Shape& shape, const std::vector<double>& v) {
  Tensor t = be.zeros(shape, be.master_dtype());
  set_values(t, v);
  return t;
}

Tensor ints(const std::vector<int32_t>& v) { return Tensor::host_from(v, DType::kI32); }

std::vector<double> vals(const Tensor& t) { return to_double_vector(t); }

std::vector<int32_t> ivals(const Tensor& t) {
  return std::vector<int32_t>(t.data<int32_t>(), t.data<int32_t>() + t.numel());
}

Tensor clone(Backend& be, const Tensor& t) {
  Tensor c = be.empty(t.shape(), t.dtype());
  be.copy(t, c);
  return c;
}

// ||a - b|| / max(||a||, ||b||)
double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0, na = 0, nb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d += (a[i] - b[i]) * (a[i] - b[i]);
    na += a[i] * a[i];
    nb += b[i] * b[i];
  }
  const double m = std::sqrt(std::max(na, nb));
  return m > 0 ? std::sqrt(d) / m : 0.0;
}

// A batch holding consecutive documents of the given lengths (one row).
PackedBatch make_batch(const std::vector<int>& lens) {
  PackedBatch b;
  b.cu_seqlens.push_back(0);
  for (int len : lens) {
    for (int i = 0; i < len; ++i) {
      b.inputs.push_back(static_cast<int32_t>(b.inputs.size() % 7));
      b.targets.push_back(i + 1 < len ? 1 : -1);
      b.positions.push_back(i);
    }
    b.cu_seqlens.push_back(static_cast<int32_t>(b.inputs.size()));
    b.max_seqlen = std::max(b.max_seqlen, len);
  }
  b.rows = 1;
  b.seq_len = static_cast<int64_t>(b.inputs.size());
  b.num_valid_targets =
      std::count_if(b.targets.begin(), b.targets.end(), [](int32_t t) { return t >= 0; });
  return b;
}

template <typename Fn>
void expect_throw_naming(Fn&& fn, const std::string& op, const std::string& fragment) {
  try {
    fn();
    ADD_FAILURE() << op << ": expected an error mentioning '" << fragment << "'";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(op), std::string::npos) << what;
    EXPECT_NE(what.find(fragment), std::string::npos) << what;
  }
}

// ---- memory -----------------------------------------------------------------------------------

TEST(CpuOpsMemory, FillAndCopyEveryDtype) {
  auto be = make_cpu_backend(DType::kF32);
  EXPECT_EQ(be->act_dtype(), DType::kF32);
  EXPECT_EQ(be->master_dtype(), DType::kF32);
  EXPECT_EQ(be->device(), Device::kCPU);
  for (DType dt : {DType::kF32, DType::kF64, DType::kBF16, DType::kI32, DType::kI64}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor a = be->empty({3, 5}, dt);
    be->fill(a, -3.0);
    for (double v : vals(a)) EXPECT_EQ(v, -3.0);
    Tensor b = be->zeros({15}, dt);
    be->copy(a, b);
    EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0);
  }
  Tensor i = be->empty({2}, DType::kI32);
  EXPECT_THROW(be->fill(i, 0.5), Error);
  Tensor f = be->empty({4}, DType::kF32);
  Tensor d = be->empty({4}, DType::kF64);
  expect_throw_naming([&] { be->copy(f, d); }, "copy", "f64[4]");
}

TEST(CpuOpsMemory, ConvertRoundsToNearestEven) {
  auto be = make_cpu_backend(DType::kF64);
  // 1 + 2^-8 + 2^-30 lies just above the midpoint of two bf16 neighbours: a direct rounding goes
  // up, a double rounding through f32 (which drops 2^-30) would land on the tie and go to 1.
  const std::vector<double> src = {
      1.0 + 0x1p-8 + 0x1p-30, 1.0 + 0x1p-8, 1.0 + 3 * 0x1p-8, -2.5, 1e-3, 3.0e38, -0.0};
  const std::vector<double> bf16_want = {
      1.0 + 0x1p-7, 1.0, 1.0 + 4 * 0x1p-8, -2.5, 0.00099945068359375, 3.00405527047391e+38, 0.0};
  Tensor s = from_values(*be, {7}, src);
  Tensor b = be->empty({7}, DType::kBF16);
  be->convert(s, b);
  const std::vector<double> got = vals(b);
  for (size_t i = 0; i < src.size(); ++i) EXPECT_EQ(got[i], bf16_want[i]) << "element " << i;

  // f64 -> f32 -> f64 and bf16 -> f32 are the exact ones.
  Tensor f = be->empty({7}, DType::kF32);
  be->convert(s, f);
  for (size_t i = 0; i < src.size(); ++i) {
    EXPECT_EQ(vals(f)[i], static_cast<double>(static_cast<float>(src[i])));
  }
  Tensor f2 = be->empty({7}, DType::kF32);
  be->convert(b, f2);
  EXPECT_EQ(vals(f2), got);
  Tensor i32 = be->empty({7}, DType::kI32);
  EXPECT_THROW(be->convert(s, i32), Error);
}

TEST(CpuOpsMemory, AddAndAxpy) {
  for (DType dt : {DType::kF32, DType::kF64}) {
    auto be = make_cpu_backend(DType::kF32);  // add/axpy follow the tensors' dtype
    Tensor a = be->zeros({37}, dt), b = be->zeros({37}, dt), out = be->zeros({37}, dt);
    const auto av = normals(37, "add.a"), bv = normals(37, "add.b");
    set_values(a, av);
    set_values(b, bv);
    be->add(a, b, out);
    be->add(a, b, a);  // out may alias an input
    be->axpy(-0.25, b, b);
    for (int i = 0; i < 37; ++i) {
      EXPECT_NEAR(vals(out)[i], av[i] + bv[i], 1e-6);
      EXPECT_EQ(vals(a)[i], vals(out)[i]);
      EXPECT_NEAR(vals(b)[i], 0.75 * bv[i], 1e-6);
    }
  }
}

TEST(CpuOpsMemory, SyncCounting) {
  auto be = make_cpu_backend(DType::kF32);
  Tensor t = randn(*be, {4}, "sync");
  Tensor h = Tensor::host({4}, DType::kF32);
  be->read_to_host(t, h, SyncCause::kLoss);
  be->read_to_host(t, h, SyncCause::kRouting);
  be->synchronize(SyncCause::kOther);
  EXPECT_EQ(vals(h), vals(t));
  EXPECT_EQ(be->syncs().get(SyncCause::kLoss), 1);
  EXPECT_EQ(be->syncs().get(SyncCause::kRouting), 1);
  EXPECT_EQ(be->syncs().get(SyncCause::kOther), 1);
  EXPECT_EQ(be->syncs().total(), 3);
  Tensor up = be->upload(h);
  EXPECT_EQ(vals(up), vals(t));
  EXPECT_EQ(be->syncs().total(), 3);
}

// ---- metadata ---------------------------------------------------------------------------------

TEST(CpuOpsMeta, UploadBatchCountsNoSync) {
  auto be = make_cpu_backend(DType::kF32);
  const PackedBatch batch = make_batch({4, 1, 6});
  BatchMeta meta = be->upload_batch(batch);
  EXPECT_EQ(meta.n_seqs, 3);
  EXPECT_EQ(meta.max_seqlen, 6);
  EXPECT_EQ(ivals(meta.inputs), batch.inputs);
  EXPECT_EQ(ivals(meta.targets), batch.targets);
  EXPECT_EQ(ivals(meta.positions), batch.positions);
  EXPECT_EQ(ivals(meta.cu_seqlens), batch.cu_seqlens);
  EXPECT_EQ(be->syncs().total(), 0);
}

TEST(CpuOpsMeta, RebuildMetadataFromPositionsCountsOneSync) {
  auto be = make_cpu_backend(DType::kF32);
  const PackedBatch batch = make_batch({3, 1, 1, 7, 2});
  BatchMeta meta = be->upload_batch(batch);
  meta.cu_seqlens = ints({0, 14});  // stale
  meta.n_seqs = 1;
  meta.max_seqlen = 0;
  be->rebuild_metadata(meta);
  EXPECT_EQ(ivals(meta.cu_seqlens), batch.cu_seqlens);
  EXPECT_EQ(meta.n_seqs, 5);
  EXPECT_EQ(meta.max_seqlen, 7);
  EXPECT_EQ(be->syncs().get(SyncCause::kMetadata), 1);
  EXPECT_EQ(be->syncs().total(), 1);
}

// ---- dense ------------------------------------------------------------------------------------

TEST(CpuOpsDense, GemmMatchesNaiveForEveryTranspose) {
  for (DType dt : {DType::kF32, DType::kF64}) {
    auto be = make_cpu_backend(dt);
    const int64_t m = 5, k = 7, n = 3;
    for (int ta = 0; ta < 2; ++ta) {
      for (int tb = 0; tb < 2; ++tb) {
        SCOPED_TRACE(str_cat(dtype_name(dt), " trans_a=", ta, " trans_b=", tb));
        Tensor a = randn(*be, ta ? Shape{k, m} : Shape{m, k}, "gemm.a");
        Tensor b = randn(*be, tb ? Shape{n, k} : Shape{k, n}, "gemm.b");
        Tensor c = randn(*be, {m, n}, "gemm.c");
        const auto av = vals(a), bv = vals(b), c0 = vals(c);
        be->gemm(a, ta, b, tb, c, 0.7, 0.3);
        const auto cv = vals(c);
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            double s = 0;
            for (int64_t l = 0; l < k; ++l) {
              s += (ta ? av[l * m + i] : av[i * k + l]) * (tb ? bv[j * k + l] : bv[l * n + j]);
            }
            EXPECT_NEAR(cv[i * n + j], 0.7 * s + 0.3 * c0[i * n + j], 1e-5);
          }
        }
      }
    }
    Tensor a = randn(*be, {5, 7}, "gemm.a"), b = randn(*be, {6, 3}, "gemm.b");
    Tensor c = be->zeros({5, 3}, dt);
    expect_throw_naming([&] { be->gemm(a, false, b, false, c, 1, 0); }, "gemm",
                        str_cat(dtype_name(dt), "[6, 3]"));
  }
}

// C = A B^T + bias, L = <C, R>: dA = R B, dB = R^T A, dbias = column sums of R.
TEST(CpuOpsDense, GemmAndBiasGradients) {
  auto be = make_cpu_backend(DType::kF64);
  const int64_t m = 7, k = 5, n = 3;
  Tensor a = randn(*be, {m, k}, "gb.a"), b = randn(*be, {n, k}, "gb.b");
  Tensor bias = randn(*be, {n}, "gb.bias"), r = randn(*be, {m, n}, "gb.r");
  Tensor c = be->zeros({m, n}, DType::kF64);
  auto loss = [&] {
    be->gemm(a, false, b, true, c, 1.0, 0.0);
    be->add_bias(c, bias);
    return weighted_sum(c, r);
  };
  Tensor da = be->zeros({m, k}, DType::kF64), db = be->zeros({n, k}, DType::kF64);
  Tensor dbias = randn(*be, {n}, "gb.dbias0");  // bias_grad accumulates
  const auto dbias0 = vals(dbias);
  be->gemm(r, false, b, false, da, 1.0, 0.0);
  be->gemm(r, true, a, false, db, 1.0, 0.0);
  be->bias_grad(r, dbias);
  auto d = vals(dbias);
  for (int64_t j = 0; j < n; ++j) d[j] -= dbias0[j];
  Tensor dbias_only = from_values(*be, {n}, d);
  EXPECT_TRUE(passes(check(a, da, loss), "dA"));
  EXPECT_TRUE(passes(check(b, db, loss), "dB"));
  EXPECT_TRUE(passes(check(bias, dbias_only, loss), "dbias"));
}

// c = a b (+ bias) + r against the naive sum; r stays as it was; r aliasing c is refused.
TEST(CpuOpsDense, GemmAddOntoResidual) {
  auto be = make_cpu_backend(DType::kF64);
  const int64_t m = 6, k = 5, n = 4;
  Tensor a = randn(*be, {m, k}, "ga.a"), b = randn(*be, {k, n}, "ga.b");
  Tensor bias = randn(*be, {n}, "ga.bias"), r = randn(*be, {m, n}, "ga.r");
  const auto av = vals(a), bv = vals(b), biasv = vals(bias), r0 = vals(r);
  for (const bool with_bias : {false, true}) {
    SCOPED_TRACE(with_bias ? "bias" : "no bias");
    Tensor c = randn(*be, {m, n}, "ga.c");
    be->gemm_add(a, false, b, false, r, c, with_bias ? bias : Tensor());
    const auto cv = vals(c);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double s = r0[i * n + j] + (with_bias ? biasv[j] : 0.0);
        for (int64_t l = 0; l < k; ++l) s += av[i * k + l] * bv[l * n + j];
        EXPECT_NEAR(cv[i * n + j], s, 1e-12);
      }
    }
    EXPECT_EQ(vals(r), r0);
  }
  expect_throw_naming([&] { be->gemm_add(a, false, b, false, r, r, Tensor()); }, "gemm_add",
                      "alias");
}

TEST(CpuOpsDense, BiasGradOverManyChunks) {
  auto be = make_cpu_backend(DType::kF64);
  const int64_t m = 1001, n = 3;
  Tensor dy = randn(*be, {m, n}, "bg.dy");
  Tensor db = be->zeros({n}, DType::kF64);
  be->bias_grad(dy, db);
  const auto v = vals(dy);
  for (int64_t j = 0; j < n; ++j) {
    double s = 0;
    for (int64_t i = 0; i < m; ++i) s += v[i * n + j];
    EXPECT_NEAR(vals(db)[j], s, 1e-10);
  }
}

// Row segments of one dy, each adding its rows to its own gradient; two segments add to one.
TEST(CpuOpsDense, BiasGradSegmentsAddEachSegmentsRows) {
  auto be = make_cpu_backend(DType::kF64);
  const int64_t m = 9, n = 3;
  Tensor dy = randn(*be, {m, n}, "bgs.dy");
  Tensor g = randn(*be, {2, n}, "bgs.g");
  const auto g0 = vals(g);
  // rows [0, 2) and [5, 9) into row 0 of g, [2, 2) (empty) and [2, 5) into row 1.
  be->bias_grad_segments(dy, {{0, 2, g.slice(0, 1).reshape({n})},
                              {2, 0, g.slice(1, 2).reshape({n})},
                              {2, 3, g.slice(1, 2).reshape({n})},
                              {5, 4, g.slice(0, 1).reshape({n})}});
  const auto v = vals(dy), got = vals(g);
  for (int64_t j = 0; j < n; ++j) {
    double s0 = g0[j], s1 = g0[n + j];
    for (int64_t i = 0; i < m; ++i) (i >= 2 && i < 5 ? s1 : s0) += v[i * n + j];
    EXPECT_NEAR(got[j], s0, 1e-12);
    EXPECT_NEAR(got[n + j], s1, 1e-12);
  }
}

// ---- normalization ----------------------------------------------------------------------------

TEST(CpuOpsNorm, RmsnormForwardAndGradients) {
  auto be = make_cpu_backend(DType::kF64);
  const int64_t m = 5, d = 7;
  const double eps = 1e-5;
  Tensor x = randn(*be, {m, d}, "rms.x"), w = randn(*be, {d}, "rms.w");
  Tensor y = be->zeros({m, d}, DType::kF64), rstd = be->zeros({m}, DType::kF64);
  Tensor r = randn(*be, {m, d}, "rms.r");
  be->rmsnorm_fwd(x, w, eps, y, rstd);
  const auto xv = vals(x), wv = vals(w), yv = vals(y);
  for (int64_t i = 0; i < m; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += xv[i * d + j] * xv[i * d + j];
    const double rs = 1.0 / std::sqrt(ss / d + eps);
    EXPECT_NEAR(vals(rstd)[i], rs, 1e-12);
    for (int64_t j = 0; j < d; ++j) EXPECT_NEAR(yv[i * d + j], xv[i * d + j] * rs * wv[j], 1e-12);
  }
  auto loss = [&] {
    be->rmsnorm_fwd(x, w, eps, y, rstd);
    return weighted_sum(y, r);
  };
  loss();
  Tensor dx = be->zeros({m, d}, DType::kF64), dw = be->zeros({d}, DType::kF64);
  be->rmsnorm_bwd(x, w, rstd, r, dx, dw, false);
  EXPECT_TRUE(passes(check(x, dx, loss), "dx"));
  EXPECT_TRUE(passes(check(w, dw, loss), "dw"));
  // accumulate_dx adds the same gradient to what dx holds (a residual's gradient); dw adds too.
  Tensor acc = randn(*be, {m, d}, "rms.acc"), dw2 = be->zeros({d}, DType::kF64);
  const auto before = vals(acc);
  be->rmsnorm_bwd(x, w, rstd, r, acc, dw2, true);
  const auto dxv = vals(dx), accv = vals(acc), dwv = vals(dw), dw2v = vals(dw2);
  for (size_t i = 0; i < accv.size(); ++i) EXPECT_NEAR(accv[i], before[i] + dxv[i], 1e-12) << i;
  for (size_t j = 0; j < dwv.size(); ++j) EXPECT_NEAR(dw2v[j], dwv[j], 1e-12) << j;
}

TEST(CpuOpsNorm, QkNormForwardAndGradients) {
  auto be = make_cpu_backend(DType::kF64);
  const int64_t n = 5, hq = 3, hkv = 1, d = 6, h = hq + 2 * hkv;
  const double eps = 1e-6;
  Tensor qkv = randn(*be, {n, h, d}, "qkn.x");
  Tensor qw = randn(*be, {d}, "qkn.qw"), kw = randn(*be, {d}, "qkn.kw");
  Tensor out = be->zeros({n, h, d}, DType::kF64), rstd = be->zeros({n, hq + hkv}, DType::kF64);
  Tensor r = randn(*be, {n, h, d}, "qkn.r");
  auto loss = [&] {
    be->qk_norm_fwd(qkv, qw, kw, hq, hkv, eps, out, rstd);
    return weighted_sum(out, r);
  };
  loss();
  const auto xv = vals(qkv), ov = vals(out), qwv = vals(qw), kwv = vals(kw);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t hh = 0; hh < h; ++hh) {
      const double* x = xv.data() + (t * h + hh) * d;
      double ss = 0;
      for (int64_t j = 0; j < d; ++j) ss += x[j] * x[j];
      const double rs = hh < hq + hkv ? 1.0 / std::sqrt(ss / d + eps) : 1.0;
      for (int64_t j = 0; j < d; ++j) {
        const double w = hh < hq ? qwv[j] : (hh < hq + hkv ? kwv[j] : 1.0);
        EXPECT_NEAR(ov[(t * h + hh) * d + j], x[j] * rs * w, 1e-12);
      }
    }
  }
  Tensor din = be->zeros({n, h, d}, DType::kF64);
  Tensor dqw = be->zeros({d}, DType::kF64), dkw = be->zeros({d}, DType::kF64);
  be->qk_norm_bwd(qkv, qw, kw, hq, hkv, rstd, r, din, dqw, dkw);
  EXPECT_TRUE(passes(check(qkv, din, loss), "dqkv"));
  EXPECT_TRUE(passes(check(qw, dqw, loss), "dqw"));
  EXPECT_TRUE(passes(check(kw, dkw, loss), "dkw"));
}

// ---- rope -------------------------------------------------------------------------------------

YarnParams gpt_oss_yarn() {
  YarnParams y;
  y.factor = 32;
  y.original_max_positions = 4096;
  y.beta_fast = 32;
  y.beta_slow = 1;
  return y;
}

TEST(CpuOpsRope, TableWithoutYarn) {
  auto be = make_cpu_backend(DType::kF64);
  const int d = 10;
  const double theta = 10000;
  RopeTable t = make_rope_table(*be, d, 17, theta, YarnParams{});
  ASSERT_EQ(t.cos.shape(), (Shape{17, 5}));
  ASSERT_EQ(t.sin.shape(), (Shape{17, 5}));
  EXPECT_EQ(t.cos.dtype(), DType::kF64);
  for (int p = 0; p < 17; ++p) {
    for (int i = 0; i < d / 2; ++i) {
      const double a = p * std::pow(theta, -2.0 * i / d);
      EXPECT_NEAR(vals(t.cos)[p * 5 + i], std::cos(a), 1e-12);
      EXPECT_NEAR(vals(t.sin)[p * 5 + i], std::sin(a), 1e-12);
    }
  }
  auto be32 = make_cpu_backend(DType::kF32);
  EXPECT_EQ(make_rope_table(*be32, d, 3, theta).cos.dtype(), DType::kF32);
}

// GPT-OSS's settings: the ramp runs between pair indices lo ~ 8.09 and hi ~ 17.4 of 32.
TEST(CpuOpsRope, TableWithYarn) {
  auto be = make_cpu_backend(DType::kF64);
  const int d = 64;
  const double theta = 150000;
  const YarnParams yarn = gpt_oss_yarn();
  const double half = d / 2.0;
  const double lo = half * std::log(4096 / (32 * 2 * kPi)) / std::log(theta);
  const double hi = half * std::log(4096 / (1 * 2 * kPi)) / std::log(theta);
  EXPECT_NEAR(lo, 8.09, 0.01);
  EXPECT_NEAR(hi, 17.40, 0.01);
  const std::vector<double> inv = rope_inv_freq(d, theta, yarn);
  const double mscale = rope_attention_factor(yarn);
  EXPECT_NEAR(mscale, 0.1 * std::log(32.0) + 1.0, 1e-15);
  EXPECT_EQ(rope_attention_factor(YarnParams{}), 1.0);
  for (int i = 0; i < d / 2; ++i) {
    const double base = std::pow(theta, -2.0 * i / d);
    const double ramp = std::min(1.0, std::max(0.0, (i - lo) / (hi - lo)));
    const double want = (1 - ramp) * base + ramp * base / 32;  // extrapolate .. interpolate
    EXPECT_NEAR(inv[i], want, 1e-15 * base) << "pair " << i;
    if (i <= 8) {
      EXPECT_EQ(inv[i], base);
    }
    if (i >= 18) {
      EXPECT_NEAR(inv[i], base / 32, 1e-15 * base);
    }
  }
  RopeTable t = make_rope_table(*be, d, 9, theta, yarn);
  for (int p = 0; p < 9; ++p) {
    for (int i = 0; i < d / 2; ++i) {
      EXPECT_NEAR(vals(t.cos)[p * 32 + i], mscale * std::cos(p * inv[i]), 1e-12);
      EXPECT_NEAR(vals(t.sin)[p * 32 + i], mscale * std::sin(p * inv[i]), 1e-12);
    }
  }
}

TEST(CpuOpsRope, RotatesHalfSplitPairs) {
  auto be = make_cpu_backend(DType::kF64);
  const int64_t n = 4, h = 3, d = 6;
  RopeTable table = make_rope_table(*be, d, 11, 100.0);
  Tensor x = randn(*be, {n, h, d}, "rope.x");
  Tensor pos = ints({3, 0, 10, 7});
  const auto x0 = vals(x), cs = vals(table.cos), sn = vals(table.sin);
  be->rope(x, 2, pos, table, false);
  const auto x1 = vals(x);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t p = pos.data<int32_t>()[t];
    for (int64_t hh = 0; hh < h; ++hh) {
      for (int64_t i = 0; i < d / 2; ++i) {
        const int64_t a = (t * h + hh) * d + i, b = a + d / 2;
        const double c = cs[p * 3 + i], s = sn[p * 3 + i];
        if (hh < 2) {
          EXPECT_NEAR(x1[a], x0[a] * c - x0[b] * s, 1e-14);
          EXPECT_NEAR(x1[b], x0[b] * c + x0[a] * s, 1e-14);
        } else {  // heads past n_rot_heads are left alone
          EXPECT_EQ(x1[a], x0[a]);
          EXPECT_EQ(x1[b], x0[b]);
        }
      }
    }
  }
  Tensor bad = ints({3, 0, 11, 7});
  expect_throw_naming([&] { be->rope(x, 2, bad, table, false); }, "rope", "positions[2]");
}

TEST(CpuOpsRope, InverseIsTransposeAndUndoesForward) {
  auto be = make_cpu_backend(DType::kF64);
  const int64_t n = 7, h = 5, d = 8;
  for (bool with_yarn : {false, true}) {
    SCOPED_TRACE(with_yarn ? "yarn" : "plain");
    YarnParams yarn;
    if (with_yarn) {
      yarn.factor = 4;
      yarn.original_max_positions = 16;
    }
    RopeTable table = make_rope_table(*be, d, 64, 500.0, yarn);
    Tensor pos = ints({0, 5, 63, 1, 17, 0, 40});
    Tensor x = randn(*be, {n, h, d}, "rope.tx"), y = randn(*be, {n, h, d}, "rope.ty");
    Tensor rx = clone(*be, x), rty = clone(*be, y);
    be->rope(rx, 3, pos, table, false);
    be->rope(rty, 3, pos, table, true);
    // <R x, y> == <x, R^T y>
    EXPECT_NEAR(weighted_sum(rx, y), weighted_sum(x, rty), 1e-12);
    // R^T R = mscale^2 I (the attention factor is folded into both cos and sin).
    const double m2 = std::pow(rope_attention_factor(yarn), 2);
    be->rope(rx, 3, pos, table, true);
    const auto xv = vals(x), back = vals(rx);
    for (int64_t i = 0; i < x.numel(); ++i) {
      const bool rotated = (i / d) % h < 3;
      EXPECT_NEAR(back[i], rotated ? m2 * xv[i] : xv[i], 1e-13) << "element " << i;
    }
  }
}

// ---- attention --------------------------------------------------------------------------------

struct AttnConfig {
  std::string name;
  std::vector<int> seqs;
  int hq, hkv, d, window;
  bool sinks;
  double scale = 0;  // 0: 1/sqrt(d)
};

AttentionShape attn_shape(const AttnConfig& c) {
  AttentionShape s;
  s.n_heads = c.hq;
  s.n_kv_heads = c.hkv;
  s.head_dim = c.d;
  s.window = c.window;
  s.scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(static_cast<double>(c.d));
  return s;
}

// Direct double-precision attention: for each token, the softmax over its visible keys and the
// sink, computed from scratch.
void reference_attention(const AttnConfig& c, const std::vector<double>& qkv,
                         const std::vector<double>& sinks, std::vector<double>& out,
                         std::vector<double>& lse) {
  const AttentionShape s = attn_shape(c);
  const int h_all = c.hq + 2 * c.hkv;
  int64_t n = 0;
  for (int len : c.seqs) n += len;
  out.assign(static_cast<size_t>(n * c.hq * c.d), 0.0);
  lse.assign(static_cast<size_t>(n * c.hq), 0.0);
  auto at = [&](int64_t t, int head, int j) { return qkv[(t * h_all + head) * c.d + j]; };
  int64_t begin = 0;
  for (int len : c.seqs) {
    for (int64_t i = begin; i < begin + len; ++i) {
      for (int h = 0; h < c.hq; ++h) {
        const int g = h / (c.hq / c.hkv);
        std::vector<double> z;
        std::vector<int64_t> keys;
        for (int64_t j = begin; j <= i; ++j) {
          if (c.window > 0 && j <= i - c.window) continue;
          double dot = 0;
          for (int e = 0; e < c.d; ++e) dot += at(i, h, e) * at(j, c.hq + g, e);
          z.push_back(s.scale * dot);
          keys.push_back(j);
        }
        double denom = c.sinks ? std::exp(sinks[h]) : 0.0;
        for (double v : z) denom += std::exp(v);
        lse[i * c.hq + h] = std::log(denom);
        for (size_t q = 0; q < z.size(); ++q) {
          const double p = std::exp(z[q]) / denom;
          for (int e = 0; e < c.d; ++e) {
            out[(i * c.hq + h) * c.d + e] += p * at(keys[q], c.hq + c.hkv + g, e);
          }
        }
      }
    }
    begin += len;
  }
}

std::vector<AttnConfig> attention_configs() {
  return {
      {"full causal, GQA 4:2", {5, 1, 9, 3, 1}, 4, 2, 5, 0, false},
      {"window 3, sinks, GQA 4:2", {5, 1, 9, 3}, 4, 2, 5, 3, true},
      {"full causal, sinks, GQA 4:1", {7, 1, 4}, 4, 1, 3, 0, true, 0.8},
      {"window 2, MHA", {6, 2, 8}, 4, 4, 4, 2, false},
      {"single tokens, sinks", {1, 1, 1}, 2, 1, 3, 0, true},
      {"window 4, sinks, GQA 4:1", {11, 3, 6}, 4, 1, 4, 4, true},
      {"window wider than sequences", {3, 5, 2}, 2, 2, 3, 8, true},
  };
}

struct AttnCase {
  PackedBatch batch;
  BatchMeta meta;
  AttentionShape shape;
  int64_t n = 0;
  Tensor qkv, sinks, out, lse;
};

AttnCase make_attn_case(Backend& be, const AttnConfig& c, const std::string& tag) {
  AttnCase a;
  a.batch = make_batch(c.seqs);
  a.n = static_cast<int64_t>(a.batch.inputs.size());
  a.shape = attn_shape(c);
  a.qkv = randn(be, {a.n, c.hq + 2 * c.hkv, c.d}, tag + ".qkv");
  if (c.sinks) a.sinks = randn(be, {c.hq}, tag + ".sinks");
  a.out = be.zeros({a.n, c.hq, c.d}, be.master_dtype());
  a.lse = be.zeros({a.n, c.hq}, be.master_dtype());
  return a;
}

TEST(CpuOpsAttention, ForwardMatchesReference) {
  auto be = make_cpu_backend(DType::kF64);
  for (const AttnConfig& c : attention_configs()) {
    SCOPED_TRACE(c.name);
    AttnCase a = make_attn_case(*be, c, "attn.fwd." + c.name);
    a.meta = be->upload_batch(a.batch);
    be->attention_fwd(a.qkv, a.sinks, a.meta, a.shape, a.out, a.lse);
    std::vector<double> out, lse;
    reference_attention(c, vals(a.qkv), c.sinks ? vals(a.sinks) : std::vector<double>{}, out, lse);
    EXPECT_LT(rel_err(vals(a.out), out), 1e-13);
    EXPECT_LT(rel_err(vals(a.lse), lse), 1e-13);
  }
}

TEST(CpuOpsAttention, GradientsMatchFiniteDifferences) {
  auto be = make_cpu_backend(DType::kF64);
  for (const AttnConfig& c : attention_configs()) {
    SCOPED_TRACE(c.name);
    AttnCase a = make_attn_case(*be, c, "attn.grad." + c.name);
    a.meta = be->upload_batch(a.batch);
    Tensor r = randn(*be, a.out.shape(), "attn.r." + c.name);
    auto loss = [&] {
      be->attention_fwd(a.qkv, a.sinks, a.meta, a.shape, a.out, a.lse);
      return weighted_sum(a.out, r);
    };
    loss();
    Tensor dqkv = randn(*be, a.qkv.shape(), "attn.garbage");  // written, not accumulated
    Tensor dsinks = be->zeros({c.hq}, DType::kF64);
    be->attention_bwd(a.qkv, a.sinks, a.meta, a.shape, a.out, a.lse, r, dqkv, dsinks);
    EXPECT_TRUE(passes(check(a.qkv, dqkv, loss), "dqkv"));
    if (c.sinks) {
      EXPECT_TRUE(passes(check(a.sinks, dsinks, loss), "dsinks"));
    }
  }
}

TEST(CpuOpsAttention, RebuiltMetadataGivesTheSameResult) {
  auto be = make_cpu_backend(DType::kF64);
  const AttnConfig c = attention_configs()[1];
  AttnCase a = make_attn_case(*be, c, "attn.meta");
  a.meta = be->upload_batch(a.batch);
  be->attention_fwd(a.qkv, a.sinks, a.meta, a.shape, a.out, a.lse);
  const auto want = vals(a.out);
  BatchMeta rebuilt = be->upload_batch(a.batch);
  be->rebuild_metadata(rebuilt);
  be->attention_fwd(a.qkv, a.sinks, rebuilt, a.shape, a.out, a.lse);
  EXPECT_EQ(vals(a.out), want);
  // Arguments are checked: a wrong lse shape and a stale cu_seqlens are refused.
  Tensor bad_lse = be->zeros({a.n, c.hq + 1}, DType::kF64);
  expect_throw_naming([&] { be->attention_fwd(a.qkv, a.sinks, a.meta, a.shape, a.out, bad_lse); },
                      "attention_fwd", "lse");
  BatchMeta stale = a.meta;
  stale.cu_seqlens = ints({0, 3, 7});
  stale.n_seqs = 2;
  expect_throw_naming([&] { be->attention_fwd(a.qkv, a.sinks, stale, a.shape, a.out, a.lse); },
                      "attention_fwd", "cu_seqlens");
}

// Documents of many lengths, as in a packed batch.
std::vector<int> mixed_lengths(int64_t total, int max_len, const std::string& purpose) {
  Philox rng(kSeed, purpose);
  std::vector<int> lens;
  int64_t used = 0;
  for (uint64_t i = 0; used < total; ++i) {
    int len = 1 + static_cast<int>(rng.below(i, static_cast<uint64_t>(max_len)));
    len = static_cast<int>(std::min<int64_t>(len, total - used));
    lens.push_back(len);
    used += len;
  }
  return lens;
}

struct AttnRun {
  std::vector<double> out, lse, dqkv, dsinks;
};

AttnRun run_attention(DType dt, const AttnConfig& c, const std::string& tag) {
  auto be = make_cpu_backend(dt);
  AttnCase a = make_attn_case(*be, c, tag);
  a.meta = be->upload_batch(a.batch);
  Tensor r = randn(*be, a.out.shape(), tag + ".r");
  Tensor dqkv = be->zeros(a.qkv.shape(), dt), dsinks = be->zeros({c.hq}, dt);
  be->attention_fwd(a.qkv, a.sinks, a.meta, a.shape, a.out, a.lse);
  be->attention_bwd(a.qkv, a.sinks, a.meta, a.shape, a.out, a.lse, r, dqkv, dsinks);
  return {vals(a.out), vals(a.lse), vals(dqkv), vals(dsinks)};
}

TEST(CpuOpsAttention, F32AgreesWithF64) {
  for (int window : {0, 16}) {
    SCOPED_TRACE(str_cat("window ", window));
    AttnConfig c{"f32 vs f64", {37, 64, 1, 100, 17, 3}, 8, 2, 32, window, true};
    const AttnRun f32 = run_attention(DType::kF32, c, "attn.prec");
    const AttnRun f64 = run_attention(DType::kF64, c, "attn.prec");
    EXPECT_LT(rel_err(f32.out, f64.out), 1e-5);
    EXPECT_LT(rel_err(f32.lse, f64.lse), 1e-6);
    EXPECT_LT(rel_err(f32.dqkv, f64.dqkv), 1e-5);
    EXPECT_LT(rel_err(f32.dsinks, f64.dsinks), 1e-5);
    // This size runs on several threads; the forward still matches the direct formula.
    int64_t n = 0;
    for (int len : c.seqs) n += len;
    std::vector<double> out, lse;
    reference_attention(c, normals(n * (c.hq + 2 * c.hkv) * c.d, "attn.prec.qkv"),
                        normals(c.hq, "attn.prec.sinks"), out, lse);
    EXPECT_LT(rel_err(f64.out, out), 1e-13);
    EXPECT_LT(rel_err(f64.lse, lse), 1e-13);
  }
}

TEST(CpuOpsAttention, F32IsBitwiseReproducible) {
  AttnConfig c{"determinism", mixed_lengths(2048, 256, "attn.det.lens"), 4, 2, 32, 64, true};
  const AttnRun a = run_attention(DType::kF32, c, "attn.det");
  const AttnRun b = run_attention(DType::kF32, c, "attn.det");
  auto same_bits = [](const std::vector<double>& x, const std::vector<double>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(double)) == 0;
  };
  EXPECT_TRUE(same_bits(a.out, b.out));
  EXPECT_TRUE(same_bits(a.lse, b.lse));
  EXPECT_TRUE(same_bits(a.dqkv, b.dqkv));
  EXPECT_TRUE(same_bits(a.dsinks, b.dsinks));
}

// ---- feed-forward activations -----------------------------------------------------------------

TEST(CpuOpsGlu, ForwardAndGradientsBothKinds) {
  auto be = make_cpu_backend(DType::kF64);
  const int64_t m = 6, f = 7;
  for (GluKind kind : {GluKind::kSwiGLU, GluKind::kGptOss}) {
    const bool gpt_oss = kind == GluKind::kGptOss;
    SCOPED_TRACE(gpt_oss ? "gpt-oss" : "swiglu");
    GluParams p;
    p.kind = kind;
    p.limit = 2.5;  // inputs reach both sides of every clamp
    // Inputs in [-4, 4], kept 1e-3 away from the clamp kinks at g = L and u = +-L.
    std::vector<double> hv = uniforms(m * 2 * f, "glu.h", -4.0, 4.0);
    for (double& v : hv) {
      if (std::fabs(std::fabs(v) - p.limit) < 1e-3) v += 3e-3;
    }
    Tensor h = from_values(*be, {m, 2 * f}, hv);
    Tensor a = be->zeros({m, f}, DType::kF64), r = randn(*be, {m, f}, "glu.r");
    auto loss = [&] {
      be->glu_fwd(h, p, a);
      return weighted_sum(a, r);
    };
    loss();
    const auto av = vals(a);
    int clamped = 0;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < f; ++j) {
        double g = hv[i * 2 * f + j], u = hv[i * 2 * f + f + j], want;
        if (gpt_oss) {
          clamped += (g > p.limit) + (std::fabs(u) > p.limit);
          g = std::min(g, p.limit);
          u = std::max(-p.limit, std::min(u, p.limit));
          want = g / (1 + std::exp(-p.alpha * g)) * (u + 1);
        } else {
          want = g / (1 + std::exp(-g)) * u;
        }
        EXPECT_NEAR(av[i * f + j], want, 1e-13);
      }
    }
    if (gpt_oss) {
      EXPECT_GT(clamped, 4);
    }
    Tensor dh = be->zeros({m, 2 * f}, DType::kF64);
    be->glu_bwd(h, r, p, dh);
    EXPECT_TRUE(passes(check(h, dh, loss), "dh"));
  }
}

// ---- routing ----------------------------------------------------------------------------------

TEST(CpuOpsRouting, TopkOrderAndTies) {
  auto be = make_cpu_backend(DType::kF64);
  Tensor logits = from_values(*be, {2, 5}, {1, 3, 3, 2, 3, /**/ -1, -1, -1, -1, 0});
  Tensor idx = be->zeros({2, 4}, DType::kI32), w = be->zeros({2, 4}, DType::kF64);
  be->router_topk(logits, 4, idx, w);
  EXPECT_EQ(ivals(idx), (std::vector<int32_t>{1, 2, 4, 3, /**/ 4, 0, 1, 2}));
  const double e1 = std::exp(-1.0), z0 = 3 + e1, z1 = 1 + 3 * e1;
  const std::vector<double> want = {1 / z0, 1 / z0,  1 / z0,  e1 / z0,
                                    1 / z1, e1 / z1, e1 / z1, e1 / z1};
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(vals(w)[i], want[i], 1e-15);
  Tensor idx1 = be->zeros({2, 1}, DType::kI32), w1 = be->zeros({2, 1}, DType::kF64);
  be->router_topk(logits, 1, idx1, w1);
  EXPECT_EQ(ivals(idx1), (std::vector<int32_t>{1, 4}));
  EXPECT_EQ(vals(w1), (std::vector<double>{1.0, 1.0}));
  Tensor idx6 = be->zeros({2, 6}, DType::kI32), w6 = be->zeros({2, 6}, DType::kF64);
  expect_throw_naming([&] { be->router_topk(logits, 6, idx6, w6); }, "router_topk", "k = 6");
}

TEST(CpuOpsRouting, TopkGradient) {
  auto be = make_cpu_backend(DType::kF64);
  const int64_t n = 7, e = 6;
  const int k = 3;
  // Each row: a shuffled ladder of well-separated values plus small noise (no near ties).
  std::vector<double> lv(static_cast<size_t>(n * e));
  Philox rng(kSeed, "topk.perm");
  const auto noise = normals(n * e, "topk.noise", 0.05);
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int> perm(static_cast<size_t>(e));
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t j = e - 1; j > 0; --j) {
      std::swap(perm[j], perm[rng.below(static_cast<uint64_t>(i * e + j), j + 1)]);
    }
    for (int64_t j = 0; j < e; ++j) lv[i * e + j] = 0.4 * perm[j] - 1.0 + noise[i * e + j];
  }
  Tensor logits = from_values(*be, {n, e}, lv);
  Tensor idx = be->zeros({n, k}, DType::kI32), w = be->zeros({n, k}, DType::kF64);
  Tensor r = randn(*be, {n, k}, "topk.r");
  auto loss = [&] {
    be->router_topk(logits, k, idx, w);
    return weighted_sum(w, r);
  };
  loss();
  const auto picked = ivals(idx);
  for (int64_t i = 0; i < n; ++i) {
    for (int s = 0; s + 1 < k; ++s) {
      EXPECT_GT(lv[i * e + picked[i * k + s]], lv[i * e + picked[i * k + s + 1]]);
    }
  }
  Tensor dlogits = randn(*be, {n, e}, "topk.garbage");  // written, not accumulated
  be->router_topk_bwd(idx, w, r, dlogits);
  EXPECT_TRUE(passes(check(logits, dlogits, loss), "dlogits"));
}

TEST(CpuOpsRouting, AuxLossValueAndGradient) {
  auto be = make_cpu_backend(DType::kF64);
  const int64_t n = 9, e = 5;
  const int k = 2;
  const double coef = 0.03;
  Tensor logits = randn(*be, {n, e}, "aux.logits");
  Tensor idx = be->zeros({n, k}, DType::kI32), w = be->zeros({n, k}, DType::kF64);
  be->router_topk(logits, k, idx, w);
  Tensor counts = be->zeros({e}, DType::kI32);
  be->histogram(idx.reshape({n * k}), static_cast<int>(e), counts);
  Tensor loss = be->zeros({1}, DType::kF64), dlogits = be->zeros({n, e}, DType::kF64);
  auto value = [&] {
    loss.data<double>()[0] = 0;
    Tensor scratch = be->zeros({n, e}, DType::kF64);
    be->router_aux_loss(logits, counts, k, coef, loss, scratch);
    return loss.data<double>()[0];
  };
  // Direct formula: coef * E * sum_e f_e P_e.
  const auto lv = vals(logits), cv = vals(counts);
  std::vector<double> pm(static_cast<size_t>(e), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    double z = 0;
    for (int64_t j = 0; j < e; ++j) z += std::exp(lv[i * e + j]);
    for (int64_t j = 0; j < e; ++j) pm[j] += std::exp(lv[i * e + j]) / z / n;
  }
  double want = 0;
  for (int64_t j = 0; j < e; ++j) want += cv[j] / static_cast<double>(n * k) * pm[j];
  want *= coef * e;
  EXPECT_NEAR(value(), want, 1e-15);
  loss.data<double>()[0] = 0.5;  // loss and dlogits accumulate
  Tensor d0 = randn(*be, {n, e}, "aux.d0");
  const auto d0v = vals(d0);
  be->router_aux_loss(logits, counts, k, coef, loss, d0);
  EXPECT_NEAR(loss.data<double>()[0], 0.5 + want, 1e-15);
  auto dv = vals(d0);
  for (size_t i = 0; i < dv.size(); ++i) dv[i] -= d0v[i];
  set_values(dlogits, dv);
  EXPECT_TRUE(passes(check(logits, dlogits, value), "dlogits"));
}

TEST(CpuOpsRouting, HistogramScanAndStableSort) {
  auto be = make_cpu_backend(DType::kF32);
  const std::vector<int32_t> ids = {3, 0, 3, 1, 3, 0, 4, 1, 3, 0, 0};
  const int n_bins = 6;  // bin 2 and bin 5 stay empty
  for (DType count_dtype : {DType::kI32, DType::kI64}) {
    SCOPED_TRACE(dtype_name(count_dtype));
    Tensor t_ids = ints(ids);
    Tensor counts = be->zeros({n_bins}, count_dtype),
           offsets = be->zeros({n_bins + 1}, count_dtype);
    be->histogram(t_ids, n_bins, counts);
    EXPECT_EQ(vals(counts), (std::vector<double>{4, 2, 0, 4, 1, 0}));
    be->exclusive_scan(counts, offsets);
    EXPECT_EQ(vals(offsets), (std::vector<double>{0, 4, 6, 6, 10, 11, 11}));
    Tensor s2a = be->zeros({11}, DType::kI32), a2s = be->zeros({11}, DType::kI32);
    be->sort_by_id(t_ids, offsets, s2a, a2s);
    // Stable: equal ids keep their assignment order.
    EXPECT_EQ(ivals(s2a), (std::vector<int32_t>{1, 5, 9, 10, 3, 7, 0, 2, 4, 8, 6}));
    const auto s = ivals(s2a), inv = ivals(a2s);
    for (int j = 0; j < 11; ++j) EXPECT_EQ(inv[s[j]], j);
  }
  Tensor bad = ints({0, 6});
  Tensor counts = be->zeros({n_bins}, DType::kI32);
  expect_throw_naming([&] { be->histogram(bad, n_bins, counts); }, "histogram", "ids[1] = 6");
}

// Routing fixture: N tokens, k picks each, M = N k assignments sorted by random expert ids.
struct Routed {
  int64_t n = 5, k = 3, d = 4, e = 4;
  Tensor ids, s2a, a2s;
};

Routed make_routed(Backend& be) {
  Routed r;
  const int64_t m = r.n * r.k;
  Philox rng(kSeed, "routed.ids");
  std::vector<int32_t> ids(static_cast<size_t>(m));
  for (int64_t a = 0; a < m; ++a) ids[a] = static_cast<int32_t>(rng.below(a, r.e));
  r.ids = ints(ids);
  Tensor counts = be.zeros({r.e}, DType::kI32), offsets = be.zeros({r.e + 1}, DType::kI32);
  be.histogram(r.ids, static_cast<int>(r.e), counts);
  be.exclusive_scan(counts, offsets);
  r.s2a = be.zeros({m}, DType::kI32);
  r.a2s = be.zeros({m}, DType::kI32);
  be.sort_by_id(r.ids, offsets, r.s2a, r.a2s);
  return r;
}

TEST(CpuOpsRouting, PermuteRowsAndGradient) {
  auto be = make_cpu_backend(DType::kF64);
  Routed rt = make_routed(*be);
  const int64_t m = rt.n * rt.k;
  Tensor x = randn(*be, {rt.n, rt.d}, "perm.x"), out = be->zeros({m, rt.d}, DType::kF64);
  Tensor r = randn(*be, {m, rt.d}, "perm.r");
  auto loss = [&] {
    be->permute_rows(x, rt.s2a, static_cast<int>(rt.k), out);
    return weighted_sum(out, r);
  };
  loss();
  const auto xv = vals(x), ov = vals(out);
  const auto s = ivals(rt.s2a);
  for (int64_t j = 0; j < m; ++j) {
    for (int64_t c = 0; c < rt.d; ++c) EXPECT_EQ(ov[j * rt.d + c], xv[s[j] / rt.k * rt.d + c]);
  }
  // Written, not added to: what dx held before is gone.
  Tensor dx = randn(*be, {rt.n, rt.d}, "perm.garbage");
  be->permute_rows_bwd(r, rt.s2a, static_cast<int>(rt.k), dx);
  EXPECT_TRUE(passes(check(x, dx, loss), "dx"));
}

TEST(CpuOpsRouting, UnpermuteCombineAndGradients) {
  auto be = make_cpu_backend(DType::kF64);
  Routed rt = make_routed(*be);
  const int64_t m = rt.n * rt.k;
  Tensor y = randn(*be, {m, rt.d}, "unperm.y"), w = randn(*be, {rt.n, rt.k}, "unperm.w");
  Tensor out = be->zeros({rt.n, rt.d}, DType::kF64), r = randn(*be, {rt.n, rt.d}, "unperm.r");
  auto loss = [&] {
    be->unpermute_combine(y, rt.a2s, w, out);
    return weighted_sum(out, r);
  };
  loss();
  Tensor dy = randn(*be, {m, rt.d}, "unperm.garbage"), dw = be->zeros({rt.n, rt.k}, DType::kF64);
  be->unpermute_combine_bwd(r, y, rt.a2s, w, dy, dw);
  EXPECT_TRUE(passes(check(y, dy, loss), "dy"));
  EXPECT_TRUE(passes(check(w, dw, loss), "dw"));

  // permute then combine with weights summing to one gives the input back.
  Tensor x = randn(*be, {rt.n, rt.d}, "unperm.x"), px = be->zeros({m, rt.d}, DType::kF64);
  Tensor wk = be->zeros({rt.n, rt.k}, DType::kF64), back = be->zeros({rt.n, rt.d}, DType::kF64);
  be->fill(wk, 1.0 / static_cast<double>(rt.k));
  be->permute_rows(x, rt.s2a, static_cast<int>(rt.k), px);
  be->unpermute_combine(px, rt.a2s, wk, back);
  EXPECT_LT(rel_err(vals(back), vals(x)), 1e-14);
}

// ---- embedding and loss -----------------------------------------------------------------------

TEST(CpuOpsEmbedding, ForwardAndGradient) {
  auto be = make_cpu_backend(DType::kF64);
  const int64_t v = 7, d = 3;
  Tensor table = randn(*be, {v, d}, "emb.table");
  Tensor ids = ints({4, 0, 4, 6, 2, 4, 0, 1, 6, 4});  // repeats; 3 and 5 unused
  const int64_t n = ids.numel();
  Tensor out = be->zeros({n, d}, DType::kF64), r = randn(*be, {n, d}, "emb.r");
  auto loss = [&] {
    be->embedding_fwd(table, ids, out);
    return weighted_sum(out, r);
  };
  loss();
  const auto tv = vals(table), ov = vals(out);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = 0; c < d; ++c) EXPECT_EQ(ov[t * d + c], tv[ids.data<int32_t>()[t] * d + c]);
  }
  Tensor dtable = be->zeros({v, d}, DType::kF64);
  be->embedding_bwd(r, ids, dtable);
  EXPECT_TRUE(passes(check(table, dtable, loss), "dtable"));
  Tensor bad = ints({7});
  Tensor out1 = be->zeros({1, d}, DType::kF64);
  expect_throw_naming([&] { be->embedding_fwd(table, bad, out1); }, "embedding_fwd", "ids[0]");
}

TEST(CpuOpsLoss, CrossEntropyValueAndGradient) {
  auto be = make_cpu_backend(DType::kF64);
  const int64_t n = 6, v = 5;
  const double grad_scale = 0.37;
  Tensor logits = randn(*be, {n, v}, "ce.logits", 2.0);
  Tensor targets = ints({3, -1, 0, 4, -1, 2});
  Tensor loss = be->zeros({1}, DType::kF64);
  auto value = [&] {
    Tensor scratch = clone(*be, logits);  // cross_entropy overwrites its logits
    loss.data<double>()[0] = 0;
    be->cross_entropy(scratch, targets, grad_scale, loss);
    return loss.data<double>()[0];
  };
  const auto lv = vals(logits);
  double want = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int t = targets.data<int32_t>()[i];
    if (t < 0) continue;
    double z = 0;
    for (int64_t j = 0; j < v; ++j) z += std::exp(lv[i * v + j]);
    want += std::log(z) - lv[i * v + t];
  }
  EXPECT_NEAR(value(), want, 1e-13);
  Tensor grad = clone(*be, logits);
  loss.data<double>()[0] = 1.0;  // accumulates
  be->cross_entropy(grad, targets, grad_scale, loss);
  EXPECT_NEAR(loss.data<double>()[0], 1.0 + want, 1e-13);
  const auto gv = vals(grad);
  for (int64_t j = 0; j < v; ++j) {
    EXPECT_EQ(gv[1 * v + j], 0.0);  // ignored rows
    EXPECT_EQ(gv[4 * v + j], 0.0);
  }
  // The written gradient is grad_scale * dloss/dlogits.
  auto unscaled = gv;
  for (double& g : unscaled) g /= grad_scale;
  Tensor dlogits = from_values(*be, {n, v}, unscaled);
  EXPECT_TRUE(passes(check(logits, dlogits, value), "dlogits"));

  // Max-subtracted: huge logits stay finite.
  Tensor big = from_values(*be, {1, 3}, {1000.0, 1001.0, 999.0});
  Tensor t0 = ints({2});
  loss.data<double>()[0] = 0;
  be->cross_entropy(big, t0, 1.0, loss);
  const double z = std::exp(-1.0) + 1.0 + std::exp(-2.0);
  EXPECT_NEAR(loss.data<double>()[0], std::log(z) + 2.0, 1e-12);
  expect_throw_naming(
      [&] {
        Tensor l = be->zeros({1, 3}, DType::kF64);
        Tensor t = ints({3});
        be->cross_entropy(l, t, 1.0, loss);
      },
      "cross_entropy", "targets[0] = 3");
}

// ---- optimizer --------------------------------------------------------------------------------

TEST(CpuOpsOptim, SumSquaresOverManyChunks) {
  for (DType dt : {DType::kF32, DType::kF64}) {
    auto be = make_cpu_backend(dt);
    const int64_t n = 40001;
    const auto xv = normals(n, "sumsq.x");
    Tensor x = from_values(*be, {n}, xv);
    Tensor acc = be->zeros({1}, dt);
    be->fill(acc, 2.0);
    be->sum_squares(x, acc);
    double want = 2.0;
    for (double v : vals(x)) want += v * v;
    EXPECT_NEAR(vals(acc)[0], want, want * (dt == DType::kF32 ? 1e-6 : 1e-14));
  }
}

TEST(CpuOpsOptim, AdamwMatchesScalarLoop) {
  for (DType dt : {DType::kF32, DType::kF64}) {
    SCOPED_TRACE(dtype_name(dt));
    auto be = make_cpu_backend(dt);
    const int64_t n = 23;
    AdamWParams p;
    p.lr = 3e-3;
    p.beta1 = 0.9;
    p.beta2 = 0.95;
    p.eps = 1e-8;
    p.weight_decay = 0.1;
    p.step = 3;
    p.grad_scale = 0.5;
    std::vector<double> w = normals(n, "adam.w"), g = normals(n, "adam.g"),
                        m = normals(n, "adam.m", 0.1), v = uniforms(n, "adam.v", 0.0, 0.2);
    Tensor tw = from_values(*be, {n}, w), tg = from_values(*be, {n}, g);
    Tensor tm = from_values(*be, {n}, m), tv = from_values(*be, {n}, v);
    // Round the inputs as the backend stores them.
    w = vals(tw);
    g = vals(tg);
    m = vals(tm);
    v = vals(tv);
    Tensor working = be->zeros({n}, DType::kBF16);
    be->adamw(tw, tg, tm, tv, p, working);
    const double bc1 = 1 - std::pow(p.beta1, 3), bc2 = 1 - std::pow(p.beta2, 3);
    const double tol = dt == DType::kF32 ? 1e-6 : 1e-15;
    for (int64_t i = 0; i < n; ++i) {
      const double gi = g[i] * p.grad_scale;
      const double mi = p.beta1 * m[i] + (1 - p.beta1) * gi;
      const double vi = p.beta2 * v[i] + (1 - p.beta2) * gi * gi;
      const double wi =
          w[i] - p.lr * ((mi / bc1) / (std::sqrt(vi / bc2) + p.eps) + p.weight_decay * w[i]);
      EXPECT_NEAR(vals(tm)[i], mi, tol * (1 + std::fabs(mi)));
      EXPECT_NEAR(vals(tv)[i], vi, tol * (1 + std::fabs(vi)));
      EXPECT_NEAR(vals(tw)[i], wi, tol * (1 + std::fabs(wi)));
      // The bf16 working copy is the master rounded to nearest: within half a bf16 ulp.
      EXPECT_LE(std::fabs(vals(working)[i] - vals(tw)[i]), 0x1p-8 * std::fabs(vals(tw)[i]));
    }
    // A working copy that is the master itself is left alone; an undefined one is skipped.
    Tensor none;
    be->adamw(tw, tg, tm, tv, p, tw);
    be->adamw(tw, tg, tm, tv, p, none);
    Tensor bad = be->zeros({n + 1}, dt);
    expect_throw_naming([&] { be->adamw(tw, bad, tm, tv, p, none); }, "adamw", "grad");
  }
}

}  // namespace
}  // namespace hp
