// The node link arbiter (parallel/link_arbiter.h) and the single-rank LocalLinkArbiter.
//
// LinkArbiterUnit.* run in one process. LinkArbiterMulti.* need a launch of 2 or more ranks on
// one host; CTest runs each under mpirun on the rank counts of its HP_MPI_TEST line (label mpi;
// started alone, they skip). They simulate a shared host link: a granted chunk "takes"
// bytes / kLinkGbps of sleep while its grant is held. What they assert is counted, never timed:
// chunks per rank, grant sequence numbers (the order the link's grants were given in), bytes,
// and the order of grants against releases (monotonic clock stamps, which all processes of one
// host share: a grant must not come before the previous chunk's release).
#include "parallel/link_arbiter.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include "framework/backend/link_arbiter.h"
#include "framework/core/error.h"
#include "framework/data/loader.h"
#include "framework/model/model.h"
#include "parallel/launch_env.h"
#include "tests/common/fixtures.h"
#include "tests/common/mpi_case.h"

namespace hp {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using CommPtr = std::shared_ptr<Communicator>;

constexpr double kLinkGbps = 2.0;  // 8 MiB chunks: ~4.2 ms each
constexpr int kMaxChunks = 256;    // per rank and test, for the fixed-size gathers

int64_t ns(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

Clock::duration chunk_time(int64_t bytes) {
  return std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(static_cast<double>(bytes) / (kLinkGbps * 1e9)));
}

// One chunk held on the simulated link.
struct Held {
  int64_t seq = 0, granted_ns = 0, released_ns = 0, waited_ns = 0, dir = 0;
};

Held move_chunk(LinkArbiter& a, CopyDirection dir, int64_t bytes) {
  LinkTicket t = a.request(dir, bytes);
  a.wait(t);
  std::this_thread::sleep_for(chunk_time(bytes));
  Held h;
  h.seq = t.grant_seq;
  h.granted_ns = ns(t.granted_at);
  h.waited_ns = ns(t.granted_at) - ns(t.requested_at);
  h.dir = static_cast<int64_t>(dir);
  h.released_ns = ns(Clock::now());  // before release(): the next grant comes after this
  a.release(t);
  return h;
}

constexpr int kFields = 6;

// Every rank's records, gathered: out[r] is rank r's list.
std::vector<std::vector<Held>> gather(Communicator& c, const std::vector<Held>& mine) {
  HP_CHECK(static_cast<int>(mine.size()) <= kMaxChunks, "too many chunks");
  Tensor in = Tensor::host({kMaxChunks * kFields}, DType::kI64);
  int64_t* p = in.data<int64_t>();
  std::fill(p, p + kMaxChunks * kFields, 0);
  for (size_t i = 0; i < mine.size(); ++i) {
    const Held& h = mine[i];
    int64_t* q = p + i * kFields;
    q[0] = h.seq, q[1] = h.granted_ns, q[2] = h.released_ns, q[3] = h.waited_ns, q[4] = h.dir;
    q[5] = 1;
  }
  Tensor out = Tensor::host({c.size() * kMaxChunks * kFields}, DType::kI64);
  c.all_gather(in, out);
  std::vector<std::vector<Held>> all(c.size());
  for (int r = 0; r < c.size(); ++r) {
    for (int i = 0; i < kMaxChunks; ++i) {
      const int64_t* q = out.data<int64_t>() + (r * kMaxChunks + i) * kFields;
      if (q[5] == 0) break;
      all[r].push_back(Held{q[0], q[1], q[2], q[3], q[4]});
    }
  }
  return all;
}

// Holds of a link sorted by grant order; with link_inflight 1 none may overlap the next.
void expect_serialized(std::vector<Held> holds) {
  std::sort(holds.begin(), holds.end(), [](const Held& a, const Held& b) { return a.seq < b.seq; });
  for (size_t i = 1; i < holds.size(); ++i) {
    EXPECT_EQ(holds[i].seq, holds[i - 1].seq + 1);
    EXPECT_GE(holds[i].granted_ns, holds[i - 1].released_ns)
        << "grant " << holds[i].seq << " overlaps the previous chunk";
  }
}

// ---- one process --------------------------------------------------------------------------------

TEST(LinkArbiterUnit, ParsesPcieGroups) {
  EXPECT_EQ(parse_pcie_groups("", 3), (std::vector<std::vector<int>>{{0, 1, 2}}));
  EXPECT_EQ(parse_pcie_groups("0,1;2,3", 4), (std::vector<std::vector<int>>{{0, 1}, {2, 3}}));
  EXPECT_EQ(parse_pcie_groups(" 3 ; 0, 2;1", 4), (std::vector<std::vector<int>>{{3}, {0, 2}, {1}}));
  for (const char* bad : {"0,1;1", "0,1", "0,1,2,4", "0;;1,2", "0,x;1,2", "0,,1;2"}) {
    try {
      parse_pcie_groups(bad, 3);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("pcie_groups"), std::string::npos) << e.what();
    }
  }
}

TEST(LinkArbiterUnit, ValidatesOptions) {
  LinkOptions o;
  EXPECT_NO_THROW(o.validate());
  EXPECT_EQ(o.chunk_bytes(), 8 << 20);
  o.inflight = 0;
  EXPECT_THROW(o.validate(), UserError);
  o = LinkOptions{};
  o.chunk_mib = 0;
  EXPECT_THROW(o.validate(), UserError);
  o = LinkOptions{};
  o.pcie_groups = "0-1";
  EXPECT_THROW(o.validate(), UserError);
  o.pcie_groups = "auto";
  EXPECT_NO_THROW(o.validate());
}

// A PCI tree like sysfs's: two root ports, two GPUs behind a switch on the first, one on the
// second; the device directory lists symlinks into it, as /sys/bus/pci/devices does.
TEST(LinkArbiterUnit, HostLinkOfPciDeviceIsItsRootPort) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("hp_pci_" + std::to_string(::getpid()));
  fs::remove_all(root);
  const fs::path tree = root / "devices" / "pci0000:17";
  const fs::path a = tree / "0000:17:01.0" / "0000:18:00.0" / "0000:19:08.0" / "0000:1b:00.0";
  const fs::path b = tree / "0000:17:01.0" / "0000:18:00.0" / "0000:19:10.0" / "0000:1c:00.0";
  const fs::path c = tree / "0000:17:03.0" / "0000:2a:00.0";
  const fs::path bus = root / "bus";
  for (const fs::path& p : {a, b, c, bus}) fs::create_directories(p);
  fs::create_directory_symlink(a, bus / "0000:1b:00.0");
  fs::create_directory_symlink(b, bus / "0000:1c:00.0");
  fs::create_directory_symlink(c, bus / "0000:2a:00.0");

  const std::string la = host_link_of_pci_device(bus.string(), "00000000:1B:00.0");  // CUDA form
  const std::string lb = host_link_of_pci_device(bus.string(), "0000:1c:00.0");
  const std::string lc = host_link_of_pci_device(bus.string(), "0000:2a:00.0");
  EXPECT_EQ(la, "pci0000:17/0000:17:01.0");
  EXPECT_EQ(lb, la);
  EXPECT_EQ(lc, "pci0000:17/0000:17:03.0");
  EXPECT_EQ(host_link_of_pci_device(bus.string(), "0000:99:00.0"), "");
  EXPECT_EQ(host_link_of_pci_device(bus.string(), ""), "");
  fs::remove_all(root);

  // Ranks 0 and 2 behind one root port, 1 and 3 behind another; one unknown id: one link.
  EXPECT_EQ(pcie_groups_from_link_ids({la, lc, lb, lc}), "0,2;1,3");
  EXPECT_EQ(parse_pcie_groups(pcie_groups_from_link_ids({la, lc, lb, lc}), 4),
            (std::vector<std::vector<int>>{{0, 2}, {1, 3}}));
  EXPECT_EQ(pcie_groups_from_link_ids({la, "", lc}), "");
  EXPECT_EQ(pcie_groups_from_link_ids({lc}), "0");
}

TEST(LinkArbiterUnit, JainFairness) {
  EXPECT_DOUBLE_EQ(jain_fairness({5, 5, 5}), 1.0);
  EXPECT_DOUBLE_EQ(jain_fairness({1, 0, 0, 0}), 0.25);
  EXPECT_DOUBLE_EQ(jain_fairness({}), 1.0);
  EXPECT_NEAR(jain_fairness({4, 1}), 25.0 / 34.0, 1e-12);
}

TEST(LinkArbiterUnit, LocalGrantsAtOnceAndCounts) {
  LocalLinkArbiter a(1 << 20);
  const auto start = std::chrono::steady_clock::now();
  a.begin_step();
  EXPECT_EQ(a.stats().active_s, 0.0);
  LinkTicket r = a.request(CopyDirection::kReload, 1000);
  LinkTicket o = a.request(CopyDirection::kOffload, 1 << 20);
  EXPECT_TRUE(a.granted(r));
  EXPECT_TRUE(a.granted(o));
  EXPECT_LT(r.grant_seq, o.grant_seq);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));  // the copies take a while
  a.release(o);
  a.release(r);
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  LinkArbiterStats s = a.stats();
  EXPECT_EQ(s.bytes[0], 1000);
  EXPECT_EQ(s.bytes[1], 1 << 20);
  EXPECT_EQ(s.chunks[0] + s.chunks[1], 2);
  EXPECT_EQ(s.max_wait_s[0], 0.0);
  // Active time runs from the first request to the last release: at least the time the copies
  // were held, at most the time the whole step took.
  EXPECT_GE(s.active_s, 0.005);
  EXPECT_LE(s.active_s, elapsed);
  EXPECT_NEAR(s.achieved_gbps(), (1000.0 + (1 << 20)) / s.active_s / 1e9, 1e-12);
  EXPECT_THROW(a.request(CopyDirection::kReload, (1 << 20) + 1), Error);
  a.begin_step();
  EXPECT_EQ(a.stats().chunks[0], 0);
  EXPECT_EQ(a.stats().active_s, 0.0);
}

// ---- one rank per process -----------------------------------------------------------------------

CommPtr link_world() {
  static CommPtr world = []() -> CommPtr {
    CommOptions options;
    options.timeout = 60s;
    LaunchInfo info = detect_launch();
    if (!info.use_mpi) return nullptr;
    CommPtr w = create_world(info, parse_bootstrap("mpi"), options);
    set_error_rank(w->rank());
    return w;
  }();
  return world;
}

// The ranks of this host; the tests need every rank on it.
#define HP_LINK_NODE(var)                                                                 \
  CommPtr world_ = link_world();                                                          \
  if (!world_ || world_->size() < 2) GTEST_SKIP() << "needs a launch of 2 or more ranks"; \
  CommPtr var = world_->split_by_host("node");                                            \
  if (var->size() != world_->size()) GTEST_SKIP() << "needs every rank on one host"

LinkOptions link_options(const std::string& groups = "") {
  LinkOptions o;
  o.enabled = true;
  o.chunk_mib = 8;
  o.inflight = 1;
  o.pcie_groups = groups;
  o.timeout = 30s;
  return o;
}

// pcie_groups=auto gathers every rank's link: even node ranks behind one root port, odd ones
// behind another; an explicit list stays as it is, and nothing is gathered for it.
HP_MPI_TEST(LinkArbiterMulti, AutoGroupsComeFromEveryRanksLink, 2, 3) {
  HP_LINK_NODE(node);
  LinkOptions o = link_options("auto");
  o.link_id = node->rank() % 2 == 0 ? "pci0000:17/0000:17:01.0" : "pci0000:3a/0000:3a:02.0";
  EXPECT_EQ(resolve_pcie_groups(*node, o), node->size() == 2 ? "0;1" : "0,2;1");
  o.pcie_groups = "0,1";
  EXPECT_EQ(resolve_pcie_groups(*node, o), "0,1");
}

HP_MPI_TEST(LinkArbiterMulti, EqualDemandsShareTheLinkFairly, 2, 3) {
  HP_LINK_NODE(node);
  std::unique_ptr<LinkArbiter> a = make_link_arbiter(*node, link_options());
  auto* node_arbiter = dynamic_cast<NodeLinkArbiter*>(a.get());
  ASSERT_NE(node_arbiter, nullptr);
  const int64_t chunk = a->chunk_bytes();
  // Every rank moves the same number of chunks, back to back. While all of them still have
  // chunks to move, the link must be shared evenly: count each rank's grants up to the last
  // grant of the rank that finished first.
  constexpr int kChunks = 12;
  node->barrier();
  std::vector<Held> mine;
  for (int i = 0; i < kChunks; ++i) mine.push_back(move_chunk(*a, CopyDirection::kOffload, chunk));
  node->barrier();
  std::vector<std::vector<Held>> all = gather(*node, mine);
  int64_t first_done = INT64_MAX;
  for (const auto& r : all) {
    ASSERT_EQ(r.size(), static_cast<size_t>(kChunks));
    first_done = std::min(first_done, r.back().seq);
  }
  std::vector<double> shares;
  std::vector<Held> holds;
  for (const auto& r : all) {
    shares.push_back(static_cast<double>(
        std::count_if(r.begin(), r.end(), [&](const Held& h) { return h.seq <= first_done; })));
    holds.insert(holds.end(), r.begin(), r.end());
  }
  const double jain = jain_fairness(shares);
  EXPECT_GE(jain, 0.95) << "grants per rank up to grant " << first_done << ": "
                        << ::testing::PrintToString(shares);
  // The shared counters agree with the ranks' own records.
  std::vector<int64_t> bytes = node_arbiter->link_bytes();
  ASSERT_EQ(bytes.size(), all.size());
  for (size_t r = 0; r < all.size(); ++r) EXPECT_EQ(bytes[r], chunk * (int64_t)all[r].size());
  EXPECT_EQ(a->stats().chunks[1], static_cast<int64_t>(mine.size()));
  EXPECT_EQ(a->stats().bytes[1], chunk * static_cast<int64_t>(mine.size()));
  EXPECT_GT(a->stats().achieved_gbps(), 0.0);
  expect_serialized(holds);
  if (node->rank() == 0) {
    std::printf("[link] %d ranks, one link: grants per rank up to grant %lld %s, Jain %.4f\n",
                node->size(), static_cast<long long>(first_done),
                ::testing::PrintToString(shares).c_str(), jain);
  }
}

HP_MPI_TEST(LinkArbiterMulti, LightRankWaitsAtMostOneChunk, 2, 3) {
  HP_LINK_NODE(node);
  const int n = node->size();
  // Ranks 0 (light) and 1 (heavy) share a link; any further ranks are heavy on a second link,
  // which must not slow the first.
  std::string groups = "0,1";
  for (int r = 2; r < n; ++r) groups += (r == 2 ? ";" : ",") + std::to_string(r);
  std::unique_ptr<LinkArbiter> a = make_link_arbiter(*node, link_options(groups));
  auto* node_arbiter = dynamic_cast<NodeLinkArbiter*>(a.get());
  ASSERT_NE(node_arbiter, nullptr);
  const int64_t chunk = a->chunk_bytes();
  const bool light = node->rank() == 0;
  const int chunks = light ? 8 : 32;  // the heavy ranks move 4x the bytes
  // For each light chunk: how many chunks the heavy rank had released right after the request.
  size_t heavy_at = 0;
  if (light) {
    const std::vector<int>& lr = node_arbiter->link_ranks();
    ASSERT_EQ(lr, (std::vector<int>{0, 1}));
    heavy_at = 1;
  }
  std::vector<int64_t> heavy_released;
  node->barrier();
  std::vector<Held> mine;
  for (int i = 0; i < chunks; ++i) {
    LinkTicket t = a->request(CopyDirection::kOffload, chunk);
    if (light) heavy_released.push_back(node_arbiter->link_bytes()[heavy_at] / chunk);
    a->wait(t);
    std::this_thread::sleep_for(chunk_time(chunk));
    Held h;
    h.seq = t.grant_seq;
    h.granted_ns = ns(t.granted_at);
    h.waited_ns = ns(t.granted_at) - ns(t.requested_at);
    h.dir = static_cast<int64_t>(CopyDirection::kOffload);
    h.released_ns = ns(Clock::now());
    a->release(t);
    mine.push_back(h);
    // The light rank computes between its chunks, so each request finds the link taken.
    if (light) std::this_thread::sleep_for(chunk_time(chunk) * 3 / 2);
  }
  node->barrier();
  std::vector<std::vector<Held>> all = gather(*node, mine);
  EXPECT_EQ(all[0].size(), 8u);
  EXPECT_EQ(all[1].size(), 32u);
  if (light) {
    // The heavy chunks granted before each light grant, less those already released when the
    // light rank asked: at most the one chunk that was on the link then. Losing the round to the
    // heavy rank would make it two or more.
    int64_t worst = 0, waited = 0;
    for (size_t i = 0; i < all[0].size(); ++i) {
      const int64_t g = all[0][i].seq;
      const int64_t heavy_before =
          std::count_if(all[1].begin(), all[1].end(), [&](const Held& h) { return h.seq < g; });
      const int64_t behind = heavy_before - heavy_released[i];
      worst = std::max(worst, behind);
      waited += behind > 0;
      EXPECT_LE(behind, 1) << "light request " << i + 1 << " (grant " << g << ") waited for "
                           << behind << " heavy chunks";
    }
    std::printf("[link] light rank: %lld of 8 requests waited, for at most %lld heavy chunk(s)\n",
                static_cast<long long>(waited), static_cast<long long>(worst));
  }
  int64_t my_max_wait = 0;
  for (const Held& h : mine) my_max_wait = std::max(my_max_wait, h.waited_ns);
  EXPECT_NEAR(a->stats().max_wait_s[1], my_max_wait / 1e9, 1e-6);
  std::vector<Held> first_link = all[0];
  first_link.insert(first_link.end(), all[1].begin(), all[1].end());
  expect_serialized(first_link);
}

HP_MPI_TEST(LinkArbiterMulti, ReloadsBeforePendingOffloads, 2, 3) {
  HP_LINK_NODE(node);
  const int n = node->size(), me = node->rank();
  std::unique_ptr<LinkArbiter> a = make_link_arbiter(*node, link_options());
  auto* node_arbiter = dynamic_cast<NodeLinkArbiter*>(a.get());
  ASSERT_NE(node_arbiter, nullptr);
  const int64_t chunk = a->chunk_bytes();
  auto until = [&](CopyDirection d, int64_t want) {
    const Clock::time_point deadline = Clock::now() + 20s;
    while (node_arbiter->link_pending(d) != want && Clock::now() < deadline) {
      std::this_thread::sleep_for(100us);
    }
    EXPECT_EQ(node_arbiter->link_pending(d), want) << copy_direction_name(d);
  };
  // Rank 0 holds the link with an offload chunk.
  LinkTicket held;
  if (me == 0) {
    held = a->request(CopyDirection::kOffload, chunk);
    ASSERT_TRUE(a->granted(held));
  }
  node->barrier();
  // The other ranks queue offloads first, then every rank queues a reload.
  std::vector<Held> mine;
  std::mutex mu;
  auto mover = [&](CopyDirection d) {
    Held h = move_chunk(*a, d, chunk);
    std::lock_guard<std::mutex> lock(mu);
    mine.push_back(h);
  };
  std::vector<std::thread> threads;
  if (me != 0) threads.emplace_back(mover, CopyDirection::kOffload);
  until(CopyDirection::kOffload, n - 1);
  node->barrier();
  threads.emplace_back(mover, CopyDirection::kReload);
  until(CopyDirection::kReload, n);
  node->barrier();
  if (me == 0) a->release(held);
  for (auto& t : threads) t.join();
  node->barrier();
  EXPECT_EQ(node_arbiter->link_pending(CopyDirection::kReload), 0);
  EXPECT_EQ(node_arbiter->link_pending(CopyDirection::kOffload), 0);
  std::vector<std::vector<Held>> all = gather(*node, mine);
  int64_t last_reload = 0, first_offload = INT64_MAX;
  int reloads = 0, offloads = 0;
  std::vector<Held> holds;
  for (const auto& r : all) {
    for (const Held& h : r) {
      holds.push_back(h);
      if (h.dir == 0) {
        last_reload = std::max(last_reload, h.seq), ++reloads;
      } else {
        first_offload = std::min(first_offload, h.seq), ++offloads;
      }
    }
  }
  EXPECT_EQ(reloads, n);
  EXPECT_EQ(offloads, n - 1);
  EXPECT_LT(last_reload, first_offload) << "an offload was granted before a pending reload";
  // Grants 2..2n: n reloads, then n-1 offloads, one at a time (grant 1 was rank 0's offload).
  expect_serialized(holds);
  if (me == 0) {
    std::printf("[link] %d reloads granted as %lld..%lld before %d pending offloads from %lld\n",
                reloads, static_cast<long long>(last_reload - reloads + 1),
                static_cast<long long>(last_reload), offloads,
                static_cast<long long>(first_offload));
  }
}

// ---- the activation store through the node arbiter ---------------------------------------------

// Block inputs of 1536 tokens x 256 f32 = 1.5 MiB: two 1 MiB chunks per copy.
ModelConfig link_model_config() {
  ModelConfig c;
  c.vocab_size = 64;
  c.d_model = 256;
  c.n_layers = 3;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 64;
  c.ffn_dim = 512;
  c.init_std = 0.05;
  return c;
}

struct StoreRun {
  std::vector<uint32_t> bits;  // losses and gradients of every step
  OffloadStats offload;        // of the last step
  LinkArbiterStats copies;     // of the last step
  int64_t offload_syncs = 0;   // of the last step
};

StoreRun run_store(LinkArbiter* arbiter, Communicator& node) {
  const ModelConfig cfg = link_model_config();
  auto be = make_cpu_backend(DType::kF32);
  if (arbiter) be->set_link_arbiter(arbiter);
  ModelOptions mo;
  mo.checkpoint_activations = true;
  mo.offload.mode = OffloadMode::kDouble;
  mo.offload.sim_link_gbps = 2.0;
  mo.offload.poison_released = true;
  Model model(cfg, mo, *be);
  model.init_params(5);
  StoreRun out;
  for (int step = 0; step < 2; ++step) {
    PackedBatch batch = test::synthetic_batch(cfg, 300 + static_cast<uint64_t>(step),
                                              /*seq_len=*/256, /*rows=*/6, /*mean_doc_len=*/40);
    BatchMeta meta = be->upload_batch(batch);
    model.zero_grads();
    be->syncs().reset();
    // Every rank offloads at once.
    node.barrier();
    if (arbiter) arbiter->begin_step();
    LossSums sums = model.forward_backward(meta, 1.0 / batch.num_valid_targets);
    be->synchronize(SyncCause::kOther);
    out.offload_syncs = be->syncs().get(SyncCause::kOffload);
    if (arbiter) out.copies = arbiter->stats();
    test::append_bits(sums.lm, out.bits);
    test::append_bits(sums.aux, out.bits);
    for (auto& p : model.params().all()) test::append_bits(p->grad, out.bits);
  }
  out.offload = model.activation_store().stats();
  return out;
}

HP_MPI_TEST(LinkArbiterMulti, OffloadThroughTheArbiterChangesNoBits, 2, 3) {
  HP_LINK_NODE(node);
  const StoreRun plain = run_store(nullptr, *node);
  LinkOptions o = link_options();
  o.chunk_mib = 1;
  std::unique_ptr<LinkArbiter> a = make_link_arbiter(*node, o);
  auto* node_arbiter = dynamic_cast<NodeLinkArbiter*>(a.get());
  ASSERT_NE(node_arbiter, nullptr);
  const std::vector<int64_t> before = node_arbiter->link_bytes();
  const StoreRun on = run_store(a.get(), *node);
  test::expect_same_bits(plain.bits, on.bits, "link_arbiter=on (reference: no arbiter)");
  EXPECT_EQ(on.offload_syncs, 0);
  // Every copy went through grants, chunk by chunk.
  ASSERT_EQ(on.offload.offloaded_blocks, link_model_config().n_layers - 1);
  const int64_t block = on.offload.d2h_bytes / on.offload.offloaded_blocks;
  const int64_t per_copy = (block + a->chunk_bytes() - 1) / a->chunk_bytes();
  EXPECT_EQ(per_copy, 2);
  for (int d = 0; d < 2; ++d) {
    EXPECT_EQ(on.copies.chunks[d], on.offload.offloaded_blocks * per_copy)
        << copy_direction_name(static_cast<CopyDirection>(d));
  }
  EXPECT_EQ(on.copies.bytes[0], on.offload.h2d_bytes);
  EXPECT_EQ(on.copies.bytes[1], on.offload.d2h_bytes);
  // Every rank moved the same bytes over the link: a perfectly fair share.
  node->barrier();
  const std::vector<int64_t> after = node_arbiter->link_bytes();
  std::vector<double> moved;
  for (size_t i = 0; i < after.size(); ++i) {
    moved.push_back(static_cast<double>(after[i] - before[i]));
    EXPECT_EQ(after[i] - before[i], 2 * (on.offload.d2h_bytes + on.offload.h2d_bytes))
        << "link rank " << node_arbiter->link_ranks()[i];
  }
  EXPECT_EQ(jain_fairness(moved), 1.0);
  node->barrier();
}

}  // namespace
}  // namespace hp
