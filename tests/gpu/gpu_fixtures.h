// What the GPU tests share: the skip without a device, and the offload tests' model shapes and
// batch (a dense stack large enough that block inputs span many chunks, and a small GPT-OSS-like
// MoE with windows, sinks and biases). The recipes they share with the CPU tests (the MoE
// variant, synthetic batches, bitwise records) live in tests/common/fixtures.h.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "framework/backend/cuda/cuda_backend.h"
#include "framework/data/loader.h"
#include "framework/model/config.h"
#include "tests/common/fixtures.h"

#define HP_REQUIRE_GPU()                                                  \
  do {                                                                    \
    if (::hp::cuda_device_count() == 0)                                   \
      GTEST_SKIP() << "no CUDA device: GPU tests run on the GPU machine"; \
  } while (0)

namespace hp::gpu_test {

// A device tensor's elements as doubles (bf16 through an f32 copy on the device).
inline std::vector<double> device_values(Backend& be, const Tensor& t) {
  Tensor src = t;
  if (t.dtype() != DType::kF32) {
    src = be.empty(t.shape(), DType::kF32);
    be.convert(t, src);
  }
  Tensor h = Tensor::host(t.shape(), DType::kF32);
  be.read_to_host(src, h, SyncCause::kOther);
  return to_double_vector(h);
}

// A CUDA backend whose results are bitwise reproducible (deterministic attention backward), for
// the tests that compare runs bit for bit.
inline std::unique_ptr<Backend> deterministic_cuda_backend() {
  CudaBackendOptions o;
  o.deterministic = true;
  return make_cuda_backend(0, o);
}

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
  return test::gptoss_like_moe(c, /*experts=*/4, /*top_k=*/2, /*expert_ffn_dim=*/192,
                               /*window=*/64);
}

// 4 rows of 512 synthetic tokens over c's vocabulary (the last id ends documents).
inline PackedBatch offload_batch(const ModelConfig& c, uint64_t seed) {
  return test::synthetic_batch(c, seed, /*seq_len=*/512, /*rows=*/4, /*mean_doc_len=*/200);
}

}  // namespace hp::gpu_test
