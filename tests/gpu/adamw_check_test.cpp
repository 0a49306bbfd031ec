// The AdamW op's check-only mode (nonfinite=skip) on the GPU against the CPU backend: the same
// flag on the same random tensors, nothing written but the flag, and the flag set exactly when
// the update itself writes a non-finite value.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "framework/backend/cuda/cuda_backend.h"
#include "tests/gpu/gpu_fixtures.h"

namespace hp {
namespace {

std::vector<double> values(Backend& be, const Tensor& t) {
  Tensor h = Tensor::host(t.shape(), t.dtype());
  be.read_to_host(t, h, SyncCause::kOther);
  return to_double_vector(h);
}

bool any_nonfinite(const std::vector<double>& v) {
  for (double x : v)
    if (!std::isfinite(x)) return true;
  return false;
}

TEST(CudaAdamWCheck, FlagMatchesTheCpuBackendAndTheUpdate) {
  HP_REQUIRE_GPU();
  auto cpu = make_cpu_backend(DType::kF32);
  auto gpu = make_cuda_backend(0, CudaBackendOptions{});
  std::mt19937 rng(23);
  std::normal_distribution<float> normal(0.f, 1.f);
  const float fmax = std::numeric_limits<float>::max();
  struct Case {
    double lr, grad_scale;
    float grads;
    float weights;  // 0: random N(0, 1) weights; else every weight this value
    DType working;
    bool bad;
  };
  // 4099 elements: not a multiple of 4, so both code paths of the update apply; 4096 too.
  for (const int64_t n : {int64_t{4099}, int64_t{4096}}) {
    for (const Case& c : {
             Case{1e-3, 0.7, 1.f, 0.f, DType::kBF16, false},
             Case{1e39, 0.7, 1.f, 0.f, DType::kBF16, true},    // weights leave the float range
             Case{1e-3, 1.0, 1e20f, 0.f, DType::kBF16, true},  // g*g does: v is inf
             Case{1e-3, 1e-30, 1e20f, 0.f, DType::kBF16, false},
             Case{1e-30, 1.0, 1.f, fmax * 0.9999f, DType::kBF16, true},  // inf in bf16 only
             Case{1e-30, 1.0, 1.f, fmax * 0.9999f, DType::kF32, false},
         }) {
      SCOPED_TRACE(testing::Message()
                   << "n=" << n << " lr=" << c.lr << " grads~" << c.grads
                   << " weights=" << c.weights << " working=" << dtype_name(c.working));
      std::vector<float> w(n), g(n), m(n), v(n);
      for (int64_t i = 0; i < n; ++i) {
        w[i] = c.weights != 0.f ? c.weights : normal(rng);
        g[i] = normal(rng) * c.grads;
        m[i] = normal(rng) * 0.1f;
        v[i] = std::fabs(normal(rng)) * 0.05f;
      }
      AdamWParams p;
      p.lr = c.lr;
      p.weight_decay = 0.1;
      p.step = 3;
      p.grad_scale = c.grad_scale;
      const Tensor hw = Tensor::host_from(w, DType::kF32), hg = Tensor::host_from(g, DType::kF32),
                   hm = Tensor::host_from(m, DType::kF32), hv = Tensor::host_from(v, DType::kF32);
      double flags[2] = {0, 0};
      int k = 0;
      for (Backend* be : {cpu.get(), gpu.get()}) {
        Tensor tw = be->upload(hw), tg = be->upload(hg), tm = be->upload(hm), tv = be->upload(hv);
        Tensor work = be->empty({n}, c.working);
        Tensor flag = be->zeros({1}, DType::kF32);
        AdamWParams check = p;
        check.check_flag = &flag;
        be->adamw(tw, tg, tm, tv, check, work);
        flags[k] = values(*be, flag)[0];
        // Nothing but the flag was written.
        EXPECT_EQ(values(*be, tw), to_double_vector(hw));
        EXPECT_EQ(values(*be, tm), to_double_vector(hm));
        EXPECT_EQ(values(*be, tv), to_double_vector(hv));
        // The update itself: non-finite exactly where flagged.
        be->adamw(tw, tg, tm, tv, p, work);
        const bool bad = any_nonfinite(values(*be, tw)) || any_nonfinite(values(*be, tm)) ||
                         any_nonfinite(values(*be, tv)) ||
                         (c.working == DType::kBF16 && any_nonfinite(values(*be, work)));
        EXPECT_EQ(bad, c.bad) << be->name();
        ++k;
      }
      EXPECT_EQ(flags[0], c.bad ? 1.0 : 0.0) << "cpu";
      EXPECT_EQ(flags[1], flags[0]) << "cuda against cpu";
    }
  }
}

}  // namespace
}  // namespace hp
