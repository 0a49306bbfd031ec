// qk_norm_rope_fwd / qk_norm_rope_bwd on the CPU reference: bitwise the compositions they stand
// for (qk_norm_fwd then rope; rope inverse then qk_norm_bwd), in place and out of place, through
// a backend that forwards every op to another; the backward is the forward's gradient (central
// differences); broken arguments are refused naming the op and the argument.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/core/error.h"
#include "framework/core/rng.h"
#include "framework/model/rope_table.h"
#include "tests/framework/fp8_forwarding_backend.h"
#include "tests/framework/grad_check.h"

namespace hp {
namespace {

// A master-dtype tensor of N(offset, scale^2) values.
Tensor randn(Backend& be, const Shape& shape, const std::string& purpose, double scale = 1.0,
             double offset = 0.0) {
  Tensor t = be.empty(shape, be.master_dtype());
  Philox rng(97, purpose);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double v = offset + scale * rng.normal(static_cast<uint64_t>(i));
    if (t.dtype() == DType::kF64)
      t.data<double>()[i] = v;
    else
      t.data<float>()[i] = static_cast<float>(v);
  }
  return t;
}

Tensor clone(Backend& be, const Tensor& t) {
  Tensor c = be.empty(t.shape(), t.dtype());
  be.copy(t, c);
  return c;
}

// The bytes of a host tensor.
std::vector<unsigned char> bytes(const Tensor& t) {
  const auto* p = static_cast<const unsigned char*>(t.raw());
  return std::vector<unsigned char>(p, p + t.nbytes());
}

// Positions of packed sequences of these lengths, one after another.
Tensor packed_positions(const std::vector<int>& lengths) {
  std::vector<int32_t> pos;
  for (int len : lengths)
    for (int i = 0; i < len; ++i) pos.push_back(i);
  return Tensor::host_from(pos, DType::kI32);
}

template <typename Fn>
void expect_error_naming(Fn&& fn, const std::string& op, const std::string& fragment) {
  try {
    fn();
    ADD_FAILURE() << op << ": expected an error mentioning '" << fragment << "'";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(op + ": "), std::string::npos) << what;
    EXPECT_NE(what.find(fragment), std::string::npos) << what;
  }
}

// One problem: qkv[n, hq + 2 hkv, d] in three packed sequences, norm weights around 1, a random
// output gradient, weight gradients that already hold something (the ops add to them).
struct Problem {
  int64_t n, hq, hkv, d;
  Tensor qkv, qw, kw, positions, dout, dqw0, dkw0;
  RopeTable table;

  Problem(Backend& be, int64_t hq_, int64_t hkv_, int64_t d_, const std::vector<int>& seqs)
      : hq(hq_), hkv(hkv_), d(d_) {
    positions = packed_positions(seqs);
    n = positions.numel();
    int max_len = 0;
    for (int s : seqs) max_len = std::max(max_len, s);
    table = make_rope_table(be, static_cast<int>(d), max_len, 1000.0);
    const int64_t h = hq + 2 * hkv;
    qkv = randn(be, {n, h, d}, "qkr.qkv", 1.5);
    qw = randn(be, {d}, "qkr.qw", 0.3, 1.0);
    kw = randn(be, {d}, "qkr.kw", 0.3, 1.0);
    dout = randn(be, {n, h, d}, "qkr.dout");
    dqw0 = randn(be, {d}, "qkr.dqw0");
    dkw0 = randn(be, {d}, "qkr.dkw0");
  }
  int64_t heads() const { return hq + 2 * hkv; }
};

struct Fwd {
  Tensor out, rstd;
};
struct Bwd {
  Tensor din, dqw, dkw;
};

Fwd fused_fwd(Backend& be, const Problem& p) {
  Fwd f{be.empty({p.n, p.heads(), p.d}, be.act_dtype()),
        be.empty({p.n, p.hq + p.hkv}, be.master_dtype())};
  be.qk_norm_rope_fwd(p.qkv, p.qw, p.kw, p.hq, p.hkv, 1e-6, p.positions, p.table, f.out, f.rstd);
  return f;
}

Fwd composed_fwd(Backend& be, const Problem& p) {
  Fwd f{be.empty({p.n, p.heads(), p.d}, be.act_dtype()),
        be.empty({p.n, p.hq + p.hkv}, be.master_dtype())};
  be.qk_norm_fwd(p.qkv, p.qw, p.kw, p.hq, p.hkv, 1e-6, f.out, f.rstd);
  be.rope(f.out, static_cast<int>(p.hq + p.hkv), p.positions, p.table, false);
  return f;
}

// Out of place (din a tensor of its own) or in place (din over a copy of dout).
Bwd fused_bwd(Backend& be, const Problem& p, const Tensor& rstd, bool in_place) {
  Bwd b{in_place ? clone(be, p.dout) : be.empty(p.dout.shape(), p.dout.dtype()), clone(be, p.dqw0),
        clone(be, p.dkw0)};
  const Tensor dout = in_place ? b.din : p.dout;
  be.qk_norm_rope_bwd(p.qkv, p.qw, p.kw, p.hq, p.hkv, rstd, p.positions, p.table, dout, b.din,
                      b.dqw, b.dkw);
  return b;
}

// The model's two ops before the fused one: rope inverse in place on the gradient, then
// qk_norm_bwd into a tensor of its own.
Bwd composed_bwd(Backend& be, const Problem& p, const Tensor& rstd) {
  Tensor dqkv = clone(be, p.dout);
  be.rope(dqkv, static_cast<int>(p.hq + p.hkv), p.positions, p.table, true);
  Bwd b{be.empty(p.dout.shape(), p.dout.dtype()), clone(be, p.dqw0), clone(be, p.dkw0)};
  be.qk_norm_bwd(p.qkv, p.qw, p.kw, p.hq, p.hkv, rstd, dqkv, b.din, b.dqw, b.dkw);
  return b;
}

void expect_same_bits(const Tensor& a, const Tensor& b, const char* what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  EXPECT_TRUE(bytes(a) == bytes(b)) << what << " differs";
}

TEST(QkNormRope, CpuFusedOpsAreTheComposition) {
  for (const DType dt : {DType::kF32, DType::kF64}) {
    SCOPED_TRACE(dtype_name(dt));
    auto be = make_cpu_backend(dt);
    Problem p(*be, 4, 2, 8, {5, 9, 3});
    const Fwd f = fused_fwd(*be, p), c = composed_fwd(*be, p);
    expect_same_bits(f.out, c.out, "out");
    expect_same_bits(f.rstd, c.rstd, "rstd");
    const std::vector<unsigned char> dout_before = bytes(p.dout);
    const Bwd ref = composed_bwd(*be, p, c.rstd);
    for (const bool in_place : {false, true}) {
      SCOPED_TRACE(in_place ? "in place" : "out of place");
      const Bwd b = fused_bwd(*be, p, f.rstd, in_place);
      expect_same_bits(b.din, ref.din, "din");
      expect_same_bits(b.dqw, ref.dqw, "dqw");
      expect_same_bits(b.dkw, ref.dkw, "dkw");
    }
    EXPECT_TRUE(bytes(p.dout) == dout_before) << "dout was modified out of place";
    // The weight gradients were added to what they held, and rope rotated something: the
    // results are not the plain norm's.
    EXPECT_FALSE(bytes(ref.dqw) == bytes(p.dqw0));
    Fwd plain{be->empty(f.out.shape(), dt), be->empty(f.rstd.shape(), dt)};
    be->qk_norm_fwd(p.qkv, p.qw, p.kw, p.hq, p.hkv, 1e-6, plain.out, plain.rstd);
    EXPECT_FALSE(bytes(plain.out) == bytes(f.out));
  }
}

// A backend that forwards every op it has to another (and has no fused ops of its own) gets the
// same bits through the default composition.
TEST(QkNormRope, ForwardingBackendGivesTheSameBits) {
  auto cpu = make_cpu_backend(DType::kF32);
  test::Fp8ForwardingBackend fwd(*cpu);
  Problem p(*cpu, 2, 1, 6, {4, 7});
  const Fwd a = fused_fwd(*cpu, p), b = fused_fwd(fwd, p);
  expect_same_bits(b.out, a.out, "out");
  expect_same_bits(b.rstd, a.rstd, "rstd");
  const Bwd da = fused_bwd(*cpu, p, a.rstd, false), db = fused_bwd(fwd, p, b.rstd, false);
  expect_same_bits(db.din, da.din, "din");
  expect_same_bits(db.dqw, da.dqw, "dqw");
  expect_same_bits(db.dkw, da.dkw, "dkw");
}

// The backward is the gradient of the forward (f64, central differences).
TEST(QkNormRope, BackwardIsTheForwardsGradient) {
  auto be = make_cpu_backend(DType::kF64);
  Problem p(*be, 2, 1, 6, {3, 4});
  Tensor out = be->empty({p.n, p.heads(), p.d}, DType::kF64);
  Tensor rstd = be->empty({p.n, p.hq + p.hkv}, DType::kF64);
  auto loss = [&] {
    be->qk_norm_rope_fwd(p.qkv, p.qw, p.kw, p.hq, p.hkv, 1e-6, p.positions, p.table, out, rstd);
    return grad_check::weighted_sum(out, p.dout);
  };
  loss();
  Tensor din = be->empty(out.shape(), DType::kF64);
  Tensor dqw = be->zeros({p.d}, DType::kF64), dkw = be->zeros({p.d}, DType::kF64);
  be->qk_norm_rope_bwd(p.qkv, p.qw, p.kw, p.hq, p.hkv, rstd, p.positions, p.table, p.dout, din, dqw,
                       dkw);
  EXPECT_TRUE(grad_check::passes(grad_check::check(p.qkv, din, loss), "dqkv"));
  EXPECT_TRUE(grad_check::passes(grad_check::check(p.qw, dqw, loss), "dqw"));
  EXPECT_TRUE(grad_check::passes(grad_check::check(p.kw, dkw, loss), "dkw"));
}

TEST(QkNormRope, BadArgumentsAreRefusedNamingThem) {
  auto be = make_cpu_backend(DType::kF32);
  Problem p(*be, 2, 1, 4, {3, 2});
  const int64_t n = p.n, h = p.heads(), d = p.d;
  Tensor out = be->empty({n, h, d}, DType::kF32), rstd = be->empty({n, 3}, DType::kF32);
  const char* fw = "qk_norm_rope_fwd";
  expect_error_naming(
      [&] {
        be->qk_norm_rope_fwd(p.qkv, p.qw, p.kw, 2, 1, 1e-6, packed_positions({4}), p.table, out,
                             rstd);
      },
      fw, "'positions'");
  expect_error_naming(
      [&] {
        RopeTable t{p.table.cos, be->empty({p.table.sin.dim(0), d}, DType::kF32)};
        be->qk_norm_rope_fwd(p.qkv, p.qw, p.kw, 2, 1, 1e-6, p.positions, t, out, rstd);
      },
      fw, "'table.sin'");
  expect_error_naming(
      [&] { be->qk_norm_rope_fwd(p.qkv, p.qw, p.kw, 1, 1, 1e-6, p.positions, p.table, out, rstd); },
      fw, "n_heads + 2 n_kv_heads");
  expect_error_naming(
      [&] {
        Tensor r2 = be->empty({n, 2}, DType::kF32);
        be->qk_norm_rope_fwd(p.qkv, p.qw, p.kw, 2, 1, 1e-6, p.positions, p.table, out, r2);
      },
      fw, "'rstd'");
  expect_error_naming(
      [&] {
        Tensor in_place = clone(*be, p.qkv);
        be->qk_norm_rope_fwd(in_place, p.qw, p.kw, 2, 1, 1e-6, p.positions, p.table, in_place,
                             rstd);
      },
      fw, "out must not overlap qkv");
  expect_error_naming(
      [&] {
        Tensor odd = be->zeros({n, h, 5}, DType::kF32), w5 = be->zeros({5}, DType::kF32);
        Tensor o5 = be->empty({n, h, 5}, DType::kF32);
        be->qk_norm_rope_fwd(odd, w5, w5, 2, 1, 1e-6, p.positions, p.table, o5, rstd);
      },
      fw, "even head_dim");

  const char* bw = "qk_norm_rope_bwd";
  Tensor din = be->empty({n, h, d}, DType::kF32);
  Tensor dqw = be->zeros({d}, DType::kF32), dkw = be->zeros({d}, DType::kF32);
  expect_error_naming(
      [&] {
        Tensor bad = be->zeros({d + 2}, DType::kF32);
        be->qk_norm_rope_bwd(p.qkv, p.qw, p.kw, 2, 1, rstd, p.positions, p.table, p.dout, din, dqw,
                             bad);
      },
      bw, "'dkw'");
  expect_error_naming(
      [&] {
        be->qk_norm_rope_bwd(p.qkv, p.qw, p.kw, 2, 1, rstd, p.positions, RopeTable{}, p.dout, din,
                             dqw, dkw);
      },
      bw, "'table.cos'");
  // din over dout shifted by one token: neither dout itself nor apart from it.
  expect_error_naming(
      [&] {
        Tensor big = be->zeros({n + 1, h, d}, DType::kF32);
        Tensor a = big.slice(0, n), b = big.slice(1, n + 1);
        be->qk_norm_rope_bwd(p.qkv, p.qw, p.kw, 2, 1, rstd, p.positions, p.table, a, b, dqw, dkw);
      },
      bw, "din must be dout itself or not overlap it");
  expect_error_naming(
      [&] {
        Tensor q = clone(*be, p.qkv);
        be->qk_norm_rope_bwd(q, p.qw, p.kw, 2, 1, rstd, p.positions, p.table, p.dout, q, dqw, dkw);
      },
      bw, "din must not overlap qkv");
  // One tensor for both weight gradients: the two sums would race for it.
  expect_error_naming(
      [&] {
        be->qk_norm_rope_bwd(p.qkv, p.qw, p.kw, 2, 1, rstd, p.positions, p.table, p.dout, din, dqw,
                             dqw);
      },
      bw, "dqw and dkw must not overlap");
  expect_error_naming(
      [&] { be->qk_norm_bwd(p.qkv, p.qw, p.kw, 2, 1, rstd, p.dout, din, dkw, dkw); }, "qk_norm_bwd",
      "dqw and dkw must not overlap");
  // Nothing refused was added to the weight gradients.
  std::vector<unsigned char> zero(static_cast<size_t>(dqw.nbytes()), 0);
  EXPECT_TRUE(bytes(dqw) == zero);
  EXPECT_TRUE(bytes(dkw) == zero);
}

}  // namespace
}  // namespace hp
