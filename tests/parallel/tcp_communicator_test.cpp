// TCP rendezvous and failure handling, with ranks as threads of this process: timeouts name the
// operation and the missing rank, a dead or aborting peer fails its partners promptly, mismatched
// calls are reported instead of corrupting data, and misconfigured launches get user errors.
#include "parallel/tcp_communicator.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <thread>

namespace hp {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

struct RankResult {
  std::string error;  // what() of the exception the rank ended with; "" when none
  bool user_error = false;
  double seconds = 0;  // until the rank's function returned or threw
};

// Runs fn(rank) on n threads and reports how each ended.
std::vector<RankResult> run_ranks(int n, const std::function<void(int)>& fn) {
  std::vector<RankResult> out(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  const auto start = Clock::now();
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      RankResult& res = out[static_cast<size_t>(r)];
      try {
        fn(r);
      } catch (const UserError& e) {
        res.error = e.what();
        res.user_error = true;
      } catch (const std::exception& e) {
        res.error = e.what();
      }
      res.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

std::string temp_path(const char* what) {
  static std::atomic<int> counter{0};
  return str_cat(::testing::TempDir(), "hp_tcp_", what, "_", ::getpid(), "_", counter++);
}

Bootstrap file_bootstrap(const char* what) { return parse_bootstrap("file:" + temp_path(what)); }

CommOptions with_timeout(std::chrono::milliseconds t) {
  CommOptions o;
  o.timeout = t;
  return o;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// A port nobody listens on right now.
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

TEST(TcpRendezvous, FileIsRemovedOnceEveryoneJoined) {
  const Bootstrap b = file_bootstrap("remove");
  auto res = run_ranks(3, [&](int r) {
    auto c = TcpCommunicator::connect_world(b, r, 3, with_timeout(30s));
    c->barrier();
    if (r == 0) {
      EXPECT_FALSE(std::ifstream(b.path).good()) << b.path << " left behind";
    }
  });
  for (auto& r : res) EXPECT_EQ(r.error, "");
}

TEST(TcpRendezvous, FixedPort) {
  const Bootstrap b = parse_bootstrap(str_cat("tcp:127.0.0.1:", free_port()));
  auto res = run_ranks(3, [&](int r) {
    auto c = TcpCommunicator::connect_world(b, r, 3, with_timeout(30s));
    Tensor t = Tensor::host_from(std::vector<int32_t>{r + 1}, DType::kI32);
    c->all_reduce(t, ReduceOp::kSum);
    EXPECT_EQ(t.data<int32_t>()[0], 6);
  });
  for (auto& r : res) EXPECT_EQ(r.error, "");
}

TEST(TcpRendezvous, StaleFileAndLateRankZero) {
  const Bootstrap b = file_bootstrap("stale");
  {
    std::ofstream f(b.path);
    f << "127.0.0.1:1\n";  // left by an earlier job; nothing listens there
  }
  auto res = run_ranks(2, [&](int r) {
    if (r == 0) std::this_thread::sleep_for(500ms);
    auto c = TcpCommunicator::connect_world(b, r, 2, with_timeout(30s));
    c->barrier();
  });
  for (auto& r : res) EXPECT_EQ(r.error, "");
}

TEST(TcpRendezvous, TimeoutsSayWhatIsMissing) {
  const Bootstrap b = file_bootstrap("alone");
  auto joiner =
      run_ranks(1, [&](int) { TcpCommunicator::connect_world(b, 1, 2, with_timeout(1s)); });
  EXPECT_TRUE(contains(joiner[0].error, "rank 1: rendezvous (file:" + b.path + ")"))
      << joiner[0].error;
  EXPECT_TRUE(contains(joiner[0].error, "timed out after 1 s")) << joiner[0].error;
  EXPECT_TRUE(contains(joiner[0].error, "never appeared")) << joiner[0].error;
  auto root = run_ranks(1, [&](int) { TcpCommunicator::connect_world(b, 0, 3, with_timeout(1s)); });
  EXPECT_TRUE(contains(root[0].error, "waiting for ranks 1, 2 to connect")) << root[0].error;
  EXPECT_FALSE(std::ifstream(b.path).good()) << "rank 0 left " << b.path << " behind";
}

TEST(TcpRendezvous, WorldSizeMismatchIsAUserError) {
  const Bootstrap b = file_bootstrap("size");
  auto res = run_ranks(
      2, [&](int r) { TcpCommunicator::connect_world(b, r, r == 0 ? 2 : 3, with_timeout(10s)); });
  EXPECT_TRUE(res[0].user_error);
  EXPECT_TRUE(
      contains(res[0].error, "rank 1 was started with a world of 3 ranks and rank 0 with 2"))
      << res[0].error;
  EXPECT_TRUE(res[1].user_error);
  EXPECT_TRUE(contains(res[1].error, "rank 0 was started with a world of 2")) << res[1].error;
}

TEST(TcpRendezvous, DuplicateRankIsAUserError) {
  const Bootstrap b = file_bootstrap("dup");
  auto res = run_ranks(
      3, [&](int r) { TcpCommunicator::connect_world(b, r == 2 ? 1 : r, 3, with_timeout(10s)); });
  EXPECT_TRUE(res[0].user_error);
  EXPECT_TRUE(contains(res[0].error, "two processes claim rank 1")) << res[0].error;
  EXPECT_NE(res[1].error, "");
  EXPECT_NE(res[2].error, "");
}

TEST(TcpRendezvous, PortInUseIsAUserError) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const Bootstrap b = parse_bootstrap(str_cat("tcp:127.0.0.1:", ntohs(a.sin_port)));
  try {
    TcpCommunicator::connect_world(b, 0, 2, with_timeout(5s));
    ADD_FAILURE() << "listened on a port in use";
  } catch (const UserError& e) {
    EXPECT_TRUE(contains(e.what(), "cannot listen")) << e.what();
  }
  ::close(fd);
}

TEST(TcpFailures, TimeoutNamesTheOperationAndTheMissingRank) {
  const Bootstrap b = file_bootstrap("timeout");
  std::vector<std::string> second(3);
  auto res = run_ranks(3, [&](int r) {
    auto c = TcpCommunicator::connect_world(b, r, 3, with_timeout(30s));
    c->set_timeout(1s);
    if (r == 2) {
      std::this_thread::sleep_for(2500ms);  // never calls; leaves after the others gave up
      return;
    }
    Tensor t = Tensor::host({8}, DType::kF32);
    try {
      c->all_reduce(t, ReduceOp::kSum);
    } catch (const Error&) {
      try {
        c->barrier();  // broken now: fails at once
      } catch (const Error& e) {
        second[static_cast<size_t>(r)] = e.what();
      }
      throw;
    }
  });
  for (int r = 0; r < 2; ++r) {
    const std::string& e = res[static_cast<size_t>(r)].error;
    EXPECT_TRUE(contains(
        e, str_cat("rank ", r, ": all_reduce on 'world' timed out after 1 s waiting for rank 2")))
        << e;
    EXPECT_LT(res[static_cast<size_t>(r)].seconds, 2.4);
    EXPECT_TRUE(contains(second[static_cast<size_t>(r)], "unusable after an earlier failure"))
        << second[static_cast<size_t>(r)];
  }
  EXPECT_EQ(res[2].error, "");
}

TEST(TcpFailures, PeerThatExitsFailsItsPartnersPromptly) {
  const Bootstrap b = file_bootstrap("exit");
  auto res = run_ranks(3, [&](int r) {
    auto c = TcpCommunicator::connect_world(b, r, 3, with_timeout(30s));
    if (r == 1) return;  // the communicator goes away: its sockets close
    c->barrier();
  });
  // Both fail at once. One of them may first see the other leave (it failed and closed too), so
  // only one is sure to name rank 1.
  for (int r : {0, 2}) {
    const std::string& e = res[static_cast<size_t>(r)].error;
    EXPECT_TRUE(contains(e, str_cat("rank ", r, ": barrier on 'world'"))) << e;
    EXPECT_LT(res[static_cast<size_t>(r)].seconds, 10.0);
  }
  EXPECT_TRUE(contains(res[0].error, "rank 1") || contains(res[2].error, "rank 1"))
      << res[0].error << "\n"
      << res[2].error;
}

TEST(TcpFailures, AbortReachesThePeers) {
  const Bootstrap b = file_bootstrap("abort");
  auto res = run_ranks(3, [&](int r) {
    auto c = TcpCommunicator::connect_world(b, r, 3, with_timeout(30s));
    if (r == 1) {
      c->abort("disk full on rank 1");
      EXPECT_THROW(c->barrier(), Error);  // an aborted communicator refuses work
      return;
    }
    c->barrier();
  });
  for (int r : {0, 2}) {
    const std::string& e = res[static_cast<size_t>(r)].error;
    EXPECT_TRUE(contains(e, "rank 1 aborted: disk full on rank 1")) << e;
    EXPECT_LT(res[static_cast<size_t>(r)].seconds, 10.0);
  }
}

TEST(TcpFailures, DifferentOperationsAreReported) {
  const Bootstrap b = file_bootstrap("mismatch");
  auto res = run_ranks(2, [&](int r) {
    auto c = TcpCommunicator::connect_world(b, r, 2, with_timeout(10s));
    if (r == 0) {
      Tensor t = Tensor::host({4}, DType::kF32);
      c->broadcast(t, 0);  // completes: the message is on its way
      std::this_thread::sleep_for(500ms);
      return;
    }
    c->barrier();
  });
  EXPECT_EQ(res[0].error, "");
  EXPECT_TRUE(contains(res[1].error, "rank 0 sent a message of broadcast")) << res[1].error;
}

TEST(TcpFailures, DifferentSizesAreReported) {
  const Bootstrap b = file_bootstrap("sizes");
  auto res = run_ranks(2, [&](int r) {
    auto c = TcpCommunicator::connect_world(b, r, 2, with_timeout(10s));
    Tensor in = Tensor::host({3 + r}, DType::kF32);
    Tensor out = Tensor::host({2 * (3 + r)}, DType::kF32);
    c->all_gather(in, out);
  });
  EXPECT_TRUE(contains(res[0].error, "rank 1 sent 16 bytes where this rank expects 12"))
      << res[0].error;
  EXPECT_TRUE(contains(res[1].error, "rank 0 sent 12 bytes where this rank expects 16"))
      << res[1].error;
}

TEST(TcpCommunicator, SingleRank) {
  auto c = TcpCommunicator::single();
  EXPECT_EQ(c->size(), 1);
  Tensor in = Tensor::host_from(std::vector<double>{1, 2, 3}, DType::kF64);
  Tensor out = Tensor::host({3}, DType::kF64);
  c->all_gather(in, out);
  EXPECT_EQ(out.data<double>()[2], 3.0);
  c->reduce_scatter(in, out, ReduceOp::kMax);
  EXPECT_EQ(out.data<double>()[1], 2.0);
  Tensor recv = Tensor::host({3}, DType::kF64);
  c->all_to_all_v(in, {3}, recv, {3});
  EXPECT_EQ(recv.data<double>()[0], 1.0);
  c->broadcast(in, 0);
  c->barrier();
  EXPECT_THROW(c->send(in, 0), Error);       // no sends to oneself
  EXPECT_THROW(c->broadcast(in, 1), Error);  // no rank 1
  Tensor b16 = Tensor::host({2}, DType::kBF16);
  EXPECT_THROW(c->all_reduce(b16, ReduceOp::kSum), Error);  // bf16 is movement-only
  c->group_start();
  EXPECT_THROW(c->barrier(), Error);  // no collectives inside a group
  c->group_end();
  auto sub = c->split(0, 0, "solo");
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->name(), "solo");
  EXPECT_EQ(c->split(-1, 0, "none"), nullptr);
}

}  // namespace
}  // namespace hp
