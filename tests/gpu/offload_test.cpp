// Activation offload on the CUDA backend: losses and gradients bitwise identical for offload
// none / single / double (the copies are exact and every kernel is deterministic), with released
// device copies poisoned so a missing event shows; both fallbacks; no offload syncs in the steady
// state. Skips without a GPU.
#include <gtest/gtest.h>

#include <cstring>

#include "framework/backend/cuda/cuda_backend.h"
#include "framework/data/loader.h"
#include "framework/model/activation_store.h"
#include "framework/model/model.h"
#include "tests/gpu/gpu_fixtures.h"

namespace hp {
namespace {

using gpu_test::offload_batch;
using gpu_test::offload_dense_config;
using gpu_test::offload_moe_config;

struct Outcome {
  std::vector<uint32_t> bits;  // losses and gradients (f32) of every step
  OffloadStats stats;
  int64_t last_step_offload_syncs = 0;
};

void append_bits(Backend& be, const Tensor& t, std::vector<uint32_t>& out) {
  Tensor h = Tensor::host(t.shape(), t.dtype());
  be.read_to_host(t, h, SyncCause::kOther);
  const size_t n = out.size();
  out.resize(n + h.nbytes() / 4);
  std::memcpy(out.data() + n, h.raw(), h.nbytes());
}

Outcome run_steps(const ModelConfig& cfg, OffloadOptions off, int steps = 2) {
  auto be = gpu_test::deterministic_cuda_backend();
  off.poison_released = off.mode != OffloadMode::kNone;
  ModelOptions mo;
  mo.checkpoint_activations = true;
  mo.max_positions = 512;
  mo.offload = off;
  Model model(cfg, mo, *be);
  model.init_params(11);
  Outcome out;
  for (int s = 0; s < steps; ++s) {
    PackedBatch batch = offload_batch(cfg, 40 + s);
    BatchMeta meta = be->upload_batch(batch);
    model.zero_grads();
    be->syncs().reset();
    LossSums sums = model.forward_backward(meta, 1.0 / batch.num_valid_targets);
    out.last_step_offload_syncs = be->syncs().get(SyncCause::kOffload);
    append_bits(*be, sums.lm, out.bits);
    append_bits(*be, sums.aux, out.bits);
    for (auto& p : model.params().all()) append_bits(*be, p->grad, out.bits);
  }
  out.stats = model.activation_store().stats();
  return out;
}

OffloadOptions mode(OffloadMode m, int buffers = 2, int lookahead = 1) {
  OffloadOptions o;
  o.mode = m;
  o.buffers = buffers;
  o.lookahead = lookahead;
  return o;
}

void expect_same_bits(const Outcome& ref, const Outcome& got, const char* what) {
  ASSERT_EQ(ref.bits.size(), got.bits.size()) << what;
  size_t diff = 0;
  for (size_t i = 0; i < ref.bits.size(); ++i) diff += ref.bits[i] != got.bits[i];
  EXPECT_EQ(diff, 0u) << what << ": " << diff << " of " << ref.bits.size()
                      << " loss/gradient values differ from offload=none";
  EXPECT_EQ(ref.bits[0], got.bits[0]) << what << ": first-step loss differs";
}

TEST(CudaOffload, ModesAreBitwiseIdentical) {
  HP_REQUIRE_GPU();
  for (const ModelConfig& cfg : {offload_dense_config(), offload_moe_config()}) {
    const Outcome none = run_steps(cfg, mode(OffloadMode::kNone));
    const Outcome single = run_steps(cfg, mode(OffloadMode::kSingle));
    const Outcome dbl = run_steps(cfg, mode(OffloadMode::kDouble, 2, 1));
    const Outcome dbl2 = run_steps(cfg, mode(OffloadMode::kDouble, 3, 2));
    expect_same_bits(none, single, "single");
    expect_same_bits(none, dbl, "double K=2 L=1");
    expect_same_bits(none, dbl2, "double K=3 L=2");
    for (const Outcome* o : {&single, &dbl, &dbl2}) {
      EXPECT_EQ(o->stats.offloaded_blocks, cfg.n_layers - 1);
      EXPECT_EQ(o->stats.h2d_bytes, o->stats.d2h_bytes);
      EXPECT_EQ(o->stats.pageable_blocks + o->stats.chunked_blocks, 0);
      EXPECT_EQ(o->last_step_offload_syncs, 0) << "steady-state offload syncs";
    }
  }
}

TEST(CudaOffload, FallbacksAreBitwiseIdentical) {
  HP_REQUIRE_GPU();
  const ModelConfig cfg = offload_dense_config();
  const int64_t block = 4 * 512 * cfg.d_model * 2;  // bf16
  const Outcome none = run_steps(cfg, mode(OffloadMode::kNone));
  OffloadOptions pageable = mode(OffloadMode::kDouble);
  pageable.pinned_pool_bytes = 2 * block;
  const Outcome p = run_steps(cfg, pageable);
  expect_same_bits(none, p, "double, pinned pool of two blocks");
  EXPECT_EQ(p.stats.pageable_blocks, cfg.n_layers - 3);
  EXPECT_EQ(p.last_step_offload_syncs, cfg.n_layers - 3);
  OffloadOptions chunked = mode(OffloadMode::kDouble, 3, 2);
  chunked.staging_bytes = block / 3 + 4096;
  const Outcome c = run_steps(cfg, chunked);
  expect_same_bits(none, c, "double, staging buffers smaller than a block input");
  EXPECT_EQ(c.stats.chunked_blocks, cfg.n_layers - 1);
  EXPECT_EQ(c.last_step_offload_syncs, 0);
}

}  // namespace
}  // namespace hp
