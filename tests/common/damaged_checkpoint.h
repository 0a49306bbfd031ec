// A checkpoint file that opens but whose metadata is damaged: what the corruption tests of the
// checkpoint reader (tests/framework) and of `hotpath inspect` (tests/launch) read.
#pragma once

#include <algorithm>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "framework/checkpoint/checkpoint.h"

namespace hp::test {

// Writes at `path` a checkpoint of two small datasets under /params, then flips one bit of the
// first one's name in the link message of the /params group's object header: the file opens, its
// root attributes read, but the group's checksum fails, so /params cannot be listed or opened.
inline void write_damaged_checkpoint(const std::string& path) {
  {
    CheckpointWriter w(path, nullptr);
    const std::vector<float> v = {1.5f, -2.25f, 3.0f, 4.75f, -5.5f, 6.0f, 7.125f, -8.0f};
    w.write_rows("/params/a_rather_long_parameter_name", {8}, DType::kF32, 8, RowRange{0, 8},
                 v.data());
    w.write_rows("/params/another_long_parameter_name", {8}, DType::kF32, 8, RowRange{0, 8},
                 v.data());
    w.set_attr("format", std::string(kCheckpointFormat));
    w.set_attr("format_version", kCheckpointVersion);
    w.close();
  }
  std::vector<char> bytes;
  {
    std::ifstream f(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), {});
  }
  const std::string needle = "a_rather_long_parameter_name";
  const auto it = std::search(bytes.begin(), bytes.end(), needle.begin(), needle.end());
  if (it == bytes.end())
    throw std::runtime_error(path + ": the dataset name to damage is not in the file");
  it[3] ^= 0x01;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f.flush()) throw std::runtime_error(path + ": cannot rewrite the damaged file");
}

}  // namespace hp::test
