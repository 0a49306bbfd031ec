// The gated update (AdamWParams::gate, Backend::update_gate) on the reference backend: the gate
// holds the host's clip coefficient bit for bit and closes on any non-finite scalar; an open gate
// updates with the bits of the host-scaled update, a closed one writes nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/core/clip.h"
#include "framework/model/params.h"
#include "optim/adamw.h"

namespace hp {
namespace {

template <typename T>
Tensor host_of(const std::vector<double>& v, DType dt) {
  Tensor t = Tensor::host({static_cast<int64_t>(v.size())}, dt);
  for (size_t i = 0; i < v.size(); ++i) t.data<T>()[i] = static_cast<T>(v[i]);
  return t;
}

// The host's decision from the same scalars, as the trainer computes it.
template <typename T>
double host_clip(const Tensor& sumsq, double max_norm) {
  double ss = 0;
  for (int64_t i = 0; i < sumsq.numel(); ++i) ss += static_cast<double>(sumsq.data<T>()[i]);
  return clip_coefficient(std::sqrt(ss), max_norm);
}

template <typename T>
void check_gate_arithmetic(DType dt) {
  auto be = make_cpu_backend(dt);
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> mag(-6, 6);
  int clipped = 0, unclipped = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const std::vector<double> sq = {std::pow(10.0, mag(rng)), std::pow(10.0, mag(rng))};
    const Tensor sumsq = host_of<T>(sq, dt);
    const Tensor checked = host_of<T>({mag(rng), mag(rng), sq[0], sq[1]}, dt);
    const double max_norm = trial % 10 == 0 ? 0.0 : std::pow(10.0, mag(rng) / 2);
    Tensor gate = Tensor::host({2}, DType::kF64);
    be->update_gate(checked, sumsq, max_norm, gate);
    const double want = host_clip<T>(sumsq, max_norm);
    EXPECT_EQ(std::memcmp(&gate.data<double>()[0], &want, sizeof want), 0)
        << "trial " << trial << ": " << gate.data<double>()[0] << " vs " << want;
    EXPECT_EQ(gate.data<double>()[1], 1.0);
    (want < 1.0 ? clipped : unclipped)++;
  }
  EXPECT_GT(clipped, 20);  // both sides of the clip were exercised
  EXPECT_GT(unclipped, 20);
}

TEST(UpdateGate, HoldsTheHostClipCoefficientBitwise) {
  check_gate_arithmetic<float>(DType::kF32);
  check_gate_arithmetic<double>(DType::kF64);
}

TEST(UpdateGate, ClosesOnAnyNonFiniteScalar) {
  auto be = make_cpu_backend(DType::kF32);
  const double bad[] = {std::nan(""), std::numeric_limits<double>::infinity(),
                        -std::numeric_limits<double>::infinity()};
  for (int at = 0; at < 4; ++at)
    for (double b : bad) {
      std::vector<double> v = {1.5, 0.25, 3.0, 4.0};
      v[static_cast<size_t>(at)] = b;
      const Tensor checked = host_of<float>(v, DType::kF32);
      Tensor gate = Tensor::host({2}, DType::kF64);
      be->update_gate(checked, checked.slice(2, 4), 1.0, gate);
      EXPECT_EQ(gate.data<double>()[1], 0.0) << "scalar " << at << " = " << b;
    }
  // Finite scalars whose norm squares only overflow in f32 still open it: the sum is in f64.
  const Tensor big = host_of<float>({1.0, 0.0, 3e38, 3e38}, DType::kF32);
  Tensor gate = Tensor::host({2}, DType::kF64);
  be->update_gate(big, big.slice(2, 4), 1.0, gate);
  EXPECT_EQ(gate.data<double>()[1], 1.0);
  EXPECT_GT(gate.data<double>()[0], 0.0);
  EXPECT_LT(gate.data<double>()[0], 1e-18);
}

// Parameters of random values in two registries of the same contents.
void fill_registry(Backend& be, ParamRegistry& reg, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const std::vector<Shape> shapes = {{7, 5}, {1000}, {3}, {64, 33}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    Param q;
    q.name = "p" + std::to_string(i);
    q.shape = q.global_shape = shapes[i];
    q.weight_decay = i % 2 == 0;
    Param& p = reg.add(q);
    auto random = [&](float scale, bool positive) {
      Tensor t = Tensor::host(shapes[i], DType::kF32);
      for (int64_t j = 0; j < t.numel(); ++j) {
        const float x = normal(rng) * scale;
        t.data<float>()[j] = positive ? std::fabs(x) : x;
      }
      return be.upload(t);
    };
    p.master = random(1.f, false);
    p.grad = random(0.5f, false);
    p.m = random(0.1f, false);
    p.v = random(0.05f, true);
    p.work = i % 2 == 0 ? be.empty(shapes[i], DType::kBF16) : p.master;
  }
}

std::vector<std::vector<char>> bytes_of(ParamRegistry& reg) {
  std::vector<std::vector<char>> out;
  for (auto& p : reg.all())
    for (const Tensor* t : {&p->master, &p->m, &p->v, &p->work}) {
      const char* c = static_cast<const char*>(t->raw());
      out.emplace_back(c, c + t->nbytes());
    }
  return out;
}

TEST(GatedUpdate, AnOpenGateUpdatesWithTheHostScaleBitwise) {
  auto be = make_cpu_backend(DType::kF32);
  AdamW opt(AdamWConfig{});
  for (double max_norm : {0.0, 0.05, 1e6}) {
    SCOPED_TRACE("grad_clip " + std::to_string(max_norm));
    ParamRegistry gated, host;
    fill_registry(*be, gated, 3);
    fill_registry(*be, host, 3);
    const auto before = bytes_of(gated);
    for (int64_t step = 1; step <= 3; ++step) {
      Tensor sumsq = be->zeros({2}, DType::kF32);
      grad_sum_squares(*be, gated, sumsq);
      Tensor checked = Tensor::host({4}, DType::kF32);
      for (int i = 0; i < 4; ++i) checked.data<float>()[i] = i < 2 ? 1.f : 0.f;
      std::memcpy(checked.data<float>() + 2, sumsq.raw(), 2 * sizeof(float));
      Tensor gate = be->zeros({2}, DType::kF64);
      be->update_gate(checked, sumsq, max_norm, gate);
      ASSERT_EQ(gate.data<double>()[1], 1.0);
      if (max_norm == 0.05) {
        EXPECT_LT(gate.data<double>()[0], 1.0);  // clipping applies
      }
      opt.step_gated(*be, gated, step, 1e-2, gate);
      const double norm = std::sqrt(static_cast<double>(sumsq.data<float>()[0]) +
                                    static_cast<double>(sumsq.data<float>()[1]));
      opt.step(*be, host, step, 1e-2, clip_coefficient(norm, max_norm));
      EXPECT_EQ(bytes_of(gated), bytes_of(host)) << "step " << step;
    }
    EXPECT_NE(bytes_of(gated), before);  // the updates moved the parameters
  }
}

TEST(GatedUpdate, AClosedGateWritesNothing) {
  auto be = make_cpu_backend(DType::kF32);
  AdamW opt(AdamWConfig{});
  ParamRegistry reg;
  fill_registry(*be, reg, 9);
  const auto before = bytes_of(reg);
  Tensor gate = Tensor::host({2}, DType::kF64);
  gate.data<double>()[0] = 0.5;
  gate.data<double>()[1] = 0.0;
  opt.step_gated(*be, reg, 1, 1e-2, gate);
  EXPECT_EQ(bytes_of(reg), before);
  // The same gate opened moves them.
  gate.data<double>()[1] = 1.0;
  opt.step_gated(*be, reg, 1, 1e-2, gate);
  EXPECT_NE(bytes_of(reg), before);
}

}  // namespace
}  // namespace hp
