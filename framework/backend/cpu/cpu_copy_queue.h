// The CPU backend's copy stream: host-memory copies executed in FIFO order by one worker thread,
// optionally paced to a simulated link bandwidth, so the offload machinery runs for real on the
// CPU (copies overlap the compute that the host thread runs meanwhile).
//
// Tickets stand for positions in the queue: enqueue_copy returns the ticket of its copy;
// ticket t is complete once every entry up to and including t has run. Ticket 0 is always
// complete. The queue keeps the storages of queued copies alive until they have run.
// With a link arbiter (set_arbiter), the worker cuts each copy into chunks of the arbiter's
// chunk size and moves a chunk only with a grant of the copy's direction, releasing it once the
// chunk is done (after its simulated link time): grant waits happen on the worker, never on the
// enqueuing thread. An arbiter error (a grant timeout) fails the queue: the entries still
// queued are dropped and every later wait() or enqueue_copy() rethrows it.
// Thread safety: one thread enqueues (the thread that drives the backend); any thread may query
// or wait.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include "framework/backend/link_arbiter.h"
#include "framework/core/tensor.h"

namespace hp {

class CpuCopyQueue {
 public:
  CpuCopyQueue() = default;
  ~CpuCopyQueue();  // drains the queue, then stops the worker
  CpuCopyQueue(const CpuCopyQueue&) = delete;
  CpuCopyQueue& operator=(const CpuCopyQueue&) = delete;

  // 0: unlimited. Applies to copies that start after the call.
  void set_link_gbps(double gbps);
  // Null: copies move whole, ungranted. Drains the queue first; the arbiter must outlive its
  // use (until replaced or the queue is destroyed).
  void set_arbiter(LinkArbiter* arbiter);
  // Copies src's bytes to dst (same byte count, host memory) after every earlier entry; `dir`
  // is the direction grants are asked for under an arbiter.
  uint64_t enqueue_copy(const Tensor& src, const Tensor& dst,
                        CopyDirection dir = CopyDirection::kOffload);
  // The ticket of the newest entry (0 when nothing was ever queued).
  uint64_t last_ticket() const;
  bool done(uint64_t ticket) const;
  // Blocks the calling thread until `ticket` is complete.
  void wait(uint64_t ticket);
  void drain() { wait(last_ticket()); }

 private:
  struct Task {
    Tensor src, dst;
    uint64_t ticket = 0;
    CopyDirection dir = CopyDirection::kOffload;
  };
  void run();
  // Moves `t` (worker only, without the lock): whole, or chunk by chunk with grants.
  void move(const Task& t, double gbps, LinkArbiter* arbiter);
  void rethrow_locked() const;

  mutable std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Task> tasks_;
  uint64_t issued_ = 0;
  uint64_t completed_ = 0;
  double gbps_ = 0;
  LinkArbiter* arbiter_ = nullptr;
  std::exception_ptr error_;  // the first arbiter failure; fails the queue from then on
  bool stop_ = false;
  std::thread worker_;                               // started by the first copy
  std::chrono::steady_clock::time_point link_free_;  // worker only: when the link is idle again
};

}  // namespace hp
