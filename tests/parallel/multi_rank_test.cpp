// Collectives, groups and failure handling across ranks.
//
// The same checks run in two settings:
//  - MultiRank.* / MultiGroups.*: one rank per process, the world from the MPI launch. Each case
//    is registered with CTest once per rank count on its HP_MPI_TEST line, run under
//    ${MPIEXEC_EXECUTABLE} (label mpi: `ctest -L mpi`, or `ctest -R MultiRank.Broadcast`);
//    started alone, it skips.
//  - ThreadRanks.*: ranks as threads of this process, their communicators moving bytes through an
//    in-process mailbox (thread_comm.h), so the single-process run covers the multi-rank paths of
//    HostCommunicator too.
//  - TcpThreads.*: ranks as threads over a TcpStore on loopback (tcp_threads.h): the control
//    messages the store communicator carries, and its refusal of anything tensor-sized.
// FaultInjection.* run only when HP_TEST_FAULT names a fault (timeout, throw, exit); they end the
// process like the top level of the program would (log, abort the communicator, exit non-zero).
// CTest sets HP_TEST_FAULT for each and checks the output (or the failing exit status) and, with
// the test's timeout, that the whole job ends instead of hanging.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>

#include "framework/core/error.h"
#include "parallel/launch_env.h"
#include "parallel/process_groups.h"
#include "parallel/store_communicator.h"
#include "tests/common/mpi_case.h"
#include "tests/parallel/tcp_threads.h"
#include "tests/parallel/thread_comm.h"

namespace hp {
namespace {

using test::run_tcp_threads;
using test::run_thread_ranks;

using CommPtr = std::shared_ptr<Communicator>;
using namespace std::chrono_literals;

// ---- deterministic test data ------------------------------------------------------------------

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t bits(uint64_t seed, int rank, int64_t i) {
  return mix(mix(seed) ^ mix(static_cast<uint64_t>(rank) + 7777) ^ static_cast<uint64_t>(i));
}

// Magnitudes spread over 2^-12 .. 2^19 so that the order of a float sum shows in its bits.
double real_value(uint64_t seed, int rank, int64_t i) {
  uint64_t h = bits(seed, rank, i);
  double u = 0.5 + static_cast<double>(h >> 11) * 0x1.0p-54;
  int e = static_cast<int>(h & 31) - 12;
  return ((h & 32) ? -1.0 : 1.0) * std::ldexp(u, e);
}

// Element i of rank r's data, for any tensor size.
void set_value(Tensor& t, int64_t at, uint64_t seed, int rank, int64_t i) {
  switch (t.dtype()) {
    case DType::kF32:
      t.data<float>()[at] = static_cast<float>(real_value(seed, rank, i));
      break;
    case DType::kF64:
      t.data<double>()[at] = real_value(seed, rank, i);
      break;
    case DType::kI32:
      t.data<int32_t>()[at] = static_cast<int32_t>(static_cast<uint32_t>(bits(seed, rank, i)));
      break;
    case DType::kI64:
      t.data<int64_t>()[at] = static_cast<int64_t>(bits(seed, rank, i));
      break;
    case DType::kBF16:
      t.data<bf16>()[at] = bf16(static_cast<float>(real_value(seed, rank, i)));
      break;
  }
}

Tensor make_data(DType dt, int64_t n, uint64_t seed, int rank, int64_t first = 0) {
  Tensor t = Tensor::host({n}, dt);
  for (int64_t i = 0; i < n; ++i) set_value(t, i, seed, rank, first + i);
  return t;
}

template <typename T>
T ref_op(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      if constexpr (std::is_integral_v<T>) {
        using U = std::make_unsigned_t<T>;
        return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
      } else {
        return a + b;
      }
    case ReduceOp::kMax:
      return std::max(a, b);
    case ReduceOp::kMin:
      return std::min(a, b);
  }
  return a;
}

template <typename T>
void ref_fold(Tensor& acc, const Tensor& x, ReduceOp op) {
  T* a = acc.data<T>();
  const T* b = x.data<T>();
  for (int64_t i = 0; i < acc.numel(); ++i) a[i] = ref_op(a[i], b[i], op);
}

// The reduction, folded in rank order 0, 1, ..., of elements [first, first + n) of every rank.
Tensor expected_reduction(DType dt, int64_t n, uint64_t seed, int ranks, ReduceOp op,
                          int64_t first = 0) {
  Tensor acc = make_data(dt, n, seed, 0, first);
  for (int r = 1; r < ranks; ++r) {
    Tensor x = make_data(dt, n, seed, r, first);
    switch (dt) {
      case DType::kF32:
        ref_fold<float>(acc, x, op);
        break;
      case DType::kF64:
        ref_fold<double>(acc, x, op);
        break;
      case DType::kI32:
        ref_fold<int32_t>(acc, x, op);
        break;
      case DType::kI64:
        ref_fold<int64_t>(acc, x, op);
        break;
      case DType::kBF16:
        ADD_FAILURE() << "no bf16 reductions";
        break;
    }
  }
  return acc;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.numel() == b.numel() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

std::string where(const Communicator& c) {
  return str_cat("rank ", c.rank(), " of ", c.size(), " on '", c.name(), "'");
}

// ---- the checks -----------------------------------------------------------------------------

void check_all_reduce(Communicator& c) {
  const int64_t sizes[] = {0, 1, 3, 5, 1000, 70001};  // below and above the gather threshold
  uint64_t seed = 100;
  for (DType dt : {DType::kF32, DType::kF64, DType::kI32, DType::kI64}) {
    for (int64_t n : sizes) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
        ++seed;
        Tensor t = make_data(dt, n, seed, c.rank());
        c.all_reduce(t, op);
        Tensor want = expected_reduction(dt, n, seed, c.size(), op);
        EXPECT_TRUE(same_bits(t, want)) << where(c) << ": all_reduce " << reduce_op_name(op)
                                        << " of " << n << " " << dtype_name(dt);
      }
    }
  }
  // Any shape: a 3-D tensor reduces element-wise like a flat one.
  Tensor t = make_data(DType::kF32, 2 * 3 * 5, 7, c.rank()).reshape({2, 3, 5});
  c.all_reduce(t, ReduceOp::kSum);
  EXPECT_TRUE(
      same_bits(t.reshape({30}), expected_reduction(DType::kF32, 30, 7, c.size(), ReduceOp::kSum)));
}

void check_bitwise_equal_across_ranks(Communicator& c) {
  for (int64_t n : {int64_t{17}, int64_t{100003}}) {
    Tensor t = make_data(DType::kF32, n, 555 + static_cast<uint64_t>(n), c.rank());
    c.all_reduce(t, ReduceOp::kSum);
    Tensor all = Tensor::host({c.size() * n}, DType::kF32);
    c.all_gather(t, all);
    for (int r = 0; r < c.size(); ++r) {
      EXPECT_TRUE(same_bits(all.slice(r * n, (r + 1) * n), t))
          << where(c) << ": rank " << r << " holds different bits after all_reduce of " << n;
    }
  }
}

void check_broadcast(Communicator& c) {
  for (int root = 0; root < c.size(); ++root) {
    for (DType dt : {DType::kF32, DType::kBF16, DType::kI64}) {
      const uint64_t seed = 900 + static_cast<uint64_t>(root);
      Tensor t = c.rank() == root ? make_data(dt, 777, seed, root)
                                  : make_data(dt, 777, seed + 1, c.rank());
      c.broadcast(t, root);
      EXPECT_TRUE(same_bits(t, make_data(dt, 777, seed, root)))
          << where(c) << ": broadcast of " << dtype_name(dt) << " from " << root;
    }
  }
}

void check_all_gather(Communicator& c) {
  const int p = c.size();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kI32}) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{5000}}) {
      Tensor in = make_data(dt, n, 31, c.rank());
      Tensor out = Tensor::host({p * n}, dt);
      c.all_gather(in, out);
      for (int r = 0; r < p; ++r) {
        EXPECT_TRUE(same_bits(out.slice(r * n, (r + 1) * n), make_data(dt, n, 31, r)))
            << where(c) << ": all_gather of " << n << " " << dtype_name(dt) << ", part " << r;
      }
    }
  }
  Tensor in = make_data(DType::kF64, 4 * 3, 32, c.rank()).reshape({4, 3});
  Tensor out = Tensor::host({p * 4, 3}, DType::kF64);
  c.all_gather(in, out);
  for (int r = 0; r < p; ++r) {
    EXPECT_TRUE(
        same_bits(out.slice(4 * r, 4 * r + 4).reshape({12}), make_data(DType::kF64, 12, 32, r)));
  }
}

void check_reduce_scatter(Communicator& c) {
  const int p = c.size();
  for (DType dt : {DType::kF32, DType::kF64, DType::kI64}) {
    for (int64_t m : {int64_t{0}, int64_t{1}, int64_t{13}, int64_t{20000}}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
        const uint64_t seed = 4000 + static_cast<uint64_t>(m);
        Tensor in = make_data(dt, p * m, seed, c.rank());
        Tensor out = Tensor::host({m}, dt);
        c.reduce_scatter(in, out, op);
        Tensor want = expected_reduction(dt, m, seed, p, op, c.rank() * m);
        EXPECT_TRUE(same_bits(out, want)) << where(c) << ": reduce_scatter " << reduce_op_name(op)
                                          << " of " << m << " " << dtype_name(dt);
      }
    }
  }
}

// Rows that rank s sends to rank d: uneven, often zero, and nothing at all from rank 1.
int64_t rows_between(int s, int d, int p) {
  if (p > 2 && s == 1) return 0;
  if ((s + 2 * d) % 3 == 0) return 0;
  return (s * 7 + d * 3 + 1) % 4 + (s == d ? 2 : 0);
}

int64_t cell(int s, int d, int64_t j, int col) { return s * 1000000 + d * 10000 + j * 10 + col; }

void check_all_to_all_v(Communicator& c) {
  const int p = c.size(), me = c.rank();
  std::vector<int64_t> send_counts(static_cast<size_t>(p)), recv_counts(static_cast<size_t>(p));
  int64_t send_rows = 0, recv_rows = 0;
  for (int q = 0; q < p; ++q) {
    send_counts[static_cast<size_t>(q)] = rows_between(me, q, p);
    recv_counts[static_cast<size_t>(q)] = rows_between(q, me, p);
    send_rows += send_counts[static_cast<size_t>(q)];
    recv_rows += recv_counts[static_cast<size_t>(q)];
  }
  // i64 rows of width 3: every cell says where it came from.
  Tensor send = Tensor::host({send_rows, 3}, DType::kI64);
  int64_t row = 0;
  for (int d = 0; d < p; ++d) {
    for (int64_t j = 0; j < send_counts[static_cast<size_t>(d)]; ++j, ++row) {
      for (int col = 0; col < 3; ++col) send.data<int64_t>()[row * 3 + col] = cell(me, d, j, col);
    }
  }
  Tensor recv = Tensor::host({recv_rows, 3}, DType::kI64);
  c.all_to_all_v(send, send_counts, recv, recv_counts);
  row = 0;
  for (int s = 0; s < p; ++s) {
    for (int64_t j = 0; j < recv_counts[static_cast<size_t>(s)]; ++j, ++row) {
      for (int col = 0; col < 3; ++col) {
        EXPECT_EQ(recv.data<int64_t>()[row * 3 + col], cell(s, me, j, col))
            << where(c) << ": row " << j << " from rank " << s;
      }
    }
  }
  // bf16, 1-D: rows are elements.
  Tensor send1 = Tensor::host({send_rows}, DType::kBF16);
  row = 0;
  for (int d = 0; d < p; ++d) {
    for (int64_t j = 0; j < send_counts[static_cast<size_t>(d)]; ++j, ++row) {
      send1.data<bf16>()[row] = bf16(static_cast<float>(me * 16 + d * 4 + j));
    }
  }
  Tensor recv1 = Tensor::host({recv_rows}, DType::kBF16);
  c.all_to_all_v(send1, send_counts, recv1, recv_counts);
  row = 0;
  for (int s = 0; s < p; ++s) {
    for (int64_t j = 0; j < recv_counts[static_cast<size_t>(s)]; ++j, ++row) {
      EXPECT_EQ(static_cast<float>(recv1.data<bf16>()[row]),
                static_cast<float>(s * 16 + me * 4 + j));
    }
  }
  // The counts themselves travel as an all_to_all_v of one i64 per rank.
  Tensor my_counts = Tensor::host_from(send_counts, DType::kI64);
  Tensor their_counts = Tensor::host({p}, DType::kI64);
  c.all_to_all_v(my_counts, std::vector<int64_t>(static_cast<size_t>(p), 1), their_counts,
                 std::vector<int64_t>(static_cast<size_t>(p), 1));
  for (int s = 0; s < p; ++s) EXPECT_EQ(their_counts.data<int64_t>()[s], recv_counts[s]);
  // Bad counts are refused before anything is sent (on every rank alike).
  std::vector<int64_t> wrong = send_counts;
  wrong[0] += 1;
  EXPECT_THROW(c.all_to_all_v(send, wrong, recv, recv_counts), Error);
}

void check_send_recv(Communicator& c) {
  const int p = c.size(), me = c.rank();
  const int next = (me + 1) % p, prev = (me + p - 1) % p;
  // A ring inside a group: every rank sends and receives at once.
  Tensor out = make_data(DType::kF32, 1000, 71, me);
  Tensor in = Tensor::host({1000}, DType::kF32);
  c.group_start();
  c.send(out, next);
  c.recv(in, prev);
  c.group_end();
  EXPECT_TRUE(same_bits(in, make_data(DType::kF32, 1000, 71, prev))) << where(c);

  // Large messages to and from everyone at once: must not deadlock inside a group.
  const int64_t big = 1 << 20;
  Tensor mine = make_data(DType::kF32, big, 72, me);
  std::vector<Tensor> got;
  c.group_start();
  for (int q = 0; q < p; ++q) {
    if (q == me) continue;
    c.send(mine, q);
    got.push_back(Tensor::host({big}, DType::kF32));
    c.recv(got.back(), q);
  }
  c.group_end();
  int k = 0;
  for (int q = 0; q < p; ++q) {
    if (q == me) continue;
    EXPECT_TRUE(same_bits(got[static_cast<size_t>(k++)], make_data(DType::kF32, big, 72, q)))
        << where(c) << ": 4 MiB from rank " << q;
  }

  // Plain blocking pair: 0 -> 1, then 1 -> 0.
  if (me < 2) {
    Tensor x = Tensor::host({5}, DType::kI64);
    if (me == 0) {
      c.send(make_data(DType::kI64, 5, 73, 0), 1);
      c.recv(x, 1);
      EXPECT_TRUE(same_bits(x, make_data(DType::kI64, 5, 73, 1)));
    } else {
      c.recv(x, 0);
      EXPECT_TRUE(same_bits(x, make_data(DType::kI64, 5, 73, 0)));
      c.send(make_data(DType::kI64, 5, 73, 1), 0);
    }
  }
  c.barrier();
}

// Rank 0 leaves a file behind before it enters the barrier, late; every rank must find it after.
void check_barrier(Communicator& c) {
  static std::atomic<int> counter{0};
  std::string path;
  if (c.rank() == 0) {
    path = str_cat(::testing::TempDir(), "hp_barrier_", ::getpid(), "_", counter++);
  }
  const std::vector<uint8_t> name =
      share_blob(c, std::vector<uint8_t>(path.begin(), path.end()), 0);
  path.assign(name.begin(), name.end());
  c.barrier();
  if (c.rank() == 0) {
    std::this_thread::sleep_for(100ms);  // a barrier that does not wait lets the others see none
    std::FILE* f = std::fopen(path.c_str(), "w");
    EXPECT_NE(f, nullptr) << path;
    if (f) std::fclose(f);
  }
  c.barrier();
  EXPECT_EQ(::access(path.c_str(), F_OK), 0)
      << where(c) << " left the barrier before rank 0 arrived (no " << path << ")";
  c.barrier();
  if (c.rank() == 0) std::remove(path.c_str());
}

void check_share_blob(Communicator& c) {
  const int root = c.size() - 1;
  std::vector<uint8_t> blob;
  if (c.rank() == root) {
    for (int i = 0; i < 37; ++i) blob.push_back(static_cast<uint8_t>(i * 13 + 5));
  }
  std::vector<uint8_t> got = share_blob(c, blob, root);
  ASSERT_EQ(got.size(), 37u) << where(c);
  for (int i = 0; i < 37; ++i)
    EXPECT_EQ(got[static_cast<size_t>(i)], static_cast<uint8_t>(i * 13 + 5));
  EXPECT_TRUE(share_blob(c, {}, 0).empty());
}

void check_split(Communicator& c) {
  const int p = c.size(), me = c.rank();
  // Even ranks in reverse order; odd ranks stay out.
  CommPtr even = c.split(me % 2 == 0 ? 0 : -1, -me, "even");
  std::vector<int> want;
  for (int r = p - 1; r >= 0; --r) {
    if (r % 2 == 0) want.push_back(c.world_rank(r));
  }
  if (me % 2 == 0) {
    ASSERT_NE(even, nullptr);
    EXPECT_EQ(even->name(), "even");
    EXPECT_EQ(even->world_ranks(), want);
    EXPECT_EQ(even->world_rank(), c.world_rank());
    Tensor t = Tensor::host_from(std::vector<int64_t>{me}, DType::kI64);
    even->all_reduce(t, ReduceOp::kSum);
    int64_t sum = 0;
    for (int r = 0; r < p; r += 2) sum += r;
    EXPECT_EQ(t.data<int64_t>()[0], sum);
  } else {
    EXPECT_EQ(even, nullptr);
  }
  // Labels: pairs of ranks pretend to share a host.
  CommPtr pairs = split_by_label(c, str_cat("host-", me / 2), "pair");
  ASSERT_NE(pairs, nullptr);
  EXPECT_EQ(pairs->size(), std::min(2, p - (me / 2) * 2));
  EXPECT_EQ(pairs->rank(), me % 2);
  // Every rank of this test runs on one host.
  CommPtr node = c.split_by_host("node");
  ASSERT_NE(node, nullptr);
  EXPECT_EQ(node->size(), p);
  EXPECT_EQ(node->rank(), me);
  // The parent still works after its children are gone, and the other way round.
  even.reset();
  c.barrier();
  pairs->barrier();
}

void check_groups(const CommPtr& world) {
  const int p = world->size(), me = world->rank();
  for (int ep = 1; ep <= p; ++ep) {
    if (p % ep) continue;
    ProcessGroups g = make_process_groups(world, ep);
    GroupLayout l = GroupLayout::make(p, ep);
    EXPECT_EQ(g.ep_size, ep);
    EXPECT_EQ(g.dp_size, p / ep);
    EXPECT_EQ(g.ep->world_ranks(), l.ep_group(me)) << "ep_size " << ep;
    EXPECT_EQ(g.dp->world_ranks(), l.dp_group(me)) << "ep_size " << ep;
    EXPECT_EQ(g.ep->rank(), me % ep);
    EXPECT_EQ(g.dp->rank(), me / ep);
    EXPECT_EQ(g.node->size(), p);
    // Sums over each group see exactly its members.
    Tensor t = Tensor::host_from(std::vector<int64_t>{int64_t{1} << me}, DType::kI64);
    g.ep->all_reduce(t, ReduceOp::kSum);
    int64_t mask = 0;
    for (int r : l.ep_group(me)) mask |= int64_t{1} << r;
    EXPECT_EQ(t.data<int64_t>()[0], mask);
    Tensor u = Tensor::host_from(std::vector<int64_t>{int64_t{1} << me}, DType::kI64);
    g.dp->all_reduce(u, ReduceOp::kSum);
    mask = 0;
    for (int r : l.dp_group(me)) mask |= int64_t{1} << r;
    EXPECT_EQ(u.data<int64_t>()[0], mask);
  }
  if (p == 4) {
    ProcessGroups g = make_process_groups(world, 2);
    const std::vector<int> ep_groups[] = {{0, 1}, {0, 1}, {2, 3}, {2, 3}};
    const std::vector<int> dp_groups[] = {{0, 2}, {1, 3}, {0, 2}, {1, 3}};
    EXPECT_EQ(g.ep->world_ranks(), ep_groups[me]);
    EXPECT_EQ(g.dp->world_ranks(), dp_groups[me]);
  }
  try {
    make_process_groups(world, p + 1);
    ADD_FAILURE() << "ep_size " << p + 1 << " accepted for a world of " << p;
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(str_cat("ep_size=", p + 1)), std::string::npos);
  }
  world->barrier();  // still in step after the refusal
}

// ---- one rank per process ---------------------------------------------------------------------

CommPtr process_world() {
  static CommPtr world = []() -> CommPtr {
    CommOptions options;
    options.timeout = 60s;
    LaunchInfo info = detect_launch();
    if (!info.use_mpi) return nullptr;
    CommPtr w = create_world(info, parse_bootstrap("mpi"), options);
    set_error_rank(w->rank());
    std::fprintf(stderr, "[parallel_tests] %s, world communicator of %d ranks\n",
                 info.describe().c_str(), w->size());
    return w;
  }();
  return world;
}

#define HP_MULTI_WORLD(var)                                                         \
  CommPtr var = process_world();                                                    \
  if (!var || var->size() < 2) GTEST_SKIP() << "needs a launch of 2 or more ranks"; \
  var->set_timeout(60s)

HP_MPI_TEST(MultiRank, WorldMatchesTheLaunch, 2, 4) {
  HP_MULTI_WORLD(world);
  LaunchInfo info = detect_launch();
  EXPECT_EQ(world->size(), info.world);
  EXPECT_EQ(world->rank(), info.rank);
  EXPECT_EQ(world->world_rank(), info.rank);
}
HP_MPI_TEST(MultiRank, AllReduceMatchesRankOrderFold, 2, 4) {
  HP_MULTI_WORLD(world);
  check_all_reduce(*world);
}
HP_MPI_TEST(MultiRank, AllReduceBitwiseEqualAcrossRanks, 2, 4) {
  HP_MULTI_WORLD(world);
  check_bitwise_equal_across_ranks(*world);
}
HP_MPI_TEST(MultiRank, Broadcast, 2, 4) {
  HP_MULTI_WORLD(world);
  check_broadcast(*world);
}
HP_MPI_TEST(MultiRank, AllGather, 2, 4) {
  HP_MULTI_WORLD(world);
  check_all_gather(*world);
}
HP_MPI_TEST(MultiRank, ReduceScatter, 2, 4) {
  HP_MULTI_WORLD(world);
  check_reduce_scatter(*world);
}
HP_MPI_TEST(MultiRank, AllToAllVUnevenCounts, 2, 4) {
  HP_MULTI_WORLD(world);
  check_all_to_all_v(*world);
}
HP_MPI_TEST(MultiRank, SendRecv, 2, 4) {
  HP_MULTI_WORLD(world);
  check_send_recv(*world);
}
HP_MPI_TEST(MultiRank, Barrier, 2, 4) {
  HP_MULTI_WORLD(world);
  check_barrier(*world);
}
HP_MPI_TEST(MultiRank, ShareBlob, 2, 4) {
  HP_MULTI_WORLD(world);
  check_share_blob(*world);
}
HP_MPI_TEST(MultiRank, Split, 2, 4) {
  HP_MULTI_WORLD(world);
  check_split(*world);
}
HP_MPI_TEST(MultiGroups, WorldDpEpNode, 2, 4) {
  HP_MULTI_WORLD(world);
  check_groups(world);
}

// ---- faults (HP_TEST_FAULT) -------------------------------------------------------------------

bool fault_is(const char* name) {
  const char* f = std::getenv("HP_TEST_FAULT");
  return f && std::strcmp(f, name) == 0;
}

// What the program's top level does with an exception: log it, abort, exit non-zero.
[[noreturn]] void exit_like_top_level(Communicator& world, const std::string& what) {
  std::fprintf(stderr, "[fault-test] rank %d caught: %s\n", world.rank(), what.c_str());
  std::fflush(stderr);
  world.abort(what);
  std::_Exit(1);
}

#define HP_FAULT_WORLD(var, fault)                                             \
  if (!fault_is(fault)) GTEST_SKIP() << "runs only with HP_TEST_FAULT=" fault; \
  CommPtr var = process_world();                                               \
  if (!var || var->size() < 2) GTEST_SKIP() << "needs a launch of 2 or more ranks"

// The last rank arrives late; the others' all_reduce times out after 2 s naming the collective.
HP_MPI_TEST(FaultInjection, Timeout, 4) {
  HP_FAULT_WORLD(world, "timeout");
  world->set_timeout(2s);
  const int late = world->size() - 1;
  try {
    if (world->rank() == late) std::this_thread::sleep_for(6s);
    Tensor t = make_data(DType::kF32, 64, 1, world->rank());
    world->all_reduce(t, ReduceOp::kSum);
  } catch (const std::exception& e) {
    exit_like_top_level(*world, e.what());
  }
  exit_like_top_level(*world, str_cat("all_reduce returned although rank ", late, " was late"));
}

// One rank throws while the others wait in a barrier with the default 60 s timeout: the job must
// end well before that.
HP_MPI_TEST(FaultInjection, Throw, 4) {
  HP_FAULT_WORLD(world, "throw");
  try {
    if (world->rank() == 1) throw Error(ErrorKind::kData, "injected failure on rank 1");
    world->barrier();
    world->barrier();
  } catch (const std::exception& e) {
    exit_like_top_level(*world, e.what());
  }
  exit_like_top_level(*world, "barrier returned although rank 1 failed");
}

// One rank dies without a word (no abort, no MPI_Finalize).
HP_MPI_TEST(FaultInjection, Exit, 4) {
  HP_FAULT_WORLD(world, "exit");
  try {
    if (world->rank() == 1) std::_Exit(3);
    world->barrier();
    world->barrier();
  } catch (const std::exception& e) {
    exit_like_top_level(*world, e.what());
  }
  exit_like_top_level(*world, "barrier returned although rank 1 died");
}

// ---- ranks as threads, in-process data path ----------------------------------------------------

TEST(ThreadRanks, AllReduce) {
  for (int n : {2, 3}) run_thread_ranks(n, [](const CommPtr& c) { check_all_reduce(*c); });
}
TEST(ThreadRanks, AllReduceBitwiseEqualAcrossRanks) {
  run_thread_ranks(4, [](const CommPtr& c) { check_bitwise_equal_across_ranks(*c); });
}
TEST(ThreadRanks, BroadcastAllGatherReduceScatter) {
  run_thread_ranks(3, [](const CommPtr& c) {
    check_broadcast(*c);
    check_all_gather(*c);
    check_reduce_scatter(*c);
  });
}
TEST(ThreadRanks, AllToAllV) {
  for (int n : {2, 4}) run_thread_ranks(n, [](const CommPtr& c) { check_all_to_all_v(*c); });
}
TEST(ThreadRanks, SendRecvBarrierBlob) {
  run_thread_ranks(3, [](const CommPtr& c) {
    check_send_recv(*c);
    check_barrier(*c);
    check_share_blob(*c);
  });
}
TEST(ThreadRanks, SplitAndGroups) {
  run_thread_ranks(4, [](const CommPtr& c) {
    check_split(*c);
    check_groups(c);
  });
}

// ---- ranks as threads over TCP: control messages only -----------------------------------------

// What the store communicator of a launch without MPI carries: the rendezvous, small sums, blobs,
// barriers, splits into the process groups. Values near the bound still pass.
TEST(TcpThreads, ControlMessages) {
  run_tcp_threads(3, [](const CommPtr& c) {
    for (DType dt : {DType::kF32, DType::kF64, DType::kI32, DType::kI64}) {
      for (int64_t n : {0, 1, 5, 1000}) {
        Tensor t = make_data(dt, n, 40 + static_cast<uint64_t>(n), c->rank());
        c->all_reduce(t, ReduceOp::kSum);
        EXPECT_TRUE(same_bits(
            t, expected_reduction(dt, n, 40 + static_cast<uint64_t>(n), c->size(), ReduceOp::kSum)))
            << where(*c) << ": all_reduce of " << n << " " << dtype_name(dt);
      }
    }
    const int64_t near = static_cast<int64_t>(StoreCommunicator::kMaxPayloadBytes / 8);
    Tensor big = make_data(DType::kF64, near, 41, 0);
    c->broadcast(big, 0);
    EXPECT_TRUE(same_bits(big, make_data(DType::kF64, near, 41, 0))) << where(*c);
    check_barrier(*c);
    check_share_blob(*c);
    check_split(*c);
    check_groups(c);
  });
}

// Anything tensor-sized is refused before a message is written, naming the operation and the
// bytes, on every rank alike; the communicator stays usable for control messages.
TEST(TcpThreads, RefusesTensorPayloads) {
  run_tcp_threads(2, [](const CommPtr& c) {
    const auto refused = [&](const std::function<void()>& call, const std::string& op,
                             const std::string& bytes) {
      try {
        call();
        ADD_FAILURE() << where(*c) << ": " << op << " of " << bytes << " bytes was carried";
      } catch (const Error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find(op + " on 'world'"), std::string::npos) << what;
        EXPECT_NE(what.find(bytes + " bytes"), std::string::npos) << what;
        EXPECT_NE(what.find("control messages only"), std::string::npos) << what;
      }
    };
    // 256 KiB of f32, a small layer's gradient: over the bound per rank.
    Tensor grad = make_data(DType::kF32, 65536, 50, c->rank());
    refused([&] { c->all_reduce(grad, ReduceOp::kSum); }, "all_reduce", "262144");
    Tensor shard = make_data(DType::kF32, 20000, 51, c->rank());
    Tensor full = Tensor::host({40000}, DType::kF32);
    refused([&] { c->all_gather(shard, full); }, "all_gather", "80000");
    refused([&] { c->broadcast(shard, 0); }, "broadcast", "80000");
    Tensor half = Tensor::host({10000}, DType::kF32);
    refused([&] { c->reduce_scatter(shard, half, ReduceOp::kSum); }, "reduce_scatter", "80000");
    // No all-to-all and no point-to-point, whatever the size.
    Tensor rows = make_data(DType::kF32, 4, 52, c->rank());
    Tensor got = Tensor::host({4}, DType::kF32);
    refused([&] { c->all_to_all_v(rows, {2, 2}, got, {2, 2}); }, "all_to_all_v", "16");
    refused([&] { c->send(rows, 1 - c->rank()); }, "send/recv", "16");
    // Still in step: a control message after the refusals.
    Tensor one = Tensor::host_from(std::vector<int64_t>{c->rank() + 1}, DType::kI64);
    c->all_reduce(one, ReduceOp::kSum);
    EXPECT_EQ(one.data<int64_t>()[0], 3);
  });
}

// The store itself refuses a tensor-sized value, naming the key and the size.
TEST(TcpThreads, StoreRefusesALargeValue) {
  auto server = TcpStore::serve(0, 5s);
  auto client = TcpStore::connect("127.0.0.1", server->port(), 1, 5s);
  for (Store* s : {static_cast<Store*>(server.get()), static_cast<Store*>(client.get())}) {
    try {
      s->set("grads/0", Store::Bytes(Store::kMaxValueBytes + 1));
      ADD_FAILURE() << "a value of " << Store::kMaxValueBytes + 1 << " bytes was stored";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'grads/0'"), std::string::npos) << what;
      EXPECT_NE(what.find(str_cat(Store::kMaxValueBytes + 1, " bytes")), std::string::npos) << what;
    }
    EXPECT_FALSE(s->check({"grads/0"})[0]);
    s->set("ok", Store::Bytes(Store::kMaxValueBytes));  // the bound itself is allowed
  }
  Store::Bytes v;
  EXPECT_TRUE(client->try_get("ok", &v));
  EXPECT_EQ(v.size(), Store::kMaxValueBytes);
}

}  // namespace
}  // namespace hp
