#include "framework/backend/cpu/cpu_copy_queue.h"

#include <algorithm>
#include <cstring>

namespace hp {

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

uint64_t CpuCopyQueue::enqueue_copy(const Tensor& src, const Tensor& dst) {
  HP_CHECK(
      src.device() == Device::kCPU && dst.device() == Device::kCPU && src.nbytes() == dst.nbytes(),
      "copy queue: ", src.desc(), " -> ", dst.desc(), " must be host tensors of equal size");
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The worker starts lazily: most backends never use their copy stream.
    if (!worker_.joinable()) worker_ = std::thread([this] { run(); });
    ticket = ++issued_;
    tasks_.push_back(Task{src, dst, ticket});
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
}

void CpuCopyQueue::run() {
  using Clock = std::chrono::steady_clock;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
    if (tasks_.empty()) return;  // stop_ with nothing left
    Task t = std::move(tasks_.front());
    tasks_.pop_front();
    const double gbps = gbps_;
    lock.unlock();
    // The link carries one copy at a time: it starts when both the copy and the link are ready
    // and occupies the link for bytes / bandwidth.
    const Clock::time_point start = std::max(Clock::now(), link_free_);
    if (t.src.nbytes() > 0 && t.src.raw() != t.dst.raw())
      std::memmove(t.dst.raw(), t.src.raw(), t.src.nbytes());
    if (gbps > 0) {
      link_free_ =
          start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                      static_cast<double>(t.src.nbytes()) / (gbps * 1e9)));
      std::this_thread::sleep_until(link_free_);
    }
    const uint64_t ticket = t.ticket;
    t = Task();  // release the storages before reporting completion
    lock.lock();
    completed_ = ticket;
    done_cv_.notify_all();
  }
}

}  // namespace hp
