// The optimizer's many-tensor ops on the GPU: adamw_many gives every tensor the bits of adamw on
// it alone (sizes from 1 to 1M, weight decay on and off, bf16, f32 and no working copy, slices at
// offsets that rule out 16-byte accesses, more tensors than one launch takes); sum_squares_many
// matches a double-precision host sum within fp32 rounding and repeats its bits, whatever the
// alignment of its tensors. Zero gradients and flagged tensors (unread, NaN in memory) give the
// bits of real zeros.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "framework/backend/cuda/cuda_backend.h"
#include "tests/gpu/gpu_fixtures.h"

namespace hp {
namespace {

Tensor to_host(Backend& be, const Tensor& t) {
  Tensor h = Tensor::host(t.shape(), t.dtype());
  be.read_to_host(t, h, SyncCause::kOther);
  return h;
}

bool same_bits(Backend& be, const Tensor& a, const Tensor& b) {
  const Tensor ha = to_host(be, a), hb = to_host(be, b);
  return ha.dtype() == hb.dtype() && ha.numel() == hb.numel() &&
         std::memcmp(ha.raw(), hb.raw(), ha.nbytes()) == 0;
}

std::vector<float> random_values(int64_t n, std::mt19937& rng, float scale, bool positive) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = (positive ? std::fabs(normal(rng)) : normal(rng)) * scale;
  return v;
}

// A device tensor of n elements `offset` elements into a buffer of its own (offset 0: the
// allocator's alignment; else one that 16-byte accesses do not fit), holding the first n of
// `values` (converted to dtype) or uninitialized.
Tensor placed(Backend& be, int64_t n, int64_t offset, DType dtype,
              const std::vector<float>* values) {
  Tensor buf = be.empty({n + offset}, dtype);
  Tensor t = buf.slice(offset, offset + n);
  if (values) {
    const Tensor host = Tensor::host_from(
        std::vector<float>(values->begin(), values->begin() + static_cast<size_t>(n)), DType::kF32);
    if (dtype == DType::kF32) {
      be.copy(host, t);
    } else {
      Tensor f = be.upload(host);
      be.convert(f, t);
    }
  }
  return t;
}

const int64_t kSizes[] = {1, 3, 1000, 4097, 1 << 20, 4, 5, 4096, 16385, 65537, 12345, 2, 7, 777};

// Working copies: none, bf16, f32, or the f32 master itself (which counts as none).
enum class Working { kNone, kBF16, kF32, kMaster };

TEST(CudaAdamWMany, EqualsAdamWPerTensorBitwise) {
  HP_REQUIRE_GPU();
  auto be = make_cuda_backend(0, CudaBackendOptions{});
  std::mt19937 rng(5);
  struct Case {
    int64_t n, offset;    // offset into its buffers, in elements, for every tensor of the entry
    int64_t work_offset;  // the working copy's
    Working working;
    bool decay;
    bool grad_zero;  // adamw_many's grad holds NaN, unread; adamw's holds zeros
    std::vector<float> master, grad, m, v;
  };
  // 140 tensors: more than one launch's 64 entries in the group of no or f32 working copies.
  std::vector<Case> cases;
  for (int i = 0; i < 140; ++i) {
    Case c;
    c.n = kSizes[static_cast<size_t>(i) % (sizeof(kSizes) / sizeof(kSizes[0]))];
    c.offset = i % 5 == 4 ? 1 : i % 7 == 6 ? 2 : 0;  // 4 or 8 bytes off 16-byte alignment
    c.working = static_cast<Working>(i % 4 == 3 ? (i / 4) % 4 : i % 3);
    c.work_offset = c.offset;
    if (i % 11 == 10) {  // an f32 working copy 8 bytes off 16-byte alignment (i = 32: 1M aligned)
      c.working = Working::kF32;
      c.work_offset = c.offset + 2;
    }
    c.decay = i % 2 == 0;
    c.grad_zero = i % 3 == 2;
    c.master = random_values(c.n, rng, 1.f, false);
    c.grad = random_values(c.n, rng, 0.3f, false);
    c.m = random_values(c.n, rng, 0.1f, false);
    c.v = random_values(c.n, rng, 0.05f, true);
    cases.push_back(std::move(c));
  }
  struct Set {
    Tensor master, grad, m, v, working;
  };
  std::vector<Set> sets[2];  // [0]: adamw_many, [1]: adamw per tensor
  for (auto& s : sets) {
    for (const Case& c : cases) {
      Set t;
      t.master = placed(*be, c.n, c.offset, DType::kF32, &c.master);
      t.grad = placed(*be, c.n, c.offset, DType::kF32, &c.grad);
      if (c.grad_zero) be->fill(t.grad, &s == &sets[0] ? std::nan("") : 0.0);
      t.m = placed(*be, c.n, c.offset, DType::kF32, &c.m);
      t.v = placed(*be, c.n, c.offset, DType::kF32, &c.v);
      if (c.working == Working::kBF16) {
        t.working = placed(*be, c.n, c.work_offset, DType::kBF16, nullptr);
      }
      if (c.working == Working::kF32) {
        t.working = placed(*be, c.n, c.work_offset, DType::kF32, nullptr);
      }
      if (c.working == Working::kMaster) t.working = t.master;
      s.push_back(t);
    }
  }
  // An empty tensor among them changes nothing.
  Set empty{be->empty({0}, DType::kF32), be->empty({0}, DType::kF32), be->empty({0}, DType::kF32),
            be->empty({0}, DType::kF32), Tensor()};
  AdamWParams p;
  p.lr = 2e-3;
  p.weight_decay = 0.1;
  p.grad_scale = 0.8;
  for (int64_t step = 1; step <= 3; ++step) {
    p.step = step;
    std::vector<Backend::AdamWEntry> entries;
    for (size_t i = 0; i < cases.size(); ++i) {
      Set& t = sets[0][i];
      entries.push_back({t.master, t.grad, t.m, t.v, t.working, cases[i].decay});
      entries.back().grad_zero = cases[i].grad_zero;
      if (i == 70) entries.push_back({empty.master, empty.grad, empty.m, empty.v, Tensor(), true});
    }
    be->adamw_many(entries, p);
    for (size_t i = 0; i < cases.size(); ++i) {
      Set& t = sets[1][i];
      AdamWParams q = p;
      q.weight_decay = cases[i].decay ? p.weight_decay : 0.0;
      be->adamw(t.master, t.grad, t.m, t.v, q, t.working);
    }
  }
  int moved = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    SCOPED_TRACE(testing::Message() << "tensor " << i << " n=" << c.n << " offset=" << c.offset
                                    << " working offset=" << c.work_offset
                                    << " working=" << static_cast<int>(c.working)
                                    << " decay=" << c.decay << " grad_zero=" << c.grad_zero);
    const Set &a = sets[0][i], &b = sets[1][i];
    EXPECT_TRUE(same_bits(*be, a.master, b.master));
    EXPECT_TRUE(same_bits(*be, a.m, b.m));
    EXPECT_TRUE(same_bits(*be, a.v, b.v));
    if (a.working.defined()) {
      EXPECT_TRUE(same_bits(*be, a.working, b.working));
    }
    const Tensor h = to_host(*be, a.master);
    moved += std::memcmp(h.raw(), c.master.data(), h.nbytes()) != 0 ? 1 : 0;
  }
  EXPECT_EQ(moved, static_cast<int>(cases.size()));
}

TEST(CudaSumSquaresMany, MatchesAHostSumAndRepeatsBitwise) {
  HP_REQUIRE_GPU();
  auto be = make_cuda_backend(0, CudaBackendOptions{});
  std::mt19937 rng(9);
  std::vector<Tensor> xs;
  double host_sum = 0.5;  // acc's start
  for (int i = 0; i < 160; ++i) {
    const int64_t n = kSizes[static_cast<size_t>(i) % (sizeof(kSizes) / sizeof(kSizes[0]))];
    const DType t = i % 6 == 5 ? DType::kBF16 : DType::kF32;
    const int64_t offset = i % 5 == 4 ? 1 : 0;
    const std::vector<float> v = random_values(n, rng, 0.5f + static_cast<float>(i % 3), false);
    xs.push_back(placed(*be, n, offset, t, &v));
    for (double x : to_double_vector(to_host(*be, xs.back()))) host_sum += x * x;  // as stored
    if (i == 80) xs.push_back(be->empty({0}, DType::kF32));
  }
  Tensor accs[2];
  for (Tensor& acc : accs) {
    acc = be->upload(Tensor::host_from<float>({0.5f}, DType::kF32));
    be->sum_squares_many(xs, acc);
  }
  EXPECT_TRUE(same_bits(*be, accs[0], accs[1]));
  const double got = to_double_vector(to_host(*be, accs[0]))[0];
  EXPECT_NEAR(got, host_sum, 1e-5 * host_sum);
  EXPECT_GT(host_sum, 1e6);
  // The per-tensor op agrees within the same rounding.
  Tensor loop = be->upload(Tensor::host_from<float>({0.5f}, DType::kF32));
  for (const Tensor& x : xs) be->sum_squares(x, loop);
  EXPECT_NEAR(to_double_vector(to_host(*be, loop))[0], host_sum, 1e-5 * host_sum);
  // Alignment changes no bit: the same values at the allocator's alignment and off it.
  for (DType t : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(t));
    const std::vector<float> v = random_values(100003, rng, 1.f, false);
    Tensor sums[2];
    for (int offset = 0; offset < 2; ++offset) {
      sums[offset] = be->zeros({1}, DType::kF32);
      be->sum_squares_many({placed(*be, 100003, offset, t, &v), placed(*be, 5, offset, t, &v)},
                           sums[offset]);
    }
    EXPECT_TRUE(same_bits(*be, sums[0], sums[1]));
    EXPECT_GT(to_double_vector(to_host(*be, sums[0]))[0], 1e4);
  }
  // Flagged tensors count as zeros, unread (NaN here): the bits of real zeros in their place.
  std::vector<Tensor> flagged_xs, zeroed_xs;
  std::vector<char> unwritten;
  for (size_t i = 0; i < xs.size(); ++i) {
    const bool flag = i % 4 == 1;
    unwritten.push_back(flag ? 1 : 0);
    flagged_xs.push_back(flag ? be->empty(xs[i].shape(), xs[i].dtype()) : xs[i]);
    zeroed_xs.push_back(flag ? be->zeros(xs[i].shape(), xs[i].dtype()) : xs[i]);
    if (flag) be->fill(flagged_xs.back(), std::nan(""));
  }
  Tensor flagged = be->zeros({1}, DType::kF32), zeroed = be->zeros({1}, DType::kF32);
  be->sum_squares_many(flagged_xs, flagged, unwritten);
  be->sum_squares_many(zeroed_xs, zeroed);
  EXPECT_TRUE(same_bits(*be, flagged, zeroed));
  EXPECT_GT(to_double_vector(to_host(*be, flagged))[0], 1e5);
}

// The gated update: update_gate gives the CPU backend's bits (the host's clip coefficient, the
// finite check), and adamw_many and adamw read the gate on the device: open, the bits of the
// update scaled on the host; closed, nothing written.
TEST(CudaGatedUpdate, GateEqualsTheCpuBackendBitwise) {
  HP_REQUIRE_GPU();
  auto cpu = make_cpu_backend(DType::kF32);
  auto gpu = make_cuda_backend(0, CudaBackendOptions{});
  std::mt19937 rng(17);
  std::uniform_real_distribution<double> mag(-6, 6);
  const double inf = std::numeric_limits<double>::infinity();
  int clipped = 0, closed = 0;
  for (int trial = 0; trial < 120; ++trial) {
    std::vector<float> s = {static_cast<float>(mag(rng)), static_cast<float>(mag(rng)),
                            static_cast<float>(std::pow(10.0, mag(rng))),
                            static_cast<float>(std::pow(10.0, mag(rng)))};
    if (trial % 9 == 8)
      s[static_cast<size_t>(trial % 4)] = static_cast<float>(trial % 2 ? inf : NAN);
    const double max_norm = trial % 10 == 0 ? 0.0 : std::pow(10.0, mag(rng) / 2);
    const Tensor hs = Tensor::host_from(s, DType::kF32);
    std::vector<double> gates[2];
    int k = 0;
    for (Backend* be : {cpu.get(), gpu.get()}) {
      const Tensor checked = be->upload(hs);
      Tensor gate = be->zeros({2}, DType::kF64);
      be->update_gate(checked, checked.slice(2, 4), max_norm, gate);
      gates[k++] = to_double_vector(to_host(*be, gate));
    }
    SCOPED_TRACE(testing::Message() << "trial " << trial << " max_norm " << max_norm);
    EXPECT_EQ(std::memcmp(gates[0].data(), gates[1].data(), 2 * sizeof(double)), 0)
        << gates[0][0] << " " << gates[0][1] << " vs " << gates[1][0] << " " << gates[1][1];
    clipped += gates[1][1] == 1.0 && gates[1][0] < 1.0;
    closed += gates[1][1] == 0.0;
  }
  EXPECT_GT(clipped, 10);
  EXPECT_GT(closed, 5);
}

TEST(CudaGatedUpdate, OpenGateIsTheHostScaleClosedGateWritesNothing) {
  HP_REQUIRE_GPU();
  auto be = make_cuda_backend(0, CudaBackendOptions{});
  std::mt19937 rng(29);
  const int kTensors = 70;  // more than one launch's 64 entries
  struct Set {
    Tensor master, grad, m, v, working;
  };
  std::vector<Set> sets[3];  // [0]: host scale, [1]: adamw_many gated, [2]: adamw gated
  std::vector<bool> decay;
  for (int i = 0; i < kTensors; ++i) {
    const int64_t n = kSizes[static_cast<size_t>(i) % (sizeof(kSizes) / sizeof(kSizes[0]))];
    const int64_t offset = i % 5 == 4 ? 1 : 0;
    const std::vector<float> w = random_values(n, rng, 1.f, false),
                             g = random_values(n, rng, 0.3f, false),
                             m = random_values(n, rng, 0.1f, false),
                             v = random_values(n, rng, 0.05f, true);
    decay.push_back(i % 2 == 0);
    for (auto& s : sets) {
      Set t;
      t.master = placed(*be, n, offset, DType::kF32, &w);
      t.grad = placed(*be, n, offset, DType::kF32, &g);
      t.m = placed(*be, n, offset, DType::kF32, &m);
      t.v = placed(*be, n, offset, DType::kF32, &v);
      if (i % 3 != 2)
        t.working = placed(*be, n, offset, i % 3 ? DType::kF32 : DType::kBF16, nullptr);
      s.push_back(t);
    }
  }
  const double scale = 0.3183;  // the gate's; the host-scaled set takes the same double
  Tensor gate = be->upload(Tensor::host_from<double>({scale, 1.0}, DType::kF64));
  auto entries_of = [&](std::vector<Set>& set) {
    std::vector<Backend::AdamWEntry> e;
    for (size_t i = 0; i < set.size(); ++i)
      e.push_back({set[i].master, set[i].grad, set[i].m, set[i].v, set[i].working, decay[i]});
    return e;
  };
  auto snapshot = [&](std::vector<Set>& set) {
    std::vector<std::vector<double>> out;
    for (Set& t : set)
      for (const Tensor* x : {&t.master, &t.m, &t.v, &t.working})
        if (x->defined()) out.push_back(gpu_test::device_values(*be, *x));
    return out;
  };
  AdamWParams p;
  p.lr = 2e-3;
  p.weight_decay = 0.1;
  for (int64_t step = 1; step <= 2; ++step) {
    p.step = step;
    AdamWParams host = p, gated = p;
    host.grad_scale = scale;
    gated.grad_scale = 7.0;  // replaced by the gate's
    gated.gate = &gate;
    be->adamw_many(entries_of(sets[0]), host);
    be->adamw_many(entries_of(sets[1]), gated);
    for (size_t i = 0; i < sets[2].size(); ++i) {
      Set& t = sets[2][i];
      AdamWParams q = gated;
      q.weight_decay = decay[i] ? p.weight_decay : 0.0;
      be->adamw(t.master, t.grad, t.m, t.v, q, t.working);
    }
  }
  for (int i = 0; i < kTensors; ++i) {
    SCOPED_TRACE(testing::Message() << "tensor " << i);
    for (int k : {1, 2}) {
      EXPECT_TRUE(same_bits(*be, sets[0][i].master, sets[k][i].master));
      EXPECT_TRUE(same_bits(*be, sets[0][i].m, sets[k][i].m));
      EXPECT_TRUE(same_bits(*be, sets[0][i].v, sets[k][i].v));
      if (sets[0][i].working.defined()) {
        EXPECT_TRUE(same_bits(*be, sets[0][i].working, sets[k][i].working));
      }
    }
  }
  // Closed: the same calls write nothing.
  gate = be->upload(Tensor::host_from<double>({scale, 0.0}, DType::kF64));
  const auto before = snapshot(sets[1]);
  const auto before_single = snapshot(sets[2]);
  p.step = 3;
  AdamWParams gated = p;
  gated.gate = &gate;
  be->adamw_many(entries_of(sets[1]), gated);
  for (size_t i = 0; i < sets[2].size(); ++i) {
    Set& t = sets[2][i];
    be->adamw(t.master, t.grad, t.m, t.v, gated, t.working);
  }
  EXPECT_EQ(snapshot(sets[1]), before);
  EXPECT_EQ(snapshot(sets[2]), before_single);
}

}  // namespace
}  // namespace hp
