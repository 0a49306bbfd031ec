// What the CPU tests (tests/framework, tests/parallel) and the CUDA tests (tests/gpu, through
// gpu_fixtures.h) share, defined once: a scratch directory, the GPT-OSS-like MoE variant of a model
// shape, synthetic packed batches over a model's vocabulary and their comparison, host f32 copies
// of device tensors, and bitwise records of losses and gradients with their comparison.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/core/tensor.h"
#include "framework/data/loader.h"
#include "framework/model/config.h"

namespace hp::test {

// A fresh directory under /tmp, removed with everything in it when the test ends.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/hp_test_XXXXXX";
    const char* p = ::mkdtemp(tmpl);
    EXPECT_NE(p, nullptr);
    path_ = p != nullptr ? p : "/tmp";
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const {
    return (std::filesystem::path(path_) / name).string();
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// `c` as a GPT-OSS-like mixture of experts: sliding windows on even layers, attention sinks and
// biases, the gptoss activation and an auxiliary load-balancing loss.
inline ModelConfig gptoss_like_moe(ModelConfig c, int64_t experts, int64_t top_k,
                                   int64_t expert_ffn_dim, int64_t window) {
  c.n_experts = experts;
  c.top_k = top_k;
  c.expert_ffn_dim = expert_ffn_dim;
  c.sliding_window = window;
  c.window_layers = WindowLayers::kEven;
  c.attn_sinks = true;
  c.attn_bias = true;
  c.activation = Activation::kGptOss;
  c.moe_aux_coef = 0.01;
  return c;
}

// One global batch of `rows` rows of `seq_len` synthetic tokens over c's vocabulary (the last id
// ends documents), documents of mean length `mean_doc_len`; the same for the same arguments.
inline PackedBatch synthetic_batch(const ModelConfig& c, uint64_t seed, int64_t seq_len,
                                   int64_t rows, double mean_doc_len) {
  DataConfig d;
  d.vocab_size = c.vocab_size;
  d.eot_token = static_cast<int32_t>(c.vocab_size - 1);
  d.seq_len = seq_len;
  d.rows_per_batch = rows;
  d.seed = seed;
  d.synthetic_vocab = c.vocab_size - 1;
  d.synthetic_mean_doc_len = mean_doc_len;
  return DataLoader::open(d)->next();
}

// Every field of two packed batches is equal (tokens, targets, positions, sequences, padding and
// the counts).
inline void expect_same_batch(const PackedBatch& a, const PackedBatch& b, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(a.rows, b.rows);
  EXPECT_EQ(a.seq_len, b.seq_len);
  EXPECT_EQ(a.inputs, b.inputs);
  EXPECT_EQ(a.targets, b.targets);
  EXPECT_EQ(a.positions, b.positions);
  EXPECT_EQ(a.cu_seqlens, b.cu_seqlens);
  EXPECT_EQ(a.seq_is_pad, b.seq_is_pad);
  EXPECT_EQ(a.max_seqlen, b.max_seqlen);
  EXPECT_EQ(a.num_valid_targets, b.num_valid_targets);
  EXPECT_EQ(a.num_doc_tokens, b.num_doc_tokens);
}

// The raw 32-bit words of host tensors (f32 losses and gradients), appended in order.
inline void append_bits(const Tensor& host, std::vector<uint32_t>& out) {
  const size_t n = out.size();
  out.resize(n + host.nbytes() / 4);
  std::memcpy(out.data() + n, host.raw(), host.nbytes());
}

// A copy of t (f32 or bf16, on any device) in f32 on the host.
inline Tensor host_f32(Backend& be, const Tensor& t) {
  Tensor f = be.empty(t.shape(), DType::kF32);
  if (t.dtype() == DType::kF32)
    be.copy(t, f);
  else
    be.convert(t, f);
  Tensor h = Tensor::host(t.shape(), DType::kF32);
  be.read_to_host(f, h, SyncCause::kOther);
  return h;
}

// Every word of `got` equals the one of `ref`; says how many differ, and whether the first one
// (the first step's loss, where the records start with it) does.
inline void expect_same_bits(const std::vector<uint32_t>& ref, const std::vector<uint32_t>& got,
                             const std::string& what) {
  ASSERT_EQ(ref.size(), got.size()) << what;
  ASSERT_FALSE(ref.empty()) << what;
  size_t diff = 0;
  for (size_t i = 0; i < ref.size(); ++i) diff += ref[i] != got[i];
  EXPECT_EQ(diff, 0u) << what << ": " << diff << " of " << ref.size()
                      << " loss/gradient values differ from the reference"
                      << (ref[0] != got[0] ? " (the first loss too)" : "");
}

}  // namespace hp::test
