// The counter-based streams: the portable log / cos behind the normal draws agree with libm to
// double rounding, the draws are standard normal, and a stream is a pure function of its key.
#include "framework/core/rng.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

namespace hp {
namespace {

TEST(Rng, PortableLogMatchesLibm) {
  const Philox rng(3, "rng-test.log");
  double worst = 0;
  for (uint64_t i = 0; i < 200000; ++i) {
    // Uniforms, and the tiny values Box-Muller's tail comes from.
    const double u =
        i % 2 ? rng.uniform(i) + 0x1.0p-53 : std::ldexp(rng.uniform(i) + 0.5, -(int)(i % 1000));
    const double ref = std::log(u), got = rng_detail::log_unit(u);
    worst = std::max(worst, std::fabs(got - ref) / std::max(std::fabs(ref), 1e-300));
  }
  EXPECT_LT(worst, 1e-15);  // a few ulp
  EXPECT_EQ(rng_detail::log_unit(1.0), 0.0);
  EXPECT_EQ(rng_detail::log_unit(0.5), -0.69314718055994530942);
}

TEST(Rng, PortableCosMatchesLibm) {
  const Philox rng(3, "rng-test.cos");
  double worst = 0;
  for (uint64_t i = 0; i < 200000; ++i) {
    const double u = rng.uniform(i);
    worst = std::max(worst, std::fabs(rng_detail::cos_2pi(u) - std::cos(6.283185307179586 * u)));
  }
  EXPECT_LT(worst, 1e-15);
  EXPECT_EQ(rng_detail::cos_2pi(0.0), 1.0);
  EXPECT_EQ(rng_detail::cos_2pi(0.25), 0.0);
  EXPECT_EQ(rng_detail::cos_2pi(0.5), -1.0);
}

TEST(Rng, NormalDrawsHaveUnitMomentsAndDependOnlyOnTheKey) {
  const Philox a(9, "init.w"), b(9, "init.w"), c(10, "init.w");
  const int64_t n = 400000;
  double s1 = 0, s2 = 0, s4 = 0;
  int64_t same_as_other_seed = 0;
  for (int64_t i = n - 1; i >= 0; --i) {  // any order: the draw is a function of the index
    const double x = a.normal(static_cast<uint64_t>(i));
    ASSERT_EQ(x, b.normal(static_cast<uint64_t>(i)));
    ASSERT_EQ(x, philox_normal(a.key(), static_cast<uint64_t>(i)));
    same_as_other_seed += x == c.normal(static_cast<uint64_t>(i));
    s1 += x;
    s2 += x * x;
    s4 += x * x * x * x;
  }
  EXPECT_NEAR(s1 / n, 0.0, 5.0 / std::sqrt(n));
  EXPECT_NEAR(s2 / n, 1.0, 0.01);
  EXPECT_NEAR(s4 / n, 3.0, 0.05);
  EXPECT_EQ(same_as_other_seed, 0);
}

}  // namespace
}  // namespace hp
