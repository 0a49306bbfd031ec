// MXFP4 dequantization against values worked out by hand, and safetensors header checks.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "framework/core/error.h"
#include "launch/hf/hf_convert.h"
#include "launch/hf/safetensors.h"

namespace hp {
namespace {

TEST(Mxfp4, E2m1Codes) {
  // sign | 2 exponent bits | 1 mantissa bit, exponent bias 1; code 1 is the subnormal 0.5.
  const float want[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int c = 0; c < 16; ++c) EXPECT_EQ(e2m1_value(static_cast<uint8_t>(c)), want[c]) << c;
}

TEST(Mxfp4, HandComputedBlocks) {
  // One expert, 2 output rows, 2 groups of 32 inputs each: blocks [1, 2, 2, 16], scales [1, 2, 2].
  std::vector<uint8_t> blocks(2 * 2 * 16, 0), scales = {127, 130, 120, 0};
  // Row 0, group 0, scale 2^0: byte 0 = 0x21 -> value 0 = code 1 (0.5), value 1 = code 2 (1.0);
  // byte 15 = 0xF7 -> value 30 = 6, value 31 = -6.
  blocks[0] = 0x21;
  blocks[15] = 0xF7;
  // Row 0, group 1, scale 2^3: byte 3 = 0x9C -> value 38 = code 0xC (-2) * 8 = -16, value 39 =
  // code 0x9 (-0.5) * 8 = -4.
  blocks[16 + 3] = 0x9C;
  // Row 1, group 0, scale 2^-7: byte 1 = 0x53 -> value 2 = 1.5/128, value 3 = 3/128.
  blocks[32 + 1] = 0x53;
  // Row 1, group 1, scale byte 0 = 2^-127: code 7 (6) -> 6 * 2^-127 (a float subnormal).
  blocks[48 + 0] = 0x07;
  const std::vector<float> w = mxfp4_dequantize(blocks.data(), scales.data(), 1, 2, 2);
  ASSERT_EQ(w.size(), 128u);
  // Output layout [E, in = 64, out = 2]: element (in i, out r) at i * 2 + r.
  auto at = [&](int in, int out) { return w[static_cast<size_t>(in * 2 + out)]; };
  EXPECT_EQ(at(0, 0), 0.5f);
  EXPECT_EQ(at(1, 0), 1.0f);
  EXPECT_EQ(at(30, 0), 6.0f);
  EXPECT_EQ(at(31, 0), -6.0f);
  EXPECT_EQ(at(32 + 6, 0), -16.0f);
  EXPECT_EQ(at(32 + 7, 0), -4.0f);
  EXPECT_EQ(at(2, 1), 1.5f / 128);
  EXPECT_EQ(at(3, 1), 3.0f / 128);
  EXPECT_EQ(at(32, 1), std::ldexp(6.0f, -127));
  int nonzero = 0;
  for (float x : w) nonzero += x != 0.0f;
  EXPECT_EQ(nonzero, 9);  // every other byte is 0x00: +0
}

std::string temp_file(const std::string& bytes) {
  char name[] = "/tmp/hp_st_XXXXXX";
  const int fd = mkstemp(name);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  close(fd);
  return name;
}

std::string with_header(const std::string& json, size_t data_bytes) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i)
    s[static_cast<size_t>(i)] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  return s + json + std::string(data_bytes, '\0');
}

void expect_error(const std::string& bytes, const std::string& needle) {
  const std::string path = temp_file(bytes);
  try {
    SafetensorsFile f(path);
    ADD_FAILURE() << "accepted: " << needle;
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  std::remove(path.c_str());
}

TEST(Safetensors, BadHeadersNameTheProblem) {
  expect_error("short", "too short");
  expect_error(with_header("{}", 0).replace(0, 8, std::string("\xff\xff\xff\xff\0\0\0\0", 8)),
               "header length");
  expect_error(with_header("{not json", 0), "not valid JSON");
  expect_error(with_header(R"({"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}})", 2),
               "unknown dtype 'Q7'");
  expect_error(with_header(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})", 4),
               "tensor 'w': 4 bytes for shape [2]");
  expect_error(with_header(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 4),
               "not inside");
}

TEST(Safetensors, EveryHeaderRuleIsChecked) {
  const std::string a = R"("a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]})";
  const std::string b = R"("b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]})";
  // Accepted: two tensors tiling 12 bytes, metadata, a zero-size tensor.
  {
    const std::string path = temp_file(with_header(
        "{\"__metadata__\": {\"format\": \"pt\"}, " + a + ", " + b +
            R"(, "z": {"dtype": "F16", "shape": [0, 3], "data_offsets": [12, 12]}})",
        12));
    SafetensorsFile f(path);
    EXPECT_EQ(f.entries().size(), 3u);
    std::remove(path.c_str());
  }
  expect_error(with_header("{" + a + ", " + b + ", " + a + "}", 12), "key 'a' appears twice");
  expect_error(
      with_header(R"({"a": {"dtype": "F32", "dtype": "F16", "shape": [2], "data_offsets": [0, 8]}})",
                  8),
      "key 'dtype' appears twice in 'a'");
  expect_error(with_header("{" + a + "}", 12), "the tensors cover 8 of the 12 data bytes");
  expect_error(with_header("{" + a + R"(, "b": {"dtype": "U8", "shape": [4], "data_offsets": [9, 13]}})",
                           13),
               "tensor 'b': data_offsets [9, 13] leave bytes [8, 9)");
  expect_error(with_header("{" + a + R"(, "b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}})",
                           8),
               "overlap");
  expect_error(
      with_header(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [18446744073709551608, 0]}})",
                  8),
      "tensor 'a': data_offsets");
  expect_error(
      with_header(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}})", 8),
      "tensor 'a': data_offsets");
  expect_error(
      with_header(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", 8),
      "end before they begin");
  expect_error(
      with_header(R"({"a": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 8]}})",
                  8),
      "more than 2^64");
  expect_error(with_header(R"({"a": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})", 8),
               "integers >= 0");
  expect_error(with_header(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}})",
                           8),
               "unknown key 'x'");
  expect_error(with_header(R"({"__metadata__": 3})", 0), "__metadata__ is not a JSON object");
  expect_error(with_header("[]", 0), "not a JSON object");
}

TEST(Safetensors, NonFiniteValuesAreRefused) {
  SafetensorsEntry e;
  e.dtype = "BF16";
  e.shape = {3};
  e.file = "f.safetensors";
  const uint8_t bf16[6] = {0x80, 0x3f, 0x80, 0xff, 0, 0};  // 1, -inf, 0
  try {
    safetensors_to_f32("w", e, bf16);
    ADD_FAILURE() << "accepted -inf";
  } catch (const UserError& err) {
    EXPECT_NE(std::string(err.what()).find("tensor 'w' in f.safetensors holds -inf at flat index 1"),
              std::string::npos)
        << err.what();
  }
}

TEST(Safetensors, WriteReadRoundTrip) {
  const std::vector<float> a = {1.5f, -2.25f, 3.0e-3f, 7.0f, 0.0f, -0.0f};
  const std::string path = "/tmp/hp_st_roundtrip.safetensors";
  for (const char* dt : {"F32", "BF16"}) {
    write_safetensors(path, {{"a", {2, 3}, a.data()}}, dt, {{"k", "v"}});
    SafetensorsFile f(path);
    const auto& e = f.entries().at("a");
    EXPECT_EQ(e.dtype, dt);
    EXPECT_EQ(e.shape, (Shape{2, 3}));
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace hp
