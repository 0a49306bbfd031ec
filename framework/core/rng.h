// Counter-based random numbers (Philox-4x32-10), keyed by (seed, purpose).
//
// A stream is a pure function of its key and a counter: the same (seed, purpose, index) gives
// the same number on every rank, in every layout, in any order of evaluation. Parameter init,
// data shuffling and synthetic data each take their own purpose string.
#pragma once

#include <math.h>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "framework/core/host_device.h"

namespace hp {

// 64-bit FNV-1a; stable across platforms, used to turn purpose strings into keys (and the bytes
// of small plain keys into hash-table hashes).
inline uint64_t hash64_bytes(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}
inline uint64_t hash64(const std::string& s, uint64_t h = 1469598103934665603ull) {
  return hash64_bytes(s.data(), s.size(), h);
}

// Host and device share the arithmetic below (HP_HD: framework/core/host_device.h).
namespace rng_detail {

// Products and sums that are never fused into an FMA, so the host (built with
// -ffp-contract=off) and the device round every step identically. Division and square root are
// correctly rounded on both.
HP_HD inline double mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
HP_HD inline double add(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

// Natural log of x in (0, 1]: x = m * 2^e with m in [sqrt(1/2), sqrt(2)), then
// ln m = 2 atanh(s) = 2 s (1 + s^2/3 + s^4/5 + ...), s = (m - 1) / (m + 1), |s| < 0.172. Twelve
// terms reach double precision. Written out in +, *, / only: libm's log and CUDA's may differ in
// the last bit, and parameter init must be bitwise the same on both.
HP_HD inline double log_unit(double x) {
  int e = 0;
  double m = frexp(x, &e);  // exact; m in [0.5, 1)
  if (m < 0.70710678118654752440) {
    m = mul(m, 2.0);
    e -= 1;
  }
  const double s = (m - 1.0) / (m + 1.0);
  const double z = mul(s, s);
  double p = 1.0 / 23.0;
  for (int k = 10; k >= 0; --k) p = add(mul(p, z), 1.0 / (2 * k + 1));
  return add(mul(static_cast<double>(e), 0.69314718055994530942), mul(mul(2.0, s), p));
}

// cos(2 pi u) for u in [0, 1): the quadrant and the reflection about pi/4 are exact, leaving a
// Taylor series on [0, pi/4] (terms to a^18 / 18!, below 1e-17 there).
HP_HD inline double cos_2pi(double u) {
  const double x = mul(u, 4.0);  // exact
  const int q = static_cast<int>(x);
  double f = x - q;  // exact, [0, 1)
  const bool reflect = f > 0.5;
  if (reflect) f = 1.0 - f;  // exact
  const double a = mul(f, 1.57079632679489661923);
  const double a2 = mul(a, a);
  double c = 1.0, s = 1.0;  // Horner from the highest term down
  for (int n = 18; n >= 2; n -= 2) c = add(1.0, -mul(c, a2 / (n * (n - 1))));
  for (int n = 19; n >= 3; n -= 2) s = add(1.0, -mul(s, a2 / (n * (n - 1))));
  s = mul(s, a);
  const double cos_a = reflect ? s : c, sin_a = reflect ? c : s;
  switch (q & 3) {
    case 0:
      return cos_a;
    case 1:
      return -sin_a;
    case 2:
      return -cos_a;
    default:
      return sin_a;
  }
}

}  // namespace rng_detail

// The Philox-4x32-10 block function of Salmon et al. (SC 2011, the Random123 library): the
// 128-bit counter ctr[0..3] under the 64-bit key key[0..1], ten rounds. Tested against the
// published known-answer vectors (tests/framework/rng_test.cpp).
HP_HD inline void philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
  uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
  uint32_t k0 = key[0], k1 = key[1];
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

// Four 32-bit words for the 64-bit counter `ctr` under a 64-bit key: Philox-4x32-10 of the
// counter {low word of ctr, high word of ctr, 0, 0} under the key {low word, high word}.
HP_HD inline void philox4x32(uint64_t key, uint64_t ctr, uint32_t out[4]) {
  const uint32_t c[4] = {static_cast<uint32_t>(ctr), static_cast<uint32_t>(ctr >> 32), 0, 0};
  const uint32_t k[2] = {static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32)};
  philox4x32_10(c, k, out);
}

// Standard normal number `i` of stream `key` (Box-Muller on the two 53-bit uniforms of one
// block), bitwise the same on the host and the device.
HP_HD inline double philox_normal(uint64_t key, uint64_t i) {
  uint32_t b[4];
  philox4x32(key, i, b);
  constexpr uint64_t kMask53 = (1ull << 53) - 1;
  double u1 = static_cast<double>((static_cast<uint64_t>(b[0]) << 21 ^ b[1]) & kMask53) * 0x1.0p-53;
  const double u2 =
      static_cast<double>((static_cast<uint64_t>(b[2]) << 21 ^ b[3]) & kMask53) * 0x1.0p-53;
  if (u1 < 1e-300) u1 = 1e-300;
  return rng_detail::mul(sqrt(-2.0 * rng_detail::log_unit(u1)), rng_detail::cos_2pi(u2));
}

class Philox {
 public:
  Philox(uint64_t seed, const std::string& purpose)
      : key_(seed ^ hash64(purpose) * 0x9E3779B97F4A7C15ull) {}
  Philox(uint64_t seed, uint64_t purpose_key) : key_(seed ^ purpose_key * 0x9E3779B97F4A7C15ull) {}

  // The stream's key: what device code needs to draw the same numbers (philox_normal).
  uint64_t key() const { return key_; }

  // Four 32-bit words for counter `ctr`.
  std::array<uint32_t, 4> block(uint64_t ctr) const {
    std::array<uint32_t, 4> b;
    philox4x32(key_, ctr, b.data());
    return b;
  }

  uint64_t u64(uint64_t i) const {
    auto b = block(i);
    return (static_cast<uint64_t>(b[0]) << 32) | b[1];
  }
  // Uniform in [0, 1).
  double uniform(uint64_t i) const { return static_cast<double>(u64(i) >> 11) * 0x1.0p-53; }
  // Standard normal (philox_normal).
  double normal(uint64_t i) const { return philox_normal(key_, i); }
  // Uniform integer in [0, n).
  uint64_t below(uint64_t i, uint64_t n) const { return n ? u64(i) % n : 0; }

 private:
  uint64_t key_;
};

}  // namespace hp
