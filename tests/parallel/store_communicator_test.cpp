// The world of a launch without MPI: the file: and tcp: rendezvous (stale files, late rank 0,
// missing ranks, mismatched world sizes, ports in use) and the StoreCommunicator's failure
// handling (timeouts name the operation and the missing rank, an abort or a vanished rank fails
// the others, mismatched calls are reported), with ranks as threads of this process or as
// forked processes. The collectives themselves are checked by multi_rank_test.cpp (TcpThreads.*).
#include "parallel/store_communicator.h"

#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <thread>

#include "parallel/launch_env.h"

namespace hp {
namespace {

using namespace std::chrono_literals;

struct RankResult {
  std::string error;  // what() of the exception the rank ended with; "" when none
  bool user_error = false;
};

// Runs fn(rank) on n threads and reports how each ended.
std::vector<RankResult> run_ranks(int n, const std::function<void(int)>& fn) {
  std::vector<RankResult> out(static_cast<size_t>(n));
  std::vector<std::thread> threads;
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
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

std::string temp_path(const char* what) {
  static std::atomic<int> counter{0};
  return str_cat(::testing::TempDir(), "hp_rdv_", what, "_", ::getpid(), "_", counter++);
}

Bootstrap file_bootstrap(const char* what) { return parse_bootstrap("file:" + temp_path(what)); }

CommOptions with_timeout(std::chrono::milliseconds t) {
  CommOptions o;
  o.timeout = t;
  return o;
}

LaunchInfo rank_of(int rank, int world) {
  LaunchInfo info;
  info.method = "env";
  info.rank = rank;
  info.world = world;
  return info;
}

std::shared_ptr<Communicator> join(const Bootstrap& b, int rank, int world,
                                   std::chrono::milliseconds timeout) {
  return create_world(rank_of(rank, world), b, with_timeout(timeout));
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

size_t count_files(const std::string& dir) {
  size_t n = 0;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
    ::closedir(d);
  }
  return n;
}

// ---- rendezvous ---------------------------------------------------------------------------

TEST(StoreRendezvous, FileIsRemovedOnceEveryoneJoined) {
  const Bootstrap b = file_bootstrap("remove");
  auto res = run_ranks(3, [&](int r) {
    auto c = join(b, r, 3, 30s);
    EXPECT_EQ(c->size(), 3);
    EXPECT_EQ(c->rank(), r);
    EXPECT_EQ(c->name(), "world");
    c->barrier();
    if (r == 0) {
      EXPECT_FALSE(std::ifstream(b.path).good()) << b.path << " left behind";
    }
  });
  for (auto& r : res) EXPECT_EQ(r.error, "");
}

TEST(StoreRendezvous, TcpOnAFixedPort) {
  // The port of a server that just went away: free, and no fixed number that could collide.
  int port = 0;
  { port = TcpStore::serve(0, 1ms)->port(); }
  const Bootstrap b = parse_bootstrap(str_cat("tcp:127.0.0.1:", port));
  auto res = run_ranks(3, [&](int r) {
    if (r == 0) std::this_thread::sleep_for(100ms);  // the others retry until rank 0 serves
    auto c = join(b, r, 3, 30s);
    Tensor t = Tensor::host_from(std::vector<int32_t>{r + 1}, DType::kI32);
    c->all_reduce(t, ReduceOp::kSum);
    EXPECT_EQ(t.data<int32_t>()[0], 6);
    std::vector<uint8_t> id{9, 8, 7};
    EXPECT_EQ(share_blob(*c, r == 0 ? id : std::vector<uint8_t>{}), id);
  });
  for (auto& r : res) EXPECT_EQ(r.error, "");
}

TEST(StoreRendezvous, StaleFileAndLateRankZero) {
  const Bootstrap b = file_bootstrap("stale");
  {
    std::ofstream f(b.path);
    f << "no-such-run\n";  // left by an earlier job
  }
  auto res = run_ranks(2, [&](int r) {
    if (r == 0) std::this_thread::sleep_for(300ms);
    join(b, r, 2, 30s)->barrier();
  });
  for (auto& r : res) EXPECT_EQ(r.error, "");
}

TEST(StoreRendezvous, FileOfARunThatDiedDuringRendezvous) {
  const Bootstrap b = file_bootstrap("dead");
  // An earlier job's rank 0 wrote the file, then died before anyone joined.
  int port = 0;
  { port = TcpStore::serve(0, 1ms)->port(); }
  {
    std::ofstream f(b.path);
    f << "127.0.0.1:" << port << " dead-run\n";
  }
  auto res = run_ranks(3, [&](int r) {
    if (r == 0) std::this_thread::sleep_for(300ms);  // ranks 1 and 2 find the dead run first
    join(b, r, 3, 30s)->barrier();
  });
  for (auto& r : res) EXPECT_EQ(r.error, "");
}

TEST(StoreRendezvous, FileNamingAnotherJobsStore) {
  const Bootstrap b = file_bootstrap("other");
  auto other = TcpStore::serve(0, 1s);  // alive, but not this job's
  other->set("run", {'x'});
  other->set("ready", {});
  {
    std::ofstream f(b.path);
    f << "127.0.0.1:" << other->port() << " another-run\n";
  }
  auto res = run_ranks(2, [&](int r) {
    if (r == 0) std::this_thread::sleep_for(300ms);
    auto c = join(b, r, 2, 30s);
    Tensor t = Tensor::host_from(std::vector<int32_t>{r + 1}, DType::kI32);
    c->all_reduce(t, ReduceOp::kSum);
    EXPECT_EQ(t.data<int32_t>()[0], 3);
  });
  for (auto& r : res) EXPECT_EQ(r.error, "");
  EXPECT_FALSE(other->check({"join/1"})[0]) << "rank 1 joined another job's store";
}

TEST(StoreRendezvous, TimeoutsSayWhatIsMissing) {
  const Bootstrap b = file_bootstrap("alone");
  auto joiner = run_ranks(1, [&](int) { join(b, 1, 2, 300ms); });
  EXPECT_TRUE(contains(joiner[0].error, "rank 1: rendezvous (file:" + b.path + ")"))
      << joiner[0].error;
  EXPECT_TRUE(contains(joiner[0].error, "never appeared")) << joiner[0].error;
  auto root = run_ranks(1, [&](int) { join(b, 0, 3, 300ms); });
  EXPECT_TRUE(contains(
      root[0].error, "rank 0: rendezvous on 'world' timed out after 300 ms waiting for ranks 1, 2"))
      << root[0].error;
  EXPECT_FALSE(std::ifstream(b.path).good()) << "rank 0 left " << b.path << " behind";
}

TEST(StoreRendezvous, WorldSizeMismatchIsAUserErrorEverywhere) {
  const Bootstrap b = file_bootstrap("size");
  auto res = run_ranks(2, [&](int r) { join(b, r, r == 0 ? 2 : 3, 10s); });
  for (int r = 0; r < 2; ++r) {
    const RankResult& x = res[static_cast<size_t>(r)];
    EXPECT_TRUE(x.user_error) << x.error;
    EXPECT_TRUE(contains(x.error, str_cat("rank ", r,
                                          ": rendezvous: rank 1 was started with a "
                                          "world of 3 ranks and rank 0 with 2")))
        << x.error;
  }
}

TEST(StoreRendezvous, PortInUseIsAUserError) {
  auto taken = TcpStore::serve(0, 1ms);
  const Bootstrap b = parse_bootstrap(str_cat("tcp:127.0.0.1:", taken->port()));
  try {
    join(b, 0, 2, 5s);
    ADD_FAILURE() << "listened on a port in use";
  } catch (const UserError& e) {
    EXPECT_TRUE(contains(e.what(), "cannot listen")) << e.what();
  }
}

TEST(StoreRendezvous, WorldOfOneNeedsNoStore) {
  auto c = join(file_bootstrap("one"), 0, 1, 1s);
  EXPECT_EQ(c->size(), 1);
  c->barrier();
}

// ---- failures -----------------------------------------------------------------------------

// Ranks as threads over one HashStore; fn gets each rank's world.
std::vector<RankResult> run_store_world(int n, std::chrono::milliseconds timeout,
                                        const std::function<void(Communicator&)>& fn) {
  auto store = std::make_shared<HashStore>(0);
  return run_ranks(n, [&](int r) {
    auto c = StoreCommunicator::create_world(store->handle(r), r, n, with_timeout(timeout));
    fn(*c);
  });
}

TEST(StoreFailures, TimeoutNamesTheOperationAndTheMissingRank) {
  std::vector<std::string> second(3);
  std::atomic<int> failed{0};
  auto res = run_store_world(3, 30s, [&](Communicator& c) {
    const int r = c.rank();
    c.set_timeout(300ms);
    if (r == 2) {
      while (failed < 2) std::this_thread::sleep_for(10ms);  // calls nothing until both gave up
      return;
    }
    Tensor t = Tensor::host({8}, DType::kF32);
    try {
      c.all_reduce(t, ReduceOp::kSum);
    } catch (const Error&) {
      ++failed;
      try {
        c.barrier();  // broken now: fails at once
      } catch (const Error& e) {
        second[static_cast<size_t>(r)] = e.what();
      }
      throw;
    }
  });
  for (int r = 0; r < 2; ++r) {
    const std::string& e = res[static_cast<size_t>(r)].error;
    EXPECT_TRUE(contains(
        e,
        str_cat("rank ", r, ": all_reduce on 'world' timed out after 300 ms waiting for rank 2")))
        << e;
    EXPECT_TRUE(contains(second[static_cast<size_t>(r)], "unusable after an earlier failure"))
        << second[static_cast<size_t>(r)];
  }
  EXPECT_EQ(res[2].error, "");
}

TEST(StoreFailures, AbortReachesThePeersOfEveryGroup) {
  std::atomic<int> split{0};
  auto res = run_store_world(4, 60s, [&](Communicator& c) {
    auto pair = c.split(c.rank() / 2, 0, "pair");  // {0, 1} and {2, 3}
    ++split;
    if (c.rank() == 1) {
      while (split < 4) std::this_thread::sleep_for(1ms);  // everyone is out of split()
      c.abort("disk full on rank 1");
      EXPECT_THROW(c.barrier(), Error);  // an aborted communicator refuses work
      return;
    }
    if (c.rank() == 3) {
      pair->barrier();  // waits for rank 2, which is in the world barrier; both fail
      return;
    }
    c.barrier();
  });
  for (int r : {0, 2}) {
    const std::string& e = res[static_cast<size_t>(r)].error;
    EXPECT_TRUE(contains(e, str_cat("rank ", r,
                                    ": barrier on 'world': rank 1 aborted: disk full "
                                    "on rank 1")))
        << e;
  }
  EXPECT_TRUE(contains(res[3].error, "rank 3: barrier on 'pair': rank 1 aborted")) << res[3].error;
  EXPECT_EQ(res[1].error, "");
}

TEST(StoreFailures, ARankThatVanishesFailsItsPeers) {
  // Rank 1 is a forked process that joins over TCP and exits without a word.
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    int port = 0;
    if (::read(fds[0], &port, sizeof(port)) == sizeof(port)) {
      try {
        auto s = TcpStore::connect("127.0.0.1", port, 1, 30s);
        auto c = StoreCommunicator::create_world(s, 1, 2, with_timeout(30s));
        ::_exit(0);  // with its store connection open: no goodbye
      } catch (...) {
      }
    }
    ::_exit(0);
  }
  auto server = TcpStore::serve(0, 1s);  // after the fork: the child has no server thread
  const int port = server->port();
  ASSERT_EQ(::write(fds[1], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
  auto c = StoreCommunicator::create_world(server, 0, 2, with_timeout(60s));
  try {
    c->barrier();
    ADD_FAILURE() << "barrier returned without rank 1";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "rank 0: barrier on 'world': rank 1 closed the connection"))
        << e.what();
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  ::close(fds[0]);
  ::close(fds[1]);
}

TEST(StoreFailures, DifferentOperationsAreReported) {
  std::atomic<bool> done{false};
  auto res = run_store_world(2, 10s, [&](Communicator& c) {
    if (c.rank() == 0) {
      Tensor t = Tensor::host({4}, DType::kF32);
      c.broadcast(t, 0);  // completes: the message is in the store
      while (!done) std::this_thread::sleep_for(10ms);
      return;
    }
    try {
      c.barrier();
    } catch (...) {
      done = true;
      throw;
    }
    done = true;
  });
  EXPECT_EQ(res[0].error, "");
  EXPECT_TRUE(contains(res[1].error,
                       "rank 0 sent a message of broadcast where this rank is in "
                       "barrier"))
      << res[1].error;
}

TEST(StoreFailures, DifferentSizesAreReported) {
  auto res = run_store_world(2, 10s, [&](Communicator& c) {
    const int r = c.rank();
    Tensor in = Tensor::host({3 + r}, DType::kF32);
    Tensor out = Tensor::host({2 * (3 + r)}, DType::kF32);
    c.all_gather(in, out);
  });
  EXPECT_TRUE(contains(res[0].error, "rank 1 sent 16 bytes where this rank expects 12"))
      << res[0].error;
  EXPECT_TRUE(contains(res[1].error, "rank 0 sent 12 bytes where this rank expects 16"))
      << res[1].error;
}

// ---- the store stays small --------------------------------------------------------------------

TEST(StoreCommunicator, OldMessagesAreErased) {
  static std::atomic<int> counter{0};
  const std::string dir = str_cat(::testing::TempDir(), "hp_gc_", ::getpid(), "_", counter++);
  auto res = run_ranks(3, [&](int r) {
    auto c = StoreCommunicator::create_world(std::make_shared<FileStore>(dir, r), r, 3,
                                             with_timeout(60s));
    auto sub = c->split(r == 2 ? -1 : 0, 0, "sub");
    for (int i = 0; i < 40; ++i) {
      Tensor t = Tensor::host_from(std::vector<int64_t>{r, i}, DType::kI64);
      c->all_reduce(t, ReduceOp::kSum);
      c->broadcast(t, i % 3);
      if (sub) {
        sub->broadcast(t, i % 2);
        sub->all_reduce(t, ReduceOp::kMax);
      }
    }
    c->barrier();
  });
  for (auto& r : res) EXPECT_EQ(r.error, "");
  // What is left: "ready", the last barrier's values and the sub-group's last all_reduce's, not
  // 40 calls' worth.
  EXPECT_LE(count_files(dir), 1u + 3u + 2u);
}

TEST(StoreCommunicator, SingleRank) {
  auto c = StoreCommunicator::single();
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
  c->all_reduce(in, ReduceOp::kSum);
  EXPECT_EQ(in.data<double>()[1], 2.0);
  c->broadcast(in, 0);
  c->barrier();
  EXPECT_NE(c->split(0, 0, "self"), nullptr);
  EXPECT_THROW(c->send(in, 0), Error);       // no sends to oneself
  EXPECT_THROW(c->broadcast(in, 1), Error);  // no rank 1
  c->abort("nothing to tell");               // no peers, no store: returns
}

}  // namespace
}  // namespace hp
