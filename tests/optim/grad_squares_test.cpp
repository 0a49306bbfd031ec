// The gradient norm taken layer by layer (optim/grad_squares.h) on the reference backend: the
// partial sums of squares in runs plus one finish are the bits of sum_squares_many, bad partial
// buffers are refused naming the op and the size that fits, and LayerGradSquares gives the bits
// of grad_sum_squares whatever the order and grouping in which layers report, step after step.
#include "optim/grad_squares.h"

#include <gtest/gtest.h>

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

Tensor random_host(const Shape& shape, std::mt19937& rng, float scale, DType dtype) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> v(static_cast<size_t>(shape_numel(shape)));
  for (double& x : v) x = normal(rng) * scale;
  Tensor t = Tensor::host_from(v, DType::kF64, shape);
  if (dtype == DType::kF64) return t;
  Tensor f = Tensor::host(shape, dtype);
  const double* src = t.data<double>();
  float* dst = f.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) dst[i] = static_cast<float>(src[i]);
  return f;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.numel() == b.numel() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(SumSquaresPartials, RunsThenOneFinishAreTheBitsOfSumSquaresMany) {
  for (DType dt : {DType::kF32, DType::kF64}) {
    SCOPED_TRACE(dtype_name(dt));
    auto be = make_cpu_backend(dt);
    std::mt19937 rng(21);
    std::vector<Tensor> xs;
    const int64_t sizes[] = {1, 7, 4096, 33, 0, 100003, 5, 64};
    for (int64_t n : sizes) xs.push_back(be->upload(random_host({n}, rng, 1.7f, dt)));
    Tensor acc_many = be->upload(random_host({1}, rng, 3.f, dt));
    Tensor acc_runs = be->upload(acc_many);
    be->sum_squares_many(xs, acc_many);
    int64_t slots = 0;
    std::vector<int64_t> first;
    for (const Tensor& x : xs) {
      first.push_back(slots);
      slots += be->sum_squares_slots(x.numel());
    }
    first.push_back(slots);
    Tensor partials = be->empty({slots}, dt);
    // Runs of 3, 1 and 4 tensors, issued last run first.
    const size_t cuts[] = {0, 3, 4, 8};
    for (int r = 2; r >= 0; --r) {
      std::vector<Tensor> run(xs.begin() + cuts[r], xs.begin() + cuts[r + 1]);
      Tensor out = partials.slice(first[cuts[r]], first[cuts[r + 1]]);
      be->sum_squares_partials(run, out);
    }
    be->sum_squares_finish(partials, acc_runs);
    EXPECT_TRUE(same_bits(acc_many, acc_runs));
    EXPECT_GT(to_double_vector(acc_runs)[0], 1e4);
    // An empty buffer adds nothing.
    be->sum_squares_finish(be->empty({0}, dt), acc_runs);
    EXPECT_TRUE(same_bits(acc_many, acc_runs));
  }
}

TEST(SumSquaresPartials, AWrongBufferIsRefusedNamingTheSizeThatFits) {
  auto be = make_cpu_backend(DType::kF32);
  std::mt19937 rng(2);
  const std::vector<Tensor> xs{be->upload(random_host({10}, rng, 1.f, DType::kF32)),
                               be->upload(random_host({3}, rng, 1.f, DType::kF32))};
  const int64_t slots = be->sum_squares_slots(10) + be->sum_squares_slots(3);
  Tensor short_buf = be->empty({slots + 1}, DType::kF32);
  std::string what = error_of([&] { be->sum_squares_partials(xs, short_buf); });
  EXPECT_NE(what.find("sum_squares_partials: partials"), std::string::npos) << what;
  EXPECT_NE(what.find("must hold exactly " + std::to_string(slots) + " partial sums"),
            std::string::npos)
      << what;
  Tensor f64 = be->empty({slots}, DType::kF64);
  what = error_of([&] { be->sum_squares_partials(xs, f64); });
  EXPECT_NE(what.find("must be of the master dtype f32"), std::string::npos) << what;
  Tensor acc2 = be->zeros({2}, DType::kF32);
  what = error_of([&] { be->sum_squares_finish(be->zeros({slots}, DType::kF32), acc2); });
  EXPECT_NE(what.find("sum_squares_finish"), std::string::npos) << what;
  EXPECT_NE(what.find("acc"), std::string::npos) << what;
  what = error_of([&] { be->sum_squares_partials({xs[0], Tensor()}, short_buf); });
  EXPECT_NE(what.find("sum_squares_partials: tensor 'xs[1]' is undefined"), std::string::npos)
      << what;
}

// A registry laid out as a model's (embedding first, then each layer's dense and expert
// parameters interleaved, then the final norm and the unembedding), with random gradients.
void add_params(Backend& be, ParamRegistry& reg, std::mt19937& rng, DType dt) {
  struct Spec {
    const char* name;
    Shape shape;
    bool expert;
  };
  const Spec specs[] = {{"embed", {37, 8}, false},
                        {"layers.0.attn.wqkv", {8, 24}, false},
                        {"layers.0.moe.w1", {4, 8, 16}, true},
                        {"layers.0.moe.router", {8, 4}, false},
                        {"layers.0.moe.w2", {4, 8, 8}, true},
                        {"layers.1.attn.wqkv", {8, 24}, false},
                        {"layers.1.moe.w1", {4, 8, 16}, true},
                        {"layers.1.norm", {8}, false},
                        {"layers.1.moe.w2", {4, 8, 8}, true},
                        {"layers.2.attn.wqkv", {8, 24}, false},
                        {"final_norm", {8}, false},
                        {"lm_head", {37, 8}, false}};
  for (const Spec& s : specs) {
    Param q;
    q.name = s.name;
    q.shape = q.global_shape = s.shape;
    q.group = s.expert ? ParamGroup::kExpert : ParamGroup::kDense;
    Param& p = reg.add(q);
    p.grad = be.upload(random_host(s.shape, rng, 0.3f, dt));
  }
}

void refill(Backend& be, ParamRegistry& reg, std::mt19937& rng, DType dt) {
  for (auto& p : reg.all()) {
    Tensor g = be.upload(random_host(p->grad.shape(), rng, 0.3f, dt));
    be.copy(g, p->grad);
  }
}

TEST(LayerGradSquares, EqualsGradSumSquaresBitwiseInAnyReportingOrder) {
  for (DType dt : {DType::kF32, DType::kF64}) {
    SCOPED_TRACE(dtype_name(dt));
    auto be = make_cpu_backend(dt);
    std::mt19937 rng(8);
    ParamRegistry reg;
    add_params(*be, reg, rng, dt);
    for (Backend::StreamKind stream : {Backend::StreamKind::kComm, Backend::StreamKind::kCompute}) {
      LayerGradSquares squares(*be, reg, stream);
      // Step after step on new gradients: as backward reports (2, 1, 0, -1); only some layers
      // (the rest squared by finish); twice the same layer; none at all.
      const std::vector<std::vector<int>> orders = {{2, 1, 0, -1}, {1, -1}, {0, 0, 2}, {}};
      for (const std::vector<int>& order : orders) {
        refill(*be, reg, rng, dt);
        Tensor want = be->zeros({2}, dt);
        grad_sum_squares(*be, reg, want);
        for (int layer : order) squares.layer_ready(layer);
        squares.layer_ready(7);                                   // no such layer: nothing
        Tensor got = be->upload(random_host({2}, rng, 1.f, dt));  // overwritten, not added to
        squares.finish(got);
        EXPECT_TRUE(same_bits(want, got)) << "order of " << order.size() << " layers";
        const std::vector<double> v = to_double_vector(got);
        EXPECT_GT(v[0], 0.0);
        EXPECT_GT(v[1], 0.0);
      }
    }
  }
}

TEST(LayerGradSquares, SquaresTheGradientsAsTheyAreWhenTheLayerReports) {
  // The squares are taken when layer_ready is called: a gradient changed afterwards is not seen
  // (the contract that backward reports a layer only once its gradients are complete).
  auto be = make_cpu_backend(DType::kF64);
  std::mt19937 rng(4);
  ParamRegistry reg;
  add_params(*be, reg, rng, DType::kF64);
  LayerGradSquares squares(*be, reg, Backend::StreamKind::kComm);
  Tensor before = be->zeros({2}, DType::kF64);
  grad_sum_squares(*be, reg, before);
  squares.layer_ready(0);
  for (auto& p : reg.all())
    if (param_layer(p->name) == 0) be->fill(p->grad, 0.0);
  Tensor got = be->zeros({2}, DType::kF64);
  squares.finish(got);
  EXPECT_TRUE(same_bits(before, got));
  Tensor after = be->zeros({2}, DType::kF64);
  grad_sum_squares(*be, reg, after);
  EXPECT_LT(to_double_vector(after)[1], to_double_vector(got)[1]);
}

}  // namespace
}  // namespace hp
