// Counter-based random numbers (Philox-4x32-10), keyed by (seed, purpose).
//
// A stream is a pure function of its key and a counter: the same (seed, purpose, index) gives
// the same number on every rank, in every layout, in any order of evaluation. Parameter init,
// data shuffling and synthetic data each take their own purpose string.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

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

class Philox {
 public:
  Philox(uint64_t seed, const std::string& purpose)
      : key_(seed ^ hash64(purpose) * 0x9E3779B97F4A7C15ull) {}
  Philox(uint64_t seed, uint64_t purpose_key) : key_(seed ^ purpose_key * 0x9E3779B97F4A7C15ull) {}

  // Four 32-bit words for counter `ctr`.
  std::array<uint32_t, 4> block(uint64_t ctr) const {
    uint32_t c0 = static_cast<uint32_t>(ctr), c1 = static_cast<uint32_t>(ctr >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = static_cast<uint32_t>(key_), k1 = static_cast<uint32_t>(key_ >> 32);
    for (int r = 0; r < 10; ++r) {
      uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
      uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
      uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
      uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
      c1 = static_cast<uint32_t>(p1);
      c3 = static_cast<uint32_t>(p0);
      c0 = n0;
      c2 = n2;
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    return {c0, c1, c2, c3};
  }

  uint64_t u64(uint64_t i) const {
    auto b = block(i);
    return (static_cast<uint64_t>(b[0]) << 32) | b[1];
  }
  // Uniform in [0, 1).
  double uniform(uint64_t i) const { return static_cast<double>(u64(i) >> 11) * 0x1.0p-53; }
  // Standard normal (Box-Muller on two uniforms of one block).
  double normal(uint64_t i) const {
    auto b = block(i);
    double u1 = ((static_cast<uint64_t>(b[0]) << 21 ^ b[1]) & ((1ull << 53) - 1)) * 0x1.0p-53;
    double u2 = ((static_cast<uint64_t>(b[2]) << 21 ^ b[3]) & ((1ull << 53) - 1)) * 0x1.0p-53;
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  // Uniform integer in [0, n).
  uint64_t below(uint64_t i, uint64_t n) const { return n ? u64(i) % n : 0; }

 private:
  uint64_t key_;
};

}  // namespace hp
