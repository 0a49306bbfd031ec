#include "framework/core/sync_counter.h"

#include <sstream>

namespace hp {

const char* sync_cause_name(SyncCause c) {
  switch (c) {
    case SyncCause::kMetadata:
      return "metadata";
    case SyncCause::kRouting:
      return "routing";
    case SyncCause::kOffload:
      return "offload";
    case SyncCause::kLoss:
      return "loss";
    case SyncCause::kOther:
      return "other";
  }
  return "?";
}

int64_t SyncCounter::total() const {
  int64_t t = 0;
  for (int64_t v : counts_) t += v;
  return t;
}

std::string SyncCounter::json() const {
  std::ostringstream os;
  os << "{";
  for (int i = 0; i < kNumSyncCauses; ++i) {
    os << (i ? "," : "") << "\"" << sync_cause_name(static_cast<SyncCause>(i))
       << "\":" << counts_[i];
  }
  os << "}";
  return os.str();
}

}  // namespace hp
