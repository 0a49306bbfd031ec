// Ranks as threads of one test process with a host data path of their own: ThreadCommunicator
// moves tensor bytes between the threads through an in-process mailbox, as MPI moves them between
// processes. It is the CPU stand-in for the device groups (NCCL) of a launch without MPI, whose
// control messages go through a StoreCommunicator: tests give the threads both, so code that must
// keep tensors off the store runs the same way it runs on GPUs. Every byte that crosses from one
// rank to another is counted (Mailbox::bytes_moved), so tests can assert what moved where.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "framework/core/error.h"
#include "parallel/host_communicator.h"

namespace hp::test {

// Messages between the threads: each is written once and taken (and erased) by its one reader.
class Mailbox {
 public:
  void put(const std::string& key, const char* data, size_t bytes) {
    std::lock_guard<std::mutex> lk(mu_);
    kv_[key].assign(data, data + bytes);
    bytes_moved_ += bytes;
    cv_.notify_all();
  }
  // Waits until `key` exists or `deadline`; false on the deadline or after an abort.
  bool take(const std::string& key, std::chrono::steady_clock::time_point deadline,
            std::vector<char>* out) {
    std::unique_lock<std::mutex> lk(mu_);
    const bool found = cv_.wait_until(lk, deadline, [&] { return aborted_ || kv_.count(key); });
    if (!found || aborted_) return false;
    auto it = kv_.find(key);
    out->swap(it->second);
    kv_.erase(it);
    return true;
  }
  void abort() {
    std::lock_guard<std::mutex> lk(mu_);
    aborted_ = true;
    cv_.notify_all();
  }
  // Bytes written for another rank so far.
  int64_t bytes_moved() const {
    std::lock_guard<std::mutex> lk(mu_);
    return bytes_moved_;
  }
  size_t pending() const {
    std::lock_guard<std::mutex> lk(mu_);
    return kv_.size();
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<char>> kv_;
  int64_t bytes_moved_ = 0;
  bool aborted_ = false;
};

class ThreadCommunicator final : public HostCommunicator {
 public:
  // The world communicators of n ranks (one per thread, element r for rank r).
  static std::vector<std::shared_ptr<ThreadCommunicator>> world(
      int n, const std::shared_ptr<Mailbox>& mailbox, const CommOptions& options = {}) {
    std::vector<int> ranks(static_cast<size_t>(n));
    std::iota(ranks.begin(), ranks.end(), 0);
    std::vector<std::shared_ptr<ThreadCommunicator>> out;
    for (int r = 0; r < n; ++r)
      out.push_back(std::shared_ptr<ThreadCommunicator>(
          new ThreadCommunicator(mailbox, "world", "world", r, n, ranks, options)));
    return out;
  }

  // The per-rank byte count of every all-gather this communicator ran, in order (the small
  // all_reduce, barrier and split go through it): what tests count host collectives by.
  const std::vector<size_t>& gathers() const { return gathers_; }

  void abort(const std::string& reason) noexcept override {
    mark_broken(str_cat("aborted: ", reason));
    mailbox_->abort();
  }

 protected:
  void do_all_to_all(const Op& op, const char* send, const std::vector<size_t>& send_bytes,
                     const std::vector<size_t>& send_displs, char* recv,
                     const std::vector<size_t>& recv_bytes,
                     const std::vector<size_t>& recv_displs) override {
    const uint64_t s = seq_++;
    for (int p = 0; p < size(); ++p) {
      const size_t q = static_cast<size_t>(p);
      if (p == rank()) {
        if (send_bytes[q]) std::memcpy(recv + recv_displs[q], send + send_displs[q], send_bytes[q]);
        continue;
      }
      mailbox_->put(key(s, rank(), p), send + send_displs[q], send_bytes[q]);
    }
    for (int p = 0; p < size(); ++p) {
      const size_t q = static_cast<size_t>(p);
      if (p != rank()) take(op, key(s, p, rank()), p, recv + recv_displs[q], recv_bytes[q]);
    }
  }
  void do_all_gather(const Op& op, const char* send, size_t bytes, char* recv,
                     const std::vector<size_t>& recv_bytes,
                     const std::vector<size_t>& recv_displs) override {
    const uint64_t s = seq_++;
    gathers_.push_back(bytes);
    for (int p = 0; p < size(); ++p)
      if (p != rank()) mailbox_->put(key(s, rank(), p), send, bytes);
    if (bytes) std::memcpy(recv + recv_displs[static_cast<size_t>(rank())], send, bytes);
    for (int p = 0; p < size(); ++p) {
      const size_t q = static_cast<size_t>(p);
      if (p != rank()) take(op, key(s, p, rank()), p, recv + recv_displs[q], recv_bytes[q]);
    }
  }
  void do_broadcast(const Op& op, char* data, size_t bytes, int root) override {
    const uint64_t s = seq_++;
    if (rank() == root) {
      for (int p = 0; p < size(); ++p)
        if (p != root) mailbox_->put(key(s, root, p), data, bytes);
      return;
    }
    take(op, key(s, root, rank()), root, data, bytes);
  }
  void do_barrier(const Op& op) override {
    std::vector<size_t> zero(static_cast<size_t>(size()), 0);
    do_all_gather(op, nullptr, 0, nullptr, zero, zero);
  }
  void do_p2p(const Op& op, const std::vector<P2p>& ops) override {
    for (const P2p& t : ops)
      if (t.is_send) mailbox_->put(pair_key(rank(), t.peer, sent_[t.peer]++), t.data, t.bytes);
    for (const P2p& t : ops)
      if (!t.is_send)
        take(op, pair_key(t.peer, rank(), received_[t.peer]++), t.peer, t.data, t.bytes);
  }
  std::shared_ptr<Communicator> do_split(const Op&, int color, const std::vector<int>& members,
                                         const std::string& name) override {
    if (members.empty()) return nullptr;
    std::vector<int> world_ranks;
    int me = -1;
    for (size_t i = 0; i < members.size(); ++i) {
      world_ranks.push_back(world_rank(members[i]));
      if (members[i] == rank()) me = static_cast<int>(i);
    }
    return std::shared_ptr<Communicator>(
        new ThreadCommunicator(mailbox_, str_cat(prefix_, "/", seq_, ".c", color), name, me,
                               static_cast<int>(members.size()), world_ranks, options()));
  }

 private:
  ThreadCommunicator(std::shared_ptr<Mailbox> mailbox, std::string prefix, std::string name,
                     int rank, int size, std::vector<int> world_ranks, CommOptions options)
      : HostCommunicator(std::move(name), rank, size, std::move(world_ranks), options),
        mailbox_(std::move(mailbox)),
        prefix_(std::move(prefix)),
        sent_(static_cast<size_t>(size)),
        received_(static_cast<size_t>(size)) {}

  std::string key(uint64_t s, int from, int to) const {
    return str_cat(prefix_, "/", s, "/", from, "-", to);
  }
  std::string pair_key(int from, int to, uint64_t n) const {
    return str_cat(prefix_, "/p", from, "-", to, "/", n);
  }
  void take(const Op& op, const std::string& k, int peer, char* out, size_t bytes) {
    std::vector<char> v;
    if (!mailbox_->take(k, op.deadline, &v)) HP_COMM_TIMEOUT(op, std::vector<int>{peer}, true);
    if (v.size() != bytes)
      HP_COMM_FAIL(op, "rank ", world_rank(peer), " sent ", v.size(),
                   " bytes where this rank expects ", bytes);
    if (bytes) std::memcpy(out, v.data(), bytes);
  }

  std::shared_ptr<Mailbox> mailbox_;
  std::string prefix_;
  uint64_t seq_ = 0;
  std::vector<uint64_t> sent_, received_;
  std::vector<size_t> gathers_;
};

// Runs fn on n ranks, one thread each with its ThreadCommunicator world; expects no rank to throw.
inline void run_thread_ranks(
    int n, const std::function<void(const std::shared_ptr<Communicator>&)>& fn,
    const std::shared_ptr<Mailbox>& mailbox = std::make_shared<Mailbox>()) {
  CommOptions options;
  options.timeout = std::chrono::seconds(60);
  auto worlds = ThreadCommunicator::world(n, mailbox, options);
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(worlds[static_cast<size_t>(r)]);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
        worlds[static_cast<size_t>(r)]->abort(e.what());  // the others fail instead of waiting
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

}  // namespace hp::test
