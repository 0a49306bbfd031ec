// The counter-based streams: the block function gives Philox-4x32-10's published known answers,
// the portable log / cos behind the normal draws agree with libm to double rounding, the draws
// are standard normal, and a stream is a pure function of its key.
#include "framework/core/rng.h"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>

namespace hp {
namespace {

// Host and device share philox4x32_10, so a wrong constant would pass every host-vs-device
// test; these are the known-answer vectors Random123 publishes for Philox-4x32-10 (counter,
// key, output).
TEST(Rng, PhiloxBlockGivesThePublishedKnownAnswers) {
  struct Kat {
    uint32_t ctr[4], key[2], out[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat& k : kats) {
    uint32_t out[4];
    philox4x32_10(k.ctr, k.key, out);
    for (int w = 0; w < 4; ++w)
      EXPECT_EQ(out[w], k.out[w]) << "word " << w
                                  << " of the block for counter word 0 = " << std::hex << k.ctr[0];
  }
}

// The 64-bit (key, counter) form is the block of counter {ctr low, ctr high, 0, 0} under key
// {key low, key high}; key 0, counter 0 is the first known answer.
TEST(Rng, SixtyFourBitKeyAndCounterMapOntoTheBlock) {
  uint32_t out[4];
  philox4x32(0, 0, out);
  EXPECT_EQ(out[0], 0x6627e8d5u);
  EXPECT_EQ(out[3], 0x9b00dbd8u);
  const Philox rng(42, "rng-test.map");
  for (uint64_t ctr : {uint64_t{1}, uint64_t{0x0123456789abcdefull}, ~uint64_t{0}}) {
    const uint32_t c[4] = {static_cast<uint32_t>(ctr), static_cast<uint32_t>(ctr >> 32), 0, 0};
    const uint32_t k[2] = {static_cast<uint32_t>(rng.key()),
                           static_cast<uint32_t>(rng.key() >> 32)};
    uint32_t want[4];
    philox4x32_10(c, k, want);
    const std::array<uint32_t, 4> got = rng.block(ctr);
    for (int w = 0; w < 4; ++w) EXPECT_EQ(got[w], want[w]) << "counter " << ctr << " word " << w;
  }
}

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
