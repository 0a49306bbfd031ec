// What the launch tests (tests/launch) share: the options of a small dense model on the CPU
// backend, a fresh scratch directory, the one check of the options, and the bytes of a CPU model's
// training state.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "framework/model/model.h"
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

// The message with which the one check of the options (validate_train_options, for `world`
// ranks) refuses `o`; empty when it accepts them.
inline std::string validation_message(const TrainOptions& o, int world = 1) {
  try {
    validate_train_options(o, world);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

// The bytes of every parameter's fp32 master, then (with_moments) its AdamW m and v, one entry
// per tensor in the model's parameter order: what "bitwise unchanged" compares. CPU tensors only.
inline std::vector<std::vector<char>> state_bytes(Model& m, bool with_moments = true) {
  std::vector<std::vector<char>> out;
  for (auto& p : m.params().all())
    for (const Tensor* t : {&p->master, &p->m, &p->v}) {
      const char* b = t->data<char>();
      out.emplace_back(b, b + t->nbytes());
      if (!with_moments) break;
    }
  return out;
}

}  // namespace hp::test
