#include "framework/backend/cpu/cpu_copy_queue.h"

#include <algorithm>
#include <cstring>

namespace hp {

using Clock = std::chrono::steady_clock;

CpuCopyQueue::~CpuCopyQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void CpuCopyQueue::set_link_gbps(double gbps) {
  HP_CHECK(gbps >= 0, "simulated link bandwidth must be >= 0 GB/s, got ", gbps);
  std::lock_guard<std::mutex> lock(mu_);
  gbps_ = gbps;
}

void CpuCopyQueue::set_arbiter(LinkArbiter* arbiter) {
  // Chunks of queued copies are released to the arbiter that granted them.
  drain();
  std::lock_guard<std::mutex> lock(mu_);
  arbiter_ = arbiter;
}

void CpuCopyQueue::rethrow_locked() const {
  if (error_) std::rethrow_exception(error_);
}

uint64_t CpuCopyQueue::enqueue_copy(const Tensor& src, const Tensor& dst, CopyDirection dir) {
  HP_CHECK(
      src.device() == Device::kCPU && dst.device() == Device::kCPU && src.nbytes() == dst.nbytes(),
      "copy queue: ", src.desc(), " -> ", dst.desc(), " must be host tensors of equal size");
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    rethrow_locked();
    // The worker starts lazily: most backends never use their copy stream.
    if (!worker_.joinable()) worker_ = std::thread([this] { run(); });
    ticket = ++issued_;
    tasks_.push_back(Task{src, dst, ticket, dir});
  }
  work_cv_.notify_one();
  return ticket;
}

uint64_t CpuCopyQueue::last_ticket() const {
  std::lock_guard<std::mutex> lock(mu_);
  return issued_;
}

bool CpuCopyQueue::done(uint64_t ticket) const {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_ >= ticket;
}

void CpuCopyQueue::wait(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return completed_ >= ticket; });
  rethrow_locked();
}

void CpuCopyQueue::move(const Task& t, double gbps, LinkArbiter* arbiter) {
  const int64_t bytes = static_cast<int64_t>(t.src.nbytes());
  const bool same = t.src.raw() == t.dst.raw();
  const int64_t step = arbiter ? arbiter->chunk_bytes() : std::max<int64_t>(bytes, 1);
  for (int64_t off = 0; off < bytes; off += step) {
    const int64_t n = std::min(step, bytes - off);
    LinkTicket grant;
    if (arbiter) {
      grant = arbiter->request(t.dir, n);
      arbiter->wait(grant);
    }
    // The link carries one chunk at a time: it starts when both the chunk and the link are
    // ready and occupies the link for bytes / bandwidth.
    const Clock::time_point start = std::max(Clock::now(), link_free_);
    if (!same) {
      std::memmove(static_cast<char*>(t.dst.raw()) + off,
                   static_cast<const char*>(t.src.raw()) + off, static_cast<size_t>(n));
    }
    if (gbps > 0) {
      const std::chrono::duration<double> busy(static_cast<double>(n) / (gbps * 1e9));
      link_free_ = start + std::chrono::duration_cast<Clock::duration>(busy);
      std::this_thread::sleep_until(link_free_);
    }
    // The chunk has left the link: its capacity passes on.
    if (arbiter) arbiter->release(grant);
  }
}

void CpuCopyQueue::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
    if (tasks_.empty()) return;  // stop_ with nothing left
    Task t = std::move(tasks_.front());
    tasks_.pop_front();
    const double gbps = gbps_;
    LinkArbiter* arbiter = arbiter_;
    const bool failed = error_ != nullptr;
    lock.unlock();
    std::exception_ptr error;
    if (!failed) {
      try {
        move(t, gbps, arbiter);
      } catch (...) {
        error = std::current_exception();
      }
    }
    const uint64_t ticket = t.ticket;
    t = Task();  // release the storages before reporting completion
    lock.lock();
    if (error && !error_) error_ = error;
    completed_ = ticket;
    done_cv_.notify_all();
  }
}

}  // namespace hp
