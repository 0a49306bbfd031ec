#include "framework/backend/link_arbiter.h"

#include <algorithm>

#include "framework/core/error.h"

namespace hp {

using Clock = std::chrono::steady_clock;

namespace {
double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

const char* copy_direction_name(CopyDirection d) {
  return d == CopyDirection::kReload ? "reload" : "offload";
}

double LinkArbiterStats::achieved_gbps() const {
  return active_s > 0 ? static_cast<double>(bytes[0] + bytes[1]) / active_s / 1e9 : 0.0;
}

void LinkStatsRecorder::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = LinkArbiterStats{};
  any_ = false;
}

void LinkStatsRecorder::on_request(const LinkTicket& t) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!any_) first_request_ = t.requested_at;
  any_ = true;
}

void LinkStatsRecorder::on_grant(const LinkTicket& t) {
  std::lock_guard<std::mutex> lock(mu_);
  const int d = static_cast<int>(t.dir);
  const double w = seconds(t.granted_at - t.requested_at);
  stats_.wait_s[d] += w;
  stats_.max_wait_s[d] = std::max(stats_.max_wait_s[d], w);
}

void LinkStatsRecorder::on_release(const LinkTicket& t) {
  std::lock_guard<std::mutex> lock(mu_);
  const int d = static_cast<int>(t.dir);
  stats_.bytes[d] += t.bytes;
  stats_.chunks[d] += 1;
  last_release_ = Clock::now();
  // A ticket requested before begin_step() still counts from its own request.
  if (!any_) first_request_ = t.requested_at;
  any_ = true;
  stats_.active_s = seconds(last_release_ - first_request_);
}

LinkArbiterStats LinkStatsRecorder::get() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

LocalLinkArbiter::LocalLinkArbiter(int64_t chunk_bytes) : chunk_bytes_(chunk_bytes) {
  HP_CHECK(chunk_bytes > 0, "copy chunk must be > 0 bytes, got ", chunk_bytes);
}

LinkTicket LocalLinkArbiter::request(CopyDirection dir, int64_t bytes) {
  HP_CHECK(bytes > 0 && bytes <= chunk_bytes_, "copy chunk of ", bytes, " bytes outside [1, ",
           chunk_bytes_, "]");
  LinkTicket t;
  t.dir = dir;
  t.bytes = bytes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    t.index = ++requested_[static_cast<int>(dir)];
    t.grant_seq = ++seq_;
  }
  t.requested_at = Clock::now();
  t.granted_at = t.requested_at;
  recorder_.on_request(t);
  recorder_.on_grant(t);
  return t;
}

bool LocalLinkArbiter::granted(LinkTicket& t) {
  HP_CHECK(t.grant_seq > 0, "ticket not made by this arbiter");
  return true;
}

void LocalLinkArbiter::release(LinkTicket& t) { recorder_.on_release(t); }

}  // namespace hp
