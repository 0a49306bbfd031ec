#include "framework/core/crc32c.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace hp {
namespace {

std::vector<unsigned char> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(gen());
  return v;
}

// The check value of the CRC-32C specification (RFC 3720, B.4: CRC32C of "123456789").
TEST(Crc32c, SpecificationCheckValue) {
  const std::string s = "123456789";
  EXPECT_EQ(crc32c(s.data(), s.size()), 0xE3069283u);
  EXPECT_EQ(crc32c_portable(s.data(), s.size()), 0xE3069283u);
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
}

// The instruction path and the table path agree at every length and alignment, and a checksum
// continues across pieces.
TEST(Crc32c, PathsAgreeAndContinue) {
  const std::vector<unsigned char> v = random_bytes(1 << 20, 7);
  for (size_t off : {size_t{0}, size_t{1}, size_t{3}, size_t{7}})
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{63},
                     size_t{4096 + 5}, v.size() - 8})
      ASSERT_EQ(crc32c(v.data() + off, n), crc32c_portable(v.data() + off, n))
          << "offset " << off << " length " << n;
  const size_t cut = 12345;
  EXPECT_EQ(crc32c(v.data() + cut, v.size() - cut, crc32c(v.data(), cut)),
            crc32c(v.data(), v.size()));
}

// Every single-bit flip changes the checksum.
TEST(Crc32c, DetectsEveryBitFlip) {
  std::vector<unsigned char> v = random_bytes(257, 11);
  const uint32_t ref = crc32c(v.data(), v.size());
  for (size_t i = 0; i < v.size(); ++i)
    for (int b = 0; b < 8; ++b) {
      v[i] ^= static_cast<unsigned char>(1u << b);
      ASSERT_NE(crc32c(v.data(), v.size()), ref) << "byte " << i << " bit " << b;
      v[i] ^= static_cast<unsigned char>(1u << b);
    }
}

}  // namespace
}  // namespace hp
