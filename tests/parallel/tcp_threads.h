// Ranks as threads of one test process, joined over TCP through a file rendezvous: multi-rank
// tests that need no launcher.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "framework/core/error.h"
#include "parallel/launch_env.h"
#include "parallel/tcp_communicator.h"

namespace hp::test {

// Runs fn on n ranks, one thread each with its world communicator; expects no rank to throw.
inline void run_tcp_threads(int n,
                            const std::function<void(const std::shared_ptr<Communicator>&)>& fn) {
  static std::atomic<int> counter{0};
  const std::string path =
      str_cat(::testing::TempDir(), "hp_threads_", ::getpid(), "_", counter++, ".rdv");
  const Bootstrap b = parse_bootstrap("file:" + path);
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        CommOptions options;
        options.timeout = std::chrono::seconds(60);
        fn(TcpCommunicator::connect_world(b, r, n, options));
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

}  // namespace hp::test
