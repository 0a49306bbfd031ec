// LinkArbiter: who may move the next chunk of host<->device bytes over a host link that several
// ranks share (one rank's offload must not starve another rank's reload: docs/architecture.md,
// "Rule 2: the host link is shared fairly").
//
// A rank cuts each copy into chunks of at most chunk_bytes() and issues a chunk only while it
// holds a grant for it:
//   LinkTicket t = arbiter.request(CopyDirection::kReload, bytes);   // never blocks
//   arbiter.wait(t);                                                // blocks this thread only
//   ... issue the chunk's copy, let it complete ...
//   arbiter.release(t);
// Reloads (host->device, on backward's critical path) are granted before pending offloads
// (device->host, needed only by the next backward). Which ranks compete, in which order, and how
// many chunks may be in flight per link is the implementation's to say (parallel/link_arbiter.h
// for ranks sharing a node; LocalLinkArbiter below for a single rank).
//
// Threads: request() and granted() never block beyond a short critical section, so the thread
// driving the compute stream may call them. wait() blocks the calling thread until the grant
// arrives (bounded by the implementation's timeout): call it from the thread that issues the
// copies (a copy thread), never from the compute stream's host thread. A rank may have requests
// of both directions outstanding at once, from different threads; tickets of one direction are
// granted in the order they were requested. Every method is thread-safe.
// Ownership: a ticket is a plain value; every requested ticket must be released exactly once,
// after wait() (or granted()) said it is granted. The arbiter must outlive its tickets.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <vector>

namespace hp {

enum class CopyDirection { kReload = 0, kOffload = 1 };  // kReload: host->device (priority)

const char* copy_direction_name(CopyDirection d);

struct LinkTicket {
  CopyDirection dir = CopyDirection::kOffload;
  int64_t bytes = 0;
  int64_t index = 0;  // 1-based position among this rank's requests of `dir`
  // Set once granted: position of the grant among all grants of the link (1, 2, ...), so grant
  // order across ranks can be compared; and when this rank saw it.
  int64_t grant_seq = 0;
  std::chrono::steady_clock::time_point requested_at, granted_at;
};

// Per step (reset by begin_step()); index [d] is CopyDirection d.
struct LinkArbiterStats {
  int64_t bytes[2] = {0, 0};   // released chunks' bytes
  int64_t chunks[2] = {0, 0};  // released chunks
  double wait_s[2] = {0, 0};   // summed request->grant time
  double max_wait_s[2] = {0, 0};
  double active_s = 0;  // first request of the step to its last release
  // An arbiter shared by several ranks also reports this rank's host link over the step: the
  // link's ranks, the bytes each released (both directions, in link_ranks order) and Jain's
  // fairness index over those bytes. Empty (and 1) for a rank's own arbiter.
  std::vector<int> link_ranks;
  std::vector<int64_t> link_bytes;
  double link_jain = 1.0;
  bool shared() const { return !link_ranks.empty(); }
  // Bytes of both directions over active_s: the rate the rank achieved, waits included.
  double achieved_gbps() const;
};

class LinkArbiter {
 public:
  virtual ~LinkArbiter() = default;
  // Largest chunk a grant covers.
  virtual int64_t chunk_bytes() const = 0;
  // Registers a request for one chunk of `bytes` (1..chunk_bytes()).
  virtual LinkTicket request(CopyDirection dir, int64_t bytes) = 0;
  // True once `t` is granted (fills t.grant_seq and t.granted_at then).
  virtual bool granted(LinkTicket& t) = 0;
  // Blocks the calling thread until `t` is granted; throws hp::Error (kComm) after the
  // implementation's timeout.
  virtual void wait(LinkTicket& t) = 0;
  // The chunk of `t` is done: its link capacity passes to the next request.
  virtual void release(LinkTicket& t) = 0;
  virtual void begin_step() = 0;
  virtual LinkArbiterStats stats() const = 0;
};

// The counting half every implementation shares: per-step stats of this rank.
class LinkStatsRecorder {
 public:
  void reset();
  void on_request(const LinkTicket& t);
  void on_grant(const LinkTicket& t);
  void on_release(const LinkTicket& t);
  LinkArbiterStats get() const;

 private:
  mutable std::mutex mu_;
  LinkArbiterStats stats_;
  bool any_ = false;
  std::chrono::steady_clock::time_point first_request_, last_release_;
};

// One rank, its own link: every request is granted at once; the stats are still counted.
class LocalLinkArbiter final : public LinkArbiter {
 public:
  explicit LocalLinkArbiter(int64_t chunk_bytes);
  int64_t chunk_bytes() const override { return chunk_bytes_; }
  LinkTicket request(CopyDirection dir, int64_t bytes) override;
  bool granted(LinkTicket& t) override;
  void wait(LinkTicket& t) override { granted(t); }
  void release(LinkTicket& t) override;
  void begin_step() override { recorder_.reset(); }
  LinkArbiterStats stats() const override { return recorder_.get(); }

 private:
  int64_t chunk_bytes_;
  std::mutex mu_;
  int64_t requested_[2] = {0, 0};
  int64_t seq_ = 0;
  LinkStatsRecorder recorder_;
};

}  // namespace hp
