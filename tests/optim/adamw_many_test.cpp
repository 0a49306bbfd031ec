// The optimizer's many-tensor ops on the reference backend: adamw_many and sum_squares_many give
// the bits of adamw and sum_squares tensor by tensor (weight decay per entry, working copies
// present and absent, odd sizes), AdamW::step and grad_sum_squares give the bits of the per-tensor
// loop, and a bad entry is refused before anything is written, the error naming the entry.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/core/error.h"
#include "framework/model/params.h"
#include "optim/adamw.h"

namespace hp {
namespace {

Tensor random_host(const Shape& shape, std::mt19937& rng, float scale, bool positive = false) {
  Tensor t = Tensor::host(shape, DType::kF32);
  std::normal_distribution<float> normal(0.f, 1.f);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i)
    p[i] = (positive ? std::fabs(normal(rng)) : normal(rng)) * scale;
  return t;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.numel() == b.numel() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// The state of one tensor's update, twice: once for the many-tensor op, once for the loop.
struct State {
  Tensor master, grad, m, v, working;
  bool weight_decay = false;
};

State make_state(Backend& be, const Shape& shape, std::mt19937& rng, DType working, bool decay) {
  State s;
  s.master = be.upload(random_host(shape, rng, 1.f));
  s.grad = be.upload(random_host(shape, rng, 0.3f));
  s.m = be.upload(random_host(shape, rng, 0.1f));
  s.v = be.upload(random_host(shape, rng, 0.05f, true));
  if (working != DType::kI32) s.working = be.empty(shape, working);  // kI32: none
  s.weight_decay = decay;
  return s;
}

State clone(Backend& be, const State& s) {
  State c;
  c.master = be.upload(s.master);
  c.grad = be.upload(s.grad);
  c.m = be.upload(s.m);
  c.v = be.upload(s.v);
  if (s.working.defined()) c.working = be.empty(s.working.shape(), s.working.dtype());
  c.weight_decay = s.weight_decay;
  return c;
}

const std::vector<Shape> kShapes = {{1}, {3}, {7, 5}, {1000}, {4097}, {64, 33}, {2, 2, 3}, {5}};

TEST(AdamWMany, EqualsAdamWPerTensorBitwise) {
  auto be = make_cpu_backend(DType::kF32);
  std::mt19937 rng(41);
  std::vector<State> many, loop;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    const DType working = i % 3 == 0 ? DType::kI32 : i % 3 == 1 ? DType::kBF16 : DType::kF32;
    many.push_back(make_state(*be, kShapes[i], rng, working, i % 2 == 0));
    loop.push_back(clone(*be, many.back()));
  }
  AdamWParams p;
  p.lr = 3e-3;
  p.weight_decay = 0.1;
  p.grad_scale = 0.7;
  for (int64_t step = 1; step <= 3; ++step) {
    p.step = step;
    std::vector<Backend::AdamWEntry> entries;
    for (State& s : many)
      entries.push_back({s.master, s.grad, s.m, s.v, s.working, s.weight_decay});
    be->adamw_many(entries, p);
    for (State& s : loop) {
      AdamWParams q = p;
      q.weight_decay = s.weight_decay ? p.weight_decay : 0.0;
      be->adamw(s.master, s.grad, s.m, s.v, q, s.working);
    }
  }
  for (size_t i = 0; i < many.size(); ++i) {
    SCOPED_TRACE("entry " + std::to_string(i) + " " + many[i].master.desc());
    EXPECT_TRUE(same_bits(many[i].master, loop[i].master));
    EXPECT_TRUE(same_bits(many[i].m, loop[i].m));
    EXPECT_TRUE(same_bits(many[i].v, loop[i].v));
    if (many[i].working.defined()) {
      EXPECT_TRUE(same_bits(many[i].working, loop[i].working));
    }
  }
  // The update moved every tensor, and weight decay made a difference where it applied.
  auto fresh = make_cpu_backend(DType::kF32);
  std::mt19937 rng2(41);
  for (size_t i = 0; i < kShapes.size(); ++i) {
    const State s0 = make_state(*fresh, kShapes[i], rng2, DType::kI32, false);
    EXPECT_FALSE(same_bits(s0.master, many[i].master)) << "entry " << i;
  }
}

// The entries' contract: each as adamw's, named by its index, checked before anything changes.
TEST(AdamWMany, BadEntriesAreRefusedNamingTheEntry) {
  auto be = make_cpu_backend(DType::kF32);
  std::mt19937 rng(7);
  const auto error_of = [](const std::function<void()>& fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  std::vector<State> st;
  for (int i = 0; i < 3; ++i) st.push_back(make_state(*be, {4, 6}, rng, DType::kBF16, true));
  const Tensor before = be->upload(st[0].master);
  const auto entries = [&] {
    std::vector<Backend::AdamWEntry> e;
    for (State& s : st) e.push_back({s.master, s.grad, s.m, s.v, s.working, s.weight_decay});
    return e;
  };
  AdamWParams p;
  p.lr = 1e-2;
  struct Bad {
    std::string fragment;
    std::function<void(std::vector<Backend::AdamWEntry>&, AdamWParams&)> spoil;
  };
  Tensor flag = be->zeros({1}, DType::kF32);
  const std::vector<Bad> bad = {
      {"adamw_many: entry 2: tensor 'grad'",
       [&](auto& e, auto&) {
         e[2].grad = be->zeros({6, 4}, DType::kF32);
       }},
      {"adamw_many: entry 1: tensor 'v' is undefined", [](auto& e, auto&) { e[1].v = Tensor(); }},
      {"adamw_many: entry 2: tensors 'working'",
       [&](auto& e, auto&) { e[2].working = be->empty({23}, DType::kBF16); }},
      {"adamw_many: entry 1: tensor 'master' is undefined",
       [](auto& e, auto&) { e[1].master = Tensor(); }},
      {"adamw_many: entry 2's 'm' overlaps entry 0's 'm'", [](auto& e, auto&) { e[2].m = e[0].m; }},
      {"overlaps entry 0's 'grad'", [](auto& e, auto&) { e[1].v = e[0].grad; }},
      {"entry 1's 'working' overlaps entry 0's 'master'",
       [](auto& e, auto&) { e[1].working = e[0].master; }},
      {"adamw_many: step 0 must be >= 1", [](auto&, auto& q) { q.step = 0; }},
      {"adamw_many: has no check-only mode", [&](auto&, auto& q) { q.check_flag = &flag; }},
  };
  const auto all_refused = [&](const Tensor& master0) {
    for (const Bad& b : bad) {
      SCOPED_TRACE(b.fragment);
      auto e = entries();
      AdamWParams q = p;
      b.spoil(e, q);
      const std::string what = error_of([&] { be->adamw_many(e, q); });
      EXPECT_NE(what.find(b.fragment), std::string::npos) << what;
      EXPECT_TRUE(same_bits(st[0].master, master0)) << "entry 0 was updated before the error";
    }
  };
  all_refused(before);
  // Entries may read the same gradient, and an entry's own tensors may overlap each other.
  auto e = entries();
  e[1].grad = e[0].grad;
  EXPECT_EQ(error_of([&] { be->adamw_many(e, p); }), "");
  EXPECT_FALSE(same_bits(st[0].master, before));
  // The list that passed is not checked again when it comes back; any other list still is.
  EXPECT_EQ(error_of([&] { be->adamw_many(e, p); }), "");
  SCOPED_TRACE("after a list passed");
  all_refused(be->upload(st[0].master));
}

// The overlap check against a pairwise one: entries cut from one buffer at random offsets are
// refused exactly when a tensor one entry writes shares bytes with a tensor of another entry.
TEST(AdamWMany, OverlapCheckAgreesWithAPairwiseCheck) {
  auto be = make_cpu_backend(DType::kF32);
  std::mt19937 rng(17);
  Tensor buf = be->zeros({4000}, DType::kF32);
  {
    // Two gradients overlap (both read: allowed), then entry 1's m, reaching less far than its
    // own gradient, overlaps entry 0's gradient.
    const auto own = [&](int64_t n) { return be->zeros({n}, DType::kF32); };
    std::vector<Backend::AdamWEntry> e = {
        {own(50), buf.slice(0, 50), own(50), own(50), Tensor(), true},
        {own(90), buf.slice(10, 100), buf.slice(20, 110), own(90), Tensor(), true}};
    std::string what;
    try {
      be->adamw_many(e, AdamWParams{});
    } catch (const Error& err) {
      what = err.what();
    }
    EXPECT_NE(what.find("entry 1's 'm' overlaps entry 0's 'grad'"), std::string::npos) << what;
  }
  int refused = 0, trials = 400;
  for (int trial = 0; trial < trials; ++trial) {
    struct Cut {
      int64_t begin, len;
      bool written;
      size_t entry;
    };
    std::vector<Cut> cuts;
    std::vector<Backend::AdamWEntry> entries;
    const int n_entries = 2 + static_cast<int>(rng() % 4);
    for (int i = 0; i < n_entries; ++i) {
      const int64_t len = 1 + static_cast<int64_t>(rng() % 60);
      Tensor t[5];
      const int parts = rng() % 2 ? 5 : 4;  // with or without a working copy
      for (int k = 0; k < parts; ++k) {
        const int64_t begin = static_cast<int64_t>(rng() % (4000 - len));
        t[k] = buf.slice(begin, begin + len);
        cuts.push_back({begin, len, k != 1, static_cast<size_t>(i)});  // t[1] is the grad
      }
      entries.push_back({t[0], t[1], t[2], t[3], t[4], true});
    }
    bool clash = false;
    for (const Cut& a : cuts) {
      for (const Cut& b : cuts) {
        clash = clash || (a.entry != b.entry && (a.written || b.written) &&
                          a.begin < b.begin + b.len && b.begin < a.begin + a.len);
      }
    }
    AdamWParams p;
    p.lr = 0;
    bool threw = false;
    try {
      be->adamw_many(entries, p);
    } catch (const Error& e) {
      threw = std::string(e.what()).find("overlaps") != std::string::npos;
    }
    EXPECT_EQ(threw, clash) << "trial " << trial;
    refused += threw ? 1 : 0;
  }
  // Both outcomes were exercised.
  EXPECT_GT(refused, 0);
  EXPECT_LT(refused, trials);
}

TEST(SumSquaresMany, EqualsSumSquaresPerTensorBitwise) {
  auto be = make_cpu_backend(DType::kF32);
  std::mt19937 rng(3);
  std::vector<Tensor> xs;
  for (const Shape& s : kShapes) xs.push_back(be->upload(random_host(s, rng, 1.5f)));
  Tensor big = be->upload(random_host({1 << 16}, rng, 0.5f));
  xs.push_back(big.slice(5, 40000));  // a slice at an odd offset
  Tensor acc_many = be->upload(Tensor::host_from<float>({0.25f}, DType::kF32));
  Tensor acc_loop = be->upload(acc_many);
  be->sum_squares_many(xs, acc_many);
  for (const Tensor& x : xs) be->sum_squares(x, acc_loop);
  EXPECT_TRUE(same_bits(acc_many, acc_loop));
  EXPECT_GT(acc_many.data<float>()[0], 1000.f);
  be->sum_squares_many({}, acc_many);  // nothing to add
  EXPECT_TRUE(same_bits(acc_many, acc_loop));
  std::string what;
  try {
    be->sum_squares_many({xs[0], Tensor(), xs[1]}, acc_many);
  } catch (const Error& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("sum_squares_many: tensor 'xs[1]' is undefined"), std::string::npos) << what;
}

// Flagged tensors count as zeros without being read: their memory holds NaN here, and the sum
// has the bits of the same list with real zeros in their place.
TEST(SumSquaresMany, UnwrittenTensorsAddTheBitsOfZeros) {
  auto be = make_cpu_backend(DType::kF32);
  std::mt19937 rng(13);
  std::vector<Tensor> xs, zeroed;
  std::vector<char> unwritten;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    const bool flag = i % 3 == 1;
    xs.push_back(be->upload(random_host(kShapes[i], rng, 1.5f)));
    zeroed.push_back(flag ? be->zeros(kShapes[i], DType::kF32) : xs.back());
    if (flag) be->fill(xs.back(), std::nan(""));
    unwritten.push_back(flag ? 1 : 0);
  }
  Tensor acc = be->zeros({1}, DType::kF32), ref = be->zeros({1}, DType::kF32);
  be->sum_squares_many(xs, acc, unwritten);
  be->sum_squares_many(zeroed, ref);
  EXPECT_TRUE(same_bits(acc, ref));
  EXPECT_GT(acc.data<float>()[0], 10.f);
  std::string what;
  try {
    be->sum_squares_many(xs, acc, std::vector<char>(2, 0));
  } catch (const Error& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("sum_squares_many: 'unwritten' has 2 flags for 8 tensors"), std::string::npos)
      << what;
}

// An entry marked grad_zero is updated as with a zero-filled gradient, its grad (NaN) unread.
TEST(AdamWMany, GradZeroEntriesUpdateAsWithZeroGradients) {
  auto be = make_cpu_backend(DType::kF32);
  std::mt19937 rng(29);
  std::vector<State> many, ref;
  std::vector<Backend::AdamWEntry> entries, ref_entries;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    many.push_back(
        make_state(*be, kShapes[i], rng, i % 2 ? DType::kBF16 : DType::kI32, i % 3 != 0));
    ref.push_back(clone(*be, many.back()));
  }
  for (size_t i = 0; i < kShapes.size(); ++i) {
    State &s = many[i], &r = ref[i];
    const bool zero = i % 2 == 0;
    if (zero) {
      be->fill(s.grad, std::nan(""));
      be->fill(r.grad, 0.0);
    }
    Backend::AdamWEntry e{s.master, s.grad, s.m, s.v, s.working, s.weight_decay};
    e.grad_zero = zero;
    entries.push_back(e);
    ref_entries.push_back({r.master, r.grad, r.m, r.v, r.working, r.weight_decay});
  }
  AdamWParams p;
  p.lr = 1e-2;
  p.weight_decay = 0.1;
  p.grad_scale = 0.5;
  p.step = 3;
  be->adamw_many(entries, p);
  be->adamw_many(ref_entries, p);
  for (size_t i = 0; i < kShapes.size(); ++i) {
    SCOPED_TRACE("entry " + std::to_string(i));
    EXPECT_TRUE(same_bits(many[i].master, ref[i].master));
    EXPECT_TRUE(same_bits(many[i].m, ref[i].m));
    EXPECT_TRUE(same_bits(many[i].v, ref[i].v));
    if (many[i].working.defined()) EXPECT_TRUE(same_bits(many[i].working, ref[i].working));
    EXPECT_TRUE(std::isfinite(many[i].master.data<float>()[0]));
  }
}

// AdamW::step and grad_sum_squares over a registry: the bits of the per-tensor ops (expert
// gradients squared expert by expert).
TEST(AdamWMany, StepAndGradNormEqualThePerTensorLoop) {
  auto be = make_cpu_backend(DType::kF32);
  ParamRegistry regs[2];
  for (ParamRegistry& reg : regs) {
    std::mt19937 r(11);
    for (size_t i = 0; i < kShapes.size(); ++i) {
      Param q;
      q.name = "p" + std::to_string(i);
      q.shape = q.global_shape = kShapes[i];
      q.weight_decay = i % 2 == 1;
      q.group = i % 4 == 3 ? ParamGroup::kExpert : ParamGroup::kDense;
      Param& p = reg.add(q);
      p.master = be->upload(random_host(kShapes[i], r, 1.f));
      p.grad = be->upload(random_host(kShapes[i], r, 0.2f));
      p.m = be->zeros(kShapes[i], DType::kF32);
      p.v = be->zeros(kShapes[i], DType::kF32);
      // Half the parameters keep a bf16 working copy; the others' working copy is the master.
      p.work = i % 2 == 0 ? be->empty(kShapes[i], DType::kBF16) : p.master;
    }
  }
  AdamWConfig cfg;
  AdamW opt(cfg);
  Tensor acc = be->zeros({2}, DType::kF32);
  grad_sum_squares(*be, regs[0], acc);
  Tensor loop_acc = be->zeros({2}, DType::kF32);
  Tensor d = loop_acc.slice(0, 1), x = loop_acc.slice(1, 2);
  for (auto& p : regs[1].all()) {
    if (p->group != ParamGroup::kExpert) {
      be->sum_squares(p->grad, d);
      continue;
    }
    for (int64_t le = 0; le < p->shape[0]; ++le) be->sum_squares(p->grad[le], x);
  }
  EXPECT_TRUE(same_bits(acc, loop_acc));
  EXPECT_GT(acc.data<float>()[0], 0.f);
  EXPECT_GT(acc.data<float>()[1], 0.f);
  for (int64_t step = 1; step <= 2; ++step) {
    opt.step(*be, regs[0], step, 1e-2, 0.9);
    for (auto& p : regs[1].all()) {
      Tensor working = p->work.storage() == p->master.storage() ? Tensor() : p->work;
      opt.update(*be, p->master, p->grad, p->m, p->v, p->weight_decay, step, 1e-2, 0.9, working);
    }
  }
  for (size_t i = 0; i < kShapes.size(); ++i) {
    const Param &a = *regs[0].all()[i], &b = *regs[1].all()[i];
    SCOPED_TRACE(a.name);
    EXPECT_TRUE(same_bits(a.master, b.master));
    EXPECT_TRUE(same_bits(a.m, b.m));
    EXPECT_TRUE(same_bits(a.v, b.v));
    EXPECT_TRUE(same_bits(a.work, b.work));
  }
}

}  // namespace
}  // namespace hp
