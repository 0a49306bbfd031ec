// The NCCL communicator and the GPU multi-rank path: every collective against host-computed
// expectations on random data, the MoE token exchange, make_nccl_groups, gradient reductions on
// the backend's comm stream (make_nccl_grad_groups, GradSync ordered by events), a 2-rank MoE
// training run against a 1-rank reference (ep_size 2 and 1) with its sync budget, and a stuck
// collective that must fail promptly, naming itself, instead of hanging.
//
// One rank per process and one GPU per rank: run under `mpirun -np 2` (or more, with as many
// GPUs). Skips when the world is smaller than 2 or there are fewer GPUs than ranks.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "framework/backend/cuda/cuda_backend.h"
#include "framework/backend/cuda/cuda_check.h"
#include "launch/train/trainer.h"
#include "parallel/cuda/nccl_communicator.h"
#include "parallel/grad_sync.h"
#include "parallel/moe_exchange.h"
#include "parallel/mpi_communicator.h"
#include "parallel/process_groups.h"

namespace hp {
namespace {

using namespace std::chrono_literals;
using CommPtr = std::shared_ptr<Communicator>;

// ---- the job ----------------------------------------------------------------------------------

CommPtr host_world() {
  static CommPtr world = []() -> CommPtr {
    LaunchInfo info = detect_launch();
    if (!info.use_mpi || info.world < 2) return nullptr;
    CommOptions options;
    options.timeout = 120s;
    CommPtr w = MpiCommunicator::create(MPI_COMM_WORLD, "world", options);
    set_error_rank(w->rank());
    return w;
  }();
  return world;
}

Backend& gpu_backend() {
  static std::unique_ptr<Backend> be =
      make_cuda_backend(detect_launch().local_rank % std::max(1, cuda_device_count()));
  return *be;
}

// The NCCL world all tests share (created once: communicator set-up costs seconds).
std::shared_ptr<NcclCommunicator> nccl_world() {
  static std::shared_ptr<NcclCommunicator> c =
      NcclCommunicator::create(*host_world(), gpu_backend(), "world");
  return c;
}

// Every rank takes the same decision: the world size and the GPU count are the same everywhere.
#define HP_NCCL_WORLD(var)                                                            \
  CommPtr hw = host_world();                                                          \
  if (!hw) GTEST_SKIP() << "needs an mpirun launch of 2 or more ranks";               \
  if (cuda_device_count() < hw->size())                                               \
    GTEST_SKIP() << "needs one GPU per rank: " << cuda_device_count() << " GPUs for " \
                 << hw->size() << " ranks";                                           \
  std::shared_ptr<NcclCommunicator> var = nccl_world();                               \
  Backend& be = gpu_backend();                                                        \
  (void)be

// ---- data -------------------------------------------------------------------------------------

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Value i of rank r (never all zero; integers small enough that sums never wrap).
double value(uint64_t seed, int rank, int64_t i, DType dt) {
  const uint64_t h = mix(mix(seed) ^ mix(static_cast<uint64_t>(rank) * 7919 + 1) ^ mix(i));
  if (dt == DType::kI32 || dt == DType::kI64) return static_cast<double>(h % 20001) - 10000.0;
  const double u = static_cast<double>(h >> 11) * 0x1.0p-53;  // [0, 1)
  double v = (u * 2.0 - 1.0) * 8.0;
  if (dt == DType::kBF16) v = static_cast<float>(bf16(static_cast<float>(v)));
  if (dt == DType::kF32) v = static_cast<float>(v);
  return v;
}

Tensor hwtensor(const std::vector<double>& v, DType dt, Shape shape = {}) {
  if (shape.empty()) shape = {static_cast<int64_t>(v.size())};
  Tensor t = Tensor::host(shape, dt);
  for (size_t i = 0; i < v.size(); ++i) {
    switch (dt) {
      case DType::kF32:
        t.data<float>()[i] = static_cast<float>(v[i]);
        break;
      case DType::kF64:
        t.data<double>()[i] = v[i];
        break;
      case DType::kBF16:
        t.data<bf16>()[i] = bf16(static_cast<float>(v[i]));
        break;
      case DType::kI32:
        t.data<int32_t>()[i] = static_cast<int32_t>(v[i]);
        break;
      case DType::kI64:
        t.data<int64_t>()[i] = static_cast<int64_t>(v[i]);
        break;
    }
  }
  return t;
}

std::vector<double> read_values(Backend& be, const Tensor& dev) {
  Tensor h = Tensor::host(dev.shape(), dev.dtype());
  be.read_to_host(dev, h, SyncCause::kOther);
  std::vector<double> out(static_cast<size_t>(h.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    switch (h.dtype()) {
      case DType::kF32:
        out[i] = h.data<float>()[i];
        break;
      case DType::kF64:
        out[i] = h.data<double>()[i];
        break;
      case DType::kBF16:
        out[i] = static_cast<float>(h.data<bf16>()[i]);
        break;
      case DType::kI32:
        out[i] = h.data<int32_t>()[i];
        break;
      case DType::kI64:
        out[i] = static_cast<double>(h.data<int64_t>()[i]);
        break;
    }
  }
  return out;
}

std::vector<double> rank_values(uint64_t seed, int rank, int64_t n, DType dt) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = value(seed, rank, i, dt);
  return v;
}

double tolerance(DType dt, int world) {
  switch (dt) {
    case DType::kF32:
      return 1e-5;
    case DType::kF64:
      return 1e-12;
    case DType::kBF16:
      return world <= 2 ? 4e-3 : 2e-2;  // one bf16 rounding per partial sum
    default:
      return 0;
  }
}

// ---- collectives ------------------------------------------------------------------------------

TEST(NcclComm, AllReduceEveryDtypeAndOp) {
  HP_NCCL_WORLD(comm);
  const int n = comm->size();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kI32, DType::kI64, DType::kF64}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
      for (int64_t numel : {int64_t{1}, int64_t{4099}}) {
        const uint64_t seed = 11 + static_cast<uint64_t>(dt) * 31 + static_cast<uint64_t>(op);
        Tensor t = be.upload(hwtensor(rank_values(seed, comm->rank(), numel, dt), dt));
        comm->all_reduce(t, op);
        std::vector<double> got = read_values(be, t);
        for (int64_t i = 0; i < numel; ++i) {
          double want = value(seed, 0, i, dt);
          for (int r = 1; r < n; ++r) {
            const double v = value(seed, r, i, dt);
            want = op == ReduceOp::kSum   ? want + v
                   : op == ReduceOp::kMax ? std::max(want, v)
                                          : std::min(want, v);
          }
          const double tol =
              op == ReduceOp::kSum ? tolerance(dt, n) * std::max(1.0, std::abs(want)) : 0.0;
          ASSERT_NEAR(got[static_cast<size_t>(i)], want, tol)
              << dtype_name(dt) << " " << reduce_op_name(op) << " element " << i;
        }
      }
    }
  }
}

TEST(NcclComm, AllReduceBitwiseEqualAcrossRanks) {
  HP_NCCL_WORLD(comm);
  const int64_t numel = 1 << 16;
  Tensor t = be.upload(hwtensor(rank_values(5, comm->rank(), numel, DType::kF32), DType::kF32));
  comm->all_reduce(t, ReduceOp::kSum);
  Tensor mine = Tensor::host({numel}, DType::kF32);
  be.read_to_host(t, mine, SyncCause::kOther);
  Tensor root = Tensor::host({numel}, DType::kF32);
  std::memcpy(root.raw(), mine.raw(), mine.nbytes());
  hw->broadcast(root, 0);
  EXPECT_EQ(std::memcmp(root.raw(), mine.raw(), mine.nbytes()), 0);
}

TEST(NcclComm, Broadcast) {
  HP_NCCL_WORLD(comm);
  for (DType dt : {DType::kBF16, DType::kI64, DType::kF32}) {
    for (int root = 0; root < comm->size(); ++root) {
      Tensor t = be.upload(hwtensor(rank_values(21, comm->rank(), 777, dt), dt));
      comm->broadcast(t, root);
      EXPECT_EQ(read_values(be, t), rank_values(21, root, 777, dt)) << dtype_name(dt);
    }
  }
}

TEST(NcclComm, AllGather) {
  HP_NCCL_WORLD(comm);
  const int n = comm->size();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kI32}) {
    Tensor in = be.upload(hwtensor(rank_values(31, comm->rank(), 513, dt), dt, {171, 3}));
    Tensor out = be.empty({171 * n, 3}, dt);
    comm->all_gather(in, out);
    std::vector<double> want;
    for (int r = 0; r < n; ++r) {
      auto v = rank_values(31, r, 513, dt);
      want.insert(want.end(), v.begin(), v.end());
    }
    EXPECT_EQ(read_values(be, out), want) << dtype_name(dt);
  }
}

TEST(NcclComm, ReduceScatter) {
  HP_NCCL_WORLD(comm);
  const int n = comm->size();
  const int64_t chunk = 1001;
  for (DType dt : {DType::kF32, DType::kI32, DType::kI64}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      Tensor in = be.upload(hwtensor(rank_values(41, comm->rank(), chunk * n, dt), dt));
      Tensor out = be.empty({chunk}, dt);
      comm->reduce_scatter(in, out, op);
      std::vector<double> got = read_values(be, out);
      for (int64_t i = 0; i < chunk; ++i) {
        const int64_t at = comm->rank() * chunk + i;
        double want = value(41, 0, at, dt);
        for (int r = 1; r < n; ++r)
          want = op == ReduceOp::kSum ? want + value(41, r, at, dt)
                                      : std::max(want, value(41, r, at, dt));
        ASSERT_NEAR(got[static_cast<size_t>(i)], want,
                    op == ReduceOp::kSum ? tolerance(dt, n) * std::max(1.0, std::abs(want)) : 0)
            << dtype_name(dt) << " " << reduce_op_name(op);
      }
    }
  }
}

// Rows rank src sends to rank dst: uneven, with zeros (including some ranks sending nothing to
// anyone in the second pattern).
int64_t a2a_rows(int pattern, int src, int dst) {
  if (pattern == 0) return (src * 3 + dst * 5 + 1) % 4;         // 0..3, zeros included
  if (pattern == 1) return src == 0 ? 0 : 7 * (dst + 1) + src;  // rank 0 sends nothing
  return src == dst ? 0 : 1000 + 13 * src + dst;                // nothing to itself
}

TEST(NcclComm, AllToAllVUnevenAndZeroCounts) {
  HP_NCCL_WORLD(comm);
  const int n = comm->size(), me = comm->rank();
  const int64_t width = 5;
  for (int pattern = 0; pattern < 3; ++pattern) {
    for (DType dt : {DType::kI64, DType::kBF16}) {
      std::vector<int64_t> send_counts(n), recv_counts(n);
      std::vector<double> send_vals;
      for (int dst = 0; dst < n; ++dst) {
        send_counts[dst] = a2a_rows(pattern, me, dst);
        recv_counts[dst] = a2a_rows(pattern, dst, me);
        for (int64_t r = 0; r < send_counts[dst]; ++r)
          for (int64_t c = 0; c < width; ++c)  // exact in bf16: small integers
            send_vals.push_back(static_cast<double>((me * n + dst) * 4 + (r + c) % 4));
      }
      int64_t send_rows = 0, recv_rows = 0;
      for (int p = 0; p < n; ++p) send_rows += send_counts[p], recv_rows += recv_counts[p];
      Tensor send = send_rows > 0 ? be.upload(hwtensor(send_vals, dt, {send_rows, width}))
                                  : be.empty({0, width}, dt);
      Tensor recv = be.empty({recv_rows, width}, dt);
      comm->all_to_all_v(send, send_counts, recv, recv_counts);
      std::vector<double> want;
      for (int src = 0; src < n; ++src)
        for (int64_t r = 0; r < recv_counts[src]; ++r)
          for (int64_t c = 0; c < width; ++c)
            want.push_back(static_cast<double>((src * n + me) * 4 + (r + c) % 4));
      if (recv_rows > 0) {
        EXPECT_EQ(read_values(be, recv), want) << "pattern " << pattern;
      }
    }
  }
  comm->synchronize();
}

// Rows this rank keeps go through NCCL (a send/recv to itself in the group): large enough for
// many chunks, with every peer's rows distinct.
TEST(NcclComm, AllToAllVLargeRowsToSelfAndPeers) {
  HP_NCCL_WORLD(comm);
  const int n = comm->size(), me = comm->rank();
  const int64_t width = 1024;  // 4 KiB rows of f32
  std::vector<int64_t> send_counts(n), recv_counts(n);
  for (int p = 0; p < n; ++p) {
    send_counts[p] = 1000 + 37 * ((me + 2 * p) % 5);
    recv_counts[p] = 1000 + 37 * ((p + 2 * me) % 5);
  }
  std::vector<double> send_vals;
  for (int dst = 0; dst < n; ++dst)
    for (int64_t r = 0; r < send_counts[dst]; ++r)
      for (int64_t c = 0; c < width; ++c)
        send_vals.push_back(static_cast<double>(((me * n + dst) * 4096 + r) * 8 + c % 8));
  int64_t send_rows = 0, recv_rows = 0;
  for (int p = 0; p < n; ++p) send_rows += send_counts[p], recv_rows += recv_counts[p];
  Tensor send = be.upload(hwtensor(send_vals, DType::kF32, {send_rows, width}));
  Tensor recv = be.empty({recv_rows, width}, DType::kF32);
  comm->all_to_all_v(send, send_counts, recv, recv_counts);
  std::vector<double> want;
  for (int src = 0; src < n; ++src)
    for (int64_t r = 0; r < recv_counts[src]; ++r)
      for (int64_t c = 0; c < width; ++c)
        want.push_back(static_cast<double>(((src * n + me) * 4096 + r) * 8 + c % 8));
  EXPECT_EQ(read_values(be, recv), want);
  comm->synchronize();
}

TEST(NcclComm, SendRecvRingInGroupAndBarrier) {
  HP_NCCL_WORLD(comm);
  const int n = comm->size(), me = comm->rank();
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  Tensor out = be.upload(hwtensor(rank_values(51, me, 3000, DType::kF32), DType::kF32));
  Tensor in = be.empty({3000}, DType::kF32);
  comm->group_start();
  comm->send(out, next);
  comm->recv(in, prev);
  comm->group_end();
  EXPECT_EQ(read_values(be, in), rank_values(51, prev, 3000, DType::kF32));
  const int64_t syncs = be.syncs().get(SyncCause::kOther);
  comm->barrier();
  EXPECT_EQ(be.syncs().get(SyncCause::kOther), syncs + 1);
  EXPECT_EQ(comm->pending(), 0u);
}

TEST(NcclComm, SplitOrdersByKeyAndMirrorsHostGroups) {
  HP_NCCL_WORLD(comm);
  const int n = comm->size(), me = comm->rank();
  // One group, ranks reversed by key.
  CommPtr rev = comm->split(0, n - 1 - me, "reversed");
  ASSERT_TRUE(rev);
  EXPECT_EQ(rev->rank(), n - 1 - me);
  EXPECT_EQ(rev->world_rank(), comm->world_rank());
  Tensor t = be.upload(hwtensor({static_cast<double>(rev->rank())}, DType::kI32));
  rev->all_reduce(t, ReduceOp::kMax);
  EXPECT_EQ(read_values(be, t)[0], n - 1);
  // Rank 0 stays out.
  CommPtr rest = comm->split(me == 0 ? -1 : 1, me, "rest");
  EXPECT_EQ(rest == nullptr, me == 0);
  if (rest) {
    EXPECT_EQ(rest->size(), n - 1);
    EXPECT_EQ(rest->rank(), me - 1);
  }

  for (int ep : {1, n}) {
    ProcessGroups host = make_process_groups(hw, ep);
    ProcessGroups dev = make_nccl_groups(host, be);
    for (auto [h, d] : {std::pair{host.world, dev.world}, std::pair{host.dp, dev.dp},
                        std::pair{host.ep, dev.ep}, std::pair{host.node, dev.node}}) {
      ASSERT_TRUE(d);
      EXPECT_EQ(d->device(), Device::kCUDA);
      EXPECT_EQ(d->name(), h->name());
      EXPECT_EQ(d->world_ranks(), h->world_ranks());
      EXPECT_EQ(d->rank(), h->rank());
    }
    Tensor s = be.upload(hwtensor({1.0}, DType::kI64));
    dev.ep->all_reduce(s, ReduceOp::kSum);
    EXPECT_EQ(read_values(be, s)[0], ep);
  }
}

// ---- the MoE exchange -------------------------------------------------------------------------

TEST(NcclMoeExchange, DispatchCombineRoundTrip) {
  HP_NCCL_WORLD(comm);
  const int n = comm->size(), me = comm->rank();
  const int experts = 4 * n, width = 6;
  CommExpertExchange ex(comm, comm);
  // Uneven random routing; one expert gets nothing from this rank.
  std::vector<double> ids;
  for (int64_t a = 0; a < 997; ++a) {
    int e = static_cast<int>(mix(me * 100003 + a) % experts);
    if (e == (me + 1) % experts) e = (e + 1) % experts;
    ids.push_back(e);
  }
  std::vector<int64_t> counts(experts, 0);
  for (double e : ids) ++counts[static_cast<size_t>(e)];
  Tensor dev_ids = be.upload(hwtensor(ids, DType::kI32));
  Tensor dev_counts = be.empty({experts}, DType::kI32);
  be.histogram(dev_ids, experts, dev_counts);
  const int64_t routing = be.syncs().get(SyncCause::kRouting);
  const ExchangePlan plan = ex.plan(be, dev_counts, experts, RoutingMode::kBincount);
  EXPECT_EQ(be.syncs().get(SyncCause::kRouting), routing + 1) << "one count read per plan";
  for (int e = 0; e < experts; ++e) EXPECT_EQ(plan.count(me, e), counts[e]);

  // Rows sorted by expert; each row says (source rank, expert, row).
  std::vector<double> x;
  for (int e = 0; e < experts; ++e)
    for (int64_t r = 0; r < counts[e]; ++r)
      for (int c = 0; c < width; ++c) x.push_back(me * 1e6 + e * 1e3 + r % 500 + c * 0.5);
  Tensor xs = be.upload(hwtensor(x, DType::kF32, {static_cast<int64_t>(ids.size()), width}));
  Tensor y = ex.dispatch(be, plan, xs);
  ASSERT_EQ(y.dim(0), plan.expert_rows);
  std::vector<double> got = read_values(be, y);
  for (const auto& c : plan.chunks()) {
    const int e = me * plan.experts_per_rank + c.local_expert;
    for (int64_t r = 0; r < c.rows; ++r) {
      const double v = got[static_cast<size_t>((c.begin + r) * width)];
      const int src = static_cast<int>(v / 1e6);
      EXPECT_EQ(static_cast<int>((v - src * 1e6) / 1e3), e) << "row " << c.begin + r;
    }
  }
  Tensor back = ex.combine(be, plan, y);
  EXPECT_EQ(read_values(be, back), x);
}

// ---- gradient reductions on the comm stream -----------------------------------------------------

TEST(NcclGradSync, GradGroupsRunOnTheBackendCommStream) {
  HP_NCCL_WORLD(comm);
  // NCCL >= 2.26 orders concurrent communicators' launches: the comm-stream groups exist.
  ASSERT_TRUE(nccl_launch_order_implicit());
  const char* env = std::getenv("NCCL_LAUNCH_ORDER_IMPLICIT");
  ASSERT_NE(env, nullptr);
  EXPECT_STRNE(env, "0");
  // ep_size 1: dp has the world's ranks and shares its communicator; ep_size = world: dp has one
  // rank per group and gets its own.
  for (int ep : {1, hw->size()}) {
    ProcessGroups g = make_nccl_grad_groups(make_process_groups(hw, ep), be);
    ASSERT_TRUE(g.world && g.dp) << "ep_size " << ep;
    EXPECT_FALSE(g.ep);
    EXPECT_FALSE(g.node);
    EXPECT_EQ(g.world->name(), "world.grad");
    EXPECT_EQ(g.world->size(), hw->size());
    EXPECT_EQ(g.dp->size(), hw->size() / ep);
    EXPECT_EQ(g.dp == g.world, ep == 1) << "ep_size " << ep;
    for (const CommPtr& c : {g.world, g.dp}) {
      auto* nc = dynamic_cast<NcclCommunicator*>(c.get());
      ASSERT_NE(nc, nullptr);
      EXPECT_EQ(nc->stream(), cuda_comm_stream(be)) << c->name();
      EXPECT_NE(nc->stream(), cuda_compute_stream(be)) << c->name();
    }
  }
  // The communicators of the other device collectives stay on the compute stream.
  EXPECT_EQ(comm->stream(), cuda_compute_stream(be));
}

// GradSync over comm-stream communicators against the same reductions on the compute stream:
// the comm stream must wait for the gradients (written on compute after a long queue of GEMMs)
// and compute must wait for the reductions (read right after finish()), with no host sync in
// between; the sums are bitwise those of the compute-stream path (and, on 2 ranks, exactly the
// float sum of the two addends).
TEST(NcclGradSync, CommStreamReductionsAreOrderedByEventsAndBitwiseUnchanged) {
  HP_NCCL_WORLD(comm);
  ASSERT_TRUE(nccl_launch_order_implicit());
  const int n = comm->size(), me = comm->rank();
  ProcessGroups host = make_process_groups(hw, 1);
  ProcessGroups on_comm = make_nccl_grad_groups(host, be);
  ASSERT_TRUE(on_comm.world);
  ProcessGroups on_compute = host;
  on_compute.world = comm;
  on_compute.dp = comm;

  // Big tensors take milliseconds to reduce; small ones share a layer (one grouped launch on 2
  // ranks). Layer 2 is never reported: finish() reduces it.
  struct Spec {
    const char* name;
    int64_t numel;
    ParamGroup group;
  };
  const std::vector<Spec> specs = {
      {"embed", 8 << 20, ParamGroup::kDense},
      {"layers.0.attn.wqkv", 4 << 20, ParamGroup::kDense},
      {"layers.0.attn.sinks", 24, ParamGroup::kDense},
      {"layers.0.moe.w1", 16 << 20, ParamGroup::kExpert},
      {"layers.0.norm", 128, ParamGroup::kDense},
      {"layers.1.attn.wqkv", 4 << 20, ParamGroup::kDense},
      {"layers.1.norm", 128, ParamGroup::kDense},
      {"layers.2.moe.b1", 1000, ParamGroup::kExpert},
  };
  ParamRegistry reg;
  std::vector<Tensor> source;  // this rank's gradient values, uploaded once
  std::vector<std::vector<double>> addends(specs.size());
  for (size_t k = 0; k < specs.size(); ++k) {
    Param p;
    p.name = specs[k].name;
    p.shape = {specs[k].numel};
    p.global_shape = p.shape;
    p.group = specs[k].group;
    p.grad = be.zeros(p.shape, DType::kF32);
    reg.add(std::move(p));
    // Only a prefix varies (host generation is slow); the rest repeats it.
    const int64_t m = std::min<int64_t>(specs[k].numel, 4096);
    addends[k] = rank_values(900 + k, me, m, DType::kF32);
    Tensor src = be.empty({specs[k].numel}, DType::kF32);
    Tensor blk = be.upload(hwtensor(addends[k], DType::kF32));
    for (int64_t i = 0; i < specs[k].numel; i += m) {
      Tensor dst = src.flat_view(i, std::min(m, specs[k].numel - i));
      be.copy(blk.flat_view(0, dst.numel()), dst);
    }
    source.push_back(src);
  }
  // Compute-stream work queued ahead of the gradient writes.
  Tensor a = be.zeros({4096, 4096}, DType::kBF16), c = be.empty({4096, 4096}, DType::kBF16);
  be.synchronize(SyncCause::kOther);

  auto run = [&](const ProcessGroups& groups, Backend::StreamKind stream) {
    GradSync sync(be, reg, groups, stream);
    EXPECT_EQ(sync.stream(), stream);
    for (auto& p : reg.all()) be.fill(p->grad, 0.0);
    be.synchronize(SyncCause::kOther);
    be.syncs().reset();
    for (int i = 0; i < 40; ++i) be.gemm(a, false, a, false, c, 1.0, 0.0);
    for (size_t k = 0; k < specs.size(); ++k) be.copy(source[k], reg.all()[k]->grad);
    for (int layer : {1, 0, -1}) sync.layer_ready(layer);
    sync.finish();
    // Read on compute at once: it must see the reduced gradients.
    std::vector<Tensor> out;
    for (auto& p : reg.all()) {
      Tensor t = be.empty(p->grad.shape(), DType::kF32);
      be.copy(p->grad, t);
      out.push_back(t);
    }
    EXPECT_EQ(be.syncs().total(), 0) << "layer_ready/finish must not wait on the host";
    std::vector<std::vector<double>> values;
    for (const Tensor& t : out) values.push_back(read_values(be, t));
    return values;
  };
  const auto got_compute = run(on_compute, Backend::StreamKind::kCompute);
  const auto got_comm = run(on_comm, Backend::StreamKind::kComm);

  for (size_t k = 0; k < specs.size(); ++k) {
    // The reduced addends of every rank (the expert group's dp is the world at ep_size 1).
    const int64_t m = static_cast<int64_t>(addends[k].size());
    std::vector<double> want(static_cast<size_t>(m), 0.0);
    for (int r = 0; r < n; ++r) {
      const std::vector<double> v = rank_values(900 + k, r, m, DType::kF32);
      for (int64_t i = 0; i < m; ++i) {
        // fl(a + b) in float, the exact result of any 2-rank sum order.
        want[static_cast<size_t>(i)] =
            static_cast<float>(static_cast<float>(want[static_cast<size_t>(i)]) +
                               static_cast<float>(v[static_cast<size_t>(i)]));
      }
    }
    size_t bad = 0;
    for (int64_t i = 0; i < specs[k].numel; ++i) {
      const double w = want[static_cast<size_t>(i % m)];
      const double g = got_comm[k][static_cast<size_t>(i)];
      const bool ok = n == 2 ? g == w : std::abs(g - w) <= 1e-5 * (1 + std::abs(w));
      if (!ok && bad++ < 3) ADD_FAILURE() << specs[k].name << "[" << i << "] " << g << " vs " << w;
    }
    EXPECT_EQ(bad, 0u) << specs[k].name;
    EXPECT_TRUE(got_comm[k] == got_compute[k])
        << specs[k].name << ": comm stream vs compute stream";
  }
}

// ---- training ---------------------------------------------------------------------------------

TrainOptions tiny_moe_options(int ep_size) {
  TrainOptions o;
  ModelConfig& c = o.model;
  c.vocab_size = 16;
  c.d_model = 128;
  c.n_layers = 4;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 64;  // cuDNN's attention on the full-causal layers, as attention=auto ships it
  c.n_experts = 8;
  c.top_k = 2;
  c.expert_ffn_dim = 128;
  c.sliding_window = 32;
  c.window_layers = WindowLayers::kEven;
  c.attn_sinks = true;
  c.attn_bias = true;
  c.activation = Activation::kGptOss;
  c.moe_aux_coef = 0.01;
  o.data.synthetic_vocab = 8;
  o.data.synthetic_zipf = 2.0;
  o.data.synthetic_mean_doc_len = 64;
  o.device.kind = DeviceKind::kCuda;
  o.data.seq_len = 256;
  o.data.batch_tokens = 4096;
  o.run.steps = 10;
  o.optimizer.lr = 3e-3;
  o.optimizer.min_lr = 3e-4;
  o.optimizer.warmup_steps = 2;
  o.optimizer.weight_decay = 0.0;
  o.parallel.ep_size = ep_size;
  return o;
}

// This rank's context with the host groups of `ep` over the launch's world `hw`.
RankContext grouped_context(const CommPtr& hw, int ep) {
  RankContext ctx;
  ctx.launch = detect_launch();
  ctx.groups = make_process_groups(hw, ep);
  return ctx;
}

// The trainer reduces gradients on the comm stream (make_nccl_grad_groups) wherever NCCL orders
// concurrent communicators, which NcclGradSync.* checks; here the whole step runs that way.
TEST(NcclTrain, TwoRankLossesMatchOneRankAndRoutingSyncsPerLayer) {
  HP_NCCL_WORLD(comm);
  ASSERT_TRUE(nccl_launch_order_implicit()) << "gradient reductions would stay on compute";
  const int steps = 10;
  // The 1-rank reference, computed by every rank on its own GPU from the same global batches.
  std::vector<double> ref;
  {
    RankContext one = single_rank_context();
    one.launch.local_rank = detect_launch().local_rank;  // this rank's own GPU
    Trainer t(tiny_moe_options(1), one);
    // The path realistic documents run: cuDNN for the full-causal layers, tiled for windows.
    EXPECT_EQ(cuda_attention_description(t.backend()).rfind("cudnn", 0), 0u)
        << cuda_attention_description(t.backend());
    for (int i = 0; i < steps; ++i) ref.push_back(t.step().loss);
  }
  for (int ep : {hw->size(), 1}) {
    const RankContext ctx = grouped_context(hw, ep);
    TrainOptions o = tiny_moe_options(ep);
    Trainer t(o, ctx);
    for (int i = 0; i < steps; ++i) {
      StepStats s = t.step();
      EXPECT_NEAR(s.loss, ref[static_cast<size_t>(i)], 2e-2 * std::abs(ref[static_cast<size_t>(i)]))
          << "ep_size " << ep << " step " << i + 1;
      // Bincount routing: one count read per MoE layer forward, none in backward.
      EXPECT_EQ(s.syncs.get(SyncCause::kRouting), o.model.n_layers)
          << "ep_size " << ep << " step " << i + 1;
      // Gradient reductions (on the comm stream, ordered by events) wait on the host nowhere.
      EXPECT_EQ(s.syncs.get(SyncCause::kOther), 0) << "ep_size " << ep << " step " << i + 1;
    }
  }
}

// optimizer_sharding=zero1 on the GPUs: reduce-scatters and all-gathers on the comm stream, no
// host sync, the state bytes divided by the world (dense) and dp (experts), and the losses and
// gradient norms of none. NCCL's reduce-scatter and all-reduce add an element's addends in orders
// of their own, which on 2 ranks (one addition per element) cannot differ: bitwise there, within
// 1e-6 relative on more ranks. Then grad_reduce_dtype=bf16 runs the same steps without a sync.
TEST(NcclTrain, Zero1MatchesNoneOnTheCommStream) {
  HP_NCCL_WORLD(comm);
  const int steps = 6;
  const int world = hw->size();
  for (int ep : {1, world}) {
    std::vector<StepStats> runs[2];
    OptimizerStateBytes bytes[2];
    for (int z = 0; z < 2; ++z) {
      const RankContext ctx = grouped_context(hw, ep);
      TrainOptions o = tiny_moe_options(ep);
      o.cuda.deterministic = true;
      o.optimizer.sharding = z ? OptimizerSharding::kZero1 : OptimizerSharding::kNone;
      Trainer t(o, ctx);
      bytes[z] = t.optimizer_state_bytes();
      for (int i = 0; i < steps; ++i) {
        runs[z].push_back(t.step());
        EXPECT_EQ(runs[z].back().syncs.get(SyncCause::kOther), 0)
            << "zero1=" << z << " ep " << ep << " step " << i + 1;
      }
    }
    EXPECT_EQ(bytes[0].dense, world * bytes[1].dense) << "ep " << ep;
    EXPECT_EQ(bytes[0].expert, (world / ep) * bytes[1].expert) << "ep " << ep;
    for (int i = 0; i < steps; ++i) {
      const StepStats &a = runs[0][static_cast<size_t>(i)], &b = runs[1][static_cast<size_t>(i)];
      if (world == 2) {
        EXPECT_EQ(a.loss, b.loss) << "ep " << ep << " step " << i + 1;
        EXPECT_EQ(a.grad_norm, b.grad_norm) << "ep " << ep << " step " << i + 1;
      } else {
        EXPECT_NEAR(a.loss, b.loss, 1e-6 * std::abs(a.loss)) << "ep " << ep << " step " << i + 1;
        EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-6 * a.grad_norm)
            << "ep " << ep << " step " << i + 1;
      }
    }
  }
  const RankContext ctx = grouped_context(hw, 1);
  TrainOptions o = tiny_moe_options(1);
  o.optimizer.sharding = OptimizerSharding::kZero1;
  o.optimizer.grad_reduce_dtype = DType::kBF16;
  Trainer t(o, ctx);
  for (int i = 0; i < steps; ++i) {
    const StepStats s = t.step();
    EXPECT_TRUE(s.finite) << "bf16 wire, step " << i + 1;
    EXPECT_EQ(s.syncs.get(SyncCause::kOther), 0) << "bf16 wire, step " << i + 1;
  }
}

// comm_overlap=false, the baseline that the overlap is measured against: the reductions (and
// zero1's all-gathers) run on the compute stream over the tensor communicators. The same
// reductions of the same bits in another stream order: on 2 ranks the losses and gradient norms
// equal the overlapped run's bit for bit (within 1e-6 relative on more), with and without zero1,
// and neither way waits on the host.
TEST(NcclTrain, CommOverlapOffRunsOnComputeWithTheSameBits) {
  HP_NCCL_WORLD(comm);
  const int steps = 4;
  const int world = hw->size();
  for (int ep : {1, world}) {
    for (OptimizerSharding sharding : {OptimizerSharding::kNone, OptimizerSharding::kZero1}) {
      std::vector<StepStats> runs[2];
      for (int overlap = 0; overlap < 2; ++overlap) {
        const RankContext ctx = grouped_context(hw, ep);
        TrainOptions o = tiny_moe_options(ep);
        o.cuda.deterministic = true;
        o.optimizer.sharding = sharding;
        o.parallel.comm_overlap = overlap == 1;
        Trainer t(o, ctx);
        EXPECT_STREQ(t.reduction_stream(), overlap ? "comm" : "compute") << "ep " << ep;
        for (int i = 0; i < steps; ++i) {
          runs[overlap].push_back(t.step());
          EXPECT_EQ(runs[overlap].back().syncs.get(SyncCause::kOther), 0)
              << "overlap " << overlap << " ep " << ep << " step " << i + 1;
        }
      }
      const char* z = sharding == OptimizerSharding::kZero1 ? "zero1" : "none";
      for (int i = 0; i < steps; ++i) {
        const StepStats &off = runs[0][static_cast<size_t>(i)],
                        &on = runs[1][static_cast<size_t>(i)];
        if (world == 2) {
          EXPECT_EQ(off.loss, on.loss) << z << " ep " << ep << " step " << i + 1;
          EXPECT_EQ(off.grad_norm, on.grad_norm) << z << " ep " << ep << " step " << i + 1;
        } else {
          EXPECT_NEAR(off.loss, on.loss, 1e-6 * std::abs(on.loss)) << z << " ep " << ep;
          EXPECT_NEAR(off.grad_norm, on.grad_norm, 1e-6 * on.grad_norm) << z << " ep " << ep;
        }
      }
    }
  }
}

// ---- failure: a stuck collective --------------------------------------------------------------

// Runs last in this file: rank 1 skips an all_reduce; rank 0 must get an error naming the
// collective, the communicator and the timeout, and nothing may hang (a hang fails the test at
// CTest's timeout; no wall-clock bound is asserted here).
TEST(NcclTimeout, StuckCollectiveFailsNamingItWithoutHanging) {
  HP_NCCL_WORLD(comm);
  // Its own stream, so the aborted operation cannot hold up the backend's stream.
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto stuck = NcclCommunicator::create(*hw, cuda_backend_device(be), stream, "timeout_test");
  stuck->set_timeout(2s);
  Tensor t = be.upload(hwtensor({1.0, 2.0, 3.0}, DType::kF32));
  be.synchronize(SyncCause::kOther);  // the upload is on the compute stream
  if (stuck->rank() == 0) {
    std::string msg;
    try {
      // Fails here while NCCL connects to the absent peer, or in the wait for the result.
      stuck->all_reduce(t, ReduceOp::kSum);
      stuck->synchronize();
    } catch (const Error& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("all_reduce"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'timeout_test'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("timed out"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
    // Broken from now on: later calls fail at once.
    EXPECT_THROW(stuck->all_reduce(t, ReduceOp::kSum), Error);
  }
  hw->barrier();  // rank 1 waits here while rank 0 times out
  if (stuck->rank() != 0) stuck->abort("timeout test over");
  stuck.reset();
  CUDA_CHECK(cudaStreamDestroy(stream));
  // The shared world still works.
  comm->barrier();
}

}  // namespace
}  // namespace hp
