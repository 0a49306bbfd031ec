// A link arbiter for tests that grants nothing until opened: shows which thread waits for
// grants, and counts what was requested and released. Shared by the CPU and CUDA offload tests.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "framework/backend/link_arbiter.h"

namespace hp::test {

class GateArbiter final : public LinkArbiter {
 public:
  explicit GateArbiter(int64_t chunk) : chunk_(chunk) {}
  int64_t chunk_bytes() const override { return chunk_; }
  LinkTicket request(CopyDirection dir, int64_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    LinkTicket t;
    t.dir = dir;
    t.bytes = bytes;
    t.index = ++requested_;
    dirs_.push_back(dir);
    return t;
  }
  bool granted(LinkTicket& t) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (open_) t.grant_seq = t.index;
    return open_;
  }
  void wait(LinkTicket& t) override {
    std::unique_lock<std::mutex> lock(mu_);
    ++waiting_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return open_; });
    t.grant_seq = t.index;
  }
  void release(LinkTicket& t) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++released_;
    released_bytes_ += t.bytes;
  }
  void begin_step() override {}
  LinkArbiterStats stats() const override { return LinkArbiterStats(); }

  void open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  void wait_for_a_waiter() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return waiting_ > 0; });
  }
  int64_t released() {
    std::lock_guard<std::mutex> lock(mu_);
    return released_;
  }
  int64_t released_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return released_bytes_;
  }
  std::vector<CopyDirection> dirs() {
    std::lock_guard<std::mutex> lock(mu_);
    return dirs_;
  }

 private:
  int64_t chunk_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  int64_t requested_ = 0, waiting_ = 0, released_ = 0, released_bytes_ = 0;
  std::vector<CopyDirection> dirs_;
};

}  // namespace hp::test
