// CUDA backend vs the CPU reference, op by op: random inputs (rounded to bf16 once, so both
// backends see the same numbers), odd sizes, forward outputs and backward gradients compared by
// relative error ||gpu - cpu|| / ||cpu||.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/backend/cuda/cuda_allocator.h"
#include "framework/backend/cuda/cuda_backend.h"
#include "framework/backend/cuda/cuda_kernels.h"
#include "framework/core/rng.h"
#include "framework/data/packed_batch.h"

namespace hp {
namespace {

constexpr double kTol = 1e-2;
constexpr double kAttnTol = 2e-2;

double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}

// A MoE layer's three groups of expert products over row slices of one buffer (rows[i] for
// expert i, zero allowed): the forward with biases, the input gradient (b transposed) and the f32
// weight gradients accumulated with beta 1 onto wg0 (a transposed). Host inputs; run() gives y,
// dx and the weight gradients, in that order.
struct ExpertGroups {
  std::vector<int64_t> rows;
  int64_t d = 0, f = 0, total = 0;
  Tensor x, dy;
  std::vector<Tensor> w, bias, wg0;

  // put(host, dtype): the tensor on the backend.
  template <typename Put>
  std::vector<Tensor> run(Backend& be, Put&& put) const {
    Tensor bx = put(x, be.act_dtype()), bdy = put(dy, be.act_dtype());
    Tensor y = be.empty({total, f}, be.act_dtype()), dx = be.empty({total, d}, be.act_dtype());
    std::vector<Tensor> out = {y, dx};
    std::vector<Backend::GemmProblem> fwd, dinput, dw;
    int64_t r = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      const int64_t b = r, en = r + rows[i];
      r = en;
      Tensor wi = put(w[i], be.act_dtype()), g = put(wg0[i], DType::kF32);
      out.push_back(g);
      fwd.push_back({bx.slice(b, en), wi, y.slice(b, en), put(bias[i], be.act_dtype())});
      dinput.push_back({bdy.slice(b, en), wi, dx.slice(b, en), {}});
      dw.push_back({bx.slice(b, en), bdy.slice(b, en), g, {}});
    }
    be.gemm_group(fwd, false, false, 0.0);
    be.gemm_group(dinput, false, true, 0.0);
    be.gemm_group(dw, true, false, 1.0);
    return out;
  }
};

class CudaConsistency : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) {
      GTEST_SKIP() << "no CUDA device: GPU tests run on the GPU machine";
    }
    cpu_ = make_cpu_backend(DType::kF32);
    gpu_ = make_cuda_backend(0);
  }

  // Host f32 tensor of N(offset, scale^2) values rounded to bf16.
  Tensor rand(const Shape& shape, uint64_t seed, double scale = 1.0, double offset = 0.0) {
    Philox rng(seed, "cuda-consistency");
    Tensor t = Tensor::host(shape, DType::kF32);
    float* p = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i)
      p[i] = static_cast<float>(bf16(static_cast<float>(offset + scale * rng.normal(i))));
    return t;
  }

  Tensor ints(const std::vector<int32_t>& v) { return Tensor::host_from(v, DType::kI32); }

  // qk_norm forward and backward of n tokens, hq query and hkv key/value heads of d, on both
  // backends.
  void check_qk_norm(int64_t n, int64_t d, int64_t hq, int64_t hkv);

  std::vector<int32_t> rand_ids(int64_t n, int64_t limit, uint64_t seed) {
    Philox rng(seed, "cuda-consistency-ids");
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[i] = static_cast<int32_t>(rng.below(i, limit));
    return v;
  }

  // Random expert groups (seeds from `seed` on), weights scaled by w_scale.
  ExpertGroups expert_groups(std::vector<int64_t> rows, int64_t d, int64_t f, uint64_t seed,
                             double w_scale) {
    ExpertGroups g;
    g.rows = std::move(rows);
    g.d = d;
    g.f = f;
    for (int64_t r : g.rows) g.total += r;
    g.x = rand({g.total, d}, seed);
    g.dy = rand({g.total, f}, seed + 1);
    for (size_t i = 0; i < g.rows.size(); ++i) {
      g.w.push_back(rand({d, f}, seed + 10 + i, w_scale));
      g.bias.push_back(rand({f}, seed + 20 + i));
      g.wg0.push_back(rand({d, f}, seed + 30 + i));
    }
    return g;
  }

  Tensor on_cpu(const Tensor& host) { return cpu_->upload(host); }

  // On the GPU in `dt` (f32 host data converted on the device; integers copied).
  Tensor on_gpu(const Tensor& host, DType dt = DType::kBF16) {
    if (host.dtype() == DType::kI32 || dt == DType::kF32) return gpu_->upload(host);
    Tensor f = gpu_->upload(host);
    Tensor t = gpu_->empty(host.shape(), dt);
    gpu_->convert(f, t);
    return t;
  }

  std::vector<double> gpu_values(const Tensor& t) {
    Tensor src = t;
    if (t.dtype() == DType::kBF16) {
      src = gpu_->empty(t.shape(), DType::kF32);
      gpu_->convert(t, src);
    }
    Tensor h = Tensor::host(t.shape(), src.dtype());
    gpu_->read_to_host(src, h, SyncCause::kOther);
    return to_double_vector(h);
  }

  static std::vector<double> cpu_values(const Tensor& t) { return to_double_vector(t); }

  void expect_close(const char* what, const Tensor& g, const Tensor& c, double tol = kTol) {
    const double e = rel_err(gpu_values(g), cpu_values(c));
    EXPECT_LE(e, tol) << what << ": relative error " << e;
  }

  void expect_equal_ints(const char* what, const Tensor& g, const Tensor& c) {
    const std::vector<double> a = gpu_values(g), b = cpu_values(c);
    ASSERT_EQ(a.size(), b.size()) << what;
    int64_t diff = 0;
    for (size_t i = 0; i < a.size(); ++i) diff += a[i] != b[i];
    EXPECT_EQ(diff, 0) << what << ": " << diff << " of " << a.size() << " entries differ";
  }

  std::unique_ptr<Backend> cpu_, gpu_;
};

// A batch of one row per entry of `rows`, each row the given sequence lengths.
PackedBatch make_batch(const std::vector<std::vector<int>>& rows) {
  int64_t seq_len = 0;
  for (const auto& r : rows) {
    int64_t s = 0;
    for (int l : r) s += l;
    seq_len = std::max(seq_len, s);
  }
  std::vector<int32_t> inputs, targets, positions;
  for (const auto& r : rows) {
    int64_t used = 0;
    for (int l : r) {
      for (int i = 0; i < l; ++i) positions.push_back(i);
      used += l;
    }
    for (int64_t i = 0; used + i < seq_len; ++i) positions.push_back(static_cast<int32_t>(i));
  }
  for (size_t i = 0; i < positions.size(); ++i) {
    inputs.push_back(static_cast<int32_t>(i % 97));
    targets.push_back(static_cast<int32_t>((i + 1) % 97));
  }
  return PackedBatch::from_tokens(inputs, targets, positions, seq_len);
}

// ---- memory
// ---------------------------------------------------------------------------------------

TEST_F(CudaConsistency, CopyConvertFillReadBack) {
  Tensor h = rand({3, 77}, 1);
  Tensor g32 = gpu_->upload(h);
  Tensor g16 = gpu_->empty({3, 77}, DType::kBF16);
  gpu_->convert(g32, g16);
  Tensor back = gpu_->empty({3, 77}, DType::kF32);
  gpu_->convert(g16, back);
  Tensor g2 = gpu_->empty({3, 77}, DType::kF32);
  gpu_->copy(back, g2);
  const int64_t before = gpu_->syncs().get(SyncCause::kOther);
  Tensor out = Tensor::host({3, 77}, DType::kF32);
  gpu_->read_to_host(g2, out, SyncCause::kOther);
  EXPECT_EQ(gpu_->syncs().get(SyncCause::kOther), before + 1);
  for (int64_t i = 0; i < h.numel(); ++i) EXPECT_EQ(out.data<float>()[i], h.data<float>()[i]);

  Tensor ones = gpu_->empty({1001}, DType::kBF16);
  gpu_->fill(ones, 1.5);
  for (double v : gpu_values(ones)) ASSERT_EQ(v, 1.5);
  Tensor i32 = gpu_->empty({17}, DType::kI32);
  gpu_->fill(i32, -3);
  for (double v : gpu_values(i32)) ASSERT_EQ(v, -3);
}

// Parameter init draws the same bits on the device as on the host, at sizes that are not a
// multiple of any block or vector width and at the offsets an expert shard starts from.
TEST_F(CudaConsistency, FillNormalBitwiseEqualsCpu) {
  const uint64_t key = Philox(11, "init.layers.0.attn.wqkv").key();
  for (const int64_t n :
       {int64_t{1}, int64_t{7}, int64_t{1021}, int64_t{65537}, int64_t{1000003}}) {
    for (const int64_t offset : {int64_t{0}, int64_t{3}, int64_t{123456789}}) {
      for (const DType dt : {DType::kF32, DType::kF64}) {
        Tensor c = cpu_->empty({n}, dt), g = gpu_->empty({n}, dt);
        cpu_->fill_normal(c, key, offset, 0.02);
        gpu_->fill_normal(g, key, offset, 0.02);
        Tensor h = Tensor::host({n}, dt);
        gpu_->read_to_host(g, h, SyncCause::kOther);
        ASSERT_EQ(std::memcmp(h.raw(), c.raw(), static_cast<size_t>(h.nbytes())), 0)
            << "n=" << n << " offset=" << offset << " dtype=" << dtype_name(dt);
      }
    }
  }
}

// ---- dense math
// -----------------------------------------------------------------------------------

TEST_F(CudaConsistency, GemmAllTransposes) {
  const int64_t m = 37, n = 53, k = 129;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      Tensor a = rand(ta ? Shape{k, m} : Shape{m, k}, 10 + ta);
      Tensor b = rand(tb ? Shape{n, k} : Shape{k, n}, 20 + tb);
      Tensor c0 = rand({m, n}, 30);
      // Activations: bf16 x bf16 -> bf16, beta 0.
      Tensor cc = on_cpu(c0), gc = on_gpu(c0);
      cpu_->gemm(on_cpu(a), ta, on_cpu(b), tb, cc, 0.7, 0.0);
      gpu_->gemm(on_gpu(a), ta, on_gpu(b), tb, gc, 0.7, 0.0);
      expect_close(("gemm bf16 ta=" + std::to_string(ta) + " tb=" + std::to_string(tb)).c_str(), gc,
                   cc);
      // Weight gradients: bf16 x bf16 -> f32, beta 1.
      Tensor cc2 = on_cpu(c0), gc2 = on_gpu(c0, DType::kF32);
      cpu_->gemm(on_cpu(a), ta, on_cpu(b), tb, cc2, 1.0, 1.0);
      gpu_->gemm(on_gpu(a), ta, on_gpu(b), tb, gc2, 1.0, 1.0);
      expect_close(("gemm f32-out ta=" + std::to_string(ta) + " tb=" + std::to_string(tb)).c_str(),
                   gc2, cc2);
    }
  }
}

// The bias rides in cuBLASLt's epilogue where it can (aligned rows), else is added after the
// product; either way the result matches the reference's gemm + add_bias.
TEST_F(CudaConsistency, GemmBias) {
  for (const int64_t n : {int64_t{48}, int64_t{45}}) {
    for (const DType bias_t : {DType::kBF16, DType::kF32}) {
      const int64_t m = 77, k = 136;
      Tensor a = rand({m, k}, 50), b = rand({k, n}, 51), bias = rand({n}, 52, 2.0);
      Tensor cc = cpu_->empty({m, n}, DType::kF32), gc = gpu_->empty({m, n}, DType::kBF16);
      cpu_->gemm_bias(on_cpu(a), false, on_cpu(b), false, cc, on_cpu(bias));
      gpu_->gemm_bias(on_gpu(a), false, on_gpu(b), false, gc, on_gpu(bias, bias_t));
      expect_close(("gemm_bias n=" + std::to_string(n) + " bias " + dtype_name(bias_t)).c_str(), gc,
                   cc);
    }
  }
}

// gemm_add puts a product onto a residual in cuBLASLt's epilogue (C = r, D = c, beta 1), with and
// without a bias and on rows the epilogue cannot take (45 columns: unaligned), and matches the
// reference's gemm + add; r is left as it was. A large one is tuned (its candidates may run again:
// they read r, not c) and matches before and after the switch.
TEST_F(CudaConsistency, GemmAddOntoResidual) {
  struct Case {
    int64_t m, n, k;
    bool bias;
  };
  for (const Case c : {Case{77, 48, 136, false}, Case{77, 48, 136, true}, Case{77, 45, 136, true},
                       Case{1024, 2048, 2048, false}}) {
    SCOPED_TRACE("m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) +
                 (c.bias ? " bias" : ""));
    Tensor a = rand({c.m, c.k}, 40), b = rand({c.k, c.n}, 41, 0.05), r = rand({c.m, c.n}, 42);
    Tensor bias = c.bias ? rand({c.n}, 43) : Tensor();
    Tensor cc = cpu_->empty({c.m, c.n}, DType::kF32);
    cpu_->gemm_add(on_cpu(a), false, on_cpu(b), false, on_cpu(r), cc,
                   c.bias ? on_cpu(bias) : Tensor());
    const Tensor ga = on_gpu(a), gb = on_gpu(b), gr = on_gpu(r);
    const Tensor gbias = c.bias ? on_gpu(bias) : Tensor();
    const std::vector<double> r_before = gpu_values(gr);
    const int tuned_before = cuda_gemm_tuned_buckets(*gpu_);
    for (int rep = 0; rep < 2; ++rep) {
      Tensor gc = gpu_->empty({c.m, c.n}, DType::kBF16);
      gpu_->gemm_add(ga, false, gb, false, gr, gc, gbias);
      expect_close(rep == 0 ? "first product" : "second product", gc, cc);
    }
    EXPECT_TRUE(gpu_values(gr) == r_before) << "gemm_add changed its residual";
    if (c.m == 1024) {
      EXPECT_EQ(cuda_gemm_tuned_buckets(*gpu_), tuned_before + 1);
    }
  }
}

// Every product writes every element of its output (beta 0 reads nothing): outputs start as
// NaN and none is left. The backend tells compute-sanitizer's initcheck that these outputs are
// written (it does not see cuBLASLt's tensor-memory stores), which this makes safe to say.
TEST_F(CudaConsistency, GemmWritesEveryElement) {
  const int64_t m = 1000, k = 136;
  for (const int64_t n : {int64_t{96}, int64_t{45}}) {
    for (const DType out_t : {DType::kBF16, DType::kF32}) {
      Tensor a = rand({m, k}, 55), b = rand({k, n}, 56), bias = rand({n}, 57);
      Tensor c = gpu_->empty({m, n}, out_t);
      gpu_->fill(c, std::nan(""));
      gpu_->gemm(on_gpu(a), false, on_gpu(b), false, c, 1.0, 0.0);
      int64_t left = 0;
      for (double v : gpu_values(c)) left += std::isnan(v);
      EXPECT_EQ(left, 0) << "gemm n=" << n << " " << dtype_name(out_t);
      if (out_t != DType::kBF16) continue;
      gpu_->fill(c, std::nan(""));
      gpu_->gemm_bias(on_gpu(a), false, on_gpu(b), false, c, on_gpu(bias));
      left = 0;
      for (double v : gpu_values(c)) left += std::isnan(v);
      EXPECT_EQ(left, 0) << "gemm_bias n=" << n;
    }
  }
}

// gemm_autotune: a large product's first call also issues its bucket's candidates, timed
// between events, and a later call that finds them done switches to the fastest; no call waits
// for them. Results match the reference before and after the switch. deterministic=true turns
// tuning off, and an accumulating product (beta 1) is never tuned: a candidate run twice on its
// own output would add twice.
TEST_F(CudaConsistency, GemmAutotuneSwitchesWithoutWaiting) {
  const int64_t m = 1024, n = 2048, k = 2048;  // 8.6 GFLOP, above LtGemm's tuning threshold
  Tensor a = rand({m, k}, 100), b = rand({n, k}, 101, 0.05), g0 = rand({m, n}, 102);
  Tensor cc = cpu_->empty({m, n}, DType::kF32), cg = on_cpu(g0);
  cpu_->gemm(on_cpu(a), false, on_cpu(b), true, cc, 1.0, 0.0);
  cpu_->gemm(on_cpu(a), false, on_cpu(b), true, cg, 1.0, 1.0);
  for (const bool deterministic : {false, true}) {
    SCOPED_TRACE(deterministic ? "deterministic" : "autotune");
    CudaBackendOptions o;
    o.deterministic = deterministic;
    gpu_ = make_cuda_backend(0, o);
    const Tensor ga = on_gpu(a), gb = on_gpu(b);
    Tensor c1 = gpu_->empty({m, n}, DType::kBF16), c2 = gpu_->empty({m, n}, DType::kBF16);
    gpu_->syncs().reset();
    gpu_->gemm(ga, false, gb, true, c1, 1.0, 0.0);
    EXPECT_EQ(gpu_->syncs().total(), 0) << "the first product waited for its candidates";
    EXPECT_EQ(cuda_gemm_tuned_buckets(*gpu_), 0) << "nothing can be compared before a later call";
    expect_close("first product", c1, cc);  // reads c1 back: the candidates are done too
    gpu_->gemm(ga, false, gb, true, c2, 1.0, 0.0);
    EXPECT_EQ(cuda_gemm_tuned_buckets(*gpu_), deterministic ? 0 : 1);
    expect_close("product after the switch", c2, cc);
    for (int rep = 0; rep < 2; ++rep) {
      Tensor g = on_gpu(g0, DType::kF32);
      gpu_->gemm(ga, false, gb, true, g, 1.0, 1.0);
      expect_close("accumulating product", g, cg);
    }
    EXPECT_EQ(cuda_gemm_tuned_buckets(*gpu_), deterministic ? 0 : 1);
    // A group's products (the experts') are not tuned either: halves of 4.3 GFLOP each.
    const std::vector<Backend::GemmProblem> halves = {
        {ga.slice(0, m / 2), gb, c1.slice(0, m / 2), {}},
        {ga.slice(m / 2, m), gb, c1.slice(m / 2, m), {}}};
    for (int rep = 0; rep < 2; ++rep) {
      gpu_->gemm_group(halves, false, true, 0.0);
      expect_close("group of halves", c1, cc);
    }
    EXPECT_EQ(cuda_gemm_tuned_buckets(*gpu_), deterministic ? 0 : 1);
  }
}

// A group's shapes have their buckets' algorithms launched once on a small problem when the
// shape is first seen (kernels load then, not in a later step). Those launches leave the group's
// results as the reference's: a bias, beta 1 onto gradients. A shape seen before, and a single
// product, warm nothing.
TEST_F(CudaConsistency, GemmGroupWarmsItsAlgorithmsOnce) {
  const ExpertGroups groups = expert_groups({100, 0, 3000, 700}, 512, 1024, 62, 0.05);
  const std::vector<Tensor> ref =
      groups.run(*cpu_, [&](const Tensor& h, DType) { return on_cpu(h); });
  auto put_gpu = [&](const Tensor& h, DType dt) { return on_gpu(h, dt); };
  EXPECT_EQ(cuda_gemm_warmed_algos(*gpu_), 0);
  for (int rep = 0; rep < 2; ++rep) {
    const std::vector<Tensor> out = groups.run(*gpu_, put_gpu);
    for (size_t i = 0; i < out.size(); ++i)
      expect_close(("run " + std::to_string(rep) + " output " + std::to_string(i)).c_str(), out[i],
                   ref[i]);
  }
  const int warmed = cuda_gemm_warmed_algos(*gpu_);
  EXPECT_GT(warmed, 0) << "no algorithm of the groups' shapes was warmed";
  Tensor c = gpu_->empty({3000, 768}, DType::kBF16);
  gpu_->gemm(on_gpu(groups.x.slice(0, 3000)), false, on_gpu(rand({512, 768}, 64)), false, c, 1.0,
             0.0);
  groups.run(*gpu_, put_gpu);
  EXPECT_EQ(cuda_gemm_warmed_algos(*gpu_), warmed) << "a shape seen before, or a single product";
}

// The experts' products of a MoE layer as groups, on every expert_gemm choice: row slices of
// one buffer (an empty expert among them), forward with biases, the input gradient (b
// transposed) and the f32 weight gradients accumulated with beta 1 (a transposed). Each choice
// matches the reference; streams gives serial's bits exactly.
TEST_F(CudaConsistency, GemmGroupEveryImpl) {
  const ExpertGroups groups = expert_groups({37, 0, 256, 1000, 129, 8}, 136, 72, 60, 0.1);
  const std::vector<Tensor> ref =
      groups.run(*cpu_, [&](const Tensor& h, DType) { return on_cpu(h); });
  std::vector<std::vector<std::vector<double>>> got;
  for (const ExpertGemmImpl impl :
       {ExpertGemmImpl::kSerial, ExpertGemmImpl::kStreams, ExpertGemmImpl::kGrouped}) {
    CudaBackendOptions o;
    o.expert_gemm = impl;
    gpu_ = make_cuda_backend(0, o);
    auto put_gpu = [&](const Tensor& h, DType dt) { return on_gpu(h, dt); };
    const std::vector<Tensor> out = groups.run(*gpu_, put_gpu);
    std::vector<std::vector<double>> vals;
    for (size_t i = 0; i < out.size(); ++i) {
      const std::string what =
          "impl " + std::to_string(static_cast<int>(impl)) + " output " + std::to_string(i);
      expect_close(what.c_str(), out[i], ref[i]);
      vals.push_back(gpu_values(out[i]));
    }
    got.push_back(vals);
  }
  EXPECT_EQ(got[0], got[1]) << "streams must give serial's bits";
}

TEST_F(CudaConsistency, BiasAddAxpy) {
  Tensor y = rand({67, 45}, 40), b = rand({45}, 41);
  Tensor cy = on_cpu(y), gy = on_gpu(y);
  cpu_->add_bias(cy, on_cpu(b));
  gpu_->add_bias(gy, on_gpu(b));
  expect_close("add_bias", gy, cy);

  Tensor dy = rand({1000, 77}, 42), db0 = rand({77}, 43);
  Tensor cdb = on_cpu(db0), gdb = on_gpu(db0, DType::kF32);
  cpu_->bias_grad(on_cpu(dy), cdb);
  gpu_->bias_grad(on_gpu(dy), gdb);
  expect_close("bias_grad", gdb, cdb, 1e-3);

  Tensor a = rand({333}, 44), c = rand({333}, 45);
  for (DType dt : {DType::kBF16, DType::kF32}) {
    Tensor co = cpu_->empty({333}, DType::kF32), go = gpu_->empty({333}, dt);
    cpu_->add(on_cpu(a), on_cpu(c), co);
    gpu_->add(on_gpu(a, dt), on_gpu(c, dt), go);
    expect_close("add", go, co);
    Tensor cyy = on_cpu(c), gyy = on_gpu(c, dt);
    cpu_->axpy(-0.3, on_cpu(a), cyy);
    gpu_->axpy(-0.3, on_gpu(a, dt), gyy);
    expect_close("axpy", gyy, cyy);
  }
}

// The deterministic column sum (bias_grad, the norms' weight gradients) in its documented order
// (column_sum.cuh): rows cut into n_chunks chunks (at most 2048 / column blocks of 32, at least 64
// rows a chunk); a chunk's 8 row slots each add rows r0 + y, r0 + y + 8, ...; the slots add in
// order; the chunk partials are finished in 8 splits of ceil(n_chunks / 8) chunks, each added in
// order, then the splits in order; the total adds to db. Emulated on the host in f32, so the GPU
// must give the same bits: 41 chunks (splits of 6, the last one empty) and 313 (splits of 40:
// two groups of 16 loads and a tail).
TEST_F(CudaConsistency, ColumnSumAddsInItsFixedOrderBitwise) {
  const auto host_sums = [](const std::vector<float>& x, int64_t rows, int64_t cols,
                            const std::vector<float>& db0) {
    const int64_t col_blocks = (cols + 31) / 32;
    int64_t n_chunks = std::min<int64_t>(2048 / col_blocks, (rows + 63) / 64);
    n_chunks = std::max<int64_t>(n_chunks, 1);
    const int64_t per_chunk = (rows + n_chunks - 1) / n_chunks;
    n_chunks = (rows + per_chunk - 1) / per_chunk;
    std::vector<float> out(db0);
    const int64_t per_split = (n_chunks + 7) / 8;
    for (int64_t c = 0; c < cols; ++c) {
      std::vector<float> partial(static_cast<size_t>(n_chunks));
      for (int64_t i = 0; i < n_chunks; ++i) {
        const int64_t r0 = i * per_chunk, r1 = std::min(rows, r0 + per_chunk);
        float chunk = 0.f;
        for (int y = 0; y < 8; ++y) {
          float slot = 0.f;
          for (int64_t r = r0 + y; r < r1; r += 8) slot += x[static_cast<size_t>(r * cols + c)];
          chunk += slot;
        }
        partial[static_cast<size_t>(i)] = chunk;
      }
      float total = 0.f;
      for (int64_t y = 0; y < 8; ++y) {
        float split = 0.f;
        for (int64_t i = y * per_split; i < std::min(n_chunks, (y + 1) * per_split); ++i)
          split += partial[static_cast<size_t>(i)];
        total += split;
      }
      out[static_cast<size_t>(c)] += total;
    }
    return std::make_pair(out, n_chunks);
  };
  const struct { int64_t rows, cols, chunks; } cases[] = {{2573, 77, 41}, {20000, 16, 313}};
  for (const auto& k : cases) {
    Tensor dy = rand({k.rows, k.cols}, 48), db0 = rand({k.cols}, 49);
    Tensor gdb = on_gpu(db0, DType::kF32);
    gpu_->bias_grad(on_gpu(dy, DType::kF32), gdb);
    const float* x = dy.data<float>();
    const auto [want, n_chunks] =
        host_sums(std::vector<float>(x, x + dy.numel()), k.rows, k.cols,
                  std::vector<float>(db0.data<float>(), db0.data<float>() + k.cols));
    ASSERT_EQ(n_chunks, k.chunks) << "the case no longer has the chunk count it was chosen for";
    const std::vector<double> got = gpu_values(gdb);
    int64_t diff = 0;
    for (int64_t c = 0; c < k.cols; ++c) diff += static_cast<float>(got[c]) != want[c];
    EXPECT_EQ(diff, 0) << k.rows << " x " << k.cols << ": " << diff << " of " << k.cols
                       << " column sums differ from the fixed-order sum";
  }
}

// Segments of one dy, as the MoE layer's experts have them: empty ones, more than one launch
// holds, and two segments adding to one output (as an expert's chunks from two source ranks do).
// Bitwise the per-segment bias_grad calls in order, and close to the CPU's.
TEST_F(CudaConsistency, BiasGradSegmentsEqualPerSegmentCallsBitwise) {
  const int64_t cols = 77;
  std::vector<int64_t> rows;
  for (int i = 0; i < 41; ++i) rows.push_back(i % 7 == 3 ? 0 : 5 + (i * 37) % 300);
  int64_t total = 0;
  for (int64_t r : rows) total += r;
  Tensor dy = rand({total, cols}, 46), db0 = rand({40, cols}, 47);
  Tensor gdy = on_gpu(dy), cdy = on_cpu(dy);
  Tensor g_one = on_gpu(db0, DType::kF32), g_seg = on_gpu(db0, DType::kF32), c_seg = on_cpu(db0);
  std::vector<Backend::RowSegment> gs, cs;
  int64_t begin = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t out = i == 40 ? 2 : static_cast<int64_t>(i);  // the last adds to row 2 again
    Tensor g = g_one.slice(out, out + 1).reshape({cols});
    if (rows[i] > 0) gpu_->bias_grad(gdy.slice(begin, begin + rows[i]), g);
    gs.push_back({begin, rows[i], g_seg.slice(out, out + 1).reshape({cols})});
    cs.push_back({begin, rows[i], c_seg.slice(out, out + 1).reshape({cols})});
    begin += rows[i];
  }
  gpu_->bias_grad_segments(gdy, gs);
  cpu_->bias_grad_segments(cdy, cs);
  EXPECT_EQ(gpu_values(g_seg), gpu_values(g_one));
  expect_close("bias_grad_segments", g_seg, c_seg, 1e-3);
  Backend::RowSegment outside{total - 1, 2, g_seg.slice(0, 1).reshape({cols})};
  EXPECT_THROW(gpu_->bias_grad_segments(gdy, {outside}), Error);
}

// ---- normalization and position
// -------------------------------------------------------------------

TEST_F(CudaConsistency, RmsNorm) {
  // d = 200: the 16-byte-vector kernels; d = 203: the scalar ones.
  for (const int64_t d : {int64_t{200}, int64_t{203}}) {
    SCOPED_TRACE("d=" + std::to_string(d));
    const int64_t m = 75;
    Tensor x = rand({m, d}, 50, 2.0, 0.3), w = rand({d}, 51, 0.5, 1.0), dy = rand({m, d}, 52);
    Tensor dw0 = rand({d}, 53);
    Tensor cy = cpu_->empty({m, d}, DType::kF32), cr = cpu_->empty({m}, DType::kF32);
    Tensor gy = gpu_->empty({m, d}, DType::kBF16), gr = gpu_->empty({m}, DType::kF32);
    cpu_->rmsnorm_fwd(on_cpu(x), on_cpu(w), 1e-5, cy, cr);
    gpu_->rmsnorm_fwd(on_gpu(x), on_gpu(w), 1e-5, gy, gr);
    expect_close("rmsnorm y", gy, cy);
    expect_close("rmsnorm rstd", gr, cr, 1e-4);
    Tensor cdx = cpu_->empty({m, d}, DType::kF32), gdx = gpu_->empty({m, d}, DType::kBF16);
    Tensor cdw = on_cpu(dw0), gdw = on_gpu(dw0, DType::kF32);
    cpu_->rmsnorm_bwd(on_cpu(x), on_cpu(w), cr, on_cpu(dy), cdx, cdw, false);
    gpu_->rmsnorm_bwd(on_gpu(x), on_gpu(w), gr, on_gpu(dy), gdx, gdw, false);
    expect_close("rmsnorm dx", gdx, cdx);
    expect_close("rmsnorm dw", gdw, cdw);
    // The residual's gradient folded in: dx += the norm's gradient.
    Tensor res = rand({m, d}, 54, 3.0);
    Tensor cacc = on_cpu(res), gacc = on_gpu(res);
    cpu_->rmsnorm_bwd(on_cpu(x), on_cpu(w), cr, on_cpu(dy), cacc, cdw, true);
    gpu_->rmsnorm_bwd(on_gpu(x), on_gpu(w), gr, on_gpu(dy), gacc, gdw, true);
    expect_close("rmsnorm dx accumulated", gacc, cacc);
    expect_close("rmsnorm dw twice", gdw, cdw);
  }
}

// Rows of 32 V 16-byte vectors take the backward with the weight gradient folded in: dx has the
// bits of the separate passes (out of place, accumulated, in place over dy), dw is close to theirs
// and to the CPU's, and the same bits on a second run. Widths: bf16 d = 1024 (Qwen3's, V = 4),
// 2048 (V = 8), 768 (V = 3); f32 d = 512 (V = 4); 3001 rows (several row strides a warp).
TEST_F(CudaConsistency, RmsNormBackwardFoldedWeightGradient) {
  const struct {
    DType dt;
    int64_t d;
  } cases[] = {{DType::kBF16, 1024}, {DType::kBF16, 2048}, {DType::kBF16, 768}, {DType::kF32, 512}};
  const int64_t m = 3001;
  cudaStream_t stream = cuda_compute_stream(*gpu_);
  for (const auto& k : cases) {
    const int64_t d = k.d;
    SCOPED_TRACE("d=" + std::to_string(d) + (k.dt == DType::kBF16 ? " bf16" : " f32"));
    Tensor x = rand({m, d}, 70, 2.0, 0.3), w = rand({d}, 71, 0.5, 1.0), dy = rand({m, d}, 72);
    Tensor res = rand({m, d}, 73, 3.0), dw0 = rand({d}, 74);
    Tensor cr = cpu_->empty({m}, DType::kF32), cy = cpu_->empty({m, d}, DType::kF32);
    cpu_->rmsnorm_fwd(on_cpu(x), on_cpu(w), 1e-5, cy, cr);
    const Tensor gx = on_gpu(x, k.dt), gw = on_gpu(w, k.dt), gdy = on_gpu(dy, k.dt);
    Tensor gy = gpu_->empty({m, d}, k.dt), gr = gpu_->empty({m}, DType::kF32);
    gpu_->rmsnorm_fwd(gx, gw, 1e-5, gy, gr);
    // mode 0: out of place; 1: dx += the gradient; 2: in place over dy.
    for (int mode = 0; mode < 3; ++mode) {
      SCOPED_TRACE("mode " + std::to_string(mode));
      const auto run = [&](bool fold, Tensor& dx, Tensor& dw) {
        dx = mode == 1 ? on_gpu(res, k.dt) : gpu_->empty({m, d}, k.dt);
        if (mode == 2) gpu_->copy(gdy, dx);
        const void* dy_ptr = mode == 2 ? dx.raw() : gdy.raw();
        dw = on_gpu(dw0, DType::kF32);
        cuda::launch_rmsnorm_bwd(gx.raw(), k.dt, gw.raw(), k.dt, gr.data<float>(), dy_ptr, dx.raw(),
                                 dw.data<float>(), m, d, mode == 1, cuda_device_allocator(0),
                                 stream, fold);
      };
      Tensor dx_sep, dw_sep, dx_fold, dw_fold, dx_again, dw_again;
      run(false, dx_sep, dw_sep);
      run(true, dx_fold, dw_fold);
      run(true, dx_again, dw_again);
      EXPECT_EQ(gpu_values(dx_fold), gpu_values(dx_sep)) << "dx differs from the separate passes";
      EXPECT_EQ(gpu_values(dw_again), gpu_values(dw_fold)) << "dw differs between two runs";
      EXPECT_LE(rel_err(gpu_values(dw_fold), gpu_values(dw_sep)), 1e-5);
      Tensor cdx = mode == 1 ? on_cpu(res) : cpu_->empty({m, d}, DType::kF32);
      Tensor cdw = on_cpu(dw0);
      cpu_->rmsnorm_bwd(on_cpu(x), on_cpu(w), cr, on_cpu(dy), cdx, cdw, mode == 1);
      expect_close("dx", dx_fold, cdx);
      expect_close("dw", dw_fold, cdw);
    }
  }
}

TEST_F(CudaConsistency, RopeForwardAndInverse) {
  // Head dim 64: the 16-byte-vector kernel; 36 (18 pairs): the scalar one.
  for (const int64_t d : {int64_t{64}, int64_t{36}}) {
    SCOPED_TRACE("head_dim=" + std::to_string(d));
    const int64_t n = 33, h = 5, n_pos = 50;
    Tensor cs = Tensor::host({n_pos, d / 2}, DType::kF32),
           sn = Tensor::host({n_pos, d / 2}, DType::kF32);
    for (int64_t p = 0; p < n_pos; ++p) {
      for (int64_t i = 0; i < d / 2; ++i) {
        const double ang = p * std::pow(10000.0, -2.0 * i / d);
        cs.data<float>()[p * d / 2 + i] = static_cast<float>(std::cos(ang));
        sn.data<float>()[p * d / 2 + i] = static_cast<float>(std::sin(ang));
      }
    }
    RopeTable ct{on_cpu(cs), on_cpu(sn)}, gt{on_gpu(cs, DType::kF32), on_gpu(sn, DType::kF32)};
    Tensor pos = ints(rand_ids(n, n_pos, 60));
    Tensor x = rand({n, h, d}, 61);
    for (bool inverse : {false, true}) {
      Tensor cx = on_cpu(x), gx = on_gpu(x);
      cpu_->rope(cx, 4, on_cpu(pos), ct, inverse);
      gpu_->rope(gx, 4, on_gpu(pos), gt, inverse);
      expect_close(inverse ? "rope inverse" : "rope", gx, cx);
    }
  }
}

// Heads of 64 and 128 (Vec16 rows: 8 and 16 lanes a head, with a last warp only partly full at
// 290 rows; 600 tokens: several blocks, each warp over many row groups, for the weight
// gradients folded into the backward) and of 40 (the one-element-a-lane kernels).
TEST_F(CudaConsistency, QkNorm) {
  for (auto [n, d, hq, hkv] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{29, 64, 4, 2},
                               {29, 64, 4, 3},
                               {29, 128, 4, 3},
                               {600, 128, 4, 2},
                               {29, 40, 2, 1}}) {
    SCOPED_TRACE("n=" + std::to_string(n) + " d=" + std::to_string(d) +
                 " hq=" + std::to_string(hq));
    check_qk_norm(n, d, hq, hkv);
  }
}

void CudaConsistency::check_qk_norm(int64_t n, int64_t d, int64_t hq, int64_t hkv) {
  const int64_t h = hq + 2 * hkv;
  Tensor x = rand({n, h, d}, 70, 1.5), qw = rand({d}, 71, 0.3, 1.0), kw = rand({d}, 72, 0.3, 1.0);
  Tensor dout = rand({n, h, d}, 73);
  Tensor cy = cpu_->empty({n, h, d}, DType::kF32), cr = cpu_->empty({n, hq + hkv}, DType::kF32);
  Tensor gy = gpu_->empty({n, h, d}, DType::kBF16), gr = gpu_->empty({n, hq + hkv}, DType::kF32);
  cpu_->qk_norm_fwd(on_cpu(x), on_cpu(qw), on_cpu(kw), hq, hkv, 1e-6, cy, cr);
  gpu_->qk_norm_fwd(on_gpu(x), on_gpu(qw), on_gpu(kw), hq, hkv, 1e-6, gy, gr);
  expect_close("qk_norm y", gy, cy);
  expect_close("qk_norm rstd", gr, cr);
  Tensor cdx = cpu_->empty({n, h, d}, DType::kF32), gdx = gpu_->empty({n, h, d}, DType::kBF16);
  Tensor cdq = cpu_->zeros({d}, DType::kF32), cdk = cpu_->zeros({d}, DType::kF32);
  Tensor gdq = gpu_->zeros({d}, DType::kF32), gdk = gpu_->zeros({d}, DType::kF32);
  cpu_->qk_norm_bwd(on_cpu(x), on_cpu(qw), on_cpu(kw), hq, hkv, cr, on_cpu(dout), cdx, cdq, cdk);
  gpu_->qk_norm_bwd(on_gpu(x), on_gpu(qw), on_gpu(kw), hq, hkv, gr, on_gpu(dout), gdx, gdq, gdk);
  expect_close("qk_norm dx", gdx, cdx);
  expect_close("qk_norm dqw", gdq, cdq);
  expect_close("qk_norm dkw", gdk, cdk);
  // In place (dx over dout): the same bits, the weight gradients too.
  Tensor inplace = on_gpu(dout), dq2 = gpu_->zeros({d}, DType::kF32),
         dk2 = gpu_->zeros({d}, DType::kF32);
  gpu_->qk_norm_bwd(on_gpu(x), on_gpu(qw), on_gpu(kw), hq, hkv, gr, inplace, inplace, dq2, dk2);
  EXPECT_EQ(gpu_values(inplace), gpu_values(gdx));
  EXPECT_EQ(gpu_values(dq2), gpu_values(gdq));
  EXPECT_EQ(gpu_values(dk2), gpu_values(gdk));
}

// ---- attention
// ------------------------------------------------------------------------------------

struct AttnCase {
  const char* name;
  int hq, hkv, d, window;
  bool sinks;
  std::vector<std::vector<int>> rows;  // sequence lengths per row
};
// Test listings show the case's name rather than its bytes.
void PrintTo(const AttnCase& c, std::ostream* os) { *os << c.name; }

// Every attention path the backend ships: its own tiled kernels, cuDNN with the deterministic
// backward (the default), and cuDNN's faster backward.
enum class AttnPath { kTiled, kCudnn, kCudnnFast };
const char* path_name(AttnPath p) {
  return p == AttnPath::kTiled ? "tiled" : p == AttnPath::kCudnn ? "cudnn" : "cudnn_fast";
}

class CudaAttention : public CudaConsistency,
                      public ::testing::WithParamInterface<std::tuple<AttnCase, AttnPath>> {
 protected:
  void SetUp() override {
    CudaConsistency::SetUp();
    if (IsSkipped()) return;
    const AttnPath path = std::get<1>(GetParam());
    CudaBackendOptions o;
    o.attention = path == AttnPath::kTiled ? AttentionImpl::kTiled : AttentionImpl::kCudnn;
    o.deterministic = path != AttnPath::kCudnnFast;
    try {
      gpu_ = make_cuda_backend(0, o);
    } catch (const UserError& e) {
      GTEST_SKIP() << "cuDNN attention unavailable here: " << e.what();
    }
  }
};

TEST_P(CudaAttention, ForwardBackward) {
  const AttnCase& c = std::get<0>(GetParam());
  const bool deterministic = std::get<1>(GetParam()) != AttnPath::kCudnnFast;
  const PackedBatch batch = make_batch(c.rows);
  const int64_t n = batch.num_tokens(), h = c.hq + 2 * c.hkv;
  AttentionShape shape;
  shape.n_heads = c.hq;
  shape.n_kv_heads = c.hkv;
  shape.head_dim = c.d;
  shape.window = c.window;
  shape.scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  Tensor qkv = rand({n, h, c.d}, 100, 1.5), dout = rand({n, c.hq, c.d}, 101);
  Tensor sinks = c.sinks ? rand({c.hq}, 102, 1.0) : Tensor();
  Tensor ds0 = rand({c.hq}, 103);

  BatchMeta cm = cpu_->upload_batch(batch), gm = gpu_->upload_batch(batch);
  Tensor cqkv = on_cpu(qkv), gqkv = on_gpu(qkv);
  Tensor cs = c.sinks ? on_cpu(sinks) : Tensor(), gs = c.sinks ? on_gpu(sinks) : Tensor();
  Tensor co = cpu_->empty({n, c.hq, c.d}, DType::kF32), cl = cpu_->empty({n, c.hq}, DType::kF32);
  Tensor go = gpu_->empty({n, c.hq, c.d}, DType::kBF16), gl = gpu_->empty({n, c.hq}, DType::kF32);
  cpu_->attention_fwd(cqkv, cs, cm, shape, co, cl);
  gpu_->attention_fwd(gqkv, gs, gm, shape, go, gl);
  expect_close("attention out", go, co, kAttnTol);
  expect_close("attention lse", gl, cl, kAttnTol);
  if (deterministic) {
    EXPECT_EQ(cuda_attention_tuned_graphs(*gpu_), 0) << "plans timed under deterministic=true";
  } else {
    // attention_autotune: the first forward also timed every plan cuDNN offers for the graph
    // (reading the outputs back waited for them); this one runs the fastest, which agrees too.
    Tensor go2 = gpu_->empty({n, c.hq, c.d}, DType::kBF16);
    Tensor gl2 = gpu_->empty({n, c.hq}, DType::kF32);
    gpu_->attention_fwd(gqkv, gs, gm, shape, go2, gl2);
    expect_close("attention out, tuned plan", go2, co, kAttnTol);
    expect_close("attention lse, tuned plan", gl2, cl, kAttnTol);
    std::cout << c.name << ": attention graphs tuned " << cuda_attention_tuned_graphs(*gpu_)
              << "\n";
    EXPECT_LE(cuda_attention_tuned_graphs(*gpu_), 1);
  }

  Tensor cd = cpu_->empty({n, h, c.d}, DType::kF32), gd = gpu_->empty({n, h, c.d}, DType::kBF16);
  Tensor cds = on_cpu(ds0), gds = on_gpu(ds0, DType::kF32);
  cpu_->attention_bwd(cqkv, cs, cm, shape, co, cl, on_cpu(dout), cd, cds);
  gpu_->attention_bwd(gqkv, gs, gm, shape, go, gl, on_gpu(dout), gd, gds);
  // dq, dk, dv separately, so a failure says which.
  const std::vector<double> gv = gpu_values(gd), cv = cpu_values(cd);
  const char* parts[3] = {"dq", "dk", "dv"};
  const int64_t h0[3] = {0, c.hq, c.hq + c.hkv}, h1[3] = {c.hq, c.hq + c.hkv, h};
  for (int p = 0; p < 3; ++p) {
    std::vector<double> a, b;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t hh = h0[p]; hh < h1[p]; ++hh)
        for (int64_t i = 0; i < c.d; ++i) {
          a.push_back(gv[(t * h + hh) * c.d + i]);
          b.push_back(cv[(t * h + hh) * c.d + i]);
        }
    const double e = rel_err(a, b);
    EXPECT_LE(e, kAttnTol) << c.name << " " << parts[p] << ": relative error " << e;
  }
  if (c.sinks) expect_close("attention dsinks", gds, cds, kAttnTol);

  if (!deterministic) return;
  // Deterministic: a second backward gives the same bits.
  Tensor gd2 = gpu_->empty({n, h, c.d}, DType::kBF16);
  Tensor gds2 = on_gpu(ds0, DType::kF32);
  gpu_->attention_bwd(gqkv, gs, gm, shape, go, gl, on_gpu(dout), gd2, gds2);
  EXPECT_EQ(gpu_values(gd2), gv) << "attention_bwd is not deterministic";
  if (c.sinks) {
    EXPECT_EQ(gpu_values(gds2), gpu_values(gds)) << "dsinks not deterministic";
  }
}

const std::vector<std::vector<int>> kMixedRows = {{1, 70, 129, 5}, {200, 3, 2}, {64, 64, 77}};

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaAttention,
    ::testing::Combine(
        ::testing::Values(
            AttnCase{"d64_gqa_sinks", 4, 2, 64, 0, true, kMixedRows},
            AttnCase{"d64_window_sinks", 4, 2, 64, 16, true, kMixedRows},
            AttnCase{"d128_mqa_window", 4, 1, 128, 40, false, kMixedRows},
            AttnCase{"d128_full", 2, 2, 128, 0, true, {{300}, {1, 1, 298}}},
            AttnCase{"d64_window_longer_than_seq", 2, 1, 64, 1000, false, {{150, 55, 95}}},
            AttnCase{"d64_window1", 2, 1, 64, 1, true, {{100, 3}}},
            AttnCase{"d128_gqa4_long", 8, 2, 128, 0, true, {{700, 1, 323}}},
            AttnCase{"d64_window128_long", 8, 1, 64, 128, true, {{1024}, {3, 1021}}},
            AttnCase{"d32_simple", 3, 1, 32, 20, true, kMixedRows},
            AttnCase{"d80_simple", 2, 2, 80, 0, false, {{90, 1, 40}}},
            AttnCase{"d64_gptoss_heads_docs", 64, 8, 64, 0, true, {{600, 1, 300, 123}}},
            AttnCase{"d64_gptoss_window128_docs", 64, 8, 64, 128, true, {{700, 63, 261}}},
            // Sequences of one length (a multiple of 64): cuDNN's plain, unpadded layout.
            AttnCase{"d64_equal_rows_sinks", 8, 2, 64, 0, true, {{256}, {256}, {256}}},
            AttnCase{"d128_equal_rows_window", 4, 1, 128, 40, false, {{128}, {128}}}),
        ::testing::Values(AttnPath::kTiled, AttnPath::kCudnn, AttnPath::kCudnnFast)),
    [](const ::testing::TestParamInfo<std::tuple<AttnCase, AttnPath>>& info) {
      return std::string(std::get<0>(info.param).name) + "_" + path_name(std::get<1>(info.param));
    });

// The cached metadata (upload_batch) and the per-layer rebuild give the same attention, bit for
// bit; only the rebuild synchronizes.
TEST_F(CudaConsistency, CachedAndRebuiltMetadataAgree) {
  const PackedBatch batch = make_batch({{1, 70, 129, 5, 51}, {256}, {100, 100, 56}});
  const int64_t n = batch.num_tokens();
  AttentionShape shape{4, 2, 64, 32, 0.125};
  Tensor qkv = on_gpu(rand({n, 8, 64}, 110)), sinks = on_gpu(rand({4}, 111));

  const int64_t s0 = gpu_->syncs().get(SyncCause::kMetadata);
  BatchMeta cached = gpu_->upload_batch(batch);
  EXPECT_EQ(gpu_->syncs().get(SyncCause::kMetadata), s0);
  Tensor o1 = gpu_->empty({n, 4, 64}, DType::kBF16), l1 = gpu_->empty({n, 4}, DType::kF32);
  gpu_->attention_fwd(qkv, sinks, cached, shape, o1, l1);
  EXPECT_EQ(gpu_->syncs().get(SyncCause::kMetadata), s0) << "cached path synchronized";

  BatchMeta rebuilt = gpu_->upload_batch(batch);
  gpu_->rebuild_metadata(rebuilt);
  EXPECT_EQ(gpu_->syncs().get(SyncCause::kMetadata), s0 + 1);
  EXPECT_EQ(rebuilt.n_seqs, batch.num_seqs());
  EXPECT_EQ(rebuilt.max_seqlen, batch.max_seqlen);
  EXPECT_EQ(gpu_values(rebuilt.cu_seqlens), gpu_values(cached.cu_seqlens));
  Tensor o2 = gpu_->empty({n, 4, 64}, DType::kBF16), l2 = gpu_->empty({n, 4}, DType::kF32);
  gpu_->attention_fwd(qkv, sinks, rebuilt, shape, o2, l2);
  EXPECT_EQ(gpu_values(o1), gpu_values(o2));
  EXPECT_EQ(gpu_values(l1), gpu_values(l2));
  EXPECT_EQ(gpu_values(cached.inputs),
            std::vector<double>(batch.inputs.begin(), batch.inputs.end()));
  EXPECT_EQ(gpu_values(cached.targets),
            std::vector<double>(batch.targets.begin(), batch.targets.end()));
}

// ---- feed-forward
// ---------------------------------------------------------------------------------

TEST_F(CudaConsistency, Glu) {
  // f = 96: the 16-byte-vector kernels; f = 93: the scalar ones.
  for (const int64_t f : {int64_t{96}, int64_t{93}}) {
    const int64_t m = 50;
    for (GluKind kind : {GluKind::kSwiGLU, GluKind::kGptOss}) {
      SCOPED_TRACE("f=" + std::to_string(f) + " kind=" + std::to_string(static_cast<int>(kind)));
      GluParams p;
      p.kind = kind;
      Tensor hh = rand({m, 2 * f}, 120, kind == GluKind::kGptOss ? 5.0 : 2.0),
             da = rand({m, f}, 121);
      Tensor ca = cpu_->empty({m, f}, DType::kF32), ga = gpu_->empty({m, f}, DType::kBF16);
      cpu_->glu_fwd(on_cpu(hh), p, ca);
      gpu_->glu_fwd(on_gpu(hh), p, ga);
      expect_close("glu fwd", ga, ca);
      Tensor cdh = cpu_->empty({m, 2 * f}, DType::kF32),
             gdh = gpu_->empty({m, 2 * f}, DType::kBF16);
      cpu_->glu_bwd(on_cpu(hh), on_cpu(da), p, cdh);
      gpu_->glu_bwd(on_gpu(hh), on_gpu(da), p, gdh);
      expect_close("glu bwd", gdh, cdh);
    }
  }
}

// The vector kernels do per element what the scalar ones do: the same inputs one element off
// 16-byte alignment (scalar path) give the same bits.
TEST_F(CudaConsistency, GluVectorEqualsScalarBitwise) {
  const int64_t m = 33, f = 64;
  GluParams p;
  p.kind = GluKind::kGptOss;
  Tensor hh = rand({m, 2 * f}, 122, 5.0), da = rand({m, f}, 123);
  Tensor h_al = on_gpu(hh), da_al = on_gpu(da);
  // Copies that start one element into a larger buffer.
  Tensor hbuf = gpu_->empty({m * 2 * f + 1}, DType::kBF16),
         dbuf = gpu_->empty({m * f + 1}, DType::kBF16);
  Tensor h_flat = hbuf.slice(1, m * 2 * f + 1), da_flat = dbuf.slice(1, m * f + 1);
  gpu_->copy(h_al.reshape({m * 2 * f}), h_flat);
  gpu_->copy(da_al.reshape({m * f}), da_flat);
  Tensor h_un = h_flat.reshape({m, 2 * f}), da_un = da_flat.reshape({m, f});
  Tensor a_al = gpu_->empty({m, f}, DType::kBF16), abuf = gpu_->empty({m * f + 1}, DType::kBF16);
  Tensor a_un = abuf.slice(1, m * f + 1).reshape({m, f});
  gpu_->glu_fwd(h_al, p, a_al);
  gpu_->glu_fwd(h_un, p, a_un);
  EXPECT_EQ(gpu_values(a_al), gpu_values(a_un)) << "glu_fwd";
  Tensor dh_al = gpu_->empty({m, 2 * f}, DType::kBF16),
         dhbuf = gpu_->empty({m * 2 * f + 1}, DType::kBF16);
  Tensor dh_un = dhbuf.slice(1, m * 2 * f + 1).reshape({m, 2 * f});
  gpu_->glu_bwd(h_al, da_al, p, dh_al);
  gpu_->glu_bwd(h_un, da_un, p, dh_un);
  EXPECT_EQ(gpu_values(dh_al), gpu_values(dh_un)) << "glu_bwd";
}

// ---- routing
// --------------------------------------------------------------------------------------

TEST_F(CudaConsistency, RouterTopkAndAuxLoss) {
  const int64_t n = 203, e = 32;
  const int k = 4;
  Tensor logits = rand({n, e}, 130, 2.0), dw = rand({n, k}, 131);
  Tensor ci = cpu_->empty({n, k}, DType::kI32), cw = cpu_->empty({n, k}, DType::kF32);
  Tensor gi = gpu_->empty({n, k}, DType::kI32), gw = gpu_->empty({n, k}, DType::kBF16);
  cpu_->router_topk(on_cpu(logits), k, ci, cw);
  gpu_->router_topk(on_gpu(logits), k, gi, gw);
  expect_equal_ints("router_topk idx", gi, ci);
  expect_close("router_topk w", gw, cw);

  Tensor cdl = cpu_->empty({n, e}, DType::kF32), gdl = gpu_->empty({n, e}, DType::kBF16);
  cpu_->router_topk_bwd(ci, cw, on_cpu(dw), cdl);
  gpu_->router_topk_bwd(gi, gw, on_gpu(dw), gdl);
  expect_close("router_topk_bwd", gdl, cdl);

  Tensor counts = ints(rand_ids(e, 60, 132));
  Tensor dl0 = rand({n, e}, 133, 1e-5);  // the size of the loss gradient
  Tensor closs = cpu_->zeros({1}, DType::kF32), gloss = gpu_->zeros({1}, DType::kF32);
  Tensor cdl2 = on_cpu(dl0), gdl2 = on_gpu(dl0);
  cpu_->router_aux_loss(on_cpu(logits), on_cpu(counts), k, 0.01, closs, cdl2);
  gpu_->router_aux_loss(on_gpu(logits), on_gpu(counts), k, 0.01, gloss, gdl2);
  expect_close("router_aux_loss loss", gloss, closs, 1e-3);
  expect_close("router_aux_loss dlogits", gdl2, cdl2);
}

TEST_F(CudaConsistency, HistogramScanSortPermute) {
  const int64_t n = 301;
  const int k = 4, e = 9;
  const int64_t m = n * k;
  Tensor ids = ints(rand_ids(m, e, 140));
  Tensor cc = cpu_->empty({e}, DType::kI32), gc = gpu_->empty({e}, DType::kI32);
  cpu_->histogram(on_cpu(ids), e, cc);
  gpu_->histogram(on_gpu(ids), e, gc);
  expect_equal_ints("histogram", gc, cc);
  Tensor co = cpu_->empty({e + 1}, DType::kI32), go = gpu_->empty({e + 1}, DType::kI32);
  cpu_->exclusive_scan(cc, co);
  gpu_->exclusive_scan(gc, go);
  expect_equal_ints("exclusive_scan", go, co);
  Tensor cs2a = cpu_->empty({m}, DType::kI32), ca2s = cpu_->empty({m}, DType::kI32);
  Tensor gs2a = gpu_->empty({m}, DType::kI32), ga2s = gpu_->empty({m}, DType::kI32);
  cpu_->sort_by_id(on_cpu(ids), co, cs2a, ca2s);
  gpu_->sort_by_id(on_gpu(ids), go, gs2a, ga2s);
  expect_equal_ints("sort_by_id sorted_to_assign", gs2a, cs2a);
  expect_equal_ints("sort_by_id assign_to_sorted", ga2s, ca2s);

  // Rows of 40 go through the 16-byte-vector kernels, rows of 45 through the scalar ones.
  for (const int64_t d : {int64_t{40}, int64_t{45}}) {
    SCOPED_TRACE("d=" + std::to_string(d));
    Tensor x = rand({n, d}, 141), dout = rand({m, d}, 142), dx0 = rand({n, d}, 143);
    Tensor cp = cpu_->empty({m, d}, DType::kF32), gp = gpu_->empty({m, d}, DType::kBF16);
    cpu_->permute_rows(on_cpu(x), cs2a, k, cp);
    gpu_->permute_rows(on_gpu(x), gs2a, k, gp);
    expect_close("permute_rows", gp, cp);
    Tensor cdx = on_cpu(dx0), gdx = on_gpu(dx0);
    cpu_->permute_rows_bwd(on_cpu(dout), cs2a, k, cdx);
    gpu_->permute_rows_bwd(on_gpu(dout), gs2a, k, gdx);
    expect_close("permute_rows_bwd", gdx, cdx);

    Tensor y = rand({m, d}, 144), w = rand({n, k}, 145, 0.3, 0.25), dcomb = rand({n, d}, 146);
    Tensor cu = cpu_->empty({n, d}, DType::kF32), gu = gpu_->empty({n, d}, DType::kBF16);
    cpu_->unpermute_combine(on_cpu(y), ca2s, on_cpu(w), cu);
    gpu_->unpermute_combine(on_gpu(y), ga2s, on_gpu(w), gu);
    expect_close("unpermute_combine", gu, cu);
    Tensor cdy = cpu_->empty({m, d}, DType::kF32), gdy = gpu_->empty({m, d}, DType::kBF16);
    Tensor cdw = cpu_->empty({n, k}, DType::kF32), gdw = gpu_->empty({n, k}, DType::kBF16);
    cpu_->unpermute_combine_bwd(on_cpu(dcomb), on_cpu(y), ca2s, on_cpu(w), cdy, cdw);
    gpu_->fill(gdy, std::nan(""));  // as many rows as assignments: each row written, none filled
    gpu_->unpermute_combine_bwd(on_gpu(dcomb), on_gpu(y), ga2s, on_gpu(w), gdy, gdw);
    expect_close("unpermute_combine_bwd dy", gdy, cdy);
    expect_close("unpermute_combine_bwd dw", gdw, cdw);
    // y with 3 rows more than assignments: those rows' gradient is zero.
    Tensor y3 = rand({m + 3, d}, 147);
    Tensor cdy3 = cpu_->empty({m + 3, d}, DType::kF32),
           gdy3 = gpu_->empty({m + 3, d}, DType::kBF16);
    cpu_->unpermute_combine_bwd(on_cpu(dcomb), on_cpu(y3), ca2s, on_cpu(w), cdy3, cdw);
    gpu_->fill(gdy3, std::nan(""));
    gpu_->unpermute_combine_bwd(on_gpu(dcomb), on_gpu(y3), ga2s, on_gpu(w), gdy3, gdw);
    expect_close("unpermute_combine_bwd dy, spare rows", gdy3, cdy3);
    const std::vector<double> spare = gpu_values(gdy3.slice(m, m + 3));
    EXPECT_TRUE(std::all_of(spare.begin(), spare.end(), [](double v) { return v == 0.0; }))
        << "rows no assignment reads must be zero";
  }
}

// ---- embedding and loss
// ---------------------------------------------------------------------------

TEST_F(CudaConsistency, Embedding) {
  // The backward sums each id's tokens in tiles of 32 sorted positions and merges the pieces of
  // runs that cross tiles: ids with short runs, one run over many tiles (as the padding's EOT
  // makes), and a batch of a single id.
  const int64_t v = 1000, n = 777;
  struct Ids {
    const char* name;
    std::vector<int32_t> ids;
  };
  std::vector<Ids> cases{{"short runs", rand_ids(n, 50, 153)},
                         {"long run", rand_ids(n, v, 154)},
                         {"one id", std::vector<int32_t>(static_cast<size_t>(n), 11)}};
  cases[0].ids[5] = static_cast<int32_t>(v - 1);
  for (int64_t i = 0; i < n; i += 3) cases[1].ids[static_cast<size_t>(i)] = 7;  // 259 tokens
  // Rows of 72 go through the 16-byte-vector kernels, rows of 75 through the scalar ones.
  for (const int64_t d : {int64_t{72}, int64_t{75}}) {
    for (const Ids& c : cases) {
      SCOPED_TRACE(std::string(c.name) + " d=" + std::to_string(d));
      Tensor table = rand({v, d}, 150), dout = rand({n, d}, 151), dt0 = rand({v, d}, 152);
      Tensor ids = ints(c.ids);
      Tensor co = cpu_->empty({n, d}, DType::kF32), go = gpu_->empty({n, d}, DType::kBF16);
      cpu_->embedding_fwd(on_cpu(table), on_cpu(ids), co);
      gpu_->embedding_fwd(on_gpu(table), on_gpu(ids), go);
      expect_close("embedding_fwd", go, co);
      Tensor cdt = on_cpu(dt0), gdt = on_gpu(dt0, DType::kF32), gdt2 = on_gpu(dt0, DType::kF32);
      cpu_->embedding_bwd(on_cpu(dout), on_cpu(ids), cdt);
      gpu_->embedding_bwd(on_gpu(dout), on_gpu(ids), gdt);
      expect_close("embedding_bwd", gdt, cdt, 1e-3);
      // The sums do not depend on scheduling: a second run gives the same bits.
      gpu_->embedding_bwd(on_gpu(dout), on_gpu(ids), gdt2);
      const std::vector<double> a = gpu_values(gdt), b = gpu_values(gdt2);
      EXPECT_TRUE(a == b) << "embedding_bwd differs between two runs";
    }
  }
}

TEST_F(CudaConsistency, CrossEntropy) {
  struct Case {
    int64_t n, v;
  };
  for (Case c : {Case{37, 5003}, Case{3, 201088}}) {
    Tensor logits = rand({c.n, c.v}, 160, 2.0);
    std::vector<int32_t> tg = rand_ids(c.n, c.v, 161);
    tg[1] = -1;
    Tensor targets = ints(tg);
    Tensor cl = on_cpu(logits), gl = on_gpu(logits);
    Tensor closs = cpu_->zeros({1}, DType::kF32), gloss = gpu_->zeros({1}, DType::kF32);
    cpu_->cross_entropy(cl, on_cpu(targets), 0.5, closs);
    gpu_->cross_entropy(gl, on_gpu(targets), 0.5, gloss);
    expect_close("cross_entropy loss", gloss, closs, 1e-4);
    expect_close("cross_entropy grad", gl, cl);
  }
}

// ---- optimizer
// ------------------------------------------------------------------------------------

TEST_F(CudaConsistency, SumSquaresAndAdamW) {
  Tensor x = rand({12345}, 170);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    Tensor ca = cpu_->zeros({1}, DType::kF32), ga = gpu_->zeros({1}, DType::kF32);
    cpu_->sum_squares(on_cpu(x), ca);
    gpu_->sum_squares(on_gpu(x, dt), ga);
    expect_close("sum_squares", ga, ca, 1e-5);
  }
  const int64_t n = 4099;
  Tensor w = rand({n}, 171), g = rand({n}, 172), m0 = rand({n}, 173, 0.1);
  Tensor v0 = rand({n}, 174, 0.01, 0.05);
  AdamWParams p;
  p.lr = 1e-2;
  p.weight_decay = 0.1;
  p.step = 3;
  p.grad_scale = 0.7;
  Tensor cw = on_cpu(w), cm = on_cpu(m0), cv = on_cpu(v0), cwork;
  Tensor gw = on_gpu(w, DType::kF32), gm = on_gpu(m0, DType::kF32), gv = on_gpu(v0, DType::kF32);
  Tensor gwork = gpu_->empty({n}, DType::kBF16);
  cpu_->adamw(cw, on_cpu(g), cm, cv, p, cwork);
  gpu_->adamw(gw, on_gpu(g, DType::kF32), gm, gv, p, gwork);
  expect_close("adamw master", gw, cw, 1e-5);
  expect_close("adamw m", gm, cm, 1e-5);
  expect_close("adamw v", gv, cv, 1e-5);
  expect_close("adamw working", gwork, cw, 1e-2);
}

}  // namespace
}  // namespace hp
