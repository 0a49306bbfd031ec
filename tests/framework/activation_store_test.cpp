// Activation offload on the CPU backend, whose copy stream is a real worker thread with a
// simulated link: losses and gradients bitwise identical for offload none / single / double,
// both fallbacks (pageable host memory, chunked reloads), no offload syncs in the steady state,
// reloads never reading a host copy before its offload finished, and the copy queue's events.
// With a link arbiter on the backend: the same bits, every chunk granted and counted, and grant
// waits on the copy worker, never on the host thread.
#include "framework/model/activation_store.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <limits>
#include <mutex>
#include <thread>

#include "framework/backend/link_arbiter.h"
#include "framework/backend/cpu/cpu_copy_queue.h"
#include "framework/core/error.h"
#include "framework/data/loader.h"
#include "framework/model/model.h"
#include "tests/common/fixtures.h"
#include "tests/common/gate_arbiter.h"

namespace hp {
namespace {

using SK = Backend::StreamKind;

// Slow enough that every copy takes about a millisecond: copies and compute really overlap and
// a missing event would let compute read an unfinished copy.
constexpr double kSlowLinkGbps = 0.01;

ModelConfig dense_config() {
  ModelConfig c;
  c.vocab_size = 37;
  c.d_model = 32;
  c.n_layers = 5;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 8;
  c.ffn_dim = 48;
  c.init_std = 0.2;
  return c;
}

ModelConfig moe_config() {
  ModelConfig c = dense_config();
  c.n_layers = 4;
  return test::gptoss_like_moe(c, /*experts=*/4, /*top_k=*/2, /*expert_ffn_dim=*/24,
                               /*window=*/8);
}

PackedBatch make_batch(const ModelConfig& c, uint64_t seed) {
  return test::synthetic_batch(c, seed, /*seq_len=*/32, /*rows=*/3, /*mean_doc_len=*/12);
}

OffloadOptions offload(OffloadMode m, int buffers = 2, int lookahead = 1) {
  OffloadOptions o;
  o.mode = m;
  o.buffers = buffers;
  o.lookahead = lookahead;
  o.sim_link_gbps = kSlowLinkGbps;
  o.poison_released = m != OffloadMode::kNone;
  return o;
}

// Raw bits of every loss and gradient of `steps` consecutive steps (different batches).
struct Outcome {
  std::vector<uint32_t> bits;
  OffloadStats stats;  // of the last step
  int64_t last_step_offload_syncs = 0;
  LinkArbiterStats copies;  // the arbiter's, of the last step
};

Outcome run_steps(const ModelConfig& cfg, const OffloadOptions& off, int steps = 2,
                  LinkArbiter* arbiter = nullptr) {
  auto be = make_cpu_backend(DType::kF32);
  if (arbiter) be->set_link_arbiter(arbiter);
  ModelOptions mo;
  mo.checkpoint_activations = true;
  mo.offload = off;
  Model model(cfg, mo, *be);
  model.init_params(7);
  Outcome out;
  for (int s = 0; s < steps; ++s) {
    PackedBatch batch = make_batch(cfg, 100 + s);
    BatchMeta meta = be->upload_batch(batch);
    model.zero_grads();
    be->syncs().reset();
    if (arbiter) arbiter->begin_step();
    LossSums sums = model.forward_backward(meta, 1.0 / batch.num_valid_targets);
    be->synchronize(SyncCause::kOther);
    out.last_step_offload_syncs = be->syncs().get(SyncCause::kOffload);
    if (arbiter) out.copies = arbiter->stats();
    test::append_bits(sums.lm, out.bits);
    test::append_bits(sums.aux, out.bits);
    for (auto& p : model.params().all()) test::append_bits(p->grad, out.bits);
  }
  out.stats = model.activation_store().stats();
  return out;
}

void expect_same_bits(const Outcome& ref, const Outcome& got, const char* what) {
  test::expect_same_bits(ref.bits, got.bits, str_cat(what, " (reference: offload=none)"));
}

TEST(ActivationStore, ModesAreBitwiseIdenticalDense) {
  const ModelConfig cfg = dense_config();
  const Outcome none = run_steps(cfg, offload(OffloadMode::kNone));
  EXPECT_GT(none.stats.resident_bytes, 0);
  EXPECT_EQ(none.stats.d2h_bytes, 0);
  const Outcome single = run_steps(cfg, offload(OffloadMode::kSingle));
  const Outcome dbl = run_steps(cfg, offload(OffloadMode::kDouble, 2, 1));
  const Outcome dbl2 = run_steps(cfg, offload(OffloadMode::kDouble, 3, 2));
  expect_same_bits(none, single, "single");
  expect_same_bits(none, dbl, "double K=2 L=1");
  expect_same_bits(none, dbl2, "double K=3 L=2");
  // Every block but the last goes to the host and comes back.
  const int64_t block = 3 * 32 * cfg.d_model * 4;
  for (const Outcome* o : {&single, &dbl, &dbl2}) {
    EXPECT_EQ(o->stats.offloaded_blocks, cfg.n_layers - 1);
    EXPECT_EQ(o->stats.d2h_bytes, (cfg.n_layers - 1) * block);
    EXPECT_EQ(o->stats.h2d_bytes, (cfg.n_layers - 1) * block);
    EXPECT_EQ(o->stats.resident_bytes, block);
    EXPECT_EQ(o->stats.pageable_blocks + o->stats.chunked_blocks, 0);
  }
  EXPECT_EQ(single.stats.staging_bytes, block);
  EXPECT_EQ(dbl.stats.staging_bytes, 2 * block);
  EXPECT_EQ(dbl2.stats.staging_bytes, 3 * block);
}

TEST(ActivationStore, ModesAreBitwiseIdenticalMoe) {
  const ModelConfig cfg = moe_config();
  const Outcome none = run_steps(cfg, offload(OffloadMode::kNone));
  expect_same_bits(none, run_steps(cfg, offload(OffloadMode::kSingle)), "single");
  expect_same_bits(none, run_steps(cfg, offload(OffloadMode::kDouble, 2, 1)), "double K=2 L=1");
  expect_same_bits(none, run_steps(cfg, offload(OffloadMode::kDouble, 4, 3)), "double K=4 L=3");
}

TEST(ActivationStore, MatchesNoCheckpointing) {
  // The store changes where inputs live, not what is computed: same bits as keeping everything.
  const ModelConfig cfg = dense_config();
  auto be = make_cpu_backend(DType::kF32);
  ModelOptions plain;
  Model model(cfg, plain, *be);
  model.init_params(7);
  PackedBatch batch = make_batch(cfg, 100);
  BatchMeta meta = be->upload_batch(batch);
  LossSums sums = model.forward_backward(meta, 1.0 / batch.num_valid_targets);
  std::vector<uint32_t> bits;
  test::append_bits(sums.lm, bits);
  const Outcome dbl = run_steps(cfg, offload(OffloadMode::kDouble), 1);
  EXPECT_EQ(bits[0], dbl.bits[0]) << "loss with offload=double differs from no checkpointing";
}

TEST(ActivationStore, PageableFallbackIsIdenticalAndCountsItsWaits) {
  const ModelConfig cfg = dense_config();
  const int64_t block = 3 * 32 * cfg.d_model * 4;
  const Outcome none = run_steps(cfg, offload(OffloadMode::kNone));
  for (OffloadMode m : {OffloadMode::kSingle, OffloadMode::kDouble}) {
    OffloadOptions o = offload(m);
    o.pinned_pool_bytes = block + 1;  // room for one block input: the rest spill
    const Outcome got = run_steps(cfg, o);
    expect_same_bits(none, got, offload_mode_name(m));
    EXPECT_EQ(got.stats.pinned_pool_bytes, block + 1);
    EXPECT_EQ(got.stats.pageable_blocks, cfg.n_layers - 2);
    // One host wait per pageable offload (a D2H into pageable memory blocks the host on a GPU).
    EXPECT_EQ(got.last_step_offload_syncs, cfg.n_layers - 2);
  }
}

TEST(ActivationStore, ChunkedReloadFallbackIsIdentical) {
  const ModelConfig cfg = dense_config();
  const int64_t block = 3 * 32 * cfg.d_model * 4;
  const Outcome none = run_steps(cfg, offload(OffloadMode::kNone));
  for (OffloadMode m : {OffloadMode::kSingle, OffloadMode::kDouble}) {
    OffloadOptions o = offload(m);
    o.staging_bytes = block / 3 - 20;  // smaller than a block input, not a divisor of it
    const Outcome got = run_steps(cfg, o);
    expect_same_bits(none, got, offload_mode_name(m));
    EXPECT_EQ(got.stats.chunked_blocks, cfg.n_layers - 1);
    EXPECT_EQ(got.stats.h2d_bytes, (cfg.n_layers - 1) * block);
    EXPECT_EQ(got.last_step_offload_syncs, 0);
  }
  // Both fallbacks at once.
  OffloadOptions o = offload(OffloadMode::kDouble, 3, 2);
  o.staging_bytes = block / 2;
  o.pinned_pool_bytes = 1;
  const Outcome got = run_steps(cfg, o);
  expect_same_bits(none, got, "double with pageable host memory and chunked reloads");
  EXPECT_EQ(got.stats.pageable_blocks, cfg.n_layers - 1);
  EXPECT_EQ(got.stats.chunked_blocks, cfg.n_layers - 1);
}

TEST(ActivationStore, SteadyStateNeedsNoOffloadSyncs) {
  for (const ModelConfig& cfg : {dense_config(), moe_config()}) {
    for (OffloadMode m : {OffloadMode::kSingle, OffloadMode::kDouble}) {
      const Outcome got = run_steps(cfg, offload(m), 3);
      EXPECT_EQ(got.last_step_offload_syncs, 0) << offload_mode_name(m);
    }
  }
}

// Fills x with a value pattern unique to block i.
void fill_block(Tensor& x, int i) {
  float* p = x.data<float>();
  for (int64_t k = 0; k < x.numel(); ++k) p[k] = static_cast<float>(1000 * i + k % 997);
}

TEST(ActivationStore, ReloadNeverReadsBeforeItsOffloadFinished) {
  // A link so slow that each copy takes ~40 ms: a store that let go of (and poisoned) a forward
  // tensor before its offload finished, or read a reload before it landed, would see NaN.
  auto be = make_cpu_backend(DType::kF32);
  for (OffloadMode m : {OffloadMode::kSingle, OffloadMode::kDouble}) {
    OffloadOptions o = offload(m, 3, 2);
    o.sim_link_gbps = 0.0001;
    auto store = make_activation_store(*be, o);
    be->syncs().reset();
    const int n = 4;
    for (int step = 0; step < 2; ++step) {
      store->begin_step(n);
      for (int i = 0; i < n; ++i) {
        Tensor x = be->empty({8, 128}, DType::kF32);
        fill_block(x, i + 10 * step);
        store->save(i, x);
      }
      for (int i = n - 1; i >= 0; --i) {
        Tensor x = store->load(i);
        Tensor expect = be->empty({8, 128}, DType::kF32);
        fill_block(expect, i + 10 * step);
        ASSERT_EQ(0, std::memcmp(x.raw(), expect.raw(), x.nbytes()))
            << offload_mode_name(m) << " step " << step << " block " << i;
      }
      store->end_step();
    }
    EXPECT_EQ(be->syncs().get(SyncCause::kOffload), 0);
  }
}

TEST(ActivationStore, RejectsOutOfOrderUse) {
  auto be = make_cpu_backend(DType::kF32);
  auto store = make_activation_store(*be, offload(OffloadMode::kDouble));
  store->begin_step(2);
  Tensor x = be->zeros({4}, DType::kF32);
  EXPECT_THROW(store->save(1, x), Error);
  store->save(0, x);
  EXPECT_THROW(store->load(0), Error);  // before every save
}

TEST(ActivationStore, OptionsNameTheKey) {
  auto message = [](OffloadOptions o) {
    try {
      o.validate();
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  OffloadOptions o;
  o.buffers = 1;
  EXPECT_NE(message(o).find("offload_buffers"), std::string::npos);
  o = OffloadOptions();
  o.lookahead = 2;
  EXPECT_NE(message(o).find("offload_lookahead"), std::string::npos);
  o = OffloadOptions();
  o.sim_link_gbps = -1;
  EXPECT_NE(message(o).find("sim_link_gbps"), std::string::npos);
  EXPECT_THROW(parse_offload_mode("triple"), UserError);
  EXPECT_EQ(parse_offload_mode("double"), OffloadMode::kDouble);
}

TEST(CpuCopyStream, EventsCompleteWhenTheQueueReachesThem) {
  auto be = make_cpu_backend(DType::kF32);
  test::GateArbiter gate(int64_t{1} << 20);
  be->set_link_arbiter(&gate);
  Tensor src = be->empty({10000}, DType::kF32);
  fill_block(src, 3);
  Tensor dst = Tensor::host({10000}, DType::kF32);
  std::memset(dst.raw(), 0, dst.nbytes());
  be->set_stream(SK::kCopy);
  be->copy(src, dst);
  auto done = be->record_event(SK::kCopy);
  be->set_stream(SK::kCompute);
  // The host thread is free while the copy waits for its grant: the copy worker waits, nothing
  // has moved, and this thread got here.
  gate.wait_for_a_waiter();
  EXPECT_NE(0, std::memcmp(src.raw(), dst.raw(), src.nbytes()));
  EXPECT_EQ(gate.released(), 0);
  gate.open();
  be->wait_event(SK::kCompute, *done);  // the compute stream (host thread) waits: no sync
  EXPECT_EQ(0, std::memcmp(src.raw(), dst.raw(), src.nbytes()));
  EXPECT_EQ(gate.released(), 1);  // 40 KB: one chunk
  EXPECT_EQ(gate.released_bytes(), static_cast<int64_t>(src.nbytes()));
  EXPECT_EQ(be->syncs().total(), 0);
  be->event_synchronize(*done, SyncCause::kOffload);
  EXPECT_EQ(be->syncs().get(SyncCause::kOffload), 1);
  be->set_link_arbiter(nullptr);
  // Compute-stream events are complete when recorded; synchronize drains the copy queue.
  be->set_simulated_link_gbps(0);
  be->set_stream(SK::kCopy);
  Tensor dst2 = Tensor::host({10000}, DType::kF32);
  be->copy(dst, dst2);
  be->set_stream(SK::kCompute);
  be->synchronize(SyncCause::kOther);
  EXPECT_EQ(0, std::memcmp(src.raw(), dst2.raw(), src.nbytes()));
}

TEST(CpuCopyStream, QueueRunsInOrderAndKeepsStoragesAlive) {
  CpuCopyQueue q;
  q.set_link_gbps(0.0001);  // 4 KB: ~40 ms per copy
  Tensor a = Tensor::host({1000}, DType::kF32), b, c = Tensor::host({1000}, DType::kF32);
  fill_block(a, 1);
  {
    Tensor tmp = Tensor::host({1000}, DType::kF32);
    q.enqueue_copy(a, tmp);
    q.enqueue_copy(tmp, c);  // tmp goes out of scope here; the queue holds it
  }
  EXPECT_FALSE(q.done(q.last_ticket()));
  q.drain();
  EXPECT_TRUE(q.done(2));
  EXPECT_EQ(0, std::memcmp(a.raw(), c.raw(), a.nbytes()));
}

}  // namespace
}  // namespace hp

namespace hp {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Chunks far smaller than a block input (and not a multiple of the element size): every copy
// is cut into many granted pieces, and the model computes the same bits.
TEST(ActivationStoreArbiter, LocalArbiterChangesNoBitsAndGrantsEveryChunk) {
  const ModelConfig cfg = moe_config();
  for (OffloadMode m : {OffloadMode::kSingle, OffloadMode::kDouble}) {
    const Outcome plain = run_steps(cfg, offload(m));
    LocalLinkArbiter arbiter(1000);
    const Outcome on = run_steps(cfg, offload(m), 2, &arbiter);
    expect_same_bits(plain, on, offload_mode_name(m));
    EXPECT_EQ(on.last_step_offload_syncs, 0) << offload_mode_name(m);
    ASSERT_GT(on.stats.offloaded_blocks, 0);
    const int64_t block = on.stats.d2h_bytes / on.stats.offloaded_blocks;
    const int64_t per_copy = ceil_div(block, 1000);
    EXPECT_GT(per_copy, 1);
    const int off = static_cast<int>(CopyDirection::kOffload);
    const int rel = static_cast<int>(CopyDirection::kReload);
    EXPECT_EQ(on.copies.chunks[off], on.stats.offloaded_blocks * per_copy) << offload_mode_name(m);
    EXPECT_EQ(on.copies.chunks[rel], on.stats.offloaded_blocks * per_copy) << offload_mode_name(m);
    EXPECT_EQ(on.copies.bytes[off], on.stats.d2h_bytes);
    EXPECT_EQ(on.copies.bytes[rel], on.stats.h2d_bytes);
    EXPECT_EQ(on.copies.max_wait_s[0] + on.copies.max_wait_s[1], 0.0);  // local: granted at once
    EXPECT_GT(on.copies.achieved_gbps(), 0.0);
  }
}

// Reloads larger than a staging buffer go in staging-sized pieces; each piece is chunked again.
TEST(ActivationStoreArbiter, ChunkedReloadFallbackWithArbiter) {
  const ModelConfig cfg = dense_config();
  OffloadOptions o = offload(OffloadMode::kDouble);
  o.staging_bytes = 3000;
  const Outcome plain = run_steps(cfg, o);
  LocalLinkArbiter arbiter(1024);
  const Outcome on = run_steps(cfg, o, 2, &arbiter);
  expect_same_bits(plain, on, "chunked reloads");
  EXPECT_GT(on.stats.chunked_blocks, 0);
  const int64_t block = on.stats.d2h_bytes / on.stats.offloaded_blocks;
  // A staging piece of 3000 bytes (750 floats) is 3 chunks; the block's last piece the rest.
  const int64_t pieces = block / 3000, rest = block % 3000;
  const int64_t per_reload = pieces * ceil_div(3000, 1024) + ceil_div(rest, 1024);
  EXPECT_EQ(on.copies.chunks[static_cast<int>(CopyDirection::kReload)],
            on.stats.offloaded_blocks * per_reload);
  EXPECT_EQ(on.copies.chunks[static_cast<int>(CopyDirection::kOffload)],
            on.stats.offloaded_blocks * ceil_div(block, 1024));
}

TEST(ActivationStoreArbiter, HostThreadNeverWaitsForAGrant) {
  test::GateArbiter gate(1024);
  auto be = make_cpu_backend(DType::kF32);
  be->set_link_arbiter(&gate);
  Tensor src = Tensor::host({1000}, DType::kF32);
  Tensor dst = Tensor::host({1000}, DType::kF32);
  for (int i = 0; i < 1000; ++i) {
    src.data<float>()[i] = static_cast<float>(i + 1);
    dst.data<float>()[i] = 0;
  }
  be->set_stream(SK::kCopy);
  be->copy_over_link(src, dst, CopyDirection::kReload);
  be->copy(src, dst);  // a plain copy: an offload on the cpu
  std::shared_ptr<Backend::Event> done = be->record_event(SK::kCopy);
  be->set_stream(SK::kCompute);
  // Issued without a grant: the copy worker is the one waiting.
  gate.wait_for_a_waiter();
  EXPECT_EQ(dst.data<float>()[0], 0.0f);
  EXPECT_EQ(gate.released(), 0);
  gate.open();
  be->syncs().reset();
  be->event_synchronize(*done, SyncCause::kOther);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(dst.data<float>()[i], static_cast<float>(i + 1));
  EXPECT_EQ(gate.released(), 2 * 4);  // 4000 bytes in chunks of 1024, twice
  EXPECT_EQ(gate.released_bytes(), 2 * 4000);
  const std::vector<CopyDirection> dirs = gate.dirs();
  ASSERT_EQ(dirs.size(), 8u);
  EXPECT_EQ(dirs.front(), CopyDirection::kReload);
  EXPECT_EQ(dirs.back(), CopyDirection::kOffload);
  be->set_link_arbiter(nullptr);
}

// A grant that never comes (a stuck peer) fails the copy stream with the arbiter's error.
class FailingArbiter final : public LinkArbiter {
 public:
  int64_t chunk_bytes() const override { return 1 << 20; }
  LinkTicket request(CopyDirection dir, int64_t bytes) override {
    LinkTicket t;
    t.dir = dir;
    t.bytes = bytes;
    return t;
  }
  bool granted(LinkTicket&) override { return false; }
  void wait(LinkTicket&) override { HP_FAIL(ErrorKind::kComm, "grant not received (test)"); }
  void release(LinkTicket&) override {}
  void begin_step() override {}
  LinkArbiterStats stats() const override { return LinkArbiterStats(); }
};

TEST(ActivationStoreArbiter, ArbiterFailureReachesTheHostThread) {
  FailingArbiter failing;  // outlives the backend that points to it
  auto be = make_cpu_backend(DType::kF32);
  be->set_link_arbiter(&failing);
  Tensor src = Tensor::host({16}, DType::kF32), dst = Tensor::host({16}, DType::kF32);
  be->set_stream(SK::kCopy);
  be->copy_over_link(src, dst, CopyDirection::kOffload);
  std::shared_ptr<Backend::Event> done = be->record_event(SK::kCopy);
  be->set_stream(SK::kCompute);
  try {
    be->event_synchronize(*done, SyncCause::kOther);
    FAIL() << "expected the arbiter's error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("grant not received"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace hp
