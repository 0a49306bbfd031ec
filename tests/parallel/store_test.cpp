// The Store on its own: FileStore, TcpStore and HashStore set/get/wait across threads and across
// processes, replaced values, timeouts that name the key and the rank, bad hosts and ports, and
// a TcpStore client that vanishes.
#include "parallel/store.h"

#include <dirent.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "framework/core/error.h"

namespace hp {
namespace {

using namespace std::chrono_literals;
using Bytes = Store::Bytes;

Bytes bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }
std::string text(const Bytes& b) { return std::string(b.begin(), b.end()); }
bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

std::string temp_dir(const char* what) {
  static std::atomic<int> counter{0};
  return str_cat(::testing::TempDir(), "hp_store_", what, "_", ::getpid(), "_", counter++);
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(n);
    }
    ::closedir(d);
  }
  return names;
}

// Two handles on one store, as two ranks would hold them: {rank 0's, rank 1's}.
struct Pair {
  std::shared_ptr<Store> a, b;
};

enum class Kind { kFile, kTcp, kHash };

Pair make_pair_of(Kind kind) {
  switch (kind) {
    case Kind::kFile: {
      const std::string dir = temp_dir("pair");
      return {std::make_shared<FileStore>(dir, 0), std::make_shared<FileStore>(dir, 1)};
    }
    case Kind::kTcp: {
      auto server = TcpStore::serve(0, 10s);
      return {server, TcpStore::connect("127.0.0.1", server->port(), 1, 10s)};
    }
    case Kind::kHash: {
      auto h = std::make_shared<HashStore>(0);
      return {h, h->handle(1)};
    }
  }
  return {};
}

class StoreKinds : public ::testing::TestWithParam<Kind> {};

TEST_P(StoreKinds, SetGetCheckErase) {
  Pair p = make_pair_of(GetParam());
  EXPECT_EQ(p.b->check({"a/b", "c"}), (std::vector<bool>{false, false}));
  p.a->set("a/b", bytes("hello"));
  p.a->set("empty", {});
  EXPECT_EQ(p.b->check({"a/b", "c", "empty"}), (std::vector<bool>{true, false, true}));
  EXPECT_EQ(text(p.b->get("a/b", 1s)), "hello");
  EXPECT_TRUE(p.b->get("empty", 1s).empty());
  Bytes v = bytes("untouched");
  EXPECT_FALSE(p.b->try_get("c", &v));
  EXPECT_EQ(text(v), "untouched");
  p.b->erase("a/b");
  p.b->erase("never-set");  // no-op
  EXPECT_FALSE(p.a->try_get("a/b", &v));
}

TEST_P(StoreKinds, SecondSetReplacesTheValue) {
  Pair p = make_pair_of(GetParam());
  p.a->set("k", bytes("first value, longer"));
  p.b->set("k", bytes("second"));
  EXPECT_EQ(text(p.a->get("k", 1s)), "second");
  EXPECT_EQ(text(p.b->get("k", 1s)), "second");
}

TEST_P(StoreKinds, OddKeysAndLargeValues) {
  Pair p = make_pair_of(GetParam());
  Bytes big(Store::kMaxValueBytes);  // the largest value a store holds
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 7 + 1);
  const std::string key = ".a key/with:odd%chars";
  p.a->set(key, big);
  EXPECT_EQ(p.b->get(key, 1s), big);
  EXPECT_FALSE(p.b->check({".a key/with:odd%chars2"})[0]);
}

// A tensor-sized value (one byte over the bound, and a 1 MiB gradient) is refused before anything
// is stored, naming the key and the size; the key keeps its earlier value.
TEST_P(StoreKinds, RefusesATensorSizedValue) {
  Pair p = make_pair_of(GetParam());
  p.a->set("grad", bytes("small"));
  for (size_t n : {Store::kMaxValueBytes + 1, size_t{1} << 20}) {
    try {
      p.a->set("grad", Bytes(n, 3));
      ADD_FAILURE() << "a value of " << n << " bytes was stored";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'grad'"), std::string::npos) << what;
      EXPECT_NE(what.find(str_cat(n, " bytes")), std::string::npos) << what;
      EXPECT_NE(what.find(str_cat(Store::kMaxValueBytes)), std::string::npos) << what;
    }
  }
  EXPECT_EQ(text(p.b->get("grad", 1s)), "small");
}

TEST_P(StoreKinds, GetWaitsForAnotherThread) {
  Pair p = make_pair_of(GetParam());
  std::thread writer([&] {
    std::this_thread::sleep_for(50ms);
    p.a->set("late/1", bytes("one"));
    p.a->set("late/2", bytes("two"));
  });
  EXPECT_EQ(text(p.b->get("late/1", 20s)), "one");
  p.b->wait({"late/1", "late/2"}, 20s);
  writer.join();
}

TEST_P(StoreKinds, TimeoutNamesTheKeyAndTheRank) {
  Pair p = make_pair_of(GetParam());
  p.a->set("there", {});
  try {
    p.b->get("missing/key", 100ms);
    ADD_FAILURE() << "get of a missing key returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kComm);
    EXPECT_TRUE(contains(e.what(), "rank 1: store (")) << e.what();
    EXPECT_TRUE(contains(e.what(), "timed out after 100 ms waiting for key 'missing/key'"))
        << e.what();
  }
  try {
    p.b->wait({"there", "gone/1", "gone/2"}, 100ms);
    ADD_FAILURE() << "wait for missing keys returned";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "waiting for keys 'gone/1', 'gone/2'")) << e.what();
    EXPECT_FALSE(contains(e.what(), "'there'")) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Store, StoreKinds, ::testing::Values(Kind::kFile, Kind::kTcp, Kind::kHash),
                         [](const ::testing::TestParamInfo<Kind>& i) {
                           return i.param == Kind::kFile  ? std::string("File")
                                  : i.param == Kind::kTcp ? std::string("Tcp")
                                                          : std::string("Hash");
                         });

TEST(FileStore, WritesLeaveNoTemporaryFiles) {
  const std::string dir = temp_dir("tmp");
  FileStore s(dir + "/nested/deeper", 0);  // missing parents are created
  for (int i = 0; i < 20; ++i) s.set("k/" + std::to_string(i % 3), bytes(std::to_string(i)));
  EXPECT_EQ(list_dir(dir + "/nested/deeper").size(), 3u);
  EXPECT_EQ(text(s.get("k/1", 1s)), "19");
}

TEST(FileStore, UnwritableDirectoryIsAnIoError) {
  const std::string file = temp_dir("notadir");
  FileStore(file, 0).set("x", {});  // creates the directory `file`
  try {
    FileStore(file + "/x/sub", 0);  // "x" is a file
    ADD_FAILURE() << "a store below a file";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIo);
    EXPECT_TRUE(contains(e.what(), "store directory " + file + "/x/sub")) << e.what();
  }
}

// Runs `child` in a forked process (before this test starts any thread) and returns its exit
// status; `child` returns the status to exit with.
int run_child(const std::function<int()>& child, const std::function<void()>& parent) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 1;
    try {
      rc = child();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
    }
    ::_exit(rc);
  }
  parent();
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

TEST(FileStore, AcrossProcesses) {
  const std::string dir = temp_dir("fork");
  const int rc = run_child(
      [&] {
        FileStore s(dir, 1);
        s.set("from/child", bytes("ping"));
        return text(s.get("from/parent", 30s)) == "pong" ? 0 : 3;
      },
      [&] {
        FileStore s(dir, 0);
        EXPECT_EQ(text(s.get("from/child", 30s)), "ping");
        s.set("from/parent", bytes("pong"));
      });
  EXPECT_EQ(rc, 0);
}

TEST(TcpStore, AcrossProcesses) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const int rc = run_child(
      [&] {
        int port = 0;
        if (::read(fds[0], &port, sizeof(port)) != sizeof(port)) return 4;
        auto s = TcpStore::connect("localhost", port, 1, 30s);
        s->set("from/child", bytes("ping"));
        return text(s->get("from/parent", 30s)) == "pong" ? 0 : 3;
      },
      [&] {
        auto s = TcpStore::serve(0, 30s);  // after the fork: the child has no server thread
        const int port = s->port();
        ASSERT_EQ(::write(fds[1], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
        EXPECT_EQ(text(s->get("from/child", 30s)), "ping");
        s->set("from/parent", bytes("pong"));
      });
  EXPECT_EQ(rc, 0);
  ::close(fds[0]);
  ::close(fds[1]);
}

TEST(TcpStore, AClientThatVanishesIsReported) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  std::shared_ptr<TcpStore> s;
  const int rc = run_child(
      [&] {
        int port = 0;
        if (::read(fds[0], &port, sizeof(port)) != sizeof(port)) return 4;
        auto c = TcpStore::connect("127.0.0.1", port, 2, 30s);
        c->set("joined", {});
        ::_exit(0);  // no goodbye: as if it crashed
      },
      [&] {
        s = TcpStore::serve(0, 30s);
        const int port = s->port();
        ASSERT_EQ(::write(fds[1], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
      });
  EXPECT_EQ(rc, 0);
  ASSERT_TRUE(s);
  EXPECT_TRUE(contains(text(s->get(Store::kLostKey, 30s)), "rank 2 closed the connection"));
  ::close(fds[0]);
  ::close(fds[1]);
}

TEST(TcpStore, AClientThatLeavesIsNotReported) {
  auto s = TcpStore::serve(0, 30s);
  TcpStore::connect("127.0.0.1", s->port(), 1, 30s)->set("left", {});
  s->get("left", 1s);
  // The goodbye was sent before "left" was read back; nothing is reported for it.
  auto again = TcpStore::connect("127.0.0.1", s->port(), 1, 30s);
  again->set("probe", {});
  EXPECT_FALSE(s->check({Store::kLostKey})[0]);
}

TEST(TcpStore, ServerWaitsForItsClientsToLeave) {
  auto server = TcpStore::serve(0, 60s);
  auto client = TcpStore::connect("127.0.0.1", server->port(), 1, 30s);
  std::thread closer([&] { server.reset(); });  // blocks until the client has left
  client->set("after", bytes("still served"));
  EXPECT_EQ(text(client->get("after", 1s)), "still served");
  client.reset();
  closer.join();
}

TEST(TcpStore, UnknownHostIsAUserError) {
  try {
    TcpStore::connect("no-such-host.invalid", 29500, 1, 1s);
    ADD_FAILURE() << "connected to an unknown host";
  } catch (const UserError& e) {
    EXPECT_TRUE(contains(e.what(), "cannot resolve host 'no-such-host.invalid'")) << e.what();
    EXPECT_TRUE(contains(e.what(), "rank 1")) << e.what();
  }
}

TEST(TcpStore, PortInUseIsAUserError) {
  auto first = TcpStore::serve(0, 1s);
  try {
    TcpStore::serve(first->port(), 1s);
    ADD_FAILURE() << "two servers on one port";
  } catch (const UserError& e) {
    EXPECT_TRUE(contains(e.what(), str_cat("cannot listen on port ", first->port()))) << e.what();
  }
}

TEST(TcpStore, NoServerTimesOutNamingTheAddress) {
  int port = 0;
  {
    auto gone = TcpStore::serve(0, 1s);  // a port that was free a moment ago
    port = gone->port();
  }
  try {
    TcpStore::connect("127.0.0.1", port, 3, 200ms);
    ADD_FAILURE() << "connected without a server";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kComm);
    EXPECT_TRUE(contains(e.what(), str_cat("rank 3: store tcp:127.0.0.1:", port, ": no server")))
        << e.what();
  }
}

TEST(TcpStore, LostServerIsAnError) {
  auto server = TcpStore::serve(0, 1ms);
  auto client = TcpStore::connect("127.0.0.1", server->port(), 1, 30s);
  client->set("x", {});
  // The server stops after its linger although the client is still connected.
  server.reset();
  try {
    client->set("y", {});
    client->check({"y"});
    ADD_FAILURE() << "a store without its server kept answering";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "lost the connection to the store on rank 0")) << e.what();
  }
}

}  // namespace
}  // namespace hp
