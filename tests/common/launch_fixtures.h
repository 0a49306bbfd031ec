// What the launch tests (tests/launch) share: the options of a small dense model on the CPU
// backend, and a fresh scratch directory.
#pragma once

#include <filesystem>
#include <string>

#include "launch/options.h"

namespace hp::test {

// A 2-layer dense model of width 32 (vocabulary 16) on the CPU backend, rows of 16 tokens and
// 64 tokens a step; the rest are the defaults.
inline TrainOptions small_dense_options() {
  TrainOptions o;
  o.model.vocab_size = 16;
  o.model.d_model = 32;
  o.model.n_layers = 2;
  o.model.n_heads = 2;
  o.model.n_kv_heads = 1;
  o.model.head_dim = 16;
  o.model.ffn_dim = 64;
  o.device.kind = DeviceKind::kCpu;
  o.data.seq_len = 16;
  o.data.batch_tokens = 64;
  return o;
}

// An empty directory <tmp>/hotpath_<name>, whatever was there before.
inline std::filesystem::path fresh_temp_dir(const std::string& name) {
  const std::filesystem::path d = std::filesystem::temp_directory_path() / ("hotpath_" + name);
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

}  // namespace hp::test
