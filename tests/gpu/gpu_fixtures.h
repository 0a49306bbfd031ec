// What the GPU tests share: the skip without a device, and the offload tests' model shapes and
// batch (a dense stack large enough that block inputs span many chunks, and a small GPT-OSS-like
// MoE with windows, sinks and biases).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>

#include "framework/backend/cuda/cuda_backend.h"
#include "framework/data/loader.h"
#include "framework/model/config.h"

#define HP_REQUIRE_GPU()                                                  \
  do {                                                                    \
    if (::hp::cuda_device_count() == 0)                                   \
      GTEST_SKIP() << "no CUDA device: GPU tests run on the GPU machine"; \
  } while (0)

namespace hp::gpu_test {

inline ModelConfig offload_dense_config() {
  ModelConfig c;
  c.vocab_size = 512;
  c.d_model = 1024;
  c.n_layers = 6;
  c.n_heads = 8;
  c.n_kv_heads = 2;
  c.head_dim = 128;
  c.ffn_dim = 2816;
  return c;
}

inline ModelConfig offload_moe_config() {
  ModelConfig c;
  c.vocab_size = 97;
  c.d_model = 256;
  c.n_layers = 4;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 64;
  c.n_experts = 4;
  c.top_k = 2;
  c.expert_ffn_dim = 192;
  c.sliding_window = 64;
  c.window_layers = WindowLayers::kEven;
  c.attn_sinks = true;
  c.attn_bias = true;
  c.activation = "gptoss";
  c.moe_aux_coef = 0.01;
  return c;
}

// 4 rows of 512 synthetic tokens over c's vocabulary (the last id ends documents).
inline PackedBatch offload_batch(const ModelConfig& c, uint64_t seed) {
  DataConfig d;
  d.vocab_size = c.vocab_size;
  d.eot_token = static_cast<int32_t>(c.vocab_size - 1);
  d.seq_len = 512;
  d.rows_per_batch = 4;
  d.seed = seed;
  d.synthetic_vocab = c.vocab_size - 1;
  d.synthetic_mean_doc_len = 200;
  return DataLoader::open(d)->next();
}

}  // namespace hp::gpu_test
