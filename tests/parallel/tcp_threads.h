// Ranks as threads of one test process, with world communicators over one TcpStore on loopback
// (rank 0 serves it on an ephemeral port): multi-rank tests of host communication that need no
// launcher.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "framework/core/error.h"
#include "parallel/store.h"
#include "parallel/store_communicator.h"

namespace hp::test {

// Runs fn on n ranks, one thread each with its world communicator; expects no rank to throw.
inline void run_tcp_threads(int n,
                            const std::function<void(const std::shared_ptr<Communicator>&)>& fn) {
  CommOptions options;
  options.timeout = std::chrono::seconds(60);
  std::shared_ptr<TcpStore> server = TcpStore::serve(0, options.timeout);
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::shared_ptr<Store> store =
            r == 0 ? std::shared_ptr<Store>(server)
                   : TcpStore::connect("127.0.0.1", server->port(), r, options.timeout);
        fn(StoreCommunicator::create_world(store, r, n, options));
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

}  // namespace hp::test
