// Activation offload on the CUDA backend through a link arbiter (Backend::set_link_arbiter):
// losses and gradients bitwise identical to the same store without one, every copy cut into
// granted chunks (counted), no offload syncs in the steady state, and grant waits on the
// backend's copy issuer, never on the thread that drives the backend. Skips without a GPU.
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <mutex>

#include "framework/backend/cuda/cuda_backend.h"
#include "framework/backend/link_arbiter.h"
#include "framework/data/loader.h"
#include "framework/model/activation_store.h"
#include "framework/model/model.h"
#include "tests/common/gate_arbiter.h"
#include "tests/gpu/gpu_fixtures.h"

namespace hp {
namespace {

using gpu_test::offload_batch;
using gpu_test::offload_dense_config;
using gpu_test::offload_moe_config;

using SK = Backend::StreamKind;

struct Outcome {
  std::vector<uint32_t> bits;  // losses and gradients (f32) of every step
  OffloadStats stats;          // of the last step
  LinkArbiterStats copies;     // of the last step
  int64_t last_step_offload_syncs = 0;
};

void append_bits(Backend& be, const Tensor& t, std::vector<uint32_t>& out) {
  Tensor h = Tensor::host(t.shape(), t.dtype());
  be.read_to_host(t, h, SyncCause::kOther);
  const size_t n = out.size();
  out.resize(n + h.nbytes() / 4);
  std::memcpy(out.data() + n, h.raw(), h.nbytes());
}

Outcome run_steps(const ModelConfig& cfg, OffloadOptions off, LinkArbiter* arbiter, int steps = 3) {
  auto be = gpu_test::deterministic_cuda_backend();
  if (arbiter) be->set_link_arbiter(arbiter);
  off.poison_released = true;
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
    if (arbiter) arbiter->begin_step();
    LossSums sums = model.forward_backward(meta, 1.0 / batch.num_valid_targets);
    out.last_step_offload_syncs = be->syncs().get(SyncCause::kOffload);
    append_bits(*be, sums.lm, out.bits);
    append_bits(*be, sums.aux, out.bits);
    for (auto& p : model.params().all()) append_bits(*be, p->grad, out.bits);
    be->synchronize(SyncCause::kOther);
    if (arbiter) out.copies = arbiter->stats();
  }
  out.stats = model.activation_store().stats();
  be->set_link_arbiter(nullptr);
  return out;
}

OffloadOptions mode(OffloadMode m, int buffers = 2, int lookahead = 1) {
  OffloadOptions o;
  o.mode = m;
  o.buffers = buffers;
  o.lookahead = lookahead;
  return o;
}

void expect_same_bits(const Outcome& ref, const Outcome& got, const std::string& what) {
  ASSERT_EQ(ref.bits.size(), got.bits.size()) << what;
  size_t diff = 0;
  for (size_t i = 0; i < ref.bits.size(); ++i) diff += ref.bits[i] != got.bits[i];
  EXPECT_EQ(diff, 0u) << what << ": " << diff << " of " << ref.bits.size()
                      << " loss/gradient values differ with the arbiter on";
}

TEST(CudaLinkOffload, ArbiterChangesNoBitsAndNeedsNoOffloadSyncs) {
  HP_REQUIRE_GPU();
  // Not a divisor of any block input: every copy ends in a partial chunk.
  constexpr int64_t kChunk = 1500000;
  for (const ModelConfig& cfg : {offload_dense_config(), offload_moe_config()}) {
    for (const OffloadOptions& o : {mode(OffloadMode::kSingle), mode(OffloadMode::kDouble, 2, 1),
                                    mode(OffloadMode::kDouble, 3, 2)}) {
      const std::string what =
          str_cat("d_model=", cfg.d_model, " ", offload_mode_name(o.mode), " L=", o.lookahead);
      const Outcome plain = run_steps(cfg, o, nullptr);
      LocalLinkArbiter arbiter(kChunk);
      const Outcome on = run_steps(cfg, o, &arbiter);
      expect_same_bits(plain, on, what);
      EXPECT_EQ(on.last_step_offload_syncs, 0) << what;
      ASSERT_EQ(on.stats.offloaded_blocks, cfg.n_layers - 1) << what;
      const int64_t block = on.stats.d2h_bytes / on.stats.offloaded_blocks;
      const int64_t per_copy = (block + kChunk - 1) / kChunk;
      for (int d = 0; d < 2; ++d)
        EXPECT_EQ(on.copies.chunks[d], on.stats.offloaded_blocks * per_copy) << what;
      EXPECT_EQ(on.copies.bytes[static_cast<int>(CopyDirection::kOffload)], on.stats.d2h_bytes);
      EXPECT_EQ(on.copies.bytes[static_cast<int>(CopyDirection::kReload)], on.stats.h2d_bytes);
    }
  }
}

TEST(CudaLinkOffload, ChunkedReloadFallbackWithArbiter) {
  HP_REQUIRE_GPU();
  const ModelConfig cfg = offload_dense_config();
  OffloadOptions o = mode(OffloadMode::kDouble, 2, 1);
  o.staging_bytes = 1 << 20;
  const Outcome plain = run_steps(cfg, o, nullptr);
  LocalLinkArbiter arbiter(300000);
  const Outcome on = run_steps(cfg, o, &arbiter);
  expect_same_bits(plain, on, "chunked reloads");
  EXPECT_GT(on.stats.chunked_blocks, 0);
  EXPECT_EQ(on.last_step_offload_syncs, 0);
}

TEST(CudaLinkOffload, DrivingThreadNeverWaitsForAGrant) {
  HP_REQUIRE_GPU();
  test::GateArbiter gate(1 << 16);
  auto be = gpu_test::deterministic_cuda_backend();
  be->set_link_arbiter(&gate);
  const int64_t n = 100000;  // 400000 bytes: 7 chunks of 64 KiB
  std::shared_ptr<Storage> pinned = be->pinned_host_storage(static_cast<size_t>(n) * 4);
  ASSERT_TRUE(pinned);
  Tensor src(pinned, 0, {n}, DType::kF32);
  for (int64_t i = 0; i < n; ++i) src.data<float>()[i] = static_cast<float>(i % 1000);
  Tensor dev = be->zeros({n}, DType::kF32);
  std::shared_ptr<Backend::Event> zeroed = be->record_event(SK::kCompute);
  be->wait_event(SK::kCopy, *zeroed);
  be->set_stream(SK::kCopy);
  be->copy_over_link(src, dev, CopyDirection::kReload);
  std::shared_ptr<Backend::Event> done = be->record_event(SK::kCopy);
  be->set_stream(SK::kCompute);
  // The driving thread is here while the issuer waits for the first grant.
  gate.wait_for_a_waiter();
  EXPECT_EQ(gate.released(), 0);
  gate.open();
  be->syncs().reset();
  be->wait_event(SK::kCompute, *done);  // returns once the issuer recorded `done`
  Tensor back = Tensor::host({n}, DType::kF32);
  be->read_to_host(dev, back, SyncCause::kOther);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(back.data<float>()[i], static_cast<float>(i % 1000));
  be->synchronize(SyncCause::kOther);
  EXPECT_EQ(gate.released(), 7);
  EXPECT_EQ(be->syncs().get(SyncCause::kOffload), 0);
  be->set_link_arbiter(nullptr);
}

}  // namespace
}  // namespace hp
